//! One layer of a long-context stage, simulated on the stage's devices: every device runs its
//! own program of compute, sends and receives over the modelled links, and the layer ends when
//! the last device does.
//!
//! A device computes its tokens' projections and MLP, joins its group's Ulysses all-to-all (an
//! all-to-all-v: Q, K and V of its tokens to the devices holding their heads), exchanges keys and
//! values with the devices holding the same heads in the other groups (a ring all-gather-v, as
//! ring attention passes blocks; attention runs on each block as it arrives, so the next block's
//! transfer hides under it, or, for an all-gather, once every block is in), and sends its heads'
//! outputs back by a second all-to-all. Keys and values move on a communication stream of their
//! own that forwards each block as soon as it is in, ahead of attention, buffering what attention
//! has not reached yet (up to every block, as an all-gather holds): a lock-step ring, which passes
//! a block on only after computing on the last, would run at the pace of the slowest device's
//! largest block once shards are uneven. The backward does the same with twice the matmuls,
//! FlashAttention's backward and the keys' and values' gradients travelling with them;
//! recomputation adds the forward's attention (selective) or the whole forward (full). The
//! communication is medley-collective's step lists, the same description the runtime's
//! communicator executes; counts are uneven wherever the plan's shards, tokens and heads are.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::num::NonZeroUsize;

use medley_collective::{self as collective, Algorithm, Chunking, Counts, DomainId, Group, Step};
use medley_cost::comm::{self, Link};
use medley_cost::context::{ContextWork, HeadSplit, HeadTailShards, KvExchange};
use medley_cost::{CostModel, PassTime};
use medley_plan::{Stage, StageContext};
use medley_spec::{BridgeMode, Cluster, DeviceSlot, NodeGroup, Recompute};

use crate::SimError;
use crate::network::{DrainAt, Network, ResourceId};
use crate::{ELEMENT_BYTES, ns};

/// What a device waits for or spends its time on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    AllToAll,
    KeysValues,
}

impl Phase {
    fn waiting(self) -> &'static str {
        match self {
            Phase::AllToAll => "waiting: all-to-all",
            Phase::KeysValues => "waiting: keys and values",
        }
    }
}

/// What one stream of a device counts, for the other to wait on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Tag {
    /// The compute stream has reached a key/value exchange.
    KvStart,
    /// The communication stream has received another message of keys and values.
    KvMessage,
}

/// One operation of a device's stream.
#[derive(Clone, Copy, Debug, PartialEq)]
enum DeviceOp {
    Compute {
        ns: u64,
        what: &'static str,
    },
    /// Starts a transfer to the device at this index of the stage; the stream moves on.
    Send {
        to: usize,
        bytes: f64,
    },
    /// Waits for the next message from that device.
    Recv {
        from: usize,
        phase: Phase,
    },
    /// Counts one more `tag` on this device.
    Mark(Tag),
    /// Waits until this device has counted `count` of `tag`.
    Await {
        tag: Tag,
        count: u32,
    },
}

/// A device's two streams: compute (with the all-to-alls) and key/value communication.
#[derive(Clone, Debug, Default)]
struct DeviceProgram {
    compute: Vec<DeviceOp>,
    comm: Vec<DeviceOp>,
    /// How many of each tag the streams count by the end of what is written so far.
    marked: [u32; 2],
}

impl DeviceProgram {
    /// Writes a mark of `tag` on the communication or the compute stream; its running count.
    fn mark(&mut self, tag: Tag, on_comm: bool) -> u32 {
        let stream = if on_comm { &mut self.comm } else { &mut self.compute };
        stream.push(DeviceOp::Mark(tag));
        self.marked[tag as usize] += 1;
        self.marked[tag as usize]
    }
}

/// One pass of one layer on one device, simulated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevicePass {
    /// When the device finished its part of the layer.
    pub end_ns: u64,
    pub compute_ns: u64,
    /// Time blocked on its group's all-to-alls.
    pub all_to_all_wait_ns: u64,
    /// Time blocked on keys and values from the other groups (what attention did not hide).
    pub kv_wait_ns: u64,
    pub sent_bytes: u64,
    pub received_bytes: u64,
}

