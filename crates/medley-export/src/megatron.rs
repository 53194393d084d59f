//! A plan as Megatron-LM's `pretrain_gpt.py` takes it. Megatron runs one pipeline split and one
//! batch share for every data-parallel replica, one NCCL (or RCCL) world, 1F1B or interleaved
//! 1F1B, and even context-parallel shards; a plan outside that is refused naming what differs.
//! The uneven stages become `--pipeline-model-parallel-layout` (`E` the embedding, `t` a
//! decoder layer, `L` the loss, `|` between stages in layer order, virtual stages included),
//! checked against the rules Megatron's own `PipelineParallelLayerLayout` enforces.

use medley_cost::long_context::KvExchange;
use medley_plan::{Plan, Stage};
use medley_spec::{
    AttentionKernel, GradReduce, MlpKind, ModelSpec, Precision, Recompute, RopeScaling, Schedule, ScheduleKind,
};
use serde::Serialize;

use crate::common::{
    Arg, Args, ContextDegrees, EnvVar, RankOrder, check_common, command_line, context_degrees, environment_lines,
    matmul_environment, rank_devices,
};
use crate::placement::{Placement, place};
use crate::{ExportError, MEGATRON};

/// What a Megatron-LM user runs for a plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MegatronExport {
    pub world_size: u32,
    pub args: Vec<Arg>,
    /// What the launch exports first (how a tf32 or fp32 plan's matmuls run).
    pub environment: Vec<EnvVar>,
    /// Which host and GPU each rank of Megatron's order runs on.
    pub placement: Placement,
}

/// Megatron-LM's arguments and rank placement for `plan`, or why it cannot run it.
pub fn megatron(plan: &Plan) -> Result<MegatronExport, ExportError> {
    check_common(plan, MEGATRON)?;
    check_schedule(plan)?;
    check_precision(plan)?;
    if plan.shard_gradients() {
        return Err(ExportError::refused(
            MEGATRON,
            "the plan shards gradients with the optimizer states (ZeRO-2); Megatron-LM's distributed optimizer shards \
             the optimizer states only: plan without --shard-gradients",
        ));
    }
    let context = context_degrees(plan, MEGATRON)?;
    // Megatron's default order, or with --use-tp-pp-dp-mapping pipeline neighbours consecutive
    // (the planner's placement of a replica's stages in one node).
    let (order, devices, placement) = [RankOrder::DataFirst, RankOrder::PipelineFirst]
        .into_iter()
        .map(|order| {
            let devices = rank_devices(plan, order);
            place(plan.cluster(), &devices).map(|placement| (order, devices, placement))
        })
        .reduce(|first, second| first.or(second))
        .expect("two orders")
        .map_err(|reason| ExportError::refused(MEGATRON, reason))?;
    let mut args = Args::default();
    if order == RankOrder::PipelineFirst {
        args.flag("--use-tp-pp-dp-mapping");
    }
    parallel_args(plan, context, &mut args)?;
    batch_and_memory_args(plan, &mut args);
    model_args(plan, &mut args)?;
    let environment = matmul_environment(plan);
    Ok(MegatronExport { world_size: devices.len() as u32, args: args.0, environment, placement })
}

/// Megatron trains tf32 and fp32 plans with fp32 parameters (no `--bf16`/`--fp16`), but its
/// fused attention backends (FlashAttention, cuDNN) take only 16-bit inputs: in fp32 its `auto`
/// backend falls back to unfused attention, which keeps every score, so a plan priced with a
/// fused kernel is refused.
fn check_precision(plan: &Plan) -> Result<(), ExportError> {
    if !plan.precision().is_mixed() && plan.attention() == AttentionKernel::Fused {
        return Err(ExportError::refused(
            MEGATRON,
            format!(
                "the plan trains in {} with a fused attention kernel; Megatron's fused attention runs 16-bit inputs \
                 only and falls back to unfused attention in fp32: plan with --attention unfused",
                plan.precision()
            ),
        ));
    }
    Ok(())
}

