//! `medley bench memory`: each worker's measured peak memory (`VmHWM`) on real training runs of a
//! model whose states dominate, beside the runtime's estimate (what `medley train` checks a run
//! against this machine's memory with) and the cost model's prediction for the same plan priced
//! in fp32, the format the runtime keeps everything in — whole optimizer states against ZeRO-1,
//! and tensor parallelism.

use anyhow::{Context, Result};
use clap::Args;
use medley_cost::Calibration;
use medley_plan::baselines::{Degrees, fixed};
use medley_plan::{Plan, evaluate};
use medley_runtime::{RankLayout, worker_memory};
use medley_spec::{Cluster, GradReduce, JobParts, JobSpec, MlpKind, ModelParts, ModelSpec, Precision, Schedule};
use serde::Serialize;

use super::train::{RunTweaks, run_steps};
use medley_report::text::{percent, right, table};

#[derive(Args, Debug)]
pub struct MemoryBenchArgs {
    /// Steps per plan: the peak is the last step's.
    #[arg(long, default_value_t = 2)]
    pub steps: u64,
    /// Print the rows as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A Llama-style model of 159M parameters: at 128 tokens its states (26 bytes a parameter
/// without ZeRO-1) outweigh its activations several times, so the layouts' savings show.
fn states_heavy_model() -> Result<ModelSpec> {
    let parts = ModelParts {
        name: "bench-159m".into(),
        n_layers: 8,
        hidden: 1024,
        n_heads: 8,
        n_kv_heads: 4,
        ffn_hidden: 2816,
        vocab: 32_000,
        mlp: MlpKind::SwiGlu,
        experts: None,
        tie_embeddings: false,
        ..ModelParts::default()
    };
    Ok(ModelSpec::new(parts, "medley bench memory")?)
}

#[derive(Serialize)]
struct Row {
    plan: String,
    worker: usize,
    measured_mib: f64,
    estimated_mib: f64,
    /// The runtime's estimate over the measured peak, minus one.
    estimate_error: f64,
    cost_model_mib: f64,
    cost_model_error: f64,
}

const MIB: f64 = (1 << 20) as f64;

pub fn run(args: &MemoryBenchArgs) -> Result<()> {
    let model = states_heavy_model()?;
    let cluster = Cluster::from_inline("2xh100", Default::default(), Default::default())?;
    let calibration = Calibration::default();
    let job = |zero1| -> Result<JobSpec> {
        let parts = JobParts {
            seq_len: 128,
            global_batch: 2,
            micro_batch: Some(1),
            precision: Precision::Fp32,
            grad_reduce: Some(GradReduce::Fp32),
            zero1,
            overlap_grad_reduce: false,
            schedule: Schedule::default(),
            ..JobParts::default()
        };
        Ok(JobSpec::new(parts, "medley bench memory")?)
    };
    let plan = |name: &str, degrees: Degrees, zero1: bool| -> Result<(String, Plan)> {
        let candidate =
            fixed(&cluster, &model, &job(zero1)?, &calibration, degrees).with_context(|| format!("planning {name}"))?;
        Ok((name.to_string(), candidate.plan))
    };
    let plans = [
        plan("one device", Degrees::new(1, 1, 1), false)?,
        plan("dp 2", Degrees::new(1, 1, 2), false)?,
        plan("dp 2, ZeRO-1", Degrees::new(1, 1, 2), true)?,
        plan("tp 2", Degrees::new(2, 1, 1), false)?,
    ];
    let mut rows = Vec::new();
    for (name, plan) in &plans {
        let steps = run_steps(plan, &calibration, &name.replace([' ', ','], "-"), args.steps, RunTweaks::default())?;
        let last = steps.last().context("no steps")?;
        let layouts = RankLayout::all(plan, &calibration)?;
        let predicted = evaluate(plan, &calibration);
        for (layout, rank) in layouts.iter().zip(&last.ranks) {
            let measured_mib = rank.peak_memory_mib.context("the workers report no peak memory (no /proc)")?;
            let estimated_mib = worker_memory(plan, layout, plan.schedule())?.total_bytes() / MIB;
            let cost_model_mib = predicted.peak_memory_by_device_gib[&layout.device.name] * 1024.0;
            rows.push(Row {
                plan: name.clone(),
                worker: layout.job_rank,
                measured_mib,
                estimated_mib,
                estimate_error: estimated_mib / measured_mib - 1.0,
                cost_model_mib,
                cost_model_error: cost_model_mib / measured_mib - 1.0,
            });
        }
    }
    if args.json {
        return crate::emit(&serde_json::to_string_pretty(&rows)?);
    }
    let mut out = table(&[
        "plan",
        "worker",
        "measured MiB",
        "runtime's estimate",
        "vs measured",
        "cost model (fp32)",
        "vs measured",
    ]);
    for row in &rows {
        out.add_row(vec![
            right(&row.plan),
            right(row.worker),
            right(format!("{:.0}", row.measured_mib)),
            right(format!("{:.0}", row.estimated_mib)),
            right(percent(row.estimate_error)),
            right(format!("{:.0}", row.cost_model_mib)),
            right(percent(row.cost_model_error)),
        ]);
    }
    let title = format!(
        "Peak memory per worker (VmHWM after {} steps) of {} at 128 tokens, fp32, on this machine's CPU. The \
         runtime's estimate is what `medley train` checks a run against this machine's memory with; the cost model \
         prices a GPU's memory for the same plan: 16 bytes a parameter in fp32 and a fixed {:.0} GiB workspace (context, \
         libraries), where this runtime keeps burn's copy of each weight and gradient beside its own and no workspace, \
         so only its layouts' differences compare:",
        args.steps,
        model.name(),
        medley_cost::memory::WORKSPACE_BYTES / (1u64 << 30) as f64
    );
    crate::emit(&format!("{title}\n{out}"))
}
