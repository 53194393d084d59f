//! Pipeline schedules: the order in which one stage runs its compute passes. Each schedule is one
//! function of (stage, stages, micro-batches) with its phases named; [`crate::generate`] lowers
//! the order into a program with its sends, receives and gradient synchronisation.

use std::fmt;
use std::num::NonZeroU32;

use serde::{Deserialize, Serialize};

/// A pipeline schedule the generators know.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (Huang et al. 2019, arXiv 1811.06965).
    Gpipe,
    /// PipeDream-Flush (Narayanan et al. 2021, arXiv 2006.09503): warm-up forwards, then one
    /// forward and one backward alternately.
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over groups of `k` micro-batches (Ada-Grouper, Wang et al. 2023, arXiv 2303.01675):
    /// fewer, larger communication windows at the price of `k` times the in-flight activations.
    /// `k = 1` is 1F1B.
    Kfkb { k: NonZeroU32 },
    /// ZB-H1 (Qi et al. 2023, arXiv 2401.10241, section 2.1): 1F1B's order of forwards and
    /// input-gradient passes, with weight-gradient passes deferred so that every stage keeps as
    /// many micro-batches in flight as 1F1B's first stage, and the deferred ones fill the
    /// cool-down bubble.
    ZbH1,
}

impl ScheduleKind {
    /// Micro-batches stage `stage_idx` of `n_stages` may hold in flight at once with `m`
    /// micro-batches: forwarded and not yet through their whole backward (for a split backward,
    /// its weight-gradient half). GPipe and 1F1B promise what [`medley_spec::Schedule::in_flight`]
    /// says, which the cost model prices; ZB-H1 promises 1F1B's first-stage peak on every stage
    /// (its deferred micro-batches hold only what the weight gradient reads, less than a whole
    /// backward, which is why its peak memory stays within 1F1B's).
    pub fn in_flight(self, stage_idx: usize, n_stages: usize, m: u32) -> u32 {
        match self {
            ScheduleKind::Gpipe => medley_spec::Schedule::Gpipe.in_flight(stage_idx, n_stages, m),
            ScheduleKind::OneFOneB => medley_spec::Schedule::OneFOneB.in_flight(stage_idx, n_stages, m),
            ScheduleKind::ZbH1 => medley_spec::Schedule::OneFOneB.in_flight(0, n_stages, m),
            ScheduleKind::Kfkb { k } => m.min(k.get().saturating_mul((n_stages - stage_idx) as u32)),
        }
    }

    /// The order of stage `stage_idx`'s passes over `m` micro-batches in a pipeline of
    /// `n_stages`.
    pub(crate) fn passes(self, stage_idx: usize, n_stages: usize, m: u32) -> Vec<Pass> {
        match self {
            ScheduleKind::Gpipe => gpipe(m),
            ScheduleKind::OneFOneB => kfkb(stage_idx, n_stages, m, 1),
            ScheduleKind::Kfkb { k } => kfkb(stage_idx, n_stages, m, k.get()),
            ScheduleKind::ZbH1 => zb_h1(stage_idx, n_stages, m),
        }
    }
}

impl From<medley_spec::Schedule> for ScheduleKind {
    fn from(schedule: medley_spec::Schedule) -> Self {
        match schedule {
            medley_spec::Schedule::Gpipe => ScheduleKind::Gpipe,
            medley_spec::Schedule::OneFOneB => ScheduleKind::OneFOneB,
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleKind::Gpipe => f.write_str("gpipe"),
            ScheduleKind::OneFOneB => f.write_str("1f1b"),
            ScheduleKind::Kfkb { k } => write!(f, "kfkb:{k}"),
            ScheduleKind::ZbH1 => f.write_str("zb-h1"),
        }
    }
}

/// One compute pass of a stage on a micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    Forward(u32),
    Backward(u32),
    BackwardInput(u32),
    BackwardWeight(u32),
}

/// GPipe: every forward, then every backward (in the same order, so the last stage can start
/// its backward with the micro-batch its neighbour finished first).
fn gpipe(m: u32) -> Vec<Pass> {
    let forwards = (0..m).map(Pass::Forward);
    let backwards = (0..m).map(Pass::Backward);
    forwards.chain(backwards).collect()
}

/// kFkB: 1F1B whose unit is a group of `k` micro-batches (the last group may be smaller).
/// Stage i of p runs k·(p − i − 1) warm-up forwards, then alternates k forwards and k backwards,
/// then runs the backwards left. With k = 1 this is 1F1B, and stage i holds at most
/// min(m, k·(p − i)) micro-batches' activations.
fn kfkb(stage_idx: usize, n_stages: usize, m: u32, k: u32) -> Vec<Pass> {
    let mut passes = Vec::with_capacity(2 * m as usize);
    let warm_up = m.min(k.saturating_mul((n_stages - stage_idx - 1) as u32));
    // Warm-up: fill the pipeline below this stage.
    passes.extend((0..warm_up).map(Pass::Forward));
    let (mut forwarded, mut backwarded) = (warm_up, 0);
    // Steady: a group of forwards, then as many backwards.
    while forwarded < m {
        let group_end = m.min(forwarded + k);
        passes.extend((forwarded..group_end).map(Pass::Forward));
        forwarded = group_end;
        let backward_end = forwarded.min(backwarded + k);
        passes.extend((backwarded..backward_end).map(Pass::Backward));
        backwarded = backward_end;
    }
    // Cool-down: drain the backwards still owed.
    passes.extend((backwarded..m).map(Pass::Backward));
    passes
}

