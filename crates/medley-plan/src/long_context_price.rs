//! What a long-context stage costs on each of its devices: one layer's work per device (its
//! tokens, its heads' attention over its group's shard, the all-to-alls inside its group, the
//! keys and values from the other groups, each on its real link), the stage's passes and memory,
//! and the same costs as linear functions of a group's shard for the split's linear program.

use medley_cost::comm::{self, Link};
use medley_cost::long_context::{
    self, ContextLayerTime, ContextWork, HeadShare, HeadSplit, KvExchange, kv_bytes_per_token,
};
use medley_cost::{CostModel, GIB, MemoryBreakdown, PassTime, StageShape};
use medley_spec::{BridgeMode, Cluster, DeviceId, DeviceSlot, NodeGroup, Recompute};

use crate::long_context_stage::StageContext;
use crate::shard_split::{GroupCost, Linear, NextLinear};
use medley_cost::memory::usable;

/// One device of a long-context stage and what it does in one layer.
#[derive(Clone, Copy, Debug)]
pub struct DeviceWork {
    pub device: DeviceId,
    pub work: ContextWork,
    /// Attention buffers it holds for the layer in flight: its heads' Q, K, V and output over its
    /// group's shard, and the keys and values it receives.
    pub buffer_bytes: f64,
}

/// Prices long-context stages of one model on one cluster.
#[derive(Clone, Copy)]
pub struct ContextPricer<'a> {
    pub cost: &'a CostModel<'a>,
    pub cluster: &'a Cluster,
    pub slots: &'a [DeviceSlot],
    /// The share of each device's memory left free.
    pub memory_headroom: f64,
}

/// A head-parallel group as the pricer sees it: its node group, its shard, its devices' tokens
/// and heads, and the link its keys and values travel between groups.
struct GroupView<'a> {
    node_group: &'a NodeGroup,
    shard_tokens: u64,
    device_tokens: Vec<u64>,
    heads: Vec<HeadShare>,
    kv_link: Link,
    n_groups: usize,
    kv_exchange: KvExchange,
}

impl<'a> ContextPricer<'a> {
    /// Bytes of an activation, key or value element in the job's precision.
    fn activation_bytes(&self) -> u64 {
        self.cost.precision().element_bytes() as u64
    }

