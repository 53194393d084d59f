//! The rendezvous store: a key-value server at MASTER_ADDR:MASTER_PORT, hosted by rank 0 or by
//! the launcher (as torchrun's TCPStore is), that every connection must greet with the job token. Besides keys it
//! carries the job's failures: each rank keeps a monitor connection open, and when one closes
//! without a goodbye (the process died) or a rank reports a failure, the store tells every
//! monitor at once.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::CommError;
use crate::wait::Abort;
use crate::wire::{Hello, read_u64, same_token};

const SET: u8 = 1;
const GET: u8 = 2;
const ABORT: u8 = 3;
const BYE: u8 = 4;
const TRY_GET: u8 = 5;
const ACCEPTED: u8 = 0;
const REFUSED: u8 = 1;
const ABSENT: u8 = 2;
/// The largest key or value the store accepts: more is a malformed request, not an allocation.
const MAX_FIELD_BYTES: usize = 1 << 20;
/// What all keys and values may hold together: a job's rendezvous needs kilobytes a rank.
const MAX_STORE_BYTES: usize = 256 << 20;
/// How long a new connection has to greet the store with the job token, in all.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// Connections still greeting, at most: more are closed at once, so that strangers cannot use up
/// the host's file descriptors or threads.
const MAX_GREETING: usize = 64;
/// Connections that greeted with the token, at most (each rank holds two).
const MAX_JOINED: usize = 4096;
const STORE: &str = "store";
const MONITOR: &str = "monitor";

fn write_field(out: &mut impl Write, bytes: &[u8]) -> std::io::Result<()> {
    out.write_all(&(bytes.len() as u64).to_le_bytes())?;
    out.write_all(bytes)
}

fn read_field(input: &mut impl Read) -> Result<Vec<u8>, String> {
    let len = read_u64(input)? as usize;
    if len > MAX_FIELD_BYTES {
        return Err(format!("field of {len} bytes exceeds {MAX_FIELD_BYTES}"));
    }
    let mut bytes = vec![0u8; len];
    input.read_exact(&mut bytes).map_err(|e| e.to_string())?;
    Ok(bytes)
}

#[derive(Default)]
struct State {
    keys: BTreeMap<String, Vec<u8>>,
    /// Ranks that said goodbye: their monitor closing is no failure.
    finished: BTreeSet<u64>,
    /// Ranks gone from the store: said goodbye or closed their monitor.
    departed: BTreeSet<u64>,
    /// Ranks that connected their monitor.
    joined: BTreeSet<u64>,
    monitors: Vec<TcpStream>,
    /// Every joined connection by id, to shut down when the store stops; removed when it ends.
    connections: BTreeMap<u64, TcpStream>,
    next_connection: u64,
    /// Bytes of all keys and values.
    bytes: usize,
    /// The first failure reported, sent to monitors that connect later too.
    failure: Option<(u64, String)>,
}

struct Shared {
    token: String,
    /// Connections accepted and not yet through their greeting.
    greeting: AtomicUsize,
    state: Mutex<State>,
    changed: Condvar,
    stopping: AtomicBool,
}

impl Shared {
    fn broadcast_failure(&self, rank: u64, reason: String) {
        let mut state = self.state.lock().expect("store lock");
        if state.failure.is_some() || self.stopping.load(Ordering::Acquire) {
            return;
        }
        let mut notice = rank.to_le_bytes().to_vec();
        write_field(&mut notice, reason.as_bytes()).expect("writing to a Vec");
        for monitor in &mut state.monitors {
            monitor.write_all(&notice).ok();
        }
        state.failure = Some((rank, reason));
        self.changed.notify_all();
    }
}

