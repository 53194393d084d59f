//! The heterogeneity-aware search.
//!
//! A layout is a set of *blocks*. Each block takes some of the cluster's node groups and cuts them
//! into `d` identical replicas; each replica is a pipeline whose stages are TP groups of one device
//! type inside one node, ordered type by type. The search enumerates, per setting (TP degree,
//! micro-batch size, recompute):
//! 1. which node groups each block takes (every partition of every subset of groups, so "one block
//!    of mixed pipelines", "one block per type" and "leave a slow type out" are all candidates);
//! 2. per block, the order of types along the pipeline and the replica count (each distinct
//!    stages-per-type vector once, with the most replicas that give it);
//! 3. per block, the optimal min-max split of layers over its uneven stages within memory;
//! 4. per layout, the optimal min-max split of micro-batches over the uneven replicas.
//!
//! Blocks are priced once and only their best few are combined. The best layouts by this
//! estimate become explicit plans, priced again by [`evaluate`](crate::evaluate::evaluate)
//! and ranked by that one number.

use std::collections::BTreeMap;

use medley_cost::comm::{self, DomainPart, Link};
use medley_cost::{Calibration, CostModel, PassTime, Setting, StageShape};
use medley_spec::{BridgeMode, Cluster, DeviceSlot, JobSpec, ModelSpec, NodeGroup, Recompute, Vendor};
use rayon::prelude::*;

use crate::assemble::{ReplicaLayout, assemble, stages_from_counts};
use crate::error::PlanError;
use crate::evaluate::{PipelineTiming, Prediction, capacity_bytes, evaluate};
use crate::partition::{ClassShare, ReplicaClass, StageLoad, min_max_layers, split_micro_batches};
use crate::plan::Plan;

/// What to search.
#[derive(Clone, Debug)]
pub struct SearchOptions {
    /// How many ranked plans to return.
    pub top: usize,
    /// Node groups the search may use; `None` for all.
    pub groups: Option<Vec<usize>>,
    /// Enumerate every layer split instead of the min-max one, and price every layout exactly
    /// (small clusters only: the check that the fast search loses nothing).
    pub exhaustive: bool,
}

impl Default for SearchOptions {
    fn default() -> Self {
        SearchOptions { top: 5, groups: None, exhaustive: false }
    }
}

/// A plan with its prediction.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub plan: Plan,
    pub prediction: Prediction,
}

/// The ranked plans and how much work found them.
#[derive(Clone, Debug)]
pub struct SearchOutcome {
    pub candidates: Vec<Candidate>,
    /// Pipelines (block configurations) and layouts priced by the estimate.
    pub layouts_priced: usize,
}

/// TP degrees the search tries: powers of two up to a node.
const TP_DEGREES: [u32; 4] = [1, 2, 4, 8];
/// Micro-batch sizes the search tries when the job does not fix one.
const MICRO_BATCHES: [u32; 4] = [1, 2, 4, 8];
/// Configurations kept per block before blocks are combined.
const CONFIGS_PER_BLOCK: usize = 6;
/// Layouts per setting that become explicit plans.
const FINALISTS_PER_SETTING: usize = 6;

