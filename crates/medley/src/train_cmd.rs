//! `medley train`: plans a job on an emulated fleet (or takes a plan), starts one `medley worker`
//! process per pipeline rank on this machine, shows progress and reports the outcome.

use std::fs;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use medley_cost::Calibration;
use medley_plan::Plan;
use medley_plan::max_k_within_memory;
use medley_runtime::run_dir::same_dir;
use medley_runtime::{
    Emulation, RankLayout, RunDir, StepMetrics, check_resumable, read_latest, time_dilation,
    unfinished_later_checkpoints, verify_checkpoint, worker_memory,
};
use medley_sim::{SimConfig, simulate_steps};
use medley_spec::{Cluster, ModelSpec, Schedule, ScheduleKind};

use crate::inputs::DEFAULT_FLEET;
use crate::inputs::{JobFlags, JobShape, emulated_cluster, load_model, read_emulation_profile};
use crate::job::{
    Outcome, RUNTIME_CONTEXT_TOKENS, RunFlags, SMALLER_RUN, WorkerArgs, as_trained, calibrate_here,
    choose_plan_to_train, cores_here, launch_and_watch, runtime_job,
};
use crate::progress::Progress;
use crate::stop::{self};
use medley_report::text::{percent, right, seconds, table};
use medley_runtime::check_memory;

#[derive(Args, Debug)]
#[command(
    mut_arg("model", |arg| arg.default_value("tiny")),
    mut_arg("seq_len", |arg| arg.default_value("128")),
    mut_arg("global_batch", |arg| arg.default_value("16")),
    mut_arg("micro_batch", |arg| arg.default_value("2"))
)]
pub struct TrainArgs {
    /// A plan file to train (as `medley plan -o` writes it) instead of planning the fleet.
    #[arg(long, conflicts_with = "fleet")]
    pub plan: Option<String>,
    /// The emulated cluster, one worker process per GPU (an MI250X is two, its GCDs): a cluster
    /// TOML file, or COUNTxDEVICE,... with each GPU its own node [default: 2xh100,2xmi300x, or
    /// the checkpoint's plan with --resume].
    #[arg(long = "cluster", visible_alias = "fleet", value_name = "CLUSTER")]
    pub fleet: Option<String>,
    /// The model (Llama-style decoders only) and the job's shape.
    #[command(flatten)]
    pub shape: JobFlags,
    /// An emulation profile from `medley calibrate` [default: measure this machine now].
    #[arg(long)]
    pub calibration: Option<String>,
    /// Continue the run in this directory from its newest checkpoint; with --plan or --fleet,
    /// under that plan (the model re-shards).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// The run directory [default: the --resume directory, else medley-run]. A new run refuses
    /// a directory that already holds one.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Start over in a run directory that already holds a run: delete its checkpoints, metrics
    /// and timelines first.
    #[arg(long, conflicts_with = "resume")]
    pub force: bool,
    #[command(flatten)]
    pub worker: RunFlags,
}

