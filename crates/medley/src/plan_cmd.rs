//! `medley plan`: search (or evaluate a given layout), compare with the baselines, report.

use std::fs;
use std::path::PathBuf;
use std::process::ExitCode;

use std::io::Write;

use anyhow::{Context, Result, bail};
use clap::Args;
use medley_cost::Calibration;
use medley_plan::baselines::{self, Baselines, Degrees};
use medley_plan::long_context::{EvenBaselines, LONG_CONTEXT_TOKENS};
use medley_plan::{Candidate, Plan, PlanError, PlanParts, SearchOptions, evaluate, search};
use medley_sim::{SimConfig, StepReport, simulate_steps};
use medley_spec::{JobParts, JobSpec};
use rayon::prelude::*;
use serde_json::json;

use crate::inputs::{SpecArgs, Specs, check_calibration_names, read};
use crate::render::{self, Baseline, Confirmed, Report};

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub specs: SpecArgs,
    /// How many ranked plans to show (at least --pick).
    #[arg(long, default_value_t = 3)]
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
    #[arg(long, value_enum, conflicts_with_all = ["plan", "fix"])]
    pub expressible: Option<Framework>,
}

/// A framework plans can be exported to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Framework {
    Megatron,
    Torchtitan,
}

impl Framework {
    fn name(self) -> &'static str {
        match self {
            Framework::Megatron => medley_export::MEGATRON,
            Framework::Torchtitan => medley_export::TORCHTITAN,
        }
    }

    /// Why the framework cannot run `plan`, if it cannot.
    fn refusal(self, plan: &Plan) -> Option<medley_export::ExportError> {
        match self {
            Framework::Megatron => medley_export::megatron::megatron(plan).err(),
            Framework::Torchtitan => medley_export::torchtitan::torchtitan(plan).err(),
        }
    }
}

/// Candidates the search keeps when only some of them may be expressible.
const EXPRESSIBLE_POOL: usize = 32;

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
                render::emit(
                    &(serde_json::to_string_pretty(&json!({"fits": false, "error": err.to_string()}))? + "\n"),
                )?;
            }
            tracing::error!("{err}");
            return Ok(ExitCode::from(1));
        }
        Err(err) => return Err(err.into()),
    };
    let search_s = started.elapsed().as_secs_f64();
    let confirmed = confirm_by_simulation(candidates, &specs.calibration)?;
    let candidates = &confirmed.candidates;
    let picked = args.pick as usize - 1;
    if picked >= candidates.len() {
        bail!("--pick {}: only {} to pick from", args.pick, render::count(candidates.len(), "ranked plan"));
    }
    let baselines = baseline_rows(&specs);
    if let Some(path) = &args.output {
        let json = serde_json::to_string_pretty(&candidates[picked].plan)?;
        fs::write(path, json + "\n").with_context(|| format!("cannot write {}", path.display()))?;
    }
    let report = Report {
        specs: &specs,
        candidates,
        picked,
        confirmed: &confirmed,
        baselines: &baselines,
        layouts_priced,
        search_s,
    };
    if args.json {
        render::emit(&(serde_json::to_string_pretty(&render::json(&report))? + "\n"))?;
    } else {
        render::emit(&render::text(&report))?;
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
        tracing::error!("this plan does not fit in memory (see the peak memory per device type)");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// The best of `candidates` and the baselines that `framework` can run, fastest first, and a note
/// of what the restriction costs against the fastest plan. torchtitan has no ZeRO-1, so its
/// plans come from a search and baselines without it.
fn expressible(
    specs: &Specs,
    candidates: Vec<Candidate>,
    framework: Framework,
    top: usize,
    options: &SearchOptions,
) -> Result<Vec<Candidate>, PlanError> {
    let best_s = candidates.first().map_or(f64::INFINITY, |best| best.prediction.step_time_s);
    let first_refusal = candidates.first().and_then(|best| framework.refusal(&best.plan));
    let (cluster, model, calibration) = (&specs.cluster, &specs.model, &specs.calibration);
    let (job, candidates) = match framework == Framework::Torchtitan && specs.job.zero1() {
        true => {
            tracing::info!(
                "torchtitan has no ZeRO-1 (its FSDP shards parameters and gradients too): searching without it"
            );
            let job = specs.job.clone().with_zero1(false);
            let searched = match search(cluster, model, &job, calibration, options) {
                Ok(outcome) => outcome.candidates,
                Err(PlanError::NothingFits(_)) => Vec::new(),
                Err(err) => return Err(err),
            };
            (job, searched)
        }
        false => (specs.job.clone(), candidates),
    };
    let baselines = Baselines::compute(cluster, model, &job, calibration);
    let mut pool: Vec<Candidate> = candidates
        .into_iter()
        .chain(baselines.uniform)
        .chain(baselines.homogeneous.map(|(_, candidate)| candidate))
        .filter(|candidate| framework.refusal(&candidate.plan).is_none())
        .collect();
    pool.sort_by(|a, b| a.prediction.step_time_s.total_cmp(&b.prediction.step_time_s));
    pool.truncate(top);
    let name = framework.name();
    let Some(best) = pool.first() else {
        let why = first_refusal.map_or_else(String::new, |refusal| format!(" (the best plan: {refusal})"));
        return Err(PlanError::NothingFits(format!("no plan {name} can run was found{why}")));
    };
    let cost = best.prediction.step_time_s / best_s;
    tracing::info!(
        "restricted to plans {name} can run: the best takes {:.3} s a step, {cost:.2}× the unrestricted plan's {:.3} s",
        best.prediction.step_time_s,
        best_s
    );
    Ok(pool)
}

/// The candidates with one simulated step each (none above [`render::SIMULATE_UP_TO_GPUS`] or
/// [`render::SIMULATE_UP_TO_PASSES`]), fastest
/// first by the simulator where it ran and by the cost model where it did not.
pub(crate) fn confirm_by_simulation(candidates: Vec<Candidate>, calibration: &Calibration) -> Result<Confirmed> {
    let simulated: Vec<Option<StepReport>> = candidates
        .par_iter()
        .map(|candidate| {
            let plan = &candidate.plan;
            let too_large = candidate.prediction.n_gpus_used > render::SIMULATE_UP_TO_GPUS
                || medley_sim::passes_per_step(plan) > render::SIMULATE_UP_TO_PASSES;
            if too_large {
                return Ok(None);
            }
            simulate_steps(plan, calibration, &SimConfig::default(), plan.schedule(), 1, None)
                .map(|run| Some(run.last_step))
        })
        .collect::<Result<_, _>>()
        .context("simulating the candidates")?;
    let step_s =
        |idx: usize| simulated[idx].as_ref().map_or(candidates[idx].prediction.step_time_s, |step| step.step_time_s);
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&a, &b| step_s(a).total_cmp(&step_s(b)));
    let mut slots: Vec<Option<(Candidate, Option<StepReport>)>> =
        candidates.into_iter().zip(simulated).map(Some).collect();
    let (candidates, simulated) = order.iter().map(|&idx| slots[idx].take().expect("each once")).unzip();
    Ok(Confirmed { candidates, simulated, analytical_rank: order })
}

