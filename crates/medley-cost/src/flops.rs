//! Floating-point work of a training step.
//!
//! Per layer and micro-batch of `b` sequences of length `s` (Korthikanti et al. 2022,
//! arXiv 2205.05198, generalised to grouped-query attention, head sizes apart from h/heads, gated
//! MLPs and experts): projections 2bs·(2h·q + 2h·kv_width) with q = heads × head size, scores and
//! score·V 4bs²q, MLP 2bs·h·f per matrix per active expert (routed top-k and shared). Backward is
//! twice forward. Causal attention computes only the lower triangle, so the time model counts
//! half the s² work (a sliding window of w: about s·w − w²/2 pairs); model FLOPs (MFU) follow
//! Megatron-LM and PaLM and count twice that, so MFU stays comparable with published figures.

use medley_spec::{ModelSpec, Recompute};

use crate::params::{attention_params, embedding_params};

/// Forward FLOPs of one layer for one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerFlops {
    /// Dense matrix multiplies: projections, MLP, router.
    pub matmul: f64,
    /// The attention core (QKᵀ and score·V) as executed with a causal mask.
    pub attention: f64,
}

fn f(value: u32) -> f64 {
    f64::from(value)
}

/// Tokens' share of active MLP work: the top-k routed experts and the shared ones with the
/// router, or the one dense MLP.
fn active_mlp_flops_per_token(model: &ModelSpec) -> f64 {
    let matrices = 2.0 * model.mlp().n_matrices() as f64 * f(model.hidden()) * model.active_ffn_width() as f64;
    let router = model.experts().map_or(0.0, |experts| 2.0 * f(model.hidden()) * f(experts.n_experts));
    matrices + router
}

/// Query–key pairs one sequence's causal attention computes: s²/2, or about s·w − w²/2 when
/// each token attends to at most the last w (a sliding window).
fn causal_pairs(model: &ModelSpec, seq_len: u32) -> f64 {
    let s = f(seq_len);
    match model.sliding_window() {
        Some(window) if window < seq_len => s * f(window) - f(window) * f(window) / 2.0,
        _ => s * s / 2.0,
    }
}

/// Attention core FLOPs per sequence without causal savings, 4·s²·(heads × head size), or twice
/// a sliding window's causal pairs: QKᵀ and score·V each 2 FLOPs per pair and query dimension.
fn attention_core_flops(model: &ModelSpec, seq_len: u32) -> f64 {
    4.0 * 2.0 * causal_pairs(model, seq_len) * model.q_width() as f64
}

pub fn layer_forward(model: &ModelSpec, seq_len: u32, micro_batch: u32) -> LayerFlops {
    let tokens = f(seq_len) * f(micro_batch);
    let projections = 2.0 * attention_params(model) as f64;
    LayerFlops {
        matmul: tokens * (projections + active_mlp_flops_per_token(model)),
        attention: f(micro_batch) * attention_core_flops(model, seq_len) / 2.0,
    }
}

/// Forward FLOPs of the output projection (logits) for one micro-batch.
pub fn head_forward(model: &ModelSpec, seq_len: u32, micro_batch: u32) -> f64 {
    2.0 * f(seq_len) * f(micro_batch) * embedding_params(model) as f64
}

/// Model FLOPs of one sequence's forward pass, Megatron/PaLM convention (full s² term).
fn model_forward_per_sequence(model: &ModelSpec, seq_len: u32) -> f64 {
    let layer = f(seq_len) * (2.0 * attention_params(model) as f64 + active_mlp_flops_per_token(model))
        + attention_core_flops(model, seq_len);
    f(model.n_layers()) * layer + head_forward(model, seq_len, 1)
}

/// Model FLOPs of a step (forward + backward = 3× forward): the MFU numerator.
pub fn model_flops_per_step(model: &ModelSpec, seq_len: u32, global_batch: u32) -> f64 {
    3.0 * f(global_batch) * model_forward_per_sequence(model, seq_len)
}

