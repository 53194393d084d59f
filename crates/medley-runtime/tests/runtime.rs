//! The runtime against the single-process reference: the same losses and weights under every
//! kind of plan, with workers as threads of this process over the real communicator.

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use medley_comm::{Config, LaunchEnv};
use medley_cost::long_context::KvExchange;
use medley_cost::{Calibration, CostModel, Setting};
use medley_model::{AdamW, HostTensor};
use medley_plan::baselines::{Degrees, fixed};
use medley_plan::{Plan, ReplicaLayout, assemble, stages_from_counts};
use medley_runtime::{
    DeviceChoice, LinkEmulation, RuntimeError, StepMetrics, StopRequest, TrainEnd, TrainOptions, Worker, WorkerOptions,
};
use medley_schedule::ScheduleKind;
use medley_spec::{Cluster, JobParts, JobSpec, Recompute, Schedule, catalog_model};
use medley_trace::BandwidthTrace;
use medley_trace::timeline::{Timeline, trace_events};

const SEQ_LEN: u32 = 32;
const STEPS: u64 = 3;

/// A plan of the tiny model on `fleet` (one GPU per node): replica r runs `replicas[r].0`
/// micro-batches of one sequence over stages of `replicas[r].1` layers, on the fleet's devices
/// in order; with `chunks` > 1, stage j runs on the replica's rank j mod p.
fn plan(fleet: &str, replicas: &[(u32, &[u32])], chunks: u32) -> Plan {
    plan_of_length(SEQ_LEN, fleet, replicas, chunks)
}

fn plan_of_length(seq_len: u32, fleet: &str, replicas: &[(u32, &[u32])], chunks: u32) -> Plan {
    plan_on(Cluster::from_fleet(fleet).unwrap(), seq_len, 1, replicas, chunks)
}

/// [`plan`] on `cluster` (the inline form: nodes of up to 8 GPUs) with each stage on the next
/// `tp` devices, a tensor-parallel group.
fn tensor_parallel_plan(cluster: &str, tp: u32, replicas: &[(u32, &[u32])], chunks: u32) -> Plan {
    let cluster = Cluster::from_inline(cluster, Default::default(), Default::default()).unwrap();
    plan_on(cluster, SEQ_LEN, tp, replicas, chunks)
}

fn plan_on(cluster: Cluster, seq_len: u32, tp: u32, replicas: &[(u32, &[u32])], chunks: u32) -> Plan {
    let model = catalog_model("tiny").unwrap();
    let global_batch = replicas.iter().map(|(m, _)| m).sum();
    let parts = JobParts { seq_len, global_batch, micro_batch: Some(1), ..JobParts::default() };
    let job = JobSpec::new(parts, "test").unwrap();
    let calibration = Calibration::default();
    let cost = CostModel::new(&model, seq_len, &calibration);
    let setting = Setting { micro_batch: 1, tp, recompute: Recompute::None };
    let mut next_device = 0;
    let layouts = replicas
        .iter()
        .map(|&(n_micro_batches, counts)| {
            let p = counts.len() as u32 / chunks;
            let devices =
                (0..counts.len() as u32).map(|j| (0..tp).map(|d| next_device + (j % p) * tp + d).collect()).collect();
            next_device += p * tp;
            ReplicaLayout { n_micro_batches, stages: stages_from_counts(devices, counts) }
        })
        .collect();
    let schedule =
        if chunks > 1 { Schedule::Fixed(ScheduleKind::Interleaved) } else { Schedule::Fixed(ScheduleKind::OneFOneB) };
    Plan::new(assemble(&cluster, &cost, &job, setting, schedule, chunks, layouts)).unwrap()
}

/// Losses per step and every rank's checkpoint tensors after `STEPS` steps of `plan`.
fn train(plan: &Plan, schedule: Schedule) -> (Vec<f64>, Vec<(String, HostTensor)>) {
    train_over(plan, schedule, None, AdamW::default())
}

fn worker_options(adamw: AdamW, link: Option<LinkEmulation>) -> WorkerOptions {
    WorkerOptions {
        device: DeviceChoice::Cpu,
        seed: 7,
        adamw,
        emulate_speed: false,
        dilation: 1.0,
        comm: Config { timeout: Duration::from_secs(20), ..Config::default() },
        calibration: Calibration::default(),
        link,
    }
}

/// Every worker of `plan` joined as a thread of this process over loopback, each running `body`.
fn run_workers<R: Send>(plan: &Plan, options: WorkerOptions, body: impl Fn(Worker) -> R + Sync) -> Vec<R> {
    run_workers_each(plan, |_| options.clone(), |joined| body(joined.unwrap()))
}

