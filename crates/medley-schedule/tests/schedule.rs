//! medley-schedule's integration tests: every generator's programs pass every check on plans
//! from the planner and on arbitrary uneven plans, and the checks catch broken programs.

use std::num::NonZeroU32;

use medley_cost::{Calibration, CostModel, Setting};
use medley_plan::baselines::{Degrees, megatron_plan};
use medley_plan::{DpGroup, GradientAlgorithm, LayerRange, Plan, Replica, Route, SearchOptions, Stage, search};
use medley_schedule::{Instruction, Programs, RankId, ScheduleError, ScheduleKind, check, generate};
use medley_spec::{Bridge, Cluster, Fabric, JobParts, JobSpec, Recompute, Schedule, catalog_model};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// Inputs

fn cluster(text: &str) -> Cluster {
    Cluster::from_inline(text, Fabric::default(), Bridge::default()).unwrap()
}

fn job(global_batch: u32) -> JobSpec {
    let parts = JobParts { seq_len: 1024, global_batch, micro_batch: Some(1), ..JobParts::default() };
    JobSpec::new(parts, "test").unwrap()
}

/// A Megatron-style plan of gpt2 (12 layers) with tp = 1 on `cluster_text`.
fn megatron(cluster_text: &str, pp: u32, dp: u32, global_batch: u32) -> Plan {
    megatron_interleaved(cluster_text, Degrees::new(1, pp, dp), global_batch)
}

/// A Megatron-style plan of gpt2 with `degrees`, interleaved when `degrees.vpp` > 1.
fn megatron_interleaved(cluster_text: &str, degrees: Degrees, global_batch: u32) -> Plan {
    let model = catalog_model("gpt2").unwrap();
    let calibration = Calibration::default();
    let cost = CostModel::new(&model, 1024, &calibration);
    let setting = Setting { micro_batch: 1, tp: 1, recompute: Recompute::Full };
    megatron_plan(&cluster(cluster_text), &cost, &job(global_batch), setting, degrees).unwrap()
}

/// `base` with its replicas replaced: one per `(cuts, n_micro_batches)`, whose stages split
/// gpt2's 12 layers at `cuts`, on consecutive devices.
fn reshape(base: &Plan, shapes: &[(Vec<u32>, u32)]) -> Plan {
    reshape_interleaved(base, 1, shapes)
}

/// [`reshape`] with `virtual_stages` chunks per rank: a replica's cuts make its virtual stages,
/// and virtual stage j runs on the replica's device j mod p.
fn reshape_interleaved(base: &Plan, virtual_stages: u32, shapes: &[(Vec<u32>, u32)]) -> Plan {
    let mut plan = base.clone().into_parts();
    plan.virtual_stages = virtual_stages;
    plan.schedule = if virtual_stages > 1 {
        Schedule::Fixed(ScheduleKind::Interleaved)
    } else {
        Schedule::Fixed(ScheduleKind::OneFOneB)
    };
    let n_layers = plan.model.n_layers();
    let mut first_device = 0;
    plan.replicas = shapes
        .iter()
        .map(|(cuts, n_micro_batches)| {
            let bounds: Vec<u32> = std::iter::once(0).chain(cuts.iter().copied()).chain([n_layers]).collect();
            let n_ranks = (bounds.len() as u32 - 1) / virtual_stages;
            let stages: Vec<Stage> = bounds
                .windows(2)
                .enumerate()
                .map(|(stage_idx, pair)| {
                    let device = first_device + stage_idx as u32 % n_ranks;
                    Stage { devices: vec![device], layers: LayerRange { start: pair[0], end: pair[1] }, context: None }
                })
                .collect();
            first_device += n_ranks;
            let boundaries = stages.windows(2).map(|pair| route(base, &pair[0..2])).collect();
            Replica { n_micro_batches: *n_micro_batches, stages, boundaries }
        })
        .collect();
    plan.global_batch = plan.replicas.iter().map(|replica| replica.n_micro_batches).sum::<u32>() * plan.micro_batch;
    plan.dp_groups = dp_layer_ranges(&plan.replicas)
        .into_iter()
        .map(|layers| {
            let holders: Vec<Stage> = plan
                .replicas
                .iter()
                .map(|replica| replica.stages.iter().find(|stage| stage.layers.contains(layers)).unwrap().clone())
                .collect();
            DpGroup { layers, route: route(base, &holders), algorithm: GradientAlgorithm::Ring }
        })
        .collect();
    Plan::new(plan).unwrap()
}

