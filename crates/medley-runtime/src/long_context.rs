//! A long-context stage's collectives over the job's communicators: the head group's
//! all-to-all-v and the lane's ring all-gather-v and reduce-scatter-v, each with the operation
//! and algorithm `medley_schedule::long_context_layer` gives it, whose step lists the simulator
//! prices; and the pacing that emulates a slower device inside such a pass.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use medley_comm::{CommError, Communicator, Counts};
use medley_model::ModelError;
use medley_model::long_context::ContextCollectives;
use medley_schedule::long_context_layer::LayerCollective;

use crate::emulation::{computing_since, stretch_since};

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

/// One worker's two communicators of its long-context stage.
pub(crate) struct CommCollectives {
    /// The devices of this worker's head-parallel group, in member order.
    pub group: Communicator,
    /// The devices holding this worker's heads in every group, in group order.
    pub lane: Communicator,
    pub pacer: Pacer,
    /// Bytes both communicators have sent, for the worker to report.
    pub sent: Arc<AtomicU64>,
}

impl CommCollectives {
    /// Runs `collective` over its communicator, as a pause in computing.
    fn run(
        &mut self,
        collective: LayerCollective,
        counts: Counts,
        input: &[f32],
        output: &mut [f32],
    ) -> Result<(), CommError> {
        let communicator = match collective {
            LayerCollective::GroupAllToAll => &mut self.group,
            LayerCollective::LaneAllGather | LayerCollective::LaneReduceScatter => &mut self.lane,
        };
        let (op, algorithm) = (collective.op(), collective.algorithm());
        let result = self.pacer.around(|| communicator.collective(op, &counts, Some(algorithm), input, output));
        self.count_sent();
        result
    }

    fn count_sent(&self) {
        self.sent.store(self.group.bytes_sent() + self.lane.bytes_sent(), Ordering::Relaxed);
    }
}

fn failed(what: &'static str) -> impl FnOnce(CommError) -> ModelError {
    move |error| ModelError::Collective { what: what.into(), source: Box::new(error) }
}

impl ContextCollectives for CommCollectives {
    fn group_all_to_all(&mut self, input: &[f32], counts: &[Vec<usize>]) -> Result<Vec<f32>, ModelError> {
        let me = self.group.rank();
        let mut output = vec![0f32; counts.iter().map(|row| row[me]).sum()];
        let counts = Counts::PerPair(counts.to_vec());
        self.run(LayerCollective::GroupAllToAll, counts, input, &mut output)
            .map_err(failed("the head group's all-to-all"))?;
        Ok(output)
    }

    fn lane_all_gather(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError> {
        let mut output = vec![0f32; counts.iter().sum()];
        self.run(LayerCollective::LaneAllGather, Counts::PerRank(counts.to_vec()), input, &mut output)
            .map_err(failed("the lane's all-gather of keys and values"))?;
        Ok(output)
    }

    fn lane_reduce_scatter(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError> {
        let mut output = vec![0f32; counts[self.lane.rank()]];
        self.run(LayerCollective::LaneReduceScatter, Counts::PerRank(counts.to_vec()), input, &mut output)
            .map_err(failed("the lane's reduce-scatter of the keys' and values' gradients"))?;
        Ok(output)
    }
}