/// Every worker of `plan`, worker r started with `options(r)`, joining as a thread of this
/// process over loopback, each running `body` on what joining gave.
fn run_workers_each<R: Send>(
    plan: &Plan,
    options: impl Fn(usize) -> WorkerOptions + Sync,
    body: impl Fn(Result<Worker, RuntimeError>) -> R + Sync,
) -> Vec<R> {
    let world = medley_runtime::worker_count(plan);
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..world)
            .map(|rank| {
                let (plan, options, body) = (plan.clone(), options(rank), &body);
                scope.spawn(move || {
                    let env = LaunchEnv::from_vars([
                        ("RANK", rank.to_string()),
                        ("WORLD_SIZE", world.to_string()),
                        ("MASTER_ADDR", "127.0.0.1".into()),
                        ("MASTER_PORT", port.to_string()),
                        ("MEDLEY_TOKEN", "t".into()),
                    ])
                    .unwrap();
                    body(Worker::join(plan, env, options))
                })
            })
            .collect();
        workers.into_iter().map(|worker| worker.join().unwrap()).collect()
    })
}

/// A worker's losses and whole checkpoint tensors after training.
type Trained = (Vec<f64>, Vec<(String, HostTensor)>);

/// Every worker of `plan` trains under `train`, first resuming from `resume`'s latest checkpoint
/// if given: each one's losses and whole checkpoint tensors.
fn train_workers(
    plan: &Plan,
    options: WorkerOptions,
    train: &TrainOptions,
    resume: Option<&std::path::Path>,
) -> Vec<Trained> {
    run_workers(plan, options, |mut worker| {
        if let Some(dir) = resume {
            worker.resume(dir).unwrap();
        }
        let mut losses = Vec::new();
        worker
            .train(train, None, |metrics: &StepMetrics| {
                losses.push(metrics.loss);
                Ok(())
            })
            .unwrap();
        (losses, worker.checkpoint_tensors().unwrap())
    })
}

fn train_over(
    plan: &Plan,
    schedule: Schedule,
    link: Option<LinkEmulation>,
    adamw: AdamW,
) -> (Vec<f64>, Vec<(String, HostTensor)>) {
    let train = TrainOptions {
        until_step: STEPS,
        schedule,
        checkpoint_dir: None,
        checkpoint_every: 0,
        keep_checkpoints: 1,
        stop: None,
    };
    let results = train_workers(plan, worker_options(adamw, link), &train, None);
    let losses = results[0].0.clone();
    assert!(results.iter().all(|(l, _)| *l == losses), "every rank reports the same losses");
    let mut tensors: Vec<_> = results.into_iter().flat_map(|(_, tensors)| tensors).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    // Replicas apply the same update to the same all-reduced gradients: their copies are equal.
    for pair in tensors.windows(2).filter(|pair| pair[0].0 == pair[1].0) {
        assert!(pair[0].1 == pair[1].1, "replicas disagree on {}", pair[0].0);
    }
    tensors.dedup_by(|a, b| a.0 == b.0);
    (losses, tensors)
}

#[test]
fn workers_started_with_another_job_refuse_naming_the_worker_and_what_differs() {
    let plan = plan("2xh100", &[(4, &[4, 4])], 1);
    let base = worker_options(AdamW::default(), None);
    let seed_of = |rank: usize| WorkerOptions { seed: 7 + rank as u64, ..base.clone() };
    let errors = run_workers_each(&plan, seed_of, |joined| joined.err().map(|err| err.to_string()));
    for error in &errors {
        let error = error.as_deref().unwrap_or_default();
        assert!(error.contains("worker 1 was started with another --seed than worker 0"), "{errors:?}");
    }
    let lr_of = |rank: usize| WorkerOptions {
        adamw: AdamW { lr: 1e-3 * (1 + rank) as f32, ..AdamW::default() },
        ..base.clone()
    };
    let errors = run_workers_each(&plan, lr_of, |joined| joined.err().map(|err| err.to_string()));
    assert!(errors.iter().all(|error| error.as_deref().is_some_and(|e| e.contains("--lr"))), "{errors:?}");
}

