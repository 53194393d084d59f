//! Tensor parallelism with sequence parallelism, Megatron-LM's form: where one device of a
//! tensor-parallel group stands, its shards of the stage's parameters, and the collectives its
//! passes run.
//!
//! A member holds a contiguous run of each sequence's positions (sequence parallelism) between
//! blocks. Each attention and MLP block all-gathers the run into whole sequences, computes its
//! share — query heads and the KV heads they read (column-parallel Q, K, V; row-parallel output
//! projection), FFN columns (column-parallel gate and up, row-parallel down) — and
//! reduce-scatters the partial sums back to the runs. The embedding is split by vocabulary rows
//! and reduce-scattered; the output head by vocabulary columns, with a cross-entropy that
//! all-reduces each token's maximum, normaliser and target logit across the group.

use std::ops::Range;

use crate::params::{Shard, stage_params};
use crate::{ModelConfig, ModelError, ParamSpec};

/// Member `member` of a tensor-parallel group of `size` devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorSeat {
    pub member: usize,
    pub size: usize,
}

/// Indices `0..total` split into `size` contiguous runs as even as whole indices allow: run
/// `member`.
pub fn even_run(total: usize, member: usize, size: usize) -> Range<usize> {
    member * total / size..(member + 1) * total / size
}

impl TensorSeat {
    /// Member `member` of `size`, checked against the model: the query heads split evenly, the KV
    /// heads too or each read by whole members (Megatron's rule), and every member has FFN
    /// columns and vocabulary rows.
    pub fn new(config: &ModelConfig, member: usize, size: usize) -> Result<TensorSeat, ModelError> {
        let (heads, kv) = (config.n_heads, config.n_kv_heads);
        let bad = |reason: String| Err(ModelError::TensorParallel(reason));
        if size == 0 || member >= size {
            return bad(format!("no member {member} of a group of {size}"));
        }
        if !heads.is_multiple_of(size) || !(kv.is_multiple_of(size) || size.is_multiple_of(kv)) {
            return bad(format!(
                "{size} devices cannot split {heads} query heads and {kv} KV heads: the heads, and the KV heads or \
                 the devices per KV head, must divide evenly"
            ));
        }
        if config.ffn_hidden < size || config.vocab < size || config.seq_len < size {
            return bad(format!("{size} devices are more than the model's FFN columns, vocabulary or sequence"));
        }
        Ok(TensorSeat { member, size })
    }

    pub fn q_heads(&self, config: &ModelConfig) -> Range<usize> {
        even_run(config.n_heads, self.member, self.size)
    }

    /// The KV heads this member's query heads read: a share of them, or one shared with the
    /// other members whose query heads read it.
    pub fn kv_heads(&self, config: &ModelConfig) -> Range<usize> {
        let q = self.q_heads(config);
        let per_kv = config.n_heads / config.n_kv_heads;
        q.start / per_kv..(q.end - 1) / per_kv + 1
    }

    fn kv_shared(&self, config: &ModelConfig) -> bool {
        self.size > config.n_kv_heads
    }

    pub fn ffn_columns(&self, config: &ModelConfig) -> Range<usize> {
        even_run(config.ffn_hidden, self.member, self.size)
    }

    pub fn vocab_rows(&self, config: &ModelConfig) -> Range<usize> {
        even_run(config.vocab, self.member, self.size)
    }

    /// Every member's run of a sequence of `seq` positions, in member order.
    pub fn sequence_runs(&self, seq: usize) -> Vec<Range<usize>> {
        (0..self.size).map(|member| even_run(seq, member, self.size)).collect()
    }

    /// This member's shards of the parameters of a stage holding `layers`, in canonical order.
    pub fn stage_params(&self, config: &ModelConfig, layers: Range<usize>) -> Vec<ParamSpec> {
        let hd = config.head_dim();
        let heads = |range: Range<usize>| range.start * hd..range.end * hd;
        stage_params(config, layers)
            .into_iter()
            .map(|spec| {
                let tensor = spec.name.rsplit('.').next().unwrap_or_default();
                let (dim, range, replicated) = match tensor {
                    "embed" => (0, self.vocab_rows(config), false),
                    "lm_head" => (1, self.vocab_rows(config), false),
                    "wq" => (1, heads(self.q_heads(config)), false),
                    "wk" | "wv" => (1, heads(self.kv_heads(config)), self.kv_shared(config)),
                    "wo" => (0, heads(self.q_heads(config)), false),
                    "w_gate" | "w_up" => (1, self.ffn_columns(config), false),
                    "w_down" => (0, self.ffn_columns(config), false),
                    _ => (0, 0..spec.shape[0], true),
                };
                let full_shape = spec.shape.clone();
                let mut shape = spec.shape.clone();
                shape[dim] = range.len();
                ParamSpec { shape, shard: Some(Shard { full_shape, dim, range, replicated }), ..spec }
            })
            .collect()
    }
}

