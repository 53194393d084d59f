//! Priced plans, ranked: what every search returns.

use rayon::prelude::*;

use medley_cost::Calibration;

use crate::evaluate::{Prediction, evaluate};
use crate::plan::Plan;

/// A plan with its prediction.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub plan: Plan,
    pub prediction: Prediction,
}

/// The ranked plans and how much work found them.
#[derive(Clone, Debug)]
pub struct SearchOutcome {
    pub candidates: Vec<Candidate>,
    /// Pipeline templates and layouts priced by the estimate.
    pub layouts_priced: usize,
}

/// `plans` priced by [`evaluate`]: those that fit, fastest first, at most `top` (at least one).
pub(crate) fn ranked(
    plans: impl ParallelIterator<Item = Plan>,
    calibration: &Calibration,
    top: usize,
) -> Vec<Candidate> {
    let mut candidates: Vec<Candidate> = plans
        .map(|plan| {
            let prediction = evaluate(&plan, calibration);
            Candidate { plan, prediction }
        })
        .filter(|candidate| candidate.prediction.fits)
        .collect();
    candidates.sort_by(|a, b| a.prediction.step_time_s.total_cmp(&b.prediction.step_time_s));
    candidates.truncate(top.max(1));
    candidates
}
