//! The `medley` command line: glue between the spec, cost and plan libraries and a person.

// Restoring the default action of SIGPIPE is one libc call.
#![allow(unsafe_code)]

mod bench;
mod calibrate_cmd;
mod export_cmd;
mod inputs;
mod job;
mod log;
mod plan_cmd;
mod progress;
mod report_cmd;
mod report_page;
mod simulate_cmd;
mod stop;
mod train_cmd;
mod worker_cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Train large language models on mixed GPU fleets.
#[derive(Parser)]
#[command(name = "medley", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Say more: debug events with -v, everything with -vv (or set MEDLEY_LOG, e.g. medley_comm=debug).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Say only warnings and errors: no notes, no progress.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Find the fastest parallel plan for a model on a (mixed) cluster.
    Plan(Box<plan_cmd::PlanArgs>),
    /// Simulate training steps of a plan (or a what-if Megatron layout) event by event.
    Simulate(Box<simulate_cmd::SimulateArgs>),
    /// Train a model for real on an emulated fleet: plan it, start one worker process per
    /// pipeline rank (per device of a long-context stage), show progress.
    Train(Box<train_cmd::TrainArgs>),
    /// Measure this machine and write the profile that prices an emulated fleet at its speed.
    Calibrate(calibrate_cmd::CalibrateArgs),
    /// Run one rank of a training job under an external launcher (torchrun's RANK and
    /// WORLD_SIZE, or srun's or mpirun's rank variables; MASTER_ADDR, MASTER_PORT, MEDLEY_TOKEN).
    Worker(Box<job::WorkerArgs>),
    /// A plan as a framework runs it: `medley export megatron --plan plan.json`.
    Export {
        #[command(subcommand)]
        which: export_cmd::ExportCommand,
    },
    /// One self-contained HTML page of a plan (and of a training run with --run): the plan as a
    /// picture, a simulated step's timeline, memory, candidates and baselines, loss and step times.
    Report(report_cmd::ReportArgs),
    /// Benchmarks that print tables.
    Bench {
        #[command(subcommand)]
        which: bench::BenchCommand,
    },
    /// One rank of `medley bench comm` (started by it).
    #[command(hide = true)]
    BenchCommWorker(medley_bench::comm_harness::WorkerArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) if err.use_stderr() => return refuse_arguments(&err),
        Err(help_or_version) => help_or_version.exit(),
    };
    log::init(log::level(cli.verbose, cli.quiet));
    let result = match cli.command {
        Command::Plan(args) => {
            exit_quietly_on_closed_pipe();
            plan_cmd::run(&args)
        }
        Command::Simulate(args) => {
            exit_quietly_on_closed_pipe();
            simulate_cmd::run(&args)
        }
        Command::Train(args) => train_cmd::run(&args),
        Command::Calibrate(args) => calibrate_cmd::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Worker(args) => worker_cmd::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Export { which } => export_cmd::run(&which),
        Command::Report(args) => report_cmd::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Bench { which } => bench::run(&which).map(|()| ExitCode::SUCCESS),
        Command::BenchCommWorker(args) => medley_bench::comm_harness::worker(&args).map(|()| ExitCode::SUCCESS),
    };
    result.unwrap_or_else(|err| {
        say_error(&format!("{err:#}"));
        ExitCode::from(2)
    })
}

/// Every error medley ends on, in one format: `error: ` and the message, on standard error, once.
/// A command whose result is a failure (a plan that does not fit, workers that stopped) ends with
/// exit code 1, bad input with 2.
pub(crate) fn say_error(message: &str) {
    eprintln!("error: {message}");
}

/// Prints clap's error for bad arguments with the arguments it quotes escaped and cut (a
/// terminal escape or a megabyte given as a value is not echoed raw), and exits as clap would.
fn refuse_arguments(err: &clap::Error) -> ExitCode {
    let text = err.render().to_string();
    for line in text.lines() {
        eprintln!("{}", medley_spec::echo(line));
    }
    ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(2))
}

/// `medley plan | head` should end quietly, as Unix tools do, not panic in `println!`: restore
/// the default SIGPIPE action that Rust's runtime replaces with "ignore". Only for commands that
/// just print; ranks talking to peers keep getting write errors they can report.
fn exit_quietly_on_closed_pipe() {
    // SAFETY: `signal` with a valid signal number and `SIG_DFL` has no preconditions, and no other
    // thread exists yet to race with the change.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Writes a command's result to standard output: a full disk or a closed pipe is an error that
/// says so, never a panic (as `println!` would).
pub(crate) fn emit(text: &str) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes()).and_then(|()| out.flush()).context("cannot write the result to standard output")
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::inputs::{JobFlags, JobShape};
    use medley_spec::Precision;

    fn job_flags(command: &[&str]) -> JobFlags {
        let cli = Cli::try_parse_from(std::iter::once("medley").chain(command.iter().copied())).unwrap();
        match cli.command {
            Command::Plan(args) => args.specs.shape,
            Command::Train(args) => args.shape,
            Command::Calibrate(args) => args.shape,
            Command::Bench { which: bench::BenchCommand::Train(args) } => args.shape,
            _ => panic!("{command:?} takes no job flags"),
        }
    }

    fn shape(model: &str, seq_len: u32, global_batch: u32, micro_batch: u32) -> JobShape {
        let (precision, memory_headroom) = (Precision::Bf16Mixed, medley_spec::DEFAULT_MEMORY_HEADROOM);
        JobShape { model: model.into(), seq_len, global_batch, micro_batch, precision, memory_headroom }
    }

    #[test]
    fn one_set_of_job_flags_takes_each_commands_defaults() {
        assert_eq!(job_flags(&["train"]).shape().unwrap(), shape("tiny", 128, 16, 2));
        assert_eq!(job_flags(&["calibrate"]).shape().unwrap(), shape("tiny", 128, 16, 2));
        assert_eq!(job_flags(&["bench", "train"]).shape().unwrap(), shape("tiny", 128, 12, 1));
        let given = ["train", "--model", "llama3-8b", "--seq-len", "64", "--global-batch", "8", "--micro-batch", "4"];
        assert_eq!(job_flags(&given).shape().unwrap(), shape("llama3-8b", 64, 8, 4));
        for (text, share) in [("10%", 0.1), ("0.02", 0.02)] {
            assert_eq!(job_flags(&["train", "--memory-headroom", text]).shape().unwrap().memory_headroom, share);
        }
        let Err(err) = Cli::try_parse_from(["medley", "train", "--memory-headroom", "lots"]) else { panic!("parsed") };
        assert!(err.to_string().contains("not a share"), "{err}");
        // The planning commands leave the shape to a job file, the job defaults or the planner.
        let plan = job_flags(&["plan"]);
        assert_eq!((plan.seq_len, plan.global_batch, plan.micro_batch), (None, None, None));
        assert!(plan.shape().unwrap_err().to_string().contains("--seq-len"));
    }
}
