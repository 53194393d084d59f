//! A layer's steps lowered into each device's operations: compute, and the sends and receives of
//! the collectives' step lists, with counts uneven wherever the shards, tokens and heads are.
//!
//! A device has two streams. The compute stream runs the matmuls, the all-to-alls and attention;
//! keys and values move on a communication stream of their own that forwards each block as soon
//! as it is in, ahead of attention, buffering what attention has not reached yet (up to every
//! block, as an all-gather holds): a lock-step ring, which passes a block on only after
//! computing on the last, would run at the pace of the slowest device's largest block once shards
//! are uneven. The streams meet through counted marks.

use std::num::NonZeroUsize;

use medley_collective::{self as collective, Chunking, Counts, DomainId, Group, Step};
use medley_cost::long_context::{HeadShare, HeadSplit, KvExchange};
use medley_plan::StageContext;
use medley_spec::{ModelSpec, Recompute};

use super::{AllToAll, AttentionWork, LayerCollective, LayerError, LayerPass, LayerStep, Matmuls, layer_steps};

/// What a receive waits for, as a timeline names the wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waiting {
    AllToAll,
    KeysValues,
}

impl Waiting {
    pub fn name(self) -> &'static str {
        match self {
            Waiting::AllToAll => "waiting: all-to-all",
            Waiting::KeysValues => "waiting: keys and values",
        }
    }
}

/// What one stream of a device counts, for the other to wait on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tag {
    /// The compute stream has reached a key/value exchange.
    KvStart,
    /// The communication stream has received another message of keys and values.
    KvMessage,
}

/// The keys a device's attention runs over (its queries are its group's, for its heads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keys {
    /// Group `group`'s whole block.
    Block(usize),
    /// `elems` of the `of` elements of group `group`'s block: one message of it.
    Part { group: usize, elems: usize, of: usize },
    /// Every group's.
    All,
}

/// What a compute operation computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    Matmuls(Matmuls),
    Attention { keys: Keys, work: AttentionWork },
}

impl Work {
    /// Its name on a timeline.
    pub fn name(self) -> &'static str {
        match self {
            Work::Matmuls(matmuls) => matmuls.name(),
            Work::Attention { .. } => "attention",
        }
    }
}

/// One operation of a device's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerOp {
    Compute(Work),
    /// Starts a transfer of `elems` elements to the device at this index of the stage; the
    /// stream moves on.
    Send {
        to: usize,
        elems: usize,
    },
    /// Waits for the next message from that device.
    Recv {
        from: usize,
        waiting: Waiting,
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
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceStreams {
    pub compute: Vec<LayerOp>,
    pub comm: Vec<LayerOp>,
    /// How many of each tag the streams count by the end of what is written so far.
    marked: [u32; 2],
}

impl DeviceStreams {
    /// Writes a mark of `tag` on the communication or the compute stream; its running count.
    fn mark(&mut self, tag: Tag, on_comm: bool) -> u32 {
        let stream = if on_comm { &mut self.comm } else { &mut self.compute };
        stream.push(LayerOp::Mark(tag));
        self.marked[tag as usize] += 1;
        self.marked[tag as usize]
    }
}

/// One device of a layer: its group, its index in the group (its lane), its heads and tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    pub group: usize,
    pub lane: usize,
    pub heads: HeadShare,
    pub tokens: usize,
}

/// A long-context layer's split over a stage's devices: what its operations need to know.
/// Every group splits the heads alike.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerShape {
    head_dim: usize,
    /// Per group: its tokens and each device's.
    groups: Vec<(usize, Vec<usize>)>,
    /// The devices in stage order: group by group.
    members: Vec<Member>,
    group_offsets: Vec<usize>,
    kv_exchange: KvExchange,
    recompute: Recompute,
}

impl LayerShape {
    /// `groups` (each group's tokens and its devices' tokens) whose devices hold `heads`, in
    /// member order, under `kv_exchange` and `recompute`.
    pub fn new(
        head_dim: usize,
        groups: Vec<(usize, Vec<usize>)>,
        heads: &[HeadShare],
        kv_exchange: KvExchange,
        recompute: Recompute,
    ) -> Result<Self, LayerError> {
        if groups.iter().any(|(_, device_tokens)| device_tokens.len() != heads.len()) {
            return Err(LayerError::HeadSplitsDiffer);
        }
        let mut members = Vec::new();
        let mut group_offsets = Vec::new();
        for (group, (_, device_tokens)) in groups.iter().enumerate() {
            group_offsets.push(members.len());
            for (lane, &tokens) in device_tokens.iter().enumerate() {
                members.push(Member { group, lane, heads: heads[lane], tokens });
            }
        }
        Ok(LayerShape { head_dim, groups, members, group_offsets, kv_exchange, recompute })
    }

