//! A plan as Megatron-LM's `pretrain_gpt.py` takes it. Megatron runs one pipeline split and one
//! batch share for every data-parallel replica, one NCCL (or RCCL) world, 1F1B or interleaved
//! 1F1B, and even context-parallel shards; a plan outside that is refused naming what differs.
//! The uneven stages become `--pipeline-model-parallel-layout` (`E` the embedding, `t` a
//! decoder layer, `L` the loss, `|` between stages in layer order, virtual stages included),
//! checked against the rules Megatron's own `PipelineParallelLayerLayout` enforces.

use medley_cost::context::KvExchange;
use medley_plan::{Plan, Stage, StageContext};
use medley_spec::{DeviceId, MlpKind, Recompute, Schedule, ScheduleKind};
use serde::Serialize;

use crate::ExportError;
use crate::placement::{Placement, place};

/// One command-line argument: a flag and its value, if it takes one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Arg {
    pub flag: String,
    pub value: Option<String>,
}

/// What a Megatron-LM user runs for a plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MegatronExport {
    pub world_size: u32,
    pub args: Vec<Arg>,
    /// Which host and GPU each rank of Megatron's order runs on.
    pub placement: Placement,
}

/// Megatron-LM's arguments and rank placement for `plan`, or why it cannot run it.
pub fn megatron(plan: &Plan) -> Result<MegatronExport, ExportError> {
    check_replicas_alike(plan)?;
    check_one_vendor(plan)?;
    check_schedule(plan)?;
    let context = context_degrees(plan)?;
    let model = plan.model();
    if model.experts().is_some() {
        return Err(ExportError::megatron(
            "medley does not export mixture-of-experts layers yet (Megatron's --num-experts and expert parallelism)",
        ));
    }
    if let Some(window) = model.sliding_window() {
        return Err(ExportError::megatron(format!(
            "the model attends over a sliding window of {window} tokens, which medley does not export yet"
        )));
    }
    // Megatron's default order, or with --use-tp-pp-dp-mapping pipeline neighbours consecutive
    // (the planner's placement of a replica's stages in one node).
    let context_size = context.map_or(1, |c| c.size());
    let (order, devices, placement) = [RankOrder::DataFirst, RankOrder::PipelineFirst]
        .into_iter()
        .map(|order| {
            let devices = rank_devices(plan, context_size, order);
            place(plan.cluster(), &devices).map(|placement| (order, devices, placement))
        })
        .reduce(|first, second| first.or(second))
        .expect("two orders")
        .map_err(ExportError::megatron)?;
    let mut args = Args::default();
    if order == RankOrder::PipelineFirst {
        args.flag("--use-tp-pp-dp-mapping");
    }
    parallel_args(plan, context, &mut args)?;
    batch_and_memory_args(plan, &mut args);
    model_args(plan, &mut args);
    Ok(MegatronExport { world_size: devices.len() as u32, args: args.0, placement })
}

#[derive(Default)]
struct Args(Vec<Arg>);

impl Args {
    fn flag(&mut self, flag: &str) {
        self.0.push(Arg { flag: flag.into(), value: None });
    }

    fn value(&mut self, flag: &str, value: impl ToString) {
        self.0.push(Arg { flag: flag.into(), value: Some(value.to_string()) });
    }
}

/// Megatron runs every data-parallel replica alike.
fn check_replicas_alike(plan: &Plan) -> Result<(), ExportError> {
    let first = &plan.replicas()[0];
    for (idx, replica) in plan.replicas().iter().enumerate().skip(1) {
        if replica.n_micro_batches != first.n_micro_batches {
            return Err(ExportError::megatron(format!(
                "replica {idx} runs {} micro-batches a step and replica 0 {}: Megatron gives every data-parallel \
                 replica the same share of the batch",
                replica.n_micro_batches, first.n_micro_batches
            )));
        }
        let layers = |stages: &[Stage]| stages.iter().map(|stage| stage.layers.len()).collect::<Vec<_>>();
        if layers(&replica.stages) != layers(&first.stages) {
            return Err(ExportError::megatron(format!(
                "replica {idx} splits the layers {:?} and replica 0 {:?}: Megatron runs one pipeline split for every \
                 replica",
                layers(&replica.stages),
                layers(&first.stages)
            )));
        }
    }
    Ok(())
}

