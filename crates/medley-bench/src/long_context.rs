//! `medley bench context`'s suite: long-context training on mixed fleets. For each case the
//! asymmetric plan (medley's long-context search) is simulated beside the even layouts people run
//! (ring attention, DeepSpeed-Ulysses, USP, each with its best factorisation) and beside each
//! device type alone; the fleet's aggregate is the sum of each type's best alone. The planner is
//! also timed on the largest instance.

use std::fmt::Display;

use medley_cost::Calibration;
use medley_plan::long_context::{EvenBaselines, search_long_context};
use medley_plan::{Candidate, Plan, SearchOptions, search};
use medley_sim::{SimConfig, simulate_steps};
use medley_spec::Cluster;
use serde::Serialize;

use crate::BenchError;
use crate::planner::CaseSpecs;
use crate::stats::{TIMED_RUNS, arithmetic_mean, geometric_mean, peak_rss_mib, timed_median};

/// A long-context problem: an inline cluster (default fabric and bridge), a catalog model, a
/// sequence length and a global batch of sequences.
#[derive(Clone, Copy, Debug)]
pub struct ContextCase {
    pub cluster: &'static str,
    pub model: &'static str,
    pub seq_len: u32,
    pub global_batch: u32,
}

/// Mixed fleets of 2–4 device types and 32–1024 GPUs, 8B and 70B models, 128K to 1M tokens; two
/// mix vendors, one is AMD's two generations.
pub const CONTEXT_CASES: [ContextCase; 12] = [
    ContextCase { cluster: "16xh100,16xa100", model: "llama3-8b", seq_len: 131_072, global_batch: 16 },
    ContextCase { cluster: "32xh100,32xl40s", model: "llama3-8b", seq_len: 262_144, global_batch: 16 },
    ContextCase { cluster: "32xh200,32xa100,32xa100-40gb", model: "llama3-8b", seq_len: 524_288, global_batch: 8 },
    ContextCase { cluster: "64xh100,64xa100", model: "llama3-70b", seq_len: 131_072, global_batch: 32 },
    ContextCase { cluster: "64xh100,32xa100,32xmi300x", model: "llama3-70b", seq_len: 131_072, global_batch: 32 },
    ContextCase { cluster: "128xh200,128xl40s", model: "llama3-8b", seq_len: 1_048_576, global_batch: 16 },
    ContextCase { cluster: "128xh100,128xa100-40gb", model: "llama3-70b", seq_len: 262_144, global_batch: 32 },
    ContextCase { cluster: "32xmi300x,32xmi250x", model: "llama3-8b", seq_len: 262_144, global_batch: 16 },
    ContextCase {
        cluster: "64xh100,64xa100,64xl40s,64xa100-40gb",
        model: "llama3-8b",
        seq_len: 1_048_576,
        global_batch: 32,
    },
    ContextCase { cluster: "256xh100,256xmi300x", model: "llama3-70b", seq_len: 524_288, global_batch: 64 },
    ContextCase { cluster: "512xh100,512xa100", model: "llama3-70b", seq_len: 262_144, global_batch: 128 },
    CONTEXT_SPEED_CASE,
];

/// The planner's speed target: 1024 GPUs of four types, a 70B model, a million tokens.
pub const CONTEXT_SPEED_CASE: ContextCase = ContextCase {
    cluster: "256xh200,256xh100,256xa100,256xa100-40gb",
    model: "llama3-70b",
    seq_len: 1_048_576,
    global_batch: 64,
};

/// Seconds the whole search (`medley plan`'s, tensor- and context-parallel) may take on
/// [`CONTEXT_SPEED_CASE`].
pub const CONTEXT_SPEED_TARGET_S: f64 = 1.0;

impl ContextCase {
    fn specs(&self) -> Result<CaseSpecs, BenchError> {
        let source = "medley bench context";
        CaseSpecs::resolve(self.cluster, self.model, self.seq_len, self.global_batch, source).map_err(self.failed())
    }

    fn info(&self, specs: &CaseSpecs) -> ContextInfo {
        ContextInfo {
            cluster: self.cluster,
            model: self.model,
            n_gpus: specs.cluster.n_gpus(),
            n_types: device_types(&specs.cluster).len(),
            seq_len: self.seq_len,
            global_batch: self.global_batch,
        }
    }

    fn failed<E: Display>(&self) -> impl Fn(E) -> BenchError + '_ {
        |err| BenchError::Case {
            case: format!("{} at {} tokens on {}", self.model, self.seq_len, self.cluster),
            message: err.to_string(),
        }
    }
}

/// The cluster's device types, in order of first appearance, with their node groups.
fn device_types(cluster: &Cluster) -> Vec<(String, Vec<usize>)> {
    let mut types: Vec<(String, Vec<usize>)> = Vec::new();
    for (idx, group) in cluster.groups().iter().enumerate() {
        match types.iter_mut().find(|(name, _)| *name == group.device.name) {
            Some((_, groups)) => groups.push(idx),
            None => types.push((group.device.name.clone(), vec![idx])),
        }
    }
    types
}

