//! The heterogeneity-aware search.
//!
//! A layout is a set of *blocks*. Each block takes some of the cluster's node groups and cuts them
//! into `d` identical replicas; each replica is a pipeline whose stages are TP groups of one device
//! type inside one node, ordered type by type. The search enumerates, per setting (TP degree,
//! micro-batch size, recompute; each TP degree also with the memory-poorer node groups at twice
//! it, [`GroupSettings`]):
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

mod enumerate;
mod estimate;
mod template;

use std::collections::{BTreeMap, HashMap, HashSet};

use itertools::iproduct;
use medley_cost::comm::{self, Link};
use medley_cost::{Calibration, CostModel, PassTime, Setting, StageShape, StateFormat};
use medley_spec::{BridgeMode, Cluster, DeviceSlot, JobSpec, ModelSpec, NodeGroup, Recompute, Schedule, ScheduleKind};
use rayon::prelude::*;

use crate::assemble::{ReplicaLayout, assemble, stages_from_counts};
use crate::candidates::{Candidate, SearchOutcome, ranked};
use crate::error::PlanError;
use crate::long_context::{self, LONG_CONTEXT_TOKENS, search_long_context};
use crate::partition::{ClassShare, ReplicaClass, check_group_count, set_partitions, split_micro_batches};
use crate::plan::{Plan, tp_splits_heads};
use enumerate::{for_each_combination, stage_vectors, type_orders};
use template::{BlockConfig, Placement, Template};

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
    /// Sequences at least this long also get context-parallel candidates: by default
    /// [`LONG_CONTEXT_TOKENS`]; lower for a small model trained on an emulated fleet, whose
    /// attention dominates much sooner.
    pub context_from_tokens: u32,
    /// The largest tensor-parallel degree to try.
    pub max_tp: u32,
    /// Also try memory-poorer device types at twice the others' TP degree (a version 3 plan,
    /// which Megatron-LM and torchtitan do not run).
    pub per_stage_tp: bool,
}

impl Default for SearchOptions {
    fn default() -> Self {
        SearchOptions {
            top: 5,
            groups: None,
            exhaustive: false,
            context_from_tokens: LONG_CONTEXT_TOKENS,
            max_tp: TP_DEGREES[TP_DEGREES.len() - 1],
            per_stage_tp: true,
        }
    }
}

/// TP degrees the search tries: powers of two up to a node.
const TP_DEGREES: [u32; 4] = [1, 2, 4, 8];
/// Micro-batch sizes the search tries when the job does not fix one.
const MICRO_BATCHES: [u32; 4] = [1, 2, 4, 8];
/// Configurations kept per block before blocks are combined.
const CONFIGS_PER_BLOCK: usize = 6;
/// Layouts per setting that become explicit plans.
const FINALISTS_PER_SETTING: usize = 6;

/// Chunks per rank of the interleaved variant the search tries of each finalist.
const INTERLEAVED_CHUNKS: u32 = 2;

/// Searches the plan space and returns the best plans that fit, fastest first: tensor-parallel
/// stages, and for sequences of [`SearchOptions::context_from_tokens`] or more also stages that
/// split each sequence over their devices ([`search_long_context`]), ranked together.
pub fn search(
    cluster: &Cluster,
    model: &ModelSpec,
    job: &JobSpec,
    calibration: &Calibration,
    options: &SearchOptions,
) -> Result<SearchOutcome, PlanError> {
    crate::error::check_precision(cluster, job)?;
    let tensor = search_tensor_parallel(cluster, model, job, calibration, options);
    if job.seq_len() < options.context_from_tokens || long_context::unsupported(job).is_some() {
        return tensor;
    }
    let context = search_long_context(cluster, model, job, calibration, options.groups.as_deref(), None, options.top);
    match (tensor, context) {
        (Ok(tensor), Ok(context)) => {
            let mut candidates: Vec<Candidate> = tensor.candidates.into_iter().chain(context.candidates).collect();
            candidates.sort_by(|a, b| a.prediction.step_time_s.total_cmp(&b.prediction.step_time_s));
            candidates.truncate(options.top.max(1));
            Ok(SearchOutcome { candidates, layouts_priced: tensor.layouts_priced + context.layouts_priced })
        }
        (Ok(found), Err(_)) | (Err(_), Ok(found)) => Ok(found),
        (Err(PlanError::NothingFits(tensor)), Err(PlanError::NothingFits(context))) => {
            Err(PlanError::NothingFits(format!("{tensor}; with context parallelism: {context}")))
        }
        (Err(error), _) => Err(error),
    }
}

