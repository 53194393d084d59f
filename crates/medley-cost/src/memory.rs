//! Memory a device needs: model states, activations, and a fixed workspace.
//!
//! Model states with Adam: in mixed precision 2 bytes of weights, the gradients in the format they
//! are reduced in (Megatron-LM's main gradients: 4 bytes in fp32, 2 in 16 bits) and 12 optimizer
//! bytes (fp32 master weights and moments); in tf32 or fp32 4, 4 and 8 (the moments). The
//! optimizer bytes are sharded over the data-parallel replicas with ZeRO-1, and the gradients
//! too with ZeRO-2 (Rajbhandari et al., arXiv 1910.02054). Activations per layer and
//! micro-batch follow Korthikanti et al. (arXiv 2205.05198), generalised to grouped-query attention
//! and gated MLPs: with 16-bit activations and dropout masks, in units of s·b·h bytes, the two norms
//! keep 4, attention 7 + 4·kv/heads plus 5·a·s/h for scores, softmax and dropout (with q = heads ×
//! head size apart from h: 3 + 4·q/h + 4·kv/h), a GELU MLP 3 + 4f/h, a SwiGLU MLP 3 + 6f/h (gate,
//! up and their product), once per routed expert a token visits and per shared expert.
//! An unfused attention kernel under `Recompute::None` keeps its score, softmax and dropout
//! buffers (the 5·a·s/h term), as Megatron-LM did before FlashAttention; selective recomputation
//! drops them. A fused (FlashAttention) kernel never stores them, only its softmax statistics
//! (fp32, one per head and token), and recomputes the scores in its backward. A tf32 or fp32 job
//! keeps every 16-bit activation at 4 bytes instead.

use medley_spec::{AttentionKernel, MlpKind, ModelSpec, Precision, Recompute};

use crate::StateFormat;

/// A fixed reserve per device: runtime context, communicator buffers, GEMM workspaces and
/// allocator fragmentation (a common rule of thumb; calibrate for a given software stack).
pub const WORKSPACE_BYTES: f64 = 2.0 * GIB;

pub const GIB: f64 = (1u64 << 30) as f64;

/// The part of a device's memory `capacity` (in any unit) a plan may use, the share `headroom`
/// of it left free (the [`WORKSPACE_BYTES`] reserve is part of each stage's memory, not of this).
pub fn usable(capacity: f64, headroom: f64) -> f64 {
    capacity * (1.0 - headroom)
}

/// Bytes of one device's memory by purpose.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MemoryBreakdown {
    pub weights: f64,
    pub gradients: f64,
    pub optimizer: f64,
    pub activations: f64,
    pub workspace: f64,
}

impl MemoryBreakdown {
    pub fn total(&self) -> f64 {
        self.weights + self.gradients + self.optimizer + self.activations + self.workspace
    }

    pub fn total_gib(&self) -> f64 {
        self.total() / GIB
    }

    /// Model states kept as `states` say for `params` parameters split `tp` ways, optimizer
    /// states further over `optimizer_shards` replicas, and gradients too when `states` shard them.
    pub fn model_states(params: f64, tp: u32, optimizer_shards: u32, states: StateFormat) -> MemoryBreakdown {
        let per_rank = params / f64::from(tp);
        let shards = f64::from(optimizer_shards.max(1));
        let gradient_shards = if states.shard_gradients { shards } else { 1.0 };
        MemoryBreakdown {
            weights: states.precision.element_bytes() * per_rank,
            gradients: states.gradient_bytes() * per_rank / gradient_shards,
            optimizer: states.precision.optimizer_bytes() * per_rank / shards,
            activations: 0.0,
            workspace: WORKSPACE_BYTES,
        }
    }
}

/// One micro-batch on one tensor-parallel rank: `micro_batch` sequences of `seq_len` tokens
/// split over `tp` ranks (sequence parallelism on whenever `tp > 1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActivationShape {
    pub seq_len: u32,
    pub micro_batch: u32,
    pub tp: u32,
}