fn check_one_vendor(plan: &Plan) -> Result<(), ExportError> {
    let devices = plan.replicas().iter().flat_map(|replica| &replica.stages).flat_map(|stage| &stage.devices);
    let mut vendors: Vec<_> = devices.map(|&device| plan.device_group(device).device.vendor).collect();
    vendors.sort_by_key(|vendor| vendor.to_string());
    vendors.dedup();
    if vendors.len() > 1 {
        return Err(ExportError::megatron(format!(
            "the job spans {} devices: Megatron runs one NCCL (or RCCL) world, which does not cross vendors",
            vendors.iter().map(ToString::to_string).collect::<Vec<_>>().join(" and ")
        )));
    }
    Ok(())
}

fn check_schedule(plan: &Plan) -> Result<(), ExportError> {
    match plan.schedule() {
        Schedule::Fixed(ScheduleKind::OneFOneB | ScheduleKind::Interleaved) => Ok(()),
        other => Err(ExportError::megatron(format!(
            "its schedule is {other}; Megatron's pipeline runs 1F1B, or interleaved 1F1B with virtual stages"
        ))),
    }
}

/// Megatron's context parallelism: `cp` groups of `hp` devices, every stage alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ContextDegrees {
    cp: usize,
    hp: usize,
    exchange: KvExchange,
}

impl ContextDegrees {
    fn size(self) -> usize {
        self.cp * self.hp
    }
}

/// The plan's context parallelism as Megatron's, which splits every stage's sequences alike into
/// equal head–tail shards and every group's heads equally.
fn context_degrees(plan: &Plan) -> Result<Option<ContextDegrees>, ExportError> {
    let stages: Vec<&Stage> = plan.replicas().iter().flat_map(|replica| &replica.stages).collect();
    let contexts: Vec<Option<&StageContext>> = stages.iter().map(|stage| stage.context.as_ref()).collect();
    let Some(first) = contexts[0] else {
        if contexts.iter().any(Option::is_some) {
            return Err(ExportError::megatron(
                "some stages split sequences and some do not: Megatron's context-parallel size is one for the whole model",
            ));
        }
        return Ok(None);
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
        let Some(context) = context else {
            return Err(ExportError::megatron(
                "some stages split sequences and some do not: Megatron's context-parallel size is one for the whole model",
            ));
        };
        if !even(context) {
            let shards: Vec<u32> = context.groups.iter().map(|group| group.tokens).collect();
            return Err(ExportError::megatron(format!(
                "a stage splits each sequence unevenly (shards of {shards:?} tokens, tokens and heads per device as \
                 the planner chose): Megatron cuts it into 2·cp equal chunks"
            )));
        }
        if (context.groups.len(), context.groups[0].device_tokens.len())
            != (first.groups.len(), first.groups[0].device_tokens.len())
        {
            return Err(ExportError::megatron(
                "stages split sequences over different numbers of devices: Megatron's context-parallel size is one for the whole model",
            ));
        }
    }
    Ok(Some(ContextDegrees {
        cp: first.groups.len(),
        hp: first.groups[0].device_tokens.len(),
        exchange: first.kv_exchange,
    }))
}

/// Megatron's two rank orders: tensor-parallel rank fastest, then context-parallel, then data
/// parallel before pipeline (the default, `tp-cp-ep-dp-pp`) or pipeline before data parallel
/// (`--use-tp-pp-dp-mapping`, `tp-cp-ep-pp-dp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RankOrder {
    DataFirst,
    PipelineFirst,
}

