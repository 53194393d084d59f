//! Even long-context layouts, as Megatron-LM, DeepSpeed-Ulysses and USP lay a job out on any
//! fleet: cp × hp × pp × dp over the devices in id order (hp innermost, then cp, dp and pp,
//! Megatron-LM's rank order), equal head–tail shards, equal heads and tokens per device, layers
//! and micro-batches split evenly. Each kind is tried with every factorisation and recompute
//! mode, and its fastest fitting plan is the baseline.

use medley_cost::Calibration;
use medley_spec::{Cluster, DeviceId, JobSpec, ModelSpec};
use rayon::prelude::*;

use super::{ContextSpace, HP_DEGREES, unsupported};
use crate::candidates::Candidate;
use crate::error::PlanError;
use crate::evaluate::evaluate;
use crate::plan::Plan;

/// Which even layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvenKind {
    /// Ring attention over cp devices, one each (Megatron-LM `--context-parallel-size`).
    Ring,
    /// Ulysses over hp devices of a node, no ring (DeepSpeed-Ulysses).
    Ulysses,
    /// Ulysses inside rings of groups, both at least 2 (USP, Fang & Zhao 2024).
    Usp,
}

impl EvenKind {
    pub const ALL: [EvenKind; 3] = [EvenKind::Ring, EvenKind::Ulysses, EvenKind::Usp];

    pub fn name(self) -> &'static str {
        match self {
            EvenKind::Ring => "even-ring",
            EvenKind::Ulysses => "even-ulysses",
            EvenKind::Usp => "even-usp",
        }
    }

    fn allows(self, cp: u32, hp: u32) -> bool {
        match self {
            EvenKind::Ring => hp == 1 && cp >= 2,
            EvenKind::Ulysses => cp == 1 && hp >= 2,
            EvenKind::Usp => cp >= 2 && hp >= 2,
        }
    }
}

/// The fastest fitting even plans of each kind.
#[derive(Clone, Debug, Default)]
pub struct EvenBaselines {
    pub ring: Option<Candidate>,
    pub ulysses: Option<Candidate>,
    pub usp: Option<Candidate>,
}

impl EvenBaselines {
    pub fn compute(cluster: &Cluster, model: &ModelSpec, job: &JobSpec, calibration: &Calibration) -> Self {
        let found: Vec<Option<Candidate>> =
            EvenKind::ALL.par_iter().map(|&kind| even_plan(cluster, model, job, calibration, kind)).collect();
        let [ring, ulysses, usp] = <[_; 3]>::try_from(found).expect("one result per kind");
        EvenBaselines { ring, ulysses, usp }
    }

    /// Each kind with its plan, if one fits.
    pub fn rows(&self) -> [(EvenKind, Option<&Candidate>); 3] {
        [
            (EvenKind::Ring, self.ring.as_ref()),
            (EvenKind::Ulysses, self.ulysses.as_ref()),
            (EvenKind::Usp, self.usp.as_ref()),
        ]
    }

    /// The fastest of them.
    pub fn best(&self) -> Option<&Candidate> {
        self.rows()
            .into_iter()
            .filter_map(|(_, candidate)| candidate)
            .min_by(|a, b| a.prediction.step_time_s.total_cmp(&b.prediction.step_time_s))
    }
}

/// The fastest fitting even plan of `kind` over every device of the cluster, if any.
pub fn even_plan(
    cluster: &Cluster,
    model: &ModelSpec,
    job: &JobSpec,
    calibration: &Calibration,
    kind: EvenKind,
) -> Option<Candidate> {
    if unsupported(job).is_some() || crate::error::check_precision(cluster, job).is_err() {
        return None;
    }
    let space = ContextSpace::new(cluster, model, job, calibration);
    let n_gpus = cluster.n_gpus();
    let n_layers = model.n_layers();
    let mut layouts = Vec::new();
    for hp in HP_DEGREES.into_iter().filter(|&hp| hp <= model.n_heads() && n_gpus.is_multiple_of(hp)) {
        for cp in (1..=n_gpus / hp).filter(|&cp| (n_gpus / hp).is_multiple_of(cp) && kind.allows(cp, hp)) {
            let per_stage = cp * hp;
            for pp in (0..).map(|e| 1u32 << e).take_while(|&pp| pp <= n_layers && per_stage * pp <= n_gpus) {
                let dp = n_gpus / (per_stage * pp);
                if per_stage * pp * dp == n_gpus && job.global_batch().is_multiple_of(dp) {
                    layouts.extend(space.recomputes().into_iter().map(|recompute| (cp, hp, pp, dp, recompute)));
                }
            }
        }
    }
    layouts
        .into_par_iter()
        .filter_map(|(cp, hp, pp, dp, recompute)| {
            let plan = space.even(cp, hp, pp, dp, recompute)?;
            let prediction = evaluate(&plan, calibration);
            prediction.fits.then_some(Candidate { plan, prediction })
        })
        .min_by(|a, b| a.prediction.step_time_s.total_cmp(&b.prediction.step_time_s))
}