/// A stretch of a device's compute stream: computing `name`, or waiting for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PhaseSpan {
    pub start_ns: u64,
    pub end_ns: u64,
    pub name: &'static str,
}

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
    let layer = LayerPrograms::new(cost, cluster, stage, context, recompute)?;
    let (forward, forward_phases) = run(&layer.slots, cluster, &layer.forward()?);
    let (backward, backward_phases) = run(&layer.slots, cluster, &layer.backward()?);
    let slowest = |passes: &[DevicePass], mut phases: Vec<Vec<PhaseSpan>>| {
        let device = (0..passes.len()).max_by_key(|&device| passes[device].end_ns).unwrap_or(0);
        if phases.is_empty() { Vec::new() } else { phases.swap_remove(device) }
    };
    let phases = [slowest(&forward, forward_phases), slowest(&backward, backward_phases)];
    let devices = stage.devices.iter().zip(forward).zip(backward).map(|((&id, f), b)| (id, f, b)).collect();
    let weight_grad_ns = layer.rates.iter().map(|rates| ns(rates.weight_grad_s)).max().unwrap_or(0);
    Ok(ContextLayerReport { devices, phases, weight_grad_ns })
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

/// The stage's devices and what each holds, to write their programs.
struct LayerPrograms<'a> {
    cost: &'a CostModel<'a>,
    context: &'a StageContext,
    shards: HeadTailShards,
    slots: Vec<DeviceSlot>,
    /// Per device, in stage order: (group, member in the group, heads, tokens).
    members: Vec<(usize, usize, medley_cost::context::HeadShare, u64)>,
    rates: Vec<DeviceRates>,
    group_offsets: Vec<usize>,
    recompute: Recompute,
}

impl<'a> LayerPrograms<'a> {
    fn new(
        cost: &'a CostModel<'a>,
        cluster: &Cluster,
        stage: &Stage,
        context: &'a StageContext,
        recompute: Recompute,
    ) -> Result<Self, SimError> {
        let first = &context.groups[0];
        if context.groups.iter().any(|group| group.heads != first.heads) {
            return Err(SimError::Unsupported(
                "context groups of different sizes or head splits (keys and values travel between the devices that \
                 hold the same heads)",
            ));
        }
        let all_slots = cluster.devices();
        let slots: Vec<DeviceSlot> = stage.devices.iter().map(|&id| all_slots[id as usize]).collect();
        let heads = HeadSplit::from_q_heads(cost.model(), &first.heads).expect("a checked plan's heads");
        let mut members = Vec::new();
        let mut group_offsets = Vec::new();
        for (g, group) in context.groups.iter().enumerate() {
            group_offsets.push(members.len());
            for (j, &tokens) in group.device_tokens.iter().enumerate() {
                members.push((g, j, heads.shares()[j], u64::from(tokens)));
            }
        }
        let rates = members
            .iter()
            .zip(&slots)
            .map(|(&(_, _, _, tokens), slot)| device_rates(cost, &cluster.groups()[slot.group_idx], tokens as f64))
            .collect();
        let seq_len = context.groups.iter().map(|group| group.tokens).sum();
        Ok(LayerPrograms {
            cost,
            context,
            shards: context.shards(seq_len),
            slots,
            members,
            rates,
            group_offsets,
            recompute,
        })
    }

    fn head_dim(&self) -> usize {
        self.cost.model().head_dim() as usize
    }

    /// The forward pass's programs.
    fn forward(&self) -> Result<Vec<DeviceProgram>, SimError> {
        let mut programs = vec![DeviceProgram::default(); self.members.len()];
        self.append_forward(&mut programs)?;
        Ok(programs)
    }