/// Plan schema v1's data-parallel layer ranges: the model cut wherever any replica cuts it.
fn dp_layer_ranges(replicas: &[Replica]) -> Vec<LayerRange> {
    let cuts: std::collections::BTreeSet<u32> = replicas
        .iter()
        .flat_map(|replica| replica.stages.iter().flat_map(|stage| [stage.layers.start, stage.layers.end]))
        .collect();
    let cuts: Vec<u32> = cuts.into_iter().collect();
    cuts.windows(2).map(|pair| LayerRange { start: pair[0], end: pair[1] }).collect()
}

/// The route between `stages`: native when they share a vendor, else the bridge.
fn route(plan: &Plan, stages: &[Stage]) -> Route {
    let vendor = plan.stage_vendor(&stages[0]);
    if stages.iter().all(|stage| plan.stage_vendor(stage) == vendor) {
        Route::Native { vendor }
    } else {
        Route::Bridge { mode: plan.cluster().bridge().modes()[0] }
    }
}

fn kfkb(k: u32) -> ScheduleKind {
    ScheduleKind::Kfkb { k: NonZeroU32::new(k).unwrap() }
}

/// Every schedule of one chunk per rank.
fn all_schedules() -> Vec<ScheduleKind> {
    let mut kinds = vec![ScheduleKind::Gpipe, ScheduleKind::OneFOneB, ScheduleKind::ZbH1];
    kinds.extend((1..=4).map(kfkb));
    kinds
}

/// The schedules that run `plan`: interleaved for several chunks per rank, else all the others.
fn schedules_for(plan: &Plan) -> Vec<ScheduleKind> {
    if plan.virtual_stages() > 1 { vec![ScheduleKind::Interleaved] } else { all_schedules() }
}

// ---------------------------------------------------------------------------------------------
// Checks

/// Every schedule's programs for `plan` pass every check.
fn check_all_schedules(plan: &Plan) {
    for kind in schedules_for(plan) {
        let programs = generate(plan, kind).unwrap();
        if let Err(err) = check(plan, &programs) {
            panic!("{kind} on replicas {:?}: {err}\n{programs}", plan.replica_shapes());
        }
        assert!(runs_to_completion(plan, &programs), "{kind}: the oracle executor is stuck\n{programs}");
    }
}

