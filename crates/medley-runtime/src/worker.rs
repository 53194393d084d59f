//! A worker: one pipeline rank's model chunks, executing the rank's program of each step.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use medley_comm::{Communicator, Config, LaunchEnv, ReduceOp};
use medley_cost::Calibration;
use medley_model::data::{Dataset, loss_scale, step_layout};
use medley_model::params::ParamGroup;
use medley_model::{
    AdamW, HostTensor, MOMENT_PREFIXES, MicroBatch, ModelConfig, StageCompute, StageOutput, StageState,
    context_compute, stage_compute, tensor_parallel_compute,
};
use medley_plan::{LayerRange, Plan};
use medley_schedule::{CheckedPrograms, Instruction, RankId};
use medley_trace::timeline::{COLLECTIVE_TID, COMPUTE_TID};
use medley_trace::{BandwidthTrace, Timeline, TraceWalker};
use serde_json::json;

use crate::emulation::{Pacer, emulated, stretched};
use crate::error::CommContext;
use crate::groups::{split_context_groups, split_dp_groups, split_tensor_group};
use crate::layout::mixed_tp_groups;
use crate::metrics::{StepClock, StepMetrics};
use crate::native::{NativeGroup, native_group};
use crate::p2p::{Kind, Mailbox, Tag, overlap, place_rows, select_rows};
use crate::reduction::{BucketSpan, InFlight, Keep, Reduced, Reduction, flatten_gradients, unflatten_gradients};
use crate::tensor_parallel::TensorGroup;
use crate::zero::ZeroShard;
use crate::{DeviceChoice, RankLayout, RuntimeError};

/// How a worker trains.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// Seeds the initial weights and the data order.
    pub seed: u64,
    pub adamw: AdamW,
    /// Stretch each pass to the emulated device's speed ([`crate::EmulatedDevice::slowdown`]).
    pub emulate_speed: bool,
    /// With `emulate_speed`, every device is this many times slower again (at least 1): the
    /// common factor that fits the workers' CPU demand to the host's cores ([`crate::time_dilation`]).
    pub dilation: f64,
    pub comm: Config,
    /// Prices the emulated devices against each other.
    pub calibration: Calibration,
    /// Throttles the pipeline links; none sends at this machine's speed.
    pub link: Option<LinkEmulation>,
    /// Where the stages compute.
    pub device: DeviceChoice,
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
    pub(crate) layouts: Vec<RankLayout>,
    pub(crate) config: ModelConfig,
    pub(crate) world: Communicator,
    /// One communicator per plan DP group this rank is a member of (none for one replica).
    pub(crate) dp: Vec<Option<Communicator>>,
    /// The group's native (NCCL/RCCL) communicator, where its gradients take that path.
    native: Vec<Option<NativeGroup>>,
    /// Under ZeRO-1, this rank's share of each of its DP groups' optimizer states.
    pub(crate) zero: Vec<Option<ZeroShard>>,
    pub(crate) stages: Vec<StageState>,
    /// The threads the stages compute on: one per core the worker owns, or one when emulating
    /// (emulation paces a pass by its thread's processor time).
    threads: Arc<rayon::ThreadPool>,
    pub(crate) dataset: Dataset,
    pub(crate) options: WorkerOptions,
    mailbox: Mailbox,
    /// Paces a long-context or tensor-parallel worker's passes to its emulated device around
    /// their collectives.
    pacer: Option<Pacer>,
    /// Bytes a long-context worker's attention collectives have sent.
    context_sent: Arc<AtomicU64>,
    /// A tensor-parallel worker's group.
    tensor: Option<TensorGroup>,
    /// Per DP group, whether its holders differ in TP degree ([`mixed_tp_groups`]).
    mixed_tp: Vec<bool>,
    /// Emulated links by destination job rank.
    links: BTreeMap<usize, EmulatedLink>,
    clock: JobClock,
    /// Steps completed: the next step's index.
    pub(crate) step: u64,
    /// Set (by a signal handler) when this rank is asked to stop; gathered with each step's
    /// metrics, so that every rank learns of any rank's request at the same step.
    pub(crate) stop_requested: Option<Arc<AtomicBool>>,
    /// Some rank had been asked to stop by the end of the last step.
    pub(crate) stop_agreed: bool,
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
    /// Per DP group, whether its reduction has started this step.
    reducing: Vec<bool>,
    /// Overlapped reductions still running, by DP group.
    in_flight: Vec<(usize, InFlight)>,
    /// When each bucket of the step's reductions ran: DP group, bucket, span.
    bucket_spans: Vec<(usize, usize, BucketSpan)>,
}

