//! Model architectures: a built-in catalog and HuggingFace `config.json` files.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{SpecError, check_name, close_names};

mod hf_config;
use hf_config::HfKeys;

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

/// A rescaling of RoPE's frequencies for contexts longer than pre-training's, as HuggingFace's
/// `rope_scaling` names it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum RopeScaling {
    /// Llama 3.1's: wavelengths longer than `original_max_position_embeddings / low_freq_factor`
    /// are stretched by `factor`, those shorter than `.. / high_freq_factor` kept, and those
    /// between interpolated.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: u32 },
}

impl RopeScaling {
    /// Llama 3.1's published values with `factor` (8 for 8B–405B, 32 for Llama 3.2's 1B and 3B).
    pub fn llama3(factor: f64) -> RopeScaling {
        RopeScaling::Llama3 {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }
    }

    /// The inverse frequencies of a head of `head_dim` with base `theta`, rescaled: what both
    /// the runtime's rotary tables and an exporter's check are computed from.
    pub fn inverse_frequencies(scaling: Option<RopeScaling>, theta: f64, head_dim: u32) -> Vec<f64> {
        let half = head_dim / 2;
        let base = (0..half).map(|i| theta.powf(-2.0 * f64::from(i) / f64::from(head_dim)));
        match scaling {
            None => base.collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let old_context = f64::from(original_max_position_embeddings);
                let (low_freq_wavelen, high_freq_wavelen) =
                    (old_context / low_freq_factor, old_context / high_freq_factor);
                base.map(|freq| {
                    let wavelen = 2.0 * std::f64::consts::PI / freq;
                    if wavelen < high_freq_wavelen {
                        freq
                    } else if wavelen > low_freq_wavelen {
                        freq / factor
                    } else {
                        let smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    }
                })
                .collect()
            }
        }
    }
}

/// RoPE's base in plans written before the model carried it: what the runtime then trained.
fn default_rope_theta() -> f64 {
    10_000.0
}

/// The normalisation's ε in plans written before the model carried it: what the runtime then
/// trained.
fn default_norm_eps() -> f64 {
    1e-5
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
    /// RoPE's base θ. Read by rotary models (those with gated MLPs); GELU models have learned
    /// positions.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// The ε of every normalisation (RMSNorm; LayerNorm in GELU models).
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
}

impl Default for ModelParts {
    fn default() -> Self {
        ModelParts {
            name: String::new(),
            n_layers: 0,
            hidden: 0,
            n_heads: 0,
            n_kv_heads: 0,
            ffn_hidden: 0,
            vocab: 0,
            mlp: MlpKind::default(),
            experts: None,
            tie_embeddings: false,
            head_dim: None,
            qkv_bias: false,
            sliding_window: None,
            rope_theta: default_rope_theta(),
            rope_scaling: None,
            norm_eps: default_norm_eps(),
        }
    }
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

/// RoPE's base, its scaling and the norm's ε: finite, positive, and within what any model uses.
fn check_numerics(parts: &ModelParts, source: &str) -> Result<(), SpecError> {
    if !(parts.rope_theta.is_finite() && (1.0..=1e12).contains(&parts.rope_theta)) {
        return Err(SpecError::field(
            source,
            "rope_theta",
            format!("must be between 1 and 1e12, got {}", parts.rope_theta),
        ));
    }
    if !(parts.norm_eps.is_finite() && parts.norm_eps > 0.0 && parts.norm_eps < 1.0) {
        return Err(SpecError::field(
            source,
            "norm_eps",
            format!("must be above 0 and below 1, got {}", parts.norm_eps),
        ));
    }
    if let Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) =
        parts.rope_scaling
    {
        let ordered = 0.0 < low_freq_factor && low_freq_factor < high_freq_factor && high_freq_factor.is_finite();
        if !(factor.is_finite() && factor >= 1.0 && ordered && original_max_position_embeddings > 0) {
            return Err(SpecError::field(
                source,
                "rope_scaling",
                format!(
                    "llama3 scaling wants factor ≥ 1, 0 < low_freq_factor < high_freq_factor and a positive \
                     original_max_position_embeddings; got factor {factor}, low {low_freq_factor}, high \
                     {high_freq_factor}, original {original_max_position_embeddings}"
                ),
            ));
        }
    }
    Ok(())
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
        check_numerics(&parts, source)?;
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
    /// RoPE's base θ (rotary models).
    pub fn rope_theta(&self) -> f64 {
        self.parts.rope_theta
    }
    pub fn rope_scaling(&self) -> Option<RopeScaling> {
        self.parts.rope_scaling
    }
    pub fn norm_eps(&self) -> f64 {
        self.parts.norm_eps
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

/// A Llama 3.1-style model: RoPE base 500,000 with llama3 scaling by `factor`, RMSNorm ε 1e-5.
fn llama3(factor: f64, parts: ModelParts) -> ModelParts {
    ModelParts { rope_theta: 500_000.0, rope_scaling: Some(RopeScaling::llama3(factor)), norm_eps: 1e-5, ..parts }
}

/// Shapes and numerics from each model's published `config.json` (HuggingFace model cards) or
/// paper.
fn catalog() -> [ModelParts; 9] {
    [
        // medley's own: what the runtime trains on a CPU in minutes (byte-level vocabulary).
        entry("tiny", 8, 128, 4, 2, 352, 256, SwiGlu, None, false),
        entry("gpt2", 12, 768, 12, 12, 3072, 50257, Gelu, None, true),
        // meta-llama/Llama-3.2-1B.
        llama3(32.0, entry("llama3.2-1b", 16, 2048, 32, 8, 8192, 128256, SwiGlu, None, true)),
        // meta-llama/Llama-3.1-8B and -70B: Llama 3's shapes with 3.1's long-context RoPE.
        llama3(8.0, entry("llama3-8b", 32, 4096, 32, 8, 14336, 128256, SwiGlu, None, false)),
        llama3(8.0, entry("llama3-70b", 80, 8192, 64, 8, 28672, 128256, SwiGlu, None, false)),
        // Llama 3 paper (Dubey et al. 2024), Table 3; meta-llama/Llama-3.1-405B.
        llama3(8.0, entry("llama3-405b", 126, 16384, 128, 8, 53248, 128256, SwiGlu, None, false)),
        ModelParts {
            qkv_bias: true,
            rope_theta: 1e6,
            norm_eps: 1e-6,
            ..entry("qwen2-7b", 28, 3584, 28, 4, 18944, 152064, SwiGlu, None, false)
        },
        // GPT-3 paper (Brown et al. 2020), Table 2.1: 96 layers, d_model 12288, 96 heads, 4x MLP.
        entry("gpt3-175b", 96, 12288, 96, 96, 49152, 50257, Gelu, None, true),
        ModelParts {
            rope_theta: 1e6,
            ..entry(
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
            )
        },
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
