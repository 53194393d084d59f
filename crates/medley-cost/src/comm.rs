//! Communication costs in the α–β model: a message of S bytes over a link takes α + S/β.
//!
//! Collective costs follow the standard ring and hierarchical forms (Thakur et al. 2005; the
//! HetCCL and NCCL hierarchical designs): ring all-reduce 2(n−1)α + 2(n−1)/n·S/β, reduce-scatter
//! and all-gather half of that, hierarchical all-reduce a reduce-scatter inside each domain, an
//! all-reduce of each border rank's 1/n share across domains, and an all-gather inside each domain.

use medley_spec::{BridgeMode, Cluster, DeviceSlot, LinkKind, NodeGroup, Package};

/// One link class: bandwidth per direction and per-message latency.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    pub gb_s: f64,
    pub latency_us: f64,
}

impl Link {
    /// Seconds to move `bytes` once over the link.
    pub fn transfer_s(self, bytes: f64) -> f64 {
        self.latency_us * 1e-6 + bytes / (self.gb_s * 1e9)
    }

    /// The link a ring over both would be held back by: the lower bandwidth, the higher latency.
    pub fn slowest(self, other: Link) -> Link {
        Link { gb_s: self.gb_s.min(other.gb_s), latency_us: self.latency_us.max(other.latency_us) }
    }
}

/// Megatron-LM's DDP gradient bucket: at least 40M elements, and 1M per data-parallel rank.
const BUCKET_ELEMENTS: f64 = 40e6;
const BUCKET_ELEMENTS_PER_MEMBER: f64 = 1e6;

/// Beyond this many buckets a group's reduction overlaps no better, only costs the simulator
/// more events.
const MAX_BUCKETS: u32 = 16;

/// Buckets that `elements` gradients reduced over `n_members` replicas are cut into when their
/// reduction overlaps the backward pass: Megatron-LM sizes buckets in elements, whatever format
/// the gradients are reduced in.
pub fn gradient_buckets(elements: f64, n_members: usize) -> u32 {
    let bucket = BUCKET_ELEMENTS.max(BUCKET_ELEMENTS_PER_MEMBER * n_members as f64);
    ((elements / bucket).ceil() as u32).clamp(1, MAX_BUCKETS)
}

/// The part of a gradient reduction of `sync_s` in `n_buckets` buckets that a backward pass of
/// `pass_s` cannot hide: bucket b of B is ready (b + 1)/B into the pass and the buckets reduce
/// one after another, so the last finishes max(T/B, T − d·(B − 1)/B) after the pass ends.
pub fn exposed_reduction_s(sync_s: f64, n_buckets: u32, pass_s: f64) -> f64 {
    let n = f64::from(n_buckets.max(1));
    (sync_s / n).max(sync_s - pass_s * (n - 1.0) / n)
}

fn steps(n: u32) -> f64 {
    f64::from(n.saturating_sub(1))
}

/// Ring all-reduce of `bytes` per rank over `n` ranks.
pub fn ring_all_reduce_s(bytes: f64, n: u32, link: Link) -> f64 {
    2.0 * reduce_scatter_s(bytes, n, link)
}

/// Ring reduce-scatter (or all-gather) of `bytes` per rank in total over `n` ranks.
pub fn reduce_scatter_s(bytes: f64, n: u32, link: Link) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    steps(n) * (link.latency_us * 1e-6 + bytes / f64::from(n) / (link.gb_s * 1e9))
}

/// One vendor domain's part of a hierarchical collective: its rank count and internal link.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DomainPart {
    pub n_ranks: u32,
    pub link: Link,
}

/// Hierarchical all-reduce across domains joined by `bridge`: each domain reduce-scatters so
/// its ranks hold 1/n of the data each, the ranks holding the same share all-reduce it across
/// domains over the bridge, and each domain all-gathers. Only 1/n of the data crosses the bridge
/// per border rank; the smallest domain has the largest shares and bounds that phase.
pub fn hierarchical_all_reduce_s(bytes: f64, domains: &[DomainPart], bridge: Link) -> f64 {
    let inner = domains.iter().map(|d| reduce_scatter_s(bytes, d.n_ranks, d.link)).fold(0.0, f64::max);
    let smallest = domains.iter().map(|d| d.n_ranks).min().unwrap_or(1).max(1);
    let across = ring_all_reduce_s(bytes / f64::from(smallest), domains.len() as u32, bridge);
    2.0 * inner + across
}

/// What one GPU's collectives get inside a node of `group`: all of its links (rings over a mesh
/// use every link, as RCCL does).
pub fn intra_node_link(group: &NodeGroup) -> Link {
    Link { gb_s: group.intra_link_gb_s, latency_us: group.intra_link.latency_us() }
}

