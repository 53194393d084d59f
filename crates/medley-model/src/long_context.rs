//! Context and head parallelism: where one device of a long-context stage stands, and the
//! collectives its passes run.
//!
//! A stage's devices form head-parallel groups, each holding a shard of every sequence (any
//! positions: the planner gives head–tail shards). Outside attention a device computes a
//! contiguous run of its group's positions; for attention its group's all-to-all gives it every
//! group token's queries, keys and values of its query heads (and the KV heads they read), and
//! the devices holding the same heads in the other groups (its *lane*) all-gather their keys
//! and values, so it attends over the whole sequence under the causal mask of the tokens' global
//! positions. The backward reverses each exchange: the keys' and values' gradients reduce-scatter
//! back over the lane, the all-to-alls run the other way (KV heads read by several devices add up).

use std::ops::Range;

use crate::{ModelConfig, ModelError};

/// One head-parallel group of a long-context stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContextGroup {
    /// The global positions of the group's tokens in every sequence, ascending.
    pub positions: Vec<usize>,
    /// Of them, how many each member computes outside attention, in order: member j holds the
    /// run after members 0..j's.
    pub device_tokens: Vec<usize>,
    /// Query heads each member computes attention for, in head order.
    pub q_heads: Vec<usize>,
}

/// Where one device stands in its stage's split of the sequence: every group, and its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContextPlacement {
    groups: Vec<ContextGroup>,
    group: usize,
    member: usize,
    /// How many query heads share one KV head.
    q_per_kv: usize,
}

impl ContextPlacement {
    /// Member `member` of group `group` among `groups`, checked against the model: the groups'
    /// positions cover the sequence once, every member holds tokens and heads, and every group
    /// splits the heads alike (keys and values travel between the members that hold the same).
    pub fn new(
        config: &ModelConfig,
        groups: Vec<ContextGroup>,
        group: usize,
        member: usize,
    ) -> Result<ContextPlacement, ModelError> {
        let bad = |reason: String| Err(ModelError::Context(reason));
        let mut seen = vec![false; config.seq_len];
        for (idx, g) in groups.iter().enumerate() {
            if !g.positions.is_sorted_by(|a, b| a < b) {
                return bad(format!("group {idx}'s positions are not ascending"));
            }
            for &pos in &g.positions {
                match seen.get_mut(pos) {
                    Some(slot @ false) => *slot = true,
                    Some(true) => return bad(format!("position {pos} is in two groups")),
                    None => return bad(format!("position {pos} is beyond the sequence of {}", config.seq_len)),
                }
            }
            if g.device_tokens.contains(&0) || g.device_tokens.iter().sum::<usize>() != g.positions.len() {
                return bad(format!(
                    "group {idx}'s members hold {:?} of its {} tokens",
                    g.device_tokens,
                    g.positions.len()
                ));
            }
            if g.q_heads != groups[0].q_heads || g.device_tokens.len() != g.q_heads.len() {
                return bad(format!("group {idx} splits the heads {:?}, group 0 {:?}", g.q_heads, groups[0].q_heads));
            }
        }
        if let Some(pos) = seen.iter().position(|&held| !held) {
            return bad(format!("position {pos} is in no group"));
        }
        let heads = &groups.first().map(|g| g.q_heads.clone()).unwrap_or_default();
        if heads.contains(&0) || heads.iter().sum::<usize>() != config.n_heads {
            return bad(format!("the members' query heads {heads:?} do not add up to the model's {}", config.n_heads));
        }
        if group >= groups.len() || member >= heads.len() {
            return bad(format!("no member {member} of group {group}"));
        }
        let q_per_kv = config.n_heads / config.n_kv_heads;
        Ok(ContextPlacement { groups, group, member, q_per_kv })
    }

    pub fn groups(&self) -> &[ContextGroup] {
        &self.groups
    }

    /// This device's group and its member index in it (its lane).
    pub fn group_and_member(&self) -> (usize, usize) {
        (self.group, self.member)
    }

    /// Members per group.
    pub fn group_size(&self) -> usize {
        self.groups[0].q_heads.len()
    }

    /// Member `member`'s run of its group's tokens, as indices into the group's positions.
    pub fn token_run(&self, group: usize, member: usize) -> Range<usize> {
        let tokens = &self.groups[group].device_tokens;
        let start = tokens[..member].iter().sum();
        start..start + tokens[member]
    }

    /// The positions this device computes outside attention.
    pub fn positions(&self) -> &[usize] {
        &self.groups[self.group].positions[self.token_run(self.group, self.member)]
    }

    /// The global positions of each member's tokens, in every group.
    pub fn member_positions(&self, group: usize, member: usize) -> &[usize] {
        &self.groups[group].positions[self.token_run(group, member)]
    }

    /// Member `member`'s query heads (the same in every group).
    pub fn q_heads(&self, member: usize) -> Range<usize> {
        let heads = &self.groups[0].q_heads;
        let start = heads[..member].iter().sum();
        start..start + heads[member]
    }

    /// The KV heads member `member`'s query heads read: whole grouped-query units, or parts of
    /// one or two shared with another member when the group has more members than KV heads.
    pub fn kv_heads(&self, member: usize) -> Range<usize> {
        let q = self.q_heads(member);
        q.start / self.q_per_kv..(q.end - 1) / self.q_per_kv + 1
    }