/// Scores (query–key pairs of every head) one layer's attention computes for `micro_batch`
/// sequences without a fused kernel: all s², the causal mask applied after.
pub fn scores(model: &ModelSpec, seq_len: u32, micro_batch: u32) -> f64 {
    f64::from(micro_batch) * f64::from(model.n_heads()) * f64::from(seq_len) * f64::from(seq_len)
}

/// Activation bytes one layer keeps for one micro-batch of `shape` with `attention` in
/// `precision`.
pub fn layer_activation_bytes(
    model: &ModelSpec,
    shape: ActivationShape,
    recompute: Recompute,
    attention: AttentionKernel,
    precision: Precision,
) -> f64 {
    let (s, b, h, t) =
        (f64::from(shape.seq_len), f64::from(shape.micro_batch), f64::from(model.hidden()), f64::from(shape.tp));
    // Korthikanti's units are bytes of 16-bit tensors; fp32 ones take twice that.
    let sbh = s * b * h * precision.element_bytes() / 2.0;
    if recompute == Recompute::Full {
        return 2.0 * sbh / t;
    }
    // Attention keeps its input and dropout mask (3, h-wide), Q and its output (4, q-wide) and K
    // and V (4, kv-wide): Korthikanti's 7 + 4·kv/heads when q = h.
    let q_ratio = model.q_width() as f64 / h;
    let kv_ratio = model.kv_width() as f64 / h;
    let attention_parts = 3.0 + 4.0 * q_ratio + 4.0 * kv_ratio;
    let mlp = |ffn_width: f64| match model.mlp() {
        MlpKind::Gelu => 3.0 + 4.0 * ffn_width / h,
        MlpKind::SwiGlu => 3.0 + 6.0 * ffn_width / h,
    };
    // Each routed expert a token visits keeps its own input and hidden values, as do shared ones.
    let mlp = match model.experts() {
        Some(experts) => {
            let routed_width = (model.active_ffn_width() - u64::from(experts.shared_ffn_hidden)) as f64;
            let routed = f64::from(experts.top_k) * mlp(routed_width / f64::from(experts.top_k));
            let shared = if experts.shared_ffn_hidden > 0 { mlp(f64::from(experts.shared_ffn_hidden)) } else { 0.0 };
            routed + shared
        }
        None => mlp(f64::from(model.ffn_hidden())),
    };
    let linear_parts = 4.0 + attention_parts + mlp;
    let heads_per_h = f64::from(model.n_heads()) / h;
    let scores = match (attention, recompute) {
        (AttentionKernel::Unfused, Recompute::None) => 5.0 * heads_per_h * s,
        (AttentionKernel::Unfused, _) => 0.0,
        // The softmax statistics are fp32 in every precision.
        (AttentionKernel::Fused, _) => 4.0 * heads_per_h * 2.0 / precision.element_bytes(),
    };
    sbh * (linear_parts + scores) / t
}

