//! Model architectures: a built-in catalog and HuggingFace `config.json` files.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{SpecError, check_name, close_names, echo};

/// The MLP block's shape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MlpKind {
    /// Two matrices, h→f→h, with a GELU between (GPT-2, GPT-3).
    Gelu,
    /// Three matrices, gate and up h→f, down f→h (Llama, Mistral, Qwen2, Mixtral).
    #[default]
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

/// Mixture-of-experts MLPs: each token runs `top_k` of `n_experts` routed expert MLPs, and
/// every shared expert (Qwen-MoE, DeepSeekMoE).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Experts {
    pub n_experts: u32,
    pub top_k: u32,
    /// One routed expert's MLP hidden size, when it is not the model's `ffn_hidden`
    /// (HuggingFace `moe_intermediate_size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ffn_hidden: Option<u32>,
    /// The shared experts' MLP hidden sizes summed (0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shared_ffn_hidden: u32,
}

fn is_zero(value: &u32) -> bool {
    *value == 0
}

fn is_false(value: &bool) -> bool {
    !*value
}

/// The largest size of any model dimension: far beyond published models.
const MAX_SIZE: u32 = 1 << 24;

/// The most parameters a model may have: a thousand times the largest published dense models, and
/// far enough below `u64::MAX` that parameter, byte and FLOP counts never overflow.
pub const MAX_PARAMS: f64 = 1e15;

/// The most routed experts.
const MAX_EXPERTS: u32 = 1 << 16;

/// A decoder-only transformer, every layer alike. Invariants (held by [`ModelSpec::new`]): every
/// size positive, heads divide the hidden size unless the head size is given, kv heads divide
/// heads, top-k at most the expert count.
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

/// The unchecked parts of a model, for [`ModelSpec::new`]. Fields added after plan schema v1
/// default to what older plans meant.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
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
    /// One attention head's size, when it is not `hidden / n_heads` (Mistral-Nemo's 128 at
    /// hidden 5120 and 32 heads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<u32>,
    /// The Q, K and V projections have biases (Qwen2).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qkv_bias: bool,
    /// Every layer attends to at most this many tokens back (Mistral 7B's sliding window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<u32>,
}

impl TryFrom<ModelParts> for ModelSpec {
    type Error = SpecError;
    fn try_from(parts: ModelParts) -> Result<Self, SpecError> {
        ModelSpec::new(parts, "model")
    }
}

/// A bound above the parameter count of `parts` (every matrix of attention and MLP, every expert,
/// the embedding and an untied head), in floating point so that it cannot overflow.
fn params_upper_bound(parts: &ModelParts) -> f64 {
    let hidden = f64::from(parts.hidden);
    let head_dim = f64::from(parts.head_dim.unwrap_or(parts.hidden / parts.n_heads.max(1)));
    let attention = hidden * head_dim * f64::from(2 * parts.n_heads + 2 * parts.n_kv_heads);
    let (n_experts, expert_ffn, shared) = match parts.experts {
        Some(experts) => (
            f64::from(experts.n_experts),
            f64::from(experts.ffn_hidden.unwrap_or(parts.ffn_hidden)),
            f64::from(experts.shared_ffn_hidden),
        ),
        None => (1.0, f64::from(parts.ffn_hidden), 0.0),
    };
    let mlp = 3.0 * hidden * (n_experts * expert_ffn + shared);
    f64::from(parts.n_layers) * (attention + mlp) + 2.0 * f64::from(parts.vocab) * hidden
}