    /// The forward in layer order: norm and Q, K, V projections, the all-to-all to the heads,
    /// attention with the key/value exchange, the all-to-all back, then the output projection
    /// and the MLP.
    fn append_forward(&self, programs: &mut [DeviceProgram]) -> Result<(), SimError> {
        self.compute(programs, "Q/K/V projections", |rates| rates.serial_forward_s * rates.before_attention);
        self.all_to_all(programs, true, false)?;
        self.kv_exchange(programs, 1, 1.0)?;
        self.all_to_all(programs, false, false)?;
        self.compute(programs, "output projection, MLP", |rates| {
            rates.serial_forward_s * (1.0 - rates.before_attention)
        });
        Ok(())
    }

    /// Every device computes `what` for `seconds` of its rates.
    fn compute(&self, programs: &mut [DeviceProgram], what: &'static str, seconds: impl Fn(&DeviceRates) -> f64) {
        for (program, rates) in programs.iter_mut().zip(&self.rates) {
            program.compute.push(DeviceOp::Compute { ns: ns(seconds(rates)), what });
        }
    }

    /// The backward pass's programs: the forward again first under full recomputation.
    fn backward(&self) -> Result<Vec<DeviceProgram>, SimError> {
        let mut programs = vec![DeviceProgram::default(); self.members.len()];
        if self.recompute == Recompute::Full {
            self.append_forward(&mut programs)?;
        }
        // In reverse layer order: the MLP and output projection, the outputs' gradients to the
        // heads, attention's, the inputs' gradients back to the tokens, the Q, K, V projections.
        self.compute(&mut programs, "MLP, output projection", |rates| {
            rates.serial_backward_s * (1.0 - rates.before_attention)
        });
        self.all_to_all(&mut programs, false, true)?;
        // Selective recomputation runs the forward's attention again inside the backward's; full
        // recomputation ran the whole forward above.
        let recomputed = if self.recompute == Recompute::Selective { 1.0 } else { 0.0 };
        let attention = medley_cost::FUSED_ATTENTION_BACKWARD + recomputed;
        if self.context.kv_exchange == KvExchange::Ring {
            // Keys and values go around again with their gradients, as ring attention passes them.
            self.kv_exchange(&mut programs, 2, attention)?;
        } else {
            // Keys and values stay from the forward (gathered again when it is recomputed);
            // attention runs on all of them, then their gradients reduce-scatter to their owners.
            if self.recompute == Recompute::Selective {
                self.kv_exchange(&mut programs, 1, 0.0)?;
            }
            self.kv_exchange_attention(&mut programs, attention);
            self.kv_gradients(&mut programs)?;
        }
        self.all_to_all(&mut programs, true, true)?;
        self.compute(&mut programs, "Q/K/V projections", |rates| rates.serial_backward_s * rates.before_attention);
        Ok(programs)
    }

    /// Each group's all-to-all-v: to the heads (Q, K, V of every device's tokens for each
    /// device's heads) or back (each device's heads' outputs for every device's tokens); in the
    /// backward the same tensors' gradients travel the other way.
    fn all_to_all(&self, programs: &mut [DeviceProgram], to_heads: bool, backward: bool) -> Result<(), SimError> {
        let hd = self.head_dim();
        for (g, group) in self.context.groups.iter().enumerate() {
            let offset = self.group_offsets[g];
            let size = group.device_tokens.len();
            if size < 2 {
                continue;
            }
            let share = |j: usize| self.members[offset + j].2;
            let forward: Vec<Vec<usize>> = (0..size)
                .map(|i| {
                    (0..size)
                        .map(|j| match to_heads {
                            true => {
                                group.device_tokens[i] as usize
                                    * (share(j).q_heads + 2 * share(j).kv_heads) as usize
                                    * hd
                            }
                            false => group.device_tokens[j] as usize * share(i).q_heads as usize * hd,
                        })
                        .collect()
                })
                .collect();
            let matrix = match backward {
                true => (0..size).map(|i| (0..size).map(|j| forward[j][i]).collect()).collect(),
                false => forward,
            };
            let steps = collective::plan_steps(
                collective::Op::AllToAll,
                &Group::new(vec![DomainId(0); size])?,
                &Counts::PerPair(matrix),
                Algorithm::Pairwise,
                Chunking::Whole,
            )?;
            for (j, rank) in steps.iter().enumerate() {
                for step in &rank.steps {
                    programs[offset + j].compute.extend(message(step, |peer| offset + peer, Phase::AllToAll));
                }
            }
        }
        Ok(())
    }

