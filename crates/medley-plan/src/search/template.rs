//! Block templates: how a block's replicas sit on its node groups, and what a layer split of
//! them costs.

use medley_cost::comm::{self, Link};
use medley_cost::{PassTime, Setting, StageShape};
use medley_spec::DeviceSlot;

use super::enumerate::compositions_within;
use super::{GroupSettings, Space};
use crate::evaluate::PipelineTiming;
use crate::partition::{StageLoad, fill_within, least_bound_s, next_bound_s};
use crate::plan::state_shards;
use medley_cost::GIB;
use medley_cost::memory::usable;

/// How a block's replicas are laid onto its node groups' tensor-parallel units (TP groups).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Placement {
    /// Each replica takes consecutive units: pipeline neighbours share nodes, gradient groups
    /// span nodes.
    PipelineMajor,
    /// Megatron-LM's rank order (dp inside pp): one stage's replicas take consecutive units, so
    /// gradient groups share nodes and pipeline neighbours span nodes.
    DataMajor,
}

impl Placement {
    /// The placements that differ for a block: with one replica, or one stage of each type per
    /// replica, both put the same stages on the same units.
    pub(super) fn distinct(order: &[(usize, u32)], n_replicas: u32) -> &'static [Placement] {
        if n_replicas == 1 || order.iter().all(|&(_, stages)| stages == 1) {
            &[Placement::PipelineMajor]
        } else {
            &[Placement::PipelineMajor, Placement::DataMajor]
        }
    }

    /// The unit, within its node group, of stage `stage_in_group` of `replica`.
    pub(super) fn unit(self, replica: u32, stage_in_group: u32, stages_per_replica: u32, n_replicas: u32) -> u32 {
        match self {
            Placement::PipelineMajor => replica * stages_per_replica + stage_in_group,
            Placement::DataMajor => stage_in_group * n_replicas + replica,
        }
    }
}

/// Replicas whose links are inspected when pricing a template: placement patterns repeat with
/// a period that divides the units per node, so this many cover nodes of up to 16 GPUs.
const SAMPLED_REPLICAS: u32 = 16;

/// Bounds above the min-max one tried when looking for a split with a shorter step.
const MAX_EXTRA_BOUNDS: usize = 48;

/// One block's pipeline template with a layer split: `n_replicas` copies of stages taken type
/// by type.
#[derive(Clone, Debug)]
pub(super) struct BlockConfig {
    /// (node group, stages of it per replica), in pipeline order.
    pub order: Vec<(usize, u32)>,
    pub placement: Placement,
    pub n_replicas: u32,
    pub layers: Vec<u32>,
    pub timing: PipelineTiming,
    /// The node group of each stage.
    pub stage_groups: Vec<usize>,
    /// The slowest link of each stage's gradient ring over the block's replicas.
    pub stage_dp_links: Vec<Link>,
    /// Each stage's backward pass of one micro-batch: what overlapped reduction hides behind.
    pub stage_backward_s: Vec<f64>,
}

impl BlockConfig {
    /// Micro-batches per second in steady state: the ranking used to prune blocks.
    pub fn throughput(&self) -> f64 {
        f64::from(self.n_replicas) / self.timing.cycle_s
    }

    /// The first layer of each stage.
    pub fn stage_starts(&self) -> Vec<u32> {
        self.layers
            .iter()
            .scan(0, |next, &count| {
                let start = *next;
                *next += count;
                Some(start)
            })
            .collect()
    }
}

/// A link no ring is held back by: what a one-replica block's gradient ring gets.
const UNBOUNDED: Link = Link { gb_s: f64::INFINITY, latency_us: 0.0 };

/// One block's stages, for pricing its layer splits.
pub(super) struct Template<'s, 'a> {
    space: &'s Space<'a>,
    setting: &'s GroupSettings,
    order: Vec<(usize, u32)>,
    placement: Placement,
    n_replicas: u32,
    /// Per stage: (node group, index among that group's stages in a replica, that group's stages).
    positions: Vec<(usize, u32, u32)>,
    /// One transfer over each boundary, on the slowest sampled replica.
    boundary_s: Vec<f64>,
    stage_dp_links: Vec<Link>,
}

impl<'s, 'a> Template<'s, 'a> {
    pub fn new(
        space: &'s Space<'a>,
        setting: &'s GroupSettings,
        order: Vec<(usize, u32)>,
        placement: Placement,
        n_replicas: u32,
    ) -> Self {
        let positions = order
            .iter()
            .flat_map(|&(g, count)| (0..count).map(move |stage_in_group| (g, stage_in_group, count)))
            .collect();
        let mut template = Template {
            space,
            setting,
            order,
            placement,
            n_replicas,
            positions,
            boundary_s: Vec::new(),
            stage_dp_links: Vec::new(),
        };
        template.boundary_s = template.boundary_times();
        template.stage_dp_links = template.dp_links();
        template
    }

