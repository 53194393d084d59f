//! The communicator: plans a collective with medley-collective, runs this rank's steps over its
//! links, and turns any failure into the job's abort.

use std::net::IpAddr;
use std::sync::Arc;

use medley_collective::{Algorithm, Choice, Counts, Group, Op, RankSteps, ReduceOp, Step, choose_call, plan_steps};

use crate::CommError;
use crate::bind::Cores;
use crate::dtype::{DType, Element};
use crate::env::{Config, LaunchEnv};
use crate::exec::{Call, Scratch, execute};
use crate::mesh;
use crate::session::Session;
use crate::transport::window::Windows;
use crate::transport::{Links, Sink, Ticket};
use crate::wait::{Blame, JoinBudget, Waiter};
use crate::wire::{FrameHeader, fingerprint};

/// A group of ranks that run collectives together. Every rank of the group must call the same
/// operations in the same order with matching arguments; a mismatch is reported, not hung on.
///
/// After any failure of a peer (death, silence past [`Config::timeout`], a mismatched or
/// malformed frame) this and every later operation on every communicator of the job fails with
/// an error naming the rank to blame.
pub struct Communicator {
    // Dropped first: closes the links before the session says goodbye.
    links: Links,
    /// Every rank's window, when the ranks share memory in one domain.
    windows: Option<Windows>,
    /// Buffers of [`Communicator::isend`]s not yet known to be delivered, with their tickets.
    outbox: Vec<PendingSend>,
    session: Arc<Session>,
    config: Config,
    waiter: Waiter,
    ns: String,
    rank: usize,
    members: Vec<usize>,
    group: Group,
    domain_names: Vec<String>,
    listen_ip: IpAddr,
    /// Collectives called so far (the sequence number frames carry).
    n_collectives: u64,
    /// Point-to-point messages sent to and received from each peer.
    n_sent: Vec<u64>,
    n_received: Vec<u64>,
    n_splits: u64,
    /// Payload bytes this rank has sent as messages: collectives' sends and point-to-point.
    bytes_sent: u64,
    /// The working buffer for operations whose result is a part of it (reduce-scatter).
    scratch: Vec<u64>,
    exec_scratch: Scratch,
    /// This rank's recent plans: a training loop repeats the same few collectives.
    plans: Vec<(PlanKey, Arc<CachedPlan>)>,
}

/// An asynchronous send's buffer, kept alive until its ticket is waited for.
struct PendingSend {
    peer: usize,
    ticket: Ticket,
    _buffer: Box<dyn std::any::Any + Send>,
}

/// What a plan depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
struct PlanKey {
    op: Op,
    counts: Counts,
    choice: Choice,
    dtype: DType,
}

struct CachedPlan {
    steps: RankSteps,
    fingerprint: u64,
    /// Elements this rank's steps send as messages.
    sent_elements: usize,
}

/// Plans kept per communicator.
const PLAN_CACHE: usize = 16;

impl Communicator {
    /// Joins the job described by `env`: rank 0 starts the store, everyone connects to it with the
    /// job token and then to each other. First the calling thread binds itself to a core when
    /// `env` asks for it and the host has a core per local rank (see [`crate::CpuBinding`]); the
    /// threads it starts afterwards inherit that, so a rank should join before starting workers.
    pub fn init(env: &LaunchEnv, config: Config) -> Result<Communicator, CommError> {
        let session = Arc::new(Session::join(env, &config)?);
        let listen_ip = session.store.local_ip()?;
        let members: Vec<usize> = (0..env.world_size).collect();
        let timeout = config.timeout;
        let budget = session.join_budget;
        let world =
            Communicator::connect(Arc::clone(&session), "world".into(), members, env.rank, listen_ip, config, budget)?;
        // Rendezvous may wait for processes still starting; once every rank has joined, a store
        // call waits no longer on a silent peer than any other wait does.
        session.store.set_timeout(timeout)?;
        Ok(world)
    }

