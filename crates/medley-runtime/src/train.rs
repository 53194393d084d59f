//! The training loop around [`Worker::step`]: the schedule of each step (fixed, or adaptive kFkB
//! from the same schedule the simulator runs), checkpoints, and a callback per step.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use medley_plan::max_k_within_memory;
use medley_schedule::{ProgramsByKind, ScheduleKind, StepSchedules};
use medley_spec::Schedule;
use medley_trace::Timeline;

use crate::{RuntimeError, StepMetrics, Worker};

/// How long to train and what to keep.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Train until this many steps are done (counting steps before a resume).
    pub until_step: u64,
    pub schedule: Schedule,
    /// Where checkpoints go; none keeps none.
    pub checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints (0: only after the last step).
    pub checkpoint_every: u64,
    /// How many of the newest complete checkpoints to keep (at least one is always kept).
    pub keep_checkpoints: usize,
    /// Stop early, at the end of a step, when asked (a signal).
    pub stop: Option<StopRequest>,
}

/// A way to ask a run to stop before `until_step`: any rank's flag stops every rank at the end
/// of the same step (the flag travels with the step's metrics).
#[derive(Clone, Debug, Default)]
pub struct StopRequest {
    /// Set to ask; a signal handler may set it.
    pub requested: Arc<AtomicBool>,
    /// Write a checkpoint of the step the run stops at (if a checkpoint directory is given).
    pub checkpoint: bool,
}

/// How a call of [`Worker::train`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrainEnd {
    /// `until_step` reached.
    Finished,
    /// Asked to stop (every rank at this step); `checkpointed`: a checkpoint of it was written.
    Stopped { step: u64, checkpointed: bool },
}

impl Worker {
    /// Trains until `options.until_step`, calling `on_step` with every step's metrics (the same on
    /// every rank). Every rank must call it with the same options.
    pub fn train(
        &mut self,
        options: &TrainOptions,
        mut timeline: Option<&mut Timeline>,
        mut on_step: impl FnMut(&StepMetrics) -> Result<(), RuntimeError>,
    ) -> Result<TrainEnd, RuntimeError> {
        if options.schedule == Schedule::Fixed(ScheduleKind::ZbH1) {
            return Err(RuntimeError::zero_bubble());
        }
        // Paths may differ between hosts; whether checkpoints are written may not (every rank
        // takes part in each).
        let stop_and_checkpoints = format!(
            "{} {} {} {} {}",
            options.until_step,
            options.checkpoint_every,
            options.keep_checkpoints,
            options.checkpoint_dir.is_some(),
            options.stop.as_ref().is_some_and(|stop| stop.checkpoint)
        );
        self.stop_requested = options.stop.as_ref().map(|stop| Arc::clone(&stop.requested));
        crate::worker::check_same_job(
            &mut self.world,
            &[
                ("--schedule", options.schedule.to_string()),
                ("--steps or checkpoint options", stop_and_checkpoints),
                ("step to resume from (--resume)", self.step.to_string()),
            ],
        )?;
        let k_max = max_k_within_memory(&self.plan, &self.options.calibration);
        let mut schedules = StepSchedules::new(options.schedule, k_max);
        let mut by_kind = ProgramsByKind::default();
        while self.step < options.until_step {
            let kind = schedules.next();
            let programs = by_kind.get(&self.plan, kind)?;
            let metrics = self.step(programs, timeline.as_deref_mut())?;
            schedules.observe(kind, metrics.step_time_s, metrics.pipeline_wait_fraction);
            on_step(&metrics)?;
            // Every rank sees the same gathered loss, so all stop together.
            if !metrics.loss.is_finite() {
                return Err(RuntimeError::Diverged { step: self.step, what: format!("the loss is {}", metrics.loss) });
            }
            let due = options.checkpoint_every > 0 && self.step.is_multiple_of(options.checkpoint_every);
            let stopping = self.stop_agreed;
            let checkpoint_on_stop = stopping && options.stop.as_ref().is_some_and(|stop| stop.checkpoint);
            let mut checkpointed = false;
            if let Some(dir) = &options.checkpoint_dir
                && (due || self.step == options.until_step || checkpoint_on_stop)
            {
                if !self.weights_are_finite()? {
                    let what = "a weight is not finite after the optimizer step".into();
                    return Err(RuntimeError::Diverged { step: self.step, what });
                }
                self.save_checkpoint(dir, options.keep_checkpoints)?;
                checkpointed = true;
            }
            if stopping && self.step < options.until_step {
                return Ok(TrainEnd::Stopped { step: self.step, checkpointed });
            }
        }
        Ok(TrainEnd::Finished)
    }
}