    fn stage_groups(&self) -> impl Iterator<Item = usize> + '_ {
        self.positions.iter().map(|&(g, _, _)| g)
    }

    fn shape(&self, stage_idx: usize, n_layers: u32) -> StageShape {
        StageShape::in_pipeline(stage_idx, self.positions.len(), n_layers)
    }

    /// Where the first device of stage `stage_idx` of `replica` sits.
    fn slot(&self, replica: u32, stage_idx: usize) -> DeviceSlot {
        let (g, stage_in_group, count) = self.positions[stage_idx];
        let unit = self.placement.unit(replica, stage_in_group, count, self.n_replicas);
        self.space.slots[(self.space.first_ids[g] + unit * self.setting.tp(g)) as usize]
    }

    fn sampled_replicas(&self) -> std::ops::Range<u32> {
        0..self.n_replicas.min(SAMPLED_REPLICAS)
    }

    /// Units of group `g` per node: link patterns along a group's stages repeat with this period.
    fn units_per_node(&self, g: usize) -> usize {
        (self.space.cluster.groups()[g].gpus_per_node / self.setting.tp(g)) as usize
    }

    /// Whether `stage_idx` repeats the link pattern of the stage one node period before it.
    fn repeats_earlier(&self, stage_idx: usize) -> Option<usize> {
        let (g, stage_in_group, _) = self.positions[stage_idx];
        let period = self.units_per_node(g);
        (stage_in_group as usize > period).then(|| stage_idx - period)
    }

    fn boundary_times(&self) -> Vec<f64> {
        let mut times: Vec<f64> = Vec::with_capacity(self.positions.len().saturating_sub(1));
        for next in 1..self.positions.len() {
            // Sequence parallelism splits the activations over the smaller group's members.
            let (g_from, g_to) = (self.positions[next - 1].0, self.positions[next].0);
            let tp = self.setting.tp(g_from).min(self.setting.tp(g_to));
            let bytes = self.space.cost.boundary_bytes(Setting { tp, ..self.setting.at(g_from) });
            let time = match self.repeats_earlier(next) {
                Some(earlier) => times[earlier - 1],
                None => self
                    .sampled_replicas()
                    .map(|replica| {
                        let link = self.space.fastest_link(self.slot(replica, next - 1), self.slot(replica, next));
                        link.transfer_s(bytes)
                    })
                    .fold(0.0, f64::max),
            };
            times.push(time);
        }
        times
    }

    /// Per stage, the slowest link of its gradient ring over the block's replicas.
    fn dp_links(&self) -> Vec<Link> {
        if self.n_replicas < 2 {
            return vec![UNBOUNDED; self.positions.len()];
        }
        let last = self.n_replicas - 1;
        let pairs: Vec<(u32, u32)> =
            self.sampled_replicas().filter(|&r| r < last).map(|r| (r, r + 1)).chain([(last, 0)]).collect();
        let mut links: Vec<Link> = Vec::with_capacity(self.positions.len());
        for stage in 0..self.positions.len() {
            let link = match self.repeats_earlier(stage) {
                Some(earlier) => links[earlier],
                None => pairs
                    .iter()
                    .map(|&(a, b)| self.space.fastest_link(self.slot(a, stage), self.slot(b, stage)))
                    .fold(UNBOUNDED, Link::slowest),
            };
            links.push(link);
        }
        links
    }

    /// What the partitioner needs: time per layer, fixed time and memory cap of every stage.
    pub fn loads(&self) -> Vec<StageLoad> {
        let groups = self.space.cluster.groups();
        let cost = &self.space.cost;
        let n_stages = self.positions.len();
        let boundary_s = &self.boundary_s;
        let replica_share = self.replica_share();
        let shards = state_shards(self.space.job.zero1(), self.n_replicas, 1);
        let layer_params = cost.stage_params(StageShape { n_layers: 1, embedding: false, head: false });
        self.stage_groups()
            .enumerate()
            .map(|(idx, g)| {
                let group = &groups[g];
                // A stage's time is affine in its layers: the head and the per-micro-batch
                // overhead, and each layer's pass with its overhead.
                let setting = self.setting.at(g);
                let fixed = self.space.stage_time(g, self.shape(idx, 0), setting).total_s();
                let per_layer = self.space.stage_time(g, self.shape(idx, 1), setting).total_s() - fixed;
                let transfers =
                    boundary_s.get(idx).copied().unwrap_or(0.0) + if idx > 0 { boundary_s[idx - 1] } else { 0.0 };
                let in_flight = f64::from(self.space.job.schedule().in_flight(idx, n_stages, 1, replica_share));
                let memory =
                    |n_layers| cost.stage_memory(self.shape(idx, n_layers), setting, in_flight, shards).total();
                StageLoad {
                    per_layer_s: per_layer,
                    fixed_s: fixed + transfers,
                    max_layers: max_layers_within(
                        memory,
                        usable(group.device.hbm_gib * GIB, self.space.job.memory_headroom()),
                        cost.model().n_layers(),
                    ),
                    extra_layers: cost.stage_params(self.shape(idx, 0)) / layer_params,
                }
            })
            .collect()
    }

    /// Micro-batches one replica runs if the block ran the whole batch alone.
    fn replica_share(&self) -> u32 {
        self.space.n_micro_batches(self.setting).div_ceil(self.n_replicas)
    }

    /// The layer splits worth pricing: every one in exhaustive mode; otherwise the min-max split
    /// and, scanning looser bounds on the slowest stage, the split with the shortest pipeline and
    /// the one with the shortest pipeline plus the block's gradient sync and optimizer step.
    pub fn splits(&self, loads: &[StageLoad]) -> Vec<Vec<u32>> {
        let n_layers = self.space.cost.model().n_layers();
        if self.space.exhaustive {
            return compositions_within(loads, n_layers);
        }
        let Some(least) = least_bound_s(loads, n_layers) else { return Vec::new() };
        let min_max = fill_within(loads, n_layers, least).expect("the least bound is feasible");
        let steady = f64::from(self.replica_share().saturating_sub(1));
        let pipeline_s = |counts: &[u32]| {
            let times = counts.iter().zip(loads).map(|(&count, load)| load.time_s(count));
            let (sum, max) = times.fold((0.0, 0.0_f64), |(sum, max), time| (sum + time, max.max(time)));
            sum + steady * max
        };
        // Each stage's backward share of its pass, what overlapped reduction hides behind.
        let backward_shares: Vec<f64> = self
            .stage_groups()
            .map(|g| {
                let layer = self.space.layer_time(g, self.setting.at(g));
                layer.backward_s / layer.total_s()
            })
            .collect();
        let step_s = |counts: &[u32]| {
            let backward_s: Vec<f64> = counts
                .iter()
                .zip(loads)
                .zip(&backward_shares)
                .map(|((&count, load), share)| share * load.time_s(count))
                .collect();
            pipeline_s(counts) + self.sync_and_update_s(counts, &backward_s)
        };
        let mut best_pipeline = (pipeline_s(&min_max), min_max.clone());
        let mut best_step = (step_s(&min_max), min_max.clone());
        // No split's fill is shorter than with every layer on the fastest stages that fit them.
        let loosest = loads.iter().map(|load| load.time_s(load.max_layers)).fold(0.0, f64::max);
        let shortest_fill_s = fill_within(loads, n_layers, loosest)
            .map_or(0.0, |counts| counts.iter().zip(loads).map(|(&count, load)| load.time_s(count)).sum::<f64>());
        let mut bound = least;
        for _ in 0..MAX_EXTRA_BOUNDS {
            let Some(next) = next_bound_s(loads, bound) else { break };
            bound = next;
            if shortest_fill_s + steady * bound >= best_pipeline.0.max(best_step.0) {
                break;
            }
            let Some(counts) = fill_within(loads, n_layers, bound) else { continue };
            let (pipeline, step) = (pipeline_s(&counts), step_s(&counts));
            if pipeline < best_pipeline.0 {
                best_pipeline = (pipeline, counts.clone());
            }
            if step < best_step.0 {
                best_step = (step, counts);
            }
        }
        let mut splits = vec![min_max];
        for candidate in [best_pipeline.1, best_step.1] {
            if !splits.contains(&candidate) {
                splits.push(candidate);
            }
        }
        splits
    }

    /// The block alone: its slowest stage's gradient ring (what its last backward pass of
    /// `backward_s` leaves of it when reduction overlaps) plus its slowest optimizer step.
    fn sync_and_update_s(&self, counts: &[u32], backward_s: &[f64]) -> f64 {
        let cost = &self.space.cost;
        let groups = self.space.cluster.groups();
        let shards = state_shards(self.space.job.zero1(), self.n_replicas, 1);
        let (mut sync_s, mut update_s) = (0.0_f64, 0.0_f64);
        for (idx, (&count, g)) in counts.iter().zip(self.stage_groups()).enumerate() {
            let tp = f64::from(self.setting.tp(g));
            let shape = self.shape(idx, count);
            let params = cost.stage_params(shape);
            let bytes = self.space.job.grad_reduce().bytes() * params / tp;
            let ring_s = comm::ring_all_reduce_s(bytes, self.n_replicas, self.stage_dp_links[idx]);
            sync_s = sync_s.max(self.space.exposed_sync_s(ring_s, bytes, self.n_replicas, backward_s[idx]));
            update_s = update_s.max(cost.optimizer_step_s(&groups[g], params / tp / f64::from(shards)));
        }
        sync_s + update_s
    }

    pub fn config(&self, layers: Vec<u32>) -> BlockConfig {
        let passes: Vec<PassTime> = self
            .stage_groups()
            .enumerate()
            .map(|(idx, g)| self.space.stage_time(g, self.shape(idx, layers[idx]), self.setting.at(g)))
            .collect();
        BlockConfig {
            order: self.order.clone(),
            placement: self.placement,
            n_replicas: self.n_replicas,
            timing: PipelineTiming::new(&passes, &self.boundary_s),
            stage_backward_s: passes.iter().map(|pass| pass.backward_s).collect(),
            layers,
            stage_groups: self.stage_groups().collect(),
            stage_dp_links: self.stage_dp_links.clone(),
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
