//! What to train: sequence length, batch, precision, and the memory-saving options.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{SpecError, echo};
use crate::schedule::{Schedule, ScheduleKind};

/// Numeric precision of training. The mixed ones keep 16-bit weights, activations and gradients
/// beside fp32 master weights and Adam moments; `tf32` and `fp32` keep everything in fp32 (no
/// master copy), their matmuls on TF32 tensor cores or at the plain fp32 rate. All take 16 bytes
/// of model state a parameter, split differently between weights, gradients and optimizer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// bf16, the default: no loss scaling needed.
    #[default]
    Bf16Mixed,
    /// fp16 with dynamic loss scaling: for devices without bf16 (V100, T4).
    Fp16Mixed,
    /// fp32 tensors with matmuls on TF32 tensor cores (PyTorch's `allow_tf32`): Ampere and later,
    /// MI300-class.
    Tf32,
    /// fp32 throughout, matmuls at the device's fp32 rate (TF32 off).
    Fp32,
}

impl Precision {
    pub const ALL: [Precision; 4] = [Precision::Bf16Mixed, Precision::Fp16Mixed, Precision::Tf32, Precision::Fp32];

    /// The number format the matmuls run: `bf16`, `fp16`, `tf32` or `fp32`.
    pub fn format(self) -> &'static str {
        match self {
            Precision::Bf16Mixed => "bf16",
            Precision::Fp16Mixed => "fp16",
            Precision::Tf32 => "tf32",
            Precision::Fp32 => "fp32",
        }
    }

    /// Whether weights, activations and gradients are 16-bit beside an fp32 master copy.
    pub fn is_mixed(self) -> bool {
        matches!(self, Precision::Bf16Mixed | Precision::Fp16Mixed)
    }

    /// Bytes of one weight, activation or gradient element as the model computes with it.
    pub fn element_bytes(self) -> f64 {
        if self.is_mixed() { 2.0 } else { 4.0 }
    }

    /// Optimizer bytes a parameter: Adam's two fp32 moments, and the fp32 master weight of mixed
    /// precision.
    pub fn optimizer_bytes(self) -> f64 {
        if self.is_mixed() { 12.0 } else { 8.0 }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.is_mixed() {
            true => write!(f, "{}-mixed", self.format()),
            false => f.write_str(self.format()),
        }
    }
}

impl FromStr for Precision {
    type Err = String;
    /// `bf16-mixed`, `fp16-mixed`, `tf32` or `fp32`; the mixed ones by their format alone too.
    fn from_str(text: &str) -> Result<Self, String> {
        let wanted = text.trim().to_ascii_lowercase();
        Precision::ALL
            .into_iter()
            .find(|precision| precision.to_string() == wanted || precision.format() == wanted)
            .ok_or_else(|| format!("unknown precision `{}`; expected bf16-mixed, fp16-mixed, tf32 or fp32", echo(text)))
    }
}

/// The number format data-parallel replicas accumulate and reduce gradients in: what crosses the
/// network is 4 or 2 bytes a parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GradReduce {
    /// Megatron-LM's default under bf16 (`accumulate_allreduce_grads_in_fp32`) and torchtitan's
    /// (`mixed_precision_reduce = "float32"`).
    #[serde(rename = "fp32")]
    Fp32,
    /// The job's 16-bit format: Megatron-LM's default under fp16, `--grad-reduce-in-bf16` under
    /// bf16.
    #[serde(rename = "16-bit")]
    SixteenBit,
}

impl GradReduce {
    pub const ALL: [GradReduce; 2] = [GradReduce::Fp32, GradReduce::SixteenBit];

    /// Bytes a gradient element takes on the wire.
    pub fn bytes(self) -> f64 {
        match self {
            GradReduce::Fp32 => 4.0,
            GradReduce::SixteenBit => 2.0,
        }
    }

    /// Megatron-LM's default for a job in `precision`.
    pub fn default_for(precision: Precision) -> Self {
        match precision {
            Precision::Fp16Mixed => GradReduce::SixteenBit,
            Precision::Bf16Mixed | Precision::Tf32 | Precision::Fp32 => GradReduce::Fp32,
        }
    }

