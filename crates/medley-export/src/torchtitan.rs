//! A plan as torchtitan (pytorch/torchtitan, its configuration as of August 2026) runs it:
//! `torchtitan.train` started from the llama3 recipe of the plan's model, the parallel degrees,
//! the uneven stages (`module_fqns_per_model_part`), the schedule and the batch as CLI overrides,
//! and the activation checkpointing, which torchtitan takes only from a config function, from a
//! small recipe module the launch script writes.
//!
//! torchtitan's device mesh is `pp, dp_replicate, dp_shard, cp, tp` (tensor-parallel rank
//! fastest); data parallelism always goes through FSDP's machinery, replicated (shard degree
//! one) for a plan without ZeRO-1; context parallelism is PyTorch's ring over even head–tail
//! shards, with no head parallelism. A plan outside that is refused naming what differs.

use medley_plan::{Plan, Stage};
use medley_spec::{
    AttentionKernel, GradReduce, MlpKind, ModelSpec, Precision, Recompute, RopeScaling, Schedule, ScheduleKind,
};
use serde::Serialize;

use crate::common::{
    Arg, Args, EnvVar, RankOrder, check_common, command_line, context_degrees, environment_lines, matmul_environment,
    rank_devices,
};
use crate::placement::{Placement, place};
use crate::{ExportError, TORCHTITAN};

/// What a torchtitan user runs for a plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TorchtitanExport {
    pub world_size: u32,
    /// torchtitan's llama3 recipe (in `torchtitan.models.llama3.config_registry`) whose model the
    /// plan trains: the recipe the launch script starts from.
    pub base_config: &'static str,
    /// The activation checkpointing policy the recipe module sets: `none`, `selective` or `full`.
    pub activation_checkpoint: &'static str,
    /// The CLI overrides of `torchtitan.train`. A value of several words (a list) is several
    /// arguments: `module_fqns_per_model_part` takes one comma-separated word per model part.
    pub overrides: Vec<Arg>,
    /// Which host and GPU each rank of torchtitan's order runs on.
    pub placement: Placement,
    /// What the launch exports first (how a tf32 or fp32 plan's matmuls run).
    pub environment: Vec<EnvVar>,
}

/// The llama3 recipes torchtitan ships and their models' shapes (`model_registry`'s "8B", "70B",
/// "405B"): layers, hidden, heads, KV heads, FFN width, vocabulary.
const RECIPES: [(&str, [u32; 6]); 3] = [
    ("llama3_8b", [32, 4096, 32, 8, 14336, 128256]),
    ("llama3_70b", [80, 8192, 64, 8, 28672, 128256]),
    ("llama3_405b", [126, 16384, 128, 8, 53248, 128256]),
];

/// torchtitan's overrides, recipe and rank placement for `plan`, or why it cannot run it.
pub fn torchtitan(plan: &Plan) -> Result<TorchtitanExport, ExportError> {
    check_common(plan, TORCHTITAN)?;
    let base_config = recipe(plan.model())?;
    if plan.zero1() {
        return Err(ExportError::refused(
            TORCHTITAN,
            "the plan shards only the optimizer state (ZeRO-1); torchtitan shards data-parallel state with FSDP, which \
             shards parameters and gradients too and moves more data a step: plan with --no-zero1 (or zero1 = false in \
             the job)",
        ));
    }
    if plan.precision() == Precision::Fp16Mixed {
        return Err(ExportError::refused(
            TORCHTITAN,
            "the plan trains in fp16-mixed; torchtitan's mixed precision takes bfloat16 or float32 parameters \
             (training.mixed_precision_param) and has no loss scaling for fp16",
        ));
    }
    if plan.grad_reduce() != GradReduce::Fp32 {
        return Err(ExportError::refused(
            TORCHTITAN,
            format!(
                "the plan reduces gradients in {}; torchtitan's FSDP reduces them in float32 only \
                 (training.mixed_precision_reduce): plan with --grad-reduce fp32",
                plan.grad_reduce()
            ),
        ));
    }
    if plan.attention() == AttentionKernel::Unfused {
        return Err(ExportError::refused(
            TORCHTITAN,
            "the plan prices an unfused attention kernel; torchtitan's llama3 runs attention through PyTorch's fused \
             SDPA or FlexAttention: plan with --attention fused",
        ));
    }
    let devices = rank_devices(plan, RankOrder::DataFirst);
    let placement = place(plan.cluster(), &devices).map_err(|reason| ExportError::refused(TORCHTITAN, reason))?;
    let mut args = Args::default();
    parallel_overrides(plan, &mut args)?;
    batch_overrides(plan, &mut args);
    check_overrides(&args.0, devices.len(), plan.model().n_layers())
        .map_err(|reason| ExportError::refused(TORCHTITAN, reason))?;
    let activation_checkpoint = match plan.recompute() {
        Recompute::None => "none",
        Recompute::Selective => "selective",
        Recompute::Full => "full",
    };
    Ok(TorchtitanExport {
        world_size: devices.len() as u32,
        base_config,
        activation_checkpoint,
        overrides: args.0,
        placement,
        environment: matmul_environment(plan),
    })
}

