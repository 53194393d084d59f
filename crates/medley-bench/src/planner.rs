//! `medley bench plan`'s suite: the whole of `medley plan`'s work (the search and both baselines)
//! timed on large clusters against targets, and the best plan compared with the uniform and
//! best-homogeneous baselines on mixed clusters, all under the same cost model.

use std::fmt::Display;

use medley_cost::Calibration;
use medley_plan::baselines::{Baselines, NamedBaseline, named_baselines};
use medley_plan::{Candidate, SearchOptions, search};
use medley_sim::rank::{Ranked, rank_by_simulation};
use medley_spec::{Bridge, Cluster, Fabric, JobParts, JobSpec, ModelSpec, Precision, catalog_model};
use serde::Serialize;

use crate::BenchError;
use crate::stats::{TIMED_RUNS, arithmetic_mean, geometric_mean, peak_rss_mib, timed_median};

/// Tokens per sequence in every case.
pub const SEQ_LEN: u32 = 4096;

/// A planning problem: an inline cluster (default fabric and bridge) and a catalog model.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub cluster: &'static str,
    pub model: &'static str,
    pub global_batch: u32,
}

/// A case timed against a target.
#[derive(Clone, Copy, Debug)]
pub struct SpeedCase {
    pub case: Case,
    /// Time the whole of `medley plan`'s work (search, the simulated re-ranking of its
    /// candidates, every baseline) rather than the search and the two baselines.
    pub whole_command: bool,
    pub target_s: f64,
    pub memory_target_mib: Option<f64>,
}

/// The candidates `medley plan` shows and simulates by default (its `--top`).
const PLAN_COMMAND_TOP: usize = 3;

pub const SPEED_CASES: [SpeedCase; 3] = [
    SpeedCase {
        case: Case { cluster: "512xh100,256xa100,256xmi300x", model: "llama3-70b", global_batch: 1024 },
        whole_command: false,
        target_s: 1.0,
        memory_target_mib: None,
    },
    SpeedCase {
        case: Case { cluster: "512xh100,256xa100,256xmi300x", model: "llama3-70b", global_batch: 1024 },
        whole_command: true,
        target_s: 1.0,
        memory_target_mib: None,
    },
    SpeedCase {
        case: Case { cluster: "4096xh100,2048xa100,2048xmi300x", model: "llama3-405b", global_batch: 4096 },
        whole_command: false,
        target_s: 10.0,
        memory_target_mib: Some(500.0),
    },
];

/// Mixed clusters of 2–4 device types and 32–1024 GPUs, models from 7B to 405B parameters. The
/// last two put a 405B and a 175B model on clusters whose 24 GiB cards cannot hold an even share.
pub const QUALITY_CASES: [Case; 12] = [
    Case { cluster: "16xh100,16xa100", model: "llama3-8b", global_batch: 1024 },
    Case { cluster: "32xh100,32xmi300x", model: "qwen2-7b", global_batch: 1024 },
    Case { cluster: "64xa100,32xh100,32xmi300x", model: "llama3-70b", global_batch: 1024 },
    Case { cluster: "128xh100,64xl40s", model: "mixtral-8x7b", global_batch: 1024 },
    Case { cluster: "256xa100,128xh100,128xmi250x", model: "gpt3-175b", global_batch: 1024 },
    Case { cluster: "512xh100,256xa100,256xmi300x", model: "llama3-70b", global_batch: 1024 },
    Case { cluster: "512xh200,256xmi325x,128xv100", model: "llama3-405b", global_batch: 1024 },
    Case { cluster: "64xh100,64xa100-40gb,32xrtx-4090,32xmi300x", model: "llama3-8b", global_batch: 1024 },
    Case { cluster: "512xh100,512xmi300x", model: "llama3-405b", global_batch: 1024 },
    Case { cluster: "64xh100,64xrtx-4090", model: "llama3-70b", global_batch: 1024 },
    Case { cluster: "64xh200,64xmi325x,64xrtx-4090", model: "llama3-405b", global_batch: 1024 },
    Case { cluster: "64xh100,32xrtx-4090", model: "gpt3-175b", global_batch: 1024 },
];

/// A case's inputs, resolved.
pub struct CaseSpecs {
    pub cluster: Cluster,
    pub model: ModelSpec,
    pub job: JobSpec,
}

