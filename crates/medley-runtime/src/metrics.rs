//! What a step measured: per rank, and for the job.

use medley_schedule::{RankTimes, ScheduleKind};
use serde::Serialize;

use crate::RankLayout;

/// What a rank clocks during a step; [`StepMetrics`] turns every rank's into [`RankTimes`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct StepClock {
    /// Pipeline receives of messages the peer had already posted.
    pub transfer_wait_s: f64,
    /// Gradient all-reduces and waiting for the step's sends to be delivered.
    pub collective_s: f64,
    /// Pipeline receives before the peer had posted: bubbles.
    pub peer_wait_s: f64,
    /// From the step's first instruction to the end of the optimizer step.
    pub busy_s: f64,
}

impl StepClock {
    /// The clock and the rank's summed loss as words for an all-gather.
    pub(crate) fn to_words(self, loss_sum: f64) -> [f64; 5] {
        [self.transfer_wait_s, self.collective_s, self.peer_wait_s, self.busy_s, loss_sum]
    }

    pub(crate) fn from_words(words: &[f64]) -> (StepClock, f64) {
        let clock =
            StepClock { transfer_wait_s: words[0], collective_s: words[1], peer_wait_s: words[2], busy_s: words[3] };
        (clock, words[4])
    }

    /// The rank's times in a step whose slowest rank took `step_s`.
    fn times(&self, step_s: f64) -> RankTimes {
        let comm_wait_s = self.transfer_wait_s + self.collective_s;
        RankTimes {
            compute_s: (self.busy_s - comm_wait_s - self.peer_wait_s).max(0.0),
            comm_wait_s,
            peer_wait_s: self.peer_wait_s,
            idle_s: step_s - self.busy_s,
        }
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
    fn new(layout: &RankLayout, times: RankTimes) -> RankMetrics {
        RankMetrics { rank: layout.job_rank, id: layout.id.to_string(), device: layout.device.name.clone(), times }
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
    /// The step's metrics from every rank's clock and layout, in rank order.
    pub(crate) fn new(
        step: u64,
        loss: f64,
        tokens: u64,
        schedule: ScheduleKind,
        clocks: &[StepClock],
        layouts: &[RankLayout],
    ) -> StepMetrics {
        let step_time_s = clocks.iter().map(|clock| clock.busy_s).fold(0.0, f64::max);
        let stalls: f64 = clocks.iter().map(|clock| clock.transfer_wait_s).sum();
        let pipeline_wait_fraction = if step_time_s > 0.0 { stalls / clocks.len() as f64 / step_time_s } else { 0.0 };
        let ranks = clocks
            .iter()
            .zip(layouts)
            .map(|(clock, layout)| RankMetrics::new(layout, clock.times(step_time_s)))
            .collect();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ranks_times_add_up_to_the_slowest_ranks_step() {
        let clock = StepClock { transfer_wait_s: 0.5, collective_s: 1.0, peer_wait_s: 2.0, busy_s: 6.0 };
        let times = clock.times(8.0);
        assert_eq!(times, RankTimes { compute_s: 2.5, comm_wait_s: 1.5, peer_wait_s: 2.0, idle_s: 2.0 });
        assert_eq!(times.step_s(), 8.0);
        let (back, loss) = StepClock::from_words(&clock.to_words(3.0));
        assert_eq!((back, loss), (clock, 3.0));
    }
}
