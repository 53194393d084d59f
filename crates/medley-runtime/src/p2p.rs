//! Pipeline messages between neighbouring stages over the world communicator.
//!
//! Every message between two workers has the same shape (one micro-batch's hidden states at the
//! positions both hold: all of them, unless a long-context stage splits them), so a trailer names
//! what it is: activation or gradient, micro-batch, sending chunk, and when it was
//! posted. Messages from one peer arrive in the order it sent them, which need not be the order
//! this worker's program receives them in (with several chunks per rank, activations and
//! gradients share a pair of ranks): a receive keeps messages it does not want yet in a stash.

use medley_model::HostTensor;
use std::collections::BTreeMap;

use medley_comm::Communicator;

use crate::RuntimeError;
use crate::error::CommContext;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    Activation = 0,
    Gradient = 1,
}

/// What a message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Tag {
    pub kind: Kind,
    pub micro_batch: u32,
    /// The sender's chunk.
    pub chunk: u32,
}

/// A received message.
pub(crate) struct Message {
    pub data: Vec<f32>,
    /// When the sender posted it, in microseconds of the job clock.
    pub posted_us: u64,
    /// When it arrives over an emulated link (see `crate::LinkEmulation`); `posted_us` otherwise.
    pub arrival_us: u64,
}

/// Trailer words, each an `f32` bit pattern: kind, micro-batch, chunk, posted time and arrival
/// time (2 words each).
const TRAILER: usize = 7;

#[derive(Default)]
pub(crate) struct Mailbox {
    stash: BTreeMap<(usize, Tag), Message>,
}

impl Mailbox {
    /// Posts `data` to `peer` (a job rank) without waiting for it to be received.
    pub fn send(
        &self,
        comm: &mut Communicator,
        peer: usize,
        tag: Tag,
        mut data: Vec<f32>,
        (posted_us, arrival_us): (u64, u64),
    ) -> Result<(), RuntimeError> {
        let words = [
            tag.kind as u32,
            tag.micro_batch,
            tag.chunk,
            posted_us as u32,
            (posted_us >> 32) as u32,
            arrival_us as u32,
            (arrival_us >> 32) as u32,
        ];
        data.extend(words.map(f32::from_bits));
        comm.isend(data, peer).during(|| format!("sending {tag:?} to rank {peer}"))
    }

    /// Receives the message `tag` from `peer`, stashing others from it that arrive first. Every
    /// message from one peer has `numel` elements (a pair of workers shares the same positions
    /// whichever way its messages go).
    pub fn recv(
        &mut self,
        comm: &mut Communicator,
        peer: usize,
        tag: Tag,
        numel: usize,
    ) -> Result<Message, RuntimeError> {
        if let Some(message) = self.stash.remove(&(peer, tag)) {
            return Ok(message);
        }
        loop {
            let mut data = vec![0f32; numel + TRAILER];
            comm.recv(&mut data, peer).during(|| format!("receiving {tag:?} from rank {peer}"))?;
            let words: Vec<u32> = data.split_off(numel).into_iter().map(f32::to_bits).collect();
            let kind = match words[0] {
                0 => Kind::Activation,
                1 => Kind::Gradient,
                other => return Err(protocol(peer, format!("unknown message kind {other}"))),
            };
            let got = Tag { kind, micro_batch: words[1], chunk: words[2] };
            let time = |at: usize| u64::from(words[at]) | (u64::from(words[at + 1]) << 32);
            let message = Message { data, posted_us: time(3), arrival_us: time(5) };
            if got == tag {
                return Ok(message);
            }
            if self.stash.insert((peer, got), message).is_some() {
                return Err(protocol(peer, format!("sent {got:?} twice in one step")));
            }
        }
    }

    /// Ends a step: every message received must have been used.
    pub fn finish_step(&mut self) -> Result<(), RuntimeError> {
        match self.stash.keys().next() {
            None => Ok(()),
            Some((peer, tag)) => {
                Err(protocol(*peer, format!("sent {tag:?}, which this rank's program never receives")))
            }
        }
    }
}

fn protocol(peer: usize, reason: String) -> RuntimeError {
    RuntimeError::Program { rank: format!("rank {peer}"), reason }
}

/// The indices into `from` and into `to` (both ascending positions) of the positions they share.
pub(crate) fn overlap(from: &[usize], to: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let (mut i, mut j) = (0, 0);
    let (mut from_rows, mut to_rows) = (Vec::new(), Vec::new());
    while i < from.len() && j < to.len() {
        match from[i].cmp(&to[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                from_rows.push(i);
                to_rows.push(j);
                (i, j) = (i + 1, j + 1);
            }
        }
    }
    (from_rows, to_rows)
}

/// `rows` of every batch row of `tensor` (`[batch, tokens, hidden]`), in order.
pub(crate) fn select_rows(tensor: &HostTensor, rows: &[usize]) -> Vec<f32> {
    let (tokens, hidden) = (tensor.shape[1], tensor.shape[2]);
    let mut data = Vec::with_capacity(tensor.shape[0] * rows.len() * hidden);
    for batch_row in tensor.data.chunks(tokens * hidden) {
        rows.iter().for_each(|&row| data.extend_from_slice(&batch_row[row * hidden..(row + 1) * hidden]));
    }
    data
}

/// Writes `data` (`select_rows`' layout) into `rows` of `tensor`.
pub(crate) fn place_rows(tensor: &mut HostTensor, rows: &[usize], data: &[f32]) {
    let (tokens, hidden) = (tensor.shape[1], tensor.shape[2]);
    let mut parts = data.chunks(hidden);
    for batch_row in tensor.data.chunks_mut(tokens * hidden) {
        for (&row, part) in rows.iter().zip(parts.by_ref()) {
            batch_row[row * hidden..(row + 1) * hidden].copy_from_slice(part);
        }
    }
}
