//! How a collective runs: the default algorithm for an operation, by message size and group
//! shape, and the size of its messages. Both engines take both from here, so the simulator and
//! the communicator run the same step lists for the same call.

use std::num::NonZeroUsize;

use crate::{Algorithm, Chunking, Counts, Group, Op};

/// Below this many bytes per rank, latency dominates: trees (log₂ n steps) beat rings (n−1).
/// NCCL's tuner switches from tree/LL protocols to ring in the same tens-of-KiB range.
pub const SMALL_BYTES: usize = 64 << 10;

/// From this many bytes per rank, a group spanning several domains uses the hierarchical
/// all-reduce, reduce-scatter and all-gather: below it the extra phases' latencies outweigh the bridge traffic saved.
pub const LARGE_BYTES: usize = 1 << 20;

/// From this many bytes per rank, ranks of one domain that share memory all-reduce through
/// windows: below it the two fences per segment cost more than recursive doubling's exchanges.
/// Float sums on this 2-core machine, `medley bench comm --setups shm --algorithms
/// ring,recursive-doubling,direct,tree`, two runs: at 64 KiB, 2 ranks took 3.1–3.2 µs direct
/// against 8.1–8.9 recursive doubling and 10.0–10.3 ring, 4 ranks 19.2–19.3 direct against
/// 18.5–20.4 ring; at 16 KiB recursive doubling won (2 ranks 0.9 µs against 1.1 direct,
/// 4 ranks 6.3–6.6 against 12.6–13.8).
pub const DIRECT_BYTES: usize = 64 << 10;

/// The largest message pipelined algorithms send unless told otherwise: big enough that a
/// message's fixed cost is small beside its bytes, small enough that a ring's forwarding starts
/// early.
pub const CHUNK_BYTES: usize = 1 << 20;

/// The most chunks one collective's buffer is cut into, whatever its size: the communicator's
/// shared-memory mailboxes hold four times this many unconsumed messages, and a plan issues at
/// most one block's chunks ahead of a receive.
pub const MAX_CHUNKS: usize = 256;

/// Window plans go through the buffer in segments of this many bytes, half a window: every
/// rank's part of a segment stays in cache between the fences. 64 MiB of floats on this 2-core
/// machine, busbw in three alternating runs per size: 2 bound ranks 4.0–4.3 GB/s with 512 KiB
/// segments, 3.2–3.6 with 8 MiB, 1.5–3.6 with 128 KiB; 4 ranks sharing the cores 1.8–2.6 with
/// 512 KiB and 1.7–2.2 with 8 MiB.
pub const WINDOW_SEGMENT_BYTES: usize = 512 << 10;

/// How one collective call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    pub algorithm: Algorithm,
    pub chunking: Chunking,
}

/// How `op` over `group` runs on buffers of `counts` elements of `elem_bytes` each:
/// `algorithm` when the caller forces one, else [`choose`]'s, or [`choose_with_windows`]' when
/// the ranks map each other's windows, by the largest input any rank passes (so that every rank
/// chooses alike, even when their inputs differ); messages of at most `chunk_bytes` (normally
/// [`CHUNK_BYTES`]) and [`MAX_CHUNKS`] per buffer, or window segments for window algorithms.
/// The communicator and the simulator both call this.
pub fn choose_call(
    op: Op,
    group: &Group,
    counts: &Counts,
    algorithm: Option<Algorithm>,
    elem_bytes: usize,
    windows: bool,
    chunk_bytes: usize,
) -> Choice {
    let bytes = largest_input(op, counts) * elem_bytes;
    let algorithm = algorithm.unwrap_or_else(|| match windows {
        true => choose_with_windows(op, group, bytes),
        false => choose(op, group, bytes),
    });
    let elems = match algorithm.needs_windows() {
        true => WINDOW_SEGMENT_BYTES / elem_bytes,
        false => (chunk_bytes / elem_bytes).max(counts.total().div_ceil(MAX_CHUNKS)),
    };
    Choice { algorithm, chunking: Chunking::MaxElems(NonZeroUsize::new(elems.max(1)).expect("at least one")) }
}

