//! medley-sim's integration tests: the simulator against closed forms on trivial cases, known
//! orderings of schedules, determinism, a well-formed timeline, and clear errors.

use std::collections::BTreeMap;
use std::num::NonZeroU32;

use medley_cost::comm::{self, Link};
use medley_cost::long_context::KvExchange;
use medley_cost::{Calibration, CostModel, Setting};
use medley_plan::baselines::{Degrees, megatron_plan};
use medley_plan::long_context::{even_fixed, search_long_context};
use medley_plan::{Plan, PlanParts};
use medley_schedule::{Instruction, Schedule, ScheduleKind, generate};
use medley_sim::{BandwidthTrace, SimConfig, SimError, Simulation, simulate, simulate_context_layer, simulate_steps};
use medley_spec::{Bridge, Cluster, Fabric, GradReduce, JobParts, JobSpec, ModelSpec, Recompute, catalog_model};
use serde_json::Value;

// ---------------------------------------------------------------------------------------------
// Inputs

fn cluster(text: &str) -> Cluster {
    Cluster::from_inline(text, Fabric::default(), Bridge::default()).unwrap()
}

/// A Llama-shaped model with a 256-token vocabulary, so the head is negligible and every stage
/// of an even split costs the same: the setting of the closed forms.
fn uniform_model(n_layers: u32) -> ModelSpec {
    let config = format!(
        r#"{{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": {n_layers},
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 256}}"#
    );
    ModelSpec::from_hf_config(&config, "uniform.json").unwrap()
}

struct Layout<'a> {
    cluster: &'a str,
    model: ModelSpec,
    seq_len: u32,
    global_batch: u32,
    degrees: Degrees,
    recompute: Recompute,
}

/// One node of H100-like GPUs whose links are so fast that transfers vanish next to compute:
/// the closed forms leave communication out.
const IDEAL_NODE: &str = r#"
[[group]]
device = "ideal-h100"
nodes = 1

[[device]]
name = "ideal-h100"
vendor = "nvidia"
bf16_tflops = 989
fp16_tflops = 989
fp32_tflops = 67
hbm_gib = 80
hbm_tb_s = 3.35
intra_link = "nvlink"
intra_link_gb_s = 1000000
nics_per_node = 8
nic_gbit_s = 400
"#;

fn megatron(layout: Layout) -> Plan {
    let Layout { cluster: text, model, seq_len, global_batch, degrees, recompute } = layout;
    let cluster = if text.trim_start().starts_with("[[") {
        Cluster::from_toml(text, "test.toml").unwrap()
    } else {
        cluster(text)
    };
    let calibration = Calibration::default();
    let cost = CostModel::new(&model, seq_len, &calibration);
    let parts = JobParts { seq_len, global_batch, micro_batch: Some(1), ..JobParts::default() };
    let job = JobSpec::new(parts, "test").unwrap();
    let setting = Setting { micro_batch: 1, tp: degrees.tp, recompute };
    megatron_plan(&cluster, &cost, &job, setting, degrees).unwrap()
}

/// A one-node pipeline of `pp` uniform stages over `m` micro-batches, communication negligible.
fn uniform_pipeline(pp: u32, m: u32) -> Plan {
    interleaved_pipeline(pp, 1, m)
}

/// As [`uniform_pipeline`], each rank holding `vpp` chunks (interleaved 1F1B when over 1). Long
/// sequences make each pass long enough that the links' per-message latency (about a
/// microsecond, on a critical path of up to a few hundred transfers) stays under 0.3% of the
/// bubble.
fn interleaved_pipeline(pp: u32, vpp: u32, m: u32) -> Plan {
    megatron(Layout {
        cluster: IDEAL_NODE,
        model: uniform_model(32),
        seq_len: 16384,
        global_batch: m,
        degrees: Degrees { vpp, ..Degrees::new(8 / pp, pp, 1) },
        recompute: Recompute::None,
    })
}

fn run(plan: &Plan, schedule: ScheduleKind) -> medley_sim::StepReport {
    simulate(plan, schedule, &Calibration::default(), &SimConfig::default(), None).unwrap()
}

fn kfkb(k: u32) -> ScheduleKind {
    ScheduleKind::Kfkb { k: NonZeroU32::new(k).unwrap() }
}

// ---------------------------------------------------------------------------------------------
// Closed forms

#[test]
fn uniform_bubbles_match_the_closed_form() {
    for (pp, m) in [(2, 4), (4, 8), (4, 32), (8, 16), (8, 64)] {
        let plan = uniform_pipeline(pp, m);
        let expected = f64::from(pp - 1) / f64::from(m);
        for schedule in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
            let bubble = run(&plan, schedule).bubble_fraction;
            assert!((bubble - expected).abs() <= 0.01 * expected, "pp={pp} m={m} {schedule}: {bubble} vs {expected}");
        }
    }
}

#[test]
fn interleaved_bubbles_match_the_closed_form() {
    for (pp, vpp, m) in [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 16)] {
        let plan = interleaved_pipeline(pp, vpp, m);
        let expected = f64::from(pp - 1) / f64::from(vpp * m);
        let bubble = run(&plan, ScheduleKind::Interleaved).bubble_fraction;
        assert!((bubble - expected).abs() <= 0.01 * expected, "pp={pp} v={vpp} m={m}: {bubble} vs {expected}");
    }
}

