//! `medley bench ...`: benchmarks that print tables.
//!
//! `medley bench plan` times the whole of `medley plan`'s work (the search and both baselines) on
//! large clusters against targets, then compares the best plan with the uniform and
//! best-homogeneous baselines on a suite of mixed clusters, all under the same cost model.

use anyhow::Result;
use clap::Subcommand;
use comfy_table::{Cell, Table};
use medley_bench::planner::{
    CaseInfo, PlannerSpeedRow, QUALITY_CASES, QualityRow, SEQ_LEN, SPEED_CASES, quality_row, quality_summary, speed_row,
};
use medley_bench::stats::TIMED_RUNS;
use serde::Serialize;

use medley_report::text::{percent, right, table, times};

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
    Comm(crate::bench_comm::CommArgs),
    /// One worker's training step at each thread count, side by side with PyTorch on the same
    /// model, weights and tokens (when TORCH_PYTHON names a python that imports torch).
    Compute(crate::bench_compute::ComputeBenchArgs),
    /// A GPU's matmul rate against its datasheet, and the tiny model trained on the CPU and on the
    /// GPU from the same weights and batches: losses step by step, step times side by side.
    Device(crate::bench_compute::DeviceBenchArgs),
    /// Real training on an emulated 2:1 mix: heterogeneity-aware vs uniform plan, measured and
    /// simulated.
    Train(crate::bench_train::TrainBenchArgs),
    /// Real training under a throttled pipeline link: adaptive kFkB against 1F1B.
    Kfkb(crate::bench_train::KfkbBenchArgs),
    /// Real long-context training on an emulated 2:1 mix: uneven against even context-parallel
    /// shards, measured and simulated.
    ContextTrain(crate::bench_train::ContextTrainBenchArgs),
}

pub fn run(which: &BenchCommand) -> Result<()> {
    match which {
        BenchCommand::Plan { json } => bench_plan(*json),
        BenchCommand::Calibration { json } => crate::bench_calibration::bench_calibration(*json),
        BenchCommand::Context { json } => crate::bench_context::bench_context(*json),
        BenchCommand::Schedules { json } => crate::bench_schedules::bench_schedules(*json),
        BenchCommand::Comm(args) => crate::bench_comm::run(args),
        BenchCommand::Compute(args) => crate::bench_compute::run(args),
        BenchCommand::Device(args) => crate::bench_compute::run_device(args),
        BenchCommand::Train(args) => crate::bench_train::run(args),
        BenchCommand::Kfkb(args) => crate::bench_train::run_kfkb(args),
        BenchCommand::ContextTrain(args) => crate::bench_train::run_context(args),
    }
}

/// One row of either table, tagged with its table in JSON.
#[derive(Serialize)]
#[serde(tag = "table", rename_all = "lowercase")]
enum Row<'a> {
    Speed(&'a PlannerSpeedRow),
    Quality(&'a QualityRow),
}

fn bench_plan(json: bool) -> Result<()> {
    // The speed cases run first and one at a time, so nothing else competes for the cores.
    let speed: Vec<PlannerSpeedRow> = SPEED_CASES.iter().map(speed_row).collect::<Result<_, _>>()?;
    let quality: Vec<QualityRow> = QUALITY_CASES.iter().map(quality_row).collect::<Result<_, _>>()?;
    if json {
        let rows: Vec<Row> = speed.iter().map(Row::Speed).chain(quality.iter().map(Row::Quality)).collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("Planner speed: search and both baselines, median of {TIMED_RUNS} runs, {SEQ_LEN}-token sequences");
        println!("{}\n", speed_table(&speed));
        println!("Plan quality against the baselines (same cost model, {SEQ_LEN}-token sequences)");
        println!("{}", quality_table(&quality));
        println!("{}", quality_summary_text(&quality));
    }
    Ok(())
}

fn case_cells(case: &CaseInfo) -> Vec<Cell> {
    vec![Cell::new(case.cluster), Cell::new(case.model), right(case.n_gpus), right(case.global_batch)]
}

fn speed_table(rows: &[PlannerSpeedRow]) -> Table {
    let mut table = table(&[
        "cluster",
        "model",
        "GPUs",
        "batch",
        "median s",
        "target s",
        "target/measured",
        "time",
        "peak RSS MiB",
        "target MiB",
        "memory",
    ]);
    for row in rows {
        let memory_passes = row.memory_target_mib.map(|target| row.peak_rss_mib.map(|peak| peak <= target));
        let mut cells = case_cells(&row.case);
        cells.extend([
            right(format!("{:.3}", row.median_s)),
            right(format!("{:.1}", row.target_s)),
            right(times(row.speed_ratio)),
            Cell::new(verdict(row.speed_ratio >= 1.0)),
            right(optional(row.peak_rss_mib, "n/a", |peak| format!("{peak:.0}"))),
            right(optional(row.memory_target_mib, "-", |target| format!("{target:.0}"))),
            Cell::new(optional(memory_passes, "-", |passes| optional(passes, "n/a", verdict))),
        ]);
        table.add_row(cells);
    }
    table
}

fn quality_table(rows: &[QualityRow]) -> Table {
    let mut table = table(&[
        "cluster",
        "model",
        "GPUs",
        "batch",
        "best tokens/s",
        "uniform tokens/s",
        "best/uniform",
        "best-homogeneous tokens/s",
        "best/homogeneous",
        "best MFU",
    ]);
    for row in rows {
        let homogeneous = row.homogeneous_device.as_ref().zip(row.homogeneous_tokens_per_s);
        let mut cells = case_cells(&row.case);
        cells.extend([
            right(format!("{:.0}", row.best_tokens_per_s)),
            right(optional(row.uniform_tokens_per_s, "does not fit", |tokens_per_s| format!("{tokens_per_s:.0}"))),
            right(optional(row.uniform_ratio, "-", times)),
            right(optional(homogeneous, "does not fit", |(device, tokens_per_s)| {
                format!("{tokens_per_s:.0} ({device})")
            })),
            right(optional(row.homogeneous_ratio, "-", times)),
            right(percent(row.best_mfu)),
        ]);
        table.add_row(cells);
    }
    table
}

/// The means of best/uniform over the cases where uniform fits, and how often it does not.
fn quality_summary_text(rows: &[QualityRow]) -> String {
    let summary = quality_summary(rows);
    let fit_part = match summary.arithmetic_mean.zip(summary.geometric_mean) {
        None => "uniform fits in no case".to_string(),
        Some((arithmetic, geometric)) => format!(
            "best/uniform over the {} cases where uniform fits: arithmetic mean {}, geometric mean {}",
            summary.n_fit,
            times(arithmetic),
            times(geometric),
        ),
    };
    format!("{fit_part}\nuniform does not fit at all in {} of {} cases", summary.n_misfit, rows.len())
}

fn verdict(passes: bool) -> &'static str {
    if passes { "pass" } else { "FAIL" }
}

/// `value` shown by `show`, or `absent` when there is none.
fn optional<T, S: ToString>(value: Option<T>, absent: &str, show: impl FnOnce(T) -> S) -> String {
    value.map_or_else(|| absent.to_string(), |value| show(value).to_string())
}
