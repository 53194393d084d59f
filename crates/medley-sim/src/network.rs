//! Flows over shared resources with max-min fair bandwidth sharing.
//!
//! A resource is one direction of a port (a node's NIC port egress, a GPU's intra-node ingress, a
//! link between two node groups, ...) with a capacity that a bandwidth trace may scale. A flow
//! crosses a path of resources and may have its own rate cap (one NIC port, the bridge's
//! bandwidth, an Infinity Fabric peer link). A flow is a bundle of equal lanes (the GPUs of a
//! tensor-parallel group each sending their part): its rate is one lane's, and it takes as many
//! shares of each resource as it has lanes there, so that max-min fairness holds lane by lane. Whenever a flow starts or
//! ends, or a capacity changes, the flows of the affected connected component get new max-min
//! fair rates by progressive filling (Bertsekas & Gallager, "Data Networks", §6.5.2); each
//! re-rated flow gets a new version, so drain events computed from its old rate are recognised as
//! stale. Versions come from one counter for the whole network: a slot reused by a later flow
//! never shares a version with its earlier occupant's pending drain events. Rates are bytes per nanosecond (numerically GB/s).

pub(crate) type ResourceId = usize;
pub(crate) type FlowId = usize;

use smallvec::SmallVec;

struct Resource {
    capacity: f64,
    fraction: f64,
    /// The flows on it and their lanes here.
    flows: Vec<(FlowId, f64)>,
}

/// One resource on a flow's path and how many of the flow's lanes cross it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Hop {
    pub resource: ResourceId,
    pub lanes: f64,
}

impl Hop {
    pub(crate) fn one_lane(resource: ResourceId) -> Self {
        Hop { resource, lanes: 1.0 }
    }
}

/// The resources a flow crosses: a sender's port, a group link, a receiver's port, so that most
/// fit without a heap allocation per transfer.
pub(crate) type Path = SmallVec<[Hop; 3]>;

struct Flow<P> {
    path: Path,
    cap: f64,
    remaining: f64,
    rate: f64,
    updated_ns: u64,
    version: u64,
    payload: P,
}

/// A flow whose drain time changed: schedule `Drained { flow, version }` at `at_ns`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DrainAt {
    pub flow: FlowId,
    pub version: u64,
    pub at_ns: u64,
}

/// What one re-rating works on, kept between re-ratings so that a transfer allocates nothing.
#[derive(Default)]
struct Scratch {
    /// The component's flows and resources, sorted.
    flows: Vec<FlowId>,
    resources: Vec<ResourceId>,
    frontier: Vec<ResourceId>,
    rates: Vec<f64>,
    frozen: Vec<bool>,
    left: Vec<f64>,
    saturated: Vec<bool>,
    /// `flow_slot[f]`: flow f's place in `flows`; `resource_slot[r]`: resource r's in `resources`.
    flow_slot: Vec<usize>,
    resource_slot: Vec<usize>,
}

pub(crate) struct Network<P> {
    resources: Vec<Resource>,
    flows: Vec<Option<Flow<P>>>,
    free_slots: Vec<FlowId>,
    last_version: u64,
    /// The search for a component marks what it has reached with its own number, so that it
    /// needs no set of its own: `resource_marks[r]`, `flow_marks[f]`.
    search: u64,
    resource_marks: Vec<u64>,
    flow_marks: Vec<u64>,
    scratch: Scratch,
}

impl<P> Network<P> {
    pub(crate) fn new() -> Self {
        Network {
            resources: Vec::new(),
            flows: Vec::new(),
            free_slots: Vec::new(),
            last_version: 0,
            search: 0,
            resource_marks: Vec::new(),
            flow_marks: Vec::new(),
            scratch: Scratch::default(),
        }
    }

    /// A resource of `capacity` bytes per ns at full bandwidth.
    pub(crate) fn add_resource(&mut self, capacity: f64) -> ResourceId {
        self.resources.push(Resource { capacity, fraction: 1.0, flows: Vec::new() });
        self.resources.len() - 1
    }

