//! Layouts medley's plans are compared with, and layouts a user already runs.
//!
//! - `uniform`: the best Megatron-style layout that ignores heterogeneity — tp × pp × dp over all
//!   devices in id order (tp innermost, then dp, then pp, Megatron-LM's default rank order), layers
//!   and batch split evenly.
//! - `best-homogeneous`: the best plan that uses one device type only.
//! - `fixed`: a Megatron-style layout with degrees the user gives (`--fix tp=8,pp=4,dp=2`), with
//!   `vpp=V` for V model chunks per pipeline rank under interleaved 1F1B.

use std::fmt;
use std::str::FromStr;

use medley_cost::{Calibration, CostModel, Setting, StateFormat};
use medley_spec::{Cluster, JobSpec, ModelSpec, Recompute, Schedule, ScheduleKind, echo};
use rayon::prelude::*;

use crate::assemble::{ReplicaLayout, assemble, stages_from_counts};
use crate::candidates::Candidate;
use crate::error::PlanError;
use crate::evaluate::evaluate;
use crate::long_context::{ContextDegrees, EvenBaselines, LONG_CONTEXT_TOKENS, even_fixed, search_long_context};
use crate::plan::{Plan, tp_splits_heads};
use crate::search::{SearchOptions, candidate_settings, search, settings_with_tp};

/// Megatron parallel degrees; the product of tp, cp, hp, pp and dp is the number of devices used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Degrees {
    pub tp: u32,
    pub pp: u32,
    pub dp: u32,
    /// Virtual pipeline size: model chunks per pipeline rank (Megatron's
    /// `--num-layers-per-virtual-pipeline-stage` expressed as a count); 1 is no interleaving.
    pub vpp: u32,
    /// Context parallelism: head-parallel groups per stage, each holding a shard of every
    /// sequence (the planner chooses the uneven shards).
    pub cp: u32,
    /// Head parallelism (Ulysses): devices per group, inside one node.
    pub hp: u32,
}

impl Degrees {
    /// Degrees without interleaving or context parallelism.
    pub const fn new(tp: u32, pp: u32, dp: u32) -> Self {
        Degrees { tp, pp, dp, vpp: 1, cp: 1, hp: 1 }
    }

    /// Whether the layout splits each sequence over devices.
    pub fn splits_sequences(&self) -> bool {
        self.cp > 1 || self.hp > 1
    }
}

impl fmt::Display for Degrees {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tp={},pp={},dp={}", self.tp, self.pp, self.dp)?;
        for (axis, degree) in [("vpp", self.vpp), ("cp", self.cp), ("hp", self.hp)] {
            if degree > 1 {
                write!(f, ",{axis}={degree}")?;
            }
        }
        Ok(())
    }
}

impl FromStr for Degrees {
    type Err = String;
    /// `tp=8,pp=4,dp=2`, `tp=8,pp=4,dp=2,vpp=2` or `pp=2,cp=4,hp=2`; an axis left out has
    /// degree 1.
    fn from_str(text: &str) -> Result<Self, String> {
        let mut degrees = Degrees::new(1, 1, 1);
        let mut given: Vec<&str> = Vec::new();
        for part in text.split(',').map(str::trim).filter(|part| !part.is_empty()) {
            let (axis, value) =
                part.split_once('=').ok_or_else(|| format!("`{}`: expected AXIS=DEGREE, e.g. tp=8", echo(part)))?;
            let value: u32 = value
                .trim()
                .parse()
                .ok()
                .filter(|&value| value > 0)
                .ok_or_else(|| format!("`{}`: the degree must be a positive integer", echo(part)))?;
            let axis = axis.trim();
            if given.contains(&axis) {
                return Err(format!("`{}` is given twice; give each axis once", echo(axis)));
            }
            given.push(axis);
            match axis {
                "tp" => degrees.tp = value,
                "pp" => degrees.pp = value,
                "dp" => degrees.dp = value,
                "vpp" => degrees.vpp = value,
                "cp" => degrees.cp = value,
                "hp" => degrees.hp = value,
                other => return Err(format!("unknown axis `{}`; expected tp, pp, dp, vpp, cp or hp", echo(other))),
            }
        }
        Ok(degrees)
    }
}