/// The store server, running until dropped.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    listener: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Serves the store at `addr` (port 0: a free port, see [`StoreServer::port`]) to
    /// connections that greet it with `token`.
    pub fn bind(addr: &str, token: &str) -> Result<StoreServer, CommError> {
        let listener =
            TcpListener::bind(addr).map_err(|err| CommError::io(format!("binding the store at {addr}"), &err))?;
        let addr = listener.local_addr().map_err(|err| CommError::io("the store's address", &err))?;
        let shared = Arc::new(Shared {
            token: token.to_string(),
            greeting: AtomicUsize::new(0),
            state: Mutex::default(),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
        });
        let accepting = Arc::clone(&shared);
        let listener = std::thread::Builder::new()
            .name("medley-store".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if accepting.stopping.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    if accepting.greeting.fetch_add(1, Ordering::AcqRel) >= MAX_GREETING {
                        accepting.greeting.fetch_sub(1, Ordering::AcqRel);
                        continue; // Dropped: closed at once.
                    }
                    let shared = Arc::clone(&accepting);
                    std::thread::spawn(move || serve(stream, &shared));
                }
            })
            .map_err(|err| CommError::io("starting the store", &err))?;
        Ok(StoreServer { addr, shared, listener: Some(listener) })
    }

    /// Tells every rank, now and as it joins, that rank `blamed` failed (a launcher that saw it
    /// exit). Only the first failure of a job is kept.
    pub fn report_failure(&self, blamed: usize, reason: &str) {
        self.shared.broadcast_failure(blamed as u64, reason.to_string());
    }

    /// The port the store listens on.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The rank the job's first reported failure blames, if one was reported.
    pub fn blamed(&self) -> Option<usize> {
        self.shared.state.lock().expect("store lock").failure.as_ref().map(|(rank, _)| *rank as usize)
    }

    /// Waits until every one of `n_ranks` ranks has left the store (said goodbye or closed its
    /// monitor), or `timeout`. After a failure only the ranks that joined are waited for, to
    /// learn of it: one that never joined (stopped at start-up, say) would hold the store for
    /// the whole timeout, and one joining late finds no store and fails on its own.
    pub fn wait_finished(&self, n_ranks: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut state = self.shared.state.lock().expect("store lock");
        let waiting = |state: &State| {
            let still_in = |rank: &u64| !state.departed.contains(rank);
            if state.failure.is_some() { state.joined.iter().any(still_in) } else { state.departed.len() < n_ranks }
        };
        while waiting(&state) && Instant::now() < deadline {
            state = self.shared.changed.wait_timeout(state, Duration::from_millis(10)).expect("store lock").0;
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        self.shared.changed.notify_all();
        for stream in self.shared.state.lock().expect("store lock").connections.values() {
            stream.shutdown(Shutdown::Both).ok();
        }
        // Wakes the accept loop so it sees `stopping`.
        TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)).ok();
        if let Some(listener) = self.listener.take() {
            listener.join().ok();
        }
    }
}

fn serve(mut stream: TcpStream, shared: &Shared) {
    stream.set_nodelay(true).ok();
    let hello = Hello::read(&mut Deadline::new(&stream, HANDSHAKE));
    shared.greeting.fetch_sub(1, Ordering::AcqRel);
    let hello = match hello {
        Ok(hello) => hello,
        Err(reason) => return refuse(&mut stream, &reason),
    };
    if !same_token(&hello.token, &shared.token) {
        return refuse(&mut stream, "wrong job token (MEDLEY_TOKEN)");
    }
    let Some(id) = join(&stream, shared) else {
        return refuse(&mut stream, &format!("the store holds {MAX_JOINED} connections already"));
    };
    if stream.set_read_timeout(None).is_ok() && stream.write_all(&[ACCEPTED]).is_ok() {
        match hello.purpose.as_str() {
            MONITOR => monitor(stream, hello.rank, shared),
            STORE => while handle_request(&mut stream, hello.rank, shared).is_ok() {},
            other => refuse(&mut stream, &format!("unknown purpose {other:?}")),
        }
    }
    shared.state.lock().expect("store lock").connections.remove(&id);
}

/// Records a connection that greeted with the token, to shut it down when the store stops; `None`
/// when the store holds as many as it takes.
fn join(stream: &TcpStream, shared: &Shared) -> Option<u64> {
    let clone = stream.try_clone().ok()?;
    let mut state = shared.state.lock().expect("store lock");
    if state.connections.len() >= MAX_JOINED {
        return None;
    }
    let id = state.next_connection;
    state.next_connection += 1;
    state.connections.insert(id, clone);
    Some(id)
}

