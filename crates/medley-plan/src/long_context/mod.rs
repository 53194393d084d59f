//! The long-context search: plans whose stages split each sequence over their devices, unevenly
//! by each device's speed, memory and links (HexiSeq, arXiv 2605.07569), inside pipeline and
//! data parallelism.
//!
//! The search is hierarchical:
//! 1. *Head-parallel groups* form along bandwidth: `hp` devices of one node (its fastest links).
//! 2. The node groups are partitioned into *blocks* of one vendor each (every partition; a
//!    block may also be left out). A block is cut into `pp · dp` identical *cells*, each holding
//!    the same number of head-parallel groups of every kind it has; a cell is one pipeline
//!    stage of one replica. Every `hp`, `pp`, `dp` and recompute mode is a candidate.
//! 3. In a cell, the sequence splits over the groups by the linear program of
//!    [`shard_split`](crate::shard_split): balanced step time under every device's memory.
//! 4. Inside a group, heads split in grouped-query units and tokens balance the devices that got
//!    more heads ([`ContextPricer::balance_tokens`]).
//! 5. A partition's blocks combine as data-parallel replicas with uneven batch shares
//!    ([`split_micro_batches`]); the best estimated layouts become explicit plans, priced again by
//!    [`evaluate`](crate::evaluate()) and ranked by that one number.

mod even;
mod resplit;

use std::collections::BTreeMap;

use itertools::Itertools;
use medley_cost::comm::{self, Link};
use medley_cost::long_context::{HeadSplit, KvExchange};
use medley_cost::{Calibration, CostModel, PassTime, Setting, StageShape, StateFormat};
use medley_spec::{Cluster, DeviceId, DeviceSlot, JobSpec, ModelSpec, NodeGroup, Recompute, Schedule, ScheduleKind};
use rayon::prelude::*;

pub use even::{EvenBaselines, EvenKind, even_fixed, even_plan};

use crate::assemble::{ReplicaLayout, assemble};
use crate::candidates::{SearchOutcome, ranked};
use crate::error::PlanError;
use crate::evaluate::PipelineTiming;
use crate::layers::LayerRange;
use crate::long_context_price::{ContextPricer, StageFrame};
use crate::long_context_stage::{HeadGroup, StageContext};
use crate::partition::{ClassShare, ReplicaClass, check_group_count, set_partitions, split_micro_batches};
use crate::plan::{PLAN_VERSION_WITH_CONTEXT, Plan, Stage, state_shards};
use crate::shard_split::{GroupCost, GroupKind, KindShare, split_by_kind};

/// Sequences at least this long also get context-parallel candidates.
pub const LONG_CONTEXT_TOKENS: u32 = 16_384;
/// Head-parallel group sizes tried: powers of two up to a node.
const HP_DEGREES: [u32; 4] = [1, 2, 4, 8];
/// Tokens per attention block: FlashAttention's tile and the ring's unit of work.
const BLOCK_TOKENS: u32 = 128;
/// Configurations kept per vendor block before blocks are combined.
const CONFIGS_PER_BLOCK: usize = 4;
/// Estimated layouts that become explicit plans.
const FINALISTS: usize = 8;

/// Degrees a user pins (`--fix cp=4,hp=2`): `cp` head-parallel groups of `hp` devices per
/// stage, `pp` stages, `dp` replicas per vendor block. The split within them is still chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextDegrees {
    pub cp: u32,
    pub hp: u32,
    pub pp: u32,
    pub dp: u32,
}

/// A kind of head-parallel group in a cell: `size` devices of one node of node group `group`,
/// `per_cell` of them in every cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Kind {
    group: usize,
    size: u32,
    per_cell: u32,
}

/// One vendor block's layout, priced: `pp · dp` identical cells of `kinds`, each kind's groups'
/// shards in `shares`: its groups but the last, then its last (which passes keys and values on
/// to the next kind, whose shard may differ: it may need another).
#[derive(Clone, Debug)]
struct BlockConfig {
    kinds: Vec<Kind>,
    pp: u32,
    dp: u32,
    recompute: Recompute,
    shares: Vec<Vec<KindShare>>,
    timing: PipelineTiming,
    /// Gradient synchronisation and optimizer step after the pipeline drains.
    after_s: f64,
}

