//! Connecting a communicator's ranks: each publishes where it listens, its domain, host and
//! process id under the communicator's namespace in the store, then every pair is joined by
//! shared memory or TCP according to the [`Config`]'s routes.

use std::io::{Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use medley_collective::{DomainId, Group};

use crate::CommError;
use crate::env::{Config, TransportKind};
use crate::session::Session;
use crate::transport::shm::{Inbox, ShmTransport, allow_reads_by, inbox_path, job_prefix};
use crate::transport::tcp::TcpTransport;
use crate::transport::window::{self, Windows, window_path};
use crate::transport::{Links, Transport};
use crate::wait::JoinBudget;
use crate::wire::{Hello, fingerprint, same_token};

/// What every rank publishes about itself.
#[derive(Clone, Debug)]
struct RankInfo {
    listen: String,
    domain: String,
    host: String,
    pid: u32,
}

impl RankInfo {
    fn encode(&self) -> Vec<u8> {
        format!("{}\n{}\n{}\n{}", self.listen, self.domain, self.host, self.pid).into_bytes()
    }

    fn decode(bytes: &[u8], rank: usize) -> Result<RankInfo, CommError> {
        let text = String::from_utf8_lossy(bytes);
        let fields: Vec<&str> = text.split('\n').collect();
        let bad = || CommError::Malformed { rank, reason: format!("rank info {text:?}") };
        let [listen, domain, host, pid] = fields[..] else { return Err(bad()) };
        Ok(RankInfo {
            listen: listen.into(),
            domain: domain.into(),
            host: host.into(),
            pid: pid.parse().map_err(|_| bad())?,
        })
    }
}

/// A connected communicator's pieces.
pub(crate) struct Mesh {
    pub links: Links,
    /// Every rank's window, when all ranks share memory in one domain.
    pub windows: Option<Windows>,
    pub group: Group,
    pub domain_names: Vec<String>,
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its whole length; the kernel NUL-terminates within it.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let len = buf.iter().position(|&b| b == 0).unwrap_or(0);
    if ok { String::from_utf8_lossy(&buf[..len]).into_owned() } else { "unknown-host".into() }
}

/// Connects rank `me` of the communicator whose ranks are the job ranks `members`, under `ns`,
/// within `budget`.
pub(crate) fn connect(
    session: &Session,
    ns: &str,
    members: &[usize],
    me: usize,
    listen_ip: IpAddr,
    config: &Config,
    budget: JoinBudget,
) -> Result<Mesh, CommError> {
    let n = members.len();
    let io = |what: &str, err: std::io::Error| CommError::io(what.to_string(), &err);
    let listener = TcpListener::bind((listen_ip, 0)).map_err(|e| io("binding a data listener", e))?;
    let listen = listener.local_addr().map_err(|e| io("the data listener's address", e))?.to_string();
    let mine = RankInfo { listen, domain: session.env.domain.clone(), host: hostname(), pid: std::process::id() };
    session.store.set(&format!("{ns}/info/{me}"), &mine.encode())?;
    let infos: Vec<RankInfo> = (0..n)
        .map(|r| {
            RankInfo::decode(
                &wait_for_peer(
                    session,
                    budget,
                    members[r],
                    &format!("{ns}/info/{r}"),
                    "joining: it never published its address",
                )?,
                members[r],
            )
        })
        .collect::<Result<_, _>>()?;

    let mut domain_names: Vec<String> = infos.iter().map(|info| info.domain.clone()).collect();
    domain_names.sort();
    domain_names.dedup();
    let domain_of = infos.iter().map(|info| DomainId(domain_names.binary_search(&info.domain).expect("listed") as u32));
    let group = Group::new(domain_of.collect())?;

    let route_to = |peer: usize| {
        let (a, b) = (&infos[me], &infos[peer]);
        let wanted = if a.domain == b.domain { config.intra_domain } else { config.bridge };
        if a.host == b.host { wanted } else { TransportKind::Tcp }
    };
    let shm_peers: Vec<usize> = (0..n).filter(|&p| p != me && route_to(p) == TransportKind::Shm).collect();
    let tcp_peers: Vec<usize> = (0..n).filter(|&p| p != me && route_to(p) == TransportKind::Tcp).collect();

    let joining = Joining { session, ns, members, me, infos: &infos, budget };
    let mut transports: Vec<Box<dyn Transport>> = Vec::new();
    let mut route = vec![0; n];
    // Windows are a native facility: a bridge between vendors offers none, even on one host.
    let share_windows = shm_peers.len() == n - 1 && group.n_domains() == 1;
    let mut windows = None;
    if n == 1 {
        windows = Some(Windows::alone(members[0])?);
    } else if !shm_peers.is_empty() {
        let (shm, shared) = connect_shm(&joining, &shm_peers, share_windows)?;
        windows = shared;
        shm_peers.iter().for_each(|&p| route[p] = transports.len());
        transports.push(Box::new(shm));
    }
    if !tcp_peers.is_empty() {
        let sockets = connect_tcp(&joining, &listener, &tcp_peers, config)?;
        tcp_peers.iter().for_each(|&p| route[p] = transports.len());
        // Only links across domains are the bridge; links within a domain across hosts are not.
        let caps = (0..n).map(|p| if infos[p].domain != infos[me].domain { config.bridge_bytes_per_s } else { None });
        transports.push(Box::new(TcpTransport::new(sockets, members, &caps.collect::<Vec<_>>())?));
    }
    Ok(Mesh { links: Links::new(transports, route), windows, group, domain_names })
}

/// A rank joining a communicator, with what every rank published.
struct Joining<'a> {
    session: &'a Session,
    ns: &'a str,
    members: &'a [usize],
    me: usize,
    infos: &'a [RankInfo],
    budget: JoinBudget,
}