impl Worker {
    /// Joins the job as `env`'s rank and builds this rank's stages at their initial weights.
    pub fn join(plan: Plan, mut env: LaunchEnv, options: WorkerOptions) -> Result<Worker, RuntimeError> {
        let layouts = RankLayout::all(&plan, &options.calibration)?;
        if env.world_size != layouts.len() {
            return Err(RuntimeError::Launch(format!(
                "WORLD_SIZE={} but the plan runs on {} workers: start one per pipeline rank, and one per device of a \
                 long-context stage",
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
        check_same_job(
            &mut world,
            &[
                ("plan", serde_json::to_string(&plan).expect("a plan serialises")),
                ("--seed", options.seed.to_string()),
                ("optimizer (--lr)", format!("{:?}", options.adamw)),
                (
                    "emulation (--no-emulate, --time-dilation)",
                    format!("{} {}", options.emulate_speed, options.dilation),
                ),
                ("calibration", options.calibration.to_toml()),
                ("link emulation (--link-gb-s, --link-trace)", format!("{:?}", options.link)),
                ("--timeout-s", format!("{:?}", options.comm.timeout)),
                ("--device", options.device.to_string()),
            ],
        )?;
        let mut dp = split_dp_groups(&plan, &layouts, &layout, &mut world)?;
        let device = options.device.resolve(env.local_rank)?;
        let native = dp
            .iter_mut()
            .enumerate()
            .map(|(group, comm)| match comm {
                Some(comm) => native_group(comm, device, &format!("DP group {group}")),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let stretch = if options.emulate_speed { layout.device.slowdown * options.dilation } else { 1.0 };
        let pacer = (layout.context.is_some() || layout.tensor.is_some()).then(|| Pacer::new(stretch));
        let context_sent = Arc::new(AtomicU64::new(0));
        let mut collectives =
            split_context_groups(&layouts, &layout, &mut world, pacer.clone(), Arc::clone(&context_sent))?;
        let tensor = split_tensor_group(&layouts, &layout, &mut world, pacer.clone())?;
        let config = ModelConfig::from_spec(plan.model(), plan.seq_len())?;
        let threads = if options.emulate_speed { 1 } else { world.compute_threads() };
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("medley-compute-{i}"))
            .build()
            .map_err(|err| RuntimeError::Launch(format!("starting {threads} compute threads: {err}")))?;
        let mut stages = layout
            .chunks
            .iter()
            .map(|layers| {
                let layers = layers.clone();
                if let (Some(seat), Some(group)) = (layout.tensor, &tensor) {
                    let group = Box::new(group.clone());
                    let compute = tensor_parallel_compute(&config, layers.clone(), seat, group, device)?;
                    return Ok(StageState::with_specs(seat.stage_params(&config, layers), options.seed, compute)?);
                }
                let compute: Box<dyn StageCompute> = match (&layout.context, collectives.take()) {
                    (Some(seat), Some(collectives)) => {
                        context_compute(&config, layers.clone(), seat.placement.clone(), Box::new(collectives), device)?
                    }
                    (Some(_), None) => {
                        return Err(RuntimeError::Unsupported(
                            "a long-context stage on a rank with several model chunks".into(),
                        ));
                    }
                    (None, _) => stage_compute(&config, layers.clone(), device)?,
                };
                Ok(StageState::new(&config, layers, options.seed, compute)?)
            })
            .collect::<Result<Vec<_>, RuntimeError>>()?;
        let zero = zero_shards(&plan, &dp, &mut stages, config.n_layers);
        let mixed_tp = mixed_tp_groups(&plan);
        let dataset = Dataset::shakespeare(config.seq_len, options.seed)?;
        let mine = [JobClock::wall_us() as i64];
        let mut origin = [0i64];
        world.broadcast(&mine, &mut origin, 0).during(|| "agreeing on the job clock".into())?;
        let mailbox = Mailbox::default();
        Ok(Worker {
            plan,
            layout,
            layouts,
            config,
            world,
            dp,
            native,
            zero,
            stages,
            threads: Arc::new(threads),
            dataset,
            options,
            mailbox,
            pacer,
            context_sent,
            tensor,
            mixed_tp,
            links: BTreeMap::new(),
            clock: JobClock { origin_us: origin[0] as u64 },
            step: 0,
            stop_requested: None,
            stop_agreed: false,
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

    /// Bytes this worker's long-context attention has sent so far: its head group's all-to-alls
    /// and its lane's keys and values.
    pub fn context_bytes_sent(&self) -> u64 {
        self.context_sent.load(Ordering::Relaxed)
    }

    /// This rank's stages, one per model chunk.
    pub fn stages(&self) -> &[StageState] {
        &self.stages
    }

    /// The tensors a checkpoint of this rank's stages holds, each whole: optimizer moments
    /// ZeRO-1 shards gathered from the data-parallel group, a tensor-parallel member's shards
    /// placed together with its group's. Every worker must call this at once.
    pub fn checkpoint_tensors(&mut self) -> Result<Vec<(String, HostTensor)>, RuntimeError> {
        let mut tensors: Vec<(String, HostTensor)> = self
            .stages
            .iter()
            .flat_map(StageState::checkpoint_tensors)
            .map(|(name, tensor)| (name, tensor.clone()))
            .collect();
        let index: HashMap<String, usize> =
            tensors.iter().enumerate().map(|(idx, (name, _))| (name.clone(), idx)).collect();
        for (group, (zero, comm)) in self.plan.dp_groups().iter().zip(self.zero.iter().zip(&mut self.dp)) {
            let (Some(zero), Some(comm)) = (zero, comm) else { continue };
            let select = holds_layers(group.layers, self.config.n_layers);
            let moments = zero.whole_moments(&self.stages, select, comm)?;
            let specs = self.stages.iter().flat_map(|stage| stage.specs()).filter(|spec| select(spec.group));
            for (spec, (m, v)) in specs.zip(moments) {
                tensors[index[&format!("{}{}", MOMENT_PREFIXES[0], spec.name)]].1 = m;
                tensors[index[&format!("{}{}", MOMENT_PREFIXES[1], spec.name)]].1 = v;
            }
        }
        match (&self.tensor, self.layout.tensor) {
            (Some(group), Some(seat)) => group.whole_tensors(&self.config, seat, &self.layout.chunks, tensors),
            _ => Ok(tensors),
        }
    }

    /// Whether this rank's checkpoint tensors are assembled with its groups' (ZeRO-1, tensor
    /// parallelism) rather than written as its stages hold them.
    pub(crate) fn checkpoint_gathers(&self) -> bool {
        self.tensor.is_some() || self.zero.iter().any(Option::is_some)
    }

    /// Under ZeRO-1, update number `step` of each DP group's parameters by their owners.
    fn zero_steps(&mut self, adamw: &AdamW) -> Result<(), RuntimeError> {
        let step = self.stages.first().map_or(0, StageState::optimizer_step_count) + 1;
        for (group, (zero, comm)) in self.plan.dp_groups().iter().zip(self.zero.iter_mut().zip(&mut self.dp)) {
            let (Some(zero), Some(comm)) = (zero, comm) else { continue };
            zero.step(&mut self.stages, holds_layers(group.layers, self.config.n_layers), adamw, step, comm)?;
        }
        Ok(())
    }

    /// Runs one training step of `programs` (generated from this worker's plan) and returns the
    /// job's metrics for it, the same on every rank.
    pub fn step(
        &mut self,
        programs: &CheckedPrograms,
        mut timeline: Option<&mut Timeline>,
    ) -> Result<StepMetrics, RuntimeError> {
        let program = programs.programs.iter().find(|program| program.rank == self.layout.id).ok_or_else(|| {
            RuntimeError::Program { rank: self.layout.id.to_string(), reason: "the programs have none for it".into() }
        })?;
        let started = Instant::now();
        let n_groups = self.plan.dp_groups().len();
        let clock = StepClock::new(n_groups);
        let mut state =
            StepState { batches: self.micro_batches(), clock, reducing: vec![false; n_groups], ..StepState::default() };
        for (idx, instruction) in program.instructions.iter().enumerate() {
            let begin_us = self.clock.now_us();
            let category = self.execute(*instruction, &mut state)?;
            if let Some(timeline) = timeline.as_deref_mut() {
                let tid = if category == "collective" { COLLECTIVE_TID } else { COMPUTE_TID };
                let span = (begin_us * 1000, self.clock.now_us() * 1000);
                let track = (self.timeline_pid(), tid);
                timeline.slice(track, &instruction.to_string(), category, span, &json!({"step": self.step + 1}));
            }
            if self.plan.overlap_grad_reduce() && matches!(instruction, Instruction::Backward { .. }) {
                for dp_group in program.reductions_following(idx + 1) {
                    self.reduce_gradients(dp_group as usize, &mut state)?;
                }
            }
        }
        if let Some(timeline) = timeline {
            for &(dp_group, bucket, (start_us, end_us)) in &state.bucket_spans {
                let track = (self.timeline_pid(), COLLECTIVE_TID);
                let name = format!("all-reduce dp{dp_group} bucket {bucket}");
                let span = (start_us * 1000, end_us * 1000);
                timeline.slice(track, &name, "collective", span, &json!({"step": self.step + 1}));
            }
        }
        self.mailbox.finish_step()?;
        state.clock.busy_s = started.elapsed().as_secs_f64();
        state.clock.peak_memory_mib = crate::peak_rss_mib().unwrap_or(f64::NAN);
        self.step += 1;
        self.gather_metrics(&state, programs)
    }

    /// Executes one instruction; returns its timeline category.
    fn execute(&mut self, instruction: Instruction, state: &mut StepState) -> Result<&'static str, RuntimeError> {
        let layout = &self.layout;
        let stretch = if self.options.emulate_speed { layout.device.slowdown * self.options.dilation } else { 1.0 };
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
                let pacer = self.pacer.as_ref();
                let clock = &mut state.clock;
                let output = self
                    .threads
                    .install(|| emulated(pacer, stretch, clock, || stage.forward(micro_batch, batch, input)))?;
                match output {
                    StageOutput::Activations(out) => {
                        state.to_send.insert((Kind::Activation, micro_batch, chunk), out);
                    }
                    StageOutput::Loss(loss) if layout.reports_loss() => state.loss_sum += loss,
                    StageOutput::Loss(_) => {}
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
                let pacer = self.pacer.as_ref();
                let clock = &mut state.clock;
                let input_grad = self
                    .threads
                    .install(|| emulated(pacer, stretch, clock, || stage.backward(micro_batch, upstream)))?;
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
                self.send_to_rank(to, Tag { kind, micro_batch, chunk }, tensor)?;
                Ok("send")
            }
            Instruction::RecvActivation { micro_batch, chunk, from }
            | Instruction::RecvGradient { micro_batch, chunk, from } => {
                let kind = if matches!(instruction, Instruction::RecvActivation { .. }) {
                    Kind::Activation
                } else {
                    Kind::Gradient
                };
                let tensor = self.recv_from_rank(from, Tag { kind, micro_batch, chunk }, state)?;
                state.received.insert((kind, micro_batch, chunk), tensor);
                Ok("wait")
            }
            // Started by the pass before it under overlapped reduction, or now.
            Instruction::AllReduceGradients { dp_group, .. } => {
                self.reduce_gradients(dp_group as usize, state)?;
                Ok("collective")
            }
            Instruction::OptimizerStep => {
                let started = Instant::now();
                self.world.wait_sends().during(|| "finishing the step's sends".into())?;
                self.wait_reductions(state)?;
                state.clock.collective_s += started.elapsed().as_secs_f64();
                let adamw = self.options.adamw;
                self.zero_steps(&adamw)?;
                let stretch = if self.options.emulate_speed { self.options.dilation } else { 1.0 };
                let stages = &mut self.stages;
                self.threads.install(|| {
                    stretched(stretch, || stages.iter_mut().try_for_each(|stage| stage.optimizer_step(&adamw)))
                })?;
                Ok("compute")
            }
        }
    }

    /// Sends this worker's part of `tensor` (`[batch, positions, hidden]`) to each worker of
    /// pipeline rank `to` that holds some of its positions: every position once, to its holder.
    fn send_to_rank(&mut self, to: RankId, tag: Tag, mut tensor: HostTensor) -> Result<(), RuntimeError> {
        let seq_len = self.config.seq_len;
        let mine = self.layout.positions(seq_len);
        for peer in self.workers_of(to) {
            let (rows, _) = overlap(&mine, &self.layouts[peer].positions(seq_len));
            if rows.is_empty() {
                continue;
            }
            // A peer holding every position (a stage of whole sequences) takes the tensor as it is;
            // positions are held once per stage, so no other peer does.
            let data = match rows.len() == tensor.shape[1] {
                true => std::mem::take(&mut tensor.data),
                false => select_rows(&tensor, &rows),
            };
            let times = self.stamp(peer, data.len() * size_of::<f32>())?;
            self.mailbox.send(&mut self.world, peer, tag, data, times)?;
        }
        Ok(())
    }

    /// Receives `tag` from the workers of pipeline rank `from` holding this worker's positions,
    /// waiting out each emulated link, and joins their parts in this worker's order.
    fn recv_from_rank(&mut self, from: RankId, tag: Tag, state: &mut StepState) -> Result<HostTensor, RuntimeError> {
        let (seq_len, hidden, batch) = (self.config.seq_len, self.config.hidden, self.plan.micro_batch() as usize);
        let mine = self.layout.positions(seq_len);
        let mut tensor = HostTensor::zeros(vec![batch, mine.len(), hidden]);
        for peer in self.workers_of(from) {
            let (_, rows) = overlap(&self.layouts[peer].positions(seq_len), &mine);
            if rows.is_empty() {
                continue;
            }
            let asked_us = self.clock.now_us();
            let message = self.mailbox.recv(&mut self.world, peer, tag, batch * rows.len() * hidden)?;
            let wire_us = message.arrival_us.saturating_sub(self.clock.now_us());
            std::thread::sleep(Duration::from_micros(wire_us));
            let done_us = self.clock.now_us();
            // Waiting for a message already posted is a transfer stall; before that, a bubble.
            let posted_us = asked_us.max(message.posted_us).min(done_us);
            state.clock.peer_wait_s += (posted_us - asked_us) as f64 * 1e-6;
            state.clock.transfer_wait_s += (done_us - posted_us) as f64 * 1e-6;
            match rows.len() == mine.len() {
                true => tensor.data = message.data,
                false => place_rows(&mut tensor, &rows, &message.data),
            }
        }
        Ok(tensor)
    }

    /// The job ranks of pipeline rank `id`'s workers.
    fn workers_of(&self, id: RankId) -> Vec<usize> {
        self.layouts.iter().filter(|layout| layout.id == id).map(|layout| layout.job_rank).collect()
    }

    /// The posting time of a message of `bytes` to `peer`, and when it arrives over the emulated
    /// link (the same time without one). A link so slow that the message would arrive after the
    /// job's timeout stops the job here, saying so, rather than leaving the receiver asleep.
    fn stamp(&mut self, peer: usize, bytes: usize) -> Result<(u64, u64), RuntimeError> {
        let now_us = self.clock.now_us();
        let Some(emulation) = &self.options.link else { return Ok((now_us, now_us)) };
        let link_id = (self.layout.job_rank * self.layouts.len() + peer) as u64;
        let link = self
            .links
            .entry(peer)
            .or_insert_with(|| EmulatedLink { walker: TraceWalker::new(&emulation.trace, link_id), free_us: 0 });
        let start_us = now_us.max(link.free_us);
        let end_ns = link.walker.finish_ns(start_us * 1000, bytes as f64, emulation.full_bytes_per_s);
        let arrival_us = end_ns.div_ceil(1000);
        let timeout = self.options.comm.timeout;
        if Duration::from_micros(arrival_us.saturating_sub(now_us)) > timeout {
            return Err(RuntimeError::LinkTooSlow(format!(
                "the emulated link to worker {peer} ({} GB/s at full speed, as its trace allows) would deliver a \
                 {bytes}-byte message in {:.0} s, past the {} s timeout: raise --link-gb-s, or --timeout-s",
                emulation.full_bytes_per_s / 1e9,
                (arrival_us - now_us) as f64 * 1e-6,
                timeout.as_secs()
            )));
        }
        link.free_us = arrival_us;
        Ok((now_us, arrival_us))
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

    /// Sums the gradients of DP group `dp_group`'s layers over its members (a sample-weighted
    /// mean, since every loss is scaled by the global batch), in the plan's algorithm, unless
    /// that has started this step: here, or under overlapped reduction on a thread of its own,
    /// which [`Self::wait_reductions`] waits for. On a tensor-parallel stage, the gradients of
    /// parameters its members share are first summed over its group; a group whose holders
    /// differ in TP degree sums whole tensors; under ZeRO-1 each member keeps its run of the sum.
    fn reduce_gradients(&mut self, dp_group: usize, state: &mut StepState) -> Result<(), RuntimeError> {
        if std::mem::replace(&mut state.reducing[dp_group], true) {
            return Ok(());
        }
        let started = Instant::now();
        state.clock.all_reduce_arrivals_us[dp_group] = self.clock.now_us() as f64;
        let layers = self.plan.dp_groups()[dp_group].layers;
        let select = holds_layers(layers, self.config.n_layers);
        let mixed = self.mixed_tp[dp_group];
        if let Some(group) = self.tensor.as_ref().filter(|_| !mixed) {
            group.sum_replicated_grads(&mut self.stages, select)?;
        }
        let Some(comm) = self.dp.get_mut(dp_group).and_then(Option::as_mut) else { return Ok(()) };
        let zero = self.zero.get_mut(dp_group).and_then(Option::as_mut);
        if let Some(native) =
            self.native.get_mut(dp_group).and_then(Option::as_mut).filter(|_| zero.is_none() && !mixed)
        {
            // The native groups all-reduce, in place of the collective, on the worker's thread.
            let flat = flatten_gradients(&mut self.stages, |spec| select(spec.group), false);
            let mut summed = vec![0f32; flat.len()];
            native.all_reduce(&flat, &mut summed).map_err(|err| {
                RuntimeError::Device(format!("all-reducing the gradients of layers {layers} natively: {err}"))
            })?;
            self.finish_reduction(dp_group, summed);
            state.clock.collective_s += started.elapsed().as_secs_f64();
            return Ok(());
        }
        let flat = flatten_gradients(&mut self.stages, |spec| select(spec.group), mixed);
        let keep = zero.map_or(Keep::Whole, ZeroShard::keep);
        let algorithm = Some(self.plan.dp_groups()[dp_group].algorithm.into());
        let overlapped = self.plan.overlap_grad_reduce();
        let reduction = Reduction::new(flat, keep, algorithm, overlapped, comm.n_ranks());
        let clock = self.clock;
        if overlapped {
            let comm = self.dp[dp_group].take().expect("the group's communicator is here between reductions");
            state.in_flight.push((dp_group, reduction.start(comm, move || clock.now_us())));
            return Ok(());
        }
        let reduced = reduction.run(comm, move || clock.now_us());
        self.take_reduction(dp_group, reduced, state)?;
        state.clock.collective_s += started.elapsed().as_secs_f64();
        Ok(())
    }

    /// Waits for the step's overlapped reductions and takes their sums.
    fn wait_reductions(&mut self, state: &mut StepState) -> Result<(), RuntimeError> {
        for (dp_group, in_flight) in std::mem::take(&mut state.in_flight) {
            let layers = self.plan.dp_groups()[dp_group].layers;
            let (comm, result) = in_flight.wait().ok_or_else(|| {
                RuntimeError::Launch(format!("the thread summing the gradients of layers {layers} panicked"))
            })?;
            self.dp[dp_group] = Some(comm);
            self.take_reduction(dp_group, result, state)?;
        }
        Ok(())
    }

    /// Takes what DP group `dp_group`'s reduction gave: its buckets' spans, and its sum.
    fn take_reduction(&mut self, dp_group: usize, reduced: Reduced, state: &mut StepState) -> Result<(), RuntimeError> {
        let layers = self.plan.dp_groups()[dp_group].layers;
        let (sum, spans) =
            reduced.during(|| format!("summing the gradients of layers {layers} over the data-parallel group"))?;
        state.bucket_spans.extend(spans.into_iter().enumerate().map(|(bucket, span)| (dp_group, bucket, span)));
        self.finish_reduction(dp_group, sum);
        Ok(())
    }

    /// Takes DP group `dp_group`'s summed gradients: this member's ZeRO-1 run, or the whole
    /// sum put back into the stages' gradients.
    fn finish_reduction(&mut self, dp_group: usize, sum: Vec<f32>) {
        if let Some(zero) = self.zero.get_mut(dp_group).and_then(Option::as_mut) {
            return zero.set_gradients(sum);
        }
        let select = holds_layers(self.plan.dp_groups()[dp_group].layers, self.config.n_layers);
        unflatten_gradients(&mut self.stages, |spec| select(spec.group), self.mixed_tp[dp_group], &sum);
    }

    /// Whether every worker's weights are finite: the same answer on every worker, so that none
    /// checkpoints a diverged state and all stop together.
    pub(crate) fn weights_are_finite(&mut self) -> Result<bool, RuntimeError> {
        let params = self.stages.iter().flat_map(StageState::params);
        let mine = params.flat_map(|param| &param.data).all(|weight| weight.is_finite());
        let mut any_not = [0f64];
        self.world
            .all_reduce(&[f64::from(u8::from(!mine))], &mut any_not, ReduceOp::Max)
            .during(|| "checking that the weights are finite".into())?;
        Ok(any_not[0] == 0.0)
    }

    /// Every rank's times and losses, gathered so that each rank reports (and adapts to) the same
    /// numbers, and whether any rank has been asked to stop (its first word).
    fn gather_metrics(&mut self, state: &StepState, programs: &CheckedPrograms) -> Result<StepMetrics, RuntimeError> {
        let stop = self.stop_requested.as_ref().is_some_and(|flag| flag.load(Ordering::Acquire));
        let mut mine = vec![f64::from(u8::from(stop))];
        mine.extend(state.clock.to_words(state.loss_sum));
        let n = self.layouts.len();
        let mut all = vec![0f64; n * mine.len()];
        self.world
            .all_gather(&mine, &mut all, &vec![mine.len(); n])
            .during(|| "gathering the step's metrics".into())?;
        self.stop_agreed = all.chunks(mine.len()).any(|words| words[0] != 0.0);
        let (clocks, losses): (Vec<StepClock>, Vec<f64>) =
            all.chunks(mine.len()).map(|words| StepClock::from_words(&words[1..])).unzip();
        let tokens = u64::from(self.plan.global_batch()) * u64::from(self.plan.seq_len());
        let loss = losses.iter().sum();
        Ok(StepMetrics::new(self.step, loss, tokens, programs.schedule, &clocks, &self.layouts))
    }
}

/// Checks that every worker of the job was started with the same `fields` (a name people know
/// it by, and its value as text): each worker's hashes are gathered by all, so every worker stops
/// with the same error naming the first worker and field that differ from worker 0's — instead
/// of training a silently different job, or failing later on a mismatch nobody can place.
pub(crate) fn check_same_job(world: &mut Communicator, fields: &[(&str, String)]) -> Result<(), RuntimeError> {
    use sha2::Digest;
    let hash = |text: &str| {
        let digest = sha2::Sha256::digest(text.as_bytes());
        i64::from_le_bytes(digest[..8].try_into().expect("eight bytes"))
    };
    let mine: Vec<i64> = fields.iter().map(|(_, value)| hash(value)).collect();
    let n = world.n_ranks();
    let mut all = vec![0i64; n * mine.len()];
    world
        .all_gather(&mine, &mut all, &vec![mine.len(); n])
        .during(|| "checking that every worker was given the same job".into())?;
    let first = &all[..mine.len()];
    for (rank, theirs) in all.chunks(mine.len()).enumerate().skip(1) {
        if let Some(field) = (0..mine.len()).find(|&field| theirs[field] != first[field]) {
            return Err(RuntimeError::Launch(format!(
                "worker {rank} was started with another {} than worker 0: every worker of a job must be given the \
                 same plan, seed and options",
                fields[field].0
            )));
        }
    }
    Ok(())
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

/// Selects the parameters of `layers` of a model of `n_layers`: the embedding with the first
/// layer, the final norm and head with the last.
pub(crate) fn holds_layers(layers: LayerRange, n_layers: usize) -> impl Fn(ParamGroup) -> bool + Copy {
    move |group: ParamGroup| match group {
        ParamGroup::Embedding => layers.start == 0,
        ParamGroup::Layer(layer) => (layers.start as usize..layers.end as usize).contains(&layer),
        ParamGroup::Head => layers.end as usize == n_layers,
    }
}

/// Under ZeRO-1, this rank's share of the optimizer states of each DP group it is in (taken
/// from `stages`, which hold them whole until then); none without ZeRO-1 or for a group of one.
pub(crate) fn zero_shards(
    plan: &Plan,
    dp: &[Option<Communicator>],
    stages: &mut [StageState],
    n_layers: usize,
) -> Vec<Option<ZeroShard>> {
    plan.dp_groups()
        .iter()
        .zip(dp)
        .map(|(group, comm)| {
            let comm = comm.as_ref().filter(|_| plan.zero1())?;
            Some(ZeroShard::take(stages, holds_layers(group.layers, n_layers), comm.rank(), comm.n_ranks()))
        })
        .collect()
}
