//! Fits the cost model to measured training steps.
//!
//! The fit scales each device type's matmul and attention efficiencies by one factor (their ratio
//! stays as the base profile states it), so that the simulator's step times of the layouts the
//! runs were measured on come as close to the measurements as they can: the factors minimise the
//! sum over runs of log(predicted / measured)², one device type at a time until none moves. A
//! factor only moves the runs its device type computes in, so types measured apart are fitted
//! apart; types that only ever ran together cannot be told apart by their runs and share one
//! factor, which the fit says. `medley calibrate --measured` fits a user's runs and
//! `medley bench calibration` published ones; the cost model's default efficiencies are its fits.

use medley_cost::{Calibration, Efficiency, ProfileKind};
use medley_plan::Plan;
use medley_sim::{SimConfig, SimError, StepReport, simulate_steps};
use medley_spec::DeviceSpec;
use rayon::prelude::*;
use serde::Serialize;

pub mod measurements;
mod rank;

pub use rank::spearman;

/// What a measurement reports of a training step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Measured {
    StepS(f64),
    /// Counting recomputation, as Megatron's papers do.
    HardwareTflopsPerGpu(f64),
    /// Model FLOPs only.
    ModelTflopsPerGpu(f64),
}

impl Measured {
    /// Predicted over measured step time: above 1, the model is pessimistic.
    pub fn time_ratio(self, report: &StepReport) -> f64 {
        match self {
            Measured::StepS(step_s) => report.step_time_s / step_s,
            Measured::HardwareTflopsPerGpu(tflops) => tflops / report.utilisation.hardware_tflops_per_gpu,
            Measured::ModelTflopsPerGpu(tflops) => tflops / report.utilisation.model_tflops_per_gpu,
        }
    }

    fn value(self) -> f64 {
        match self {
            Measured::StepS(value) | Measured::HardwareTflopsPerGpu(value) | Measured::ModelTflopsPerGpu(value) => {
                value
            }
        }
    }
}

/// Why a fit could not be made.
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    #[error("run `{run}`: the simulator cannot run its plan: {source}")]
    Simulation {
        run: String,
        #[source]
        source: SimError,
    },
    #[error("run `{run}`: the measurement must be a positive number, got {value}")]
    BadMeasurement { run: String, value: f64 },
    #[error("the base profile is {0}; a fit to measured runs of GPUs starts from a GPU profile")]
    NotGpuProfile(String),
    #[error("no measured runs to fit")]
    NoRuns,
}

/// One measured training step and the layout it was measured on.
#[derive(Clone, Debug)]
pub struct MeasuredRun {
    pub label: String,
    /// The cluster as the measurement names it: runs of one cluster are ranked together.
    pub cluster: String,
    pub plan: Plan,
    pub measured: Measured,
}

impl MeasuredRun {
    /// A run whose measurement is a positive number.
    pub fn new(label: String, cluster: String, plan: Plan, measured: Measured) -> Result<Self, FitError> {
        let value = measured.value();
        if !(value.is_finite() && value > 0.0) {
            return Err(FitError::BadMeasurement { run: label, value });
        }
        Ok(MeasuredRun { label, cluster, plan, measured })
    }

    /// The simulator's step under `calibration`, against the measurement.
    pub fn predict(&self, calibration: &Calibration) -> Result<Prediction, FitError> {
        let report = simulate_steps(&self.plan, calibration, &SimConfig::default(), self.plan.schedule(), 1, None)
            .map_err(|source| FitError::Simulation { run: self.label.clone(), source })?
            .last_step;
        Ok(Prediction { predicted_step_s: report.step_time_s, time_ratio: self.measured.time_ratio(&report) })
    }

    /// The device types the run computes on, in the plan's cluster order.
    fn device_types(&self) -> Vec<DeviceSpec> {
        let mut types: Vec<DeviceSpec> = Vec::new();
        for id in self.plan.used_devices() {
            let device = &self.plan.device_group(id).device;
            if !types.iter().any(|known| known.name == device.name) {
                types.push(device.clone());
            }
        }
        types
    }
}

/// The simulator's prediction of one run.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Prediction {
    pub predicted_step_s: f64,
    /// Predicted over measured step time.
    pub time_ratio: f64,
}

impl Prediction {
    /// The measured step time (a throughput measurement's, as the prediction implies it).
    pub fn measured_step_s(&self) -> f64 {
        self.predicted_step_s / self.time_ratio
    }

    /// How far off the prediction is, as a fraction of the measurement.
    pub fn abs_error(&self) -> f64 {
        (self.time_ratio - 1.0).abs()
    }
}

/// Every run's prediction under `calibration`, in order.
pub fn predict(runs: &[MeasuredRun], calibration: &Calibration) -> Result<Vec<Prediction>, FitError> {
    runs.par_iter().map(|run| run.predict(calibration)).collect()
}

