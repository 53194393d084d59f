//! A worker: one pipeline rank's model chunks, executing the rank's program of each step.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use medley_comm::{Communicator, Config, Counts, LaunchEnv, Op, ReduceOp};
use medley_cost::Calibration;
use medley_model::data::{Dataset, loss_scale, step_layout};
use medley_model::params::ParamGroup;
use medley_model::{AdamW, BurnStage, HostTensor, MicroBatch, ModelConfig, StageOutput, StageState};
use medley_plan::{LayerRange, Plan};
use medley_schedule::{Instruction, Programs, RankId};
use medley_trace::timeline::{COLLECTIVE_TID, COMPUTE_TID};
use medley_trace::{BandwidthTrace, Timeline, TraceWalker};
use serde_json::json;

use crate::error::CommContext;
use crate::metrics::{StepClock, StepMetrics};
use crate::p2p::{Kind, Mailbox, Tag};
use crate::{RankLayout, RuntimeError};

/// How a worker trains.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// Seeds the initial weights and the data order.
    pub seed: u64,
    pub adamw: AdamW,
    /// Stretch each pass to the emulated device's speed ([`crate::EmulatedDevice::slowdown`]).
    pub emulate_speed: bool,
    pub comm: Config,
    /// Prices the emulated devices against each other.
    pub calibration: Calibration,
    /// Throttles the pipeline links; none sends at this machine's speed.
    pub link: Option<LinkEmulation>,
}

/// An emulated pipeline link: each message between two stages takes its size over
/// `full_bytes_per_s` times the trace's fraction, one message at a time per direction, on top of
/// the real transfer. The sender stamps the arrival time; the receiver waits for it.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkEmulation {
    pub full_bytes_per_s: f64,
    pub trace: BandwidthTrace,
}

/// One direction of an emulated link.
struct EmulatedLink {
    walker: TraceWalker,
    /// When the previous message has left the link, µs of the job clock.
    free_us: u64,
}

/// One pipeline rank of a running job.
pub struct Worker {
    pub(crate) plan: Plan,
    pub(crate) layout: RankLayout,
    layouts: Vec<RankLayout>,
    config: ModelConfig,
    pub(crate) world: Communicator,
    /// One communicator per plan DP group this rank is a member of (none for one replica).
    dp: Vec<Option<Communicator>>,
    pub(crate) stages: Vec<StageState>,
    pub(crate) dataset: Dataset,
    pub(crate) options: WorkerOptions,
    mailbox: Mailbox,
    /// Emulated links by destination job rank.
    links: BTreeMap<usize, EmulatedLink>,
    clock: JobClock,
    /// Steps completed: the next step's index.
    pub(crate) step: u64,
}

/// Microseconds since the job started, on a clock every worker of one host shares.
#[derive(Clone, Copy, Debug)]
struct JobClock {
    origin_us: u64,
}

impl JobClock {
    fn wall_us() -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |since| since.as_micros() as u64)
    }

    fn now_us(self) -> u64 {
        JobClock::wall_us().saturating_sub(self.origin_us)
    }
}

/// What one step's execution holds between instructions, keyed by (micro-batch, chunk).
#[derive(Default)]
struct StepState {
    batches: Vec<MicroBatch>,
    /// Received activations and gradients, by the sender's chunk.
    received: BTreeMap<(Kind, u32, u32), HostTensor>,
    /// Outputs waiting to be sent, by this rank's chunk.
    to_send: BTreeMap<(Kind, u32, u32), HostTensor>,
    loss_sum: f64,
    clock: StepClock,
}