pub fn run(args: &TrainArgs) -> Result<ExitCode> {
    let out = args.out.clone().or_else(|| args.resume.clone()).unwrap_or_else(|| PathBuf::from("medley-run"));
    let claimed = RunDir::at(&out).claim(args.resume.as_deref(), args.force)?;
    let run_dir = claimed.dir();
    let (plan, calibration) = choose_plan(args)?;
    let layouts = RankLayout::all(&plan, &calibration)?;
    check_workers_memory(&plan, &calibration, &layouts, args.worker.schedule.unwrap_or(plan.schedule()))?;
    if let Some(dir) = &args.resume {
        let source = RunDir::at(dir);
        let (checkpoint, manifest) = read_latest(&source.checkpoints())?;
        check_resumable(&checkpoint, &manifest, &plan)?;
        verify_checkpoint(&checkpoint, &manifest)?;
        if same_dir(dir, &out) {
            unfinished_later_checkpoints(&source.checkpoints(), manifest.step)?;
        }
    }
    // Only a run that passed its checks touches the directory.
    claimed.start_over_if_forced()?;
    run_dir.write_inputs(&plan, &calibration)?;
    println!("{}", medley_report::plan_text::explain(&plan));
    println!("{}", workers_table(&plan, &layouts, !args.worker.no_emulate));
    let mut run = args.worker.clone();
    if !run.no_emulate {
        run.time_dilation = run.time_dilation.max(dilation_here(layouts.len()));
    }
    let emulation = Emulation { time_dilation: run.time_dilation, workers: layouts.len(), cores: cores_here() };
    run_dir.write_emulation(&emulation)?;
    let devices = plan.cluster().groups().iter().map(|group| &group.device);
    let predicted_step_s = predict_step_s(&plan, &calibration.dilated(devices, run.time_dilation), &run)?;
    run.timeout_s = timeout_for(predicted_step_s, &run);
    let worker_args = WorkerArgs {
        plan: run_dir.plan().to_string_lossy().into_owned(),
        calibration: Some(run_dir.calibration().to_string_lossy().into_owned()),
        out: out.clone(),
        resume: args.resume.clone(),
        run,
        print_metrics: true,
        force: false,
        run_dir_locked: true,
    };
    let started = Instant::now();
    let outcome = launch_and_watch(&worker_args, &layouts, Progress::new(worker_args.run.steps))?;
    report(run_dir, &outcome, &layouts, (started.elapsed(), predicted_step_s))
}

/// The time dilation that fits `workers` to this machine's cores, said when it slows the run.
fn dilation_here(workers: usize) -> f64 {
    let cores = cores_here();
    let dilation = time_dilation(workers, cores);
    if dilation > 1.0 {
        tracing::info!(
            "{} share {cores} cores: every emulated device runs {dilation:.2}× slower still (time dilation), so that \
             the workers keep to it when all compute at once, and the prediction with it",
            medley_report::text::count(workers, "worker")
        );
    }
    dilation
}

/// Waits on a peer legitimately last up to a step (a pipeline's fill, a slow replica before the
/// all-reduce): the timeout is at least this many predicted steps.
const TIMEOUT_STEPS: f64 = 10.0;

/// The simulator's step time for `plan` under the run's emulation profile.
fn predict_step_s(plan: &Plan, calibration: &Calibration, run: &RunFlags) -> Result<f64> {
    let schedule = run.schedule.unwrap_or(plan.schedule());
    let predicted = simulate_steps(plan, calibration, &SimConfig::default(), schedule, 1, None)?.mean_step_time_s;
    tracing::info!("the simulator predicts {} a step for this plan on this machine", seconds(predicted));
    Ok(predicted)
}

/// The workers' timeout: `--timeout-s`, raised to `TIMEOUT_STEPS` predicted steps so that a big
/// model's long waits are not taken for a dead peer.
fn timeout_for(predicted_step_s: f64, run: &RunFlags) -> u64 {
    let needed = (TIMEOUT_STEPS * predicted_step_s).ceil() as u64;
    if needed > run.timeout_s {
        tracing::info!(
            "a silent worker is given {needed} s (ten predicted steps) before it is named, not {} s",
            run.timeout_s
        );
    }
    run.timeout_s.max(needed)
}