    fn node_group(&self, device: DeviceId) -> &'a NodeGroup {
        &self.cluster.groups()[self.slots[device as usize].group_idx]
    }

    /// One layer's work on each device of a stage holding `devices` with `context`.
    pub fn device_works(&self, context: &StageContext, devices: &[DeviceId]) -> Vec<DeviceWork> {
        let seq_len = context.groups.iter().map(|group| group.tokens).sum();
        let shards = context.shards(seq_len);
        let firsts: Vec<DeviceId> =
            (0..context.groups.len()).map(|idx| context.group_devices(devices, idx)[0]).collect();
        let kv_link = self.ring_link(&firsts);
        let mut works = Vec::with_capacity(devices.len());
        for (idx, group) in context.groups.iter().enumerate() {
            let members = context.group_devices(devices, idx);
            let split = HeadSplit::from_q_heads(self.cost.model(), &group.heads).expect("a checked plan's heads");
            let view = GroupView {
                node_group: self.node_group(members[0]),
                shard_tokens: u64::from(group.tokens),
                device_tokens: group.device_tokens.iter().map(|&tokens| u64::from(tokens)).collect(),
                heads: split.shares().to_vec(),
                kv_link,
                n_groups: context.groups.len(),
                kv_exchange: context.kv_exchange,
            };
            for (me, &device) in members.iter().enumerate() {
                let kv = long_context::kv_traffic(
                    self.cost.model(),
                    &shards,
                    idx,
                    view.heads[me].kv_heads,
                    view.kv_exchange,
                    self.activation_bytes(),
                );
                works.push(self.device_work(&view, me, device, kv.sent.max(kv.received) as f64, shards.n_tokens()));
            }
        }
        works
    }

    /// Device `me` of `view`'s group, which sends or receives `kv_bytes` of keys and values at most.
    fn device_work(&self, view: &GroupView, me: usize, device: DeviceId, kv_bytes: f64, n_tokens: u64) -> DeviceWork {
        let model = self.cost.model();
        let share = view.heads[me];
        let ulysses =
            long_context::ulysses_traffic(model, &view.device_tokens, &view.heads, me, self.activation_bytes());
        let peers = view.device_tokens.len() as f64 - 1.0;
        let all_to_all_s =
            transfers_s(comm::intra_node_peer_link(view.node_group), peers, ulysses.sent.max(ulysses.received) as f64);
        let others = view.n_groups as f64 - 1.0;
        let kv_s = transfers_s(view.kv_link, others, kv_bytes);
        let work = ContextWork {
            tokens: view.device_tokens[me] as f64,
            attention_flops: long_context::attention_core_flops(model, n_tokens, view.shard_tokens, share.q_heads),
            all_to_all_s,
            kv_s,
            kv_exchange: view.kv_exchange,
        };
        DeviceWork { device, work, buffer_bytes: self.buffer_bytes(view, share, n_tokens) }
    }

    /// Q, K, V in and the output out for the device's heads over the group's shard, and the keys
    /// and values of the others: all of them, gathered, or forwarded around a ring ahead of
    /// attention (which may reach the last only after every block is in).
    fn buffer_bytes(&self, view: &GroupView, share: HeadShare, n_tokens: u64) -> f64 {
        let model = self.cost.model();
        let head_dim = u64::from(model.head_dim());
        let shard = view.shard_tokens;
        let heads = (2 * u64::from(share.q_heads) + 2 * u64::from(share.kv_heads)) * head_dim * self.activation_bytes();
        let others = (n_tokens - shard) as f64;
        (shard * heads) as f64 + others * kv_bytes_per_token(model, share.kv_heads, self.activation_bytes()) as f64
    }

    /// Seconds to reduce `bytes` of gradients over a long-context stage's `devices` (each holds
    /// every parameter) around a ring of them, before the replicas share them by shares.
    pub fn stage_gradient_sync_s(&self, devices: &[DeviceId], bytes: f64) -> f64 {
        comm::ring_all_reduce_s(bytes, devices.len() as u32, self.ring_link(devices))
    }

    /// The link a ring through `devices`, in order, is held back by.
    pub fn ring_link(&self, devices: &[DeviceId]) -> Link {
        let n = devices.len();
        (0..n)
            .map(|idx| {
                let (a, b) = (self.slots[devices[idx] as usize], self.slots[devices[(idx + 1) % n] as usize]);
                comm::link_between(self.cluster, a, b, BridgeMode::DeviceDirect)
            })
            .reduce(Link::slowest)
            .unwrap_or(Link { gb_s: f64::INFINITY, latency_us: 0.0 })
    }

    /// One layer and the stage's passes on `work`'s device.
    fn layer_time(&self, work: &DeviceWork, recompute: Recompute) -> ContextLayerTime {
        self.cost.context_layer_time(self.node_group(work.device), work.work, recompute)
    }

    /// A stage of `shape` for one micro-batch on `work`'s device.
    pub fn device_pass(&self, work: &DeviceWork, shape: StageShape, recompute: Recompute) -> PassTime {
        let layer = self.layer_time(work, recompute);
        let layer = PassTime {
            forward_s: layer.pass_s(layer.forward),
            backward_s: layer.pass_s(layer.backward),
            weight_grad_s: layer.weight_grad_s,
        };
        let head = match shape.head {
            true => self.cost.context_head_time(self.node_group(work.device), work.work.tokens),
            false => PassTime::default(),
        };
        self.cost.stage_pass(shape, layer, head)
    }

    /// The stage's pass: its slowest device's, as every device waits for the others each layer.
    pub fn stage_pass(&self, works: &[DeviceWork], shape: StageShape, recompute: Recompute) -> PassTime {
        works
            .iter()
            .map(|work| self.device_pass(work, shape, recompute))
            .max_by(|a, b| a.total_s().total_cmp(&b.total_s()))
            .unwrap_or_default()
    }

    /// Peak memory of `work`'s device.
    pub fn device_memory(
        &self,
        work: &DeviceWork,
        shape: StageShape,
        recompute: Recompute,
        in_flight: f64,
        optimizer_shards: u32,
    ) -> MemoryBreakdown {
        self.cost.context_memory(shape, recompute, in_flight, optimizer_shards, work.work.tokens, work.buffer_bytes)
    }

    /// Tokens of a group's devices holding `heads` query heads each over a shard of `shard`
    /// tokens of `n_tokens`, so that each device's projections, MLP and attention take as long:
    /// a device with more heads (grouped-query units need not divide evenly) holds fewer tokens.
    pub fn balance_tokens(
        &self,
        node_group: &NodeGroup,
        n_tokens: u64,
        shard: u64,
        heads: &[u32],
        recompute: Recompute,
    ) -> Vec<u32> {
        let work = |tokens: f64, q_heads: u32| ContextWork {
            tokens,
            attention_flops: long_context::attention_core_flops(self.cost.model(), n_tokens, shard, q_heads),
            all_to_all_s: 0.0,
            kv_s: 0.0,
            kv_exchange: KvExchange::AllGather,
        };
        let seconds =
            |tokens, q_heads| self.cost.context_layer_time(node_group, work(tokens, q_heads), recompute).total_s();
        let per_head_in_tokens = seconds(0.0, 1) / seconds(1.0, 0).max(f64::MIN_POSITIVE);
        let mean_heads = heads.iter().map(|&q| f64::from(q)).sum::<f64>() / heads.len() as f64;
        let weights: Vec<f64> = heads
            .iter()
            .map(|&q| (shard as f64 / heads.len() as f64 + per_head_in_tokens * (mean_heads - f64::from(q))).max(1.0))
            .collect();
        long_context::split_whole(shard as u32, &weights).expect("a shard holds at least a token per device")
    }

    /// A group of `size` devices of `node_group` with heads split as evenly as grouped-query
    /// units allow and the shard's tokens evenly, in a stage of `n_groups` groups over `n_tokens`
    /// whose keys and values travel on `kv_link`, as linear functions of the group's shard: what
    /// the split's linear program balances, for every stage of `frames` (they share the split).
    #[allow(clippy::too_many_arguments)]
    pub fn group_cost(
        &self,
        node_group: &NodeGroup,
        size: usize,
        n_groups: usize,
        n_tokens: u64,
        kv_link: Link,
        kv_exchange: KvExchange,
        frames: &[StageFrame],
    ) -> GroupCost {
        let heads =
            HeadSplit::proportional(self.cost.model(), &vec![1.0; size]).expect("a group no larger than the heads");
        let heads = heads.shares().to_vec();
        // Two shards a multiple of the group's size: every cost is linear in the shard and in
        // the tokens whose keys and values it moves.
        let points = [size as u64 * 2, size as u64 * 4].map(|tokens| tokens.min(n_tokens));
        let at = |shard_tokens: u64, kv_tokens: u64, stage: &StageFrame| -> (Vec<f64>, Vec<f64>) {
            let view = GroupView {
                node_group,
                shard_tokens,
                device_tokens: vec![shard_tokens / size as u64; size],
                heads: heads.clone(),
                kv_link,
                n_groups,
                kv_exchange,
            };
            let (mut pieces, mut memory) = (Vec::new(), Vec::new());
            for (me, share) in heads.iter().enumerate() {
                let moved = kv_tokens * kv_bytes_per_token(self.cost.model(), share.kv_heads, self.activation_bytes());
                let work = self.device_work(&view, me, 0, moved as f64, n_tokens);
                let layer = self.cost.context_layer_time(node_group, work.work, stage.recompute);
                let head = match stage.shape.head {
                    true => self.cost.context_head_time(node_group, work.work.tokens).total_s(),
                    false => 0.0,
                };
                let layers = f64::from(stage.shape.n_layers);
                pieces.extend(layer.pieces_s().into_iter().map(|piece| layers * piece + head));
                let held = self.cost.context_memory(
                    stage.shape,
                    stage.recompute,
                    stage.in_flight,
                    stage.optimizer_shards,
                    work.work.tokens,
                    work.buffer_bytes,
                );
                memory.push(held.total());
            }
            (pieces, memory)
        };
        let [n1, n2] = points;
        let step = (n2 - n1).max(1) as f64;
        let (mut times_s, mut next_times_s, mut memory_bytes) = (Vec::new(), Vec::new(), Vec::new());
        for frame in frames {
            // p(n, k) = fixed + a·n + b·k for a shard of n moving k tokens' keys and values.
            let (base, memory_base) = at(n1, n_tokens - n1, frame);
            let (more_shard, memory_more) = at(n2, n_tokens - n1, frame);
            let (less_kv, _) = at(n1, n_tokens - n2, frame);
            for ((p, p_shard), p_kv) in base.iter().zip(&more_shard).zip(&less_kv) {
                let (a, b) = ((p_shard - p) / step, (p - p_kv) / step);
                let fixed = p - a * n1 as f64 - b * (n_tokens - n1) as f64;
                let own = Linear { fixed: fixed + b * n_tokens as f64, per_token: a };
                // It receives every other block: k = N − n.
                times_s.push(Linear { fixed: own.fixed, per_token: a - b });
                // Around a ring it sends every block but the next group's: k = N − m.
                if b != 0.0 && kv_exchange == KvExchange::Ring {
                    next_times_s.push(NextLinear { own, per_next_token: -b });
                }
            }
            for (m1, m2) in memory_base.iter().zip(&memory_more) {
                let per_token = (m2 - m1) / step;
                memory_bytes.push(Linear { fixed: m1 - per_token * n1 as f64, per_token });
            }
        }
        // Devices with the same heads cost the same: one constraint each is enough.
        let order = |a: &Linear, b: &Linear| a.fixed.total_cmp(&b.fixed).then(a.per_token.total_cmp(&b.per_token));
        for lines in [&mut times_s, &mut memory_bytes] {
            lines.sort_by(order);
            lines.dedup();
        }
        next_times_s.sort_by(|a, b| order(&a.own, &b.own).then(a.per_next_token.total_cmp(&b.per_next_token)));
        next_times_s.dedup();
        let capacity_bytes = usable(node_group.device.hbm_gib * GIB, self.memory_headroom);
        GroupCost { times_s, next_times_s, memory_bytes, capacity_bytes }
    }
}

/// What a stage holds and keeps in flight, for pricing its groups.
#[derive(Clone, Copy, Debug)]
pub struct StageFrame {
    pub shape: StageShape,
    pub recompute: Recompute,
    pub in_flight: f64,
    pub optimizer_shards: u32,
}

/// `bytes` to or from `peers` others over `link`: one latency each, the bytes at its rate.
fn transfers_s(link: Link, peers: f64, bytes: f64) -> f64 {
    if peers <= 0.0 {
        return 0.0;
    }
    peers * link.latency_us * 1e-6 + bytes / (link.gb_s * 1e9)
}
