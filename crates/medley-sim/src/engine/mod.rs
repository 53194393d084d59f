//! The discrete-event core: executes one step's programs over the network in simulated time.
//!
//! Events are ordered by (time, sequence number): ties go to the event scheduled first, so the
//! same input always replays the same way. The rules are the schedule crate's execution
//! semantics: a rank runs its instructions in order; a compute pass occupies its compute
//! stream; a send starts a transfer and never blocks; a receive blocks until its message has
//! arrived; an all-reduce starts when every member has reached it and is lowered to its
//! algorithm's steps from `medley-collective`, each send a transfer; the optimizer step waits for
//! the rank's outstanding sends. With overlapped gradient reduction, an all-reduce does not
//! block: the pass before it reduces the gradients bucket by bucket, and the optimizer step
//! waits for them (see `all_reduce`).

use rustc_hash::{FxHashMap, FxHashSet};
use slab::Slab;

use medley_collective::{self as collective, Choice, Counts, DomainId, Group, Op, RankSteps, ReduceOp, Step};
use medley_schedule::{Instruction, Program, RankId};
use medley_trace::timeline::{COLLECTIVE_TID, COMPUTE_TID, LAYER_TID, lane_tid};
use serde_json::json;

use crate::network::{DrainAt, FlowId};
use crate::{HORIZON_NS, ns};
use crate::{SimError, Simulation};

// The event core, shared with the long-context layer's executor.
use crate::events::{Channels, EventQueue};
// The step's parts, each an `impl StepRun` over this module's state.
mod all_reduce;
use all_reduce::CollectiveState;
mod labels;
mod transfers;

use labels::{CollectiveArgs, NoArgs, TransferArgs, chunk_suffix};

/// A message between ranks; receives match sends by key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum MessageKey {
    Activation {
        from: u32,
        to: u32,
        micro_batch: u32,
        chunk: u32,
    },
    Gradient {
        from: u32,
        to: u32,
        micro_batch: u32,
        chunk: u32,
    },
    /// The `seq`-th message from member `from` to member `to` of DP group `group`'s all-reduce
    /// (of its bucket `bucket` when overlapped).
    Collective {
        group: u32,
        bucket: u32,
        from: u32,
        to: u32,
        seq: u32,
    },
}

/// A transfer in flight: what it carries and where it shows on the timeline.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Transfer {
    key: MessageKey,
    from: usize,
    to: usize,
    lane: u32,
    start_ns: u64,
    latency_ns: u64,
    bytes: f64,
}

#[derive(Clone, Copy, Debug)]
enum Event {
    Resume(usize),
    Drained {
        flow: FlowId,
        version: u64,
    },
    /// A drained transfer arrives: its key in `StepRun::arriving`.
    Deliver(usize),
    Bandwidth(usize),
    JoinBucket {
        group: u32,
        bucket: u32,
        rank: usize,
    },
}

/// A send waiting for its channel.
#[derive(Clone, Copy, Debug)]
struct QueuedSend {
    key: MessageKey,
    from: usize,
    to: usize,
    bytes: f64,
    route: medley_plan::Route,
}

