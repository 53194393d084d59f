//! Clusters: groups of identical nodes, the fabric between nodes, and the bridge between vendor
//! domains. Written as a TOML file or inline (`64xh100,32xmi300x`); both become a [`Cluster`].

use serde::{Deserialize, Serialize};

use crate::device::{DeviceSpec, LinkKind, Vendor, catalog_device, devices_per_counted};
use crate::error::{SpecError, echo};
use crate::job::Precision;

/// The largest cluster medley plans: beyond today's largest training runs (Llama 3 405B trained
/// on 16,384 H100s), and what the search finishes in about 30 s and 2 GB on two cores (it prices
/// its finalists as explicit plans, device by device: 1,048,576 GPUs took minutes and 16.8 GB).
pub const MAX_GPUS: u32 = 1 << 15;

/// The most node groups a cluster may list (the planner searches at most a handful).
pub const MAX_GROUPS: usize = 64;

/// GPUs per node when the inline form does not say (the common 8-GPU server).
pub const DEFAULT_GPUS_PER_NODE: u32 = 8;

/// Nodes of one device type with one shape. Invariant (held by [`Cluster::new`]): counts and
/// rates are positive.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeGroup {
    pub device: DeviceSpec,
    pub n_nodes: u32,
    pub gpus_per_node: u32,
    pub intra_link: LinkKind,
    /// Per GPU, per direction.
    pub intra_link_gb_s: f64,
    pub nics_per_node: u32,
    pub nic_gbit_s: f64,
}

impl NodeGroup {
    /// A group with the catalog defaults of its device for links and NICs.
    pub fn with_defaults(device: DeviceSpec, n_nodes: u32, gpus_per_node: u32) -> Self {
        NodeGroup {
            intra_link: device.intra_link,
            intra_link_gb_s: device.intra_link_gb_s,
            nics_per_node: device.nics_per_node,
            nic_gbit_s: device.nic_gbit_s,
            device,
            n_nodes,
            gpus_per_node,
        }
    }

    pub fn n_gpus(&self) -> u32 {
        self.n_nodes * self.gpus_per_node
    }

    /// Inter-node bandwidth one GPU gets when every GPU of the node sends at once, in GB/s.
    pub fn nic_gb_s_per_gpu(&self) -> f64 {
        f64::from(self.nics_per_node) * self.nic_gbit_s / 8.0 / f64::from(self.gpus_per_node)
    }

    /// The NIC ports a node's GPUs send through: each GPU its own NICs where the node has a NIC
    /// for every GPU, else each NIC shared by the GPUs nearest it.
    pub fn nic_ports(&self) -> u32 {
        self.nics_per_node.min(self.gpus_per_node)
    }

    /// One NIC port's rate: all of a node's NICs split over its ports.
    pub fn nic_port_gb_s(&self) -> f64 {
        f64::from(self.nics_per_node) * self.nic_gbit_s / 8.0 / f64::from(self.nic_ports())
    }

    /// Whether GPUs `a` and `b` of one node are dies of one package.
    pub fn same_package(&self, a: u32, b: u32) -> bool {
        self.device.package.is_some_and(|package| a / package.dies == b / package.dies)
    }

    /// The NIC port that GPU `local_idx` of a node sends through.
    pub fn nic_port_of(&self, local_idx: u32) -> u32 {
        local_idx * self.nic_ports() / self.gpus_per_node
    }
}

/// The network between nodes of one vendor domain.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Fabric {
    pub latency_us: f64,
    /// Core oversubscription: 1 is a full-bisection fat tree, 2 halves cross-node bandwidth.
    pub oversubscription: f64,
}

impl Default for Fabric {
    /// A rail-optimised InfiniBand/RoCE fat tree: a few µs per message through two switch tiers.
    fn default() -> Self {
        Fabric { latency_us: 5.0, oversubscription: 1.0 }
    }
}

/// A link between two node groups that every transfer between their nodes crosses, shared by
/// those transfers in each direction: two sites or racks joined by one uplink. Groups without one
/// reach each other through the fabric at their NICs' rates.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupLink {
    /// The two groups' places in the cluster's group list, from 0.
    pub groups: [usize; 2],
    /// The link's whole rate in each direction.
    pub gbit_s: f64,
    /// Replaces the fabric's latency for messages across this link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_us: Option<f64>,
}

impl GroupLink {
    pub fn gb_s(&self) -> f64 {
        self.gbit_s / 8.0
    }