/// The mean of the predictions' absolute errors, as a fraction; 0 for none.
pub fn mean_abs_error(predictions: &[Prediction]) -> f64 {
    if predictions.is_empty() {
        return 0.0;
    }
    predictions.iter().map(Prediction::abs_error).sum::<f64>() / predictions.len() as f64
}

/// How far predictions are from measurements, and whether they order the runs as measured.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Accuracy {
    /// Mean absolute percentage error of the step time, as a fraction.
    pub mean_abs_error: f64,
    /// Predicted over measured step time, geometric mean: below 1, the model is optimistic.
    pub mean_time_ratio: f64,
    /// Spearman's rank correlation of predicted and measured step times.
    pub spearman: Option<f64>,
}

impl Accuracy {
    pub fn of(predictions: &[Prediction]) -> Accuracy {
        let predicted: Vec<f64> = predictions.iter().map(|p| p.predicted_step_s).collect();
        let measured: Vec<f64> = predictions.iter().map(Prediction::measured_step_s).collect();
        let log_mean = predictions.iter().map(|p| p.time_ratio.ln()).sum::<f64>() / predictions.len().max(1) as f64;
        Accuracy {
            mean_abs_error: mean_abs_error(predictions),
            mean_time_ratio: log_mean.exp(),
            spearman: spearman(&predicted, &measured),
        }
    }
}

/// The runs' clusters, in order of first appearance, each with its runs' indexes: layouts of one
/// cluster are the ones a ranking compares.
pub fn by_cluster(runs: &[MeasuredRun]) -> Vec<(&str, Vec<usize>)> {
    let mut clusters: Vec<(&str, Vec<usize>)> = Vec::new();
    for (idx, run) in runs.iter().enumerate() {
        match clusters.iter_mut().find(|(cluster, _)| *cluster == run.cluster) {
            Some((_, members)) => members.push(idx),
            None => clusters.push((&run.cluster, vec![idx])),
        }
    }
    clusters
}

/// One fitted factor and the device types it scales.
#[derive(Clone, Debug, Serialize)]
pub struct FittedFactor {
    /// More than one where those types only ran together.
    pub devices: Vec<String>,
    /// On the base profile's matmul and attention efficiencies.
    pub factor: f64,
    /// The fitted efficiencies, per device type of `devices`.
    pub efficiencies: Vec<(String, f64, f64)>,
    /// Runs the factor was fitted on.
    pub n_runs: usize,
}

/// The factors and the profile they make.
#[derive(Clone, Debug)]
pub struct Fit {
    pub factors: Vec<FittedFactor>,
    /// The base profile with the fitted device types' efficiencies replaced.
    pub calibration: Calibration,
}

/// Where a factor is looked for: a device's kernels reaching a third of its stated efficiency, up
/// to half again more (an efficiency is still capped at 1).
pub const FACTOR_RANGE: (f64, f64) = (0.3, 1.5);

/// The fit has settled when no factor moves by more than this fraction in a sweep: below the three
/// digits profiles and reports keep.
const SETTLED: f64 = 1e-5;

/// Sweeps over the device types before the fit stops waiting for the factors to settle; a type
/// whose runs are compute-bound settles in two or three.
const MAX_SWEEPS: usize = 30;

/// The step on a log factor that its derivative is taken over.
const DERIVATIVE_STEP: f64 = 1e-3;

/// The most a log factor moves in one Newton step, so that a kink in the step time (another stage
/// becoming the slowest) cannot throw it far.
const MAX_STEP: f64 = 0.5;

/// Fits `runs` from `base` (see the module comment). Each device type's factor takes Gauss-Newton
/// steps on its own runs' log errors, the others held, halved until the loss falls; sweeps repeat
/// until no factor moves.
pub fn fit(runs: &[MeasuredRun], base: &Calibration) -> Result<Fit, FitError> {
    fit_runs(&runs.iter().collect::<Vec<_>>(), base)
}