#[test]
fn a_link_too_slow_for_the_timeout_stops_the_job_saying_so() {
    let plan = plan("2xh100", &[(4, &[4, 4])], 1);
    // 16 KiB activations at one byte a second: hours a message, against a 3 s timeout.
    let link = LinkEmulation { full_bytes_per_s: 1.0, trace: BandwidthTrace::Constant { fraction: 1.0 } };
    let mut options = worker_options(AdamW::default(), Some(link));
    options.comm.timeout = Duration::from_secs(3);
    let train = TrainOptions {
        until_step: 1,
        schedule: one_f_one_b(),
        checkpoint_dir: None,
        checkpoint_every: 0,
        keep_checkpoints: 1,
        stop: None,
    };
    let errors = run_workers(&plan, options, |mut worker| {
        worker.train(&train, None, |_: &StepMetrics| Ok(())).err().map(|err| err.to_string())
    });
    let sender = errors[0].as_deref().unwrap_or_default();
    assert!(sender.contains("past the 3 s timeout") && sender.contains("--link-gb-s"), "{errors:?}");
    assert!(errors[1].is_some(), "the receiver stops too: {errors:?}");
}

#[test]
fn a_diverging_run_stops_on_every_rank_without_checkpointing_it() {
    let plan = plan("2xh100", &[(4, &[4, 4])], 1);
    let dir = tempfile::tempdir().unwrap();
    let train = TrainOptions {
        until_step: 6,
        schedule: one_f_one_b(),
        checkpoint_dir: Some(dir.path().to_path_buf()),
        checkpoint_every: 1,
        keep_checkpoints: 10,
        stop: None,
    };
    let options = worker_options(AdamW { lr: 1e10, ..AdamW::default() }, None);
    let errors = run_workers(&plan, options, |mut worker| {
        worker.train(&train, None, |_: &StepMetrics| Ok(())).unwrap_err().to_string()
    });
    assert!(errors.iter().all(|error| error.contains("training diverged at step")), "{errors:?}");
    // What was checkpointed is finite: the diverged step and those after it are not there.
    let diverged: u64 = errors[0].split("step ").nth(1).unwrap().split(':').next().unwrap().parse().unwrap();
    let steps: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("step-"))
        .collect();
    assert!(diverged >= 2, "step 1's loss comes before any update: {errors:?}");
    assert_eq!(steps.len() as u64, diverged - 1, "{steps:?} with divergence at {diverged}");
}

/// The largest difference between two runs' weights, relative to the largest weight.
fn max_relative_difference(a: &[(String, HostTensor)], b: &[(String, HostTensor)]) -> f32 {
    assert_eq!(a.iter().map(|t| &t.0).collect::<Vec<_>>(), b.iter().map(|t| &t.0).collect::<Vec<_>>());
    let mut worst = 0f32;
    for ((name, x), (_, y)) in a.iter().zip(b) {
        let scale = x.data.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let diff = x.data.iter().zip(&y.data).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(diff.is_finite(), "{name}");
        worst = worst.max(diff / scale);
    }
    worst
}

fn one_f_one_b() -> Schedule {
    Schedule::Fixed(ScheduleKind::OneFOneB)
}

/// Tolerances (relative: to the reference loss, to each tensor's largest weight) for plans whose
/// replicas sum gradients in another order than one process's micro-batch by micro-batch
/// accumulation. f32 addition is not associative, so gradients differ by ~1e-7 of their scale
/// (medley-model's uneven-shares test bounds it by 1e-5). The loss after such a step moves by as
/// little; the weights move more, because AdamW divides each moment by the root of the second
/// one, which amplifies a perturbation of a near-zero gradient up to the learning rate (3e-3).
/// Three steps here move weights by about 4e-5 of their scale.
const REORDERED_LOSS: f64 = 1e-6;
const REORDERED_WEIGHTS: f64 = 2e-4;

/// `plan` with whole optimizer states on every replica.
fn without_zero1(plan: Plan) -> Plan {
    let mut parts = plan.into_parts();
    parts.zero1 = false;
    Plan::new(parts).unwrap()
}

/// `plan` with its gradients reduced after the last backward pass, blocking.
fn without_overlap(plan: Plan) -> Plan {
    let mut parts = plan.into_parts();
    parts.overlap_grad_reduce = false;
    Plan::new(parts).unwrap()
}

