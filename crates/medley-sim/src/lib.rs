//! medley's discrete-event simulator: executes the per-rank programs of a plan in simulated time.
//!
//! The simulator runs the very programs `medley-schedule` generates and the runtime executes,
//! under the same execution rules (see [`medley_schedule`]). Compute passes take the cost
//! model's time for their device type. Transfers are flows over a modelled network — each GPU's
//! NIC and intra-node ports, per-flow caps for the cross-vendor bridge and Infinity Fabric peer
//! links — sharing bandwidth max-min fairly when they overlap; all-reduces are lowered into
//! their algorithm's steps by `medley-collective`, so contention between them is simulated, not
//! assumed. Inter-node ports can follow a [`BandwidthTrace`] to model a network shared with other
//! jobs.
//!
//! Time is an integer number of nanoseconds; events are ordered by (time, sequence number), and
//! nothing reads the wall clock or iterates a hash map, so the same input gives the same output,
//! byte for byte. A timeline in the Chrome/Perfetto trace format can be streamed to any writer.
//!
//! Tensor-parallel collectives sit inside compute passes (the cost model prices them on the
//! intra-node links, where they do not meet the pipeline's traffic), and every TP group is
//! simulated as one rank whose representative GPU stands for its members, which move their own
//! shards over their own ports in lock step.

mod adaptive;
mod engine;
mod events;
mod layer;
mod links;
mod long_context;
mod network;
pub mod rank;
mod report;
mod setup;

use std::io::Write;

use medley_cost::Calibration;
use medley_plan::Plan;
use medley_schedule::{CheckedPrograms, ScheduleKind};

pub use adaptive::{RunReport, StepSummary, simulate_steps};
pub use long_context::{ContextLayerReport, DevicePass, PhaseSpan, simulate_context_layer};
pub use medley_trace::{BandwidthTrace, timeline};
pub use report::{RankReport, StepReport};

use engine::{StepRun, Transfer};
pub use medley_trace::Timeline;
use medley_trace::TraceCursor;
use network::Network;
use setup::Setup;

/// The furthest the engine's clock runs, s: it counts nanoseconds in a `u64` (584 years), and a
/// step the cost model prices beyond this (absurd device rates or links), or a transfer a network
/// trace slows past it, would overflow it.
const HORIZON_S: f64 = 1e9;

/// [`HORIZON_S`] in the clock's nanoseconds.
pub(crate) const HORIZON_NS: u64 = 1_000_000_000 * 1_000_000_000;

/// Seconds as the simulator's whole nanoseconds.
pub(crate) fn ns(seconds: f64) -> u64 {
    (seconds * 1e9).round() as u64
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("the programs do not match the plan: {0}")]
    ProgramsDoNotMatchPlan(String),
    #[error("rank {rank} names peer {peer}, which the plan does not have")]
    UnknownPeer { rank: String, peer: String },
    #[error("rank {rank} runs chunk {chunk}, but holds {n_chunks} chunk(s)")]
    UnknownChunk { rank: String, chunk: u32, n_chunks: usize },
    #[error("rank {rank} all-reduces DP group {group}, which the plan does not have")]
    UnknownGroup { rank: String, group: u32 },
    #[error("rank {rank} all-reduces DP group {group}, which it is not a member of")]
    NotAMember { rank: String, group: u32 },
    #[error("the programs deadlock: {}", stuck.join("; "))]
    Deadlock { stuck: Vec<String> },
    #[error(
        "the step cannot finish: {stalled_transfers} transfer(s) wait on links the network trace leaves at zero \
         bandwidth for good ({})",
        stuck.join("; ")
    )]
    Stalled { stuck: Vec<String>, stalled_transfers: usize },
    // The messages below quote their cause, which is therefore not also their source (see the
    // `From`s after the enum): `{:#}` would print it twice.
    #[error("invalid programs: {0}")]
    Schedule(medley_schedule::ScheduleError),
    #[error("lowering an all-reduce: {0}")]
    Collective(medley_collective::CollectiveError),
    #[error("writing the timeline: {0}")]
    Timeline(std::io::Error),
    #[error("the simulator cannot run this plan yet: {0}")]
    Unsupported(&'static str),
    #[error(
        "the cost model prices one step of this plan at {predicted_s:.3e} s, beyond what the simulator's clock \
         holds ({HORIZON_S:e} s): check the cluster's device rates, links and the calibration's efficiencies"
    )]
    BeyondHorizon { predicted_s: f64 },
    #[error(
        "simulated time passes {HORIZON_S:e} s, the furthest the simulator's clock runs, before the step ends: \
         the network trace leaves links too little bandwidth to finish it ({})",
        waiting.join("; ")
    )]
    PastHorizon { waiting: Vec<String> },
    #[error(
        "a step of this plan is {passes_per_step} passes (a micro-batch's forward and backward through one stage), \
         beyond the {MAX_PASSES} the simulator runs in a step (about 30 s and a few GB): fewer micro-batches (a \
         larger micro-batch or a smaller global batch) simulate"
    )]
    TooManyPasses { passes_per_step: u64 },
    #[error(
        "{n_steps} steps of this plan are about {} events, beyond the {MAX_EVENTS} the simulator runs at once \
         (about a minute): {}",
        u64::from(*.n_steps).saturating_mul(*.events_per_step),
        match MAX_EVENTS / .events_per_step {
            0 => "even one step is: fewer data-parallel replicas or micro-batches simulate".to_string(),
            steps => format!("simulate at most {steps} steps of this plan"),
        }
    )]
    TooManyEvents { n_steps: u32, events_per_step: u64 },
}

