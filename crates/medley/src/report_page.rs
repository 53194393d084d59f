//! The report page of a plan — its picture, a simulated step's timeline, memory, the candidates
//! and baselines — and of a training run when given its directory (loss, step times against the
//! simulator, a measured step's timeline): what `medley report` writes and `medley train` leaves in
//! its run directory.

use std::fs;
use std::path::Path;

use anyhow::{Context, Result};
use medley_cost::Calibration;
use medley_cost::memory::usable;
use medley_plan::{Candidate, Plan, SearchOptions, Utilisation, evaluate, search};
use medley_report::timeline::Lanes;
use medley_report::{Compared, MemoryBar, Report, RunRecord, RunStep};
use medley_sim::timeline::trace_events;
use medley_sim::{SimConfig, StepReport, simulate_steps};
use serde_json::Value;

use crate::inputs::{Specs, check_calibration_names, check_gpu_pricing, read};
use medley_plan::baselines::named_baselines;
use medley_sim::rank::rank_by_simulation;

use crate::inputs::load_plan;
use medley_report::plan_text::{self, pipeline_summary};
use medley_report::text::{percent, seconds};
use medley_runtime::RunDir;

/// Ranks a timeline draws before it says how many it left out.
const MAX_LANES: usize = 32;
/// Other candidates the report compares with the plan.
const CANDIDATES: usize = 4;

/// The report page of the plan at `plan_path`, priced with `calibration` (a file) or the
/// built-in profile, with the training run in `run` if given.
pub fn page(plan_path: &str, calibration: Option<&str>, run: Option<&Path>) -> Result<String> {
    let plan = load_plan(plan_path)?;
    let calibration = match calibration {
        Some(path) => {
            let calibration = Calibration::from_toml(&read(path)?, path)?;
            check_gpu_pricing(&calibration, plan.model(), path)?;
            calibration
        }
        None => Calibration::default(),
    };
    check_calibration_names(&calibration, plan.cluster())?;
    // A training run's prediction is priced at its time dilation, as medley train priced it.
    let calibration = match run.map(run_dilation).transpose()? {
        Some(dilation) => calibration.dilated(plan.cluster().groups().iter().map(|group| &group.device), dilation),
        None => calibration,
    };
    let specs = crate::inputs::specs_with_calibration(plan_path, &plan, calibration)?;
    let (simulated, lanes) = simulate_with_lanes(&plan, &specs.calibration)?;
    let run = run.map(|dir| run_record(dir, simulated.step_time_s)).transpose()?;
    let prediction = evaluate(&plan, &specs.calibration);
    let memory = prediction
        .peak_memory_by_device_gib
        .iter()
        .map(|(device_type, &predicted_gib)| MemoryBar {
            device_type: device_type.clone(),
            predicted_gib,
            simulated_gib: simulated.peak_memory_by_device_gib.get(device_type).copied(),
            capacity_gib: prediction.capacity_gib.get(device_type).copied().unwrap_or(f64::NAN),
            usable_gib: usable(
                prediction.capacity_gib.get(device_type).copied().unwrap_or(f64::NAN),
                plan.memory_headroom(),
            ),
        })
        .collect();
    let report = Report {
        title: format!("medley: {} on {}", plan.model().name(), plan_text::cluster_summary(plan.cluster())),
        facts: facts(&plan, &specs, &prediction, &simulated, run.as_ref()),
        plan: &plan,
        explanation: plan_text::explain(&plan),
        simulated: lanes,
        memory,
        compared: compared(&plan, &simulated, &specs, run.is_some())?,
        run,
    };
    Ok(medley_report::html(&report))
}

/// One simulated step of `plan` and its timeline's lanes.
fn simulate_with_lanes(plan: &Plan, calibration: &Calibration) -> Result<(StepReport, Lanes)> {
    let mut trace = Vec::new();
    let run = simulate_steps(plan, calibration, &SimConfig::default(), plan.schedule(), 1, Some(&mut trace))
        .context("simulating the plan")?;
    let events = trace_events(&String::from_utf8_lossy(&trace));
    Ok((run.last_step, Lanes::from_events(&events, None, MAX_LANES)))
}

fn facts(
    plan: &Plan,
    specs: &Specs,
    prediction: &medley_plan::Prediction,
    simulated: &StepReport,
    run: Option<&RunRecord>,
) -> Vec<(String, String)> {
    let mut facts = vec![
        ("model".to_string(), plan_text::model_summary(&specs.model)),
        ("job".into(), plan_text::job_summary(&specs.job)),
        ("layout".into(), pipeline_summary(plan)),
        (
            "step time".into(),
            format!(
                "{} simulated, {} by the cost model",
                seconds(simulated.step_time_s),
                seconds(prediction.step_time_s)
            ),
        ),
        (
            "throughput".into(),
            format!("{:.0} tokens/s, MFU {}", simulated.utilisation.tokens_per_s, percent(simulated.utilisation.mfu)),
        ),
        ("fits in memory".into(), if simulated.fits { "yes" } else { "no" }.into()),
    ];
    if let Some(run) = run
        && let (Some(first), Some(last)) = (run.steps.first(), run.steps.last())
    {
        facts.push((
            "trained".into(),
            format!("steps {} to {}, loss {:.3} → {:.3}", first.step, last.step, first.loss, last.loss),
        ));
        if let Some(measured) = steady_median(&run.steps) {
            facts.push((
                "measured step".into(),
                format!(
                    "{} median after the first step; the simulator's {} is {}",
                    seconds(measured),
                    seconds(run.predicted_step_s),
                    percent(run.predicted_step_s / measured - 1.0)
                ),
            ));
        }
    }
    facts
}

