//! How much host memory a worker needs: its model state and the activations it keeps for the
//! micro-batches in flight. The constants are fitted to peak resident sizes measured on this
//! runtime (burn's CPU backend, f32 throughout): Llama-style models of 45M and 160M parameters at
//! sequence lengths 128 to 2,048, where the estimate came out 4-18% above the measured peak
//! (`VmHWM` of each `medley worker`, on `medley train --fleet 1xh100 --no-emulate`); and per
//! worker of whole, ZeRO-1 and tensor-parallel layouts, `medley bench memory`.

use std::ops::Range;

use medley_model::ModelConfig;
use medley_model::params::stage_params;
use medley_plan::Plan;

use crate::{RankLayout, RuntimeError};

/// The process itself: the binary, burn, the communicator, the data.
const BASE_BYTES: f64 = 64.0 * (1 << 20) as f64;
/// Per parameter: the host copy, the summed gradient, burn's copy of the weight and the gradient
/// autodiff computes — four f32s — plus the allocator's slack.
const BYTES_PER_PARAM: f64 = 18.0;
/// Per parameter: AdamW's two f32 moments, shared out over the data-parallel group under ZeRO-1
/// (whose members also keep their run of the summed gradient: 12 bytes a parameter shared out).
const MOMENT_BYTES_PER_PARAM: f64 = 8.0;
const ZERO1_BYTES_PER_PARAM: f64 = 12.0;
/// Per parameter, while a data-parallel group reduces its gradients: the flattened gradients and
/// the part of the reduction's working buffer it touches, 6.8 bytes a parameter measured with
/// whole optimizer states and 4.9 with ZeRO-1 (`medley bench memory`).
const REDUCTION_BYTES_PER_PARAM: f64 = 6.0;
/// f32 values autodiff keeps per token and layer, per unit of the hidden size (norms, the Q, K,
/// V and output projections, rotary embedding, residuals) and of the MLP's hidden size (gate,
/// up, their SiLU product).
const KEPT_PER_HIDDEN: f64 = 24.0;
/// Of them, those a tensor-parallel member keeps for the whole sequence, unsplit: each block's
/// all-gathered input, its norm and its partial output.
const KEPT_WHOLE_PER_HIDDEN: f64 = 6.0;
const KEPT_PER_FFN: f64 = 6.0;
/// f32 values kept per attention score (scores, mask, softmax): the unfused s² term.
const KEPT_PER_SCORE: f64 = 3.0;
/// f32 values kept per logit (the logits and the log-softmax) on the last stage.
const KEPT_PER_LOGIT: f64 = 2.0;

/// A worker's host memory by purpose, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostMemory {
    /// Parameters, gradients and optimizer state, and the process itself.
    pub state_bytes: f64,
    /// What the backward passes of the micro-batches in flight need.
    pub activation_bytes: f64,
}

impl HostMemory {
    pub fn total_bytes(&self) -> f64 {
        self.state_bytes + self.activation_bytes
    }
}

impl std::ops::Add for HostMemory {
    type Output = HostMemory;
    fn add(self, other: HostMemory) -> HostMemory {
        HostMemory {
            state_bytes: self.state_bytes + other.state_bytes,
            activation_bytes: self.activation_bytes + other.activation_bytes,
        }
    }
}

/// The host memory of the worker at `layout` when it trains `plan` under `schedule`.
pub fn worker_memory(
    plan: &Plan,
    layout: &RankLayout,
    schedule: medley_spec::Schedule,
) -> Result<HostMemory, RuntimeError> {
    let config = ModelConfig::from_spec(plan.model(), plan.seq_len())?;
    let replica = &plan.replicas()[layout.id.replica as usize];
    let n_chunks = layout.chunks.len() as u32;
    let in_flight =
        schedule.in_flight(layout.id.pp_rank as usize, layout.n_pipeline_ranks, n_chunks, replica.n_micro_batches);
    let last_chunk = (n_chunks - 1) as usize;
    let shape = match (&layout.context, layout.tensor) {
        (Some(seat), _) => {
            let placement = &seat.placement;
            let (group, member) = placement.group_and_member();
            let group_tokens = placement.groups()[group].positions.len();
            let scores = placement.q_heads(member).len() * group_tokens * config.seq_len;
            PassShape { tokens: placement.positions().len(), scores, tp: 1 }
        }
        (None, Some(seat)) => PassShape { tp: seat.size, ..PassShape::whole(&config) },
        (None, None) => PassShape::whole(&config),
    };
    // The chunk-micro-batches in flight spread over the chunks; the last chunk's logits are
    // priced as if every one of them were on it, a bound that matters only with virtual stages.
    let layers: usize = layout.chunks.iter().map(Range::len).sum();
    let per_chunk_micro_batch_layers = layers as f64 / f64::from(n_chunks);
    let logits = layout.is_last(last_chunk as u32);
    let activations = f64::from(in_flight)
        * (per_chunk_micro_batch_layers * layer_activation_bytes(&config, shape, plan.micro_batch())
            + if logits { logit_bytes(&config, shape, plan.micro_batch()) } else { 0.0 });
    let specs = |chunk: &Range<usize>| match layout.tensor {
        Some(seat) => seat.stage_params(&config, chunk.clone()),
        None => stage_params(&config, chunk.clone()),
    };
    let params: usize = layout.chunks.iter().flat_map(specs).map(|spec| spec.numel()).sum();
    let stage = &replica.stages[layout.id.pp_rank as usize];
    let shards = plan.stage_state_shards(stage);
    let moments = if shards > 1 { ZERO1_BYTES_PER_PARAM / f64::from(shards) } else { MOMENT_BYTES_PER_PARAM };
    let reduces = plan.replicas().len() > 1 || stage.context.is_some();
    let per_param = BYTES_PER_PARAM + moments + if reduces { REDUCTION_BYTES_PER_PARAM } else { 0.0 };
    Ok(HostMemory { state_bytes: BASE_BYTES + per_param * params as f64, activation_bytes: activations })
}

