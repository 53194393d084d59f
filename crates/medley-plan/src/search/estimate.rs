//! The search's estimate of a layout's gradient synchronisation and optimizer step, priced the
//! way `evaluate` prices a plan but from block templates instead of device slots.

use medley_cost::StageShape;
use medley_cost::comm::{self, DomainPart, Link};
use medley_spec::Vendor;

use super::template::BlockConfig;
use super::{GroupSettings, Space};
use crate::evaluate::dp_group_bytes;
use crate::layers::LayerRange;
use crate::plan::state_shards;

impl Space<'_> {
    /// One gradient group per range of layers between any block's stage cuts, each held by one
    /// stage per block: a native ring when the holders share a vendor, else the cheaper of a
    /// ring and a hierarchical all-reduce over the bridge. A stage pays for every range it holds;
    /// the slowest stage sets the time.
    pub(super) fn dp_sync_estimate_s(&self, setting: &GroupSettings, blocks: &[&BlockConfig]) -> f64 {
        let n_replicas: u32 = blocks.iter().map(|block| block.n_replicas).sum();
        if n_replicas < 2 {
            return 0.0;
        }
        let starts: Vec<Vec<u32>> = blocks.iter().map(|block| block.stage_starts()).collect();
        let mut cuts: Vec<u32> = starts.iter().flatten().copied().chain([self.cost.model().n_layers()]).collect();
        cuts.sort_unstable();
        cuts.dedup();
        // Per stage: the summed sync time and bytes of the ranges it holds.
        let mut per_stage: Vec<Vec<(f64, f64)>> =
            blocks.iter().map(|block| vec![(0.0, 0.0); block.layers.len()]).collect();
        for range in cuts.windows(2).map(|pair| LayerRange { start: pair[0], end: pair[1] }) {
            let holders: Vec<usize> = starts
                .iter()
                .map(|block_starts| block_starts.partition_point(|&start| start <= range.start) - 1)
                .collect();
            // A holder of a smaller TP degree holds the larger shard.
            let tp =
                blocks.iter().zip(&holders).map(|(block, &h)| setting.tp(block.stage_groups[h])).min().unwrap_or(1);
            let bytes = dp_group_bytes(&self.cost, tp, range, self.job.grad_reduce());
            let time_s = self.range_sync_s(blocks, &holders, bytes, n_replicas);
            for (stages, &holder) in per_stage.iter_mut().zip(&holders) {
                stages[holder] = (stages[holder].0 + time_s, stages[holder].1 + bytes);
            }
        }
        let exposed = per_stage.iter().zip(blocks).flat_map(|(stages, block)| {
            stages
                .iter()
                .zip(&block.stage_backward_s)
                .map(|(&(sync_s, bytes), &backward_s)| self.exposed_sync_s(sync_s, bytes, n_replicas, backward_s))
        });
        exposed.fold(0.0, f64::max)
    }

    /// What a stage's gradient reduction of `sync_s` over `bytes` and `n_replicas` leaves after
    /// its last backward pass of `backward_s` when the job overlaps the two (all of it when not).
    pub(super) fn exposed_sync_s(&self, sync_s: f64, bytes: f64, n_replicas: u32, backward_s: f64) -> f64 {
        if !self.job.overlap_grad_reduce() {
            return sync_s;
        }
        let elements = bytes / self.job.grad_reduce().bytes();
        comm::exposed_reduction_s(sync_s, comm::gradient_buckets(elements, n_replicas as usize), backward_s)
    }

    /// One range's all-reduce over its holder stage in every block.
    fn range_sync_s(&self, blocks: &[&BlockConfig], holders: &[usize], bytes: f64, n_replicas: u32) -> f64 {
        let groups = self.cluster.groups();
        let holder_groups: Vec<usize> = blocks.iter().zip(holders).map(|(block, &h)| block.stage_groups[h]).collect();
        let mut vendors: Vec<Vendor> = holder_groups.iter().map(|&g| groups[g].device.vendor).collect();
        vendors.sort();
        vendors.dedup();
        let domains: Vec<DomainPart> = vendors
            .iter()
            .map(|&vendor| {
                let members: Vec<usize> =
                    (0..blocks.len()).filter(|&b| groups[holder_groups[b]].device.vendor == vendor).collect();
                let inner = members
                    .iter()
                    .map(|&b| blocks[b].stage_dp_links[holders[b]])
                    .reduce(Link::slowest)
                    .expect("a vendor present has a member");
                let link = if members.len() > 1 {
                    inner.slowest(comm::nic_link(
                        self.cluster,
                        &members.iter().map(|&b| holder_groups[b]).collect::<Vec<_>>(),
                    ))
                } else {
                    inner
                };
                DomainPart { n_ranks: members.iter().map(|&b| blocks[b].n_replicas).sum(), link }
            })
            .collect();
        if let [domain] = domains.as_slice() {
            return comm::ring_all_reduce_s(bytes, n_replicas, domain.link);
        }
        let bridge = self.best_bridge_link(comm::nic_link(self.cluster, &holder_groups));
        let flat_link = domains.iter().map(|domain| domain.link).fold(bridge, Link::slowest);
        comm::hierarchical_all_reduce_s(bytes, &domains, bridge)
            .min(comm::ring_all_reduce_s(bytes, n_replicas, flat_link))
    }

    /// The slowest stage's optimizer step, its states sharded over all replicas with ZeRO-1.
    pub(super) fn optimizer_estimate_s(&self, setting: &GroupSettings, blocks: &[&BlockConfig]) -> f64 {
        let n_replicas: u32 = blocks.iter().map(|block| block.n_replicas).sum();
        let shards = state_shards(self.job.zero1(), n_replicas, 1);
        let groups = self.cluster.groups();
        blocks
            .iter()
            .flat_map(|block| {
                let n_stages = block.layers.len();
                block.layers.iter().zip(&block.stage_groups).enumerate().map(move |(idx, (&n_layers, &g))| {
                    let shape = StageShape::in_pipeline(idx, n_stages, n_layers);
                    let params = self.cost.stage_params(shape) / f64::from(setting.tp(g)) / f64::from(shards);
                    self.cost.optimizer_step_s(&groups[g], params)
                })
            })
            .fold(0.0, f64::max)
    }
}