/// Every plan here but one is written with ZeRO-1 and overlapped reduction, the planner's
/// defaults: uneven replicas each update an even share of the optimizer states, as the cost
/// model prices them, and reduce each chunk's gradients beside their later passes.
#[test]
fn plans_train_like_one_process() {
    let reference = train(&plan("1xh100", &[(4, &[8])], 1), one_f_one_b());
    assert!(reference.0[STEPS as usize - 1] < reference.0[0] - 0.05, "the loss falls: {:?}", reference.0);
    let kfkb = |k: u32| Schedule::Fixed(ScheduleKind::Kfkb { k: k.try_into().unwrap() });
    // (name, plan, schedule, whether the gradient sums keep one process's order exactly): a
    // replica boundary after the first replica's micro-batches keeps it, for two replicas.
    let cases: Vec<(&str, Plan, Schedule, bool)> = vec![
        ("uneven pipeline", plan("3xh100", &[(4, &[1, 2, 5])], 1), one_f_one_b(), true),
        ("uneven data parallel", plan("2xh100", &[(3, &[8]), (1, &[8])], 1), one_f_one_b(), true),
        (
            "uneven data parallel without ZeRO-1",
            without_zero1(plan("2xh100", &[(3, &[8]), (1, &[8])], 1)),
            one_f_one_b(),
            true,
        ),
        (
            "uneven data parallel, reduced after the last pass",
            without_overlap(plan("2xh100", &[(3, &[8]), (1, &[8])], 1)),
            one_f_one_b(),
            true,
        ),
        ("three uneven replicas", plan("3xh100", &[(1, &[8]), (2, &[8]), (1, &[8])], 1), one_f_one_b(), false),
        ("both, across vendors", plan("2xh100,2xmi300x", &[(3, &[3, 5]), (1, &[5, 3])], 1), one_f_one_b(), true),
        ("kfkb", plan("2xh100", &[(4, &[3, 5])], 1), kfkb(2), true),
        ("kfkb with data parallel", plan("4xh100", &[(1, &[2, 6]), (3, &[7, 1])], 1), kfkb(3), false),
        ("gpipe", plan("2xh100", &[(4, &[6, 2])], 1), Schedule::Fixed(ScheduleKind::Gpipe), true),
        ("interleaved", plan("2xh100", &[(4, &[2, 2, 1, 3])], 2), Schedule::Fixed(ScheduleKind::Interleaved), true),
        ("adaptive", plan("2xh100", &[(4, &[4, 4])], 1), Schedule::Adaptive, true),
        (
            "interleaved with data parallel",
            plan("2xh100,2xmi300x", &[(2, &[1, 3, 2, 2]), (2, &[3, 1, 1, 3])], 2),
            Schedule::Fixed(ScheduleKind::Interleaved),
            false,
        ),
    ];
    for (name, plan, schedule, same_order) in cases {
        let (losses, tensors) = train(&plan, schedule);
        let weights = f64::from(max_relative_difference(&reference.1, &tensors));
        let loss = losses.iter().zip(&reference.0).fold(0f64, |m, (a, b)| m.max((a - b).abs() / b.abs()));
        let (loss_tolerance, weight_tolerance) =
            if same_order { (0.0, 0.0) } else { (REORDERED_LOSS, REORDERED_WEIGHTS) };
        assert!(
            loss <= loss_tolerance && weights <= weight_tolerance,
            "{name}: loss differs by {loss:e}, weights by {weights:e} (relative); tolerances {loss_tolerance:e}, {weight_tolerance:e}"
        );
    }
}

/// Long enough for uneven shards of whole block pairs over four groups.
const CONTEXT_SEQ_LEN: u32 = 64;

/// The tiny model's long-context plan on `cluster` (`4xh100,4xa100`: nodes of 4) with the given
/// degrees, its shards and heads the planner's, over a global batch of 4 sequences.
fn context_plan(cluster: &str, cp: u32, hp: u32, pp: u32, dp: u32) -> Plan {
    let cluster = Cluster::from_inline(cluster, Default::default(), Default::default()).unwrap();
    let model = catalog_model("tiny").unwrap();
    let parts = JobParts { seq_len: CONTEXT_SEQ_LEN, global_batch: 4, micro_batch: Some(1), ..JobParts::default() };
    let job = JobSpec::new(parts, "test").unwrap();
    let degrees = Degrees { cp, hp, ..Degrees::new(1, pp, dp) };
    let plan = fixed(&cluster, &model, &job, &Calibration::default(), degrees).unwrap().plan;
    // The runtime all-gathers keys and values (a ring plan is refused).
    plan.with_kv_exchange(KvExchange::AllGather).unwrap()
}

/// AdamW whose ε is well above the rounding noise of the smallest gradients. Splitting attention
/// over devices sums in another order: gradients agree to ~5e-7 of each tensor's largest
/// (medley-model's context tests), but AdamW divides by √v + ε, so at the default ε = 1e-8 a
/// near-zero gradient's noise moves its weight by a share of the learning rate. Measured over
/// three steps of the four-group plan below: weights 1e-3 apart (relative) at ε = 1e-8, 6e-4 at
/// 1e-6, 1.4e-5 at 1e-4 — the gap scales with 1/ε, as amplified rounding does, while the
/// losses agree to 1e-7 throughout.
const WELL_CONDITIONED: AdamW = AdamW { eps: 1e-4, lr: 3e-3, beta1: 0.9, beta2: 0.95, weight_decay: 0.1 };

