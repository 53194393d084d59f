//! The default algorithm for an operation, by message size and group shape.

use crate::{Algorithm, Group, Op};

/// Below this many bytes per rank, latency dominates: trees (log₂ n steps) beat rings (n−1).
/// NCCL's tuner switches from tree/LL protocols to ring in the same tens-of-KiB range.
pub const SMALL_BYTES: usize = 64 << 10;

/// From this many bytes per rank, a group spanning several domains uses the hierarchical
/// all-reduce, reduce-scatter and all-gather: below it the extra phases' latencies outweigh the bridge traffic saved.
pub const LARGE_BYTES: usize = 1 << 20;

/// From this many bytes per rank, ranks of one domain that share memory all-reduce through
/// windows: below it the two fences per segment cost more than the ring's messages.
pub const DIRECT_BYTES: usize = 256 << 10;

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
}
