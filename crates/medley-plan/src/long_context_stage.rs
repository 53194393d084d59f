//! A long-context stage's split of each sequence over its devices: context parallelism across
//! head-parallel groups, each holding a head–tail shard of the sequence, and head parallelism
//! (Ulysses) inside a group, each device holding some of the shard's tokens for the projections
//! and MLP and some of the heads for attention. Shards, token shares and heads may be uneven.

use medley_cost::long_context::{HeadSplit, HeadTailShards, KvExchange};
use medley_spec::{Cluster, DeviceId, DeviceSlot, ModelSpec};
use serde::{Deserialize, Serialize};

use crate::error::ContextProblem;

/// How a stage splits each sequence (schema version 2). The stage's `devices` are its groups'
/// devices, group after group.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageContext {
    /// Tokens per block: every group's shard is whole pairs of blocks, half from the front of
    /// the sequence and half from the back.
    pub block: u32,
    /// How keys and values reach the other groups.
    pub kv_exchange: KvExchange,
    /// Head-parallel groups in shard order.
    pub groups: Vec<HeadGroup>,
}

/// One head-parallel (all-to-all) group: devices of one node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeadGroup {
    /// Tokens of each sequence the group holds: its head–tail shard.
    pub tokens: u32,
    /// Of them, the tokens each device holds outside attention (projections, MLP); one entry a
    /// device.
    pub device_tokens: Vec<u32>,
    /// Query heads each device computes attention for: whole grouped-query units when the group
    /// has at most as many devices as the model has KV heads, else any split, KV heads replicated.
    pub heads: Vec<u32>,
}

impl StageContext {
    /// The sequence's head–tail shards, one a group.
    pub fn shards(&self, seq_len: u32) -> HeadTailShards {
        let counts = self.groups.iter().map(|group| u64::from(group.tokens)).collect();
        HeadTailShards::new(u64::from(seq_len), counts).expect("a checked plan's shards")
    }

    /// Group `group`'s devices among the stage's `devices`.
    pub fn group_devices<'a>(&self, devices: &'a [DeviceId], group: usize) -> &'a [DeviceId] {
        let start: usize = self.groups[..group].iter().map(|group| group.device_tokens.len()).sum();
        &devices[start..start + self.groups[group].device_tokens.len()]
    }

    /// Checks the split against the stage's `devices`, the model and the sequence length.
    pub(crate) fn check(
        &self,
        devices: &[DeviceId],
        cluster: &Cluster,
        slots: &[DeviceSlot],
        model: &ModelSpec,
        seq_len: u32,
    ) -> Result<(), ContextProblem> {
        if let Some(group) = self.groups.iter().position(|group| group.device_tokens.is_empty()) {
            return Err(ContextProblem::EmptyGroup { group });
        }
        let in_groups: usize = self.groups.iter().map(|group| group.device_tokens.len()).sum();
        if self.groups.is_empty() || in_groups != devices.len() {
            return Err(ContextProblem::Devices { stage_devices: devices.len(), in_groups });
        }
        let unit = 2 * u64::from(self.block);
        let tokens: u64 = self.groups.iter().map(|group| u64::from(group.tokens)).sum();
        if self.block == 0 || tokens != u64::from(seq_len) {
            return Err(ContextProblem::Tokens { block: self.block, tokens, seq_len });
        }
        let mut vendor = None;
        for (idx, group) in self.groups.iter().enumerate() {
            let slots: Vec<&DeviceSlot> =
                self.group_devices(devices, idx).iter().map(|&id| &slots[id as usize]).collect();
            let node = (slots[0].node_idx, slots[0].group_idx);
            if slots.iter().any(|slot| (slot.node_idx, slot.group_idx) != node) {
                return Err(ContextProblem::GroupAcrossNodes { group: idx });
            }
            let group_vendor = cluster.groups()[slots[0].group_idx].device.vendor;
            if *vendor.get_or_insert(group_vendor) != group_vendor {
                return Err(ContextProblem::MixedVendors);
            }
            if group.tokens == 0 || !u64::from(group.tokens).is_multiple_of(unit) {
                return Err(ContextProblem::Shard { group: idx, tokens: group.tokens, unit });
            }
            let held: u64 = group.device_tokens.iter().map(|&t| u64::from(t)).sum();
            if group.device_tokens.contains(&0) || held != u64::from(group.tokens) {
                return Err(ContextProblem::DeviceTokens { group: idx, held, tokens: group.tokens });
            }
            if group.heads.len() != group.device_tokens.len() {
                let (devices, heads) = (group.device_tokens.len(), group.heads.len());
                return Err(ContextProblem::HeadCount { group: idx, devices, heads });
            }
            HeadSplit::from_q_heads(model, &group.heads)
                .map_err(|error| ContextProblem::Heads { group: idx, reason: error.to_string() })?;
        }
        Ok(())
    }
}
