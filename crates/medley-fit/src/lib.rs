//! Fits the cost model to measured training steps.
//!
//! The fit scales each device type's matmul and attention efficiencies by one factor (their ratio
//! stays as the base profile states it), so that the simulator's step times of the layouts the
//! runs were measured on come as close to the measurements as they can: the factors minimise the
//! sum over runs of log(predicted / measured)², one device type at a time until none moves. A
//! factor only moves the runs its device type computes in, so types measured apart are fitted
//! apart; types that only ever ran together cannot be told apart by their runs and share one
//! factor, which the fit says. It may also fit the framework's overheads per micro-batch and per
//! layer (seconds added to each pass, which every run moves), for frameworks whose host-side costs
//! no FLOP count sees. `medley calibrate --measured` fits a user's runs and
//! `medley bench calibration` published ones; the cost model's default efficiencies are its fits.

use medley_cost::{Calibration, Efficiency, Overheads, ProfileKind};
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

/// What a fit may move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fitted {
    /// One factor per device type on its efficiencies; the base profile's overheads kept.
    Efficiencies,
    /// Those factors and the framework's overheads per micro-batch and per layer
    /// ([`Overheads`]), which every run moves.
    EfficienciesAndOverheads,
}

/// The factors and the profile they make.
#[derive(Clone, Debug)]
pub struct Fit {
    pub factors: Vec<FittedFactor>,
    /// The fitted overheads, when the fit moved them.
    pub overheads: Option<Overheads>,
    /// The base profile with the fitted device types' efficiencies (and the overheads) replaced.
    pub calibration: Calibration,
}

impl FittedFactor {
    /// Whether the fit stopped at an end of [`FACTOR_RANGE`]: the runs ask more of these devices'
    /// efficiency than it can explain, and the gap lies elsewhere (their links, their rates).
    pub fn at_bound(&self) -> bool {
        let near = |bound: f64| (self.factor / bound - 1.0).abs() < 1e-3;
        near(FACTOR_RANGE.0) || near(FACTOR_RANGE.1)
    }

    /// The factor to three places, and `(bound)` where it is at one.
    pub fn describe(&self) -> String {
        match self.at_bound() {
            true => format!("{:.3} (bound)", self.factor),
            false => format!("{:.3}", self.factor),
        }
    }
}

/// What `medley calibrate` and the benchmark say under their factors when one is at a bound.
pub fn at_bound_note() -> String {
    format!(
        "(bound): the fit stopped at the end of the factors it tries ({} to {}); efficiency alone does not explain \
         those devices' runs, so check their links and rates",
        FACTOR_RANGE.0, FACTOR_RANGE.1
    )
}

/// Where a factor is looked for: a device's kernels reaching a third of its stated efficiency, up
/// to half again more (an efficiency is still capped at 1).
pub const FACTOR_RANGE: (f64, f64) = (0.3, 1.5);

/// The fit has settled when no log factor moves by more than this in an iteration (nor an
/// overhead by this many seconds): below the three digits profiles and reports keep.
const SETTLED: f64 = 1e-5;

/// Iterations before the fit stops waiting for the knobs to settle; compute-bound runs settle in
/// a handful.
const MAX_ITERATIONS: usize = 50;

/// Levenberg-Marquardt's damping, relative to each knob's curvature: where it starts, and the
/// most it grows to before an iteration gives up looking for a step that lowers the loss.
const INITIAL_DAMPING: f64 = 1e-3;
const MAX_DAMPING: f64 = 1e6;

/// Fits `runs` from `base` (see the module comment) by Levenberg-Marquardt on every knob at once:
/// knobs that move the same runs (a device's speed and a per-layer overhead both lengthen its
/// layers) are stepped together instead of one after the other, which would crawl between them.
pub fn fit(runs: &[MeasuredRun], base: &Calibration, fitted: Fitted) -> Result<Fit, FitError> {
    fit_runs(&runs.iter().collect::<Vec<_>>(), base, fitted)
}