/// Searches the plan space and returns the best plans that fit, fastest first.
pub fn search(
    cluster: &Cluster,
    model: &ModelSpec,
    job: &JobSpec,
    calibration: &Calibration,
    options: &SearchOptions,
) -> Result<SearchOutcome, PlanError> {
    let cost = CostModel::new(model, job.seq_len(), calibration);
    let allowed: Vec<usize> = options.groups.clone().unwrap_or_else(|| (0..cluster.groups().len()).collect());
    let space = Space {
        cluster,
        slots: cluster.devices(),
        first_ids: cluster.group_first_ids(),
        bridge_modes: cluster.bridge().modes(),
        job,
        cost,
        exhaustive: options.exhaustive,
    };
    let per_setting: Vec<(Vec<Layout>, usize)> = candidate_settings(cluster, model, job, &allowed)
        .par_iter()
        .map(|&setting| space.layouts(setting, &allowed))
        .collect();
    let layouts_priced = per_setting.iter().map(|(_, priced)| priced).sum();
    let finalists: Vec<Layout> = per_setting.into_iter().flat_map(|(layouts, _)| layouts).collect();
    let mut candidates: Vec<Candidate> = finalists
        .par_iter()
        .map(|layout| {
            let plan = space.assemble(layout);
            let prediction = evaluate(&plan, calibration);
            Candidate { plan, prediction }
        })
        .filter(|candidate| candidate.prediction.fits)
        .collect();
    candidates.sort_by(|a, b| a.prediction.step_time_s.total_cmp(&b.prediction.step_time_s));
    candidates.truncate(options.top.max(1));
    if candidates.is_empty() {
        return Err(PlanError::NothingFits(nothing_fits_hint(cluster, &allowed, model, job, &space.cost)));
    }
    Ok(SearchOutcome { candidates, layouts_priced })
}

/// Every (TP, micro-batch, recompute) the job allows and the model's heads divide.
pub(crate) fn candidate_settings(
    cluster: &Cluster,
    model: &ModelSpec,
    job: &JobSpec,
    allowed: &[usize],
) -> Vec<Setting> {
    let node_fits = |tp: u32| allowed.iter().any(|&g| cluster.groups()[g].gpus_per_node.is_multiple_of(tp));
    let heads_split = |tp: u32| {
        model.n_heads().is_multiple_of(tp)
            && (model.n_kv_heads().is_multiple_of(tp) || tp.is_multiple_of(model.n_kv_heads()))
    };
    TP_DEGREES
        .into_iter()
        .filter(|&tp| node_fits(tp) && heads_split(tp))
        .flat_map(|tp| settings_with_tp(job, tp))
        .collect()
}

/// Every (micro-batch, recompute) the job allows, with tensor parallelism `tp`.
pub(crate) fn settings_with_tp(job: &JobSpec, tp: u32) -> Vec<Setting> {
    let micro_batches: Vec<u32> = match job.micro_batch() {
        Some(micro_batch) => vec![micro_batch],
        None => MICRO_BATCHES.into_iter().filter(|mb| job.global_batch().is_multiple_of(*mb)).collect(),
    };
    let recomputes: Vec<Recompute> = job.recompute().map_or(Recompute::ALL.to_vec(), |recompute| vec![recompute]);
    micro_batches
        .iter()
        .flat_map(|&micro_batch| recomputes.iter().map(move |&recompute| Setting { micro_batch, tp, recompute }))
        .collect()
}

/// How a block's replicas are laid onto its node groups' tensor-parallel units (TP groups).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placement {
    /// Each replica takes consecutive units: pipeline neighbours share nodes, gradient groups
    /// span nodes.
    PipelineMajor,
    /// Megatron-LM's rank order (dp inside pp): one stage's replicas take consecutive units, so
    /// gradient groups share nodes and pipeline neighbours span nodes.
    DataMajor,
}

impl Placement {
    const ALL: [Placement; 2] = [Placement::PipelineMajor, Placement::DataMajor];

    /// The unit, within its node group, of stage `stage_in_group` of `replica`.
    fn unit(self, replica: u32, stage_in_group: u32, stages_per_replica: u32, n_replicas: u32) -> u32 {
        match self {
            Placement::PipelineMajor => replica * stages_per_replica + stage_in_group,
            Placement::DataMajor => stage_in_group * n_replicas + replica,
        }
    }
}

/// Replicas whose links are inspected when pricing a template: placement patterns repeat with
/// a period that divides the units per node, so this many cover nodes of up to 16 GPUs.
const SAMPLED_REPLICAS: u32 = 16;

/// One block's pipeline template: `n_replicas` copies of stages taken type by type.
#[derive(Clone, Debug)]
struct BlockConfig {
    /// (node group, stages of it per replica), in pipeline order.
    order: Vec<(usize, u32)>,
    placement: Placement,
    n_replicas: u32,
    layers: Vec<u32>,
    timing: PipelineTiming,
    /// Gradient bytes of the block's largest stage per TP rank, for the sync estimate.
    max_stage_grad_bytes: f64,
    /// The slowest link of any stage's gradient ring inside the block.
    dp_link: Link,
    vendors: Vec<Vendor>,
}

