//! torchtitan export: the overrides for uniform, uneven, interleaved and context-parallel plans,
//! the model parts against the rules of torchtitan's pipeline split, the launch script as
//! torchrun receives it, and the refusals.

mod plans;

use medley_cost::Calibration;
use medley_export::torchtitan::{TorchtitanExport, check_overrides, torchtitan};
use medley_plan::baselines::Degrees;
use medley_plan::long_context::even_fixed;
use medley_plan::{Plan, PlanParts};
use medley_spec::{AttentionKernel, GradReduce, Precision, Schedule, ScheduleKind, catalog_model};
use plans::{Zero1, assembled, cluster, job, launch, uniform, uniform_of, with_model, words};

fn value<'a>(export: &'a TorchtitanExport, flag: &str) -> Option<&'a str> {
    plans::value(&export.overrides, &format!("--{flag}"))
}

fn refusal(plan: &Plan) -> String {
    plans::refusal(torchtitan(plan).map(|export| export.command_line()), "torchtitan")
}

/// Checks the model parts as torchtitan's pipeline split needs them: every module of the model
/// exactly once, in order, the embedding first and the norm and output last; returns the
/// decoder layers per part.
fn layers_per_part(parts: &str, n_layers: u32) -> Vec<usize> {
    let parts: Vec<Vec<&str>> = parts.split(' ').map(|part| part.split(',').collect()).collect();
    let mut expected = vec!["tok_embeddings".to_string()];
    expected.extend((0..n_layers).map(|layer| format!("layers.{layer}")));
    expected.extend(["norm".to_string(), "lm_head".to_string()]);
    let flat: Vec<&str> = parts.iter().flatten().copied().collect();
    assert_eq!(flat, expected, "every module once, in order");
    parts.iter().map(|part| part.iter().filter(|module| module.starts_with("layers.")).count()).collect()
}

#[test]
fn a_uniform_plan_exports_torchtitans_degrees_and_token_counts() {
    let export = torchtitan(&uniform("8xh100", Degrees::new(2, 2, 2), Zero1::Off)).unwrap();
    assert_eq!((export.world_size, export.base_config, export.activation_checkpoint), (8, "llama3_8b", "selective"));
    for (flag, expected) in [
        ("parallelism.data_parallel_replicate_degree", "2"),
        ("parallelism.data_parallel_shard_degree", "1"),
        ("parallelism.tensor_parallel_degree", "2"),
        ("parallelism.context_parallel_degree", "1"),
        ("parallelism.pipeline_parallel_degree", "2"),
        ("parallelism.pipeline_parallel_schedule", "1F1B"),
        ("parallelism.num_pp_microbatches", "16"),
        ("training.max_context_length", "4096"),
        ("training.num_tokens_per_microbatch_per_dp_rank", "4096"),
        ("training.num_tokens_per_train_step", "131072"),
        ("training.mixed_precision_reduce", "float32"),
    ] {
        assert_eq!(value(&export, flag), Some(expected), "{flag} in {}", export.command_line());
    }
    let parts = value(&export, "parallelism.module_fqns_per_model_part").unwrap();
    assert_eq!(layers_per_part(parts, 32), [16, 16]);
    // torchtitan's step: tokens per micro-batch × micro-batches × replicas, no accumulation left.
    assert_eq!(4096 * 16 * 2, 131_072);
}

#[test]
fn uneven_and_interleaved_stages_become_model_parts() {
    let uneven = torchtitan(&assembled("3xh100", &[(8, &[6, 10, 16])], Zero1::Off)).unwrap();
    let parts = value(&uneven, "parallelism.module_fqns_per_model_part").unwrap();
    assert_eq!(layers_per_part(parts, 32), [6, 10, 16]);
    let interleaved = torchtitan(&uniform("8xh100", Degrees { vpp: 2, ..Degrees::new(1, 4, 2) }, Zero1::Off)).unwrap();
    assert_eq!(value(&interleaved, "parallelism.pipeline_parallel_schedule"), Some("Interleaved1F1B"));
    assert_eq!(value(&interleaved, "parallelism.pipeline_parallel_degree"), Some("4"));
    let parts = value(&interleaved, "parallelism.module_fqns_per_model_part").unwrap();
    assert_eq!(layers_per_part(parts, 32).len(), 8, "two model parts a rank");
    let gpipe = assembled("2xh100", &[(4, &[12, 20])], Zero1::Off).with_schedule(Schedule::Fixed(ScheduleKind::Gpipe));
    let gpipe = torchtitan(&gpipe.unwrap()).unwrap();
    assert_eq!(value(&gpipe, "parallelism.pipeline_parallel_schedule"), Some("GPipe"));
}