/// What a blocked rank waits for.
#[derive(Clone, Copy, Debug)]
enum Wait {
    Message(MessageKey),
    CollectiveStart(u32),
    Sends,
    /// The optimizer step waits for the rank's overlapped gradient buckets.
    Reductions,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct RankState {
    pc: usize,
    blocked: Option<(u64, Wait)>,
    pending_sends: u32,
    lanes: Vec<bool>,
    memory_bytes: f64,
    pub peak_memory_bytes: f64,
    /// Forward and backward passes (the pipeline's work), then all compute with the optimizer.
    pub pass_ns: u64,
    pub compute_ns: u64,
    /// Blocked on data already on its way (or on the rank's own sends draining): the network's
    /// share of the step.
    pub transfer_wait_ns: u64,
    /// Blocked on a peer that had not sent yet, or on all-reduce members still to arrive:
    /// pipeline bubbles, imbalance, stragglers.
    pub peer_wait_ns: u64,
    /// The part of `transfer_wait_ns` spent on pipeline activations and gradients: what the
    /// group size k of kFkB can hide.
    pub pipeline_wait_ns: u64,
    pub last_pass_end_ns: u64,
    pub done_ns: Option<u64>,
    /// Overlapped gradient buckets started and not yet reduced.
    open_reductions: u32,
    /// Where the last slice on the rank's collective track ends.
    collective_track_end_ns: u64,
}

enum Progress {
    Done,
    Blocked,
}

#[derive(Clone, Copy)]
enum PassKind {
    Forward,
    Backward,
    BackwardInput,
    BackwardWeight,
}

/// One step being simulated.
pub(crate) struct StepRun<'s, 'p, 'w> {
    sim: &'s mut Simulation<'p, 'w>,
    programs: &'s [Program],
    queue: EventQueue<Event>,
    pub ranks: Vec<RankState>,
    mailbox: FxHashSet<MessageKey>,
    waiting: FxHashMap<MessageKey, usize>,
    channels: Channels<QueuedSend>,
    /// When each message not yet consumed was issued (a rank waiting on it reads it once).
    issued_ns: FxHashMap<MessageKey, u64>,
    /// Per DP group, its collectives (see `all_reduce::collectives`).
    collectives: Vec<Vec<CollectiveState>>,
    /// Overlapped buckets waiting on a message: group, bucket, member.
    bucket_waits: FxHashMap<MessageKey, (u32, u32, usize)>,
    /// The (rank, group) reductions already started by the pass before them.
    launched: FxHashSet<(usize, u32)>,
    drains: Vec<DrainAt>,
    /// Transfers drained and not yet delivered, held here so that queued events stay small.
    arriving: Slab<Transfer>,
    n_done: usize,
    pub start_ns: u64,
    pub events: u64,
    /// Queued events other than bandwidth changes: when none is left and no transfer is on the
    /// wire, nothing can ever wake a blocked rank, however long the traces run.
    queued_work: usize,
}

impl<'s, 'p, 'w> StepRun<'s, 'p, 'w> {
    pub(crate) fn new(sim: &'s mut Simulation<'p, 'w>, programs: &'s [Program]) -> Self {
        let n_ranks = sim.setup.ranks.len();
        let collectives = all_reduce::collectives(&sim.setup, sim.setup.plan.overlap_grad_reduce());
        let ranks = sim
            .setup
            .ranks
            .iter()
            .map(|rank| RankState {
                memory_bytes: rank.static_bytes,
                peak_memory_bytes: rank.static_bytes,
                ..RankState::default()
            })
            .collect();
        let start_ns = sim.now_ns;
        let mut run = StepRun {
            sim,
            programs,
            queue: EventQueue::default(),
            ranks,
            mailbox: FxHashSet::default(),
            waiting: FxHashMap::default(),
            channels: Channels::default(),
            issued_ns: FxHashMap::default(),
            collectives,
            bucket_waits: FxHashMap::default(),
            launched: FxHashSet::default(),
            drains: Vec::new(),
            arriving: Slab::new(),
            n_done: 0,
            start_ns,
            events: 0,
            queued_work: 0,
        };
        for rank in 0..n_ranks {
            run.push(start_ns, Event::Resume(rank));
        }
        // The links' next bandwidth changes carry over from the previous step.
        let pending: Vec<(usize, u64)> = run
            .sim
            .trace_changes
            .iter()
            .enumerate()
            .filter_map(|(endpoint, change)| change.map(|(at_ns, _)| (endpoint, at_ns)))
            .collect();
        for (endpoint, at_ns) in pending {
            run.push(at_ns.max(start_ns), Event::Bandwidth(endpoint));
        }
        run
    }