impl BlockConfig {
    /// Micro-batches per second in steady state: the ranking used to prune blocks.
    fn throughput(&self) -> f64 {
        f64::from(self.n_replicas) / self.timing.cycle_s
    }
}

/// A layout: blocks and their replicas' batch shares.
#[derive(Clone, Debug)]
struct Layout {
    setting: Setting,
    blocks: Vec<BlockConfig>,
    shares: Vec<ClassShare>,
    estimate_s: f64,
}

struct Space<'a> {
    cluster: &'a Cluster,
    slots: Vec<DeviceSlot>,
    first_ids: Vec<u32>,
    bridge_modes: Vec<BridgeMode>,
    job: &'a JobSpec,
    cost: CostModel<'a>,
    exhaustive: bool,
}

impl Space<'_> {
    fn n_micro_batches(&self, setting: Setting) -> u32 {
        self.job.global_batch() / setting.micro_batch
    }

    /// The best layouts for one setting, and how many configurations were priced.
    fn layouts(&self, setting: Setting, allowed: &[usize]) -> (Vec<Layout>, usize) {
        let usable: Vec<usize> = allowed
            .iter()
            .copied()
            .filter(|&g| self.cluster.groups()[g].gpus_per_node.is_multiple_of(setting.tp))
            .collect();
        let n = usable.len();
        let mut priced = 0;
        let mut block_configs: BTreeMap<u32, Vec<BlockConfig>> = BTreeMap::new();
        for mask in 1..(1u32 << n) {
            let block: Vec<usize> = (0..n).filter(|bit| mask & (1 << bit) != 0).map(|bit| usable[bit]).collect();
            let mut configs = self.block_configs(setting, &block);
            priced += configs.len();
            configs.sort_by(|a, b| {
                b.throughput().total_cmp(&a.throughput()).then(a.timing.fill_s.total_cmp(&b.timing.fill_s))
            });
            if !self.exhaustive {
                configs.truncate(CONFIGS_PER_BLOCK);
            }
            block_configs.insert(mask, configs);
        }
        let mut layouts = Vec::new();
        for mask in 1..(1u32 << n) {
            for partition in set_partitions(mask) {
                let options: Vec<&[BlockConfig]> =
                    partition.iter().map(|block| block_configs[block].as_slice()).collect();
                for_each_combination(&options, &mut |blocks| {
                    priced += 1;
                    if let Some(layout) = self.price_layout(setting, blocks) {
                        layouts.push(layout);
                    }
                });
            }
        }
        layouts.sort_by(|a, b| a.estimate_s.total_cmp(&b.estimate_s));
        if !self.exhaustive {
            layouts.truncate(FINALISTS_PER_SETTING);
        }
        (layouts, priced)
    }

    /// Every pipeline template of one block of node groups.
    fn block_configs(&self, setting: Setting, block: &[usize]) -> Vec<BlockConfig> {
        let groups = self.cluster.groups();
        let n_layers = self.cost.model().n_layers();
        let mut configs = Vec::new();
        for order in type_orders(groups, block) {
            let units: Vec<u32> = order.iter().map(|&g| groups[g].n_gpus() / setting.tp).collect();
            for (n_replicas, stages_per_group) in stage_vectors(&units, n_layers, self.n_micro_batches(setting)) {
                let order_counts: Vec<(usize, u32)> = order.iter().copied().zip(stages_per_group).collect();
                for placement in Placement::ALL {
                    let template = Template::new(self, setting, order_counts.clone(), placement, n_replicas);
                    let loads = template.loads();
                    let splits: Vec<Vec<u32>> = if self.exhaustive {
                        compositions_within(&loads, n_layers)
                    } else {
                        min_max_layers(&loads, n_layers).into_iter().collect()
                    };
                    configs.extend(splits.into_iter().map(|layers| template.config(layers)));
                }
            }
        }
        configs
    }

    /// Splits the batch over the layout's replicas and estimates the step.
    fn price_layout(&self, setting: Setting, blocks: &[&BlockConfig]) -> Option<Layout> {
        let classes: Vec<ReplicaClass> =
            blocks.iter().map(|block| ReplicaClass { timing: block.timing, count: block.n_replicas }).collect();
        let (pipeline_s, shares) = split_micro_batches(&classes, self.n_micro_batches(setting))?;
        let estimate_s = pipeline_s + self.dp_sync_estimate_s(blocks);
        Some(Layout { setting, blocks: blocks.iter().map(|&block| block.clone()).collect(), shares, estimate_s })
    }

    /// Gradient synchronisation over all replicas, for the largest stage: a ring inside one
    /// vendor domain, else the cheaper of a ring and a hierarchical all-reduce over the bridge.
    /// Inside a block the ring runs over the block's own links; between blocks over the NICs.
    fn dp_sync_estimate_s(&self, blocks: &[&BlockConfig]) -> f64 {
        let n_replicas: u32 = blocks.iter().map(|block| block.n_replicas).sum();
        let bytes = blocks.iter().map(|block| block.max_stage_grad_bytes).fold(0.0, f64::max);
        if n_replicas < 2 {
            return 0.0;
        }
        let mut vendors: Vec<Vendor> = blocks.iter().flat_map(|block| block.vendors.iter().copied()).collect();
        vendors.sort();
        vendors.dedup();
        let domains: Vec<DomainPart> = vendors.iter().map(|&vendor| self.domain_estimate(blocks, vendor)).collect();
        if let [domain] = domains.as_slice() {
            return comm::ring_all_reduce_s(bytes, n_replicas, domain.link);
        }
        let bridge = self.best_bridge_link(self.nic_link(&self.block_groups(blocks)));
        let flat_link = domains.iter().map(|domain| domain.link).fold(bridge, Link::slowest);
        comm::hierarchical_all_reduce_s(bytes, &domains, bridge)
            .min(comm::ring_all_reduce_s(bytes, n_replicas, flat_link))
    }

    /// The replicas of `vendor`'s blocks and the slowest link of a ring through them.
    fn domain_estimate(&self, blocks: &[&BlockConfig], vendor: Vendor) -> DomainPart {
        let members: Vec<&BlockConfig> =
            blocks.iter().copied().filter(|block| block.vendors.contains(&vendor)).collect();
        let inner = members.iter().map(|block| block.dp_link).reduce(Link::slowest).expect("a vendor has blocks");
        let link = if members.len() > 1 { inner.slowest(self.nic_link(&self.block_groups(&members))) } else { inner };
        DomainPart { n_ranks: members.iter().map(|block| block.n_replicas).sum(), link }
    }

    fn block_groups(&self, blocks: &[&BlockConfig]) -> Vec<&NodeGroup> {
        blocks.iter().flat_map(|block| block.order.iter().map(|&(g, _)| &self.cluster.groups()[g])).collect()
    }

    /// Inter-node link shared by `groups`: the smallest NIC share.
    fn nic_link(&self, groups: &[&NodeGroup]) -> Link {
        let fabric = self.cluster.fabric();
        let gb_s =
            groups.iter().map(|group| group.nic_gb_s_per_gpu()).fold(f64::INFINITY, f64::min) / fabric.oversubscription;
        Link { gb_s, latency_us: fabric.latency_us }
    }

    fn best_bridge_link(&self, nic: Link) -> Link {
        let bridge = self.cluster.bridge();
        bridge
            .modes()
            .into_iter()
            .map(|mode| {
                let (gb_s, latency_us) = bridge.rate(mode, nic.gb_s);
                Link { gb_s, latency_us }
            })
            .max_by(|a, b| a.gb_s.total_cmp(&b.gb_s))
            .expect("a bridge offers at least one mode")
    }

    /// The fastest link between two devices: any bridge mode the cluster offers across vendors.
    fn fastest_link(&self, a: DeviceSlot, b: DeviceSlot) -> Link {
        let groups = self.cluster.groups();
        if groups[a.group_idx].device.vendor == groups[b.group_idx].device.vendor {
            return comm::link_between(self.cluster, a, b, BridgeMode::DeviceDirect);
        }
        self.bridge_modes
            .iter()
            .map(|&mode| comm::link_between(self.cluster, a, b, mode))
            .reduce(|x, y| if y.gb_s > x.gb_s { y } else { x })
            .expect("a bridge offers at least one mode")
    }

    /// The explicit plan of a layout.
    fn assemble(&self, layout: &Layout) -> Plan {
        let tp = layout.setting.tp;
        let mut replicas = Vec::new();
        for (block, shares) in layout.blocks.iter().zip(&layout.shares) {
            for (replica_idx, n_micro_batches) in shares.per_replica().enumerate() {
                let replica_idx = replica_idx as u32;
                let device_groups: Vec<Vec<u32>> = block
                    .order
                    .iter()
                    .flat_map(|&(g, count)| {
                        (0..count).map(move |stage_in_group| {
                            let unit = block.placement.unit(replica_idx, stage_in_group, count, block.n_replicas);
                            let first = self.first_ids[g] + unit * tp;
                            (first..first + tp).collect()
                        })
                    })
                    .collect();
                replicas
                    .push(ReplicaLayout { n_micro_batches, stages: stages_from_counts(device_groups, &block.layers) });
            }
        }
        assemble(self.cluster, &self.cost, self.job, layout.setting, replicas)
    }
}

