//! One rank's membership in a job: its store connection, failure monitor and abort flag, shared
//! by the world communicator and every communicator split from it. Rank 0 also hosts the store
//! unless the launcher does.

use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a rank whose peer hung up waits for that peer's own failure report.
const PEER_REPORT_GRACE: Duration = Duration::from_millis(250);

use crate::CommError;
use crate::bind::Cores;
use crate::env::{Config, LaunchEnv, StoreHost};
use crate::store::{Monitor, StoreClient, StoreServer};
use crate::wait::{Abort, Blame, JoinBudget};

pub(crate) struct Session {
    pub env: LaunchEnv,
    pub store: StoreClient,
    pub abort: Arc<Abort>,
    /// The CPUs this rank was bound to when it joined, or its share of the host's.
    pub cores: Cores,
    timeout: Duration,
    /// The job's join, from the moment this rank started joining: `Config::connect_timeout`.
    pub join_budget: JoinBudget,
    monitor: Option<Monitor>,
    server: Option<StoreServer>,
}

impl Session {
    /// Joins the job, first binding the calling thread to a core as `env` asks (see
    /// [`crate::CpuBinding`]): the store's threads started here inherit the binding.
    pub fn join(env: &LaunchEnv, config: &Config) -> Result<Session, CommError> {
        let join_budget = JoinBudget::from_now(config.connect_timeout);
        let cores = crate::bind::bind_to_cores(env);
        let addr = env.store_addr();
        let hosts_store = env.rank == 0 && env.store_host == StoreHost::Rank0;
        let server = if hosts_store { Some(StoreServer::bind(&addr, &env.token)?) } else { None };
        let store = StoreClient::connect(&addr, &env.token, env.rank, config.connect_timeout)?;
        let abort = Arc::new(Abort::default());
        let monitor = Monitor::start(&addr, &env.token, env.rank, config.connect_timeout, Arc::clone(&abort))?;
        Ok(Session {
            env: env.clone(),
            store,
            abort,
            cores,
            timeout: config.timeout,
            join_budget,
            monitor: Some(monitor),
            server,
        })
    }

    /// Records a failure this rank found and tells the job who is to blame; returns the error to
    /// report. A peer that closed its connection may have done so because it failed first: its
    /// report, if it comes within a moment, names the rank really to blame.
    pub fn fail(&self, err: CommError) -> CommError {
        if matches!(err, CommError::PeerGone { .. }) {
            let deadline = Instant::now() + PEER_REPORT_GRACE;
            while Instant::now() < deadline {
                if let Err(cause) = self.abort.check() {
                    return cause;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        self.abort.raise(err.clone());
        if let Some(blamed) = err.blamed_rank()
            && !matches!(err, CommError::Aborted { .. })
        {
            let reason = format!("rank {} reports: {err}", self.env.rank);
            self.store.report_failure(blamed, &reason).ok();
        }
        err
    }
}

fn waiting_key(rank: usize) -> String {
    format!("waiting/{rank}")
}

/// Long waits are posted in the store under `waiting/RANK` (the job rank waited on, or empty).
impl Blame for Session {
    fn waiting_on(&self, peer: Option<usize>) {
        let value = peer.map(|p| p.to_string()).unwrap_or_default();
        self.store.set(&waiting_key(self.env.rank), value.as_bytes()).ok();
    }

    fn culprit(&self, peer: usize) -> usize {
        let mut seen = vec![self.env.rank, peer];
        let mut culprit = peer;
        loop {
            let next = self.store.try_get(&waiting_key(culprit)).ok().flatten();
            match next.and_then(|bytes| String::from_utf8_lossy(&bytes).parse::<usize>().ok()) {
                // A cycle of waits (ranks in different calls) blames the last rank before it.
                Some(next) if !seen.contains(&next) => {
                    seen.push(next);
                    culprit = next;
                }
                _ => return culprit,
            }
        }
    }
}

impl Drop for Session {
    /// Says goodbye so closing the monitor is no failure; rank 0 keeps the store up until every
    /// rank has left (or the timeout), since late ranks may still need it.
    fn drop(&mut self) {
        self.store.goodbye().ok();
        if let Some(server) = &self.server {
            server.wait_finished(self.env.world_size, self.timeout);
        }
        self.monitor.take();
        self.server.take();
    }
}