/// torchtitan takes a model's shape only from a recipe: the plan's model must be one it ships.
fn recipe(model: &ModelSpec) -> Result<&'static str, ExportError> {
    let shape =
        [model.n_layers(), model.hidden(), model.n_heads(), model.n_kv_heads(), model.ffn_hidden(), model.vocab()];
    let llama =
        model.mlp() == MlpKind::SwiGlu && !model.qkv_bias() && !model.tie_embeddings() && !model.has_own_head_dim();
    match RECIPES.iter().find(|(_, known)| *known == shape).filter(|_| llama) {
        Some((name, _)) => {
            check_recipe_numerics(model)?;
            Ok(name)
        }
        None => Err(ExportError::refused(
            TORCHTITAN,
            format!(
                "torchtitan takes a model's shape only from a recipe, and its llama3 recipes are 8B, 70B and 405B; \
                 {} ({} layers, hidden {}, {} heads, {} KV heads, FFN {}, vocabulary {}) is none of them",
                model.name(),
                shape[0],
                shape[1],
                shape[2],
                shape[3],
                shape[4],
                shape[5]
            ),
        )),
    }
}

/// The llama3 recipes' RoPE and norm (`ComplexRoPE.Config(theta=500000, scaling="llama")` with
/// its defaults factor 8, low 1, high 4, context 8,192; `RMSNorm`'s ε 1e-5): a model of a
/// recipe's shape with other numerics would train as another model.
fn check_recipe_numerics(model: &ModelSpec) -> Result<(), ExportError> {
    let recipe = (500_000.0, Some(RopeScaling::llama3(8.0)), 1e-5);
    let planned = (model.rope_theta(), model.rope_scaling(), model.norm_eps());
    if planned == recipe {
        return Ok(());
    }
    let scaling = |scaling: Option<RopeScaling>| match scaling {
        None => "none".to_string(),
        Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
            format!("llama3 {factor}/{low_freq_factor}/{high_freq_factor}/{original_max_position_embeddings}")
        }
    };
    Err(ExportError::refused(
        TORCHTITAN,
        format!(
            "its llama3 recipes train with RoPE base {}, scaling {} and norm ε {}; {} has base {}, scaling {} and ε {}",
            recipe.0,
            scaling(recipe.1),
            recipe.2,
            model.name(),
            planned.0,
            scaling(planned.1),
            planned.2
        ),
    ))
}

/// torchtitan's name of the plan's schedule: single-stage schedules run one stage a rank, looped
/// ones at least two.
fn schedule_name(plan: &Plan) -> Result<&'static str, ExportError> {
    let looped = plan.virtual_stages() > 1;
    match (plan.schedule(), looped) {
        (Schedule::Fixed(ScheduleKind::Gpipe), false) => Ok("GPipe"),
        (Schedule::Fixed(ScheduleKind::OneFOneB), false) => Ok("1F1B"),
        (Schedule::Fixed(ScheduleKind::Interleaved), true) => Ok("Interleaved1F1B"),
        (other, _) => Err(ExportError::refused(
            TORCHTITAN,
            format!(
                "its schedule is {other} with {} stages a rank; torchtitan runs GPipe or 1F1B with one stage a rank, or \
                 Interleaved1F1B with several",
                plan.virtual_stages()
            ),
        )),
    }
}

