//! `medley calibrate`: measures this machine's pass time for a model and writes the emulation
//! profile that `medley train --calibration` takes (`medley plan` and `medley simulate` take it
//! only to price that model's emulated runs); with `--measured`, fits the GPU profile that
//! `plan`, `simulate` and `train` take to step times measured on real devices.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use comfy_table::Cell;
use medley_cost::Calibration;
use medley_fit::measurements::{read_csv, read_run};
use medley_fit::{
    Accuracy, Fit, Fitted, FittedFactor, MeasuredRun, Prediction, at_bound_note, by_cluster, cross_validate, fit,
    mean_abs_error, predict,
};
use medley_report::text::{count, right, table};
use medley_runtime::DeviceChoice;

use crate::inputs::DEFAULT_FLEET;
use crate::inputs::{JobFlags, emulated_cluster, load_model, read};
use crate::job::calibrate_here;

/// Takes train's job flags and defaults, so that train's command line makes its profile.
#[derive(Args, Debug)]
#[command(
    mut_arg("model", |arg| arg.default_value("tiny")),
    mut_arg("seq_len", |arg| arg.default_value("128")),
    mut_arg("global_batch", |arg| arg.default_value("16").help("Sequences per optimizer step: accepted as train takes it; a profile does not depend on it")),
    mut_arg("micro_batch", |arg| arg.default_value("2"))
)]
pub struct CalibrateArgs {
    /// The emulated cluster the profile is for: a cluster TOML file, or COUNTxDEVICE,... as train
    /// takes it.
    #[arg(long = "cluster", visible_alias = "fleet", value_name = "CLUSTER", default_value = DEFAULT_FLEET)]
    pub fleet: String,
    /// The model and the job's shape.
    #[command(flatten)]
    pub shape: JobFlags,
    /// Write the profile here instead of printing it.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    /// Fit the device efficiencies and framework overheads to measured steps instead: a CSV of
    /// layouts and step times (label,cluster,model,seq_len,global_batch,micro_batch,tp,pp,dp,step_s
    /// and optionally vpp,cp,recompute,attention,precision,grad_reduce,zero1,overlap_grad_reduce;
    /// or label,plan,step_s with a medley plan file per row), or a medley run directory from real
    /// devices (its plan.json and metrics.jsonl). Repeat for several.
    #[arg(long, value_name = "FILE")]
    pub measured: Vec<PathBuf>,
    /// With --measured: the GPU profile the fit starts from [default: the built-in efficiencies].
    #[arg(long, requires = "measured")]
    pub calibration: Option<String>,
    /// With --measured: fit the device efficiencies only, keeping the base profile's framework
    /// overheads (per micro-batch and per layer pass) instead of fitting them too.
    #[arg(long, requires = "measured")]
    pub no_overheads: bool,
    /// With --measured: held-out predictions come from this many folds, each run predicted by a
    /// fit of the others.
    #[arg(long, default_value_t = 5, requires = "measured", value_parser = clap::value_parser!(u32).range(2..))]
    pub folds: u32,
}

pub fn run(args: &CalibrateArgs) -> Result<()> {
    if !args.measured.is_empty() {
        return fit_measured(args);
    }
    let cluster = emulated_cluster(&args.fleet)?;
    let shape = args.shape.shape()?;
    let model = load_model(&shape.model)?;
    let calibration =
        calibrate_here(&cluster, &model, shape.seq_len, shape.micro_batch, shape.precision, DeviceChoice::Cpu)?;
    let text = format!(
        "# medley calibrate --cluster {} --model {} --seq-len {} --micro-batch {}\n# Efficiencies under which the cost model runs the fleet at this machine's emulated speeds.\n{}",
        args.fleet,
        shape.model,
        shape.seq_len,
        shape.micro_batch,
        calibration.to_toml()
    );
    write_profile(args.output.as_deref(), &text)
}

fn write_profile(output: Option<&Path>, text: &str) -> Result<()> {
    match output {
        Some(path) => std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display())),
        None => crate::emit(text),
    }
}

