//! `medley simulate`: run a plan's steps in the discrete-event simulator and report what they did.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::Args;
use medley_cost::{CostModel, Setting, StateFormat};
use medley_plan::baselines::{self, Degrees, megatron_plan};
use medley_plan::long_context::even_fixed;
use medley_plan::{Plan, PlanError};
use medley_sim::{SimConfig, simulate_steps};
use medley_spec::Recompute;

use crate::inputs::{SpecArgs, Specs, network_trace};
use crate::inputs::{load_plan, specs_of_plan};
use medley_report::sim_text;
use medley_report::text::count;

#[derive(Args, Debug, Clone)]
pub struct SimulateArgs {
    /// A plan file (from `medley plan -o`); without one, a homogeneous Megatron-style layout is
    /// built from --cluster, --model, the job flags and the degrees below.
    #[arg(long)]
    pub plan: Option<String>,
    #[command(flatten)]
    pub specs: SpecArgs,
    /// The what-if layout's degrees as `medley plan --fix` takes them (`tp=8,pp=4,dp=2`, with
    /// `vpp=V` or `cp=C`), instead of --tp, --pp, --dp, --vpp and --cp.
    #[arg(long, conflicts_with_all = ["plan", "tp", "pp", "dp", "vpp", "cp"])]
    pub fix: Option<Degrees>,
    /// Tensor-parallel degree of the what-if layout [default: 1; with none of --tp, --pp and
    /// --dp, the best uniform layout's].
    #[arg(long, conflicts_with = "plan")]
    pub tp: Option<u32>,
    /// Pipeline-parallel degree of the what-if layout [default: 1, or as --tp says].
    #[arg(long, conflicts_with = "plan")]
    pub pp: Option<u32>,
    /// Data-parallel degree of the what-if layout [default: the devices left, GPUs / (tp·pp)].
    #[arg(long, conflicts_with = "plan")]
    pub dp: Option<u32>,
    /// Virtual pipeline stages per rank (interleaved 1F1B, Narayanan et al. 2021); over 1 turns
    /// the default 1F1B schedule into `interleaved`.
    #[arg(long, default_value_t = 1, conflicts_with = "plan")]
    pub vpp: u32,
    /// Context-parallel degree of the what-if layout: Megatron-LM's `--context-parallel-size`
    /// (even head–tail shards, keys and values around a ring, tp = 1).
    #[arg(long, default_value_t = 1, conflicts_with = "plan", value_parser = clap::value_parser!(u32).range(1..))]
    pub cp: u32,
    /// Accepted for Megatron-style command lines: medley always pairs tensor parallelism with
    /// sequence parallelism (Korthikanti et al. 2022).
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Steps to simulate; the network trace and the adaptive schedule carry over between them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub steps: u32,
    /// Available bandwidth of inter-node links over time: constant:F,
    /// on-off:full=T,reduced=T,fraction=F, random:seed=N,full=T,reduced=T,fraction=F, or a CSV
    /// file of time_s,fraction rows.
    #[arg(long)]
    pub network_trace: Option<String>,
    /// Write a Chrome/Perfetto timeline (open it at ui.perfetto.dev) to this file.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &SimulateArgs) -> Result<ExitCode> {
    let (specs, plan) = match &args.plan {
        Some(path) => {
            let mut plan = load_plan(path)?;
            if let Some(schedule) = args.specs.schedule {
                plan = plan.with_schedule(schedule).with_context(|| format!("--schedule {schedule} with {path}"))?;
            }
            (specs_of_plan(&args.specs, path, &plan)?, plan)
        }
        None => what_if(&with_fixed_degrees(args)?)?,
    };
    let config = SimConfig { network_trace: args.network_trace.as_deref().map(network_trace).transpose()? };
    let schedule = plan.schedule();
    let report = match &args.trace {
        Some(path) => {
            let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
            let mut out = BufWriter::new(file);
            let report = simulate_steps(&plan, &specs.calibration, &config, schedule, args.steps, Some(&mut out));
            out.flush().with_context(|| format!("cannot write {}", path.display()))?;
            report
        }
        None => simulate_steps(&plan, &specs.calibration, &config, schedule, args.steps, None),
    }?;
    if args.json {
        crate::emit(&(serde_json::to_string_pretty(&sim_text::json(&report))? + "\n"))?;
    } else {
        crate::emit(&(sim_text::text(specs.cluster.n_gpus(), &plan, &report) + "\n"))?;
        if let Some(path) = &args.trace {
            std::io::stdout().flush()?;
            tracing::info!("timeline written to {} (open it at https://ui.perfetto.dev)", path.display());
        }
    }
    if !report.fits {
        std::io::stdout().flush()?;
        crate::say_error("the plan does not fit in memory (see the peak memory per device type)");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// `args` with the degrees of `--fix` as the flags that give them one by one.
fn with_fixed_degrees(args: &SimulateArgs) -> Result<SimulateArgs> {
    let Some(degrees) = args.fix else { return Ok(args.clone()) };
    if degrees.hp != 1 {
        bail!("--fix {degrees}: simulate's what-if layouts split sequences by context parallelism only; leave out hp");
    }
    Ok(SimulateArgs {
        tp: Some(degrees.tp),
        pp: Some(degrees.pp),
        dp: Some(degrees.dp),
        vpp: degrees.vpp,
        cp: degrees.cp,
        fix: None,
        ..args.clone()
    })
}

/// The homogeneous Megatron-style plan the flags describe. Micro-batch size and recompute, where
/// the job leaves them open, are chosen as the planner chooses them: the fastest that fits.
/// Without any degree, the layout is the best uniform one (the planner's `uniform` baseline).
fn what_if(args: &SimulateArgs) -> Result<(Specs, Plan)> {
    let specs = args.specs.resolve()?;
    if args.cp > 1 {
        return context_what_if(args, specs);
    }
    if args.tp.is_none() && args.pp.is_none() && args.dp.is_none() && args.vpp == 1 {
        let Some(uniform) = baselines::uniform(&specs.cluster, &specs.model, &specs.job, &specs.calibration) else {
            bail!(
                "no uniform layout of the cluster's {} fits {}; give the layout with --tp, --pp and --dp, or run \
                 `medley plan` to search the uneven ones",
                count(specs.cluster.n_gpus() as usize, "GPU"),
                specs.model.name()
            );
        };
        tracing::info!("{}", chosen("the best uniform layout", &uniform.plan));
        return Ok((specs, uniform.plan));
    }
    let (tp, pp) = (args.tp.unwrap_or(1), args.pp.unwrap_or(1));
    let n_gpus = specs.cluster.n_gpus();
    let dp = match args.dp {
        Some(dp) => dp,
        None if n_gpus.is_multiple_of(tp * pp) => n_gpus / (tp * pp),
        None => {
            bail!("--tp {tp} × --pp {pp} does not divide the cluster's {}; give --dp", count(n_gpus as usize, "GPU"))
        }
    };
    let degrees = Degrees { vpp: args.vpp, ..Degrees::new(tp, pp, dp) };
    let open = specs.job.micro_batch().is_none() || specs.job.recompute().is_none();
    match baselines::fixed(&specs.cluster, &specs.model, &specs.job, &specs.calibration, degrees) {
        Ok(candidate) => {
            if open {
                tracing::info!("{}", chosen("the fastest setting that fits", &candidate.plan));
            }
            Ok((specs, candidate.plan))
        }
        // Shown anyway, at its smallest memory, so the memory table says by how much.
        Err(PlanError::NothingFits(reason)) => {
            let setting = Setting {
                micro_batch: specs.job.micro_batch().unwrap_or(1),
                tp,
                recompute: specs.job.recompute().unwrap_or(Recompute::Full),
            };
            tracing::warn!(
                "{reason}; simulated at micro-batch {} and recompute {}",
                setting.micro_batch,
                setting.recompute
            );
            let cost = CostModel::new(&specs.model, specs.job.seq_len(), &specs.calibration)
                .with_attention(specs.job.attention())
                .with_states(StateFormat::of_job(&specs.job));
            let plan = megatron_plan(&specs.cluster, &cost, &specs.job, setting, degrees)?;
            Ok((specs, plan))
        }
        Err(err) => Err(err.into()),
    }
}

/// Megatron-LM's context parallelism as the flags give it: `--cp` equal shards around a ring,
/// `--pp` stages, the devices left as replicas.
fn context_what_if(args: &SimulateArgs, specs: Specs) -> Result<(Specs, Plan)> {
    if args.tp.is_some_and(|tp| tp != 1) || args.vpp != 1 {
        bail!(
            "--cp {}: medley's context-parallel stages run without tensor parallelism or interleaving: use --tp 1",
            args.cp
        );
    }
    let (cp, pp) = (args.cp, args.pp.unwrap_or(1));
    let n_gpus = specs.cluster.n_gpus();
    let dp = match args.dp {
        Some(dp) => dp,
        None if n_gpus.is_multiple_of(cp * pp) => n_gpus / (cp * pp),
        None => {
            bail!("--cp {cp} × --pp {pp} does not divide the cluster's {}; give --dp", count(n_gpus as usize, "GPU"))
        }
    };
    let candidate = even_fixed(&specs.cluster, &specs.model, &specs.job, &specs.calibration, cp, 1, pp, dp)?;
    match candidate.prediction.fits {
        true => tracing::info!("{}", chosen("the fastest setting that fits", &candidate.plan)),
        // Shown anyway, at its smallest memory, so the memory table says by how much.
        false => tracing::warn!("{}", chosen("nothing fits; simulated at its smallest memory", &candidate.plan)),
    }
    Ok((specs, candidate.plan))
}

/// What the what-if layout chose where the flags left it open.
fn chosen(what: &str, plan: &Plan) -> String {
    let pp = plan.replicas().first().map_or(0, |replica| plan.n_ranks(replica));
    let vpp = if plan.virtual_stages() > 1 { format!(",vpp={}", plan.virtual_stages()) } else { String::new() };
    format!(
        "medley simulate: {what}: tp={},pp={pp},dp={}{vpp}, micro-batch {}, recompute {}",
        plan.tp_label(),
        plan.replicas().len(),
        plan.micro_batch(),
        plan.recompute()
    )
}
