//! Model architectures: a built-in catalog and HuggingFace `config.json` files.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{SpecError, close_names};

/// The MLP block's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MlpKind {
    /// Two matrices, h→f→h, with a GELU between (GPT-2, GPT-3).
    Gelu,
    /// Three matrices, gate and up h→f, down f→h (Llama, Mistral, Qwen2, Mixtral).
    SwiGlu,
}

impl MlpKind {
    pub fn n_matrices(self) -> u64 {
        match self {
            MlpKind::Gelu => 2,
            MlpKind::SwiGlu => 3,
        }
    }
}

/// Mixture-of-experts MLPs: each token runs `top_k` of `n_experts` expert MLPs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Experts {
    pub n_experts: u32,
    pub top_k: u32,
}

/// The largest size of any model dimension: far beyond published models, and small enough that
/// parameter and FLOP counts never overflow.
const MAX_SIZE: u32 = 1 << 24;

/// A decoder-only transformer. Invariants (held by [`ModelSpec::new`]): every size positive,
/// heads divide the hidden size, kv heads divide heads, top-k at most the expert count.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "ModelParts", into = "ModelParts")]
pub struct ModelSpec {
    parts: ModelParts,
}

impl From<ModelSpec> for ModelParts {
    fn from(model: ModelSpec) -> Self {
        model.parts
    }
}

/// The unchecked parts of a model, for [`ModelSpec::new`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelParts {
    pub name: String,
    pub n_layers: u32,
    pub hidden: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub ffn_hidden: u32,
    pub vocab: u32,
    pub mlp: MlpKind,
    pub experts: Option<Experts>,
    pub tie_embeddings: bool,
}

impl TryFrom<ModelParts> for ModelSpec {
    type Error = SpecError;
    fn try_from(parts: ModelParts) -> Result<Self, SpecError> {
        ModelSpec::new(parts, "model")
    }
}

impl ModelSpec {
    pub fn new(parts: ModelParts, source: &str) -> Result<Self, SpecError> {
        let sizes = [
            ("n_layers", parts.n_layers),
            ("hidden", parts.hidden),
            ("n_heads", parts.n_heads),
            ("n_kv_heads", parts.n_kv_heads),
            ("ffn_hidden", parts.ffn_hidden),
            ("vocab", parts.vocab),
        ];
        for (field, value) in sizes {
            if value == 0 || value > MAX_SIZE {
                return Err(SpecError::field(source, field, format!("must be between 1 and {MAX_SIZE}, got {value}")));
            }
        }
        if !parts.hidden.is_multiple_of(parts.n_heads) {
            return Err(SpecError::field(
                source,
                "n_heads",
                format!("{} heads do not divide hidden size {}", parts.n_heads, parts.hidden),
            ));
        }
        if !parts.n_heads.is_multiple_of(parts.n_kv_heads) {
            return Err(SpecError::field(
                source,
                "n_kv_heads",
                format!("{} kv heads do not divide {} heads", parts.n_kv_heads, parts.n_heads),
            ));
        }
        if let Some(experts) = parts.experts
            && (experts.top_k == 0 || experts.top_k > experts.n_experts)
        {
            return Err(SpecError::field(
                source,
                "experts",
                format!("top-k {} must be between 1 and the {} experts", experts.top_k, experts.n_experts),
            ));
        }
        Ok(ModelSpec { parts })
    }

    /// Parses a HuggingFace `config.json`: llama/mistral/qwen2/mixtral keys or gpt2 keys.
    pub fn from_hf_config(text: &str, source: &str) -> Result<Self, SpecError> {
        let config: Value = serde_json::from_str(text).map_err(|err| SpecError::Syntax {
            source_name: source.to_string(),
            line: err.line(),
            column: err.column(),
            message: err.to_string(),
        })?;
        let keys = HfKeys { config: &config, source };
        let name = config
            .get("_name_or_path")
            .and_then(Value::as_str)
            .filter(|name| !name.is_empty())
            .unwrap_or(source)
            .to_string();
        let parts = if config.get("n_layer").is_some() { keys.gpt2(name)? } else { keys.llama(name)? };
        ModelSpec::new(parts, source)
    }