/// `plan` with its gradients reduced after the whole backward.
fn without_overlap(plan: Plan) -> Plan {
    Plan::try_from(PlanParts { overlap_grad_reduce: false, ..plan.into_parts() }).unwrap()
}

#[test]
fn an_idle_ring_all_reduce_takes_the_alpha_beta_time_and_overlap_hides_it_behind_backward() {
    // Data parallelism across nodes, TP inside: each gradient all-reduce is a ring over NICs.
    let overlapped = megatron(Layout {
        cluster: "64xh100",
        model: catalog_model("llama3.2-1b").unwrap(),
        seq_len: 2048,
        global_batch: 8,
        degrees: Degrees::new(8, 1, 8),
        recompute: Recompute::None,
    });
    let blocking = run(&without_overlap(overlapped.clone()), ScheduleKind::OneFOneB);
    let calibration = Calibration::default();
    let cost = CostModel::new(overlapped.model(), overlapped.seq_len(), &calibration);
    let setting = Setting { micro_batch: 1, tp: 8, recompute: Recompute::None };
    let group = &overlapped.cluster().groups()[0];
    let pass = cost.stage_time(group, medley_cost::StageShape::in_pipeline(0, 1, 16), setting);
    let link: Link = comm::nic_link(overlapped.cluster(), &[0]);
    // A bf16 job reduces its gradients in fp32, as Megatron-LM does: 4 bytes a parameter.
    assert_eq!(overlapped.grad_reduce(), GradReduce::Fp32);
    let params = cost.stage_params(medley_cost::StageShape::in_pipeline(0, 1, 16)) / 8.0;
    let all_reduce_s = |format: GradReduce| comm::ring_all_reduce_s(format.bytes() * params, 8, link);
    let rank = &blocking.ranks[0];
    // Every rank computes the same and waits only for the all-reduce.
    let fp32_s = all_reduce_s(GradReduce::Fp32);
    assert!((rank.times.comm_wait_s - fp32_s).abs() < 0.01 * fp32_s, "{} vs {fp32_s}", rank.times.comm_wait_s);
    let sixteen_bit =
        PlanParts { grad_reduce: GradReduce::SixteenBit, ..without_overlap(overlapped.clone()).into_parts() };
    let sixteen_bit = run(&Plan::try_from(sixteen_bit).unwrap(), ScheduleKind::OneFOneB).ranks[0].times.comm_wait_s;
    let half_s = all_reduce_s(GradReduce::SixteenBit);
    assert!((sixteen_bit - half_s).abs() < 0.01 * half_s, "{sixteen_bit} vs {half_s}");
    assert!((rank.times.compute_s - pass.total_s()).abs() < 0.05 * pass.total_s() + 1e-3, "{rank:?}");
    // Overlapped, buckets reduce while the one backward pass runs: what is hidden is at most
    // that pass, and most of it.
    let exposed = run(&overlapped, ScheduleKind::OneFOneB).ranks[0].times.comm_wait_s;
    let hidden = rank.times.comm_wait_s - exposed;
    assert!(hidden > 0.5 * pass.backward_s && hidden <= pass.backward_s * 1.01, "{hidden} of {}", pass.backward_s);
}

// ---------------------------------------------------------------------------------------------
// Orderings

#[test]
fn interleaving_beats_one_f_one_b_when_micro_batches_are_few() {
    let (pp, m) = (4, 4);
    let one_f = run(&uniform_pipeline(pp, m), ScheduleKind::OneFOneB).step_time_s;
    let interleaved = run(&interleaved_pipeline(pp, 2, m), ScheduleKind::Interleaved).step_time_s;
    assert!(interleaved < 0.9 * one_f, "{interleaved} vs {one_f}");
}

#[test]
fn zero_bubble_beats_one_f_one_b() {
    let plan = uniform_pipeline(4, 8);
    let (one_f, zero) = (run(&plan, ScheduleKind::OneFOneB), run(&plan, ScheduleKind::ZbH1));
    assert!(zero.step_time_s < 0.97 * one_f.step_time_s, "{} vs {}", zero.step_time_s, one_f.step_time_s);
    assert!(zero.bubble_fraction < one_f.bubble_fraction);
}

#[test]
fn a_slower_network_slows_a_cross_node_pipeline_and_larger_k_recovers_some() {
    // One node per stage: every pipeline boundary crosses the network.
    let plan = megatron(Layout {
        cluster: "32xh100",
        model: uniform_model(16),
        seq_len: 4096,
        global_batch: 16,
        degrees: Degrees::new(8, 4, 1),
        recompute: Recompute::Full,
    });
    let calibration = Calibration::default();
    let step = |trace: Option<&str>, schedule| {
        let config = SimConfig { network_trace: trace.map(|t| t.parse::<BandwidthTrace>().unwrap()) };
        simulate(&plan, schedule, &calibration, &config, None).unwrap().step_time_s
    };
    let full = step(None, ScheduleKind::OneFOneB);
    let slow = step(Some("constant:0.02"), ScheduleKind::OneFOneB);
    assert!(slow > 1.2 * full, "{slow} vs {full}");
    assert!(step(Some("constant:0.02"), kfkb(4)) < slow, "k = 4 on the slow network");
}