/// The most elements any rank passes as input to `op` over `counts`.
fn largest_input(op: Op, counts: &Counts) -> usize {
    match (op, counts) {
        (_, Counts::Same(len)) => *len,
        (Op::AllGather, Counts::PerRank(sizes)) => sizes.iter().copied().max().unwrap_or(0),
        (_, Counts::PerRank(sizes)) => sizes.iter().sum(),
        (_, Counts::PerPair(matrix)) => matrix.iter().map(|row| row.iter().sum()).max().unwrap_or(0),
    }
}

/// The algorithm for `op` over `group` when every rank maps every other's window: as [`choose`],
/// except that large all-reduces inside one domain go through the windows. A window spanning
/// vendors is not something a bridge offers, so groups of several domains keep the hierarchy.
pub fn choose_with_windows(op: Op, group: &Group, bytes: usize) -> Algorithm {
    match op {
        Op::AllReduce { .. } if group.n_domains() == 1 && bytes >= DIRECT_BYTES => Algorithm::Direct,
        _ => choose(op, group, bytes),
    }
}

/// The algorithm medley uses for `op` over `group` with `bytes` per rank unless the caller forces
/// one (by passing its own to [`crate::plan_steps`]). Always one that [`Algorithm::supports`] `op`.
pub fn choose(op: Op, group: &Group, bytes: usize) -> Algorithm {
    match op {
        Op::AllToAll | Op::Barrier => Algorithm::Pairwise,
        Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather
            if group.n_domains() > 1 && bytes >= LARGE_BYTES =>
        {
            Algorithm::Hierarchical
        }
        // log₂ n dependent exchanges, where the tree takes 2·log₂ n and the ring 2(n−1): two
        // ranks exchange once.
        Op::AllReduce { .. } if bytes < SMALL_BYTES => Algorithm::RecursiveDoubling,
        // Two ranks' tree is a round trip through the root; their ring exchanges both ways at once.
        _ if bytes < SMALL_BYTES && group.n_ranks() > 2 => Algorithm::Tree,
        // The domain-ordered chain is as long as the flat one and never changes domain more often.
        Op::Broadcast { .. } | Op::Reduce { .. } if group.n_domains() > 1 => Algorithm::Hierarchical,
        _ => Algorithm::Ring,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DomainId, ReduceOp};

    #[test]
    fn picks_by_size_and_shape() {
        let one = Group::single_domain(8).unwrap();
        let two = Group::new([0, 0, 0, 0, 1, 1, 1, 1].map(DomainId).to_vec()).unwrap();
        let all_reduce = Op::AllReduce { op: ReduceOp::Sum };
        let check = |group: &Group, bytes, expected| assert_eq!(choose(all_reduce, group, bytes), expected, "{bytes}");
        check(&one, 4 << 10, Algorithm::RecursiveDoubling);
        check(&one, 64 << 20, Algorithm::Ring);
        check(&two, 4 << 10, Algorithm::RecursiveDoubling);
        check(&two, 256 << 10, Algorithm::Ring);
        check(&two, 64 << 20, Algorithm::Hierarchical);
        assert_eq!(choose(Op::Barrier, &two, 0), Algorithm::Pairwise);
        assert_eq!(choose(Op::AllGather, &two, 64 << 20), Algorithm::Hierarchical);
        assert_eq!(choose(Op::AllGather, &one, 64 << 20), Algorithm::Ring);
        assert_eq!(choose(Op::Broadcast { root: 0 }, &two, 64 << 20), Algorithm::Hierarchical);
        assert_eq!(choose(Op::Reduce { op: ReduceOp::Sum, root: 0 }, &one, 64 << 20), Algorithm::Ring);
        assert_eq!(choose(Op::Reduce { op: ReduceOp::Sum, root: 0 }, &two, 1 << 10), Algorithm::Tree);
        assert_eq!(choose(all_reduce, &Group::single_domain(2).unwrap(), 4 << 10), Algorithm::RecursiveDoubling);
        assert_eq!(choose(all_reduce, &Group::single_domain(2).unwrap(), 1 << 20), Algorithm::Ring);
        assert_eq!(choose(Op::AllGather, &one, 4 << 10), Algorithm::Tree);
    }

    #[test]
    fn windows_serve_large_all_reduces_inside_one_domain() {
        let all_reduce = Op::AllReduce { op: ReduceOp::Avg };
        let one = Group::single_domain(4).unwrap();
        let two = Group::new([0, 0, 1, 1].map(DomainId).to_vec()).unwrap();
        assert_eq!(choose_with_windows(all_reduce, &one, 64 << 20), Algorithm::Direct);
        assert_eq!(choose_with_windows(all_reduce, &one, 4 << 10), Algorithm::RecursiveDoubling);
        assert_eq!(choose_with_windows(all_reduce, &two, 64 << 20), Algorithm::Hierarchical);
        assert_eq!(choose_with_windows(Op::AllGather, &one, 64 << 20), Algorithm::Ring);
    }

    #[test]
    fn every_choice_is_supported() {
        let two = Group::new([0, 1, 1].map(DomainId).to_vec()).unwrap();
        let ops = [
            Op::AllReduce { op: ReduceOp::Avg },
            Op::ReduceScatter { op: ReduceOp::Max },
            Op::AllGather,
            Op::Broadcast { root: 1 },
            Op::Reduce { op: ReduceOp::Min, root: 2 },
            Op::AllToAll,
            Op::Barrier,
        ];
        for op in ops {
            for bytes in [0, 4 << 10, 1 << 20, 1 << 30] {
                assert!(choose(op, &two, bytes).supports(op), "{op:?} {bytes}");
                assert!(choose_with_windows(op, &two, bytes).supports(op), "{op:?} {bytes}");
                let one = Group::single_domain(3).unwrap();
                assert!(choose_with_windows(op, &one, bytes).supports(op), "{op:?} {bytes}");
            }
        }
    }

    #[test]
    fn a_call_is_chunked_by_the_chunk_size_up_to_a_bounded_number_of_chunks() {
        let one = Group::single_domain(4).unwrap();
        let all_reduce = Op::AllReduce { op: ReduceOp::Sum };
        let elems = |choice: Choice| match choice.chunking {
            Chunking::MaxElems(max) => max.get(),
            Chunking::Whole => panic!("calls are always chunked"),
        };
        let call = |len, algorithm, windows| {
            choose_call(all_reduce, &one, &Counts::Same(len), algorithm, 4, windows, CHUNK_BYTES)
        };
        assert_eq!(elems(call(1 << 20, None, false)), CHUNK_BYTES / 4);
        let huge = call(1 << 30, None, false);
        assert_eq!(huge.algorithm, Algorithm::Ring);
        assert_eq!((1usize << 30).div_ceil(elems(huge)), MAX_CHUNKS);
        let direct = call(1 << 24, None, true);
        assert_eq!((direct.algorithm, elems(direct)), (Algorithm::Direct, WINDOW_SEGMENT_BYTES / 4));
        assert_eq!(call(16, Some(Algorithm::Tree), true).algorithm, Algorithm::Tree);
    }

    #[test]
    fn ranks_with_uneven_inputs_choose_by_the_largest() {
        let one = Group::single_domain(3).unwrap();
        let sizes = Counts::PerRank(vec![16, SMALL_BYTES, 16]);
        let choice = choose_call(Op::AllGather, &one, &sizes, None, 1, false, CHUNK_BYTES);
        assert_eq!(choice.algorithm, choose(Op::AllGather, &one, SMALL_BYTES));
    }
}