    /// Per lane (the devices of each group holding the same heads), the elements of `copies`
    /// K/V-sized blocks of every group's tokens.
    fn lane_counts(&self, copies: usize) -> Vec<Vec<usize>> {
        let hd = self.head_dim();
        (0..self.context.groups[0].device_tokens.len())
            .map(|j| {
                let kv_heads = self.members[j].2.kv_heads as usize;
                self.context.groups.iter().map(|group| group.tokens as usize * copies * 2 * kv_heads * hd).collect()
            })
            .collect()
    }

    /// The keys and values of each device's heads around the devices holding the same heads in
    /// every group: a ring all-gather-v of `copies` K/V-sized blocks per token (2 in the backward,
    /// with the gradients), in messages no larger than the smallest block so that the hops
    /// pipeline, and attention `attention` forward-passes' worth on each message's keys: as each
    /// arrives around a ring, once all have for an all-gather.
    fn kv_exchange(&self, programs: &mut [DeviceProgram], copies: usize, attention: f64) -> Result<(), SimError> {
        let n_groups = self.context.groups.len();
        let overlaps = self.context.kv_exchange == KvExchange::Ring;
        for (j, counts) in self.lane_counts(copies).into_iter().enumerate() {
            let lane: Vec<usize> = self.group_offsets.iter().map(|offset| offset + j).collect();
            let starts: Vec<usize> =
                counts.iter().scan(0, |at, count| Some(std::mem::replace(at, *at + count))).collect();
            let smallest = counts.iter().copied().min().and_then(NonZeroUsize::new);
            let steps = collective::plan_steps(
                collective::Op::AllGather,
                &Group::new(vec![DomainId(0); n_groups])?,
                &Counts::PerRank(counts.clone()),
                Algorithm::Ring,
                smallest.map_or(Chunking::Whole, Chunking::MaxElems),
            )?;
            for (g, rank) in steps.iter().enumerate() {
                let device = lane[g];
                let program = &mut programs[device];
                let started = program.mark(Tag::KvStart, false);
                program.comm.push(DeviceOp::Await { tag: Tag::KvStart, count: started });
                // Attention on each message's keys, own block first: (the message's count, ns).
                let mut attention_ns = vec![(None, self.attention_ns(device, g, g, attention))];
                for step in &rank.steps {
                    program.comm.extend(message(step, |peer| lane[peer], Phase::KeysValues));
                    if let Step::Recv { range, .. } = step {
                        let owner = starts.partition_point(|&start| start <= range.start) - 1;
                        let fraction = range.len() as f64 / counts[owner] as f64;
                        let block_ns = self.attention_ns(device, g, owner, attention) as f64;
                        attention_ns.push((Some(program.mark(Tag::KvMessage, true)), (fraction * block_ns) as u64));
                    }
                }
                if !overlaps && let Some(&(Some(last), _)) = attention_ns.last() {
                    program.compute.push(DeviceOp::Await { tag: Tag::KvMessage, count: last });
                }
                for (message, ns) in attention_ns {
                    if let (true, Some(count)) = (overlaps, message) {
                        program.compute.push(DeviceOp::Await { tag: Tag::KvMessage, count });
                    }
                    program.compute.push(DeviceOp::Compute { ns, what: "attention" });
                }
            }
        }
        Ok(())
    }

    /// Attention of every device over every group's keys, `attention` forward-passes' worth.
    fn kv_exchange_attention(&self, programs: &mut [DeviceProgram], attention: f64) {
        let n_groups = self.context.groups.len();
        for (device, program) in programs.iter_mut().enumerate() {
            let group = self.members[device].0;
            let ns = (0..n_groups).map(|keys| self.attention_ns(device, group, keys, attention)).sum();
            program.compute.push(DeviceOp::Compute { ns, what: "attention" });
        }
    }

