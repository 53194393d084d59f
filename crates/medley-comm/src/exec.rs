//! Executes one rank's step list ([`medley_collective::step`]) over its links, zero-copy.
//!
//! A send hands the transport the address of its range, so before any step writes a range the
//! executor waits for the unfinished sends that still read it, and before returning for all of
//! them. Copies from the input are deferred: until a step needs the bytes in the output, a send
//! of a copied range reads the input instead, a reducing receive combines input and message
//! straight into the output, and a plain receive overwrites it uncopied. On one host that
//! saves a whole pass over the buffer, the largest memory cost of a ring all-reduce.

use std::ops::Range;

use medley_collective::{Buf, RankSteps, Step};

use crate::CommError;
use crate::dtype::DType;
use crate::transport::window::Windows;
use crate::transport::{Links, Sink, Ticket};
use crate::wait::Waiter;
use crate::wire::FrameHeader;

/// One call of a collective as this rank runs it.
pub(crate) struct Call<'a> {
    pub plan: &'a RankSteps,
    pub dtype: DType,
    pub fingerprint: u64,
    pub seq: u64,
}

/// A send of output bytes the executor has not yet seen finish.
struct InFlight {
    peer: usize,
    ticket: Ticket,
    bytes: Range<usize>,
}

/// Output bytes that hold, by a deferred copy, the input bytes from `input_start` on.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Deferred {
    output: Range<usize>,
    input_start: usize,
}

impl Deferred {
    fn input(&self) -> Range<usize> {
        self.input_start..self.input_start + self.output.len()
    }
}

/// Removes from `deferred` the parts that overlap `span` and returns them.
fn take_overlap(deferred: &mut Vec<Deferred>, span: &Range<usize>) -> Vec<Deferred> {
    // The common case, and allocation-free: small collectives run this several times per call.
    if !deferred.iter().any(|copy| copy.output.start < span.end && span.start < copy.output.end) {
        return Vec::new();
    }
    let mut taken = Vec::new();
    let mut kept = Vec::with_capacity(deferred.len());
    for copy in deferred.drain(..) {
        let (start, end) = (copy.output.start.max(span.start), copy.output.end.min(span.end));
        if start >= end {
            kept.push(copy);
            continue;
        }
        let part = |from: usize, to: usize| Deferred {
            output: from..to,
            input_start: copy.input_start + (from - copy.output.start),
        };
        if copy.output.start < start {
            kept.push(part(copy.output.start, start));
        }
        if end < copy.output.end {
            kept.push(part(end, copy.output.end));
        }
        taken.push(part(start, end));
    }
    *deferred = kept;
    taken
}

/// Performs the deferred copies that overlap `span`.
fn materialize(deferred: &mut Vec<Deferred>, span: &Range<usize>, input: &[u8], output: &mut [u8]) {
    for copy in take_overlap(deferred, span) {
        output[copy.output.clone()].copy_from_slice(&input[copy.input()]);
    }
}

/// The executor's bookkeeping, kept by the communicator between calls so that a small
/// collective allocates nothing: at a few microseconds per call, an allocation shows.
#[derive(Default)]
pub(crate) struct Scratch {
    in_flight: Vec<InFlight>,
    deferred: Vec<Deferred>,
    /// The last ticket per peer, input sends included: all are waited for at the end.
    last_ticket: Vec<Option<Ticket>>,
}

/// Bytes of a share combined from every window before the next piece: the piece of every window
/// and of the destination stay in L2 together.
const WINDOW_PIECE_BYTES: usize = 32 << 10;

/// Runs `call` over `input` and `output` (bytes, `plan.input_len` and `plan.output_len` elements).
/// A plan that uses windows needs `windows`, whose capacity the caller has checked. Whatever
/// ends the call early (an error, a panic) closes the links first, so no send still reads the
/// buffers once their borrow ends.
pub(crate) fn execute(
    links: &mut Links,
    windows: Option<&Windows>,
    waiter: &Waiter,
    call: &Call<'_>,
    input: &[u8],
    output: &mut [u8],
    scratch: &mut Scratch,
) -> Result<(), CommError> {
    let Scratch { in_flight, deferred, last_ticket } = scratch;
    in_flight.clear();
    deferred.clear();
    last_ticket.clear();
    let mut run =
        Run { links, windows, waiter, call, input, output, in_flight, deferred, last_ticket, finished: false };
    for step in &call.plan.steps {
        run.step(step)?;
    }
    run.finish()
}

