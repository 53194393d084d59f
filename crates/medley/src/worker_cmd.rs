//! `medley worker`: one rank of a training job, under `medley train` or any launcher: torchrun's
//! variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LOCAL_RANK and LOCAL_WORLD_SIZE
//! optional), or Slurm's and MPI launchers' rank variables with MASTER_ADDR and MASTER_PORT set
//! by the job script; plus MEDLEY_TOKEN, the job's shared secret.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use medley_comm::{Config, LaunchEnv};
use medley_cost::Calibration;
use medley_model::AdamW;
use medley_runtime::run_dir::same_dir;
use medley_runtime::{
    LinkEmulation, RunDir, RuntimeError, StopRequest, TrainEnd, TrainOptions, Worker, WorkerOptions, sweep_incomplete,
};
use medley_sim::{BandwidthTrace, Timeline};
use medley_spec::Schedule;

use crate::inputs::load_plan;
use crate::job::WorkerArgs;
use crate::stop::StopSignals;

/// Where launchers other than torchrun put a process's place in the job; torchrun's own
/// variables win when both are set.
const LAUNCHER_VARIABLES: [(&str, [&str; 3]); 4] = [
    ("RANK", ["SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"]),
    ("WORLD_SIZE", ["SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]),
    ("LOCAL_RANK", ["SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"]),
    ("LOCAL_WORLD_SIZE", ["SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]),
];

/// The launch variables with Slurm's (srun) and MPI launchers' (mpirun: OpenMPI, MPICH/PMI)
/// names mapped onto torchrun's.
fn launch_vars(vars: impl IntoIterator<Item = (String, String)>) -> BTreeMap<String, String> {
    let mut vars: BTreeMap<String, String> = vars.into_iter().collect();
    for (torchrun, others) in LAUNCHER_VARIABLES {
        if !vars.contains_key(torchrun)
            && let Some(value) = others.iter().find_map(|name| vars.get(*name).cloned())
        {
            vars.insert(torchrun.to_string(), value);
        }
    }
    vars
}

pub fn run(args: &WorkerArgs) -> Result<()> {
    let signals = StopSignals::register()?;
    let env = LaunchEnv::from_vars(launch_vars(std::env::vars()))?;
    let plan = load_plan(&args.plan)?;
    let schedule = args.run.schedule.unwrap_or(plan.schedule());
    let options = WorkerOptions {
        seed: args.run.seed,
        adamw: AdamW { lr: args.run.lr, ..AdamW::default() },
        emulate_speed: !args.run.no_emulate,
        device: args.run.device,
        dilation: args.run.time_dilation,
        // The join is bounded by the job's timeout too: a rank stopped at start-up is named
        // as soon as a silent peer would be.
        comm: Config {
            timeout: Duration::from_secs(args.run.timeout_s),
            connect_timeout: Duration::from_secs(args.run.timeout_s),
            ..Config::default()
        },
        calibration: match &args.calibration {
            Some(path) => Calibration::from_toml(&crate::inputs::read(path)?, path)?,
            None => Calibration::default(),
        },
        link: args
            .run
            .link_gb_s
            .map(|gb_s| -> Result<LinkEmulation> {
                let trace = match &args.run.link_trace {
                    Some(text) => crate::inputs::network_trace(text)?,
                    None => BandwidthTrace::Constant { fraction: 1.0 },
                };
                Ok(LinkEmulation { full_bytes_per_s: gb_s * 1e9, trace })
            })
            .transpose()?,
    };
    let rank = env.rank;
    // Under another launcher rank 0 locks the run directory for the job, and every rank refuses
    // on its own to start a new run over another (before joining: nobody writes there before).
    let _run_dir = match (args.run_dir_locked, rank) {
        (true, _) => None,
        (false, 0) => {
            let run_dir = RunDir::at(&args.out).claim(args.resume.as_deref(), args.force)?;
            run_dir.start_over_if_forced()?;
            Some(run_dir)
        }
        (false, _) if args.force => None,
        (false, _) => RunDir::at(&args.out).refuse_a_run_over_another(args.resume.as_deref(), false).map(|_| None)?,
    };
    let mut worker = Worker::join(plan, env, options).map_err(|err| blame(err, rank))?;
    let result = train_joined(&mut worker, args, schedule, &signals);
    let Err(err) = result else { return Ok(()) };
    let err = match err.downcast::<RuntimeError>() {
        Ok(err) => err,
        Err(err) => {
            // This worker's own failure (a file it cannot write, say): the others stop now.
            worker.abort(&format!("{err:#}"));
            return Err(err.context(format!("worker {rank}")));
        }
    };
    if err.blamed_rank().is_none_or(|blamed| blamed == rank) {
        worker.abort(&err.to_string());
    }
    Err(blame(err, rank))
}

/// Resumes if asked, trains, and writes the timeline and (rank 0) the metrics.
fn train_joined(worker: &mut Worker, args: &WorkerArgs, schedule: Schedule, signals: &StopSignals) -> Result<()> {
    let rank = worker.layout().job_rank;
    let run_dir = RunDir::at(&args.out);
    let resumed_at = match &args.resume {
        Some(dir) => {
            let step = worker.resume(&RunDir::at(dir).checkpoints())?.step;
            // Only the run's own directory is swept, once every file this rank read has passed.
            if rank == 0 && same_dir(dir, &args.out) {
                sweep_incomplete(&run_dir.checkpoints(), step)?;
            }
            Some(step)
        }
        None => None,
    };
    let train = TrainOptions {
        until_step: args.run.steps,
        schedule,
        checkpoint_dir: Some(run_dir.checkpoints()),
        checkpoint_every: args.run.checkpoint_every,
        keep_checkpoints: args.run.keep_checkpoints as usize,
        stop: Some(StopRequest {
            requested: Arc::clone(&signals.requested),
            checkpoint: args.run.checkpoint_on_signal,
        }),
    };
    let timeline_dir = run_dir.timelines();
    fs::create_dir_all(&timeline_dir).with_context(|| format!("cannot create {}", timeline_dir.display()))?;
    let timeline_path = run_dir.rank_timeline(rank, resumed_at);
    let mut timeline_file = BufWriter::new(
        File::create(&timeline_path).with_context(|| format!("cannot create {}", timeline_path.display()))?,
    );
    let mut timeline = Timeline::new(&mut timeline_file);
    let layout = worker.layout();
    let label = format!("{} · {} (worker {rank}, emulated)", layout.id, layout.device.name);
    timeline.process(worker.timeline_pid(), &label, rank as u32);
    let mut metrics = (rank == 0).then(|| run_dir.open_metrics(resumed_at)).transpose()?;
    let printer = (rank == 0 && args.print_metrics).then(MetricsPrinter::start);
    let end = worker.train(&train, Some(&mut timeline), |step| {
        if let Some(file) = metrics.as_mut() {
            let line = serde_json::to_string(step).expect("metrics serialise");
            writeln!(file, "{line}").map_err(|error| RuntimeError::Io { path: run_dir.metrics(), error })?;
            if let Some(printer) = &printer {
                printer.print(line);
            }
        }
        Ok(())
    })?;
    if let Some(printer) = printer {
        printer.finish();
    }
    timeline.finish().with_context(|| format!("cannot write {}", timeline_path.display()))?;
    // Under `medley train` the launcher says it, for the whole job.
    if let TrainEnd::Stopped { step, checkpointed } = end
        && rank == 0
        && !args.run_dir_locked
    {
        let signal = signals.received().map_or_else(|| "a signal".to_string(), crate::stop::name);
        let kept = if checkpointed { "a checkpoint of it is written" } else { "its last checkpoint is kept" };
        tracing::warn!(
            "stopped at step {step} of {} on {signal}; {kept}: continue with --resume {}",
            args.run.steps,
            args.out.display()
        );
    }
    Ok(())
}

/// Prints metric lines on standard output from a thread of its own, so that a reader that stops
/// reading (a paused launcher, its pipe full) holds up only that thread, never training: lines
/// wait in memory (a hundred bytes a step) until it reads again.
struct MetricsPrinter {
    lines: std::sync::mpsc::Sender<String>,
    thread: std::thread::JoinHandle<()>,
}

impl MetricsPrinter {
    fn start() -> MetricsPrinter {
        let (lines, received) = std::sync::mpsc::channel::<String>();
        let thread = std::thread::spawn(move || {
            let mut stdout = std::io::stdout();
            for line in received {
                // A reader that has gone away (a closed pipe) only loses the progress lines; the
                // metrics file has them all.
                if writeln!(stdout, "{line}").and_then(|()| stdout.flush()).is_err() {
                    break;
                }
            }
        });
        MetricsPrinter { lines, thread }
    }

    fn print(&self, line: String) {
        self.lines.send(line).ok();
    }

    /// Waits until every line is printed.
    fn finish(self) {
        drop(self.lines);
        self.thread.join().ok();
    }
}

/// Says which worker stopped, and which other one it blames.
fn blame(err: RuntimeError, rank: usize) -> anyhow::Error {
    match err.blamed_rank() {
        Some(peer) => anyhow::anyhow!("worker {rank}: {err} (worker {peer} failed or stopped answering)"),
        None => anyhow::anyhow!("worker {rank}: {err}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn slurm_and_mpi_launchers_map_onto_torchrun_variables() {
        let slurm = launch_vars(vars(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "1")]));
        assert_eq!((&slurm["RANK"][..], &slurm["WORLD_SIZE"][..], &slurm["LOCAL_RANK"][..]), ("3", "8", "1"));
        let mpi = launch_vars(vars(&[("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "4")]));
        assert_eq!((&mpi["RANK"][..], &mpi["WORLD_SIZE"][..]), ("2", "4"));
        let both = launch_vars(vars(&[("RANK", "0"), ("SLURM_PROCID", "5")]));
        assert_eq!(both["RANK"], "0", "torchrun's variable wins");
    }
}