/// The columns every row starts with.
#[derive(Clone, Debug, Serialize)]
pub struct ContextInfo {
    pub cluster: &'static str,
    pub model: &'static str,
    pub n_gpus: u32,
    pub n_types: usize,
    pub seq_len: u32,
    pub global_batch: u32,
}

/// A plan's simulated throughput and its layout in a few words.
#[derive(Clone, Debug, Serialize)]
pub struct Simulated {
    pub tokens_per_s: f64,
    /// Its first stage, as `medley plan` labels it.
    pub layout: String,
    pub fits: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct ContextRow {
    #[serde(flatten)]
    pub case: ContextInfo,
    /// medley's asymmetric plan; `None` when nothing fits.
    pub asymmetric: Option<Simulated>,
    pub even_ring: Option<Simulated>,
    pub even_ulysses: Option<Simulated>,
    pub even_usp: Option<Simulated>,
    /// The best plan on one device type, with the type.
    pub homogeneous: Option<(String, Simulated)>,
    /// The sum of each device type's best tokens/s alone.
    pub aggregate_tokens_per_s: f64,
    /// asymmetric / the best even layout; `None` when either does not fit.
    pub best_even_ratio: Option<f64>,
    /// asymmetric / aggregate.
    pub aggregate_fraction: Option<f64>,
}

/// Simulates one step of `plan`.
fn simulated(plan: &Plan, calibration: &Calibration) -> Result<Simulated, BenchError> {
    let run = simulate_steps(plan, calibration, &SimConfig::default(), plan.schedule(), 1, None)?;
    let first = &plan.replicas()[0].stages[0];
    Ok(Simulated {
        tokens_per_s: run.last_step.utilisation.tokens_per_s,
        layout: plan.stage_label(first),
        fits: run.last_step.fits,
    })
}

/// The fastest in simulation of `candidates` (the cost model ranks them; the simulator confirms).
fn fastest_simulated(candidates: &[Candidate], calibration: &Calibration) -> Result<Option<Simulated>, BenchError> {
    let mut best: Option<Simulated> = None;
    for candidate in candidates {
        let run = simulated(&candidate.plan, calibration)?;
        if run.fits && best.as_ref().is_none_or(|best| run.tokens_per_s > best.tokens_per_s) {
            best = Some(run);
        }
    }
    Ok(best)
}

/// Candidates the asymmetric search and each device type's search return, to simulate.
const SIMULATED_CANDIDATES: usize = 3;

/// One case: the asymmetric plan against the even layouts, each type alone and their sum.
pub fn context_row(case: &ContextCase) -> Result<ContextRow, BenchError> {
    let specs = case.specs()?;
    let calibration = Calibration::default();
    let (cluster, model, job) = (&specs.cluster, &specs.model, &specs.job);
    let asymmetric = match search_long_context(cluster, model, job, &calibration, None, None, SIMULATED_CANDIDATES) {
        Ok(outcome) => fastest_simulated(&outcome.candidates, &calibration)?,
        Err(medley_plan::PlanError::NothingFits(_)) => None,
        Err(err) => return Err(case.failed()(err)),
    };
    let even = EvenBaselines::compute(cluster, model, job, &calibration);
    let mut evens = Vec::new();
    for (_, candidate) in even.rows() {
        evens.push(candidate.map(|candidate| simulated(&candidate.plan, &calibration)).transpose()?);
    }
    let mut alone: Vec<(String, Simulated)> = Vec::new();
    for (name, groups) in device_types(cluster) {
        let options = SearchOptions { top: SIMULATED_CANDIDATES, groups: Some(groups), ..SearchOptions::default() };
        if let Ok(outcome) = search(cluster, model, job, &calibration, &options)
            && let Some(best) = fastest_simulated(&outcome.candidates, &calibration)?
        {
            alone.push((name, best));
        }
    }
    let aggregate_tokens_per_s = alone.iter().map(|(_, run)| run.tokens_per_s).sum();
    let homogeneous = alone.into_iter().max_by(|a, b| a.1.tokens_per_s.total_cmp(&b.1.tokens_per_s));
    let fitting = |run: &Option<Simulated>| run.as_ref().filter(|run| run.fits).map(|run| run.tokens_per_s);
    let best_even = evens.iter().filter_map(fitting).reduce(f64::max);
    let asymmetric_tokens_per_s = fitting(&asymmetric);
    let [even_ring, even_ulysses, even_usp] = <[_; 3]>::try_from(evens).expect("one per even kind");
    Ok(ContextRow {
        case: case.info(&specs),
        best_even_ratio: asymmetric_tokens_per_s.zip(best_even).map(|(asymmetric, even)| asymmetric / even),
        aggregate_fraction: asymmetric_tokens_per_s
            .filter(|_| aggregate_tokens_per_s > 0.0)
            .map(|tokens_per_s| tokens_per_s / aggregate_tokens_per_s),
        asymmetric,
        even_ring,
        even_ulysses,
        even_usp,
        homogeneous,
        aggregate_tokens_per_s,
    })
}

#[derive(Clone, Debug, Serialize)]
pub struct ContextSpeedRow {
    #[serde(flatten)]
    pub case: ContextInfo,
    pub runs: usize,
    pub median_s: f64,
    pub target_s: f64,
    /// target_s / median_s: at least 1 passes.
    pub speed_ratio: f64,
    /// The process's peak resident memory after the planner ran; `None` off Linux.
    pub peak_rss_mib: Option<f64>,
}

/// Times [`TIMED_RUNS`] searches of [`CONTEXT_SPEED_CASE`]. Run it first, alone.
pub fn context_speed_row() -> Result<ContextSpeedRow, BenchError> {
    let case = CONTEXT_SPEED_CASE;
    let specs = case.specs()?;
    let calibration = Calibration::default();
    let (median_s, _) = timed_median(|| {
        search(&specs.cluster, &specs.model, &specs.job, &calibration, &SearchOptions::default()).map_err(case.failed())
    })?;
    Ok(ContextSpeedRow {
        case: case.info(&specs),
        runs: TIMED_RUNS,
        median_s,
        target_s: CONTEXT_SPEED_TARGET_S,
        speed_ratio: CONTEXT_SPEED_TARGET_S / median_s,
        peak_rss_mib: peak_rss_mib(),
    })
}

/// The suite's goals: asymmetric over the best even layout, and over the fleet's aggregate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ContextSummary {
    /// Cases where both the asymmetric plan and an even layout fit.
    pub n_compared: usize,
    pub best_even_arithmetic_mean: Option<f64>,
    pub best_even_geometric_mean: Option<f64>,
    pub best_even_max: Option<f64>,
    /// Cases where the asymmetric plan fits and some device type alone does.
    pub n_aggregate: usize,
    pub aggregate_mean: Option<f64>,
    pub aggregate_min: Option<f64>,
}