impl Joining<'_> {
    /// Waits until `peer` has set `key` in the store (within the budget).
    fn wait_for(&self, key: &str, peer: usize, what: &'static str) -> Result<(), CommError> {
        wait_for_peer(self.session, self.budget, self.members[peer], key, what).map(drop)
    }
}

/// The value job rank `rank` sets under `key`, waited for within `budget`; the timeout names
/// the rank and `what` it never did.
fn wait_for_peer(
    session: &Session,
    budget: JoinBudget,
    rank: usize,
    key: &str,
    what: &'static str,
) -> Result<Vec<u8>, CommError> {
    let value = session.store.wait_for(key, budget.deadline, &session.abort)?;
    value.ok_or_else(|| budget.timeout(rank, what))
}

/// Creates this rank's inbox (and window, with `share_windows`), maps its shared-memory peers'
/// and removes the files once they have all mapped them (the mappings outlive the names).
fn connect_shm(
    joining: &Joining<'_>,
    peers: &[usize],
    share_windows: bool,
) -> Result<(ShmTransport, Option<Windows>), CommError> {
    let Joining { session, ns, members, me, infos, .. } = *joining;
    let n = members.len();
    let job = format!("{}{:08x}", job_prefix(&session.env.token, &session.env.store_addr()), fingerprint(ns) as u32);
    let my_paths = RemovedOnDrop(vec![inbox_path(&job, me), window_path(&job, me)]);
    let inbox = Inbox::create(&my_paths.0[0], n)?;
    let mut maps = Vec::new();
    if share_windows {
        maps = (0..n).map(|_| None).collect();
        maps[me] = Some(window::create(&my_paths.0[1])?);
    }
    session.store.set(&format!("{ns}/inbox/{me}"), b"")?;
    let mut theirs: Vec<Option<(usize, u32, Inbox)>> = (0..n).map(|_| None).collect();
    for &p in peers {
        joining.wait_for(&format!("{ns}/inbox/{p}"), p, "joining: it never created its shared-memory inbox")?;
        theirs[p] = Some((members[p], infos[p].pid, Inbox::open(&inbox_path(&job, p), n)?));
        if share_windows {
            maps[p] = Some(window::open(&window_path(&job, p))?);
        }
    }
    session.store.set(&format!("{ns}/mapped/{me}"), b"")?;
    for &p in peers {
        joining.wait_for(&format!("{ns}/mapped/{p}"), p, "joining: it never mapped the shared-memory inboxes")?;
    }
    drop(my_paths);
    let windows = share_windows.then(|| Windows::new(me, maps.into_iter().flatten().collect(), members.to_vec()));
    allow_reads_by(&peers.iter().map(|&p| infos[p].pid).collect::<Vec<_>>());
    Ok((ShmTransport::new(me, inbox, theirs), windows))
}