fn check_schedule(plan: &Plan) -> Result<(), ExportError> {
    match plan.schedule() {
        Schedule::Fixed(ScheduleKind::OneFOneB | ScheduleKind::Interleaved) => Ok(()),
        other => Err(ExportError::refused(
            MEGATRON,
            format!("its schedule is {other}; Megatron's pipeline runs 1F1B, or interleaved 1F1B with virtual stages"),
        )),
    }
}

fn parallel_args(plan: &Plan, context: Option<ContextDegrees>, args: &mut Args) -> Result<(), ExportError> {
    let replica = &plan.replicas()[0];
    let pipeline_ranks = plan.n_ranks(replica);
    args.value("--tensor-model-parallel-size", plan.tp());
    if plan.tp() > 1 {
        args.flag("--sequence-parallel");
    }
    args.value("--pipeline-model-parallel-size", pipeline_ranks);
    if replica.stages.len() > 1 {
        let layout = pipeline_layout(&replica.stages);
        check_layout(&layout, pipeline_ranks, plan.model().n_layers() as usize)
            .map_err(|reason| ExportError::refused(MEGATRON, reason))?;
        args.value("--pipeline-model-parallel-layout", layout);
    }
    if let Some(context) = context {
        args.value("--context-parallel-size", context.size());
        let comm_type = match (context.cp, context.hp, context.exchange) {
            (_, 1, KvExchange::Ring) => "p2p",
            (_, 1, KvExchange::AllGather) => "allgather",
            (1, _, _) => "a2a",
            (_, _, KvExchange::Ring) => "a2a+p2p",
            (_, _, KvExchange::AllGather) => {
                return Err(ExportError::refused(
                    MEGATRON,
                    "head groups that all-gather keys and values across groups: Megatron's hierarchical context \
                     parallelism (a2a+p2p) passes them around a ring",
                ));
            }
        };
        args.value("--cp-comm-type", comm_type);
        if comm_type == "a2a+p2p" {
            args.value("--hierarchical-context-parallel-sizes", format!("{} {}", context.hp, context.cp));
        }
    }
    Ok(())
}

/// Stages in layer order, `E` before the first layer, `L` after the last, `t*N` for N layers.
fn pipeline_layout(stages: &[Stage]) -> String {
    let last = stages.len() - 1;
    let stage_text = |(idx, stage): (usize, &Stage)| {
        let layers = stage.layers.len();
        let mut text = String::new();
        if idx == 0 {
            text.push('E');
        }
        match layers {
            0 => {}
            1 => text.push('t'),
            n => text.push_str(&format!("t*{n}")),
        }
        if idx == last {
            text.push('L');
        }
        text
    };
    stages.iter().enumerate().map(stage_text).collect::<Vec<_>>().join("|")
}

/// Megatron's checks of a layout (megatron/core/transformer/pipeline_parallel_layer_layout.py):
/// `x*N` unrolled, stages split at `|`, their count a multiple of the pipeline size, the embedding
/// first and the loss last, each exactly once, and every decoder layer counted once.
pub fn check_layout(layout: &str, pipeline_size: usize, n_layers: usize) -> Result<(), String> {
    let mut unrolled = String::new();
    let mut chars = layout.chars().filter(|&c| c != ',').peekable();
    while let Some(c) = chars.next() {
        if chars.peek() == Some(&'*') {
            chars.next();
            let mut digits = String::new();
            while let Some(&d) = chars.peek().filter(|d| d.is_ascii_digit()) {
                digits.push(d);
                chars.next();
            }
            let count: usize = digits.parse().map_err(|_| format!("`{c}*` without a count in {layout:?}"))?;
            unrolled.extend(std::iter::repeat_n(c, count));
        } else {
            unrolled.push(c);
        }
    }
    let stages: Vec<&str> = unrolled.split('|').collect();
    if let Some(bad) = unrolled.chars().find(|c| !matches!(c, 'E' | 'L' | 't' | '|')) {
        return Err(format!("{layout:?}: `{bad}` is not a layer Megatron knows here (E, t, L)"));
    }
    if !stages.len().is_multiple_of(pipeline_size) {
        return Err(format!(
            "{layout:?}: {} stages are not a multiple of the pipeline size {pipeline_size}",
            stages.len()
        ));
    }
    let layers: String = stages.concat();
    if !layers.starts_with('E') || !layers.ends_with('L') {
        return Err(format!("{layout:?}: the embedding must come first and the loss last"));
    }
    let count = |c: char| layers.chars().filter(|&x| x == c).count();
    if count('E') != 1 || count('L') != 1 || count('t') != n_layers {
        return Err(format!(
            "{layout:?}: {} embeddings, {} losses and {} decoder layers; Megatron wants one, one and {n_layers}",
            count('E'),
            count('L'),
            count('t')
        ));
    }
    Ok(())
}

