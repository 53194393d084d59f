//! One layer of a long-context stage, simulated on the stage's devices: every device runs its
//! own program of compute, sends and receives over the modelled links, and the layer ends when
//! the last device does.
//!
//! The programs are `medley-schedule`'s ([`medley_schedule::long_context_layer`]): the layer's order
//! of operations, which the runtime's long-context stage runs too, lowered over the plan's
//! shards, tokens and heads into each device's compute and the sends and receives of
//! medley-collective's step lists, the same description the runtime's communicator executes.
//! This module prices each operation's work on its device from the cost model; the engine's
//! event core ([`crate::engine::layer`]) runs them.

use medley_cost::long_context::{ContextWork, HeadTailShards, KvExchange};
use medley_cost::{CostModel, PassTime, StageShape};
use medley_plan::{Stage, StageContext};
use medley_schedule::long_context_layer::{
    AttentionWork, Keys, LayerError, LayerPass, LayerShape, Work, device_programs,
};
use medley_spec::{Cluster, DeviceSlot, NodeGroup, Recompute};

use crate::layer::run_layer;
pub use crate::layer::{DevicePass, PhaseSpan};
use crate::{SimError, ns};

/// One layer of a long-context stage: each device's forward and backward.
#[derive(Clone, Debug, PartialEq)]
pub struct ContextLayerReport {
    /// The stage's devices, in stage order, with their passes.
    pub devices: Vec<(u32, DevicePass, DevicePass)>,
    /// The phases of the forward's and of the backward's slowest device, in order.
    pub phases: [Vec<PhaseSpan>; 2],
    /// The slowest device's weight-gradient matmuls inside the backward.
    pub weight_grad_ns: u64,
}

impl ContextLayerReport {
    /// The layer's forward: until its last device is done.
    pub fn forward_ns(&self) -> u64 {
        self.devices.iter().map(|(_, forward, _)| forward.end_ns).max().unwrap_or(0)
    }

    pub fn backward_ns(&self) -> u64 {
        self.devices.iter().map(|(_, _, backward)| backward.end_ns).max().unwrap_or(0)
    }
}

/// Simulates one layer of `stage` (a long-context stage of a plan over `cluster`).
pub fn simulate_context_layer(
    cost: &CostModel,
    cluster: &Cluster,
    stage: &Stage,
    recompute: Recompute,
) -> Result<ContextLayerReport, SimError> {
    let context = stage.context.as_ref().ok_or(SimError::Unsupported("a stage without a context split"))?;
    let shape = LayerShape::of_stage(cost.model(), context, recompute).map_err(layer_error)?;
    let all_slots = cluster.devices();
    let slots: Vec<DeviceSlot> = stage.devices.iter().map(|&id| all_slots[id as usize]).collect();
    let prices = LayerPrices::new(cost, cluster, context, &shape, &slots);
    let run = |pass| -> Result<_, SimError> {
        let programs = device_programs(&shape, pass).map_err(layer_error)?;
        let element_bytes = cost.precision().element_bytes();
        Ok(run_layer(&slots, cluster, &programs, element_bytes, |device, work| prices.work_ns(device, work)))
    };
    let (forward, forward_phases) = run(LayerPass::Forward)?;
    let (backward, backward_phases) = run(LayerPass::Backward)?;
    let slowest = |passes: &[DevicePass], mut phases: Vec<Vec<PhaseSpan>>| {
        let device = (0..passes.len()).max_by_key(|&device| passes[device].end_ns).unwrap_or(0);
        if phases.is_empty() { Vec::new() } else { phases.swap_remove(device) }
    };
    let phases = [slowest(&forward, forward_phases), slowest(&backward, backward_phases)];
    let devices = stage.devices.iter().zip(forward).zip(backward).map(|((&id, f), b)| (id, f, b)).collect();
    let weight_grad_ns = prices.rates.iter().map(|rates| ns(rates.weight_grad_s)).max().unwrap_or(0);
    Ok(ContextLayerReport { devices, phases, weight_grad_ns })
}

fn layer_error(error: LayerError) -> SimError {
    match error {
        LayerError::HeadSplitsDiffer => SimError::Unsupported(
            "context groups of different sizes or head splits (keys and values travel between the devices that \
             hold the same heads)",
        ),
        LayerError::Collective(error) => SimError::Collective(error),
    }
}

/// What a device computes: seconds per token outside attention and per attention FLOP.
struct DeviceRates {
    serial_forward_s: f64,
    weight_grad_s: f64,
    serial_backward_s: f64,
    /// The share of the matmuls before attention: the Q, K and V projections.
    before_attention: f64,
    attention_per_flop_s: f64,
}

/// What each operation of a layer's programs takes on its device.
struct LayerPrices<'a> {
    shape: &'a LayerShape,
    shards: HeadTailShards,
    head_dim: f64,
    rates: Vec<DeviceRates>,
}