/// The process's peak resident memory so far (`VmHWM`), MiB; `None` where there is no /proc
/// (not Linux).
pub fn peak_rss_mib() -> Option<f64> {
    vm_hwm_mib(&std::fs::read_to_string("/proc/self/status").ok()?)
}

/// The `VmHWM:` (high-water mark of resident memory) line of a /proc/PID/status text, in MiB.
fn vm_hwm_mib(status: &str) -> Option<f64> {
    let value = status.lines().find_map(|line| line.strip_prefix("VmHWM:"))?;
    let kib: f64 = value.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib / 1024.0)
}

/// What one sequence of a pass holds: its tokens outside attention and its attention scores, on
/// one member of a tensor-parallel group of `tp` (1 without), which keeps a `tp`-th of the heads'
/// and FFN columns' values and of the scores.
#[derive(Clone, Copy, Debug)]
struct PassShape {
    tokens: usize,
    scores: usize,
    tp: usize,
}

impl PassShape {
    /// A whole sequence on one worker.
    fn whole(config: &ModelConfig) -> PassShape {
        PassShape { tokens: config.seq_len, scores: config.n_heads * config.seq_len * config.seq_len, tp: 1 }
    }
}

/// The host memory of `medley train`'s calibration: `concurrency` whole models at once, each
/// running one micro-batch of `micro_batch` sequences.
pub fn calibration_memory(
    model: &medley_spec::ModelSpec,
    seq_len: u32,
    micro_batch: u32,
    concurrency: usize,
) -> Result<HostMemory, RuntimeError> {
    let config = ModelConfig::from_spec(model, seq_len)?;
    let params: usize = stage_params(&config, 0..config.n_layers).iter().map(|spec| spec.numel()).sum();
    let shape = PassShape::whole(&config);
    let activations = config.n_layers as f64 * layer_activation_bytes(&config, shape, micro_batch)
        + logit_bytes(&config, shape, micro_batch);
    let threads = concurrency.max(1) as f64;
    Ok(HostMemory {
        state_bytes: BASE_BYTES + threads * (BYTES_PER_PARAM + MOMENT_BYTES_PER_PARAM) * params as f64,
        activation_bytes: threads * activations,
    })
}

fn layer_activation_bytes(config: &ModelConfig, shape: PassShape, micro_batch: u32) -> f64 {
    let tokens = f64::from(micro_batch) * shape.tokens as f64;
    let tp = shape.tp as f64;
    let split =
        (KEPT_PER_HIDDEN - KEPT_WHOLE_PER_HIDDEN) * config.hidden as f64 + KEPT_PER_FFN * config.ffn_hidden as f64;
    let per_token = KEPT_WHOLE_PER_HIDDEN * config.hidden as f64 + split / tp;
    let scores = f64::from(micro_batch) * shape.scores as f64 / tp;
    4.0 * (tokens * per_token + KEPT_PER_SCORE * scores)
}

fn logit_bytes(config: &ModelConfig, shape: PassShape, micro_batch: u32) -> f64 {
    4.0 * KEPT_PER_LOGIT * f64::from(micro_batch) * shape.tokens as f64 * config.vocab as f64 / shape.tp as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use medley_spec::{MlpKind, ModelParts, ModelSpec};

    fn model(n_layers: u32, hidden: u32, ffn_hidden: u32) -> ModelSpec {
        let parts = ModelParts {
            name: "measured".into(),
            n_layers,
            hidden,
            n_heads: 8,
            n_kv_heads: 4,
            ffn_hidden,
            vocab: 32_000,
            mlp: MlpKind::SwiGlu,
            experts: None,
            tie_embeddings: false,
            ..ModelParts::default()
        };
        ModelSpec::new(parts, "test").unwrap()
    }

    #[test]
    fn vm_hwm_is_read_in_mib() {
        let status = "Name:\tmedley\nVmPeak:\t  9000 kB\nVmHWM:\t    2048 kB\nVmRSS:\t 1024 kB\n";
        assert_eq!(vm_hwm_mib(status), Some(2.0));
        assert_eq!(vm_hwm_mib("Name:\tmedley\n"), None);
    }

    /// Peak resident sizes measured on this runtime, one worker training the whole model with
    /// one micro-batch in flight: (layers, hidden, ffn, seq_len, micro-batch, GiB).
    const MEASURED: [(u32, u32, u32, u32, u32, f64); 4] = [
        (4, 512, 1408, 128, 1, 1.154),
        (4, 512, 1408, 1024, 2, 2.722),
        (4, 512, 1408, 2048, 2, 6.118),
        (8, 1024, 2816, 128, 1, 3.919),
    ];

    #[test]
    fn the_estimate_covers_measured_peaks_without_doubling_them() {
        for (n_layers, hidden, ffn, seq_len, micro_batch, measured_gib) in MEASURED {
            let estimate = calibration_memory(&model(n_layers, hidden, ffn), seq_len, micro_batch, 1).unwrap();
            let ratio = estimate.total_bytes() / (measured_gib * (1u64 << 30) as f64);
            assert!((1.0..1.25).contains(&ratio), "{n_layers}×{hidden} at {seq_len}×{micro_batch}: {ratio:.2}");
        }
    }
}