/// The search over tensor-parallel stages (every sequence whole on each stage).
fn search_tensor_parallel(
    cluster: &Cluster,
    model: &ModelSpec,
    job: &JobSpec,
    calibration: &Calibration,
    options: &SearchOptions,
) -> Result<SearchOutcome, PlanError> {
    let cost = CostModel::new(model, job.seq_len(), calibration)
        .with_attention(job.attention())
        .with_states(StateFormat::of_job(job));
    let allowed: Vec<usize> = options.groups.clone().unwrap_or_else(|| (0..cluster.groups().len()).collect());
    check_group_count(allowed.len())?;
    let mut settings = candidate_settings(cluster, model, job, &allowed);
    settings.retain(|setting| setting.tp <= options.max_tp);
    let settings: Vec<GroupSettings> = settings
        .into_iter()
        .flat_map(|setting| GroupSettings::candidates(cluster, model, &allowed, setting, options))
        .collect();
    let pairs: HashSet<(usize, Setting)> =
        settings.iter().flat_map(|settings| allowed.iter().map(move |&g| (g, settings.at(g)))).collect();
    let passes = pairs
        .into_iter()
        .map(|(g, setting)| {
            let group = &cluster.groups()[g];
            ((g, setting), (cost.layer_time(group, setting), cost.head_time(group, setting)))
        })
        .collect();
    let space = Space {
        cluster,
        slots: cluster.devices(),
        first_ids: cluster.group_first_ids(),
        bridge_modes: cluster.bridge().modes(),
        job,
        cost,
        exhaustive: options.exhaustive,
        passes,
    };
    let per_setting: Vec<(Vec<Layout>, usize)> =
        settings.par_iter().map(|setting| space.layouts(setting, &allowed)).collect();
    let layouts_priced = per_setting.iter().map(|(_, priced)| priced).sum();
    let finalists: Vec<Layout> = per_setting.into_iter().flat_map(|(layouts, _)| layouts).collect();
    // 1F1B lets every finalist also run interleaved, when that is faster (fewer micro-batches
    // than the pipeline is deep make the fill and drain dominate; Narayanan et al. 2021).
    let chunk_counts: &[u32] = match job.schedule() {
        Schedule::Fixed(ScheduleKind::OneFOneB) => &[1, INTERLEAVED_CHUNKS],
        Schedule::Fixed(ScheduleKind::Interleaved) => &[INTERLEAVED_CHUNKS],
        _ => &[1],
    };
    let plans = finalists
        .par_iter()
        .flat_map_iter(|layout| chunk_counts.iter().filter_map(|&chunks| space.assemble(layout, chunks)));
    let candidates = ranked(plans, calibration, options.top);
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
    TP_DEGREES
        .into_iter()
        .filter(|&tp| node_fits(tp) && tp_splits_heads(model, tp))
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
    iproduct!(micro_batches, recomputes)
        .map(|(micro_batch, recompute)| Setting { micro_batch, tp, recompute })
        .collect()
}

/// What the search fixes for a layout: the micro-batch and recomputation every stage shares, and
/// each node group's TP degree.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GroupSettings {
    base: Setting,
    /// TP degree per node group of the cluster.
    tp_by_group: Vec<u32>,
}

