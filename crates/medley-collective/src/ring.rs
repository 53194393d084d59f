//! Pipelined rings, and chains for the rooted operations (Patarasuk & Yuan 2009; NCCL's ring).

use std::ops::Range;

use crate::{Buf, Builder, balanced};

/// One pass around `ring` (global ranks in ring order) over `blocks`: at step s, the rank at
/// position p sends block `send_block(p, s)` to position p+1 and receives position p−1's block,
/// reducing when `reduce(s)`. Every step's send must be the block the rank received in the step
/// before (or its own data at step 0), which is what lets the steps pipeline: the order is
/// step-major, so a rank forwards chunk c of step s+1 as soon as it has received chunk c of step s,
/// while chunk c+1 is still on the way.
pub(crate) fn pass(
    b: &mut Builder,
    ring: &[usize],
    blocks: &[Range<usize>],
    n_steps: usize,
    send_block: impl Fn(usize, usize) -> usize,
    reduce: impl Fn(usize) -> bool,
) {
    let m = ring.len();
    if m < 2 || n_steps == 0 {
        return;
    }
    for p in 0..m {
        let (rank, next, prev) = (ring[p], ring[(p + 1) % m], ring[(p + m - 1) % m]);
        b.send(rank, next, Buf::Output, blocks[send_block(p, 0)].clone());
        for s in 0..n_steps {
            let incoming = send_block((p + m - 1) % m, s);
            let next_send = (s + 1 < n_steps).then(|| send_block(p, s + 1));
            debug_assert!(next_send.is_none_or(|block| block == incoming), "ring step {s} does not forward");
            for chunk in b.chunking.split(blocks[incoming].clone()) {
                b.recv(rank, prev, chunk.clone(), reduce(s));
                if next_send.is_some() {
                    b.send(rank, next, Buf::Output, chunk);
                }
            }
        }
    }
}

/// Reduce-scatter around `ring`: position p ends with block p reduced over the ring.
pub(crate) fn reduce_scatter_pass(b: &mut Builder, ring: &[usize], blocks: &[Range<usize>]) {
    let m = ring.len();
    pass(b, ring, blocks, m.saturating_sub(1), |p, s| (p + 2 * m - s - 1) % m, |_| true);
}

/// All-gather around `ring`: position p starts with block p and ends with all of them.
pub(crate) fn all_gather_pass(b: &mut Builder, ring: &[usize], blocks: &[Range<usize>]) {
    let m = ring.len();
    pass(b, ring, blocks, m.saturating_sub(1), |p, s| (p + m - s) % m, |_| false);
}

/// All-reduce around `ring` over `blocks`: a reduce-scatter and an all-gather as one pipelined pass.
pub(crate) fn all_reduce_pass(b: &mut Builder, ring: &[usize], blocks: &[Range<usize>]) {
    let m = ring.len();
    let half = m.saturating_sub(1);
    let send_block = |p: usize, s: usize| {
        if s < half { (p + 2 * m - s - 1) % m } else { (p + 2 * m - (s - half)) % m }
    };
    pass(b, ring, blocks, 2 * half, send_block, |s| s < half);
}

fn everyone(b: &Builder) -> Vec<usize> {
    (0..b.steps.len()).collect()
}

pub(crate) fn all_reduce(b: &mut Builder, len: usize) {
    let ring = everyone(b);
    for &rank in &ring {
        b.copy(rank, 0..len, 0..len);
    }
    all_reduce_pass(b, &ring, &balanced(len, ring.len()));
}

pub(crate) fn reduce_scatter(b: &mut Builder, blocks: &[Range<usize>]) {
    let ring = everyone(b);
    let total = blocks.last().map_or(0, |b| b.end);
    for &rank in &ring {
        b.copy(rank, 0..total, 0..total);
    }
    reduce_scatter_pass(b, &ring, blocks);
}

pub(crate) fn all_gather(b: &mut Builder, blocks: &[Range<usize>]) {
    let ring = everyone(b);
    for &rank in &ring {
        b.copy(rank, 0..blocks[rank].len(), blocks[rank].clone());
    }
    all_gather_pass(b, &ring, blocks);
}

/// The flat chain for a rooted operation: root, root+1, root+2, … (wrapping).
pub(crate) fn chain_from(root: usize, n: usize) -> Vec<usize> {
    (0..n).map(|v| (root + v) % n).collect()
}

/// Broadcast down `chain` (its first rank is the root), each rank forwarding chunk by chunk.
pub(crate) fn broadcast(b: &mut Builder, chain: &[usize], len: usize) {
    b.copy(chain[0], 0..len, 0..len);
    for (v, &rank) in chain.iter().enumerate() {
        for chunk in b.chunking.split(0..len) {
            if v > 0 {
                b.recv(rank, chain[v - 1], chunk.clone(), false);
            }
            if let Some(&next) = chain.get(v + 1) {
                b.send(rank, next, Buf::Output, chunk);
            }
        }
    }
}

/// Reduce up `chain` to its first rank (the root): the last rank starts, each rank adds its own
/// input chunk by chunk before forwarding.
pub(crate) fn reduce(b: &mut Builder, chain: &[usize], len: usize) {
    for (v, &rank) in chain.iter().enumerate() {
        b.copy(rank, 0..len, 0..len);
        for chunk in b.chunking.split(0..len) {
            if let Some(&prev) = chain.get(v + 1) {
                b.recv(rank, prev, chunk.clone(), true);
            }
            if v > 0 {
                b.send(rank, chain[v - 1], Buf::Output, chunk);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{Algorithm, Chunking, Counts, Group, Op, ReduceOp, Step, plan_steps};
    use std::num::NonZeroUsize;

    /// A rank's steps as letters: C(opy), S(end), R(eceive), D(ivide).
    fn shape(steps: &[Step]) -> String {
        let letter = |step: &Step| match step {
            Step::Copy { .. } => 'C',
            Step::Send { .. } => 'S',
            Step::Recv { .. } => 'R',
            Step::DivideBy { .. } => 'D',
            _ => unreachable!("rings use no windows"),
        };
        steps.iter().map(letter).collect()
    }

    #[test]
    fn a_rank_forwards_each_chunk_as_soon_as_it_has_it() {
        // 3 ranks, blocks of 2 elements, chunks of 1: after sending its first block, a rank
        // alternates receive-forward per chunk through the 2(n−1) = 4 steps; the last step only
        // receives.
        let group = Group::single_domain(3).unwrap();
        let chunking = Chunking::MaxElems(NonZeroUsize::new(1).unwrap());
        let op = Op::AllReduce { op: ReduceOp::Avg };
        let plans = plan_steps(op, &group, &Counts::Same(6), Algorithm::Ring, chunking).unwrap();
        assert_eq!(shape(&plans[0].steps), "CSSRSRSRSRSRSRSRRD");
        let reduces: Vec<bool> = plans[0]
            .steps
            .iter()
            .filter_map(|s| if let Step::Recv { reduce, .. } = s { Some(*reduce) } else { None })
            .collect();
        assert_eq!(reduces, [true, true, true, true, false, false, false, false]);
    }
}
