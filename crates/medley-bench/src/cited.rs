//! Published, measured training runs, the simulator's predictions of them, and the efficiency
//! factor that fits each device type's tuning runs.
//!
//! Each device type's runs are split in two: the tuning runs are the only data the default
//! efficiencies (`medley_cost::Efficiency::default_for`) were fitted on; the check runs were held
//! out and show how far the fitted model is from measurements it never saw. The fit scales the
//! matmul and attention efficiencies together by one factor (their ratio stays as stated), so that
//! the geometric mean of predicted over measured step time on the tuning runs is 1.

use medley_cost::{Calibration, CostModel, Efficiency, Setting};
use medley_plan::Plan;
use medley_plan::baselines::{Degrees, fixed, megatron_plan};
use medley_sim::{SimConfig, StepReport, simulate_steps};
use medley_spec::{
    AttentionKernel, Bridge, Cluster, Fabric, JobParts, JobSpec, ModelSpec, Recompute, catalog_device, catalog_model,
};
use rayon::prelude::*;
use serde::Serialize;

use crate::BenchError;

/// What a source reports.
#[derive(Clone, Copy, Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reported {
    StepS(f64),
    /// Counting recomputation, as Megatron's papers do.
    HardwareTflopsPerGpu(f64),
    /// Model FLOPs only.
    ModelTflopsPerGpu(f64),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Tune,
    Check,
}

/// One published measurement and the layout it was taken on.
pub struct CitedRun {
    pub source: &'static str,
    pub label: &'static str,
    /// A catalog name or a HuggingFace config.json's text.
    pub model: &'static str,
    pub cluster: &'static str,
    pub seq_len: u32,
    pub global_batch: u32,
    pub micro_batch: u32,
    pub degrees: Degrees,
    pub recompute: Recompute,
    pub attention: AttentionKernel,
    /// Megatron-LM's `--overlap-grad-reduce` (which it did not have before 2023).
    pub overlap_grad_reduce: bool,
    pub zero1: bool,
    pub measured: Reported,
    pub role: Role,
}

pub const KORTHIKANTI: &str =
    "Korthikanti et al. 2022, arXiv 2205.05198, Table 4 (times via calculon's validation data)";
pub const NARAYANAN: &str = "Narayanan et al. 2021, arXiv 2104.04473, Table 2";
pub const DGXC: &str = "NVIDIA dgxc-benchmarking, NeMo 24.09, GPT-3 175B BF16 README (nemo_megatron/README_175b.md)";
pub const DGXC_LLAMA: &str = "NVIDIA dgxc-benchmarking, NeMo 24.09, Llama 3.1 8B BF16 README (llama3.1/README_8b.md)";
pub const LLAMA3: &str = "Llama 3 paper, arXiv 2407.21783, Table 4";

/// Megatron's GPT-3-style models with its padded 51,200-token vocabulary.
const GPT_22B: &str = r#"{"model_type": "gpt2", "n_embd": 6144, "n_layer": 48, "n_head": 64, "vocab_size": 51200}"#;
const GPT_175B: &str = r#"{"model_type": "gpt2", "n_embd": 12288, "n_layer": 96, "n_head": 96, "vocab_size": 51200}"#;
const GPT_530B: &str = r#"{"model_type": "gpt2", "n_embd": 20480, "n_layer": 105, "n_head": 128, "vocab_size": 51200}"#;
const GPT_1T: &str = r#"{"model_type": "gpt2", "n_embd": 25600, "n_layer": 128, "n_head": 160, "vocab_size": 51200}"#;

const fn degrees(tp: u32, pp: u32, dp: u32, vpp: u32) -> Degrees {
    Degrees { vpp, ..Degrees::new(tp, pp, dp) }
}

/// The sources, in the order a report lists them.
pub const SOURCES: [&str; 5] = [KORTHIKANTI, NARAYANAN, DGXC, DGXC_LLAMA, LLAMA3];

