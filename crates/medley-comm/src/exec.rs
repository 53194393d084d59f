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
use crate::transport::window::{WINDOW_BYTES, Windows};
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
/// A plan that uses windows needs `windows`, whose capacity the caller has checked. On error the
/// caller must close the links before the buffers' borrow ends, so no send still reads them.
pub(crate) fn execute(
    links: &mut Links,
    windows: Option<&Windows>,
    waiter: &Waiter,
    call: &Call<'_>,
    input: &[u8],
    output: &mut [u8],
    scratch: &mut Scratch,
) -> Result<(), CommError> {
    let size = call.dtype.size_bytes();
    let bytes = |range: &Range<usize>| range.start * size..range.end * size;
    let header = |range: &Range<usize>| FrameHeader {
        fingerprint: call.fingerprint,
        seq: call.seq,
        len: (range.len() * size) as u64,
    };
    let window_bytes = |range: &Range<usize>| {
        let span = bytes(range);
        assert!(span.end <= WINDOW_BYTES, "the communicator plans windows within their capacity");
        span
    };
    let Scratch { in_flight, deferred, last_ticket } = scratch;
    in_flight.clear();
    deferred.clear();
    last_ticket.clear();
    for step in &call.plan.steps {
        match step {
            Step::Copy { from, to } => {
                let to = bytes(to);
                wait_for_senders(links, waiter, in_flight, &to)?;
                take_overlap(deferred, &to);
                deferred.push(Deferred { output: to, input_start: from.start * size });
            }
            Step::Send { to, buf, range } => {
                let span = bytes(range);
                let whole_copy = match take_overlap(deferred, &span).as_slice() {
                    [copy] if copy.output == span => Some(copy.clone()),
                    parts => {
                        for copy in parts {
                            output[copy.output.clone()].copy_from_slice(&input[copy.input()]);
                        }
                        None
                    }
                };
                let (data, reads_output) = match (buf, &whole_copy) {
                    (Buf::Input, _) => (input[span.clone()].as_ptr(), false),
                    (Buf::Output, Some(copy)) => (input[copy.input()].as_ptr(), false),
                    (Buf::Output, None) => (output[span.clone()].as_ptr(), true),
                };
                if let Some(copy) = whole_copy {
                    deferred.push(copy);
                }
                // SAFETY: the bytes are the caller's buffers, which outlive this call; output
                // sends are recorded and waited for before any step writes their range, input
                // is never written, and every send is waited for (or the links closed by the
                // caller) before the buffers' borrow ends.
                let ticket = unsafe { links.to(*to).send(*to, header(range), data, span.len(), waiter)? };
                if reads_output {
                    in_flight.push(InFlight { peer: *to, ticket, bytes: span });
                }
                if last_ticket.len() <= *to {
                    last_ticket.resize(*to + 1, None);
                }
                last_ticket[*to] = Some(ticket);
            }
            Step::Recv { from, range, reduce } => {
                let span = bytes(range);
                // Sends the peers have long taken (a ring's reduce-scatter sends, by the time its
                // all-gather writes the same blocks) need no staging.
                in_flight.retain(|sent| !overlaps(sent, &span) || !links.to(sent.peer).is_sent(sent.peer, sent.ticket));
                if in_flight.iter().any(|sent| overlaps(sent, &span)) {
                    // An exchange (both partners send a range, then receive into it): waiting for
                    // the partner to take this rank's bytes first would wait on a partner doing
                    // the same. Receive into a staged copy, then wait, then write the range.
                    let mut staged = output[span.clone()].to_vec();
                    for copy in take_overlap(deferred, &span) {
                        let at = copy.output.start - span.start..copy.output.end - span.start;
                        staged[at].copy_from_slice(&input[copy.input()]);
                    }
                    let sink = if *reduce {
                        Sink::Reduce { into: &mut staged, base: None, dtype: call.dtype, how: call.plan.combine }
                    } else {
                        Sink::Copy(&mut staged)
                    };
                    links.to(*from).recv(*from, header(range), sink, waiter)?;
                    wait_for_senders(links, waiter, in_flight, &span)?;
                    output[span].copy_from_slice(&staged);
                    continue;
                }
                let overlap = take_overlap(deferred, &span);
                let into = &mut output[span.clone()];
                let sink = match (reduce, overlap.as_slice()) {
                    (false, _) => Sink::Copy(into),
                    (true, [copy]) if copy.output == span => Sink::Reduce {
                        into,
                        base: Some(&input[copy.input()]),
                        dtype: call.dtype,
                        how: call.plan.combine,
                    },
                    (true, parts) => {
                        for copy in parts {
                            let at = copy.output.start - span.start..copy.output.end - span.start;
                            into[at].copy_from_slice(&input[copy.input()]);
                        }
                        Sink::Reduce { into, base: None, dtype: call.dtype, how: call.plan.combine }
                    }
                };
                links.to(*from).recv(*from, header(range), sink, waiter)?;
            }
            Step::DivideBy { range, divisor } => {
                let span = bytes(range);
                wait_for_senders(links, waiter, in_flight, &span)?;
                materialize(deferred, &span, input, output);
                call.dtype.divide_bytes(&mut output[span], *divisor);
            }
            Step::Publish { from, at } => {
                let to = window_bytes(&(*at..at + from.len()));
                // SAFETY: this rank's own window, in bounds; no peer reads it before the next fence.
                let window = unsafe { std::slice::from_raw_parts_mut(need(windows).data(call.plan.rank), to.end) };
                window[to].copy_from_slice(&input[bytes(from)]);
            }
            Step::Fence => need(windows).fence(waiter)?,
            Step::ReduceWindows { from, window, to } => {
                let span = bytes(to);
                wait_for_senders(links, waiter, in_flight, &span)?;
                take_overlap(deferred, &span);
                let own = &input[bytes(from)];
                reduce_windows(need(windows), call, own, window_bytes(window), &mut output[span]);
            }
            Step::Gather { from, window, to } => {
                let span = bytes(to);
                wait_for_senders(links, waiter, in_flight, &span)?;
                take_overlap(deferred, &span);
                let window = window_bytes(window);
                // SAFETY: in bounds; the plan's fences keep the owner from writing this range now.
                let theirs =
                    unsafe { std::slice::from_raw_parts(need(windows).data(*from).add(window.start), window.len()) };
                output[span].copy_from_slice(theirs);
            }
        }
    }
    // Only the result must hold its bytes; the rest of the output is scratch.
    materialize(deferred, &bytes(&call.plan.result), input, output);
    for (peer, ticket) in last_ticket.iter().enumerate() {
        if let Some(ticket) = *ticket {
            links.to(peer).wait_sent(peer, ticket, waiter)?;
        }
    }
    Ok(())
}