    pub fn joins(&self, a: usize, b: usize) -> bool {
        self.groups == [a, b] || self.groups == [b, a]
    }
}

/// How traffic crosses between two vendor domains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BridgeMode {
    /// RDMA between the two vendors' devices over the NICs (GPUDirect / ROCm peer memory).
    DeviceDirect,
    /// Staged through host memory on both sides: extra copies over PCIe and extra latency.
    CpuForward,
}

/// The links between vendor domains, per GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Bridge {
    /// Whether device-direct RDMA works between the vendors at all.
    pub device_direct: bool,
    /// Device-direct bandwidth per GPU; `None` means the slower side's NIC share.
    pub device_direct_gb_s: Option<f64>,
    pub device_direct_latency_us: f64,
    /// Host-staged bandwidth per GPU (device→host copy, NIC, host→device, pipelined).
    pub cpu_forward_gb_s: f64,
    pub cpu_forward_latency_us: f64,
}

impl Default for Bridge {
    /// Device-direct at NIC speed and a little over the fabric's latency; CPU forwarding at 100 Gb/s per GPU with
    /// the two extra staging copies' latency. Assumptions, stated in ARCHITECTURE.md: override
    /// them with measured values.
    fn default() -> Self {
        Bridge {
            device_direct: true,
            device_direct_gb_s: None,
            device_direct_latency_us: 6.0,
            cpu_forward_gb_s: 12.5,
            cpu_forward_latency_us: 25.0,
        }
    }
}

impl Bridge {
    /// The modes this bridge offers, fastest kind first.
    pub fn modes(&self) -> Vec<BridgeMode> {
        let mut modes = Vec::with_capacity(2);
        if self.device_direct {
            modes.push(BridgeMode::DeviceDirect);
        }
        modes.push(BridgeMode::CpuForward);
        modes
    }

    /// (bandwidth GB/s, latency µs) of `mode` between GPUs whose NIC shares are `nic_gb_s`.
    pub fn rate(&self, mode: BridgeMode, nic_gb_s: f64) -> (f64, f64) {
        match mode {
            BridgeMode::DeviceDirect => {
                (self.device_direct_gb_s.unwrap_or(nic_gb_s).min(nic_gb_s), self.device_direct_latency_us)
            }
            BridgeMode::CpuForward => (self.cpu_forward_gb_s.min(nic_gb_s), self.cpu_forward_latency_us),
        }
    }
}

/// Index of a GPU in the cluster: groups in order, nodes in order, GPUs in order.
pub type DeviceId = u32;

/// Where one GPU sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceSlot {
    pub id: DeviceId,
    pub group_idx: usize,
    /// Node index across the whole cluster.
    pub node_idx: u32,
    pub local_idx: u32,
}

/// A validated cluster. Invariants: at least one group; every count and rate positive.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "ClusterParts")]
pub struct Cluster {
    groups: Vec<NodeGroup>,
    fabric: Fabric,
    bridge: Bridge,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    links: Vec<GroupLink>,
}

/// A cluster as stored inside a plan file: already resolved groups, checked again on load.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterParts {
    groups: Vec<NodeGroup>,
    fabric: Fabric,
    bridge: Bridge,
    #[serde(default)]
    links: Vec<GroupLink>,
}

impl TryFrom<ClusterParts> for Cluster {
    type Error = SpecError;
    fn try_from(parts: ClusterParts) -> Result<Self, SpecError> {
        let groups = parts
            .groups
            .into_iter()
            .map(|mut group| {
                group.device = group.device.validated("cluster")?;
                Ok(group)
            })
            .collect::<Result<Vec<_>, SpecError>>()?;
        Cluster::new(groups, parts.fabric, parts.bridge, "cluster")?.with_links(parts.links, "cluster")
    }
}