impl Worker {
    /// Joins the job as `env`'s rank and builds this rank's stages at their initial weights.
    pub fn join(plan: Plan, mut env: LaunchEnv, options: WorkerOptions) -> Result<Worker, RuntimeError> {
        let layouts = RankLayout::all(&plan, &options.calibration)?;
        if env.world_size != layouts.len() {
            return Err(RuntimeError::Launch(format!(
                "WORLD_SIZE={} but the plan has {} pipeline ranks: start one worker per rank",
                env.world_size,
                layouts.len()
            )));
        }
        let layout = layouts[env.rank].clone();
        let vendor = layout.device.vendor.to_string();
        if env.domain == "default" {
            env.domain = vendor;
        } else if env.domain != vendor {
            return Err(RuntimeError::Launch(format!(
                "MEDLEY_DOMAIN={} but rank {} ({}) is a {} device in the plan",
                env.domain, env.rank, layout.id, vendor
            )));
        }
        let mut world = Communicator::init(&env, options.comm.clone()).during(|| "joining the job".into())?;
        let dp = split_dp_groups(&plan, layout.id, &mut world)?;
        let config = ModelConfig::from_spec(plan.model(), plan.seq_len())?;
        let stages = layout
            .chunks
            .iter()
            .map(|layers| {
                let compute = Box::new(BurnStage::new(&config, layers.clone()));
                StageState::new(&config, layers.clone(), options.seed, compute)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let dataset = Dataset::shakespeare(config.seq_len, options.seed)?;
        let mine = [JobClock::wall_us() as i64];
        let mut origin = [0i64];
        world.broadcast(&mine, &mut origin, 0).during(|| "agreeing on the job clock".into())?;
        let mailbox = Mailbox::new(plan.micro_batch() as usize * config.seq_len * config.hidden);
        Ok(Worker {
            plan,
            layout,
            layouts,
            config,
            world,
            dp,
            stages,
            dataset,
            options,
            mailbox,
            links: BTreeMap::new(),
            clock: JobClock { origin_us: origin[0] as u64 },
            step: 0,
        })
    }

    pub fn layout(&self) -> &RankLayout {
        &self.layout
    }

    /// Tells every other worker that this one is failing for a reason of its own, so they stop
    /// at once naming it instead of waiting out the timeout.
    pub fn abort(&mut self, reason: &str) {
        self.world.abort(reason);
    }

    /// This rank's process in a Perfetto timeline: numbered as the simulator numbers its ranks,
    /// so a simulated and a measured step line up.
    pub fn timeline_pid(&self) -> u32 {
        self.layout.job_rank as u32 + 1
    }

    /// This rank's stages, one per model chunk.
    pub fn stages(&self) -> &[StageState] {
        &self.stages
    }

    /// Runs one training step of `programs` (generated from this worker's plan) and returns the
    /// job's metrics for it, the same on every rank.
    pub fn step(
        &mut self,
        programs: &Programs,
        mut timeline: Option<&mut Timeline>,
    ) -> Result<StepMetrics, RuntimeError> {
        let program = programs.programs.iter().find(|program| program.rank == self.layout.id).ok_or_else(|| {
            RuntimeError::Program { rank: self.layout.id.to_string(), reason: "the programs have none for it".into() }
        })?;
        let started = Instant::now();
        let clock = StepClock::new(self.plan.dp_groups().len());
        let mut state = StepState { batches: self.micro_batches(), clock, ..StepState::default() };
        for instruction in &program.instructions {
            let begin_us = self.clock.now_us();
            let category = self.execute(*instruction, &mut state)?;
            if let Some(timeline) = timeline.as_deref_mut() {
                let tid = if category == "collective" { COLLECTIVE_TID } else { COMPUTE_TID };
                let span = (begin_us * 1000, self.clock.now_us() * 1000);
                let track = (self.timeline_pid(), tid);
                timeline.slice(track, &instruction.to_string(), category, span, json!({"step": self.step + 1}));
            }
        }
        self.mailbox.finish_step()?;
        state.clock.busy_s = started.elapsed().as_secs_f64();
        self.step += 1;
        self.gather_metrics(&state, programs)
    }

    /// Executes one instruction; returns its timeline category.
    fn execute(&mut self, instruction: Instruction, state: &mut StepState) -> Result<&'static str, RuntimeError> {
        let layout = &self.layout;
        let stretch = if self.options.emulate_speed { layout.device.slowdown } else { 1.0 };
        let peer = |rank: RankId| self.layouts.iter().position(|l| l.id == rank).expect("rank of the plan");
        match instruction {
            Instruction::Forward { micro_batch, chunk } => {
                let input = (!layout.is_first(chunk))
                    .then(|| {
                        take(
                            &mut state.received,
                            (Kind::Activation, micro_batch, layout.input_sender_chunk(chunk)),
                            layout.id,
                        )
                    })
                    .transpose()?;
                let batch = &state.batches[micro_batch as usize];
                let stage = &mut self.stages[chunk as usize];
                let output = stretched(stretch, || stage.forward(micro_batch, batch, input))?;
                match output {
                    StageOutput::Activations(out) => {
                        state.to_send.insert((Kind::Activation, micro_batch, chunk), out);
                    }
                    StageOutput::Loss(loss) => state.loss_sum += loss,
                }
                Ok("compute")
            }
            Instruction::Backward { micro_batch, chunk } => {
                let upstream = (!layout.is_last(chunk))
                    .then(|| {
                        take(
                            &mut state.received,
                            (Kind::Gradient, micro_batch, layout.gradient_sender_chunk(chunk)),
                            layout.id,
                        )
                    })
                    .transpose()?;
                let stage = &mut self.stages[chunk as usize];
                let input_grad = stretched(stretch, || stage.backward(micro_batch, upstream))?;
                if let Some(grad) = input_grad {
                    state.to_send.insert((Kind::Gradient, micro_batch, chunk), grad);
                }
                Ok("compute")
            }
            Instruction::BackwardInput { .. } | Instruction::BackwardWeight { .. } => Err(RuntimeError::zero_bubble()),
            Instruction::SendActivation { micro_batch, chunk, to }
            | Instruction::SendGradient { micro_batch, chunk, to } => {
                let kind = if matches!(instruction, Instruction::SendActivation { .. }) {
                    Kind::Activation
                } else {
                    Kind::Gradient
                };
                let tensor = take(&mut state.to_send, (kind, micro_batch, chunk), self.layout.id)?;
                let tag = Tag { kind, micro_batch, chunk };
                let peer = peer(to);
                let times = self.stamp(peer, tensor.data.len() * size_of::<f32>());
                self.mailbox.send(&mut self.world, peer, tag, tensor.data, times)?;
                Ok("send")
            }
            Instruction::RecvActivation { micro_batch, chunk, from }
            | Instruction::RecvGradient { micro_batch, chunk, from } => {
                let kind = if matches!(instruction, Instruction::RecvActivation { .. }) {
                    Kind::Activation
                } else {
                    Kind::Gradient
                };
                let asked_us = self.clock.now_us();
                let message = self.mailbox.recv(&mut self.world, peer(from), Tag { kind, micro_batch, chunk })?;
                let wire_us = message.arrival_us.saturating_sub(self.clock.now_us());
                std::thread::sleep(Duration::from_micros(wire_us));
                let done_us = self.clock.now_us();
                // Waiting for a message already posted is a transfer stall; before that, a bubble.
                let posted_us = asked_us.max(message.posted_us).min(done_us);
                state.clock.peer_wait_s += (posted_us - asked_us) as f64 * 1e-6;
                state.clock.transfer_wait_s += (done_us - posted_us) as f64 * 1e-6;
                let shape = vec![self.plan.micro_batch() as usize, self.config.seq_len, self.config.hidden];
                state.received.insert((kind, micro_batch, chunk), HostTensor::new(shape, message.data));
                Ok("wait")
            }
            Instruction::AllReduceGradients { dp_group, layers } => {
                state.clock.all_reduce_arrivals_us[dp_group as usize] = self.clock.now_us() as f64;
                let started = Instant::now();
                self.all_reduce_gradients(dp_group as usize, layers)?;
                state.clock.collective_s += started.elapsed().as_secs_f64();
                Ok("collective")
            }
            Instruction::OptimizerStep => {
                let started = Instant::now();
                self.world.wait_sends().during(|| "finishing the step's sends".into())?;
                state.clock.collective_s += started.elapsed().as_secs_f64();
                let adamw = self.options.adamw;
                stretched(1.0, || self.stages.iter_mut().try_for_each(|stage| stage.optimizer_step(&adamw)))?;
                Ok("compute")
            }
        }
    }

    /// The posting time of a message of `bytes` to `peer`, and when it arrives over the emulated
    /// link (the same time without one).
    fn stamp(&mut self, peer: usize, bytes: usize) -> (u64, u64) {
        let now_us = self.clock.now_us();
        let Some(emulation) = &self.options.link else { return (now_us, now_us) };
        let link_id = (self.layout.job_rank * self.layouts.len() + peer) as u64;
        let link = self
            .links
            .entry(peer)
            .or_insert_with(|| EmulatedLink { walker: TraceWalker::new(&emulation.trace, link_id), free_us: 0 });
        let start_us = now_us.max(link.free_us);
        let end_ns = link.walker.finish_ns(start_us * 1000, bytes as f64, emulation.full_bytes_per_s);
        link.free_us = end_ns.div_ceil(1000);
        (now_us, link.free_us)
    }

    /// This rank's micro-batches of the current step.
    fn micro_batches(&self) -> Vec<MicroBatch> {
        let counts: Vec<u32> = self.plan.replicas().iter().map(|replica| replica.n_micro_batches).collect();
        let starts = step_layout(&counts, self.plan.micro_batch(), self.step);
        let scale = loss_scale(u64::from(self.plan.global_batch()), self.config.seq_len);
        starts[self.layout.id.replica as usize]
            .iter()
            .map(|&first| self.dataset.micro_batch(first, self.plan.micro_batch() as usize, scale))
            .collect()
    }

    /// Sums the gradients of `layers` over the DP group's members (a sample-weighted mean, since
    /// every loss is scaled by the global batch), in the plan's algorithm.
    fn all_reduce_gradients(&mut self, dp_group: usize, layers: LayerRange) -> Result<(), RuntimeError> {
        let Some(comm) = self.dp.get_mut(dp_group).and_then(Option::as_mut) else { return Ok(()) };
        let n_layers = self.config.n_layers;
        let select = |group: ParamGroup| match group {
            ParamGroup::Embedding => layers.start == 0,
            ParamGroup::Layer(layer) => (layers.start as usize..layers.end as usize).contains(&layer),
            ParamGroup::Head => layers.end as usize == n_layers,
        };
        let mut flat = Vec::new();
        for stage in &mut self.stages {
            stage.grads_of_mut(select).for_each(|grad| flat.extend_from_slice(&grad.data));
        }
        let mut summed = vec![0f32; flat.len()];
        let algorithm = self.plan.dp_groups()[dp_group].algorithm.into();
        let op = Op::AllReduce { op: ReduceOp::Sum };
        comm.collective(op, &Counts::Same(flat.len()), Some(algorithm), &flat, &mut summed)
            .during(|| format!("all-reducing the gradients of layers {layers}"))?;
        let mut rest = summed.as_slice();
        for stage in &mut self.stages {
            for grad in stage.grads_of_mut(select) {
                let (mine, tail) = rest.split_at(grad.data.len());
                grad.data.copy_from_slice(mine);
                rest = tail;
            }
        }
        Ok(())
    }

    /// Every rank's times and losses, gathered so that each rank reports (and adapts to) the same
    /// numbers.
    fn gather_metrics(&mut self, state: &StepState, programs: &Programs) -> Result<StepMetrics, RuntimeError> {
        let mine = state.clock.to_words(state.loss_sum);
        let n = self.layouts.len();
        let mut all = vec![0f64; n * mine.len()];
        self.world
            .all_gather(&mine, &mut all, &vec![mine.len(); n])
            .during(|| "gathering the step's metrics".into())?;
        let (clocks, losses): (Vec<StepClock>, Vec<f64>) = all.chunks(mine.len()).map(StepClock::from_words).unzip();
        let tokens = u64::from(self.plan.global_batch()) * u64::from(self.plan.seq_len());
        let loss = losses.iter().sum();
        Ok(StepMetrics::new(self.step, loss, tokens, programs.schedule, &clocks, &self.layouts))
    }
}

/// Runs a pass, stretched to `stretch` times what it took here by sleeping, so a slower
/// emulated device's pass really takes longer.
fn stretched<T>(stretch: f64, pass: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let result = pass();
    if stretch > 1.0 {
        std::thread::sleep(started.elapsed().mul_f64(stretch - 1.0));
    }
    result
}

fn take(
    map: &mut BTreeMap<(Kind, u32, u32), HostTensor>,
    key: (Kind, u32, u32),
    rank: RankId,
) -> Result<HostTensor, RuntimeError> {
    map.remove(&key).ok_or_else(|| RuntimeError::Program {
        rank: rank.to_string(),
        reason: format!("{key:?} is used before it was received or computed"),
    })
}

/// One communicator per DP group: the stage of each replica that holds the group's layers, in
/// replica order. Every rank takes part in every split.
fn split_dp_groups(
    plan: &Plan,
    id: RankId,
    world: &mut Communicator,
) -> Result<Vec<Option<Communicator>>, RuntimeError> {
    if plan.replicas().len() == 1 {
        return Ok(plan.dp_groups().iter().map(|_| None).collect());
    }
    plan.dp_groups()
        .iter()
        .enumerate()
        .map(|(group_idx, group)| {
            let holder = plan.holders(group_idx)[id.replica as usize];
            let replica = &plan.replicas()[id.replica as usize];
            let member = plan.rank_of(replica, holder) == id.pp_rank as usize;
            world
                .split(member.then_some(0), i64::from(id.replica))
                .during(|| format!("forming the data-parallel group of layers {}", group.layers))
        })
        .collect()
}