/// [`fit`] of some runs, borrowed (a fold's, in [`cross_validate`]).
fn fit_runs(runs: &[&MeasuredRun], base: &Calibration, fitted: Fitted) -> Result<Fit, FitError> {
    if *base.kind() != ProfileKind::Gpu {
        return Err(FitError::NotGpuProfile(base.kind().to_string()));
    }
    if runs.is_empty() {
        return Err(FitError::NoRuns);
    }
    let knobs = knobs(runs, fitted);
    let every_run: Vec<usize> = (0..runs.len()).collect();
    let log_errors = |values: &[f64], which: &[usize]| -> Result<Vec<f64>, FitError> {
        let calibration = apply(base, &knobs, values);
        which.par_iter().map(|&run| Ok(runs[run].predict(&calibration)?.time_ratio.ln())).collect()
    };
    let loss = |errors: &[f64]| errors.iter().map(|error| error * error).sum::<f64>();
    let mut values: Vec<f64> = knobs.iter().map(|knob| knob.start(base)).collect();
    let mut errors = log_errors(&values, &every_run)?;
    let mut damping = INITIAL_DAMPING;
    for _ in 0..MAX_ITERATIONS {
        let columns = jacobian(&knobs, &values, &errors, log_errors)?;
        // Knobs no run moves (another device bounds them, or the efficiency is at its cap) say
        // nothing and stay.
        let active: Vec<usize> =
            (0..knobs.len()).filter(|&k| columns[k].iter().map(|slope| slope * slope).sum::<f64>() > 1e-12).collect();
        if active.is_empty() {
            break;
        }
        let mut moved = None;
        while moved.is_none() && damping <= MAX_DAMPING {
            let step = damped_step(&columns, &errors, &active, damping);
            let mut trial = values.clone();
            for (&k, delta) in active.iter().zip(step) {
                let limits = knobs[k].kind.limits();
                trial[k] =
                    (values[k] + delta.clamp(-limits.max_step, limits.max_step)).clamp(limits.range.0, limits.range.1);
            }
            let trial_errors = log_errors(&trial, &every_run)?;
            if loss(&trial_errors) < loss(&errors) {
                moved = Some(trial.iter().zip(&values).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max));
                (values, errors) = (trial, trial_errors);
                damping = (damping / 3.0).max(1e-9);
            } else {
                damping *= 4.0;
            }
        }
        if moved.is_none_or(|moved| moved < SETTLED) {
            break;
        }
    }
    let calibration = apply(base, &knobs, &values);
    let factors = knobs
        .iter()
        .zip(&values)
        .filter_map(|(knob, &value)| match &knob.kind {
            KnobKind::Speed(devices) => Some(FittedFactor {
                devices: devices.iter().map(|device| device.name.clone()).collect(),
                factor: value.exp(),
                efficiencies: devices
                    .iter()
                    .map(|device| {
                        let efficiency = calibration.efficiency(device);
                        (device.name.clone(), efficiency.matmul, efficiency.attention)
                    })
                    .collect(),
                n_runs: knob.runs.len(),
            }),
            KnobKind::Overhead(_) => None,
        })
        .collect();
    let overheads = (fitted == Fitted::EfficienciesAndOverheads).then(|| calibration.overheads());
    Ok(Fit { factors, overheads, calibration })
}

/// Where a knob's value may go, and how it is stepped.
#[derive(Clone, Copy)]
struct Limits {
    range: (f64, f64),
    /// The step its derivative is taken over.
    derivative_step: f64,
    /// The most it moves in one step, so that a kink in the step time (another stage becoming
    /// the slowest) cannot throw it far.
    max_step: f64,
}

