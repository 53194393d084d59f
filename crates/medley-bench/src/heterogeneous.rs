//! Published measured runs of mixed clusters: how far the simulator's predictions are, how well
//! it orders each cluster's layouts, and what a fit to them changes — in-sample and held out.

use std::path::Path;

use medley_cost::{Calibration, Overheads};
use medley_fit::measurements::parse_csv;
use medley_fit::{Accuracy, Fitted, FittedFactor, MeasuredRun, Prediction, by_cluster, cross_validate, fit, predict};
use serde::Serialize;

use crate::BenchError;

/// A source of measured heterogeneous runs: its CSV (`medley calibrate --measured`'s format)
/// and the files its rows name, built in.
struct Source {
    name: &'static str,
    csv: (&'static str, &'static str),
    files: &'static [(&'static str, &'static str)],
}

const AMP: Source = Source {
    name: "AMP (Li et al., NeurIPS 2022, arXiv 2210.07297), heterogeneous-cluster trials",
    csv: ("data/amp-heterogeneous.csv", include_str!("../data/amp-heterogeneous.csv")),
    files: &[
        ("amp-cluster.toml", include_str!("../data/amp-cluster.toml")),
        ("amp-gpt2.json", include_str!("../data/amp-gpt2.json")),
    ],
};

/// The plans are Sailor's, written by `bench/sailor_plans.py` (with the cluster and model files
/// beside them, which the plans hold by value).
const SAILOR: Source = Source {
    name: "Sailor (Strati et al., SOSP 2025, arXiv 2504.17096), MIT cluster validation runs",
    csv: ("data/sailor/mit.csv", include_str!("../data/sailor/mit.csv")),
    files: &[
        ("mit-N2_D1.json", include_str!("../data/sailor/mit-N2_D1.json")),
        ("mit-N2_D2.json", include_str!("../data/sailor/mit-N2_D2.json")),
        ("mit-N3_D1.json", include_str!("../data/sailor/mit-N3_D1.json")),
        ("mit-N4_D1.json", include_str!("../data/sailor/mit-N4_D1.json")),
        ("mit-N4_D2.json", include_str!("../data/sailor/mit-N4_D2.json")),
        ("mit-N4_D4.json", include_str!("../data/sailor/mit-N4_D4.json")),
        ("mit-N6_D2.json", include_str!("../data/sailor/mit-N6_D2.json")),
        ("mit-N6_D3.json", include_str!("../data/sailor/mit-N6_D3.json")),
        ("mit-N6_D6.json", include_str!("../data/sailor/mit-N6_D6.json")),
    ],
};

const SOURCES: [Source; 2] = [AMP, SAILOR];

/// Held-out predictions come from this many folds: each run predicted by a fit of the others.
const FOLDS: usize = 5;

/// What one fit of a source's runs gives on one cluster of it.
#[derive(Clone, Debug, Serialize)]
pub struct FitSummary {
    /// What the fit moved.
    pub knobs: &'static str,
    pub fitted: Accuracy,
    pub held_out: Accuracy,
    /// The fit on all of the source's runs.
    pub factors: Vec<FittedFactor>,
    pub overheads: Option<Overheads>,
}

/// One source's runs of one cluster, under the defaults, then under each fit, in-sample and
/// held out.
#[derive(Clone, Debug, Serialize)]
pub struct ClusterSummary {
    pub source: &'static str,
    pub cluster: String,
    pub n_runs: usize,
    pub defaults: Accuracy,
    pub fits: Vec<FitSummary>,
}

/// The fits compared: the efficiencies alone, then with the framework's overheads.
const FITS: [(Fitted, &str); 2] =
    [(Fitted::Efficiencies, "efficiencies"), (Fitted::EfficienciesAndOverheads, "efficiencies + overheads")];

/// Every source's clusters, summarised.
pub fn summaries() -> Result<Vec<ClusterSummary>, BenchError> {
    let mut out = Vec::new();
    for source in &SOURCES {
        let runs = source.runs()?;
        let base = Calibration::default();
        let defaults = predict(&runs, &base)?;
        let mut fits = Vec::new();
        for (knobs, name) in FITS {
            let fitted = fit(&runs, &base, knobs)?;
            let in_sample = predict(&runs, &fitted.calibration)?;
            let held_out = cross_validate(&runs, &base, knobs, FOLDS)?;
            fits.push((name, fitted, in_sample, held_out));
        }
        for (cluster, members) in by_cluster(&runs) {
            let of = |predictions: &[Prediction]| {
                let picked: Vec<Prediction> = members.iter().map(|&idx| predictions[idx]).collect();
                Accuracy::of(&picked)
            };
            out.push(ClusterSummary {
                source: source.name,
                cluster: cluster.to_string(),
                n_runs: members.len(),
                defaults: of(&defaults),
                fits: fits
                    .iter()
                    .map(|(knobs, fitted, in_sample, held_out)| FitSummary {
                        knobs,
                        fitted: of(in_sample),
                        held_out: of(held_out),
                        factors: fitted.factors.clone(),
                        overheads: fitted.overheads,
                    })
                    .collect(),
            });
        }
    }
    Ok(out)
}

impl Source {
    fn runs(&self) -> Result<Vec<MeasuredRun>, BenchError> {
        let open = |name: &str| {
            self.files
                .iter()
                .find(|(file, _)| *file == name)
                .map(|(_, text)| text.to_string())
                .ok_or_else(|| format!("no built-in file {name}"))
        };
        Ok(parse_csv(self.csv.1, Path::new(self.csv.0), &open)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_built_in_source_reads_into_runs_on_a_mixed_cluster() {
        for source in &SOURCES {
            let runs = source.runs().unwrap();
            // Sailor published nine runs of its MIT cluster.
            assert!(runs.len() >= 9, "{}: {} runs", source.name, runs.len());
            for run in &runs {
                let types: std::collections::BTreeSet<&str> =
                    run.plan.cluster().groups().iter().map(|group| group.device.name.as_str()).collect();
                assert!(types.len() >= 2, "{}: {} is not mixed", source.name, run.label);
            }
        }
    }
}