/// One block's stages, for pricing its layer splits.
struct Template<'s, 'a> {
    space: &'s Space<'a>,
    setting: Setting,
    order: Vec<(usize, u32)>,
    placement: Placement,
    n_replicas: u32,
    /// Per stage: (node group, index among that group's stages in a replica, that group's stages).
    positions: Vec<(usize, u32, u32)>,
    /// One transfer over each boundary, on the slowest sampled replica.
    boundary_s: Vec<f64>,
    dp_link: Link,
}

impl<'s, 'a> Template<'s, 'a> {
    fn new(
        space: &'s Space<'a>,
        setting: Setting,
        order: Vec<(usize, u32)>,
        placement: Placement,
        n_replicas: u32,
    ) -> Self {
        let positions = order
            .iter()
            .flat_map(|&(g, count)| (0..count).map(move |stage_in_group| (g, stage_in_group, count)))
            .collect();
        let unbounded = Link { gb_s: f64::INFINITY, latency_us: 0.0 };
        let mut template = Template {
            space,
            setting,
            order,
            placement,
            n_replicas,
            positions,
            boundary_s: Vec::new(),
            dp_link: unbounded,
        };
        template.boundary_s = template.boundary_times();
        template.dp_link = template.slowest_dp_link();
        template
    }

    fn stage_groups(&self) -> impl Iterator<Item = usize> + '_ {
        self.positions.iter().map(|&(g, _, _)| g)
    }

    fn shape(&self, stage_idx: usize, n_layers: u32) -> StageShape {
        StageShape { n_layers, embedding: stage_idx == 0, head: stage_idx + 1 == self.positions.len() }
    }

    /// Where the first device of stage `stage_idx` of `replica` sits.
    fn slot(&self, replica: u32, stage_idx: usize) -> DeviceSlot {
        let (g, stage_in_group, count) = self.positions[stage_idx];
        let unit = self.placement.unit(replica, stage_in_group, count, self.n_replicas);
        self.space.slots[(self.space.first_ids[g] + unit * self.setting.tp) as usize]
    }

    fn sampled_replicas(&self) -> std::ops::Range<u32> {
        0..self.n_replicas.min(SAMPLED_REPLICAS)
    }

    /// Units of group `g` per node: link patterns along a group's stages repeat with this period.
    fn units_per_node(&self, g: usize) -> u32 {
        self.space.cluster.groups()[g].gpus_per_node / self.setting.tp
    }

    fn boundary_times(&self) -> Vec<f64> {
        let bytes = self.space.cost.boundary_bytes(self.setting);
        let mut times: Vec<f64> = Vec::with_capacity(self.positions.len().saturating_sub(1));
        for next in 1..self.positions.len() {
            let ((g, stage_in_group, _), (previous_g, _, _)) = (self.positions[next], self.positions[next - 1]);
            let period = self.units_per_node(g);
            let time = if g == previous_g && stage_in_group > period {
                times[next - 1 - period as usize]
            } else {
                self.sampled_replicas()
                    .map(|replica| {
                        let link = self.space.fastest_link(self.slot(replica, next - 1), self.slot(replica, next));
                        link.transfer_s(bytes)
                    })
                    .fold(0.0, f64::max)
            };
            times.push(time);
        }
        times
    }

    /// The slowest link of any stage's gradient ring over the block's replicas.
    fn slowest_dp_link(&self) -> Link {
        let unbounded = self.dp_link;
        if self.n_replicas < 2 {
            return unbounded;
        }
        let last = self.n_replicas - 1;
        let pairs: Vec<(u32, u32)> =
            self.sampled_replicas().filter(|&r| r < last).map(|r| (r, r + 1)).chain([(last, 0)]).collect();
        (0..self.positions.len())
            .filter(|&stage| {
                let (g, stage_in_group, _) = self.positions[stage];
                stage_in_group < self.units_per_node(g)
            })
            .flat_map(|stage| pairs.iter().map(move |&(a, b)| (stage, a, b)))
            .map(|(stage, a, b)| self.space.fastest_link(self.slot(a, stage), self.slot(b, stage)))
            .fold(unbounded, Link::slowest)
    }

    /// What the partitioner needs: time per layer, fixed time and memory cap of every stage.
    fn loads(&self) -> Vec<StageLoad> {
        let groups = self.space.cluster.groups();
        let cost = &self.space.cost;
        let n_stages = self.positions.len();
        let boundary_s = &self.boundary_s;
        let replica_share = self.space.n_micro_batches(self.setting).div_ceil(self.n_replicas);
        let shards = if self.space.job.zero1() { self.n_replicas } else { 1 };
        self.stage_groups()
            .enumerate()
            .map(|(idx, g)| {
                let group = &groups[g];
                let head = if idx + 1 == n_stages { cost.head_time(group, self.setting) } else { PassTime::default() };
                let transfers =
                    boundary_s.get(idx).copied().unwrap_or(0.0) + if idx > 0 { boundary_s[idx - 1] } else { 0.0 };
                let in_flight = self.space.job.schedule().in_flight(idx, n_stages, replica_share);
                let memory =
                    |n_layers| cost.stage_memory(self.shape(idx, n_layers), self.setting, in_flight, shards).total();
                StageLoad {
                    per_layer_s: cost.layer_time(group, self.setting).total_s(),
                    fixed_s: head.total_s() + transfers,
                    max_layers: max_layers_within(
                        memory,
                        capacity_bytes(group.device.hbm_gib),
                        cost.model().n_layers(),
                    ),
                }
            })
            .collect()
    }

    fn config(&self, layers: Vec<u32>) -> BlockConfig {
        let groups = self.space.cluster.groups();
        let cost = &self.space.cost;
        let passes: Vec<PassTime> = self
            .stage_groups()
            .enumerate()
            .map(|(idx, g)| cost.stage_time(&groups[g], self.shape(idx, layers[idx]), self.setting))
            .collect();
        let max_stage_grad_bytes = (0..layers.len())
            .map(|idx| 2.0 * cost.stage_params(self.shape(idx, layers[idx])) / f64::from(self.setting.tp))
            .fold(0.0, f64::max);
        let mut vendors: Vec<Vendor> = self.order.iter().map(|&(g, _)| groups[g].device.vendor).collect();
        vendors.sort();
        vendors.dedup();
        BlockConfig {
            order: self.order.clone(),
            placement: self.placement,
            n_replicas: self.n_replicas,
            timing: PipelineTiming::new(&passes, &self.boundary_s),
            layers,
            max_stage_grad_bytes,
            dp_link: self.dp_link,
            vendors,
        }
    }
}

