//! HuggingFace `config.json` files read into a model's parts: every key that changes the size,
//! cost or math of the model is read, or the configuration is refused naming it.

use serde_json::Value;

use super::{Experts, MlpKind, ModelParts, RopeScaling};
use crate::error::{SpecError, echo};

/// The HuggingFace `model_type`s whose shape keys medley reads (DeepSeek's, to refuse what it
/// cannot represent by name); a config without one is read by the same keys.
const READ_MODEL_TYPES: [&str; 13] = [
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "deepseek_v2",
    "deepseek_v3",
];

pub(super) struct HfKeys<'a> {
    pub(super) config: &'a Value,
    pub(super) source: &'a str,
}

impl HfKeys<'_> {
    fn optional(&self, key: &str) -> Result<Option<u32>, SpecError> {
        match self.config.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => {
                value.as_u64().and_then(|value| u32::try_from(value).ok()).map(Some).ok_or_else(|| {
                    SpecError::field(self.source, key, format!("expected a positive integer, got {value}"))
                })
            }
        }
    }

    fn required(&self, key: &str) -> Result<u32, SpecError> {
        self.optional(key)?
            .ok_or_else(|| SpecError::field(self.source, key, "missing; is this a HuggingFace config.json?"))
    }

    fn flag(&self, key: &str) -> Option<bool> {
        self.config.get(key).and_then(Value::as_bool)
    }

    fn text(&self, key: &str) -> &str {
        self.config.get(key).and_then(Value::as_str).unwrap_or("")
    }

    /// The first of `keys` that is set, with its name.
    fn first_of(&self, keys: &[&'static str]) -> Result<Option<(&'static str, u32)>, SpecError> {
        for &key in keys {
            if let Some(value) = self.optional(key)? {
                return Ok(Some((key, value)));
            }
        }
        Ok(None)
    }

    pub(super) fn llama(&self, name: String) -> Result<ModelParts, SpecError> {
        let model_type = self.text("model_type");
        self.refuse_what_cannot_be_represented(model_type)?;
        let n_heads = self.required("num_attention_heads")?;
        let hidden = self.required("hidden_size")?;
        // Every model type medley reads has gated MLPs (SwiGLU, Gemma's GeGLU); a config without
        // one is gated unless its activation says GELU, as GPT-NeoX-style configs reusing these
        // key names do.
        let act = self.config.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        let gated = !model_type.is_empty() || !act.starts_with("gelu");
        let mlp = if gated { MlpKind::SwiGlu } else { MlpKind::Gelu };
        let ffn_hidden = self.required("intermediate_size")?;
        Ok(ModelParts {
            name,
            n_layers: self.required("num_hidden_layers")?,
            hidden,
            n_heads,
            n_kv_heads: self.optional("num_key_value_heads")?.unwrap_or(n_heads),
            ffn_hidden,
            vocab: self.required("vocab_size")?,
            mlp,
            experts: self.experts(ffn_hidden)?,
            // Gemma's configuration class ties them unless told otherwise; the others untie.
            tie_embeddings: self.flag("tie_word_embeddings").unwrap_or(model_type.starts_with("gemma")),
            // A head size that is just hidden / heads is kept implicit, so equal models compare equal.
            head_dim: self
                .optional("head_dim")?
                .filter(|&dim| u64::from(dim) * u64::from(n_heads) != u64::from(hidden)),
            // Qwen2's attention always has Q, K and V biases; others say so with `attention_bias`.
            qkv_bias: model_type.starts_with("qwen2") || self.flag("attention_bias") == Some(true),
            sliding_window: self.sliding_window(model_type)?,
            rope_theta: self.rope_theta(model_type)?,
            rope_scaling: self.rope_scaling()?,
            norm_eps: self.number("rms_norm_eps")?.unwrap_or(default_rms_norm_eps(model_type)),
        })
    }

    /// A number under `key` (of `rope_parameters`, transformers 5's home for RoPE's keys, when
    /// there), if set.
    fn number(&self, key: &str) -> Result<Option<f64>, SpecError> {
        let value = self.config.get("rope_parameters").and_then(|rope| rope.get(key)).or_else(|| self.config.get(key));
        match value {
            None | Some(Value::Null) => Ok(None),
            Some(value) => value
                .as_f64()
                .map(Some)
                .ok_or_else(|| SpecError::field(self.source, key, format!("expected a number, got {value}"))),
        }
    }

    fn rope_theta(&self, model_type: &str) -> Result<f64, SpecError> {
        if let Some(fraction) = self.number("partial_rotary_factor")?.filter(|&fraction| fraction != 1.0) {
            return Err(self.unrepresentable(vec![format!(
                "RoPE rotates only {fraction} of each head (`partial_rotary_factor`); medley's models rotate all of it"
            )]));
        }
        Ok(self.number("rope_theta")?.unwrap_or(default_rope_theta(model_type)))
    }

    /// `rope_scaling` (transformers 4) or the scaling keys of `rope_parameters` (5): none, or
    /// Llama 3.1's; any other kind is refused by name rather than trained as plain RoPE.
    fn rope_scaling(&self) -> Result<Option<RopeScaling>, SpecError> {
        let scaling = match (self.config.get("rope_parameters"), self.config.get("rope_scaling")) {
            (Some(parameters), _) if parameters.is_object() => parameters,
            (_, Some(scaling)) if scaling.is_object() => scaling,
            (_, None | Some(Value::Null)) => return Ok(None),
            (_, Some(other)) => {
                return Err(SpecError::field(self.source, "rope_scaling", format!("expected an object, got {other}")));
            }
        };
        let kind =
            scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(Value::as_str).unwrap_or("default");
        match kind {
            "default" => Ok(None),
            "llama3" => {
                let field = |key: &str| {
                    scaling.get(key).and_then(Value::as_f64).ok_or_else(|| {
                        SpecError::field(
                            self.source,
                            "rope_scaling",
                            format!("llama3 scaling without a number `{key}`"),
                        )
                    })
                };
                let original = scaling
                    .get("original_max_position_embeddings")
                    .and_then(Value::as_u64)
                    .and_then(|value| u32::try_from(value).ok())
                    .ok_or_else(|| {
                        SpecError::field(
                            self.source,
                            "rope_scaling",
                            "llama3 scaling without a whole `original_max_position_embeddings`",
                        )
                    })?;
                Ok(Some(RopeScaling::Llama3 {
                    factor: field("factor")?,
                    low_freq_factor: field("low_freq_factor")?,
                    high_freq_factor: field("high_freq_factor")?,
                    original_max_position_embeddings: original,
                }))
            }
            other => Err(self.unrepresentable(vec![format!(
                "its RoPE scaling is of type `{}` (`rope_scaling`); medley carries Llama 3's (`llama3`) and plain RoPE",
                echo(other)
            )])),
        }
    }

    /// Routed experts under any of the names HuggingFace models use, their own MLP size, and
    /// shared experts (`shared_expert_intermediate_size`, or DeepSeek's count of experts).
    fn experts(&self, ffn_hidden: u32) -> Result<Option<Experts>, SpecError> {
        let Some((_, n_experts)) = self.first_of(&["num_local_experts", "num_experts", "n_routed_experts"])? else {
            return Ok(None);
        };
        if n_experts <= 1 {
            return Ok(None);
        }
        let top_k = self.optional("num_experts_per_tok")?.ok_or_else(|| {
            SpecError::field(self.source, "num_experts_per_tok", "missing: how many experts does each token run?")
        })?;
        let expert_ffn = self.optional("moe_intermediate_size")?;
        let shared_ffn_hidden = match self.optional("shared_expert_intermediate_size")? {
            Some(size) => size,
            None => self.optional("n_shared_experts")?.unwrap_or(0).saturating_mul(expert_ffn.unwrap_or(ffn_hidden)),
        };
        Ok(Some(Experts {
            n_experts,
            top_k,
            ffn_hidden: expert_ffn.filter(|&size| size != ffn_hidden),
            shared_ffn_hidden,
        }))
    }

    /// The window every layer attends within, if any: `layer_types` when given, else Qwen2's
    /// `use_sliding_window` and `max_window_layers`, else `sliding_window` alone (Mistral).
    fn sliding_window(&self, model_type: &str) -> Result<Option<u32>, SpecError> {
        let n_layers = self.required("num_hidden_layers")?;
        // HuggingFace's MistralConfig windows 4096 tokens when the key is absent (null: none).
        let window = match self.config.get("sliding_window") {
            None if model_type == "mistral" => Some(4096),
            _ => self.optional("sliding_window")?,
        };
        let windowed_layers = match self.config.get("layer_types").and_then(Value::as_array) {
            Some(types) => types.iter().filter(|kind| kind.as_str() == Some("sliding_attention")).count() as u32,
            // Qwen's configurations window only with `use_sliding_window`, and then the layers
            // from `max_window_layers` on.
            None if model_type.starts_with("qwen") => match self.flag("use_sliding_window") {
                Some(true) => n_layers.saturating_sub(self.optional("max_window_layers")?.unwrap_or(0)),
                _ => 0,
            },
            None if self.flag("use_sliding_window") == Some(false) => 0,
            None => n_layers,
        };
        match (window, windowed_layers) {
            (_, 0) | (None, _) => Ok(None),
            (Some(window), windowed) if windowed >= n_layers => Ok(Some(window)),
            (Some(window), windowed) => Err(self.unrepresentable(vec![format!(
                "{windowed} of its {n_layers} layers attend within a sliding window of {window} tokens and the others to \
                 every token (`layer_types`, `max_window_layers`), but medley's layers are all alike"
            )])),
        }
    }

    /// Refuses configurations whose size or cost medley's model would get wrong.
    fn refuse_what_cannot_be_represented(&self, model_type: &str) -> Result<(), SpecError> {
        let mut reasons = Vec::new();
        if !model_type.is_empty() && !READ_MODEL_TYPES.contains(&model_type) {
            reasons.push(format!(
                "its `model_type` `{}` is not one whose keys medley reads ({})",
                echo(model_type),
                READ_MODEL_TYPES.join(", ")
            ));
        }
        let layer_types = self.config.get("layer_types").and_then(Value::as_array).into_iter().flatten();
        let mut other_layers: Vec<&str> = layer_types
            .filter_map(Value::as_str)
            .filter(|kind| !["full_attention", "sliding_attention"].contains(kind))
            .collect();
        other_layers.dedup();
        if !other_layers.is_empty() {
            let other_layers: Vec<String> = other_layers.iter().map(|kind| echo(kind).to_string()).collect();
            reasons.push(format!("some of its layers are `{}` (`layer_types`)", other_layers.join("`, `")));
        }
        let latent: Vec<&str> = ["q_lora_rank", "kv_lora_rank"]
            .into_iter()
            .filter(|key| self.config.get(*key).is_some_and(|value| !value.is_null()))
            .collect();
        if !latent.is_empty() {
            reasons.push(format!("multi-head latent attention (`{}`)", latent.join("`, `")));
        }
        if let Some(dense) = self.optional("first_k_dense_replace")?.filter(|&n| n > 0) {
            reasons.push(format!("its first {dense} layers are dense and the rest experts (`first_k_dense_replace`)"));
        }
        for key in ["decoder_sparse_step", "moe_layer_freq"] {
            if let Some(step) = self.optional(key)?.filter(|&step| step > 1) {
                reasons.push(format!("only every {step}th layer has experts (`{key}`)"));
            }
        }
        if self.config.get("mlp_only_layers").and_then(Value::as_array).is_some_and(|layers| !layers.is_empty()) {
            reasons.push("some layers are dense and the rest experts (`mlp_only_layers`)".into());
        }
        if self.flag("mlp_bias") == Some(true) {
            reasons.push("its MLP projections have biases (`mlp_bias`)".into());
        }
        if model_type.starts_with("gemma")
            && self.optional("sliding_window")?.is_some()
            && self.config.get("layer_types").is_none()
        {
            reasons.push("its layers alternate between sliding-window and global attention (`sliding_window`)".into());
        }
        if reasons.is_empty() { Ok(()) } else { Err(self.unrepresentable(reasons)) }
    }

    fn unrepresentable(&self, reasons: Vec<String>) -> SpecError {
        SpecError::Unrepresentable { source_name: self.source.to_string(), reasons }
    }

    pub(super) fn gpt2(&self, name: String) -> Result<ModelParts, SpecError> {
        let hidden = self.required("n_embd")?;
        let n_heads = self.required("n_head")?;
        Ok(ModelParts {
            name,
            n_layers: self.required("n_layer")?,
            hidden,
            n_heads,
            n_kv_heads: n_heads,
            ffn_hidden: self.optional("n_inner")?.unwrap_or(hidden.saturating_mul(4)),
            vocab: self.required("vocab_size")?,
            mlp: MlpKind::Gelu,
            experts: None,
            tie_embeddings: self.flag("tie_word_embeddings").unwrap_or(true),
            norm_eps: self.number("layer_norm_epsilon")?.unwrap_or(1e-5),
            ..ModelParts::default()
        })
    }
}

/// RoPE's base when a config leaves it out: its transformers configuration class's default.
fn default_rope_theta(model_type: &str) -> f64 {
    match model_type {
        "mixtral" | "gemma3_text" => 1e6,
        _ => 10_000.0,
    }
}

/// RMSNorm's ε when a config leaves it out: its transformers configuration class's default.
fn default_rms_norm_eps(model_type: &str) -> f64 {
    match model_type {
        "mixtral" | "phi3" => 1e-5,
        _ => 1e-6,
    }
}