    pub(crate) fn sim(&self) -> &Simulation<'p, 'w> {
        self.sim
    }

    /// Runs until every rank has finished its program.
    pub(crate) fn run(&mut self) -> Result<(), SimError> {
        while self.n_done < self.ranks.len() {
            if self.queued_work == 0 && self.sim.network.n_flows() == 0 {
                return Err(self.deadlock());
            }
            let Some((at_ns, event)) = self.queue.pop() else {
                return Err(self.deadlock());
            };
            if !matches!(event, Event::Bandwidth(_)) {
                self.queued_work -= 1;
            }
            // Drains beyond the clock saturate at its end: refuse them before time could wrap.
            if at_ns > HORIZON_NS {
                return Err(SimError::PastHorizon { waiting: self.unfinished() });
            }
            self.sim.now_ns = at_ns;
            self.events += 1;
            match event {
                Event::Resume(rank) => self.resume(rank)?,
                Event::Drained { flow, version } => self.drained(flow, version),
                Event::Deliver(arrival) => {
                    let transfer = self.arriving.remove(arrival);
                    self.deliver(transfer)
                }
                Event::Bandwidth(endpoint) => self.bandwidth(endpoint),
                Event::JoinBucket { group, bucket, rank } => self.join_bucket(group, bucket, rank)?,
            }
        }
        Ok(())
    }

    fn now(&self) -> u64 {
        self.sim.now_ns
    }

    fn push(&mut self, at_ns: u64, event: Event) {
        if !matches!(event, Event::Bandwidth(_)) {
            self.queued_work += 1;
        }
        self.queue.push(at_ns, event);
    }

    fn schedule_drains(&mut self) {
        let drains = std::mem::take(&mut self.drains);
        for drain in &drains {
            self.push(drain.at_ns, Event::Drained { flow: drain.flow, version: drain.version });
        }
        self.drains = drains;
        self.drains.clear();
    }

    fn block(&mut self, rank: usize, wait: Wait) {
        self.ranks[rank].blocked = Some((self.now(), wait));
    }

    /// Wakes a rank: books the wait it ends, then runs it as far as it goes.
    fn resume(&mut self, rank: usize) -> Result<(), SimError> {
        if let Some((since_ns, wait)) = self.ranks[rank].blocked.take() {
            let now = self.now();
            // The wait is the peer's until the awaited message was issued, the network's after.
            let issued_ns = match wait {
                Wait::Message(key) => self.issued_ns.remove(&key).map_or(now, |at| at.clamp(since_ns, now)),
                Wait::CollectiveStart(_) => now,
                Wait::Sends | Wait::Reductions => since_ns,
            };
            self.ranks[rank].peer_wait_ns += issued_ns - since_ns;
            self.ranks[rank].transfer_wait_ns += now - issued_ns;
            if let Wait::Message(MessageKey::Activation { .. } | MessageKey::Gradient { .. }) = wait {
                self.ranks[rank].pipeline_wait_ns += now - issued_ns;
            }
            if now > since_ns && self.sim.timeline.is_some() {
                let name = self.wait_label(rank, wait);
                self.timeline_slice(rank, COMPUTE_TID, &name, "wait", (since_ns, now), &NoArgs {});
            }
        }
        self.advance(rank)
    }