impl GroupSettings {
    /// `setting` on every allowed group; and, where the allowed groups' devices differ in memory,
    /// the memory-poorer groups at twice its TP degree where their nodes and the model's heads
    /// allow it (Metis, FlashFlex and Sailor choose TP per device type alike).
    fn candidates(
        cluster: &Cluster,
        model: &ModelSpec,
        allowed: &[usize],
        setting: Setting,
        options: &SearchOptions,
    ) -> Vec<GroupSettings> {
        let groups = cluster.groups();
        let uniform = GroupSettings { base: setting, tp_by_group: vec![setting.tp; groups.len()] };
        let richest = allowed.iter().map(|&g| groups[g].device.hbm_gib).fold(0.0, f64::max);
        let doubled = setting.tp * 2;
        let takes_more = |g: usize| {
            options.per_stage_tp
                && groups[g].device.hbm_gib < richest
                && doubled <= options.max_tp
                && groups[g].gpus_per_node.is_multiple_of(doubled)
                && tp_splits_heads(model, doubled)
        };
        let mut more = uniform.clone();
        for &g in allowed.iter().filter(|&&g| takes_more(g)) {
            more.tp_by_group[g] = doubled;
        }
        if more == uniform { vec![uniform] } else { vec![uniform, more] }
    }

    /// The setting of node group `g`'s stages.
    pub(crate) fn at(&self, g: usize) -> Setting {
        Setting { tp: self.tp_by_group[g], ..self.base }
    }

    pub(crate) fn tp(&self, g: usize) -> u32 {
        self.tp_by_group[g]
    }

    pub(crate) fn micro_batch(&self) -> u32 {
        self.base.micro_batch
    }
}

/// A layout: blocks and their replicas' batch shares.
#[derive(Clone, Debug)]
struct Layout {
    setting: GroupSettings,
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
    /// One layer's and the head's pass per (node group, setting), priced once: the search
    /// prices the same stages over and over.
    passes: HashMap<(usize, Setting), (PassTime, PassTime)>,
}