/// Korthikanti et al.'s runs: one model-parallel group (dp = 1), sequence 2048; calculon's
/// validation configs give the 175B and 530B runs three virtual stages per rank.
const fn korthikanti(
    (label, model): (&'static str, &'static str),
    cluster: &'static str,
    (global_batch, micro_batch): (u32, u32),
    degrees: Degrees,
    recompute: Recompute,
    step_s: f64,
    role: Role,
) -> CitedRun {
    CitedRun {
        source: KORTHIKANTI,
        label,
        model,
        cluster,
        seq_len: 2048,
        global_batch,
        micro_batch,
        degrees,
        recompute,
        attention: AttentionKernel::Unfused,
        overlap_grad_reduce: false,
        zero1: false,
        measured: Reported::StepS(step_s),
        role,
    }
}

const fn narayanan(cluster: &'static str, dp: u32, tflops: f64) -> CitedRun {
    CitedRun {
        source: NARAYANAN,
        label: "GPT-3 175B, full recompute",
        model: GPT_175B,
        cluster,
        seq_len: 2048,
        global_batch: 1536,
        micro_batch: 1,
        degrees: degrees(8, 12, dp, 1),
        recompute: Recompute::Full,
        attention: AttentionKernel::Unfused,
        overlap_grad_reduce: false,
        zero1: false,
        measured: Reported::HardwareTflopsPerGpu(tflops),
        role: Role::Check,
    }
}

/// Llama 3 405B's 8K pre-training runs: Table 4's layouts, FlashAttention and no activation
/// recomputation (§3.3.2), the embedding and output layer's stages one layer short (§3.3.2, what
/// medley's Megatron-style layouts do anyway), and an interleaved schedule whose depth the paper
/// does not give: the least, two chunks per rank.
const fn llama3(cluster: &'static str, dp: u32, tflops: f64) -> CitedRun {
    CitedRun {
        source: LLAMA3,
        label: "Llama 3 405B, 8K sequences",
        model: "llama3-405b",
        cluster,
        seq_len: 8192,
        global_batch: 2048,
        micro_batch: 1,
        degrees: degrees(8, 16, dp, 2),
        recompute: Recompute::None,
        attention: AttentionKernel::Fused,
        overlap_grad_reduce: true,
        zero1: true,
        measured: Reported::ModelTflopsPerGpu(tflops),
        role: Role::Check,
    }
}

/// NeMo's GPT-3 175B on H100s (tp 4, pp 8, 12 chunks per rank, 64 sequences per replica). NeMo's
/// recompute and optimizer settings are not in the README; selective recompute and a distributed
/// optimizer are what fits this layout in 80 GiB; NeMo overlaps gradient reduction by default.
const fn dgxc_gpt3(cluster: &'static str, dp: u32, step_s: f64, role: Role) -> CitedRun {
    CitedRun {
        source: DGXC,
        label: "GPT 175B, interleaved v=12",
        model: GPT_175B,
        cluster,
        seq_len: 2048,
        global_batch: 64 * dp,
        micro_batch: 1,
        degrees: degrees(4, 8, dp, 12),
        recompute: Recompute::Selective,
        attention: AttentionKernel::Fused,
        overlap_grad_reduce: true,
        zero1: true,
        measured: Reported::StepS(step_s),
        role,
    }
}

/// NeMo's Llama 3.1 8B on H100s: context parallelism 2 and no other model parallelism, 32
/// sequences of 8K per replica; recompute none (what fits), a distributed optimizer and
/// overlapped reduction (NeMo's defaults).
const fn dgxc_llama31_8b(cluster: &'static str, dp: u32, step_s: f64) -> CitedRun {
    CitedRun {
        source: DGXC_LLAMA,
        label: "Llama 3.1 8B, cp=2",
        model: "llama3-8b",
        cluster,
        seq_len: 8192,
        global_batch: 32 * dp,
        micro_batch: 1,
        degrees: Degrees { cp: 2, ..Degrees::new(1, 1, dp) },
        recompute: Recompute::None,
        attention: AttentionKernel::Fused,
        overlap_grad_reduce: true,
        zero1: true,
        measured: Reported::StepS(step_s),
        role: Role::Check,
    }
}