/// An executor written independently of `check`'s, for its oracle: one instruction at a time,
/// always on the highest rank that can move. A send always moves; a receive moves once its
/// message is in the bag; an all-reduce moves once every member's program has reached its own
/// all-reduce of that group. Returns whether every program finishes.
fn runs_to_completion(plan: &Plan, programs: &Programs) -> bool {
    let programs = &programs.programs;
    let mut pcs = vec![0usize; programs.len()];
    // (activation?, micro-batch, sender's chunk, sender, receiver)
    let mut bag: Vec<(bool, u32, u32, RankId, RankId)> = Vec::new();
    let reached_all_reduce = |pcs: &[usize], dp_group: u32| {
        plan.holders(dp_group as usize).iter().enumerate().all(|(replica_idx, &stage_idx)| {
            let rank = RankId::new(replica_idx, plan.rank_of(&plan.replicas()[replica_idx], stage_idx));
            let member = programs.iter().position(|program| program.rank == rank).unwrap();
            let at = programs[member].instructions.iter().position(
                |ins| matches!(ins, Instruction::AllReduceGradients { dp_group: group, .. } if *group == dp_group),
            );
            at.is_some_and(|at| pcs[member] >= at)
        })
    };
    loop {
        if programs.iter().zip(&pcs).all(|(program, &pc)| pc == program.instructions.len()) {
            return true;
        }
        let movable = (0..programs.len()).rev().find(|&i| {
            let rank = programs[i].rank;
            match programs[i].instructions.get(pcs[i]) {
                None => false,
                Some(&Instruction::RecvActivation { micro_batch, chunk, from }) => {
                    bag.contains(&(true, micro_batch, chunk, from, rank))
                }
                Some(&Instruction::RecvGradient { micro_batch, chunk, from }) => {
                    bag.contains(&(false, micro_batch, chunk, from, rank))
                }
                Some(&Instruction::AllReduceGradients { dp_group, .. }) => reached_all_reduce(&pcs, dp_group),
                Some(_) => true,
            }
        });
        let Some(i) = movable else { return false };
        let rank = programs[i].rank;
        match programs[i].instructions[pcs[i]] {
            Instruction::SendActivation { micro_batch, chunk, to } => bag.push((true, micro_batch, chunk, rank, to)),
            Instruction::SendGradient { micro_batch, chunk, to } => bag.push((false, micro_batch, chunk, rank, to)),
            Instruction::RecvActivation { micro_batch, chunk, from } => {
                bag.swap_remove(bag.iter().position(|&msg| msg == (true, micro_batch, chunk, from, rank)).unwrap());
            }
            Instruction::RecvGradient { micro_batch, chunk, from } => {
                bag.swap_remove(bag.iter().position(|&msg| msg == (false, micro_batch, chunk, from, rank)).unwrap());
            }
            _ => {}
        }
        pcs[i] += 1;
    }
}

/// Breaking `programs` with `edit` makes `check` fail with an error that `expected` accepts.
fn check_rejects(
    plan: &Plan,
    kind: ScheduleKind,
    edit: impl FnOnce(&mut Programs),
    expected: fn(&ScheduleError) -> bool,
) {
    let mut programs = generate(plan, kind).unwrap().into_programs();
    check(plan, &programs).unwrap();
    edit(&mut programs);
    match check(plan, &programs) {
        Err(err) if expected(&err) => {}
        other => panic!("{kind}: unexpected outcome {other:?}\n{programs}"),
    }
}

fn instructions(programs: &mut Programs, replica_idx: usize, stage_idx: usize) -> &mut Vec<Instruction> {
    let rank = RankId::new(replica_idx, stage_idx);
    &mut programs.programs.iter_mut().find(|program| program.rank == rank).unwrap().instructions
}

// ---------------------------------------------------------------------------------------------
// Generators on real plans

#[test]
fn megatron_plans_with_uneven_stages() {
    // 12 layers over 5 stages: 3,3,2,2,2.
    check_all_schedules(&megatron("16xh100", 5, 2, 14));
    check_all_schedules(&megatron("16xh100", 4, 4, 4));
    check_all_schedules(&megatron("8xh100", 1, 1, 3));
}

#[test]
fn searched_plans_on_a_mixed_cluster() {
    let model = catalog_model("gpt2").unwrap();
    let parts = JobParts { seq_len: 1024, global_batch: 24, ..JobParts::default() };
    let job = JobSpec::new(parts, "test").unwrap();
    let options = SearchOptions { top: 3, ..SearchOptions::default() };
    let outcome = search(&cluster("4xh100,4xa100"), &model, &job, &Calibration::default(), &options).unwrap();
    for candidate in &outcome.candidates {
        check_all_schedules(&candidate.plan);
    }
}

#[test]
fn replicas_of_different_depths_and_batch_shares() {
    let base = megatron("16xh100", 1, 1, 1);
    check_all_schedules(&reshape(&base, &[(vec![3, 7, 8], 5), (vec![6], 2), (vec![], 1)]));
    check_all_schedules(&reshape(&base, &[(vec![1, 2, 3, 4, 5, 6, 7], 3), (vec![11], 9)]));
}

#[test]
fn a_large_step_generates_and_checks_quickly() {
    // 8 replicas of 12 stages with 64 micro-batches each: 96 programs of about 400 instructions.
    let shape = ((1..12).collect::<Vec<u32>>(), 64);
    let plan = reshape(&megatron("128xh100", 1, 1, 1), &vec![shape; 8]);
    let start = std::time::Instant::now();
    for kind in all_schedules() {
        check(&plan, &generate(&plan, kind).unwrap()).unwrap();
    }
    assert!(start.elapsed().as_secs_f64() < 5.0, "took {:?}", start.elapsed());
}