fn batch_and_memory_args(plan: &Plan, args: &mut Args) {
    args.value("--micro-batch-size", plan.micro_batch());
    args.value("--global-batch-size", plan.global_batch());
    match plan.recompute() {
        Recompute::None => {}
        Recompute::Selective => args.value("--recompute-granularity", "selective"),
        Recompute::Full => {
            args.value("--recompute-granularity", "full");
            args.value("--recompute-method", "uniform");
            args.value("--recompute-num-layers", 1);
        }
    }
    if plan.zero1() {
        args.flag("--use-distributed-optimizer");
    }
    if plan.overlap_grad_reduce() {
        args.flag("--overlap-grad-reduce");
    }
    // Megatron's default (`auto`) picks a fused kernel; an unfused plan asks for Megatron's own.
    if plan.attention() == AttentionKernel::Unfused {
        args.value("--attention-backend", "unfused");
    }
}

fn model_args(plan: &Plan, args: &mut Args) -> Result<(), ExportError> {
    let model = plan.model();
    args.value("--num-layers", model.n_layers());
    args.value("--hidden-size", model.hidden());
    args.value("--ffn-hidden-size", model.ffn_hidden());
    args.value("--num-attention-heads", model.n_heads());
    if model.n_kv_heads() < model.n_heads() {
        args.flag("--group-query-attention");
        args.value("--num-query-groups", model.n_kv_heads());
    }
    if model.has_own_head_dim() {
        args.value("--kv-channels", model.head_dim());
    }
    args.value("--seq-length", plan.seq_len());
    args.value("--max-position-embeddings", plan.seq_len());
    vocabulary_args(plan, args)?;
    if model.mlp() == MlpKind::SwiGlu {
        // A gated MLP is a Llama-style decoder: RMSNorm, rotary positions, no linear biases.
        args.flag("--swiglu");
        args.value("--normalization", "RMSNorm");
        args.value("--position-embedding-type", "rope");
        rope_args(model, args)?;
        args.flag("--disable-bias-linear");
    }
    args.value("--norm-epsilon", model.norm_eps());
    if model.qkv_bias() {
        args.flag("--add-qkv-bias");
    }
    if !model.tie_embeddings() {
        args.flag("--untie-embeddings-and-output-weights");
    }
    // fp16 runs with Megatron's dynamic loss scaling, its default under --fp16; without either
    // flag Megatron keeps fp32 parameters (tf32 and fp32 differ in the launch's environment).
    match plan.precision() {
        Precision::Bf16Mixed => args.flag("--bf16"),
        Precision::Fp16Mixed => args.flag("--fp16"),
        Precision::Tf32 | Precision::Fp32 => {}
    }
    // Said either way under mixed precision: Megatron's default follows it (fp32 under bf16, fp16
    // under fp16). fp32 parameters reduce fp32 gradients, the only way a plan may (JobSpec).
    match (plan.grad_reduce(), plan.precision()) {
        (GradReduce::Fp32, precision) if precision.is_mixed() => args.flag("--accumulate-allreduce-grads-in-fp32"),
        (GradReduce::SixteenBit, Precision::Bf16Mixed) => args.flag("--grad-reduce-in-bf16"),
        _ => {}
    }
    Ok(())
}