/// Each knob's column of the log errors' Jacobian at `values` (`errors` there), by a forward
/// difference (backward at the top of its range) over the runs the knob moves; zero elsewhere.
fn jacobian(
    knobs: &[Knob],
    values: &[f64],
    errors: &[f64],
    log_errors: impl Fn(&[f64], &[usize]) -> Result<Vec<f64>, FitError>,
) -> Result<Vec<Vec<f64>>, FitError> {
    let mut columns = Vec::with_capacity(knobs.len());
    for (k, knob) in knobs.iter().enumerate() {
        let limits = knob.kind.limits();
        let h = match values[k] + limits.derivative_step <= limits.range.1 {
            true => limits.derivative_step,
            false => -limits.derivative_step,
        };
        let mut nudged = values.to_vec();
        nudged[k] += h;
        let mut column = vec![0.0; errors.len()];
        for (&run, moved) in knob.runs.iter().zip(log_errors(&nudged, &knob.runs)?) {
            column[run] = (moved - errors[run]) / h;
        }
        columns.push(column);
    }
    Ok(columns)
}

/// Levenberg-Marquardt's step for the `active` knobs: (JᵀJ + λ·diag(JᵀJ)) δ = −Jᵀr, which the
/// damping λ turns from Gauss-Newton's step towards steepest descent scaled per knob (so that
/// seconds and log factors mix).
fn damped_step(columns: &[Vec<f64>], errors: &[f64], active: &[usize], damping: f64) -> Vec<f64> {
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let n = active.len();
    let mut matrix: Vec<Vec<f64>> =
        active.iter().map(|&i| active.iter().map(|&j| dot(&columns[i], &columns[j])).collect()).collect();
    for (i, row) in matrix.iter_mut().enumerate() {
        row[i] *= 1.0 + damping;
    }
    let rhs: Vec<f64> = active.iter().map(|&i| -dot(&columns[i], errors)).collect();
    // Cholesky: the damped normal matrix is symmetric and, every active column being nonzero,
    // positive definite.
    let mut lower = vec![vec![0.0; n]; n];
    for i in 0..n {
        for j in 0..=i {
            let sum: f64 = (0..j).map(|k| lower[i][k] * lower[j][k]).sum();
            lower[i][j] = match i == j {
                true => (matrix[i][i] - sum).max(f64::MIN_POSITIVE).sqrt(),
                false => (matrix[i][j] - sum) / lower[j][j],
            };
        }
    }
    let mut forward = vec![0.0; n];
    for i in 0..n {
        forward[i] = (rhs[i] - (0..i).map(|k| lower[i][k] * forward[k]).sum::<f64>()) / lower[i][i];
    }
    let mut step = vec![0.0; n];
    for i in (0..n).rev() {
        step[i] = (forward[i] - (i + 1..n).map(|k| lower[k][i] * step[k]).sum::<f64>()) / lower[i][i];
    }
    step
}

/// Held-out predictions: the runs split into `folds` by position (run i in fold i mod folds),
/// each fold predicted under the fit of the others; a fold whose device types the others never
/// ran on is predicted with the base profile for them.
pub fn cross_validate(
    runs: &[MeasuredRun],
    base: &Calibration,
    fitted: Fitted,
    folds: usize,
) -> Result<Vec<Prediction>, FitError> {
    let folds = folds.clamp(2, runs.len().max(2));
    let mut held_out: Vec<Option<Prediction>> = vec![None; runs.len()];
    for fold in 0..folds {
        let (test, train): (Vec<usize>, Vec<usize>) = (0..runs.len()).partition(|idx| idx % folds == fold);
        if test.is_empty() {
            continue;
        }
        let calibration = match train.is_empty() {
            true => base.clone(),
            false => fit_runs(&train.iter().map(|&idx| &runs[idx]).collect::<Vec<_>>(), base, fitted)?.calibration,
        };
        for idx in test {
            held_out[idx] = Some(runs[idx].predict(&calibration)?);
        }
    }
    Ok(held_out.into_iter().map(|prediction| prediction.expect("every run is in one fold")).collect())
}

/// What a fit moves, and the runs that move it.
struct Knob {
    kind: KnobKind,
    runs: Vec<usize>,
}