    /// Starts a flow of `bytes` a lane over `path`, each lane at most `cap` bytes per ns.
    pub(crate) fn start(
        &mut self,
        now_ns: u64,
        path: Path,
        cap: f64,
        bytes: f64,
        payload: P,
        drains: &mut Vec<DrainAt>,
    ) -> FlowId {
        let version = self.next_version();
        let id = self.free_slots.pop().unwrap_or_else(|| {
            self.flows.push(None);
            self.flows.len() - 1
        });
        for hop in &path {
            self.resources[hop.resource].flows.push((id, hop.lanes));
        }
        let seeds: SmallVec<[ResourceId; 3]> = path.iter().map(|hop| hop.resource).collect();
        let unshared = path.is_empty();
        self.flows[id] = Some(Flow { path, cap, remaining: bytes, rate: 0.0, updated_ns: now_ns, version, payload });
        self.rerate(now_ns, &seeds, drains);
        if unshared {
            // Nothing to share: the flow drains at once.
            drains.push(DrainAt { flow: id, version, at_ns: now_ns });
        }
        id
    }

    fn next_version(&mut self) -> u64 {
        self.last_version += 1;
        self.last_version
    }

    /// Flows still on the wire.
    pub(crate) fn n_flows(&self) -> usize {
        self.flows.len() - self.free_slots.len()
    }

    /// Whether `version` is still `flow`'s current one.
    pub(crate) fn is_current(&self, flow: FlowId, version: u64) -> bool {
        self.flows.get(flow).and_then(Option::as_ref).is_some_and(|f| f.version == version)
    }

    /// Removes a drained flow and re-rates its neighbours; returns its payload.
    pub(crate) fn finish(&mut self, now_ns: u64, id: FlowId, drains: &mut Vec<DrainAt>) -> P {
        let flow = self.flows[id].take().expect("a drained flow is live");
        self.free_slots.push(id);
        for hop in &flow.path {
            self.resources[hop.resource].flows.retain(|&(f, _)| f != id);
        }
        let seeds: SmallVec<[ResourceId; 3]> = flow.path.iter().map(|hop| hop.resource).collect();
        self.rerate(now_ns, &seeds, drains);
        flow.payload
    }

    /// Sets the available fraction of `resource`'s capacity and re-rates the flows it carries.
    pub(crate) fn set_fraction(&mut self, now_ns: u64, resource: ResourceId, fraction: f64, drains: &mut Vec<DrainAt>) {
        self.resources[resource].fraction = fraction;
        self.rerate(now_ns, &[resource], drains);
    }

    fn flow(&self, id: FlowId) -> &Flow<P> {
        self.flows[id].as_ref().expect("live flow")
    }

    fn flow_mut(&mut self, id: FlowId) -> &mut Flow<P> {
        self.flows[id].as_mut().expect("live flow")
    }

    /// New max-min fair rates for every flow connected to `seeds`, progress booked at the old
    /// rates first.
    fn rerate(&mut self, now_ns: u64, seeds: &[ResourceId], drains: &mut Vec<DrainAt>) {
        self.find_component(seeds);
        let mut scratch = std::mem::take(&mut self.scratch);
        if !scratch.flows.is_empty() {
            for &id in &scratch.flows {
                let flow = self.flow_mut(id);
                flow.remaining = (flow.remaining - flow.rate * (now_ns - flow.updated_ns) as f64).max(0.0);
                flow.updated_ns = now_ns;
            }
            self.max_min_rates(&mut scratch);
            for (&id, &rate) in scratch.flows.iter().zip(&scratch.rates) {
                let version = self.next_version();
                let flow = self.flow_mut(id);
                flow.rate = rate;
                flow.version = version;
                if rate > 0.0 || flow.remaining == 0.0 {
                    let wait_ns = if flow.remaining == 0.0 { 0 } else { (flow.remaining / rate).ceil() as u64 };
                    drains.push(DrainAt { flow: id, version: flow.version, at_ns: now_ns.saturating_add(wait_ns) });
                }
            }
        }
        self.scratch = scratch;
    }

