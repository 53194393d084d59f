//! Pipeline schedules: the fixed orders a pipeline can run ([`ScheduleKind`]) and what a user asks
//! for ([`Schedule`]): one of them, or Ada-Grouper's adaptive choice between kFkB orders.

use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::echo;

/// A fixed order of one pipeline rank's forward and backward passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (Huang et al. 2019, arXiv 1811.06965): every
    /// micro-batch's activations are live at once.
    Gpipe,
    /// PipeDream-Flush (Narayanan et al. 2021, arXiv 2006.09503): warm-up forwards, then one
    /// forward and one backward alternately; stage i of p keeps at most p − i micro-batches.
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over groups of `k` micro-batches (Ada-Grouper, Wang et al. 2023, arXiv 2303.01675):
    /// fewer, larger communication windows at the price of `k` times the in-flight activations.
    /// `k = 1` is 1F1B.
    Kfkb { k: NonZeroU32 },
    /// ZB-H1 (Qi et al. 2023, arXiv 2401.10241, section 2.1): 1F1B's order of forwards and
    /// input-gradient passes, with weight-gradient passes deferred so that every stage keeps as
    /// many micro-batches in flight as 1F1B's first stage, and the deferred ones fill the
    /// cool-down bubble.
    ZbH1,
    /// Interleaved 1F1B (Narayanan et al. SC'21, arXiv 2104.04473) over the plan's
    /// `virtual_stages` chunks per rank, in Megatron-LM's order. Only for plans with more than
    /// one chunk per rank; every other kind needs exactly one.
    Interleaved,
}

impl ScheduleKind {
    /// Chunk-micro-batches (one micro-batch on one model chunk) whose activations rank `rank_idx`
    /// of `n_ranks`, holding `n_chunks` chunks, keeps at its peak with `m` micro-batches per step:
    /// forwarded and not yet through their whole backward (for a split backward, its
    /// weight-gradient half). With one chunk per rank that is micro-batches. The one in-flight
    /// rule the cost model, the planner and the schedule checker share.
    pub fn in_flight(self, rank_idx: usize, n_ranks: usize, n_chunks: u32, m: u32) -> u32 {
        let later_ranks = (n_ranks - rank_idx - 1) as u32;
        match self {
            ScheduleKind::Gpipe => m,
            ScheduleKind::OneFOneB => m.min(later_ranks + 1),
            // ZB-H1 keeps 1F1B's first-stage peak on every stage (its section 2.1); its deferred
            // micro-batches hold only what the weight gradient reads, less than a whole backward.
            ScheduleKind::ZbH1 => m.min(n_ranks as u32),
            ScheduleKind::Kfkb { k } => m.min(k.get().saturating_mul(later_ranks + 1)),
            // Megatron-LM's interleaved 1F1B (forward_backward_pipelining_with_interleaving):
            // (p − i − 1)·2 + (v − 1)·p warm-up forwards, then one more before the first
            // backward, never more than the m·v the step runs.
            ScheduleKind::Interleaved => {
                let warm_up =
                    later_ranks.saturating_mul(2).saturating_add((n_chunks - 1).saturating_mul(n_ranks as u32));
                warm_up.saturating_add(1).min(m.saturating_mul(n_chunks))
            }
        }
    }

    /// Whether the kind runs plans with `virtual_stages` chunks per rank.
    pub fn runs_chunks(self, virtual_stages: u32) -> bool {
        (self == ScheduleKind::Interleaved) == (virtual_stages > 1)
    }
}

/// How a pipeline orders its micro-batches' passes: one fixed order for every step, or
/// Ada-Grouper's adaptive kFkB, whose k a policy chooses between steps and bounds by memory.
/// Written as a string everywhere (CLI, TOML, JSON): `gpipe`, `1f1b`, `interleaved`, `kfkb:K`,
/// `zb-h1`, `adaptive`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Schedule {
    Fixed(ScheduleKind),
    /// kFkB with k chosen per step; the cost model prices it as 1F1B.
    Adaptive,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule::Fixed(ScheduleKind::OneFOneB)
    }
}

impl From<ScheduleKind> for Schedule {
    fn from(kind: ScheduleKind) -> Self {
        Schedule::Fixed(kind)
    }
}

impl Schedule {
    /// The fixed order, if this is one.
    pub fn fixed(self) -> Option<ScheduleKind> {
        match self {
            Schedule::Fixed(kind) => Some(kind),
            Schedule::Adaptive => None,
        }
    }

    /// [`ScheduleKind::in_flight`] of the order the cost model prices: adaptive as 1F1B.
    pub fn in_flight(self, rank_idx: usize, n_ranks: usize, n_chunks: u32, m: u32) -> u32 {
        self.fixed().unwrap_or(ScheduleKind::OneFOneB).in_flight(rank_idx, n_ranks, n_chunks, m)
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleKind::Gpipe => f.write_str("gpipe"),
            ScheduleKind::OneFOneB => f.write_str("1f1b"),
            ScheduleKind::Interleaved => f.write_str("interleaved"),
            ScheduleKind::Kfkb { k } => write!(f, "kfkb:{k}"),
            ScheduleKind::ZbH1 => f.write_str("zb-h1"),
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Schedule::Fixed(kind) => kind.fmt(f),
            Schedule::Adaptive => f.write_str("adaptive"),
        }
    }
}