#[test]
fn the_plans_own_schedule_is_generated() {
    let plan = megatron("16xh100", 4, 2, 8);
    let programs = generate(&plan, plan.schedule().fixed().unwrap()).unwrap();
    assert_eq!(programs.schedule, ScheduleKind::OneFOneB);
    check(&plan, &programs).unwrap();
}

#[test]
fn generation_is_deterministic_and_round_trips_through_json() {
    let plan = reshape(&megatron("16xh100", 1, 1, 1), &[(vec![4, 8], 4), (vec![6], 3)]);
    for kind in all_schedules() {
        let programs = generate(&plan, kind).unwrap();
        assert_eq!(programs, generate(&plan, kind).unwrap());
        let json = serde_json::to_string(&programs).unwrap();
        assert_eq!(json, serde_json::to_string(&generate(&plan, kind).unwrap()).unwrap());
        assert_eq!(serde_json::from_str::<Programs>(&json).unwrap(), *programs);
    }
}

#[test]
fn programs_print_one_instruction_a_line() {
    let plan = megatron("8xh100", 2, 1, 2);
    let text = generate(&plan, ScheduleKind::OneFOneB).unwrap().to_string();
    let expected = "schedule 1f1b\nr0s0:\n     0  forward mb0 c0\n     1  send-activation mb0 c0 -> r0s1\n";
    assert!(text.starts_with(expected), "{text}");
    assert!(text.contains("recv-gradient mb1 c0 <- r0s1\n"), "{text}");
    assert!(text.contains("all-reduce-gradients dp0 layers 0..6\n"), "{text}");
    assert!(text.ends_with("optimizer-step\n"), "{text}");
}

#[test]
fn interleaved_megatron_plans() {
    // 12 layers over 2 ranks × 3 chunks, 4 ranks × 2 chunks (m a multiple of p and not), and
    // 5 ranks × 2 chunks (uneven chunks: 2,2,1,…).
    for (pp, vpp, dp, global_batch) in [(2, 3, 2, 8), (4, 2, 1, 8), (4, 2, 2, 6), (5, 2, 1, 10), (3, 4, 1, 1)] {
        let plan = megatron_interleaved("16xh100", Degrees { vpp, ..Degrees::new(1, pp, dp) }, global_batch);
        assert_eq!((plan.virtual_stages(), plan.schedule()), (vpp, Schedule::Fixed(ScheduleKind::Interleaved)));
        check_all_schedules(&plan);
    }
}

#[test]
fn interleaved_runs_micro_batch_counts_that_are_multiples_of_the_ranks_or_below_them() {
    // llama3-8b's 32 layers leave room for p·v up to 24.
    let model = catalog_model("llama3-8b").unwrap();
    let calibration = Calibration::default();
    let cost = CostModel::new(&model, 1024, &calibration);
    let setting = Setting { micro_batch: 1, tp: 1, recompute: Recompute::Full };
    let cluster = cluster("16xh100");
    for n_ranks in 2..=6 {
        for vpp in 2..=4 {
            for m in 1..=2 * n_ranks + 1 {
                let degrees = Degrees { vpp, ..Degrees::new(1, n_ranks, 1) };
                let plan = megatron_plan(&cluster, &cost, &job(m), setting, degrees).unwrap();
                let supported = m < n_ranks || m.is_multiple_of(n_ranks);
                match generate(&plan, ScheduleKind::Interleaved) {
                    Ok(programs) if supported => drop(check(&plan, &programs).unwrap()),
                    Err(err) if !supported => assert_eq!(
                        err,
                        ScheduleError::InterleavedMicroBatches { replica_idx: 0, n_micro_batches: m, n_ranks }
                    ),
                    other => panic!("p={n_ranks} v={vpp} m={m}: {other:?}"),
                }
            }
        }
    }
}

