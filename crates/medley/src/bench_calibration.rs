//! `medley bench calibration`: the simulator's predictions against published, measured training
//! runs, and the efficiency factor that fits each device type's tuning runs (the runs, the
//! predictions and the fit are `medley_bench::cited`'s; this prints them).

use std::fmt::Write as _;

use anyhow::Result;
use comfy_table::Cell;
use medley_bench::cited::{CitedPrediction, Fit, Reported, Role, SOURCES, fit_devices, planned_runs, predict};
use medley_bench::stats::geometric_mean;
use medley_cost::Calibration;
use serde::Serialize;

use crate::render::{right, table};

pub fn bench_calibration(json: bool) -> Result<()> {
    let runs = planned_runs()?;
    let rows = predict(&runs, &Calibration::default())?;
    let fits = fit_devices(&runs)?;
    if json {
        #[derive(Serialize)]
        struct Out<'a> {
            runs: &'a [CitedPrediction],
            fits: &'a [Fit],
        }
        println!("{}", serde_json::to_string_pretty(&Out { runs: &rows, fits: &fits })?);
        return Ok(());
    }
    println!("{}", text(&rows, &fits));
    Ok(())
}

fn text(rows: &[CitedPrediction], fits: &[Fit]) -> String {
    let mut out = String::from(
        "Simulated steps against published measurements, with the default efficiencies\n\
         (time ratio = predicted / measured step time; above 1 the model is pessimistic)\n",
    );
    let mut runs = table(&["run", "cluster", "layout", "role", "measured", "predicted step", "time ratio"]);
    for row in rows {
        let measured = match row.measured {
            Reported::StepS(step_s) => format!("{step_s:.2} s"),
            Reported::HardwareTflopsPerGpu(tflops) => format!("{tflops:.0} TFLOP/s (hw)"),
            Reported::ModelTflopsPerGpu(tflops) => format!("{tflops:.0} TFLOP/s (model)"),
        };
        runs.add_row(vec![
            Cell::new(row.run),
            Cell::new(row.cluster),
            Cell::new(&row.layout),
            Cell::new(format!("{:?}", row.role).to_lowercase()),
            right(measured),
            right(format!("{:.2} s", row.predicted_step_s)),
            right(format!("{:.2}", row.time_ratio)),
        ]);
    }
    out += &runs.to_string();
    for role in [Role::Tune, Role::Check] {
        let ratios: Vec<f64> = rows.iter().filter(|row| row.role == role).map(|row| row.time_ratio).collect();
        let geomean = geometric_mean(&ratios);
        let worst = ratios.iter().map(|r| (r.ln()).abs()).fold(0.0, f64::max).exp();
        let _ = write!(
            out,
            "\n{role:?} runs: geometric-mean time ratio {geomean:.3}, worst off by {:.1}%",
            100.0 * (worst - 1.0)
        );
    }
    out += "\n\nFits on the tuning runs (one factor on the stated matmul and attention efficiencies)\n";
    let mut fitted = table(&["device", "factor", "matmul", "attention"]);
    for fit in fits {
        fitted.add_row(vec![
            Cell::new(&fit.device),
            right(format!("{:.3}", fit.factor)),
            right(format!("{:.3}", fit.matmul)),
            right(format!("{:.3}", fit.attention)),
        ]);
    }
    out += &fitted.to_string();
    out += "\nSources:\n";
    for source in SOURCES {
        let _ = writeln!(out, "  {source}");
    }
    out
}