/// A stream read against one deadline for all its reads, so a client that trickles a byte at a
/// time cannot hold a connection longer than the handshake allows.
struct Deadline<'s> {
    stream: &'s TcpStream,
    by: Instant,
}

impl<'s> Deadline<'s> {
    fn new(stream: &'s TcpStream, within: Duration) -> Deadline<'s> {
        Deadline { stream, by: Instant::now() + within }
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.by.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no greeting within the handshake's time"));
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut stream = self.stream;
        stream.read(buf)
    }
}

fn refuse(stream: &mut TcpStream, reason: &str) {
    stream.write_all(&[REFUSED]).ok();
    write_field(stream, reason.as_bytes()).ok();
}

/// Holds a rank's monitor connection; when it closes before the rank said goodbye, the rank died.
fn monitor(mut stream: TcpStream, rank: u64, shared: &Shared) {
    {
        let mut state = shared.state.lock().expect("store lock");
        if let Some((blamed, reason)) = &state.failure {
            stream.write_all(&blamed.to_le_bytes()).ok();
            write_field(&mut stream, reason.as_bytes()).ok();
        }
        if let Ok(clone) = stream.try_clone() {
            state.monitors.push(clone);
        }
        state.joined.insert(rank);
        shared.changed.notify_all();
    }
    let mut byte = [0u8; 1];
    while matches!(stream.read(&mut byte), Ok(1)) {}
    let finished = {
        let mut state = shared.state.lock().expect("store lock");
        state.departed.insert(rank);
        shared.changed.notify_all();
        state.finished.contains(&rank)
    };
    if !finished {
        shared.broadcast_failure(rank, format!("rank {rank} exited or lost its connection without closing"));
    }
}

/// A store request's operation, key and value, as a client sends them.
pub(crate) fn read_request(input: &mut impl Read) -> Result<(u8, String, Vec<u8>), String> {
    let mut op = [0u8; 1];
    input.read_exact(&mut op).map_err(|e| e.to_string())?;
    let key = String::from_utf8(read_field(input)?).map_err(|_| "key is not UTF-8".to_string())?;
    Ok((op[0], key, read_field(input)?))
}

fn handle_request(stream: &mut TcpStream, rank: u64, shared: &Shared) -> Result<(), String> {
    let (op, key, value) = read_request(stream)?;
    let mut status = ACCEPTED;
    let reply = match op {
        TRY_GET => match shared.state.lock().expect("store lock").keys.get(&key) {
            Some(value) => value.clone(),
            None => {
                status = ABSENT;
                Vec::new()
            }
        },
        SET => {
            let mut state = shared.state.lock().expect("store lock");
            let replaced = state.keys.get(&key).map_or(0, |old| key.len() + old.len());
            let bytes = state.bytes - replaced + key.len() + value.len();
            if bytes > MAX_STORE_BYTES {
                return Err(format!("the store would hold {bytes} bytes, more than its {MAX_STORE_BYTES}"));
            }
            state.bytes = bytes;
            state.keys.insert(key, value);
            shared.changed.notify_all();
            Vec::new()
        }
        GET => {
            let mut state = shared.state.lock().expect("store lock");
            loop {
                if let Some(value) = state.keys.get(&key) {
                    break value.clone();
                }
                if shared.stopping.load(Ordering::Acquire) {
                    return Err("store stopping".into());
                }
                state = shared.changed.wait_timeout(state, Duration::from_millis(50)).expect("store lock").0;
            }
        }
        ABORT => {
            let blamed = value.get(..8).map_or(rank, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
            shared.broadcast_failure(blamed, String::from_utf8_lossy(value.get(8..).unwrap_or_default()).into_owned());
            Vec::new()
        }
        BYE => {
            let mut state = shared.state.lock().expect("store lock");
            state.finished.insert(rank);
            state.departed.insert(rank);
            shared.changed.notify_all();
            Vec::new()
        }
        other => return Err(format!("unknown request {other}")),
    };
    stream.write_all(&[status]).map_err(|e| e.to_string())?;
    write_field(stream, &reply).map_err(|e| e.to_string())
}

/// Connects to the store and greets it, retrying while it is not up yet (rank 0 may start last)
/// and while whatever holds the port closes the connection before answering the greeting (a
/// listener that held the port for a moment before the store bound it): only the store's answer,
/// or the deadline, ends the wait.
fn connect(addr: &str, token: &str, rank: usize, purpose: &str, timeout: Duration) -> Result<TcpStream, CommError> {
    let deadline = Instant::now() + timeout;
    let io = |err: std::io::Error| CommError::io(format!("greeting the store at {addr}"), &err);
    let (mut stream, status) = loop {
        let attempt = addr
            .to_socket_addrs()
            .map_err(|err| CommError::io(format!("resolving the store address {addr}"), &err))?
            .find_map(|sock| TcpStream::connect_timeout(&sock, Duration::from_secs(1)).ok());
        let greeted = attempt.map(|stream| greet(stream, token, rank, purpose, timeout));
        match greeted {
            Some(Ok(greeted)) => break greeted,
            Some(Err(err)) if !closed_early(&err) || Instant::now() >= deadline => return Err(io(err)),
            _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => return Err(CommError::Store(format!("no store answered at {addr} within {timeout:?}"))),
        }
    };
    if status != ACCEPTED {
        let reason = read_field(&mut stream).map(|r| String::from_utf8_lossy(&r).into_owned()).unwrap_or_default();
        return Err(CommError::Refused { addr: addr.into(), reason });
    }
    Ok(stream)
}

/// Sends the greeting on `stream`; the stream with the store's answer.
fn greet(
    mut stream: TcpStream,
    token: &str,
    rank: usize,
    purpose: &str,
    timeout: Duration,
) -> std::io::Result<(TcpStream, u8)> {
    stream.set_nodelay(true).ok();
    stream.set_read_timeout(Some(timeout))?;
    Hello { token: token.into(), purpose: purpose.into(), rank: rank as u64, stream: 0 }.write(&mut stream)?;
    let mut status = [0u8; 1];
    stream.read_exact(&mut status)?;
    Ok((stream, status[0]))
}

/// Whether the other end closed the connection before answering: not a store's refusal, which
/// answers with its reason.
fn closed_early(err: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        err.kind(),
        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::UnexpectedEof | ErrorKind::BrokenPipe
    )
}

/// A rank's connection to the store.
pub(crate) struct StoreClient {
    addr: String,
    stream: Mutex<TcpStream>,
}

impl StoreClient {
    pub fn connect(addr: &str, token: &str, rank: usize, timeout: Duration) -> Result<StoreClient, CommError> {
        Ok(StoreClient { addr: addr.into(), stream: Mutex::new(connect(addr, token, rank, STORE, timeout)?) })
    }