/// The plan to train and the emulation profile that prices its fleet.
fn choose_plan(args: &TrainArgs) -> Result<(Plan, Calibration)> {
    let calibration =
        |cluster: &Cluster, model: &ModelSpec, (seq_len, micro_batch): (u32, u32), precision| match &args.calibration {
            Some(path) => read_emulation_profile(path, model),
            None => calibrate_here(cluster, model, seq_len, micro_batch, precision, args.worker.device),
        };
    let given = |plan: Plan| -> Result<(Plan, Calibration)> {
        let plan = as_trained(plan)?;
        let shape = (plan.seq_len(), plan.micro_batch());
        let calibration = calibration(plan.cluster(), plan.model(), shape, plan.precision())?;
        Ok((plan, calibration))
    };
    if let Some(path) = &args.plan {
        return given(crate::inputs::load_plan(path)?);
    }
    let resumed = args.resume.as_ref().map(|dir| read_latest(&RunDir::at(dir).checkpoints())).transpose()?;
    let resumed = match (resumed, &args.fleet) {
        (Some((_, manifest)), None) => return given(manifest.plan),
        (resumed, _) => resumed.map(|(_, manifest)| manifest.plan),
    };
    let fleet = args.fleet.as_deref().unwrap_or(DEFAULT_FLEET);
    let cluster = emulated_cluster(fleet)?;
    // Resuming on another fleet trains the checkpoint's model on its batches.
    let (model, shape) = match resumed {
        Some(plan) => {
            let shape = JobShape {
                model: plan.model().name().to_string(),
                seq_len: plan.seq_len(),
                global_batch: plan.global_batch(),
                micro_batch: plan.micro_batch(),
                precision: plan.precision(),
                memory_headroom: plan.memory_headroom(),
            };
            (plan.model().clone(), shape)
        }
        None => {
            let shape = args.shape.shape()?;
            (load_model(&shape.model)?, shape)
        }
    };
    let (seq_len, micro_batch) = (shape.seq_len, shape.micro_batch);
    let micro_batch = if seq_len >= RUNTIME_CONTEXT_TOKENS && micro_batch != 1 {
        tracing::info!(
            "sequences of {seq_len} tokens train one per micro-batch (not {micro_batch}), so that a plan may split \
             each over several devices"
        );
        1
    } else {
        micro_batch
    };
    let shape = JobShape { micro_batch, ..shape };
    let job = runtime_job(&shape, args.worker.schedule)?;
    let calibration = calibration(&cluster, &model, (seq_len, micro_batch), shape.precision)?;
    let plan = choose_plan_to_train(&cluster, &model, &job, &calibration)
        .with_context(|| format!("planning {} on {fleet}", model.name()))?;
    Ok((as_trained(plan)?, calibration))
}

/// Refuses a job whose workers would not fit in this machine's memory together. An adaptive
/// schedule is priced at the largest k it may choose.
fn check_workers_memory(
    plan: &Plan,
    calibration: &Calibration,
    layouts: &[RankLayout],
    schedule: Schedule,
) -> Result<()> {
    let schedule = match schedule {
        Schedule::Adaptive => NonZeroU32::new(max_k_within_memory(plan, calibration))
            .map_or(Schedule::Fixed(ScheduleKind::OneFOneB), |k| Schedule::Fixed(ScheduleKind::Kfkb { k })),
        fixed => fixed,
    };
    let needs = layouts.iter().map(|layout| worker_memory(plan, layout, schedule)).collect::<Result<Vec<_>, _>>()?;
    let what = format!("the {} of {}", medley_report::text::count(layouts.len(), "worker"), plan.model().name());
    Ok(check_memory(&what, &needs, SMALLER_RUN)?)
}

fn workers_table(plan: &Plan, layouts: &[RankLayout], emulate: bool) -> String {
    let mut rows = table(&["worker", "rank", "device (emulated)", "domain", "layers", "micro-batches", "slowdown"]);
    for layout in layouts {
        let layers: Vec<String> = layout.chunks.iter().map(|c| format!("{}..{}", c.start, c.end)).collect();
        let slowdown = if emulate { format!("{:.2}×", layout.device.slowdown) } else { "off".into() };
        rows.add_row(vec![
            right(layout.job_rank),
            right(layout.id),
            right(&layout.device.name),
            right(layout.device.vendor),
            right(layers.join(" ")),
            right(plan.replicas()[layout.id.replica as usize].n_micro_batches),
            right(slowdown),
        ]);
    }
    format!("Workers (processes on this machine; device speeds are emulated by stretching each pass):\n{rows}")
}