/// Summarises the rows.
pub fn context_summary(rows: &[ContextRow]) -> ContextSummary {
    let ratios: Vec<f64> = rows.iter().filter_map(|row| row.best_even_ratio).collect();
    let fractions: Vec<f64> = rows.iter().filter_map(|row| row.aggregate_fraction).collect();
    let some = |values: &[f64]| !values.is_empty();
    ContextSummary {
        n_compared: ratios.len(),
        best_even_arithmetic_mean: some(&ratios).then(|| arithmetic_mean(&ratios)),
        best_even_geometric_mean: some(&ratios).then(|| geometric_mean(&ratios)),
        best_even_max: ratios.iter().copied().reduce(f64::max),
        n_aggregate: fractions.len(),
        aggregate_mean: some(&fractions).then(|| arithmetic_mean(&fractions)),
        aggregate_min: fractions.iter().copied().reduce(f64::min),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_case_resolves_within_the_suite_bounds() {
        for case in &CONTEXT_CASES {
            let specs = case.specs().unwrap();
            let info = case.info(&specs);
            assert!((2..=4).contains(&info.n_types), "{}", case.cluster);
            assert!((32..=1024).contains(&info.n_gpus), "{}", case.cluster);
            assert!((131_072..=1_048_576).contains(&info.seq_len), "{}", case.cluster);
        }
        let largest = CONTEXT_SPEED_CASE.specs().unwrap();
        assert_eq!((largest.cluster.n_gpus(), device_types(&largest.cluster).len()), (1024, 4));
    }

    #[test]
    fn a_context_row_compares_the_asymmetric_plan_with_every_baseline() {
        let case = ContextCase { cluster: "16xh100,16xa100", model: "llama3-8b", seq_len: 131_072, global_batch: 8 };
        let row = context_row(&case).unwrap();
        let asymmetric = row.asymmetric.as_ref().expect("a plan fits").tokens_per_s;
        // Each type alone is one of the plans the aggregate adds up.
        let (device, homogeneous) = row.homogeneous.as_ref().expect("H100s alone fit");
        assert!(device.contains("H100") && homogeneous.tokens_per_s < row.aggregate_tokens_per_s, "{row:?}");
        // The even ring splits the sequence over all 32 devices, as fast as the A100s allow.
        let ring = row.even_ring.as_ref().expect("an even ring fits");
        assert!(ring.layout.starts_with("cp"), "{}", ring.layout);
        assert!(row.best_even_ratio.unwrap() > 1.0 && asymmetric > homogeneous.tokens_per_s, "{row:?}");
        let summary = context_summary(&[row]);
        assert_eq!((summary.n_compared, summary.n_aggregate), (1, 1));
    }
}