#[test]
fn interleaved_programs_are_one_per_physical_rank() {
    let plan = megatron_interleaved("8xh100", Degrees { vpp: 2, ..Degrees::new(1, 2, 1) }, 2);
    let programs = generate(&plan, ScheduleKind::Interleaved).unwrap();
    let ranks: Vec<String> = programs.programs.iter().map(|program| program.rank.to_string()).collect();
    assert_eq!(ranks, ["r0s0", "r0s1"]);
    // Rank 0 forwards chunk 0, then receives its chunk 1's input from rank 1's chunk 0.
    let text = programs.to_string();
    assert!(text.contains("r0s0:\n     0  forward mb0 c0\n     1  send-activation mb0 c0 -> r0s1\n"), "{text}");
    assert!(text.contains("recv-activation mb0 c0 <- r0s1\n     5  forward mb0 c1\n"), "{text}");
    // Rank 0 holds layers 0..3 and 6..9: its two dp groups, last layers first.
    assert!(text.contains("all-reduce-gradients dp2 layers 6..9\n"), "{text}");
}

#[test]
fn schedules_and_chunks_must_agree() {
    let interleaved = megatron_interleaved("8xh100", Degrees { vpp: 2, ..Degrees::new(1, 2, 1) }, 2);
    let flat = megatron("8xh100", 2, 1, 2);
    let mismatch = |plan: &Plan, kind| generate(plan, kind).unwrap_err();
    assert_eq!(
        mismatch(&interleaved, ScheduleKind::OneFOneB),
        ScheduleError::ChunkMismatch { schedule: ScheduleKind::OneFOneB, virtual_stages: 2 }
    );
    assert_eq!(
        mismatch(&flat, ScheduleKind::Interleaved),
        ScheduleError::ChunkMismatch { schedule: ScheduleKind::Interleaved, virtual_stages: 1 }
    );
    // Programs of the wrong kind are refused by the check too.
    let mut programs = generate(&flat, ScheduleKind::OneFOneB).unwrap().into_programs();
    programs.schedule = ScheduleKind::Interleaved;
    assert!(matches!(check(&flat, &programs), Err(ScheduleError::ChunkMismatch { .. })));
    // Adaptive is no fixed order: a program is generated per step for the k chosen then.
    assert_eq!(Schedule::Adaptive.fixed(), None);
}

// ---------------------------------------------------------------------------------------------
// The checks catch broken programs

#[test]
fn check_catches_a_point_to_point_deadlock() {
    // Stage 1 waits for micro-batch 1's activation before it sends micro-batch 0's gradient,
    // while stage 0 waits for that gradient before it forwards micro-batch 1.
    let plan = megatron("8xh100", 2, 1, 2);
    check_rejects(
        &plan,
        ScheduleKind::OneFOneB,
        |programs| {
            let (s0, s1) = (RankId::new(0, 0), RankId::new(0, 1));
            let chunk = 0;
            // Stage 1's order keeps both micro-batches live, as GPipe's does.
            programs.schedule = ScheduleKind::Gpipe;
            *instructions(programs, 0, 0) = vec![
                Instruction::Forward { micro_batch: 0, chunk },
                Instruction::SendActivation { micro_batch: 0, chunk, to: s1 },
                Instruction::RecvGradient { micro_batch: 0, chunk, from: s1 },
                Instruction::Backward { micro_batch: 0, chunk },
                Instruction::Forward { micro_batch: 1, chunk },
                Instruction::SendActivation { micro_batch: 1, chunk, to: s1 },
                Instruction::RecvGradient { micro_batch: 1, chunk, from: s1 },
                Instruction::Backward { micro_batch: 1, chunk },
                Instruction::AllReduceGradients { dp_group: 0, layers: LayerRange { start: 0, end: 6 } },
                Instruction::OptimizerStep,
            ];
            *instructions(programs, 0, 1) = vec![
                Instruction::RecvActivation { micro_batch: 0, chunk, from: s0 },
                Instruction::Forward { micro_batch: 0, chunk },
                Instruction::RecvActivation { micro_batch: 1, chunk, from: s0 },
                Instruction::Forward { micro_batch: 1, chunk },
                Instruction::Backward { micro_batch: 0, chunk },
                Instruction::SendGradient { micro_batch: 0, chunk, to: s0 },
                Instruction::Backward { micro_batch: 1, chunk },
                Instruction::SendGradient { micro_batch: 1, chunk, to: s0 },
                Instruction::AllReduceGradients { dp_group: 1, layers: LayerRange { start: 6, end: 12 } },
                Instruction::OptimizerStep,
            ];
        },
        |err| matches!(err, ScheduleError::Deadlock { blocked } if blocked.contains("r0s0 at 2") && blocked.contains("r0s1 at 2")),
    );
}