/// The run's wall time and the simulator's predicted step time.
type Timing = (Duration, f64);

fn report(out: &RunDir, outcome: &Outcome, layouts: &[RankLayout], timing: Timing) -> Result<ExitCode> {
    let failed = outcome.end.failed_ranks();
    if failed.is_empty() {
        out.merge_timelines()?;
        print_summary(out, &outcome.steps, timing);
        write_report(out);
        let Some(signal) = outcome.stopped_by else { return Ok(ExitCode::SUCCESS) };
        let stopped_at = outcome.steps.last().map_or(0, |step| step.step);
        tracing::warn!("stopped at step {stopped_at} on {}; {}", stop::name(signal), last_checkpoint(out));
        return Ok(ExitCode::from(stop::exit_code(signal) as u8));
    }
    let mut lines = vec!["training stopped:".to_string()];
    for &rank in &failed {
        let layout = &layouts[rank];
        lines.push(format!("  worker {rank} ({}, {}): {}", layout.id, layout.device.name, outcome.end.describe(rank)));
        lines.extend(outcome.end.stderr[rank].last().map(|last| format!("    {last}")));
    }
    lines.push(last_checkpoint(out));
    crate::say_error(&lines.join("\n"));
    Ok(ExitCode::from(1))
}

/// The run's last complete checkpoint and how to continue from it, in words.
fn last_checkpoint(out: &RunDir) -> String {
    match read_latest(&out.checkpoints()) {
        Ok((dir, manifest)) => format!(
            "the last complete checkpoint is {} (step {}); continue with `medley train --resume {}`",
            dir.display(),
            manifest.step,
            out.root().display()
        ),
        Err(_) => "no checkpoint was completed".to_string(),
    }
}

/// The run's report page; a report that cannot be written is said, and the run still succeeded.
fn write_report(out: &RunDir) {
    let (plan, calibration, path) = (out.plan(), out.calibration(), out.report());
    let page =
        crate::report_page::page(&plan.to_string_lossy(), Some(&calibration.to_string_lossy()), Some(out.root()));
    match page.and_then(|html| fs::write(&path, html).with_context(|| format!("cannot write {}", path.display()))) {
        Ok(()) => println!("report: {} (open it in a browser)", path.display()),
        Err(err) => tracing::warn!("the run's report was not written: {err:#}"),
    }
}

fn print_summary(out: &RunDir, steps: &[StepMetrics], (wall, predicted_step_s): Timing) {
    let (Some(first), Some(last)) = (steps.first(), steps.last()) else {
        tracing::info!("nothing to train: the run is already at the requested step");
        return;
    };
    // The first step includes the workers' start-up and first-touch costs.
    let steady = if steps.len() > 1 { &steps[1..] } else { steps };
    let mean_tokens_per_s = steady.iter().map(|s| s.tokens_per_s).sum::<f64>() / steady.len() as f64;
    let mut rows = table(&["run", "summary"]);
    rows.add_row(vec![right("steps"), right(format!("{} → {}", first.step - 1, last.step))]);
    rows.add_row(vec![right("loss"), right(format!("{:.3} → {:.3}", first.loss, last.loss))]);
    rows.add_row(vec![right("tokens/s (mean after step 1)"), right(format!("{mean_tokens_per_s:.0}"))]);
    let measured = medley_bench::stats::median(steady.iter().map(|s| s.step_time_s).collect());
    rows.add_row(vec![
        right("step time (median after step 1)"),
        right(format!(
            "{}, simulated {} ({})",
            seconds(measured),
            seconds(predicted_step_s),
            percent(predicted_step_s / measured - 1.0)
        )),
    ]);
    rows.add_row(vec![right("wall time"), right(seconds(wall.as_secs_f64()))]);
    println!("{rows}");
    println!(
        "metrics: {}\ntimeline: {} (open in ui.perfetto.dev)\ncheckpoint: {}",
        out.metrics().display(),
        out.timeline().display(),
        out.checkpoints().display()
    );
}