/// The model's vocabulary exactly: Megatron pads a tokenizer's vocabulary to a multiple of 128 ×
/// tp unless told the size, and a padded model has other logits than the one planned. Its
/// vocabulary-parallel embedding splits the rows evenly over the tensor-parallel group.
fn vocabulary_args(plan: &Plan, args: &mut Args) -> Result<(), ExportError> {
    let vocab = plan.model().vocab();
    if !vocab.is_multiple_of(plan.tp()) {
        return Err(ExportError::refused(
            MEGATRON,
            format!(
                "its vocabulary of {vocab} tokens does not split over tensor parallelism {}: Megatron's \
                 vocabulary-parallel embedding would pad it, a different model",
                plan.tp()
            ),
        ));
    }
    args.value("--padded-vocab-size", vocab);
    Ok(())
}

/// RoPE's base and Llama 3.1's scaling as Megatron takes them: an integer base (`--rotary-base`
/// is an int), and the scaling's factor alone (`_apply_scaling` fixes low 1, high 4, context 8,192).
fn rope_args(model: &ModelSpec, args: &mut Args) -> Result<(), ExportError> {
    let theta = model.rope_theta();
    if theta.fract() != 0.0 {
        return Err(ExportError::refused(
            MEGATRON,
            format!("its RoPE base is {theta}; Megatron's --rotary-base takes a whole number"),
        ));
    }
    args.value("--rotary-base", theta);
    match model.rope_scaling() {
        None => {}
        Some(scaling) if scaling == RopeScaling::llama3(scaling_factor(scaling)) => {
            args.flag("--use-rope-scaling");
            args.value("--rope-scaling-factor", scaling_factor(scaling));
        }
        Some(RopeScaling::Llama3 { low_freq_factor, high_freq_factor, original_max_position_embeddings, .. }) => {
            return Err(ExportError::refused(
                MEGATRON,
                format!(
                    "its llama3 RoPE scaling has low_freq_factor {low_freq_factor}, high_freq_factor \
                     {high_freq_factor} and original_max_position_embeddings {original_max_position_embeddings}; \
                     Megatron's --use-rope-scaling fixes them at 1, 4 and 8192"
                ),
            ));
        }
    }
    Ok(())
}

fn scaling_factor(scaling: RopeScaling) -> f64 {
    match scaling {
        RopeScaling::Llama3 { factor, .. } => factor,
    }
}

impl MegatronExport {
    /// The arguments one per line, as a shell continues them.
    pub fn command_line(&self) -> String {
        command_line(&self.args)
    }

    /// A bash script that starts this host's ranks with torchrun: which host is which is fixed by
    /// Megatron's rank order, so the script says how to list them and sets each host's GPUs.
    pub fn launch_script(&self) -> String {
        let mut script = String::from("#!/usr/bin/env bash\n");
        script.push_str(&format!(
            "# Megatron-LM launch of a medley plan: {} ranks on {} hosts of {} GPUs.\n",
            self.world_size,
            self.placement.hosts.len(),
            self.placement.procs_per_host
        ));
        let order = match self.args.iter().any(|arg| arg.flag == "--use-tp-pp-dp-mapping") {
            true => "pipeline, data-parallel: --use-tp-pp-dp-mapping",
            false => "data-parallel, pipeline",
        };
        script.push_str(&format!(
            "# Megatron's rank order is fixed: tensor-parallel rank fastest, then context-parallel, {order}.\n"
        ));
        script.push_str(&self.placement.host_setup());
        script.push_str(
            "# Megatron asks for it with tensor or context parallelism.\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n",
        );
        script.push_str(&environment_lines(&self.environment));
        script.push_str(&self.placement.torchrun("pretrain_gpt.py", &self.command_line()));
        script
    }
}