/// One call in progress: the buffers, the links and the executor's bookkeeping.
struct Run<'a> {
    links: &'a mut Links,
    windows: Option<&'a Windows>,
    waiter: &'a Waiter,
    call: &'a Call<'a>,
    input: &'a [u8],
    output: &'a mut [u8],
    in_flight: &'a mut Vec<InFlight>,
    deferred: &'a mut Vec<Deferred>,
    last_ticket: &'a mut Vec<Option<Ticket>>,
    /// Every send was waited for: the buffers are free.
    finished: bool,
}

impl Drop for Run<'_> {
    /// The soundness of the sends rests here, not on callers: a call that did not finish may
    /// still have sends reading the buffers, and closing the links stops them.
    fn drop(&mut self) {
        if !self.finished {
            self.links.close();
        }
    }
}

impl<'a> Run<'a> {
    fn step(&mut self, step: &Step) -> Result<(), CommError> {
        match step {
            Step::Copy { from, to } => self.copy(from, to),
            Step::Send { to, buf, range } => self.send(*to, *buf, range),
            Step::Recv { from, range, reduce } => self.recv(*from, range, *reduce),
            Step::DivideBy { range, divisor } => self.divide(range, *divisor),
            Step::Publish { from, at } => {
                self.publish(from, *at);
                Ok(())
            }
            Step::Fence => self.windows().fence(self.waiter),
            Step::ReduceWindows { from, window, to } => self.reduce_windows(from, window, to),
            Step::Gather { from, window, to } => self.gather(*from, window, to),
        }
    }

    /// Materializes the result and waits for every send.
    fn finish(&mut self) -> Result<(), CommError> {
        // Only the result must hold its bytes; the rest of the output is scratch.
        let result = self.bytes(&self.call.plan.result);
        materialize(self.deferred, &result, self.input, self.output);
        for (peer, ticket) in self.last_ticket.iter().enumerate() {
            if let Some(ticket) = *ticket {
                self.links.to(peer).wait_sent(peer, ticket, self.waiter)?;
            }
        }
        self.finished = true;
        Ok(())
    }

    /// Byte range of an element range.
    fn bytes(&self, range: &Range<usize>) -> Range<usize> {
        let size = self.call.dtype.size_bytes();
        range.start * size..range.end * size
    }

    fn header(&self, range: &Range<usize>) -> FrameHeader {
        let len = (range.len() * self.call.dtype.size_bytes()) as u64;
        FrameHeader { fingerprint: self.call.fingerprint, seq: self.call.seq, len }
    }

