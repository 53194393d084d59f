//! The checks every step's programs pass: each rank's program is well formed (every micro-batch
//! forwarded and backwarded exactly once on each of the rank's chunks, transfers to the right
//! neighbours in virtual-stage order after the pass that produces them, the rank's data-parallel
//! groups synchronised once), activations in flight stay within the schedule's promise, every
//! send meets a receive, and executing all programs together cannot deadlock.

use std::collections::{BTreeMap, BTreeSet};

use medley_plan::Plan;

use crate::error::ScheduleError;
use crate::geometry::{ReplicaGeometry, VirtualPipeline, check_chunks};
use crate::program::{CheckedPrograms, Instruction, Program, Programs, RankId};

/// Checks `programs` against the validated `plan` they were generated for, and returns them
/// checked. Ranks are physical: with several chunks per rank, one program runs all of a rank's
/// chunks.
pub fn check(plan: &Plan, programs: &Programs) -> Result<CheckedPrograms, ScheduleError> {
    prove(plan, programs)?;
    Ok(CheckedPrograms::proven(programs.clone()))
}

/// [`check`] without the copy, for programs this crate has just generated.
pub(crate) fn check_owned(plan: &Plan, programs: Programs) -> Result<CheckedPrograms, ScheduleError> {
    prove(plan, &programs)?;
    Ok(CheckedPrograms::proven(programs))
}

fn prove(plan: &Plan, programs: &Programs) -> Result<(), ScheduleError> {
    check_chunks(plan, programs.schedule)?;
    check_ranks(plan, programs)?;
    let geometries: Vec<ReplicaGeometry> =
        plan.replicas().iter().map(|replica| ReplicaGeometry::of(plan, replica)).collect();
    for program in &programs.programs {
        check_program(plan, programs, program, &geometries[program.rank.replica as usize])?;
    }
    check_matching(&programs.programs)?;
    execute(plan, &programs.programs)
}

fn check_ranks(plan: &Plan, programs: &Programs) -> Result<(), ScheduleError> {
    let expected: Vec<RankId> = plan
        .replicas()
        .iter()
        .enumerate()
        .flat_map(|(replica_idx, replica)| {
            (0..plan.n_ranks(replica)).map(move |rank_idx| RankId::new(replica_idx, rank_idx))
        })
        .collect();
    let found: Vec<RankId> = programs.programs.iter().map(|program| program.rank).collect();
    if found != expected {
        let list = |ranks: &[RankId]| ranks.iter().map(RankId::to_string).collect::<Vec<_>>().join(", ");
        return Err(ScheduleError::Ranks { expected: list(&expected), found: list(&found) });
    }
    Ok(())
}

/// How often each pass and transfer of one micro-batch has run so far on a rank.
#[derive(Clone, Copy, Default)]
struct Seen {
    forward: u32,
    backward: u32,
    backward_input: u32,
    backward_weight: u32,
    recv_activation: u32,
    recv_gradient: u32,
}

/// [`VirtualPipeline::previous`] or [`VirtualPipeline::next`]: the (rank, chunk) on one side of
/// a rank's chunk.
type Neighbour = fn(VirtualPipeline, usize, u32) -> Option<(usize, u32)>;

