//! Collective algorithms as data.
//!
//! [`plan_steps`] turns an operation, a group of ranks, element counts and an [`Algorithm`] into
//! one list of [`Step`]s per rank: sends, receives (reducing or copying), local copies. A
//! communicator executes those lists over transports; the simulator lowers them to timed
//! transfers; [`mod@reference`] executes them in memory as the test oracle. Nothing here does I/O.
//! The format, its buffers and its FIFO matching rule are documented in [`step`].

mod choose;
mod direct;
mod doubling;
mod error;
mod group;
mod hierarchical;
mod lower;
mod pairwise;
pub mod reference;
mod ring;
pub mod step;
mod tree;

use serde::{Deserialize, Serialize};
use std::num::NonZeroUsize;
use std::ops::Range;

pub use choose::{
    CHUNK_BYTES, Choice, DIRECT_BYTES, LARGE_BYTES, MAX_CHUNKS, SMALL_BYTES, WINDOW_SEGMENT_BYTES, choose, choose_call,
    choose_with_windows,
};
pub use error::CollectiveError;
pub use group::{DomainId, Group};
pub use lower::as_messages;
pub use step::{Buf, Combine, RankSteps, Step};

/// How elements are combined across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
    Min,
    Prod,
}

/// A collective operation. Ranks are indices into the [`Group`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Op {
    /// Every rank ends with the element-wise reduction of all inputs ([`Counts::Same`]).
    AllReduce { op: ReduceOp },
    /// Rank r ends with block r of the reduction ([`Counts::PerRank`]: block sizes, in rank order).
    ReduceScatter { op: ReduceOp },
    /// Every rank ends with every rank's block, in rank order ([`Counts::PerRank`]).
    AllGather,
    /// Every rank ends with `root`'s input ([`Counts::Same`]).
    Broadcast { root: usize },
    /// `root` ends with the reduction of all inputs ([`Counts::Same`]).
    Reduce { op: ReduceOp, root: usize },
    /// Rank i sends `counts[i][j]` elements to rank j ([`Counts::PerPair`]).
    AllToAll,
    /// No rank leaves before every rank has arrived ([`Counts::Same`] of 0).
    Barrier,
}

impl Op {
    /// The reduction, for the operations that have one.
    pub fn reduce_op(self) -> Option<ReduceOp> {
        match self {
            Op::AllReduce { op } | Op::ReduceScatter { op } | Op::Reduce { op, .. } => Some(op),
            _ => None,
        }
    }
}

/// Element counts, in the shape the operation needs (see [`Op`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Counts {
    /// Every rank's buffer holds this many elements.
    Same(usize),
    /// One block size per rank (uneven allowed); the full buffer is their concatenation.
    PerRank(Vec<usize>),
    /// `[i][j]`: elements rank i sends to rank j.
    PerPair(Vec<Vec<usize>>),
}

impl Counts {
    /// Elements of the whole buffer: one rank's where every rank's is the same, else every block.
    pub fn total(&self) -> usize {
        match self {
            Counts::Same(len) => *len,
            Counts::PerRank(sizes) => sizes.iter().sum(),
            Counts::PerPair(matrix) => matrix.iter().flatten().sum(),
        }
    }
}

/// How the data moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Algorithm {
    /// Pipelined ring (a chain for broadcast and reduce): bandwidth-optimal, n−1 latencies per phase.
    Ring,
    /// Binomial trees: log₂ n latencies, for small messages.
    Tree,
    /// Reduce-scatter inside each domain, all-reduce of each share across domains between the
    /// ranks holding it (the border ranks), all-gather inside each domain: each element crosses
    /// between domains the fewest times. Reduce-scatter and all-gather use the halves; broadcast
    /// and reduce a chain that visits the domains in turn.
    Hierarchical,
    /// Direct exchanges between pairs: all-to-all's rounds (r → r+k), the barrier's
    /// dissemination rounds (r → r+2^k).
    Pairwise,
    /// All-reduce in log₂ n rounds of whole-buffer exchanges between partners r and r xor 2^k
    /// (odd groups fold their extra ranks in first and out last): the fewest dependent messages,
    /// for small messages. Two ranks exchange once.
    RecursiveDoubling,
    /// All-reduce through windows every rank maps (see [`step`]): each rank combines its share of
    /// every segment straight from all windows, then copies the other shares from theirs. Only
    /// for groups whose ranks share memory.
    Direct,
}

