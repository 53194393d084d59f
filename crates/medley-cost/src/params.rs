//! Parameter counts of a decoder-only transformer.

use medley_spec::ModelSpec;

fn u(value: u32) -> u64 {
    u64::from(value)
}

/// Q, K, V and output projections (and the Q, K, V biases where the model has them); grouped-query
/// attention shrinks K and V by kv heads / heads.
pub fn attention_params(model: &ModelSpec) -> u64 {
    let hidden = u(model.hidden());
    let (q_width, kv_width) = (model.q_width(), model.kv_width());
    let biases = if model.qkv_bias() { q_width + 2 * kv_width } else { 0 };
    2 * hidden * q_width + 2 * hidden * kv_width + biases
}

/// Every MLP's matrices — each expert's, routed and shared — plus the router.
pub fn mlp_params(model: &ModelSpec) -> u64 {
    let matrices = model.mlp().n_matrices() * u(model.hidden()) * model.stored_ffn_width();
    let router = model.experts().map_or(0, |experts| u(model.hidden()) * u(experts.n_experts));
    matrices + router
}

/// One transformer layer: attention, MLP and its two norms.
pub fn layer_params(model: &ModelSpec) -> u64 {
    attention_params(model) + mlp_params(model) + 2 * u(model.hidden())
}

pub fn embedding_params(model: &ModelSpec) -> u64 {
    u(model.vocab()) * u(model.hidden())
}

/// The final norm and the output projection. A tied head shares the embedding's matrix, but a
/// pipeline whose first and last stages differ keeps a copy on each (as Megatron-LM does).
pub fn head_params(model: &ModelSpec) -> u64 {
    u(model.vocab()) * u(model.hidden()) + u(model.hidden())
}

/// Every distinct parameter of the model.
pub fn total_params(model: &ModelSpec) -> u64 {
    let untied_head = if model.tie_embeddings() { u(model.hidden()) } else { head_params(model) };
    u(model.n_layers()) * layer_params(model) + embedding_params(model) + untied_head
}

/// Parameters one token runs through: a mixture of experts activates `top_k` of its routed
/// experts (and every shared one).
pub fn active_params(model: &ModelSpec) -> u64 {
    let inactive_width = model.stored_ffn_width() - model.active_ffn_width();
    total_params(model) - model.mlp().n_matrices() * u(model.hidden()) * inactive_width * u(model.n_layers())
}

#[cfg(test)]
mod tests {
    use super::*;
    use medley_spec::catalog_model;

    fn billions(params: u64) -> f64 {
        params as f64 / 1e9
    }

    #[test]
    fn published_parameter_counts() {
        // Published sizes: Llama 3 8B 8.03B, 70B 70.6B, 405B 405.9B; Mixtral 46.7B total, 12.9B
        // active; GPT-3 175B; GPT-2 124M.
        for (name, total, active) in [
            ("llama3-8b", 8.03, 8.03),
            ("llama3-70b", 70.55, 70.55),
            ("llama3-405b", 405.9, 405.9),
            ("mixtral-8x7b", 46.7, 12.9),
            ("gpt3-175b", 174.6, 174.6),
            ("gpt2", 0.124, 0.124),
        ] {
            let model = catalog_model(name).unwrap();
            let (got_total, got_active) = (billions(total_params(&model)), billions(active_params(&model)));
            assert!((got_total / total - 1.0).abs() < 0.01, "{name}: {got_total} vs {total}");
            assert!((got_active / active - 1.0).abs() < 0.01, "{name}: {got_active} vs {active}");
        }
    }
}
