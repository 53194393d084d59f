use thiserror::Error;

use crate::{Algorithm, Counts, Op};

/// Why a collective cannot be planned.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CollectiveError {
    #[error("a group needs at least one rank")]
    EmptyGroup,
    #[error("root {root} is not a rank of a group of {n_ranks}")]
    RootOutOfRange { root: usize, n_ranks: usize },
    #[error("algorithm {algorithm:?} is not implemented for {op:?}")]
    Unsupported { algorithm: Algorithm, op: Op },
    #[error(
        "counts {counts:?} do not fit {op:?} over {n_ranks} ranks (all-reduce, broadcast and reduce take same(n), reduce-scatter and all-gather per-rank with one count per rank, all-to-all per-pair n×n, barrier same(0))"
    )]
    CountsShape { op: Op, n_ranks: usize, counts: Counts },
    #[error("element counts overflow usize")]
    CountOverflow,
    #[error("rank {rank}'s window {window:?} is read before any step writes it whole")]
    UnwrittenWindow { rank: usize, window: std::ops::Range<usize> },
}