/// The plan against the search's best others and the baselines, each simulated (up to the size
/// `medley plan` simulates); a trained plan against what the runtime could have trained.
fn compared(plan: &Plan, simulated: &StepReport, specs: &Specs, trained: bool) -> Result<Vec<Compared>> {
    let searchable = if trained { crate::job::runtime_search_options() } else { SearchOptions::default() };
    let options = SearchOptions { top: CANDIDATES + 1, ..searchable };
    let searched = search(&specs.cluster, &specs.model, &specs.job, &specs.calibration, &options)
        .map(|outcome| outcome.candidates)
        .unwrap_or_default();
    let others: Vec<Candidate> =
        searched.into_iter().filter(|candidate| candidate.plan != *plan).take(CANDIDATES).collect();
    let confirmed = rank_by_simulation(others, &specs.calibration).context("simulating the candidates")?;
    let mut rows = vec![row("this plan", plan, (simulated.step_time_s, &simulated.utilisation), simulated.fits, false)];
    rows[0].chosen = true;
    let mut add = |name: &str, candidate: &Candidate, simulated: &Option<StepReport>, baseline: bool| {
        let mut compared = match simulated {
            Some(step) => row(name, &candidate.plan, (step.step_time_s, &step.utilisation), step.fits, baseline),
            None => {
                let prediction = &candidate.prediction;
                let timing = (prediction.step_time_s, &prediction.utilisation);
                row(name, &candidate.plan, timing, prediction.fits, baseline)
            }
        };
        if simulated.is_none() {
            compared.layout += " (the cost model's: not simulated at this size)";
        }
        rows.push(compared);
    };
    for (idx, (candidate, simulated)) in confirmed.candidates.iter().zip(&confirmed.simulated).enumerate() {
        add(&format!("candidate {}", idx + 1), candidate, simulated, false);
    }
    let baselines = named_baselines(&specs.cluster, &specs.model, &specs.job, &specs.calibration);
    let (fitting, missing): (Vec<_>, Vec<_>) = baselines.into_iter().partition(|baseline| baseline.candidate.is_some());
    let names: Vec<String> = fitting.iter().map(baseline_name).collect();
    let candidates: Vec<Candidate> = fitting.into_iter().filter_map(|baseline| baseline.candidate).collect();
    let plans: Vec<Plan> = candidates.iter().map(|candidate| candidate.plan.clone()).collect();
    let simulated = rank_by_simulation(candidates, &specs.calibration).context("simulating the candidates")?;
    for (name, baseline_plan) in names.iter().zip(&plans) {
        let idx =
            simulated.candidates.iter().position(|candidate| candidate.plan == *baseline_plan).expect("each simulated");
        add(name, &simulated.candidates[idx], &simulated.simulated[idx], true);
    }
    for baseline in &missing {
        rows.push(Compared {
            name: baseline_name(baseline),
            layout: "no layout of this kind fits".into(),
            step_time_s: None,
            tokens_per_s: None,
            mfu: None,
            chosen: false,
            baseline: true,
        });
    }
    Ok(rows)
}

fn baseline_name(baseline: &medley_plan::baselines::NamedBaseline) -> String {
    match &baseline.detail {
        Some(detail) => format!("{} ({detail})", baseline.name),
        None => baseline.name.clone(),
    }
}

/// A compared plan's row from its step time and utilisation (simulated or the cost model's).
fn row(name: &str, plan: &Plan, (step_s, utilisation): (f64, &Utilisation), fits: bool, baseline: bool) -> Compared {
    Compared {
        name: name.into(),
        layout: pipeline_summary(plan),
        step_time_s: fits.then_some(step_s),
        tokens_per_s: Some(utilisation.tokens_per_s),
        mfu: Some(utilisation.mfu),
        chosen: false,
        baseline,
    }
}

/// A training run's metrics and the timeline of its median step.
fn run_record(dir: &Path, predicted_step_s: f64) -> Result<RunRecord> {
    let run = RunDir::at(dir);
    let steps: Vec<RunStep> = run
        .read_metrics()?
        .into_iter()
        .map(|step| RunStep { step: step.step, loss: step.loss, step_time_s: step.step_time_s })
        .collect();
    let median = steady_median(&steps);
    let measured_step = steps
        .iter()
        .skip(usize::from(steps.len() > 1))
        .min_by(|a, b| {
            (a.step_time_s - median.unwrap_or(0.0)).abs().total_cmp(&(b.step_time_s - median.unwrap_or(0.0)).abs())
        })
        .map(|step| step.step);
    let timeline = run.timeline();
    let measured = match fs::read(&timeline) {
        Ok(bytes) => {
            let document: Value =
                serde_json::from_slice(&bytes).with_context(|| format!("{} is not a timeline", timeline.display()))?;
            let events = document["traceEvents"].as_array().map_or(&[][..], Vec::as_slice);
            Lanes::from_events(events, measured_step, MAX_LANES)
        }
        Err(_) => Lanes::default(),
    };
    Ok(RunRecord { steps, predicted_step_s, measured_step, measured })
}

/// The time dilation a run trained at (1 for runs from before it was kept).
fn run_dilation(dir: &Path) -> Result<f64> {
    let emulation = RunDir::at(dir).read_emulation()?;
    Ok(emulation
        .map(|record| record.time_dilation)
        .filter(|factor| factor.is_finite() && *factor >= 1.0)
        .unwrap_or(1.0))
}

/// The median step time after the first (which includes start-up), as `medley train` reports it.
fn steady_median(steps: &[RunStep]) -> Option<f64> {
    let steady = if steps.len() > 1 { &steps[1..] } else { steps };
    (!steady.is_empty()).then(|| medley_bench::stats::median(steady.iter().map(|step| step.step_time_s).collect()))
}
