//! What a step measured: per rank, and for the job.

use medley_schedule::{RankTimes, ScheduleKind};
use serde::{Deserialize, Serialize};

use crate::RankLayout;

/// What a rank clocks during a step; [`StepMetrics`] turns every rank's into [`RankTimes`].
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct StepClock {
    /// Pipeline receives of messages the peer had already posted.
    pub transfer_wait_s: f64,
    /// Gradient all-reduces and waiting for the step's sends to be delivered.
    pub collective_s: f64,
    /// Pipeline receives before the peer had posted: bubbles.
    pub peer_wait_s: f64,
    /// From the step's first instruction to the end of the optimizer step.
    pub busy_s: f64,
    /// When the rank reached each DP group's all-reduce, µs of the job clock; NaN for the groups
    /// it is not a member of.
    pub all_reduce_arrivals_us: Vec<f64>,
    /// The rank's process's peak resident memory so far, MiB; NaN where unknown.
    pub peak_memory_mib: f64,
}

impl StepClock {
    /// A clock for a plan of `n_dp_groups` DP groups.
    pub(crate) fn new(n_dp_groups: usize) -> StepClock {
        StepClock {
            all_reduce_arrivals_us: vec![f64::NAN; n_dp_groups],
            peak_memory_mib: f64::NAN,
            ..StepClock::default()
        }
    }

    /// The clock and the rank's summed loss as words for an all-gather: the same count on every
    /// rank of a job.
    pub(crate) fn to_words(&self, loss_sum: f64) -> Vec<f64> {
        let mut words = vec![
            self.transfer_wait_s,
            self.collective_s,
            self.peer_wait_s,
            self.busy_s,
            loss_sum,
            self.peak_memory_mib,
        ];
        words.extend(&self.all_reduce_arrivals_us);
        words
    }

    pub(crate) fn from_words(words: &[f64]) -> (StepClock, f64) {
        let clock = StepClock {
            transfer_wait_s: words[0],
            collective_s: words[1],
            peer_wait_s: words[2],
            busy_s: words[3],
            peak_memory_mib: words[5],
            all_reduce_arrivals_us: words[6..].to_vec(),
        };
        (clock, words[4])
    }

    /// The rank's times in a step whose slowest rank took `step_s`, where `members_late_s` of
    /// its all-reduce time went on waiting for the last member to arrive.
    fn times(&self, step_s: f64, members_late_s: f64) -> RankTimes {
        let members_late_s = members_late_s.min(self.collective_s);
        let comm_wait_s = self.transfer_wait_s + self.collective_s - members_late_s;
        let peer_wait_s = self.peer_wait_s + members_late_s;
        RankTimes {
            compute_s: (self.busy_s - comm_wait_s - peer_wait_s).max(0.0),
            comm_wait_s,
            peer_wait_s,
            idle_s: step_s - self.busy_s,
        }
    }
}

/// Per rank, the seconds its all-reduces waited for their last member to arrive: a member
/// cannot finish before that, so the wait is the straggler's, not the network's.
fn members_late_s(clocks: &[StepClock]) -> Vec<f64> {
    let n_groups = clocks.first().map_or(0, |clock| clock.all_reduce_arrivals_us.len());
    let last: Vec<f64> = (0..n_groups)
        .map(|group| {
            clocks
                .iter()
                .map(|clock| clock.all_reduce_arrivals_us[group])
                .filter(|at| at.is_finite())
                .fold(f64::NAN, f64::max)
        })
        .collect();
    clocks
        .iter()
        .map(|clock| {
            let late_us = clock.all_reduce_arrivals_us.iter().zip(&last).filter(|(at, _)| at.is_finite());
            late_us.map(|(at, last)| (last - at).max(0.0)).sum::<f64>() * 1e-6
        })
        .collect()
}

/// One rank's line in a step's metrics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankMetrics {
    pub rank: usize,
    /// The pipeline rank, e.g. `r1s0`.
    pub id: String,
    /// The emulated device.
    pub device: String,
    #[serde(flatten)]
    pub times: RankTimes,
    /// The worker's process's peak resident memory so far (`VmHWM`), MiB; workers that are
    /// threads of one process report that process's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_memory_mib: Option<f64>,
}

impl RankMetrics {
    fn new(layout: &RankLayout, clock: &StepClock, times: RankTimes) -> RankMetrics {
        RankMetrics {
            rank: layout.job_rank,
            id: layout.id.to_string(),
            device: layout.device.name.clone(),
            times,
            peak_memory_mib: Some(clock.peak_memory_mib).filter(|mib| mib.is_finite()),
        }
    }
}

/// One training step of the job, as `metrics.jsonl` records it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
        let late_s = members_late_s(clocks);
        let ranks = (clocks.iter().zip(&late_s).zip(layouts))
            .map(|((clock, &late_s), layout)| RankMetrics::new(layout, clock, clock.times(step_time_s, late_s)))
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
        let clock =
            StepClock { transfer_wait_s: 0.5, collective_s: 1.0, peer_wait_s: 2.0, busy_s: 6.0, ..StepClock::new(1) };
        let times = clock.times(8.0, 0.25);
        assert_eq!(times, RankTimes { compute_s: 2.5, comm_wait_s: 1.25, peer_wait_s: 2.25, idle_s: 2.0 });
        assert_eq!(times.step_s(), 8.0);
        let (back, loss) = StepClock::from_words(&clock.to_words(3.0));
        assert_eq!(back.busy_s, clock.busy_s);
        assert_eq!(loss, 3.0);
    }

    #[test]
    fn an_all_reduce_waits_for_its_last_member_and_only_members_count() {
        let arrivals = |at: [f64; 2]| StepClock { all_reduce_arrivals_us: at.to_vec(), ..StepClock::new(2) };
        // Group 0: ranks 0 and 1, rank 1 2 ms late; group 1: ranks 1 and 2, rank 1 last.
        let clocks = [arrivals([1_000.0, f64::NAN]), arrivals([3_000.0, 5_000.0]), arrivals([f64::NAN, 4_500.0])];
        assert_eq!(members_late_s(&clocks), [0.002, 0.0, 0.0005]);
    }
}
