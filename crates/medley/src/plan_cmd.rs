//! `medley plan`: search (or evaluate a given layout), compare with the baselines, report.

use std::fs;
use std::path::PathBuf;
use std::process::ExitCode;

use std::io::Write;

use anyhow::{Context, Result, bail};
use clap::Args;
use medley_export::expressible::{EXPRESSIBLE_POOL, Framework, restrict};
use medley_plan::baselines::{self, Degrees, named_baselines};
use medley_plan::{Candidate, PlanError, SearchOptions, evaluate, search};
use medley_sim::rank::{RANKED_CANDIDATES, rank_by_simulation};
use serde_json::json;

use crate::inputs::{SpecArgs, Specs, load_plan, specs_of_plan};
use medley_report::plan_text::{self, PlanReport};

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub specs: SpecArgs,
    /// How many ranked plans to show (at least --pick).
    #[arg(long, default_value_t = RANKED_CANDIDATES)]
    pub top: usize,
    /// Print one JSON object (plan, prediction, baselines) instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Write the chosen plan (the best, or --pick's) as JSON to this file.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    /// Which of the ranked plans -o writes and --json describes, counting from 1.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub pick: u32,
    /// Evaluate a homogeneous Megatron-style layout instead of searching, e.g. tp=8,pp=4,dp=2;
    /// add vpp=V for V model chunks per pipeline rank under interleaved 1F1B (tp=8,pp=8,dp=16,vpp=2).
    /// With cp=N (groups per stage) and hp=N (devices per group, inside a node), the best
    /// context-parallel plan with those degrees: the planner still splits sequences unevenly
    /// (tp=1,pp=1,dp=1,cp=4).
    #[arg(long, conflicts_with = "plan")]
    pub fix: Option<Degrees>,
    /// Evaluate a plan file instead of searching (its cluster, model and job are used).
    #[arg(long)]
    pub plan: Option<String>,
    /// Only plans this framework can run (`medley export`), and what that costs against the best
    /// plan: `megatron` or `torchtitan` (which has no ZeRO-1: its search plans without it).
    #[arg(long, conflicts_with_all = ["plan", "fix"])]
    pub expressible: Option<Framework>,
}

pub fn run(args: &PlanArgs) -> Result<ExitCode> {
    let given = args.plan.as_deref().map(|path| load_plan(path).map(|plan| (path, plan))).transpose()?;
    let specs = match &given {
        Some((path, plan)) => specs_of_plan(&args.specs, path, plan)?,
        None => args.specs.resolve()?,
    };
    let started = std::time::Instant::now();
    let found = match (given, args.fix) {
        (Some((_, plan)), _) => {
            let prediction = evaluate(&plan, &specs.calibration);
            Ok((vec![Candidate { plan, prediction }], None))
        }
        (None, Some(degrees)) => {
            baselines::fixed(&specs.cluster, &specs.model, &specs.job, &specs.calibration, degrees)
                .map(|candidate| (vec![candidate], None))
        }
        (None, None) => {
            let top = args.top.max(args.pick as usize);
            let pool = if args.expressible.is_some() { top.max(EXPRESSIBLE_POOL) } else { top };
            let options = SearchOptions { top: pool, ..SearchOptions::default() };
            search(&specs.cluster, &specs.model, &specs.job, &specs.calibration, &options).and_then(|outcome| {
                match args.expressible {
                    Some(framework) => expressible(&specs, outcome.candidates, framework, top, &options),
                    None => Ok(outcome.candidates),
                }
                .map(|candidates| (candidates, Some(outcome.layouts_priced)))
            })
        }
    };
    let (candidates, layouts_priced) = match found {
        Ok(found) => found,
        Err(err @ PlanError::NothingFits(_)) => {
            if args.json {
                crate::emit(
                    &(serde_json::to_string_pretty(&json!({"fits": false, "error": err.to_string()}))? + "\n"),
                )?;
            }
            crate::say_error(&err.to_string());
            return Ok(ExitCode::from(1));
        }
        Err(err) => return Err(err.into()),
    };
    let search_s = started.elapsed().as_secs_f64();
    let confirmed = rank_by_simulation(candidates, &specs.calibration).context("simulating the candidates")?;
    let candidates = &confirmed.candidates;
    let picked = args.pick as usize - 1;
    if picked >= candidates.len() {
        bail!(
            "--pick {}: only {} to pick from",
            args.pick,
            medley_report::text::count(candidates.len(), "ranked plan")
        );
    }
    let baselines = named_baselines(&specs.cluster, &specs.model, &specs.job, &specs.calibration);
    if let Some(path) = &args.output {
        let json = serde_json::to_string_pretty(&candidates[picked].plan)?;
        fs::write(path, json + "\n").with_context(|| format!("cannot write {}", path.display()))?;
    }
    let report = PlanReport {
        cluster: &specs.cluster,
        model: &specs.model,
        job: &specs.job,
        candidates,
        picked,
        confirmed: &confirmed,
        baselines: &baselines,
        layouts_priced,
        search_s,
    };
    if args.json {
        crate::emit(&(serde_json::to_string_pretty(&plan_text::json(&report))? + "\n"))?;
    } else {
        crate::emit(&plan_text::text(&report))?;
        std::io::stdout().flush()?;
        match &args.output {
            Some(path) => tracing::info!("plan #{} written to {}", args.pick, path.display()),
            None => tracing::info!(
                "write this plan as JSON with -o plan.json, another with --pick N (or print everything with --json)"
            ),
        }
    }
    // Only a given plan can fail to fit here: the search and --fix return fitting plans.
    if !candidates[picked].prediction.fits {
        std::io::stdout().flush()?;
        crate::say_error("this plan does not fit in memory (see the peak memory per device type)");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// The best plans `framework` can run, at most `top`, with what the restriction costs said.
fn expressible(
    specs: &Specs,
    candidates: Vec<Candidate>,
    framework: Framework,
    top: usize,
    options: &SearchOptions,
) -> Result<Vec<Candidate>, PlanError> {
    let (cluster, model, job, calibration) = (&specs.cluster, &specs.model, &specs.job, &specs.calibration);
    if !framework.has_zero1() && job.zero1() {
        tracing::info!(
            "{framework} has no ZeRO-1 (its FSDP shards parameters and gradients too): searching without it"
        );
    } else if job.shard_gradients() {
        tracing::info!("{framework} does not shard gradients with the optimizer states (ZeRO-2): searching without it");
    }
    let mut restricted = restrict(cluster, model, job, calibration, candidates, framework, options)?;
    restricted.candidates.truncate(top);
    tracing::info!(
        "restricted to plans {framework} can run: the best takes {:.3} s a step, {:.2}× the unrestricted plan's {:.3} s",
        restricted.candidates[0].prediction.step_time_s,
        restricted.cost,
        restricted.unrestricted_s
    );
    Ok(restricted.candidates)
}
