//! TCP between hosts and across the bridge: N streams per peer pair, big messages striped over
//! all of them, each stream written by its own long-lived writer thread so a send never blocks
//! the rank (the step format's rule), and read by the rank itself straight into the destination.
//! A send to an idle stream first writes what the socket takes at once on the rank's own
//! thread: waking the writer thread costs more than a small message's whole trip.

use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Sink, Ticket, Transport};
use crate::CommError;
use crate::wait::Waiter;
use crate::wire::FrameHeader;

/// Messages below this many bytes go whole on the first stream: striping pays only once each
/// stripe is large enough to keep a stream busy.
const STRIPE_MIN_BYTES: usize = 256 << 10;
/// Stripe boundaries fall on multiples of this, so every stripe holds whole elements.
const STRIPE_ALIGN: usize = 64;
/// Bytes received before a reduce combines them: fits in L2 next to the destination.
const REDUCE_PIECE_BYTES: usize = 128 << 10;

/// The byte ranges of a `len`-byte message's stripes over `n_streams` streams (stream i gets the
/// i-th); sender and receiver compute the same cut from the length alone.
fn stripes(len: usize, n_streams: usize) -> Vec<std::ops::Range<usize>> {
    if len < STRIPE_MIN_BYTES || n_streams == 1 {
        return std::iter::once(0..len).collect();
    }
    let per = len.div_ceil(n_streams).div_ceil(STRIPE_ALIGN) * STRIPE_ALIGN;
    (0..n_streams).map(|i| (i * per).min(len)..((i + 1) * per).min(len)).filter(|r| !r.is_empty()).collect()
}

/// A write the writer thread performs; the address is the caller's, valid until the job counts done.
struct Job {
    header: [u8; FrameHeader::BYTES],
    data: usize,
    len: usize,
    /// Bytes of the frame (header, then data) the rank already wrote itself.
    written: usize,
}

/// Progress of one stream's writer, shared with the rank.
#[derive(Default)]
struct WriterState {
    /// Jobs finished (written, or dropped after a failure).
    done: AtomicU64,
    /// Set on the first write error or on close: later jobs are dropped unwritten.
    failed: AtomicBool,
    error: Mutex<Option<String>>,
    lock: Mutex<()>,
    finished: Condvar,
}

struct Stream {
    socket: TcpStream,
    jobs: Option<mpsc::Sender<Job>>,
    enqueued: u64,
    state: Arc<WriterState>,
    writer: Option<JoinHandle<()>>,
    /// Whether a pacer holds this stream to a rate: then only the writer writes.
    paced: bool,
}

/// Holds a stream's writes to a rate: each write books its bytes' time on the link, and once
/// the bookings run more than [`Pacer::AHEAD`] past now the writer sleeps off the excess. A cap
/// on bandwidth, not a latency: a small message goes at once, as the sleep it would owe is
/// shorter than the timer's own slack.
struct Pacer {
    bytes_per_s: f64,
    /// When the link has carried everything booked so far.
    free_at: Instant,
}

impl Pacer {
    /// Writes go in pieces of at most this many bytes, so a paced link sends steadily rather than
    /// in socket-buffer-sized bursts.
    const PIECE: usize = 64 << 10;
    /// How far ahead of the link the writer may run before it sleeps.
    const AHEAD: Duration = Duration::from_millis(1);

    fn book(&mut self, bytes: usize) {
        let now = Instant::now();
        self.free_at = self.free_at.max(now) + Duration::from_secs_f64(bytes as f64 / self.bytes_per_s);
        if let Some(excess) = self.free_at.checked_duration_since(now + Self::AHEAD) {
            std::thread::sleep(excess);
        }
    }
}

impl Stream {
    /// A stream whose writes go at most `bytes_per_s` (unpaced when `None`).
    fn new(socket: TcpStream, bytes_per_s: Option<f64>) -> Result<Stream, CommError> {
        let io = |err: std::io::Error| CommError::io("configuring a TCP stream", &err);
        socket.set_nodelay(true).map_err(io)?;
        // Non-blocking so the rank can poll while it checks the abort flag; the writer polls too.
        socket.set_nonblocking(true).map_err(io)?;
        let (jobs, queue) = mpsc::channel::<Job>();
        let state = Arc::new(WriterState::default());
        let writer_socket = socket.try_clone().map_err(io)?;
        let writer_state = Arc::clone(&state);
        let writer = std::thread::Builder::new()
            .name("medley-tcp-writer".into())
            .spawn(move || {
                let mut pacer = bytes_per_s.map(|bytes_per_s| Pacer { bytes_per_s, free_at: Instant::now() });
                write_jobs(writer_socket, queue, &writer_state, pacer.as_mut())
            })
            .map_err(io)?;
        Ok(Stream { socket, jobs: Some(jobs), enqueued: 0, state, writer: Some(writer), paced: bytes_per_s.is_some() })
    }