    fn windows(&self) -> &'a Windows {
        self.windows.expect("the communicator plans windows only when it has them")
    }

    /// Defers copying input `from` into output `to` until something needs the bytes there.
    fn copy(&mut self, from: &Range<usize>, to: &Range<usize>) -> Result<(), CommError> {
        let to = self.bytes(to);
        self.wait_for_senders(&to)?;
        take_overlap(self.deferred, &to);
        let input_start = self.bytes(from).start;
        self.deferred.push(Deferred { output: to, input_start });
        Ok(())
    }

    /// Starts sending `range` of `buf` to `to`; a range that is a whole deferred copy is sent
    /// from the input, uncopied.
    fn send(&mut self, to: usize, buf: Buf, range: &Range<usize>) -> Result<(), CommError> {
        let span = self.bytes(range);
        let whole_copy = match take_overlap(self.deferred, &span).as_slice() {
            [copy] if copy.output == span => Some(copy.clone()),
            parts => {
                for copy in parts {
                    self.output[copy.output.clone()].copy_from_slice(&self.input[copy.input()]);
                }
                None
            }
        };
        let (data, reads_output) = match (buf, &whole_copy) {
            (Buf::Input, _) => (self.input[span.clone()].as_ptr(), false),
            (Buf::Output, Some(copy)) => (self.input[copy.input()].as_ptr(), false),
            (Buf::Output, None) => (self.output[span.clone()].as_ptr(), true),
        };
        if let Some(copy) = whole_copy {
            self.deferred.push(copy);
        }
        let header = self.header(range);
        // SAFETY: the bytes are the caller's buffers, borrowed by this run; output sends are
        // recorded and waited for before any step writes their range, input is never written,
        // and every send is waited for in `finish` or the links are closed when the run drops.
        let ticket = unsafe { self.links.to(to).send(to, header, data, span.len(), self.waiter)? };
        if reads_output {
            self.in_flight.push(InFlight { peer: to, ticket, bytes: span });
        }
        if self.last_ticket.len() <= to {
            self.last_ticket.resize(to + 1, None);
        }
        self.last_ticket[to] = Some(ticket);
        Ok(())
    }

    /// Receives `range` from `from`, reducing it into what the output holds or overwriting it.
    fn recv(&mut self, from: usize, range: &Range<usize>, reduce: bool) -> Result<(), CommError> {
        let span = self.bytes(range);
        // Sends the peers have long taken (a ring's reduce-scatter sends, by the time its
        // all-gather writes the same blocks) need no staging.
        let links = &mut *self.links;
        self.in_flight.retain(|sent| !overlaps(sent, &span) || !links.to(sent.peer).is_sent(sent.peer, sent.ticket));
        if self.in_flight.iter().any(|sent| overlaps(sent, &span)) {
            return self.recv_staged(from, range, reduce);
        }
        let (dtype, how, header) = (self.call.dtype, self.call.plan.combine, self.header(range));
        let overlap = take_overlap(self.deferred, &span);
        let into = &mut self.output[span.clone()];
        let sink = match (reduce, overlap.as_slice()) {
            (false, _) => Sink::Copy(into),
            (true, [copy]) if copy.output == span => {
                Sink::Reduce { into, base: Some(&self.input[copy.input()]), dtype, how }
            }
            (true, parts) => {
                for copy in parts {
                    let at = copy.output.start - span.start..copy.output.end - span.start;
                    into[at].copy_from_slice(&self.input[copy.input()]);
                }
                Sink::Reduce { into, base: None, dtype, how }
            }
        };
        self.links.to(from).recv(from, header, sink, self.waiter)
    }

    /// A receive into bytes a send still reads: an exchange (both partners send a range, then
    /// receive into it), where waiting for the partner to take this rank's bytes first would
    /// wait on a partner doing the same. Receives into a staged copy, then waits, then writes.
    fn recv_staged(&mut self, from: usize, range: &Range<usize>, reduce: bool) -> Result<(), CommError> {
        let span = self.bytes(range);
        let mut staged = self.output[span.clone()].to_vec();
        for copy in take_overlap(self.deferred, &span) {
            let at = copy.output.start - span.start..copy.output.end - span.start;
            staged[at].copy_from_slice(&self.input[copy.input()]);
        }
        let sink = match reduce {
            true => Sink::Reduce { into: &mut staged, base: None, dtype: self.call.dtype, how: self.call.plan.combine },
            false => Sink::Copy(&mut staged),
        };
        let header = self.header(range);
        self.links.to(from).recv(from, header, sink, self.waiter)?;
        self.wait_for_senders(&span)?;
        self.output[span].copy_from_slice(&staged);
        Ok(())
    }

    fn divide(&mut self, range: &Range<usize>, divisor: usize) -> Result<(), CommError> {
        let span = self.bytes(range);
        self.wait_for_senders(&span)?;
        materialize(self.deferred, &span, self.input, self.output);
        self.call.dtype.divide_bytes(&mut self.output[span], divisor);
        Ok(())
    }

    /// Copies input `from` into this rank's window at element `at`.
    fn publish(&mut self, from: &Range<usize>, at: usize) {
        let to = self.bytes(&(at..at + from.len()));
        let bytes = &self.input[self.bytes(from)];
        // SAFETY: the plan's fences keep every peer from reading these bytes of this rank's
        // window until the next fence.
        unsafe { self.windows().write(to.start, bytes) };
    }

    /// Combines input `from` with every peer's `window` into output `to`.
    fn reduce_windows(
        &mut self,
        from: &Range<usize>,
        window: &Range<usize>,
        to: &Range<usize>,
    ) -> Result<(), CommError> {
        let span = self.bytes(to);
        self.wait_for_senders(&span)?;
        take_overlap(self.deferred, &span);
        let (own, window) = (&self.input[self.bytes(from)], self.bytes(window));
        reduce_windows(self.windows(), self.call, own, window, &mut self.output[span]);
        Ok(())
    }

    /// Copies `from`'s `window` into output `to`.
    fn gather(&mut self, from: usize, window: &Range<usize>, to: &Range<usize>) -> Result<(), CommError> {
        let span = self.bytes(to);
        self.wait_for_senders(&span)?;
        take_overlap(self.deferred, &span);
        let window = self.bytes(window);
        // SAFETY: the plan's fences keep the owner from writing this range until the next fence.
        let theirs = unsafe { self.windows().read(from, window) };
        self.output[span].copy_from_slice(theirs);
        Ok(())
    }

    /// Waits for every in-flight send that reads bytes in `span`, and forgets it.
    fn wait_for_senders(&mut self, span: &Range<usize>) -> Result<(), CommError> {
        wait_for_senders(self.links, self.waiter, self.in_flight, span)
    }
}

