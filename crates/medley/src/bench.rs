//! `medley bench ...`: benchmarks that print tables.
//!
//! `medley bench plan` times the whole of `medley plan`'s work (the search and both baselines) on
//! large clusters against targets, then compares the best plan with the uniform and
//! best-homogeneous baselines on a suite of mixed clusters, all under the same cost model.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Subcommand;
use comfy_table::{Cell, Table};
use medley_cost::Calibration;
use medley_plan::{Candidate, SearchOptions, search};
use medley_spec::{Bridge, Cluster, Fabric, JobParts, JobSpec, catalog_model};
use serde::Serialize;

use medley_bench::stats::{arithmetic_mean, geometric_mean, median, peak_rss_mib};

use crate::inputs::Specs;
use crate::plan_cmd::Baselines;
use crate::render::{percent, right, table, times};

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
    /// Simulator speed on a 1024-GPU step, and known orderings of pipeline schedules in simulation.
    Schedules {
        /// Print the rows as JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Communicator bandwidth and latency, nccl-tests style, over real worker processes.
    Comm(crate::bench_comm::CommArgs),
    /// Real training on an emulated 2:1 mix: heterogeneity-aware vs uniform plan, measured and
    /// simulated.
    Train(crate::bench_train::TrainBenchArgs),
    /// Real training under a throttled pipeline link: adaptive kFkB against 1F1B.
    Kfkb(crate::bench_train::KfkbBenchArgs),
}

pub fn run(which: &BenchCommand) -> Result<()> {
    match which {
        BenchCommand::Plan { json } => bench_plan(*json),
        BenchCommand::Calibration { json } => crate::bench_calibration::bench_calibration(*json),
        BenchCommand::Schedules { json } => crate::bench_schedules::bench_schedules(*json),
        BenchCommand::Comm(args) => crate::bench_comm::run(args),
        BenchCommand::Train(args) => crate::bench_train::run(args),
        BenchCommand::Kfkb(args) => crate::bench_train::run_kfkb(args),
    }
}

/// Tokens per sequence in every case.
const SEQ_LEN: u32 = 4096;
/// Timed runs of each speed case; the median is reported.
const SPEED_RUNS: usize = 3;

/// A planning problem: an inline cluster (default fabric and bridge) and a catalog model.
struct Case {
    cluster: &'static str,
    model: &'static str,
    global_batch: u32,
}

struct SpeedCase {
    case: Case,
    target_s: f64,
    memory_target_mib: Option<f64>,
}

const SPEED_CASES: [SpeedCase; 2] = [
    SpeedCase {
        case: Case { cluster: "512xh100,256xa100,256xmi300x", model: "llama3-70b", global_batch: 1024 },
        target_s: 1.0,
        memory_target_mib: None,
    },
    SpeedCase {
        case: Case { cluster: "4096xh100,2048xa100,2048xmi300x", model: "llama3-405b", global_batch: 4096 },
        target_s: 10.0,
        memory_target_mib: Some(500.0),
    },
];

/// Mixed clusters of 2–4 device types and 32–1024 GPUs, models from 7B to 405B parameters. The
/// last two put a 405B and a 175B model on clusters whose 24 GiB cards cannot hold an even share.
const QUALITY_CASES: [Case; 12] = [
    Case { cluster: "16xh100,16xa100", model: "llama3-8b", global_batch: 1024 },
    Case { cluster: "32xh100,32xmi300x", model: "qwen2-7b", global_batch: 1024 },
    Case { cluster: "64xa100,32xh100,32xmi300x", model: "llama3-70b", global_batch: 1024 },
    Case { cluster: "128xh100,64xl40s", model: "mixtral-8x7b", global_batch: 1024 },
    Case { cluster: "256xa100,128xh100,128xmi250x", model: "gpt3-175b", global_batch: 1024 },
    Case { cluster: "512xh100,256xa100,256xmi300x", model: "llama3-70b", global_batch: 1024 },
    Case { cluster: "512xh200,256xmi325x,128xv100", model: "llama3-405b", global_batch: 1024 },
    Case { cluster: "64xh100,64xa100-40gb,32xrtx-4090,32xmi300x", model: "llama3-8b", global_batch: 1024 },
    Case { cluster: "512xh100,512xmi300x", model: "llama3-405b", global_batch: 1024 },
    Case { cluster: "64xh100,64xrtx-4090", model: "llama3-70b", global_batch: 1024 },
    Case { cluster: "64xh200,64xmi325x,64xrtx-4090", model: "llama3-405b", global_batch: 1024 },
    Case { cluster: "64xh100,32xrtx-4090", model: "gpt3-175b", global_batch: 1024 },
];

