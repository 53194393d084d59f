//! `medley bench context`: long context on mixed fleets, the asymmetric plan against the even
//! layouts and each device type alone, all simulated; and the planner's time on 1024 GPUs.

use crate::BenchError;
use crate::long_context::{
    CONTEXT_CASES, ContextInfo, ContextRow, ContextSpeedRow, Simulated, context_row, context_speed_row, context_summary,
};
use crate::stats::TIMED_RUNS;
use comfy_table::Cell;
use medley_plan::long_context::EvenKind;
use serde_json::json;

use medley_report::text::{percent, quantity, right, table, times};

/// The suite's tables, or its rows as JSON.
pub fn report(json: bool) -> Result<String, BenchError> {
    use std::fmt::Write as _;
    let mut out = String::new();
    // The planner's time first, alone, so that nothing competes for the cores.
    let speed = context_speed_row()?;
    let rows: Vec<ContextRow> = CONTEXT_CASES.iter().map(context_row).collect::<Result<_, _>>()?;
    if json {
        let summary = context_summary(&rows);
        let _ = writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&json!({"speed": speed, "rows": rows, "summary": summary}))
                .expect("rows serialise")
        );
        return Ok(out);
    }
    let _ =
        writeln!(out, "Planner time (medley plan's search, tensor- and context-parallel), median of {TIMED_RUNS} runs");
    let _ = writeln!(out, "{}\n", speed_table(&speed));
    let _ =
        writeln!(out, "Long context on mixed fleets: simulated tokens/s (one step, the same simulator for every plan)");
    let _ = writeln!(out, "{}", rows_table(&rows));
    let _ = writeln!(out, "{}", summary_text(&rows));
    Ok(out)
}

fn case_cells(case: &ContextInfo) -> Vec<Cell> {
    vec![
        Cell::new(case.cluster),
        Cell::new(case.model),
        right(case.n_gpus),
        right(quantity(f64::from(case.seq_len))),
        right(case.global_batch),
    ]
}

fn speed_table(row: &ContextSpeedRow) -> comfy_table::Table {
    let mut table = table(&[
        "cluster",
        "model",
        "GPUs",
        "tokens",
        "batch",
        "median s",
        "target s",
        "target/measured",
        "peak RSS MiB",
    ]);
    let mut cells = case_cells(&row.case);
    cells.extend([
        right(format!("{:.3}", row.median_s)),
        right(format!("{:.1}", row.target_s)),
        right(format!("{} {}", times(row.speed_ratio), if row.speed_ratio >= 1.0 { "pass" } else { "FAIL" })),
        right(row.peak_rss_mib.map_or("n/a".to_string(), |peak| format!("{peak:.0}"))),
    ]);
    table.add_row(cells);
    table
}

/// `12345 (cp8·hp4(...))`, or why there is no figure.
fn run_cell(run: Option<&Simulated>) -> Cell {
    right(match run {
        Some(run) if run.fits => format!("{:.0}", run.tokens_per_s),
        Some(_) => "out of memory".to_string(),
        None => "does not fit".to_string(),
    })
}

fn rows_table(rows: &[ContextRow]) -> comfy_table::Table {
    let evens: Vec<&str> = EvenKind::ALL.iter().map(|kind| kind.name()).collect();
    let mut header = vec!["cluster", "model", "GPUs", "tokens", "batch", "asymmetric"];
    header.extend(&evens);
    header.extend(["best homogeneous", "aggregate", "vs best even", "of aggregate", "asymmetric layout"]);
    let mut table = table(&header);
    for row in rows {
        let mut cells = case_cells(&row.case);
        cells.push(run_cell(row.asymmetric.as_ref()));
        cells.extend([&row.even_ring, &row.even_ulysses, &row.even_usp].map(|run| run_cell(run.as_ref())));
        cells.push(right(match &row.homogeneous {
            Some((device, run)) => format!("{:.0} ({device})", run.tokens_per_s),
            None => "does not fit".to_string(),
        }));
        cells.push(right(format!("{:.0}", row.aggregate_tokens_per_s)));
        cells.push(right(row.best_even_ratio.map_or("-".to_string(), times)));
        cells.push(right(row.aggregate_fraction.map_or("-".to_string(), percent)));
        cells.push(Cell::new(row.asymmetric.as_ref().map_or("-", |run| run.layout.as_str())));
        table.add_row(cells);
    }
    table
}

fn summary_text(rows: &[ContextRow]) -> String {
    let summary = context_summary(rows);
    let show = |value: Option<f64>, how: fn(f64) -> String| value.map_or("-".to_string(), how);
    format!(
        "asymmetric / best even layout over {} cases: arithmetic mean {}, geometric mean {}, max {} (goal: mean ≥ 1.40×)\n\
         asymmetric / the fleet's aggregate over {} cases: mean {}, min {} (goal: ≥ 95%)",
        summary.n_compared,
        show(summary.best_even_arithmetic_mean, times),
        show(summary.best_even_geometric_mean, times),
        show(summary.best_even_max, times),
        summary.n_aggregate,
        show(summary.aggregate_mean, percent),
        show(summary.aggregate_min, percent),
    )
}
