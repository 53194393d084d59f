//! Lowering: a schedule's order of compute passes becomes each rank's program, with the
//! point-to-point transfers around every pass and the gradient synchronisation at the end.

use medley_plan::Plan;
use medley_spec::ScheduleKind;

use crate::check::check_owned;
use crate::error::ScheduleError;
use crate::geometry::{ReplicaGeometry, VirtualPipeline, check_chunks};
use crate::program::{CheckedPrograms, Instruction, Program, Programs, RankId};
use crate::schedules::{ChunkPass, Pass, passes};

/// Every rank's program for one step of `plan` under `schedule` (a [`Plan`] is valid by
/// construction); replicas may differ in depth, layer split and micro-batch count, each
/// running its own pipeline. Fails when the schedule does not run the plan's chunks per rank
/// (interleaved needs `virtual_stages` > 1, every other kind exactly 1), and for interleaved when
/// a replica's micro-batch count is neither a multiple of its rank count nor below it. The
/// programs are checked before they are returned: a generator's mistake is an error here, never a
/// wrong step in an engine.
pub fn generate(plan: &Plan, schedule: ScheduleKind) -> Result<CheckedPrograms, ScheduleError> {
    check_chunks(plan, schedule)?;
    let mut programs = Vec::new();
    for (replica_idx, replica) in plan.replicas().iter().enumerate() {
        let geometry = ReplicaGeometry::of(plan, replica);
        let pipeline = geometry.pipeline;
        let (m, n_ranks) = (replica.n_micro_batches, pipeline.n_ranks as u32);
        // Megatron's order over a last group of k micro-batches, 0 < k < p, waits on itself
        // (Megatron-LM refuses it too); below p there is one group and the warm-up covers it.
        if schedule == ScheduleKind::Interleaved && m > n_ranks && !m.is_multiple_of(n_ranks) {
            return Err(ScheduleError::InterleavedMicroBatches { replica_idx, n_micro_batches: m, n_ranks });
        }
        for rank_idx in 0..pipeline.n_ranks {
            let rank = RankId::new(replica_idx, rank_idx);
            let passes = passes(schedule, rank_idx, pipeline.n_ranks, pipeline.n_chunks, replica.n_micro_batches);
            let mut instructions = lower_passes(rank, pipeline, &passes);
            synchronise(plan, geometry.groups(rank_idx), &mut instructions);
            instructions.push(Instruction::OptimizerStep);
            programs.push(Program { rank, instructions });
        }
    }
    check_owned(plan, Programs { schedule, programs })
}

/// One plan's checked programs for each schedule kind asked for, each generated once: an adaptive
/// schedule changes kFkB's k between steps, and its few kinds repeat.
#[derive(Debug, Default)]
pub struct ProgramsByKind {
    generated: Vec<CheckedPrograms>,
}

impl ProgramsByKind {
    /// `plan`'s programs under `kind` (always the same plan for one `ProgramsByKind`).
    pub fn get(&mut self, plan: &Plan, kind: ScheduleKind) -> Result<&CheckedPrograms, ScheduleError> {
        let idx = match self.generated.iter().position(|programs| programs.schedule == kind) {
            Some(idx) => idx,
            None => {
                self.generated.push(generate(plan, kind)?);
                self.generated.len() - 1
            }
        };
        Ok(&self.generated[idx])
    }
}

