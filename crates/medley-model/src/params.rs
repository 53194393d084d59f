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
    pub shape: Vec<usize>,
    pub group: ParamGroup,
    pub init: Init,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Weight decay applies to matrices, not to norm gains.
    pub fn decays(&self) -> bool {
        self.shape.len() > 1
    }

    /// The seeded initial value; the same for the same seed and name everywhere.
    pub fn initial_value(&self, seed: u64) -> HostTensor {
        let data = match self.init {
            Init::Ones => vec![1.0; self.numel()],
            Init::Normal { std } => {
                let mut rng = ChaCha8Rng::seed_from_u64(seed ^ name_hash(&self.name));
                let normal = Normal::new(0.0f32, std).expect("a positive standard deviation");
                (0..self.numel()).map(|_| normal.sample(&mut rng)).collect()
            }
        };
        HostTensor::new(self.shape.clone(), data)
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
    };
    let gain = |name: String, group| ParamSpec { name, shape: vec![config.hidden], group, init: Init::Ones };
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