impl Case {
    fn specs(&self) -> Result<Specs> {
        let parts = JobParts { seq_len: SEQ_LEN, global_batch: self.global_batch, ..JobParts::default() };
        Ok(Specs {
            cluster: Cluster::from_inline(self.cluster, Fabric::default(), Bridge::default())?,
            model: catalog_model(self.model)?,
            job: JobSpec::new(parts, "medley bench plan")?,
            calibration: Calibration::default(),
        })
    }

    fn info(&self, specs: &Specs) -> CaseInfo {
        CaseInfo {
            cluster: self.cluster,
            model: self.model,
            n_gpus: specs.cluster.n_gpus(),
            seq_len: SEQ_LEN,
            global_batch: self.global_batch,
        }
    }
}

/// The columns every row starts with.
#[derive(Serialize)]
struct CaseInfo {
    cluster: &'static str,
    model: &'static str,
    n_gpus: u32,
    seq_len: u32,
    global_batch: u32,
}

#[derive(Serialize)]
struct SpeedRow {
    #[serde(flatten)]
    case: CaseInfo,
    runs: usize,
    median_s: f64,
    target_s: f64,
    /// target_s / median_s: at least 1 passes.
    speed_ratio: f64,
    /// The process's peak resident memory after the case ran; `None` off Linux.
    peak_rss_mib: Option<f64>,
    memory_target_mib: Option<f64>,
}

#[derive(Serialize)]
struct QualityRow {
    #[serde(flatten)]
    case: CaseInfo,
    best_tokens_per_s: f64,
    best_mfu: f64,
    /// `None` when no uniform layout fits.
    uniform_tokens_per_s: Option<f64>,
    /// best_tokens_per_s / uniform_tokens_per_s.
    uniform_ratio: Option<f64>,
    homogeneous_device: Option<String>,
    homogeneous_tokens_per_s: Option<f64>,
    homogeneous_ratio: Option<f64>,
}

