//! Waiting without hanging: poll for a while (spinning on a core of one's own, yielding on a
//! shared one), then block in short slices, checking the job's abort flag and the timeout between
//! slices. Every blocking wait in the crate goes through here.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::CommError;

/// How long one blocking slice lasts: the longest an abort goes unnoticed by a waiting rank.
const SLICE: Duration = Duration::from_millis(2);
/// Polls before yielding, on a shared core. A shared-memory round trip takes well under a
/// microsecond when the peer is running, but when ranks share cores (4 on 2, or 2 unbound ones
/// the scheduler put on one) the peer is often waiting for this very core, and every poll spent
/// spinning delays it: measured there, a 4 KiB all-reduce of 2 processes took 4–8 µs yielding
/// at once, 7–14 µs after 10 polls, 13–17 µs after 200 and 70–76 µs after 2000. A handful of
/// polls (well under a microsecond) still catch a peer that has already answered.
///
/// A rank bound to a core of its own ([`crate::CpuBinding`]) spins instead, as MPI libraries do:
/// there a yield hands the core for a whole time slice to any other runnable process, while the
/// peer waits. With a busy loop running beside 2 bound ranks on 2 cores, a 4 KiB all-reduce took
/// 1.0–2.4 µs spinning and 2 ms yielding (1.0–1.2 µs both, without it).
const SPINS: u32 = 4;
/// How long to keep polling before blocking.
const POLL_FOR: Duration = Duration::from_micros(50);
/// Spinning polls between clock reads.
const SPINS_PER_CLOCK: u32 = 64;

/// The first failure anyone in the job reported, shared by every communicator of one rank.
#[derive(Debug, Default)]
pub(crate) struct Abort {
    raised: AtomicBool,
    cause: OnceLock<CommError>,
}

impl Abort {
    /// Records `cause` unless a failure was already recorded; returns the recorded one.
    pub fn raise(&self, cause: CommError) -> CommError {
        let kept = self.cause.get_or_init(|| cause).clone();
        self.raised.store(true, Ordering::Release);
        kept
    }

    pub fn check(&self) -> Result<(), CommError> {
        if self.raised.load(Ordering::Acquire) {
            return Err(self.cause.get().expect("raised after set").clone());
        }
        Ok(())
    }
}

/// Finds whom to blame when a wait times out: the peer waited on may itself be waiting on
/// another rank, and the rank at the end of that chain is the one that stopped answering.
pub(crate) trait Blame: Send + Sync {
    /// Records that this rank has been waiting long on job rank `peer` (`None`: no longer).
    fn waiting_on(&self, peer: Option<usize>);
    /// The end of the chain of long waits that starts at job rank `peer`.
    fn culprit(&self, peer: usize) -> usize;
}

/// What every wait needs: the timeout without progress, the job's abort flag and, in a job, the
/// chain of waits to blame the right rank.
#[derive(Clone)]
pub(crate) struct Waiter {
    pub timeout: Duration,
    pub abort: Arc<Abort>,
    pub blame: Option<Arc<dyn Blame>>,
    /// Whether this rank has a core of its own: then it spins while it polls (see [`SPINS`]).
    pub own_core: bool,
}

impl Waiter {
    /// Calls `poll` until it yields a value. `poll(None)` must not block; `poll(Some(slice))` may
    /// block up to `slice`. Fails with the job's abort cause, or with a timeout blaming `rank` once
    /// `timeout` passes.
    pub fn wait<T>(
        &self,
        rank: usize,
        what: &'static str,
        mut poll: impl FnMut(Option<Duration>) -> Result<Option<T>, CommError>,
    ) -> Result<T, CommError> {
        // A wait that is over at once (the usual one in a small collective) reads no clock.
        if let Some(value) = poll(None)? {
            return Ok(value);
        }
        let start = Instant::now();
        let mut spins: u32 = 0;
        loop {
            if let Some(value) = poll(None)? {
                return Ok(value);
            }
            self.abort.check()?;
            if self.own_core {
                spins = spins.wrapping_add(1);
                std::hint::spin_loop();
                if spins.is_multiple_of(SPINS_PER_CLOCK) && start.elapsed() >= POLL_FOR {
                    break;
                }
            } else if spins < SPINS {
                spins += 1;
                std::hint::spin_loop();
            } else if start.elapsed() < POLL_FOR {
                std::thread::yield_now();
            } else {
                break;
            }
        }
        let mut posted = false;
        let result = loop {
            match poll(Some(SLICE)) {
                Ok(Some(value)) => break Ok(value),
                Err(err) => break Err(err),
                Ok(None) => {}
            }
            if let Err(err) = self.abort.check() {
                break Err(err);
            }
            let waited = start.elapsed();
            // Posted early enough that every rank along a chain of waits has posted by the time
            // the first of them times out.
            if let (Some(blame), false) = (&self.blame, posted)
                && waited >= self.timeout / 4
            {
                blame.waiting_on(Some(rank));
                posted = true;
            }
            if waited >= self.timeout {
                let rank = self.blame.as_ref().map_or(rank, |blame| blame.culprit(rank));
                break Err(CommError::Timeout { rank, waited, what });
            }
        };
        // After a failure the entry stays: ranks still waiting along the chain read it.
        if let (Some(blame), true, true) = (&self.blame, posted, result.is_ok()) {
            blame.waiting_on(None);
        }
        result
    }
}

/// Blocks while `*word == expected`, at most `timeout`. The word may be in memory shared between
/// processes, so the futex is not private.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let spec = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: `word` is a live, aligned u32; the kernel only reads it and the timespec.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &spec as *const libc::timespec);
    }
}

/// Wakes every waiter blocked on `word`.
pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned u32; FUTEX_WAKE does not access memory through it.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_ends_with_a_timeout_naming_the_rank_or_with_the_abort() {
        let waiter = Waiter { timeout: Duration::from_millis(20), abort: Arc::default(), blame: None, own_core: false };
        let err = waiter.wait(3, "a test", |_| Ok(None::<()>)).unwrap_err();
        assert!(matches!(err, CommError::Timeout { rank: 3, .. }), "{err}");
        waiter.abort.raise(CommError::PeerGone { rank: 5, what: "gone".into() });
        waiter.abort.raise(CommError::PeerGone { rank: 6, what: "later".into() });
        let err = waiter.wait(3, "a test", |_| Ok(None::<()>)).unwrap_err();
        assert_eq!(err.blamed_rank(), Some(5));
    }
}

/// How long a communicator's ranks have to join it, all waits together: every wait of the join
/// ends by `deadline` and names the rank it waited on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct JoinBudget {
    pub deadline: Instant,
    pub total: Duration,
}

impl JoinBudget {
    pub fn from_now(total: Duration) -> JoinBudget {
        JoinBudget { deadline: Instant::now() + total, total }
    }

    /// What is left of it, at least a millisecond (a socket refuses a zero timeout).
    pub fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
    }

    pub fn timeout(&self, rank: usize, what: &'static str) -> CommError {
        CommError::Timeout { rank, waited: self.total, what }
    }
}
