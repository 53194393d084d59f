//! Windows: a region of shared memory per rank that every rank of the communicator maps, for
//! the collectives whose plans read peers' memory directly (see [`medley_collective::step`]).
//!
//! A window file starts with a page holding the owner's fence counter; its data follows. A fence
//! bumps the rank's own counter and waits for every peer's to reach it, so it is a barrier of
//! one store and n−1 loads when every rank is there.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use memmap2::{MmapMut, MmapRaw};

use super::shm::{bump_and_wake, map_shared, reached, wait_on};
use crate::CommError;
use crate::wait::Waiter;

/// Data bytes per window: two segments of the communicator's window plans.
pub(crate) const WINDOW_BYTES: usize = 2 * medley_collective::WINDOW_SEGMENT_BYTES;
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
pub(crate) fn create(path: &Path) -> Result<MmapRaw, CommError> {
    map_shared(path, DATA_OFFSET + WINDOW_BYTES, true)
}

/// Maps a peer's window file.
pub(crate) fn open(path: &Path) -> Result<MmapRaw, CommError> {
    map_shared(path, DATA_OFFSET + WINDOW_BYTES, false)
}

/// Every rank's window, mapped into this rank.
pub(crate) struct Windows {
    /// By communicator rank, this rank's own included.
    maps: Vec<MmapRaw>,
    job_ranks: Vec<usize>,
    rank: usize,
}

impl Windows {
    pub fn new(rank: usize, maps: Vec<MmapRaw>, job_ranks: Vec<usize>) -> Windows {
        Windows { maps, job_ranks, rank }
    }

    /// The window of a communicator of one rank, which no other process maps.
    pub fn alone(job_rank: usize) -> Result<Windows, CommError> {
        let map =
            MmapMut::map_anon(DATA_OFFSET + WINDOW_BYTES).map_err(|err| CommError::io("mapping a window", &err))?;
        Ok(Windows::new(0, vec![MmapRaw::from(map)], vec![job_rank]))
    }

    pub fn n_ranks(&self) -> usize {
        self.maps.len()
    }

    fn header(&self, owner: usize) -> &Header {
        // SAFETY: every mapping is page-aligned and longer than a header, zero-filled when created
        // (all-zero atomics are valid), and lives as long as `self`.
        unsafe { &*(self.maps[owner].as_ptr() as *const Header) }
    }

    /// `owner`'s data bytes in `range`, for reading. Only a window's owner writes it; which bytes
    /// a reader may read when is the plan's rule (see [`medley_collective::step`]).
    ///
    /// # Safety
    /// No rank may write these bytes until the returned slice is dropped: the plan's fences
    /// must order the owner's writes of `range` before this read and its next ones after.
    pub unsafe fn read(&self, owner: usize, range: Range<usize>) -> &[u8] {
        let start = self.data(owner, &range);
        // SAFETY: `data` checked that the range lies in `owner`'s mapping, which lives as long
        // as `self`; the caller guarantees that nobody writes it meanwhile.
        unsafe { std::slice::from_raw_parts(start, range.len()) }
    }

    /// Writes `bytes` into this rank's own window at `at`.
    ///
    /// # Safety
    /// No peer may read these bytes meanwhile: the plan's fences must order its reads of them
    /// before this write or after the next fence.
    pub unsafe fn write(&self, at: usize, bytes: &[u8]) {
        let start = self.data(self.rank, &(at..at + bytes.len()));
        // SAFETY: `data` checked the bounds; the pointer comes from the raw mapping, which
        // grants writes through a shared borrow, and `bytes` is this process's own memory, not
        // the window, so the two do not overlap. Nobody reads the range meanwhile (the caller).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), start, bytes.len()) }
    }

    /// The address of `range` in `owner`'s data, which it must lie in.
    fn data(&self, owner: usize, range: &Range<usize>) -> *mut u8 {
        assert!(range.start <= range.end && range.end <= WINDOW_BYTES, "window range {range:?} outside its data");
        // SAFETY: DATA_OFFSET + range.start lies within the mapping, DATA_OFFSET + WINDOW_BYTES long.
        unsafe { self.maps[owner].as_mut_ptr().add(DATA_OFFSET + range.start) }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_reads_back_what_its_owner_wrote() {
        let windows = Windows::alone(0).unwrap();
        // SAFETY: no other process maps a lone rank's window.
        unsafe { windows.write(WINDOW_BYTES - 3, &[7, 8, 9]) };
        // SAFETY: as above.
        assert_eq!(unsafe { windows.read(0, WINDOW_BYTES - 3..WINDOW_BYTES) }, [7, 8, 9]);
    }

    #[test]
    #[should_panic(expected = "outside its data")]
    fn a_write_past_the_window_is_refused() {
        let windows = Windows::alone(0).unwrap();
        // SAFETY: no other process maps a lone rank's window; the write must not happen.
        unsafe { windows.write(WINDOW_BYTES - 2, &[1, 2, 3]) };
    }
}