#[test]
fn long_context_plans_train_like_one_process() {
    let one_process = plan_of_length(CONTEXT_SEQ_LEN, "1xh100", &[(4, &[8])], 1);
    let reference = train_over(&one_process, one_f_one_b(), None, WELL_CONDITIONED);
    let kfkb = Schedule::Fixed(ScheduleKind::Kfkb { k: 2.try_into().unwrap() });
    let cases = [
        ("context parallel over two device types", context_plan("2xh100,2xa100", 4, 1, 1, 1), one_f_one_b()),
        ("head parallel, KV heads fewer than devices", context_plan("4xh100", 1, 4, 1, 1), one_f_one_b()),
        ("context × head parallel", context_plan("2xh100,2xa100", 2, 2, 1, 1), one_f_one_b()),
        ("context × head with pipeline and data parallel, kFkB", context_plan("8xh100,8xa100", 2, 2, 2, 2), kfkb),
    ];
    for (name, plan, schedule) in cases {
        let (losses, tensors) = train_over(&plan, schedule, None, WELL_CONDITIONED);
        let weights = f64::from(max_relative_difference(&reference.1, &tensors));
        let loss = losses.iter().zip(&reference.0).fold(0f64, |m, (a, b)| m.max((a - b).abs() / b.abs()));
        assert!(loss <= 1e-5 && weights <= 1e-4, "{name}: loss differs by {loss:e}, weights by {weights:e} (relative)");
    }
}

/// Tensor parallelism (with sequence parallelism) alone at two and four devices (more than the
/// KV heads), with pipeline and uneven data parallelism across vendors, and interleaved.
#[test]
fn tensor_parallel_plans_train_like_one_process() {
    let reference = train_over(&plan("1xh100", &[(4, &[8])], 1), one_f_one_b(), None, WELL_CONDITIONED);
    let interleaved = Schedule::Fixed(ScheduleKind::Interleaved);
    let cases = [
        ("tp = 2", tensor_parallel_plan("2xh100", 2, &[(4, &[8])], 1), one_f_one_b()),
        ("tp = 4", tensor_parallel_plan("4xh100", 4, &[(4, &[8])], 1), one_f_one_b()),
        (
            "tp = 2 × uneven pipeline × uneven data parallel, across vendors",
            tensor_parallel_plan("4xh100,4xmi300x", 2, &[(3, &[3, 5]), (1, &[5, 3])], 1),
            one_f_one_b(),
        ),
        ("tp = 2, interleaved", tensor_parallel_plan("4xh100", 2, &[(4, &[2, 2, 1, 3])], 2), interleaved),
    ];
    for (name, plan, schedule) in cases {
        let ranks: usize = plan.replicas().iter().map(|replica| plan.n_ranks(replica)).sum();
        assert!(plan.tp() > 1 && medley_runtime::worker_count(&plan) == ranks * plan.tp() as usize, "{name}");
        let (losses, tensors) = train_over(&plan, schedule, None, WELL_CONDITIONED);
        let weights = f64::from(max_relative_difference(&reference.1, &tensors));
        let loss = losses.iter().zip(&reference.0).fold(0f64, |m, (a, b)| m.max((a - b).abs() / b.abs()));
        assert!(loss <= 1e-5 && weights <= 1e-4, "{name}: loss differs by {loss:e}, weights by {weights:e} (relative)");
    }
}

/// Trains `plan` from `dir`'s latest checkpoint, if any, to step `until`, checkpointing there;
/// the losses of the steps it ran and the final weights.
fn train_to_checkpoint(plan: &Plan, dir: &std::path::Path, until: u64) -> (Vec<f64>, Vec<(String, HostTensor)>) {
    let train = TrainOptions {
        until_step: until,
        schedule: one_f_one_b(),
        checkpoint_dir: Some(dir.to_path_buf()),
        checkpoint_every: until,
        keep_checkpoints: 10,
        stop: None,
    };
    let resume = dir.join("latest").exists().then_some(dir);
    let results = train_workers(plan, worker_options(WELL_CONDITIONED, None), &train, resume);
    let mut tensors: Vec<_> = results.iter().flat_map(|(_, tensors)| tensors.clone()).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors.dedup_by(|a, b| a.0 == b.0);
    (results[0].0.clone(), tensors)
}

