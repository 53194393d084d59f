//! Starting a job's ranks as processes on this machine, as torchrun does: each gets torchrun's
//! variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`), its vendor domain and a job token drawn from the operating system's random
//! source. The launcher hosts the job's rendezvous store itself, on a port the kernel picks, so
//! two jobs on one machine never race for a port and a stalled rank 0 does not take the store
//! with it. It watches the ranks: when one fails, the store tells the others at once (even if the
//! failed rank never joined them), and those still running after a grace period are killed.
//! Each rank's standard error is kept, and rank 0's standard output can be read as it comes.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, ChildStderr, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use medley_comm::{CommError, StoreServer};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum LaunchError {
    #[error("cannot start the job's rendezvous store: {0}")]
    Store(#[from] CommError),
    #[error("cannot draw a job token from the operating system's random source: {0}")]
    Token(String),
    #[error("cannot start rank {rank} ({program}): {error}")]
    Spawn { rank: usize, program: String, error: std::io::Error },
}

/// One rank's process: its arguments after the program, and its vendor domain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankCommand {
    pub args: Vec<OsString>,
    pub domain: String,
}

/// Where a rank's standard error lines go as they come (they are kept either way).
pub type Echo = Arc<dyn Fn(&str) + Send + Sync>;

/// A fresh 128-bit secret per job, from the operating system's random source: a stranger on
/// this machine cannot guess it to join the job.
pub fn job_token() -> Result<String, LaunchError> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|err| LaunchError::Token(err.to_string()))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// A job's ranks running on this machine.
pub struct LocalJob {
    children: Vec<Child>,
    stderr: Vec<KeptLines>,
    store: StoreServer,
    token: String,
    /// Set when the job is asked to stop: the ranks are sent SIGTERM once.
    stop: Option<Arc<AtomicBool>>,
}

/// A rank's standard error lines, read on a thread of their own.
struct KeptLines {
    lines: Arc<Mutex<Vec<String>>>,
    reader: JoinHandle<()>,
}

/// How long the last lines may take to arrive once every rank has ended: a process a rank
/// started may hold its standard error open, and the launcher does not wait for it.
const LAST_LINES: Duration = Duration::from_secs(1);

/// How a job's ranks ended.
#[derive(Debug)]
pub struct JobEnd {
    /// Exit status per rank; `None` for a rank the launcher had to kill.
    pub statuses: Vec<Option<ExitStatus>>,
    /// What each rank wrote to standard error, line by line.
    pub stderr: Vec<Vec<String>>,
}

impl JobEnd {
    pub fn succeeded(&self) -> bool {
        self.statuses.iter().all(|status| status.is_some_and(|status| status.success()))
    }

    /// The ranks that did not exit successfully.
    pub fn failed_ranks(&self) -> Vec<usize> {
        (0..self.statuses.len()).filter(|&rank| !self.statuses[rank].is_some_and(|status| status.success())).collect()
    }

    /// The last standard error line of the first rank that wrote one.
    pub fn first_error(&self) -> Option<&str> {
        self.stderr.iter().find_map(|lines| lines.last()).map(String::as_str)
    }

    /// How rank `rank` ended, in words.
    pub fn describe(&self, rank: usize) -> String {
        match self.statuses[rank] {
            None => "did not stop after the others failed; killed".to_string(),
            Some(status) => describe_exit(status),
        }
    }
}

/// `exited with status 2`, `killed by signal 9`.
pub fn describe_exit(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (_, Some(signal)) => format!("killed by signal {signal}"),
        (Some(code), _) => format!("exited with status {code}"),
        _ => "ended".into(),
    }
}

/// Where the launcher serves the job's store: its ranks run on this machine.
const STORE_IP: &str = "127.0.0.1";

/// The store's address as the ranks form it (`LaunchEnv::store_addr`) from MASTER_ADDR and
/// MASTER_PORT.
fn store_addr(store: &StoreServer) -> String {
    format!("{STORE_IP}:{}", store.port())
}