    fn advance(&mut self, rank: usize) -> Result<(), SimError> {
        let programs = self.programs;
        loop {
            let Some(&instruction) = programs[rank].instructions.get(self.ranks[rank].pc) else {
                self.ranks[rank].done_ns = Some(self.now());
                self.n_done += 1;
                return Ok(());
            };
            match instruction {
                Instruction::Forward { micro_batch, chunk } => {
                    return self.compute(rank, PassKind::Forward, micro_batch, chunk);
                }
                Instruction::Backward { micro_batch, chunk } => {
                    return self.compute(rank, PassKind::Backward, micro_batch, chunk);
                }
                Instruction::BackwardInput { micro_batch, chunk } => {
                    return self.compute(rank, PassKind::BackwardInput, micro_batch, chunk);
                }
                Instruction::BackwardWeight { micro_batch, chunk } => {
                    return self.compute(rank, PassKind::BackwardWeight, micro_batch, chunk);
                }
                Instruction::SendActivation { micro_batch, chunk, to } => {
                    let to = self.peer(rank, to)?;
                    let key = MessageKey::Activation { from: rank as u32, to: to as u32, micro_batch, chunk };
                    self.send_boundary(rank, to, key);
                }
                Instruction::SendGradient { micro_batch, chunk, to } => {
                    let to = self.peer(rank, to)?;
                    let key = MessageKey::Gradient { from: rank as u32, to: to as u32, micro_batch, chunk };
                    self.send_boundary(rank, to, key);
                }
                Instruction::RecvActivation { micro_batch, chunk, from } => {
                    let from = self.peer(rank, from)? as u32;
                    if !self.take(rank, MessageKey::Activation { from, to: rank as u32, micro_batch, chunk }) {
                        return Ok(());
                    }
                }
                Instruction::RecvGradient { micro_batch, chunk, from } => {
                    let from = self.peer(rank, from)? as u32;
                    if !self.take(rank, MessageKey::Gradient { from, to: rank as u32, micro_batch, chunk }) {
                        return Ok(());
                    }
                }
                // Started by the pass before it, or now if no pass did.
                Instruction::AllReduceGradients { dp_group, .. } if self.sim.setup.plan.overlap_grad_reduce() => {
                    self.launch_reduction(rank, dp_group, 0)?;
                }
                Instruction::AllReduceGradients { dp_group, .. } => {
                    if let Progress::Blocked = self.all_reduce(rank, dp_group)? {
                        return Ok(());
                    }
                }
                Instruction::OptimizerStep => {
                    if self.ranks[rank].open_reductions > 0 {
                        self.block(rank, Wait::Reductions);
                        return Ok(());
                    }
                    if self.ranks[rank].pending_sends > 0 {
                        self.block(rank, Wait::Sends);
                        return Ok(());
                    }
                    let (sync_ns, optimizer_ns) =
                        (self.sim.setup.ranks[rank].stage_sync_ns, self.sim.setup.ranks[rank].optimizer_ns);
                    self.ranks[rank].pc += 1;
                    self.ranks[rank].compute_ns += sync_ns + optimizer_ns;
                    let start = self.now();
                    if sync_ns > 0 {
                        let span = (start, start + sync_ns);
                        let name = "gradients over the stage's devices and the tied embedding";
                        self.timeline_slice(rank, COLLECTIVE_TID, name, "collective", span, &NoArgs {});
                    }
                    let span = (start + sync_ns, start + sync_ns + optimizer_ns);
                    self.timeline_slice(rank, COMPUTE_TID, "optimizer step", "optimizer", span, &NoArgs {});
                    self.push(span.1, Event::Resume(rank));
                    return Ok(());
                }
            }
            self.ranks[rank].pc += 1;
        }
    }

    fn peer(&self, rank: usize, peer: RankId) -> Result<usize, SimError> {
        self.sim.setup.rank_index(peer).ok_or_else(|| SimError::UnknownPeer {
            rank: self.sim.setup.ranks[rank].id.to_string(),
            peer: peer.to_string(),
        })
    }

    /// Consumes a delivered message, or blocks the rank until it arrives.
    fn take(&mut self, rank: usize, key: MessageKey) -> bool {
        if self.mailbox.remove(&key) {
            self.issued_ns.remove(&key);
            return true;
        }
        self.waiting.insert(key, rank);
        self.block(rank, Wait::Message(key));
        false
    }