impl Algorithm {
    pub const ALL: [Algorithm; 6] = [
        Algorithm::Ring,
        Algorithm::Tree,
        Algorithm::Hierarchical,
        Algorithm::Pairwise,
        Algorithm::RecursiveDoubling,
        Algorithm::Direct,
    ];

    /// Whether the algorithm's plans use windows, which only ranks that share memory have.
    pub fn needs_windows(self) -> bool {
        self == Algorithm::Direct
    }

    /// Whether [`plan_steps`] implements this algorithm for `op`.
    pub fn supports(self, op: Op) -> bool {
        use Algorithm::*;
        match op {
            Op::AllReduce { .. } => matches!(self, Ring | Tree | Hierarchical | RecursiveDoubling | Direct),
            Op::ReduceScatter { .. } | Op::AllGather | Op::Broadcast { .. } | Op::Reduce { .. } => {
                matches!(self, Ring | Tree | Hierarchical)
            }
            Op::AllToAll => self == Pairwise,
            Op::Barrier => matches!(self, Tree | Pairwise),
        }
    }
}

/// How large one message may be: pipelined algorithms cut every block into chunks so that a rank
/// forwards the first chunk while the next is still arriving.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Chunking {
    /// One message per block.
    #[default]
    Whole,
    /// At most this many elements per message.
    MaxElems(NonZeroUsize),
}

impl Chunking {
    /// The chunks of `range`, in order; none for an empty range.
    pub fn split(self, range: Range<usize>) -> impl Iterator<Item = Range<usize>> {
        let step = match self {
            Chunking::Whole => range.len().max(1),
            Chunking::MaxElems(max) => max.get(),
        };
        (range.start..range.end).step_by(step).map(move |start| start..(start + step).min(range.end))
    }
}

/// Per-rank step lists for `op` over `group` (see [`step`] for their meaning).
pub fn plan_steps(
    op: Op,
    group: &Group,
    counts: &Counts,
    algorithm: Algorithm,
    chunking: Chunking,
) -> Result<Vec<RankSteps>, CollectiveError> {
    let n = group.n_ranks();
    if !algorithm.supports(op) {
        return Err(CollectiveError::Unsupported { algorithm, op });
    }
    if let Op::Broadcast { root } | Op::Reduce { root, .. } = op
        && root >= n
    {
        return Err(CollectiveError::RootOutOfRange { root, n_ranks: n });
    }
    // `supports` has refused every other pairing: in each match below, `_` is the one algorithm left.
    let combine = op.reduce_op().map_or(Combine::Sum, Combine::from);
    let mut b = Builder::new(n, chunking);
    let mut window_len = 0;
    let shapes = match (op, counts) {
        (Op::AllReduce { op }, &Counts::Same(len)) => {
            match algorithm {
                Algorithm::Ring => ring::all_reduce(&mut b, len),
                Algorithm::Tree => tree::all_reduce(&mut b, len),
                Algorithm::RecursiveDoubling => doubling::all_reduce(&mut b, len),
                Algorithm::Direct => window_len = direct::all_reduce(&mut b, len),
                _ => hierarchical::all_reduce(&mut b, group, len),
            }
            b.divide_if_avg(op, |_| 0..len);
            vec![(len, len, 0..len); n]
        }
        (Op::ReduceScatter { op }, Counts::PerRank(sizes)) if sizes.len() == n => {
            let blocks = blocks_of(sizes)?;
            match algorithm {
                Algorithm::Ring => ring::reduce_scatter(&mut b, &blocks),
                Algorithm::Tree => tree::reduce_scatter(&mut b, &blocks),
                _ => hierarchical::reduce_scatter(&mut b, group, &blocks),
            }
            b.divide_if_avg(op, |r| blocks[r].clone());
            let total = blocks.last().map_or(0, |b| b.end);
            (0..n).map(|r| (total, total, blocks[r].clone())).collect()
        }
        (Op::AllGather, Counts::PerRank(sizes)) if sizes.len() == n => {
            let blocks = blocks_of(sizes)?;
            match algorithm {
                Algorithm::Ring => ring::all_gather(&mut b, &blocks),
                Algorithm::Tree => tree::all_gather(&mut b, &blocks),
                _ => hierarchical::all_gather(&mut b, group, &blocks),
            }
            let total = blocks.last().map_or(0, |b| b.end);
            (0..n).map(|r| (sizes[r], total, 0..total)).collect()
        }
        (Op::Broadcast { root }, &Counts::Same(len)) => {
            match algorithm {
                Algorithm::Ring => ring::broadcast(&mut b, &ring::chain_from(root, n), len),
                Algorithm::Tree => tree::broadcast(&mut b, root, len),
                _ => ring::broadcast(&mut b, &hierarchical::chain(group, root), len),
            }
            vec![(len, len, 0..len); n]
        }
        (Op::Reduce { op, root }, &Counts::Same(len)) => {
            match algorithm {
                Algorithm::Ring => ring::reduce(&mut b, &ring::chain_from(root, n), len),
                Algorithm::Tree => tree::reduce(&mut b, root, len),
                _ => ring::reduce(&mut b, &hierarchical::chain(group, root), len),
            }
            b.divide_if_avg(op, |r| if r == root { 0..len } else { 0..0 });
            (0..n).map(|r| (len, len, if r == root { 0..len } else { 0..0 })).collect()
        }
        (Op::AllToAll, Counts::PerPair(matrix)) if matrix.len() == n && matrix.iter().all(|row| row.len() == n) => {
            pairwise::all_to_all(&mut b, matrix)?
        }
        (Op::Barrier, Counts::Same(0)) => {
            match algorithm {
                Algorithm::Tree => tree::barrier(&mut b),
                _ => pairwise::barrier(&mut b),
            }
            vec![(0, 0, 0..0); n]
        }
        _ => return Err(CollectiveError::CountsShape { op, n_ranks: n, counts: counts.clone() }),
    };
    Ok(b.steps
        .into_iter()
        .zip(shapes)
        .enumerate()
        .map(|(rank, (steps, (input_len, output_len, result)))| RankSteps {
            rank,
            input_len,
            output_len,
            result,
            combine,
            window_len,
            steps,
        })
        .collect())
}