    /// Puts in `scratch.flows` and `scratch.resources` the flows and resources reachable from
    /// `seeds` through shared resources, sorted, and numbers their places.
    fn find_component(&mut self, seeds: &[ResourceId]) {
        self.search += 1;
        let search = self.search;
        self.resource_marks.resize(self.resources.len(), 0);
        self.flow_marks.resize(self.flows.len(), 0);
        let Scratch { flows, resources, frontier, flow_slot, resource_slot, .. } = &mut self.scratch;
        flows.clear();
        resources.clear();
        frontier.clear();
        frontier.extend_from_slice(seeds);
        while let Some(resource) = frontier.pop() {
            if self.resource_marks[resource] == search {
                continue;
            }
            self.resource_marks[resource] = search;
            resources.push(resource);
            for &(id, _) in &self.resources[resource].flows {
                if self.flow_marks[id] != search {
                    self.flow_marks[id] = search;
                    flows.push(id);
                    let path = &self.flows[id].as_ref().expect("live flow").path;
                    frontier.extend(path.iter().map(|hop| hop.resource).filter(|&r| self.resource_marks[r] != search));
                }
            }
        }
        flows.sort_unstable();
        resources.sort_unstable();
        flow_slot.resize(self.flows.len(), 0);
        resource_slot.resize(self.resources.len(), 0);
        for (slot, &id) in flows.iter().enumerate() {
            flow_slot[id] = slot;
        }
        for (slot, &r) in resources.iter().enumerate() {
            resource_slot[r] = slot;
        }
    }

