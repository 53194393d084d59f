//! The reference executor: runs step lists in memory, one rank after another, with an unbounded
//! FIFO channel per (sender, receiver) pair. It is the oracle for the algorithms' tests and for
//! the communicator's: it checks every rule of the [step format](crate::step) and reports the
//! first broken one instead of producing a wrong answer.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Debug;
use std::ops::Range;
use thiserror::Error;

use crate::{Buf, Combine, Counts, Op, RankSteps, ReduceOp, Step};

/// An element type the reference executor can reduce.
pub trait Element: Copy + Debug + PartialEq {
    /// What the output buffer holds before any step writes it: a value that shows up in a result
    /// read from scratch.
    const POISON: Self;
    fn combine(self, other: Self, how: Combine) -> Self;
    fn divide(self, divisor: usize) -> Self;
}

impl Element for f64 {
    const POISON: f64 = f64::NAN;
    fn combine(self, other: f64, how: Combine) -> f64 {
        match how {
            Combine::Sum => self + other,
            Combine::Prod => self * other,
            Combine::Max => self.max(other),
            Combine::Min => self.min(other),
        }
    }
    fn divide(self, divisor: usize) -> f64 {
        self / divisor as f64
    }
}

impl Element for i64 {
    const POISON: i64 = 1_000_003;
    fn combine(self, other: i64, how: Combine) -> i64 {
        match how {
            Combine::Sum => self.wrapping_add(other),
            Combine::Prod => self.wrapping_mul(other),
            Combine::Max => self.max(other),
            Combine::Min => self.min(other),
        }
    }
    fn divide(self, divisor: usize) -> i64 {
        self / divisor as i64
    }
}

/// A broken rule, found while executing.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ExecError {
    #[error("{n_plans} step lists for {n_inputs} inputs")]
    RankCount { n_plans: usize, n_inputs: usize },
    #[error("rank {rank}: step list says rank {claimed}")]
    WrongRank { rank: usize, claimed: usize },
    #[error("rank {rank}: input of {got} elements, the plan expects {expected}")]
    InputLength { rank: usize, expected: usize, got: usize },
    #[error("rank {rank} step {step_idx}: range {range:?} outside its {buf:?} buffer of {len} elements")]
    OutOfBounds { rank: usize, step_idx: usize, buf: Buf, range: Range<usize>, len: usize },
    #[error("rank {rank} step {step_idx}: copy from {from:?} to {to:?} changes the length")]
    CopyLength { rank: usize, step_idx: usize, from: Range<usize>, to: Range<usize> },
    #[error("rank {rank} step {step_idx}: peer {peer} is not one of {n_ranks} ranks")]
    NoSuchPeer { rank: usize, step_idx: usize, peer: usize, n_ranks: usize },
    #[error("rank {rank} step {step_idx}: receives {expected} elements from rank {from}, the message holds {got}")]
    MessageLength { rank: usize, step_idx: usize, from: usize, expected: usize, got: usize },
    #[error("rank {rank} step {step_idx}: range {range:?} outside rank {owner}'s window of {len} elements")]
    WindowOutOfBounds { rank: usize, step_idx: usize, owner: usize, range: Range<usize>, len: usize },
    #[error("deadlock: no rank can progress; (rank, waiting on) {waiting:?}")]
    Deadlock { waiting: Vec<(usize, usize)> },
    #[error("{count} messages from rank {from} to rank {to} were never received")]
    Unreceived { from: usize, to: usize, count: usize },
}

fn check_window(
    (rank, step_idx): (usize, usize),
    owner: usize,
    range: &Range<usize>,
    len: usize,
) -> Result<(), ExecError> {
    if range.start > range.end || range.end > len {
        return Err(ExecError::WindowOutOfBounds { rank, step_idx, owner, range: range.clone(), len });
    }
    Ok(())
}

fn check_range(rank: usize, step_idx: usize, buf: Buf, range: &Range<usize>, len: usize) -> Result<(), ExecError> {
    if range.start > range.end || range.end > len {
        return Err(ExecError::OutOfBounds { rank, step_idx, buf, range: range.clone(), len });
    }
    Ok(())
}