    /// The keys' and values' gradients, one K/V-sized block per token of every group, summed
    /// over the devices holding the same heads and scattered to their owners: a ring
    /// reduce-scatter-v, after attention.
    fn kv_gradients(&self, programs: &mut [DeviceProgram]) -> Result<(), SimError> {
        let n_groups = self.context.groups.len();
        for (j, counts) in self.lane_counts(1).into_iter().enumerate() {
            let lane: Vec<usize> = self.group_offsets.iter().map(|offset| offset + j).collect();
            let steps = collective::plan_steps(
                collective::Op::ReduceScatter { op: collective::ReduceOp::Sum },
                &Group::new(vec![DomainId(0); n_groups])?,
                &Counts::PerRank(counts),
                Algorithm::Ring,
                Chunking::Whole,
            )?;
            for (g, rank) in steps.iter().enumerate() {
                let phase = Phase::KeysValues;
                programs[lane[g]]
                    .compute
                    .extend(rank.steps.iter().filter_map(|step| message(step, |peer| lane[peer], phase)));
            }
        }
        Ok(())
    }

    /// Attention of device `device` (of group `queries`) over group `keys`' block, `passes`
    /// forward-passes' worth.
    fn attention_ns(&self, device: usize, queries: usize, keys: usize, passes: f64) -> u64 {
        let q_heads = f64::from(self.members[device].2.q_heads);
        let flops = 4.0 * self.shards.pairs_between(queries, keys) as f64 * q_heads * self.head_dim() as f64;
        ns(passes * flops * self.rates[device].attention_per_flop_s)
    }
}

