//! The launch environment: torchrun's variables plus medley's domain and job token. The caller
//! passes the variables in (the binary reads the process environment; this crate does not).

use std::time::Duration;

use crate::CommError;

/// Where this rank stands in the job and how to reach the others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// The vendor domain (`MEDLEY_DOMAIN`, e.g. `nvidia`, `amd`); one domain when unset.
    pub domain: String,
    /// The shared job secret (`MEDLEY_TOKEN`): the store refuses connections without it.
    pub token: String,
    /// Whether the rank binds itself to a core (`MEDLEY_CPU_BIND`: `core`, the default, or `none`).
    pub cpu_binding: CpuBinding,
    /// Who hosts the rendezvous store at MASTER_ADDR:MASTER_PORT (`MEDLEY_STORE_HOST`: `rank0`,
    /// the default, or `launcher`).
    pub store_host: StoreHost,
}

/// Where the job's rendezvous store runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreHost {
    /// Rank 0 binds MASTER_PORT and serves the store (torchrun's static rendezvous).
    Rank0,
    /// The launcher serves it (a [`crate::StoreServer`] it bound before starting the ranks, as
    /// torchrun's agent does): it picks a free port with no race, and outlives a stalled rank 0.
    Launcher,
}

/// Whether a rank pins itself to one core of its host ([`crate::Communicator::init`] does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuBinding {
    /// Local rank i runs on the i-th CPU it may use, when the host has a CPU per local rank (as
    /// `mpirun`'s default binding); otherwise the scheduler places it.
    Core,
    /// The scheduler places the rank.
    None,
}

impl LaunchEnv {
    /// Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and MEDLEY_TOKEN (required), LOCAL_RANK,
    /// LOCAL_WORLD_SIZE, MEDLEY_DOMAIN, MEDLEY_CPU_BIND and MEDLEY_STORE_HOST (optional) from
    /// `vars`.
    pub fn from_vars<K: AsRef<str>, V: Into<String>>(
        vars: impl IntoIterator<Item = (K, V)>,
    ) -> Result<LaunchEnv, CommError> {
        let vars: std::collections::BTreeMap<String, String> =
            vars.into_iter().map(|(k, v)| (k.as_ref().to_string(), v.into())).collect();
        let text = |name: &str| vars.get(name).cloned().ok_or_else(|| CommError::Env(format!("{name} is not set")));
        let number = |name: &str| -> Result<Option<usize>, CommError> {
            vars.get(name)
                .map(|v| {
                    v.trim().parse().map_err(|_| CommError::Env(format!("{name}={v:?} is not a non-negative integer")))
                })
                .transpose()
        };
        let required = |name: &str| number(name)?.ok_or_else(|| CommError::Env(format!("{name} is not set")));
        let (rank, world_size) = (required("RANK")?, required("WORLD_SIZE")?);
        if rank >= world_size {
            return Err(CommError::Env(format!("RANK={rank} is not below WORLD_SIZE={world_size}")));
        }
        let master_port = text("MASTER_PORT")?;
        let master_port = master_port
            .trim()
            .parse()
            .map_err(|_| CommError::Env(format!("MASTER_PORT={master_port:?} is not a port")))?;
        let token = text("MEDLEY_TOKEN")?;
        if token.is_empty() {
            return Err(CommError::Env("MEDLEY_TOKEN is empty: every rank of the job needs the same secret".into()));
        }
        let cpu_binding = match vars.get("MEDLEY_CPU_BIND").map(|v| v.trim()) {
            None | Some("core") => CpuBinding::Core,
            Some("none") => CpuBinding::None,
            Some(other) => {
                return Err(CommError::Env(format!("MEDLEY_CPU_BIND={other:?} is neither \"core\" nor \"none\"")));
            }
        };
        let store_host = match vars.get("MEDLEY_STORE_HOST").map(|v| v.trim()) {
            None | Some("rank0") => StoreHost::Rank0,
            Some("launcher") => StoreHost::Launcher,
            Some(other) => {
                return Err(CommError::Env(format!(
                    "MEDLEY_STORE_HOST={other:?} is neither \"rank0\" nor \"launcher\""
                )));
            }
        };
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank: number("LOCAL_RANK")?.unwrap_or(rank),
            local_world_size: number("LOCAL_WORLD_SIZE")?.unwrap_or(world_size),
            master_addr: text("MASTER_ADDR")?,
            master_port,
            domain: vars.get("MEDLEY_DOMAIN").cloned().unwrap_or_else(|| "default".into()),
            token,
            cpu_binding,
            store_host,
        })
    }

    pub fn store_addr(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }
}

/// Which transport carries messages between two ranks on one host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// Single-copy shared memory (the native backend on this machine).
    Shm,
    Tcp,
}

/// How a communicator behaves; the defaults suit one host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// How long a rank waits for a peer without progress before blaming it.
    pub timeout: Duration,
    /// How long rendezvous may take (processes start at different times).
    pub connect_timeout: Duration,
    /// Parallel TCP streams per peer pair; big messages are striped over them.
    pub tcp_streams: usize,
    /// Between ranks of one domain on one host.
    pub intra_domain: TransportKind,
    /// Between ranks of different domains on one host (always TCP across hosts).
    pub bridge: TransportKind,
    /// The largest message pipelined algorithms send.
    pub chunk_bytes: usize,
    /// Emulates a slower bridge: caps each TCP link between ranks of different domains at this
    /// many bytes per second, all its streams together (as a vendor-to-vendor path through host
    /// memory or a NIC is slower than either side's native links). `None`: as fast as TCP goes.
    pub bridge_bytes_per_s: Option<u64>,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(60),
            tcp_streams: 2,
            intra_domain: TransportKind::Shm,
            bridge: TransportKind::Tcp,
            chunk_bytes: 1 << 20,
            bridge_bytes_per_s: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(extra: &[(&str, &str)]) -> Vec<(String, String)> {
        let base = [
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("MEDLEY_TOKEN", "s"),
        ];
        base.iter().chain(extra).map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn torchrun_variables_parse_and_bad_ones_are_named() {
        let env = LaunchEnv::from_vars(vars(&[("MEDLEY_DOMAIN", "amd"), ("LOCAL_RANK", "0")])).unwrap();
        assert_eq!((env.rank, env.world_size, env.local_rank, env.domain.as_str()), (1, 4, 0, "amd"));
        assert_eq!(env.store_addr(), "127.0.0.1:29500");
        let err = LaunchEnv::from_vars(vars(&[("RANK", "4")])).unwrap_err();
        assert!(err.to_string().contains("RANK=4"), "{err}");
        let err = LaunchEnv::from_vars(vars(&[("MASTER_PORT", "http")])).unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT"), "{err}");
        let no_token: Vec<_> = vars(&[]).into_iter().filter(|(k, _)| k != "MEDLEY_TOKEN").collect();
        assert!(LaunchEnv::from_vars(no_token).unwrap_err().to_string().contains("MEDLEY_TOKEN"));
        assert_eq!(env.cpu_binding, CpuBinding::Core);
        let unbound = LaunchEnv::from_vars(vars(&[("MEDLEY_CPU_BIND", "none")])).unwrap();
        assert_eq!(unbound.cpu_binding, CpuBinding::None);
        let err = LaunchEnv::from_vars(vars(&[("MEDLEY_CPU_BIND", "socket")])).unwrap_err();
        assert!(err.to_string().contains("MEDLEY_CPU_BIND=\"socket\""), "{err}");
    }
}