/// Shared-memory files this rank created, removed once the peers have mapped them — or when
/// joining fails on the way, so a failed start leaves nothing in /dev/shm.
struct RemovedOnDrop(Vec<PathBuf>);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        for path in &self.0 {
            std::fs::remove_file(path).ok();
        }
    }
}

/// Opens `config.tcp_streams` connections per TCP peer: to lower ranks this rank connects, from
/// higher ranks it accepts, checking each greeting's token, namespace and rank.
fn connect_tcp(
    joining: &Joining<'_>,
    listener: &TcpListener,
    peers: &[usize],
    config: &Config,
) -> Result<Vec<Option<Vec<TcpStream>>>, CommError> {
    let Joining { session, ns, members, me, infos, budget } = *joining;
    let n = infos.len();
    let streams = config.tcp_streams.max(1);
    let token = &session.env.token;
    let mut slots: Vec<Vec<Option<TcpStream>>> = (0..n).map(|_| Vec::new()).collect();
    for &p in peers {
        slots[p] = (0..streams).map(|_| None).collect();
    }
    for &p in peers.iter().filter(|&&p| p < me) {
        for (s, slot) in slots[p].iter_mut().enumerate() {
            let io =
                |err: std::io::Error| CommError::io(format!("connecting to rank {p} at {}", infos[p].listen), &err);
            let mut stream = TcpStream::connect(&infos[p].listen).map_err(io)?;
            stream.set_read_timeout(Some(budget.left())).map_err(io)?;
            Hello { token: token.clone(), purpose: ns.into(), rank: me as u64, stream: s as u64 }
                .write(&mut stream)
                .map_err(io)?;
            let mut ack = [0u8; 1];
            stream.read_exact(&mut ack).map_err(|err| match err.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    budget.timeout(members[p], "joining: it never answered this rank's greeting")
                }
                _ => io(err),
            })?;
            if ack[0] != 1 {
                return Err(CommError::Refused {
                    addr: infos[p].listen.clone(),
                    reason: "the peer refused the greeting".into(),
                });
            }
            *slot = Some(stream);
        }
    }
    let mut expected = peers.iter().filter(|&&p| p > me).count() * streams;
    listener.set_nonblocking(true).map_err(|e| CommError::io("configuring the data listener", &e))?;
    while expected > 0 {
        session.abort.check()?;
        let mut stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > budget.deadline {
                    let missing = peers.iter().find(|&&p| p > me && slots[p].iter().any(Option::is_none));
                    let rank = members[*missing.expect("a connection is missing")];
                    return Err(budget.timeout(rank, "joining: it never connected to this rank"));
                }
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(err) => return Err(CommError::io("accepting a peer", &err)),
        };
        stream.set_nonblocking(false).ok();
        stream.set_read_timeout(Some(budget.left().min(Duration::from_secs(5)))).ok();
        let Ok(hello) = Hello::read(&mut stream) else { continue };
        let (rank, s) = (hello.rank as usize, hello.stream as usize);
        let fits = same_token(&hello.token, token)
            && hello.purpose == ns
            && rank > me
            && peers.contains(&rank)
            && s < streams
            && slots[rank][s].is_none();
        stream.write_all(&[u8::from(fits)]).ok();
        if fits {
            slots[rank][s] = Some(stream);
            expected -= 1;
        }
    }
    Ok(slots
        .into_iter()
        .map(|streams| {
            let streams: Vec<TcpStream> = streams.into_iter().flatten().collect();
            (!streams.is_empty()).then_some(streams)
        })
        .collect())
}
