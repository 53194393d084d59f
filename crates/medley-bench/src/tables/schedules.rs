//! `medley bench schedules`: the tables of [`medley_bench::schedules`]' suite — the simulator's
//! own speed on a 1024-GPU step, and the orderings of pipeline schedules the literature reports.

use crate::BenchError;
use crate::schedules::{OrderingRow, SimulatorSpeedRow, orderings, speed_row};
use crate::stats::TIMED_RUNS;
use comfy_table::Cell;
use serde::Serialize;

use medley_report::text::{right, table, times};

/// The suite's tables, or its rows as JSON.
pub fn report(json: bool) -> Result<String, BenchError> {
    use std::fmt::Write as _;
    let mut out = String::new();
    // Speed first, alone, so that the peak RSS is the simulator's.
    let speed = vec![speed_row(false)?, speed_row(true)?];
    let orderings = orderings()?;
    if json {
        #[derive(Serialize)]
        struct Rows<'a> {
            speed: &'a [SimulatorSpeedRow],
            orderings: &'a [OrderingRow],
        }
        let _ = writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&Rows { speed: &speed, orderings: &orderings }).expect("rows serialise")
        );
        return Ok(out);
    }
    let _ = writeln!(out, "Simulator speed: one step, median of {TIMED_RUNS} runs");
    let mut table_ = table(&["layout", "timeline", "median", "target", "target/median", "events", "peak RSS"]);
    for row in &speed {
        table_.add_row(vec![
            Cell::new(&row.layout),
            Cell::new(row.timeline_mib.map_or("none".into(), |mib| format!("streamed, {mib:.0} MiB"))),
            right(format!("{:.3} s", row.median_s)),
            right(format!("{:.1} s", row.target_s)),
            right(times(row.speed_ratio)),
            right(row.events),
            right(row.peak_rss_mib.map_or("-".into(), |mib| format!("{mib:.0} MiB"))),
        ]);
    }
    let _ = writeln!(out, "{table_}\n");
    let _ = writeln!(out, "Schedule orderings, simulated side by side (speedup = baseline time / schedule time)");
    let mut table_ = table(&["claim", "setting", "schedule", "baseline", "speedup", "needs", "holds"]);
    let mut legend = std::collections::BTreeMap::new();
    for row in &orderings {
        legend.insert(row.setting, format!("{}; network {}", row.layout, row.network));
        table_.add_row(vec![
            Cell::new(row.claim),
            Cell::new(row.setting),
            Cell::new(format!("{} {:.3} s", row.schedule, row.schedule_s)),
            Cell::new(format!("{} {:.3} s", row.baseline, row.baseline_s)),
            right(times(row.speedup)),
            right(format!("≥ {}", times(row.required))),
            Cell::new(if row.holds { "yes" } else { "NO" }),
        ]);
    }
    let _ = writeln!(out, "{table_}");
    for (setting, description) in legend {
        let _ = writeln!(out, "  {setting}: {description}");
    }
    Ok(out)
}