/// Consecutive ranges of the given sizes.
fn blocks_of(sizes: &[usize]) -> Result<Vec<Range<usize>>, CollectiveError> {
    let mut start = 0usize;
    sizes
        .iter()
        .map(|&len| {
            let end = start.checked_add(len).ok_or(CollectiveError::CountOverflow)?;
            Ok(std::mem::replace(&mut start, end)..end)
        })
        .collect()
}

/// `len` elements cut into `parts` consecutive blocks whose sizes differ by at most one, the
/// larger first.
fn balanced(len: usize, parts: usize) -> Vec<Range<usize>> {
    let (base, extra) = (len / parts, len % parts);
    let sizes: Vec<usize> = (0..parts).map(|i| base + usize::from(i < extra)).collect();
    blocks_of(&sizes).expect("sizes sum to len")
}

/// Collects the steps of every rank.
struct Builder {
    steps: Vec<Vec<Step>>,
    chunking: Chunking,
}

impl Builder {
    fn new(n: usize, chunking: Chunking) -> Builder {
        Builder { steps: vec![Vec::new(); n], chunking }
    }

    fn copy(&mut self, rank: usize, from: Range<usize>, to: Range<usize>) {
        if !from.is_empty() {
            self.steps[rank].push(Step::Copy { from, to });
        }
    }

    /// Sends every chunk of `range` (none when empty).
    fn send(&mut self, rank: usize, to: usize, buf: Buf, range: Range<usize>) {
        for chunk in self.chunking.split(range) {
            self.steps[rank].push(Step::Send { to, buf, range: chunk });
        }
    }

    /// Receives every chunk of `range` (none when empty).
    fn recv(&mut self, rank: usize, from: usize, range: Range<usize>, reduce: bool) {
        for chunk in self.chunking.split(range) {
            self.steps[rank].push(Step::Recv { from, range: chunk, reduce });
        }
    }

    fn divide_if_avg(&mut self, op: ReduceOp, result: impl Fn(usize) -> Range<usize>) {
        if op != ReduceOp::Avg {
            return;
        }
        let divisor = self.steps.len();
        for (rank, steps) in self.steps.iter_mut().enumerate() {
            let range = result(rank);
            if !range.is_empty() {
                steps.push(Step::DivideBy { range, divisor });
            }
        }
    }
}