impl Space<'_> {
    /// One layer's pass on node group `g` under `setting`.
    fn layer_time(&self, g: usize, setting: Setting) -> PassTime {
        self.passes.get(&(g, setting)).map_or_else(|| self.cost.layer_time(&self.cluster.groups()[g], setting), |p| p.0)
    }

    /// The head's pass on node group `g` under `setting`.
    fn head_time(&self, g: usize, setting: Setting) -> PassTime {
        self.passes.get(&(g, setting)).map_or_else(|| self.cost.head_time(&self.cluster.groups()[g], setting), |p| p.1)
    }

    /// A stage of `shape` on node group `g` under `setting`.
    fn stage_time(&self, g: usize, shape: StageShape, setting: Setting) -> PassTime {
        self.cost.stage_pass(shape, self.layer_time(g, setting), self.head_time(g, setting))
    }

    fn n_micro_batches(&self, setting: &GroupSettings) -> u32 {
        self.job.global_batch() / setting.micro_batch()
    }

    /// The best layouts for one setting, and how many configurations were priced.
    fn layouts(&self, setting: &GroupSettings, allowed: &[usize]) -> (Vec<Layout>, usize) {
        let usable: Vec<usize> = allowed
            .iter()
            .copied()
            .filter(|&g| self.cluster.groups()[g].gpus_per_node.is_multiple_of(setting.tp(g)))
            .collect();
        let block_configs = self.block_configs_by_mask(setting, &usable);
        let priced_templates: usize = block_configs.values().map(|(_, priced)| priced).sum();
        let (layouts, priced_layouts) = self.best_layouts(setting, usable.len(), &block_configs);
        (layouts, priced_templates + priced_layouts)
    }

    /// Per subset of `usable` groups (a bit mask over them): its best templates, and how many
    /// were priced.
    fn block_configs_by_mask(
        &self,
        setting: &GroupSettings,
        usable: &[usize],
    ) -> BTreeMap<u32, (Vec<BlockConfig>, usize)> {
        (1..(1u32 << usable.len()))
            .map(|mask| {
                let block: Vec<usize> =
                    (0..usable.len()).filter(|bit| mask & (1 << bit) != 0).map(|bit| usable[bit]).collect();
                let mut configs = self.block_configs(setting, &block);
                let priced = configs.len();
                configs.sort_by(|a, b| {
                    b.throughput().total_cmp(&a.throughput()).then(a.timing.fill_s.total_cmp(&b.timing.fill_s))
                });
                if !self.exhaustive {
                    configs.truncate(CONFIGS_PER_BLOCK);
                }
                (mask, (configs, priced))
            })
            .collect()
    }

    /// Every way to combine the blocks of every partition of every subset of `n_groups` groups,
    /// priced; the best kept, and how many were priced.
    fn best_layouts(
        &self,
        setting: &GroupSettings,
        n_groups: usize,
        block_configs: &BTreeMap<u32, (Vec<BlockConfig>, usize)>,
    ) -> (Vec<Layout>, usize) {
        let keep = if self.exhaustive { usize::MAX } else { FINALISTS_PER_SETTING };
        let mut layouts: Vec<Layout> = Vec::new();
        let mut priced = 0;
        for mask in 1..(1u32 << n_groups) {
            for partition in set_partitions(mask) {
                let options: Vec<&[BlockConfig]> =
                    partition.iter().map(|block| block_configs[block].0.as_slice()).collect();
                for_each_combination(&options, &mut |blocks| {
                    priced += 1;
                    // A layout whose pipeline alone is slower than every kept one cannot be kept.
                    let cutoff_s = if layouts.len() < keep { f64::INFINITY } else { layouts[keep - 1].estimate_s };
                    if let Some(layout) = self.price_layout(setting, blocks, cutoff_s) {
                        let at = layouts.partition_point(|kept| kept.estimate_s <= layout.estimate_s);
                        layouts.insert(at, layout);
                        layouts.truncate(keep);
                    }
                });
            }
        }
        (layouts, priced)
    }

    /// Every pipeline template of one block of node groups.
    fn block_configs(&self, setting: &GroupSettings, block: &[usize]) -> Vec<BlockConfig> {
        let groups = self.cluster.groups();
        let n_layers = self.cost.model().n_layers();
        let mut configs = Vec::new();
        for order in type_orders(groups, block) {
            let units: Vec<u32> = order.iter().map(|&g| groups[g].n_gpus() / setting.tp(g)).collect();
            for (n_replicas, stages_per_group) in stage_vectors(&units, n_layers, self.n_micro_batches(setting)) {
                let order_counts: Vec<(usize, u32)> = order.iter().copied().zip(stages_per_group).collect();
                for &placement in Placement::distinct(&order_counts, n_replicas) {
                    let template = Template::new(self, setting, order_counts.clone(), placement, n_replicas);
                    let splits = template.splits(&template.loads());
                    configs.extend(splits.into_iter().map(|layers| template.config(layers)));
                }
            }
        }
        configs
    }

    /// Splits the batch over the layout's replicas and estimates the step.
    /// `None` when the batch does not split or the pipeline alone reaches `cutoff_s`.
    fn price_layout(&self, setting: &GroupSettings, blocks: &[&BlockConfig], cutoff_s: f64) -> Option<Layout> {
        let classes: Vec<ReplicaClass> =
            blocks.iter().map(|block| ReplicaClass { timing: block.timing, count: block.n_replicas }).collect();
        let (pipeline_s, shares) = split_micro_batches(&classes, self.n_micro_batches(setting))?;
        if pipeline_s >= cutoff_s {
            return None;
        }
        let estimate_s =
            pipeline_s + self.dp_sync_estimate_s(setting, blocks) + self.optimizer_estimate_s(setting, blocks);
        let blocks = blocks.iter().map(|&block| block.clone()).collect();
        Some(Layout { setting: setting.clone(), blocks, shares, estimate_s })
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
    /// The plan of `layout` with `chunks` model chunks per rank, if every rank has a layer for
    /// each chunk and every replica's micro-batch count suits the interleaved order.
    fn assemble(&self, layout: &Layout, chunks: u32) -> Option<Plan> {
        let setting = &layout.setting;
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
                            let first = self.first_ids[g] + unit * setting.tp(g);
                            (first..first + setting.tp(g)).collect()
                        })
                    })
                    .collect();
                let (device_groups, counts) = interleave(device_groups, &block.layers, chunks, n_micro_batches)?;
                replicas.push(ReplicaLayout { n_micro_batches, stages: stages_from_counts(device_groups, &counts) });
            }
        }
        let schedule = if chunks > 1 { Schedule::Fixed(ScheduleKind::Interleaved) } else { self.job.schedule() };
        // Each stage's TP degree is its device count; the base gives the rest.
        Some(Plan::assembled(assemble(self.cluster, &self.cost, self.job, setting.base, schedule, chunks, replicas)))
    }
}

