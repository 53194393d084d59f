//! Parameter names, shapes and seeded initial values.
//!
//! Every stage lists its parameters in one canonical order: the token embedding (first stage),
//! each layer's nine tensors, then the final norm and the output head (last stage). A
//! parameter's initial value depends only on the seed and its name, so a layer starts from the
//! same weights whichever stage or plan holds it.

use std::ops::Range;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use serde::{Deserialize, Serialize};

use crate::{HostTensor, ModelConfig};

/// Standard deviation of the initial weights (GPT-2's); output projections are scaled further.
const INIT_STD: f32 = 0.02;

/// Which part of the model a parameter belongs to; data-parallel all-reduces select by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ParamGroup {
    Embedding,
    Layer(usize),
    Head,
}

/// How a parameter starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Ones,
    Normal { std: f32 },
}

#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    /// The shape this rank holds: the shard's under tensor parallelism.
    pub shape: Vec<usize>,
    pub group: ParamGroup,
    pub init: Init,
    /// Under tensor parallelism, the part of the whole parameter this rank holds.
    pub shard: Option<Shard>,
}

/// A rank's part of a parameter split over a tensor-parallel group: indices `range` of
/// dimension `dim` of the whole `full_shape`.
#[derive(Clone, Debug, PartialEq)]
pub struct Shard {
    pub full_shape: Vec<usize>,
    pub dim: usize,
    pub range: Range<usize>,
    /// Whether other members hold the same elements (norm gains; KV heads when the group is
    /// larger than their count): each member's gradient is then a part of the sum.
    pub replicated: bool,
}

impl Shard {
    /// Elements of the whole tensor per index of `dim`, and how many indices come before.
    fn strides(&self) -> (usize, usize) {
        let inner: usize = self.full_shape[self.dim + 1..].iter().product();
        let outer: usize = self.full_shape[..self.dim].iter().product();
        (inner, outer)
    }

    /// This shard of `full`, a tensor of the whole shape.
    pub fn slice(&self, full: &[f32]) -> Vec<f32> {
        let (inner, outer) = self.strides();
        let row = self.full_shape[self.dim] * inner;
        let (start, end) = (self.range.start * inner, self.range.end * inner);
        (0..outer).flat_map(|o| &full[o * row + start..o * row + end]).copied().collect()
    }

    /// Writes `part`, this shard's elements, into `full`, a tensor of the whole shape.
    pub fn place(&self, part: &[f32], full: &mut [f32]) {
        let (inner, outer) = self.strides();
        let row = self.full_shape[self.dim] * inner;
        let width = self.range.len() * inner;
        for (o, chunk) in (0..outer).zip(part.chunks(width)) {
            let at = o * row + self.range.start * inner;
            full[at..at + width].copy_from_slice(chunk);
        }
    }

    pub fn full_numel(&self) -> usize {
        self.full_shape.iter().product()
    }
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Weight decay applies to matrices, not to norm gains.
    pub fn decays(&self) -> bool {
        self.shape.len() > 1
    }

    /// The seeded initial value; the same for the same seed and name everywhere (a shard's is
    /// its part of the whole parameter's).
    pub fn initial_value(&self, seed: u64) -> HostTensor {
        let numel = self.full_numel();
        let data = match self.init {
            Init::Ones => vec![1.0; numel],
            Init::Normal { std } => {
                let mut rng = ChaCha8Rng::seed_from_u64(seed ^ name_hash(&self.name));
                let normal = Normal::new(0.0f32, std).expect("a positive standard deviation");
                (0..numel).map(|_| normal.sample(&mut rng)).collect()
            }
        };
        let data = match &self.shard {
            Some(shard) => shard.slice(&data),
            None => data,
        };
        HostTensor::new(self.shape.clone(), data)
    }

    /// The whole parameter's shape.
    pub fn full_shape(&self) -> &[usize] {
        self.shard.as_ref().map_or(&self.shape, |shard| &shard.full_shape)
    }

    /// Elements of the whole parameter.
    pub fn full_numel(&self) -> usize {
        self.full_shape().iter().product()
    }
}

/// FNV-1a: a stable hash, unlike std's, so seeds mean the same thing in every build.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3))
}

/// The tensors of one decoder layer, in canonical order.
pub const LAYER_TENSORS: [&str; 9] = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"];

/// The parameters of a stage holding `layers`, in canonical order. The first stage (layers start
/// at 0) holds the embedding, the last (layers end at `n_layers`) the final norm and head.
pub fn stage_params(config: &ModelConfig, layers: Range<usize>) -> Vec<ParamSpec> {
    let mut specs = Vec::new();
    let matrix = |name: String, shape: [usize; 2], group, std| ParamSpec {
        name,
        shape: shape.to_vec(),
        group,
        init: Init::Normal { std },
        shard: None,
    };
    let gain =
        |name: String, group| ParamSpec { name, shape: vec![config.hidden], group, init: Init::Ones, shard: None };
    if layers.start == 0 {
        specs.push(matrix("embed".into(), [config.vocab, config.hidden], ParamGroup::Embedding, INIT_STD));
    }
    let residual_std = INIT_STD / (2.0 * config.n_layers as f32).sqrt();
    let (d, kv, f) = (config.hidden, config.kv_dim(), config.ffn_hidden);
    for layer in layers.clone() {
        let group = ParamGroup::Layer(layer);
        let name = |tensor: &str| format!("layers.{layer}.{tensor}");
        specs.push(gain(name("attn_norm"), group));
        specs.push(matrix(name("wq"), [d, d], group, INIT_STD));
        specs.push(matrix(name("wk"), [d, kv], group, INIT_STD));
        specs.push(matrix(name("wv"), [d, kv], group, INIT_STD));
        specs.push(matrix(name("wo"), [d, d], group, residual_std));
        specs.push(gain(name("mlp_norm"), group));
        specs.push(matrix(name("w_gate"), [d, f], group, INIT_STD));
        specs.push(matrix(name("w_up"), [d, f], group, INIT_STD));
        specs.push(matrix(name("w_down"), [f, d], group, residual_std));
    }
    if layers.end == config.n_layers {
        specs.push(gain("final_norm".into(), ParamGroup::Head));
        specs.push(matrix("lm_head".into(), [config.hidden, config.vocab], ParamGroup::Head, INIT_STD));
    }
    specs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ModelConfig {
        let spec = medley_spec::catalog_model("tiny").unwrap();
        ModelConfig::from_spec(&spec, 32).unwrap()
    }

    #[test]
    fn stages_partition_the_model_parameters() {
        let config = config();
        let whole = stage_params(&config, 0..config.n_layers);
        let split: Vec<_> =
            [0..3, 3..5, 5..config.n_layers].into_iter().flat_map(|r| stage_params(&config, r)).collect();
        assert_eq!(whole, split);
        assert_eq!(whole.len(), 2 + 9 * config.n_layers + 1);
    }

    #[test]
    fn initial_values_depend_on_seed_and_name_only() {
        let config = config();
        let a = &stage_params(&config, 0..2)[2];
        let b = &stage_params(&config, 0..config.n_layers)[2];
        assert_eq!(a.initial_value(7), b.initial_value(7));
        assert_ne!(a.initial_value(7), a.initial_value(8));
        let other = &stage_params(&config, 0..2)[3];
        assert_ne!(a.initial_value(7).data[..8], other.initial_value(7).data[..8]);
    }
}