    /// Progressive filling over the component in `scratch`, into `scratch.rates`: raise every
    /// unfrozen flow's lane rate together until a resource is full or a flow reaches its cap,
    /// freeze those flows, repeat.
    fn max_min_rates(&self, scratch: &mut Scratch) {
        let Scratch { flows, resources, rates, frozen, left, saturated, flow_slot, resource_slot, .. } = scratch;
        rates.clear();
        rates.resize(flows.len(), 0.0);
        frozen.clear();
        frozen.resize(flows.len(), false);
        left.clear();
        left.extend(resources.iter().map(|&r| self.resources[r].capacity * self.resources[r].fraction));
        let active_on = |r: ResourceId, frozen: &[bool]| -> f64 {
            self.resources[r].flows.iter().filter(|&&(id, _)| !frozen[flow_slot[id]]).map(|&(_, lanes)| lanes).sum()
        };
        loop {
            let mut level = f64::INFINITY;
            for (idx, &id) in flows.iter().enumerate() {
                if !frozen[idx] {
                    level = level.min(self.flow(id).cap - rates[idx]);
                }
            }
            for (slot, &r) in resources.iter().enumerate() {
                let active = active_on(r, frozen);
                if active > 0.0 {
                    level = level.min(left[slot] / active);
                }
            }
            // Every flow frozen, or none limited by anything (no resources, no cap).
            if level == f64::INFINITY {
                return;
            }
            let level = level.max(0.0);
            for (idx, rate) in rates.iter_mut().enumerate() {
                if !frozen[idx] {
                    *rate += level;
                }
            }
            for (slot, &r) in resources.iter().enumerate() {
                left[slot] -= level * active_on(r, frozen);
            }
            // Freeze flows at their cap or on a saturated resource.
            saturated.clear();
            saturated.extend(left.iter().map(|&l| l <= 1e-12));
            for (idx, &id) in flows.iter().enumerate() {
                if frozen[idx] {
                    continue;
                }
                let flow = self.flow(id);
                let on_full = flow.path.iter().any(|hop| saturated[resource_slot[hop.resource]]);
                if on_full || flow.cap - rates[idx] <= 1e-12 {
                    frozen[idx] = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_lane(resources: &[ResourceId]) -> Path {
        resources.iter().copied().map(Hop::one_lane).collect()
    }

    fn rates(network: &Network<()>) -> Vec<f64> {
        network.flows.iter().flatten().map(|f| f.rate).collect()
    }

    #[test]
    fn flows_share_a_bottleneck_fairly_and_take_what_is_left() {
        let mut network = Network::new();
        let mut drains = Vec::new();
        let (a, b, c) = (network.add_resource(10.0), network.add_resource(4.0), network.add_resource(10.0));
        // Two flows through b share its 4; the third, through a and c only, gets the rest of a.
        network.start(0, one_lane(&[a, b]), f64::INFINITY, 100.0, (), &mut drains);
        network.start(0, one_lane(&[b, c]), f64::INFINITY, 100.0, (), &mut drains);
        network.start(0, one_lane(&[a, c]), f64::INFINITY, 100.0, (), &mut drains);
        assert_eq!(rates(&network), [2.0, 2.0, 8.0]);
        // A cap below the fair share frees bandwidth for the others.
        network.start(0, one_lane(&[a]), 1.0, 100.0, (), &mut drains);
        assert_eq!(rates(&network), [2.0, 2.0, 7.0, 1.0]);
    }

    #[test]
    fn a_flow_of_several_lanes_takes_a_share_for_each() {
        let mut network = Network::new();
        let mut drains = Vec::new();
        let (nic, uplink) = (network.add_resource(6.0), network.add_resource(100.0));
        // Two lanes of one flow and one lane of another through the NIC: 2 bytes/ns a lane.
        let two_lanes = smallvec::smallvec![Hop { resource: nic, lanes: 2.0 }, Hop { resource: uplink, lanes: 2.0 }];
        network.start(0, two_lanes, f64::INFINITY, 100.0, (), &mut drains);
        network.start(0, one_lane(&[nic]), f64::INFINITY, 100.0, (), &mut drains);
        assert_eq!(rates(&network), [2.0, 2.0]);
    }

    /// The drain time of `flow` in `drains`, if it got a current one.
    fn drain_of(network: &Network<()>, drains: &[DrainAt], flow: FlowId) -> Option<u64> {
        drains.iter().rev().find(|d| d.flow == flow && network.is_current(flow, d.version)).map(|d| d.at_ns)
    }

    #[test]
    fn drain_times_follow_rate_changes() {
        let mut network = Network::new();
        let link = network.add_resource(2.0);
        let mut drains = Vec::new();
        let first = network.start(0, one_lane(&[link]), f64::INFINITY, 100.0, (), &mut drains);
        assert_eq!(drain_of(&network, &drains, first), Some(50));
        let stale = drains.clone();
        // At 10 ns a second flow halves the first's rate: 80 bytes left at 1 byte/ns.
        drains.clear();
        let second = network.start(10, one_lane(&[link]), f64::INFINITY, 10.0, (), &mut drains);
        assert!(stale.iter().all(|d| !network.is_current(d.flow, d.version)));
        assert_eq!(drain_of(&network, &drains, first), Some(90));
        assert_eq!(drain_of(&network, &drains, second), Some(20));
        // The link drops to a quarter for the rest: 70 bytes left on the first at 0.5 byte/ns.
        drains.clear();
        network.finish(20, second, &mut drains);
        network.set_fraction(20, link, 0.25, &mut drains);
        assert_eq!(drain_of(&network, &drains, first), Some(160));
        // A link at zero stalls its flows: no drain is scheduled until it comes back.
        drains.clear();
        network.set_fraction(30, link, 0.0, &mut drains);
        assert!(drains.is_empty());
        network.set_fraction(40, link, 1.0, &mut drains);
        assert_eq!(drain_of(&network, &drains, first), Some(40 + 33));
    }

    #[test]
    fn a_stale_drain_never_finishes_the_next_flow_in_its_slot() {
        let mut network = Network::new();
        let link = network.add_resource(2.0);
        let mut drains = Vec::new();
        let slow = network.start(0, one_lane(&[link]), f64::INFINITY, 100.0, (), &mut drains);
        let quick = network.start(0, one_lane(&[link]), f64::INFINITY, 10.0, (), &mut drains);
        // Both at 1 byte/ns: the slow flow's drain at 100 ns goes stale when the quick one ends.
        let stale: Vec<DrainAt> = drains.iter().copied().filter(|d| d.flow == slow).collect();
        drains.clear();
        network.finish(10, quick, &mut drains);
        network.finish(55, slow, &mut drains);
        // A new flow takes the slow one's slot; the stale drain must not be current for it.
        let next = network.start(60, one_lane(&[link]), f64::INFINITY, 1000.0, (), &mut drains);
        assert_eq!(next, slow, "the slot is reused");
        assert!(stale.iter().all(|d| !network.is_current(d.flow, d.version)), "{stale:?}");
        assert_eq!(drain_of(&network, &drains, next), Some(560));
    }
}