/// One rank's program on its own: references, local order, pass counts, groups and memory.
fn check_program(
    plan: &Plan,
    programs: &Programs,
    program: &Program,
    geometry: &ReplicaGeometry,
) -> Result<(), ScheduleError> {
    let rank = program.rank;
    let replica = &plan.replicas()[rank.replica as usize];
    let pipeline = geometry.pipeline;
    let rank_idx = rank.pp_rank as usize;
    let m = replica.n_micro_batches;
    let n_chunks = pipeline.n_chunks;
    let peer = |(pp_rank, chunk): (usize, u32)| (RankId { pp_rank: pp_rank as u32, ..rank }, chunk);
    // Per (micro-batch, chunk), at micro_batch·v + chunk.
    let mut seen = vec![Seen::default(); (m * n_chunks) as usize];
    let mut all_reduced = Vec::new();
    let (mut live, mut peak) = (0u32, 0u32);
    let n_instructions = program.instructions.len();
    for (idx, &instruction) in program.instructions.iter().enumerate() {
        let malformed = |reason: String| Err(ScheduleError::Malformed { rank, idx, instruction, reason });
        if let Some((micro_batch, chunk)) = micro_batch_of(instruction) {
            if micro_batch >= m {
                return malformed(format!("the replica runs {m} micro-batches"));
            }
            if chunk >= n_chunks {
                return malformed(format!("ranks hold {n_chunks} model chunk(s), numbered from 0"));
            }
        }
        let entry_of = |micro_batch: u32, chunk: u32| (micro_batch * n_chunks + chunk) as usize;
        // A send goes to the neighbour of the sending chunk.
        let check_send =
            |chunk: u32, to: RankId, neighbour: Neighbour| match neighbour(pipeline, rank_idx, chunk).map(peer) {
                Some((expected, _)) if expected == to => Ok(()),
                Some((expected, _)) => malformed(format!("the peer is {to}, expected {expected}")),
                None => malformed(format!("the peer is {to}, but the stage has no such neighbour")),
            };
        // A receive names the sender's chunk: find the local chunk that sender neighbours.
        let receiving_chunk = |from: RankId, from_chunk: u32, neighbour: Neighbour| {
            (0..n_chunks)
                .find(|&chunk| neighbour(pipeline, rank_idx, chunk).map(peer) == Some((from, from_chunk)))
                .ok_or_else(|| {
                    let reason = format!("the peer {from} chunk {from_chunk} is not a neighbour of this rank's chunks");
                    ScheduleError::Malformed { rank, idx, instruction, reason }
                })
        };
        match instruction {
            Instruction::Forward { micro_batch, chunk } => {
                let entry = &mut seen[entry_of(micro_batch, chunk)];
                if pipeline.previous(rank_idx, chunk).is_some() && entry.recv_activation == 0 {
                    return malformed("comes before its activation is received".into());
                }
                entry.forward += 1;
                live += 1;
                peak = peak.max(live);
            }
            Instruction::Backward { micro_batch, chunk } | Instruction::BackwardInput { micro_batch, chunk } => {
                let entry = &mut seen[entry_of(micro_batch, chunk)];
                if entry.forward == 0 {
                    return malformed("comes before the micro-batch's forward".into());
                }
                if pipeline.next(rank_idx, chunk).is_some() && entry.recv_gradient == 0 {
                    return malformed("comes before its output gradient is received".into());
                }
                match instruction {
                    Instruction::Backward { .. } => {
                        entry.backward += 1;
                        live = live.saturating_sub(1);
                    }
                    _ => entry.backward_input += 1,
                }
            }
            Instruction::BackwardWeight { micro_batch, chunk } => {
                let entry = &mut seen[entry_of(micro_batch, chunk)];
                if entry.backward_input == 0 {
                    return malformed("comes before the micro-batch's backward-input".into());
                }
                entry.backward_weight += 1;
                live = live.saturating_sub(1);
            }
            Instruction::SendActivation { micro_batch, chunk, to } => {
                check_send(chunk, to, VirtualPipeline::next)?;
                if seen[entry_of(micro_batch, chunk)].forward == 0 {
                    return malformed("comes before the forward that produces it".into());
                }
            }
            Instruction::RecvActivation { micro_batch, chunk, from } => {
                let local = receiving_chunk(from, chunk, VirtualPipeline::previous)?;
                seen[entry_of(micro_batch, local)].recv_activation += 1;
            }
            Instruction::SendGradient { micro_batch, chunk, to } => {
                check_send(chunk, to, VirtualPipeline::previous)?;
                let entry = seen[entry_of(micro_batch, chunk)];
                if entry.backward + entry.backward_input == 0 {
                    return malformed("comes before the backward that produces it".into());
                }
            }
            Instruction::RecvGradient { micro_batch, chunk, from } => {
                let local = receiving_chunk(from, chunk, VirtualPipeline::next)?;
                seen[entry_of(micro_batch, local)].recv_gradient += 1;
            }
            Instruction::AllReduceGradients { dp_group, layers } => {
                if plan.dp_groups().get(dp_group as usize).map(|group| group.layers) != Some(layers) {
                    return malformed(format!("the plan has no dp group {dp_group} over layers {layers}"));
                }
                let Some(chunk) = geometry.group_chunk(rank_idx, dp_group) else {
                    return malformed(format!("the rank holds no layers of dp group {dp_group}"));
                };
                let mut of_chunk = seen.iter().skip(chunk as usize).step_by(n_chunks as usize);
                if of_chunk.any(|entry| entry.backward + entry.backward_weight == 0) {
                    return malformed(format!("comes before every micro-batch's weight gradient of chunk {chunk}"));
                }
                all_reduced.push(dp_group);
            }
            Instruction::OptimizerStep => {
                if idx + 1 != n_instructions {
                    return malformed("the optimizer step must be the last instruction".into());
                }
            }
        }
    }
    check_pass_counts(rank, n_chunks, &seen)?;
    if let Some(&last) = program.instructions.last()
        && last != Instruction::OptimizerStep
    {
        let reason = "a step ends with the optimizer step".into();
        return Err(ScheduleError::Malformed { rank, idx: n_instructions - 1, instruction: last, reason });
    }
    let expected: Vec<u32> = geometry.groups(rank_idx).iter().map(|&(dp_group, _)| dp_group).collect();
    all_reduced.sort_unstable();
    if all_reduced != expected {
        return Err(ScheduleError::DpGroups { rank, expected, found: all_reduced });
    }
    let promised = programs.schedule.in_flight(rank_idx, pipeline.n_ranks, n_chunks, m);
    if peak > promised {
        return Err(ScheduleError::InFlight { rank, peak, promised });
    }
    Ok(())
}