/// A checkpoint holds whole tensors whatever the layout that wrote it (tensor-parallel shards
/// placed together, ZeRO-1's optimizer states gathered), so training resumes under any other
/// layout: here two steps under one, the third under another, against three on one process.
#[test]
fn checkpoints_resume_under_other_tensor_pipeline_and_data_parallel_layouts() {
    let reference = train_over(&plan("1xh100", &[(4, &[8])], 1), one_f_one_b(), None, WELL_CONDITIONED);
    let layouts = [
        ("tp 2 × uneven ZeRO-1 dp 2", tensor_parallel_plan("4xh100", 2, &[(3, &[8]), (1, &[8])], 1)),
        ("uneven pp 2 × uneven ZeRO-1 dp 2", plan("4xh100", &[(1, &[5, 3]), (3, &[2, 6])], 1)),
        ("tp 4", tensor_parallel_plan("4xh100", 4, &[(4, &[8])], 1)),
    ];
    assert!(layouts[0].1.zero1() && layouts[1].1.zero1());
    for (first, second) in [(0, 1), (1, 2), (2, 0)] {
        let ((first_name, first), (second_name, second)) = (&layouts[first], &layouts[second]);
        let dir = tempfile::tempdir().unwrap();
        let (mut losses, _) = train_to_checkpoint(first, dir.path(), 2);
        let (resumed, tensors) = train_to_checkpoint(second, dir.path(), 3);
        assert_eq!(resumed.len(), 1, "the second layout resumed at step 2");
        losses.extend(resumed);
        let weights = f64::from(max_relative_difference(&reference.1, &tensors));
        let loss = losses.iter().zip(&reference.0).fold(0f64, |m, (a, b)| m.max((a - b).abs() / b.abs()));
        let name = format!("{first_name}, then {second_name}");
        assert!(loss <= 1e-5 && weights <= 1e-4, "{name}: loss differs by {loss:e}, weights by {weights:e}");
    }
}

/// A plan of the tiny model on `cluster` whose stages have their own TP degree: replica r runs
/// `replicas[r].0` micro-batches over stages of `(layers, tp)`, each on the next `tp` devices.
fn per_stage_tp_plan(cluster: &str, replicas: &[(u32, &[(u32, u32)])], zero1: bool) -> Plan {
    let cluster = Cluster::from_inline(cluster, Default::default(), Default::default()).unwrap();
    let model = catalog_model("tiny").unwrap();
    let global_batch = replicas.iter().map(|(m, _)| m).sum();
    let parts = JobParts { seq_len: SEQ_LEN, global_batch, micro_batch: Some(1), zero1, ..JobParts::default() };
    let job = JobSpec::new(parts, "test").unwrap();
    let calibration = Calibration::default();
    let cost = CostModel::new(&model, SEQ_LEN, &calibration);
    let largest = replicas.iter().flat_map(|(_, stages)| stages.iter().map(|&(_, tp)| tp)).max().unwrap();
    let setting = Setting { micro_batch: 1, tp: largest, recompute: Recompute::None };
    let mut next_device = 0;
    let layouts = replicas
        .iter()
        .map(|&(n_micro_batches, stages)| {
            let devices = stages
                .iter()
                .map(|&(_, tp)| {
                    next_device += tp;
                    (next_device - tp..next_device).collect()
                })
                .collect();
            let counts: Vec<u32> = stages.iter().map(|&(layers, _)| layers).collect();
            ReplicaLayout { n_micro_batches, stages: stages_from_counts(devices, &counts) }
        })
        .collect();
    let mut parts = assemble(&cluster, &cost, &job, setting, one_f_one_b(), 1, layouts);
    parts.version = medley_plan::PLAN_VERSION_PER_STAGE_TP;
    Plan::new(parts).unwrap()
}