    fn connect(
        session: Arc<Session>,
        ns: String,
        members: Vec<usize>,
        rank: usize,
        listen_ip: IpAddr,
        config: Config,
        budget: JoinBudget,
    ) -> Result<Communicator, CommError> {
        let mesh = mesh::connect(&session, &ns, &members, rank, listen_ip, &config, budget)
            .map_err(|err| session.fail(err))?;
        let n = members.len();
        Ok(Communicator {
            links: mesh.links,
            windows: mesh.windows,
            waiter: Waiter {
                timeout: config.timeout,
                abort: Arc::clone(&session.abort),
                blame: Some(Arc::clone(&session) as Arc<dyn Blame>),
                own_core: matches!(session.cores, Cores::Bound(_)),
            },
            session,
            config,
            ns,
            rank,
            members,
            group: mesh.group,
            domain_names: mesh.domain_names,
            listen_ip,
            n_collectives: 0,
            n_sent: vec![0; n],
            n_received: vec![0; n],
            n_splits: 0,
            bytes_sent: 0,
            outbox: Vec::new(),
            scratch: Vec::new(),
            exec_scratch: Scratch::default(),
            plans: Vec::new(),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many threads this rank's compute should run on: one per core it was bound to, or its
    /// share of the host's cores when the scheduler places it (never more, which would
    /// oversubscribe the cores that other local ranks compute on).
    pub fn compute_threads(&self) -> usize {
        self.session.cores.threads()
    }

    /// The value `root` makes, on every rank of this communicator, through the job's rendezvous
    /// store: how a native library's bootstrap (NCCL's unique id) reaches its ranks. Every rank
    /// calls it once per `key`, which names the value within this communicator; only `root` calls
    /// `make`, the others wait (up to the timeout) for its value.
    pub fn share_via_store<E: From<CommError>>(
        &self,
        key: &str,
        root: usize,
        make: impl FnOnce() -> Result<Vec<u8>, E>,
    ) -> Result<Vec<u8>, E> {
        let key = format!("{}/shared/{key}", self.ns);
        if self.rank != root {
            return Ok(self.session.store.get(&key)?);
        }
        let value = make()?;
        self.session.store.set(&key, &value)?;
        Ok(value)
    }

    pub fn n_ranks(&self) -> usize {
        self.members.len()
    }

    /// The job rank of each rank of this communicator.
    pub fn job_ranks(&self) -> &[usize] {
        &self.members
    }

    /// The ranks' vendor domains, as the algorithms see them.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// The domain names, indexed by [`medley_collective::DomainId`].
    pub fn domain_names(&self) -> &[String] {
        &self.domain_names
    }

    pub fn all_reduce<T: Element>(&mut self, input: &[T], output: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        self.collective(Op::AllReduce { op }, &Counts::Same(input.len()), None, input, output)
    }

    /// `counts[r]` elements of the reduction end on rank r; `output` holds this rank's block.
    pub fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.collective(Op::ReduceScatter { op }, &Counts::PerRank(counts.to_vec()), None, input, output)
    }

    /// Rank r contributes `counts[r]` elements; `output` holds all of them in rank order.
    pub fn all_gather<T: Element>(&mut self, input: &[T], output: &mut [T], counts: &[usize]) -> Result<(), CommError> {
        self.collective(Op::AllGather, &Counts::PerRank(counts.to_vec()), None, input, output)
    }

    /// Every `output` ends with `root`'s `input` (other ranks' inputs are not read).
    pub fn broadcast<T: Element>(&mut self, input: &[T], output: &mut [T], root: usize) -> Result<(), CommError> {
        self.collective(Op::Broadcast { root }, &Counts::Same(input.len()), None, input, output)
    }

    /// `root`'s `output` ends with the reduction; other ranks' outputs are scratch.
    pub fn reduce<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CommError> {
        self.collective(Op::Reduce { op, root }, &Counts::Same(input.len()), None, input, output)
    }

    /// Rank i sends `counts[i][j]` elements to rank j: inputs hold the messages to each rank in
    /// rank order, outputs those from each rank.
    pub fn all_to_all<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        counts: &[Vec<usize>],
    ) -> Result<(), CommError> {
        self.collective(Op::AllToAll, &Counts::PerPair(counts.to_vec()), None, input, output)
    }

    pub fn barrier(&mut self) -> Result<(), CommError> {
        self.collective::<u8>(Op::Barrier, &Counts::Same(0), None, &[], &mut [])
    }

    /// Whether the ranks share windows (one host, one domain, shared memory between every pair),
    /// which [`Algorithm::Direct`] needs.
    pub fn shares_windows(&self) -> bool {
        self.windows.is_some()
    }

    /// How a collective of `op` over `counts` runs: `algorithm` if given, else the default one
    /// for the group, its size and whether the ranks share windows, chunked as
    /// [`choose_call`] says for [`Config::chunk_bytes`].
    pub fn choice(&self, op: Op, counts: &Counts, algorithm: Option<Algorithm>, dtype: DType) -> Choice {
        let (elem_bytes, windows) = (dtype.size_bytes(), self.windows.is_some());
        choose_call(op, &self.group, counts, algorithm, elem_bytes, windows, self.config.chunk_bytes)
    }

    /// Runs `op` with `algorithm` (or the default of [`Communicator::choice`]). `output` is either
    /// the whole working buffer of the plan or just this rank's result.
    pub fn collective<T: Element>(
        &mut self,
        op: Op,
        counts: &Counts,
        algorithm: Option<Algorithm>,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        self.session.abort.check()?;
        let size = size_of::<T>();
        if let Some(algorithm) = algorithm.filter(|algorithm| algorithm.needs_windows() && self.windows.is_none()) {
            return Err(CommError::NeedsWindows { algorithm });
        }
        let choice = self.choice(op, counts, algorithm, T::DTYPE);
        let cached = self.plan(PlanKey { op, counts: counts.clone(), choice, dtype: T::DTYPE })?;
        let plan = &cached.steps;
        if input.len() != plan.input_len {
            return Err(CommError::BufferLength { what: "input", expected: plan.input_len, got: input.len() });
        }
        let direct = output.len() == plan.output_len;
        if !direct && output.len() != plan.result.len() {
            return Err(CommError::BufferLength { what: "output", expected: plan.result.len(), got: output.len() });
        }
        let call = Call { plan, dtype: T::DTYPE, fingerprint: cached.fingerprint, seq: self.n_collectives };
        self.n_collectives += 1;
        let input = bytemuck::cast_slice(input);
        let result = if direct {
            execute(
                &mut self.links,
                self.windows.as_ref(),
                &self.waiter,
                &call,
                input,
                bytemuck::cast_slice_mut(output),
                &mut self.exec_scratch,
            )
        } else {
            let bytes = plan.output_len * size;
            self.scratch.resize(bytes.div_ceil(8), 0);
            let scratch = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.scratch)[..bytes];
            let done = execute(
                &mut self.links,
                self.windows.as_ref(),
                &self.waiter,
                &call,
                input,
                scratch,
                &mut self.exec_scratch,
            );
            let result = plan.result.start * size..plan.result.end * size;
            bytemuck::cast_slice_mut::<T, u8>(output).copy_from_slice(&scratch[result]);
            done
        };
        result.map_err(|err| self.fail(err))?;
        self.bytes_sent += (cached.sent_elements * size) as u64;
        Ok(())
    }