/// Every micro-batch forwarded once and backwarded once on each chunk, whole or split into halves.
fn check_pass_counts(rank: RankId, n_chunks: u32, seen: &[Seen]) -> Result<(), ScheduleError> {
    for (idx, entry) in seen.iter().enumerate() {
        let (micro_batch, chunk) = (idx as u32 / n_chunks, idx as u32 % n_chunks);
        let count_error = |pass, count| Err(ScheduleError::PassCount { rank, micro_batch, chunk, pass, count });
        if entry.forward != 1 {
            return count_error("forward", entry.forward);
        }
        if entry.backward + entry.backward_input != 1 {
            return count_error("backward", entry.backward + entry.backward_input);
        }
        if entry.backward_weight != entry.backward_input {
            return count_error("backward-weight", entry.backward_weight);
        }
    }
    Ok(())
}

fn micro_batch_of(instruction: Instruction) -> Option<(u32, u32)> {
    match instruction {
        Instruction::Forward { micro_batch, chunk }
        | Instruction::Backward { micro_batch, chunk }
        | Instruction::BackwardInput { micro_batch, chunk }
        | Instruction::BackwardWeight { micro_batch, chunk }
        | Instruction::SendActivation { micro_batch, chunk, .. }
        | Instruction::RecvActivation { micro_batch, chunk, .. }
        | Instruction::SendGradient { micro_batch, chunk, .. }
        | Instruction::RecvGradient { micro_batch, chunk, .. } => Some((micro_batch, chunk)),
        Instruction::AllReduceGradients { .. } | Instruction::OptimizerStep => None,
    }
}

/// What a transfer carries, in the order messages are keyed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Payload {
    Activation,
    Gradient,
}

/// A transfer's identity: payload, micro-batch, chunk, sender, receiver.
type Message = (Payload, u32, u32, RankId, RankId);