impl BlockConfig {
    /// Sequences per second the block would train alone on `global_batch` sequences a step:
    /// its pipelines' fill and drain and its gradient synchronisation count, which a deep,
    /// narrow block pays for when the batch is small.
    fn throughput(&self, global_batch: u32) -> f64 {
        let per_replica = global_batch.div_ceil(self.dp);
        f64::from(global_batch) / (self.timing.time_s(per_replica) + self.after_s)
    }
}

/// The block size of a sequence of `seq_len` tokens over up to `n_devices` shards: [`BLOCK_TOKENS`],
/// or the largest power of two such that the sequence is whole pairs of blocks, at least one
/// pair a device (a short sequence over many devices takes small blocks).
pub(crate) fn block_tokens(seq_len: u32, n_devices: usize) -> u32 {
    let mut block = BLOCK_TOKENS;
    let too_few_pairs = |block: u32| (seq_len / (2 * block)) < n_devices as u32;
    while block > 1 && (!seq_len.is_multiple_of(2 * block) || too_few_pairs(block)) {
        block /= 2;
    }
    block
}

/// Why the job cannot have context-parallel plans, if it cannot.
pub fn unsupported(job: &JobSpec) -> Option<String> {
    if job.micro_batch().is_some_and(|micro_batch| micro_batch != 1) {
        return Some("context parallelism splits one sequence per micro-batch: leave the micro-batch at 1".into());
    }
    if job.schedule() == Schedule::Fixed(ScheduleKind::Interleaved) {
        return Some("context-parallel stages run one model chunk per rank, not interleaved 1F1B".into());
    }
    if !job.seq_len().is_multiple_of(2) {
        return Some(format!("a sequence of {} tokens does not split into head–tail halves", job.seq_len()));
    }
    None
}

/// The long-context planner over one model, job and cluster.
pub(crate) struct ContextSpace<'a> {
    cluster: &'a Cluster,
    job: &'a JobSpec,
    cost: CostModel<'a>,
    slots: Vec<DeviceSlot>,
    first_ids: Vec<u32>,
    block: u32,
}

impl<'a> ContextSpace<'a> {
    pub(crate) fn new(
        cluster: &'a Cluster,
        model: &'a ModelSpec,
        job: &'a JobSpec,
        calibration: &'a Calibration,
    ) -> Self {
        ContextSpace {
            cluster,
            job,
            cost: CostModel::new(model, job.seq_len(), calibration).with_states(StateFormat::of_job(job)),
            slots: cluster.devices(),
            first_ids: cluster.group_first_ids(),
            block: block_tokens(job.seq_len(), cluster.n_gpus() as usize),
        }
    }

