//! What this machine can give a run: memory it has free now, within its cgroup's limit.

use std::fs;

use anyhow::{Result, bail};
use medley_runtime::HostMemory;

const GIB: f64 = (1u64 << 30) as f64;

/// Bytes a new process can take: `MemAvailable`, lowered to what the cgroup (v2) still allows;
/// `None` where neither can be read.
pub fn available_memory_bytes() -> Option<f64> {
    let meminfo = fs::read_to_string("/proc/meminfo").ok().and_then(|text| mem_available(&text));
    let read = |name: &str| fs::read_to_string(format!("/sys/fs/cgroup/{name}")).ok()?.trim().parse::<f64>().ok();
    // `memory.max` is "max" when unlimited, which does not parse.
    let cgroup = read("memory.max").zip(read("memory.current")).map(|(max, current)| (max - current).max(0.0));
    match (meminfo, cgroup) {
        (Some(free), Some(allowed)) => Some(free.min(allowed)),
        (free, allowed) => free.or(allowed),
    }
}

fn mem_available(meminfo: &str) -> Option<f64> {
    let line = meminfo.lines().find(|line| line.starts_with("MemAvailable:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// Refuses, with the numbers, when the processes whose needs are `needs` (what `what` names)
/// would together exceed the memory this machine has available.
pub fn check_memory(what: &str, needs: &[HostMemory], remedy: &str) -> Result<()> {
    let Some(available) = available_memory_bytes() else { return Ok(()) };
    let total = needs.iter().fold(HostMemory::default(), |sum, &need| sum + need);
    if total.total_bytes() <= available {
        return Ok(());
    }
    let largest = needs.iter().map(HostMemory::total_bytes).fold(0.0, f64::max);
    let each = if needs.len() > 1 { format!("; the largest process {:.1} GiB", largest / GIB) } else { String::new() };
    bail!(
        "{what} would need about {:.1} GiB of host memory ({:.1} GiB model state, {:.1} GiB activations{each}), \
         but this machine has {:.1} GiB available; {remedy}",
        total.total_bytes() / GIB,
        total.state_bytes / GIB,
        total.activation_bytes / GIB,
        available / GIB,
    )
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