fn parallel_overrides(plan: &Plan, args: &mut Args) -> Result<(), ExportError> {
    let replica = &plan.replicas()[0];
    let pipeline_ranks = plan.n_ranks(replica);
    args.value("--parallelism.data_parallel_replicate_degree", plan.replicas().len());
    args.value("--parallelism.data_parallel_shard_degree", 1);
    args.value("--parallelism.tensor_parallel_degree", plan.tp());
    let context = context_degrees(plan, TORCHTITAN)?;
    if let Some(context) = context.filter(|context| context.hp > 1) {
        return Err(ExportError::refused(
            TORCHTITAN,
            format!(
                "the plan splits heads over {} devices (head parallelism, Ulysses); torchtitan's context parallelism \
                 splits only sequences, over a ring",
                context.hp
            ),
        ));
    }
    args.value("--parallelism.context_parallel_degree", context.map_or(1, |context| context.cp));
    args.value("--parallelism.pipeline_parallel_degree", pipeline_ranks);
    if pipeline_ranks > 1 {
        args.value("--parallelism.pipeline_parallel_schedule", schedule_name(plan)?);
        args.value("--parallelism.num_pp_microbatches", replica.n_micro_batches);
        args.value("--parallelism.module_fqns_per_model_part", model_parts(&replica.stages));
    }
    Ok(())
}

/// The stages in layer order as torchtitan's module names: one word per stage, its modules
/// comma-separated, the embedding in the first and the final norm and output in the last.
fn model_parts(stages: &[Stage]) -> String {
    let last = stages.len() - 1;
    let part = |(idx, stage): (usize, &Stage)| {
        let mut modules = Vec::new();
        if idx == 0 {
            modules.push("tok_embeddings".to_string());
        }
        modules.extend((stage.layers.start..stage.layers.end).map(|layer| format!("layers.{layer}")));
        if idx == last {
            modules.extend(["norm".to_string(), "lm_head".to_string()]);
        }
        modules.join(",")
    };
    stages.iter().enumerate().map(part).collect::<Vec<_>>().join(" ")
}

/// Tokens, as torchtitan counts the batch: a micro-batch's per data-parallel rank and a step's.
fn batch_overrides(plan: &Plan, args: &mut Args) {
    let seq_len = u64::from(plan.seq_len());
    args.value("--training.max_context_length", seq_len);
    args.value("--training.num_tokens_per_microbatch_per_dp_rank", u64::from(plan.micro_batch()) * seq_len);
    args.value("--training.num_tokens_per_train_step", u64::from(plan.global_batch()) * seq_len);
    // Said either way: torchtitan's default is bfloat16 parameters.
    let parameters = if plan.precision().is_mixed() { "bfloat16" } else { "float32" };
    args.value("--training.mixed_precision_param", parameters);
    args.value("--training.mixed_precision_reduce", "float32");
}