    /// The positions this device's attention sees keys at: every group's, in group order.
    pub fn key_positions(&self) -> Vec<usize> {
        self.groups.iter().flat_map(|g| g.positions.iter().copied()).collect()
    }
}

/// The collectives a long-context stage's passes run; the runtime implements them over its
/// communicators, tests in memory. Elements are in the caller's order; every member of a
/// collective calls it with the same counts.
pub trait ContextCollectives: Send {
    /// All-to-all-v in this device's head group: member i sends `counts[i][j]` elements to member
    /// j; `input` holds this member's messages in member order, the result those it receives.
    fn group_all_to_all(&mut self, input: &[f32], counts: &[Vec<usize>]) -> Result<Vec<f32>, ModelError>;

    /// All-gather-v over this device's lane (the members with its heads, one per group, in group
    /// order): group g contributes `counts[g]` elements.
    fn lane_all_gather(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError>;

    /// Reduce-scatter-v (sum) over the lane: the result is this group's `counts[g]` elements of
    /// the sum of every member's `input`.
    fn lane_reduce_scatter(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError>;
}

/// A `[batch, tokens, heads, head_dim]` tensor's data, flat.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeadsLayout {
    pub batch: usize,
    pub tokens: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl HeadsLayout {
    pub fn numel(&self) -> usize {
        self.batch * self.tokens * self.heads * self.head_dim
    }

    /// Appends to `out` the elements of `tokens` × `heads` of `data`, in layout order.
    pub fn copy_out(&self, data: &[f32], tokens: Range<usize>, heads: Range<usize>, out: &mut Vec<f32>) {
        let hd = self.head_dim;
        for b in 0..self.batch {
            for t in tokens.clone() {
                let row = ((b * self.tokens + t) * self.heads) * hd;
                out.extend_from_slice(&data[row + heads.start * hd..row + heads.end * hd]);
            }
        }
    }

    /// Adds `part` (`tokens` × `heads` in layout order) into `data`; returns the elements used.
    pub fn add_in(&self, data: &mut [f32], tokens: Range<usize>, heads: Range<usize>, part: &[f32]) -> usize {
        let (hd, width) = (self.head_dim, heads.len() * self.head_dim);
        let mut used = 0;
        for b in 0..self.batch {
            for t in tokens.clone() {
                let row = ((b * self.tokens + t) * self.heads) * hd;
                let slot = &mut data[row + heads.start * hd..row + heads.end * hd];
                slot.iter_mut().zip(&part[used..used + width]).for_each(|(sum, x)| *sum += x);
                used += width;
            }
        }
        used
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(seq_len: usize) -> ModelConfig {
        ModelConfig {
            n_layers: 2,
            hidden: 32,
            n_heads: 4,
            n_kv_heads: 2,
            ffn_hidden: 64,
            vocab: 256,
            seq_len,
            rope_theta: 10_000.0,
            rope_scaling: None,
            norm_eps: 1e-5,
        }
    }

    fn group(positions: Range<usize>, device_tokens: Vec<usize>, q_heads: Vec<usize>) -> ContextGroup {
        ContextGroup { positions: positions.collect(), device_tokens, q_heads }
    }

    #[test]
    fn members_hold_runs_and_heads_read_their_kv_heads() {
        let groups = vec![group(0..6, vec![4, 2], vec![1, 3]), group(6..8, vec![1, 1], vec![1, 3])];
        let placement = ContextPlacement::new(&config(8), groups, 0, 1).unwrap();
        assert_eq!(placement.positions(), &[4, 5]);
        assert_eq!(placement.member_positions(1, 0), &[6]);
        assert_eq!((placement.q_heads(0), placement.q_heads(1)), (0..1, 1..4));
        assert_eq!((placement.kv_heads(0), placement.kv_heads(1)), (0..1, 0..2));
        assert_eq!(placement.key_positions(), (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn placements_that_lose_or_repeat_tokens_or_split_heads_apart_are_refused() {
        let cases = [
            vec![group(0..6, vec![6], vec![4])],
            vec![group(0..4, vec![4], vec![4]), group(3..8, vec![5], vec![4])],
            vec![group(0..4, vec![2, 2], vec![2, 2]), group(4..8, vec![2, 2], vec![1, 3])],
            vec![group(0..8, vec![8, 0], vec![2, 2])],
            vec![group(0..8, vec![8], vec![3])],
        ];
        for groups in cases {
            assert!(ContextPlacement::new(&config(8), groups.clone(), 0, 0).is_err(), "{groups:?}");
        }
    }

    #[test]
    fn copied_out_parts_add_back_in_place() {
        let layout = HeadsLayout { batch: 2, tokens: 3, heads: 4, head_dim: 2 };
        let data: Vec<f32> = (0..layout.numel()).map(|x| x as f32).collect();
        let mut back = vec![0.0; layout.numel()];
        for (tokens, heads) in [(0..2, 0..1), (0..2, 1..4), (2..3, 0..4)] {
            let mut part = Vec::new();
            layout.copy_out(&data, tokens.clone(), heads.clone(), &mut part);
            assert_eq!(layout.add_in(&mut back, tokens, heads, &part), part.len());
        }
        assert_eq!(back, data);
    }
}
