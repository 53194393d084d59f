//! All-reduce through windows, for ranks that map each other's memory.
//!
//! The buffer goes through in segments of at most one chunk, alternating between two window slots.
//! Per segment every rank publishes the shares its peers reduce, fences, combines its own share
//! from its input and every peer's window in one pass, fences, and copies the other shares
//! straight out of their owners' windows: each element is copied in once (or not at all, in its
//! reducer's own share), read once per rank and copied out once, with no chain of dependent
//! messages. DeepSpeed's and oneCCL's shared-memory all-reduces, and NCCL's
//! one-shot kernels over symmetric memory, have this shape. Alternating slots lets a rank publish
//! segment k+1 while a slower peer still gathers segment k: it cannot publish k+2 into the slot of
//! k before passing the fence that every rank reaches only after gathering k.
//!
//! The plan starts with a barrier of messages: fences carry no description of the call, frames
//! do, so a rank that runs another collective meets a frame it does not expect and reports the
//! mismatch, where it would otherwise wait at a fence that never comes.

use std::ops::Range;

use crate::{Builder, Step, balanced};

/// Plans the all-reduce of `len` elements and returns the window length every rank needs.
pub(crate) fn all_reduce(b: &mut Builder, len: usize) -> usize {
    let n = b.steps.len();
    let segments: Vec<_> = b.chunking.split(0..len).collect();
    let slot_len = segments.first().map_or(0, |segment| segment.len());
    if !segments.is_empty() {
        crate::pairwise::barrier(b);
    }
    for (k, segment) in segments.iter().enumerate() {
        let base = (k % 2) * slot_len;
        let shares = balanced(segment.len(), n);
        // A share's elements in the buffer and in the segment's window slot.
        let at = |share: &Range<usize>| segment.start + share.start..segment.start + share.end;
        let in_slot = |share: &Range<usize>| base + share.start..base + share.end;
        for r in 0..n {
            let steps = &mut b.steps[r];
            // Peers read the other shares; this rank combines its own straight from its input.
            let (before, after) = (0..shares[r].start, shares[r].end..segment.len());
            for part in [before, after].into_iter().filter(|part| !part.is_empty()) {
                steps.push(Step::Publish { from: at(&part), at: in_slot(&part).start });
            }
            steps.push(Step::Fence);
            let own = &shares[r];
            if !own.is_empty() {
                steps.push(Step::ReduceWindows { from: at(own), window: in_slot(own), to: at(own) });
            }
            steps.push(Step::Fence);
            for (q, share) in shares.iter().enumerate().filter(|(q, share)| *q != r && !share.is_empty()) {
                steps.push(Step::Gather { from: q, window: in_slot(share), to: at(share) });
            }
        }
    }
    if !segments.is_empty() {
        b.steps.iter_mut().for_each(|steps| steps.push(Step::Fence));
    }
    slot_len * segments.len().min(2)
}

#[cfg(test)]
mod tests {
    use crate::{Algorithm, Chunking, Counts, Group, Op, ReduceOp, Step, plan_steps};
    use std::num::NonZeroUsize;

    #[test]
    fn segments_alternate_slots_and_no_rank_publishes_its_own_share() {
        // 10 elements in segments of 4 over 3 ranks: shares of 2, 1, 1; then 1, 1, 0 of the last 2.
        let group = Group::single_domain(3).unwrap();
        let chunking = Chunking::MaxElems(NonZeroUsize::new(4).unwrap());
        let op = Op::AllReduce { op: ReduceOp::Sum };
        let plans = plan_steps(op, &group, &Counts::Same(10), Algorithm::Direct, chunking).unwrap();
        let own_elems = [2 + 2 + 1, 1 + 1 + 1, 1 + 1];
        for (plan, own) in plans.iter().zip(own_elems) {
            assert_eq!(plan.window_len, 8);
            assert_eq!(plan.steps.iter().filter(|step| **step == Step::Fence).count(), 2 * 3 + 1);
            assert_eq!(plan.steps.last(), Some(&Step::Fence));
            let published: Vec<_> = plan
                .steps
                .iter()
                .filter_map(|step| match step {
                    Step::Publish { from, at } => Some((from.clone(), *at)),
                    _ => None,
                })
                .collect();
            assert_eq!(published.iter().map(|(from, _)| from.len()).sum::<usize>(), 10 - own, "rank {}", plan.rank);
            for (from, at) in published {
                let segment = from.start / 4;
                assert_eq!(at, (segment % 2) * 4 + from.start % 4, "rank {}: {from:?}", plan.rank);
            }
        }
    }
}
