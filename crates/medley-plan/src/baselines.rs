//! Layouts medley's plans are compared with, and layouts a user already runs.
//!
//! - `uniform`: the best Megatron-style layout that ignores heterogeneity — tp × pp × dp over all
//!   devices in id order (tp innermost, then dp, then pp, Megatron-LM's default rank order), layers
//!   and batch split evenly.
//! - `best-homogeneous`: the best plan that uses one device type only.
//! - `fixed`: a Megatron-style layout with degrees the user gives (`--fix tp=8,pp=4,dp=2`).

use std::fmt;
use std::str::FromStr;

use medley_cost::{Calibration, CostModel, Setting};
use medley_spec::{Cluster, JobSpec, ModelSpec};
use rayon::prelude::*;

use crate::assemble::{ReplicaLayout, assemble, stages_from_counts};
use crate::error::PlanError;
use crate::evaluate::evaluate;
use crate::plan::{Plan, tp_splits_heads};
use crate::search::{Candidate, SearchOptions, candidate_settings, search, settings_with_tp};

/// Megatron parallel degrees; their product is the number of devices used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Degrees {
    pub tp: u32,
    pub pp: u32,
    pub dp: u32,
}

impl fmt::Display for Degrees {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tp={},pp={},dp={}", self.tp, self.pp, self.dp)
    }
}

impl FromStr for Degrees {
    type Err = String;
    /// `tp=8,pp=4,dp=2`; an axis left out has degree 1.
    fn from_str(text: &str) -> Result<Self, String> {
        let mut degrees = Degrees { tp: 1, pp: 1, dp: 1 };
        for part in text.split(',').map(str::trim).filter(|part| !part.is_empty()) {
            let (axis, value) =
                part.split_once('=').ok_or_else(|| format!("`{part}`: expected AXIS=DEGREE, e.g. tp=8"))?;
            let value: u32 = value
                .trim()
                .parse()
                .ok()
                .filter(|&value| value > 0)
                .ok_or_else(|| format!("`{part}`: the degree must be a positive integer"))?;
            match axis.trim() {
                "tp" => degrees.tp = value,
                "pp" => degrees.pp = value,
                "dp" => degrees.dp = value,
                other => return Err(format!("unknown axis `{other}`; expected tp, pp or dp")),
            }
        }
        Ok(degrees)
    }
}

/// The Megatron-style plan with `degrees` over the first tp·pp·dp devices.
pub fn megatron_plan(
    cluster: &Cluster,
    cost: &CostModel,
    job: &JobSpec,
    setting: Setting,
    degrees: Degrees,
) -> Result<Plan, PlanError> {
    check_degrees(cluster, cost.model(), degrees)?;
    let error = |message: String| PlanError::Layout { layout: degrees.to_string(), message };
    let n_layers = cost.model().n_layers();
    let n_micro_batches = job.global_batch() / setting.micro_batch;
    if !n_micro_batches.is_multiple_of(degrees.dp) {
        return Err(error(format!(
            "{n_micro_batches} micro-batches of {} do not split evenly over dp={}",
            setting.micro_batch, degrees.dp
        )));
    }
    let counts: Vec<u32> =
        (0..degrees.pp).map(|stage| n_layers / degrees.pp + u32::from(stage < n_layers % degrees.pp)).collect();
    let replicas = (0..degrees.dp)
        .map(|dp_rank| {
            let device_groups = (0..degrees.pp)
                .map(|pp_rank| {
                    let first = degrees.tp * (dp_rank + degrees.dp * pp_rank);
                    (first..first + degrees.tp).collect()
                })
                .collect();
            ReplicaLayout {
                n_micro_batches: n_micro_batches / degrees.dp,
                stages: stages_from_counts(device_groups, &counts),
            }
        })
        .collect();
    Ok(assemble(cluster, cost, job, setting, replicas))
}

/// Checks that `degrees` can be laid out on `cluster` for `model` at all.
fn check_degrees(cluster: &Cluster, model: &ModelSpec, degrees: Degrees) -> Result<(), PlanError> {
    let error = |message: String| Err(PlanError::Layout { layout: degrees.to_string(), message });
    let n_used = u64::from(degrees.tp) * u64::from(degrees.pp) * u64::from(degrees.dp);
    if n_used > u64::from(cluster.n_gpus()) {
        return error(format!("needs {n_used} devices, the cluster has {}", cluster.n_gpus()));
    }
    // The layout takes the first tp·pp·dp devices; only their groups must host whole TP groups.
    let used_groups = cluster.group_first_ids().into_iter().filter(|&first| u64::from(first) < n_used).count();
    let misfit = cluster.groups()[..used_groups].iter().find(|group| !group.gpus_per_node.is_multiple_of(degrees.tp));
    if let Some(group) = misfit {
        return error(format!(
            "tp={} does not divide the {} GPUs per node of {}: a tensor-parallel group must sit in one node",
            degrees.tp, group.gpus_per_node, group.device.name
        ));
    }
    if !tp_splits_heads(model, degrees.tp) {
        return error(format!(
            "tp={} does not divide the model's {} attention heads and {} kv heads",
            degrees.tp,
            model.n_heads(),
            model.n_kv_heads()
        ));
    }
    if degrees.pp > model.n_layers() {
        return error(format!("pp={} exceeds the model's {} layers", degrees.pp, model.n_layers()));
    }
    Ok(())
}

