//! A job of `medley worker` processes on this host, as `medley train` and `medley bench train`
//! run one: the workers' flags, the plan as the runtime trains it, calibrating this machine, and
//! starting the workers and watching them.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use medley_cost::Calibration;
use medley_launch::{Echo, JobEnd, LocalJob, RankCommand};
use medley_model::AdamW;
use medley_plan::{Plan, SearchOptions, search};
use medley_runtime::{
    DeviceChoice, RankLayout, StepMetrics, calibration_memory, emulation_calibration, measure_model_pass,
};
use medley_sim::rank::{RANKED_CANDIDATES, rank_by_simulation};
use medley_spec::{Cluster, GradReduce, JobParts, JobSpec, ModelSpec, Precision, Schedule};

use crate::inputs::JobShape;
use crate::progress::Progress;
use crate::stop::StopSignals;
use medley_runtime::check_memory;

#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    /// The plan to train (as `medley plan -o` writes it); every rank must get the same one.
    #[arg(long)]
    pub plan: String,
    /// The emulation profile (from `medley calibrate`) that prices the devices against each
    /// other for their slowdowns [default: the cost model's defaults].
    #[arg(long)]
    pub calibration: Option<String>,
    /// The run directory: checkpoints, metrics.jsonl (rank 0), timeline/rank-R.json.
    #[arg(long)]
    pub out: PathBuf,
    /// Continue from the newest checkpoint of this run directory (under this plan or another).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    #[command(flatten)]
    pub run: RunFlags,
    /// Print each step's metrics as a JSON line on standard output (rank 0).
    #[arg(long)]
    pub print_metrics: bool,
    /// Start over in a run directory that holds a run: rank 0 deletes its checkpoints, metrics
    /// and timelines first.
    #[arg(long, conflicts_with = "resume")]
    pub force: bool,
    /// The launcher (`medley train`) holds the run directory's lock and checked it.
    #[arg(long, hide = true)]
    pub run_dir_locked: bool,
}

/// How every worker of a job trains: `medley train` passes them on as they are.
#[derive(Args, Debug, Clone)]
pub struct RunFlags {
    /// Train until this many steps are done.
    #[arg(long, default_value_t = 100)]
    pub steps: u64,
    /// Steps between checkpoints (0: only after the last step).
    #[arg(long, default_value_t = 10)]
    pub checkpoint_every: u64,
    /// How many of the newest checkpoints to keep (at least 1); older ones are deleted once a
    /// newer one is complete.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub keep_checkpoints: u64,
    /// Pipeline schedule [default: the plan's].
    #[arg(long)]
    pub schedule: Option<Schedule>,
    /// Seeds the initial weights and the data order.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// AdamW learning rate, above 0 and at most 1.
    #[arg(long, default_value_t = AdamW::default().lr, value_parser = crate::inputs::parse_learning_rate)]
    pub lr: f32,
    /// Compute at this machine's speed instead of stretching passes to the emulated device's.
    #[arg(long)]
    pub no_emulate: bool,
    /// What the workers compute on: cpu (emulation's default), cuda, rocm (a binary built with
    /// `--features cuda` / `rocm`), or auto (a GPU when this build and machine have one). A
    /// worker takes its host's GPU number LOCAL_RANK modulo the host's count.
    #[arg(long, default_value_t = DeviceChoice::Cpu)]
    pub device: DeviceChoice,
    /// Slow every emulated device by this common factor (at least 1); `medley train` sets it so
    /// that the workers' CPU demand fits this machine's cores.
    #[arg(long, default_value_t = 1.0, value_parser = crate::inputs::parse_dilation)]
    pub time_dilation: f64,
    /// Seconds to wait for a silent peer before naming it and stopping.
    #[arg(long, default_value_t = 30)]
    pub timeout_s: u64,
    /// On SIGINT, SIGTERM, SIGUSR1 or SIGUSR2 (a preemption's warning), write a checkpoint of
    /// the step the run stops at; without it the run stops there and keeps its last checkpoint.
    #[arg(long)]
    pub checkpoint_on_signal: bool,
    /// Throttle the pipeline links to this many GB/s (emulating a slow network between stages).
    #[arg(long, value_parser = crate::inputs::parse_gb_s)]
    pub link_gb_s: Option<f64>,
    /// How the throttled links' bandwidth varies (as `medley simulate --network-trace`):
    /// constant:F, on-off:full=T,reduced=T,fraction=F, random:seed=N,full=T,reduced=T,fraction=F,
    /// or a time_s,fraction CSV [default: constant:1].
    #[arg(long, requires = "link_gb_s")]
    pub link_trace: Option<String>,
}