/// Two nodes of `gpus_per_node` A100s with `nics_per_node` 100 Gb/s NICs, and `more` after.
fn a100_nodes(gpus_per_node: u32, nics_per_node: u32, more: &str) -> String {
    format!(
        "[[group]]\ndevice = \"a100\"\nnodes = 2\ngpus_per_node = {gpus_per_node}\nnics_per_node = {nics_per_node}\n\
         nic_gbit_s = 100\n{more}"
    )
}

/// The first micro-batch's activation transfers of `degrees` on `cluster_toml`: each one's
/// time in µs less the fabric's latency, and its bytes.
fn first_activation_transfers(cluster_toml: &str, degrees: Degrees) -> Vec<(f64, f64)> {
    let plan = megatron(Layout {
        cluster: cluster_toml,
        model: uniform_model(4),
        seq_len: 2048,
        global_batch: 8,
        degrees,
        recompute: Recompute::None,
    });
    let (_, bytes) = timeline_bytes(&plan, ScheduleKind::OneFOneB, None);
    let document: Value = serde_json::from_slice(&bytes).unwrap();
    let latency_us = Fabric::default().latency_us;
    document["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|event| {
            event["ph"] == "X"
                && event["cat"] == "transfer"
                && event["name"].as_str().unwrap().starts_with("activation mb0 ")
        })
        .map(|event| (event["dur"].as_f64().unwrap() - latency_us, event["args"]["bytes"].as_f64().unwrap()))
        .collect()
}

#[test]
fn two_stages_sending_through_one_nic_each_get_half_of_it() {
    let nic_bytes_per_us = 100e9 / 8.0 / 1e6;
    // Two replicas of a two-stage pipeline, a stage a node: both replicas' first activations
    // leave node 0 at the same instant. With a NIC for each GPU each has a whole NIC ...
    let two_replicas = Degrees::new(1, 2, 2);
    let own_nics = first_activation_transfers(&a100_nodes(2, 2, ""), two_replicas);
    // ... and with one NIC for both GPUs of a node, each gets half of it.
    let one_nic = first_activation_transfers(&a100_nodes(2, 1, ""), two_replicas);
    assert_eq!((own_nics.len(), one_nic.len()), (2, 2));
    for ((own_us, bytes), (shared_us, _)) in own_nics.into_iter().zip(one_nic) {
        assert!((own_us - bytes / nic_bytes_per_us).abs() < 0.01 * own_us, "{own_us} µs for {bytes} B");
        assert!((shared_us - 2.0 * own_us).abs() < 0.01 * own_us, "{shared_us} µs shared, {own_us} µs alone");
    }
    // One replica of four stages, two a node: the one transfer between the nodes has the shared
    // NIC to itself, where a fixed per-GPU share would have given it half.
    let alone = first_activation_transfers(&a100_nodes(2, 1, ""), Degrees::new(1, 4, 1));
    let (us, bytes) = alone.into_iter().max_by(|a, b| a.0.total_cmp(&b.0)).unwrap();
    assert!((us - bytes / nic_bytes_per_us).abs() < 0.01 * us, "{us} µs for {bytes} B");
}

#[test]
fn a_link_between_two_groups_is_shared_by_every_transfer_across_it() {
    // The same nodes as two groups joined by one 20 Gb/s link: both replicas' transfers cross it.
    let [a, b] = [0, 1]
        .map(|_| "[[group]]\ndevice = \"a100\"\nnodes = 1\ngpus_per_node = 2\nnics_per_node = 2\nnic_gbit_s = 100\n");
    let linked = format!("{a}{b}[[link]]\ngroups = [0, 1]\ngbit_s = 20\n");
    let transfers = first_activation_transfers(&linked, Degrees::new(1, 2, 2));
    assert_eq!(transfers.len(), 2);
    for (us, bytes) in transfers {
        let half_link_bytes_per_us = 20e9 / 8.0 / 2.0 / 1e6;
        assert!((us - bytes / half_link_bytes_per_us).abs() < 0.01 * us, "{us} µs for {bytes} B");
    }
}

/// The Ada-Grouper setting: a pipeline across nodes, one A100 per node behind one 100 Gb/s NIC,
/// so that pipeline transfers are a fair share of the step.
fn shared_network_pipeline() -> Plan {
    let text = "[[group]]\ndevice = \"a100\"\nnodes = 8\ngpus_per_node = 1\nnics_per_node = 1\nnic_gbit_s = 100\n";
    let model = catalog_model("llama3.2-1b").unwrap();
    let calibration = Calibration::default();
    let cost = CostModel::new(&model, 4096, &calibration);
    let parts = JobParts { seq_len: 4096, global_batch: 32, micro_batch: Some(1), ..JobParts::default() };
    let job = JobSpec::new(parts, "test").unwrap();
    let setting = Setting { micro_batch: 1, tp: 1, recompute: Recompute::Full };
    let cluster = Cluster::from_toml(text, "shared.toml").unwrap();
    megatron_plan(&cluster, &cost, &job, setting, Degrees::new(1, 8, 1)).unwrap()
}