#[test]
fn ranks_follow_torchtitans_mesh_onto_the_plans_devices() {
    let plan = uniform("8xh100", Degrees::new(2, 2, 2), Zero1::Off);
    let export = torchtitan(&plan).unwrap();
    // The mesh is pp, dp_replicate, dp_shard, cp, tp: rank = tp + 2·(dp + 2·pp).
    for rank in &export.placement.ranks {
        let (tp, dp, pp) = (rank.rank % 2, rank.rank / 2 % 2, rank.rank / 4);
        assert_eq!(rank.device, plan.replicas()[dp as usize].stages[pp as usize].devices[tp as usize]);
    }
}

#[test]
fn the_launch_script_writes_the_recipe_and_gives_torchrun_the_overrides_word_for_word() {
    let export = torchtitan(&assembled("3xh100", &[(8, &[6, 10, 16])], Zero1::Off)).unwrap();
    let launched = launch(&export.launch_script(), 0, &["--training.steps", "10"]);
    let config = launched.argv.iter().position(|arg| arg == "medley_plan").unwrap();
    let program = ["-m", "torchtitan.train", "--module", "medley_recipe", "--config", "medley_plan"];
    assert_eq!(launched.argv[config - 5..=config], program.map(String::from));
    let mut expected = words(&export.overrides);
    expected.extend(["--training.steps".to_string(), "10".to_string()]);
    assert_eq!(launched.argv[config + 1..], expected[..], "{}", export.launch_script());
    assert_eq!(launched.cuda_visible_devices, "0,1,2");
    let recipe = launched.recipe.expect("the script puts its recipe module on PYTHONPATH");
    assert_eq!(recipe, export.recipe_module());
    assert!(recipe.contains("config = llama3_8b()") && recipe.contains("SelectiveAC.Config()"), "{recipe}");
}