/// torchtitan's own checks of these overrides, read back from them: the degrees multiply to the
/// world size (`ParallelDims._validate`), the model parts are a multiple of the pipeline degree,
/// one a rank for GPipe and 1F1B and at least two for Interleaved1F1B
/// (`_get_pipeline_metadata`), every module of the model in exactly one part in order (the
/// pipeline split), and a step's tokens a whole number of gradient-accumulation iterations (the
/// trainer).
pub fn check_overrides(overrides: &[Arg], world_size: usize, n_layers: u32) -> Result<(), String> {
    let text = |name: &str| {
        let flag = format!("--{name}");
        overrides.iter().find(|arg| arg.flag == flag).and_then(|arg| arg.value.as_deref())
    };
    let number = |name: &str| -> Result<u64, String> {
        let value = text(name).ok_or_else(|| format!("--{name} is missing"))?;
        value.parse().map_err(|_| format!("--{name} {value} is not a count"))
    };
    let degrees = [
        "parallelism.data_parallel_replicate_degree",
        "parallelism.data_parallel_shard_degree",
        "parallelism.context_parallel_degree",
        "parallelism.tensor_parallel_degree",
        "parallelism.pipeline_parallel_degree",
    ];
    let product = degrees.iter().map(|name| number(name)).product::<Result<u64, String>>()?;
    if product != world_size as u64 {
        return Err(format!("the parallel degrees multiply to {product}, not the world size {world_size}"));
    }
    let (pp, dp) = (number(degrees[4])?, number(degrees[0])? * number(degrees[1])?);
    let mut pp_microbatches = 1;
    if pp > 1 {
        pp_microbatches = number("parallelism.num_pp_microbatches")?;
        let parts: Vec<&str> = text("parallelism.module_fqns_per_model_part").unwrap_or("").split(' ').collect();
        let per_rank = parts.len() as u64 / pp;
        let looped = text("parallelism.pipeline_parallel_schedule") == Some("Interleaved1F1B");
        if !(parts.len() as u64).is_multiple_of(pp) || (looped && per_rank < 2) || (!looped && per_rank != 1) {
            return Err(format!(
                "{} model parts on {pp} pipeline ranks under {}: torchtitan wants one a rank, or at least two with a \
                 looped schedule",
                parts.len(),
                text("parallelism.pipeline_parallel_schedule").unwrap_or("no schedule")
            ));
        }
        let modules: Vec<&str> = parts.iter().flat_map(|part| part.split(',')).collect();
        let mut expected = vec!["tok_embeddings".to_string()];
        expected.extend((0..n_layers).map(|layer| format!("layers.{layer}")));
        expected.extend(["norm".to_string(), "lm_head".to_string()]);
        if modules != expected {
            return Err("the model parts do not hold every module of the model once, in order".into());
        }
    }
    let per_iteration = number("training.num_tokens_per_microbatch_per_dp_rank")? * pp_microbatches * dp;
    let step = number("training.num_tokens_per_train_step")?;
    if !step.is_multiple_of(per_iteration) {
        return Err(format!("{step} tokens a step are not a whole number of iterations of {per_iteration}"));
    }
    Ok(())
}

impl TorchtitanExport {
    /// The overrides one per line, as a shell continues them.
    pub fn command_line(&self) -> String {
        command_line(&self.overrides)
    }

    /// The recipe module the launch script writes: the base recipe with the plan's activation
    /// checkpointing (the one setting torchtitan's CLI does not take).
    pub fn recipe_module(&self) -> String {
        let policy = match self.activation_checkpoint {
            "full" => "FullAC.Config()",
            "selective" => "SelectiveAC.Config()",
            _ => "None",
        };
        format!(
            "from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC\n\
             from torchtitan.models.llama3.config_registry import {base}\n\n\n\
             def medley_plan():\n    \
             config = {base}()\n    \
             config.activation_checkpoint = {policy}\n    \
             return config\n",
            base = self.base_config
        )
    }

    /// A bash script that starts this host's ranks with torchrun: torchtitan's rank order is
    /// fixed, so the script says how to list the hosts and sets each host's GPUs.
    pub fn launch_script(&self) -> String {
        let mut script = String::from("#!/usr/bin/env bash\n");
        script.push_str(&format!(
            "# torchtitan launch of a medley plan: {} ranks on {} hosts of {} GPUs, from torchtitan's {}.\n\
             # torchtitan's rank order is fixed: tensor-parallel rank fastest, then context-parallel, data-parallel,\n\
             # pipeline.\n",
            self.world_size,
            self.placement.hosts.len(),
            self.placement.procs_per_host,
            self.base_config
        ));
        script.push_str(&self.placement.host_setup());
        script.push_str(&environment_lines(&self.environment));
        script.push_str(&format!(
            "# torchtitan takes activation checkpointing only from a config function: this recipe starts from\n\
             # {} and sets the plan's ({}); the overrides below set every parallel degree and the batch.\n\
             recipe_dir=\"$(mktemp -d)\"\n\
             cat > \"$recipe_dir/medley_recipe.py\" <<'PY'\n{}PY\n\
             export PYTHONPATH=\"$recipe_dir${{PYTHONPATH:+:$PYTHONPATH}}\"\n",
            self.base_config,
            self.activation_checkpoint,
            self.recipe_module()
        ));
        script.push_str(
            &self.placement.torchrun(
                "-m torchtitan.train \\\n    --module medley_recipe --config medley_plan",
                &self.command_line(),
            ),
        );
        script
    }
}