/// Most layers a stage holds within `capacity` bytes; memory grows linearly per layer.
fn max_layers_within(memory: impl Fn(u32) -> f64, capacity: f64, n_layers: u32) -> u32 {
    let (one, two) = (memory(1), memory(2));
    if one > capacity {
        return 0;
    }
    let per_layer = two - one;
    let estimate = if per_layer <= 0.0 {
        n_layers
    } else {
        (1.0 + (capacity - one) / per_layer).floor().min(f64::from(n_layers)) as u32
    };
    // Guard the float estimate against rounding at the boundary.
    (1..=estimate).rev().find(|&n| memory(n) <= capacity).unwrap_or(1)
}

/// Orders of a block's node groups along the pipeline: every permutation for up to four groups;
/// beyond that, vendors kept contiguous (one bridge crossing) largest memory first, and reversed.
fn type_orders(groups: &[NodeGroup], block: &[usize]) -> Vec<Vec<usize>> {
    if block.len() <= 4 {
        return permutations(block);
    }
    let mut order = block.to_vec();
    order.sort_by(|&a, &b| {
        let (ga, gb) = (&groups[a], &groups[b]);
        ga.device.vendor.cmp(&gb.device.vendor).then(gb.device.hbm_gib.total_cmp(&ga.device.hbm_gib)).then(a.cmp(&b))
    });
    let reversed = order.iter().rev().copied().collect();
    vec![order, reversed]
}