    /// Writes as much of the frame `header` + `data` as the socket takes without blocking, when
    /// the writer has nothing queued (else nothing, to keep the stream's order); returns the
    /// bytes written.
    fn write_now(&mut self, header: &[u8], data: &[u8]) -> std::io::Result<usize> {
        if self.paced || self.state.done.load(Ordering::Acquire) != self.enqueued {
            return Ok(0);
        }
        let mut written = 0;
        while written < header.len() + data.len() {
            let rest_header = &header[written.min(header.len())..];
            let rest_data = &data[written.saturating_sub(header.len())..];
            match self.socket.write_vectored(&[IoSlice::new(rest_header), IoSlice::new(rest_data)]) {
                Ok(0) => return Err(std::io::Error::from(ErrorKind::WriteZero)),
                Ok(n) => written += n,
                Err(err) if err.kind() == ErrorKind::WouldBlock => break,
                Err(err) if err.kind() == ErrorKind::Interrupted => {}
                Err(err) => return Err(err),
            }
        }
        Ok(written)
    }
}

fn write_jobs(mut socket: TcpStream, queue: mpsc::Receiver<Job>, state: &WriterState, mut pacer: Option<&mut Pacer>) {
    for job in queue {
        if !state.failed.load(Ordering::Acquire) {
            // SAFETY: `Transport::send`'s contract keeps the bytes valid until this job is counted
            // done, and `close` waits for that after setting `failed`.
            let data = unsafe { std::slice::from_raw_parts(job.data as *const u8, job.len) };
            let header = &job.header[job.written.min(FrameHeader::BYTES)..];
            let data = &data[job.written.saturating_sub(FrameHeader::BYTES)..];
            let written = write_all(&mut socket, header, state, pacer.as_deref_mut())
                .and_then(|()| write_all(&mut socket, data, state, pacer.as_deref_mut()));
            if let Err(err) = written {
                *state.error.lock().expect("writer error lock") = Some(err.to_string());
                state.failed.store(true, Ordering::Release);
            }
        }
        let _guard = state.lock.lock().expect("writer lock");
        state.done.fetch_add(1, Ordering::AcqRel);
        state.finished.notify_all();
    }
}

