//! Several steps in a row under a fixed schedule or adaptive kFkB: the network's bandwidth trace
//! runs on across steps, and [`medley_schedule::StepSchedules`] (the same code the runtime runs)
//! picks each step's schedule, adaptive kFkB's k from the steps before it.

use std::io::Write;

use medley_cost::Calibration;
use medley_plan::{Plan, max_k_within_memory};
use medley_schedule::{ProgramsByKind, StepSchedules};
use medley_spec::Schedule;
use serde::Serialize;

use crate::{MAX_EVENTS, SimConfig, SimError, Simulation, StepReport};

/// One step of a run, in brief.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepSummary {
    pub step: u32,
    pub schedule: String,
    pub step_time_s: f64,
    pub comm_wait_fraction: f64,
    pub peak_memory_gib: f64,
    pub fits: bool,
}

/// Several simulated steps.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunReport {
    pub steps: Vec<StepSummary>,
    /// Mean step time over the run.
    pub mean_step_time_s: f64,
    pub tokens_per_s: f64,
    /// Whether every step fit in memory.
    pub fits: bool,
    /// The last step in full.
    pub last_step: StepReport,
}

/// Simulates `n_steps` steps of `plan` (at least one) under `schedule`. Steps beyond
/// [`MAX_PASSES`](crate::MAX_PASSES) are refused before they start, and runs whose steps so far
/// put the whole beyond [`MAX_EVENTS`] as soon as they do (after the first step, unless later
/// steps take more events).
pub fn simulate_steps(
    plan: &Plan,
    calibration: &Calibration,
    config: &SimConfig,
    schedule: Schedule,
    n_steps: u32,
    timeline: Option<&mut dyn Write>,
) -> Result<RunReport, SimError> {
    crate::check_passes(plan)?;
    let mut simulation = Simulation::new(plan, calibration, config, timeline)?;
    let mut schedules = StepSchedules::new(schedule, max_k_within_memory(plan, calibration));
    let mut steps = Vec::new();
    let mut last_step = None;
    let mut events: u64 = 0;
    let mut programs = ProgramsByKind::default();
    for step in 0..n_steps.max(1) {
        let kind = schedules.next();
        let report = simulation.step(programs.get(plan, kind)?)?;
        schedules.observe(kind, report.step_time_s, report.pipeline_wait_fraction);
        steps.push(StepSummary {
            step,
            schedule: report.schedule.clone(),
            step_time_s: report.step_time_s,
            comm_wait_fraction: report.comm_wait_fraction,
            peak_memory_gib: report.peak_memory_gib,
            fits: report.fits,
        });
        events += report.events;
        let steps_left = u64::from(n_steps.saturating_sub(step + 1));
        if events.saturating_add(report.events.saturating_mul(steps_left)) > MAX_EVENTS {
            let events_per_step = report.events.max(events / u64::from(step + 1)).max(1);
            return Err(SimError::TooManyEvents { n_steps, events_per_step });
        }
        last_step = Some(report);
    }
    simulation.finish()?;
    let total_s: f64 = steps.iter().map(|step| step.step_time_s).sum();
    let tokens = f64::from(plan.seq_len()) * f64::from(plan.global_batch()) * steps.len() as f64;
    Ok(RunReport {
        mean_step_time_s: total_s / steps.len() as f64,
        tokens_per_s: tokens / total_s,
        fits: steps.iter().all(|step| step.fits),
        steps,
        last_step: last_step.expect("at least one step"),
    })
}
