//! Plans with windows, lowered to sends and receives.
//!
//! A read of a peer's window between two fences becomes a message the owner sends when it passes
//! the first of them, carrying what it had last written to that range: a `Publish`'s input, or a
//! `ReduceWindows`' output. The reduction itself becomes a copy of the rank's own input and a
//! reducing receive from each peer. Fences disappear; the data they ordered now travels in messages that
//! cannot arrive before it exists. This is what a simulator times (each read is a transfer from
//! the owner), and the reference executor checks that both forms compute the same.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::{Buf, CollectiveError, RankSteps, Step};

/// Reads of peers' windows by (owner, epoch): who reads which range between the owner's fences
/// `epoch` and `epoch + 1` (epoch 0: before the first), in each reader's order.
type Reads = BTreeMap<(usize, usize), Vec<(usize, Range<usize>)>>;

/// Where a rank's window range last came from.
struct Written {
    window: Range<usize>,
    buf: Buf,
    from: Range<usize>,
}

impl Written {
    /// The part of the source behind `window`, if this write covers it.
    fn source(&self, window: &Range<usize>) -> Option<(Buf, Range<usize>)> {
        (self.window.start <= window.start && window.end <= self.window.end).then(|| {
            let start = self.from.start + (window.start - self.window.start);
            (self.buf, start..start + window.len())
        })
    }
}

/// The same collective as `plans`, with every window step replaced by sends and receives. Plans
/// without windows come back unchanged.
pub fn as_messages(plans: &[RankSteps]) -> Result<Vec<RankSteps>, CollectiveError> {
    if plans.iter().all(|plan| plan.window_len == 0) {
        return Ok(plans.to_vec());
    }
    let n = plans.len();
    let reads = peer_reads(plans);
    plans
        .iter()
        .map(|plan| {
            let rank = plan.rank;
            let mut steps = Vec::with_capacity(plan.steps.len());
            let mut written: Vec<Written> = Vec::new();
            let source = |written: &[Written], window: &Range<usize>| {
                written
                    .iter()
                    .rev()
                    .find_map(|w| w.source(window))
                    .ok_or_else(|| CollectiveError::UnwrittenWindow { rank, window: window.clone() })
            };
            let mut epoch = 0;
            let serve = |steps: &mut Vec<Step>, written: &[Written], epoch: usize| {
                for (reader, window) in reads.get(&(rank, epoch)).into_iter().flatten() {
                    let (buf, range) = source(written, window)?;
                    steps.push(Step::Send { to: *reader, buf, range });
                }
                Ok::<_, CollectiveError>(())
            };
            serve(&mut steps, &written, epoch)?;
            for step in &plan.steps {
                match step {
                    Step::Publish { from, at } => {
                        written.push(Written { window: *at..at + from.len(), buf: Buf::Input, from: from.clone() })
                    }
                    Step::Fence => {
                        epoch += 1;
                        serve(&mut steps, &written, epoch)?;
                    }
                    Step::ReduceWindows { from, window, to } => {
                        steps.push(Step::Copy { from: from.clone(), to: to.clone() });
                        for from in (0..n).filter(|&q| q != rank) {
                            steps.push(Step::Recv { from, range: to.clone(), reduce: true });
                        }
                        written.push(Written { window: window.clone(), buf: Buf::Output, from: to.clone() });
                    }
                    Step::Gather { from, to, .. } => {
                        steps.push(Step::Recv { from: *from, range: to.clone(), reduce: false })
                    }
                    other => steps.push(other.clone()),
                }
            }
            Ok(RankSteps { window_len: 0, steps, ..plan.clone() })
        })
        .collect()
}

/// Every read of a peer's window.
fn peer_reads(plans: &[RankSteps]) -> Reads {
    let n = plans.len();
    let mut reads = Reads::new();
    for plan in plans {
        let mut epoch = 0;
        for step in &plan.steps {
            match step {
                Step::Fence => epoch += 1,
                Step::ReduceWindows { window, .. } => {
                    for owner in (0..n).filter(|&q| q != plan.rank) {
                        reads.entry((owner, epoch)).or_default().push((plan.rank, window.clone()));
                    }
                }
                Step::Gather { from, window, .. } => {
                    reads.entry((*from, epoch)).or_default().push((plan.rank, window.clone()))
                }
                _ => {}
            }
        }
    }
    reads
}
