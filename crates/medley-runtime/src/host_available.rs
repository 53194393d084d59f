//! What this machine can give a run: memory it has free now, within its cgroup's limit.

use std::fs;
use std::path::Path;

use crate::{HostMemory, RuntimeError};

const GIB: f64 = (1u64 << 30) as f64;

/// Bytes a new process can take: `MemAvailable`, lowered to what this process's cgroup and each
/// cgroup above it still allow (a Slurm job's, a systemd slice's, a container's); `None` where
/// none of it can be read.
fn available_memory_bytes() -> Option<f64> {
    let meminfo = fs::read_to_string("/proc/meminfo").ok().and_then(|text| mem_available(&text));
    let cgroup = fs::read_to_string("/proc/self/cgroup").ok().and_then(|text| cgroup_headroom(&text));
    match (meminfo, cgroup) {
        (Some(free), Some(allowed)) => Some(free.min(allowed)),
        (free, allowed) => free.or(allowed),
    }
}

/// Where each cgroup version keeps memory limits, and the files of a limit and of the usage.
const CGROUP_MEMORY: [(&str, &str, &str); 2] = [
    ("/sys/fs/cgroup", "memory.max", "memory.current"),
    ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes"),
];

/// The least limit-minus-usage from this process's memory cgroup (v2's `0::PATH` line of
/// `/proc/self/cgroup`, or v1's `N:memory:PATH`) up to the hierarchy's root as mounted here; `None`
/// when no level sets a limit. Inside a container the hierarchy is mounted at its own cgroup.
fn cgroup_headroom(proc_self_cgroup: &str) -> Option<f64> {
    let mut least: Option<f64> = None;
    for line in proc_self_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else { continue };
        let version = match controllers {
            "" => 0,
            listed if listed.split(',').any(|controller| controller == "memory") => 1,
            _ => continue,
        };
        let (mount, limit_file, usage_file) = CGROUP_MEMORY[version];
        let mount = Path::new(mount);
        let own = mount.join(path.trim().trim_start_matches('/'));
        let mut dir = if own.is_dir() { own } else { mount.to_path_buf() };
        let read = |dir: &Path, name: &str| fs::read_to_string(dir.join(name)).ok()?.trim().parse::<f64>().ok();
        loop {
            // v2's "max" (no limit) does not parse; v1's no limit is a number near 2⁶³.
            if let (Some(limit), Some(usage)) = (read(&dir, limit_file), read(&dir, usage_file)) {
                let headroom = (limit - usage).max(0.0);
                least = Some(least.map_or(headroom, |least| least.min(headroom)));
            }
            if dir == mount || !dir.pop() {
                break;
            }
        }
    }
    least
}

fn mem_available(meminfo: &str) -> Option<f64> {
    let line = meminfo.lines().find(|line| line.starts_with("MemAvailable:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// Refuses, with the numbers, when the processes whose needs are `needs` (what `what` names)
/// would together exceed the memory this machine has available.
pub fn check_memory(what: &str, needs: &[HostMemory], remedy: &str) -> Result<(), RuntimeError> {
    let Some(available) = available_memory_bytes() else { return Ok(()) };
    let total = needs.iter().fold(HostMemory::default(), |sum, &need| sum + need);
    if total.total_bytes() <= available {
        return Ok(());
    }
    let largest = needs.iter().map(HostMemory::total_bytes).fold(0.0, f64::max);
    let each = if needs.len() > 1 { format!("; the largest process {:.1} GiB", largest / GIB) } else { String::new() };
    Err(RuntimeError::HostMemory(format!(
        "{what} would need about {:.1} GiB of host memory ({:.1} GiB model state, {:.1} GiB activations{each}), \
         but this machine has {:.1} GiB available; {remedy}",
        total.total_bytes() / GIB,
        total.state_bytes / GIB,
        total.activation_bytes / GIB,
        available / GIB,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let meminfo = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2000 kB\n";
        assert_eq!(mem_available(meminfo), Some(2_048_000.0));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn what_fits_passes_and_what_does_not_names_the_numbers() {
        let small = HostMemory { state_bytes: 1.0, activation_bytes: 1.0 };
        check_memory("one worker", &[small, small], "").unwrap();
        let huge = HostMemory { state_bytes: 1e15, activation_bytes: 1e12 };
        let err = check_memory("4 workers", &[huge], "use a smaller model").unwrap_err().to_string();
        assert!(err.starts_with("4 workers would need about 9322") && err.contains("smaller model"), "{err}");
    }
}