/// ZB-H1: 1F1B's forwards and input-gradient passes, with stage i deferring up to i
/// weight-gradient passes, so that its p − i 1F1B micro-batches plus i deferred ones make p in
/// flight on every stage. Deferring on later stages lets input gradients, which depend only on
/// the next stage's input gradients, travel back sooner. In cool-down every input-gradient pass
/// is followed by one deferred weight-gradient pass, filling the wait for the next gradient; the
/// rest run at the end.
fn zb_h1(stage_idx: usize, n_stages: usize, m: u32) -> Vec<Pass> {
    let mut passes = Vec::with_capacity(3 * m as usize);
    let max_deferred = stage_idx as u32;
    let warm_up = m.min((n_stages - stage_idx - 1) as u32);
    // Warm-up: as in 1F1B.
    passes.extend((0..warm_up).map(Pass::Forward));
    let mut weights_done = 0;
    // Steady: one forward, one input-gradient pass, and a weight-gradient pass once more than
    // `max_deferred` are owed.
    for backwarded in 0..m - warm_up {
        passes.push(Pass::Forward(warm_up + backwarded));
        passes.push(Pass::BackwardInput(backwarded));
        if backwarded + 1 - weights_done > max_deferred {
            passes.push(Pass::BackwardWeight(weights_done));
            weights_done += 1;
        }
    }
    // Cool-down: each input-gradient pass followed by one owed weight-gradient pass.
    for backwarded in m - warm_up..m {
        passes.push(Pass::BackwardInput(backwarded));
        passes.push(Pass::BackwardWeight(weights_done));
        weights_done += 1;
    }
    // Flush: the weight-gradient passes still owed.
    passes.extend((weights_done..m).map(Pass::BackwardWeight));
    passes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(passes: &[Pass]) -> String {
        let words: Vec<String> = passes
            .iter()
            .map(|pass| match pass {
                Pass::Forward(mb) => format!("F{mb}"),
                Pass::Backward(mb) => format!("B{mb}"),
                Pass::BackwardInput(mb) => format!("I{mb}"),
                Pass::BackwardWeight(mb) => format!("W{mb}"),
            })
            .collect();
        words.join(" ")
    }

    fn check(kind: ScheduleKind, stage_idx: usize, n_stages: usize, m: u32, expected: &str) {
        assert_eq!(render(&kind.passes(stage_idx, n_stages, m)), expected, "{kind} stage {stage_idx}/{n_stages} m={m}");
    }

    fn k(k: u32) -> ScheduleKind {
        ScheduleKind::Kfkb { k: NonZeroU32::new(k).unwrap() }
    }

    #[test]
    fn gpipe_runs_all_forwards_then_all_backwards() {
        check(ScheduleKind::Gpipe, 1, 4, 3, "F0 F1 F2 B0 B1 B2");
    }

    #[test]
    fn one_f_one_b_phases() {
        check(ScheduleKind::OneFOneB, 0, 4, 6, "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5");
        check(ScheduleKind::OneFOneB, 3, 4, 3, "F0 B0 F1 B1 F2 B2");
        // Fewer micro-batches than stages: warm-up takes them all.
        check(ScheduleKind::OneFOneB, 0, 4, 2, "F0 F1 B0 B1");
    }

    #[test]
    fn kfkb_with_k_one_is_1f1b() {
        for (stage_idx, n_stages, m) in [(0, 4, 6), (2, 4, 6), (0, 1, 3), (1, 3, 1)] {
            assert_eq!(k(1).passes(stage_idx, n_stages, m), ScheduleKind::OneFOneB.passes(stage_idx, n_stages, m));
        }
    }

    #[test]
    fn kfkb_groups_micro_batches() {
        check(k(2), 0, 2, 7, "F0 F1 F2 F3 B0 B1 F4 F5 B2 B3 F6 B4 B5 B6");
        check(k(2), 1, 2, 5, "F0 F1 B0 B1 F2 F3 B2 B3 F4 B4");
    }

    #[test]
    fn zb_h1_defers_weight_gradients_on_late_stages() {
        check(ScheduleKind::ZbH1, 0, 3, 4, "F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3");
        check(ScheduleKind::ZbH1, 1, 3, 4, "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3");
        check(ScheduleKind::ZbH1, 2, 3, 4, "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3");
    }

    #[test]
    fn in_flight_promises() {
        assert_eq!(ScheduleKind::Gpipe.in_flight(0, 4, 8), 8);
        assert_eq!(ScheduleKind::OneFOneB.in_flight(1, 4, 8), 3);
        assert_eq!(k(3).in_flight(1, 4, 8), 8);
        assert_eq!(k(2).in_flight(2, 4, 8), 4);
        assert_eq!(ScheduleKind::ZbH1.in_flight(3, 4, 8), 4);
        assert_eq!(ScheduleKind::ZbH1.in_flight(0, 4, 2), 2);
    }

    #[test]
    fn serde_names() {
        assert_eq!(ScheduleKind::from(medley_spec::Schedule::OneFOneB).to_string(), "1f1b");
        assert_eq!(k(4).to_string(), "kfkb:4");
    }
}
