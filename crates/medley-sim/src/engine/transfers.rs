//! Transfers: sends queue on their channel, one on the wire at a time; the network drains
//! them at its fair share of bandwidth; a delivered message wakes its receiver.

use super::*;

impl StepRun<'_, '_, '_> {
    pub(super) fn send_boundary(&mut self, from: usize, to: usize, key: MessageKey) {
        let (chunk, forward) = match key {
            MessageKey::Activation { chunk, .. } => (chunk, true),
            MessageKey::Gradient { chunk, .. } => (chunk, false),
            MessageKey::Collective { .. } => unreachable!("collective messages take their group's route"),
        };
        let route = self.sim.setup.boundary_route(self.sim.setup.ranks[from].id, chunk, forward);
        let bytes = self.sim.setup.ranks[from].boundary_bytes;
        self.send(from, to, key, bytes, route);
    }

    /// Issues a transfer; the sender moves on. Transfers between one pair of ranks go one at a
    /// time, in order, as operations on one NCCL channel do.
    pub(super) fn send(&mut self, from: usize, to: usize, key: MessageKey, bytes: f64, route: medley_plan::Route) {
        self.ranks[from].pending_sends += 1;
        self.issued_ns.insert(key, self.sim.now_ns);
        let send = QueuedSend { key, from, to, bytes, route };
        if let Some(send) = self.channels.offer(from, to, send) {
            self.start_transfer(send);
        }
    }

    pub(super) fn start_transfer(&mut self, send: QueuedSend) {
        let QueuedSend { key, from, to, bytes, route } = send;
        let (link, path) = self.sim.setup.path(from, to, route);
        let lane = self.take_lane(from);
        let now = self.now();
        let transfer = Transfer { key, from, to, lane, start_ns: now, latency_ns: ns(link.latency_us * 1e-6), bytes };
        self.sim.network.start(now, path, link.gb_s, bytes, transfer, &mut self.drains);
        self.schedule_drains();
    }

    pub(super) fn take_lane(&mut self, rank: usize) -> u32 {
        let lanes = &mut self.ranks[rank].lanes;
        let lane = lanes.iter().position(|busy| !busy).unwrap_or_else(|| {
            lanes.push(false);
            lanes.len() - 1
        });
        lanes[lane] = true;
        let lane = lane as u32;
        let named = &mut self.sim.named_lanes[rank];
        if lane >= *named {
            *named = lane + 1;
            if let Some(timeline) = self.sim.timeline.as_mut() {
                timeline.thread(rank as u32 + 1, lane_tid(lane), &format!("send {lane}"));
            }
        }
        lane
    }

    pub(super) fn drained(&mut self, flow: FlowId, version: u64) {
        if !self.sim.network.is_current(flow, version) {
            return;
        }
        let now = self.now();
        let transfer = self.sim.network.finish(now, flow, &mut self.drains);
        self.schedule_drains();
        let (from, to, latency_ns) = (transfer.from, transfer.to, transfer.latency_ns);
        let arrival = self.arriving.insert(transfer);
        self.push(now + latency_ns, Event::Deliver(arrival));
        if let Some(next) = self.channels.finished(from, to) {
            self.start_transfer(next);
        }
    }

    pub(super) fn deliver(&mut self, transfer: Transfer) {
        let now = self.now();
        if self.sim.timeline.is_some() {
            let name = self.transfer_label(&transfer);
            let args = TransferArgs { bytes: transfer.bytes };
            self.timeline_slice(
                transfer.from,
                lane_tid(transfer.lane),
                &name,
                "transfer",
                (transfer.start_ns, now),
                &args,
            );
            let from = (transfer.from as u32 + 1, lane_tid(transfer.lane));
            let to = (transfer.to as u32 + 1, COMPUTE_TID);
            self.sim.timeline.as_mut().expect("checked").arrow(&name, from, transfer.start_ns, to, now);
        }
        let sender = &mut self.ranks[transfer.from];
        sender.lanes[transfer.lane as usize] = false;
        sender.pending_sends -= 1;
        if sender.pending_sends == 0 && matches!(sender.blocked, Some((_, Wait::Sends))) {
            self.push(now, Event::Resume(transfer.from));
        }
        self.mailbox.insert(transfer.key);
        if let Some((group, bucket, member)) = self.bucket_waits.remove(&transfer.key) {
            self.advance_bucket(group, bucket, member);
        } else if let Some(receiver) = self.waiting.remove(&transfer.key) {
            self.push(now, Event::Resume(receiver));
        }
    }

    pub(super) fn bandwidth(&mut self, endpoint: usize) {
        let Some((at_ns, fraction)) = self.sim.trace_changes[endpoint] else { return };
        if at_ns > self.now() {
            return;
        }
        let now = self.now();
        let port = self.sim.setup.links.ports()[endpoint];
        for resource in port {
            self.sim.network.set_fraction(now, resource, fraction, &mut self.drains);
        }
        self.schedule_drains();
        let next = self.sim.trace_cursors[endpoint].next_change();
        self.sim.trace_changes[endpoint] = next;
        if let Some((next_ns, _)) = next {
            self.push(next_ns.max(now), Event::Bandwidth(endpoint));
        }
    }
}