#[test]
fn on_a_preempted_network_kfkb_beats_1f1b_and_adaptive_k_comes_close_to_the_best() {
    let plan = shared_network_pipeline();
    let calibration = Calibration::default();
    let config =
        SimConfig { network_trace: Some("random:seed=5,full=200ms,reduced=200ms,fraction=0.05".parse().unwrap()) };
    let mean = |schedule| simulate_steps(&plan, &calibration, &config, schedule, 12, None).unwrap().mean_step_time_s;
    let one_f_one_b = mean(Schedule::Fixed(ScheduleKind::OneFOneB));
    let fixed: BTreeMap<u32, f64> = [2, 4, 8].map(|k| (k, mean(Schedule::Fixed(kfkb(k))))).into();
    let best = fixed.values().copied().fold(f64::INFINITY, f64::min);
    assert!(one_f_one_b >= 1.10 * best, "1F1B {one_f_one_b} vs kFkB {fixed:?}");
    let adaptive = mean(Schedule::Adaptive);
    assert!(adaptive <= 1.10 * best, "adaptive {adaptive} vs fixed {fixed:?}");
}

// ---------------------------------------------------------------------------------------------
// Determinism and the timeline

fn timeline_bytes(plan: &Plan, schedule: ScheduleKind, trace: Option<&str>) -> (String, Vec<u8>) {
    let config = SimConfig { network_trace: trace.map(|t| t.parse().unwrap()) };
    let mut bytes = Vec::new();
    let report = simulate(plan, schedule, &Calibration::default(), &config, Some(&mut bytes)).unwrap();
    (serde_json::to_string(&report).unwrap(), bytes)
}

fn mixed_plan() -> Plan {
    megatron(Layout {
        cluster: "8xh100,8xmi300x",
        model: catalog_model("llama3-8b").unwrap(),
        seq_len: 2048,
        global_batch: 16,
        degrees: Degrees::new(2, 4, 2),
        recompute: Recompute::Selective,
    })
}

#[test]
fn same_input_same_bytes() {
    let plan = mixed_plan();
    let trace = Some("random:seed=11,full=20ms,reduced=10ms,fraction=0.1");
    let first = timeline_bytes(&plan, ScheduleKind::OneFOneB, trace);
    assert_eq!(first, timeline_bytes(&plan, ScheduleKind::OneFOneB, trace));
    assert_ne!(first.0, timeline_bytes(&plan, ScheduleKind::OneFOneB, None).0, "the trace matters");
}