impl LocalJob {
    /// Starts `program` once per entry of `ranks`, rank r with `ranks[r]`'s arguments and domain;
    /// rank 0's standard output is piped for [`LocalJob::take_rank0_stdout`], the others'
    /// discarded; every standard error line goes to `echo` and is kept. If a rank cannot be
    /// started, those already started are killed.
    pub fn start(program: &Path, ranks: &[RankCommand], echo: Option<Echo>) -> Result<LocalJob, LaunchError> {
        let token = job_token()?;
        let store = StoreServer::bind(&format!("{STORE_IP}:0"), &token)?;
        let world = ranks.len().to_string();
        let mut children: Vec<Child> = Vec::new();
        for (rank, command) in ranks.iter().enumerate() {
            let spawned = Command::new(program)
                .args(&command.args)
                .envs([
                    ("RANK", rank.to_string()),
                    ("WORLD_SIZE", world.clone()),
                    ("LOCAL_RANK", rank.to_string()),
                    ("LOCAL_WORLD_SIZE", world.clone()),
                    ("MASTER_ADDR", STORE_IP.into()),
                    ("MASTER_PORT", store.port().to_string()),
                    ("MEDLEY_DOMAIN", command.domain.clone()),
                    ("MEDLEY_TOKEN", token.clone()),
                    ("MEDLEY_STORE_HOST", "launcher".into()),
                ])
                .stdin(Stdio::null())
                .stdout(if rank == 0 { Stdio::piped() } else { Stdio::null() })
                .stderr(Stdio::piped())
                .spawn();
            match spawned {
                Ok(child) => {
                    tracing::debug!(rank, pid = child.id(), domain = %command.domain, "started");
                    children.push(child);
                }
                Err(error) => {
                    for child in &mut children {
                        child.kill().ok();
                        child.wait().ok();
                    }
                    medley_comm::remove_job_shared_memory(&token, &store_addr(&store));
                    return Err(LaunchError::Spawn { rank, program: program.display().to_string(), error });
                }
            }
        }
        let stderr =
            children.iter_mut().map(|child| keep_lines(child.stderr.take().expect("piped"), echo.clone())).collect();
        Ok(LocalJob { children, stderr, store, token, stop: None })
    }

    /// Rank 0's standard output (once).
    pub fn take_rank0_stdout(&mut self) -> Option<ChildStdout> {
        self.children.first_mut().and_then(|child| child.stdout.take())
    }

    /// Passes a request to stop on to the ranks: once `flag` is set, [`LocalJob::wait`] sends
    /// each running rank SIGTERM (once), which medley's workers take as a request to stop at the
    /// end of the step.
    pub fn forward_stop(&mut self, flag: Arc<AtomicBool>) {
        self.stop = Some(flag);
    }

    /// Waits for every rank. Once one has failed the store tells the others, which get `grace`
    /// to notice and report; any still running then, or at `deadline`, is killed.
    pub fn wait(mut self, grace: Duration, deadline: Option<Instant>) -> JobEnd {
        let mut statuses = vec![None; self.children.len()];
        let mut failed_at: Option<Instant> = None;
        let mut stop_forwarded = false;
        loop {
            if !stop_forwarded && self.stop.as_ref().is_some_and(|flag| flag.load(Ordering::Acquire)) {
                stop_forwarded = true;
                for (child, _) in self.children.iter().zip(&statuses).filter(|(_, status)| status.is_none()) {
                    let pid = rustix::process::Pid::from_raw(child.id() as i32);
                    // A rank that has just exited is no longer there to ask: nothing to do.
                    pid.map(|pid| rustix::process::kill_process(pid, rustix::process::Signal::TERM).ok());
                }
            }
            for (rank, (child, status)) in self.children.iter_mut().zip(statuses.iter_mut()).enumerate() {
                if status.is_none()
                    && let Ok(Some(exit)) = child.try_wait()
                {
                    tracing::debug!(rank, "{}", describe_exit(exit));
                    if !exit.success() && failed_at.is_none() {
                        failed_at = Some(Instant::now());
                        self.store.report_failure(rank, &format!("worker {rank} {}", describe_exit(exit)));
                    }
                    *status = Some(exit);
                }
            }
            // A rank the job blames that is all that still runs (stopped, say) has nobody left
            // to report to: no grace to wait out.
            let blamed = self.store.blamed();
            let only_blamed_left = failed_at.is_some()
                && statuses.iter().enumerate().all(|(rank, status)| status.is_some() || Some(rank) == blamed);
            let out_of_time = failed_at.is_some_and(|at| at.elapsed() > grace)
                || only_blamed_left
                || deadline.is_some_and(|deadline| Instant::now() > deadline);
            if statuses.iter().all(Option::is_some) || out_of_time {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for (rank, (child, status)) in self.children.iter_mut().zip(&statuses).enumerate() {
            if status.is_none() {
                tracing::debug!(rank, "still running: killed");
                child.kill().ok();
                child.wait().ok();
            }
        }
        // Ranks killed while joining had no time to remove their shared-memory files.
        let removed = medley_comm::remove_job_shared_memory(&self.token, &store_addr(&self.store));
        if removed > 0 {
            tracing::debug!("removed {removed} shared-memory files the ranks left");
        }
        // The pipes close when the ranks exit, and the readers then have every last line.
        let lines_by = Instant::now() + LAST_LINES;
        while Instant::now() < lines_by && !self.stderr.iter().all(|kept| kept.reader.is_finished()) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let stderr = self.stderr.iter().map(|kept| kept.lines.lock().map(|lines| lines.clone()).unwrap_or_default());
        JobEnd { statuses, stderr: stderr.collect() }
    }
}

/// Reads a rank's standard error to its end on a thread of its own, passing each line to `echo`.
fn keep_lines(stderr: ChildStderr, echo: Option<Echo>) -> KeptLines {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&lines);
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(echo) = &echo {
                echo(&line);
            }
            if let Ok(mut lines) = kept.lock() {
                lines.push(line);
            }
        }
    });
    KeptLines { lines, reader }
}
