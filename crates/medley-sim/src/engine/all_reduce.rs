//! Gradient all-reduces: members join, the collective is lowered to its algorithm's steps once
//! all have, and each member walks its steps as transfers.
//!
//! Without overlap a group's all-reduce is one collective that its members' programs walk,
//! blocking. With the plan's `overlap_grad_reduce`, the pass just before a group's all-reduce
//! starts it: the group's gradients are cut into buckets as Megatron-LM's DDP cuts them, bucket
//! b of B of a pass of length d is ready (b + 1)·d/B into it, and each bucket is a collective of its own
//! that the members' transfers walk while their programs go on; the optimizer step waits for
//! the rank's buckets.

use std::rc::Rc;

use super::*;

/// One collective of this step: a group's whole all-reduce, or one bucket of it.
pub(super) struct CollectiveState {
    pub(super) members: Vec<usize>,
    joined_ns: Vec<Option<u64>>,
    /// Lowered when every member has joined; a group's buckets share one lowering.
    steps: Option<Rc<Vec<RankSteps>>>,
    cursors: Vec<usize>,
    sent: FxHashMap<(u32, u32), u32>,
    received: FxHashMap<(u32, u32), u32>,
    bytes: f64,
}

/// Each DP group's collectives: its buckets when reduction overlaps backward, else one.
pub(super) fn collectives(setup: &crate::setup::Setup, overlapped: bool) -> Vec<Vec<CollectiveState>> {
    let element_bytes = setup.plan.grad_reduce().bytes();
    setup
        .dp_members
        .iter()
        .zip(&setup.dp_bytes)
        .map(|(members, &bytes)| {
            let n_buckets = match overlapped {
                true => medley_cost::comm::gradient_buckets(bytes / element_bytes, members.len()),
                false => 1,
            };
            (0..n_buckets)
                .map(|_| CollectiveState {
                    members: members.clone(),
                    joined_ns: vec![None; members.len()],
                    steps: None,
                    cursors: vec![0; members.len()],
                    sent: FxHashMap::default(),
                    received: FxHashMap::default(),
                    bytes: bytes / f64::from(n_buckets),
                })
                .collect()
        })
        .collect()
}