/// Rank i's `layers[i]` split into `chunks` virtual stages in Megatron's order (rank i holds
/// virtual stages i, i + p, ...): the devices and layer counts of every virtual stage. `None`
/// when a rank has fewer layers than chunks, the pipeline has one rank, or the micro-batch
/// count is above the ranks and not a multiple of them (the interleaved order deadlocks there).
fn interleave(
    device_groups: Vec<Vec<u32>>,
    layers: &[u32],
    chunks: u32,
    n_micro_batches: u32,
) -> Option<(Vec<Vec<u32>>, Vec<u32>)> {
    if chunks == 1 {
        return Some((device_groups, layers.to_vec()));
    }
    let n_ranks = layers.len() as u32;
    let order_works = n_micro_batches < n_ranks || n_micro_batches.is_multiple_of(n_ranks);
    if n_ranks < 2 || !order_works || layers.iter().any(|&count| count < chunks) {
        return None;
    }
    let counts = (0..chunks)
        .flat_map(|chunk| layers.iter().map(move |&count| count / chunks + u32::from(chunk < count % chunks)));
    let devices = (0..chunks).flat_map(|_| device_groups.iter().cloned());
    Some((devices.collect(), counts.collect()))
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
    let states_gib =
        cost.states().unsharded_bytes() * medley_cost::params::total_params(model) as f64 / medley_cost::GIB;
    let hbm_gib: f64 = groups.iter().map(|group| f64::from(group.n_gpus()) * group.device.hbm_gib).sum();
    let largest = groups.iter().map(|group| group.device.hbm_gib).fold(0.0, f64::max);
    // Model states alone, on devices less their headroom and workspace, with a quarter more for
    // activations.
    let usable = medley_cost::memory::usable(largest * medley_cost::GIB, job.memory_headroom())
        - medley_cost::memory::WORKSPACE_BYTES;
    let usable_gib = (usable / medley_cost::GIB).max(1.0);
    let needed = (states_gib / usable_gib * 1.25).ceil();
    let more_devices = format!(
        "more devices (the model's weights, gradients and Adam states alone need {states_gib:.0} GiB, \
         about {needed} GPUs of {largest:.0} GiB, before activations)"
    );
    let seq_len = cost.seq_len();
    // When model states alone exceed the cluster, only more devices help.
    let mut hints = Vec::new();
    if states_gib < hbm_gib {
        if job.recompute().is_some_and(|recompute| recompute != Recompute::Full) {
            hints.push("--recompute full".to_string());
        }
        if job.micro_batch().is_some_and(|mb| mb > 1) {
            hints.push("--micro-batch 1".to_string());
        }
        if job.schedule() == Schedule::Fixed(ScheduleKind::Gpipe) {
            hints.push("--schedule 1f1b (GPipe keeps every micro-batch's activations)".to_string());
        }
        if seq_len > 1024 {
            hints.push(format!("a shorter --seq-len than {seq_len}"));
        }
        if job.memory_headroom() > 0.0 {
            hints.push(format!(
                "a smaller --memory-headroom than {:.0}% (the share of each device's memory left free)",
                job.memory_headroom() * 100.0
            ));
        }
    }
    hints.push(more_devices);
    let n_gpus = groups.iter().map(|group| group.n_gpus()).sum::<u32>();
    let devices = if n_gpus == 1 { "the one GPU".to_string() } else { format!("the {n_gpus} GPUs") };
    format!(
        "no layout of {devices} ({hbm_gib:.0} GiB in all) fits {} at sequence length {seq_len}; try {}",
        model.name(),
        hints.join(", or ")
    )
}