/// `step`'s send or receive, with peers mapped to stage indices.
fn message(step: &Step, device: impl Fn(usize) -> usize, phase: Phase) -> Option<DeviceOp> {
    match step {
        Step::Send { to, range, .. } => {
            Some(DeviceOp::Send { to: device(*to), bytes: range.len() as f64 * ELEMENT_BYTES })
        }
        Step::Recv { from, .. } => Some(DeviceOp::Recv { from: device(*from), phase }),
        _ => None,
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

/// A device's four port directions in the layer's own network.
struct Ports {
    nic_out: ResourceId,
    nic_in: ResourceId,
    intra_out: ResourceId,
    intra_in: ResourceId,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// Runs a device's stream (0: compute, 1: communication) as far as it goes.
    Run(usize, usize),
    Drained {
        flow: usize,
        version: u64,
    },
    Deliver {
        from: usize,
        to: usize,
    },
}

/// Where one stream of one device stands.
#[derive(Clone, Copy, Debug, Default)]
struct StreamState {
    cursor: usize,
    /// Since when it has waited, while it waits for a message or a count.
    blocked_since: Option<u64>,
    /// Whether a run to check again is already on its way.
    woken: bool,
}

/// The events of a run, in (time, order of pushing) order.
#[derive(Default)]
struct Events {
    queue: BinaryHeap<Reverse<(u64, u64, Event)>>,
    pushed: u64,
}

impl Events {
    fn push(&mut self, at_ns: u64, event: Event) {
        self.pushed += 1;
        self.queue.push(Reverse((at_ns, self.pushed, event)));
    }

    /// Runs `device`'s waiting streams again, to check what they wait for: once per wait, so
    /// that no stream runs twice at once.
    fn wake(&mut self, states: &mut [StreamState; 2], device: usize, now: u64) {
        for (stream, state) in states.iter_mut().enumerate() {
            if state.blocked_since.is_some() && !std::mem::replace(&mut state.woken, true) {
                self.push(now, Event::Run(device, stream));
            }
        }
    }
}

/// Runs the devices' programs from time 0 over their links, max-min fair where flows share a port.
/// Each device's pass and its compute stream's phases.
fn run(slots: &[DeviceSlot], cluster: &Cluster, programs: &[DeviceProgram]) -> (Vec<DevicePass>, Vec<Vec<PhaseSpan>>) {
    let mut network: Network<(usize, usize, u64)> = Network::new();
    let ports: Vec<Ports> = slots
        .iter()
        .map(|slot| {
            let group = &cluster.groups()[slot.group_idx];
            let (nic, intra) = (comm::nic_link(cluster, &[group]).gb_s, comm::intra_node_link(group).gb_s);
            Ports {
                nic_out: network.add_resource(nic),
                nic_in: network.add_resource(nic),
                intra_out: network.add_resource(intra),
                intra_in: network.add_resource(intra),
            }
        })
        .collect();
    let streams = |device: usize| [&programs[device].compute, &programs[device].comm];
    let mut passes = vec![DevicePass::default(); programs.len()];
    let mut phases: Vec<Vec<PhaseSpan>> = vec![Vec::new(); programs.len()];
    let mut states = vec![[StreamState::default(); 2]; programs.len()];
    let mut delivered: BTreeMap<(usize, usize), u32> = BTreeMap::new();
    let mut counted = vec![[0u32; 2]; programs.len()];
    // Transfers between one pair go one at a time, in order, as on one NCCL channel: bytes
    // waiting behind the one on the wire, per (from, to).
    let mut channels: BTreeMap<(usize, usize), VecDeque<f64>> = BTreeMap::new();
    let start = |network: &mut Network<(usize, usize, u64)>, drains: &mut Vec<DrainAt>, now, from, to, bytes| {
        let (link, path) = route(cluster, slots, &ports, from, to);
        let latency_ns = ns(link.latency_us * 1e-6);
        network.start(now, path, link.gb_s, bytes, (from, to, latency_ns), drains);
    };
    let mut events = Events::default();
    for device in 0..programs.len() {
        events.push(0, Event::Run(device, 0));
        events.push(0, Event::Run(device, 1));
    }
    let mut drains = Vec::new();
    while let Some(Reverse((now, _, event))) = events.queue.pop() {
        match event {
            Event::Drained { flow, version } => {
                if network.is_current(flow, version) {
                    let (from, to, latency_ns) = network.finish(now, flow, &mut drains);
                    events.push(now + latency_ns, Event::Deliver { from, to });
                    let queue = channels.get_mut(&(from, to)).expect("a transfer's channel");
                    queue.pop_front();
                    if let Some(&bytes) = queue.front() {
                        start(&mut network, &mut drains, now, from, to, bytes);
                    }
                }
            }
            Event::Deliver { from, to } => {
                *delivered.entry((from, to)).or_insert(0) += 1;
                events.wake(&mut states[to], to, now);
            }
            Event::Run(device, stream) => {
                let pass = &mut passes[device];
                let ops = streams(device)[stream];
                let state = &mut states[device][stream];
                state.woken = false;
                let mut marked = false;
                while let Some(&op) = ops.get(state.cursor) {
                    match op {
                        DeviceOp::Compute { ns, what } => {
                            if stream == 0 {
                                add_phase(
                                    &mut phases[device],
                                    PhaseSpan { start_ns: now, end_ns: now + ns, name: what },
                                );
                            }
                            pass.compute_ns += ns;
                            state.cursor += 1;
                            events.push(now + ns, Event::Run(device, stream));
                            break;
                        }
                        DeviceOp::Send { to, bytes } => {
                            let queue = channels.entry((device, to)).or_default();
                            queue.push_back(bytes);
                            if queue.len() == 1 {
                                start(&mut network, &mut drains, now, device, to, bytes);
                            }
                            pass.sent_bytes += bytes as u64;
                        }
                        DeviceOp::Recv { from, phase } => {
                            let count = delivered.entry((from, device)).or_insert(0);
                            if *count == 0 {
                                state.blocked_since.get_or_insert(now);
                                break;
                            }
                            *count -= 1;
                            let waited = state.blocked_since.take().map_or(0, |since| now - since);
                            match (stream, phase) {
                                (0, Phase::AllToAll) => pass.all_to_all_wait_ns += waited,
                                (0, Phase::KeysValues) => pass.kv_wait_ns += waited,
                                _ => {}
                            }
                            if stream == 0 && waited > 0 {
                                let name = phase.waiting();
                                add_phase(&mut phases[device], PhaseSpan { start_ns: now - waited, end_ns: now, name });
                            }
                        }
                        DeviceOp::Mark(tag) => {
                            counted[device][tag as usize] += 1;
                            marked = true;
                        }
                        DeviceOp::Await { tag, count } => {
                            if counted[device][tag as usize] < count {
                                state.blocked_since.get_or_insert(now);
                                break;
                            }
                            let waited = state.blocked_since.take().map_or(0, |since| now - since);
                            if stream == 0 && tag == Tag::KvMessage {
                                pass.kv_wait_ns += waited;
                                let name = Phase::KeysValues.waiting();
                                add_phase(&mut phases[device], PhaseSpan { start_ns: now - waited, end_ns: now, name });
                            }
                        }
                    }
                    state.cursor += 1;
                }
                if state.cursor == ops.len() {
                    pass.end_ns = pass.end_ns.max(now);
                }
                if marked {
                    events.wake(&mut states[device], device, now);
                }
            }
        }
        for DrainAt { flow, version, at_ns } in drains.drain(..) {
            events.push(at_ns, Event::Drained { flow, version });
        }
    }
    // Bytes in: every device's sends, by receiver.
    for (device, program) in programs.iter().enumerate() {
        for op in program.compute.iter().chain(&program.comm) {
            if let DeviceOp::Send { to, bytes } = op {
                passes[*to].received_bytes += *bytes as u64;
            }
        }
        debug_assert!(
            (0..2).all(|stream| states[device][stream].cursor == streams(device)[stream].len()),
            "a device's streams ran to their ends"
        );
    }
    (passes, phases)
}

/// Appends `span`, or extends the last span when it continues it under the same name.
fn add_phase(phases: &mut Vec<PhaseSpan>, span: PhaseSpan) {
    match phases.last_mut() {
        Some(last) if last.name == span.name && last.end_ns == span.start_ns => last.end_ns = span.end_ns,
        _ => phases.push(span),
    }
}

/// The link between two of the stage's devices and the ports a transfer crosses.
fn route(cluster: &Cluster, slots: &[DeviceSlot], ports: &[Ports], from: usize, to: usize) -> (Link, Vec<ResourceId>) {
    let (a, b) = (slots[from], slots[to]);
    let link = comm::link_between(cluster, a, b, BridgeMode::DeviceDirect);
    let path = match a.node_idx == b.node_idx {
        true => vec![ports[from].intra_out, ports[to].intra_in],
        false => vec![ports[from].nic_out, ports[to].nic_in],
    };
    (link, path)
}

/// The pass of a whole long-context chunk: `n_layers` simulated layers, the head's on the last.
pub(crate) fn chunk_pass(
    cost: &CostModel,
    cluster: &Cluster,
    stage: &Stage,
    layer: &ContextLayerReport,
    n_layers: u32,
    head: bool,
) -> PassTime {
    let layers = f64::from(n_layers);
    let mut pass = PassTime {
        forward_s: layers * layer.forward_ns() as f64 * 1e-9,
        backward_s: layers * layer.backward_ns() as f64 * 1e-9,
        weight_grad_s: layers * layer.weight_grad_ns as f64 * 1e-9,
    };
    if head {
        let slots = cluster.devices();
        let context = stage.context.as_ref().expect("a context stage");
        let tokens = context.groups.iter().flat_map(|group| &group.device_tokens);
        let head_pass = stage
            .devices
            .iter()
            .zip(tokens)
            .map(|(&id, &tokens)| {
                cost.context_head_time(&cluster.groups()[slots[id as usize].group_idx], f64::from(tokens))
            })
            .max_by(|a, b| a.total_s().total_cmp(&b.total_s()))
            .unwrap_or_default();
        pass = pass.plus(head_pass);
    }
    pass
}