impl RunFlags {
    /// The flags as `medley worker` takes them.
    pub fn to_args(&self) -> Vec<String> {
        let mut flags = vec![
            format!("--steps={}", self.steps),
            format!("--checkpoint-every={}", self.checkpoint_every),
            format!("--keep-checkpoints={}", self.keep_checkpoints),
            format!("--seed={}", self.seed),
            format!("--lr={}", self.lr),
            format!("--timeout-s={}", self.timeout_s),
        ];
        flags.extend(self.schedule.map(|schedule| format!("--schedule={schedule}")));
        flags.extend(self.no_emulate.then(|| "--no-emulate".to_string()));
        flags.extend(self.checkpoint_on_signal.then(|| "--checkpoint-on-signal".to_string()));
        flags.push(format!("--device={}", self.device));
        flags.push(format!("--time-dilation={}", self.time_dilation));
        flags.extend(self.link_gb_s.map(|gb_s| format!("--link-gb-s={gb_s}")));
        flags.extend(self.link_trace.as_ref().map(|trace| format!("--link-trace={trace}")));
        flags
    }
}

/// What a run that would not fit this machine's memory is told to change.
pub const SMALLER_RUN: &str = "train a smaller model, shorter sequences (--seq-len) or smaller micro-batches (--micro-batch), on fewer workers (--cluster), or on a machine with more memory";

/// The cores this process may run on.
pub fn cores_here() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Sequences at least this long also get long-context plans in `medley train`, one sequence per
/// micro-batch: on an emulated fleet the model is small, so attention dominates a pass from a few
/// thousand tokens on.
pub const RUNTIME_CONTEXT_TOKENS: u32 = 2048;

/// What the search may choose for the runtime: everything it plans, with long context from fewer
/// tokens.
pub fn runtime_search_options() -> SearchOptions {
    SearchOptions { context_from_tokens: RUNTIME_CONTEXT_TOKENS, ..SearchOptions::default() }
}

/// The plan `medley train` trains, chosen as `medley plan` chooses: the cost model's best few,
/// re-ranked by one simulated step each.
pub fn choose_plan_to_train(
    cluster: &Cluster,
    model: &ModelSpec,
    job: &JobSpec,
    calibration: &Calibration,
) -> Result<Plan> {
    let options = SearchOptions { top: RANKED_CANDIDATES, ..runtime_search_options() };
    let outcome = search(cluster, model, job, calibration, &options)?;
    let ranked = rank_by_simulation(outcome.candidates, calibration).context("simulating the candidates")?;
    Ok(ranked.candidates.into_iter().next().expect("search returns at least one plan").plan)
}

/// The plan as the runtime trains it ([`medley_runtime::as_trained`]), each change said.
pub fn as_trained(plan: Plan) -> Result<Plan> {
    let (plan, changes) = medley_runtime::as_trained(plan)?;
    for change in changes {
        tracing::info!("{change}");
    }
    Ok(plan)
}

/// A job as the runtime trains it: whole optimizer states on every replica (no ZeRO-1 sharding).
pub fn runtime_job(shape: &JobShape, schedule: Option<Schedule>) -> Result<JobSpec> {
    let parts = JobParts {
        seq_len: shape.seq_len,
        global_batch: shape.global_batch,
        micro_batch: Some(shape.micro_batch),
        precision: shape.precision,
        memory_headroom: shape.memory_headroom,
        schedule: schedule.unwrap_or_default(),
        // Its communicator sums fp32 gradients, whatever the job's precision.
        grad_reduce: Some(GradReduce::Fp32),
        ..JobParts::default()
    };
    Ok(JobSpec::new(parts, "command line")?)
}

