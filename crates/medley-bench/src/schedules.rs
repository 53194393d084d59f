//! `medley bench schedules`' suite: the simulator's own speed on a 1024-GPU step, and the
//! orderings of pipeline schedules the literature reports, each reproduced in simulation side by
//! side with its baseline.

use std::fmt::Display;
use std::fs::File;
use std::io::BufWriter;
use std::num::NonZeroU32;

use medley_cost::{Calibration, CostModel, Setting};
use medley_plan::Plan;
use medley_plan::baselines::{Degrees, megatron_plan};
use medley_schedule::{Schedule, ScheduleKind};
use medley_sim::{SimConfig, simulate, simulate_steps};
use medley_spec::{Bridge, Cluster, Fabric, JobParts, JobSpec, Recompute, catalog_model};
use serde::Serialize;

use crate::BenchError;
use crate::stats::{peak_rss_mib, timed_median};

/// A cluster: inline, or TOML text with a short name for the tables.
#[derive(Clone, Copy)]
enum ClusterText {
    Inline(&'static str),
    Toml { name: &'static str, text: &'static str },
}

/// A homogeneous Megatron-style layout.
#[derive(Clone, Copy)]
struct Layout {
    cluster: ClusterText,
    model: &'static str,
    seq_len: u32,
    global_batch: u32,
    degrees: Degrees,
    recompute: Recompute,
}

impl Layout {
    fn plan(&self) -> Result<Plan, BenchError> {
        let calibration = Calibration::default();
        let model = catalog_model(self.model).map_err(self.failed())?;
        let cluster = match self.cluster {
            ClusterText::Inline(text) => Cluster::from_inline(text, Fabric::default(), Bridge::default()),
            ClusterText::Toml { name, text } => Cluster::from_toml(text, name),
        }
        .map_err(self.failed())?;
        let parts = JobParts {
            seq_len: self.seq_len,
            global_batch: self.global_batch,
            micro_batch: Some(1),
            zero1: false,
            ..JobParts::default()
        };
        let job = JobSpec::new(parts, "medley bench schedules").map_err(self.failed())?;
        let cost = CostModel::new(&model, self.seq_len, &calibration);
        let setting = Setting { micro_batch: 1, tp: self.degrees.tp, recompute: self.recompute };
        megatron_plan(&cluster, &cost, &job, setting, self.degrees).map_err(self.failed())
    }

    fn failed<E: Display>(&self) -> impl Fn(E) -> BenchError + '_ {
        |err| BenchError::Case { case: self.describe(), message: err.to_string() }
    }

    pub fn describe(&self) -> String {
        let cluster = match self.cluster {
            ClusterText::Inline(text) | ClusterText::Toml { name: text, .. } => text,
        };
        format!("{} on {cluster}, {}, {} seqs", self.model, self.degrees, self.global_batch)
    }
}

/// The step the simulator's speed is measured on: 1024 GPUs, pp = 16, 64 micro-batches per replica.
const SPEED_LAYOUT: Layout = Layout {
    cluster: ClusterText::Inline("1024xh100"),
    model: "llama3-70b",
    seq_len: 4096,
    global_batch: 512,
    degrees: Degrees::new(8, 16, 8),
    recompute: Recompute::Selective,
};
pub const SPEED_TARGET_S: f64 = 0.4;
pub const MEMORY_TARGET_MIB: f64 = 1024.0;

/// The Ada-Grouper setting (Wang et al. 2023): a pipeline across nodes of a shared cluster, one
/// A100 per node behind one 100 Gb/s NIC, so pipeline transfers are a fair share of the step.
const CROSS_NODE: Layout = Layout {
    cluster: ClusterText::Toml {
        name: "8 nodes × 1 A100, 100 Gb/s",
        text: "[[group]]\ndevice = \"a100\"\nnodes = 8\ngpus_per_node = 1\nnics_per_node = 1\nnic_gbit_s = 100\n",
    },
    model: "llama3.2-1b",
    seq_len: 4096,
    global_batch: 32,
    degrees: Degrees::new(1, 8, 1),
    recompute: Recompute::Full,
};
/// Other jobs take 95% of a link's bandwidth for periods of 200 ms on average, half the time.
pub const PREEMPTED: &str = "random:seed=7,full=200ms,reduced=200ms,fraction=0.05";
/// Steps per network experiment: enough for the adaptive schedule to settle.
pub const NETWORK_STEPS: u32 = 16;

