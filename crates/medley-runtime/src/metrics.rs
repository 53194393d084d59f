//! What a step measured: per rank, and for the job.

use medley_schedule::ScheduleKind;
use serde::Serialize;

use crate::RankLayout;

/// Where one rank's step time went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct RankTimes {
    /// Forward, backward and optimizer passes (stretched to the emulated device's speed).
    pub compute_s: f64,
    /// Gradient all-reduces and waiting for the step's sends to be delivered.
    pub comm_s: f64,
    /// Blocked on pipeline receives: bubbles and transfers.
    pub idle_s: f64,
    /// The part of `idle_s` spent on messages the peer had already posted: transfer stalls.
    pub transfer_wait_s: f64,
    /// From the step's first instruction to the end of the optimizer step.
    pub busy_s: f64,
}

impl RankTimes {
    /// The times and the rank's summed loss as words for an all-gather.
    pub(crate) fn to_words(self, loss_sum: f64) -> [f64; 6] {
        [self.compute_s, self.comm_s, self.idle_s, self.transfer_wait_s, self.busy_s, loss_sum]
    }

    pub(crate) fn from_words(words: &[f64]) -> (RankTimes, f64) {
        let times = RankTimes {
            compute_s: words[0],
            comm_s: words[1],
            idle_s: words[2],
            transfer_wait_s: words[3],
            busy_s: words[4],
        };
        (times, words[5])
    }
}

/// One rank's line in a step's metrics.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankMetrics {
    pub rank: usize,
    /// The pipeline rank, e.g. `r1s0`.
    pub id: String,
    /// The emulated device.
    pub device: String,
    #[serde(flatten)]
    pub times: RankTimes,
}

impl RankMetrics {
    pub(crate) fn new(layout: &RankLayout, times: &RankTimes) -> RankMetrics {
        RankMetrics {
            rank: layout.job_rank,
            id: layout.id.to_string(),
            device: layout.device.name.clone(),
            times: *times,
        }
    }
}

/// One training step of the job, as `metrics.jsonl` records it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepMetrics {
    /// Steps completed, counting this one.
    pub step: u64,
    /// Mean next-token loss over the global batch.
    pub loss: f64,
    pub tokens_per_s: f64,
    /// The slowest rank's step.
    pub step_time_s: f64,
    pub schedule: String,
    /// Share of the step the average rank stalled on transfers already posted (what adaptive
    /// kFkB reacts to).
    pub pipeline_wait_fraction: f64,
    pub ranks: Vec<RankMetrics>,
}

impl StepMetrics {
    pub(crate) fn new(
        step: u64,
        loss: f64,
        tokens: u64,
        schedule: ScheduleKind,
        ranks: Vec<RankMetrics>,
    ) -> StepMetrics {
        let step_time_s = ranks.iter().map(|rank| rank.times.busy_s).fold(0.0, f64::max);
        let stalls: f64 = ranks.iter().map(|rank| rank.times.transfer_wait_s).sum();
        let pipeline_wait_fraction = if step_time_s > 0.0 { stalls / ranks.len() as f64 / step_time_s } else { 0.0 };
        StepMetrics {
            step,
            loss,
            tokens_per_s: tokens as f64 / step_time_s,
            step_time_s,
            schedule: schedule.to_string(),
            pipeline_wait_fraction,
            ranks,
        }
    }
}