    fn pricer(&self) -> ContextPricer<'_> {
        ContextPricer {
            cost: &self.cost,
            cluster: self.cluster,
            slots: &self.slots,
            memory_headroom: self.job.memory_headroom(),
        }
    }

    fn model(&self) -> &ModelSpec {
        self.cost.model()
    }

    fn node_group(&self, group: usize) -> &NodeGroup {
        &self.cluster.groups()[group]
    }

    fn device_node_group(&self, device: DeviceId) -> &NodeGroup {
        self.node_group(self.slots[device as usize].group_idx)
    }

    fn recomputes(&self) -> Vec<Recompute> {
        self.job.recompute().map_or(Recompute::ALL.to_vec(), |recompute| vec![recompute])
    }

    /// Head-parallel groups of `size` devices node group `group` holds.
    fn groups_of(&self, group: usize, size: u32) -> u32 {
        let node_group = self.node_group(group);
        node_group.n_nodes * (node_group.gpus_per_node / size)
    }

    /// Every configuration of a block over all of `groups` (one vendor's) the degrees allow,
    /// priced.
    fn block_configs(&self, groups: &[usize], fixed: Option<ContextDegrees>) -> Vec<BlockConfig> {
        let sizes: Vec<u32> = match fixed {
            Some(degrees) => vec![degrees.hp],
            None => HP_DEGREES.to_vec(),
        };
        let mut candidates = Vec::new();
        for size in sizes {
            let fits_nodes = groups.iter().all(|&g| self.node_group(g).gpus_per_node.is_multiple_of(size));
            if !fits_nodes || size > self.model().n_heads() {
                continue;
            }
            for (pp, dp, per_cell) in self.cell_counts(groups, size, fixed) {
                let kinds: Vec<Kind> =
                    groups.iter().zip(&per_cell).map(|(&group, &per_cell)| Kind { group, size, per_cell }).collect();
                candidates.extend(self.recomputes().into_iter().map(|recompute| (kinds.clone(), pp, dp, recompute)));
            }
        }
        candidates
            .into_iter()
            .filter_map(|(kinds, pp, dp, recompute)| self.price_block(kinds, pp, dp, recompute))
            .collect()
    }

    /// (pp, dp, head-parallel groups of each of `subset`'s kinds per cell): every group used
    /// when nothing is pinned, else the pinned degrees with every way to make up `cp` groups.
    fn cell_counts(&self, subset: &[usize], size: u32, fixed: Option<ContextDegrees>) -> Vec<(u32, u32, Vec<u32>)> {
        let available: Vec<u32> = subset.iter().map(|&g| self.groups_of(g, size)).collect();
        let n_layers = self.model().n_layers();
        if let Some(degrees) = fixed {
            let cells = degrees.pp * degrees.dp;
            let bounds: Vec<u32> = available.iter().map(|&n| (n / cells).min(degrees.cp)).collect();
            return compositions(degrees.cp, &bounds)
                .into_iter()
                .filter(|_| degrees.pp <= n_layers)
                .map(|per_cell| (degrees.pp, degrees.dp, per_cell))
                .collect();
        }
        let fewest = available.iter().copied().min().unwrap_or(0);
        let mut counts = Vec::new();
        for pp in (0..).map(|e| 1u32 << e).take_while(|&pp| pp <= n_layers.min(fewest)) {
            let mut dps: Vec<u32> = available
                .iter()
                .flat_map(|&n| (1..=n / pp).filter(move |dp| (n / pp).is_multiple_of(*dp)))
                .chain((0..).map(|e| 1u32 << e).take_while(|&dp| dp <= fewest / pp))
                .filter(|&dp| dp * pp <= fewest && dp <= self.job.global_batch())
                .collect();
            dps.sort_unstable();
            dps.dedup();
            for dp in dps {
                counts.push((pp, dp, available.iter().map(|&n| n / (pp * dp)).collect()));
            }
        }
        counts
    }

    /// The link keys and values cross between a cell's groups: the node's, when the cell fits
    /// in one node, else the network between the kinds' nodes.
    fn kv_link(&self, kinds: &[Kind]) -> Link {
        let node_group = self.node_group(kinds[0].group);
        match kinds {
            [kind] if kind.per_cell * kind.size <= node_group.gpus_per_node => comm::intra_node_peer_link(node_group),
            _ => self.nic(kinds),
        }
    }

    /// Prices one block configuration, if its split fits in memory.
    fn price_block(&self, kinds: Vec<Kind>, pp: u32, dp: u32, recompute: Recompute) -> Option<BlockConfig> {
        let model = self.model();
        let n_tokens = u64::from(self.job.seq_len());
        let n_layers = model.n_layers();
        let cell_devices: u32 = kinds.iter().map(|kind| kind.per_cell * kind.size).sum();
        let n_groups: usize = kinds.iter().map(|kind| kind.per_cell as usize).sum();
        let micro_batches = self.job.global_batch().div_ceil(dp);
        let in_flight = f64::from(self.job.schedule().in_flight(0, pp as usize, 1, micro_batches));
        let optimizer_shards = state_shards(self.job.zero1(), dp, cell_devices);
        let first = StageShape { n_layers: n_layers.div_ceil(pp), embedding: true, head: pp == 1 };
        let last = StageShape { n_layers: n_layers / pp, embedding: pp == 1, head: true };
        let frames = [
            StageFrame { shape: first, recompute, in_flight, optimizer_shards },
            StageFrame { shape: last, recompute, in_flight: 1.0, optimizer_shards },
        ];
        let kv_link = self.kv_link(&kinds);
        let pricer = self.pricer();
        let costs: Vec<GroupCost> = kinds
            .iter()
            .map(|kind| {
                let node_group = self.node_group(kind.group);
                let size = kind.size as usize;
                pricer.group_cost(node_group, size, n_groups, n_tokens, kv_link, KvExchange::Ring, &frames)
            })
            .collect();
        let (group_kinds, owners) = ring_kinds(&kinds, &costs);
        let sub_shares = split_by_kind(&group_kinds, n_tokens, u64::from(self.block)).ok()?;
        let unit = 2 * u64::from(self.block);
        let stage_s = group_kinds
            .iter()
            .zip(&sub_shares)
            .flat_map(|(kind, share)| {
                let fewest = |next: &usize| sub_shares[*next].tokens(unit).min().unwrap_or(unit);
                let next_tokens = kind.next.iter().map(fewest).min().unwrap_or(unit) as f64;
                share.tokens(unit).dedup().map(move |tokens| kind.cost.time_s(tokens as f64, next_tokens))
            })
            .fold(0.0, f64::max);
        let mut shares = vec![Vec::new(); kinds.len()];
        for (share, &owner) in sub_shares.into_iter().zip(&owners) {
            shares[owner].push(share);
        }
        let most_tokens = kinds
            .iter()
            .zip(&shares)
            .flat_map(|(kind, shares)| shares.iter().map(move |share| (share.units + 1) * unit / u64::from(kind.size)))
            .max()
            .unwrap_or(n_tokens);
        let boundary_s =
            kv_link.transfer_s(most_tokens as f64 * self.cost.precision().element_bytes() * f64::from(model.hidden()));
        let pass = PassTime { forward_s: stage_s / 3.0, backward_s: 2.0 * stage_s / 3.0, weight_grad_s: 0.0 };
        let timing = PipelineTiming::new(&vec![pass; pp as usize], &vec![boundary_s; pp as usize - 1]);
        let params = self.cost.stage_params(first);
        // Gradients reduce over each cell's devices, then across the replicas by shares, which
        // an overlapping job hides behind the last backward pass as far as it goes.
        let grad_bytes = self.job.grad_reduce().bytes();
        let in_cell_s = comm::ring_all_reduce_s(grad_bytes * params, cell_devices, kv_link);
        let across_bytes = grad_bytes * params / f64::from(cell_devices);
        let mut across_s = comm::ring_all_reduce_s(across_bytes, dp, self.nic(&kinds));
        if self.job.overlap_grad_reduce() {
            let buckets = comm::gradient_buckets(params / f64::from(cell_devices), dp as usize);
            across_s = comm::exposed_reduction_s(across_s, buckets, pass.backward_s);
        }
        let sync_s = in_cell_s + across_s;
        let optimizer_s = kinds
            .iter()
            .map(|kind| self.cost.optimizer_step_s(self.node_group(kind.group), params / f64::from(optimizer_shards)))
            .fold(0.0, f64::max);
        Some(BlockConfig { kinds, pp, dp, recompute, shares, timing, after_s: sync_s + optimizer_s })
    }

    /// The network between `kinds`' nodes.
    fn nic(&self, kinds: &[Kind]) -> Link {
        let groups: Vec<usize> = kinds.iter().map(|kind| kind.group).collect();
        comm::nic_link(self.cluster, &groups)
    }

    /// The best layouts over the vendors' blocks, estimated, best first, and how many block
    /// configurations were priced.
    fn layouts(
        &self,
        allowed: &[usize],
        fixed: Option<ContextDegrees>,
    ) -> (Vec<Vec<(BlockConfig, ClassShare)>>, usize) {
        let groups_of = |mask: u32| -> Vec<usize> {
            (0..allowed.len()).filter(|bit| mask & (1 << bit) != 0).map(|bit| allowed[bit]).collect()
        };
        let one_vendor = |mask: u32| groups_of(mask).iter().map(|&g| self.node_group(g).device.vendor).all_equal();
        // Every block a partition may hold: each subset of one vendor's groups, all of them used.
        let masks: Vec<u32> = (1..1u32 << allowed.len()).filter(|&mask| one_vendor(mask)).collect();
        let priced_blocks: Vec<(u32, Vec<BlockConfig>)> =
            masks.par_iter().map(|&mask| (mask, self.block_configs(&groups_of(mask), fixed))).collect();
        let priced = priced_blocks.iter().map(|(_, configs)| configs.len()).sum();
        // Per (block, recompute): its fastest configurations, then leaving it out.
        let mut options: BTreeMap<(u32, Recompute), Vec<Option<BlockConfig>>> = BTreeMap::new();
        for (mask, mut configs) in priced_blocks {
            let batch = self.job.global_batch();
            configs.sort_by(|a, b| b.throughput(batch).total_cmp(&a.throughput(batch)));
            for recompute in self.recomputes() {
                let fastest = configs.iter().filter(|config| config.recompute == recompute).take(CONFIGS_PER_BLOCK);
                options.insert((mask, recompute), fastest.cloned().map(Some).chain([None]).collect());
            }
        }
        let mut layouts: Vec<(f64, Vec<(BlockConfig, ClassShare)>)> = Vec::new();
        // A plan has one recompute mode: its blocks share it.
        for recompute in self.recomputes() {
            for partition in set_partitions((1u32 << allowed.len()) - 1) {
                let Some(blocks) =
                    partition.iter().map(|&mask| options.get(&(mask, recompute))).collect::<Option<Vec<_>>>()
                else {
                    continue;
                };
                for choice in blocks.into_iter().multi_cartesian_product() {
                    let chosen: Vec<&BlockConfig> = choice.into_iter().flatten().collect();
                    if let Some(layout) = self.combine(&chosen) {
                        layouts.push(layout);
                    }
                }
            }
        }
        layouts.sort_by(|a, b| a.0.total_cmp(&b.0));
        (layouts.into_iter().take(FINALISTS).map(|(_, layout)| layout).collect(), priced)
    }

    /// Blocks as data-parallel replicas sharing the batch unevenly: the estimated step, and each
    /// block's share.
    fn combine(&self, chosen: &[&BlockConfig]) -> Option<(f64, Vec<(BlockConfig, ClassShare)>)> {
        let classes: Vec<ReplicaClass> =
            chosen.iter().map(|config| ReplicaClass { timing: config.timing, count: config.dp }).collect();
        let (pipeline_s, shares) = split_micro_batches(&classes, self.job.global_batch())?;
        let after_s = chosen.iter().map(|config| config.after_s).fold(0.0, f64::max);
        Some((pipeline_s + after_s, chosen.iter().map(|&config| config.clone()).zip(shares).collect()))
    }

    /// The plan of `layout`: each block's cells in order, replica by replica.
    fn build(&self, layout: &[(BlockConfig, ClassShare)]) -> Result<Plan, PlanError> {
        let recompute = layout[0].0.recompute;
        let mut replicas = Vec::new();
        for (config, share) in layout {
            // Every head-parallel group of each kind, node by node, in device order.
            let kind_groups: Vec<Vec<Vec<DeviceId>>> = config.kinds.iter().map(|kind| self.hp_groups(*kind)).collect();
            let unit = 2 * u64::from(self.block);
            let mut micro_batches = share.per_replica();
            for replica in 0..config.dp {
                let stages = (0..config.pp)
                    .map(|stage| {
                        let cell = (replica * config.pp + stage) as usize;
                        config
                            .kinds
                            .iter()
                            .zip(&kind_groups)
                            .zip(&config.shares)
                            .flat_map(|((kind, groups), shares)| {
                                let cell_groups = &groups[cell * kind.per_cell as usize..][..kind.per_cell as usize];
                                let tokens = shares.iter().flat_map(|share| share.tokens(unit));
                                cell_groups.iter().cloned().zip(tokens)
                            })
                            .collect::<Vec<_>>()
                    })
                    .collect::<Vec<_>>();
                let n_micro_batches = micro_batches.next().expect("a share per replica");
                replicas.push(self.replica(stages, n_micro_batches, recompute, false));
            }
        }
        self.plan(recompute, replicas)
    }

    /// `kind`'s head-parallel groups over its node group, node by node.
    fn hp_groups(&self, kind: Kind) -> Vec<Vec<DeviceId>> {
        let node_group = self.node_group(kind.group);
        let first = self.first_ids[kind.group];
        (0..node_group.n_nodes * node_group.gpus_per_node / kind.size)
            .map(|idx| (first + idx * kind.size..first + (idx + 1) * kind.size).collect())
            .collect()
    }

    /// A replica whose stages hold `stages[i]`'s groups (devices and shard tokens), layers split
    /// as evenly as they go (the first stages take the remainder), device tokens even or
    /// balanced against uneven heads.
    fn replica(
        &self,
        stages: Vec<Vec<(Vec<DeviceId>, u64)>>,
        n_micro_batches: u32,
        recompute: Recompute,
        even: bool,
    ) -> ReplicaLayout {
        let n_layers = self.model().n_layers();
        let pp = stages.len() as u32;
        let mut start = 0;
        let stages = stages
            .into_iter()
            .enumerate()
            .map(|(idx, groups)| {
                let count = n_layers / pp + u32::from((idx as u32) < n_layers % pp);
                let layers = LayerRange { start, end: start + count };
                start += count;
                self.stage(groups, layers, recompute, even)
            })
            .collect();
        ReplicaLayout { n_micro_batches, stages }
    }

    fn stage(&self, groups: Vec<(Vec<DeviceId>, u64)>, layers: LayerRange, recompute: Recompute, even: bool) -> Stage {
        let n_tokens = u64::from(self.job.seq_len());
        let pricer = self.pricer();
        let mut devices = Vec::new();
        let groups = groups
            .into_iter()
            .map(|(members, tokens)| {
                let weights = vec![1.0; members.len()];
                let heads: Vec<u32> = HeadSplit::proportional(self.model(), &weights)
                    .expect("a group no larger than the heads")
                    .shares()
                    .iter()
                    .map(|share| share.q_heads)
                    .collect();
                let device_tokens = match even {
                    true => {
                        medley_cost::long_context::split_whole(tokens as u32, &weights).expect("a token per device")
                    }
                    false => {
                        let node_group = &self.cluster.groups()[self.slots[members[0] as usize].group_idx];
                        pricer.balance_tokens(node_group, n_tokens, tokens, &heads, recompute)
                    }
                };
                devices.extend(members);
                HeadGroup { tokens: tokens as u32, device_tokens, heads }
            })
            .collect();
        let context = StageContext { block: self.block, kv_exchange: KvExchange::Ring, groups };
        Stage { devices, layers, context: Some(context) }
    }

    /// The plan of `replicas`, routes chosen.
    fn plan(&self, recompute: Recompute, replicas: Vec<ReplicaLayout>) -> Result<Plan, PlanError> {
        let setting = Setting { micro_batch: 1, tp: 1, recompute };
        let mut parts = assemble(self.cluster, &self.cost, self.job, setting, self.job.schedule(), 1, replicas);
        parts.version = PLAN_VERSION_WITH_CONTEXT;
        Plan::new(parts)
    }
}