    /// Payload bytes this rank has sent as messages so far (a collective's window reads are not
    /// messages and do not count).
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// Reports a failure to the job, then closes the links so no send reads the caller's buffers.
    fn fail(&mut self, err: CommError) -> CommError {
        let err = self.session.fail(err);
        self.links.close();
        err
    }

    /// This rank's steps and the call's fingerprint, planned once per key.
    fn plan(&mut self, key: PlanKey) -> Result<Arc<CachedPlan>, CommError> {
        if let Some(at) = self.plans.iter().position(|(cached, _)| *cached == key) {
            let entry = self.plans.remove(at);
            self.plans.push(entry);
        } else {
            let Choice { algorithm, chunking } = key.choice;
            let mut plans = plan_steps(key.op, &self.group, &key.counts, algorithm, chunking)?;
            let PlanKey { op, counts, dtype, .. } = &key;
            let description = format!("{op:?}|{dtype:?}|{counts:?}|{algorithm:?}|{chunking:?}");
            let steps = plans.swap_remove(self.rank);
            let sent_elements =
                steps.steps.iter().map(|step| if let Step::Send { range, .. } = step { range.len() } else { 0 }).sum();
            let plan = CachedPlan { steps, fingerprint: fingerprint(&description), sent_elements };
            if self.plans.len() == PLAN_CACHE {
                self.plans.remove(0);
            }
            self.plans.push((key, Arc::new(plan)));
        }
        Ok(Arc::clone(&self.plans.last().expect("just pushed").1))
    }

    fn p2p_header<T: Element>(&self, len: usize, seq: u64) -> FrameHeader {
        FrameHeader {
            fingerprint: fingerprint(&format!("p2p|{:?}|{len}", T::DTYPE)),
            seq,
            len: (len * size_of::<T>()) as u64,
        }
    }

    fn check_peer(&self, peer: usize) -> Result<(), CommError> {
        if peer >= self.n_ranks() || peer == self.rank {
            return Err(CommError::NoSuchRank { peer, n_ranks: self.n_ranks() });
        }
        self.session.abort.check()
    }

    /// Sends `data` to `peer` and returns once it no longer needs `data` (over shared memory, once
    /// the peer has received it: pair every send with the peer's receive).
    pub fn send<T: Element>(&mut self, data: &[T], peer: usize) -> Result<(), CommError> {
        self.check_peer(peer)?;
        let header = self.p2p_header::<T>(data.len(), self.n_sent[peer]);
        self.n_sent[peer] += 1;
        let bytes: &[u8] = bytemuck::cast_slice(data);
        self.bytes_sent += bytes.len() as u64;
        let link = self.links.to(peer);
        // SAFETY: `data` is borrowed until this function returns, after `wait_sent` (or `close`).
        let sent = unsafe { link.send(peer, header, bytes.as_ptr(), bytes.len(), &self.waiter) }
            .and_then(|ticket| link.wait_sent(peer, ticket, &self.waiter));
        sent.map_err(|err| self.fail(err))
    }

