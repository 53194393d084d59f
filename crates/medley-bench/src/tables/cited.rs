//! `medley bench calibration`: the simulator's predictions against published, measured training
//! runs, their errors per source for the tuning runs and the held-out ones, and the efficiency
//! factor that fits each device type's tuning runs (the runs, the predictions and the fit are
//! `medley_bench::cited`'s; this prints them).

use std::fmt::Write as _;

use crate::BenchError;
use crate::cited::{CitedPrediction, ErrorSummary, Role, SOURCES, error_summaries, fit_devices, planned_runs, predict};
use crate::heterogeneous::{self, ClusterSummary};
use comfy_table::Cell;
use medley_cost::{Calibration, Overheads};
use medley_fit::{Accuracy, FittedFactor, Measured, at_bound_note};
use serde::Serialize;

use medley_report::text::{right, table};

/// What the held-out runs must stay within (issue 20): on average, and each.
const HELD_OUT_MEAN_TARGET: f64 = 0.05;
const HELD_OUT_WORST_TARGET: f64 = 0.10;

/// The suite's tables, or its rows as JSON.
pub fn report(json: bool) -> Result<String, BenchError> {
    let mut out = String::new();
    let runs = planned_runs()?;
    let rows = predict(&runs, &Calibration::default())?;
    let errors = error_summaries(&rows);
    let fits = fit_devices(&runs)?;
    let mixed = heterogeneous::summaries()?;
    if json {
        #[derive(Serialize)]
        struct Out<'a> {
            runs: &'a [CitedPrediction],
            errors: &'a [ErrorSummary],
            fits: &'a [FittedFactor],
            heterogeneous: &'a [ClusterSummary],
        }
        let all = Out { runs: &rows, errors: &errors, fits: &fits, heterogeneous: &mixed };
        let _ = writeln!(out, "{}", serde_json::to_string_pretty(&all).expect("rows serialise"));
        return Ok(out);
    }
    let _ = writeln!(out, "{}", text(&rows, &errors, &fits));
    let _ = writeln!(out, "{}", heterogeneous_text(&mixed));
    Ok(out)
}

/// A source's number in the list that ends the report.
fn source_number(source: &str) -> usize {
    SOURCES.iter().position(|&known| known == source).map_or(0, |idx| idx + 1)
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Tune => "tuning",
        Role::Check => "held out",
    }
}

fn text(rows: &[CitedPrediction], errors: &[ErrorSummary], fits: &[FittedFactor]) -> String {
    let mut out = String::from(
        "Simulated steps against published measurements, with the default efficiencies\n\
         (time ratio = predicted / measured step time; above 1 the model is pessimistic)\n",
    );
    let mut runs = table(&["source", "run", "cluster", "layout", "role", "measured", "predicted step", "time ratio"]);
    for row in rows {
        let measured = match row.measured {
            Measured::StepS(step_s) => format!("{step_s:.2} s"),
            Measured::HardwareTflopsPerGpu(tflops) => format!("{tflops:.0} TFLOP/s (hw)"),
            Measured::ModelTflopsPerGpu(tflops) => format!("{tflops:.0} TFLOP/s (model)"),
        };
        runs.add_row(vec![
            right(format!("[{}]", source_number(row.source))),
            Cell::new(row.run),
            Cell::new(row.cluster),
            Cell::new(&row.layout),
            Cell::new(role_name(row.role)),
            right(measured),
            right(format!("{:.2} s", row.predicted_step_s)),
            right(format!("{:.3}", row.time_ratio)),
        ]);
    }
    out += &runs.to_string();
    out += "\n\nErrors (mean and worst absolute percentage error of the step time)\n";
    let mut summary = table(&["source", "runs", "n", "mean error", "worst"]);
    for error in errors {
        summary.add_row(vec![
            Cell::new(error.source.map_or("all".to_string(), |source| format!("[{}]", source_number(source)))),
            Cell::new(role_name(error.role)),
            right(error.n_runs.to_string()),
            right(format!("{:.1}%", 100.0 * error.mean_abs_error)),
            right(format!("{:.1}%", 100.0 * error.worst_abs_error)),
        ]);
    }
    out += &summary.to_string();
    if let Some(held_out) = errors.iter().find(|error| error.source.is_none() && error.role == Role::Check) {
        let verdict = |value: f64, target: f64| if value <= target { "within" } else { "OVER" };
        let _ = write!(
            out,
            "\nHeld-out runs: mean error {:.1}% ({} the {:.0}% target), worst {:.1}% ({} the {:.0}% target)\n",
            100.0 * held_out.mean_abs_error,
            verdict(held_out.mean_abs_error, HELD_OUT_MEAN_TARGET),
            100.0 * HELD_OUT_MEAN_TARGET,
            100.0 * held_out.worst_abs_error,
            verdict(held_out.worst_abs_error, HELD_OUT_WORST_TARGET),
            100.0 * HELD_OUT_WORST_TARGET,
        );
    }
    out += "\nFits on the tuning runs (one factor on the default matmul and attention efficiencies;\n1.000 means the defaults are the fit)\n";
    let mut fitted = table(&["device", "factor", "matmul", "attention"]);
    for fit in fits {
        for (device, matmul, attention) in &fit.efficiencies {
            fitted.add_row(vec![
                Cell::new(device),
                right(format!("{:.3}", fit.factor)),
                right(format!("{matmul:.3}")),
                right(format!("{attention:.3}")),
            ]);
        }
    }
    out += &fitted.to_string();
    out += "\nSources:\n";
    for (idx, source) in SOURCES.iter().enumerate() {
        let _ = writeln!(out, "  [{}] {source}", idx + 1);
    }
    out
}

