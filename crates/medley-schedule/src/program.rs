//! The program format: what one rank executes in one training step, as plain data.

use std::fmt;

use medley_plan::LayerRange;
use medley_spec::ScheduleKind;
use serde::{Deserialize, Serialize};

/// A pipeline rank: place `pp_rank` in the pipeline of replica `replica` (with several chunks per
/// rank, the rank that runs virtual stages pp_rank, pp_rank + p, …). Every tensor-parallel
/// rank of the stage runs the same program; tensor-parallel collectives happen inside the
/// compute passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankId {
    /// Which replica (data-parallel copy of the pipeline) the rank belongs to.
    pub replica: u32,
    /// Its place in the replica's pipeline, 0 first; with virtual stages it runs chunks
    /// `pp_rank`, `pp_rank + p`, ...
    pub pp_rank: u32,
}

impl RankId {
    pub fn new(replica: usize, pp_rank: usize) -> Self {
        RankId { replica: replica as u32, pp_rank: pp_rank as u32 }
    }
}

impl fmt::Display for RankId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}s{}", self.replica, self.pp_rank)
    }
}

/// One step of a program. Micro-batch indices count from 0 within the rank's replica; `chunk` is
/// which of the rank's model chunks a pass runs on (0 when it holds one), and for a transfer the
/// sending chunk on both ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Instruction {
    /// The forward pass of the rank's layers on a micro-batch.
    Forward { micro_batch: u32, chunk: u32 },
    /// The whole backward pass: input and weight gradients.
    Backward { micro_batch: u32, chunk: u32 },
    /// The input-gradient half of the backward pass (zero-bubble schedules); it frees the
    /// micro-batch's activations except what the weight-gradient half reads.
    BackwardInput { micro_batch: u32, chunk: u32 },
    /// The weight-gradient half of the backward pass (zero-bubble schedules).
    BackwardWeight { micro_batch: u32, chunk: u32 },
    /// Sends the forward output to the next stage. Never blocks (see the crate docs).
    SendActivation { micro_batch: u32, chunk: u32, to: RankId },
    /// Receives the forward input from the previous stage; blocks until it has been sent.
    RecvActivation { micro_batch: u32, chunk: u32, from: RankId },
    /// Sends the input gradient to the previous stage. Never blocks.
    SendGradient { micro_batch: u32, chunk: u32, to: RankId },
    /// Receives the output gradient from the next stage; blocks until it has been sent.
    RecvGradient { micro_batch: u32, chunk: u32, from: RankId },
    /// All-reduces the gradients of `layers` over data-parallel group `plan.dp_groups[dp_group]`:
    /// one member per replica, the stage holding those layers. Blocks until every member arrives.
    AllReduceGradients { dp_group: u32, layers: LayerRange },
    /// Applies the optimizer to the rank's parameters; the last instruction of a step.
    OptimizerStep,
}

impl fmt::Display for Instruction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Instruction::Forward { micro_batch, chunk } => write!(f, "forward mb{micro_batch} c{chunk}"),
            Instruction::Backward { micro_batch, chunk } => write!(f, "backward mb{micro_batch} c{chunk}"),
            Instruction::BackwardInput { micro_batch, chunk } => {
                write!(f, "backward-input mb{micro_batch} c{chunk}")
            }
            Instruction::BackwardWeight { micro_batch, chunk } => {
                write!(f, "backward-weight mb{micro_batch} c{chunk}")
            }
            Instruction::SendActivation { micro_batch, chunk, to } => {
                write!(f, "send-activation mb{micro_batch} c{chunk} -> {to}")
            }
            Instruction::RecvActivation { micro_batch, chunk, from } => {
                write!(f, "recv-activation mb{micro_batch} c{chunk} <- {from}")
            }
            Instruction::SendGradient { micro_batch, chunk, to } => {
                write!(f, "send-gradient mb{micro_batch} c{chunk} -> {to}")
            }
            Instruction::RecvGradient { micro_batch, chunk, from } => {
                write!(f, "recv-gradient mb{micro_batch} c{chunk} <- {from}")
            }
            Instruction::AllReduceGradients { dp_group, layers } => {
                write!(f, "all-reduce-gradients dp{dp_group} layers {layers}")
            }
            Instruction::OptimizerStep => f.write_str("optimizer-step"),
        }
    }
}

/// What one rank executes in one training step, in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Program {
    pub rank: RankId,
    pub instructions: Vec<Instruction>,
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}:", self.rank)?;
        for (idx, instruction) in self.instructions.iter().enumerate() {
            writeln!(f, "  {idx:4}  {instruction}")?;
        }
        Ok(())
    }
}

impl Program {
    /// The data-parallel groups whose gradient reductions start with the backward pass just
    /// before instruction `next`, under overlapped reduction: the `AllReduceGradients` right
    /// after it, past its gradient send. Both engines start them there, and no others.
    pub fn reductions_following(&self, next: usize) -> impl Iterator<Item = u32> + '_ {
        self.instructions[next.min(self.instructions.len())..]
            .iter()
            .take_while(|i| matches!(i, Instruction::SendGradient { .. } | Instruction::AllReduceGradients { .. }))
            .filter_map(|instruction| match *instruction {
                Instruction::AllReduceGradients { dp_group, .. } => Some(dp_group),
                _ => None,
            })
    }
}

/// Every rank's program for one step of a plan, sorted by rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Programs {
    pub schedule: ScheduleKind,
    pub programs: Vec<Program>,
}

/// A step's programs proven correct for their plan by [`check`](crate::check): the only form the
/// engines take, so neither proves them again. [`generate`](crate::generate) returns them checked;
/// programs edited by hand are checked again through [`check`](crate::check).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct CheckedPrograms(Programs);

impl CheckedPrograms {
    /// Wraps programs [`check`](crate::check) has just proven.
    pub(crate) fn proven(programs: Programs) -> CheckedPrograms {
        CheckedPrograms(programs)
    }

    /// The programs, to edit (and check again).
    pub fn into_programs(self) -> Programs {
        self.0
    }
}

impl std::ops::Deref for CheckedPrograms {
    type Target = Programs;

    fn deref(&self) -> &Programs {
        &self.0
    }
}

impl fmt::Display for CheckedPrograms {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for Programs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "schedule {}", self.schedule)?;
        for program in &self.programs {
            write!(f, "{program}")?;
        }
        Ok(())
    }
}