/// Writes all of `bytes` to a non-blocking socket, waiting for room (and for the pacer, if any);
/// gives up once `failed` is set.
fn write_all(
    socket: &mut TcpStream,
    mut bytes: &[u8],
    state: &WriterState,
    mut pacer: Option<&mut Pacer>,
) -> std::io::Result<()> {
    while !bytes.is_empty() {
        if state.failed.load(Ordering::Acquire) {
            return Err(std::io::Error::other("transport closed"));
        }
        let piece = if pacer.is_some() { &bytes[..bytes.len().min(Pacer::PIECE)] } else { bytes };
        match socket.write(piece) {
            Ok(0) => return Err(std::io::Error::from(ErrorKind::WriteZero)),
            Ok(n) => {
                if let Some(pacer) = pacer.as_deref_mut() {
                    pacer.book(n);
                }
                bytes = &bytes[n..];
            }
            Err(err) if err.kind() == ErrorKind::WouldBlock => {
                poll_fd(socket, libc::POLLOUT, Duration::from_millis(20))
            }
            Err(err) if err.kind() == ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

fn poll_fd(socket: &TcpStream, events: libc::c_short, timeout: Duration) {
    let mut fd = libc::pollfd { fd: socket.as_raw_fd(), events, revents: 0 };
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut fd, 1, timeout.as_millis().max(1) as libc::c_int) };
}

struct Peer {
    /// This peer's rank in the job, for errors.
    job_rank: usize,
    streams: Vec<Stream>,
    /// For each message still possibly in flight: its ticket and, per stream, the jobs that must
    /// be done for it (and everything before it) to be sent.
    in_flight: VecDeque<(Ticket, Vec<u64>)>,
    next_ticket: u64,
    scratch: Vec<u8>,
}

impl Peer {
    fn sent(&self, targets: &[u64]) -> Result<bool, CommError> {
        for (stream, &target) in self.streams.iter().zip(targets) {
            if stream.state.failed.load(Ordering::Acquire) {
                let error = stream.state.error.lock().expect("writer error lock").clone();
                return Err(CommError::PeerGone {
                    rank: self.job_rank,
                    what: format!("sending failed: {}", error.unwrap_or_else(|| "closed".into())),
                });
            }
            if stream.state.done.load(Ordering::Acquire) < target {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Reads exactly `buf.len()` bytes from stream `idx`, straight into `buf`.
    fn read_exact(&mut self, idx: usize, buf: &mut [u8], waiter: &Waiter) -> Result<(), CommError> {
        let (rank, socket) = (self.job_rank, &mut self.streams[idx].socket);
        let mut filled = 0;
        while filled < buf.len() {
            filled += waiter.wait(rank, "a TCP receive", |slice| {
                if let Some(slice) = slice {
                    poll_fd(socket, libc::POLLIN, slice);
                }
                match socket.read(&mut buf[filled..]) {
                    Ok(0) => Err(CommError::PeerGone { rank, what: "its TCP stream ended mid-operation".into() }),
                    Ok(n) => Ok(Some(n)),
                    Err(err) if matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => Ok(None),
                    Err(err) => Err(CommError::PeerGone { rank, what: format!("receiving failed: {err}") }),
                }
            })?;
        }
        Ok(())
    }
}

/// TCP links to some of a rank's peers.
pub(crate) struct TcpTransport {
    peers: Vec<Option<Peer>>,
}

impl TcpTransport {
    /// `sockets[peer]`: the connected streams to that peer (the same count and order on both
    /// sides), `None` for peers this transport does not serve; `job_ranks` maps peers to job
    /// ranks; the link to peer `p` carries at most `caps[p]` bytes per second over all its
    /// streams (`None`: no cap).
    pub fn new(
        sockets: Vec<Option<Vec<TcpStream>>>,
        job_ranks: &[usize],
        caps: &[Option<u64>],
    ) -> Result<TcpTransport, CommError> {
        let peers = sockets
            .into_iter()
            .zip(job_ranks)
            .zip(caps)
            .map(|((sockets, &job_rank), &cap)| {
                sockets
                    .map(|sockets| {
                        let per_stream = cap.map(|cap| cap as f64 / sockets.len() as f64);
                        Ok(Peer {
                            job_rank,
                            streams: sockets
                                .into_iter()
                                .map(|socket| Stream::new(socket, per_stream))
                                .collect::<Result<_, CommError>>()?,
                            in_flight: VecDeque::new(),
                            next_ticket: 0,
                            scratch: Vec::new(),
                        })
                    })
                    .transpose()
            })
            .collect::<Result<_, CommError>>()?;
        Ok(TcpTransport { peers })
    }

    fn peer(&mut self, peer: usize) -> &mut Peer {
        self.peers[peer].as_mut().expect("routed to a peer with TCP streams")
    }
}

impl Transport for TcpTransport {
    unsafe fn send(
        &mut self,
        peer: usize,
        header: FrameHeader,
        data: *const u8,
        len: usize,
        _waiter: &Waiter,
    ) -> Result<Ticket, CommError> {
        let peer = self.peer(peer);
        let n_streams = peer.streams.len();
        let rank = peer.job_rank;
        for (stream, stripe) in peer.streams.iter_mut().zip(stripes(len, n_streams)) {
            let header = FrameHeader { len: stripe.len() as u64, ..header }.encode();
            // SAFETY: the stripe lies inside the caller's `len` bytes, valid for this call.
            let bytes = unsafe { std::slice::from_raw_parts(data.add(stripe.start), stripe.len()) };
            let written = stream
                .write_now(&header, bytes)
                .map_err(|err| CommError::PeerGone { rank, what: format!("sending failed: {err}") })?;
            if written == header.len() + bytes.len() {
                continue;
            }
            let job = Job { header, data: bytes.as_ptr() as usize, len: bytes.len(), written };
            let gone = || CommError::PeerGone { rank, what: "its TCP writer stopped".into() };
            stream.jobs.as_ref().ok_or_else(gone)?.send(job).map_err(|_| gone())?;
            stream.enqueued += 1;
        }
        let ticket = Ticket(peer.next_ticket);
        peer.next_ticket += 1;
        peer.in_flight.push_back((ticket, peer.streams.iter().map(|s| s.enqueued).collect()));
        Ok(ticket)
    }

    fn wait_sent(&mut self, peer: usize, ticket: Ticket, waiter: &Waiter) -> Result<(), CommError> {
        let peer = self.peer(peer);
        while let Some((front, targets)) = peer.in_flight.front() {
            if *front > ticket {
                break;
            }
            let targets = targets.clone();
            waiter.wait(peer.job_rank, "a TCP send", |slice| {
                if let (Some(slice), Some(stream)) = (slice, peer.streams.first()) {
                    let guard = stream.state.lock.lock().expect("writer lock");
                    if stream.state.done.load(Ordering::Acquire) < targets[0] {
                        drop(stream.state.finished.wait_timeout(guard, slice).expect("writer lock"));
                    }
                }
                Ok(peer.sent(&targets)?.then_some(()))
            })?;
            peer.in_flight.pop_front();
        }
        Ok(())
    }

    fn is_sent(&mut self, peer: usize, ticket: Ticket) -> bool {
        let peer = self.peer(peer);
        peer.in_flight.iter().take_while(|(sent, _)| *sent <= ticket).all(|(_, targets)| peer.sent(targets) == Ok(true))
    }

    fn recv(&mut self, peer: usize, header: FrameHeader, mut sink: Sink<'_>, waiter: &Waiter) -> Result<(), CommError> {
        let peer = self.peer(peer);
        let rank = peer.job_rank;
        for (idx, stripe) in stripes(sink.len(), peer.streams.len()).into_iter().enumerate() {
            let mut head = [0u8; FrameHeader::BYTES];
            peer.read_exact(idx, &mut head, waiter)?;
            FrameHeader::check(&head, rank, FrameHeader { len: stripe.len() as u64, ..header })?;
            match &mut sink {
                Sink::Copy(into) => peer.read_exact(idx, &mut into[stripe], waiter)?,
                Sink::Reduce { .. } => {
                    let mut scratch = std::mem::take(&mut peer.scratch);
                    scratch.resize(REDUCE_PIECE_BYTES.min(stripe.len()), 0);
                    for start in stripe.clone().step_by(REDUCE_PIECE_BYTES) {
                        let piece = &mut scratch[..REDUCE_PIECE_BYTES.min(stripe.end - start)];
                        peer.read_exact(idx, piece, waiter)?;
                        sink.deliver(start, piece);
                    }
                    peer.scratch = scratch;
                }
            }
        }
        Ok(())
    }

    fn close(&mut self) {
        for peer in self.peers.iter_mut().flatten() {
            for stream in &mut peer.streams {
                stream.state.failed.store(true, Ordering::Release);
                // Unblocks a writer stuck on a full socket; it then drops its remaining jobs.
                stream.socket.shutdown(Shutdown::Both).ok();
                stream.jobs = None;
                if let Some(writer) = stream.writer.take() {
                    writer.join().ok();
                }
            }
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wait::Abort;
    use std::net::TcpListener;

    /// A transport whose only peer (rank 1, one stream) is the returned raw socket.
    fn transport_and_raw_peer() -> (TcpTransport, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let raw = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        (TcpTransport::new(vec![None, Some(vec![ours])], &[0, 1], &[None, None]).unwrap(), raw)
    }

    #[test]
    fn oversized_and_malformed_frames_are_errors_not_allocations() {
        let waiter =
            Waiter { timeout: Duration::from_secs(5), abort: Arc::new(Abort::default()), blame: None, own_core: false };
        let expected = FrameHeader { fingerprint: 9, seq: 0, len: 16 };
        let (mut transport, mut raw) = transport_and_raw_peer();
        raw.write_all(&FrameHeader { len: 1 << 40, ..expected }.encode()).unwrap();
        let mut into = [0u8; 16];
        let err = transport.recv(1, expected, Sink::Copy(&mut into), &waiter).unwrap_err();
        assert!(matches!(err, CommError::Mismatch { rank: 1, got_bytes, .. } if got_bytes == 1 << 40), "{err}");

        let (mut transport, mut raw) = transport_and_raw_peer();
        raw.write_all(&[0xab; FrameHeader::BYTES]).unwrap();
        let err = transport.recv(1, expected, Sink::Copy(&mut into), &waiter).unwrap_err();
        assert!(matches!(err, CommError::Malformed { rank: 1, .. }), "{err}");

        let (mut transport, raw) = transport_and_raw_peer();
        drop(raw);
        let err = transport.recv(1, expected, Sink::Copy(&mut into), &waiter).unwrap_err();
        assert!(matches!(err, CommError::PeerGone { rank: 1, .. }), "{err}");
    }

    #[test]
    fn stripes_cover_the_message_on_aligned_boundaries() {
        assert_eq!(stripes(100, 4), vec![0..100]);
        let cut = stripes(STRIPE_MIN_BYTES + 8, 3);
        assert_eq!(cut.len(), 3);
        assert_eq!(cut.last().unwrap().end, STRIPE_MIN_BYTES + 8);
        assert!(cut.windows(2).all(|w| w[0].end == w[1].start && w[0].end % STRIPE_ALIGN == 0));
    }
}