    pub fn name(&self) -> &str {
        &self.parts.name
    }
    pub fn n_layers(&self) -> u32 {
        self.parts.n_layers
    }
    pub fn hidden(&self) -> u32 {
        self.parts.hidden
    }
    pub fn n_heads(&self) -> u32 {
        self.parts.n_heads
    }
    pub fn n_kv_heads(&self) -> u32 {
        self.parts.n_kv_heads
    }
    pub fn head_dim(&self) -> u32 {
        self.parts.hidden / self.parts.n_heads
    }
    pub fn ffn_hidden(&self) -> u32 {
        self.parts.ffn_hidden
    }
    pub fn vocab(&self) -> u32 {
        self.parts.vocab
    }
    pub fn mlp(&self) -> MlpKind {
        self.parts.mlp
    }
    pub fn experts(&self) -> Option<Experts> {
        self.parts.experts
    }
    pub fn tie_embeddings(&self) -> bool {
        self.parts.tie_embeddings
    }
}

struct HfKeys<'a> {
    config: &'a Value,
    source: &'a str,
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

    fn llama(&self, name: String) -> Result<ModelParts, SpecError> {
        let n_heads = self.required("num_attention_heads")?;
        let experts = match self.optional("num_local_experts")? {
            Some(n_experts) if n_experts > 1 => {
                Some(Experts { n_experts, top_k: self.optional("num_experts_per_tok")?.unwrap_or(2) })
            }
            _ => None,
        };
        // Llama-family configs use gated (SwiGLU) MLPs unless the activation says GELU without a
        // gate, as in GPT-NeoX-style configs that reuse these key names.
        let act = self.config.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        let model_type = self.config.get("model_type").and_then(Value::as_str).unwrap_or("");
        let gated_family =
            ["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "gemma", "gemma2"].contains(&model_type);
        let mlp = if act.starts_with("gelu") && !gated_family { MlpKind::Gelu } else { MlpKind::SwiGlu };
        Ok(ModelParts {
            name,
            n_layers: self.required("num_hidden_layers")?,
            hidden: self.required("hidden_size")?,
            n_heads,
            n_kv_heads: self.optional("num_key_value_heads")?.unwrap_or(n_heads),
            ffn_hidden: self.required("intermediate_size")?,
            vocab: self.required("vocab_size")?,
            mlp,
            experts,
            tie_embeddings: self.config.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
        })
    }

    fn gpt2(&self, name: String) -> Result<ModelParts, SpecError> {
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
            tie_embeddings: self.config.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(true),
        })
    }
}

#[allow(clippy::too_many_arguments)]
fn entry(
    name: &str,
    n_layers: u32,
    hidden: u32,
    n_heads: u32,
    n_kv_heads: u32,
    ffn_hidden: u32,
    vocab: u32,
    mlp: MlpKind,
    experts: Option<Experts>,
    tie_embeddings: bool,
) -> ModelParts {
    let name = name.to_string();
    ModelParts { name, n_layers, hidden, n_heads, n_kv_heads, ffn_hidden, vocab, mlp, experts, tie_embeddings }
}

use MlpKind::{Gelu, SwiGlu};

