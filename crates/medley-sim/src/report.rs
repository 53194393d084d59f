//! What a simulated step measured: time, throughput, utilisation, bubbles, memory, and where
//! each rank's time went.

use std::collections::BTreeMap;

use medley_cost::GIB;
use medley_cost::memory::usable;
use medley_plan::Utilisation;
use medley_schedule::RankTimes;
use serde::Serialize;

use crate::engine::StepRun;

/// One simulated training step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepReport {
    pub schedule: String,
    pub step_time_s: f64,
    #[serde(flatten)]
    pub utilisation: Utilisation,
    /// Pipeline bubble time over pipeline compute time, averaged over ranks (Narayanan et al.
    /// 2021's definition, so uniform GPipe/1F1B gives (p − 1)/m). A rank's pipeline time runs from
    /// the step's start to its replica's last forward or backward pass.
    pub bubble_fraction: f64,
    /// Share of the step the average rank spends blocked on data in flight: what the network
    /// costs beyond the pipeline's own bubbles.
    pub comm_wait_fraction: f64,
    /// The part of `comm_wait_fraction` spent on pipeline transfers (what kFkB's k can hide;
    /// the adaptive policy reads this).
    pub pipeline_wait_fraction: f64,
    /// The highest peak of any device, GiB.
    pub peak_memory_gib: f64,
    pub peak_memory_by_device_gib: BTreeMap<String, f64>,
    pub capacity_gib: BTreeMap<String, f64>,
    pub fits: bool,
    pub ranks: Vec<RankReport>,
    /// Events the engine processed: a measure of the simulation's own work.
    pub events: u64,
}

/// Where one pipeline rank's step went.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankReport {
    pub rank: String,
    pub device: String,
    pub devices: Vec<u32>,
    #[serde(flatten)]
    pub times: RankTimes,
    pub peak_memory_gib: f64,
}

impl StepReport {
    pub(crate) fn of(run: &StepRun, schedule: String) -> Self {
        let sim = run.sim();
        let plan = sim.setup.plan;
        let end_ns = run.ranks.iter().filter_map(|state| state.done_ns).max().unwrap_or(run.start_ns);
        let step_ns = end_ns - run.start_ns;
        let step_time_s = step_ns as f64 * 1e-9;
        let ranks: Vec<RankReport> = sim
            .setup
            .ranks
            .iter()
            .zip(&run.ranks)
            .map(|(setup, state)| RankReport {
                rank: setup.id.to_string(),
                device: setup.device_name.clone(),
                devices: setup.devices.clone(),
                times: RankTimes {
                    compute_s: state.compute_ns as f64 * 1e-9,
                    comm_wait_s: state.transfer_wait_ns as f64 * 1e-9,
                    peer_wait_s: state.peer_wait_ns as f64 * 1e-9,
                    idle_s: step_ns.saturating_sub(state.compute_ns + state.transfer_wait_ns + state.peer_wait_ns)
                        as f64
                        * 1e-9,
                },
                peak_memory_gib: state.peak_memory_bytes / GIB,
            })
            .collect();
        let mut peak_memory_by_device_gib: BTreeMap<String, f64> = BTreeMap::new();
        let mut capacity_gib = BTreeMap::new();
        let mut fits = true;
        for (setup, state) in sim.setup.ranks.iter().zip(&run.ranks) {
            let peak = peak_memory_by_device_gib.entry(setup.device_name.clone()).or_insert(0.0);
            *peak = peak.max(state.peak_memory_bytes / GIB);
            capacity_gib.insert(setup.device_name.clone(), setup.capacity_bytes / GIB);
            fits &= state.peak_memory_bytes <= usable(setup.capacity_bytes, sim.setup.plan.memory_headroom());
        }
        let rank_steps_ns = step_ns as f64 * run.ranks.len() as f64;
        let share =
            |wait: fn(&crate::engine::RankState) -> u64| run.ranks.iter().map(wait).sum::<u64>() as f64 / rank_steps_ns;
        StepReport {
            schedule,
            step_time_s,
            utilisation: Utilisation::of(plan, step_time_s),
            bubble_fraction: bubble_fraction(run),
            comm_wait_fraction: share(|state| state.transfer_wait_ns),
            pipeline_wait_fraction: share(|state| state.pipeline_wait_ns),
            peak_memory_gib: peak_memory_by_device_gib.values().copied().fold(0.0, f64::max),
            peak_memory_by_device_gib,
            capacity_gib,
            fits,
            ranks,
            events: run.events,
        }
    }
}

/// Mean over ranks of (pipeline time − pass time) / pass time, the pipeline time being each
/// replica's span from the step's start to its last pass.
fn bubble_fraction(run: &StepRun) -> f64 {
    let setup = &run.sim().setup;
    let mut replica_end_ns: BTreeMap<u32, u64> = BTreeMap::new();
    for (rank, state) in setup.ranks.iter().zip(&run.ranks) {
        let end = replica_end_ns.entry(rank.id.replica).or_insert(0);
        *end = (*end).max(state.last_pass_end_ns);
    }
    let ratios: Vec<f64> = setup
        .ranks
        .iter()
        .zip(&run.ranks)
        .filter(|(_, state)| state.pass_ns > 0)
        .map(|(rank, state)| {
            let span_ns = replica_end_ns[&rank.id.replica] - run.start_ns;
            (span_ns - state.pass_ns) as f64 / state.pass_ns as f64
        })
        .collect();
    if ratios.is_empty() { 0.0 } else { ratios.iter().sum::<f64>() / ratios.len() as f64 }
}
