//! Lowering: a schedule's order of compute passes becomes each rank's program, with the
//! point-to-point transfers around every pass and the gradient synchronisation at the end.

use medley_plan::Plan;

use crate::program::{Instruction, Program, Programs, RankId};
use crate::schedules::{Pass, ScheduleKind};

/// The model chunk every rank holds while plans give each rank one contiguous range of layers.
const ONLY_CHUNK: u32 = 0;

/// Every rank's program for one step of `plan` under `schedule`. The plan must have passed
/// [`Plan::validate`]; replicas may differ in depth, layer split and micro-batch count, each
/// running its own pipeline.
pub fn generate(plan: &Plan, schedule: ScheduleKind) -> Programs {
    let mut programs = Vec::new();
    for (replica_idx, replica) in plan.replicas.iter().enumerate() {
        let n_stages = replica.stages.len();
        for stage_idx in 0..n_stages {
            let rank = RankId::new(replica_idx, stage_idx);
            let passes = schedule.passes(stage_idx, n_stages, replica.n_micro_batches);
            let mut instructions = lower_passes(rank, n_stages, &passes);
            instructions.extend(synchronise(plan, rank));
            programs.push(Program { rank, instructions });
        }
    }
    Programs { schedule, programs }
}

/// Wraps each pass in the transfers it needs: a forward receives its input from the previous
/// stage and sends its output to the next; a backward receives its output gradient from the
/// next stage and sends its input gradient to the previous. The weight-gradient half of a split
/// backward reads only local tensors.
fn lower_passes(rank: RankId, n_stages: usize, passes: &[Pass]) -> Vec<Instruction> {
    let stage_idx = rank.stage_idx as usize;
    let previous = (stage_idx > 0).then(|| RankId { stage_idx: rank.stage_idx - 1, ..rank });
    let next = (stage_idx + 1 < n_stages).then(|| RankId { stage_idx: rank.stage_idx + 1, ..rank });
    let chunk = ONLY_CHUNK;
    let mut instructions = Vec::with_capacity(passes.len() * 3 + 2);
    for &pass in passes {
        match pass {
            Pass::Forward(micro_batch) => {
                if let Some(from) = previous {
                    instructions.push(Instruction::RecvActivation { micro_batch, chunk, from });
                }
                instructions.push(Instruction::Forward { micro_batch, chunk });
                if let Some(to) = next {
                    instructions.push(Instruction::SendActivation { micro_batch, chunk, to });
                }
            }
            Pass::Backward(micro_batch) | Pass::BackwardInput(micro_batch) => {
                if let Some(from) = next {
                    instructions.push(Instruction::RecvGradient { micro_batch, chunk, from });
                }
                instructions.push(match pass {
                    Pass::Backward(_) => Instruction::Backward { micro_batch, chunk },
                    _ => Instruction::BackwardInput { micro_batch, chunk },
                });
                if let Some(to) = previous {
                    instructions.push(Instruction::SendGradient { micro_batch, chunk, to });
                }
            }
            Pass::BackwardWeight(micro_batch) => {
                instructions.push(Instruction::BackwardWeight { micro_batch, chunk });
            }
        }
    }
    instructions
}

/// The end of a step: one all-reduce per data-parallel group whose layers the stage holds, last
/// layers first (the order backward finishes them, and one order for every member so the
/// collectives cannot wait on each other in a cycle), then the optimizer step.
fn synchronise(plan: &Plan, rank: RankId) -> Vec<Instruction> {
    let stage = &plan.replicas[rank.replica_idx as usize].stages[rank.stage_idx as usize];
    let mut instructions: Vec<Instruction> = plan
        .dp_groups
        .iter()
        .enumerate()
        .rev()
        .filter(|(_, group)| stage.layers.contains(group.layers))
        .map(|(dp_group, group)| Instruction::AllReduceGradients { dp_group: dp_group as u32, layers: group.layers })
        .collect();
    instructions.push(Instruction::OptimizerStep);
    instructions
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_are_wrapped_in_their_transfers() {
        let rank = RankId::new(1, 1);
        let (previous, next) = (RankId::new(1, 0), RankId::new(1, 2));
        let passes = [Pass::Forward(0), Pass::BackwardInput(0), Pass::BackwardWeight(0)];
        let chunk = 0;
        assert_eq!(
            lower_passes(rank, 3, &passes),
            [
                Instruction::RecvActivation { micro_batch: 0, chunk, from: previous },
                Instruction::Forward { micro_batch: 0, chunk },
                Instruction::SendActivation { micro_batch: 0, chunk, to: next },
                Instruction::RecvGradient { micro_batch: 0, chunk, from: next },
                Instruction::BackwardInput { micro_batch: 0, chunk },
                Instruction::SendGradient { micro_batch: 0, chunk, to: previous },
                Instruction::BackwardWeight { micro_batch: 0, chunk },
            ]
        );
        // A single-stage pipeline transfers nothing.
        assert_eq!(
            lower_passes(RankId::new(0, 0), 1, &[Pass::Forward(0), Pass::Backward(0)]),
            [Instruction::Forward { micro_batch: 0, chunk }, Instruction::Backward { micro_batch: 0, chunk }]
        );
    }
}
