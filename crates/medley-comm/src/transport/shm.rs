//! Shared memory between ranks on one host, single-copy: a sender posts the address and length
//! of its bytes in the receiver's inbox (a small file in `/dev/shm` every local rank maps), and
//! the receiver copies them straight out of the sender's memory with `process_vm_readv`, into
//! the destination (a plain receive) or through a cache-sized piece (a reducing one). The sender
//! learns that its bytes are free when the receiver counts the message consumed. Small messages
//! go eagerly instead (as MPI's do): copied into the mailbox, so the sender is done at once and
//! the receiver needs no system call. Both sides wait poll-yield-futex on the counters; no thread
//! runs for a collective.

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memmap2::MmapRaw;

use super::{Sink, Ticket, Transport};
use crate::CommError;
use crate::wait::{Waiter, futex_wait, futex_wake};
use crate::wire::{FrameHeader, fingerprint};

/// Messages a sender may post before the receiver consumes one. Plans issue at most one block's
/// chunks ahead of a receive, and the communicator sizes chunks so that stays well below this.
pub(crate) const MAILBOX_SLOTS: usize = 1024;
const _: () = assert!(MAILBOX_SLOTS >= 4 * medley_collective::MAX_CHUNKS, "a plan's sends fit a mailbox");
/// Bytes read from a peer before a reduce combines them: fits in L2 next to the destination.
const REDUCE_PIECE_BYTES: usize = 128 << 10;
/// Messages up to this size are copied into the mailbox: below it a copy costs less than the
/// `process_vm_readv` call and the sender's wait for the receiver. 16 KiB rather than 8: a 16 KiB
/// all-reduce of 2 ranks (one exchange of the whole buffer) took 8–11 µs eager against 19–26 µs
/// zero-copy, interleaved runs on this loaded 2-core machine. A mailbox holds 16 such buffers,
/// 256 KiB per sender and receiver in `/dev/shm`.
const EAGER_BYTES: usize = 16 << 10;
/// Eager buffers per mailbox: message k uses buffer k mod this, so a sender sends eagerly only
/// while fewer than this many of its messages are unconsumed.
const EAGER_SLOTS: usize = 16;

#[repr(C)]
struct Slot {
    fingerprint: AtomicU64,
    seq: AtomicU64,
    len: AtomicU64,
    /// The sender's address of the bytes, or `EAGER` when they are in the mailbox.
    addr: AtomicU64,
}

const EAGER: u64 = u64::MAX;

/// One sender's mailbox in a receiver's inbox. The counters sit on their own cache lines: the
/// sender writes `posted`, the receiver `consumed`.
#[repr(C, align(64))]
struct Mailbox {
    posted: AtomicU32,
    /// Non-zero while the receiver sleeps on `posted`, so the sender knows to wake it.
    receiver_sleeping: AtomicU32,
    _pad0: [u8; 56],
    consumed: AtomicU32,
    sender_sleeping: AtomicU32,
    _pad1: [u8; 56],
    slots: [Slot; MAILBOX_SLOTS],
    eager: UnsafeCell<[[u8; EAGER_BYTES]; EAGER_SLOTS]>,
}

impl Mailbox {
    /// Eager buffer `idx`; only the sender writes it, and only while its last message is consumed.
    fn eager_buffer(&self, idx: usize) -> *mut u8 {
        // SAFETY: `idx` is reduced modulo the buffer count, so the offset stays inside `eager`.
        unsafe { self.eager.get().cast::<u8>().add((idx % EAGER_SLOTS) * EAGER_BYTES) }
    }
}

/// A rank's inbox: one mailbox per possible sender, in a file every local rank maps.
pub(crate) struct Inbox {
    map: MmapRaw,
    n_ranks: usize,
}

impl Inbox {
    fn bytes(n_ranks: usize) -> usize {
        n_ranks * size_of::<Mailbox>()
    }

    /// Creates (or replaces a stale) inbox file for `n_ranks` senders.
    pub fn create(path: &Path, n_ranks: usize) -> Result<Inbox, CommError> {
        Ok(Inbox { map: map_shared(path, Inbox::bytes(n_ranks), true)?, n_ranks })
    }

    /// Maps a peer's inbox file, which must be of the expected size.
    pub fn open(path: &Path, n_ranks: usize) -> Result<Inbox, CommError> {
        Ok(Inbox { map: map_shared(path, Inbox::bytes(n_ranks), false)?, n_ranks })
    }