/// The mixed clusters' section: per source and cluster, the defaults, then each fit on all its
/// runs and held out.
fn heterogeneous_text(summaries: &[ClusterSummary]) -> String {
    let mut out = String::from(
        "Heterogeneous clusters: published layouts of one mixed cluster, predicted with the defaults,\n\
         fitted to all of the source's runs (`medley calibrate --measured`'s fit: the efficiencies\n\
         alone, then with the framework's overheads), and held out (each run predicted by a fit of\n\
         the others, 5 folds). Spearman: predicted against measured order of the cluster's layouts\n\
         (1 is the measured order).\n",
    );
    let mut rows = table(&["source", "cluster", "runs", "predictions", "mean error", "time ratio", "Spearman"]);
    for summary in summaries {
        let mut accuracies = vec![("defaults".to_string(), summary.defaults)];
        for fit in &summary.fits {
            accuracies.push((format!("fitted: {}", fit.knobs), fit.fitted));
            accuracies.push((format!("held out: {}", fit.knobs), fit.held_out));
        }
        for (name, Accuracy { mean_abs_error, mean_time_ratio, spearman }) in accuracies {
            rows.add_row(vec![
                Cell::new(summary.source),
                Cell::new(&summary.cluster),
                right(summary.n_runs.to_string()),
                Cell::new(name),
                right(format!("{:.1}%", 100.0 * mean_abs_error)),
                right(format!("{mean_time_ratio:.3}")),
                right(spearman.map_or("-".to_string(), |rho| format!("{rho:.2}"))),
            ]);
        }
    }
    out += &rows.to_string();
    out += "\nEach fit on all of a source's runs: factors on the default matmul and attention efficiencies\n\
            (device types that only ran together share one), and the overheads added to each forward\n\
            and each backward pass\n";
    let mut factors = table(&["source", "fit", "device types", "factor", "runs", "per micro-batch", "per layer"]);
    // A source's fits are on all its runs: listed once, whatever its clusters.
    let mut listed = std::collections::HashSet::new();
    for summary in summaries.iter().filter(|summary| listed.insert(summary.source)) {
        for fit in &summary.fits {
            let overhead = |value: fn(&Overheads) -> f64| {
                fit.overheads.as_ref().map_or("-".to_string(), |overheads| format!("{:.2} ms", 1e3 * value(overheads)))
            };
            for factor in &fit.factors {
                factors.add_row(vec![
                    Cell::new(summary.source),
                    Cell::new(fit.knobs),
                    Cell::new(factor.devices.join(" + ")),
                    right(factor.describe()),
                    right(factor.n_runs.to_string()),
                    right(overhead(|overheads| overheads.per_micro_batch_s)),
                    right(overhead(|overheads| overheads.per_layer_s)),
                ]);
            }
        }
    }
    out += &factors.to_string();
    let at_bound = summaries.iter().flat_map(|summary| &summary.fits).flat_map(|fit| &fit.factors);
    if at_bound.into_iter().any(FittedFactor::at_bound) {
        out += &format!("\n{}\n", at_bound_note());
    }
    out
}
