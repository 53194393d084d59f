//! Megatron-LM export of five kinds of plan: the arguments, the layout against Megatron's own
//! rules, the rank placement, and the refusals.

mod plans;

use medley_cost::Calibration;
use medley_cost::long_context::KvExchange;
use medley_export::megatron::{MegatronExport, check_layout, megatron};
use medley_plan::baselines::Degrees;
use medley_plan::long_context::even_fixed;
use medley_plan::{Plan, PlanParts};
use medley_spec::{AttentionKernel, GradReduce, Precision, RopeScaling, Schedule, ScheduleKind, catalog_model};
use plans::{Zero1, assembled, cluster, job, launch, uniform, with_model, words};

fn value<'a>(export: &'a MegatronExport, flag: &str) -> Option<&'a str> {
    plans::value(&export.args, flag)
}

fn refusal(plan: &Plan) -> String {
    plans::refusal(megatron(plan).map(|export| export.command_line()), "Megatron-LM")
}

#[test]
fn a_uniform_plan_exports_megatrons_own_sizes() {
    let export = megatron(&uniform("8xh100", Degrees::new(2, 2, 2), Zero1::On)).unwrap();
    assert_eq!(export.world_size, 8);
    for (flag, expected) in [
        ("--tensor-model-parallel-size", "2"),
        ("--pipeline-model-parallel-size", "2"),
        ("--pipeline-model-parallel-layout", "Et*16|t*16L"),
        ("--sequence-parallel", ""),
        ("--micro-batch-size", "1"),
        ("--global-batch-size", "32"),
        ("--recompute-granularity", "selective"),
        ("--num-layers", "32"),
        ("--hidden-size", "4096"),
        ("--ffn-hidden-size", "14336"),
        ("--num-attention-heads", "32"),
        ("--num-query-groups", "8"),
        ("--seq-length", "4096"),
        ("--normalization", "RMSNorm"),
        ("--swiglu", ""),
        ("--untie-embeddings-and-output-weights", ""),
        ("--use-distributed-optimizer", ""),
        ("--overlap-grad-reduce", ""),
    ] {
        assert_eq!(value(&export, flag), Some(expected), "{flag} in {}", export.command_line());
    }
    // A fused kernel is Megatron's default; an unfused one, and no overlap, are asked for.
    assert_eq!(value(&export, "--attention-backend"), None);
    let parts = uniform("8xh100", Degrees::new(2, 2, 2), Zero1::On).into_parts();
    let other = PlanParts { attention: AttentionKernel::Unfused, overlap_grad_reduce: false, ..parts };
    let other = megatron(&Plan::try_from(other).unwrap()).unwrap();
    assert_eq!(value(&other, "--attention-backend"), Some("unfused"));
    assert_eq!(value(&other, "--overlap-grad-reduce"), None);
    // One host of 8: Megatron's order (tp fastest, then dp, pp) is the plan's device order here.
    assert_eq!(export.placement.hosts.len(), 1);
    assert_eq!(export.placement.hosts[0].gpus, (0..8).collect::<Vec<u32>>());
}

#[test]
fn the_launch_script_gives_torchrun_megatrons_arguments_word_for_word() {
    for plan in [
        uniform("8xh100", Degrees::new(2, 2, 2), Zero1::On),
        assembled("2xh100,2xh100", &[(4, &[16, 16]), (4, &[16, 16])], Zero1::On),
    ] {
        let export = megatron(&plan).unwrap();
        for host in &export.placement.hosts {
            let node_rank = export.placement.hosts.iter().position(|listed| listed == host).unwrap() as u32;
            let launched = launch(&export.launch_script(), node_rank, &["--data-path", "my data"]);
            let program = launched.argv.iter().position(|arg| arg == "pretrain_gpt.py").unwrap();
            let mut expected = words(&export.args);
            expected.extend(["--data-path".to_string(), "my data".to_string()]);
            assert_eq!(launched.argv[program + 1..], expected[..], "{}", export.launch_script());
            let gpus: Vec<String> = host.gpus.iter().map(ToString::to_string).collect();
            assert_eq!(launched.cuda_visible_devices, gpus.join(","));
            assert!(launched.argv.contains(&export.placement.procs_per_host.to_string()));
        }
    }
}

