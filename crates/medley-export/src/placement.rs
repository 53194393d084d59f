//! A framework's fixed rank order against the plan's devices: torchrun gives host k the ranks
//! k·g to (k + 1)·g − 1, so each such run of ranks must be one node's devices, and the hosts must
//! be listed node by node in the order the ranks need.

use medley_spec::{Cluster, DeviceId};
use serde::Serialize;

/// One rank of the launch and the plan's device it runs on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RankDevice {
    pub rank: u32,
    pub device: DeviceId,
    /// The host (in launch order) and its GPU, as `CUDA_VISIBLE_DEVICES` there numbers them.
    pub host: u32,
    pub local_rank: u32,
}

/// A host of the launch, in the order the hosts must be listed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Host {
    /// The cluster's node (numbered across the whole cluster) and its device type.
    pub node: u32,
    pub device_type: String,
    /// The node's GPUs (its local indices) for local ranks 0, 1, ...: its `CUDA_VISIBLE_DEVICES`.
    pub gpus: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Placement {
    pub ranks: Vec<RankDevice>,
    pub hosts: Vec<Host>,
    pub procs_per_host: u32,
}

/// Places the ranks whose devices are `devices` (rank r on `devices[r]`) on hosts of
/// `procs_per_host` consecutive ranks each: the ranks on one host must be one node's devices.
pub fn place(cluster: &Cluster, devices: &[DeviceId]) -> Result<Placement, String> {
    let slots = cluster.devices();
    let node_of = |rank: usize| slots[devices[rank] as usize].node_idx;
    let Some(&first) = devices.first() else { return Err("the plan places no ranks".into()) };
    let procs_per_host =
        devices.iter().take_while(|&&device| slots[device as usize].node_idx == slots[first as usize].node_idx).count();
    if !devices.len().is_multiple_of(procs_per_host) {
        return Err(format!(
            "torchrun starts the same number of ranks on every host, but the first host's {procs_per_host} ranks do not divide the {} ranks",
            devices.len()
        ));
    }
    let mut hosts: Vec<Host> = Vec::new();
    let mut ranks = Vec::new();
    for (host, run) in devices.chunks(procs_per_host).enumerate() {
        let start = host * procs_per_host;
        let node = node_of(start);
        if let Some(offset) = (0..run.len()).find(|&offset| node_of(start + offset) != node) {
            return Err(format!(
                "ranks {start} to {} would share a host, but rank {} runs on node {} and rank {start} on node {node}: \
                 the framework's rank order splits a node's ranks",
                start + procs_per_host - 1,
                start + offset,
                node_of(start + offset)
            ));
        }
        if hosts.iter().any(|listed| listed.node == node) {
            return Err(format!(
                "node {node} would have to be listed twice: its ranks are not consecutive in the framework's order"
            ));
        }
        let gpus: Vec<u32> = run.iter().map(|&device| slots[device as usize].local_idx).collect();
        for (local_rank, &device) in run.iter().enumerate() {
            ranks.push(RankDevice {
                rank: (start + local_rank) as u32,
                device,
                host: host as u32,
                local_rank: local_rank as u32,
            });
        }
        let device_type = cluster.groups()[slots[run[0] as usize].group_idx].device.name.clone();
        hosts.push(Host { node, device_type, gpus });
    }
    Ok(Placement { ranks, hosts, procs_per_host: procs_per_host as u32 })
}