    /// How long a call may wait for its answer (a get, for its key) from now on.
    pub fn set_timeout(&self, timeout: Duration) -> Result<(), CommError> {
        let stream = self.stream.lock().expect("store stream lock");
        stream.set_read_timeout(Some(timeout)).map_err(|err| CommError::io(format!("the store at {}", self.addr), &err))
    }

    /// The address this rank reaches the store from: the interface its peers can reach it on.
    pub fn local_ip(&self) -> Result<std::net::IpAddr, CommError> {
        let stream = self.stream.lock().expect("store client lock");
        stream.local_addr().map(|addr| addr.ip()).map_err(|err| CommError::io("the store connection's address", &err))
    }

    /// The reply's status and bytes.
    fn exchange(&self, op: u8, key: &str, value: &[u8]) -> Result<(u8, Vec<u8>), CommError> {
        let mut stream = self.stream.lock().expect("store client lock");
        let waited = stream.read_timeout().ok().flatten();
        let io = |err: std::io::Error| match (err.kind(), waited) {
            (std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut, Some(waited)) => CommError::Store(format!(
                "the store at {} did not answer within {waited:?} (asked about {key:?}): the process hosting it \
                 (rank 0, or the launcher) is stopped or gone",
                self.addr
            )),
            _ => CommError::io(format!("talking to the store at {} about {key:?}", self.addr), &err),
        };
        let mut request = vec![op];
        write_field(&mut request, key.as_bytes()).map_err(io)?;
        write_field(&mut request, value).map_err(io)?;
        stream.write_all(&request).map_err(io)?;
        let mut status = [0u8; 1];
        stream.read_exact(&mut status).map_err(io)?;
        let reply = read_field(&mut *stream).map_err(CommError::Store)?;
        Ok((status[0], reply))
    }

