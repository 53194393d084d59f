//! Executes one rank's step list ([`medley_collective::step`]) over its links, zero-copy: a send
//! hands the transport the address of its range, so before any step writes a range the executor
//! waits for the unfinished sends that still read it, and before returning for all of them.

use std::ops::Range;

use medley_collective::{Buf, RankSteps, Step};

use crate::CommError;
use crate::dtype::DType;
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

/// Runs `call` over `input` and `output` (bytes, `plan.input_len` and `plan.output_len` elements).
/// On error the caller must close the links before the buffers' borrow ends, so no send still
/// reads them.
pub(crate) fn execute(
    links: &mut Links,
    waiter: &Waiter,
    call: &Call<'_>,
    input: &[u8],
    output: &mut [u8],
) -> Result<(), CommError> {
    let size = call.dtype.size_bytes();
    let bytes = |range: &Range<usize>| range.start * size..range.end * size;
    let header = |range: &Range<usize>| FrameHeader {
        fingerprint: call.fingerprint,
        seq: call.seq,
        len: (range.len() * size) as u64,
    };
    // Output sends still in flight, and the last ticket per peer (input sends included).
    let mut in_flight: Vec<InFlight> = Vec::new();
    let mut last_ticket: Vec<Option<Ticket>> = vec![None; n_peers_named(call.plan)];
    for step in &call.plan.steps {
        match step {
            Step::Copy { from, to } => {
                let to = bytes(to);
                wait_for_writers(links, waiter, &mut in_flight, &to)?;
                output[to].copy_from_slice(&input[bytes(from)]);
            }
            Step::Send { to, buf, range } => {
                let span = bytes(range);
                let data = match buf {
                    Buf::Input => input[span.clone()].as_ptr(),
                    Buf::Output => output[span.clone()].as_ptr(),
                };
                // SAFETY: the bytes are the caller's buffers, which outlive this call; output
                // sends are recorded and waited for before any step writes their range, and
                // every send is waited for (or the links closed) before this function returns.
                let ticket = unsafe { links.to(*to).send(*to, header(range), data, span.len(), waiter)? };
                if *buf == Buf::Output {
                    in_flight.push(InFlight { peer: *to, ticket, bytes: span });
                }
                last_ticket[*to] = Some(ticket);
            }
            Step::Recv { from, range, reduce } => {
                let span = bytes(range);
                wait_for_writers(links, waiter, &mut in_flight, &span)?;
                let into = &mut output[span];
                let sink = if *reduce {
                    Sink::Reduce { into, dtype: call.dtype, how: call.plan.combine }
                } else {
                    Sink::Copy(into)
                };
                links.to(*from).recv(*from, header(range), sink, waiter)?;
            }
            Step::DivideBy { range, divisor } => {
                let span = bytes(range);
                wait_for_writers(links, waiter, &mut in_flight, &span)?;
                call.dtype.divide_bytes(&mut output[span], *divisor);
            }
        }
    }
    for (peer, ticket) in last_ticket.into_iter().enumerate() {
        if let Some(ticket) = ticket {
            links.to(peer).wait_sent(peer, ticket, waiter)?;
        }
    }
    Ok(())
}

/// The number of peers a plan may name: one past the largest.
fn n_peers_named(plan: &RankSteps) -> usize {
    plan.steps
        .iter()
        .filter_map(|step| match step {
            Step::Send { to: peer, .. } | Step::Recv { from: peer, .. } => Some(peer + 1),
            _ => None,
        })
        .max()
        .unwrap_or(0)
}

/// Waits for every in-flight send that reads bytes in `span`, and forgets it.
fn wait_for_writers(
    links: &mut Links,
    waiter: &Waiter,
    in_flight: &mut Vec<InFlight>,
    span: &Range<usize>,
) -> Result<(), CommError> {
    let overlaps = |sent: &InFlight| sent.bytes.start < span.end && span.start < sent.bytes.end;
    if !in_flight.iter().any(overlaps) {
        return Ok(());
    }
    for sent in in_flight.iter().filter(|sent| overlaps(sent)) {
        links.to(sent.peer).wait_sent(sent.peer, sent.ticket, waiter)?;
    }
    in_flight.retain(|sent| !overlaps(sent));
    Ok(())
}