/// Runs `plans` over `inputs` (one per rank) and returns every rank's whole output buffer.
pub fn execute<T: Element>(plans: &[RankSteps], inputs: &[Vec<T>]) -> Result<Vec<Vec<T>>, ExecError> {
    let n = plans.len();
    if inputs.len() != n {
        return Err(ExecError::RankCount { n_plans: n, n_inputs: inputs.len() });
    }
    for (rank, (plan, input)) in plans.iter().zip(inputs).enumerate() {
        if plan.rank != rank {
            return Err(ExecError::WrongRank { rank, claimed: plan.rank });
        }
        if input.len() != plan.input_len {
            return Err(ExecError::InputLength { rank, expected: plan.input_len, got: input.len() });
        }
    }
    let mut outputs: Vec<Vec<T>> = plans.iter().map(|plan| vec![T::POISON; plan.output_len]).collect();
    let mut windows: Vec<Vec<T>> = plans.iter().map(|plan| vec![T::POISON; plan.window_len]).collect();
    let mut channels: BTreeMap<(usize, usize), VecDeque<Vec<T>>> = BTreeMap::new();
    let mut next_step = vec![0usize; n];
    // Fences each rank has reached, and passed.
    let (mut arrived, mut passed) = (vec![0usize; n], vec![0usize; n]);
    loop {
        let mut progressed = false;
        for rank in 0..n {
            let plan = &plans[rank];
            while let Some(step) = plan.steps.get(next_step[rank]) {
                let step_idx = next_step[rank];
                let output = &mut outputs[rank];
                let peer_ok = |peer: usize| {
                    if peer < n { Ok(()) } else { Err(ExecError::NoSuchPeer { rank, step_idx, peer, n_ranks: n }) }
                };
                match step {
                    Step::Copy { from, to } => {
                        check_range(rank, step_idx, Buf::Input, from, inputs[rank].len())?;
                        check_range(rank, step_idx, Buf::Output, to, output.len())?;
                        if from.len() != to.len() {
                            return Err(ExecError::CopyLength { rank, step_idx, from: from.clone(), to: to.clone() });
                        }
                        output[to.clone()].copy_from_slice(&inputs[rank][from.clone()]);
                    }
                    Step::Send { to, buf, range } => {
                        peer_ok(*to)?;
                        let source = match buf {
                            Buf::Input => &inputs[rank],
                            Buf::Output => &*output,
                        };
                        check_range(rank, step_idx, *buf, range, source.len())?;
                        channels.entry((rank, *to)).or_default().push_back(source[range.clone()].to_vec());
                    }
                    Step::Recv { from, range, reduce } => {
                        peer_ok(*from)?;
                        check_range(rank, step_idx, Buf::Output, range, output.len())?;
                        let Some(message) = channels.get_mut(&(*from, rank)).and_then(VecDeque::pop_front) else {
                            break;
                        };
                        if message.len() != range.len() {
                            return Err(ExecError::MessageLength {
                                rank,
                                step_idx,
                                from: *from,
                                expected: range.len(),
                                got: message.len(),
                            });
                        }
                        for (slot, value) in output[range.clone()].iter_mut().zip(message) {
                            *slot = if *reduce { slot.combine(value, plan.combine) } else { value };
                        }
                    }
                    Step::DivideBy { range, divisor } => {
                        check_range(rank, step_idx, Buf::Output, range, output.len())?;
                        for slot in &mut output[range.clone()] {
                            *slot = slot.divide(*divisor);
                        }
                    }
                    Step::Publish { from, at } => {
                        check_range(rank, step_idx, Buf::Input, from, inputs[rank].len())?;
                        let to = *at..at + from.len();
                        check_window((rank, step_idx), rank, &to, windows[rank].len())?;
                        windows[rank][to].copy_from_slice(&inputs[rank][from.clone()]);
                    }
                    Step::Fence => {
                        arrived[rank] = passed[rank] + 1;
                        if arrived.iter().any(|&a| a < arrived[rank]) {
                            break;
                        }
                        passed[rank] += 1;
                    }
                    Step::ReduceWindows { from, window, to } => {
                        check_range(rank, step_idx, Buf::Input, from, inputs[rank].len())?;
                        check_range(rank, step_idx, Buf::Output, to, output.len())?;
                        if window.len() != to.len() || from.len() != to.len() {
                            return Err(ExecError::CopyLength { rank, step_idx, from: window.clone(), to: to.clone() });
                        }
                        for (owner, owned) in windows.iter().enumerate().filter(|(owner, _)| *owner != rank) {
                            check_window((rank, step_idx), owner, window, owned.len())?;
                        }
                        let share = |owner: usize| match owner == rank {
                            true => &inputs[rank][from.clone()],
                            false => &windows[owner][window.clone()],
                        };
                        let mut acc = share(0).to_vec();
                        for owner in 1..n {
                            for (a, &b) in acc.iter_mut().zip(share(owner)) {
                                *a = a.combine(b, plan.combine);
                            }
                        }
                        check_window((rank, step_idx), rank, window, windows[rank].len())?;
                        output[to.clone()].copy_from_slice(&acc);
                        windows[rank][window.clone()].copy_from_slice(&acc);
                    }
                    Step::Gather { from, window, to } => {
                        peer_ok(*from)?;
                        check_range(rank, step_idx, Buf::Output, to, output.len())?;
                        check_window((rank, step_idx), *from, window, windows[*from].len())?;
                        if window.len() != to.len() {
                            return Err(ExecError::CopyLength { rank, step_idx, from: window.clone(), to: to.clone() });
                        }
                        output[to.clone()].copy_from_slice(&windows[*from][window.clone()]);
                    }
                }
                next_step[rank] += 1;
                progressed = true;
            }
        }
        let waiting: Vec<(usize, usize)> = (0..n)
            .filter_map(|rank| match plans[rank].steps.get(next_step[rank]) {
                Some(Step::Recv { from, .. }) => Some((rank, *from)),
                Some(Step::Fence) => Some((rank, arrived.iter().position(|&a| a < arrived[rank]).unwrap_or(rank))),
                _ => None,
            })
            .collect();
        if waiting.is_empty() {
            break;
        }
        if !progressed {
            return Err(ExecError::Deadlock { waiting });
        }
    }
    if let Some((&(from, to), queue)) = channels.iter().find(|(_, queue)| !queue.is_empty()) {
        return Err(ExecError::Unreceived { from, to, count: queue.len() });
    }
    Ok(outputs)
}