/// The kinds of a cell's groups as the ring meets them: each device kind's groups but its last
/// (followed by one of their own kind or by the last), then its last (followed by the next
/// kind's first); with the device kind each came from.
fn ring_kinds(kinds: &[Kind], costs: &[GroupCost]) -> (Vec<GroupKind>, Vec<usize>) {
    // Where each device kind's first sub-kind sits.
    let firsts: Vec<usize> = kinds
        .iter()
        .scan(0, |at, kind| Some(std::mem::replace(at, *at + 1 + usize::from(kind.per_cell > 1))))
        .collect();
    let mut group_kinds = Vec::new();
    let mut owners = Vec::new();
    for (k, (kind, cost)) in kinds.iter().zip(costs).enumerate() {
        let after = firsts[(k + 1) % kinds.len()];
        if kind.per_cell > 1 {
            let (inner, last) = (group_kinds.len(), group_kinds.len() + 1);
            let next = if kind.per_cell > 2 { vec![inner, last] } else { vec![last] };
            group_kinds.push(GroupKind { cost: cost.clone(), count: kind.per_cell - 1, next });
            owners.push(k);
        }
        group_kinds.push(GroupKind { cost: cost.clone(), count: 1, next: vec![after] });
        owners.push(k);
    }
    (group_kinds, owners)
}