/// Every cited run, tuning runs and held-out checks.
pub const RUNS: [CitedRun; 17] = [
    korthikanti(
        ("GPT 175B, selective", GPT_175B),
        "64xa100",
        (64, 1),
        degrees(8, 8, 1, 3),
        Recompute::Selective,
        13.75,
        Role::Tune,
    ),
    korthikanti(
        ("GPT 175B, full", GPT_175B),
        "64xa100",
        (64, 1),
        degrees(8, 8, 1, 3),
        Recompute::Full,
        18.13,
        Role::Tune,
    ),
    korthikanti(
        ("GPT 530B, selective", GPT_530B),
        "280xa100",
        (280, 1),
        degrees(8, 35, 1, 3),
        Recompute::Selective,
        37.83,
        Role::Tune,
    ),
    korthikanti(
        ("GPT 530B, full", GPT_530B),
        "280xa100",
        (280, 1),
        degrees(8, 35, 1, 3),
        Recompute::Full,
        49.05,
        Role::Tune,
    ),
    korthikanti(
        ("GPT 22B, selective", GPT_22B),
        "8xa100",
        (4, 4),
        degrees(8, 1, 1, 1),
        Recompute::Selective,
        1.10,
        Role::Check,
    ),
    korthikanti(("GPT 22B, full", GPT_22B), "8xa100", (4, 4), degrees(8, 1, 1, 1), Recompute::Full, 1.42, Role::Check),
    korthikanti(
        ("GPT 1T, selective", GPT_1T),
        "512xa100",
        (512, 1),
        degrees(8, 64, 1, 1),
        Recompute::Selective,
        71.49,
        Role::Check,
    ),
    korthikanti(
        ("GPT 1T, full", GPT_1T),
        "512xa100",
        (512, 1),
        degrees(8, 64, 1, 1),
        Recompute::Full,
        94.42,
        Role::Check,
    ),
    narayanan("384xa100", 4, 153.0),
    narayanan("768xa100", 8, 149.0),
    narayanan("1536xa100", 16, 141.0),
    dgxc_gpt3("128xh100", 4, 8.309, Role::Tune),
    dgxc_gpt3("2048xh100", 64, 8.49, Role::Check),
    dgxc_llama31_8b("8xh100", 4, 12.91),
    dgxc_llama31_8b("128xh100", 64, 13.10),
    llama3("8192xh100", 64, 430.0),
    llama3("16384xh100", 128, 400.0),
];

/// The simulator's prediction of one cited run.
#[derive(Clone, Debug, Serialize)]
pub struct CitedPrediction {
    pub source: &'static str,
    pub run: &'static str,
    pub cluster: &'static str,
    pub layout: String,
    pub role: Role,
    pub measured: Reported,
    pub predicted_step_s: f64,
    /// Predicted over measured step time: above 1, the model is pessimistic.
    pub time_ratio: f64,
}

impl CitedPrediction {
    /// How far off the prediction is, as a fraction of the measurement.
    pub fn abs_error(&self) -> f64 {
        (self.time_ratio - 1.0).abs()
    }
}

/// How far the predictions of one source's runs in one role are off (all sources' with
/// `source` `None`).
#[derive(Clone, Debug, Serialize)]
pub struct ErrorSummary {
    pub source: Option<&'static str>,
    pub role: Role,
    pub n_runs: usize,
    /// Mean absolute percentage error, as a fraction.
    pub mean_abs_error: f64,
    pub worst_abs_error: f64,
}

/// Per source and role, then over all sources per role: the errors of `rows`.
pub fn error_summaries(rows: &[CitedPrediction]) -> Vec<ErrorSummary> {
    let sources = SOURCES.iter().map(|&source| Some(source)).chain([None]);
    sources
        .flat_map(|source| [Role::Tune, Role::Check].map(|role| (source, role)))
        .filter_map(|(source, role)| {
            let errors: Vec<f64> = rows
                .iter()
                .filter(|row| row.role == role && source.is_none_or(|source| row.source == source))
                .map(CitedPrediction::abs_error)
                .collect();
            (!errors.is_empty()).then(|| ErrorSummary {
                source,
                role,
                n_runs: errors.len(),
                mean_abs_error: errors.iter().sum::<f64>() / errors.len() as f64,
                worst_abs_error: errors.iter().copied().fold(0.0, f64::max),
            })
        })
        .collect()
}

