use std::path::PathBuf;

use medley_comm::CommError;
use medley_model::ModelError;
use medley_schedule::ScheduleError;

/// Why a worker stopped. Failures caused by another worker carry its job rank through
/// [`CommError::blamed_rank`].
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("the runtime cannot run this plan: {0}")]
    Unsupported(String),
    #[error("launch: {0}")]
    Launch(String),
    #[error("compute device: {0}")]
    Device(String),
    /// An emulated link too slow to deliver a message within the job's timeout.
    #[error("{0}")]
    LinkTooSlow(String),
    #[error("schedule: {0}")]
    Schedule(#[from] ScheduleError),
    #[error("{during}: {error}")]
    Comm { during: String, error: CommError },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{}: {reason}", path.display())]
    Checkpoint { path: PathBuf, reason: String },
    /// The workers would not fit in this machine's memory.
    #[error("{0}")]
    HostMemory(String),
    /// A run directory refused (in use, holding another run) or one that does not read.
    #[error("{0}")]
    RunDirectory(String),
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
    #[error("program of {rank}: {reason}")]
    Program { rank: String, reason: String },
    #[error(
        "training diverged at step {step}: {what}; that step was not checkpointed and the checkpoints before it \
         are kept (try a lower learning rate)"
    )]
    Diverged { step: u64, what: String },
}

impl RuntimeError {
    /// Zero-bubble schedules split the backward pass, which the runtime's stages cannot yet.
    pub(crate) fn zero_bubble() -> RuntimeError {
        RuntimeError::Unsupported(
            "zero-bubble schedules (zb-h1) need a split backward, which the runtime's stages do not have yet; use 1f1b, kfkb:K, gpipe or adaptive".into(),
        )
    }

    /// The job rank of the worker that caused this failure, if another one did.
    pub fn blamed_rank(&self) -> Option<usize> {
        match self {
            RuntimeError::Comm { error, .. } => error.blamed_rank(),
            _ => None,
        }
    }
}

/// Adds what the worker was doing to a communicator error.
pub(crate) trait CommContext<T> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T, RuntimeError>;
}

impl<T> CommContext<T> for Result<T, CommError> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T, RuntimeError> {
        self.map_err(|error| RuntimeError::Comm { during: what(), error })
    }
}