impl Cluster {
    /// Validates the parts; `source` names where they came from for error messages.
    pub fn new(groups: Vec<NodeGroup>, fabric: Fabric, bridge: Bridge, source: &str) -> Result<Self, SpecError> {
        if groups.is_empty() {
            return Err(SpecError::field(source, "group", "a cluster needs at least one node group"));
        }
        if groups.len() > MAX_GROUPS {
            return Err(SpecError::field(
                source,
                "group",
                format!(
                    "{} node groups; medley takes at most {MAX_GROUPS}: merge groups of the same device and node shape",
                    groups.len()
                ),
            ));
        }
        for (idx, group) in groups.iter().enumerate() {
            let counts = [
                ("n_nodes", group.n_nodes),
                ("gpus_per_node", group.gpus_per_node),
                ("nics_per_node", group.nics_per_node),
            ];
            for (name, value) in counts {
                if value == 0 {
                    return Err(SpecError::field(source, format!("group[{idx}].{name}"), "must be at least 1"));
                }
            }
            if let Some(package) = group.device.package
                && !group.gpus_per_node.is_multiple_of(package.dies)
            {
                return Err(SpecError::field(
                    source,
                    format!("group[{idx}].gpus_per_node"),
                    format!(
                        "{} come {} to a package and a node holds whole packages: count devices as the driver \
                         lists them, a multiple of {}",
                        group.device.name, package.dies, package.dies
                    ),
                ));
            }
            positive(source, &format!("group[{idx}].intra_link_gb_s"), group.intra_link_gb_s)?;
            positive(source, &format!("group[{idx}].nic_gbit_s"), group.nic_gbit_s)?;
            // A cluster read back from a plan file carries its devices' rates: they are checked
            // here as a user's [[device]] table is.
            group.device.check(source)?;
        }
        let total: u64 = groups.iter().map(|group| u64::from(group.n_nodes) * u64::from(group.gpus_per_node)).sum();
        if total > u64::from(MAX_GPUS) {
            return Err(SpecError::field(
                source,
                "group",
                format!("{total} GPUs in all; medley plans at most {MAX_GPUS}"),
            ));
        }
        for (idx, group) in groups.iter().enumerate() {
            let clash = groups[..idx].iter().any(|other| {
                other.device.name.eq_ignore_ascii_case(&group.device.name) && other.device != group.device
            });
            if clash {
                return Err(SpecError::field(
                    source,
                    format!("group[{idx}].device"),
                    format!(
                        "`{}` names two different devices; give custom devices their own names",
                        echo(&group.device.name)
                    ),
                ));
            }
        }
        non_negative(source, "fabric.latency_us", fabric.latency_us)?;
        if !(fabric.oversubscription >= 1.0 && fabric.oversubscription.is_finite()) {
            return Err(SpecError::field(source, "fabric.oversubscription", "must be at least 1"));
        }
        positive(source, "bridge.cpu_forward_gb_s", bridge.cpu_forward_gb_s)?;
        positive(source, "bridge.device_direct_gb_s", bridge.device_direct_gb_s.unwrap_or(1.0))?;
        non_negative(source, "bridge.cpu_forward_latency_us", bridge.cpu_forward_latency_us)?;
        non_negative(source, "bridge.device_direct_latency_us", bridge.device_direct_latency_us)?;
        Ok(Cluster { groups, fabric, bridge, links: Vec::new() })
    }

    /// The cluster with `links` between its node groups, checked: groups that exist, two different
    /// ones, each pair once, positive rates.
    pub fn with_links(mut self, links: Vec<GroupLink>, source: &str) -> Result<Self, SpecError> {
        for (idx, link) in links.iter().enumerate() {
            let field = format!("link[{idx}].groups");
            let n_groups = self.groups.len();
            if let Some(&missing) = link.groups.iter().find(|&&group| group >= n_groups) {
                return Err(SpecError::field(
                    source,
                    field,
                    format!(
                        "there is no group {missing}: groups are numbered from 0 in file order, and there are {n_groups}"
                    ),
                ));
            }
            let [a, b] = link.groups;
            if a == b {
                return Err(SpecError::field(
                    source,
                    field,
                    "a link joins two different groups; a group's own nodes talk over the fabric",
                ));
            }
            if links[..idx].iter().any(|earlier| earlier.joins(a, b)) {
                return Err(SpecError::field(source, field, format!("groups {a} and {b} are linked twice")));
            }
            positive(source, &format!("link[{idx}].gbit_s"), link.gbit_s)?;
            non_negative(source, &format!("link[{idx}].latency_us"), link.latency_us.unwrap_or(0.0))?;
        }
        self.links = links;
        Ok(self)
    }

    /// The link between node groups `a` and `b`, if the cluster names one.
    pub fn link_between_groups(&self, a: usize, b: usize) -> Option<&GroupLink> {
        self.links.iter().find(|link| link.joins(a, b))
    }

    pub fn links(&self) -> &[GroupLink] {
        &self.links
    }