impl CaseSpecs {
    /// An inline cluster (default fabric and bridge), a catalog model, and a job of
    /// `global_batch` sequences of `seq_len` tokens that errors name `source`.
    pub fn resolve(cluster: &str, model: &str, seq_len: u32, global_batch: u32, source: &str) -> Result<Self, String> {
        let cluster = Cluster::from_inline(cluster, Fabric::default(), Bridge::default()).map_err(|e| e.to_string())?;
        // A fleet with devices that lack bf16 (the V100 case) trains in fp16, as its users must.
        let precision = match cluster.check_precision(Precision::Bf16Mixed) {
            Ok(()) => Precision::Bf16Mixed,
            Err(_) => Precision::Fp16Mixed,
        };
        let parts = JobParts { seq_len, global_batch, precision, ..JobParts::default() };
        Ok(CaseSpecs {
            cluster,
            model: catalog_model(model).map_err(|e| e.to_string())?,
            job: JobSpec::new(parts, source).map_err(|e| e.to_string())?,
        })
    }
}

impl Case {
    pub fn specs(&self) -> Result<CaseSpecs, BenchError> {
        CaseSpecs::resolve(self.cluster, self.model, SEQ_LEN, self.global_batch, "medley bench plan")
            .map_err(self.failed())
    }

    fn info(&self, specs: &CaseSpecs) -> CaseInfo {
        CaseInfo {
            cluster: self.cluster,
            model: self.model,
            n_gpus: specs.cluster.n_gpus(),
            seq_len: SEQ_LEN,
            global_batch: self.global_batch,
        }
    }

    /// What `medley plan` computes when it searches: the best plan and the baselines.
    fn plan(&self, specs: &CaseSpecs) -> Result<(Candidate, Baselines), BenchError> {
        let calibration = Calibration::default();
        let outcome = search(&specs.cluster, &specs.model, &specs.job, &calibration, &SearchOptions::default())
            .map_err(self.failed())?;
        let best = outcome.candidates.into_iter().next().expect("a successful search returns at least one plan");
        Ok((best, Baselines::compute(&specs.cluster, &specs.model, &specs.job, &calibration)))
    }

    /// All `medley plan` computes before it prints: the search's candidates, each simulated one
    /// step and re-ranked, and every baseline.
    fn whole_command(&self, specs: &CaseSpecs) -> Result<(Ranked, Vec<NamedBaseline>), BenchError> {
        let calibration = Calibration::default();
        let options = SearchOptions { top: PLAN_COMMAND_TOP, ..SearchOptions::default() };
        let outcome =
            search(&specs.cluster, &specs.model, &specs.job, &calibration, &options).map_err(self.failed())?;
        let ranked = rank_by_simulation(outcome.candidates, &calibration)?;
        Ok((ranked, named_baselines(&specs.cluster, &specs.model, &specs.job, &calibration)))
    }

    fn failed<E: Display>(&self) -> impl Fn(E) -> BenchError + '_ {
        |err| BenchError::Case { case: format!("{} on {}", self.model, self.cluster), message: err.to_string() }
    }
}

/// The columns every row starts with.
#[derive(Clone, Debug, Serialize)]
pub struct CaseInfo {
    pub cluster: &'static str,
    pub model: &'static str,
    pub n_gpus: u32,
    pub seq_len: u32,
    pub global_batch: u32,
}