    fn mailbox(&self, sender: usize) -> &Mailbox {
        assert!(sender < self.n_ranks, "sender {sender} outside the inbox");
        // SAFETY: the mapping is page-aligned and holds `n_ranks` mailboxes, zero-filled when
        // created (all-zero atomics are valid, and every field is an atomic, padding or bytes
        // behind an `UnsafeCell`); it lives as long as `self`.
        unsafe { &*(self.map.as_ptr() as *const Mailbox).add(sender) }
    }
}

/// Maps the shared file at `path` of `len` bytes: created zero-filled, readable and writable by
/// this user alone, with its memory reserved when `create` (a stale file or a planted link at the
/// path is removed first, and the new file made with exclusive create, so nothing else's file is
/// ever opened or truncated), else opened without following a link, and only if this user owns
/// it; then it must have exactly that size.
pub(crate) fn map_shared(path: &Path, len: usize, create: bool) -> Result<MmapRaw, CommError> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let what = if create { "creating" } else { "opening" };
    let io = |err: std::io::Error| CommError::io(format!("{what} {}", path.display()), &err);
    let mut options = OpenOptions::new();
    options.read(true).write(true).custom_flags(libc::O_NOFOLLOW);
    if create {
        match std::fs::remove_file(path) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => return Err(io(err)),
            _ => {}
        }
        options.create_new(true).mode(0o600);
    }
    let file = options.open(path).map_err(io)?;
    let metadata = file.metadata().map_err(io)?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if metadata.uid() != me {
        return Err(CommError::Io {
            context: format!("{what} {}", path.display()),
            message: format!(
                "owned by user {}, not this job's user {me}: another user's file is never mapped",
                metadata.uid()
            ),
        });
    }
    if create {
        // Reserved now, so a full /dev/shm fails here, named, instead of raising SIGBUS at the
        // first touch of a page that does not fit.
        // SAFETY: a plain system call on a descriptor this function owns.
        let errno = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
        if errno != 0 {
            return Err(io(std::io::Error::from_raw_os_error(errno)));
        }
    }
    let found = file.metadata().map_err(io)?.len();
    if found != len as u64 {
        return Err(CommError::Io {
            context: format!("{what} {}", path.display()),
            message: format!("{found} bytes, expected {len}"),
        });
    }
    // A raw mapping: every access goes through a pointer, as atomics or in ranges the ranks'
    // protocol hands from one to another, never through a Rust slice over the whole file that
    // another process could change under it.
    MmapRaw::map_raw(&file).map_err(|err| CommError::io(format!("mapping {}", path.display()), &err))
}

/// What the names of every shared-memory file of the job with `token` and store address
/// `store_addr` start with (the rest names the communicator and the rank).
pub(crate) fn job_prefix(token: &str, store_addr: &str) -> String {
    format!("{:016x}-", fingerprint(&format!("{token}|{store_addr}")))
}

/// Removes every shared-memory file of the job with `token` and store address `store_addr`;
/// returns how many there were. Ranks remove their own once their peers have mapped them, or
/// when joining fails; this is for a launcher whose ranks were killed mid-join.
pub fn remove_job_shared_memory(token: &str, store_addr: &str) -> usize {
    let prefix = format!("medley-{}", job_prefix(token, store_addr));
    let Ok(entries) = std::fs::read_dir("/dev/shm") else { return 0 };
    entries
        .flatten()
        .filter(|entry| entry.file_name().to_str().is_some_and(|name| name.starts_with(&prefix)))
        .filter(|entry| std::fs::remove_file(entry.path()).is_ok())
        .count()
}

/// Where a rank's inbox lives.
pub(crate) fn inbox_path(job: &str, rank: usize) -> PathBuf {
    PathBuf::from("/dev/shm").join(format!("medley-{job}-{rank}"))
}

struct Peer {
    job_rank: usize,
    pid: libc::pid_t,
    /// The peer's inbox: this rank's mailbox in it carries this rank's sends.
    their_inbox: Inbox,
    next_ticket: u64,
    /// Tickets of zero-copy messages (the ones that read this rank's memory) not yet seen consumed.
    zero_copy: VecDeque<u64>,
}

impl Peer {
    /// The last zero-copy message (the kind that reads this rank's memory) up to `ticket`.
    fn last_zero_copy(&self, ticket: Ticket) -> Option<u64> {
        self.zero_copy.iter().rev().find(|&&t| t <= ticket.0).copied()
    }

