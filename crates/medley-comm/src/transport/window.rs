//! Windows: a region of shared memory per rank that every rank of the communicator maps, for
//! the collectives whose plans read peers' memory directly (see [`medley_collective::step`]).
//!
//! A window file starts with a page holding the owner's fence counter; its data follows. A fence
//! bumps the rank's own counter and waits for every peer's to reach it, so it is a barrier of
//! one store and n−1 loads when every rank is there.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use memmap2::MmapMut;

use super::shm::{bump_and_wake, map_shared, reached, wait_on};
use crate::CommError;
use crate::wait::Waiter;

/// Data bytes per window: two segments of the communicator's window plans.
pub(crate) const WINDOW_BYTES: usize = 1 << 20;
/// Where the data starts: the fence counter has the first page to itself.
const DATA_OFFSET: usize = 4096;

#[repr(C)]
struct Header {
    fences: AtomicU32,
    /// Peers asleep on `fences`: the owner wakes them when it passes a fence.
    sleepers: AtomicU32,
}

/// Where a rank's window lives.
pub(crate) fn window_path(job: &str, rank: usize) -> PathBuf {
    PathBuf::from("/dev/shm").join(format!("medley-{job}-{rank}-window"))
}

/// Creates this rank's window file (or replaces a stale one).
pub(crate) fn create(path: &Path) -> Result<MmapMut, CommError> {
    map_shared(path, DATA_OFFSET + WINDOW_BYTES, true)
}

/// Maps a peer's window file.
pub(crate) fn open(path: &Path) -> Result<MmapMut, CommError> {
    map_shared(path, DATA_OFFSET + WINDOW_BYTES, false)
}

/// Every rank's window, mapped into this rank.
pub(crate) struct Windows {
    /// By communicator rank, this rank's own included.
    maps: Vec<MmapMut>,
    job_ranks: Vec<usize>,
    rank: usize,
}

impl Windows {
    pub fn new(rank: usize, maps: Vec<MmapMut>, job_ranks: Vec<usize>) -> Windows {
        Windows { maps, job_ranks, rank }
    }

    /// The window of a communicator of one rank, which no other process maps.
    pub fn alone(job_rank: usize) -> Result<Windows, CommError> {
        let map =
            MmapMut::map_anon(DATA_OFFSET + WINDOW_BYTES).map_err(|err| CommError::io("mapping a window", &err))?;
        Ok(Windows::new(0, vec![map], vec![job_rank]))
    }

    pub fn n_ranks(&self) -> usize {
        self.maps.len()
    }

    fn header(&self, owner: usize) -> &Header {
        // SAFETY: every mapping is page-aligned and longer than a header, zero-filled when created
        // (all-zero atomics are valid), and lives as long as `self`.
        unsafe { &*(self.maps[owner].as_ptr() as *const Header) }
    }

    /// The start of `owner`'s data, [`WINDOW_BYTES`] long. Only its owner writes it, and readers
    /// read only what a fence has handed them (the plan's rules).
    pub fn data(&self, owner: usize) -> *mut u8 {
        // SAFETY (of the arithmetic): the mapping is DATA_OFFSET + WINDOW_BYTES long.
        unsafe { self.maps[owner].as_ptr().add(DATA_OFFSET).cast_mut() }
    }

    /// Passes this rank's next fence: waits until every peer has reached it too.
    pub fn fence(&self, waiter: &Waiter) -> Result<(), CommError> {
        let own = self.header(self.rank);
        // Only this rank writes its counter, so its next value is the fence to pass.
        let target = own.fences.load(Ordering::Relaxed).wrapping_add(1);
        bump_and_wake(&own.fences, &own.sleepers);
        for peer in (0..self.maps.len()).filter(|&peer| peer != self.rank) {
            let header = self.header(peer);
            wait_on(waiter, self.job_ranks[peer], "a window fence", &header.fences, &header.sleepers, || {
                reached(header.fences.load(Ordering::Acquire), target)
            })?;
        }
        Ok(())
    }
}
