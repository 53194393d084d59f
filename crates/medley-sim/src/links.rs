//! The links a simulated transfer crosses and shares: each GPU's intra-node ports, the die link
//! out of each die of a multi-die package, each NIC port of each node, and each link the cluster
//! names between two node groups. Each is one resource a direction, shared max-min fairly by
//! every transfer through it at that moment.

use medley_spec::{Cluster, DeviceSlot};
use smallvec::smallvec;

use crate::network::{Hop, Network, Path, ResourceId};

/// Where a set of GPUs that send together (a rank's TP group, each GPU its own lane, or one GPU)
/// meets the links. Its first GPU's ports stand for all of its GPUs' ports, with as many lanes
/// as it has GPUs on that port: a TP group is aligned in its node, as ports are, so the other
/// ports carry the same load as the first.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Endpoint {
    /// Its first GPU, which decides whether a transfer stays in a node or a package.
    pub slot: DeviceSlot,
    lanes: f64,
    intra_out: Hop,
    intra_in: Hop,
    die_out: Option<Hop>,
    nic_out: Hop,
    nic_in: Hop,
}

pub(crate) struct SharedLinks {
    /// Each GPU's intra-node egress and ingress, and its die link's egress in a package.
    intra: Vec<[ResourceId; 2]>,
    die_out: Vec<Option<ResourceId>>,
    /// Each NIC port's egress and ingress, nodes in order, each node's ports in order.
    ports: Vec<[ResourceId; 2]>,
    /// Each node's first port in `ports`.
    first_port: Vec<usize>,
    /// `group_links[from * n_groups + to]`: the link from group `from` to group `to`, if named.
    group_links: Vec<Option<ResourceId>>,
    n_groups: usize,
}

impl SharedLinks {
    /// Adds `cluster`'s links to `network`.
    pub(crate) fn new<P>(cluster: &Cluster, network: &mut Network<P>) -> Self {
        let oversubscription = cluster.fabric().oversubscription;
        let (mut intra, mut die_out) = (Vec::new(), Vec::new());
        for slot in cluster.devices() {
            let group = &cluster.groups()[slot.group_idx];
            intra.push([network.add_resource(group.intra_link_gb_s), network.add_resource(group.intra_link_gb_s)]);
            die_out.push(group.device.package.map(|package| network.add_resource(package.die_link_gb_s)));
        }
        let (mut ports, mut first_port) = (Vec::new(), Vec::new());
        for group in cluster.groups() {
            let port_gb_s = group.nic_port_gb_s() / oversubscription;
            for _ in 0..group.n_nodes {
                first_port.push(ports.len());
                for _ in 0..group.nic_ports() {
                    ports.push([network.add_resource(port_gb_s), network.add_resource(port_gb_s)]);
                }
            }
        }
        let n_groups = cluster.groups().len();
        let mut group_links = vec![None; n_groups * n_groups];
        for link in cluster.links() {
            let [a, b] = link.groups;
            group_links[a * n_groups + b] = Some(network.add_resource(link.gb_s()));
            group_links[b * n_groups + a] = Some(network.add_resource(link.gb_s()));
        }
        SharedLinks { intra, die_out, ports, first_port, group_links, n_groups }
    }

    /// The endpoint of `devices` (at least one), each a lane.
    pub(crate) fn endpoint(&self, cluster: &Cluster, devices: &[DeviceSlot]) -> Endpoint {
        let port = |slot: DeviceSlot| {
            let group = &cluster.groups()[slot.group_idx];
            self.first_port[slot.node_idx as usize] + group.nic_port_of(slot.local_idx) as usize
        };
        // The first GPU's resource, with a lane for each GPU on it.
        let hop = |resource_of: &dyn Fn(DeviceSlot) -> ResourceId| {
            let resource = resource_of(devices[0]);
            Hop { resource, lanes: devices.iter().filter(|&&slot| resource_of(slot) == resource).count() as f64 }
        };
        Endpoint {
            slot: devices[0],
            lanes: devices.len() as f64,
            intra_out: hop(&|slot| self.intra[slot.id as usize][0]),
            intra_in: hop(&|slot| self.intra[slot.id as usize][1]),
            die_out: self.die_out[devices[0].id as usize].map(Hop::one_lane),
            nic_out: hop(&|slot| self.ports[port(slot)][0]),
            nic_in: hop(&|slot| self.ports[port(slot)][1]),
        }
    }

    /// The resources a transfer from `from` to `to` crosses: inside a package its dies' link,
    /// inside a node the GPUs' intra-node ports, between nodes their NIC ports and any link
    /// between their node groups.
    pub(crate) fn path(&self, cluster: &Cluster, from: &Endpoint, to: &Endpoint) -> Path {
        let (a, b) = (from.slot, to.slot);
        if a.node_idx != b.node_idx {
            let mut path: Path = smallvec![from.nic_out];
            if let Some(resource) = self.group_links[a.group_idx * self.n_groups + b.group_idx] {
                path.push(Hop { resource, lanes: from.lanes });
            }
            path.push(to.nic_in);
            return path;
        }
        match from.die_out {
            Some(die_out) if cluster.groups()[a.group_idx].same_package(a.local_idx, b.local_idx) => smallvec![die_out],
            _ => smallvec![from.intra_out, to.intra_in],
        }
    }

    /// Each NIC port's two directions.
    pub(crate) fn ports(&self) -> &[[ResourceId; 2]] {
        &self.ports
    }
}