    /// Refuses a 16-bit reduction of a job whose gradients are fp32: there is no 16-bit format
    /// to reduce them in.
    pub fn check_for(self, precision: Precision) -> Result<(), String> {
        match (self, precision.is_mixed()) {
            (GradReduce::SixteenBit, false) => Err(format!(
                "in {precision}, gradients are fp32 and reduce in fp32; a 16-bit reduction needs a mixed \
                 precision (bf16-mixed or fp16-mixed)"
            )),
            _ => Ok(()),
        }
    }

    /// What plans written before it was a setting were priced with.
    pub fn unstated() -> Self {
        GradReduce::SixteenBit
    }
}

impl fmt::Display for GradReduce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GradReduce::Fp32 => "fp32",
            GradReduce::SixteenBit => "16-bit",
        })
    }
}

impl FromStr for GradReduce {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        by_name(&GradReduce::ALL, text, "gradient reduction")
    }
}

/// How the attention core (scores, softmax, score × V) runs; orthogonal to [`Recompute`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKernel {
    /// One kernel that never writes the s × s scores to memory and recomputes them in its
    /// backward (FlashAttention, Dao et al. 2022, arXiv 2205.14135): the default of current
    /// Megatron-LM, torchtitan and NeMo.
    #[default]
    Fused,
    /// Separate matmuls and softmax/mask/dropout kernels that write the full s × s scores to
    /// memory and keep them for the backward unless recomputed (Megatron-LM before
    /// FlashAttention, as in Korthikanti et al. 2022).
    Unfused,
}

impl AttentionKernel {
    pub const ALL: [AttentionKernel; 2] = [AttentionKernel::Fused, AttentionKernel::Unfused];
}

impl fmt::Display for AttentionKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttentionKernel::Fused => "fused",
            AttentionKernel::Unfused => "unfused",
        })
    }
}

impl FromStr for AttentionKernel {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        by_name(&AttentionKernel::ALL, text, "attention kernel")
    }
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
        by_name(&Recompute::ALL, text, "recompute")
    }
}

/// The one of `all` whose name (its `Display`) is `text`, in any case; else an error naming
/// `what` and the names it takes.
fn by_name<T: Copy + fmt::Display>(all: &[T], text: &str, what: &str) -> Result<T, String> {
    let wanted = text.trim().to_ascii_lowercase();
    all.iter().copied().find(|item| item.to_string() == wanted).ok_or_else(|| {
        let names: Vec<String> = all.iter().map(ToString::to_string).collect();
        let expected = match names.split_last() {
            Some((last, [])) => last.clone(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        };
        format!("unknown {what} `{}`; expected {expected}", echo(text))
    })
}

/// A training job. Invariants (held by [`JobSpec::new`]): positive sizes; a fixed micro-batch
/// divides the global batch. `None` leaves a choice to the planner.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobSpec {
    seq_len: u32,
    global_batch: u32,
    micro_batch: Option<u32>,
    precision: Precision,
    grad_reduce: GradReduce,
    zero1: bool,
    shard_gradients: bool,
    recompute: Option<Recompute>,
    attention: AttentionKernel,
    overlap_grad_reduce: bool,
    schedule: Schedule,
    memory_headroom: f64,
}

/// Refuses gradients sharded (ZeRO-2) with whole optimizer states: ZeRO shards the optimizer
/// states first.
pub fn check_shard_gradients(shard_gradients: bool, zero1: bool) -> Result<(), String> {
    match shard_gradients && !zero1 {
        true => {
            Err("sharding gradients over the replicas (ZeRO-2) needs the optimizer states sharded too (zero1)".into())
        }
        false => Ok(()),
    }
}

/// The share of each device's memory a plan leaves free by default: beyond the fixed reserve for
/// the runtime context and communicator buffers that every stage's memory counts, room for the
/// caching allocator's fragmentation, which the cost model does not see.
pub const DEFAULT_MEMORY_HEADROOM: f64 = 0.05;

/// The most of a device's memory a job may keep free.
const MAX_MEMORY_HEADROOM: f64 = 0.5;

/// Refuses a headroom outside 0 to [`MAX_MEMORY_HEADROOM`]: a job's, or a plan's (`source`).
pub fn check_memory_headroom(headroom: f64, source: &str) -> Result<(), SpecError> {
    match (0.0..=MAX_MEMORY_HEADROOM).contains(&headroom) {
        true => Ok(()),
        false => Err(SpecError::field(
            source,
            "memory_headroom",
            format!("must be a share of device memory from 0 to {MAX_MEMORY_HEADROOM}, got {headroom}"),
        )),
    }
}