fn permutations(items: &[usize]) -> Vec<Vec<usize>> {
    if items.len() <= 1 {
        return vec![items.to_vec()];
    }
    (0..items.len())
        .flat_map(|idx| {
            let mut rest = items.to_vec();
            let first = rest.remove(idx);
            permutations(&rest).into_iter().map(move |mut tail| {
                tail.insert(0, first);
                tail
            })
        })
        .collect()
}

/// Distinct stages-per-group vectors `units[g] / d` for replica counts `d`, each with the largest
/// `d` that gives it, keeping pipelines no deeper than the layers and replicas no more than the
/// micro-batches.
fn stage_vectors(units: &[u32], n_layers: u32, n_micro_batches: u32) -> Vec<(u32, Vec<u32>)> {
    let max_replicas = units.iter().copied().min().unwrap_or(0).min(n_micro_batches);
    let mut vectors: Vec<(u32, Vec<u32>)> = Vec::new();
    for n_replicas in 1..=max_replicas {
        let stages: Vec<u32> = units.iter().map(|&u| u / n_replicas).collect();
        if stages.iter().sum::<u32>() > n_layers {
            continue;
        }
        match vectors.last_mut() {
            Some(last) if last.1 == stages => last.0 = n_replicas,
            _ => vectors.push((n_replicas, stages)),
        }
    }
    vectors
}

