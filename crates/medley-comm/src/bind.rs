//! Binding a rank to one core, as `mpirun` does by default when the host has a core per rank.
//!
//! Two ranks that wait on each other by polling run a small collective in about a microsecond
//! when each has a core of its own, but the scheduler often keeps them on one core (a futex wake
//! pulls the woken rank next to its waker), where every message costs a switch between them:
//! measured on a 2-core machine, a 4 KiB all-reduce of 2 processes took 3.5 µs pinned to one
//! core and 1.2 µs pinned to two. Hosts with more ranks than cores are left to the scheduler.

use crate::env::{CpuBinding, LaunchEnv};

/// Binds the calling thread (and the threads it starts afterwards) to the `local_rank`-th CPU
/// it may run on, when `env` asks for it and every local rank can have a CPU of its own.
/// Returns the CPU, or `None` when nothing was bound. Best effort: a refusal (a cgroup's
/// restriction, say) leaves the thread where it was, as an unbound rank still works.
pub(crate) fn bind_to_core(env: &LaunchEnv) -> Option<usize> {
    if env.cpu_binding == CpuBinding::None {
        return None;
    }
    let allowed = allowed_cpus()?;
    if env.local_world_size > allowed.len() {
        return None;
    }
    let cpu = *allowed.get(env.local_rank)?;
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes within it for cpu < CPU_SETSIZE,
    // which `allowed_cpus` guarantees.
    let bound = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) == 0
    };
    bound.then_some(cpu)
}

/// The CPUs the calling thread may run on, ascending.
fn allowed_cpus() -> Option<Vec<usize>> {
    // SAFETY: the kernel writes at most `size_of::<cpu_set_t>()` bytes into `set`; CPU_ISSET reads
    // within it for indices below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        Some((0..libc::CPU_SETSIZE as usize).filter(|&cpu| libc::CPU_ISSET(cpu, &set)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(local_rank: usize, local_world_size: usize, cpu_binding: CpuBinding) -> LaunchEnv {
        LaunchEnv {
            rank: local_rank,
            world_size: local_world_size,
            local_rank,
            local_world_size,
            master_addr: "127.0.0.1".into(),
            master_port: 1,
            domain: "default".into(),
            token: "t".into(),
            cpu_binding,
            store_host: crate::StoreHost::Rank0,
        }
    }

    #[test]
    fn a_rank_gets_its_own_core_only_when_every_local_rank_can() {
        // Run on a thread of its own: binding outlives the test otherwise.
        std::thread::spawn(|| {
            let allowed = allowed_cpus().expect("readable affinity");
            assert_eq!(bind_to_core(&env(0, allowed.len() + 1, CpuBinding::Core)), None);
            assert_eq!(bind_to_core(&env(0, 1, CpuBinding::None)), None);
            let last = allowed.len() - 1;
            assert_eq!(bind_to_core(&env(last, allowed.len(), CpuBinding::Core)), Some(allowed[last]));
            assert_eq!(allowed_cpus(), Some(vec![allowed[last]]));
        })
        .join()
        .unwrap();
    }
}
