//! The event core every executor of the simulator shares: the queue of events in (time, order of
//! scheduling) order, ties going to the event scheduled first so that the same input replays
//! the same way; and the channels that put one transfer between a pair of ranks on the wire at a
//! time, in order, as operations on one NCCL channel do. Transfers themselves are flows of the
//! crate's [`Network`](crate::network::Network).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use rustc_hash::FxHashMap;

struct Scheduled<E> {
    at_ns: u64,
    seq: u64,
    event: E,
}

impl<E> PartialEq for Scheduled<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.at_ns, self.seq) == (other.at_ns, other.seq)
    }
}
impl<E> Eq for Scheduled<E> {}
impl<E> PartialOrd for Scheduled<E> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Scheduled<E> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at_ns, self.seq).cmp(&(other.at_ns, other.seq))
    }
}

/// Events by time, then by the order they were scheduled in.
pub(crate) struct EventQueue<E> {
    heap: BinaryHeap<Reverse<Scheduled<E>>>,
    seq: u64,
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue { heap: BinaryHeap::new(), seq: 0 }
    }
}

impl<E> EventQueue<E> {
    pub(crate) fn push(&mut self, at_ns: u64, event: E) {
        self.seq += 1;
        self.heap.push(Reverse(Scheduled { at_ns, seq: self.seq, event }));
    }

    /// The next event and its time.
    pub(crate) fn pop(&mut self) -> Option<(u64, E)> {
        self.heap.pop().map(|Reverse(Scheduled { at_ns, event, .. })| (at_ns, event))
    }
}

/// The transfers from one rank to another: one on the wire at a time.
#[derive(Debug)]
struct Channel<S> {
    busy: bool,
    queue: VecDeque<S>,
}

/// Every pair's channel; `S` is a send waiting for its turn.
#[derive(Debug)]
pub(crate) struct Channels<S> {
    channels: FxHashMap<(usize, usize), Channel<S>>,
}

impl<S> Default for Channels<S> {
    fn default() -> Self {
        Channels { channels: FxHashMap::default() }
    }
}

impl<S> Channels<S> {
    /// Offers a send from `from` to `to`: it comes back when it may start now (the channel was
    /// idle); else it waits behind the one on the wire.
    pub(crate) fn offer(&mut self, from: usize, to: usize, send: S) -> Option<S> {
        let channel =
            self.channels.entry((from, to)).or_insert_with(|| Channel { busy: false, queue: VecDeque::new() });
        if channel.busy {
            channel.queue.push_back(send);
            None
        } else {
            channel.busy = true;
            Some(send)
        }
    }

    /// The transfer on the wire from `from` to `to` has drained: the next send to start, if any.
    pub(crate) fn finished(&mut self, from: usize, to: usize) -> Option<S> {
        let channel = self.channels.get_mut(&(from, to)).expect("a transfer's channel");
        let next = channel.queue.pop_front();
        channel.busy = next.is_some();
        next
    }
}