#[derive(Clone, Debug, Serialize)]
pub struct PlannerSpeedRow {
    #[serde(flatten)]
    pub case: CaseInfo,
    /// Timed the whole of `medley plan` (with the simulated re-ranking), not the search and the
    /// two baselines.
    pub whole_command: bool,
    pub runs: usize,
    pub median_s: f64,
    pub target_s: f64,
    /// target_s / median_s: at least 1 passes.
    pub speed_ratio: f64,
    /// The process's peak resident memory after the case ran; `None` off Linux.
    pub peak_rss_mib: Option<f64>,
    pub memory_target_mib: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct QualityRow {
    #[serde(flatten)]
    pub case: CaseInfo,
    pub best_tokens_per_s: f64,
    pub best_mfu: f64,
    /// `None` when no uniform layout fits.
    pub uniform_tokens_per_s: Option<f64>,
    /// best_tokens_per_s / uniform_tokens_per_s.
    pub uniform_ratio: Option<f64>,
    pub homogeneous_device: Option<String>,
    pub homogeneous_tokens_per_s: Option<f64>,
    pub homogeneous_ratio: Option<f64>,
}

/// Times [`TIMED_RUNS`] plannings of `speed`'s case. Run the speed cases first and one at a time,
/// so that nothing else competes for the cores and the peak RSS is the planner's.
pub fn speed_row(speed: &SpeedCase) -> Result<PlannerSpeedRow, BenchError> {
    let specs = speed.case.specs()?;
    let median_s = match speed.whole_command {
        true => timed_median(|| speed.case.whole_command(&specs))?.0,
        false => timed_median(|| speed.case.plan(&specs))?.0,
    };
    Ok(PlannerSpeedRow {
        case: speed.case.info(&specs),
        whole_command: speed.whole_command,
        runs: TIMED_RUNS,
        median_s,
        target_s: speed.target_s,
        speed_ratio: speed.target_s / median_s,
        peak_rss_mib: peak_rss_mib(),
        memory_target_mib: speed.memory_target_mib,
    })
}

/// The best plan of `case` against both baselines.
pub fn quality_row(case: &Case) -> Result<QualityRow, BenchError> {
    let specs = case.specs()?;
    let (best, baselines) = case.plan(&specs)?;
    let best_tokens_per_s = best.prediction.utilisation.tokens_per_s;
    let uniform_tokens_per_s = baselines.uniform.map(|uniform| uniform.prediction.utilisation.tokens_per_s);
    let (homogeneous_device, homogeneous_tokens_per_s) = baselines
        .homogeneous
        .map(|(device, candidate)| (device, candidate.prediction.utilisation.tokens_per_s))
        .unzip();
    Ok(QualityRow {
        case: case.info(&specs),
        best_tokens_per_s,
        best_mfu: best.prediction.utilisation.mfu,
        uniform_tokens_per_s,
        uniform_ratio: uniform_tokens_per_s.map(|tokens_per_s| best_tokens_per_s / tokens_per_s),
        homogeneous_device,
        homogeneous_tokens_per_s,
        homogeneous_ratio: homogeneous_tokens_per_s.map(|tokens_per_s| best_tokens_per_s / tokens_per_s),
    })
}

/// best/uniform over the quality rows.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct QualitySummary {
    /// Cases where a uniform plan fits.
    pub n_fit: usize,
    /// Means of best/uniform over those; `None` when there are none.
    pub arithmetic_mean: Option<f64>,
    pub geometric_mean: Option<f64>,
    /// Cases where no uniform plan fits at all.
    pub n_misfit: usize,
}

pub fn quality_summary(rows: &[QualityRow]) -> QualitySummary {
    let ratios: Vec<f64> = rows.iter().filter_map(|row| row.uniform_ratio).collect();
    let some = !ratios.is_empty();
    QualitySummary {
        n_fit: ratios.len(),
        arithmetic_mean: some.then(|| arithmetic_mean(&ratios)),
        geometric_mean: some.then(|| geometric_mean(&ratios)),
        n_misfit: rows.len() - ratios.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_case_resolves_and_the_quality_suite_is_mixed() {
        for speed in &SPEED_CASES {
            speed.case.specs().unwrap();
        }
        for case in &QUALITY_CASES {
            let specs = case.specs().unwrap();
            let mut types: Vec<&str> = specs.cluster.groups().iter().map(|group| group.device.name.as_str()).collect();
            types.sort_unstable();
            types.dedup();
            assert!((2..=4).contains(&types.len()), "{}", case.cluster);
            assert!((32..=1024).contains(&specs.cluster.n_gpus()), "{}", case.cluster);
        }
    }

    #[test]
    fn a_quality_row_compares_the_search_with_both_baselines() {
        let case = Case { cluster: "8xh100,8xa100", model: "llama3-8b", global_batch: 64 };
        let row = quality_row(&case).unwrap();
        assert_eq!((row.case.n_gpus, row.case.seq_len), (16, SEQ_LEN));
        // The uniform layouts are among those the search prices, so it never does worse.
        let uniform = row.uniform_ratio.expect("a uniform plan fits 16 GPUs");
        assert!(uniform >= 1.0 - 1e-9, "best/uniform {uniform}");
        assert_eq!(row.homogeneous_device.as_deref().map(|name| name.contains("H100")), Some(true));
        assert!(row.best_mfu > 0.0 && row.best_mfu < 1.0, "{}", row.best_mfu);
    }

    #[test]
    fn the_summary_counts_misfits_apart() {
        let row = |ratio| QualityRow {
            case: CaseInfo { cluster: "c", model: "m", n_gpus: 1, seq_len: 1, global_batch: 1 },
            best_tokens_per_s: 1.0,
            best_mfu: 0.5,
            uniform_tokens_per_s: None,
            uniform_ratio: ratio,
            homogeneous_device: None,
            homogeneous_tokens_per_s: None,
            homogeneous_ratio: None,
        };
        let summary = quality_summary(&[row(Some(2.0)), row(Some(8.0)), row(None)]);
        assert_eq!(summary.n_fit, 2);
        assert_eq!(summary.n_misfit, 1);
        assert!((summary.arithmetic_mean.unwrap() - 5.0).abs() < 1e-12);
        assert!((summary.geometric_mean.unwrap() - 4.0).abs() < 1e-12);
        assert_eq!(quality_summary(&[row(None)]).geometric_mean, None);
    }
}