/// Combines `own` (this rank's input) with every peer's `window` bytes into `into`, in rank
/// order, and leaves the result in this rank's own window too, piece by piece so each piece is
/// combined while it is in cache.
fn reduce_windows(windows: &Windows, call: &Call<'_>, own: &[u8], window: Range<usize>, into: &mut [u8]) {
    let (dtype, how, rank) = (call.dtype, call.plan.combine, call.plan.rank);
    let piece = WINDOW_PIECE_BYTES / dtype.size_bytes() * dtype.size_bytes();
    for start in (0..window.len()).step_by(piece.max(1)) {
        let len = piece.min(window.len() - start);
        let at = window.start + start..window.start + start + len;
        let share = |owner: usize| match owner == rank {
            true => &own[start..start + len],
            // SAFETY: between the fences around this step the owner does not write this share.
            false => unsafe { windows.read(owner, at.clone()) },
        };
        let out = &mut into[start..start + len];
        match windows.n_ranks() {
            1 => out.copy_from_slice(share(0)),
            _ => dtype.combine_from_bytes(out, share(0), share(1), how),
        }
        for owner in 2..windows.n_ranks() {
            dtype.combine_bytes(out, share(owner), how);
        }
        // SAFETY: no peer reads this share of this rank's window before the next fence.
        unsafe { windows.write(at.start, out) };
    }
}

/// Waits for every in-flight send that reads bytes in `span`, and forgets it.
fn wait_for_senders(
    links: &mut Links,
    waiter: &Waiter,
    in_flight: &mut Vec<InFlight>,
    span: &Range<usize>,
) -> Result<(), CommError> {
    if !in_flight.iter().any(|sent| overlaps(sent, span)) {
        return Ok(());
    }
    for sent in in_flight.iter().filter(|sent| overlaps(sent, span)) {
        links.to(sent.peer).wait_sent(sent.peer, sent.ticket, waiter)?;
    }
    in_flight.retain(|sent| !overlaps(sent, span));
    Ok(())
}

/// Whether `sent` reads bytes in `span`.
fn overlaps(sent: &InFlight, span: &Range<usize>) -> bool {
    sent.bytes.start < span.end && span.start < sent.bytes.end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlaps_are_cut_out_of_deferred_copies() {
        let mut deferred =
            vec![Deferred { output: 10..20, input_start: 0 }, Deferred { output: 30..40, input_start: 50 }];
        let taken = take_overlap(&mut deferred, &(15..35));
        assert_eq!(taken, [Deferred { output: 15..20, input_start: 5 }, Deferred { output: 30..35, input_start: 50 }]);
        assert_eq!(
            deferred,
            [Deferred { output: 10..15, input_start: 0 }, Deferred { output: 35..40, input_start: 55 }]
        );
    }
}