/// The link a tensor-parallel group of `tp` consecutive devices of `group` talks over: its dies'
/// link where the group lies inside one package (the package's dies split evenly into such
/// groups: an MI250X's two GCDs at tp = 2), else the node's.
pub fn tensor_parallel_link(group: &NodeGroup, tp: u32) -> Link {
    match group.device.package {
        Some(package) if tp > 1 && package.dies.is_multiple_of(tp) => die_link(group, package),
        _ => intra_node_link(group),
    }
}

/// Between two dies of one package.
fn die_link(group: &NodeGroup, package: Package) -> Link {
    Link { gb_s: package.die_link_gb_s, ..intra_node_link(group) }
}

/// What one GPU gets to one peer in its node: a switched fabric (NVSwitch, a PCIe switch) gives
/// any peer the GPU's whole bandwidth; an Infinity Fabric mesh has one direct link per peer
/// (MI300X: 7 links of 64 GB/s each way).
pub fn intra_node_peer_link(group: &NodeGroup) -> Link {
    let link = intra_node_link(group);
    match group.intra_link {
        LinkKind::InfinityFabric if group.gpus_per_node > 1 => {
            Link { gb_s: link.gb_s / f64::from(group.gpus_per_node - 1), ..link }
        }
        _ => link,
    }
}

/// The link between two GPUs, with `mode` for the bridge when they belong to different vendors,
/// as the analytic model prices it: every GPU of their nodes busy at once, each with its share of
/// its node's NICs and of any link between their groups.
pub fn link_between(cluster: &Cluster, a: DeviceSlot, b: DeviceSlot, mode: BridgeMode) -> Link {
    let nic = nic_link(cluster, &[a.group_idx, b.group_idx]);
    across_nodes_or_not(cluster, a, b, mode, nic)
}

/// What one GPU's transfer to another can reach alone, with `mode` for the bridge: its NIC
/// port's whole rate between nodes. The simulator caps each transfer at this and lets the
/// transfers crossing one NIC port or group link share it.
pub fn lane_link(cluster: &Cluster, a: DeviceSlot, b: DeviceSlot, mode: BridgeMode) -> Link {
    let groups = cluster.groups();
    let port_gb_s = groups[a.group_idx].nic_port_gb_s().min(groups[b.group_idx].nic_port_gb_s());
    let fabric = cluster.fabric();
    let latency_us = cluster
        .link_between_groups(a.group_idx, b.group_idx)
        .and_then(|link| link.latency_us)
        .unwrap_or(fabric.latency_us);
    let nic = Link { gb_s: port_gb_s / fabric.oversubscription, latency_us };
    across_nodes_or_not(cluster, a, b, mode, nic)
}

/// Inside one package its dies' link; inside one node the intra-node peer link; between nodes
/// `nic`, through the bridge across vendors.
fn across_nodes_or_not(cluster: &Cluster, a: DeviceSlot, b: DeviceSlot, mode: BridgeMode, nic: Link) -> Link {
    let (group_a, group_b) = (&cluster.groups()[a.group_idx], &cluster.groups()[b.group_idx]);
    if a.node_idx == b.node_idx {
        return match group_a.device.package {
            Some(package) if group_a.same_package(a.local_idx, b.local_idx) => die_link(group_a, package),
            _ => intra_node_peer_link(group_a),
        };
    }
    if group_a.device.vendor == group_b.device.vendor {
        nic
    } else {
        let (gb_s, latency_us) = cluster.bridge().rate(mode, nic.gb_s);
        Link { gb_s, latency_us }
    }
}