/// The Megatron-style plan with `degrees` over the first tp·pp·dp devices. With vpp = v > 1 each
/// replica has pp·v virtual stages, layers split as evenly as possible over them, and pipeline
/// rank i holds virtual stages i, i + pp, …; the job's 1F1B becomes interleaved 1F1B.
pub fn megatron_plan(
    cluster: &Cluster,
    cost: &CostModel,
    job: &JobSpec,
    setting: Setting,
    degrees: Degrees,
) -> Result<Plan, PlanError> {
    crate::error::check_precision(cluster, job)?;
    check_degrees(cluster, cost.model(), degrees)?;
    let error = |message: String| PlanError::Layout { layout: degrees.to_string(), message };
    let n_layers = cost.model().n_layers();
    let schedule = chunked_schedule(job.schedule(), degrees.vpp)?;
    let n_micro_batches = job.global_batch() / setting.micro_batch;
    if !n_micro_batches.is_multiple_of(degrees.dp) {
        return Err(error(format!(
            "{n_micro_batches} micro-batches of {} do not split evenly over dp={}",
            setting.micro_batch, degrees.dp
        )));
    }
    let n_stages = degrees.pp * degrees.vpp;
    let counts = layer_counts(n_layers, n_stages);
    let replicas = (0..degrees.dp)
        .map(|dp_rank| {
            let device_groups = (0..n_stages)
                .map(|stage_idx| stage_idx % degrees.pp)
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
    Ok(Plan::assembled(assemble(cluster, cost, job, setting, schedule, degrees.vpp, replicas)))
}

/// Layers per stage as even as they go; where they do not divide, the first and last stages
/// (then the second and second to last, …) take one fewer, as Llama 3 did (arXiv 2407.21783,
/// §3.3.2) and Megatron-LM's `--decoder-first/last-pipeline-num-layers` allow: the first stage
/// also holds the embedding and the most micro-batches in flight, the last the output layer.
fn layer_counts(n_layers: u32, n_stages: u32) -> Vec<u32> {
    let short = (n_stages - n_layers % n_stages) % n_stages;
    let shortened = |stage: u32| {
        let from_edge = stage.min(n_stages - 1 - stage);
        let rank = 2 * from_edge + u32::from(stage > n_stages - 1 - stage);
        rank < short
    };
    (0..n_stages).map(|stage| n_layers.div_ceil(n_stages) - u32::from(shortened(stage))).collect()
}

/// The schedule a Megatron-style plan with `vpp` chunks per rank runs: 1F1B over several
/// chunks is interleaved 1F1B; any other schedule needs one chunk per rank, and interleaved
/// needs several.
fn chunked_schedule(schedule: Schedule, vpp: u32) -> Result<Schedule, PlanError> {
    match (schedule, vpp) {
        (Schedule::Fixed(ScheduleKind::OneFOneB) | Schedule::Fixed(ScheduleKind::Interleaved), 2..) => {
            Ok(Schedule::Fixed(ScheduleKind::Interleaved))
        }
        (Schedule::Fixed(ScheduleKind::Interleaved), _) | (_, 2..) => {
            Err(PlanError::ScheduleMismatch { schedule, virtual_stages: vpp })
        }
        _ => Ok(schedule),
    }
}

/// Checks that `degrees` can be laid out on `cluster` for `model` at all.
fn check_degrees(cluster: &Cluster, model: &ModelSpec, degrees: Degrees) -> Result<(), PlanError> {
    let error = |message: String| Err(PlanError::Layout { layout: degrees.to_string(), message });
    let named = [("tp", degrees.tp), ("pp", degrees.pp), ("dp", degrees.dp), ("vpp", degrees.vpp), ("cp", degrees.cp)];
    if let Some((name, _)) = named.iter().find(|(_, degree)| *degree == 0) {
        return error(format!("{name} must be at least 1"));
    }
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
    if u64::from(degrees.pp) * u64::from(degrees.vpp) > u64::from(model.n_layers()) {
        let stages = match degrees.vpp {
            1 => format!("pp={}", degrees.pp),
            vpp => format!("pp={} × vpp={vpp}", degrees.pp),
        };
        return error(format!("{stages} exceeds the model's {} layers", model.n_layers()));
    }
    if degrees.vpp > 1 && degrees.pp < 2 {
        return error(format!("vpp={} interleaves chunks over pipeline ranks and needs pp of at least 2", degrees.vpp));
    }
    Ok(())
}

/// The fastest fitting Megatron-style plan with `degrees` over the settings the job allows; with
/// cp or hp over 1, the best context-parallel plan with those degrees, its split still chosen by
/// the planner (pp stages and dp replicas per vendor).
pub fn fixed(
    cluster: &Cluster,
    model: &ModelSpec,
    job: &JobSpec,
    calibration: &Calibration,
    degrees: Degrees,
) -> Result<Candidate, PlanError> {
    crate::error::check_precision(cluster, job)?;
    if degrees.splits_sequences() {
        if degrees.tp != 1 || degrees.vpp != 1 {
            return Err(PlanError::Layout {
                layout: degrees.to_string(),
                message: "context and head parallelism take the place of tensor parallelism and run one chunk per \
                          rank: use tp=1 and no vpp"
                    .into(),
            });
        }
        let pinned = ContextDegrees { cp: degrees.cp, hp: degrees.hp, pp: degrees.pp, dp: degrees.dp };
        let outcome = search_long_context(cluster, model, job, calibration, None, Some(pinned), 1)?;
        return Ok(outcome.candidates.into_iter().next().expect("a search returns a plan or an error"));
    }
    check_degrees(cluster, model, degrees)?;
    let cost = CostModel::new(model, job.seq_len(), calibration)
        .with_attention(job.attention())
        .with_states(StateFormat::of_job(job));
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

/// The Megatron-style plan a run was measured on: `degrees` with the job's micro-batch and
/// `recompute`, built whether or not the cost model thinks it fits (it ran).
pub fn as_measured(
    cluster: &Cluster,
    model: &ModelSpec,
    job: &JobSpec,
    calibration: &Calibration,
    degrees: Degrees,
    recompute: Recompute,
) -> Result<Plan, PlanError> {
    let Some(micro_batch) = job.micro_batch() else {
        return Err(PlanError::Layout {
            layout: degrees.to_string(),
            message: "a measured run states its micro-batch".into(),
        });
    };
    // Megatron-LM's context parallelism splits sequences evenly: the measured layout, not the
    // uneven one medley would choose for the same degrees.
    if degrees.splits_sequences() {
        if degrees.tp != 1 || degrees.vpp != 1 {
            let message = "a measured context-parallel run is priced with tp=1 and no vpp".to_string();
            return Err(PlanError::Layout { layout: degrees.to_string(), message });
        }
        let job = job.clone().with_recompute(recompute);
        let Degrees { cp, hp, pp, dp, .. } = degrees;
        return even_fixed(cluster, model, &job, calibration, cp, hp, pp, dp).map(|candidate| candidate.plan);
    }
    let cost = CostModel::new(model, job.seq_len(), calibration)
        .with_attention(job.attention())
        .with_states(StateFormat::of_job(job));
    megatron_plan(cluster, &cost, job, Setting { micro_batch, tp: degrees.tp, recompute }, degrees)
}

/// The best uniform (heterogeneity-blind) plan over every device, if any fits.
pub fn uniform(cluster: &Cluster, model: &ModelSpec, job: &JobSpec, calibration: &Calibration) -> Option<Candidate> {
    crate::error::check_precision(cluster, job).ok()?;
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
            layouts.push((setting, Degrees::new(setting.tp, pp, per_tp / pp)));
        }
    }
    let cost = CostModel::new(model, job.seq_len(), calibration)
        .with_attention(job.attention())
        .with_states(StateFormat::of_job(job));
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
            let options = SearchOptions { top: 1, groups: Some(groups), ..SearchOptions::default() };
            let outcome = search(cluster, model, job, calibration, &options).ok()?;
            outcome.candidates.into_iter().next().map(|candidate| (name.to_string(), candidate))
        })
        .min_by(|a, b| a.1.prediction.step_time_s.total_cmp(&b.1.prediction.step_time_s))
}

