//! The planner's candidates re-ranked by simulation: the cost model searches, one simulated step
//! of each candidate confirms (or corrects) its order.

use medley_cost::Calibration;
use medley_plan::Candidate;
use rayon::prelude::*;

use crate::{MAX_PASSES, SimConfig, SimError, StepReport, passes_per_step, simulate_steps};

/// Plans on more GPUs than this are ranked by the cost model alone: one simulated step of a
/// 16,384-GPU plan takes seconds (every replica's collectives are simulated flow by flow).
pub const SIMULATE_UP_TO_GPUS: u32 = 4096;
/// Nor are plans of more passes a step than this (a micro-batch's forward and backward through a
/// stage; a million sequences a step are millions of passes): the candidates are simulated side
/// by side, each within a quarter of what one simulation runs at once.
pub const SIMULATE_UP_TO_PASSES: u64 = MAX_PASSES / 4;

/// How many of the cost model's best plans one simulated step each re-ranks when medley chooses a
/// plan: what `medley plan` shows by default and what `medley train` chooses among, so that both
/// choose alike.
pub const RANKED_CANDIDATES: usize = 3;

/// The candidates ranked by simulated step time (analytical search first, simulation to
/// confirm), and the cost model's rank of each.
pub struct Ranked {
    pub candidates: Vec<Candidate>,
    /// `None` for a plan too large to simulate in moments ([`SIMULATE_UP_TO_GPUS`],
    /// [`SIMULATE_UP_TO_PASSES`]).
    pub simulated: Vec<Option<StepReport>>,
    /// `analytical_rank[i]`: where the cost model ranked candidate i (0 = first).
    pub analytical_rank: Vec<usize>,
}

/// Whether one step of `candidate` simulates in moments.
fn simulates_quickly(candidate: &Candidate) -> bool {
    candidate.prediction.n_gpus_used <= SIMULATE_UP_TO_GPUS && passes_per_step(&candidate.plan) <= SIMULATE_UP_TO_PASSES
}

/// The candidates with one simulated step each (on every core), fastest first by the simulator
/// where it ran and by the cost model where the plan is too large to simulate.
pub fn rank_by_simulation(candidates: Vec<Candidate>, calibration: &Calibration) -> Result<Ranked, SimError> {
    let simulated: Vec<Option<StepReport>> = candidates
        .par_iter()
        .map(|candidate| {
            let plan = &candidate.plan;
            if !simulates_quickly(candidate) {
                return Ok(None);
            }
            simulate_steps(plan, calibration, &SimConfig::default(), plan.schedule(), 1, None)
                .map(|run| Some(run.last_step))
        })
        .collect::<Result<_, _>>()?;
    let step_s =
        |idx: usize| simulated[idx].as_ref().map_or(candidates[idx].prediction.step_time_s, |step| step.step_time_s);
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&a, &b| step_s(a).total_cmp(&step_s(b)));
    let mut slots: Vec<Option<(Candidate, Option<StepReport>)>> =
        candidates.into_iter().zip(simulated).map(Some).collect();
    let (candidates, simulated) = order.iter().map(|&idx| slots[idx].take().expect("each once")).unzip();
    Ok(Ranked { candidates, simulated, analytical_rank: order })
}
