//! `medley bench plan`'s tables: the whole of `medley plan`'s work (the search and both
//! baselines) timed on large clusters against targets, then the best plan against the uniform
//! and best-homogeneous baselines on a suite of mixed clusters, all under the same cost model.

use comfy_table::{Cell, Table};
use medley_report::text::{percent, right, table, times};
use serde::Serialize;

use crate::BenchError;
use crate::planner::{
    CaseInfo, PlannerSpeedRow, QUALITY_CASES, QualityRow, SEQ_LEN, SPEED_CASES, quality_row, quality_summary, speed_row,
};
use crate::stats::TIMED_RUNS;

/// One row of either table, tagged with its table in JSON.
#[derive(Serialize)]
#[serde(tag = "table", rename_all = "lowercase")]
enum Row<'a> {
    Speed(&'a PlannerSpeedRow),
    Quality(&'a QualityRow),
}

/// The suite's tables, or its rows as JSON.
pub fn report(json: bool) -> Result<String, BenchError> {
    use std::fmt::Write as _;
    let mut out = String::new();
    // The speed cases run first and one at a time, so nothing else competes for the cores.
    let speed: Vec<PlannerSpeedRow> = SPEED_CASES.iter().map(speed_row).collect::<Result<_, _>>()?;
    let quality: Vec<QualityRow> = QUALITY_CASES.iter().map(quality_row).collect::<Result<_, _>>()?;
    if json {
        let rows: Vec<Row> = speed.iter().map(Row::Speed).chain(quality.iter().map(Row::Quality)).collect();
        let _ = writeln!(out, "{}", serde_json::to_string_pretty(&rows).expect("rows serialise"));
    } else {
        let _ = writeln!(
            out,
            "Planner speed: the search and both baselines, or the whole of medley plan (search, simulated re-ranking, every baseline), median of {TIMED_RUNS} runs, {SEQ_LEN}-token sequences"
        );
        let _ = writeln!(out, "{}\n", speed_table(&speed));
        let _ = writeln!(out, "Plan quality against the baselines (same cost model, {SEQ_LEN}-token sequences)");
        let _ = writeln!(out, "{}", quality_table(&quality));
        let _ = writeln!(out, "{}", quality_summary_text(&quality));
    }
    Ok(out)
}

fn case_cells(case: &CaseInfo) -> Vec<Cell> {
    vec![Cell::new(case.cluster), Cell::new(case.model), right(case.n_gpus), right(case.global_batch)]
}

fn speed_table(rows: &[PlannerSpeedRow]) -> Table {
    let mut table = table(&[
        "work",
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
        let mut cells = vec![Cell::new(if row.whole_command { "medley plan" } else { "search + 2 baselines" })];
        cells.extend(case_cells(&row.case));
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