impl FromStr for Schedule {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        let lower = text.to_ascii_lowercase();
        if let Some(k) = lower.strip_prefix("kfkb:") {
            return k
                .parse()
                .map(|k| Schedule::Fixed(ScheduleKind::Kfkb { k }))
                .map_err(|_| format!("schedule `{}`: k must be a positive integer, as in kfkb:4", echo(text)));
        }
        let kind = match lower.as_str() {
            "gpipe" => ScheduleKind::Gpipe,
            "1f1b" => ScheduleKind::OneFOneB,
            "interleaved" => ScheduleKind::Interleaved,
            "zb-h1" => ScheduleKind::ZbH1,
            "adaptive" => return Ok(Schedule::Adaptive),
            _ => {
                return Err(format!(
                    "unknown schedule `{}`; expected gpipe, 1f1b, interleaved, kfkb:K, zb-h1 or adaptive",
                    echo(text)
                ));
            }
        };
        Ok(Schedule::Fixed(kind))
    }
}

impl TryFrom<String> for Schedule {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        text.parse()
    }
}

impl From<Schedule> for String {
    fn from(schedule: Schedule) -> String {
        schedule.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::JobSpec;

    #[test]
    fn schedule_names_round_trip_through_text_toml_and_json() {
        for name in ["gpipe", "1f1b", "interleaved", "kfkb:4", "zb-h1", "adaptive"] {
            let schedule: Schedule = name.parse().unwrap();
            assert_eq!(schedule.to_string(), name);
            let json = serde_json::to_string(&schedule).unwrap();
            assert_eq!(json, format!("\"{name}\""));
            assert_eq!(serde_json::from_str::<Schedule>(&json).unwrap(), schedule);
            let job =
                JobSpec::from_toml(&format!("seq_len = 1\nglobal_batch = 1\nschedule = \"{name}\"\n"), "job.toml");
            assert_eq!(job.unwrap().schedule(), schedule);
        }
        assert_eq!("KFKB:2".parse::<Schedule>().unwrap().to_string(), "kfkb:2");
        assert!("kfkb:0".parse::<Schedule>().unwrap_err().contains("positive"));
        assert!("kfkb".parse::<Schedule>().unwrap_err().contains("kfkb:K"));
        let toml_error = JobSpec::from_toml("seq_len = 1\nglobal_batch = 1\nschedule = \"2f2b\"\n", "job.toml");
        assert!(toml_error.unwrap_err().to_string().contains("unknown schedule `2f2b`"));
    }

    #[test]
    fn fixed_kinds_and_adaptive() {
        let k4 = ScheduleKind::Kfkb { k: NonZeroU32::new(4).unwrap() };
        assert_eq!(k4.to_string(), "kfkb:4");
        for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved, ScheduleKind::ZbH1, k4] {
            assert_eq!(Schedule::from(kind).fixed(), Some(kind));
        }
        assert_eq!(Schedule::Adaptive.fixed(), None);
        assert_eq!(Schedule::default(), Schedule::Fixed(ScheduleKind::OneFOneB));
    }

    #[test]
    fn in_flight_per_schedule() {
        let k = |k| Schedule::Fixed(ScheduleKind::Kfkb { k: NonZeroU32::new(k).unwrap() });
        let check = |schedule: Schedule, rank_idx, n_ranks, n_chunks, m, expected| {
            assert_eq!(
                schedule.in_flight(rank_idx, n_ranks, n_chunks, m),
                expected,
                "{schedule} {rank_idx}/{n_ranks} v={n_chunks} m={m}"
            );
        };
        let fixed = Schedule::Fixed;
        check(fixed(ScheduleKind::Gpipe), 0, 4, 1, 8, 8);
        check(fixed(ScheduleKind::OneFOneB), 1, 4, 1, 8, 3);
        check(Schedule::Adaptive, 1, 4, 1, 2, 2);
        check(k(3), 1, 4, 1, 8, 8);
        check(k(2), 2, 4, 1, 8, 4);
        check(fixed(ScheduleKind::ZbH1), 3, 4, 1, 8, 4);
        check(fixed(ScheduleKind::ZbH1), 0, 4, 1, 2, 2);
        // Megatron: rank 0 of 4 with 2 chunks warms up with 3·2 + 1·4 = 10 chunk-micro-batches.
        check(fixed(ScheduleKind::Interleaved), 0, 4, 2, 8, 11);
        check(fixed(ScheduleKind::Interleaved), 3, 4, 2, 8, 5);
        check(fixed(ScheduleKind::Interleaved), 0, 4, 2, 3, 6);
    }
}
