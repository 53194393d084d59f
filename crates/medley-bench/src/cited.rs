//! Published, measured training runs, the simulator's predictions of them, and the efficiency
//! factor that fits each device type's tuning runs.
//!
//! Each device type's runs are split in two: the tuning runs are the only data the default
//! efficiencies (`medley_cost::Efficiency::default_for`) were fitted on, by `medley_fit::fit`;
//! the check runs were held out and show how far the fitted model is from measurements it never
//! saw.

use medley_cost::Calibration;
use medley_fit::{FittedFactor, Measured, MeasuredRun};
use medley_plan::Plan;
use medley_plan::baselines::{Degrees, as_measured};
use medley_spec::{AttentionKernel, Bridge, Cluster, Fabric, JobParts, JobSpec, ModelSpec, Recompute, catalog_model};
use rayon::prelude::*;
use serde::Serialize;

use crate::BenchError;

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
    /// Gradients sharded with the optimizer states (ZeRO-2).
    pub shard_gradients: bool,
    pub measured: Measured,
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
        shard_gradients: false,
        measured: Measured::StepS(step_s),
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
        shard_gradients: false,
        measured: Measured::HardwareTflopsPerGpu(tflops),
        role: Role::Check,
    }
}

/// Llama 3 405B's 8K pre-training runs: Table 4's layouts, FlashAttention and no activation
/// recomputation (§3.3.2), optimizer states and gradients sharded over the replicas ("Our use of
/// FSDP for Llama 3 shards optimizer states and gradients", §3.3.2), the embedding and output
/// layer's stages one layer short (§3.3.2, what medley's Megatron-style layouts do anyway), and
/// an interleaved schedule whose depth the paper does not give: the least, two chunks per rank.
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
        shard_gradients: true,
        measured: Measured::ModelTflopsPerGpu(tflops),
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
        shard_gradients: false,
        measured: Measured::StepS(step_s),
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
        shard_gradients: false,
        measured: Measured::StepS(step_s),
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
    pub measured: Measured,
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
            shard_gradients: self.shard_gradients,
            attention: self.attention,
            overlap_grad_reduce: self.overlap_grad_reduce,
            ..JobParts::default()
        };
        let job = JobSpec::new(parts, self.source).map_err(|err| failed(err.to_string()))?;
        as_measured(&cluster, &model, &job, &Calibration::default(), self.degrees, self.recompute)
            .map_err(|err| failed(err.to_string()))
    }

    /// The run as the fit takes it.
    pub fn measured_run(&self, plan: &Plan) -> Result<MeasuredRun, BenchError> {
        Ok(MeasuredRun::new(self.label.to_string(), self.cluster.to_string(), plan.clone(), self.measured)?)
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
            let prediction = run.measured_run(plan)?.predict(calibration)?;
            Ok(CitedPrediction {
                source: run.source,
                run: run.label,
                cluster: run.cluster,
                layout: format!("{}, {}", run.degrees, plan.recompute()),
                role: run.role,
                measured: run.measured,
                predicted_step_s: prediction.predicted_step_s,
                time_ratio: prediction.time_ratio,
            })
        })
        .collect()
}

/// The factors that fit the tuning runs, one per device type (each run is on one type).
pub fn fit_devices(runs: &[(&'static CitedRun, Plan)]) -> Result<Vec<FittedFactor>, BenchError> {
    let tuning: Vec<MeasuredRun> = runs
        .iter()
        .filter(|(run, _)| run.role == Role::Tune)
        .map(|(run, plan)| run.measured_run(plan))
        .collect::<Result<_, _>>()?;
    Ok(medley_fit::fit(&tuning, &Calibration::default(), medley_fit::Fitted::Efficiencies)?.factors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_device_type_has_tuning_and_check_runs() {
        for role in [Role::Tune, Role::Check] {
            assert!(RUNS.iter().filter(|run| run.role == role).count() >= 2, "{role:?}");
        }
        assert!(RUNS.iter().all(|run| SOURCES.contains(&run.source)));
    }
}
