//! The search restricted to plans a framework can run, and what the restriction costs against
//! the best plan medley would run itself.

use std::fmt;
use std::str::FromStr;

use medley_cost::Calibration;
use medley_plan::baselines::Baselines;
use medley_plan::{Candidate, Plan, PlanError, SearchOptions, search};
use medley_spec::{Cluster, JobSpec, ModelSpec};

use crate::{ExportError, MEGATRON, TORCHTITAN};

/// Candidates the search keeps when only some of them may be expressible.
pub const EXPRESSIBLE_POOL: usize = 32;

/// A framework plans can be exported to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framework {
    Megatron,
    Torchtitan,
}

impl Framework {
    /// The framework's name, as refusals say it.
    pub fn name(self) -> &'static str {
        match self {
            Framework::Megatron => MEGATRON,
            Framework::Torchtitan => TORCHTITAN,
        }
    }

    /// Why the framework cannot run `plan`, if it cannot.
    pub fn refusal(self, plan: &Plan) -> Option<ExportError> {
        match self {
            Framework::Megatron => crate::megatron::megatron(plan).err(),
            Framework::Torchtitan => crate::torchtitan::torchtitan(plan).err(),
        }
    }

    /// Whether the framework has a distributed optimizer (ZeRO-1); torchtitan's FSDP shards
    /// parameters and gradients too, which is another layout.
    pub fn has_zero1(self) -> bool {
        self == Framework::Megatron
    }
}

impl FromStr for Framework {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "megatron" => Ok(Framework::Megatron),
            "torchtitan" => Ok(Framework::Torchtitan),
            _ => Err("expected `megatron` or `torchtitan`".into()),
        }
    }
}

impl fmt::Display for Framework {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a search restricted to one framework found.
#[derive(Debug)]
pub struct Restricted {
    /// The best plans the framework can run, fastest first.
    pub candidates: Vec<Candidate>,
    /// The best restricted plan's step time over the unrestricted best's.
    pub cost: f64,
    /// The unrestricted best's step time, s.
    pub unrestricted_s: f64,
}

/// The best of `candidates` (an unrestricted search's, fastest first) and the baselines that
/// `framework` can run. A framework without ZeRO-1 gets plans from a search and
/// baselines without it.
pub fn restrict(
    cluster: &Cluster,
    model: &ModelSpec,
    job: &JobSpec,
    calibration: &Calibration,
    candidates: Vec<Candidate>,
    framework: Framework,
    options: &SearchOptions,
) -> Result<Restricted, PlanError> {
    let unrestricted_s = candidates.first().map_or(f64::INFINITY, |best| best.prediction.step_time_s);
    let first_refusal = candidates.first().and_then(|best| framework.refusal(&best.plan));
    // Neither framework shards gradients with the optimizer states (ZeRO-2), and torchtitan
    // shards no optimizer states alone (ZeRO-1): searched again without what it lacks.
    let runnable = job.clone().with_zero1(job.zero1() && framework.has_zero1()).with_shard_gradients(false);
    // Nor gives either framework its stages their own TP degrees.
    let per_stage_tp = candidates.iter().any(|candidate| candidate.plan.uniform_tp().is_none());
    let options = SearchOptions { per_stage_tp: false, ..options.clone() };
    let (job, candidates) = match runnable != *job || per_stage_tp {
        true => {
            let job = runnable;
            let searched = match search(cluster, model, &job, calibration, &options) {
                Ok(outcome) => outcome.candidates,
                Err(PlanError::NothingFits(_)) => Vec::new(),
                Err(err) => return Err(err),
            };
            (job, searched)
        }
        false => (job.clone(), candidates),
    };
    let baselines = Baselines::compute(cluster, model, &job, calibration);
    let mut pool: Vec<Candidate> = candidates
        .into_iter()
        .chain(baselines.uniform)
        .chain(baselines.homogeneous.map(|(_, candidate)| candidate))
        .filter(|candidate| framework.refusal(&candidate.plan).is_none())
        .collect();
    pool.sort_by(|a, b| a.prediction.step_time_s.total_cmp(&b.prediction.step_time_s));
    let Some(best) = pool.first() else {
        let why = first_refusal.map_or_else(String::new, |refusal| format!(" (the best plan: {refusal})"));
        return Err(PlanError::NothingFits(format!("no plan {} can run was found{why}", framework.name())));
    };
    let cost = best.prediction.step_time_s / unrestricted_s;
    Ok(Restricted { candidates: pool, cost, unrestricted_s })
}