/// Stages of their own TP degree: tp 1 and tp 2 stages in one replica, replicas of different TP
/// degrees (their gradients reduced whole), and both at once.
#[test]
fn per_stage_tensor_parallel_plans_train_like_one_process() {
    let reference = train_over(&plan("1xh100", &[(4, &[8])], 1), one_f_one_b(), None, WELL_CONDITIONED);
    let cases = [
        ("tp 1 then tp 2 in one replica, ZeRO-1", per_stage_tp_plan("4xh100", &[(4, &[(3, 1), (5, 2)])], true)),
        ("replicas of tp 2 and tp 1", per_stage_tp_plan("4xh100", &[(3, &[(8, 2)]), (1, &[(8, 1)])], false)),
        (
            "both, with stages cut apart",
            per_stage_tp_plan("8xh100", &[(3, &[(3, 2), (5, 1)]), (1, &[(5, 1), (3, 2)])], false),
        ),
    ];
    for (name, plan) in cases {
        assert!(plan.uniform_tp().is_none() && plan.version() == medley_plan::PLAN_VERSION_PER_STAGE_TP, "{name}");
        let (losses, tensors) = train_over(&plan, one_f_one_b(), None, WELL_CONDITIONED);
        let weights = f64::from(max_relative_difference(&reference.1, &tensors));
        let loss = losses.iter().zip(&reference.0).fold(0f64, |m, (a, b)| m.max((a - b).abs() / b.abs()));
        assert!(loss <= 1e-5 && weights <= 1e-4, "{name}: loss differs by {loss:e}, weights by {weights:e} (relative)");
    }
    let refused = per_stage_tp_plan("4xh100", &[(3, &[(8, 2)]), (1, &[(8, 1)])], true);
    let refused = medley_runtime::check_runnable(&refused).unwrap_err().to_string();
    assert!(refused.contains("differ in TP degree") && refused.contains("--no-zero1"), "{refused}");
}

#[test]
fn a_throttled_link_slows_transfers_but_not_the_result() {
    let plan = plan("2xh100", &[(4, &[4, 4])], 1);
    let (fast_losses, fast_weights) = train(&plan, one_f_one_b());
    // 16 KiB activations (sequence 32 × width 128 × 4 bytes) at 4 MB/s: 4 ms or more per message.
    let trace = BandwidthTrace::OnOff { full_ns: 1_000_000, reduced_ns: 1_000_000, fraction: 0.5 };
    let link = LinkEmulation { full_bytes_per_s: 4e6, trace };
    let started = std::time::Instant::now();
    let (losses, weights) = train_over(&plan, Schedule::Adaptive, Some(link), AdamW::default());
    // 3 steps of 4 activations and 4 gradients, each at least 4 ms over its link.
    assert!(started.elapsed() >= Duration::from_millis(3 * 4 * 4), "{:?}", started.elapsed());
    assert_eq!((losses, weights), (fast_losses, fast_weights));
}

#[test]
fn a_stop_asked_of_one_rank_stops_every_rank_at_the_same_step_with_a_checkpoint() {
    let plan = plan("3xh100", &[(2, &[2, 2, 4])], 1);
    let dir = tempfile::tempdir().unwrap();
    let ends = run_workers(&plan, worker_options(AdamW::default(), None), |mut worker| {
        let stop = StopRequest { requested: Arc::new(AtomicBool::new(false)), checkpoint: true };
        let train = TrainOptions {
            until_step: 6,
            schedule: one_f_one_b(),
            checkpoint_dir: Some(dir.path().to_path_buf()),
            checkpoint_every: 0,
            keep_checkpoints: 10,
            stop: Some(stop.clone()),
        };
        let asked = worker.layout().job_rank == 1;
        worker
            .train(&train, None, |metrics: &StepMetrics| {
                // Asked after step 2's metrics were gathered: every rank learns of it with step 3's.
                if asked && metrics.step == 2 {
                    stop.requested.store(true, Ordering::Release);
                }
                Ok(())
            })
            .unwrap()
    });
    assert!(ends.iter().all(|end| *end == TrainEnd::Stopped { step: 3, checkpointed: true }), "{ends:?}");
    assert_eq!(std::fs::read_to_string(dir.path().join("latest")).unwrap(), "step-00000003");
}