/// The plan's device of each rank in `order`: rank = tp + TP·(cp + CP·(dp + DP·pp)) by default,
/// tp + TP·(cp + CP·(pp + PP·dp)) with pipeline first.
fn rank_devices(plan: &Plan, context_size: usize, order: RankOrder) -> Vec<DeviceId> {
    let replicas = plan.replicas();
    let pipeline_ranks = plan.n_ranks(&replicas[0]);
    let stage_devices = |pp: usize, dp: usize| {
        let stage = &replicas[dp].stages[pp];
        debug_assert_eq!(stage.devices.len(), context_size * plan.tp() as usize);
        stage.devices.clone()
    };
    let (outer, inner) = match order {
        RankOrder::DataFirst => (pipeline_ranks, replicas.len()),
        RankOrder::PipelineFirst => (replicas.len(), pipeline_ranks),
    };
    let mut devices = Vec::new();
    for slow in 0..outer {
        for fast in 0..inner {
            let (pp, dp) = if order == RankOrder::DataFirst { (slow, fast) } else { (fast, slow) };
            devices.extend(stage_devices(pp, dp));
        }
    }
    devices
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
        check_layout(&layout, pipeline_ranks, plan.model().n_layers() as usize).map_err(ExportError::megatron)?;
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
                return Err(ExportError::megatron(
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
}

fn model_args(plan: &Plan, args: &mut Args) {
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
    if model.mlp() == MlpKind::SwiGlu {
        // A gated MLP is a Llama-style decoder: RMSNorm, rotary positions, no linear biases.
        args.flag("--swiglu");
        args.value("--normalization", "RMSNorm");
        args.value("--position-embedding-type", "rope");
        args.flag("--disable-bias-linear");
    }
    if model.qkv_bias() {
        args.flag("--add-qkv-bias");
    }
    if !model.tie_embeddings() {
        args.flag("--untie-embeddings-and-output-weights");
    }
    args.flag("--bf16");
}

impl MegatronExport {
    /// The arguments one per line, as a shell continues them.
    pub fn command_line(&self) -> String {
        self.args
            .iter()
            .map(|arg| match &arg.value {
                Some(value) if value.contains(' ') || value.contains('|') || value.contains('*') => {
                    format!("{} \"{value}\"", arg.flag)
                }
                Some(value) => format!("{} {value}", arg.flag),
                None => arg.flag.clone(),
            })
            .collect::<Vec<_>>()
            .join(" \\\n    ")
    }

    /// A bash script that starts this host's ranks with torchrun: which host is which is fixed by
    /// Megatron's rank order, so the script says how to list them and sets each host's GPUs.
    pub fn launch_script(&self) -> String {
        let hosts = &self.placement.hosts;
        let mut script = String::from("#!/usr/bin/env bash\n");
        script.push_str(&format!(
            "# Megatron-LM launch of a medley plan: {} ranks on {} hosts of {} GPUs.\n",
            self.world_size,
            hosts.len(),
            self.placement.procs_per_host
        ));
        let order = match self.args.iter().any(|arg| arg.flag == "--use-tp-pp-dp-mapping") {
            true => "pipeline, data-parallel: --use-tp-pp-dp-mapping",
            false => "data-parallel, pipeline",
        };
        script.push_str(&format!(
            "# Megatron's rank order is fixed: tensor-parallel rank fastest, then context-parallel, {order}.\n\
             # So the hosts must be listed in this order (host 0 is MASTER_ADDR), each with these GPUs:\n"
        ));
        for (idx, host) in hosts.iter().enumerate() {
            let gpus: Vec<String> = host.gpus.iter().map(ToString::to_string).collect();
            script.push_str(&format!(
                "#   host {idx}: the plan's node {} ({}), GPUs {}\n",
                host.node,
                host.device_type,
                gpus.join(",")
            ));
        }
        script.push_str(
            "# Run it on every host with NODE_RANK set to the host's position (under Slurm, SLURM_NODEID does when the\n\
             # nodelist is in this order) and MASTER_ADDR to host 0; extra arguments (data, tokenizer, ...) pass on.\n\
             set -euo pipefail\n\
             NODE_RANK=\"${NODE_RANK:-${SLURM_NODEID:?set NODE_RANK to this host's position}}\"\n\
             case \"$NODE_RANK\" in\n",
        );
        for (idx, host) in hosts.iter().enumerate() {
            let gpus: Vec<String> = host.gpus.iter().map(ToString::to_string).collect();
            script.push_str(&format!("    {idx}) export CUDA_VISIBLE_DEVICES={} ;;\n", gpus.join(",")));
        }
        script.push_str(&format!(
            "    *) echo \"NODE_RANK=$NODE_RANK: this plan has {} hosts\" >&2; exit 1 ;;\nesac\n",
            hosts.len()
        ));
        script.push_str(
            "# Megatron asks for it with tensor or context parallelism.\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n",
        );
        script.push_str(&format!(
            "exec torchrun --nnodes {} --nproc-per-node {} --node-rank \"$NODE_RANK\" \\\n    \
             --master-addr \"${{MASTER_ADDR:?set MASTER_ADDR to host 0}}\" --master-port \"${{MASTER_PORT:-6000}}\" \\\n    \
             pretrain_gpt.py \\\n    {} \\\n    \"$@\"\n",
            hosts.len(),
            self.placement.procs_per_host,
            self.command_line()
        ));
        script
    }
}
