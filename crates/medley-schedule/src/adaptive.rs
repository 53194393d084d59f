//! Adaptive kFkB (Ada-Grouper, Wang et al. 2023, arXiv 2303.01675): between steps, pick the group
//! size k from what the last steps showed.
//!
//! Larger k amortises each pipeline transfer's stalls over k micro-batches, which pays when the
//! network is slow or preempted by other jobs; it costs k times the in-flight activations and a
//! longer fill. The right k moves with the network, so the policy learns it online: it keeps a
//! smoothed step time per k it has tried, moves to the best, doubles k while communication stalls
//! dominate and k has not been tried, and re-probes a neighbour of the best every few steps
//! because old measurements go stale when the network changes. `k_max` comes from the caller's
//! memory check. The simulator and the runtime run this same code between steps.

use std::collections::BTreeMap;
use std::num::NonZeroU32;

use medley_spec::{Schedule, ScheduleKind};

/// The fixed order of each step of a run under a [`Schedule`]: the loop the simulator and the
/// runtime share; adaptive kFkB's k comes from [`AdaptiveK`]. Ask [`StepSchedules::next`] before a step, tell [`StepSchedules::observe`] after it.
#[derive(Clone, Debug, PartialEq)]
pub struct StepSchedules {
    schedule: Schedule,
    adaptive: AdaptiveK,
}

impl StepSchedules {
    /// Steps under `schedule`; adaptive kFkB never exceeds `k_max` (the caller's memory check).
    pub fn new(schedule: Schedule, k_max: u32) -> Self {
        StepSchedules { schedule, adaptive: AdaptiveK::new(k_max) }
    }

    /// The next step's schedule.
    pub fn next(&self) -> ScheduleKind {
        match self.schedule {
            Schedule::Fixed(kind) => kind,
            Schedule::Adaptive => ScheduleKind::Kfkb { k: NonZeroU32::new(self.adaptive.k()).expect("k ≥ 1") },
        }
    }

    /// Books what a step run under `kind` showed; kFkB steps teach the adaptive policy.
    pub fn observe(&mut self, kind: ScheduleKind, step_time_s: f64, pipeline_wait_fraction: f64) {
        if let ScheduleKind::Kfkb { k } = kind {
            self.adaptive.observe(StepObservation { k: k.get(), step_time_s, pipeline_wait_fraction });
        }
    }
}

/// What one step showed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepObservation {
    pub k: u32,
    pub step_time_s: f64,
    /// Share of the step the average rank was blocked on pipeline transfers already on their
    /// way (not on bubbles, and not on gradient all-reduces, which k does not change).
    pub pipeline_wait_fraction: f64,
}

/// The adaptive group-size policy.
#[derive(Clone, Debug, PartialEq)]
pub struct AdaptiveK {
    k_max: u32,
    k: u32,
    /// Smoothed step time per k tried.
    step_time_s: BTreeMap<u32, f64>,
    steps_since_probe: u32,
    probe_up_next: bool,
}

/// Stalls above this share of the step ask for a larger k.
const STALLED: f64 = 0.05;
/// Steps between re-probes of the best k's neighbours.
const PROBE_PERIOD: u32 = 6;
/// Weight of the newest measurement in the smoothed step time.
const SMOOTHING: f64 = 0.5;

impl AdaptiveK {
    /// Starts at k = 1 (1F1B), never exceeding `k_max` (at least 1).
    pub fn new(k_max: u32) -> Self {
        AdaptiveK { k_max: k_max.max(1), k: 1, step_time_s: BTreeMap::new(), steps_since_probe: 0, probe_up_next: true }
    }

    /// The group size for the next step.
    pub fn k(&self) -> u32 {
        self.k
    }

    /// Books a step's observation and picks the next k.
    pub fn observe(&mut self, observation: StepObservation) -> u32 {
        let estimate = self.step_time_s.entry(observation.k).or_insert(observation.step_time_s);
        *estimate = SMOOTHING * observation.step_time_s + (1.0 - SMOOTHING) * *estimate;
        self.steps_since_probe += 1;
        let best = self.best();
        let larger = self.larger(observation.k);
        self.k = if observation.pipeline_wait_fraction > STALLED && !self.step_time_s.contains_key(&larger) {
            larger
        } else if self.steps_since_probe >= PROBE_PERIOD {
            self.steps_since_probe = 0;
            self.probe_up_next = !self.probe_up_next;
            if self.probe_up_next { self.smaller(best) } else { self.larger(best) }
        } else {
            best
        };
        self.k
    }

    fn best(&self) -> u32 {
        self.step_time_s.iter().min_by(|a, b| a.1.total_cmp(b.1)).map_or(1, |(&k, _)| k)
    }

    /// The next candidate above `k`: double it, within `k_max`.
    fn larger(&self, k: u32) -> u32 {
        k.saturating_mul(2).min(self.k_max)
    }

    fn smaller(&self, k: u32) -> u32 {
        (k / 2).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the policy against a step-time function of k; returns the ks it chose.
    fn run(k_max: u32, steps: usize, step_time_s: impl Fn(u32) -> f64, waits: impl Fn(u32) -> f64) -> Vec<u32> {
        let mut policy = AdaptiveK::new(k_max);
        let mut chosen = Vec::new();
        for _ in 0..steps {
            let k = policy.k();
            chosen.push(k);
            policy.observe(StepObservation { k, step_time_s: step_time_s(k), pipeline_wait_fraction: waits(k) });
        }
        chosen
    }

    #[test]
    fn climbs_while_stalled_and_settles_on_the_best() {
        // Stalls fall with k; the step is fastest at k = 4.
        let time = |k: u32| [0.0, 10.0, 8.0, 7.0, 6.0, 7.5, 7.5, 7.5, 7.0][k as usize];
        let waits = |k: u32| if k < 8 { 0.3 / f64::from(k) } else { 0.02 };
        let chosen = run(8, 30, time, waits);
        assert_eq!(&chosen[..4], [1, 2, 4, 8]);
        let settled = chosen[4..].iter().filter(|&&k| k == 4).count();
        assert!(settled >= 20, "{chosen:?}");
    }

    #[test]
    fn stays_at_one_on_a_quiet_network_and_respects_the_limit() {
        let chosen = run(8, 12, f64::from, |_| 0.0);
        assert!(chosen.iter().filter(|&&k| k == 1).count() >= 10, "{chosen:?}");
        let chosen = run(3, 12, |k| 10.0 / f64::from(k), |_| 0.5);
        assert!(chosen.iter().all(|&k| k <= 3), "{chosen:?}");
        assert_eq!(*chosen.last().unwrap(), 3);
    }
}