/// The fastest fitting even plan with `cp` groups of `hp` devices per stage, `pp` stages and
/// `dp` replicas over the first devices (a Megatron-LM `--context-parallel-size` what-if when
/// hp = 1), over the recompute modes the job allows; when none fits, the one that needs the
/// least memory, its prediction saying by how much it does not.
#[allow(clippy::too_many_arguments)]
pub fn even_fixed(
    cluster: &Cluster,
    model: &ModelSpec,
    job: &JobSpec,
    calibration: &Calibration,
    cp: u32,
    hp: u32,
    pp: u32,
    dp: u32,
) -> Result<Candidate, PlanError> {
    let layout = format!("cp={cp},hp={hp},pp={pp},dp={dp}");
    crate::error::check_precision(cluster, job)?;
    let error = |message: String| PlanError::Layout { layout: layout.clone(), message };
    if let Some(reason) = unsupported(job) {
        return Err(error(reason));
    }
    let needed = u64::from(cp) * u64::from(hp) * u64::from(pp) * u64::from(dp);
    if needed > u64::from(cluster.n_gpus()) {
        return Err(error(format!("needs {needed} devices, the cluster has {}", cluster.n_gpus())));
    }
    if pp > model.n_layers() || !job.global_batch().is_multiple_of(dp) {
        return Err(error(format!(
            "pp must be at most the model's {} layers and dp must divide the global batch of {}",
            model.n_layers(),
            job.global_batch()
        )));
    }
    let space = ContextSpace::new(cluster, model, job, calibration);
    let plans: Vec<Plan> =
        space.recomputes().into_iter().filter_map(|recompute| space.even(cp, hp, pp, dp, recompute)).collect();
    if plans.is_empty() {
        return Err(error(format!(
            "no such layout: each group of hp devices must sit in one node, each stage in one vendor, and {} \
             tokens must split into cp equal shards of whole {}-token block pairs",
            job.seq_len(),
            space.block
        )));
    }
    let candidates: Vec<Candidate> = plans
        .into_iter()
        .map(|plan| {
            let prediction = evaluate(&plan, calibration);
            Candidate { plan, prediction }
        })
        .collect();
    let fastest = candidates
        .iter()
        .filter(|candidate| candidate.prediction.fits)
        .min_by(|a, b| a.prediction.step_time_s.total_cmp(&b.prediction.step_time_s));
    let overflow = |candidate: &Candidate| {
        let prediction = &candidate.prediction;
        prediction
            .peak_memory_by_device_gib
            .iter()
            .map(|(name, peak)| peak / prediction.capacity_gib[name])
            .fold(0.0, f64::max)
    };
    let smallest = || candidates.iter().min_by(|a, b| overflow(a).total_cmp(&overflow(b)));
    Ok(fastest.or_else(smallest).expect("at least one plan").clone())
}

impl ContextSpace<'_> {
    /// The even plan with these degrees, if its groups sit in nodes, its stages in one vendor
    /// and the sequence splits into cp equal shards of whole block pairs.
    fn even(&self, cp: u32, hp: u32, pp: u32, dp: u32, recompute: medley_spec::Recompute) -> Option<Plan> {
        let seq_len = u64::from(self.job.seq_len());
        if !seq_len.is_multiple_of(2 * u64::from(cp) * u64::from(self.block)) {
            return None;
        }
        let shard = seq_len / u64::from(cp);
        let per_stage = cp * hp;
        let replicas = (0..dp)
            .map(|replica| {
                let stages = (0..pp)
                    .map(|stage| {
                        let first = (replica + dp * stage) * per_stage;
                        (0..cp)
                            .map(|group| {
                                let start = first + group * hp;
                                ((start..start + hp).collect::<Vec<DeviceId>>(), shard)
                            })
                            .collect()
                    })
                    .collect();
                self.replica(stages, self.job.global_batch() / dp, recompute, true)
            })
            .collect();
        self.plan(recompute, replicas).ok()
    }
}