impl<'a> LayerPrices<'a> {
    fn new(
        cost: &CostModel,
        cluster: &Cluster,
        context: &StageContext,
        shape: &'a LayerShape,
        slots: &[DeviceSlot],
    ) -> Self {
        let rates = shape
            .members()
            .iter()
            .zip(slots)
            .map(|(member, slot)| device_rates(cost, &cluster.groups()[slot.group_idx], member.tokens as f64))
            .collect();
        let seq_len = context.groups.iter().map(|group| group.tokens).sum();
        let head_dim = cost.model().head_dim() as usize as f64;
        LayerPrices { shape, shards: context.shards(seq_len), head_dim, rates }
    }

    fn work_ns(&self, device: usize, work: Work) -> u64 {
        let rates = &self.rates[device];
        let group = self.shape.members()[device].group;
        match work {
            Work::Matmuls(matmuls) => {
                let serial_s = if matmuls.is_backward() { rates.serial_backward_s } else { rates.serial_forward_s };
                let share =
                    if matmuls.before_attention() { rates.before_attention } else { 1.0 - rates.before_attention };
                ns(serial_s * share)
            }
            Work::Attention { keys, work } => {
                let passes = match work {
                    AttentionWork::None => 0.0,
                    AttentionWork::Forward => 1.0,
                    // Selective recomputation runs the forward's attention again inside the backward's.
                    AttentionWork::Backward { recomputed } => {
                        medley_cost::FUSED_ATTENTION_BACKWARD + if recomputed { 1.0 } else { 0.0 }
                    }
                };
                match keys {
                    Keys::Block(keys) => self.attention_ns(device, group, keys, passes),
                    Keys::Part { group: keys, elems, of } => {
                        let fraction = elems as f64 / of as f64;
                        (fraction * self.attention_ns(device, group, keys, passes) as f64) as u64
                    }
                    Keys::All => {
                        (0..self.shape.n_groups()).map(|keys| self.attention_ns(device, group, keys, passes)).sum()
                    }
                }
            }
        }
    }

    /// Attention of device `device` (of group `queries`) over group `keys`' block, `passes`
    /// forward-passes' worth.
    fn attention_ns(&self, device: usize, queries: usize, keys: usize, passes: f64) -> u64 {
        let q_heads = f64::from(self.shape.members()[device].heads.q_heads);
        let flops = 4.0 * self.shards.pairs_between(queries, keys) as f64 * q_heads * self.head_dim;
        ns(passes * flops * self.rates[device].attention_per_flop_s)
    }
}

/// The Q, K and V projections' share of a layer's matmul FLOPs.
fn qkv_share(model: &medley_spec::ModelSpec) -> f64 {
    let qkv = 2.0 * f64::from(model.hidden()) * (model.q_width() + 2 * model.kv_width()) as f64;
    qkv / medley_cost::flops::layer_forward(model, 1, 1).matmul
}

fn device_rates(cost: &CostModel, group: &NodeGroup, tokens: f64) -> DeviceRates {
    let work = |tokens: f64, attention_flops: f64| ContextWork {
        tokens,
        attention_flops,
        all_to_all_s: 0.0,
        kv_s: 0.0,
        kv_exchange: KvExchange::AllGather,
    };
    let serial = cost.context_layer_time(group, work(tokens, 0.0), Recompute::None);
    let reference_flops = 1e12;
    let attention = cost.context_layer_time(group, work(0.0, reference_flops), Recompute::None);
    DeviceRates {
        serial_forward_s: serial.forward.serial_s,
        weight_grad_s: serial.weight_grad_s,
        serial_backward_s: serial.backward.serial_s,
        before_attention: qkv_share(cost.model()),
        attention_per_flop_s: attention.forward.attention_s / reference_flops,
    }
}

/// The pass of a whole long-context chunk of `shape`: its simulated layers, the head's on the
/// last, and the framework's overheads.
pub(crate) fn chunk_pass(
    cost: &CostModel,
    cluster: &Cluster,
    stage: &Stage,
    layer: &ContextLayerReport,
    shape: StageShape,
) -> PassTime {
    let per_layer = PassTime {
        forward_s: layer.forward_ns() as f64 * 1e-9,
        backward_s: layer.backward_ns() as f64 * 1e-9,
        weight_grad_s: layer.weight_grad_ns as f64 * 1e-9,
    };
    let head = match shape.head {
        false => PassTime::default(),
        true => {
            let slots = cluster.devices();
            let context = stage.context.as_ref().expect("a context stage");
            let tokens = context.groups.iter().flat_map(|group| &group.device_tokens);
            stage
                .devices
                .iter()
                .zip(tokens)
                .map(|(&id, &tokens)| {
                    cost.context_head_time(&cluster.groups()[slots[id as usize].group_idx], f64::from(tokens))
                })
                .max_by(|a, b| a.total_s().total_cmp(&b.total_s()))
                .unwrap_or_default()
        }
    };
    cost.stage_pass(shape, per_layer, head)
}