/// The efficiency factor that fits one device type's tuning runs.
#[derive(Clone, Debug, Serialize)]
pub struct Fit {
    pub device: String,
    /// The factor on the stated efficiencies that fits the tuning runs.
    pub factor: f64,
    pub matmul: f64,
    pub attention: f64,
}

impl CitedRun {
    /// The Megatron-style plan the run was measured on, priced with the default efficiencies.
    pub fn plan(&self) -> Result<Plan, BenchError> {
        let failed = |message: String| BenchError::CitedRun { run: self.label, message };
        let model = if self.model.starts_with('{') {
            ModelSpec::from_hf_config(self.model, self.label)
        } else {
            catalog_model(self.model)
        }
        .map_err(|err| failed(err.to_string()))?;
        let cluster = Cluster::from_inline(self.cluster, Fabric::default(), Bridge::default())
            .map_err(|err| failed(err.to_string()))?;
        let parts = JobParts {
            seq_len: self.seq_len,
            global_batch: self.global_batch,
            micro_batch: Some(self.micro_batch),
            zero1: self.zero1,
            attention: self.attention,
            overlap_grad_reduce: self.overlap_grad_reduce,
            ..JobParts::default()
        };
        let job = JobSpec::new(parts, self.source).map_err(|err| failed(err.to_string()))?;
        let calibration = Calibration::default();
        if self.degrees.splits_sequences() {
            let job = job.with_recompute(self.recompute);
            let candidate = fixed(&cluster, &model, &job, &calibration, self.degrees);
            return candidate.map(|candidate| candidate.plan).map_err(|err| failed(err.to_string()));
        }
        let cost = CostModel::new(&model, self.seq_len, &calibration).with_attention(self.attention);
        let setting = Setting { micro_batch: self.micro_batch, tp: self.degrees.tp, recompute: self.recompute };
        megatron_plan(&cluster, &cost, &job, setting, self.degrees).map_err(|err| failed(err.to_string()))
    }

    /// Predicted over measured step time.
    pub fn time_ratio(&self, report: &StepReport) -> f64 {
        match self.measured {
            Reported::StepS(step_s) => report.step_time_s / step_s,
            Reported::HardwareTflopsPerGpu(tflops) => tflops / report.utilisation.hardware_tflops_per_gpu,
            Reported::ModelTflopsPerGpu(tflops) => tflops / report.utilisation.model_tflops_per_gpu,
        }
    }

    /// The run's device type (every cited run is on one).
    pub fn device(&self, plan: &Plan) -> String {
        plan.cluster().groups()[0].device.name.clone()
    }
}

/// Every cited run with its plan.
pub fn planned_runs() -> Result<Vec<(&'static CitedRun, Plan)>, BenchError> {
    RUNS.iter().map(|run| Ok((run, run.plan()?))).collect()
}