    /// A plan's long-context stage: `context` of `model`.
    pub fn of_stage(model: &ModelSpec, context: &StageContext, recompute: Recompute) -> Result<Self, LayerError> {
        let first = &context.groups[0];
        if context.groups.iter().any(|group| group.heads != first.heads) {
            return Err(LayerError::HeadSplitsDiffer);
        }
        let heads = HeadSplit::from_q_heads(model, &first.heads).expect("a checked plan's heads");
        let groups = context
            .groups
            .iter()
            .map(|group| (group.tokens as usize, group.device_tokens.iter().map(|&t| t as usize).collect()))
            .collect();
        LayerShape::new(model.head_dim() as usize, groups, heads.shares(), context.kv_exchange, recompute)
    }

    /// The stage's devices, in stage order.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    pub fn n_groups(&self) -> usize {
        self.groups.len()
    }

    pub fn kv_exchange(&self) -> KvExchange {
        self.kv_exchange
    }

    /// The steps of `pass`, as [`layer_steps`] orders them for this layer.
    pub fn steps(&self, pass: LayerPass) -> Vec<LayerStep> {
        layer_steps(pass, self.kv_exchange, self.recompute)
    }

    /// The all-to-all's elements from member i to member j of group `group` (a row per sender).
    pub fn all_to_all_counts(&self, group: usize, all_to_all: AllToAll) -> Vec<Vec<usize>> {
        let device_tokens = &self.groups[group].1;
        let share = |j: usize| self.members[self.group_offsets[group] + j].heads;
        let size = device_tokens.len();
        let forward: Vec<Vec<usize>> = (0..size)
            .map(|i| {
                (0..size)
                    .map(|j| match all_to_all.carries_qkv() {
                        true => device_tokens[i] * (share(j).q_heads + 2 * share(j).kv_heads) as usize * self.head_dim,
                        false => device_tokens[j] * share(i).q_heads as usize * self.head_dim,
                    })
                    .collect()
            })
            .collect();
        match all_to_all.is_backward() {
            true => (0..size).map(|i| (0..size).map(|j| forward[j][i]).collect()).collect(),
            false => forward,
        }
    }

    /// The elements of `copies` K/V-sized blocks of every group's tokens, over lane `lane`.
    pub fn lane_counts(&self, lane: usize, copies: usize) -> Vec<usize> {
        let kv_heads = self.members[lane].heads.kv_heads as usize;
        self.groups.iter().map(|(tokens, _)| tokens * copies * 2 * kv_heads * self.head_dim).collect()
    }

    /// The stage indices of lane `lane`'s devices, in group order.
    fn lane(&self, lane: usize) -> Vec<usize> {
        self.group_offsets.iter().map(|offset| offset + lane).collect()
    }

    fn n_lanes(&self) -> usize {
        self.groups[0].1.len()
    }
}

/// Every device's operations for `pass` of `shape`'s layer, in stage order.
pub fn device_programs(shape: &LayerShape, pass: LayerPass) -> Result<Vec<DeviceStreams>, LayerError> {
    let mut programs = vec![DeviceStreams::default(); shape.members.len()];
    for step in shape.steps(pass) {
        match step {
            LayerStep::Matmuls(matmuls) => {
                for program in &mut programs {
                    program.compute.push(LayerOp::Compute(Work::Matmuls(matmuls)));
                }
            }
            LayerStep::AllToAll(all_to_all) => lower_all_to_all(shape, &mut programs, all_to_all)?,
            LayerStep::KeysValues { copies, attention } => {
                lower_keys_values(shape, &mut programs, copies as usize, attention)?;
            }
            LayerStep::Attention(work) => {
                for program in &mut programs {
                    program.compute.push(LayerOp::Compute(Work::Attention { keys: Keys::All, work }));
                }
            }
            LayerStep::KvGradients => lower_kv_gradients(shape, &mut programs)?,
        }
    }
    Ok(programs)
}