    /// Parses the inline form `64xh100,128xa100,32xmi300x`: 8 GPUs per node unless the count is
    /// smaller, catalog defaults for links and NICs.
    pub fn from_inline(text: &str, fabric: Fabric, bridge: Bridge) -> Result<Self, SpecError> {
        let source = "--cluster";
        let groups = text
            .split(',')
            .map(str::trim)
            .filter(|entry| !entry.is_empty())
            .map(|entry| inline_group(source, entry))
            .collect::<Result<Vec<_>, _>>()?;
        Cluster::new(groups, fabric, bridge, source)
    }

    /// Parses a fleet of single-GPU nodes, `2xh100,2xmi300x`: what `medley train` emulates with
    /// one worker process per GPU. A package of several devices (`2xmi250x`: two MI250X, four
    /// GCDs) is one node of its devices, joined by its die link.
    pub fn from_fleet(text: &str) -> Result<Self, SpecError> {
        let source = "--fleet";
        let groups = text
            .split(',')
            .map(str::trim)
            .filter(|entry| !entry.is_empty())
            .map(|entry| {
                let (count, device) = count_and_device(source, entry)?;
                let per_node = device.package.map_or(1, |package| package.dies);
                if !count.is_multiple_of(per_node) {
                    return Err(SpecError::field(
                        source,
                        entry,
                        format!("{} come {per_node} to a package: give a multiple of {per_node}", device.name),
                    ));
                }
                Ok(NodeGroup::with_defaults(device, count / per_node, per_node))
            })
            .collect::<Result<Vec<_>, SpecError>>()?;
        Cluster::new(groups, Fabric::default(), Bridge::default(), source)
    }

    /// Parses a cluster TOML file's text; `source` is its path, for error messages.
    pub fn from_toml(text: &str, source: &str) -> Result<Self, SpecError> {
        let file: ClusterFile = toml::from_str(text).map_err(|err| SpecError::from_toml(source, text, &err))?;
        let custom = file.device.into_iter().map(|device| device.validated(source)).collect::<Result<Vec<_>, _>>()?;
        if let Some(device) = custom.iter().find(|device| catalog_device(&device.name).is_ok()) {
            return Err(SpecError::field(
                source,
                format!("device.{}.name", device.name),
                "is a catalog device's name; give the custom device its own name",
            ));
        }
        let groups = file
            .group
            .into_iter()
            .enumerate()
            .map(|(idx, group)| group.resolve(source, idx, &custom))
            .collect::<Result<Vec<_>, _>>()?;
        Cluster::new(groups, file.fabric, file.bridge, source)?.with_links(file.link, source)
    }

    /// Refuses a job in `precision` on devices without its number format, naming them and what
    /// to do instead: never priced or trained in another precision than the one asked.
    pub fn check_precision(&self, precision: Precision) -> Result<(), SpecError> {
        let mut without: Vec<&str> = self
            .groups
            .iter()
            .filter(|group| group.device.tensor_tflops(precision).is_none())
            .map(|group| group.device.name.as_str())
            .collect();
        without.sort_unstable();
        without.dedup();
        if without.is_empty() {
            return Ok(());
        }
        let shared: Vec<String> = Precision::ALL
            .into_iter()
            .filter(|other| self.groups.iter().all(|group| group.device.tensor_tflops(*other).is_some()))
            .map(|other| other.to_string())
            .collect();
        Err(SpecError::field(
            "job",
            "precision",
            format!(
                "{precision} needs {} on every device, and {} {} none: train in {} (--precision), plan without \
                 them, or state the rate ({}_tflops) of a custom device that has it",
                precision.format(),
                without.join(", "),
                if without.len() == 1 { "has" } else { "have" },
                shared.join(" or "),
                precision.format()
            ),
        ))
    }

    pub fn groups(&self) -> &[NodeGroup] {
        &self.groups
    }

    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    pub fn bridge(&self) -> &Bridge {
        &self.bridge
    }

    pub fn n_gpus(&self) -> u32 {
        self.groups.iter().map(NodeGroup::n_gpus).sum()
    }

    /// The distinct vendor domains, sorted.
    pub fn vendors(&self) -> Vec<Vendor> {
        let mut vendors: Vec<Vendor> = self.groups.iter().map(|group| group.device.vendor).collect();
        vendors.sort();
        vendors.dedup();
        vendors
    }

    /// The first device id of each group.
    pub fn group_first_ids(&self) -> Vec<DeviceId> {
        self.groups
            .iter()
            .scan(0, |next, group| {
                let first = *next;
                *next += group.n_gpus();
                Some(first)
            })
            .collect()
    }

