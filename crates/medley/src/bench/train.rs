//! `medley bench train`: real training on an emulated mixed fleet, the heterogeneity-aware plan
//! against the uniform (Megatron-style) one, each measured and predicted by the simulator under
//! a calibration of this machine; `medley bench context-train` the same for uneven against even
//! context-parallel shards; `medley bench kfkb` schedules under a throttled link.

use anyhow::{Context, Result, bail};
use clap::Args;
use medley_cost::Calibration;
use medley_plan::long_context::even_fixed;
use medley_plan::{Plan, baselines};
use medley_runtime::{DeviceChoice, RankLayout, RunDir, StepMetrics};
use medley_sim::{SimConfig, simulate_steps};
use medley_spec::{Cluster, DEFAULT_MEMORY_HEADROOM, ModelSpec, Precision, Schedule, catalog_model};

use crate::inputs::{JobFlags, JobShape, load_model};
use serde::Serialize;

use crate::job::{
    RunFlags, WorkerArgs, as_trained, calibrate_here, choose_plan_to_train, launch_and_watch, runtime_job,
};
use crate::progress::Progress;
use medley_bench::stats::median;
use medley_report::text::{percent, right, table, times};

#[derive(Args, Debug)]
#[command(
    mut_arg("model", |arg| arg.default_value("tiny")),
    mut_arg("seq_len", |arg| arg.default_value("128")),
    mut_arg("global_batch", |arg| arg.default_value("12")),
    mut_arg("micro_batch", |arg| arg.default_value("1"))
)]
pub struct TrainBenchArgs {
    /// The emulated fleet: by default an H100-PCIe and an L40S, a 2.1:1 speed mix when the cost
    /// model is calibrated to this machine (compute-bound).
    #[arg(long, default_value = "1xh100-pcie,1xl40s")]
    pub fleet: String,
    /// Timed steps per plan and round (after two warm-up steps).
    #[arg(long, default_value_t = 8)]
    pub steps: u64,
    /// Rounds; each calibrates afresh and runs both plans (this machine's speed drifts).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    #[command(flatten)]
    pub shape: JobFlags,
    /// Print the rows as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Steps left out of the measurement: start-up and first-touch costs.
const WARM_UP_STEPS: u64 = 2;

#[derive(Serialize)]
struct Row {
    plan: String,
    layout: String,
    predicted_step_s: f64,
    measured_step_s: f64,
    /// Per round, predicted over measured minus one.
    prediction_errors: Vec<f64>,
    prediction_error: f64,
    tokens_per_s: f64,
    /// Measured step time of the first (baseline) plan over this one's.
    speedup: f64,
}

pub fn run(args: &TrainBenchArgs) -> Result<()> {
    let cluster = Cluster::from_fleet(&args.fleet)?;
    let shape = args.shape.shape()?;
    let model = load_model(&shape.model)?;
    let job = runtime_job(&shape, None)?;
    let calibration =
        calibrate_here(&cluster, &model, shape.seq_len, shape.micro_batch, shape.precision, DeviceChoice::Cpu)?;
    let aware = choose_plan_to_train(&cluster, &model, &job, &calibration)?;
    let Some(uniform) = baselines::uniform(&cluster, &model, &job, &calibration).map(|candidate| candidate.plan) else {
        bail!("no uniform plan fits {} for this job", args.fleet)
    };
    let rounds = Rounds { cluster: &cluster, model: &model, steps: args.steps, rounds: args.rounds };
    let rows = rounds.compare(&[("uniform", &uniform), ("heterogeneity-aware", &aware)])?;
    let title = format!(
        "Real training on {} (emulated: passes stretched to each device's catalog speed); per round a fresh calibration, then {} timed steps after {WARM_UP_STEPS} warm-up per plan; medians over {} rounds:",
        args.fleet, args.steps, args.rounds
    );
    print_rows(&rows, "vs uniform", &title, args.json)
}

#[derive(Args, Debug)]
#[command(
    mut_arg("model", |arg| arg.default_value("tiny")),
    mut_arg("seq_len", |arg| arg.default_value("1024")),
    mut_arg("global_batch", |arg| arg.default_value("2")),
    mut_arg("micro_batch", |arg| arg.default_value("1"))
)]
pub struct ContextTrainBenchArgs {
    /// The emulated fleet, one worker per device, each sequence split over all of them (keep it
    /// to this machine's cores: the workers compute at once). By default an H100-PCIe and an
    /// L40S, a 2.1:1 speed mix under a calibration of this machine.
    #[arg(long, default_value = "1xh100-pcie,1xl40s")]
    pub fleet: String,
    /// Timed steps per plan and round (after two warm-up steps).
    #[arg(long, default_value_t = 4)]
    pub steps: u64,
    /// Rounds; each calibrates afresh and runs both plans (this machine's speed drifts).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    #[command(flatten)]
    pub shape: JobFlags,
    /// Print the rows as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Real long-context training: each sequence split over every device of the fleet by the
/// planner's uneven shards against even ones (ring-style context parallelism), measured and
/// simulated.
pub fn run_context(args: &ContextTrainBenchArgs) -> Result<()> {
    let cluster = Cluster::from_fleet(&args.fleet)?;
    let shape = args.shape.shape()?;
    let model = load_model(&shape.model)?;
    let job = runtime_job(&shape, None)?;
    let calibration =
        calibrate_here(&cluster, &model, shape.seq_len, shape.micro_batch, shape.precision, DeviceChoice::Cpu)?;
    let cp = cluster.n_gpus();
    let degrees = baselines::Degrees { cp, ..baselines::Degrees::new(1, 1, 1) };
    let asymmetric = as_trained(baselines::fixed(&cluster, &model, &job, &calibration, degrees)?.plan)?;
    let even = as_trained(even_fixed(&cluster, &model, &job, &calibration, cp, 1, 1, 1)?.plan)?;
    let rounds = Rounds { cluster: &cluster, model: &model, steps: args.steps, rounds: args.rounds };
    let rows = rounds.compare(&[("even shards", &even), ("asymmetric shards", &asymmetric)])?;
    let title = format!(
        "Real long-context training on {} ({} tokens a sequence over {cp} context-parallel devices; emulated speeds); per round a fresh calibration, then {} timed steps after {WARM_UP_STEPS} warm-up per plan; medians over {} rounds:",
        args.fleet, shape.seq_len, args.steps, args.rounds
    );
    print_rows(&rows, "vs even", &title, args.json)
}

/// Plans measured against each other on one emulated fleet: rounds alternate between them.
struct Rounds<'a> {
    cluster: &'a Cluster,
    model: &'a ModelSpec,
    steps: u64,
    rounds: usize,
}

