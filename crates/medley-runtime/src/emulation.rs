//! How a worker stands in for a slower device: every pass stretched to the device's speed, and a
//! common time dilation that fits the workers' demand for processor time to this machine's cores,
//! and the pacing of passes that communicate.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::metrics::StepClock;

/// Runs a pass at the emulated device's speed: paced around its collectives on a long-context
/// stage (their time counted as the step's collective time), stretched as a whole otherwise.
pub(crate) fn emulated<T>(pacer: Option<&Pacer>, stretch: f64, clock: &mut StepClock, pass: impl FnOnce() -> T) -> T {
    let Some(pacer) = pacer else { return stretched(stretch, pass) };
    pacer.begin_pass();
    let result = pass();
    clock.collective_s += pacer.end_pass();
    result
}

/// The common factor by which an emulated fleet's devices are slowed so that `workers` sharing
/// `cores` keep their promise: when every worker computes at once (a pipeline's steady state, a
/// step's first passes) each gets `cores / workers` of a core, so a pass takes `workers / cores`
/// times its processor time. Every device is that much slower again (the fastest too), and the
/// prediction with it; passes are paced by processor time, so the slowdown is not counted twice.
pub fn time_dilation(workers: usize, cores: usize) -> f64 {
    (workers as f64 / cores.max(1) as f64).max(1.0)
}

/// Runs a pass, stretched to `stretch` times the processor time it took here by sleeping, so a
/// slower device's pass takes as long as it would. Paced by the pass's own processor time rather
/// than its wall time: a pass slowed by workers competing for the cores is not stretched by that
/// slowdown again (the time dilation keeps the emulated time above it).
pub(crate) fn stretched<T>(stretch: f64, pass: impl FnOnce() -> T) -> T {
    let since = computing_since();
    let result = pass();
    stretch_since(since, stretch);
    result
}

/// Now on the wall clock and on the calling thread's processor clock: where computing starts.
pub(crate) fn computing_since() -> (Instant, Duration) {
    (Instant::now(), cpu_time::ThreadTime::now().as_duration())
}

/// Sleeps until the computing on this thread since `since` has lasted `stretch` times the
/// processor time it took.
pub(crate) fn stretch_since((wall, processor): (Instant, Duration), stretch: f64) {
    let computed = cpu_time::ThreadTime::now().as_duration().saturating_sub(processor);
    if stretch > 1.0
        && let Some(left) = computed.mul_f64(stretch).checked_sub(wall.elapsed())
    {
        std::thread::sleep(left);
    }
}

/// Emulates a slower device inside passes that communicate: each stretch of computing is
/// followed, before the collective that ends it, by a sleep that makes it last `stretch` times
/// the processor time it took, so peers wait for the slow device where they would (stretching
/// the whole pass afterwards would stretch the waits on its peers too). Paced by processor time,
/// as [`crate::emulation`] paces whole passes: computing slowed by workers competing for the
/// cores is not stretched by that slowdown again. Shared by the worker, which marks passes, and
/// its collectives, all on the thread that computes.
#[derive(Clone, Debug)]
pub(crate) struct Pacer(Arc<Mutex<PacerState>>);

#[derive(Debug)]
struct PacerState {
    stretch: f64,
    /// When the current stretch of computing began: the wall clock and the thread's processor
    /// time.
    computing_since: Option<(Instant, Duration)>,
    /// Seconds in collectives since the pass began.
    collective_s: f64,
}

impl Pacer {
    pub fn new(stretch: f64) -> Pacer {
        Pacer(Arc::new(Mutex::new(PacerState { stretch, computing_since: None, collective_s: 0.0 })))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PacerState> {
        // A panic elsewhere cannot leave the state inconsistent: every field is whole.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn begin_pass(&self) {
        let mut state = self.state();
        state.computing_since = Some(computing_since());
        state.collective_s = 0.0;
    }

    /// Ends a stretch of computing: sleeps for the slower device's extra time.
    fn pause(&self) {
        let (stretch, since) = {
            let mut state = self.state();
            (state.stretch, state.computing_since.take())
        };
        if let Some(since) = since {
            stretch_since(since, stretch);
        }
    }

    /// Starts computing again after a collective that began at `started`.
    fn resume(&self, started: Instant) {
        let mut state = self.state();
        state.collective_s += started.elapsed().as_secs_f64();
        state.computing_since = Some(computing_since());
    }

    /// Ends a pass; the seconds it spent in collectives.
    pub fn end_pass(&self) -> f64 {
        self.pause();
        std::mem::take(&mut self.state().collective_s)
    }

    /// Runs `collective` as a pause in computing.
    pub fn around<T>(&self, collective: impl FnOnce() -> T) -> T {
        self.pause();
        let started = Instant::now();
        let result = collective();
        self.resume(started);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dilation_fits_the_workers_to_the_cores() {
        assert_eq!(time_dilation(4, 2), 2.0);
        assert_eq!(time_dilation(2, 2), 1.0, "workers that fit are not slowed");
        assert_eq!(time_dilation(6, 2), 3.0);
        assert_eq!(time_dilation(1, 16), 1.0);
    }
}