#[test]
fn uneven_stages_and_virtual_stages_become_a_layout_megatron_accepts() {
    let uneven = megatron(&assembled("3xh100", &[(8, &[6, 10, 16])], Zero1::On)).unwrap();
    let layout = value(&uneven, "--pipeline-model-parallel-layout").unwrap();
    assert_eq!(layout, "Et*6|t*10|t*16L");
    check_layout(layout, 3, 32).unwrap();
    let interleaved = megatron(&uniform("8xh100", Degrees { vpp: 2, ..Degrees::new(1, 4, 2) }, Zero1::On)).unwrap();
    let layout = value(&interleaved, "--pipeline-model-parallel-layout").unwrap();
    assert_eq!(layout.split('|').count(), 8, "{layout}: p·v stages in layer order");
    check_layout(layout, 4, 32).unwrap();
}

#[test]
fn ranks_follow_megatrons_order_onto_the_plans_devices() {
    // tp = 2, pp = 2, dp = 2 over two nodes of 4: Megatron puts pipeline stage 0 on ranks 0–3.
    let plan = uniform("8xh100", Degrees::new(2, 2, 2), Zero1::On);
    let export = megatron(&plan).unwrap();
    for rank in &export.placement.ranks {
        let (tp, dp, pp) = (rank.rank % 2, rank.rank / 2 % 2, rank.rank / 4);
        let stage = &plan.replicas()[dp as usize].stages[pp as usize];
        assert_eq!(rank.device, stage.devices[tp as usize], "rank {}", rank.rank);
    }
}

#[test]
fn a_replicas_stages_in_one_node_take_megatrons_pipeline_first_order() {
    // Replica 0's two stages on node 0, replica 1's on node 1: only tp-pp-dp order keeps each
    // node's ranks consecutive.
    let export = megatron(&assembled("2xh100,2xh100", &[(4, &[16, 16]), (4, &[16, 16])], Zero1::On)).unwrap();
    assert_eq!(value(&export, "--use-tp-pp-dp-mapping"), Some(""));
    assert_eq!((export.placement.hosts.len(), export.placement.procs_per_host), (2, 2));
    let uniform = megatron(&uniform("8xh100", Degrees::new(2, 2, 2), Zero1::On)).unwrap();
    assert_eq!(value(&uniform, "--use-tp-pp-dp-mapping"), None, "the default order places it");
}

#[test]
fn even_context_parallelism_exports_and_uneven_is_refused() {
    let model = catalog_model("llama3-8b").unwrap();
    let calibration = Calibration::default();
    let long = job(131_072, 4, Zero1::On);
    let ring = even_fixed(&cluster("8xh100"), &model, &long, &calibration, 8, 1, 1, 1).unwrap().plan;
    let export = megatron(&ring).unwrap();
    assert_eq!(value(&export, "--context-parallel-size"), Some("8"));
    assert_eq!(value(&export, "--cp-comm-type"), Some("p2p"));
    let usp = even_fixed(&cluster("8xh100"), &model, &long, &calibration, 2, 4, 1, 1).unwrap().plan;
    let export = megatron(&usp).unwrap();
    assert_eq!(value(&export, "--cp-comm-type"), Some("a2a+p2p"));
    assert_eq!(value(&export, "--hierarchical-context-parallel-sizes"), Some("4 2"));
    let gathered = megatron(&ring.clone().with_kv_exchange(KvExchange::AllGather).unwrap()).unwrap();
    assert_eq!(value(&gathered, "--cp-comm-type"), Some("allgather"));
    let mut parts = ring.into_parts();
    let context = parts.replicas[0].stages[0].context.as_mut().unwrap();
    let unit = 2 * context.block;
    context.groups[0].tokens += unit;
    context.groups[0].device_tokens[0] += unit;
    context.groups[1].tokens -= unit;
    context.groups[1].device_tokens[0] -= unit;
    let uneven = Plan::new(parts).unwrap();
    assert!(refusal(&uneven).contains("2·cp equal chunks"), "{}", refusal(&uneven));
}

#[test]
fn what_megatron_cannot_run_is_refused_naming_it() {
    let shares = refusal(&assembled("2xh100", &[(6, &[32]), (2, &[32])], Zero1::On));
    assert!(shares.contains("replica 1 runs 2 micro-batches a step and replica 0 6"), "{shares}");
    let splits = refusal(&assembled("4xh100", &[(4, &[12, 20]), (4, &[20, 12])], Zero1::On));
    assert!(splits.contains("[20, 12]") && splits.contains("one pipeline split"), "{splits}");
    let vendors = refusal(&assembled("1xh100,1xmi300x", &[(4, &[16, 16])], Zero1::On));
    assert!(vendors.contains("does not cross vendors"), "{vendors}");
    let gpipe =
        assembled("2xh100", &[(4, &[16, 16])], Zero1::On).with_schedule(Schedule::Fixed(ScheduleKind::Gpipe)).unwrap();
    assert!(refusal(&gpipe).contains("1F1B"), "{}", refusal(&gpipe));
    let mut per_stage = uniform("8xh100", Degrees::new(2, 2, 1), Zero1::On).into_parts();
    per_stage.replicas[0].stages[1].devices = vec![2, 3, 4, 5];
    (per_stage.tp, per_stage.version) = (4, medley_plan::PLAN_VERSION_PER_STAGE_TP);
    let per_stage = refusal(&Plan::new(per_stage).unwrap());
    assert!(per_stage.contains("differ in tensor-parallel degree (2–4)"), "{per_stage}");
}