/// The layouts a searched plan is compared with.
#[derive(Clone, Debug)]
pub struct Baselines {
    /// [`uniform`].
    pub uniform: Option<Candidate>,
    /// [`best_homogeneous`]: the fastest plan on one device type, with that type's name.
    pub homogeneous: Option<(String, Candidate)>,
}

impl Baselines {
    /// Both baselines, computed side by side.
    pub fn compute(cluster: &Cluster, model: &ModelSpec, job: &JobSpec, calibration: &Calibration) -> Self {
        let (uniform, homogeneous) = rayon::join(
            || uniform(cluster, model, job, calibration),
            || best_homogeneous(cluster, model, job, calibration),
        );
        Baselines { uniform, homogeneous }
    }
}

/// A baseline as a report's table shows it: its name, which device type for the best
/// homogeneous one, and its plan, absent when it does not fit.
#[derive(Clone, Debug)]
pub struct NamedBaseline {
    pub name: String,
    pub detail: Option<String>,
    pub candidate: Option<Candidate>,
}

/// Every layout a searched plan is compared with, by name: uniform and best homogeneous, and
/// for long sequences the even context-parallel layouts.
pub fn named_baselines(
    cluster: &Cluster,
    model: &ModelSpec,
    job: &JobSpec,
    calibration: &Calibration,
) -> Vec<NamedBaseline> {
    let (baselines, even) = rayon::join(
        || Baselines::compute(cluster, model, job, calibration),
        || (job.seq_len() >= LONG_CONTEXT_TOKENS).then(|| EvenBaselines::compute(cluster, model, job, calibration)),
    );
    let mut rows = vec![
        NamedBaseline { name: "uniform".into(), detail: None, candidate: baselines.uniform },
        NamedBaseline {
            name: "best-homogeneous".into(),
            detail: baselines.homogeneous.as_ref().map(|(device, _)| device.clone()),
            candidate: baselines.homogeneous.map(|(_, candidate)| candidate),
        },
    ];
    for (kind, candidate) in even.iter().flat_map(EvenBaselines::rows) {
        let detail = candidate.map(|candidate| candidate.plan.stage_label(&candidate.plan.replicas()[0].stages[0]));
        rows.push(NamedBaseline { name: kind.name().into(), detail, candidate: candidate.cloned() });
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 31: `tp=8,tp=4` was taken as tp=4.
    #[test]
    fn an_axis_given_twice_is_refused_naming_it() {
        for (text, axis) in [("tp=8,tp=4", "tp"), ("tp=8,pp=2,dp=1,pp=2", "pp"), ("vpp=2, vpp=2", "vpp")] {
            let err = text.parse::<Degrees>().unwrap_err();
            assert!(err.contains(&format!("`{axis}` is given twice")), "{text}: {err}");
        }
    }

    /// Issue 31: user text in `--fix` errors goes through medley-spec's one echo.
    #[test]
    fn degree_errors_echo_text_escaped_and_cut() {
        let long = "9".repeat(100_000);
        for text in ["tp\u{1b}[31m=8".to_string(), "tp=\u{1b}".to_string(), format!("tp={long}"), format!("{long}=1")] {
            let err = text.parse::<Degrees>().unwrap_err();
            assert!(!err.chars().any(char::is_control) && err.len() < 1000, "{err:?}");
        }
    }

    #[test]
    fn degrees_parse_with_defaults_and_errors() {
        assert_eq!("tp=8,pp=4,dp=2".parse(), Ok(Degrees::new(8, 4, 2)));
        assert_eq!("pp=2".parse(), Ok(Degrees::new(1, 2, 1)));
        let interleaved = Degrees { vpp: 2, ..Degrees::new(8, 8, 16) };
        assert_eq!("tp=8,pp=8,dp=16,vpp=2".parse(), Ok(interleaved));
        assert_eq!(interleaved.to_string(), "tp=8,pp=8,dp=16,vpp=2");
        assert_eq!(Degrees::new(8, 4, 2).to_string(), "tp=8,pp=4,dp=2");
        assert!("tp=0".parse::<Degrees>().unwrap_err().contains("positive"));
        assert!("ep=2".parse::<Degrees>().unwrap_err().contains("unknown axis"));
        let context = Degrees { cp: 4, hp: 2, ..Degrees::new(1, 2, 1) };
        assert_eq!("pp=2,cp=4,hp=2".parse(), Ok(context));
        assert_eq!(context.to_string(), "tp=1,pp=2,dp=1,cp=4,hp=2");
        assert!("tp8".parse::<Degrees>().unwrap_err().contains("AXIS=DEGREE"));
    }

    #[test]
    fn uneven_layers_leave_the_edge_stages_one_short() {
        // Llama 3 405B over 16 stages: 7 on the first and last, 8 between.
        let llama = layer_counts(126, 16);
        assert_eq!((llama[0], llama[15]), (7, 7));
        assert!(llama[1..15].iter().all(|&n| n == 8), "{llama:?}");
        assert_eq!(layer_counts(10, 4), [2, 3, 3, 2]);
        assert_eq!(layer_counts(9, 4), [2, 2, 3, 2]);
        assert_eq!(layer_counts(8, 4), [2, 2, 2, 2]);
        for n_stages in 1..40 {
            for n_layers in n_stages..130 {
                let counts = layer_counts(n_layers, n_stages);
                assert_eq!(counts.iter().sum::<u32>(), n_layers, "{n_layers} over {n_stages}");
                let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
                assert!(max - min <= 1, "{n_layers} over {n_stages}: {counts:?}");
            }
        }
    }
}