#[derive(Clone, Debug, Serialize)]
pub struct SimulatorSpeedRow {
    pub layout: String,
    pub n_gpus: u32,
    pub timeline: bool,
    pub median_s: f64,
    pub target_s: f64,
    pub speed_ratio: f64,
    pub events: u64,
    pub peak_rss_mib: Option<f64>,
    pub memory_target_mib: f64,
    pub timeline_mib: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct OrderingRow {
    pub claim: &'static str,
    /// Which setting of the legend.
    pub setting: char,
    pub layout: String,
    pub network: &'static str,
    pub schedule: String,
    pub schedule_s: f64,
    pub baseline: String,
    pub baseline_s: f64,
    /// baseline_s / schedule_s.
    pub speedup: f64,
    /// The speedup the claim needs.
    pub required: f64,
    pub holds: bool,
}

/// Times [`TIMED_RUNS`](crate::stats::TIMED_RUNS) simulations of the 1024-GPU step, with its timeline streamed to a
/// temporary file or without one. Run it alone, so that the peak RSS is the simulator's.
pub fn speed_row(with_timeline: bool) -> Result<SimulatorSpeedRow, BenchError> {
    let plan = SPEED_LAYOUT.plan()?;
    let calibration = Calibration::default();
    let timeline_path = std::env::temp_dir().join(format!("medley-bench-timeline-{}.json", std::process::id()));
    let (median_s, report) = timed_median(|| -> Result<_, BenchError> {
        Ok(if with_timeline {
            let file = File::create(&timeline_path)
                .map_err(|source| BenchError::Io { context: "creating the benchmark's timeline file", source })?;
            let mut out = BufWriter::new(file);
            simulate(&plan, ScheduleKind::OneFOneB, &calibration, &SimConfig::default(), Some(&mut out))?
        } else {
            simulate(&plan, ScheduleKind::OneFOneB, &calibration, &SimConfig::default(), None)?
        })
    })?;
    let timeline_mib = with_timeline
        .then(|| std::fs::metadata(&timeline_path).map(|meta| meta.len() as f64 / (1 << 20) as f64))
        .transpose()
        .map_err(|source| BenchError::Io { context: "reading the benchmark's timeline file's size", source })?;
    if with_timeline {
        std::fs::remove_file(&timeline_path).ok();
    }
    Ok(SimulatorSpeedRow {
        layout: SPEED_LAYOUT.describe(),
        n_gpus: plan.used_devices().len() as u32,
        timeline: with_timeline,
        median_s,
        target_s: SPEED_TARGET_S,
        speed_ratio: SPEED_TARGET_S / median_s,
        events: report.events,
        peak_rss_mib: peak_rss_mib(),
        memory_target_mib: MEMORY_TARGET_MIB,
        timeline_mib,
    })
}

fn kfkb(k: u32) -> ScheduleKind {
    ScheduleKind::Kfkb { k: NonZeroU32::new(k).expect("k ≥ 1") }
}

/// Mean step time of `schedule` over the network experiment's steps.
fn network_run(plan: &Plan, trace: Option<&str>, schedule: Schedule) -> Result<f64, BenchError> {
    let config = SimConfig { network_trace: trace.map(str::parse).transpose()? };
    Ok(simulate_steps(plan, &Calibration::default(), &config, schedule, NETWORK_STEPS, None)?.mean_step_time_s)
}

/// Each ordering claim, simulated side by side with its baseline.
pub fn orderings() -> Result<Vec<OrderingRow>, BenchError> {
    let calibration = Calibration::default();
    let mut rows = Vec::new();
    let mut row =
        |claim, setting, layout: &Layout, network, (schedule, schedule_s), (baseline, baseline_s), required| {
            let speedup = baseline_s / schedule_s;
            rows.push(OrderingRow {
                claim,
                setting,
                layout: layout.describe(),
                network,
                schedule,
                schedule_s,
                baseline,
                baseline_s,
                speedup,
                required,
                holds: speedup >= required,
            });
        };
    // ZB-H1 fills 1F1B's cool-down with deferred weight-gradient passes (Qi et al. 2023).
    let zero_bubble = Layout {
        cluster: ClusterText::Inline("64xh100"),
        model: "llama3-70b",
        seq_len: 4096,
        global_batch: 16,
        degrees: Degrees::new(8, 8, 1),
        recompute: Recompute::Selective,
    };
    let plan = zero_bubble.plan()?;
    let step = |kind| -> Result<f64, BenchError> {
        Ok(simulate(&plan, kind, &calibration, &SimConfig::default(), None)?.step_time_s)
    };
    let one_f_one_b = step(ScheduleKind::OneFOneB)?;
    row(
        "ZB-H1 beats 1F1B",
        'A',
        &zero_bubble,
        "idle",
        ("zb-h1".into(), step(ScheduleKind::ZbH1)?),
        ("1f1b".into(), one_f_one_b),
        1.0,
    );
    // Interleaving divides the fill and drain by the chunks per rank (Narayanan et al. 2021),
    // which matters most when micro-batches are few.
    let few = Layout { global_batch: 8, ..zero_bubble };
    let interleaved = Layout { degrees: Degrees { vpp: 2, ..few.degrees }, ..few };
    let simulate_one = |layout: &Layout, kind| -> Result<f64, BenchError> {
        Ok(simulate(&layout.plan()?, kind, &calibration, &SimConfig::default(), None)?.step_time_s)
    };
    row(
        "interleaved beats 1F1B when m is small",
        'B',
        &interleaved,
        "idle",
        ("interleaved".into(), simulate_one(&interleaved, ScheduleKind::Interleaved)?),
        ("1f1b".into(), simulate_one(&few, ScheduleKind::OneFOneB)?),
        1.0,
    );
    // The Ada-Grouper setting: a cross-node pipeline whose links lose most of their bandwidth
    // for periods.
    let plan = CROSS_NODE.plan()?;
    let one_f_one_b = network_run(&plan, Some(PREEMPTED), Schedule::Fixed(ScheduleKind::OneFOneB))?;
    let fixed: Vec<(u32, f64)> = [2, 4, 8, 16]
        .into_iter()
        .map(|k| Ok((k, network_run(&plan, Some(PREEMPTED), Schedule::Fixed(kfkb(k)))?)))
        .collect::<Result<_, BenchError>>()?;
    let &(best_k, best_s) = fixed.iter().min_by(|a, b| a.1.total_cmp(&b.1)).expect("candidates");
    row(
        "kFkB (best k) beats 1F1B by ≥ 10%",
        'C',
        &CROSS_NODE,
        PREEMPTED,
        (format!("kfkb:{best_k}"), best_s),
        ("1f1b".into(), one_f_one_b),
        1.10,
    );
    let adaptive = network_run(&plan, Some(PREEMPTED), Schedule::Adaptive)?;
    row(
        "adaptive k ≈ best fixed k",
        'C',
        &CROSS_NODE,
        PREEMPTED,
        ("adaptive".into(), adaptive),
        (format!("kfkb:{best_k}"), best_s),
        0.9,
    );
    let quiet_adaptive = network_run(&plan, None, Schedule::Adaptive)?;
    let quiet_one_f = network_run(&plan, None, Schedule::Fixed(ScheduleKind::OneFOneB))?;
    row(
        "adaptive k costs little when idle",
        'D',
        &CROSS_NODE,
        "idle",
        ("adaptive".into(), quiet_adaptive),
        ("1f1b".into(), quiet_one_f),
        0.95,
    );
    Ok(rows)
}