/// The inter-node link that GPUs of the node groups `group_idxs` get when all of them send at
/// once: the smallest NIC share through the fabric's oversubscription, and where the cluster
/// names a link between two of the groups, that link split over the smaller group's GPUs, at
/// its latency.
pub fn nic_link(cluster: &Cluster, group_idxs: &[usize]) -> Link {
    let fabric = cluster.fabric();
    let groups = cluster.groups();
    let nic_gb_s = group_idxs.iter().map(|&g| groups[g].nic_gb_s_per_gpu()).fold(f64::INFINITY, f64::min);
    let mut link = Link { gb_s: nic_gb_s / fabric.oversubscription, latency_us: fabric.latency_us };
    for (idx, &a) in group_idxs.iter().enumerate() {
        for &b in &group_idxs[idx + 1..] {
            if let Some(joining) = cluster.link_between_groups(a, b) {
                let sharers = groups[a].n_gpus().min(groups[b].n_gpus());
                link = link.slowest(Link {
                    gb_s: joining.gb_s() / f64::from(sharers),
                    latency_us: joining.latency_us.unwrap_or(fabric.latency_us),
                });
            }
        }
    }
    link
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_between_groups_bounds_their_share_and_a_lane_reaches_a_whole_nic_port() {
        let text = "[[group]]\ndevice = \"a100\"\nnodes = 2\ngpus_per_node = 4\nnics_per_node = 1\nnic_gbit_s = 100\n\
                    [[group]]\ndevice = \"a100\"\nnodes = 1\ngpus_per_node = 2\nnics_per_node = 1\nnic_gbit_s = 100\n\
                    [[link]]\ngroups = [0, 1]\ngbit_s = 8\nlatency_us = 30\n";
        let cluster = Cluster::from_toml(text, "c.toml").unwrap();
        let slots = cluster.devices();
        // Inside group 0 every GPU has a quarter of its node's NIC; across, the link's 1 GB/s
        // is split over the smaller group's 2 GPUs.
        assert_eq!(nic_link(&cluster, &[0]), Link { gb_s: 12.5 / 4.0, latency_us: 5.0 });
        assert_eq!(nic_link(&cluster, &[0, 1]), Link { gb_s: 0.5, latency_us: 30.0 });
        let (a, b, c) = (slots[0], slots[4], slots[8]);
        assert_eq!(link_between(&cluster, a, c, BridgeMode::DeviceDirect), nic_link(&cluster, &[0, 1]));
        // One GPU alone reaches its node's whole NIC; the link itself is a shared resource.
        assert_eq!(lane_link(&cluster, a, b, BridgeMode::DeviceDirect), Link { gb_s: 12.5, latency_us: 5.0 });
        assert_eq!(lane_link(&cluster, a, c, BridgeMode::DeviceDirect), Link { gb_s: 12.5, latency_us: 30.0 });
    }

    /// Issue 33: tensor parallelism over an MI250X's two GCDs talked over the node's Infinity
    /// Fabric instead of the 200 GB/s link between the dies.
    #[test]
    fn tensor_parallelism_inside_a_package_talks_over_its_dies_link() {
        let cluster = Cluster::from_inline("8xmi250x", Default::default(), Default::default()).unwrap();
        let group = &cluster.groups()[0];
        let package = group.device.package.expect("an MI250X is a package");
        assert_eq!(tensor_parallel_link(group, 2).gb_s, package.die_link_gb_s);
        assert_eq!(tensor_parallel_link(group, 4), intra_node_link(group));
        assert_eq!(tensor_parallel_link(group, 1), intra_node_link(group));
        let h100s = Cluster::from_inline("8xh100", Default::default(), Default::default()).unwrap();
        assert_eq!(tensor_parallel_link(&h100s.groups()[0], 2), intra_node_link(&h100s.groups()[0]));
    }

    const LINK: Link = Link { gb_s: 100.0, latency_us: 2.0 };

    #[test]
    fn buckets_follow_megatrons_size_and_stay_bounded() {
        assert_eq!(gradient_buckets(1e6, 8), 1);
        assert_eq!(gradient_buckets(100e6, 8), 3);
        // 64 members make buckets of 64M elements.
        assert_eq!(gradient_buckets(100e6, 64), 2);
        assert_eq!(gradient_buckets(1e12, 8), MAX_BUCKETS);
    }

    #[test]
    fn a_pass_hides_all_but_the_last_bucket_or_what_outlasts_it() {
        assert_eq!(exposed_reduction_s(1.0, 4, 10.0), 0.25);
        assert_eq!(exposed_reduction_s(1.0, 4, 0.0), 1.0);
        assert!((exposed_reduction_s(1.0, 4, 0.8) - 0.4).abs() < 1e-12);
        assert_eq!(exposed_reduction_s(1.0, 1, 10.0), 1.0);
    }

    #[test]
    fn ring_matches_the_closed_form() {
        let (bytes, n) = (1e9, 8);
        let expected = 2.0 * 7.0 * 2e-6 + 2.0 * 7.0 / 8.0 * bytes / 100e9;
        assert!((ring_all_reduce_s(bytes, n, LINK) - expected).abs() < 1e-12);
        assert_eq!(ring_all_reduce_s(bytes, 1, LINK), 0.0);
    }

    #[test]
    fn hierarchical_beats_flat_when_the_bridge_is_slow() {
        let bridge = Link { gb_s: 10.0, latency_us: 20.0 };
        let domains = [DomainPart { n_ranks: 8, link: LINK }, DomainPart { n_ranks: 8, link: LINK }];
        let flat = ring_all_reduce_s(1e9, 16, bridge.slowest(LINK));
        let hierarchical = hierarchical_all_reduce_s(1e9, &domains, bridge);
        assert!(hierarchical < flat / 2.0, "{hierarchical} vs {flat}");
    }
}