/// Every split of `n_layers` over the stages within their memory caps (exhaustive mode).
fn compositions_within(loads: &[StageLoad], n_layers: u32) -> Vec<Vec<u32>> {
    fn extend(loads: &[StageLoad], left: u32, prefix: &mut Vec<u32>, out: &mut Vec<Vec<u32>>) {
        let idx = prefix.len();
        if idx + 1 == loads.len() {
            if left >= 1 && left <= loads[idx].max_layers {
                prefix.push(left);
                out.push(prefix.clone());
                prefix.pop();
            }
            return;
        }
        let rest = (loads.len() - idx - 1) as u32;
        for count in 1..=loads[idx].max_layers.min(left.saturating_sub(rest)) {
            prefix.push(count);
            extend(loads, left - count, prefix, out);
            prefix.pop();
        }
    }
    let mut out = Vec::new();
    extend(loads, n_layers, &mut Vec::new(), &mut out);
    out
}

/// Every partition of the set bits of `mask` into blocks (as bit masks).
fn set_partitions(mask: u32) -> Vec<Vec<u32>> {
    if mask == 0 {
        return vec![Vec::new()];
    }
    let lowest = mask & mask.wrapping_neg();
    let rest = mask & !lowest;
    let mut partitions = Vec::new();
    // Every subset of `rest` joins the lowest element's block.
    let mut sub = rest;
    loop {
        let block = lowest | sub;
        for mut tail in set_partitions(rest & !sub) {
            tail.insert(0, block);
            partitions.push(tail);
        }
        if sub == 0 {
            break;
        }
        sub = (sub - 1) & rest;
    }
    partitions
}