#[test]
fn check_catches_all_reduces_in_crossed_orders() {
    // Replicas 0 and 2 hold both dp groups; replica 2 all-reduces them in the other order.
    let plan = reshape(&megatron("16xh100", 1, 1, 1), &[(vec![], 2), (vec![6], 2), (vec![], 2)]);
    check_rejects(
        &plan,
        ScheduleKind::OneFOneB,
        |programs| {
            let program = instructions(programs, 2, 0);
            let n = program.len();
            program.swap(n - 3, n - 2);
        },
        |err| matches!(err, ScheduleError::Deadlock { .. }),
    );
}

#[test]
fn check_catches_broken_counts_transfers_and_groups() {
    let plan = megatron("8xh100", 2, 1, 3);
    let kind = ScheduleKind::OneFOneB;
    // A duplicated forward.
    check_rejects(
        &plan,
        kind,
        |programs| instructions(programs, 0, 0).insert(0, Instruction::Forward { micro_batch: 0, chunk: 0 }),
        |err| matches!(err, ScheduleError::PassCount { pass: "forward", count: 2, .. }),
    );
    // A chunk the rank does not hold.
    check_rejects(
        &plan,
        kind,
        |programs| instructions(programs, 0, 0).insert(0, Instruction::Forward { micro_batch: 0, chunk: 1 }),
        |err| matches!(err, ScheduleError::Malformed { reason, .. } if reason.contains("1 model chunk")),
    );
    // A gradient never sent.
    check_rejects(
        &plan,
        kind,
        |programs| {
            instructions(programs, 0, 1).retain(|ins| !matches!(ins, Instruction::SendGradient { micro_batch: 2, .. }))
        },
        |err| matches!(err, ScheduleError::Unmatched { counterpart: "send", .. }),
    );
    // A micro-batch the replica does not run.
    check_rejects(
        &plan,
        kind,
        |programs| instructions(programs, 0, 1).insert(0, Instruction::Forward { micro_batch: 3, chunk: 0 }),
        |err| matches!(err, ScheduleError::Malformed { .. }),
    );
    // A send to a stage that is not the neighbour.
    check_rejects(
        &plan,
        kind,
        |programs| {
            let to = RankId::new(0, 0);
            instructions(programs, 0, 1).insert(1, Instruction::SendActivation { micro_batch: 0, chunk: 0, to });
        },
        |err| matches!(err, ScheduleError::Malformed { reason, .. } if reason.contains("no such neighbour")),
    );
    // A missing all-reduce.
    check_rejects(
        &plan,
        kind,
        |programs| instructions(programs, 0, 0).retain(|ins| !matches!(ins, Instruction::AllReduceGradients { .. })),
        |err| matches!(err, ScheduleError::DpGroups { .. }),
    );
    // An empty program.
    check_rejects(
        &plan,
        kind,
        |programs| instructions(programs, 0, 1).clear(),
        |err| matches!(err, ScheduleError::PassCount { pass: "forward", count: 0, .. }),
    );
    // A step that does not end with the optimizer step.
    check_rejects(
        &plan,
        kind,
        |programs| {
            instructions(programs, 0, 1).pop();
        },
        |err| matches!(err, ScheduleError::Malformed { reason, .. } if reason.contains("optimizer")),
    );
    // A missing rank.
    check_rejects(
        &plan,
        kind,
        |programs| drop(programs.programs.pop()),
        |err| matches!(err, ScheduleError::Ranks { .. }),
    );
}