/// [`fit`] of some runs, borrowed (a fold's, in [`cross_validate`]).
fn fit_runs(runs: &[&MeasuredRun], base: &Calibration) -> Result<Fit, FitError> {
    if *base.kind() != ProfileKind::Gpu {
        return Err(FitError::NotGpuProfile(base.kind().to_string()));
    }
    if runs.is_empty() {
        return Err(FitError::NoRuns);
    }
    let coordinates = coordinates(runs);
    let mut log_factors = vec![0.0; coordinates.len()];
    let range = (FACTOR_RANGE.0.ln(), FACTOR_RANGE.1.ln());
    for _ in 0..MAX_SWEEPS {
        let mut moved: f64 = 0.0;
        for (idx, coordinate) in coordinates.iter().enumerate() {
            let log_errors = |log_factor: f64| -> Result<Vec<f64>, FitError> {
                let mut trial = log_factors.clone();
                trial[idx] = log_factor;
                let calibration = scaled(base, &coordinates, &trial);
                coordinate.runs.par_iter().map(|&run| Ok(runs[run].predict(&calibration)?.time_ratio.ln())).collect()
            };
            let loss = |errors: &[f64]| errors.iter().map(|error| error * error).sum::<f64>();
            let at = log_factors[idx];
            let errors = log_errors(at)?;
            let nudged = log_errors(at + DERIVATIVE_STEP)?;
            let slopes: Vec<f64> = errors.iter().zip(&nudged).map(|(e, n)| (n - e) / DERIVATIVE_STEP).collect();
            let curvature: f64 = slopes.iter().map(|slope| slope * slope).sum();
            // Runs that do not move with this factor (another device bounds them, or the
            // efficiency is at its cap) say nothing about it.
            if curvature < 1e-12 {
                continue;
            }
            let gradient: f64 = errors.iter().zip(&slopes).map(|(error, slope)| error * slope).sum();
            let mut step = (-gradient / curvature).clamp(-MAX_STEP, MAX_STEP);
            let current = loss(&errors);
            loop {
                let next = (at + step).clamp(range.0, range.1);
                if loss(&log_errors(next)?) <= current || step.abs() < SETTLED {
                    moved = moved.max((next - at).abs());
                    log_factors[idx] = next;
                    break;
                }
                step /= 2.0;
            }
        }
        if moved < SETTLED {
            break;
        }
    }
    let calibration = scaled(base, &coordinates, &log_factors);
    let factors = coordinates
        .iter()
        .zip(&log_factors)
        .map(|(coordinate, log_factor)| FittedFactor {
            devices: coordinate.devices.iter().map(|device| device.name.clone()).collect(),
            factor: log_factor.exp(),
            efficiencies: coordinate
                .devices
                .iter()
                .map(|device| {
                    let efficiency = calibration.efficiency(device);
                    (device.name.clone(), efficiency.matmul, efficiency.attention)
                })
                .collect(),
            n_runs: coordinate.runs.len(),
        })
        .collect();
    Ok(Fit { factors, calibration })
}

/// Held-out predictions: the runs split into `folds` by position (run i in fold i mod folds),
/// each fold predicted under the fit of the others; a fold whose device types the others never
/// ran on is predicted with the base profile for them.
pub fn cross_validate(runs: &[MeasuredRun], base: &Calibration, folds: usize) -> Result<Vec<Prediction>, FitError> {
    let folds = folds.clamp(2, runs.len().max(2));
    let mut held_out: Vec<Option<Prediction>> = vec![None; runs.len()];
    for fold in 0..folds {
        let (test, train): (Vec<usize>, Vec<usize>) = (0..runs.len()).partition(|idx| idx % folds == fold);
        if test.is_empty() {
            continue;
        }
        let calibration = match train.is_empty() {
            true => base.clone(),
            false => fit_runs(&train.iter().map(|&idx| &runs[idx]).collect::<Vec<_>>(), base)?.calibration,
        };
        for idx in test {
            held_out[idx] = Some(runs[idx].predict(&calibration)?);
        }
    }
    Ok(held_out.into_iter().map(|prediction| prediction.expect("every run is in one fold")).collect())
}

/// Device types that share a factor, and the runs that move it.
struct Coordinate {
    devices: Vec<DeviceSpec>,
    runs: Vec<usize>,
}

/// One coordinate per set of device types that ran in exactly the same runs.
fn coordinates(runs: &[&MeasuredRun]) -> Vec<Coordinate> {
    let mut by_device: Vec<(DeviceSpec, Vec<usize>)> = Vec::new();
    for (idx, run) in runs.iter().enumerate() {
        for device in run.device_types() {
            match by_device.iter_mut().find(|(known, _)| known.name == device.name) {
                Some((_, members)) => members.push(idx),
                None => by_device.push((device, vec![idx])),
            }
        }
    }
    let mut coordinates: Vec<Coordinate> = Vec::new();
    for (device, members) in by_device {
        match coordinates.iter_mut().find(|coordinate| coordinate.runs == members) {
            Some(coordinate) => coordinate.devices.push(device),
            None => coordinates.push(Coordinate { devices: vec![device], runs: members }),
        }
    }
    coordinates
}

/// `base` with every coordinate's device types' matmul and attention efficiencies scaled.
fn scaled(base: &Calibration, coordinates: &[Coordinate], log_factors: &[f64]) -> Calibration {
    let mut calibration = base.clone();
    for (coordinate, log_factor) in coordinates.iter().zip(log_factors) {
        let factor = log_factor.exp();
        for device in &coordinate.devices {
            let stated = base.efficiency(device);
            let efficiency = Efficiency {
                matmul: (stated.matmul * factor).min(1.0),
                attention: (stated.attention * factor).min(1.0),
                memory: stated.memory,
            };
            calibration.set(device, efficiency);
        }
    }
    calibration
}