#[test]
fn even_rings_export_and_what_torchtitan_cannot_run_is_refused_naming_it() {
    let model = catalog_model("llama3-8b").unwrap();
    let (calibration, long) = (Calibration::default(), job(131_072, 4, Zero1::Off));
    let ring = even_fixed(&cluster("8xh100"), &model, &long, &calibration, 8, 1, 1, 1).unwrap().plan;
    assert_eq!(value(&torchtitan(&ring).unwrap(), "parallelism.context_parallel_degree"), Some("8"));
    let usp = even_fixed(&cluster("8xh100"), &model, &long, &calibration, 2, 4, 1, 1).unwrap().plan;
    assert!(refusal(&usp).contains("head parallelism"), "{}", refusal(&usp));
    let zero1 = refusal(&uniform("8xh100", Degrees::new(2, 2, 2), Zero1::On));
    assert!(zero1.contains("ZeRO-1") && zero1.contains("--no-zero1"), "{zero1}");
    let shares = refusal(&assembled("2xh100", &[(6, &[32]), (2, &[32])], Zero1::Off));
    assert!(shares.contains("same share of the batch"), "{shares}");
    let vendors = refusal(&assembled("1xh100,1xmi300x", &[(4, &[16, 16])], Zero1::Off));
    assert!(vendors.contains("does not cross vendors"), "{vendors}");
    let kfkb = assembled("2xh100", &[(4, &[16, 16])], Zero1::Off).with_schedule("kfkb:2".parse().unwrap());
    assert!(refusal(&kfkb.unwrap()).contains("GPipe or 1F1B"));
    let gpt2 = refusal(&uniform_of("gpt2", "2xh100", Degrees::new(1, 1, 2), Zero1::Off));
    assert!(gpt2.contains("8B, 70B and 405B") && gpt2.contains("gpt2"), "{gpt2}");
    let parts = uniform("8xh100", Degrees::new(2, 2, 2), Zero1::Off).into_parts();
    let unfused = Plan::try_from(PlanParts { attention: AttentionKernel::Unfused, ..parts }).unwrap();
    assert!(refusal(&unfused).contains("--attention fused"), "{}", refusal(&unfused));
    let fp16 = PlanParts {
        precision: Precision::Fp16Mixed,
        ..uniform("8xh100", Degrees::new(2, 2, 2), Zero1::Off).into_parts()
    };
    let fp16 = refusal(&Plan::try_from(fp16).unwrap());
    assert!(fp16.contains("fp16-mixed") && fp16.contains("mixed_precision_param"), "{fp16}");
    let sixteen_bit = PlanParts {
        grad_reduce: GradReduce::SixteenBit,
        ..uniform("8xh100", Degrees::new(2, 2, 2), Zero1::Off).into_parts()
    };
    let sixteen_bit = refusal(&Plan::try_from(sixteen_bit).unwrap());
    assert!(sixteen_bit.contains("16-bit") && sixteen_bit.contains("--grad-reduce fp32"), "{sixteen_bit}");
    // Issue 33: a recipe's shape with other numerics (Llama 3.0's RoPE) is another model.
    let llama3_0 = with_model(uniform("8xh100", Degrees::new(2, 2, 2), Zero1::Off), |model| model.rope_scaling = None);
    let numerics = refusal(&llama3_0);
    assert!(numerics.contains("scaling llama3 8/1/4/8192") && numerics.contains("scaling none"), "{numerics}");
}

#[test]
fn overrides_are_checked_by_torchtitans_rules() {
    let export = torchtitan(&uniform("8xh100", Degrees::new(2, 2, 2), Zero1::Off)).unwrap();
    check_overrides(&export.overrides, 8, 32).unwrap();
    let with = |flag: &str, value: &str| {
        let mut overrides = export.overrides.clone();
        let arg = overrides.iter_mut().find(|arg| arg.flag == format!("--{flag}")).unwrap();
        arg.value = Some(value.to_string());
        check_overrides(&overrides, 8, 32).unwrap_err()
    };
    assert!(with("parallelism.tensor_parallel_degree", "4").contains("world size 8"));
    assert!(with("parallelism.pipeline_parallel_schedule", "Interleaved1F1B").contains("at least two"));
    let parts = value(&export, "parallelism.module_fqns_per_model_part").unwrap();
    assert!(with("parallelism.module_fqns_per_model_part", &parts.replace("layers.3,", "")).contains("every module"));
    assert!(with("training.num_tokens_per_train_step", "100000").contains("whole number"));
}

/// Issue 33: torchtitan trains a tf32 or fp32 plan with float32 parameters, TF32 switched as the
/// plan was priced; a bf16 plan says its bfloat16 parameters.
#[test]
fn tf32_and_fp32_plans_train_float32_parameters() {
    let plan = |precision| {
        let parts = PlanParts { precision, ..uniform("8xh100", Degrees::new(2, 2, 2), Zero1::Off).into_parts() };
        torchtitan(&Plan::try_from(parts).unwrap()).unwrap()
    };
    for (precision, parameters, tf32) in [
        (Precision::Bf16Mixed, "bfloat16", None),
        (Precision::Tf32, "float32", Some("1")),
        (Precision::Fp32, "float32", Some("0")),
    ] {
        let export = plan(precision);
        assert_eq!(value(&export, "training.mixed_precision_param"), Some(parameters), "{precision}");
        let launched = launch(&export.launch_script(), 0, &[]);
        assert_eq!(launched.env.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE").map(String::as_str), tf32, "{precision}");
    }
}
