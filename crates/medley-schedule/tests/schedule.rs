//! medley-schedule's integration tests: every generator's programs pass every check on plans
//! from the planner and on arbitrary uneven plans, and the checks catch broken programs.

use std::num::NonZeroU32;

use medley_cost::{Calibration, CostModel, Setting};
use medley_plan::baselines::{Degrees, megatron_plan};
use medley_plan::{Algorithm, DpGroup, LayerRange, Plan, Replica, Route, SearchOptions, Stage, search};
use medley_schedule::{Instruction, Programs, RankId, ScheduleError, ScheduleKind, check, generate};
use medley_spec::{Bridge, Cluster, Fabric, JobParts, JobSpec, Recompute, catalog_model};
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
    let model = catalog_model("gpt2").unwrap();
    let calibration = Calibration::default();
    let cost = CostModel::new(&model, 1024, &calibration);
    let setting = Setting { micro_batch: 1, tp: 1, recompute: Recompute::Full };
    megatron_plan(&cluster(cluster_text), &cost, &job(global_batch), setting, Degrees { tp: 1, pp, dp }).unwrap()
}

/// `base` with its replicas replaced: one per `(cuts, n_micro_batches)`, whose stages split
/// gpt2's 12 layers at `cuts`, on consecutive devices.
fn reshape(base: &Plan, shapes: &[(Vec<u32>, u32)]) -> Plan {
    let mut plan = base.clone();
    let n_layers = plan.model.n_layers();
    let mut next_device = 0;
    plan.replicas = shapes
        .iter()
        .map(|(cuts, n_micro_batches)| {
            let bounds: Vec<u32> = std::iter::once(0).chain(cuts.iter().copied()).chain([n_layers]).collect();
            let stages: Vec<Stage> = bounds
                .windows(2)
                .map(|pair| {
                    next_device += 1;
                    Stage { devices: vec![next_device - 1], layers: LayerRange { start: pair[0], end: pair[1] } }
                })
                .collect();
            let boundaries = stages.windows(2).map(|pair| route(base, &pair[0..2])).collect();
            Replica { n_micro_batches: *n_micro_batches, stages, boundaries }
        })
        .collect();
    plan.global_batch = plan.n_micro_batches() * plan.micro_batch;
    plan.dp_groups = dp_layer_ranges(&plan.replicas)
        .into_iter()
        .map(|layers| {
            let holders: Vec<Stage> = plan
                .replicas
                .iter()
                .map(|replica| replica.stages.iter().find(|stage| stage.layers.contains(layers)).unwrap().clone())
                .collect();
            DpGroup { layers, route: route(base, &holders), algorithm: Algorithm::Ring }
        })
        .collect();
    plan.validate().unwrap();
    plan
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
        Route::Bridge { mode: plan.cluster.bridge().modes()[0] }
    }
}

fn kfkb(k: u32) -> ScheduleKind {
    ScheduleKind::Kfkb { k: NonZeroU32::new(k).unwrap() }
}

fn all_schedules() -> Vec<ScheduleKind> {
    let mut kinds = vec![ScheduleKind::Gpipe, ScheduleKind::OneFOneB, ScheduleKind::ZbH1];
    kinds.extend((1..=4).map(kfkb));
    kinds
}

// ---------------------------------------------------------------------------------------------
// Checks