/// The simulator's prediction of every run under `calibration`.
pub fn predict(
    runs: &[(&'static CitedRun, Plan)],
    calibration: &Calibration,
) -> Result<Vec<CitedPrediction>, BenchError> {
    runs.par_iter()
        .map(|(run, plan)| {
            let report = simulate_one(plan, calibration)?;
            Ok(CitedPrediction {
                source: run.source,
                run: run.label,
                cluster: run.cluster,
                layout: format!("{}, {}", run.degrees, plan.recompute()),
                role: run.role,
                measured: run.measured,
                predicted_step_s: report.step_time_s,
                time_ratio: run.time_ratio(&report),
            })
        })
        .collect()
}

/// The fit of every device type's tuning runs, in the order the runs list the types.
pub fn fit_devices(runs: &[(&'static CitedRun, Plan)]) -> Result<Vec<Fit>, BenchError> {
    let mut devices: Vec<String> = runs.iter().map(|(run, plan)| run.device(plan)).collect();
    devices.dedup();
    devices
        .iter()
        .map(|device| {
            let tuning: Vec<(&CitedRun, Plan)> = runs
                .iter()
                .filter(|(run, plan)| run.role == Role::Tune && &run.device(plan) == device)
                .map(|(run, plan)| (*run, plan.clone()))
                .collect();
            fit(device, &tuning)
        })
        .collect()
}

fn simulate_one(plan: &Plan, calibration: &Calibration) -> Result<StepReport, BenchError> {
    let report = simulate_steps(plan, calibration, &SimConfig::default(), plan.schedule(), 1, None)?;
    Ok(report.last_step)
}

/// A calibration that scales `device`'s stated matmul and attention efficiencies by `factor`.
fn scaled(device: &str, factor: f64) -> Result<(Calibration, Efficiency), BenchError> {
    let failed = |message: String| BenchError::Fit { device: device.to_string(), message };
    let stated = Efficiency::default_for(&catalog_device(device).map_err(|err| failed(err.to_string()))?);
    let efficiency = Efficiency {
        matmul: (stated.matmul * factor).min(1.0),
        attention: (stated.attention * factor).min(1.0),
        memory: stated.memory,
    };
    let text = format!(
        "[device.\"{device}\"]\nmatmul = {}\nattention = {}\nmemory = {}\n",
        efficiency.matmul, efficiency.attention, efficiency.memory
    );
    let calibration = Calibration::from_toml(&text, "fit").map_err(|err| failed(err.to_string()))?;
    Ok((calibration, efficiency))
}

/// The factor on `device`'s stated efficiencies under which its tuning runs' geometric-mean
/// time ratio is 1.
fn fit(device: &str, runs: &[(&CitedRun, Plan)]) -> Result<Fit, BenchError> {
    let log_ratio = |factor: f64| -> Result<f64, BenchError> {
        let (calibration, _) = scaled(device, factor)?;
        let log_ratios: Vec<f64> = runs
            .par_iter()
            .map(|(run, plan)| Ok(run.time_ratio(&simulate_one(plan, &calibration)?).ln()))
            .collect::<Result<_, BenchError>>()?;
        Ok(log_ratios.iter().sum::<f64>() / runs.len() as f64)
    };
    let factor = falling_root(log_ratio, FACTOR_RANGE)?;
    let (_, efficiency) = scaled(device, factor)?;
    Ok(Fit { device: device.to_string(), factor, matmul: efficiency.matmul, attention: efficiency.attention })
}

/// Where the fit looks for its factor.
const FACTOR_RANGE: (f64, f64) = (0.3, 1.5);

/// Bisection steps: the range shrinks by 2²⁰ to about 1e-6, below the three digits the defaults
/// keep.
const BISECTION_STEPS: usize = 20;

/// The root of `f`, which falls as its argument grows (a faster device predicts shorter
/// steps), within `(low, high)`; the nearer end when the root lies outside.
fn falling_root<E>(f: impl Fn(f64) -> Result<f64, E>, (mut low, mut high): (f64, f64)) -> Result<f64, E> {
    for _ in 0..BISECTION_STEPS {
        let middle = 0.5 * (low + high);
        if f(middle)? > 0.0 { low = middle } else { high = middle }
    }
    Ok(0.5 * (low + high))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_of_a_falling_function_is_found_or_clamped_to_the_range() {
        let at = |root: f64| move |x: f64| Ok::<_, ()>((root / x).ln());
        assert!((falling_root(at(0.8), FACTOR_RANGE).unwrap() - 0.8).abs() < 1e-6);
        assert!((falling_root(at(5.0), FACTOR_RANGE).unwrap() - FACTOR_RANGE.1).abs() < 1e-6);
        assert!((falling_root(at(0.01), FACTOR_RANGE).unwrap() - FACTOR_RANGE.0).abs() < 1e-6);
    }

    #[test]
    fn every_device_type_has_tuning_and_check_runs() {
        for role in [Role::Tune, Role::Check] {
            assert!(RUNS.iter().filter(|run| run.role == role).count() >= 2, "{role:?}");
        }
        assert!(RUNS.iter().all(|run| SOURCES.contains(&run.source)));
    }
}
