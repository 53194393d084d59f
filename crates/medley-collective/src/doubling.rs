//! Recursive doubling (Thakur, Rabenseifner & Gropp 2005): log₂ n rounds in which every rank
//! exchanges its whole buffer with one partner and both reduce, for small messages. Two ranks
//! need a single exchange, one message each way, where the ring needs two dependent ones and the
//! tree a round trip through the root.
//!
//! With p the largest power of two up to n and rem = n − p, the first 2·rem ranks pair up before
//! the rounds (the even one hands its input to the odd one, which stands for both) and after them
//! (the odd one hands the result back). Partners combine the same two values in the two orders,
//! so with commutative operations every rank ends with the same bits.

use crate::{Buf, Builder};

/// Rank `v` of the rounds, as a rank of the group.
fn real(v: usize, rem: usize) -> usize {
    if v < rem { 2 * v + 1 } else { v + rem }
}

pub(crate) fn all_reduce(b: &mut Builder, len: usize) {
    let n = b.steps.len();
    for rank in 0..n {
        b.copy(rank, 0..len, 0..len);
    }
    if n < 2 {
        return;
    }
    let p = 1 << n.ilog2();
    let rem = n - p;
    for pair in 0..rem {
        let (even, odd) = (2 * pair, 2 * pair + 1);
        b.send(even, odd, Buf::Output, 0..len);
        b.recv(odd, even, 0..len, true);
    }
    let mut mask = 1;
    while mask < p {
        for v in 0..p {
            let (rank, partner) = (real(v, rem), real(v ^ mask, rem));
            b.send(rank, partner, Buf::Output, 0..len);
            b.recv(rank, partner, 0..len, true);
        }
        mask <<= 1;
    }
    for pair in 0..rem {
        let (even, odd) = (2 * pair, 2 * pair + 1);
        b.send(odd, even, Buf::Output, 0..len);
        b.recv(even, odd, 0..len, false);
    }
}

#[cfg(test)]
mod tests {
    use crate::{Algorithm, Chunking, Counts, Group, Op, ReduceOp, Step, plan_steps};

    #[test]
    fn two_ranks_exchange_once_and_odd_groups_fold_in_and_out() {
        let op = Op::AllReduce { op: ReduceOp::Sum };
        let plan = |n| {
            let group = Group::single_domain(n).unwrap();
            plan_steps(op, &group, &Counts::Same(8), Algorithm::RecursiveDoubling, Chunking::Whole).unwrap()
        };
        for rank in plan(2) {
            let peer = 1 - rank.rank;
            assert_eq!(
                rank.steps[1..],
                [
                    Step::Send { to: peer, buf: crate::Buf::Output, range: 0..8 },
                    Step::Recv { from: peer, range: 0..8, reduce: true }
                ]
            );
        }
        // 3 ranks: rank 0 folds into rank 1, which exchanges with rank 2 and hands back the result.
        let three = plan(3);
        let messages = |rank: usize| three[rank].steps.iter().filter(|s| !matches!(s, Step::Copy { .. })).count();
        assert_eq!([messages(0), messages(1), messages(2)], [2, 4, 2]);
    }
}