/// Wraps each pass in the transfers it needs: a forward receives its input from the previous
/// virtual stage and sends its output to the next; a backward receives its output gradient from
/// the next and sends its input gradient to the previous. A transfer names the sender's chunk on
/// both ends, so both name the same message. The weight-gradient half of a split backward reads
/// only local tensors.
fn lower_passes(rank: RankId, pipeline: VirtualPipeline, passes: &[ChunkPass]) -> Vec<Instruction> {
    let rank_idx = rank.pp_rank as usize;
    let peer = |(pp_rank, chunk): (usize, u32)| (RankId { pp_rank: pp_rank as u32, ..rank }, chunk);
    let mut instructions = Vec::with_capacity(passes.len() * 3 + 2);
    for &ChunkPass { pass, chunk } in passes {
        let previous = pipeline.previous(rank_idx, chunk).map(peer);
        let next = pipeline.next(rank_idx, chunk).map(peer);
        match pass {
            Pass::Forward(micro_batch) => {
                if let Some((from, from_chunk)) = previous {
                    instructions.push(Instruction::RecvActivation { micro_batch, chunk: from_chunk, from });
                }
                instructions.push(Instruction::Forward { micro_batch, chunk });
                if let Some((to, _)) = next {
                    instructions.push(Instruction::SendActivation { micro_batch, chunk, to });
                }
            }
            Pass::Backward(micro_batch) | Pass::BackwardInput(micro_batch) => {
                if let Some((from, from_chunk)) = next {
                    instructions.push(Instruction::RecvGradient { micro_batch, chunk: from_chunk, from });
                }
                instructions.push(match pass {
                    Pass::Backward(_) => Instruction::Backward { micro_batch, chunk },
                    _ => Instruction::BackwardInput { micro_batch, chunk },
                });
                if let Some((to, _)) = previous {
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

/// The gradient synchronisation: one all-reduce per data-parallel group whose layers the rank
/// holds, last layers first (the order backward finishes them, and one order for every member
/// so the collectives cannot wait on each other in a cycle). Without overlap they all come after
/// the last pass; with it, each right after the pass that completes its chunk's gradients (and
/// that pass's gradient send), where the simulator overlaps it with that pass, bucket by bucket,
/// and the runtime runs it before the rank's remaining chunks. Never earlier than the group
/// before it, so the order holds whatever order chunks finish in.
fn synchronise(plan: &Plan, groups: &[(u32, u32)], instructions: &mut Vec<Instruction>) {
    let mut placed: Vec<(usize, Instruction)> = Vec::with_capacity(groups.len());
    for &(dp_group, chunk) in groups.iter().rev() {
        let at = match plan.overlap_grad_reduce() {
            true => after_last_backward(instructions, chunk),
            false => instructions.len(),
        };
        let at = placed.last().map_or(at, |&(previous, _)| at.max(previous));
        let layers = plan.dp_groups()[dp_group as usize].layers;
        placed.push((at, Instruction::AllReduceGradients { dp_group, layers }));
    }
    // From the back, so that earlier positions stay put and ties keep their order.
    for (at, instruction) in placed.into_iter().rev() {
        instructions.insert(at, instruction);
    }
}

/// Just after the last pass computing weight gradients of `chunk` and its gradient send.
fn after_last_backward(instructions: &[Instruction], chunk: u32) -> usize {
    let last = instructions.iter().rposition(|instruction| {
        matches!(*instruction, Instruction::Backward { chunk: c, .. } | Instruction::BackwardWeight { chunk: c, .. } if c == chunk)
    });
    let Some(last) = last else { return instructions.len() };
    match instructions.get(last + 1) {
        Some(Instruction::SendGradient { chunk: c, .. }) if *c == chunk => last + 2,
        _ => last + 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_chunk(chunk: u32, passes: &[Pass]) -> Vec<ChunkPass> {
        passes.iter().map(|&pass| ChunkPass { pass, chunk }).collect()
    }

    #[test]
    fn passes_are_wrapped_in_their_transfers() {
        let rank = RankId::new(1, 1);
        let (previous, next) = (RankId::new(1, 0), RankId::new(1, 2));
        let passes = on_chunk(0, &[Pass::Forward(0), Pass::BackwardInput(0), Pass::BackwardWeight(0)]);
        let chunk = 0;
        let one_chunk = |n_ranks| VirtualPipeline { n_ranks, n_chunks: 1 };
        assert_eq!(
            lower_passes(rank, one_chunk(3), &passes),
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
            lower_passes(RankId::new(0, 0), one_chunk(1), &on_chunk(0, &[Pass::Forward(0), Pass::Backward(0)])),
            [Instruction::Forward { micro_batch: 0, chunk }, Instruction::Backward { micro_batch: 0, chunk }]
        );
    }

    #[test]
    fn chunks_wrap_from_the_last_rank_to_the_first() {
        // Rank 0 of 2 with 2 chunks: chunk 1 is virtual stage 2, fed by rank 1's chunk 0.
        let (rank, other) = (RankId::new(0, 0), RankId::new(0, 1));
        let pipeline = VirtualPipeline { n_ranks: 2, n_chunks: 2 };
        assert_eq!(
            lower_passes(rank, pipeline, &on_chunk(1, &[Pass::Forward(0), Pass::Backward(0)])),
            [
                Instruction::RecvActivation { micro_batch: 0, chunk: 0, from: other },
                Instruction::Forward { micro_batch: 0, chunk: 1 },
                Instruction::SendActivation { micro_batch: 0, chunk: 1, to: other },
                Instruction::RecvGradient { micro_batch: 0, chunk: 1, from: other },
                Instruction::Backward { micro_batch: 0, chunk: 1 },
                Instruction::SendGradient { micro_batch: 0, chunk: 1, to: other },
            ]
        );
        assert_eq!((pipeline.previous(0, 0), pipeline.next(1, 1)), (None, None));
    }
}