/// Shapes from each model's published `config.json` (HuggingFace model cards) or paper.
fn catalog() -> [ModelParts; 9] {
    [
        // medley's own: what the runtime trains on a CPU in minutes (byte-level vocabulary).
        entry("tiny", 8, 128, 4, 2, 352, 256, SwiGlu, None, false),
        entry("gpt2", 12, 768, 12, 12, 3072, 50257, Gelu, None, true),
        entry("llama3.2-1b", 16, 2048, 32, 8, 8192, 128256, SwiGlu, None, true),
        entry("llama3-8b", 32, 4096, 32, 8, 14336, 128256, SwiGlu, None, false),
        entry("llama3-70b", 80, 8192, 64, 8, 28672, 128256, SwiGlu, None, false),
        // Llama 3 paper (Dubey et al. 2024), Table 3.
        entry("llama3-405b", 126, 16384, 128, 8, 53248, 128256, SwiGlu, None, false),
        entry("qwen2-7b", 28, 3584, 28, 4, 18944, 152064, SwiGlu, None, false),
        // GPT-3 paper (Brown et al. 2020), Table 2.1: 96 layers, d_model 12288, 96 heads, 4x MLP.
        entry("gpt3-175b", 96, 12288, 96, 96, 49152, 50257, Gelu, None, true),
        entry("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, SwiGlu, Some(Experts { n_experts: 8, top_k: 2 }), false),
    ]
}

/// Looks a model up in the built-in catalog, case-insensitively.
pub fn catalog_model(name: &str) -> Result<ModelSpec, SpecError> {
    let wanted = name.trim().to_ascii_lowercase();
    let parts = catalog().into_iter().find(|parts| parts.name == wanted).ok_or_else(|| SpecError::Unknown {
        kind: "model",
        name: name.to_string(),
        close: close_names(&wanted, catalog_model_names().iter().map(String::as_str)),
    })?;
    ModelSpec::new(parts, "catalog")
}

pub fn catalog_model_names() -> Vec<String> {
    catalog().into_iter().map(|parts| parts.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalog_models_are_valid() {
        for name in catalog_model_names() {
            catalog_model(&name).unwrap();
        }
        assert_eq!(catalog_model("Llama3-70B").unwrap().n_layers(), 80);
        let err = catalog_model("llama3-7b").unwrap_err().to_string();
        assert!(err.contains("did you mean"), "{err}");
    }

    #[test]
    fn hf_llama_config() {
        let text = r#"{"model_type":"mixtral","num_hidden_layers":32,"hidden_size":4096,
            "num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,
            "vocab_size":32000,"num_local_experts":8,"num_experts_per_tok":2,"hidden_act":"silu"}"#;
        let model = ModelSpec::from_hf_config(text, "mixtral/config.json").unwrap();
        assert_eq!(model.experts(), Some(Experts { n_experts: 8, top_k: 2 }));
        assert_eq!(model.mlp(), MlpKind::SwiGlu);
        assert!(!model.tie_embeddings());
        assert_eq!(model, {
            let mut expected = catalog_model("mixtral-8x7b").unwrap();
            expected.parts.name = "mixtral/config.json".to_string();
            expected
        });
    }

    #[test]
    fn hf_gpt2_config_defaults_inner_to_four_h() {
        let text = r#"{"model_type":"gpt2","n_layer":12,"n_embd":768,"n_head":12,"n_inner":null,"vocab_size":50257}"#;
        let model = ModelSpec::from_hf_config(text, "gpt2.json").unwrap();
        assert_eq!((model.ffn_hidden(), model.mlp(), model.tie_embeddings()), (3072, MlpKind::Gelu, true));
    }

    #[test]
    fn hf_config_errors_name_the_key() {
        let err = ModelSpec::from_hf_config(r#"{"hidden_size":4096}"#, "c.json").unwrap_err().to_string();
        assert!(err.contains("num_attention_heads"), "{err}");
        let err = ModelSpec::from_hf_config("{\n  \"a\": ,\n}", "c.json").unwrap_err().to_string();
        assert!(err.starts_with("c.json:2:"), "{err}");
        let text =
            r#"{"num_hidden_layers":2,"hidden_size":100,"num_attention_heads":3,"intermediate_size":4,"vocab_size":5}"#;
        let err = ModelSpec::from_hf_config(text, "c.json").unwrap_err().to_string();
        assert!(err.contains("do not divide"), "{err}");
    }
}
