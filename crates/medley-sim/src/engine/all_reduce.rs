//! Gradient all-reduces: members join, the collective is lowered to its algorithm's steps once
//! all have, and each member walks its steps as transfers.

use super::*;

impl StepRun<'_, '_, '_> {
    /// Runs `rank`'s part of DP group `group`'s all-reduce as far as it can.
    pub(super) fn all_reduce(&mut self, rank: usize, group: u32) -> Result<Progress, SimError> {
        let group_idx = group as usize;
        let Some(collective) = self.collectives.get_mut(group_idx) else {
            return Err(SimError::UnknownGroup { rank: self.sim.setup.ranks[rank].id.to_string(), group });
        };
        let n_members = collective.members.len();
        let member = collective
            .members
            .iter()
            .position(|&m| m == rank)
            .ok_or_else(|| SimError::NotAMember { rank: self.sim.setup.ranks[rank].id.to_string(), group })?;
        if n_members < 2 {
            return Ok(Progress::Done);
        }
        if collective.steps.is_none() {
            collective.joined_ns[member].get_or_insert(self.sim.now_ns);
            if collective.joined_ns.iter().any(Option::is_none) {
                self.block(rank, Wait::CollectiveStart(group));
                return Ok(Progress::Blocked);
            }
            self.start_all_reduce(group_idx)?;
        }
        loop {
            let collective = &mut self.collectives[group_idx];
            let steps = collective.steps.as_ref().expect("started");
            let Some(step) = steps[member].steps.get(collective.cursors[member]).cloned() else { break };
            match step {
                Step::Send { to, range, .. } => {
                    let seq = next_seq(&mut collective.sent, member, to);
                    let key = MessageKey::Collective { group, from: member as u32, to: to as u32, seq };
                    let to_rank = collective.members[to];
                    let route = self.sim.setup.plan.dp_groups()[group_idx].route;
                    self.send(rank, to_rank, key, range.len() as f64 * ELEMENT_BYTES, route);
                }
                Step::Recv { from, .. } => {
                    let seq = *collective.received.get(&(from as u32, member as u32)).unwrap_or(&0);
                    let key = MessageKey::Collective { group, from: from as u32, to: member as u32, seq };
                    if !self.take(rank, key) {
                        return Ok(Progress::Blocked);
                    }
                    next_seq(&mut self.collectives[group_idx].received, from, member);
                }
                // Local memory passes run at HBM speed, far beneath the transfers they sit between.
                Step::Copy { .. } | Step::DivideBy { .. } => {}
                // `as_messages` has turned every window step into the transfers above.
                Step::Publish { .. } | Step::Fence | Step::ReduceWindows { .. } | Step::Gather { .. } => {}
            }
            self.collectives[group_idx].cursors[member] += 1;
        }
        let joined_ns = self.collectives[group_idx].joined_ns[member].expect("joined");
        if self.sim.timeline.is_some() {
            let name = format!("all-reduce dp{group}");
            let args = json!({"bytes": self.sim.setup.dp_bytes[group_idx], "members": n_members});
            self.timeline_slice(rank, COLLECTIVE_TID, &name, "collective", (joined_ns, self.now()), args);
        }
        Ok(Progress::Done)
    }

    /// Lowers the all-reduce to its algorithm's steps once every member has joined, and wakes
    /// the members waiting for that.
    pub(super) fn start_all_reduce(&mut self, group_idx: usize) -> Result<(), SimError> {
        let setup = &self.sim.setup;
        let dp_group = &setup.plan.dp_groups()[group_idx];
        let collective = &mut self.collectives[group_idx];
        let domains = collective.members.iter().map(|&m| DomainId(setup.ranks[m].vendor as u32)).collect();
        let group = Group::new(domains)?;
        let algorithm = dp_group.algorithm.into();
        let n_elements = (setup.dp_bytes[group_idx] / ELEMENT_BYTES).round() as usize;
        let op = Op::AllReduce { op: ReduceOp::Sum };
        let counts = Counts::Same(n_elements);
        // Chunked as the communicator chunks it, so that both engines run the same step lists.
        let elem_bytes = ELEMENT_BYTES as usize;
        let Choice { algorithm, chunking } =
            collective::choose_call(op, &group, &counts, Some(algorithm), elem_bytes, false, collective::CHUNK_BYTES);
        let plans = collective::plan_steps(op, &group, &counts, algorithm, chunking)?;
        // Reads of a peer's window are transfers from that peer.
        collective.steps = Some(collective::as_messages(&plans)?);
        let members = collective.members.clone();
        for member in members {
            if matches!(self.ranks[member].blocked, Some((_, Wait::CollectiveStart(_)))) {
                self.push(self.now(), Event::Resume(member));
            }
        }
        Ok(())
    }
}

fn next_seq(counters: &mut HashMap<(u32, u32), u32>, from: usize, to: usize) -> u32 {
    let counter = counters.entry((from as u32, to as u32)).or_insert(0);
    *counter += 1;
    *counter - 1
}
