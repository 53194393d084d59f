//! Binding a rank to its share of the cores, as `mpirun` does by default when the host has a
//! core per rank.
//!
//! Two ranks that wait on each other by polling run a small collective in about a microsecond
//! when each has a core of its own, but the scheduler often keeps them on one core (a futex wake
//! pulls the woken rank next to its waker), where every message costs a switch between them:
//! measured on a 2-core machine, a 4 KiB all-reduce of 2 processes took 3.5 µs pinned to one
//! core and 1.2 µs pinned to two. A host with more cores than local ranks gives each rank a
//! contiguous block of them, for its compute threads. Hosts with more ranks than cores are left to
//! the scheduler.

use crate::env::{CpuBinding, LaunchEnv};

/// The CPUs a rank computes on: those it was bound to, or its fair share of the host's when the
/// scheduler places it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Cores {
    Bound(Vec<usize>),
    Shared { share: usize },
}

impl Cores {
    /// How many threads the rank's compute should run on: one per core it owns, at least one.
    pub(crate) fn threads(&self) -> usize {
        match self {
            Cores::Bound(cpus) => cpus.len(),
            Cores::Shared { share } => *share,
        }
    }
}

/// Binds the calling thread (and the threads it starts afterwards) to the `local_rank`-th block
/// of the CPUs it may run on, when `env` asks for it and every local rank can have at least one
/// CPU of its own. Best effort: a refusal (a cgroup's restriction, say) leaves the thread where it
/// was, as an unbound rank still works.
pub(crate) fn bind_to_cores(env: &LaunchEnv) -> Cores {
    let allowed = allowed_cpus().unwrap_or_default();
    let share = Cores::Shared { share: (allowed.len() / env.local_world_size.max(1)).max(1) };
    if env.cpu_binding == CpuBinding::None
        || env.local_world_size > allowed.len()
        || env.local_rank >= env.local_world_size
    {
        return share;
    }
    let block = |rank: usize| rank * allowed.len() / env.local_world_size;
    let cpus = allowed[block(env.local_rank)..block(env.local_rank + 1)].to_vec();
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes within it for cpu < CPU_SETSIZE,
    // which `allowed_cpus` guarantees.
    let bound = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        cpus.iter().for_each(|&cpu| libc::CPU_SET(cpu, &mut set));
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) == 0
    };
    if bound { Cores::Bound(cpus) } else { share }
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
    fn a_rank_gets_its_own_cores_only_when_every_local_rank_can() {
        // Run on threads of their own: binding outlives the test otherwise.
        let allowed = allowed_cpus().expect("readable affinity");
        let n = allowed.len();
        let bind = |local_rank, local_world_size, binding| {
            std::thread::spawn(move || (bind_to_cores(&env(local_rank, local_world_size, binding)), allowed_cpus()))
                .join()
                .unwrap()
        };
        assert_eq!(bind(0, n + 1, CpuBinding::Core).0, Cores::Shared { share: 1 });
        assert_eq!(bind(0, 1, CpuBinding::None).0, Cores::Shared { share: n });
        let last = n - 1;
        assert_eq!(bind(last, n, CpuBinding::Core), (Cores::Bound(vec![allowed[last]]), Some(vec![allowed[last]])));
        // A lone rank owns every core, and computes on as many threads.
        let (alone, now) = bind(0, 1, CpuBinding::Core);
        assert_eq!((alone.threads(), now), (n, Some(allowed.clone())));
    }

    #[test]
    fn the_blocks_cover_every_core_once() {
        let allowed = allowed_cpus().expect("readable affinity");
        for ranks in 1..=allowed.len() {
            let blocks: Vec<usize> = (0..ranks)
                .flat_map(|rank| {
                    let allowed = allowed.clone();
                    std::thread::spawn(move || match bind_to_cores(&env(rank, ranks, CpuBinding::Core)) {
                        Cores::Bound(cpus) => cpus,
                        shared => panic!("rank {rank} of {ranks} was not bound: {shared:?} on {allowed:?}"),
                    })
                    .join()
                    .unwrap()
                })
                .collect();
            assert_eq!(blocks, allowed, "{ranks} ranks");
        }
    }
}