/// Bytes of the logits in `precision` and their fp32 softmax and gradient for one micro-batch on
/// the last stage.
pub fn logits_bytes(model: &ModelSpec, seq_len: u32, micro_batch: u32, tp: u32, precision: Precision) -> f64 {
    let per_logit = precision.element_bytes() + 8.0;
    per_logit * f64::from(seq_len) * f64::from(micro_batch) * f64::from(model.vocab()) / f64::from(tp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use medley_spec::GradReduce;

    fn gpt3_like() -> ModelSpec {
        crate::flops::tests::gpt(96, 12288, 96, 51200)
    }

    #[test]
    fn korthikanti_formulas() {
        let model = gpt3_like();
        let (s, b, t) = (2048u32, 1u32, 8u32);
        let (sf, bf, h, a, tf) = (2048.0, 1.0, 12288.0, 96.0, 8.0);
        let shape = ActivationShape { seq_len: s, micro_batch: b, tp: t };
        let check = |recompute, expected: f64| {
            let got = layer_activation_bytes(&model, shape, recompute, AttentionKernel::Unfused, Precision::Bf16Mixed);
            assert!((got / expected - 1.0).abs() < 1e-12, "{recompute}: {got} vs {expected}");
        };
        // TP + SP: sbh(34 + 5as/h)/t; TP + SP + selective: 34·sbh/t; full: 2sbh (per TP rank /t).
        check(Recompute::None, sf * bf * h * (34.0 + 5.0 * a * sf / h) / tf);
        check(Recompute::Selective, sf * bf * h * 34.0 / tf);
        check(Recompute::Full, 2.0 * sf * bf * h / tf);
        // A fused kernel keeps no scores, only fp32 softmax statistics per head and token.
        let fused =
            layer_activation_bytes(&model, shape, Recompute::None, AttentionKernel::Fused, Precision::Bf16Mixed);
        let expected = sf * bf * h * (34.0 + 4.0 * a / h) / tf;
        assert!((fused / expected - 1.0).abs() < 1e-12, "{fused} vs {expected}");
        // In fp32 every tensor but the fp32 statistics doubles.
        let fp32 = layer_activation_bytes(&model, shape, Recompute::None, AttentionKernel::Fused, Precision::Fp32);
        let expected = sf * bf * h * (2.0 * 34.0 + 4.0 * a / h) / tf;
        assert!((fp32 / expected - 1.0).abs() < 1e-12, "{fp32} vs {expected}");
        let full = layer_activation_bytes(&model, shape, Recompute::Full, AttentionKernel::Unfused, Precision::Tf32);
        assert_eq!(full, 4.0 * sf * bf * h / tf);
        let logits = |precision| logits_bytes(&model, s, b, t, precision) / (sf * bf * 51200.0 / tf);
        assert_eq!((logits(Precision::Fp16Mixed), logits(Precision::Fp32)), (10.0, 12.0));
    }

    #[test]
    fn zero1_shards_optimizer_states_and_zero2_gradients_too() {
        let states = |precision, grad_reduce, shard_gradients| StateFormat { precision, grad_reduce, shard_gradients };
        // bf16 with gradients kept and reduced in fp32, Megatron-LM's default: 18 bytes a
        // parameter, 6 + 12/d with its distributed optimizer.
        let bf16 = states(Precision::Bf16Mixed, GradReduce::Fp32, false);
        let plain = MemoryBreakdown::model_states(1e9, 1, 1, bf16);
        assert_eq!(plain.total() - WORKSPACE_BYTES, 18e9);
        assert_eq!(bf16.unsharded_bytes(), 18.0);
        let sharded = MemoryBreakdown::model_states(1e9, 2, 4, bf16);
        assert_eq!((sharded.weights, sharded.gradients, sharded.optimizer), (1e9, 2e9, 1.5e9));
        // 16-bit gradients, 16 bytes; ZeRO-2 shards them with the optimizer states.
        let sixteen = states(Precision::Bf16Mixed, GradReduce::SixteenBit, false);
        assert_eq!(MemoryBreakdown::model_states(1e9, 1, 1, sixteen).total() - WORKSPACE_BYTES, 16e9);
        let zero2 = MemoryBreakdown::model_states(1e9, 2, 4, StateFormat { shard_gradients: true, ..bf16 });
        assert_eq!((zero2.gradients, zero2.optimizer), (0.5e9, 1.5e9));
        // fp32 keeps 4-byte weights and gradients and no master copy: ZeRO-1 saves less of it.
        let fp32 = MemoryBreakdown::model_states(1e9, 2, 4, StateFormat::new(Precision::Fp32));
        assert_eq!((fp32.weights, fp32.gradients, fp32.optimizer), (2e9, 2e9, 1e9));
        let tf32 = MemoryBreakdown::model_states(1e9, 1, 1, StateFormat::new(Precision::Tf32));
        assert_eq!(tf32.total() - WORKSPACE_BYTES, 16e9);
    }
}