#[test]
fn layouts_are_checked_by_megatrons_rules() {
    check_layout("Et*3|t*2,tL", 2, 6).unwrap();
    for (layout, pp, layers, wanted) in [
        ("Et*3|t*3L", 4, 6, "not a multiple"),
        ("t*3E|t*3L", 2, 6, "embedding must come first"),
        ("Et*3|t*2L", 2, 6, "and 6"),
        ("Et*3|t*3LL", 2, 6, "one, one"),
        ("Et*3|m*3L", 2, 6, "not a layer"),
    ] {
        let error = check_layout(layout, pp, layers).unwrap_err();
        assert!(error.contains(wanted), "{layout}: {error}");
    }
}

/// Issue 33: the export left out Llama 3's RoPE base and scaling, the norm's ε and the
/// vocabulary, and Megatron trained a different model than the one planned.
#[test]
fn a_llama3_plan_exports_every_setting_of_its_math() {
    let export = megatron(&uniform("8xh100", Degrees::new(2, 2, 2), Zero1::On)).unwrap();
    for (flag, expected) in [
        ("--rotary-base", "500000"),
        ("--use-rope-scaling", ""),
        ("--rope-scaling-factor", "8"),
        ("--norm-epsilon", "0.00001"),
        ("--padded-vocab-size", "128256"),
        ("--position-embedding-type", "rope"),
        ("--bf16", ""),
    ] {
        assert_eq!(value(&export, flag), Some(expected), "{flag} in {}", export.command_line());
    }
    // Megatron parses these as it declares them: an int base, float factor and ε.
    let parsed = |flag| value(&export, flag).unwrap().parse::<f64>().unwrap();
    assert_eq!((parsed("--rope-scaling-factor"), parsed("--norm-epsilon")), (8.0, 1e-5));
    value(&export, "--rotary-base").unwrap().parse::<u64>().unwrap();
    // Without scaling, no scaling flags; a plan's own base and ε are carried as they are.
    let plain = with_model(uniform("8xh100", Degrees::new(2, 2, 2), Zero1::On), |model| {
        model.rope_scaling = None;
        model.rope_theta = 1e6;
        model.norm_eps = 1e-6;
    });
    let plain = megatron(&plain).unwrap();
    assert_eq!(value(&plain, "--use-rope-scaling"), None);
    assert_eq!(value(&plain, "--rotary-base"), Some("1000000"));
    assert_eq!(value(&plain, "--norm-epsilon"), Some("0.000001"));
}

#[test]
fn numerics_megatron_cannot_carry_are_refused_naming_them() {
    let plan = || uniform("8xh100", Degrees::new(2, 2, 2), Zero1::On);
    let fractional = refusal(&with_model(plan(), |model| model.rope_theta = 10_000.5));
    assert!(fractional.contains("--rotary-base takes a whole number"), "{fractional}");
    let scaling = with_model(plan(), |model| {
        model.rope_scaling = Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 2.0,
            original_max_position_embeddings: 8192,
        })
    });
    assert!(refusal(&scaling).contains("fixes them at 1, 4 and 8192"), "{}", refusal(&scaling));
    let odd_vocab = refusal(&with_model(plan(), |model| model.vocab = 50257));
    // An fp16 plan (V100s) runs Megatron's fp16 with its dynamic loss scaling, not --bf16.
    let fp16 = Plan::try_from(PlanParts { precision: Precision::Fp16Mixed, ..plan().into_parts() }).unwrap();
    let fp16 = megatron(&fp16).unwrap();
    assert_eq!((value(&fp16, "--fp16"), value(&fp16, "--bf16")), (Some(""), None));
    assert!(odd_vocab.contains("50257 tokens does not split over tensor parallelism 2"), "{odd_vocab}");
}