/// How an all-reduce combines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Combine {
    Sum,
    Max,
}

/// The collectives a tensor-parallel member's passes run over its group; the runtime implements
/// them over its communicators, tests in memory. Every member calls each with the same counts.
pub trait TensorCollectives: Send {
    /// All-gather-v: member j contributes `counts[j]` elements; the result is every member's, in
    /// member order.
    fn all_gather(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError>;

    /// Reduce-scatter-v (sum): this member's `counts[member]` elements of the sum of every
    /// member's `input`, whose parts are in member order.
    fn reduce_scatter(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError>;

    /// All-reduce in place.
    fn all_reduce(&mut self, values: &mut [f32], combine: Combine) -> Result<(), ModelError>;
}

/// `[batch, seq, width]` data whose sequence is split into `runs`: reorders between sequence order
/// and member order (each member's run of every row, member after member), which the
/// collectives exchange.
#[derive(Clone, Debug)]
pub(crate) struct SequenceRuns {
    pub batch: usize,
    pub runs: Vec<Range<usize>>,
    pub width: usize,
}

impl SequenceRuns {
    pub fn seq(&self) -> usize {
        self.runs.last().map_or(0, |run| run.end)
    }

    /// Elements of each member's part.
    pub fn counts(&self) -> Vec<usize> {
        self.runs.iter().map(|run| self.batch * run.len() * self.width).collect()
    }

    /// Sequence order to member order.
    pub fn to_members(&self, data: &[f32]) -> Vec<f32> {
        let row = self.seq() * self.width;
        let mut out = Vec::with_capacity(data.len());
        for run in &self.runs {
            for b in 0..self.batch {
                out.extend_from_slice(&data[b * row + run.start * self.width..b * row + run.end * self.width]);
            }
        }
        out
    }

    /// Member order to sequence order.
    pub fn to_sequence(&self, data: &[f32]) -> Vec<f32> {
        let row = self.seq() * self.width;
        let mut out = vec![0.0; data.len()];
        let mut at = 0;
        for run in &self.runs {
            let width = run.len() * self.width;
            for b in 0..self.batch {
                out[b * row + run.start * self.width..b * row + run.end * self.width]
                    .copy_from_slice(&data[at..at + width]);
                at += width;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::stage_params;

    fn config() -> ModelConfig {
        ModelConfig::from_spec(&medley_spec::catalog_model("tiny").unwrap(), 16).unwrap()
    }

    #[test]
    fn members_shards_place_back_into_the_whole_parameters() {
        let config = config();
        for size in [1, 2, 4] {
            let whole = stage_params(&config, 0..config.n_layers);
            let mut rebuilt: Vec<Vec<f32>> = whole.iter().map(|spec| vec![f32::NAN; spec.numel()]).collect();
            for member in 0..size {
                let seat = TensorSeat::new(&config, member, size).unwrap();
                for (spec, full) in seat.stage_params(&config, 0..config.n_layers).iter().zip(&mut rebuilt) {
                    spec.shard.as_ref().unwrap().place(&spec.initial_value(3).data, full);
                }
            }
            for (spec, full) in whole.iter().zip(&rebuilt) {
                assert_eq!(spec.initial_value(3).data, *full, "{} at tp = {size}", spec.name);
            }
        }
    }

    #[test]
    fn kv_heads_are_split_or_shared_as_megatron_does() {
        let config = config();
        let kv = |member, size| TensorSeat::new(&config, member, size).unwrap().kv_heads(&config);
        assert_eq!((kv(0, 2), kv(1, 2)), (0..1, 1..2));
        assert_eq!((kv(0, 4), kv(1, 4), kv(2, 4), kv(3, 4)), (0..1, 0..1, 1..2, 1..2));
        let refused = TensorSeat::new(&config, 0, 3).unwrap_err().to_string();
        assert!(refused.contains("3 devices cannot split 4 query heads"), "{refused}");
    }

    #[test]
    fn sequence_runs_reorder_both_ways() {
        let runs = SequenceRuns { batch: 2, runs: vec![0..3, 3..5], width: 2 };
        let data: Vec<f32> = (0..20).map(|x| x as f32).collect();
        let members = runs.to_members(&data);
        assert_eq!(&members[..6], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(&members[6..12], &[10.0, 11.0, 12.0, 13.0, 14.0, 15.0]);
        assert_eq!(runs.to_sequence(&members), data);
        assert_eq!(runs.counts(), vec![12, 8]);
    }
}