#[test]
fn check_holds_schedules_to_their_memory_promise() {
    // GPipe's programs keep all 8 micro-batches live; 1F1B promises 2 on stage 0 of 2.
    let plan = megatron("8xh100", 2, 1, 8);
    check_rejects(
        &plan,
        ScheduleKind::Gpipe,
        |programs| programs.schedule = ScheduleKind::OneFOneB,
        |err| matches!(err, ScheduleError::InFlight { peak: 8, promised: 2, .. }),
    );
    check_rejects(
        &plan,
        kfkb(3),
        |programs| programs.schedule = kfkb(2),
        |err| matches!(err, ScheduleError::InFlight { peak: 6, promised: 4, .. }),
    );
}

#[test]
fn check_catches_broken_interleaved_programs() {
    let plan = megatron_interleaved("8xh100", Degrees { vpp: 2, ..Degrees::new(1, 2, 1) }, 4);
    let kind = ScheduleKind::Interleaved;
    // Chunk 1's forward of micro-batch 0 runs twice on rank 1.
    check_rejects(
        &plan,
        kind,
        |programs| {
            let program = instructions(programs, 0, 1);
            let at = program.iter().position(|ins| *ins == Instruction::Forward { micro_batch: 0, chunk: 1 }).unwrap();
            program.insert(at, Instruction::Forward { micro_batch: 0, chunk: 1 });
        },
        |err| matches!(err, ScheduleError::PassCount { pass: "forward", chunk: 1, count: 2, .. }),
    );
    // Rank 1's chunk 1 is the last virtual stage: it sends no activation.
    check_rejects(
        &plan,
        kind,
        |programs| {
            let to = RankId::new(0, 0);
            let program = instructions(programs, 0, 1);
            let at = program.iter().position(|ins| *ins == Instruction::Forward { micro_batch: 0, chunk: 1 }).unwrap();
            program.insert(at + 1, Instruction::SendActivation { micro_batch: 0, chunk: 1, to });
        },
        |err| matches!(err, ScheduleError::Malformed { reason, .. } if reason.contains("no such neighbour")),
    );
    // A receive naming the wrong sender chunk matches none of the rank's chunks.
    check_rejects(
        &plan,
        kind,
        |programs| {
            let program = instructions(programs, 0, 0);
            let at = program.iter().position(|ins| matches!(ins, Instruction::RecvActivation { .. })).unwrap();
            let Instruction::RecvActivation { micro_batch, from, .. } = program[at] else { unreachable!() };
            program[at] = Instruction::RecvActivation { micro_batch, chunk: 1, from };
        },
        |err| matches!(err, ScheduleError::Malformed { reason, .. } if reason.contains("not a neighbour")),
    );
    // Rank 0 of 2 with 2 chunks promises (2 − 0 − 1)·2 + 1·2 + 1 = 5; delaying its first
    // backward (and the gradient it sends) to the end of the step holds one more.
    check_rejects(
        &megatron_interleaved("8xh100", Degrees { vpp: 2, ..Degrees::new(1, 2, 1) }, 8),
        kind,
        |programs| {
            let program = instructions(programs, 0, 0);
            let at = program.iter().position(|ins| matches!(ins, Instruction::Backward { .. })).unwrap();
            let delayed: Vec<Instruction> = program.drain(at..at + 2).collect();
            let end = program.iter().position(|ins| matches!(ins, Instruction::AllReduceGradients { .. })).unwrap();
            program.splice(end..end, delayed);
        },
        |err| matches!(err, ScheduleError::InFlight { peak: 6, promised: 5, .. }),
    );
}

// ---------------------------------------------------------------------------------------------
// Properties over arbitrary uneven plans

/// Up to three replicas, each with up to four stages cut anywhere in gpt2's 12 layers and its
/// own micro-batch count.
fn shapes() -> impl Strategy<Value = Vec<(Vec<u32>, u32)>> {
    let replica = (prop::collection::btree_set(1u32..12, 0..4), 1u32..=9)
        .prop_map(|(cuts, n_micro_batches)| (cuts.into_iter().collect(), n_micro_batches));
    prop::collection::vec(replica, 1..=3)
}

