//! What to train: sequence length, batch, precision, and the memory-saving options.

use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::SpecError;

/// Numeric precision of training.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// bf16 weights, activations and gradients; fp32 master weights and Adam moments
    /// (16 bytes of model state per parameter).
    #[default]
    Bf16Mixed,
}

/// Activation recomputation (Korthikanti et al. 2022, arXiv 2205.05198).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every activation.
    None,
    /// Recompute attention's score/softmax part; keeps the linear layers' inputs.
    Selective,
    /// Keep only each layer's input; rerun the layer's forward in backward.
    Full,
}

impl Recompute {
    pub const ALL: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];
}

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        })
    }
}

impl FromStr for Recompute {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        Recompute::ALL
            .into_iter()
            .find(|mode| mode.to_string() == text.to_ascii_lowercase())
            .ok_or_else(|| format!("unknown recompute `{text}`; expected none, selective or full"))
    }
}

/// How a pipeline orders its micro-batches' forward and backward passes. Written as a string
/// everywhere (CLI, TOML, JSON): `gpipe`, `1f1b`, `interleaved`, `kfkb:K`, `zb-h1`, `adaptive`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Schedule {
    /// All forwards, then all backwards: every micro-batch's activations are live at once.
    Gpipe,
    /// One forward, one backward in steady state (PipeDream-Flush): stage i of p keeps at most
    /// p - i micro-batches' activations.
    #[default]
    OneFOneB,
    /// 1F1B over virtual stages: each rank holds several model chunks (Narayanan et al. SC'21,
    /// arXiv 2104.04473); needs a plan with more than one virtual stage per rank.
    Interleaved,
    /// 1F1B over groups of `k` micro-batches (Ada-Grouper, Wang et al. 2023, arXiv 2303.01675).
    Kfkb { k: NonZeroU32 },
    /// Zero-bubble ZB-H1 (Qi et al. 2023, arXiv 2401.10241): 1F1B with weight gradients deferred.
    ZbH1,
    /// Ada-Grouper's adaptive k: a simulator policy chooses kFkB's k per step and bounds it by
    /// memory, so the cost model prices it as 1F1B.
    Adaptive,
}

impl Schedule {
    /// Chunk-micro-batches (one micro-batch on one model chunk) whose activations rank `rank_idx`
    /// of `n_ranks`, holding `n_chunks` chunks, keeps at its peak with `m` micro-batches per step.
    /// With one chunk per rank that is micro-batches. The one in-flight rule the cost model, the
    /// planner and the schedule checker share.
    pub fn in_flight(self, rank_idx: usize, n_ranks: usize, n_chunks: u32, m: u32) -> u32 {
        let later_ranks = (n_ranks - rank_idx - 1) as u32;
        match self {
            Schedule::Gpipe => m,
            Schedule::OneFOneB | Schedule::Adaptive => m.min(later_ranks + 1),
            // ZB-H1 keeps 1F1B's first-stage peak on every stage (its section 2.1).
            Schedule::ZbH1 => m.min(n_ranks as u32),
            Schedule::Kfkb { k } => m.min(k.get().saturating_mul(later_ranks + 1)),
            // Megatron-LM's interleaved 1F1B (forward_backward_pipelining_with_interleaving):
            // (p − i − 1)·2 + (v − 1)·p warm-up forwards, then one more before the first
            // backward, never more than the m·v the step runs.
            Schedule::Interleaved => {
                let warm_up =
                    later_ranks.saturating_mul(2).saturating_add((n_chunks - 1).saturating_mul(n_ranks as u32));
                warm_up.saturating_add(1).min(m.saturating_mul(n_chunks))
            }
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Schedule::Gpipe => f.write_str("gpipe"),
            Schedule::OneFOneB => f.write_str("1f1b"),
            Schedule::Interleaved => f.write_str("interleaved"),
            Schedule::Kfkb { k } => write!(f, "kfkb:{k}"),
            Schedule::ZbH1 => f.write_str("zb-h1"),
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
                .map(|k| Schedule::Kfkb { k })
                .map_err(|_| format!("schedule `{text}`: k must be a positive integer, as in kfkb:4"));
        }
        match lower.as_str() {
            "gpipe" => Ok(Schedule::Gpipe),
            "1f1b" => Ok(Schedule::OneFOneB),
            "interleaved" => Ok(Schedule::Interleaved),
            "zb-h1" => Ok(Schedule::ZbH1),
            "adaptive" => Ok(Schedule::Adaptive),
            _ => {
                Err(format!("unknown schedule `{text}`; expected gpipe, 1f1b, interleaved, kfkb:K, zb-h1 or adaptive"))
            }
        }
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

/// A training job. Invariants (held by [`JobSpec::new`]): positive sizes; a fixed micro-batch
/// divides the global batch. `None` leaves a choice to the planner.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobSpec {
    seq_len: u32,
    global_batch: u32,
    micro_batch: Option<u32>,
    precision: Precision,
    zero1: bool,
    recompute: Option<Recompute>,
    schedule: Schedule,
}

/// The unchecked parts of a job, as a TOML file or flags give them.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobParts {
    pub seq_len: u32,
    /// Sequences per optimizer step.
    pub global_batch: u32,
    #[serde(default)]
    pub micro_batch: Option<u32>,
    #[serde(default)]
    pub precision: Precision,
    #[serde(default = "yes")]
    pub zero1: bool,
    #[serde(default)]
    pub recompute: Option<Recompute>,
    #[serde(default)]
    pub schedule: Schedule,
}