/// The most events one simulation runs over all its steps: about a minute on a two-core machine
/// (one step of Llama 3 405B on 16,384 GPUs, gradients reduced in fp32, is 34 million).
pub const MAX_EVENTS: u64 = 1 << 26;

/// The most passes (a micro-batch's forward and backward through one stage) a simulated step
/// runs: about 30 s and a few GB on a two-core machine (its programs are generated whole).
pub const MAX_PASSES: u64 = 1 << 21;

/// The passes one step of `plan` simulates: every replica's micro-batches through each of its
/// (virtual) stages.
pub fn passes_per_step(plan: &Plan) -> u64 {
    plan.replicas().iter().map(|replica| u64::from(replica.n_micro_batches) * replica.stages.len() as u64).sum()
}

/// Refuses a step of `plan` beyond [`MAX_PASSES`], before anything is simulated.
fn check_passes(plan: &Plan) -> Result<(), SimError> {
    let passes_per_step = passes_per_step(plan);
    if passes_per_step > MAX_PASSES {
        return Err(SimError::TooManyPasses { passes_per_step });
    }
    Ok(())
}

impl From<medley_schedule::ScheduleError> for SimError {
    fn from(err: medley_schedule::ScheduleError) -> Self {
        SimError::Schedule(err)
    }
}

impl From<medley_collective::CollectiveError> for SimError {
    fn from(err: medley_collective::CollectiveError) -> Self {
        SimError::Collective(err)
    }
}

impl From<std::io::Error> for SimError {
    fn from(err: std::io::Error) -> Self {
        SimError::Timeline(err)
    }
}

/// Knobs of a simulation beyond the plan.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimConfig {
    /// Available bandwidth over time on every inter-node port (each link draws its own random
    /// periods); full bandwidth when absent.
    pub network_trace: Option<BandwidthTrace>,
}

/// A plan being simulated step after step: simulated time, the network's bandwidth traces and
/// the timeline carry over from one step to the next.
pub struct Simulation<'p, 'w> {
    setup: Setup<'p>,
    network: Network<Transfer>,
    timeline: Option<Timeline<'w>>,
    now_ns: u64,
    /// Per NIC port, while a trace is followed: its cursor and its next change.
    trace_cursors: Vec<TraceCursor>,
    trace_changes: Vec<Option<(u64, f64)>>,
    /// Transfer lanes each rank's timeline has named so far.
    named_lanes: Vec<u32>,
}

impl<'p, 'w> Simulation<'p, 'w> {
    /// A simulation of `plan` starting at time 0; `timeline` receives the Perfetto trace.
    pub fn new(
        plan: &'p Plan,
        calibration: &Calibration,
        config: &SimConfig,
        timeline: Option<&'w mut dyn Write>,
    ) -> Result<Self, SimError> {
        let predicted_s = medley_plan::evaluate(plan, calibration).step_time_s;
        if predicted_s.is_nan() || predicted_s >= HORIZON_S {
            return Err(SimError::BeyondHorizon { predicted_s });
        }
        let mut network = Network::new();
        let setup = Setup::new(plan, calibration, &mut network)?;
        let n_ranks = setup.ranks.len();
        let mut simulation = Simulation {
            setup,
            network,
            timeline: timeline.map(Timeline::new),
            now_ns: 0,
            trace_cursors: Vec::new(),
            trace_changes: Vec::new(),
            named_lanes: vec![0; n_ranks],
        };
        if let Some(trace) = &config.network_trace {
            simulation.follow_trace(trace);
        }
        simulation.name_processes();
        Ok(simulation)
    }

