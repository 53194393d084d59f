//! Any layout of long-context stages, the even ones people run included, with each stage's
//! sequence split again by the linear program for that stage's own devices, and a pipeline's
//! layers split again by its stages' speed: pipelines whose stages differ (a vendor or a type per
//! stage, in device order) get uneven shards and uneven stages too.

use medley_cost::StageShape;
use medley_cost::long_context::HeadSplit;

use super::ContextSpace;
use crate::assemble::ReplicaLayout;
use crate::layers::LayerRange;
use crate::long_context_price::StageFrame;
use crate::long_context_stage::HeadGroup;
use crate::partition::{StageLoad, min_max_layers};
use crate::plan::{Plan, Replica, state_shards};
use crate::shard_split::{GroupKind, split_by_kind};

impl ContextSpace<'_> {
    /// `plan` with every long-context stage's shards balanced over its groups' speed, memory and
    /// links, and each group's tokens over its devices; `None` when a stage's split fits nowhere.
    pub(crate) fn resplit(&self, plan: &Plan) -> Option<Plan> {
        let pricer = self.pricer();
        let n_tokens = u64::from(self.job.seq_len());
        let n_replicas = plan.replicas().len() as u32;
        let mut parts = plan.clone().into_parts();
        for replica in &mut parts.replicas {
            let (n_ranks, m) = (replica.stages.len(), replica.n_micro_batches);
            for (rank, stage) in replica.stages.iter_mut().enumerate() {
                let Some(context) = stage.context.as_mut() else { continue };
                let shards = state_shards(plan.zero1(), n_replicas, stage.devices.len() as u32);
                let frame = StageFrame {
                    shape: StageShape::in_pipeline(rank, n_ranks, stage.layers.len()),
                    recompute: plan.recompute(),
                    in_flight: f64::from(plan.schedule().in_flight(rank, n_ranks, 1, m)),
                    optimizer_shards: shards,
                };
                let n_groups = context.groups.len();
                let firsts: Vec<u32> = (0..n_groups).map(|g| context.group_devices(&stage.devices, g)[0]).collect();
                let kv_link = pricer.ring_link(&firsts);
                let kinds: Vec<GroupKind> = (0..n_groups)
                    .map(|g| {
                        let (node_group, size) = (self.device_node_group(firsts[g]), context.groups[g].heads.len());
                        let cost = pricer.group_cost(
                            node_group,
                            size,
                            n_groups,
                            n_tokens,
                            kv_link,
                            context.kv_exchange,
                            &[frame],
                        );
                        GroupKind { cost, count: 1, next: vec![(g + 1) % n_groups] }
                    })
                    .collect();
                let shares = split_by_kind(&kinds, n_tokens, u64::from(context.block)).ok()?;
                let unit = 2 * u64::from(context.block);
                for (g, share) in shares.iter().enumerate() {
                    let tokens = share.tokens(unit).next().expect("one group a kind");
                    let heads = HeadSplit::from_q_heads(self.model(), &context.groups[g].heads).ok()?;
                    let q_heads: Vec<u32> = heads.shares().iter().map(|share| share.q_heads).collect();
                    let node_group = self.device_node_group(firsts[g]);
                    let device_tokens = pricer.balance_tokens(node_group, n_tokens, tokens, &q_heads, plan.recompute());
                    context.groups[g] = HeadGroup { tokens: tokens as u32, device_tokens, heads: q_heads };
                }
            }
        }
        Plan::new(parts).ok()
    }

    /// `plan` with each replica's layers split over its long-context stages by their speed (the
    /// head's time on the last), fastest slowest stage first; `None` when a replica has stages
    /// of another kind or the split does not go.
    pub(crate) fn rebalance_layers(&self, plan: &Plan) -> Option<Plan> {
        let pricer = self.pricer();
        let n_layers = self.model().n_layers();
        let replicas = plan
            .replicas()
            .iter()
            .map(|replica| {
                let n_stages = replica.stages.len();
                let loads = replica
                    .stages
                    .iter()
                    .enumerate()
                    .map(|(idx, stage)| {
                        let works = pricer.device_works(stage.context.as_ref()?, &stage.devices);
                        let layer = StageShape { n_layers: 1, embedding: false, head: false };
                        let ends = StageShape { n_layers: 0, ..StageShape::in_pipeline(idx, n_stages, 0) };
                        Some(StageLoad {
                            per_layer_s: pricer.stage_pass(&works, layer, plan.recompute()).total_s(),
                            fixed_s: pricer.stage_pass(&works, ends, plan.recompute()).total_s(),
                            max_layers: n_layers,
                            extra_layers: 0.0,
                        })
                    })
                    .collect::<Option<Vec<_>>>()?;
                let counts = min_max_layers(&loads, n_layers)?;
                Some(relayered(replica, &counts))
            })
            .collect::<Option<Vec<_>>>()?;
        self.plan(plan.recompute(), replicas).ok()
    }
}

/// `replica`'s stages holding `counts[i]` consecutive layers, routes chosen again.
fn relayered(replica: &Replica, counts: &[u32]) -> ReplicaLayout {
    let mut start = 0;
    let stages = replica
        .stages
        .iter()
        .zip(counts)
        .map(|(stage, &count)| {
            let layers = LayerRange { start, end: start + count };
            start += count;
            crate::plan::Stage { layers, ..stage.clone() }
        })
        .collect();
    ReplicaLayout { n_micro_batches: replica.n_micro_batches, stages }
}