impl Rounds<'_> {
    /// Each plan's median prediction and measurement; speedups against the first plan.
    fn compare(&self, plans: &[(&str, &Plan)]) -> Result<Vec<Row>> {
        // (predicted, measured) per plan and round.
        let mut runs = vec![Vec::new(); plans.len()];
        for _ in 0..self.rounds.max(1) {
            for ((name, plan), runs) in plans.iter().zip(&mut runs) {
                let (seq_len, micro_batch, precision) = (plan.seq_len(), plan.micro_batch(), plan.precision());
                let calibration =
                    calibrate_here(self.cluster, self.model, seq_len, micro_batch, precision, DeviceChoice::Cpu)?;
                let predicted = simulate_steps(plan, &calibration, &SimConfig::default(), plan.schedule(), 1, None)
                    .with_context(|| format!("simulating the {name} plan"))?
                    .mean_step_time_s;
                runs.push((predicted, measure(plan, &calibration, name, self.steps)?));
            }
        }
        let mut rows = Vec::new();
        for ((name, plan), runs) in plans.iter().zip(runs) {
            let measured = median(runs.iter().map(|run| run.1).collect());
            let prediction_errors: Vec<f64> = runs.iter().map(|(p, m)| p / m - 1.0).collect();
            rows.push(Row {
                plan: name.to_string(),
                layout: describe(plan),
                predicted_step_s: median(runs.iter().map(|run| run.0).collect()),
                measured_step_s: measured,
                prediction_error: median(prediction_errors.clone()),
                prediction_errors,
                tokens_per_s: f64::from(plan.global_batch() * plan.seq_len()) / measured,
                speedup: 0.0,
            });
        }
        let baseline_s = rows[0].measured_step_s;
        rows.iter_mut().for_each(|row| row.speedup = baseline_s / row.measured_step_s);
        Ok(rows)
    }
}