    /// Whether the peer has consumed this rank's (`rank`'s) messages through ticket `last`.
    fn consumed_through(&self, rank: usize, last: u64) -> bool {
        reached(self.their_inbox.mailbox(rank).consumed.load(Ordering::Acquire), (last + 1) as u32)
    }
}

/// Shared-memory links to the peers on this host.
pub(crate) struct ShmTransport {
    rank: usize,
    inbox: Inbox,
    peers: Vec<Option<Peer>>,
    scratch: Vec<u8>,
}

impl ShmTransport {
    /// `peers[p]`: the job rank, process id and inbox of peer `p`, `None` for peers not served.
    pub fn new(rank: usize, inbox: Inbox, peers: Vec<Option<(usize, u32, Inbox)>>) -> ShmTransport {
        let peers = peers
            .into_iter()
            .map(|peer| {
                peer.map(|(job_rank, pid, their_inbox)| Peer {
                    job_rank,
                    pid: pid as libc::pid_t,
                    their_inbox,
                    next_ticket: 0,
                    zero_copy: VecDeque::new(),
                })
            })
            .collect();
        ShmTransport { rank, inbox, peers, scratch: Vec::new() }
    }

    fn peer(&self, peer: usize) -> &Peer {
        self.peers[peer].as_ref().expect("routed to a peer with shared memory")
    }
}

/// Waits until `ready()` holds, sleeping on `word`; `sleepers` counts the ranks asleep on it, so
/// the side that bumps the word knows to wake them (every one: a fence has several waiters). Only
/// a wait that sleeps touches the count: it shares a cache line with the word the other side
/// bumps, and a store on every message would pull the line back and forth.
pub(super) fn wait_on(
    waiter: &Waiter,
    rank: usize,
    what: &'static str,
    word: &AtomicU32,
    sleepers: &AtomicU32,
    ready: impl Fn() -> bool,
) -> Result<(), CommError> {
    waiter.wait(rank, what, |slice| {
        if ready() {
            return Ok(Some(()));
        }
        if let Some(slice) = slice {
            let seen = word.load(Ordering::SeqCst);
            sleepers.fetch_add(1, Ordering::SeqCst);
            if !ready() {
                futex_wait(word, seen, slice);
            }
            sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        Ok(ready().then_some(()))
    })
}

pub(super) fn bump_and_wake(word: &AtomicU32, sleepers: &AtomicU32) {
    word.fetch_add(1, Ordering::SeqCst);
    if sleepers.load(Ordering::SeqCst) != 0 {
        futex_wake(word);
    }
}

/// Whether counter `value` has reached `target` (both wrapping u32 counts).
pub(super) fn reached(value: u32, target: u32) -> bool {
    (value.wrapping_sub(target) as i32) >= 0
}

/// Who may read this process's memory, as far as this process has widened Yama's rule.
enum Readers {
    /// Yama's default: under ptrace scope 1, only ancestors.
    Default,
    One(u32),
    AnyOfThisUser,
}

static READERS: Mutex<Readers> = Mutex::new(Readers::Default);

/// Lets the processes `pids` (local peers, of this user) read this process's memory with
/// `process_vm_readv` under Yama's ptrace scope 1, where by default only ancestors may. The
/// effect lasts for the life of the process: Yama allows one exception per process, so it is
/// that one peer while every communicator names the same one, and any process of this user
/// (the rule without Yama) as soon as two peers need it. Without Yama or at scope 0 this does
/// nothing; scopes 2 and 3 cannot be widened, and the first read then fails naming the scope.
pub(crate) fn allow_reads_by(pids: &[u32]) {
    if pids.is_empty() || yama_scope().as_deref() != Some("1") {
        return;
    }
    let mut readers = READERS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let wanted = match (&*readers, pids) {
        (Readers::AnyOfThisUser, _) => return,
        (Readers::One(set), [pid]) if set == pid => return,
        (Readers::Default, [pid]) => Readers::One(*pid),
        _ => Readers::AnyOfThisUser,
    };
    let ptracer = match wanted {
        Readers::One(pid) => pid as libc::c_ulong,
        _ => libc::PR_SET_PTRACER_ANY,
    };
    // SAFETY: PR_SET_PTRACER takes integers only and changes nothing but this process's
    // Yama exception.
    if unsafe { libc::prctl(libc::PR_SET_PTRACER, ptracer, 0, 0, 0) } == 0 {
        *readers = wanted;
    }
}

/// Yama's ptrace scope, where the kernel has Yama.
fn yama_scope() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").ok().map(|scope| scope.trim().to_string())
}