#[test]
fn the_timeline_is_well_formed_and_tracks_never_overlap() {
    let plan = mixed_plan();
    let (_, bytes) = timeline_bytes(&plan, ScheduleKind::ZbH1, Some("on-off:full=5ms,reduced=5ms,fraction=0.2"));
    let document: Value = serde_json::from_slice(&bytes).expect("valid JSON");
    let events = document["traceEvents"].as_array().expect("traceEvents");
    let mut tracks: BTreeMap<(u64, u64), Vec<(f64, f64)>> = BTreeMap::new();
    let (mut names, mut counters, mut flow_starts, mut flow_ends) = (0, 0, BTreeMap::new(), BTreeMap::new());
    for event in events {
        let phase = event["ph"].as_str().expect("ph");
        let pid = event["pid"].as_u64().expect("pid");
        match phase {
            "X" => {
                let (ts, dur) = (event["ts"].as_f64().unwrap(), event["dur"].as_f64().unwrap());
                assert!(ts >= 0.0 && dur >= 0.0 && event["name"].is_string(), "{event}");
                tracks.entry((pid, event["tid"].as_u64().unwrap())).or_default().push((ts, ts + dur));
            }
            "M" => names += 1,
            "C" => counters += 1,
            "s" => assert!(flow_starts.insert(event["id"].as_u64().unwrap(), event["ts"].as_f64().unwrap()).is_none()),
            "f" => assert!(flow_ends.insert(event["id"].as_u64().unwrap(), event["ts"].as_f64().unwrap()).is_none()),
            other => panic!("unexpected phase {other}"),
        }
    }
    let n_ranks = 8;
    assert!(names >= 2 * n_ranks + 4 * n_ranks, "process and thread names: {names}");
    assert!(counters > 0, "memory counters");
    assert_eq!(flow_starts.keys().collect::<Vec<_>>(), flow_ends.keys().collect::<Vec<_>>());
    assert!(flow_starts.iter().all(|(id, start)| flow_ends[id] >= *start));
    for (track, mut slices) in tracks {
        slices.sort_by(|a, b| a.0.total_cmp(&b.0));
        for pair in slices.windows(2) {
            // Slices are exact to the nanosecond; allow float rounding of the microsecond values.
            assert!(pair[1].0 >= pair[0].1 - 1e-6, "overlap on {track:?}: {pair:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Errors

#[test]
fn broken_programs_cannot_reach_the_simulator() {
    let plan = uniform_pipeline(2, 2);
    let mut programs = generate(&plan, ScheduleKind::OneFOneB).unwrap().into_programs();
    // The last stage waits for a micro-batch the first stage never sends: the check, which
    // every program the simulator takes has passed, refuses them.
    programs.programs[0].instructions.retain(|i| !matches!(i, Instruction::SendActivation { micro_batch: 1, .. }));
    let message = medley_schedule::check(&plan, &programs).unwrap_err().to_string();
    assert!(message.contains("r0s1") && message.contains("recv-activation mb1"), "{message}");
}

#[test]
fn a_network_that_never_comes_back_is_reported_not_waited_for() {
    let plan = megatron(Layout {
        cluster: "32xh100",
        model: uniform_model(16),
        seq_len: 4096,
        global_batch: 8,
        degrees: Degrees::new(8, 4, 1),
        recompute: Recompute::Full,
    });
    let calibration = Calibration::default();
    // Zero from the start, and zero for good after a millisecond of full bandwidth.
    let traces =
        [BandwidthTrace::Constant { fraction: 0.0 }, BandwidthTrace::from_csv("0,1\n0.001,0\n", "t.csv").unwrap()];
    for trace in traces {
        let config = SimConfig { network_trace: Some(trace.clone()) };
        let err = simulate(&plan, ScheduleKind::OneFOneB, &calibration, &config, None).unwrap_err();
        assert!(matches!(err, SimError::Stalled { .. }), "{trace}: {err}");
        assert!(err.to_string().contains("r0s1"), "{err}");
    }
}

/// A slower network never makes a step faster: the step grows as the fraction falls, until it
/// would run past the simulator's clock, which is refused (issue 31: 1e-12 of the bandwidth gave
/// a 0.024 s step, the nanosecond clock having wrapped).
#[test]
fn a_slower_network_never_makes_a_faster_step() {
    let plan = megatron(Layout {
        cluster: "16xh100",
        model: uniform_model(4),
        seq_len: 2048,
        global_batch: 4,
        degrees: Degrees::new(8, 2, 1),
        recompute: Recompute::Full,
    });
    let calibration = Calibration::default();
    let mut last_s = 0.0;
    let mut refused = false;
    // Built directly, past the parser's floor: the engine must hold on its own.
    for fraction in [1.0, 1e-3, 1e-6, 1e-9, 1e-12, 1e-15, 1e-300] {
        let config = SimConfig { network_trace: Some(BandwidthTrace::Constant { fraction }) };
        match simulate(&plan, ScheduleKind::OneFOneB, &calibration, &config, None) {
            Ok(report) => {
                assert!(!refused, "{fraction}: a step after a slower one was refused");
                assert!(report.step_time_s > last_s, "{fraction}: {} s after {last_s} s", report.step_time_s);
                assert!((0.0..=1.0).contains(&report.comm_wait_fraction), "{}", report.comm_wait_fraction);
                last_s = report.step_time_s;
            }
            Err(err) => {
                assert!(matches!(err, SimError::PastHorizon { .. }), "{fraction}: {err}");
                assert!(err.to_string().contains("1e9 s"), "{err}");
                refused = true;
            }
        }
    }
    assert!(refused, "1e-300 of the bandwidth runs past any clock");
}

/// Issue 31: `--steps 1000000`, or a million micro-batches a step, simulated for minutes and
/// gigabytes. A step beyond the simulator's budget of passes is refused before it is simulated,
/// and a run beyond its budget of events after its first step, saying how many steps fit.
#[test]
fn runs_beyond_the_budgets_are_refused_at_once() {
    let calibration = Calibration::default();
    assert_eq!(medley_sim::passes_per_step(&uniform_pipeline(2, 3)), 6);
    let huge = megatron(Layout {
        cluster: "16xh100",
        model: uniform_model(4),
        seq_len: 2048,
        global_batch: 1 << 20,
        degrees: Degrees::new(4, 4, 1),
        recompute: Recompute::Full,
    });
    assert_eq!(medley_sim::passes_per_step(&huge), 4 << 20);
    let err = simulate(&huge, ScheduleKind::OneFOneB, &calibration, &SimConfig::default(), None).unwrap_err();
    assert!(matches!(err, SimError::TooManyPasses { .. }), "{err}");
    assert!(err.to_string().contains(&medley_sim::MAX_PASSES.to_string()), "{err}");
    // Few passes, but a gradient all-reduce across nodes every step: refused after the first.
    let replicated = megatron(Layout {
        cluster: "16xh100",
        model: uniform_model(4),
        seq_len: 2048,
        global_batch: 2,
        degrees: Degrees::new(8, 1, 2),
        recompute: Recompute::Full,
    });
    let one_step = simulate(&replicated, ScheduleKind::OneFOneB, &calibration, &SimConfig::default(), None).unwrap();
    let schedule = Schedule::Fixed(ScheduleKind::OneFOneB);
    let err = simulate_steps(&replicated, &calibration, &SimConfig::default(), schedule, u32::MAX, None).unwrap_err();
    assert!(matches!(err, SimError::TooManyEvents { .. }), "{err}");
    let max_steps = medley_sim::MAX_EVENTS / one_step.events;
    assert!(err.to_string().contains(&format!("at most {max_steps} steps")), "{err}");
}

#[test]
fn programs_of_another_plan_are_refused() {
    let calibration = Calibration::default();
    let plan = uniform_pipeline(2, 2);
    let mut simulation = Simulation::new(&plan, &calibration, &SimConfig::default(), None).unwrap();
    let err = simulation.step(&generate(&uniform_pipeline(4, 4), ScheduleKind::OneFOneB).unwrap()).unwrap_err();
    assert!(err.to_string().contains("do not match the plan"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Properties over the planner's plans for mixed clusters

/// The planner's best plans for a small mixed cluster and a model that must be split.
fn searched_plans(h100: u32, other: (&str, u32), global_batch: u32) -> Vec<Plan> {
    let text = format!("{h100}xh100,{}x{}", other.1, other.0);
    let model = catalog_model("llama3-8b").unwrap();
    let parts = JobParts { seq_len: 2048, global_batch, ..JobParts::default() };
    let job = JobSpec::new(parts, "test").unwrap();
    let options = medley_plan::SearchOptions { top: 3, ..Default::default() };
    let outcome = medley_plan::search(&cluster(&text), &model, &job, &Calibration::default(), &options).unwrap();
    outcome.candidates.into_iter().map(|candidate| candidate.plan).collect()
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 12, ..Default::default() })]

    /// Every schedule runs every searched plan to the end; no rank computes or waits longer than
    /// the step; the simulated memory peak is the one the cost model prices for the plan's schedule.
    #[test]
    fn every_schedule_runs_searched_plans_within_their_promises(
        h100 in 1u32..=2,
        other in proptest::sample::select(vec![("a100", 8u32), ("mi300x", 8), ("a100", 4), ("mi300x", 16)]),
        global_batch in proptest::sample::select(vec![16u32, 24, 64]),
    ) {
        let calibration = Calibration::default();
        for plan in searched_plans(8 * h100, other, global_batch) {
            let predicted = medley_plan::evaluate(&plan, &calibration);
            let schedules = if plan.virtual_stages() > 1 {
                vec![ScheduleKind::Interleaved]
            } else {
                vec![ScheduleKind::Gpipe, ScheduleKind::OneFOneB, kfkb(2), ScheduleKind::ZbH1]
            };
            for schedule in schedules {
                let report = run(&plan, schedule);
                for rank in &report.ranks {
                    let busy_s = rank.times.compute_s + rank.times.comm_wait_s + rank.times.peer_wait_s;
                    proptest::prop_assert!(busy_s <= report.step_time_s + 1e-9, "{rank:?}");
                    // A rank's time adds up: what it did, waited and idled is the step.
                    let accounted_s = busy_s + rank.times.idle_s;
                    proptest::prop_assert!((accounted_s - report.step_time_s).abs() <= 1e-9, "{rank:?}");
                }
                // A pipeline of several ranks cannot start its last rank before the first has
                // passed a micro-batch on: it has a bubble.
                let pipelined = plan.replicas().iter().any(|replica| plan.n_ranks(replica) > 1);
                proptest::prop_assert!(!pipelined || report.bubble_fraction > 0.0, "{schedule}: no bubble");
                if plan.schedule() == schedule.into() {
                    for (device, peak) in &report.peak_memory_by_device_gib {
                        let promised = predicted.peak_memory_by_device_gib[device];
                        // The schedule reaches its promise: the simulated peak is the priced one
                        // (interleaved prices every chunk at the largest, so there it is a bound).
                        let tight = schedule != ScheduleKind::Interleaved;
                        proptest::prop_assert!(*peak <= promised * (1.0 + 1e-9), "{schedule} {device}: {peak} > {promised}");
                        proptest::prop_assert!(!tight || peak / promised > 1.0 - 1e-6, "{schedule} {device}: {peak} < {promised}");
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Long context: context and head parallelism

fn long_job(seq_len: u32, global_batch: u32) -> JobSpec {
    JobSpec::new(JobParts { seq_len, global_batch, ..JobParts::default() }, "test").unwrap()
}

/// The even layout of `cp` groups of `hp` devices in one stage of one replica, of Llama 3 8B's
/// shape with a small vocabulary (the logits of long shards would not fit beside it).
fn even_context(text: &str, seq_len: u32, cp: u32, hp: u32) -> Plan {
    let (model, calibration) = (uniform_model(32), Calibration::default());
    even_fixed(&cluster(text), &model, &long_job(seq_len, 1), &calibration, cp, hp, 1, 1).unwrap().plan
}

/// The forward bytes each device of `plan`'s first stage sends and receives in one layer.
fn layer_bytes(plan: &Plan) -> Vec<(u64, u64)> {
    pass_bytes(plan).into_iter().map(|(forward, _)| forward).collect()
}

/// The same in the backward, without recomputation.
fn backward_layer_bytes(plan: &Plan) -> Vec<(u64, u64)> {
    pass_bytes(plan).into_iter().map(|(_, backward)| backward).collect()
}

fn pass_bytes(plan: &Plan) -> Vec<((u64, u64), (u64, u64))> {
    let calibration = Calibration::default();
    let cost = CostModel::new(plan.model(), plan.seq_len(), &calibration);
    let stage = &plan.replicas()[0].stages[0];
    let layer = simulate_context_layer(&cost, plan.cluster(), stage, Recompute::None).unwrap();
    let bytes = |pass: &medley_sim::DevicePass| (pass.sent_bytes, pass.received_bytes);
    layer.devices.iter().map(|(_, forward, backward)| (bytes(forward), bytes(backward))).collect()
}

#[test]
fn simulated_bytes_per_layer_equal_the_closed_forms() {
    // ../shared/reference/formulas.md ("Long context"), Llama 3 8B's shape: d = 4096, d_kv = 1024, bf16.
    let (d, d_kv, b, n) = (4096u64, 1024u64, 2u64, 131_072u64);
    // (Two devices cannot hold the 8B model's states; four and eight can.)
    for p in [4u64, 8] {
        // Ring over p devices: (P − 1)·(N/P)·2·d_kv·b each way.
        let ring = (p - 1) * (n / p) * 2 * d_kv * b;
        let plan = even_context("8xh100", n as u32, p as u32, 1);
        assert!(layer_bytes(&plan).iter().all(|&bytes| bytes == (ring, ring)), "ring p={p}: {:?}", layer_bytes(&plan));
        // An all-gather moves the same bytes (it only gives up the overlap).
        let plan_ring = plan.clone();
        let mut parts = plan.into_parts();
        parts.replicas[0].stages[0].context.as_mut().unwrap().kv_exchange = KvExchange::AllGather;
        let gathered = Plan::new(parts).unwrap();
        assert!(layer_bytes(&gathered).iter().all(|&bytes| bytes == (ring, ring)), "all-gather p={p}");
        // Backward: a ring passes keys and values with their gradients, twice the bytes; an
        // all-gather keeps them and reduce-scatters the gradients, as many bytes as it gathered.
        let backward = |plan: &Plan| backward_layer_bytes(plan).into_iter().all(|bytes| bytes.0 == bytes.1);
        assert!(backward(&plan_ring) && backward_layer_bytes(&plan_ring)[0].0 == 2 * ring, "ring backward p={p}");
        assert!(backward(&gathered) && backward_layer_bytes(&gathered)[0].0 == ring, "all-gather backward p={p}");
        // Ulysses over p devices: (P − 1)/P·(N/P)·(2d + 2d_kv)·b each way.
        let ulysses = (p - 1) * (n / p) * (2 * d + 2 * d_kv) * b / p;
        let plan = even_context("8xh100", n as u32, 1, p as u32);
        assert!(layer_bytes(&plan).iter().all(|&bytes| bytes == (ulysses, ulysses)), "ulysses p={p}");
    }
    // USP, u-way Ulysses inside r ring groups: both parts, the ring's on d_kv/u.
    let (u, r) = (4u64, 2u64);
    let ulysses = (u - 1) * (n / (r * u)) * (2 * d + 2 * d_kv) * b / u;
    let ring = (r - 1) * (n / r) * 2 * (d_kv / u) * b;
    let plan = even_context("8xh100", n as u32, r as u32, u as u32);
    assert!(layer_bytes(&plan).iter().all(|&bytes| bytes == (ulysses + ring, ulysses + ring)), "usp");
}

#[test]
fn a_ring_hides_its_transfers_under_attention_and_the_timeline_shows_the_phases() {
    let plan = even_context("16xh100", 131_072, 16, 1);
    let calibration = Calibration::default();
    let cost = CostModel::new(plan.model(), plan.seq_len(), &calibration);
    let stage = &plan.replicas()[0].stages[0];
    let ring = simulate_context_layer(&cost, plan.cluster(), stage, plan.recompute()).unwrap();
    let mut parts = plan.clone().into_parts();
    parts.replicas[0].stages[0].context.as_mut().unwrap().kv_exchange = KvExchange::AllGather;
    let gathered = Plan::new(parts).unwrap();
    let gather = simulate_context_layer(&cost, gathered.cluster(), &gathered.replicas()[0].stages[0], plan.recompute());
    let gather = gather.unwrap();
    assert!(ring.forward_ns() < gather.forward_ns(), "{} vs {}", ring.forward_ns(), gather.forward_ns());
    // Around the ring, the device waits less for keys and values than they take to arrive.
    let ring_wait: u64 = ring.devices.iter().map(|(_, forward, _)| forward.kv_wait_ns).max().unwrap();
    let gather_wait: u64 = gather.devices.iter().map(|(_, forward, _)| forward.kv_wait_ns).max().unwrap();
    assert!(ring_wait < gather_wait, "{ring_wait} vs {gather_wait}");
    let (_, bytes) = timeline_bytes(&plan, ScheduleKind::OneFOneB, None);
    let events: Value = serde_json::from_slice(&bytes).unwrap();
    let forward = events["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|event| event["name"].as_str().is_some_and(|name| name.starts_with("F mb0")))
        .expect("a forward slice");
    let phases = &forward["args"]["layer (slowest device)"];
    assert!(phases["compute_ns"].as_u64().unwrap() > 0 && phases["sent_bytes"].as_u64().unwrap() > 0, "{forward}");
    // The first layer of each pass, phase by phase, on a track of its own.
    let layer: Vec<&str> = events["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|event| event["cat"] == "layer")
        .filter_map(|event| event["name"].as_str())
        .collect();
    for phase in ["Q/K/V projections", "attention", "output projection, MLP"] {
        assert!(layer.contains(&phase), "{phase} not in {layer:?}");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 8, ..Default::default() })]

    /// Random mixed fleets and sequence lengths: every long-context plan the planner returns runs
    /// to the end of a simulated step within every device's memory, and the simulation lands
    /// near the cost model's price.
    #[test]
    fn long_context_plans_fit_when_simulated(
        fleet in proptest::sample::subsequence(vec!["16xh100", "32xa100", "16xh200", "16xa100-40gb", "32xl40s"], 2..=3),
        seq_len in proptest::sample::select(vec![32_768u32, 65_536, 131_072, 262_144]),
        global_batch in proptest::sample::select(vec![4u32, 8, 16]),
        model in proptest::sample::select(vec!["llama3-8b", "llama3-70b"]),
    ) {
        let (cluster, calibration) = (cluster(&fleet.join(",")), Calibration::default());
        let (spec, job) = (catalog_model(model).unwrap(), long_job(seq_len, global_batch));
        let outcome = match search_long_context(&cluster, &spec, &job, &calibration, None, None, 3) {
            Ok(outcome) => outcome,
            // 70B's states alone fill 32 of these GPUs; 8B fits every fleet here.
            Err(medley_plan::PlanError::NothingFits(_)) if model == "llama3-70b" => return Ok(()),
            Err(error) => return Err(proptest::test_runner::TestCaseError::fail(error.to_string())),
        };
        for candidate in outcome.candidates {
            let report = simulate_steps(&candidate.plan, &calibration, &SimConfig::default(), candidate.plan.schedule(), 1, None)
                .unwrap()
                .last_step;
            proptest::prop_assert!(report.fits, "{:?} does not fit: {:?}", candidate.plan.replica_shapes(), report.peak_memory_gib);
            let gap = report.step_time_s / candidate.prediction.step_time_s - 1.0;
            proptest::prop_assert!(gap.abs() < 0.15, "simulated {} vs priced {}", report.step_time_s, candidate.prediction.step_time_s);
        }
    }
}

/// Issue 33: a model whose input embedding and output head are one matrix reduces its gradients
/// between the first and the last pipeline rank each step (Megatron-LM's embedding group), which
/// neither engine priced. Tied and untied twins hold the same parameters on every stage (the
/// last keeps a copy of the tied matrix), so the exchange is the whole difference.
#[test]
fn a_tied_embedding_costs_its_gradients_exchange_between_first_and_last_rank() {
    let twin = |tied: bool| {
        let config = format!(
            r#"{{"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                "tie_word_embeddings": {tied}}}"#
        );
        let model = ModelSpec::from_hf_config(&config, "twin.json").unwrap();
        // Stage 0 on the first node, stage 1 on the second.
        let layout = Layout {
            cluster: "16xa100",
            model,
            seq_len: 2048,
            global_batch: 16,
            degrees: Degrees::new(1, 2, 8),
            recompute: Recompute::None,
        };
        without_overlap(megatron(layout))
    };
    let (tied, untied) = (twin(true), twin(false));
    let calibration = Calibration::default();
    let cost = CostModel::new(tied.model(), tied.seq_len(), &calibration);
    let sync_s = medley_plan::tied_embedding_syncs_s(&tied, &cost, &tied.cluster().devices())[0];
    // fp32 gradients of 128256 × 2048 parameters across the nodes' NICs: tens of milliseconds.
    assert!(sync_s > 0.01, "{sync_s}");
    let (simulated, simulated_untied) = (run(&tied, ScheduleKind::OneFOneB), run(&untied, ScheduleKind::OneFOneB));
    let added_s = simulated.step_time_s - simulated_untied.step_time_s;
    assert!((added_s - sync_s).abs() < 1e-6, "simulated {added_s} s, exchange {sync_s} s");
    let evaluated = medley_plan::evaluate(&tied, &calibration).dp_sync_s;
    let evaluated_untied = medley_plan::evaluate(&untied, &calibration).dp_sync_s;
    assert!((evaluated - evaluated_untied - sync_s).abs() < 1e-9, "{evaluated} - {evaluated_untied} vs {sync_s}");
    // One rank holds both ends: nothing to exchange.
    let one_stage = megatron(Layout {
        cluster: "8xa100",
        model: tied.model().clone(),
        seq_len: 2048,
        global_batch: 16,
        degrees: Degrees::new(1, 1, 8),
        recompute: Recompute::None,
    });
    let slots = one_stage.cluster().devices();
    assert_eq!(medley_plan::tied_embedding_syncs_s(&one_stage, &cost, &slots)[0], 0.0);
}

/// The tied exchanges share a node's NIC only with each other: two replicas of a four-stage
/// pipeline leave half of each node's GPUs out of it, so each exchange gets half the NIC, where
/// four replicas of a two-stage pipeline split it four ways.
#[test]
fn tied_exchanges_share_a_nic_only_with_each_other() {
    let nodes = "[[group]]\ndevice = \"a100\"\nnodes = 2\ngpus_per_node = 4\nnics_per_node = 1\nnic_gbit_s = 10\n";
    let config = r#"{"model_type": "gpt2", "n_embd": 1024, "n_layer": 24, "n_head": 16, "vocab_size": 52256}"#;
    let model = ModelSpec::from_hf_config(config, "gpt2.json").unwrap();
    let sync_s = |pp: u32, dp: u32| {
        let layout = Layout {
            cluster: nodes,
            model: model.clone(),
            seq_len: 1024,
            global_batch: 8,
            degrees: Degrees::new(1, pp, dp),
            recompute: Recompute::None,
        };
        let plan = megatron(layout);
        let calibration = Calibration::default();
        let cost = CostModel::new(plan.model(), plan.seq_len(), &calibration);
        medley_plan::tied_embedding_syncs_s(&plan, &cost, &plan.cluster().devices())[0]
    };
    // fp32 gradients of 52256 × 1024 parameters over a quarter and a half of 1.25 GB/s.
    let bytes = 4.0 * 52256.0 * 1024.0;
    let (four_ways, two_ways) = (sync_s(2, 4), sync_s(4, 2));
    assert!((four_ways - bytes / (1.25e9 / 4.0)).abs() < 0.01 * four_ways, "{four_ways}");
    assert!((two_ways - bytes / (1.25e9 / 2.0)).abs() < 0.01 * two_ways, "{two_ways}");
}
