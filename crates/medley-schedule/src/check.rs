//! The checks every step's programs pass: each rank's program is well formed (every micro-batch
//! forwarded and backwarded exactly once, transfers to the right neighbours after the pass that
//! produces them, the stage's data-parallel groups synchronised once), activations in flight stay
//! within the schedule's promise, every send meets a receive, and executing all programs together
//! cannot deadlock.

use std::collections::{BTreeMap, BTreeSet};

use medley_plan::Plan;
use thiserror::Error;

use crate::program::{Instruction, Program, Programs, RankId};

/// Why a step's programs are wrong.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ScheduleError {
    /// The programs are not one per pipeline position of the plan.
    #[error("the programs are for ranks [{found}]; the plan has ranks [{expected}]")]
    Ranks { expected: String, found: String },
    /// An instruction that names something the rank does not have, or comes before what it needs.
    #[error("{rank}: instruction {idx} `{instruction}`: {reason}")]
    Malformed { rank: RankId, idx: usize, instruction: Instruction, reason: String },
    /// A micro-batch's pass runs other than once.
    #[error("{rank}: micro-batch {micro_batch} runs {pass} {count} times, expected once")]
    PassCount { rank: RankId, micro_batch: u32, pass: &'static str, count: u32 },
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

/// Checks `programs` against the validated `plan` they were generated for.
pub fn check(plan: &Plan, programs: &Programs) -> Result<(), ScheduleError> {
    check_ranks(plan, programs)?;
    for program in &programs.programs {
        check_program(plan, programs, program)?;
    }
    check_matching(&programs.programs)?;
    execute(plan, &programs.programs)
}

fn check_ranks(plan: &Plan, programs: &Programs) -> Result<(), ScheduleError> {
    let expected: Vec<RankId> = plan
        .replicas
        .iter()
        .enumerate()
        .flat_map(|(replica_idx, replica)| {
            (0..replica.stages.len()).map(move |stage_idx| RankId::new(replica_idx, stage_idx))
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

/// One rank's program on its own: references, local order, pass counts, groups and memory.
fn check_program(plan: &Plan, programs: &Programs, program: &Program) -> Result<(), ScheduleError> {
    let rank = program.rank;
    let replica = &plan.replicas[rank.replica_idx as usize];
    let stage_idx = rank.stage_idx as usize;
    let n_stages = replica.stages.len();
    let m = replica.n_micro_batches;
    let previous = (stage_idx > 0).then(|| RankId { stage_idx: rank.stage_idx - 1, ..rank });
    let next = (stage_idx + 1 < n_stages).then(|| RankId { stage_idx: rank.stage_idx + 1, ..rank });
    let mut seen = vec![Seen::default(); m as usize];
    let mut all_reduced = Vec::new();
    let (mut live, mut peak) = (0u32, 0u32);
    let n_instructions = program.instructions.len();
    for (idx, &instruction) in program.instructions.iter().enumerate() {
        let malformed = |reason: String| Err(ScheduleError::Malformed { rank, idx, instruction, reason });
        if let Some((micro_batch, chunk)) = micro_batch_of(instruction) {
            if micro_batch >= m {
                return malformed(format!("the replica runs {m} micro-batches"));
            }
            if chunk != 0 {
                return malformed("ranks hold one model chunk, chunk 0".into());
            }
        }
        let check_peer = |peer: RankId, expected: Option<RankId>| match expected {
            Some(expected) if expected == peer => Ok(()),
            Some(expected) => malformed(format!("the peer is {peer}, expected {expected}")),
            None => malformed(format!("the peer is {peer}, but the stage has no such neighbour")),
        };
        match instruction {
            Instruction::Forward { micro_batch, .. } => {
                let entry = &mut seen[micro_batch as usize];
                if previous.is_some() && entry.recv_activation == 0 {
                    return malformed("comes before its activation is received".into());
                }
                entry.forward += 1;
                live += 1;
                peak = peak.max(live);
            }
            Instruction::Backward { micro_batch, .. } | Instruction::BackwardInput { micro_batch, .. } => {
                let entry = &mut seen[micro_batch as usize];
                if entry.forward == 0 {
                    return malformed("comes before the micro-batch's forward".into());
                }
                if next.is_some() && entry.recv_gradient == 0 {
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
            Instruction::BackwardWeight { micro_batch, .. } => {
                let entry = &mut seen[micro_batch as usize];
                if entry.backward_input == 0 {
                    return malformed("comes before the micro-batch's backward-input".into());
                }
                entry.backward_weight += 1;
                live = live.saturating_sub(1);
            }
            Instruction::SendActivation { micro_batch, to, .. } => {
                check_peer(to, next)?;
                if seen[micro_batch as usize].forward == 0 {
                    return malformed("comes before the forward that produces it".into());
                }
            }
            Instruction::RecvActivation { micro_batch, from, .. } => {
                check_peer(from, previous)?;
                seen[micro_batch as usize].recv_activation += 1;
            }
            Instruction::SendGradient { micro_batch, to, .. } => {
                check_peer(to, previous)?;
                let entry = seen[micro_batch as usize];
                if entry.backward + entry.backward_input == 0 {
                    return malformed("comes before the backward that produces it".into());
                }
            }
            Instruction::RecvGradient { micro_batch, from, .. } => {
                check_peer(from, next)?;
                seen[micro_batch as usize].recv_gradient += 1;
            }
            Instruction::AllReduceGradients { dp_group, layers } => {
                if plan.dp_groups.get(dp_group as usize).map(|group| group.layers) != Some(layers) {
                    return malformed(format!("the plan has no dp group {dp_group} over layers {layers}"));
                }
                if seen.iter().any(|entry| entry.backward + entry.backward_weight == 0) {
                    return malformed("comes before every micro-batch's weight gradient".into());
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
    check_pass_counts(rank, &seen)?;
    if let Some(&last) = program.instructions.last()
        && last != Instruction::OptimizerStep
    {
        let reason = "a step ends with the optimizer step".into();
        return Err(ScheduleError::Malformed { rank, idx: n_instructions - 1, instruction: last, reason });
    }
    let stage = &replica.stages[stage_idx];
    let expected: Vec<u32> = (0..plan.dp_groups.len() as u32)
        .filter(|&dp_group| stage.layers.contains(plan.dp_groups[dp_group as usize].layers))
        .collect();
    all_reduced.sort_unstable();
    if all_reduced != expected {
        return Err(ScheduleError::DpGroups { rank, expected, found: all_reduced });
    }
    let promised = programs.schedule.in_flight(stage_idx, n_stages, m);
    if peak > promised {
        return Err(ScheduleError::InFlight { rank, peak, promised });
    }
    Ok(())
}

/// Every micro-batch forwarded once and backwarded once, whole or split into halves.
fn check_pass_counts(rank: RankId, seen: &[Seen]) -> Result<(), ScheduleError> {
    for (micro_batch, entry) in seen.iter().enumerate() {
        let micro_batch = micro_batch as u32;
        let count_error = |pass, count| Err(ScheduleError::PassCount { rank, micro_batch, pass, count });
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
    let members: Vec<usize> = plan.dp_groups.iter().map(|_| plan.replicas.len()).collect();
    let mut arrived: Vec<BTreeSet<RankId>> = vec![BTreeSet::new(); plan.dp_groups.len()];
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