/// Calls `visit` with every choice of one configuration per block.
fn for_each_combination<'c>(options: &[&'c [BlockConfig]], visit: &mut impl FnMut(&[&'c BlockConfig])) {
    fn recurse<'c>(
        options: &[&'c [BlockConfig]],
        chosen: &mut Vec<&'c BlockConfig>,
        visit: &mut impl FnMut(&[&'c BlockConfig]),
    ) {
        match options.split_first() {
            None => visit(chosen),
            Some((first, rest)) => {
                for config in *first {
                    chosen.push(config);
                    recurse(rest, chosen, visit);
                    chosen.pop();
                }
            }
        }
    }
    recurse(options, &mut Vec::with_capacity(options.len()), visit);
}

/// Says what would make the job fit when nothing does.
fn nothing_fits_hint(
    cluster: &Cluster,
    allowed: &[usize],
    model: &ModelSpec,
    job: &JobSpec,
    cost: &CostModel,
) -> String {
    let groups: Vec<&NodeGroup> = allowed.iter().map(|&g| &cluster.groups()[g]).collect();
    let states_gib = 16.0 * medley_cost::params::total_params(model) as f64 / medley_cost::GIB;
    let hbm_gib: f64 = groups.iter().map(|group| f64::from(group.n_gpus()) * group.device.hbm_gib).sum();
    let mut hints = Vec::new();
    if job.recompute() != Some(Recompute::Full) && job.recompute().is_some() {
        hints.push("--recompute full".to_string());
    }
    if job.micro_batch().is_some_and(|mb| mb > 1) {
        hints.push("--micro-batch 1".to_string());
    }
    let seq_len = cost.seq_len();
    if seq_len > 1024 {
        hints.push(format!("a shorter --seq-len than {seq_len}"));
    }
    let largest = groups.iter().map(|group| group.device.hbm_gib).fold(0.0, f64::max);
    let needed = (states_gib / (largest - 2.0).max(1.0) * 1.25).ceil();
    hints.push(format!("more devices (the model's weights, gradients and Adam states alone need {states_gib:.0} GiB, about {needed} GPUs of {largest:.0} GiB, before activations)"));
    format!(
        "no layout of the {} GPUs ({hbm_gib:.0} GiB in all) fits {} at sequence length {seq_len}; try {}",
        groups.iter().map(|group| group.n_gpus()).sum::<u32>(),
        model.name(),
        hints.join(", or ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_partitions_counts_are_bell_numbers() {
        assert_eq!(set_partitions(0b1).len(), 1);
        assert_eq!(set_partitions(0b11).len(), 2);
        assert_eq!(set_partitions(0b111).len(), 5);
        assert_eq!(set_partitions(0b1111).len(), 15);
        assert_eq!(set_partitions(0b1010).len(), 2);
    }

    #[test]
    fn stage_vectors_keep_the_most_replicas_per_shape() {
        assert_eq!(stage_vectors(&[8], 80, 1000), [(1, vec![8]), (2, vec![4]), (4, vec![2]), (8, vec![1])]);
        // Deeper than 4 layers is pruned; more replicas than micro-batches too.
        assert_eq!(stage_vectors(&[8, 4], 4, 1000), [(4, vec![2, 1])]);
        assert_eq!(stage_vectors(&[8], 80, 2), [(1, vec![8]), (2, vec![4])]);
    }
}
