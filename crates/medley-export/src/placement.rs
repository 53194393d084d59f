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

impl Placement {
    /// The launch script's part that says how the hosts must be listed, and on each host sets
    /// `NODE_RANK` and the GPUs its ranks run on.
    pub fn host_setup(&self) -> String {
        let gpus = |host: &Host| host.gpus.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
        let mut script = String::from(
            "# So the hosts must be listed in this order (host 0 is MASTER_ADDR), each with these GPUs:\n",
        );
        for (idx, host) in self.hosts.iter().enumerate() {
            script.push_str(&format!(
                "#   host {idx}: the plan's node {} ({}), GPUs {}\n",
                host.node,
                host.device_type,
                gpus(host)
            ));
        }
        script.push_str(
            "# Run it on every host with NODE_RANK set to the host's position (under Slurm, SLURM_NODEID does when the\n\
             # nodelist is in this order) and MASTER_ADDR to host 0; extra arguments (data, tokenizer, ...) pass on.\n\
             set -euo pipefail\n\
             NODE_RANK=\"${NODE_RANK:-${SLURM_NODEID:?set NODE_RANK to the position of this host}}\"\n\
             case \"$NODE_RANK\" in\n",
        );
        for (idx, host) in self.hosts.iter().enumerate() {
            script.push_str(&format!("    {idx}) export CUDA_VISIBLE_DEVICES={} ;;\n", gpus(host)));
        }
        script.push_str(&format!(
            "    *) echo \"NODE_RANK=$NODE_RANK: this plan has {} hosts\" >&2; exit 1 ;;\nesac\n",
            self.hosts.len()
        ));
        script
    }

    /// The script's last line: torchrun starts this host's ranks of `program` with `args`, and
    /// the script's own arguments after them.
    pub fn torchrun(&self, program: &str, args: &str) -> String {
        format!(
            "exec torchrun --nnodes {} --nproc-per-node {} --node-rank \"$NODE_RANK\" \\\n    \
             --master-addr \"${{MASTER_ADDR:?set MASTER_ADDR to host 0}}\" --master-port \"${{MASTER_PORT:-6000}}\" \\\n    \
             {program} \\\n    {args} \\\n    \"$@\"\n",
            self.hosts.len(),
            self.procs_per_host
        )
    }
}