/// The fastest fitting Megatron-style plan with `degrees` over the settings the job allows.
pub fn fixed(
    cluster: &Cluster,
    model: &ModelSpec,
    job: &JobSpec,
    calibration: &Calibration,
    degrees: Degrees,
) -> Result<Candidate, PlanError> {
    check_degrees(cluster, model, degrees)?;
    let cost = CostModel::new(model, job.seq_len(), calibration);
    let mut layout_error = None;
    let (mut built, mut best) = (false, None::<Candidate>);
    for setting in settings_with_tp(job, degrees.tp) {
        match megatron_plan(cluster, &cost, job, setting, degrees) {
            Ok(plan) => {
                built = true;
                let prediction = evaluate(&plan, calibration);
                if prediction.fits && best.as_ref().is_none_or(|b| prediction.step_time_s < b.prediction.step_time_s) {
                    best = Some(Candidate { plan, prediction });
                }
            }
            Err(err) => layout_error = Some(err),
        }
    }
    // A layout that builds but never fits is a memory problem, not bad input.
    best.ok_or_else(|| match layout_error {
        Some(err) if !built => err,
        _ => PlanError::NothingFits(format!(
            "layout {degrees} does not fit {} in memory with any micro-batch size or recompute the job allows",
            model.name()
        )),
    })
}

/// The best uniform (heterogeneity-blind) plan over every device, if any fits.
pub fn uniform(cluster: &Cluster, model: &ModelSpec, job: &JobSpec, calibration: &Calibration) -> Option<Candidate> {
    let n_gpus = cluster.n_gpus();
    let all_groups: Vec<usize> = (0..cluster.groups().len()).collect();
    let settings = candidate_settings(cluster, model, job, &all_groups);
    let mut layouts = Vec::new();
    for setting in settings {
        let per_tp = n_gpus / setting.tp;
        if !n_gpus.is_multiple_of(setting.tp) {
            continue;
        }
        for pp in (1..=model.n_layers().min(per_tp)).filter(|pp| per_tp.is_multiple_of(*pp)) {
            layouts.push((setting, Degrees { tp: setting.tp, pp, dp: per_tp / pp }));
        }
    }
    let cost = CostModel::new(model, job.seq_len(), calibration);
    layouts
        .par_iter()
        .filter_map(|&(setting, degrees)| {
            let plan = megatron_plan(cluster, &cost, job, setting, degrees).ok()?;
            let prediction = evaluate(&plan, calibration);
            prediction.fits.then_some(Candidate { plan, prediction })
        })
        .min_by(|a, b| a.prediction.step_time_s.total_cmp(&b.prediction.step_time_s))
}

/// The best plan on one device type, with that type's name, if any fits.
pub fn best_homogeneous(
    cluster: &Cluster,
    model: &ModelSpec,
    job: &JobSpec,
    calibration: &Calibration,
) -> Option<(String, Candidate)> {
    let mut names: Vec<&str> = cluster.groups().iter().map(|group| group.device.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    names
        .into_iter()
        .filter_map(|name| {
            let groups = (0..cluster.groups().len()).filter(|&g| cluster.groups()[g].device.name == name).collect();
            let options = SearchOptions { top: 1, groups: Some(groups), exhaustive: false };
            let outcome = search(cluster, model, job, calibration, &options).ok()?;
            outcome.candidates.into_iter().next().map(|candidate| (name.to_string(), candidate))
        })
        .min_by(|a, b| a.1.prediction.step_time_s.total_cmp(&b.1.prediction.step_time_s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn degrees_parse_with_defaults_and_errors() {
        assert_eq!("tp=8,pp=4,dp=2".parse(), Ok(Degrees { tp: 8, pp: 4, dp: 2 }));
        assert_eq!("pp=2".parse(), Ok(Degrees { tp: 1, pp: 2, dp: 1 }));
        assert!("tp=0".parse::<Degrees>().unwrap_err().contains("positive"));
        assert!("ep=2".parse::<Degrees>().unwrap_err().contains("unknown axis"));
        assert!("tp8".parse::<Degrees>().unwrap_err().contains("AXIS=DEGREE"));
    }
}