/// Hardware FLOPs of a step: model FLOPs plus recomputation (the HFU numerator).
pub fn hardware_flops_per_step(model: &ModelSpec, seq_len: u32, global_batch: u32, recompute: Recompute) -> f64 {
    let per_sequence_layers = f(model.n_layers())
        * match recompute {
            Recompute::None => 0.0,
            // Korthikanti et al.'s convention: s/(6h) becomes s/(3h), the core's forward and
            // backward counted once more (the kernels rerun only its forward; HFU follows the
            // published definition so figures compare).
            Recompute::Selective => 3.0 * attention_core_flops(model, seq_len),
            Recompute::Full => {
                f(seq_len) * (2.0 * attention_params(model) as f64 + active_mlp_flops_per_token(model))
                    + attention_core_flops(model, seq_len)
            }
        };
    model_flops_per_step(model, seq_len, global_batch) + f(global_batch) * per_sequence_layers
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use medley_spec::{MlpKind, ModelParts};

    /// A GPT-style model (GELU MLP of 4h, full multi-head attention, tied embeddings), the shape
    /// Korthikanti et al. and Narayanan et al. count with.
    pub(crate) fn gpt(layers: u32, hidden: u32, heads: u32, vocab: u32) -> ModelSpec {
        let parts = ModelParts {
            name: "gpt".into(),
            n_layers: layers,
            hidden,
            n_heads: heads,
            n_kv_heads: heads,
            ffn_hidden: 4 * hidden,
            vocab,
            mlp: MlpKind::Gelu,
            experts: None,
            tie_embeddings: true,
            ..ModelParts::default()
        };
        ModelSpec::new(parts, "test").unwrap()
    }

    #[test]
    fn dense_gpt_matches_korthikanti_and_megatron() {
        let (l, h, a, v, s, b) = (24u32, 2048u32, 16u32, 50304u32, 2048u32, 4u32);
        let model = gpt(l, h, a, v);
        let (hf, sf, bf) = (f(h), f(s), f(b));
        let flops = layer_forward(&model, s, b);
        assert_eq!(flops.matmul, 24.0 * bf * sf * hf * hf);
        assert_eq!(flops.attention * 2.0, 4.0 * bf * sf * sf * hf);
        // Megatron-LM: 72·B·L·s·h²·(1 + s/(6h) + V/(12hL)).
        let megatron = 72.0 * bf * f(l) * sf * hf * hf * (1.0 + sf / (6.0 * hf) + f(v) / (12.0 * hf * f(l)));
        let ours = model_flops_per_step(&model, s, b);
        assert!((ours / megatron - 1.0).abs() < 1e-12, "{ours} vs {megatron}");
        // Full recompute: 96·B·s·L·h²·(1 + s/(6h) + V/(16Lh)).
        let full = 96.0 * bf * sf * f(l) * hf * hf * (1.0 + sf / (6.0 * hf) + f(v) / (16.0 * f(l) * hf));
        let ours = hardware_flops_per_step(&model, s, b, Recompute::Full);
        assert!((ours / full - 1.0).abs() < 1e-12, "{ours} vs {full}");
        // Selective recompute replaces s/(6h) by s/(3h).
        let selective = 72.0 * bf * f(l) * sf * hf * hf * (1.0 + sf / (3.0 * hf) + f(v) / (12.0 * hf * f(l)));
        let ours = hardware_flops_per_step(&model, s, b, Recompute::Selective);
        assert!((ours / selective - 1.0).abs() < 1e-12, "{ours} vs {selective}");
    }

    #[test]
    fn palm_convention_six_n_plus_attention() {
        // PaLM appendix B: 6N + 12·L·h·s FLOPs per token, N counting the (tied) head.
        let model = gpt(12, 768, 12, 50257);
        let (s, batch) = (1024u32, 8u32);
        let n = (f(model.n_layers()) * crate::params::layer_params(&model) as f64) + embedding_params(&model) as f64;
        let palm = f(s) * f(batch) * (6.0 * n + 12.0 * 12.0 * 768.0 * f(s));
        let ours = model_flops_per_step(&model, s, batch);
        // Norm and bias parameters are the only difference.
        assert!((ours / palm - 1.0).abs() < 1e-3, "{ours} vs {palm}");
    }
}