/// Each group's all-to-all-v, on the compute stream.
fn lower_all_to_all(
    shape: &LayerShape,
    programs: &mut [DeviceStreams],
    all_to_all: AllToAll,
) -> Result<(), LayerError> {
    let collective = LayerCollective::GroupAllToAll;
    for (g, (_, device_tokens)) in shape.groups.iter().enumerate() {
        let (offset, size) = (shape.group_offsets[g], device_tokens.len());
        if size < 2 {
            continue;
        }
        let steps = collective::plan_steps(
            collective.op(),
            &Group::new(vec![DomainId(0); size])?,
            &Counts::PerPair(shape.all_to_all_counts(g, all_to_all)),
            collective.algorithm(),
            Chunking::Whole,
        )?;
        for (j, rank) in steps.iter().enumerate() {
            for step in &rank.steps {
                programs[offset + j].compute.extend(message(step, |peer| offset + peer, Waiting::AllToAll));
            }
        }
    }
    Ok(())
}

/// The keys and values of each device's heads around its lane: a ring all-gather-v of `copies`
/// K/V-sized blocks per token, in messages no larger than the smallest block so that the hops
/// pipeline, on the communication stream; and `attention` on each message's keys on the
/// compute stream: as each arrives around a ring, once all have for an all-gather.
fn lower_keys_values(
    shape: &LayerShape,
    programs: &mut [DeviceStreams],
    copies: usize,
    attention: AttentionWork,
) -> Result<(), LayerError> {
    let collective = LayerCollective::LaneAllGather;
    let n_groups = shape.groups.len();
    let overlaps = shape.kv_exchange == KvExchange::Ring;
    for j in 0..shape.n_lanes() {
        let (lane, counts) = (shape.lane(j), shape.lane_counts(j, copies));
        let starts: Vec<usize> = counts.iter().scan(0, |at, count| Some(std::mem::replace(at, *at + count))).collect();
        let smallest = counts.iter().copied().min().and_then(NonZeroUsize::new);
        let steps = collective::plan_steps(
            collective.op(),
            &Group::new(vec![DomainId(0); n_groups])?,
            &Counts::PerRank(counts.clone()),
            collective.algorithm(),
            smallest.map_or(Chunking::Whole, Chunking::MaxElems),
        )?;
        for (g, rank) in steps.iter().enumerate() {
            let program = &mut programs[lane[g]];
            let started = program.mark(Tag::KvStart, false);
            program.comm.push(LayerOp::Await { tag: Tag::KvStart, count: started });
            // Attention on each message's keys, own block first: (the message's count, keys).
            let mut blocks = vec![(None, Keys::Block(g))];
            for step in &rank.steps {
                program.comm.extend(message(step, |peer| lane[peer], Waiting::KeysValues));
                if let Step::Recv { range, .. } = step {
                    let owner = starts.partition_point(|&start| start <= range.start) - 1;
                    let keys = Keys::Part { group: owner, elems: range.len(), of: counts[owner] };
                    blocks.push((Some(program.mark(Tag::KvMessage, true)), keys));
                }
            }
            if !overlaps && let Some(&(Some(last), _)) = blocks.last() {
                program.compute.push(LayerOp::Await { tag: Tag::KvMessage, count: last });
            }
            for (message, keys) in blocks {
                if let (true, Some(count)) = (overlaps, message) {
                    program.compute.push(LayerOp::Await { tag: Tag::KvMessage, count });
                }
                program.compute.push(LayerOp::Compute(Work::Attention { keys, work: attention }));
            }
        }
    }
    Ok(())
}

/// The keys' and values' gradients, one K/V-sized block per token of every group, summed over
/// the lane and scattered to their owners: a ring reduce-scatter-v, after attention.
fn lower_kv_gradients(shape: &LayerShape, programs: &mut [DeviceStreams]) -> Result<(), LayerError> {
    let collective = LayerCollective::LaneReduceScatter;
    let n_groups = shape.groups.len();
    for j in 0..shape.n_lanes() {
        let lane = shape.lane(j);
        let steps = collective::plan_steps(
            collective.op(),
            &Group::new(vec![DomainId(0); n_groups])?,
            &Counts::PerRank(shape.lane_counts(j, 1)),
            collective.algorithm(),
            Chunking::Whole,
        )?;
        for (g, rank) in steps.iter().enumerate() {
            let ops = rank.steps.iter().filter_map(|step| message(step, |peer| lane[peer], Waiting::KeysValues));
            programs[lane[g]].compute.extend(ops);
        }
    }
    Ok(())
}

/// `step`'s send or receive, with peers mapped to stage indices.
fn message(step: &Step, device: impl Fn(usize) -> usize, waiting: Waiting) -> Option<LayerOp> {
    match step {
        Step::Send { to, range, .. } => Some(LayerOp::Send { to: device(*to), elems: range.len() }),
        Step::Recv { from, .. } => Some(LayerOp::Recv { from: device(*from), waiting }),
        _ => None,
    }
}