    fn request(&self, op: u8, key: &str, value: &[u8]) -> Result<Vec<u8>, CommError> {
        match self.exchange(op, key, value)? {
            (ACCEPTED, reply) => Ok(reply),
            (_, reply) => Err(CommError::Store(String::from_utf8_lossy(&reply).into_owned())),
        }
    }

    /// The value of `key` if some rank has set it, without waiting.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>, CommError> {
        match self.exchange(TRY_GET, key, &[])? {
            (ACCEPTED, reply) => Ok(Some(reply)),
            (ABSENT, _) => Ok(None),
            (_, reply) => Err(CommError::Store(String::from_utf8_lossy(&reply).into_owned())),
        }
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        self.request(SET, key, value).map(drop)
    }

    /// The value of `key` once some rank has set it, asked again and again until `deadline`
    /// (`None` if no rank has by then); a failure the job reports meanwhile (`abort`) ends the
    /// wait. Unlike [`StoreClient::get`] no answer is left in flight when it gives up.
    pub fn wait_for(&self, key: &str, deadline: Instant, abort: &Abort) -> Result<Option<Vec<u8>>, CommError> {
        let mut pause = Duration::from_millis(1);
        loop {
            if let Some(value) = self.try_get(key)? {
                return Ok(Some(value));
            }
            abort.check()?;
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// The value of `key`, waiting (up to the connection's timeout) until some rank sets it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, CommError> {
        self.request(GET, key, &[])
    }

    /// Tells every rank that `blamed` failed.
    pub fn report_failure(&self, blamed: usize, reason: &str) -> Result<(), CommError> {
        let mut value = (blamed as u64).to_le_bytes().to_vec();
        value.extend(reason.as_bytes());
        self.request(ABORT, "", &value).map(drop)
    }

    pub fn goodbye(&self) -> Result<(), CommError> {
        self.request(BYE, "", &[]).map(drop)
    }
}

/// The thread that turns the store's failure notices into this rank's abort.
pub(crate) struct Monitor {
    stream: TcpStream,
    closing: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Monitor {
    pub fn start(
        addr: &str,
        token: &str,
        rank: usize,
        timeout: Duration,
        abort: Arc<Abort>,
    ) -> Result<Monitor, CommError> {
        let stream = connect(addr, token, rank, MONITOR, timeout)?;
        let io = |err: std::io::Error| CommError::io("starting the failure monitor", &err);
        stream.set_read_timeout(None).map_err(io)?;
        let mut reading = stream.try_clone().map_err(io)?;
        let closing = Arc::new(AtomicBool::new(false));
        let closing_seen = Arc::clone(&closing);
        let addr = addr.to_string();
        let thread = std::thread::Builder::new()
            .name("medley-monitor".into())
            .spawn(move || {
                let notice = read_u64(&mut reading).and_then(|rank| Ok((rank, read_field(&mut reading)?)));
                if closing_seen.load(Ordering::Acquire) {
                    return;
                }
                abort.raise(match notice {
                    Ok((rank, reason)) => CommError::Aborted {
                        rank: rank as usize,
                        reason: String::from_utf8_lossy(&reason).into_owned(),
                    },
                    Err(_) => CommError::Aborted {
                        rank: 0,
                        reason: format!("the store at {addr} (hosted by rank 0) went away"),
                    },
                });
            })
            .map_err(io)?;
        Ok(Monitor { stream, closing, thread: Some(thread) })
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Release);
        self.stream.shutdown(Shutdown::Both).ok();
        if let Some(thread) = self.thread.take() {
            thread.join().ok();
        }
    }
}

#[cfg(test)]
mod tests;