/// Copies `into.len()` bytes at `addr` in process `pid` into `into`.
fn read_from(pid: libc::pid_t, addr: u64, into: &mut [u8], rank: usize) -> Result<(), CommError> {
    let mut done = 0;
    while done < into.len() {
        let local = libc::iovec { iov_base: into[done..].as_mut_ptr().cast(), iov_len: into.len() - done };
        let remote = libc::iovec { iov_base: (addr as usize + done) as *mut libc::c_void, iov_len: into.len() - done };
        // SAFETY: `local` is a live, writable slice; the kernel checks `remote` against the peer's
        // address space and fails rather than touching anything else.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        if n <= 0 {
            let err = std::io::Error::last_os_error();
            let mut what = format!("reading its memory failed: {err}");
            if let (Some(libc::EPERM), Some(scope)) = (err.raw_os_error(), yama_scope()) {
                what += &format!(
                    " (kernel.yama.ptrace_scope is {scope}; shared memory between ranks needs 0 or 1, \
                     or a `Config` that routes these ranks over TCP)"
                );
            }
            return Err(CommError::PeerGone { rank, what });
        }
        done += n as usize;
    }
    Ok(())
}

impl Transport for ShmTransport {
    unsafe fn send(
        &mut self,
        peer: usize,
        header: FrameHeader,
        data: *const u8,
        len: usize,
        waiter: &Waiter,
    ) -> Result<Ticket, CommError> {
        let rank = self.rank;
        let peer = self.peers[peer].as_mut().expect("routed to a peer with shared memory");
        let mailbox = peer.their_inbox.mailbox(rank);
        let posted = mailbox.posted.load(Ordering::Relaxed);
        // The communicator's chunking keeps plans well below the mailbox size, so this wait for a
        // free slot only blocks while the receiver is behind, never for a message of its own.
        wait_on(
            waiter,
            peer.job_rank,
            "a free shared-memory slot",
            &mailbox.consumed,
            &mailbox.sender_sleeping,
            || {
                reached(
                    mailbox.consumed.load(Ordering::Acquire).wrapping_add(MAILBOX_SLOTS as u32),
                    posted.wrapping_add(1),
                )
            },
        )?;
        let unconsumed = posted.wrapping_sub(mailbox.consumed.load(Ordering::Acquire)) as usize;
        let ticket = Ticket(peer.next_ticket);
        peer.next_ticket += 1;
        let addr = if len <= EAGER_BYTES && unconsumed < EAGER_SLOTS {
            // SAFETY: the buffer holds EAGER_BYTES; the message that used it last is consumed
            // (fewer than EAGER_SLOTS are outstanding), so the receiver no longer reads it.
            unsafe { std::ptr::copy_nonoverlapping(data, mailbox.eager_buffer(posted as usize), len) };
            EAGER
        } else {
            peer.zero_copy.push_back(ticket.0);
            data as u64
        };
        let slot = &mailbox.slots[posted as usize % MAILBOX_SLOTS];
        slot.fingerprint.store(header.fingerprint, Ordering::Relaxed);
        slot.seq.store(header.seq, Ordering::Relaxed);
        slot.len.store(header.len, Ordering::Relaxed);
        slot.addr.store(addr, Ordering::Relaxed);
        bump_and_wake(&mailbox.posted, &mailbox.receiver_sleeping);
        Ok(ticket)
    }

    fn is_sent(&mut self, peer: usize, ticket: Ticket) -> bool {
        let peer = self.peer(peer);
        peer.last_zero_copy(ticket).is_none_or(|last| peer.consumed_through(self.rank, last))
    }

    /// Eager messages never need the sender's memory: only the last zero-copy one up to `ticket`
    /// is waited for.
    fn wait_sent(&mut self, peer: usize, ticket: Ticket, waiter: &Waiter) -> Result<(), CommError> {
        let rank = self.rank;
        let peer = self.peers[peer].as_mut().expect("routed to a peer with shared memory");
        let Some(last) = peer.last_zero_copy(ticket) else { return Ok(()) };
        let mailbox = peer.their_inbox.mailbox(rank);
        wait_on(waiter, peer.job_rank, "a shared-memory send", &mailbox.consumed, &mailbox.sender_sleeping, || {
            peer.consumed_through(rank, last)
        })?;
        peer.zero_copy.retain(|&t| t > last);
        Ok(())
    }