/// The specs a plan file carries, with the calibration the flags name.
pub(crate) fn specs_of_plan(args: &SpecArgs, path: &str, plan: &Plan) -> Result<Specs> {
    let calibration = args.resolve_calibration(plan.model())?;
    check_calibration_names(&calibration, plan.cluster())?;
    specs_with_calibration(path, plan, calibration)
}

/// The specs a plan file carries, priced with `calibration`.
pub(crate) fn specs_with_calibration(path: &str, plan: &Plan, calibration: Calibration) -> Result<Specs> {
    let parts = JobParts {
        seq_len: plan.seq_len(),
        global_batch: plan.global_batch(),
        micro_batch: None,
        precision: Default::default(),
        zero1: plan.zero1(),
        recompute: None,
        attention: plan.attention(),
        overlap_grad_reduce: plan.overlap_grad_reduce(),
        schedule: plan.schedule(),
    };
    Ok(Specs {
        job: JobSpec::new(parts, path)?,
        cluster: plan.cluster().clone(),
        model: plan.model().clone(),
        calibration,
    })
}

/// A plan file: its parts read, then checked, so a hand edit that breaks the plan is named.
pub(crate) fn load_plan(path: &str) -> Result<Plan> {
    let parts: PlanParts =
        serde_json::from_str(&read(path)?).with_context(|| format!("{path} is not a medley plan"))?;
    Plan::new(parts).with_context(|| format!("in {path}"))
}

/// The rows of the report's baselines table: uniform and best homogeneous, and for long
/// sequences the even context-parallel layouts.
pub(crate) fn baseline_rows(specs: &Specs) -> Vec<Baseline> {
    let (cluster, model, job, calibration) = (&specs.cluster, &specs.model, &specs.job, &specs.calibration);
    let (baselines, even) = rayon::join(
        || Baselines::compute(cluster, model, job, calibration),
        || (job.seq_len() >= LONG_CONTEXT_TOKENS).then(|| EvenBaselines::compute(cluster, model, job, calibration)),
    );
    let mut rows = vec![
        Baseline { name: "uniform".into(), detail: None, candidate: baselines.uniform },
        Baseline {
            name: "best-homogeneous".into(),
            detail: baselines.homogeneous.as_ref().map(|(device, _)| device.clone()),
            candidate: baselines.homogeneous.map(|(_, candidate)| candidate),
        },
    ];
    for (kind, candidate) in even.iter().flat_map(EvenBaselines::rows) {
        let detail = candidate.map(|candidate| candidate.plan.stage_label(&candidate.plan.replicas()[0].stages[0]));
        rows.push(Baseline { name: kind.name().into(), detail, candidate: candidate.cloned() });
    }
    rows
}