/// Every way to pick `bounds.len()` counts, each from 1 to its bound, adding up to `total`.
fn compositions(total: u32, bounds: &[u32]) -> Vec<Vec<u32>> {
    match bounds {
        [] => vec![],
        [bound] => {
            if (1..=*bound).contains(&total) {
                vec![vec![total]]
            } else {
                vec![]
            }
        }
        [bound, rest @ ..] => (1..=(*bound).min(total.saturating_sub(rest.len() as u32)))
            .flat_map(|first| {
                compositions(total - first, rest).into_iter().map(move |mut tail| {
                    tail.insert(0, first);
                    tail
                })
            })
            .collect(),
    }
}

/// Searches context-parallel plans over `groups` of the cluster (all when `None`), with degrees
/// pinned or not, and returns the `top` fastest that fit.
pub fn search_long_context(
    cluster: &Cluster,
    model: &ModelSpec,
    job: &JobSpec,
    calibration: &Calibration,
    groups: Option<&[usize]>,
    fixed: Option<ContextDegrees>,
    top: usize,
) -> Result<SearchOutcome, PlanError> {
    crate::error::check_precision(cluster, job)?;
    if let Some(reason) = unsupported(job) {
        return Err(PlanError::NothingFits(reason));
    }
    let space = ContextSpace::new(cluster, model, job, calibration);
    let allowed: Vec<usize> = groups.map_or_else(|| (0..cluster.groups().len()).collect(), <[usize]>::to_vec);
    check_group_count(allowed.len())?;
    let (layouts, layouts_priced) = space.layouts(&allowed, fixed);
    let mut built: Vec<Plan> = layouts.par_iter().map(|layout| space.build(layout)).collect::<Result<_, _>>()?;
    // The even layouts over the whole fleet, re-split: their pipelines may run a vendor or a
    // type per stage, which the identical cells above do not.
    if groups.is_none() && fixed.is_none() {
        let even = EvenBaselines::compute(cluster, model, job, calibration);
        built.extend(even.rows().into_iter().filter_map(|(_, candidate)| space.resplit(&candidate?.plan)));
    }
    // Each also with its layers split by its stages' speed (the head's stage lighter).
    let relayered: Vec<Plan> = built.par_iter().filter_map(|plan| space.rebalance_layers(plan)).collect();
    built.extend(relayered);
    let candidates = ranked(built.into_par_iter(), calibration, top);
    if candidates.is_empty() {
        return Err(PlanError::NothingFits(format!(
            "no context-parallel layout of {} at {} tokens fits{}",
            model.name(),
            job.seq_len(),
            match fixed {
                Some(degrees) =>
                    format!(" with cp={} hp={} pp={} dp={}", degrees.cp, degrees.hp, degrees.pp, degrees.dp),
                None => String::new(),
            }
        )));
    }
    Ok(SearchOutcome { candidates, layouts_priced })
}
