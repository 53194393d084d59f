//! `medley bench ...`: benchmarks that print tables. The suites are `medley-bench`'s; those that
//! start this binary's workers (`comm`, `train`, `kfkb`, `context-train`) are wired here.

mod memory;
mod train;

use anyhow::{Context, Result};
use clap::Subcommand;
use medley_bench::{BenchError, tables};

use crate::inputs::load_model;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Planner speed on large clusters, and plan quality against the uniform baseline.
    Plan {
        /// Print the rows of both tables as one JSON array instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// The simulator against published measured runs, and the efficiencies that fit them.
    Calibration {
        /// Print the rows as JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Long context on mixed fleets: the asymmetric CP/HP plan against even ring, Ulysses and USP
    /// layouts and each device type alone, simulated; the planner's time on 1024 GPUs.
    Context {
        /// Print the rows as JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Simulator speed on a 1024-GPU step, and known orderings of pipeline schedules in simulation.
    Schedules {
        /// Print the rows as JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Communicator bandwidth and latency, nccl-tests style, over real worker processes.
    Comm(medley_bench::comm_harness::CommArgs),
    /// One worker's training step at each thread count, side by side with PyTorch on the same
    /// model, weights and tokens (when TORCH_PYTHON names a python that imports torch).
    Compute(medley_bench::compute::ComputeBenchArgs),
    /// A GPU's matmul rate against its datasheet, and the tiny model trained on the CPU and on the
    /// GPU from the same weights and batches: losses step by step, step times side by side.
    Device(medley_bench::compute::DeviceBenchArgs),
    /// Real training on an emulated 2:1 mix: heterogeneity-aware vs uniform plan, measured and
    /// simulated.
    Train(train::TrainBenchArgs),
    /// Real training under a throttled pipeline link: adaptive kFkB against 1F1B.
    Kfkb(train::KfkbBenchArgs),
    /// Real long-context training on an emulated 2:1 mix: uneven against even context-parallel
    /// shards, measured and simulated.
    ContextTrain(train::ContextTrainBenchArgs),
    /// Each worker's measured peak memory against the runtime's estimate and the cost model's
    /// prediction: whole optimizer states, ZeRO-1 and tensor parallelism.
    Memory(memory::MemoryBenchArgs),
}

pub fn run(which: &BenchCommand) -> Result<()> {
    match which {
        BenchCommand::Plan { json } => print_report(tables::planner::report(*json)),
        BenchCommand::Calibration { json } => print_report(tables::cited::report(*json)),
        BenchCommand::Context { json } => print_report(tables::long_context::report(*json)),
        BenchCommand::Schedules { json } => print_report(tables::schedules::report(*json)),
        BenchCommand::Comm(args) => {
            let exe = std::env::current_exe().context("finding the medley binary to start workers")?;
            medley_bench::comm_harness::run(args, &exe)
        }
        BenchCommand::Compute(args) => medley_bench::compute::run(args, &load_model(&args.shape.model)?),
        BenchCommand::Device(args) => medley_bench::compute::run_device(args, &load_model(&args.shape.model)?),
        BenchCommand::Train(args) => train::run(args),
        BenchCommand::Kfkb(args) => train::run_kfkb(args),
        BenchCommand::ContextTrain(args) => train::run_context(args),
        BenchCommand::Memory(args) => memory::run(args),
    }
}

fn print_report(report: Result<String, BenchError>) -> Result<()> {
    crate::emit(&report?)
}