    fn compute(&mut self, rank: usize, kind: PassKind, micro_batch: u32, chunk: u32) -> Result<(), SimError> {
        let setup = &self.sim.setup.ranks[rank];
        let cost = *setup.chunks.get(chunk as usize).ok_or_else(|| SimError::UnknownChunk {
            rank: setup.id.to_string(),
            chunk,
            n_chunks: setup.chunks.len(),
        })?;
        let (duration_ns, memory_change, name) = match kind {
            PassKind::Forward => (cost.forward_ns, cost.activation_bytes, "F"),
            PassKind::Backward => (cost.backward_ns, -cost.activation_bytes, "B"),
            PassKind::BackwardInput => (cost.input_grad_ns, 0.0, "Bi"),
            // The weight-gradient pass frees what the micro-batch still held.
            PassKind::BackwardWeight => (cost.weight_grad_ns, -cost.activation_bytes, "Bw"),
        };
        let now = self.now();
        let state = &mut self.ranks[rank];
        state.pc += 1;
        state.pass_ns += duration_ns;
        state.compute_ns += duration_ns;
        state.last_pass_end_ns = now + duration_ns;
        // Memory grows when a forward starts and shrinks when a backward starts: a rank runs one
        // pass at a time, so the peak is the same as booking the release at the end.
        state.memory_bytes += memory_change;
        state.peak_memory_bytes = state.peak_memory_bytes.max(state.memory_bytes);
        let memory_gib = state.memory_bytes / medley_cost::GIB;
        if self.sim.timeline.is_some() {
            let name = format!("{name} mb{micro_batch}{}", chunk_suffix(chunk));
            let mut args = json!({"micro_batch": micro_batch, "chunk": chunk});
            // A long-context pass shows one layer's phases on its slowest device.
            let layer = cost.context_layer.map(|(forward, backward)| match kind {
                PassKind::Forward => forward,
                _ => backward,
            });
            if let Some(layer) = layer {
                args["layer (slowest device)"] = json!({
                    "layer_ns": layer.end_ns,
                    "compute_ns": layer.compute_ns,
                    "all_to_all_wait_ns": layer.all_to_all_wait_ns,
                    "kv_wait_ns": layer.kv_wait_ns,
                    "sent_bytes": layer.sent_bytes,
                });
            }
            let pass = match kind {
                PassKind::Forward => Some(0),
                PassKind::Backward | PassKind::BackwardInput => Some(1),
                PassKind::BackwardWeight => None,
            };
            let phases =
                self.sim.setup.ranks[rank].layer_phases.as_ref().zip(pass).map(|(phases, pass)| phases[pass].clone());
            for span in phases.unwrap_or_default() {
                let at = (now + span.start_ns, now + span.end_ns);
                self.timeline_slice(rank, LAYER_TID, span.name, "layer", at, &NoArgs {});
            }
            self.timeline_slice(rank, COMPUTE_TID, &name, "compute", (now, now + duration_ns), &args);
            if memory_change != 0.0 {
                let at_ns = if memory_change > 0.0 { now } else { now + duration_ns };
                let pid = rank as u32 + 1;
                self.sim.timeline.as_mut().expect("checked").counter(pid, "memory GiB", at_ns, memory_gib);
            }
        }
        if matches!(kind, PassKind::Backward | PassKind::BackwardWeight) {
            self.launch_reductions_after(rank, duration_ns)?;
        }
        self.push(now + duration_ns, Event::Resume(rank));
        Ok(())
    }

    /// Under overlapped reduction, starts the all-reduces that follow a backward pass (past its
    /// gradient send) alongside it: the pass produces their gradients.
    fn launch_reductions_after(&mut self, rank: usize, pass_ns: u64) -> Result<(), SimError> {
        if !self.sim.setup.plan.overlap_grad_reduce() {
            return Ok(());
        }
        let programs = self.programs;
        for dp_group in programs[rank].reductions_following(self.ranks[rank].pc) {
            self.launch_reduction(rank, dp_group, pass_ns)?;
        }
        Ok(())
    }
}