impl ModelSpec {
    pub fn new(parts: ModelParts, source: &str) -> Result<Self, SpecError> {
        check_name(source, "name", &parts.name)?;
        let sizes = [
            ("n_layers", parts.n_layers),
            ("hidden", parts.hidden),
            ("n_heads", parts.n_heads),
            ("n_kv_heads", parts.n_kv_heads),
            ("ffn_hidden", parts.ffn_hidden),
            ("vocab", parts.vocab),
        ];
        let optional_sizes = [
            ("head_dim", parts.head_dim),
            ("sliding_window", parts.sliding_window),
            ("experts.ffn_hidden", parts.experts.and_then(|experts| experts.ffn_hidden)),
        ];
        let given = optional_sizes.into_iter().filter_map(|(field, value)| value.map(|value| (field, value)));
        for (field, value) in sizes.into_iter().chain(given) {
            if value == 0 || value > MAX_SIZE {
                return Err(SpecError::field(source, field, format!("must be between 1 and {MAX_SIZE}, got {value}")));
            }
        }
        if parts.head_dim.is_none() && !parts.hidden.is_multiple_of(parts.n_heads) {
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
            && experts.shared_ffn_hidden > MAX_SIZE
        {
            return Err(SpecError::field(source, "experts.shared_ffn_hidden", format!("must be at most {MAX_SIZE}")));
        }
        if let Some(experts) = parts.experts
            && experts.n_experts > MAX_EXPERTS
        {
            return Err(SpecError::field(source, "experts.n_experts", format!("must be at most {MAX_EXPERTS}")));
        }
        let params = params_upper_bound(&parts);
        if params > MAX_PARAMS {
            return Err(SpecError::field(
                source,
                "n_layers",
                format!("these sizes make about {params:.1e} parameters, beyond the {MAX_PARAMS:.0e} medley models"),
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
    /// One attention head's size.
    pub fn head_dim(&self) -> u32 {
        self.parts.head_dim.unwrap_or(self.parts.hidden / self.parts.n_heads)
    }
    /// Whether the head size was given apart from the hidden size and differs from
    /// `hidden / n_heads`.
    pub fn has_own_head_dim(&self) -> bool {
        self.parts.head_dim.is_some()
    }
    /// The width of the queries (and of the attention output): heads × head size.
    pub fn q_width(&self) -> u64 {
        u64::from(self.parts.n_heads) * u64::from(self.head_dim())
    }
    /// The width of the keys, and of the values.
    pub fn kv_width(&self) -> u64 {
        u64::from(self.parts.n_kv_heads) * u64::from(self.head_dim())
    }
    pub fn qkv_bias(&self) -> bool {
        self.parts.qkv_bias
    }
    pub fn sliding_window(&self) -> Option<u32> {
        self.parts.sliding_window
    }
    /// The MLP hidden sizes a layer stores, summed: every expert's (routed and shared), or the
    /// dense MLP's.
    pub fn stored_ffn_width(&self) -> u64 {
        match self.parts.experts {
            Some(experts) => {
                u64::from(experts.n_experts) * u64::from(self.expert_ffn_hidden())
                    + u64::from(experts.shared_ffn_hidden)
            }
            None => u64::from(self.parts.ffn_hidden),
        }
    }
    /// The MLP hidden sizes one token runs through, summed: its top-k routed experts and the
    /// shared ones, or the dense MLP.
    pub fn active_ffn_width(&self) -> u64 {
        match self.parts.experts {
            Some(experts) => {
                u64::from(experts.top_k) * u64::from(self.expert_ffn_hidden()) + u64::from(experts.shared_ffn_hidden)
            }
            None => u64::from(self.parts.ffn_hidden),
        }
    }
    /// One routed expert's MLP hidden size (the dense size for a dense model).
    fn expert_ffn_hidden(&self) -> u32 {
        self.parts.experts.and_then(|experts| experts.ffn_hidden).unwrap_or(self.parts.ffn_hidden)
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

    fn llama(&self, name: String) -> Result<ModelParts, SpecError> {
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
        })
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
            tie_embeddings: self.flag("tie_word_embeddings").unwrap_or(true),
            ..ModelParts::default()
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
    ModelParts {
        name,
        n_layers,
        hidden,
        n_heads,
        n_kv_heads,
        ffn_hidden,
        vocab,
        mlp,
        experts,
        tie_embeddings,
        ..ModelParts::default()
    }
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
        ModelParts { qkv_bias: true, ..entry("qwen2-7b", 28, 3584, 28, 4, 18944, 152064, SwiGlu, None, false) },
        // GPT-3 paper (Brown et al. 2020), Table 2.1: 96 layers, d_model 12288, 96 heads, 4x MLP.
        entry("gpt3-175b", 96, 12288, 96, 96, 49152, 50257, Gelu, None, true),
        entry(
            "mixtral-8x7b",
            32,
            4096,
            32,
            8,
            14336,
            32000,
            SwiGlu,
            Some(Experts { n_experts: 8, top_k: 2, ..Experts::default() }),
            false,
        ),
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
mod tests;
