use medley_spec::{MlpKind, ModelSpec, RopeScaling};
use serde::{Deserialize, Serialize};

use crate::ModelError;

/// The shape the runtime trains: a Llama-style decoder with untied input and output embeddings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub ffn_hidden: usize,
    pub vocab: usize,
    pub seq_len: usize,
    pub rope_theta: f64,
    /// Llama 3.1's rescaled frequencies, when the model has them.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    pub norm_eps: f32,
}

impl ModelConfig {
    /// The trainable config of a model spec, refusing shapes this runtime's decoder does not have.
    pub fn from_spec(model: &ModelSpec, seq_len: u32) -> Result<Self, ModelError> {
        let unsupported = |reason: &str| ModelError::Unsupported { model: model.name().into(), reason: reason.into() };
        if model.mlp() != MlpKind::SwiGlu {
            return Err(unsupported("its MLP is not SwiGLU; the runtime's decoder is Llama-style"));
        }
        if model.experts().is_some() {
            return Err(unsupported("mixture-of-experts layers are not implemented in the runtime"));
        }
        if model.tie_embeddings() {
            return Err(unsupported("tied embeddings are not implemented; pipeline stages hold them apart"));
        }
        if model.has_own_head_dim() {
            return Err(unsupported("its head size is not hidden / heads; the runtime's attention derives it"));
        }
        if model.qkv_bias() {
            return Err(unsupported("its Q, K and V projections have biases, which the runtime's decoder does not"));
        }
        if model.sliding_window().is_some() {
            return Err(unsupported("sliding-window attention is not implemented in the runtime"));
        }
        if !model.head_dim().is_multiple_of(2) {
            return Err(unsupported("rotary embeddings need an even head dimension"));
        }
        if seq_len == 0 {
            return Err(unsupported("the sequence length is 0"));
        }
        if model.vocab() < crate::data::BYTE_TOKENS {
            return Err(unsupported(&format!(
                "its vocabulary has {} tokens, fewer than the {} of the runtime's byte-level tokenizer",
                model.vocab(),
                crate::data::BYTE_TOKENS
            )));
        }
        Ok(ModelConfig {
            n_layers: model.n_layers() as usize,
            hidden: model.hidden() as usize,
            n_heads: model.n_heads() as usize,
            n_kv_heads: model.n_kv_heads() as usize,
            ffn_hidden: model.ffn_hidden() as usize,
            vocab: model.vocab() as usize,
            seq_len: seq_len as usize,
            rope_theta: model.rope_theta(),
            rope_scaling: model.rope_scaling(),
            norm_eps: model.norm_eps() as f32,
        })
    }

    pub fn head_dim(&self) -> usize {
        self.hidden / self.n_heads
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 31: a config with fewer than 256 tokens panicked in calibration, its byte-level
    /// tokens indexing past the embedding.
    #[test]
    fn a_vocabulary_below_the_byte_tokenizer_is_refused() {
        let config = |vocab: u32| {
            let text = format!(
                r#"{{"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": {vocab}}}"#
            );
            ModelConfig::from_spec(&ModelSpec::from_hf_config(&text, "config.json").unwrap(), 64)
        };
        let err = config(100).unwrap_err().to_string();
        assert!(err.contains("100") && err.contains("256"), "{err}");
        assert_eq!(config(256).unwrap().vocab, 256);
    }

    /// Issue 33: RoPE's base and scaling and the norm's ε were 10,000 and 1e-5 whatever the
    /// model said: a Llama 3.1 config trained as another model.
    #[test]
    fn the_models_rope_and_epsilon_are_what_it_trains_with() {
        let text = r#"{"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256, "rms_norm_eps": 1e-6,
            "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;
        let config = ModelConfig::from_spec(&ModelSpec::from_hf_config(text, "config.json").unwrap(), 64).unwrap();
        assert_eq!(
            (config.rope_theta, config.rope_scaling, config.norm_eps),
            (500_000.0, Some(RopeScaling::llama3(32.0)), 1e-6)
        );
    }
}
