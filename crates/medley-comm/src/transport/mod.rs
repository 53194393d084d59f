//! Transports move one rank's messages to and from its peers, first in, first out per pair.
//!
//! The executor ([`crate::exec`]) is the only caller. It knows nothing of sockets or shared
//! memory: it hands a transport a header and the address of the bytes to send, and a [`Sink`] to
//! receive into. A native vendor backend (NCCL or RCCL loaded with `dlopen` from a path, behind a
//! cargo feature) slots in as one more implementation of [`Transport`] over `ncclSend`/`ncclRecv`
//! inside a group call: the algorithms and the executor stay as they are, and [`Links`] routes the
//! peers of the rank's own domain to it instead of to shared memory.

pub(crate) mod shm;
pub(crate) mod tcp;
pub(crate) mod window;

use medley_collective::Combine;

use crate::CommError;
use crate::dtype::DType;
use crate::wait::Waiter;
use crate::wire::FrameHeader;

/// Where a received payload goes: copied over the destination, or combined element by element
/// with what the destination holds (or, given a `base`, with that, the result overwriting the
/// destination).
pub enum Sink<'a> {
    Copy(&'a mut [u8]),
    Reduce { into: &'a mut [u8], base: Option<&'a [u8]>, dtype: DType, how: Combine },
}

impl Sink<'_> {
    pub fn len(&self) -> usize {
        match self {
            Sink::Copy(into) | Sink::Reduce { into, .. } => into.len(),
        }
    }

    /// Delivers `bytes`, which belong at `offset` of the destination. For a reduce, pieces hold
    /// whole elements.
    pub fn deliver(&mut self, offset: usize, bytes: &[u8]) {
        match self {
            Sink::Copy(into) => into[offset..offset + bytes.len()].copy_from_slice(bytes),
            Sink::Reduce { into, base: None, dtype, how } => {
                dtype.combine_bytes(&mut into[offset..offset + bytes.len()], bytes, *how)
            }
            Sink::Reduce { into, base: Some(base), dtype, how } => {
                let span = offset..offset + bytes.len();
                dtype.combine_from_bytes(&mut into[span.clone()], &base[span], bytes, *how)
            }
        }
    }
}

/// The k-th message a rank sent to one peer (counting from 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ticket(pub u64);

/// Point-to-point messaging with one peer set. Peers are ranks of the communicator; errors name
/// ranks of the job.
pub trait Transport: Send {
    /// Starts sending `len` bytes at `data` to `peer` under `header` and returns without waiting
    /// for the receiver. It may wait (through `waiter`) for room, never for the receiver to reach this message.
    ///
    /// # Safety
    /// The bytes must stay valid and unchanged until [`Transport::wait_sent`] has returned `Ok`
    /// for this ticket or a later one to the same peer, or [`Transport::close`] has returned.
    unsafe fn send(
        &mut self,
        peer: usize,
        header: FrameHeader,
        data: *const u8,
        len: usize,
        waiter: &Waiter,
    ) -> Result<Ticket, CommError>;

    /// Waits until every message to `peer` up to `ticket` no longer needs the sender's memory.
    fn wait_sent(&mut self, peer: usize, ticket: Ticket, waiter: &Waiter) -> Result<(), CommError>;

    /// Whether every message to `peer` up to `ticket` no longer needs the sender's memory, without
    /// waiting. A failure reads as `false`: the next wait reports it.
    fn is_sent(&mut self, peer: usize, ticket: Ticket) -> bool;

    /// Receives the next message from `peer`, which must carry `header`, into `sink`
    /// (`header.len == sink.len()`).
    fn recv(&mut self, peer: usize, header: FrameHeader, sink: Sink<'_>, waiter: &Waiter) -> Result<(), CommError>;

    /// After a failure: makes sure no pending send reads the caller's memory any more. The
    /// transport is unusable afterwards.
    fn close(&mut self);
}

/// Which transport serves each peer.
pub(crate) struct Links {
    transports: Vec<Box<dyn Transport>>,
    /// `route[peer]`: index into `transports` (unused for the rank itself).
    route: Vec<usize>,
}

impl Links {
    pub fn new(transports: Vec<Box<dyn Transport>>, route: Vec<usize>) -> Links {
        Links { transports, route }
    }

    pub fn to(&mut self, peer: usize) -> &mut dyn Transport {
        &mut *self.transports[self.route[peer]]
    }

    pub fn close(&mut self) {
        self.transports.iter_mut().for_each(|transport| transport.close());
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        self.close();
    }
}