    fn recv(&mut self, peer: usize, header: FrameHeader, mut sink: Sink<'_>, waiter: &Waiter) -> Result<(), CommError> {
        let mailbox = self.inbox.mailbox(peer);
        let (job_rank, pid) = {
            let peer = self.peer(peer);
            (peer.job_rank, peer.pid)
        };
        let consumed = mailbox.consumed.load(Ordering::Relaxed);
        wait_on(waiter, job_rank, "a shared-memory receive", &mailbox.posted, &mailbox.receiver_sleeping, || {
            mailbox.posted.load(Ordering::Acquire) != consumed
        })?;
        let slot = &mailbox.slots[consumed as usize % MAILBOX_SLOTS];
        let got = FrameHeader {
            fingerprint: slot.fingerprint.load(Ordering::Relaxed),
            seq: slot.seq.load(Ordering::Relaxed),
            len: slot.len.load(Ordering::Relaxed),
        };
        header.matches(job_rank, got)?;
        let addr = slot.addr.load(Ordering::Relaxed);
        if addr == EAGER {
            let len = sink.len();
            if len > EAGER_BYTES {
                return Err(CommError::Malformed { rank: job_rank, reason: format!("eager message of {len} bytes") });
            }
            // SAFETY: the sender wrote `len` bytes there before posting, and leaves the buffer
            // alone until this message is counted consumed.
            let bytes = unsafe { std::slice::from_raw_parts(mailbox.eager_buffer(consumed as usize), len) };
            sink.deliver(0, bytes);
            bump_and_wake(&mailbox.consumed, &mailbox.sender_sleeping);
            return Ok(());
        }
        match &mut sink {
            Sink::Copy(into) => read_from(pid, addr, into, job_rank)?,
            Sink::Reduce { into, .. } => {
                let len = into.len();
                self.scratch.resize(REDUCE_PIECE_BYTES.min(len), 0);
                for start in (0..len).step_by(REDUCE_PIECE_BYTES) {
                    let piece = &mut self.scratch[..REDUCE_PIECE_BYTES.min(len - start)];
                    read_from(pid, addr + start as u64, piece, job_rank)?;
                    sink.deliver(start, piece);
                }
            }
        }
        bump_and_wake(&mailbox.consumed, &mailbox.sender_sleeping);
        Ok(())
    }

    /// Posted messages point into this process, which only peers read: nothing here to stop.
    fn close(&mut self) {}
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn scratch_path(name: &str) -> PathBuf {
        PathBuf::from("/dev/shm").join(format!("medley-test-{}-{name}", std::process::id()))
    }

    #[test]
    fn a_launcher_removes_every_shared_file_of_its_job_and_only_those() {
        let token = format!("token-{}", std::process::id());
        let job = |ns: &str| format!("{}{:08x}", job_prefix(&token, "127.0.0.1:1"), fingerprint(ns) as u32);
        let ours = [inbox_path(&job("world"), 0), inbox_path(&job("world/split0/color1"), 3)];
        let other_job = inbox_path(&format!("{}00000000", job_prefix(&token, "127.0.0.1:2")), 0);
        for path in ours.iter().chain([&other_job]) {
            std::fs::write(path, b"mailbox").unwrap();
        }
        assert_eq!(remove_job_shared_memory(&token, "127.0.0.1:1"), 2);
        assert!(ours.iter().all(|path| !path.exists()));
        assert!(other_job.exists(), "another job's file was removed");
        std::fs::remove_file(other_job).unwrap();
    }

    #[test]
    fn shared_files_are_this_users_alone_and_a_planted_link_is_never_followed() {
        let target = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(target.path(), b"precious").unwrap();
        let path = scratch_path("planted");
        std::os::unix::fs::symlink(target.path(), &path).unwrap();
        // Opening a peer's file refuses a link; creating replaces the link, not its target.
        assert!(map_shared(&path, 4096, false).is_err());
        let map = map_shared(&path, 4096, true).unwrap();
        assert_eq!(std::fs::read(target.path()).unwrap(), b"precious");
        let metadata = std::fs::symlink_metadata(&path).unwrap();
        assert!(metadata.is_file() && metadata.len() == 4096);
        assert_eq!(metadata.permissions().mode() & 0o777, 0o600);
        drop(map);
        std::fs::remove_file(&path).unwrap();
    }
}
