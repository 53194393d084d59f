use std::time::Duration;
use thiserror::Error;

use medley_collective::CollectiveError;

/// Why a communicator operation failed. Every failure caused by another process names its rank
/// (in the communicator that saw it, or in the job for store and abort messages).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CommError {
    #[error("launch environment: {0}")]
    Env(String),
    #[error("cannot plan the collective: {0}")]
    Plan(#[from] CollectiveError),
    #[error("{what}: buffer of {got} elements, the operation needs {expected}")]
    BufferLength { what: &'static str, expected: usize, got: usize },
    #[error("rank {peer} is not a rank of this communicator of {n_ranks}")]
    NoSuchRank { peer: usize, n_ranks: usize },
    #[error("{context}: {message}")]
    Io { context: String, message: String },
    #[error("the store at {addr} refused this process: {reason}")]
    Refused { addr: String, reason: String },
    #[error("rank {rank} did not answer within {waited:?} ({what})")]
    Timeout { rank: usize, waited: Duration, what: &'static str },
    #[error("rank {rank} closed its connection ({what})")]
    PeerGone { rank: usize, what: String },
    #[error("job aborted: rank {rank} failed: {reason}")]
    Aborted { rank: usize, reason: String },
    #[error(
        "rank {rank} sent a frame for another operation: expected fingerprint {expected_fingerprint:#018x} call #{expected_seq} with {expected_bytes} bytes, got fingerprint {got_fingerprint:#018x} call #{got_seq} with {got_bytes} bytes (ranks called different collectives, sizes or types)"
    )]
    Mismatch {
        rank: usize,
        expected_fingerprint: u64,
        expected_seq: u64,
        expected_bytes: u64,
        got_fingerprint: u64,
        got_seq: u64,
        got_bytes: u64,
    },
    #[error("rank {rank} sent a malformed frame: {reason}")]
    Malformed { rank: usize, reason: String },
    #[error(
        "algorithm {algorithm:?} reads peers' memory directly: it needs every rank of the communicator on one host, in one domain, joined by shared memory"
    )]
    NeedsWindows { algorithm: medley_collective::Algorithm },
    #[error("store: {0}")]
    Store(String),
}

impl CommError {
    pub(crate) fn io(context: impl Into<String>, err: &std::io::Error) -> CommError {
        CommError::Io { context: context.into(), message: err.to_string() }
    }

    /// The rank this error blames, if another rank caused it.
    pub fn blamed_rank(&self) -> Option<usize> {
        match self {
            CommError::Timeout { rank, .. }
            | CommError::PeerGone { rank, .. }
            | CommError::Aborted { rank, .. }
            | CommError::Mismatch { rank, .. }
            | CommError::Malformed { rank, .. } => Some(*rank),
            _ => None,
        }
    }
}