/// Every schedule's programs for `plan` pass every check.
fn check_all_schedules(plan: &Plan) {
    for kind in all_schedules() {
        let programs = generate(plan, kind);
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
    let mut bag: Vec<(bool, u32, RankId, RankId)> = Vec::new();
    let reached_all_reduce = |pcs: &[usize], dp_group: u32| {
        let layers = plan.dp_groups[dp_group as usize].layers;
        plan.holders(layers).iter().enumerate().all(|(replica_idx, &stage_idx)| {
            let member =
                programs.iter().position(|program| program.rank == RankId::new(replica_idx, stage_idx)).unwrap();
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
                Some(&Instruction::RecvActivation { micro_batch, from, .. }) => {
                    bag.contains(&(true, micro_batch, from, rank))
                }
                Some(&Instruction::RecvGradient { micro_batch, from, .. }) => {
                    bag.contains(&(false, micro_batch, from, rank))
                }
                Some(&Instruction::AllReduceGradients { dp_group, .. }) => reached_all_reduce(&pcs, dp_group),
                Some(_) => true,
            }
        });
        let Some(i) = movable else { return false };
        let rank = programs[i].rank;
        match programs[i].instructions[pcs[i]] {
            Instruction::SendActivation { micro_batch, to, .. } => bag.push((true, micro_batch, rank, to)),
            Instruction::SendGradient { micro_batch, to, .. } => bag.push((false, micro_batch, rank, to)),
            Instruction::RecvActivation { micro_batch, from, .. } => {
                bag.swap_remove(bag.iter().position(|&msg| msg == (true, micro_batch, from, rank)).unwrap());
            }
            Instruction::RecvGradient { micro_batch, from, .. } => {
                bag.swap_remove(bag.iter().position(|&msg| msg == (false, micro_batch, from, rank)).unwrap());
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
    let mut programs = generate(plan, kind);
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
        check(&plan, &generate(&plan, kind)).unwrap();
    }
    assert!(start.elapsed().as_secs_f64() < 5.0, "took {:?}", start.elapsed());
}

#[test]
fn the_plans_own_schedule_is_generated() {
    let plan = megatron("16xh100", 4, 2, 8);
    let programs = generate(&plan, plan.schedule.into());
    assert_eq!(programs.schedule, ScheduleKind::OneFOneB);
    check(&plan, &programs).unwrap();
}

#[test]
fn generation_is_deterministic_and_round_trips_through_json() {
    let plan = reshape(&megatron("16xh100", 1, 1, 1), &[(vec![4, 8], 4), (vec![6], 3)]);
    for kind in all_schedules() {
        let programs = generate(&plan, kind);
        assert_eq!(programs, generate(&plan, kind));
        let json = serde_json::to_string(&programs).unwrap();
        assert_eq!(json, serde_json::to_string(&generate(&plan, kind)).unwrap());
        assert_eq!(serde_json::from_str::<Programs>(&json).unwrap(), programs);
    }
}

#[test]
fn programs_print_one_instruction_a_line() {
    let plan = megatron("8xh100", 2, 1, 2);
    let text = generate(&plan, ScheduleKind::OneFOneB).to_string();
    let expected = "schedule 1f1b\nr0s0:\n     0  forward mb0 c0\n     1  send-activation mb0 c0 -> r0s1\n";
    assert!(text.starts_with(expected), "{text}");
    assert!(text.contains("recv-gradient mb1 c0 <- r0s1\n"), "{text}");
    assert!(text.contains("all-reduce-gradients dp0 layers 0..6\n"), "{text}");
    assert!(text.ends_with("optimizer-step\n"), "{text}");
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

// ---------------------------------------------------------------------------------------------
// Properties over arbitrary uneven plans

/// Up to three replicas, each with up to four stages cut anywhere in gpt2's 12 layers and its
/// own micro-batch count.
fn shapes() -> impl Strategy<Value = Vec<(Vec<u32>, u32)>> {
    let replica = (prop::collection::btree_set(1u32..12, 0..4), 1u32..=9)
        .prop_map(|(cuts, n_micro_batches)| (cuts.into_iter().collect(), n_micro_batches));
    prop::collection::vec(replica, 1..=3)
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
        let mut programs = generate(&plan, all_schedules()[kind_idx]);
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
            Ok(()) => prop_assert!(runs_to_completion(&plan, &programs)),
            Err(ScheduleError::Deadlock { .. }) => prop_assert!(!runs_to_completion(&plan, &programs)),
            Err(err) => prop_assert!(false, "moving {} from {} to {} broke more than order: {}", instruction, from, to, err),
        }
    }

    #[test]
    fn kfkb_with_k_one_is_1f1b(shapes in shapes()) {
        let plan = reshape(&megatron("16xh100", 1, 1, 1), &shapes);
        let programs = generate(&plan, kfkb(1));
        prop_assert_eq!(programs.programs, generate(&plan, ScheduleKind::OneFOneB).programs);
    }
}