fn default_memory_headroom() -> f64 {
    DEFAULT_MEMORY_HEADROOM
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
    /// [default: Megatron-LM's for the precision, [`GradReduce::default_for`]]
    #[serde(default)]
    pub grad_reduce: Option<GradReduce>,
    #[serde(default = "yes")]
    pub zero1: bool,
    /// Gradients sharded over the replicas with the optimizer states (ZeRO-2), as the Llama 3
    /// paper's FSDP does (§3.3.2); needs `zero1`.
    #[serde(default)]
    pub shard_gradients: bool,
    #[serde(default)]
    pub recompute: Option<Recompute>,
    #[serde(default)]
    pub attention: AttentionKernel,
    /// Reduce each bucket of gradients while the last backward pass still computes the rest
    /// (Megatron-LM's `--overlap-grad-reduce`); off, gradients are reduced after the pipeline
    /// drains.
    #[serde(default = "yes")]
    pub overlap_grad_reduce: bool,
    #[serde(default)]
    pub schedule: Schedule,
    /// The share of each device's memory that plans leave free ([`DEFAULT_MEMORY_HEADROOM`]).
    #[serde(default = "default_memory_headroom")]
    pub memory_headroom: f64,
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
            grad_reduce: None,
            zero1: true,
            shard_gradients: false,
            recompute: None,
            attention: AttentionKernel::Fused,
            overlap_grad_reduce: true,
            schedule: Schedule::Fixed(ScheduleKind::OneFOneB),
            memory_headroom: DEFAULT_MEMORY_HEADROOM,
        }
    }
}

/// The largest job medley plans: 16M-token sequences, and 1M sequences a step (Llama 3 405B took
/// 2,048 sequences of 8K tokens); beyond them the planner's time grows past what it is for.
pub const MAX_SEQ_LEN: u32 = 1 << 24;
pub const MAX_GLOBAL_BATCH: u32 = 1 << 20;