fn print_rows(rows: &[Row], speedup_header: &str, title: &str, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(rows)?);
        return Ok(());
    }
    let mut out = table(&[
        "plan",
        "layout",
        "predicted step",
        "measured step",
        "error",
        "error per round",
        "tokens/s",
        speedup_header,
    ]);
    for row in rows {
        out.add_row(vec![
            right(&row.plan),
            right(&row.layout),
            right(format!("{:.1} ms", row.predicted_step_s * 1e3)),
            right(format!("{:.1} ms", row.measured_step_s * 1e3)),
            right(percent(row.prediction_error)),
            right(row.prediction_errors.iter().map(|e| percent(*e)).collect::<Vec<_>>().join(" ")),
            right(format!("{:.0}", row.tokens_per_s)),
            right(times(row.speedup)),
        ]);
    }
    println!("{title}\n{out}");
    Ok(())
}

/// The median measured step time of `plan` over `steps` steps after the warm-up.
fn measure(plan: &Plan, calibration: &Calibration, name: &str, steps: u64) -> Result<f64> {
    Ok(median(step_times(plan, calibration, name, steps, RunTweaks::default())?))
}

/// What a benchmark run changes from the plan's defaults.
#[derive(Default)]
pub(super) struct RunTweaks {
    schedule: Option<Schedule>,
    /// GB/s and bandwidth trace of throttled pipeline links.
    link: Option<(f64, String)>,
}

/// Trains `plan` for `steps` steps after the warm-up in real worker processes and returns the
/// measured step times after the warm-up.
fn step_times(plan: &Plan, calibration: &Calibration, name: &str, steps: u64, tweaks: RunTweaks) -> Result<Vec<f64>> {
    let measured = run_steps(plan, calibration, name, steps + WARM_UP_STEPS, tweaks)?;
    Ok(measured[WARM_UP_STEPS as usize..].iter().map(|step| step.step_time_s).collect())
}

/// Trains `plan` for `steps` steps in real worker processes, each stretched to its emulated
/// device, and returns every step's metrics.
pub(super) fn run_steps(
    plan: &Plan,
    calibration: &Calibration,
    name: &str,
    steps: u64,
    tweaks: RunTweaks,
) -> Result<Vec<StepMetrics>> {
    let dir = std::env::temp_dir().join(format!("medley-bench-train-{}-{name}", std::process::id()));
    let claimed = RunDir::at(&dir).claim(None, true)?;
    claimed.start_over_if_forced()?;
    let run_dir = claimed.dir();
    run_dir.write_inputs(plan, calibration)?;
    let layouts = RankLayout::all(plan, calibration)?;
    let (link_gb_s, link_trace) = tweaks.link.map_or((None, None), |(gb_s, trace)| (Some(gb_s), Some(trace)));
    let args = WorkerArgs {
        plan: run_dir.plan().to_string_lossy().into_owned(),
        calibration: Some(run_dir.calibration().to_string_lossy().into_owned()),
        out: dir.clone(),
        resume: None,
        run: RunFlags {
            steps,
            checkpoint_every: 0,
            keep_checkpoints: 1,
            schedule: tweaks.schedule,
            seed: 0,
            lr: medley_model::AdamW::default().lr,
            no_emulate: false,
            device: DeviceChoice::Cpu,
            // Two workers on two cores: the runs fit the cores as they are.
            time_dilation: 1.0,
            timeout_s: 30,
            checkpoint_on_signal: false,
            link_gb_s,
            link_trace,
        },
        print_metrics: true,
        force: false,
        run_dir_locked: true,
    };
    // A benchmark's table is its output: the runs it times show no progress of their own.
    let outcome = launch_and_watch(&args, &layouts, Progress::Quiet)?;
    drop(claimed);
    std::fs::remove_dir_all(&dir).ok();
    if !outcome.end.succeeded() {
        bail!("the {name} run's workers failed: {}", outcome.end.first_error().unwrap_or("no error message"));
    }
    if outcome.steps.len() as u64 != steps {
        bail!("the {name} run reported {} of its {steps} steps", outcome.steps.len());
    }
    Ok(outcome.steps)
}