/// One row of either table, tagged with its table in JSON.
#[derive(Serialize)]
#[serde(tag = "table", rename_all = "lowercase")]
enum Row<'a> {
    Speed(&'a SpeedRow),
    Quality(&'a QualityRow),
}

fn bench_plan(json: bool) -> Result<()> {
    // The speed cases run first and one at a time, so nothing else competes for the cores.
    let speed: Vec<SpeedRow> = SPEED_CASES.iter().map(speed_row).collect::<Result<_>>()?;
    let quality: Vec<QualityRow> = QUALITY_CASES.iter().map(quality_row).collect::<Result<_>>()?;
    if json {
        let rows: Vec<Row> = speed.iter().map(Row::Speed).chain(quality.iter().map(Row::Quality)).collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("Planner speed: search and both baselines, median of {SPEED_RUNS} runs, {SEQ_LEN}-token sequences");
        println!("{}\n", speed_table(&speed));
        println!("Plan quality against the baselines (same cost model, {SEQ_LEN}-token sequences)");
        println!("{}", quality_table(&quality));
        println!("{}", quality_summary(&quality));
    }
    Ok(())
}

/// What `medley plan` computes when it searches: the best plan and the baselines.
fn plan(case: &Case, specs: &Specs) -> Result<(Candidate, Baselines)> {
    let outcome = search(&specs.cluster, &specs.model, &specs.job, &specs.calibration, &SearchOptions::default())
        .with_context(|| format!("planning {} on {}", case.model, case.cluster))?;
    let best = outcome.candidates.into_iter().next().expect("a successful search returns at least one plan");
    Ok((best, Baselines::compute(specs)))
}

fn speed_row(speed: &SpeedCase) -> Result<SpeedRow> {
    let specs = speed.case.specs()?;
    let mut runs_s = Vec::with_capacity(SPEED_RUNS);
    for _ in 0..SPEED_RUNS {
        let started = Instant::now();
        plan(&speed.case, &specs)?;
        runs_s.push(started.elapsed().as_secs_f64());
    }
    let median_s = median(runs_s);
    Ok(SpeedRow {
        case: speed.case.info(&specs),
        runs: SPEED_RUNS,
        median_s,
        target_s: speed.target_s,
        speed_ratio: speed.target_s / median_s,
        peak_rss_mib: peak_rss_mib(),
        memory_target_mib: speed.memory_target_mib,
    })
}

fn quality_row(case: &Case) -> Result<QualityRow> {
    let specs = case.specs()?;
    let (best, baselines) = plan(case, &specs)?;
    let best_tokens_per_s = best.prediction.utilisation.tokens_per_s;
    let uniform_tokens_per_s = baselines.uniform.map(|uniform| uniform.prediction.utilisation.tokens_per_s);
    let (homogeneous_device, homogeneous_tokens_per_s) = baselines
        .homogeneous
        .map(|(device, candidate)| (device, candidate.prediction.utilisation.tokens_per_s))
        .unzip();
    Ok(QualityRow {
        case: case.info(&specs),
        best_tokens_per_s,
        best_mfu: best.prediction.utilisation.mfu,
        uniform_tokens_per_s,
        uniform_ratio: uniform_tokens_per_s.map(|tokens_per_s| best_tokens_per_s / tokens_per_s),
        homogeneous_device,
        homogeneous_tokens_per_s,
        homogeneous_ratio: homogeneous_tokens_per_s.map(|tokens_per_s| best_tokens_per_s / tokens_per_s),
    })
}

fn case_cells(case: &CaseInfo) -> Vec<Cell> {
    vec![Cell::new(case.cluster), Cell::new(case.model), right(case.n_gpus), right(case.global_batch)]
}

fn speed_table(rows: &[SpeedRow]) -> Table {
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
fn quality_summary(rows: &[QualityRow]) -> String {
    let ratios: Vec<f64> = rows.iter().filter_map(|row| row.uniform_ratio).collect();
    let misfits = rows.len() - ratios.len();
    let fit_part = if ratios.is_empty() {
        "uniform fits in no case".to_string()
    } else {
        format!(
            "best/uniform over the {} cases where uniform fits: arithmetic mean {}, geometric mean {}",
            ratios.len(),
            times(arithmetic_mean(&ratios)),
            times(geometric_mean(&ratios)),
        )
    };
    format!("{fit_part}\nuniform does not fit at all in {misfits} of {} cases", rows.len())
}

fn verdict(passes: bool) -> &'static str {
    if passes { "pass" } else { "FAIL" }
}

/// `value` shown by `show`, or `absent` when there is none.
fn optional<T, S: ToString>(value: Option<T>, absent: &str, show: impl FnOnce(T) -> S) -> String {
    value.map_or_else(|| absent.to_string(), |value| show(value).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_case_resolves_and_the_quality_suite_is_mixed() {
        for speed in &SPEED_CASES {
            speed.case.specs().unwrap();
        }
        for case in &QUALITY_CASES {
            let specs = case.specs().unwrap();
            let mut types: Vec<&str> = specs.cluster.groups().iter().map(|group| group.device.name.as_str()).collect();
            types.sort_unstable();
            types.dedup();
            assert!((2..=4).contains(&types.len()), "{}", case.cluster);
            assert!((32..=1024).contains(&specs.cluster.n_gpus()), "{}", case.cluster);
        }
    }
}
