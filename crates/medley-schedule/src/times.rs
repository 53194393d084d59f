//! Where one rank's step went, in the words both engines use: the simulator's report, the
//! runtime's `metrics.jsonl` and every `--json`. The four parts add up to the step.

use serde::{Deserialize, Serialize};

/// One rank's step, split by what the rank was doing under the execution rules of this crate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankTimes {
    /// Running its own instructions: forward, backward and optimizer passes (the runtime's
    /// include the bookkeeping around them).
    pub compute_s: f64,
    /// Blocked on data already on its way: a pipeline message its peer had sent, its own sends
    /// draining, a gradient all-reduce once every member has arrived.
    pub comm_wait_s: f64,
    /// Blocked on a peer that had not sent yet, or on all-reduce members still to arrive:
    /// pipeline bubbles, imbalance, stragglers.
    pub peer_wait_s: f64,
    /// Done with the step, until its slowest rank was.
    pub idle_s: f64,
}

impl RankTimes {
    /// The whole step, as the four parts add up to it.
    pub fn step_s(&self) -> f64 {
        self.compute_s + self.comm_wait_s + self.peer_wait_s + self.idle_s
    }
}