impl JobSpec {
    pub fn new(parts: JobParts, source: &str) -> Result<Self, SpecError> {
        for (field, value, max) in
            [("seq_len", parts.seq_len, MAX_SEQ_LEN), ("global_batch", parts.global_batch, MAX_GLOBAL_BATCH)]
        {
            if value == 0 || value > max {
                return Err(SpecError::field(source, field, format!("must be from 1 to {max}, got {value}")));
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
        check_memory_headroom(parts.memory_headroom, source)?;
        let grad_reduce = parts.grad_reduce.unwrap_or(GradReduce::default_for(parts.precision));
        grad_reduce.check_for(parts.precision).map_err(|reason| SpecError::field(source, "grad_reduce", reason))?;
        check_shard_gradients(parts.shard_gradients, parts.zero1)
            .map_err(|reason| SpecError::field(source, "shard_gradients", reason))?;
        Ok(JobSpec {
            seq_len: parts.seq_len,
            global_batch: parts.global_batch,
            micro_batch: parts.micro_batch,
            precision: parts.precision,
            grad_reduce,
            zero1: parts.zero1,
            shard_gradients: parts.shard_gradients,
            recompute: parts.recompute,
            attention: parts.attention,
            overlap_grad_reduce: parts.overlap_grad_reduce,
            schedule: parts.schedule,
            memory_headroom: parts.memory_headroom,
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
    pub fn grad_reduce(&self) -> GradReduce {
        self.grad_reduce
    }
    /// The share of each device's memory plans leave free.
    pub fn memory_headroom(&self) -> f64 {
        self.memory_headroom
    }
    pub fn zero1(&self) -> bool {
        self.zero1
    }
    /// Gradients sharded over the replicas with the optimizer states (ZeRO-2).
    pub fn shard_gradients(&self) -> bool {
        self.shard_gradients
    }

    /// The same job with gradients sharded (ZeRO-2) or not; on needs ZeRO-1, which it turns on.
    pub fn with_shard_gradients(self, shard_gradients: bool) -> Self {
        JobSpec { shard_gradients, zero1: self.zero1 || shard_gradients, ..self }
    }

    /// The same job with ZeRO-1 on or off; off, gradients are not sharded either.
    pub fn with_zero1(self, zero1: bool) -> Self {
        JobSpec { zero1, shard_gradients: self.shard_gradients && zero1, ..self }
    }
    pub fn recompute(&self) -> Option<Recompute> {
        self.recompute
    }
    /// The same job with its recomputation fixed (no invariant depends on it).
    pub fn with_recompute(self, recompute: Recompute) -> Self {
        JobSpec { recompute: Some(recompute), ..self }
    }
    pub fn attention(&self) -> AttentionKernel {
        self.attention
    }
    pub fn overlap_grad_reduce(&self) -> bool {
        self.overlap_grad_reduce
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
    fn jobs_beyond_the_planners_limits_are_refused_naming_the_limit() {
        for (seq_len, global_batch, wanted) in [(0, 8, "seq_len"), (1 << 25, 8, "16777216"), (8, 20_000_000, "1048576")]
        {
            let parts = JobParts { seq_len, global_batch, ..JobParts::default() };
            let err = JobSpec::new(parts, "job.toml").unwrap_err().to_string();
            assert!(err.contains(wanted), "{err}");
        }
    }

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
    fn gradients_reduce_as_megatron_does_unless_the_job_says() {
        let job = |text: &str| JobSpec::from_toml(&format!("seq_len = 8\nglobal_batch = 8\n{text}"), "job.toml");
        assert_eq!(job("").unwrap().grad_reduce(), GradReduce::Fp32);
        assert_eq!(job("precision = \"fp16-mixed\"").unwrap().grad_reduce(), GradReduce::SixteenBit);
        assert_eq!(job("grad_reduce = \"16-bit\"").unwrap().grad_reduce(), GradReduce::SixteenBit);
        assert!(job("grad_reduce = \"fp8\"").is_err());
        assert_eq!("FP32".parse::<GradReduce>(), Ok(GradReduce::Fp32));
        assert!("bf16".parse::<GradReduce>().unwrap_err().contains("fp32 or 16-bit"));
        assert_eq!(" Selective ".parse::<Recompute>(), Ok(Recompute::Selective));
        let err = "some".parse::<Recompute>().unwrap_err();
        assert_eq!(err, "unknown recompute `some`; expected none, selective or full");
        assert!("flash".parse::<AttentionKernel>().unwrap_err().ends_with("expected fused or unfused"));
        assert_eq!((GradReduce::Fp32.bytes(), GradReduce::SixteenBit.bytes()), (4.0, 2.0));
        // fp32 jobs reduce fp32 gradients: a 16-bit reduction is refused, not silently priced.
        assert_eq!(job("precision = \"tf32\"").unwrap().grad_reduce(), GradReduce::Fp32);
        let err = job("precision = \"fp32\"\ngrad_reduce = \"16-bit\"").unwrap_err().to_string();
        assert!(err.contains("grad_reduce") && err.contains("in fp32, gradients are fp32"), "{err}");
    }

    /// ZeRO-2 shards gradients with the optimizer states: a job asking for it with whole optimizer
    /// states is refused naming the field, and turning ZeRO-1 off turns it off.
    #[test]
    fn gradients_shard_only_with_the_optimizer_states() {
        let job = |text: &str| JobSpec::from_toml(&format!("seq_len = 8\nglobal_batch = 8\n{text}"), "job.toml");
        assert!(!job("").unwrap().shard_gradients());
        let zero2 = job("shard_gradients = true").unwrap();
        assert!(zero2.shard_gradients() && zero2.zero1());
        let err = job("shard_gradients = true\nzero1 = false").unwrap_err().to_string();
        assert!(err.contains("shard_gradients") && err.contains("needs the optimizer states sharded too"), "{err}");
        assert!(!zero2.clone().with_zero1(false).shard_gradients());
        let on = job("zero1 = false").unwrap().with_shard_gradients(true);
        assert!(on.shard_gradients() && on.zero1());
    }

    /// Mixed precision keeps 16-bit tensors beside an fp32 master copy; tf32 and fp32 keep fp32
    /// tensors and no copy: 16 bytes of model state a parameter either way.
    #[test]
    fn precisions_size_their_tensors() {
        for precision in Precision::ALL {
            let state = 2.0 * precision.element_bytes() + precision.optimizer_bytes();
            assert_eq!(state, 16.0, "{precision}");
            assert_eq!(precision.to_string().parse::<Precision>(), Ok(precision));
        }
        assert_eq!(Precision::Tf32.element_bytes(), 4.0);
        assert_eq!(Precision::Bf16Mixed.optimizer_bytes(), 12.0);
        assert_eq!(Precision::Fp32.to_string(), "fp32");
    }
}