/// Issue 33: the format gradients are reduced in changes the numerics and the bytes a step moves;
/// the export says it whatever Megatron's default for the precision is.
#[test]
fn the_gradient_reduction_format_is_exported_as_planned() {
    let plan = || uniform("8xh100", Degrees::new(2, 2, 2), Zero1::On);
    let reduce = |grad_reduce, precision| {
        let parts = PlanParts { grad_reduce, precision, ..plan().into_parts() };
        let export = megatron(&Plan::try_from(parts).unwrap()).unwrap();
        let given = |flag| value(&export, flag).is_some();
        (given("--accumulate-allreduce-grads-in-fp32"), given("--grad-reduce-in-bf16"))
    };
    assert_eq!(plan().grad_reduce(), GradReduce::Fp32, "a bf16 job reduces in fp32 as Megatron does");
    assert_eq!(reduce(GradReduce::Fp32, Precision::Bf16Mixed), (true, false));
    assert_eq!(reduce(GradReduce::SixteenBit, Precision::Bf16Mixed), (false, true));
    assert_eq!(reduce(GradReduce::Fp32, Precision::Fp16Mixed), (true, false));
    assert_eq!(reduce(GradReduce::SixteenBit, Precision::Fp16Mixed), (false, false));
}

/// Issue 33: a tf32 or fp32 plan trains fp32 parameters (neither `--bf16` nor `--fp16`), its
/// matmuls as priced: the launch exports whether TF32 runs, which NVIDIA's PyTorch containers turn
/// on and ROCm turns on only when asked.
#[test]
fn tf32_and_fp32_plans_export_fp32_parameters_and_their_matmul_environment() {
    let plan = |cluster: &str, precision, attention| {
        let parts =
            PlanParts { precision, attention, ..uniform(cluster, Degrees::new(2, 2, 2), Zero1::On).into_parts() };
        Plan::try_from(parts).unwrap()
    };
    type Environment = &'static [(&'static str, &'static str)];
    let cases: [(&str, Precision, Environment); 4] = [
        ("8xh100", Precision::Tf32, &[("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")]),
        ("8xh100", Precision::Fp32, &[("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "0"), ("NVIDIA_TF32_OVERRIDE", "0")]),
        ("8xmi300x", Precision::Tf32, &[("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1"), ("HIPBLASLT_ALLOW_TF32", "1")]),
        ("8xmi300x", Precision::Fp32, &[("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "0"), ("HIPBLASLT_ALLOW_TF32", "0")]),
    ];
    for (cluster, precision, expected) in cases {
        let export = megatron(&plan(cluster, precision, AttentionKernel::Unfused)).unwrap();
        let flags = ["--bf16", "--fp16", "--grad-reduce-in-bf16"].map(|flag| value(&export, flag));
        assert_eq!(flags, [None; 3], "{precision} on {cluster}: {}", export.command_line());
        let launched = launch(&export.launch_script(), 0, &[]);
        for (name, set) in expected {
            assert_eq!(launched.env.get(*name).map(String::as_str), Some(*set), "{name}: {precision} on {cluster}");
        }
    }
    let bf16 = launch(&megatron(&uniform("8xh100", Degrees::new(2, 2, 2), Zero1::On)).unwrap().launch_script(), 0, &[]);
    assert!(!bf16.env.contains_key("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"), "mixed precision sets no TF32 switch");
    // Megatron's fused attention takes 16-bit inputs only: in fp32 it would keep every score.
    let fused = refusal(&plan("8xh100", Precision::Fp32, AttentionKernel::Fused));
    assert!(fused.contains("trains in fp32 with a fused attention kernel") && fused.contains("--attention unfused"));
    // fp32 gradients have no 16-bit format to reduce in: such a plan does not load.
    let parts = PlanParts {
        grad_reduce: GradReduce::SixteenBit,
        ..plan("8xh100", Precision::Tf32, AttentionKernel::Unfused).into_parts()
    };
    let err = Plan::try_from(parts).unwrap_err().to_string();
    assert!(err.contains("grad_reduce: in tf32, gradients are fp32"), "{err}");
}

/// Megatron-LM's distributed optimizer shards optimizer states, not gradients: a ZeRO-2 plan is
/// refused; and a plan that shards gradients over whole optimizer states does not load.
#[test]
fn a_plan_that_shards_gradients_is_refused() {
    let parts = PlanParts { shard_gradients: true, ..uniform("8xh100", Degrees::new(2, 2, 2), Zero1::On).into_parts() };
    let zero2 = Plan::try_from(parts).unwrap();
    assert!(refusal(&zero2).contains("shards the optimizer states only"), "{}", refusal(&zero2));
    let parts =
        PlanParts { shard_gradients: true, ..uniform("8xh100", Degrees::new(2, 2, 2), Zero1::Off).into_parts() };
    let err = Plan::try_from(parts).unwrap_err().to_string();
    assert!(err.contains("shard_gradients: sharding gradients"), "{err}");
}