impl JobParts {
    /// Parses a job TOML file's text, for callers that override fields before validation.
    pub fn from_toml(text: &str, source: &str) -> Result<Self, SpecError> {
        toml::from_str(text).map_err(|err| SpecError::from_toml(source, text, &err))
    }
}

fn yes() -> bool {
    true
}

impl Default for JobParts {
    /// A common pre-training setting: 4K tokens, 1024 sequences (4M tokens) a step.
    fn default() -> Self {
        JobParts {
            seq_len: 4096,
            global_batch: 1024,
            micro_batch: None,
            precision: Precision::Bf16Mixed,
            zero1: true,
            recompute: None,
            schedule: Schedule::OneFOneB,
        }
    }
}

impl JobSpec {
    pub fn new(parts: JobParts, source: &str) -> Result<Self, SpecError> {
        for (field, value) in [("seq_len", parts.seq_len), ("global_batch", parts.global_batch)] {
            if value == 0 {
                return Err(SpecError::field(source, field, "must be at least 1"));
            }
        }
        if let Some(micro_batch) = parts.micro_batch
            && (micro_batch == 0 || !parts.global_batch.is_multiple_of(micro_batch))
        {
            return Err(SpecError::field(
                source,
                "micro_batch",
                format!("{micro_batch} must be positive and divide the global batch {}", parts.global_batch),
            ));
        }
        Ok(JobSpec {
            seq_len: parts.seq_len,
            global_batch: parts.global_batch,
            micro_batch: parts.micro_batch,
            precision: parts.precision,
            zero1: parts.zero1,
            recompute: parts.recompute,
            schedule: parts.schedule,
        })
    }

    /// Parses and validates a job TOML file's text.
    pub fn from_toml(text: &str, source: &str) -> Result<Self, SpecError> {
        JobSpec::new(JobParts::from_toml(text, source)?, source)
    }

    pub fn seq_len(&self) -> u32 {
        self.seq_len
    }
    pub fn global_batch(&self) -> u32 {
        self.global_batch
    }
    pub fn micro_batch(&self) -> Option<u32> {
        self.micro_batch
    }
    pub fn precision(&self) -> Precision {
        self.precision
    }
    pub fn zero1(&self) -> bool {
        self.zero1
    }
    /// The same job with ZeRO-1 on or off (no invariant depends on it).
    pub fn with_zero1(self, zero1: bool) -> Self {
        JobSpec { zero1, ..self }
    }
    pub fn recompute(&self) -> Option<Recompute> {
        self.recompute
    }
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }
    pub fn tokens_per_step(&self) -> u64 {
        u64::from(self.seq_len) * u64::from(self.global_batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_batch_must_divide_global_batch() {
        let parts = JobParts { global_batch: 10, micro_batch: Some(4), ..JobParts::default() };
        assert!(JobSpec::new(parts, "--micro-batch").unwrap_err().to_string().contains("divide"));
    }

    #[test]
    fn toml_job_with_defaults() {
        let job =
            JobSpec::from_toml("seq_len = 2048\nglobal_batch = 512\nrecompute = \"selective\"\n", "job.toml").unwrap();
        assert_eq!((job.seq_len(), job.zero1(), job.recompute()), (2048, true, Some(Recompute::Selective)));
        assert!(JobSpec::from_toml("seq_len = 1\nglobal_batch = 1\nbatch = 2\n", "job.toml").is_err());
    }

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
    fn in_flight_per_schedule() {
        let k = |k| Schedule::Kfkb { k: NonZeroU32::new(k).unwrap() };
        let check = |schedule: Schedule, rank_idx, n_ranks, n_chunks, m, expected| {
            assert_eq!(
                schedule.in_flight(rank_idx, n_ranks, n_chunks, m),
                expected,
                "{schedule} {rank_idx}/{n_ranks} v={n_chunks} m={m}"
            );
        };
        check(Schedule::Gpipe, 0, 4, 1, 8, 8);
        check(Schedule::OneFOneB, 1, 4, 1, 8, 3);
        check(Schedule::Adaptive, 1, 4, 1, 2, 2);
        check(k(3), 1, 4, 1, 8, 8);
        check(k(2), 2, 4, 1, 8, 4);
        check(Schedule::ZbH1, 3, 4, 1, 8, 4);
        check(Schedule::ZbH1, 0, 4, 1, 2, 2);
        // Megatron: rank 0 of 4 with 2 chunks warms up with 3·2 + 1·4 = 10 chunk-micro-batches.
        check(Schedule::Interleaved, 0, 4, 2, 8, 11);
        check(Schedule::Interleaved, 3, 4, 2, 8, 5);
        check(Schedule::Interleaved, 0, 4, 2, 3, 6);
    }
}