    /// Every GPU, in id order.
    pub fn devices(&self) -> Vec<DeviceSlot> {
        let mut slots = Vec::with_capacity(self.n_gpus() as usize);
        let mut node_idx = 0;
        for (group_idx, group) in self.groups.iter().enumerate() {
            for _ in 0..group.n_nodes {
                for local_idx in 0..group.gpus_per_node {
                    let id = slots.len() as DeviceId;
                    slots.push(DeviceSlot { id, group_idx, node_idx, local_idx });
                }
                node_idx += 1;
            }
        }
        slots
    }
}

fn non_negative(source: &str, field: &str, value: f64) -> Result<(), SpecError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(SpecError::field(source, field, format!("must be zero or more, got {value}")))
    }
}

fn positive(source: &str, field: &str, value: f64) -> Result<(), SpecError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(SpecError::field(source, field, format!("must be a positive number, got {value}")))
    }
}

fn inline_group(source: &str, entry: &str) -> Result<NodeGroup, SpecError> {
    let (count, device) = count_and_device(source, entry)?;
    let gpus_per_node = count.min(DEFAULT_GPUS_PER_NODE);
    if !count.is_multiple_of(gpus_per_node) {
        return Err(SpecError::field(
            source,
            entry,
            format!(
                "{count} GPUs do not fill whole {gpus_per_node}-GPU nodes; use a multiple of {gpus_per_node} or a cluster TOML file"
            ),
        ));
    }
    Ok(NodeGroup::with_defaults(device, count / gpus_per_node, gpus_per_node))
}

/// One `COUNTxDEVICE` entry: the count of devices, packages counted as their dies.
fn count_and_device(source: &str, entry: &str) -> Result<(u32, DeviceSpec), SpecError> {
    let bad = |message: String| SpecError::field(source, entry, message);
    let (count, name) =
        entry.split_once(['x', 'X']).ok_or_else(|| bad("expected COUNTxDEVICE, e.g. 64xh100".to_string()))?;
    let count: u32 = count
        .trim()
        .parse()
        .map_err(|_| bad(format!("`{}` is not a GPU count; expected COUNTxDEVICE, e.g. 64xh100", echo(count))))?;
    if count == 0 {
        return Err(bad("the GPU count must be at least 1".to_string()));
    }
    let devices = count.checked_mul(devices_per_counted(name)).ok_or_else(|| bad("too many GPUs".to_string()))?;
    Ok((devices, catalog_device(name)?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    #[serde(default)]
    device: Vec<DeviceSpec>,
    #[serde(default)]
    group: Vec<GroupEntry>,
    #[serde(default)]
    fabric: Fabric,
    #[serde(default)]
    bridge: Bridge,
    #[serde(default)]
    link: Vec<GroupLink>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GroupEntry {
    device: String,
    nodes: u32,
    #[serde(default)]
    gpus_per_node: Option<u32>,
    #[serde(default)]
    intra_link: Option<LinkKind>,
    #[serde(default)]
    intra_link_gb_s: Option<f64>,
    #[serde(default)]
    nics_per_node: Option<u32>,
    #[serde(default)]
    nic_gbit_s: Option<f64>,
}

impl GroupEntry {
    fn resolve(self, source: &str, idx: usize, custom: &[DeviceSpec]) -> Result<NodeGroup, SpecError> {
        let device = match custom.iter().find(|device| device.name.eq_ignore_ascii_case(&self.device)) {
            Some(device) => device.clone(),
            None => catalog_device(&self.device).map_err(|err| match err {
                SpecError::Unknown { kind, name, close } => {
                    SpecError::field(source, format!("group[{idx}].device"), SpecError::Unknown { kind, name, close })
                }
                other => other,
            })?,
        };
        let mut group =
            NodeGroup::with_defaults(device, self.nodes, self.gpus_per_node.unwrap_or(DEFAULT_GPUS_PER_NODE));
        group.intra_link = self.intra_link.unwrap_or(group.intra_link);
        group.intra_link_gb_s = self.intra_link_gb_s.unwrap_or(group.intra_link_gb_s);
        group.nics_per_node = self.nics_per_node.unwrap_or(group.nics_per_node);
        group.nic_gbit_s = self.nic_gbit_s.unwrap_or(group.nic_gbit_s);
        Ok(group)
    }
}

#[cfg(test)]
mod tests;