/// `--measured`: the fit, what it changes in-sample and held out, and its profile.
fn fit_measured(args: &CalibrateArgs) -> Result<()> {
    let mut runs = Vec::new();
    for path in &args.measured {
        match path.is_dir() || path.file_name().is_some_and(|name| name == "metrics.jsonl") {
            true => runs.push(read_run(path)?),
            false => runs.extend(read_csv(path)?),
        }
    }
    let base = match &args.calibration {
        Some(path) => Calibration::from_toml(&read(path)?, path)?,
        None => Calibration::default(),
    };
    let knobs = match args.no_overheads {
        true => Fitted::Efficiencies,
        false => Fitted::EfficienciesAndOverheads,
    };
    let defaults = predict(&runs, &base)?;
    let fitted = fit(&runs, &base, knobs)?;
    let in_sample = predict(&runs, &fitted.calibration)?;
    let held_out = cross_validate(&runs, &base, knobs, args.folds as usize)?;
    crate::emit(&fit_text(&runs, [&defaults, &in_sample, &held_out], &fitted, args.folds))?;
    let sources: Vec<String> = args.measured.iter().map(|path| path.display().to_string()).collect();
    let text = format!(
        "# medley calibrate --measured {}\n# Fitted to {}; held-out mean error {:.1}%.\n{}",
        sources.join(" --measured "),
        count(runs.len(), "measured run"),
        100.0 * mean_abs_error(&held_out),
        fitted.calibration.to_toml()
    );
    write_profile(args.output.as_deref(), &text)?;
    if let Some(path) = &args.output {
        tracing::info!(
            "wrote {}: give it to plan, simulate and train as --calibration {}",
            path.display(),
            path.display()
        );
    }
    Ok(())
}

/// Per run, then per cluster: the predictions under the defaults, the fit and held out.
fn fit_text(runs: &[MeasuredRun], [defaults, fitted, held_out]: [&[Prediction]; 3], fit: &Fit, folds: u32) -> String {
    let error = |prediction: &Prediction| format!("{:+.1}%", 100.0 * (prediction.time_ratio - 1.0));
    let mut per_run = table(&["run", "cluster", "measured", "defaults", "fitted", "held out"]);
    for (idx, run) in runs.iter().enumerate() {
        per_run.add_row(vec![
            Cell::new(&run.label),
            Cell::new(&run.cluster),
            right(format!("{:.3} s", defaults[idx].measured_step_s())),
            right(error(&defaults[idx])),
            right(error(&fitted[idx])),
            right(error(&held_out[idx])),
        ]);
    }
    let mut per_cluster = table(&["cluster", "runs", "predictions", "mean error", "time ratio", "Spearman"]);
    for (cluster, members) in by_cluster(runs) {
        for (name, predictions) in [("defaults", defaults), ("fitted", fitted), ("held out", held_out)] {
            let picked: Vec<Prediction> = members.iter().map(|&idx| predictions[idx]).collect();
            let Accuracy { mean_abs_error, mean_time_ratio, spearman } = Accuracy::of(&picked);
            per_cluster.add_row(vec![
                Cell::new(cluster),
                right(members.len().to_string()),
                Cell::new(name),
                right(format!("{:.1}%", 100.0 * mean_abs_error)),
                right(format!("{mean_time_ratio:.3}")),
                right(spearman.map_or("-".to_string(), |rho| format!("{rho:.2}"))),
            ]);
        }
    }
    let mut fitted_factors = table(&["device types", "factor", "runs"]);
    let mut fitted_factors_note = String::new();
    for factor in &fit.factors {
        fitted_factors.add_row(vec![
            Cell::new(factor.devices.join(" + ")),
            right(factor.describe()),
            right(factor.n_runs.to_string()),
        ]);
    }
    if fit.factors.iter().any(FittedFactor::at_bound) {
        fitted_factors_note = format!("{}\n", at_bound_note());
    }
    let overheads = fit.overheads.map_or(String::new(), |overheads| {
        format!(
            "Framework overheads, added to each forward and each backward pass: {:.3} ms per micro-batch on a stage, {:.3} ms per layer\n",
            1e3 * overheads.per_micro_batch_s,
            1e3 * overheads.per_layer_s
        )
    });
    format!(
        "Step time errors (predicted / measured - 1) under the base profile, the fit, and held out ({folds} folds: each run predicted by a fit of the others)\n{per_run}\n{per_cluster}\nFactors on the matmul and attention efficiencies (device types that only ran together share one)\n{fitted_factors}\n{fitted_factors_note}{overheads}"
    )
}