#[derive(Args, Debug)]
pub struct KfkbBenchArgs {
    /// Timed steps per schedule (after two warm-up steps).
    #[arg(long, default_value_t = 24)]
    pub steps: u64,
    /// The pipeline link's full bandwidth, GB/s (one micro-batch's activations are 64 KiB).
    #[arg(long, default_value_t = 0.05, value_parser = crate::inputs::parse_gb_s)]
    pub link_gb_s: f64,
    /// How the link's bandwidth varies (other jobs taking it for periods).
    #[arg(long, default_value = "on-off:full=5s,reduced=5s,fraction=0.1")]
    pub link_trace: String,
    /// Rounds of all the schedules one after another (this machine's speed drifts); the
    /// median round counts.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Print the rows as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct KfkbRow {
    schedule: String,
    mean_step_s: f64,
    tokens_per_s: f64,
    speedup_vs_1f1b: f64,
}

/// Adaptive kFkB against 1F1B (and fixed group sizes) on a two-stage pipeline whose link is
/// throttled for periods, measured in real worker processes.
pub fn run_kfkb(args: &KfkbBenchArgs) -> Result<()> {
    let cluster = Cluster::from_fleet("2xh100")?;
    let model = catalog_model("tiny")?;
    let shape = JobShape {
        model: "tiny".into(),
        seq_len: 128,
        global_batch: 16,
        micro_batch: 1,
        precision: Precision::Bf16Mixed,
        memory_headroom: DEFAULT_MEMORY_HEADROOM,
    };
    let job = runtime_job(&shape, None)?;
    let calibration = Calibration::default();
    let plan = baselines::fixed(&cluster, &model, &job, &calibration, baselines::Degrees::new(1, 2, 1))?.plan;
    let link = (args.link_gb_s, args.link_trace.clone());
    let schedules = ["1f1b", "kfkb:2", "kfkb:4", "adaptive"];
    let mut mean_steps_s = vec![Vec::new(); schedules.len()];
    for _ in 0..args.rounds.max(1) {
        for (schedule, means) in schedules.iter().zip(&mut mean_steps_s) {
            let schedule_kind: Schedule = schedule.parse().map_err(anyhow::Error::msg)?;
            let tweaks = RunTweaks { schedule: Some(schedule_kind), link: Some(link.clone()) };
            let times = step_times(&plan, &calibration, schedule, args.steps, tweaks)?;
            means.push(times.iter().sum::<f64>() / times.len() as f64);
        }
    }
    let mut rows: Vec<KfkbRow> = Vec::new();
    for (schedule, means) in schedules.iter().zip(mean_steps_s) {
        let mean_step_s = median(means);
        let baseline = rows.first().map_or(mean_step_s, |row| row.mean_step_s);
        rows.push(KfkbRow {
            schedule: schedule.to_string(),
            mean_step_s,
            tokens_per_s: f64::from(plan.global_batch() * plan.seq_len()) / mean_step_s,
            speedup_vs_1f1b: baseline / mean_step_s,
        });
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let mut out = table(&["schedule", "mean step", "tokens/s", "vs 1f1b"]);
    for row in &rows {
        out.add_row(vec![
            right(&row.schedule),
            right(format!("{:.1} ms", row.mean_step_s * 1e3)),
            right(format!("{:.0}", row.tokens_per_s)),
            right(times(row.speedup_vs_1f1b)),
        ]);
    }
    println!(
        "Real training, tiny model on a 2-stage pipeline (16 micro-batches a step), link {} GB/s varying as {}; mean of {} steps after {WARM_UP_STEPS} warm-up, median of {} rounds:\n{out}",
        args.link_gb_s, args.link_trace, args.steps, args.rounds
    );
    Ok(())
}

/// Layers per stage and micro-batches per replica, e.g. `[5+3]×8 | [8]×4`, and a long-context
/// stage's tokens per group, e.g. `[8 cp 768/256]×2`.
fn describe(plan: &Plan) -> String {
    let stage = |stage: &medley_plan::Stage| match &stage.context {
        None => stage.layers.len().to_string(),
        Some(context) => {
            let tokens: Vec<String> = context.groups.iter().map(|group| group.tokens.to_string()).collect();
            format!("{} cp {}", stage.layers.len(), tokens.join("/"))
        }
    };
    plan.replicas()
        .iter()
        .map(|replica| {
            let layers: Vec<String> = replica.stages.iter().map(stage).collect();
            format!("[{}]×{}", layers.join("+"), replica.n_micro_batches)
        })
        .collect::<Vec<_>>()
        .join(" | ")
}
