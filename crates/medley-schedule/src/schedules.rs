//! Pipeline schedules: the order in which one rank runs its compute passes. Each schedule is one
//! function of (rank, ranks, chunks, micro-batches) with its phases named; [`crate::generate`]
//! lowers the order into a program with its sends, receives and gradient synchronisation.

use medley_spec::ScheduleKind;

/// The order of rank `rank_idx`'s passes under `kind` over `m` micro-batches in a pipeline of
/// `n_ranks` ranks holding `n_chunks` chunks each.
pub(crate) fn passes(kind: ScheduleKind, rank_idx: usize, n_ranks: usize, n_chunks: u32, m: u32) -> Vec<ChunkPass> {
    let on_one_chunk = |passes: Vec<Pass>| passes.into_iter().map(|pass| ChunkPass { pass, chunk: 0 }).collect();
    match kind {
        ScheduleKind::Gpipe => on_one_chunk(gpipe(m)),
        ScheduleKind::OneFOneB => on_one_chunk(kfkb(rank_idx, n_ranks, m, 1)),
        ScheduleKind::Kfkb { k } => on_one_chunk(kfkb(rank_idx, n_ranks, m, k.get())),
        ScheduleKind::ZbH1 => on_one_chunk(zb_h1(rank_idx, n_ranks, m)),
        ScheduleKind::Interleaved => interleaved(rank_idx, n_ranks, n_chunks, m),
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

/// A pass on one of the rank's model chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ChunkPass {
    pub pass: Pass,
    pub chunk: u32,
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
fn kfkb(rank_idx: usize, n_ranks: usize, m: u32, k: u32) -> Vec<Pass> {
    let mut passes = Vec::with_capacity(2 * m as usize);
    let warm_up = m.min(k.saturating_mul((n_ranks - rank_idx - 1) as u32));
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
fn zb_h1(rank_idx: usize, n_ranks: usize, m: u32) -> Vec<Pass> {
    let mut passes = Vec::with_capacity(3 * m as usize);
    let max_deferred = rank_idx as u32;
    let warm_up = m.min((n_ranks - rank_idx - 1) as u32);
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

/// Interleaved 1F1B for rank `rank_idx` of p = `n_ranks` with v = `n_chunks` chunks, in
/// Megatron-LM's order (`forward_backward_pipelining_with_interleaving` and its
/// `get_schedule_table`): forwards take the micro-batches in groups of p, running each group
/// through chunk 0, then chunk 1, … (the last group may be smaller); backwards follow the same
/// table with the chunks reversed. Rank i warms up with (p − i − 1)·2 + (v − 1)·p forwards,
/// capped at the m·v the step runs, then alternates one forward and one backward, then drains.
/// [`crate::generate`] calls it only for m a multiple of p (Megatron-LM's requirement) or below p;
/// a smaller last group deadlocks.
fn interleaved(rank_idx: usize, n_ranks: usize, n_chunks: u32, m: u32) -> Vec<ChunkPass> {
    let group = n_ranks as u32;
    let table: Vec<(u32, u32)> = (0..m)
        .step_by(group as usize)
        .flat_map(|first| {
            let micro_batches = first..m.min(first + group);
            (0..n_chunks).flat_map(move |chunk| micro_batches.clone().map(move |micro_batch| (micro_batch, chunk)))
        })
        .collect();
    let total = table.len();
    let forward = |idx: usize| ChunkPass { pass: Pass::Forward(table[idx].0), chunk: table[idx].1 };
    let backward = |idx: usize| ChunkPass { pass: Pass::Backward(table[idx].0), chunk: n_chunks - 1 - table[idx].1 };
    let warm_up = total.min((n_ranks - rank_idx - 1) * 2 + (n_chunks as usize - 1) * n_ranks);
    let mut passes = Vec::with_capacity(2 * total);
    // Warm-up: enough forwards that the first backward's gradient can come round.
    passes.extend((0..warm_up).map(forward));
    // Steady: one forward, one backward.
    for backwarded in 0..total - warm_up {
        passes.push(forward(warm_up + backwarded));
        passes.push(backward(backwarded));
    }
    // Cool-down: the backwards still owed.
    passes.extend((total - warm_up..total).map(backward));
    passes
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU32;

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

    fn check(kind: ScheduleKind, rank_idx: usize, n_ranks: usize, m: u32, expected: &str) {
        let passes: Vec<Pass> =
            passes(kind, rank_idx, n_ranks, 1, m).into_iter().map(|chunk_pass| chunk_pass.pass).collect();
        assert_eq!(render(&passes), expected, "{kind} stage {rank_idx}/{n_ranks} m={m}");
    }

    /// Interleaved passes as `F<micro-batch>.<chunk>`.
    fn check_interleaved(rank_idx: usize, n_ranks: usize, n_chunks: u32, m: u32, expected: &str) {
        let passes = passes(ScheduleKind::Interleaved, rank_idx, n_ranks, n_chunks, m);
        let words: Vec<String> =
            passes.iter().map(|chunk_pass| format!("{}.{}", render(&[chunk_pass.pass]), chunk_pass.chunk)).collect();
        assert_eq!(words.join(" "), expected, "rank {rank_idx}/{n_ranks} v={n_chunks} m={m}");
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
        for (rank_idx, n_ranks, m) in [(0, 4, 6), (2, 4, 6), (0, 1, 3), (1, 3, 1)] {
            assert_eq!(passes(k(1), rank_idx, n_ranks, 1, m), passes(ScheduleKind::OneFOneB, rank_idx, n_ranks, 1, m));
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
    fn interleaved_phases_follow_megatron() {
        // p = 2, v = 2, m = 4: groups of 2 micro-batches, chunk 0 then chunk 1. Rank 0 warms up
        // with 1·2 + 1·2 = 4 forwards, rank 1 with 2.
        check_interleaved(
            0,
            2,
            2,
            4,
            "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0",
        );
        check_interleaved(
            1,
            2,
            2,
            4,
            "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0",
        );
        // m = 3 is not a multiple of p = 2: the last group holds one micro-batch.
        check_interleaved(1, 2, 2, 3, "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F2.1 B1.0 B2.1 B2.0");
        // Fewer chunk-micro-batches than the warm-up: all forwards, then all backwards.
        check_interleaved(0, 4, 2, 1, "F0.0 F0.1 B0.1 B0.0");
    }
}