/// What each rank's result must hold after `op` over `counts` on `inputs` (rank r's input at r),
/// computed without any algorithm; `None` where the result is unspecified (a reduce's non-roots).
/// The oracle both the algorithms' and the communicator's tests compare with, each with its own
/// element types: `combine` and `divide` are their arithmetic.
pub fn expected_results<T: Clone>(
    op: Op,
    counts: &Counts,
    inputs: &[Vec<T>],
    combine: impl Fn(T, T, Combine) -> T,
    divide: impl Fn(T, usize) -> T,
) -> Vec<Option<Vec<T>>> {
    let n = inputs.len();
    let reduce_all = |op: ReduceOp| {
        let mut acc = inputs[0].clone();
        for input in &inputs[1..] {
            for (a, b) in acc.iter_mut().zip(input) {
                *a = combine(a.clone(), b.clone(), op.into());
            }
        }
        if op == ReduceOp::Avg {
            acc.iter_mut().for_each(|a| *a = divide(a.clone(), n));
        }
        acc
    };
    let block = |sizes: &[usize], r: usize| {
        let start: usize = sizes[..r].iter().sum();
        start..start + sizes[r]
    };
    match (op, counts) {
        (Op::AllReduce { op }, _) => vec![Some(reduce_all(op)); n],
        (Op::ReduceScatter { op }, Counts::PerRank(sizes)) => {
            let all = reduce_all(op);
            (0..n).map(|r| Some(all[block(sizes, r)].to_vec())).collect()
        }
        (Op::AllGather, _) => vec![Some(inputs.concat()); n],
        (Op::Broadcast { root }, _) => vec![Some(inputs[root].clone()); n],
        (Op::Reduce { op, root }, _) => (0..n).map(|r| (r == root).then(|| reduce_all(op))).collect(),
        (Op::AllToAll, Counts::PerPair(matrix)) => (0..n)
            .map(|to| Some((0..n).flat_map(|from| inputs[from][block(&matrix[from], to)].to_vec()).collect()))
            .collect(),
        (Op::Barrier, _) => vec![Some(Vec::new()); n],
        (op, counts) => panic!("{op:?} takes other counts than {counts:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(rank: usize, steps: Vec<Step>) -> RankSteps {
        RankSteps { rank, input_len: 1, output_len: 1, result: 0..1, combine: Combine::Sum, window_len: 1, steps }
    }

    #[test]
    fn two_receives_first_deadlock() {
        let plans = [
            rank(0, vec![Step::Recv { from: 1, range: 0..1, reduce: false }]),
            rank(1, vec![Step::Recv { from: 0, range: 0..1, reduce: false }]),
        ];
        let err = execute(&plans, &[vec![1.0], vec![2.0]]).unwrap_err();
        assert_eq!(err, ExecError::Deadlock { waiting: vec![(0, 1), (1, 0)] });
    }

    #[test]
    fn mismatched_lengths_and_leftovers_are_reported() {
        let send = |to, range| Step::Send { to, buf: Buf::Input, range };
        let plans = [rank(0, vec![send(1, 0..1)]), rank(1, vec![Step::Recv { from: 0, range: 0..0, reduce: true }])];
        assert!(matches!(execute(&plans, &[vec![1i64], vec![2]]), Err(ExecError::MessageLength { got: 1, .. })));
        let plans = [rank(0, vec![send(1, 0..1), send(1, 0..1)]), rank(1, vec![])];
        assert_eq!(execute(&plans, &[vec![1i64], vec![2]]), Err(ExecError::Unreceived { from: 0, to: 1, count: 2 }));
    }

    #[test]
    fn a_fence_not_every_rank_reaches_deadlocks() {
        let plans = [rank(0, vec![Step::Fence]), rank(1, vec![])];
        assert_eq!(execute(&plans, &[vec![1i64], vec![2]]), Err(ExecError::Deadlock { waiting: vec![(0, 1)] }));
    }

    #[test]
    fn windows_are_read_after_the_fence() {
        let steps = |peer| {
            vec![
                Step::Publish { from: 0..1, at: 0 },
                Step::Fence,
                Step::Gather { from: peer, window: 0..1, to: 0..1 },
                Step::Fence,
            ]
        };
        let outputs = execute(&[rank(0, steps(1)), rank(1, steps(0))], &[vec![3i64], vec![4]]).unwrap();
        assert_eq!(outputs, vec![vec![4], vec![3]]);
        let past_the_end = [rank(0, vec![Step::Publish { from: 0..1, at: 1 }]), rank(1, vec![])];
        assert!(matches!(execute(&past_the_end, &[vec![1i64], vec![2]]), Err(ExecError::WindowOutOfBounds { .. })));
    }

    #[test]
    fn exchange_with_async_sends_reduces() {
        let steps = |peer| {
            vec![
                Step::Copy { from: 0..1, to: 0..1 },
                Step::Send { to: peer, buf: Buf::Output, range: 0..1 },
                Step::Recv { from: peer, range: 0..1, reduce: true },
            ]
        };
        let outputs = execute(&[rank(0, steps(1)), rank(1, steps(0))], &[vec![3i64], vec![4]]).unwrap();
        assert_eq!(outputs, vec![vec![7], vec![7]]);
    }
}