/// How the workers ended, and the steps rank 0 reported.
pub struct Outcome {
    pub end: JobEnd,
    pub steps: Vec<StepMetrics>,
    /// The signal that asked the job to stop early, if one did.
    pub stopped_by: Option<i32>,
}

/// Starts one worker per layout and watches them, reporting each step to `progress`.
pub fn launch_and_watch(args: &WorkerArgs, layouts: &[RankLayout], progress: Progress) -> Result<Outcome> {
    let exe = std::env::current_exe().context("cannot find the medley executable to start workers")?;
    let mut worker = vec![OsString::from("worker")];
    worker.extend(worker_flags(args).into_iter().map(OsString::from));
    let ranks: Vec<RankCommand> = layouts
        .iter()
        .map(|layout| RankCommand { args: worker.clone(), domain: layout.device.vendor.to_string() })
        .collect();
    let echo: Echo = {
        let progress = progress.clone();
        Arc::new(move |line: &str| progress.println(line))
    };
    // From here a signal asks the workers to stop at the end of a step instead of killing them.
    let signals = StopSignals::register()?;
    let mut job = LocalJob::start(&exe, &ranks, Some(echo))?;
    job.forward_stop(Arc::clone(&signals.requested));
    let stdout = job.take_rank0_stdout().expect("rank 0's output is piped");
    // Rank 0's metrics are read on a thread of their own while the job is watched, so a worker
    // that stops answering (even rank 0, stopped with its pipe open) is killed once the others
    // have failed on it, rather than waited for while its output stays open.
    let reader = {
        let progress = progress.clone();
        std::thread::spawn(move || {
            let mut steps = Vec::new();
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let Ok(step) = serde_json::from_str::<StepMetrics>(&line) else { continue };
                progress.step(step.step, step.loss, step.tokens_per_s);
                steps.push(step);
            }
            steps
        })
    };
    let end = job.wait(Duration::from_secs(args.run.timeout_s + 15), None);
    // Every worker has exited or been killed: the pipe is closed and the reader done.
    let steps = reader.join().unwrap_or_default();
    progress.finish();
    Ok(Outcome { end, steps, stopped_by: signals.received() })
}

fn worker_flags(args: &WorkerArgs) -> Vec<String> {
    let mut flags =
        vec![format!("--plan={}", args.plan), format!("--out={}", args.out.display()), "--print-metrics".into()];
    flags.extend(args.run_dir_locked.then(|| "--run-dir-locked".to_string()));
    flags.extend(args.calibration.as_ref().map(|path| format!("--calibration={path}")));
    flags.extend(args.resume.as_ref().map(|dir| format!("--resume={}", dir.display())));
    flags.extend(args.run.to_args());
    flags
}

/// Measures this machine and prices the fleet at its speed (see `medley calibrate`).
pub fn calibrate_here(
    cluster: &Cluster,
    model: &ModelSpec,
    seq_len: u32,
    micro_batch: u32,
    precision: Precision,
    device: DeviceChoice,
) -> Result<Calibration> {
    cluster.check_precision(precision)?;
    // As many passes at once as the workers will run on this machine's cores.
    let cores = cores_here();
    let concurrency = (cluster.n_gpus() as usize).min(cores);
    let need = calibration_memory(model, seq_len, micro_batch, concurrency)?;
    let what = format!("calibrating {} ({concurrency} whole models at once)", model.name());
    check_memory(&what, &[need], SMALLER_RUN)?;
    let measured = measure_model_pass(model, seq_len, micro_batch, 6, concurrency, device.resolve(0)?)?;
    tracing::info!(
        "calibrated: one micro-batch ({micro_batch}×{seq_len} tokens) through {} takes {:.1} ms forward and backward here with {concurrency} at once, an optimizer step {:.1} ms; the fleet's fastest device is emulated at that speed",
        model.name(),
        measured.pass_s * 1e3,
        measured.optimizer_s * 1e3
    );
    Ok(emulation_calibration(cluster, model, seq_len, precision, measured))
}