    /// Starts sending `data` to `peer` and returns without waiting for the peer to receive it:
    /// pipeline neighbours send to each other at the same time, and a blocking send would
    /// deadlock them. The communicator keeps `data` until [`Communicator::wait_sends`].
    pub fn isend<T: Element + 'static>(&mut self, data: Vec<T>, peer: usize) -> Result<(), CommError> {
        self.check_peer(peer)?;
        let header = self.p2p_header::<T>(data.len(), self.n_sent[peer]);
        self.n_sent[peer] += 1;
        let bytes: &[u8] = bytemuck::cast_slice(&data);
        let (ptr, len) = (bytes.as_ptr(), bytes.len());
        self.bytes_sent += len as u64;
        // SAFETY: the heap buffer behind `ptr` moves into `outbox` unchanged and is freed only after
        // `wait_sent` for this ticket or later; a communicator dropped before that leaks it.
        let ticket = unsafe { self.links.to(peer).send(peer, header, ptr, len, &self.waiter) };
        let ticket = ticket.map_err(|err| self.fail(err))?;
        self.outbox.push(PendingSend { peer, ticket, _buffer: Box::new(data) });
        Ok(())
    }

    /// Waits until every [`Communicator::isend`] so far has been delivered, and frees the buffers.
    pub fn wait_sends(&mut self) -> Result<(), CommError> {
        while let Some(pending) = self.outbox.last() {
            let (peer, ticket) = (pending.peer, pending.ticket);
            // The last ticket to a peer covers the earlier ones to it.
            self.links.to(peer).wait_sent(peer, ticket, &self.waiter).map_err(|err| self.fail(err))?;
            self.outbox.retain(|pending| pending.peer != peer);
        }
        Ok(())
    }

    /// Receives the next message from `peer`, which must hold exactly `data.len()` elements.
    pub fn recv<T: Element>(&mut self, data: &mut [T], peer: usize) -> Result<(), CommError> {
        self.check_peer(peer)?;
        let header = self.p2p_header::<T>(data.len(), self.n_received[peer]);
        self.n_received[peer] += 1;
        let sink = Sink::Copy(bytemuck::cast_slice_mut(data));
        let received = self.links.to(peer).recv(peer, header, sink, &self.waiter);
        received.map_err(|err| self.fail(err))
    }

    /// Tells the whole job that this rank is failing for a reason of its own (not a peer's), so
    /// every other rank's pending and next operation fails at once naming it instead of
    /// waiting out the timeout. This communicator is unusable afterwards.
    pub fn abort(&mut self, reason: &str) {
        let rank = self.session.env.rank;
        self.session.abort.raise(CommError::Aborted { rank, reason: reason.to_string() });
        self.session.store.report_failure(rank, reason).ok();
        self.links.close();
    }

    /// Splits the ranks into new communicators, like `MPI_Comm_split`/`ncclCommSplit`: ranks that
    /// pass the same `color` form one, ordered by `key` and then by rank here; `None` takes part
    /// in the split but joins none. Every rank must call it.
    pub fn split(&mut self, color: Option<u32>, key: i64) -> Result<Option<Communicator>, CommError> {
        const NO_COLOR: i64 = -1;
        let n = self.n_ranks();
        let mine = [color.map_or(NO_COLOR, i64::from), key];
        let mut all = vec![0i64; 2 * n];
        self.all_gather(&mine, &mut all, &vec![2; n])?;
        self.n_splits += 1;
        let Some(color) = color else { return Ok(None) };
        let mut ranks: Vec<usize> = (0..n).filter(|&r| all[2 * r] == i64::from(color)).collect();
        ranks.sort_by_key(|&r| (all[2 * r + 1], r));
        let rank = ranks.iter().position(|&r| r == self.rank).expect("this rank has its color");
        let members = ranks.iter().map(|&r| self.members[r]).collect();
        let ns = format!("{}/split{}/color{color}", self.ns, self.n_splits);
        let budget = JoinBudget::from_now(self.config.timeout);
        Communicator::connect(Arc::clone(&self.session), ns, members, rank, self.listen_ip, self.config.clone(), budget)
            .map(Some)
    }
}

impl Drop for Communicator {
    /// Sends still pending here (after a failure) may yet be read by a peer through shared
    /// memory, which closing the links does not revoke: their buffers are leaked, not freed for
    /// reuse under the peer's read.
    fn drop(&mut self) {
        std::mem::take(&mut self.outbox).into_iter().for_each(std::mem::forget);
    }
}

/// A communicator can move to the thread that uses it.
const _: fn() = || {
    fn movable<T: Send>() {}
    movable::<Communicator>();
};