/// Whether `instruction` on `rank` sends (`true`) or receives (`false`) a message, and which.
fn message(rank: RankId, instruction: Instruction) -> Option<(bool, Message)> {
    match instruction {
        Instruction::SendActivation { micro_batch, chunk, to } => {
            Some((true, (Payload::Activation, micro_batch, chunk, rank, to)))
        }
        Instruction::RecvActivation { micro_batch, chunk, from } => {
            Some((false, (Payload::Activation, micro_batch, chunk, from, rank)))
        }
        Instruction::SendGradient { micro_batch, chunk, to } => {
            Some((true, (Payload::Gradient, micro_batch, chunk, rank, to)))
        }
        Instruction::RecvGradient { micro_batch, chunk, from } => {
            Some((false, (Payload::Gradient, micro_batch, chunk, from, rank)))
        }
        _ => None,
    }
}

/// Every send has exactly one receive with the same payload, micro-batch, chunk and ends, and
/// the other way round.
fn check_matching(programs: &[Program]) -> Result<(), ScheduleError> {
    // Per message: the sends and receives naming it, as (rank, instruction index).
    let mut ends: BTreeMap<Message, [Vec<(RankId, usize)>; 2]> = BTreeMap::new();
    for program in programs {
        for (idx, &instruction) in program.instructions.iter().enumerate() {
            if let Some((is_send, key)) = message(program.rank, instruction) {
                ends.entry(key).or_default()[usize::from(!is_send)].push((program.rank, idx));
            }
        }
    }
    let instruction_at = |rank: RankId, idx: usize| {
        programs.iter().find(|program| program.rank == rank).expect("rank of a program").instructions[idx]
    };
    for [sends, recvs] in ends.values() {
        let (extra, counterpart) = if sends.len() > recvs.len() {
            (sends[recvs.len()], "receive")
        } else if recvs.len() > sends.len() {
            (recvs[sends.len()], "send")
        } else {
            continue;
        };
        let (rank, idx) = extra;
        return Err(ScheduleError::Unmatched { rank, idx, instruction: instruction_at(rank, idx), counterpart });
    }
    Ok(())
}

/// Runs every program abstractly, with the blocking rules the crate documents: compute and
/// sends never block (a send deposits its message), a receive waits for its message, and an
/// all-reduce waits until every member of its group has reached it. Ranks are visited in rank
/// order, each running until it blocks, until all finish; a sweep in which no rank advances is
/// a deadlock. The outcome does not depend on the visiting order: blocking conditions only
/// become true as other ranks advance, never false.
fn execute(plan: &Plan, programs: &[Program]) -> Result<(), ScheduleError> {
    let members: Vec<usize> = plan.dp_groups().iter().map(|_| plan.replicas().len()).collect();
    let mut arrived: Vec<BTreeSet<RankId>> = vec![BTreeSet::new(); plan.dp_groups().len()];
    let mut mailbox: BTreeMap<Message, u32> = BTreeMap::new();
    let mut pcs = vec![0usize; programs.len()];
    loop {
        let mut progressed = false;
        for (program, pc) in programs.iter().zip(pcs.iter_mut()) {
            while let Some(&instruction) = program.instructions.get(*pc) {
                let ready = match (message(program.rank, instruction), instruction) {
                    (Some((true, key)), _) => {
                        *mailbox.entry(key).or_default() += 1;
                        true
                    }
                    (Some((false, key)), _) => match mailbox.get_mut(&key) {
                        Some(count) if *count > 0 => {
                            *count -= 1;
                            true
                        }
                        _ => false,
                    },
                    (None, Instruction::AllReduceGradients { dp_group, .. }) => {
                        let group = dp_group as usize;
                        arrived[group].insert(program.rank);
                        arrived[group].len() == members[group]
                    }
                    (None, _) => true,
                };
                if !ready {
                    break;
                }
                *pc += 1;
                progressed = true;
            }
        }
        let finished = programs.iter().zip(&pcs).all(|(program, &pc)| pc == program.instructions.len());
        if finished {
            return Ok(());
        }
        if !progressed {
            let blocked: Vec<String> = programs
                .iter()
                .zip(&pcs)
                .filter_map(|(program, &pc)| {
                    program.instructions.get(pc).map(|instruction| format!("{} at {pc} `{instruction}`", program.rank))
                })
                .collect();
            return Err(ScheduleError::Deadlock { blocked: blocked.join("; ") });
        }
    }
}
