//! What every framework export checks and builds alike: one split and one batch share for every
//! replica, one vendor, a dense model, even context parallelism, and the rank order of a
//! `tp-cp-dp-pp` device mesh.

use medley_cost::long_context::KvExchange;
use medley_plan::{Plan, Stage, StageContext};
use medley_spec::{DeviceId, Precision, Vendor};
use serde::Serialize;

use crate::ExportError;

/// One command-line argument: a flag and its value, if it takes one; a value of several
/// space-separated words (a list) is that many arguments after the flag.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Arg {
    pub flag: String,
    pub value: Option<String>,
}

/// An environment variable a launch script exports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct EnvVar {
    pub name: &'static str,
    pub value: &'static str,
}

/// The variables that make PyTorch run a tf32 or fp32 plan's matmuls as planned: on TF32 tensor
/// cores, or at the fp32 rate. Saying it either way matters: PyTorch leaves TF32 off by default,
/// NVIDIA's PyTorch containers turn it on (`TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`), and ROCm's
/// hipBLASLt takes it on an MI300 only with `HIPBLASLT_ALLOW_TF32=1`. Mixed precision needs none.
pub(crate) fn matmul_environment(plan: &Plan) -> Vec<EnvVar> {
    let var = |name, value| EnvVar { name, value };
    // One vendor: check_common refused the others.
    let first = plan.replicas()[0].stages[0].devices[0];
    let vendor = plan.device_group(first).device.vendor;
    match (plan.precision(), vendor) {
        (Precision::Bf16Mixed | Precision::Fp16Mixed, _) => vec![],
        (Precision::Tf32, Vendor::Nvidia) => vec![var("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")],
        (Precision::Tf32, Vendor::Amd) => {
            vec![var("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1"), var("HIPBLASLT_ALLOW_TF32", "1")]
        }
        (Precision::Fp32, Vendor::Nvidia) => {
            vec![var("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "0"), var("NVIDIA_TF32_OVERRIDE", "0")]
        }
        (Precision::Fp32, Vendor::Amd) => {
            vec![var("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "0"), var("HIPBLASLT_ALLOW_TF32", "0")]
        }
    }
}

/// The launch script's lines exporting `environment`, with why; none when it is empty.
pub(crate) fn environment_lines(environment: &[EnvVar]) -> String {
    if environment.is_empty() {
        return String::new();
    }
    let mut lines = String::from("# The plan's fp32 matmuls run as it was priced: on TF32 tensor cores or not.\n");
    for var in environment {
        lines.push_str(&format!("export {}={}\n", var.name, var.value));
    }
    lines
}

/// Arguments in the order they are added.
#[derive(Default)]
pub(crate) struct Args(pub(crate) Vec<Arg>);

impl Args {
    pub(crate) fn flag(&mut self, flag: &str) {
        self.0.push(Arg { flag: flag.into(), value: None });
    }

    pub(crate) fn value(&mut self, flag: &str, value: impl ToString) {
        self.0.push(Arg { flag: flag.into(), value: Some(value.to_string()) });
    }
}

/// `args` one per line, as a shell continues them: a value's words (a list) are separate
/// arguments, each quoted if the shell would read it otherwise.
pub(crate) fn command_line(args: &[Arg]) -> String {
    let word = |word: &str| match word.contains(|c: char| "|*?;&<>()$'\"[]{}!#~`\\".contains(c)) {
        true => format!("'{word}'"),
        false => word.to_string(),
    };
    args.iter()
        .map(|arg| match &arg.value {
            Some(value) => format!("{} {}", arg.flag, value.split(' ').map(word).collect::<Vec<_>>().join(" ")),
            None => arg.flag.clone(),
        })
        .collect::<Vec<_>>()
        .join(" \\\n    ")
}

/// The checks every framework makes first: one TP degree, one pipeline split and one batch share
/// for every replica, one vendor's devices, a dense model with full attention.
pub(crate) fn check_common(plan: &Plan, framework: &'static str) -> Result<(), ExportError> {
    if plan.uniform_tp().is_none() {
        return Err(ExportError::refused(
            framework,
            format!(
                "its stages differ in tensor-parallel degree ({}): {framework} gives every stage one tensor-parallel \
                 size; plan with one TP degree (`--fix tp=N`, or `--expressible`)",
                plan.tp_label()
            ),
        ));
    }
    check_replicas_alike(plan, framework)?;
    check_one_vendor(plan, framework)?;
    let model = plan.model();
    if model.experts().is_some() {
        return Err(ExportError::refused(
            framework,
            "medley does not export mixture-of-experts layers yet (experts and expert parallelism)",
        ));
    }
    if let Some(window) = model.sliding_window() {
        return Err(ExportError::refused(
            framework,
            format!("the model attends over a sliding window of {window} tokens, which medley does not export yet"),
        ));
    }
    Ok(())
}

fn check_replicas_alike(plan: &Plan, framework: &'static str) -> Result<(), ExportError> {
    let first = &plan.replicas()[0];
    for (idx, replica) in plan.replicas().iter().enumerate().skip(1) {
        if replica.n_micro_batches != first.n_micro_batches {
            return Err(ExportError::refused(
                framework,
                format!(
                    "replica {idx} runs {} micro-batches a step and replica 0 {}: {framework} gives every data-parallel \
                     replica the same share of the batch",
                    replica.n_micro_batches, first.n_micro_batches
                ),
            ));
        }
        let layers = |stages: &[Stage]| stages.iter().map(|stage| stage.layers.len()).collect::<Vec<_>>();
        if layers(&replica.stages) != layers(&first.stages) {
            return Err(ExportError::refused(
                framework,
                format!(
                    "replica {idx} splits the layers {:?} and replica 0 {:?}: {framework} runs one pipeline split for \
                     every replica",
                    layers(&replica.stages),
                    layers(&first.stages)
                ),
            ));
        }
    }
    Ok(())
}

fn check_one_vendor(plan: &Plan, framework: &'static str) -> Result<(), ExportError> {
    let devices = plan.replicas().iter().flat_map(|replica| &replica.stages).flat_map(|stage| &stage.devices);
    let mut vendors: Vec<_> = devices.map(|&device| plan.device_group(device).device.vendor).collect();
    vendors.sort_by_key(|vendor| vendor.to_string());
    vendors.dedup();
    if vendors.len() > 1 {
        return Err(ExportError::refused(
            framework,
            format!(
                "the job spans {} devices: {framework} runs one NCCL (or RCCL) world, which does not cross vendors",
                vendors.iter().map(ToString::to_string).collect::<Vec<_>>().join(" and ")
            ),
        ));
    }
    Ok(())
}

/// A framework's context parallelism: `cp` groups of `hp` devices, every stage alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ContextDegrees {
    pub(crate) cp: usize,
    pub(crate) hp: usize,
    pub(crate) exchange: KvExchange,
}

impl ContextDegrees {
    pub(crate) fn size(self) -> usize {
        self.cp * self.hp
    }
}

/// The plan's context parallelism as the frameworks run it: every stage's sequences split alike
/// into equal head–tail shards, every group's heads split equally.
pub(crate) fn context_degrees(plan: &Plan, framework: &'static str) -> Result<Option<ContextDegrees>, ExportError> {
    let contexts: Vec<Option<&StageContext>> =
        plan.replicas().iter().flat_map(|replica| &replica.stages).map(|stage| stage.context.as_ref()).collect();
    let mixed = || {
        ExportError::refused(
            framework,
            format!(
                "some stages split sequences and some do not: {framework}'s context-parallel size is one for the whole model"
            ),
        )
    };
    let Some(first) = contexts[0] else {
        return match contexts.iter().any(Option::is_some) {
            true => Err(mixed()),
            false => Ok(None),
        };
    };
    let even = |context: &StageContext| {
        let group = &context.groups[0];
        context.groups.iter().all(|other| {
            other.tokens == group.tokens
                && other.device_tokens.iter().all(|&tokens| tokens == group.device_tokens[0])
                && other.heads.iter().all(|&heads| heads == group.heads[0])
                && other.device_tokens.len() == group.device_tokens.len()
        })
    };
    for context in &contexts {
        let Some(context) = context else { return Err(mixed()) };
        if !even(context) {
            let shards: Vec<u32> = context.groups.iter().map(|group| group.tokens).collect();
            return Err(ExportError::refused(
                framework,
                format!(
                    "a stage splits each sequence unevenly (shards of {shards:?} tokens, tokens and heads per device as \
                     the planner chose): {framework} cuts it into 2·cp equal chunks"
                ),
            ));
        }
        if (context.groups.len(), context.groups[0].device_tokens.len())
            != (first.groups.len(), first.groups[0].device_tokens.len())
        {
            return Err(ExportError::refused(
                framework,
                format!(
                    "stages split sequences over different numbers of devices: {framework}'s context-parallel size is \
                     one for the whole model"
                ),
            ));
        }
    }
    Ok(Some(ContextDegrees {
        cp: first.groups.len(),
        hp: first.groups[0].device_tokens.len(),
        exchange: first.kv_exchange,
    }))
}

/// The two rank orders of a `tp-cp-dp-pp` mesh: tensor-parallel rank fastest, then context
/// parallel, then data parallel before pipeline (Megatron's default and torchtitan's only order)
/// or pipeline before data parallel (Megatron's `--use-tp-pp-dp-mapping`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RankOrder {
    DataFirst,
    PipelineFirst,
}

/// The plan's device of each rank in `order`: rank = tp + TP·(cp + CP·(dp + DP·pp)) data first,
/// tp + TP·(cp + CP·(pp + PP·dp)) pipeline first. A stage's devices are its context devices'
/// tensor-parallel groups in order.
pub(crate) fn rank_devices(plan: &Plan, order: RankOrder) -> Vec<DeviceId> {
    let replicas = plan.replicas();
    let pipeline_ranks = plan.n_ranks(&replicas[0]);
    let (outer, inner) = match order {
        RankOrder::DataFirst => (pipeline_ranks, replicas.len()),
        RankOrder::PipelineFirst => (replicas.len(), pipeline_ranks),
    };
    let mut devices = Vec::new();
    for slow in 0..outer {
        for fast in 0..inner {
            let (pp, dp) = if order == RankOrder::DataFirst { (slow, fast) } else { (fast, slow) };
            devices.extend(&replicas[dp].stages[pp].devices);
        }
    }
    devices
}