fn need(windows: Option<&Windows>) -> &Windows {
    windows.expect("the communicator plans windows only when it has them")
}

/// Combines `own` (this rank's input) with every peer's `window` bytes into `into`, in rank
/// order, and leaves the result in this rank's own window too, piece by piece so each piece is
/// combined while it is in cache.
fn reduce_windows(windows: &Windows, call: &Call<'_>, own: &[u8], window: Range<usize>, into: &mut [u8]) {
    let (dtype, how, rank) = (call.dtype, call.plan.combine, call.plan.rank);
    let piece = WINDOW_PIECE_BYTES / dtype.size_bytes() * dtype.size_bytes();
    for start in (0..window.len()).step_by(piece.max(1)) {
        let len = piece.min(window.len() - start);
        let share = |owner: usize| match owner == rank {
            true => &own[start..start + len],
            // SAFETY: in bounds of the owner's window; between the fences around this step its
            // owner does not write this share.
            false => unsafe { std::slice::from_raw_parts(windows.data(owner).add(window.start + start), len) },
        };
        let out = &mut into[start..start + len];
        match windows.n_ranks() {
            1 => out.copy_from_slice(share(0)),
            _ => dtype.combine_from_bytes(out, share(0), share(1), how),
        }
        for owner in 2..windows.n_ranks() {
            dtype.combine_bytes(out, share(owner), how);
        }
        // SAFETY: this rank's own window, in bounds; no peer reads this share before the next fence.
        unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), windows.data(rank).add(window.start + start), len) };
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
