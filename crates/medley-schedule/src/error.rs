//! Why a plan's schedule cannot be generated or its programs are wrong.

use medley_spec::ScheduleKind;
use thiserror::Error;

use crate::program::{Instruction, RankId};

/// Why a step's programs are wrong.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ScheduleError {
    /// A schedule that does not run the plan's chunks per rank.
    #[error(
        "schedule {schedule} does not run a plan with {virtual_stages} virtual stage(s) per rank: interleaved needs more than one, every other schedule exactly one"
    )]
    ChunkMismatch { schedule: ScheduleKind, virtual_stages: u32 },
    /// Interleaved 1F1B over a micro-batch count its order cannot pipeline without deadlock.
    #[error(
        "replica {replica_idx}: interleaved 1F1B needs a micro-batch count that is a multiple of its {n_ranks} ranks or below it, not {n_micro_batches}"
    )]
    InterleavedMicroBatches { replica_idx: usize, n_micro_batches: u32, n_ranks: u32 },
    /// The programs are not one per pipeline position of the plan.
    #[error("the programs are for ranks [{found}]; the plan has ranks [{expected}]")]
    Ranks { expected: String, found: String },
    /// An instruction that names something the rank does not have, or comes before what it needs.
    #[error("{rank}: instruction {idx} `{instruction}`: {reason}")]
    Malformed { rank: RankId, idx: usize, instruction: Instruction, reason: String },
    /// A micro-batch's pass runs other than once on one of the rank's chunks.
    #[error("{rank}: micro-batch {micro_batch} runs {pass} on chunk {chunk} {count} times, expected once")]
    PassCount { rank: RankId, micro_batch: u32, chunk: u32, pass: &'static str, count: u32 },
    /// The rank does not synchronise exactly the data-parallel groups whose layers it holds.
    #[error("{rank}: all-reduces dp groups {found:?}, expected {expected:?}")]
    DpGroups { rank: RankId, expected: Vec<u32>, found: Vec<u32> },
    /// More micro-batches are in flight (forwarded, backward not finished) than the schedule
    /// promises.
    #[error("{rank}: holds {peak} micro-batches in flight, the schedule promises at most {promised}")]
    InFlight { rank: RankId, peak: u32, promised: u32 },
    /// A send without a receive, or a receive without a send.
    #[error("{rank}: instruction {idx} `{instruction}` has no matching {counterpart} on its peer")]
    Unmatched { rank: RankId, idx: usize, instruction: Instruction, counterpart: &'static str },
    /// No rank can make progress before every program has finished.
    #[error("deadlock: no rank can progress; blocked: {blocked}")]
    Deadlock { blocked: String },
}