enum KnobKind {
    /// The log of one factor on these device types' efficiencies.
    Speed(Vec<DeviceSpec>),
    /// One of the framework's overheads, in seconds.
    Overhead(OverheadField),
}

#[derive(Clone, Copy)]
enum OverheadField {
    PerMicroBatch,
    PerLayer,
}

impl OverheadField {
    fn get(self, overheads: &Overheads) -> f64 {
        match self {
            OverheadField::PerMicroBatch => overheads.per_micro_batch_s,
            OverheadField::PerLayer => overheads.per_layer_s,
        }
    }

    fn set(self, overheads: &mut Overheads, value: f64) {
        match self {
            OverheadField::PerMicroBatch => overheads.per_micro_batch_s = value,
            OverheadField::PerLayer => overheads.per_layer_s = value,
        }
    }
}

impl KnobKind {
    fn limits(&self) -> Limits {
        match self {
            KnobKind::Speed(_) => {
                Limits { range: (FACTOR_RANGE.0.ln(), FACTOR_RANGE.1.ln()), derivative_step: 1e-3, max_step: 0.5 }
            }
            // Tens of microseconds move a step of a second by a part in ten thousand or more,
            // well above the simulator's nanosecond clock.
            KnobKind::Overhead(_) => Limits { range: (0.0, Overheads::MAX_S), derivative_step: 2e-5, max_step: 0.02 },
        }
    }
}

impl Knob {
    /// The knob's value in `base`.
    fn start(&self, base: &Calibration) -> f64 {
        match self.kind {
            KnobKind::Speed(_) => 0.0,
            KnobKind::Overhead(field) => field.get(&base.overheads()),
        }
    }
}

/// One speed knob per set of device types that ran in exactly the same runs, then the overheads
/// where they are fitted, each moved by every run.
fn knobs(runs: &[&MeasuredRun], fitted: Fitted) -> Vec<Knob> {
    let mut by_device: Vec<(DeviceSpec, Vec<usize>)> = Vec::new();
    for (idx, run) in runs.iter().enumerate() {
        for device in run.device_types() {
            match by_device.iter_mut().find(|(known, _)| known.name == device.name) {
                Some((_, members)) => members.push(idx),
                None => by_device.push((device, vec![idx])),
            }
        }
    }
    let mut knobs: Vec<Knob> = Vec::new();
    for (device, members) in by_device {
        match knobs.iter_mut().find(|knob| knob.runs == members) {
            Some(Knob { kind: KnobKind::Speed(devices), .. }) => devices.push(device),
            _ => knobs.push(Knob { kind: KnobKind::Speed(vec![device]), runs: members }),
        }
    }
    if fitted == Fitted::EfficienciesAndOverheads {
        let every_run: Vec<usize> = (0..runs.len()).collect();
        for field in [OverheadField::PerMicroBatch, OverheadField::PerLayer] {
            knobs.push(Knob { kind: KnobKind::Overhead(field), runs: every_run.clone() });
        }
    }
    knobs
}

/// `base` with every knob at its value: speed knobs scale their device types' matmul and
/// attention efficiencies, overhead knobs replace the overhead.
fn apply(base: &Calibration, knobs: &[Knob], values: &[f64]) -> Calibration {
    let mut calibration = base.clone();
    let mut overheads = base.overheads();
    for (knob, &value) in knobs.iter().zip(values) {
        match &knob.kind {
            KnobKind::Speed(devices) => {
                let factor = value.exp();
                for device in devices {
                    let stated = base.efficiency(device);
                    let efficiency = Efficiency {
                        matmul: (stated.matmul * factor).min(1.0),
                        attention: (stated.attention * factor).min(1.0),
                        memory: stated.memory,
                    };
                    calibration.set(device, efficiency);
                }
            }
            KnobKind::Overhead(field) => field.set(&mut overheads, value),
        }
    }
    calibration.set_overheads(overheads);
    calibration
}