#[test]
fn a_checkpoint_that_fails_before_it_is_published_leaves_no_rank_files() {
    let plan = plan("3xh100", &[(2, &[2, 2, 4])], 1);
    let dir = tempfile::tempdir().unwrap();
    // Rank 0 cannot publish step 1: its manifest's name is taken by a directory (as a full
    // disk or a dead peer fails it, after the other ranks wrote their files).
    std::fs::create_dir_all(dir.path().join("step-00000001/manifest.json")).unwrap();
    let train = TrainOptions {
        until_step: 1,
        schedule: one_f_one_b(),
        checkpoint_dir: Some(dir.path().to_path_buf()),
        checkpoint_every: 1,
        keep_checkpoints: 3,
        stop: None,
    };
    let errors = run_workers(&plan, worker_options(AdamW::default(), None), |mut worker| {
        let result = worker.train(&train, None, |_: &StepMetrics| Ok(()));
        // As `medley worker` does with a failure of its own: the others stop at once.
        if let Err(err) = &result
            && err.blamed_rank().is_none()
        {
            worker.abort(&err.to_string());
        }
        result.err().map(|err| err.to_string())
    });
    assert!(errors.iter().all(Option::is_some), "{errors:?}");
    let left: Vec<String> = std::fs::read_dir(dir.path().join("step-00000001"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["manifest.json"], "the unpublished checkpoint's rank files stayed");
    assert!(!dir.path().join("latest").exists());
}

/// What the runtime cannot run it refuses before starting a worker, naming it: sharded gradients
/// (ZeRO-2) and 16-bit reduction among them, rather than training another plan than the one priced.
#[test]
fn plans_the_runtime_cannot_run_are_refused_naming_what() {
    let runnable = plan("4xh100", &[(2, &[4, 4]), (2, &[4, 4])], 1);
    medley_runtime::check_runnable(&runnable).unwrap();
    let with = |edit: fn(&mut medley_plan::PlanParts)| {
        let mut parts = runnable.clone().into_parts();
        edit(&mut parts);
        medley_runtime::check_runnable(&Plan::new(parts).unwrap()).unwrap_err().to_string()
    };
    let zero2 = with(|parts| parts.shard_gradients = true);
    assert!(zero2.contains("ZeRO-2") && zero2.contains("--shard-gradients"), "{zero2}");
    let sixteen = with(|parts| parts.grad_reduce = medley_spec::GradReduce::SixteenBit);
    assert!(sixteen.contains("--grad-reduce fp32"), "{sixteen}");
}

/// A plan written with the planner's defaults (ZeRO-1, overlapped reduction) is trained as it
/// was written and priced; a change (a ring exchange of keys and values, which the runtime
/// all-gathers) is said, never silent; one it cannot run at all is refused.
#[test]
fn a_plan_is_trained_as_written_or_says_what_changed() {
    let written = plan("4xh100", &[(2, &[4, 4]), (2, &[4, 4])], 1);
    assert!(written.zero1() && written.overlap_grad_reduce());
    let (trained, changes) = medley_runtime::as_trained(written.clone()).unwrap();
    assert_eq!((trained == written, changes.len()), (true, 0), "{changes:?}");
    let ring = context_plan("4xh100,4xa100", 2, 1, 1, 1);
    let (_, changes) = medley_runtime::as_trained(ring.with_kv_exchange(KvExchange::Ring).unwrap()).unwrap();
    assert!(changes.len() == 1 && changes[0].contains("no ring attention yet"), "{changes:?}");
    let mut parts = written.into_parts();
    parts.shard_gradients = true;
    let err = medley_runtime::as_trained(Plan::new(parts).unwrap()).unwrap_err().to_string();
    assert!(err.contains("ZeRO-2"), "{err}");
}

/// Under overlapped reduction, a chunk's gradients are summed beside the rank's later passes:
/// on an interleaved plan with two replicas, some bucket starts before its rank's last backward
/// pass ends, as the simulator runs it; without overlap none does.
#[test]
fn overlapped_reduction_runs_beside_later_passes() {
    let written = plan("2xh100,2xmi300x", &[(2, &[1, 3, 2, 2]), (2, &[3, 1, 1, 3])], 2);
    let interleaved = Schedule::Fixed(ScheduleKind::Interleaved);
    let overlapping_ranks = |plan: &Plan| -> usize {
        let train = TrainOptions {
            until_step: 1,
            schedule: interleaved,
            checkpoint_dir: None,
            checkpoint_every: 0,
            keep_checkpoints: 1,
            stop: None,
        };
        let traces = run_workers(plan, worker_options(AdamW::default(), None), |mut worker| {
            let mut out = Vec::new();
            let mut timeline = Timeline::new(&mut out);
            worker.train(&train, Some(&mut timeline), |_| Ok(())).unwrap();
            timeline.finish().unwrap();
            String::from_utf8(out).unwrap()
        });
        traces
            .iter()
            .filter(|trace| {
                let events = trace_events(trace);
                let end = |event: &serde_json::Value| event["ts"].as_f64().unwrap() + event["dur"].as_f64().unwrap();
                let named = |prefix: &str| -> Vec<&serde_json::Value> {
                    events.iter().filter(|e| e["name"].as_str().is_some_and(|name| name.starts_with(prefix))).collect()
                };
                let last_backward_end = named("backward").into_iter().map(end).fold(0.0, f64::max);
                let buckets = named("all-reduce dp");
                assert!(!buckets.is_empty(), "every rank of two replicas reduces");
                buckets.iter().any(|bucket| bucket["ts"].as_f64().unwrap() < last_backward_end)
            })
            .count()
    };
    assert!(overlapping_ranks(&written) > 0, "no reduction ran beside a later pass");
    assert_eq!(overlapping_ranks(&without_overlap(written)), 0);
}