impl StepRun<'_, '_, '_> {
    /// Runs `rank`'s part of DP group `group`'s blocking all-reduce as far as it can.
    pub(super) fn all_reduce(&mut self, rank: usize, group: u32) -> Result<Progress, SimError> {
        let member = self.member(rank, group)?;
        let group_idx = group as usize;
        let collective = &mut self.collectives[group_idx][0];
        if collective.members.len() < 2 {
            return Ok(Progress::Done);
        }
        if collective.steps.is_none() {
            collective.joined_ns[member].get_or_insert(self.sim.now_ns);
            if collective.joined_ns.iter().any(Option::is_none) {
                self.block(rank, Wait::CollectiveStart(group));
                return Ok(Progress::Blocked);
            }
            self.lower(group, 0)?;
            let members = self.collectives[group_idx][0].members.clone();
            for member in members {
                if matches!(self.ranks[member].blocked, Some((_, Wait::CollectiveStart(_)))) {
                    self.push(self.now(), Event::Resume(member));
                }
            }
        }
        if let Err(key) = self.walk(group, 0, member) {
            self.waiting.insert(key, rank);
            self.block(rank, Wait::Message(key));
            return Ok(Progress::Blocked);
        }
        let joined_ns = self.collectives[group_idx][0].joined_ns[member].expect("joined");
        self.collective_slice(group, 0, member, joined_ns);
        Ok(Progress::Done)
    }

    /// Starts `rank`'s buckets of group `group`'s overlapped reduction over a pass of `pass_ns`
    /// starting now: each joins its collective when the pass has produced it.
    pub(super) fn launch_reduction(&mut self, rank: usize, group: u32, pass_ns: u64) -> Result<(), SimError> {
        self.member(rank, group)?;
        if !self.launched.insert((rank, group)) {
            return Ok(());
        }
        let buckets = &self.collectives[group as usize];
        if buckets[0].members.len() < 2 {
            return Ok(());
        }
        let n_buckets = buckets.len() as u32;
        self.ranks[rank].open_reductions += n_buckets;
        let now = self.now();
        for bucket in 0..n_buckets {
            let ready_ns = now + pass_ns * u64::from(bucket + 1) / u64::from(n_buckets);
            self.push(ready_ns, Event::JoinBucket { group, bucket, rank });
        }
        Ok(())
    }

    /// A bucket of `rank`'s is ready: it joins, and once every member has, all walk it.
    pub(super) fn join_bucket(&mut self, group: u32, bucket: u32, rank: usize) -> Result<(), SimError> {
        let member = self.member(rank, group)?;
        let now = self.now();
        let collective = &mut self.collectives[group as usize][bucket as usize];
        collective.joined_ns[member] = Some(now);
        if collective.joined_ns.iter().any(Option::is_none) {
            return Ok(());
        }
        self.lower(group, bucket)?;
        for member in 0..self.collectives[group as usize][bucket as usize].members.len() {
            self.advance_bucket(group, bucket, member);
        }
        Ok(())
    }

    /// Walks a member's part of an overlapped bucket until it waits on a message or is done.
    pub(super) fn advance_bucket(&mut self, group: u32, bucket: u32, member: usize) {
        if let Err(key) = self.walk(group, bucket, member) {
            self.bucket_waits.insert(key, (group, bucket, member));
            return;
        }
        let collective = &self.collectives[group as usize][bucket as usize];
        let (rank, joined_ns) = (collective.members[member], collective.joined_ns[member].expect("joined"));
        self.collective_slice(group, bucket, member, joined_ns);
        let state = &mut self.ranks[rank];
        state.open_reductions -= 1;
        if state.open_reductions == 0 && matches!(state.blocked, Some((_, Wait::Reductions))) {
            self.push(self.now(), Event::Resume(rank));
        }
    }

    fn member(&self, rank: usize, group: u32) -> Result<usize, SimError> {
        let name = || self.sim.setup.ranks[rank].id.to_string();
        let buckets =
            self.collectives.get(group as usize).ok_or_else(|| SimError::UnknownGroup { rank: name(), group })?;
        buckets[0].members.iter().position(|&m| m == rank).ok_or_else(|| SimError::NotAMember { rank: name(), group })
    }

    /// Takes a member's steps of a lowered collective as far as its messages have arrived;
    /// `Err` names the message it waits for.
    fn walk(&mut self, group: u32, bucket: u32, member: usize) -> Result<(), MessageKey> {
        let group_idx = group as usize;
        loop {
            let collective = &mut self.collectives[group_idx][bucket as usize];
            let steps = collective.steps.as_ref().expect("lowered");
            let Some(step) = steps[member].steps.get(collective.cursors[member]).cloned() else { return Ok(()) };
            match step {
                Step::Send { to, range, .. } => {
                    let seq = next_seq(&mut collective.sent, member, to);
                    let key = MessageKey::Collective { group, bucket, from: member as u32, to: to as u32, seq };
                    let (from_rank, to_rank) = (collective.members[member], collective.members[to]);
                    let route = self.sim.setup.plan.dp_groups()[group_idx].route;
                    let grad_bytes = self.sim.setup.plan.grad_reduce().bytes();
                    self.send(from_rank, to_rank, key, range.len() as f64 * grad_bytes, route);
                }
                Step::Recv { from, .. } => {
                    let seq = *collective.received.get(&(from as u32, member as u32)).unwrap_or(&0);
                    let key = MessageKey::Collective { group, bucket, from: from as u32, to: member as u32, seq };
                    if !self.mailbox.remove(&key) {
                        return Err(key);
                    }
                    self.issued_ns.remove(&key);
                    next_seq(&mut self.collectives[group_idx][bucket as usize].received, from, member);
                }
                // Local memory passes run at HBM speed, far beneath the transfers they sit between.
                Step::Copy { .. } | Step::DivideBy { .. } => {}
                // `as_messages` has turned every window step into the transfers above.
                Step::Publish { .. } | Step::Fence | Step::ReduceWindows { .. } | Step::Gather { .. } => {}
            }
            self.collectives[group_idx][bucket as usize].cursors[member] += 1;
        }
    }

    /// The collective's slice on the member's collective track, from when it joined (or the
    /// track's previous slice ended: overlapped buckets run side by side) until now.
    fn collective_slice(&mut self, group: u32, bucket: u32, member: usize, joined_ns: u64) {
        let collective = &self.collectives[group as usize][bucket as usize];
        let (rank, n_members, bytes) = (collective.members[member], collective.members.len(), collective.bytes);
        let start_ns = joined_ns.max(self.ranks[rank].collective_track_end_ns);
        if self.sim.timeline.is_none() || start_ns >= self.now() {
            return;
        }
        self.ranks[rank].collective_track_end_ns = self.now();
        let name = match self.collectives[group as usize].len() {
            1 => format!("all-reduce dp{group}"),
            _ => format!("all-reduce dp{group} bucket {bucket}"),
        };
        let args = CollectiveArgs { bytes, members: n_members };
        self.timeline_slice(rank, COLLECTIVE_TID, &name, "collective", (start_ns, self.now()), &args);
    }

    /// Lowers a collective to its algorithm's steps once every member has joined. Chunked as
    /// the communicator chunks the group's whole all-reduce, so that both engines run the same
    /// step lists, and a bucket's chunks are the whole's that fall in it (equal buckets lower
    /// alike: the first lowering serves them all).
    fn lower(&mut self, group: u32, bucket: u32) -> Result<(), SimError> {
        let buckets = &self.collectives[group as usize];
        if let Some(steps) = buckets.iter().find_map(|collective| collective.steps.clone()) {
            self.collectives[group as usize][bucket as usize].steps = Some(steps);
            return Ok(());
        }
        let setup = &self.sim.setup;
        let dp_group = &setup.plan.dp_groups()[group as usize];
        let collective = &buckets[bucket as usize];
        let domains = collective.members.iter().map(|&m| DomainId(setup.ranks[m].vendor as u32)).collect();
        let domains = Group::new(domains)?;
        let op = Op::AllReduce { op: ReduceOp::Sum };
        let grad_bytes = setup.plan.grad_reduce().bytes();
        let whole = Counts::Same((setup.dp_bytes[group as usize] / grad_bytes).round() as usize);
        let Choice { algorithm, chunking } = collective::choose_call(
            op,
            &domains,
            &whole,
            Some(dp_group.algorithm.into()),
            grad_bytes as usize,
            false,
            collective::CHUNK_BYTES,
        );
        let counts = Counts::Same((collective.bytes / grad_bytes).round() as usize);
        let plans = collective::plan_steps(op, &domains, &counts, algorithm, chunking)?;
        // Reads of a peer's window are transfers from that peer.
        let steps = Rc::new(collective::as_messages(&plans)?);
        self.collectives[group as usize][bucket as usize].steps = Some(steps);
        Ok(())
    }
}

fn next_seq(counters: &mut FxHashMap<(u32, u32), u32>, from: usize, to: usize) -> u32 {
    let counter = counters.entry((from as u32, to as u32)).or_insert(0);
    *counter += 1;
    *counter - 1
}
