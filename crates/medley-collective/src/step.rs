//! The step format every algorithm produces and every executor consumes.
//!
//! # Buffers
//! Each rank has two buffers of elements (the element type is the executor's business):
//! - the **input** buffer holds what the rank contributes; steps only read it (`Copy`, and `Send`
//!   with [`Buf::Input`]);
//! - the **output** buffer is the working buffer: receives land in it, reductions happen in it, and
//!   the collective's result is left in [`RankSteps::result`]. Outside `result` the output buffer is
//!   scratch whose content after the collective is unspecified.
//!
//! An executor may run a collective in place (one allocation for both buffers) when the layouts
//! make `Copy` a no-op; it then skips `Copy` steps whose ranges coincide.
//!
//! # Ordering and matching
//! - A rank executes its steps in list order.
//! - A `Send` is asynchronous: it captures the content of its range at the moment it is executed
//!   and the rank moves on without waiting for the receiver. A zero-copy executor must therefore
//!   not let a later step write a range an unfinished send still reads. A `Send` never blocks the
//!   rank: an executor whose transport has finite slots queues the send and keeps progressing
//!   queued sends while it waits in a `Recv` (a pipelined ring issues a whole block's chunks before
//!   its first receive, so a send that blocked on a full slot could deadlock the ring).
//! - A `Recv` blocks until its message has arrived.
//! - Messages between one (sender, receiver) pair are matched first in, first out: the k-th `Send`
//!   from `a` to `b` is received by the k-th `Recv` from `a` on `b`, and both name the same number
//!   of elements. There are no tags.
//! - Zero-length messages exist (barrier tokens); executors must deliver them like any other.
//!
//! # Lowering to time
//! A simulator lowers each matched `Send`/`Recv` pair to one transfer of `range.len()` elements
//! (times the element size) over the link between the two ranks: it may start once the sender has
//! reached the `Send`, and the `Recv` completes when it has arrived. `Copy` and `DivideBy` are
//! local memory work; a reducing `Recv` adds one pass over its range.
//!
//! Under these rules every plan from [`crate::plan_steps`] completes, with no message left over,
//! on any executor with unbounded buffering per pair (the reference executor checks exactly that).
//!
//! # Windows
//! Ranks that map each other's memory (shared memory on one host; NCCL's symmetric memory and
//! NVLS play the same part on a GPU node) also have a **window** of [`RankSteps::window_len`]
//! elements that every rank of the group can read. `Publish` and `ReduceWindows` write the
//! rank's own window; `ReduceWindows` and `Gather` read its peers'. `Fence` orders them: what a
//! rank writes into its window before its k-th fence, peers may read after their k-th fence; what
//! they read between their k-th and (k+1)-th fences, the owner overwrites only after its
//! (k+1)-th. Every rank of a plan passes the same number of fences, and a plan that uses windows
//! ends with one, so the next collective may reuse them. [`crate::as_messages`] lowers a plan
//! with windows to sends and receives, which is how a simulator times it.

use serde::{Deserialize, Serialize};
use std::ops::Range;

use crate::ReduceOp;

/// Which of a rank's buffers a `Send` reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Buf {
    Input,
    Output,
}

/// One thing a rank does. Ranges are element ranges of the named buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Step {
    /// Copies `input[from]` into `output[to]` (equal lengths).
    Copy { from: Range<usize>, to: Range<usize> },
    /// Sends the current content of `buf[range]` to rank `to`.
    Send { to: usize, buf: Buf, range: Range<usize> },
    /// Receives the next message from rank `from` into `output[range]`: combined element-wise with
    /// what is there by [`RankSteps::combine`] when `reduce`, copied over it otherwise.
    Recv { from: usize, range: Range<usize>, reduce: bool },
    /// Divides `output[range]` element-wise by `divisor` (the last step of an average).
    DivideBy { range: Range<usize>, divisor: usize },
    /// Copies `input[from]` into this rank's window from element `at` on.
    Publish { from: Range<usize>, at: usize },
    /// Waits until every rank of the group has reached its fence of the same number.
    Fence,
    /// Writes into `output[to]`, and into this rank's own `window[window]`, the combination (by
    /// [`RankSteps::combine`], in rank order) of every peer's `window[window]` and this rank's
    /// `input[from]` (all of equal length).
    ReduceWindows { from: Range<usize>, window: Range<usize>, to: Range<usize> },
    /// Copies rank `from`'s `window[window]` into `output[to]`.
    Gather { from: usize, window: Range<usize>, to: Range<usize> },
}

/// How `Recv { reduce: true }` combines two elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Combine {
    Sum,
    Prod,
    Max,
    Min,
}

impl From<ReduceOp> for Combine {
    /// An average sums, then divides once at the end.
    fn from(op: ReduceOp) -> Combine {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => Combine::Sum,
            ReduceOp::Prod => Combine::Prod,
            ReduceOp::Max => Combine::Max,
            ReduceOp::Min => Combine::Min,
        }
    }
}

/// Everything one rank does in one collective.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankSteps {
    pub rank: usize,
    /// Elements in the input buffer.
    pub input_len: usize,
    /// Elements in the output buffer.
    pub output_len: usize,
    /// Where the output buffer holds this rank's result (empty when the rank gets none).
    pub result: Range<usize>,
    /// How received elements are combined when a `Recv` reduces.
    pub combine: Combine,
    /// Elements in the window (0 for plans that only send and receive).
    #[serde(default)]
    pub window_len: usize,
    pub steps: Vec<Step>,
}

impl RankSteps {
    /// Every send as (peer, range), in order.
    pub fn sends(&self) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        self.steps.iter().filter_map(|step| match step {
            Step::Send { to, range, .. } => Some((*to, range.clone())),
            _ => None,
        })
    }
}
