//! The runtime's long-context attention moves, per worker and step, the bytes the simulator
//! counts for the same plan's devices: the head groups' all-to-alls and the lanes' keys, values
//! and their gradients. Here, where both crates meet (the runtime does not depend on the
//! simulator).

use std::net::TcpListener;
use std::time::Duration;

use medley_comm::{Config, LaunchEnv};
use medley_cost::long_context::KvExchange;
use medley_cost::{Calibration, CostModel};
use medley_model::AdamW;
use medley_plan::Plan;
use medley_plan::baselines::{Degrees, fixed};
use medley_runtime::{DeviceChoice, StepMetrics, TrainOptions, Worker, WorkerOptions, worker_count};
use medley_sim::simulate_context_layer;
use medley_spec::{Cluster, JobParts, JobSpec, Recompute, Schedule, ScheduleKind, catalog_model};

const STEPS: u64 = 2;
/// The runtime sends `f32`, the simulator prices bf16.
const RUNTIME_PER_SIMULATED_BYTE: u64 = 2;

fn context_plan(cluster: &str, degrees: Degrees) -> Plan {
    let cluster = Cluster::from_inline(cluster, Default::default(), Default::default()).unwrap();
    let model = catalog_model("tiny").unwrap();
    let parts = JobParts { seq_len: 64, global_batch: 4, micro_batch: Some(1), ..JobParts::default() };
    let job = JobSpec::new(parts, "test").unwrap();
    let plan = fixed(&cluster, &model, &job, &Calibration::default(), degrees).unwrap().plan;
    plan.with_kv_exchange(KvExchange::AllGather).unwrap()
}

/// Each worker's attention bytes after `STEPS` steps of `plan`, workers as threads of this process.
fn runtime_bytes(plan: &Plan) -> Vec<u64> {
    let world = worker_count(plan);
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let options = WorkerOptions {
        device: DeviceChoice::Cpu,
        seed: 7,
        adamw: AdamW::default(),
        emulate_speed: false,
        dilation: 1.0,
        comm: Config { timeout: Duration::from_secs(20), ..Config::default() },
        calibration: Calibration::default(),
        link: None,
    };
    let schedule = Schedule::Fixed(ScheduleKind::OneFOneB);
    let train = TrainOptions {
        until_step: STEPS,
        schedule,
        checkpoint_dir: None,
        checkpoint_every: 0,
        keep_checkpoints: 1,
        stop: None,
    };
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..world)
            .map(|rank| {
                let (plan, options, train) = (plan.clone(), options.clone(), train.clone());
                scope.spawn(move || {
                    let vars = [
                        ("RANK", rank.to_string()),
                        ("WORLD_SIZE", world.to_string()),
                        ("MASTER_ADDR", "127.0.0.1".into()),
                        ("MASTER_PORT", port.to_string()),
                        ("MEDLEY_TOKEN", "t".into()),
                    ];
                    let mut worker = Worker::join(plan, LaunchEnv::from_vars(vars).unwrap(), options).unwrap();
                    worker.train(&train, None, |_: &StepMetrics| Ok(())).unwrap();
                    worker.context_bytes_sent()
                })
            })
            .collect();
        workers.into_iter().map(|worker| worker.join().unwrap()).collect()
    })
}

/// Each device's simulated attention bytes over `STEPS` steps, in the workers' order (replica by
/// replica, stage by stage, device by device), in the runtime's element size.
fn simulated_bytes(plan: &Plan) -> Vec<u64> {
    let calibration = Calibration::default();
    let cost = CostModel::new(plan.model(), plan.seq_len(), &calibration);
    let mut bytes = Vec::new();
    for replica in plan.replicas() {
        for stage in &replica.stages {
            let layer = simulate_context_layer(&cost, plan.cluster(), stage, Recompute::None).unwrap();
            let passes = u64::from(replica.n_micro_batches) * stage.layers.len() as u64 * STEPS;
            for (_, forward, backward) in &layer.devices {
                bytes.push((forward.sent_bytes + backward.sent_bytes) * passes * RUNTIME_PER_SIMULATED_BYTE);
            }
        }
    }
    bytes
}

/// `plan` with its first stage's groups' tokens split unevenly over their devices (3:1).
fn uneven_token_runs(plan: Plan) -> Plan {
    let mut parts = plan.into_parts();
    let context = parts.replicas[0].stages[0].context.as_mut().unwrap();
    for group in &mut context.groups {
        let quarter = group.tokens / 4;
        group.device_tokens = vec![group.tokens - quarter, quarter];
    }
    Plan::new(parts).unwrap()
}

#[test]
fn attention_bytes_per_worker_equal_the_simulators() {
    let cp_hp = Degrees { cp: 2, hp: 2, ..Degrees::new(1, 1, 1) };
    let cases = [
        ("uneven token runs in each head group", uneven_token_runs(context_plan("2xh100,2xa100", cp_hp))),
        (
            "uneven context × head parallel",
            context_plan("2xh100,2xa100", Degrees { cp: 2, hp: 2, ..Degrees::new(1, 1, 1) }),
        ),
        ("head parallel, KV heads shared", context_plan("4xh100", Degrees { hp: 4, ..Degrees::new(1, 1, 1) })),
        ("with pipeline and data parallel", context_plan("8xh100", Degrees { cp: 2, hp: 2, ..Degrees::new(1, 1, 2) })),
    ];
    for (name, plan) in cases {
        assert_eq!(plan.recompute(), Recompute::None, "{name}: the runtime does not recompute");
        let (runtime, simulated) = (runtime_bytes(&plan), simulated_bytes(&plan));
        assert!(runtime.iter().all(|&bytes| bytes > 0), "{name}: {runtime:?}");
        assert_eq!(runtime, simulated, "{name}: runtime against simulated bytes per worker");
    }
}