    /// Every NIC port follows `trace`, each with its own random stream.
    fn follow_trace(&mut self, trace: &BandwidthTrace) {
        let mut drains = Vec::new();
        for (port_idx, port) in self.setup.links.ports().iter().enumerate() {
            let (fraction, mut cursor) = TraceCursor::new(trace, port_idx as u64);
            for &resource in port {
                self.network.set_fraction(0, resource, fraction, &mut drains);
            }
            self.trace_changes.push(cursor.next_change());
            self.trace_cursors.push(cursor);
        }
    }

    fn name_processes(&mut self) {
        let Some(timeline) = self.timeline.as_mut() else { return };
        for (rank_idx, rank) in self.setup.ranks.iter().enumerate() {
            let first = rank.devices[0];
            let last = rank.devices[rank.devices.len() - 1];
            let devices = if first == last { format!("device {first}") } else { format!("devices {first}-{last}") };
            let name = format!("{} · {} ×{} ({devices})", rank.id, rank.device_name, rank.devices.len());
            timeline.process(rank_idx as u32 + 1, &name, rank_idx as u32);
            if rank.layer_phases.is_some() {
                timeline.thread(rank_idx as u32 + 1, timeline::LAYER_TID, "first layer's phases (slowest device)");
            }
        }
    }

    /// Simulates one step of `programs`, proven correct by `medley_schedule::check` and here
    /// matched to this simulation's plan by their ranks.
    pub fn step(&mut self, programs: &CheckedPrograms) -> Result<StepReport, SimError> {
        self.check_programs(programs)?;
        let mut run = StepRun::new(self, &programs.programs);
        run.run()?;
        Ok(StepReport::of(&run, programs.schedule.to_string()))
    }

    /// Closes the timeline; reports the first error writing it.
    pub fn finish(self) -> Result<(), SimError> {
        self.timeline.map_or(Ok(()), Timeline::finish).map_err(SimError::from)
    }

    fn check_programs(&self, programs: &CheckedPrograms) -> Result<(), SimError> {
        let expected: Vec<_> = self.setup.ranks.iter().map(|rank| rank.id).collect();
        let given: Vec<_> = programs.programs.iter().map(|program| program.rank).collect();
        if expected != given {
            return Err(SimError::ProgramsDoNotMatchPlan(format!(
                "the plan has {} ranks, the programs are for {} (or name other ranks)",
                expected.len(),
                given.len()
            )));
        }
        Ok(())
    }
}

/// Simulates one step of `plan` under `schedule`, streaming the timeline to `timeline`.
pub fn simulate(
    plan: &Plan,
    schedule: ScheduleKind,
    calibration: &Calibration,
    config: &SimConfig,
    timeline: Option<&mut dyn Write>,
) -> Result<StepReport, SimError> {
    check_passes(plan)?;
    let mut simulation = Simulation::new(plan, calibration, config, timeline)?;
    let report = simulation.step(&medley_schedule::generate(plan, schedule)?)?;
    simulation.finish()?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 31: errors printed their cause twice (`{:#}` joins an error and its sources), and
    /// a plan's problem came wrapped as "invalid plan: invalid plan: ...".
    #[test]
    fn errors_print_their_cause_once() {
        let chain = |err: &dyn std::error::Error| {
            let mut text = err.to_string();
            let mut source = err.source();
            while let Some(next) = source {
                text += &format!(": {next}");
                source = next.source();
            }
            text
        };
        let mismatch =
            medley_schedule::ScheduleError::ChunkMismatch { schedule: ScheduleKind::Interleaved, virtual_stages: 1 };
        assert_eq!(chain(&SimError::from(mismatch.clone())), format!("invalid programs: {mismatch}"));
        let io = SimError::from(std::io::Error::other("disk full"));
        assert_eq!(chain(&io), "writing the timeline: disk full");
    }
}