/// A chunk count v of 2 or 3 and up to two replicas, each with its own rank count p (2 to 4,
/// p·v ≤ 12), virtual stages cut anywhere in gpt2's 12 layers, and its own micro-batch count
/// (one interleaving runs).
fn interleaved_shapes() -> impl Strategy<Value = (u32, Vec<(Vec<u32>, u32)>)> {
    (2u32..=3).prop_flat_map(|virtual_stages| {
        let replica = (2u32..=(12 / virtual_stages).min(4), 1u32..=9).prop_flat_map(move |(n_ranks, m)| {
            let n_cuts = (n_ranks * virtual_stages - 1) as usize;
            // A micro-batch count interleaving runs: below p or a multiple of it.
            let n_micro_batches = if m < n_ranks { m } else { m - m % n_ranks };
            prop::sample::subsequence((1u32..12).collect::<Vec<_>>(), n_cuts)
                .prop_map(move |cuts| (cuts, n_micro_batches))
        });
        (Just(virtual_stages), prop::collection::vec(replica, 1..=2))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn every_schedule_passes_every_check_on_uneven_plans(shapes in shapes()) {
        let base = megatron("16xh100", 1, 1, 1);
        check_all_schedules(&reshape(&base, &shapes));
    }

    #[test]
    fn check_judges_moved_transfers_as_an_independent_executor_does(
        shapes in shapes(),
        kind_idx in 0usize..7,
        picks in (any::<prop::sample::Index>(), any::<prop::sample::Index>(), any::<prop::sample::Index>()),
    ) {
        // Moving a receive earlier or a send later keeps every program well formed, but may make
        // ranks wait on each other in a cycle.
        let plan = reshape(&megatron("16xh100", 1, 1, 1), &shapes);
        let mut programs = generate(&plan, all_schedules()[kind_idx]).unwrap().into_programs();
        let program = picks.0.get_mut(&mut programs.programs);
        let transfers: Vec<usize> = (0..program.instructions.len())
            .filter(|&idx| {
                matches!(
                    program.instructions[idx],
                    Instruction::SendActivation { .. }
                        | Instruction::SendGradient { .. }
                        | Instruction::RecvActivation { .. }
                        | Instruction::RecvGradient { .. }
                )
            })
            .collect();
        prop_assume!(!transfers.is_empty());
        let from = *picks.1.get(&transfers);
        let instruction = program.instructions.remove(from);
        let to = match instruction {
            Instruction::RecvActivation { .. } | Instruction::RecvGradient { .. } => picks.2.index(from + 1),
            // Before the all-reduces and the optimizer step, which follow the last transfer.
            _ => from + picks.2.index(transfers.last().unwrap() - from + 1),
        };
        program.instructions.insert(to, instruction);
        // The check's verdict agrees with the independent executor's.
        match check(&plan, &programs) {
            Ok(_) => prop_assert!(runs_to_completion(&plan, &programs)),
            Err(ScheduleError::Deadlock { .. }) => prop_assert!(!runs_to_completion(&plan, &programs)),
            Err(err) => prop_assert!(false, "moving {} from {} to {} broke more than order: {}", instruction, from, to, err),
        }
    }

    #[test]
    fn interleaved_passes_every_check_on_uneven_plans(shapes in interleaved_shapes()) {
        let (virtual_stages, shapes) = shapes;
        let plan = reshape_interleaved(&megatron("32xh100", 1, 1, 1), virtual_stages, &shapes);
        check_all_schedules(&plan);
    }

    #[test]
    fn kfkb_with_k_one_is_1f1b(shapes in shapes()) {
        let plan = reshape(&megatron("16xh100", 1, 1, 1), &shapes);
        let programs = generate(&plan, kfkb(1)).unwrap();
        let one_f_one_b = generate(&plan, ScheduleKind::OneFOneB).unwrap().into_programs();
        prop_assert_eq!(programs.into_programs().programs, one_f_one_b.programs);
    }
}
