//! The `medley` binary as a person or script runs it: exit codes, JSON shape, plan files; and, at
//! the end, the invariants of ARCHITECTURE.md that the workspace's sources show.

// Signalling workers and asking for the user id are libc calls.
#![allow(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

/// Runs the binary, killing it (and failing) if it takes longer than two minutes.
fn medley<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(args: &[S]) -> Output {
    finish(start(args), args)
}

fn start<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_medley"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("medley starts")
}

/// The output of a started `medley`, killing it (and failing) past two minutes.
fn finish(mut child: Child, args: &[impl std::fmt::Debug]) -> Output {
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().expect("medley can be waited on").is_none() {
        if Instant::now() > deadline {
            child.kill().ok();
            panic!("medley {args:?} ran past two minutes");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("medley's output")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// This binary's scratch folder, emptied once per run: inside the target directory, so the runs
/// and checkpoints the tests write (hundreds of MiB) are replaced by the next run, not left in /tmp.
static SCRATCH: LazyLock<PathBuf> = LazyLock::new(|| {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("medley-cli");
    if dir.exists() {
        fs::remove_dir_all(&dir).expect("the last run's scratch folder can be removed");
    }
    fs::create_dir_all(&dir).expect("the scratch folder can be made");
    dir
});

fn scratch(name: &str) -> PathBuf {
    SCRATCH.join(name)
}

/// Runs `args` and checks the exit code and that `wanted` appears in stdout or stderr.
fn check(args: &[&str], code: i32, wanted: &str) -> Output {
    let output = medley(args);
    let text = stdout(&output) + &stderr(&output);
    assert_eq!(output.status.code(), Some(code), "{args:?}:\n{text}");
    assert!(text.contains(wanted), "{args:?}: `{wanted}` not in:\n{text}");
    output
}

#[test]
fn default_plan_prints_tables_and_baselines() {
    let output = check(&["plan"], 0, "Baselines");
    let text = stdout(&output);
    for wanted in ["llama3-70b", "uniform", "best-homogeneous", "Peak memory", "tokens/s"] {
        assert!(text.contains(wanted), "{wanted} missing:\n{text}");
    }
}

#[test]
fn json_has_the_documented_keys() {
    let output = check(&["plan", "--cluster", "16xh100,16xa100", "--model", "llama3-8b", "--json"], 0, "plan");
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    for key in ["step_time_s", "tokens_per_s", "mfu", "peak_memory_by_device_gib"] {
        assert!(value["prediction"].get(key).is_some(), "prediction.{key} missing");
    }
    let names: Vec<&str> = value["baselines"].as_array().unwrap().iter().map(|b| b["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["uniform", "best-homogeneous"]);
    for baseline in value["baselines"].as_array().unwrap() {
        for key in ["fits", "step_time_s", "tokens_per_s", "mfu"] {
            assert!(baseline.get(key).is_some(), "baseline.{key} missing");
        }
    }
    assert_eq!(value["plan"]["version"], 1);
}

#[test]
fn a_written_plan_evaluates_to_the_same_prediction() {
    let path = scratch("plan.json");
    let path = path.to_str().unwrap();
    let searched =
        check(&["plan", "--cluster", "8xh100,8xmi300x", "--model", "llama3-8b", "--json", "-o", path], 0, "plan");
    let evaluated = check(&["plan", "--plan", path, "--json"], 0, "plan");
    let step = |output: &Output| {
        let value: serde_json::Value = serde_json::from_str(&stdout(output)).unwrap();
        value["prediction"]["step_time_s"].as_f64().unwrap()
    };
    assert_eq!(step(&searched), step(&evaluated));
}

#[test]
fn a_plan_file_that_does_not_fit_exits_one() {
    let path = scratch("small.json");
    let path = path.to_str().unwrap();
    check(&["plan", "--cluster", "8xh100", "--model", "gpt2", "--global-batch", "8", "-o", path], 0, "written");
    let mut plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    plan["seq_len"] = serde_json::json!(1 << 22);
    let grown = scratch("grown.json");
    std::fs::write(&grown, plan.to_string()).unwrap();
    check(&["plan", "--plan", grown.to_str().unwrap()], 1, "does not fit");
}

#[test]
fn a_broken_plan_file_is_bad_input() {
    let path = scratch("broken.json");
    std::fs::write(&path, "{\"version\": 1}").unwrap();
    check(&["plan", "--plan", path.to_str().unwrap()], 2, "is not a medley plan");
}

#[test]
fn a_hand_edited_plan_file_is_refused_at_load_naming_the_field() {
    let path = scratch("edited.json");
    let path = path.to_str().unwrap();
    check(&[&["plan"][..], &TINY_JOB, &["-o", path]].concat(), 0, "written");
    let mut plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    plan["replicas"][0]["stages"][0]["devices"][0] = serde_json::json!(99);
    std::fs::write(path, plan.to_string()).unwrap();
    let wanted = format!("in {path}: invalid plan: replica 0: stage 0: device 99 is not in the 4-GPU cluster");
    check(&["plan", "--plan", path], 2, &wanted);
    check(&["simulate", "--plan", path], 2, &wanted);
}

#[test]
fn fixed_layouts_are_evaluated_or_refused() {
    check(&["plan", "--cluster", "16xh100", "--model", "llama3-8b", "--fix", "tp=2,pp=2,dp=4"], 0, "uniform");
    check(&["plan", "--cluster", "16xh100", "--model", "llama3-8b", "--fix", "tp=3"], 2, "one node");
    check(&["plan", "--cluster", "16xh100", "--model", "llama3-8b", "--fix", "tp=2,pp=2,dp=8"], 2, "needs 32 devices");
}

#[test]
fn fixed_layouts_interleave_with_vpp() {
    let args = ["plan", "--cluster", "16xh100", "--model", "llama3-8b", "--fix", "tp=2,pp=4,dp=2,vpp=2", "--json"];
    let output = check(&args, 0, "plan");
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(value["plan"]["virtual_stages"], 2);
    assert_eq!(value["plan"]["schedule"], "interleaved");
    assert_eq!(value["plan"]["replicas"][0]["stages"].as_array().unwrap().len(), 8);
    let path = scratch("interleaved.json");
    let path = path.to_str().unwrap();
    let text = ["plan", "--cluster", "16xh100", "--model", "llama3-8b", "--fix", "tp=2,pp=4,dp=2,vpp=2", "-o", path];
    check(&text, 0, "×2 chunks");
    // The written plan evaluates to the same prediction.
    let evaluated = check(&["plan", "--plan", path, "--json"], 0, "plan");
    let evaluated: serde_json::Value = serde_json::from_str(&stdout(&evaluated)).unwrap();
    assert_eq!(evaluated["prediction"]["step_time_s"], value["prediction"]["step_time_s"]);
    let gpipe = ["plan", "--cluster", "16xh100", "--model", "llama3-8b", "--fix", "pp=4,vpp=2", "--schedule", "gpipe"];
    check(&gpipe, 2, "schedule gpipe does not run plans with 2 virtual stage(s)");
    check(&["plan", "--cluster", "16xh100", "--model", "llama3-8b", "--fix", "pp=2,vpp=0"], 2, "positive integer");
    // The search can interleave every layout it finds.
    let searched = check(
        &["plan", "--cluster", "16xh100", "--model", "llama3-8b", "--schedule", "interleaved", "--json"],
        0,
        "plan",
    );
    let searched: serde_json::Value = serde_json::from_str(&stdout(&searched)).unwrap();
    assert_eq!(
        (&searched["plan"]["schedule"], &searched["plan"]["virtual_stages"]),
        (&"interleaved".into(), &2.into())
    );
    check(&["plan", "--schedule", "2f2b"], 2, "unknown schedule `2f2b`");
}

#[test]
fn schedules_by_name() {
    for schedule in ["gpipe", "kfkb:2", "zb-h1", "adaptive"] {
        let args = ["plan", "--cluster", "8xh100", "--model", "gpt2", "--global-batch", "16", "--schedule", schedule];
        check(&args, 0, &format!("schedule {schedule}"));
    }
}

#[test]
fn nothing_fits_exits_one_and_says_what_would() {
    check(&["plan", "--cluster", "8xa100-40gb", "--model", "llama3-405b"], 1, "more devices");
}

#[test]
fn bad_input_exits_two_and_names_the_problem() {
    check(&["plan", "--cluster", "8xh1000"], 2, "did you mean");
    check(&["plan", "--model", "llama-70b"], 2, "did you mean");
    check(&["plan", "--cluster", "12xh100"], 2, "multiple of 8");
    check(&["plan", "--global-batch", "10", "--micro-batch", "4"], 2, "divide the global batch");
    let path = scratch("cluster.toml");
    std::fs::write(&path, "[[group]]\ndevice = \"h100\"\nnodes = 1\nspeed = 2\n").unwrap();
    check(&["plan", "--cluster", path.to_str().unwrap()], 2, "cluster.toml:4:1");
    check(&["plan", "--model", "/nonexistent/config.json"], 2, "cannot read");
    let profile = scratch("calibration.toml");
    std::fs::write(&profile, "[device.h10]\nmatmul = 0.6\nattention = 0.4\nmemory = 0.8\n").unwrap();
    check(&["plan", "--calibration", profile.to_str().unwrap()], 2, "does not have");
}

#[test]
fn a_huggingface_config_is_a_model() {
    let path = scratch("config.json");
    let config = r#"{"model_type":"llama","num_hidden_layers":16,"hidden_size":2048,"num_attention_heads":32,
        "num_key_value_heads":8,"intermediate_size":8192,"vocab_size":128256,"tie_word_embeddings":true}"#;
    std::fs::write(&path, config).unwrap();
    check(&["plan", "--cluster", "8xa100", "--model", path.to_str().unwrap()], 0, "config.json");
}

#[test]
fn simulate_what_if_prints_the_documented_json() {
    let args = [
        "simulate",
        "--cluster",
        "64xa100",
        "--model",
        "gpt3-175b",
        "--seq-len",
        "2048",
        "--global-batch",
        "32",
        "--micro-batch",
        "1",
        "--tp",
        "8",
        "--pp",
        "8",
        "--recompute",
        "full",
        "--sequence-parallel",
        "--json",
    ];
    let output = check(&args, 0, "step_time_s");
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    for key in [
        "step_time_s",
        "tokens_per_s",
        "model_tflops_per_gpu",
        "hardware_tflops_per_gpu",
        "mfu",
        "hfu",
        "bubble_fraction",
        "peak_memory_gib",
        "fits",
    ] {
        assert!(value.get(key).is_some(), "{key} missing");
    }
    assert!(value["hfu"].as_f64().unwrap() > value["mfu"].as_f64().unwrap(), "full recompute counts in HFU");
}

#[test]
fn simulate_a_plan_file_with_a_timeline_and_a_network_trace() {
    let plan = scratch("sim-plan.json");
    let timeline = scratch("sim-trace.json");
    let csv = scratch("bandwidth.csv");
    std::fs::write(&csv, "time_s,fraction\n0,1\n0.5,0.1\n").unwrap();
    let (plan, timeline, csv) = (plan.to_str().unwrap(), timeline.to_str().unwrap(), csv.to_str().unwrap());
    let interleaved = ["--schedule", "interleaved"];
    check(
        &[&["plan", "--cluster", "8xh100,8xmi300x", "--model", "llama3-8b", "-o", plan][..], &interleaved].concat(),
        0,
        "written",
    );
    let args = ["simulate", "--plan", plan, "--trace", timeline, "--network-trace", csv, "--steps", "2"];
    check(&args, 0, "Where the time went");
    // A schedule given on the command line replaces the plan's, if the plan can run it: this
    // plan runs two chunks per rank (interleaved 1F1B), which a one-chunk schedule cannot.
    check(&["simulate", "--plan", plan, "--schedule", "zb-h1"], 2, "virtual stage");
    let one_chunk = scratch("sim-plan-kfkb.json");
    let one_chunk = one_chunk.to_str().unwrap();
    let search = ["plan", "--cluster", "8xh100,8xmi300x", "--model", "llama3-8b", "--schedule", "kfkb:1"];
    check(&[&search[..], &["-o", one_chunk]].concat(), 0, "written");
    check(&["simulate", "--plan", one_chunk, "--schedule", "zb-h1", "--json"], 0, "\"schedule\": \"zb-h1\"");
    check(&["simulate", "--plan", one_chunk, "--schedule", "interleaved"], 2, "interleaved");
    let document: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(timeline).unwrap()).unwrap();
    assert!(document["traceEvents"].as_array().unwrap().len() > 100);
}

#[test]
fn simulate_refuses_bad_input_with_exit_two() {
    check(&["simulate", "--cluster", "8xh100", "--model", "gpt2", "--cp", "0"], 2, "--cp");
    check(&["simulate", "--cluster", "8xh100", "--model", "gpt2", "--network-trace", "constant:2"], 2, "from 0 to 1");
    check(&["simulate", "--cluster", "8xh100", "--model", "gpt2", "--tp", "3"], 2, "does not divide");
}

#[test]
fn simulate_a_layout_that_does_not_fit_exits_one() {
    let args = ["simulate", "--cluster", "8xh100", "--model", "llama3-70b", "--global-batch", "8", "--tp", "8"];
    check(&args, 1, "does not fit");
}

/// The tiny model's job on four GPUs: planned and simulated in milliseconds.
const TINY_JOB: [&str; 8] = ["--cluster", "4xh100", "--model", "tiny", "--seq-len", "128", "--global-batch", "16"];

/// Runs `args` with standard output and error into one file, in the order they were written.
fn interleaved(args: &[&str]) -> (Option<i32>, String) {
    let path = scratch(&format!("interleaved-{}.txt", args.join("_").replace('/', "_")));
    let file = std::fs::File::create(&path).unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_medley"))
        .args(args)
        .stdout(Stdio::from(file.try_clone().unwrap()))
        .stderr(Stdio::from(file))
        .status()
        .unwrap();
    (status.code(), std::fs::read_to_string(&path).unwrap())
}

#[test]
fn simulate_what_if_chooses_micro_batch_and_recompute_as_the_planner_does() {
    let args = [
        "simulate",
        "--cluster",
        "16xh100,16xa100",
        "--model",
        "llama3-8b",
        "--seq-len",
        "4096",
        "--global-batch",
        "64",
        "--tp",
        "1",
        "--pp",
        "4",
        "--dp",
        "8",
        "--json",
    ];
    let output = check(&args, 0, "the fastest setting that fits");
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(value["fits"], true, "{value}");
    // Given both, the layout is simulated as given, and shown even when it does not fit (an
    // unfused attention kernel keeps every score).
    let fixed = [&args[..13], &["--micro-batch", "1", "--recompute", "none", "--attention", "unfused"]].concat();
    let (code, text) = interleaved(&fixed);
    assert_eq!(code, Some(1), "{text}");
    let verdict = text.find("does not fit in memory").expect("a verdict");
    assert!(text.rfind('┘').unwrap() < verdict && text.ends_with('\n'), "the verdict follows the tables:\n{text}");
}

/// Issue 33: a what-if layout kept whole optimizer states where `medley plan` sharded them (and
/// overrode a job file's `zero1 = true`): simulate and plan now price one job the same way.
#[test]
fn simulate_shards_optimizer_states_as_plan_does_unless_told_not_to() {
    let layout = [
        &["--cluster", "8xh100", "--model", "llama3-8b", "--fix", "tp=1,pp=2,dp=4", "--json"][..],
        &["--micro-batch", "1", "--recompute", "full"],
    ]
    .concat();
    let peak = |args: &[&str], path: &str| -> f64 {
        let value: serde_json::Value = serde_json::from_str(&stdout(&check(args, 0, ""))).unwrap();
        value.pointer(path).and_then(serde_json::Value::as_f64).unwrap_or_else(|| panic!("{path} in {value}"))
    };
    let planned = peak(&[&["plan"][..], &layout].concat(), "/prediction/peak_memory_by_device_gib/H100-SXM");
    let simulated = peak(&[&["simulate"][..], &layout].concat(), "/peak_memory_by_device_gib/H100-SXM");
    assert!((planned - simulated).abs() < 0.05 * planned, "plan {planned} GiB, simulate {simulated} GiB");
    let whole = peak(&[&["simulate", "--no-zero1"][..], &layout].concat(), "/peak_memory_by_device_gib/H100-SXM");
    // A stage's 4B parameters' 12 bytes of fp32 optimizer state, whole or over 4 replicas.
    assert!(whole > simulated + 25.0, "whole optimizer states {whole} GiB, sharded {simulated} GiB");
}

#[test]
fn simulate_and_plan_run_on_their_defaults() {
    check(&["simulate"], 0, "the best uniform layout");
    let (code, text) = interleaved(&[&["simulate"][..], &TINY_JOB].concat());
    assert_eq!(code, Some(0), "{text}");
    assert!(text.ends_with("┘\n") && text.contains(" µs"), "times of a tiny model read in µs:\n{text}");
    let output = check(&[&["plan"][..], &TINY_JOB].concat(), 0, "");
    let text = stdout(&output);
    for wanted in ["tiny (1.54M parameters) on 4 GPUs", "= 2,048 tokens per step", "1 stage each"] {
        assert!(text.contains(wanted), "`{wanted}` missing:\n{text}");
    }
}

#[test]
fn plan_json_reports_nothing_fits_as_an_object() {
    let output = check(&["plan", "--cluster", "1xh100", "--model", "llama3-70b", "--json"], 1, "nothing fits");
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(value["fits"], false);
    assert!(value["error"].as_str().unwrap().contains("the one GPU"), "{value}");
    // Issue 33: one error format whatever ends the command, said once.
    let bad_input = check(&["plan", "--cluster", "1xv100", "--model", "llama3-8b"], 2, "V100-32GB has none");
    for output in [&output, &bad_input] {
        let text = stderr(output);
        let errors: Vec<&str> = text.lines().filter(|line| line.contains("error")).collect();
        assert!(errors.len() == 1 && errors[0].starts_with("error: "), "{errors:?}");
    }
}

#[test]
fn any_ranked_plan_can_be_picked_and_look_alikes_are_told_apart() {
    let base = ["plan", "--cluster", "16xh100,16xa100", "--model", "llama3-8b", "--top", "20"];
    let output = check(&base, 0, "differs in");
    assert!(stdout(&output).contains("replica 1 on devices"), "{}", stdout(&output));
    let path = scratch("picked.json");
    let path = path.to_str().unwrap();
    let picked = check(&[&base[..], &["--pick", "2", "-o", path, "--json"]].concat(), 0, "plan");
    let value: serde_json::Value = serde_json::from_str(&stdout(&picked)).unwrap();
    assert_eq!(value["rank"], 2);
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(written, value["plan"], "-o writes the picked plan");
    let first = check(&[&base[..], &["--json"]].concat(), 0, "plan");
    let first: serde_json::Value = serde_json::from_str(&stdout(&first)).unwrap();
    assert_ne!(first["plan"], value["plan"]);
    check(&["plan", "--pick", "0"], 2, "--pick");
}

#[test]
fn an_emulation_profile_prices_only_its_own_models_emulated_runs() {
    let profile = scratch("emulation.toml");
    let text =
        "kind = \"emulation\"\nmodel = \"tiny\"\n\n[device.H100-SXM]\nmatmul = 1e-4\nattention = 1e-4\nmemory = 0.2\n";
    std::fs::write(&profile, text).unwrap();
    let profile = profile.to_str().unwrap();
    check(&[&["plan"][..], &TINY_JOB, &["--calibration", profile]].concat(), 0, "tiny");
    let other = ["plan", "--cluster", "8xh100", "--model", "llama3-8b", "--calibration", profile];
    check(&other, 2, "is an emulation profile");
    let gpu = format!("{}/../../examples/calibration.toml", env!("CARGO_MANIFEST_DIR"));
    let out = scratch("train-gpu-profile");
    check(&["train", "--out", out.to_str().unwrap(), "--calibration", &gpu], 2, "is a GPU efficiency profile");
}

#[test]
fn bench_comm_measures_every_setup_with_real_workers() {
    let args = ["bench", "comm", "--json", "--min-bytes", "4K", "--max-bytes", "16K", "--ranks", "2,3"];
    let output = check(&[&args[..], &["--ops", "all-reduce,all-to-all", "--timeout-s", "20"]].concat(), 0, "");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&stdout(&output)).unwrap();
    // Per setup and rank count: two sizes × (all-to-all + all-reduce, which the two-domain setup
    // runs both hierarchical and flat).
    assert_eq!(rows.len(), 2 * (2 + 2 + 3) * 2, "{rows:#?}");
    for row in &rows {
        for key in ["op", "bytes", "ranks", "transport", "algorithm", "time_us", "algbw_gbps", "busbw_gbps"] {
            assert!(row.get(key).is_some(), "{key} missing from {row}");
        }
        assert!(row["time_us"].as_f64().unwrap() > 0.0, "{row}");
    }
    let two_domain_all_reduce = |algorithm: &str| {
        rows.iter().any(|r| r["transport"] == "two-domain" && r["op"] == "all-reduce" && r["algorithm"] == algorithm)
    };
    assert!(two_domain_all_reduce("hierarchical") && two_domain_all_reduce("ring"));
    check(&["bench", "comm", "--min-bytes", "64K", "--max-bytes", "4K"], 2, "--min-bytes");
}

/// A quick training job's flags: the tiny model on short sequences, real speed.
const QUICK_TRAIN: [&str; 8] =
    ["--seq-len", "32", "--global-batch", "4", "--micro-batch", "1", "--no-emulate", "--timeout-s"];

fn train(out: &std::path::Path, extra: &[&str]) -> Output {
    let out = out.to_string_lossy().into_owned();
    let args: Vec<&str> = ["train", "--out", &out]
        .iter()
        .copied()
        .chain(QUICK_TRAIN)
        .chain(["10"])
        .chain(extra.iter().copied())
        .collect();
    let output = medley(&args);
    assert!(output.status.success(), "{args:?}:\n{}{}", stdout(&output), stderr(&output));
    output
}

/// The losses `metrics.jsonl` recorded, by step.
fn losses(out: &std::path::Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|line| {
            let step: serde_json::Value = serde_json::from_str(line).unwrap();
            (step["step"].as_u64().unwrap(), step["loss"].as_f64().unwrap())
        })
        .collect()
}

#[test]
fn training_resumes_bit_for_bit_and_under_another_plan() {
    let whole = scratch("train-whole");
    train(&whole, &["--fleet", "2xh100,1xmi300x", "--steps", "4"]);
    let reference = losses(&whole);
    assert_eq!(reference.iter().map(|s| s.0).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert!(whole.join("timeline.json").is_file());

    let halves = scratch("train-halves");
    train(&halves, &["--fleet", "2xh100,1xmi300x", "--steps", "2"]);
    let resumed = train(&halves, &["--resume", &halves.to_string_lossy(), "--steps", "4"]);
    assert!(stdout(&resumed).contains("2 → 4"), "{}", stdout(&resumed));
    assert_eq!(losses(&halves), reference, "stopping and resuming changes nothing");
    assert_eq!(timeline_steps(&halves), [1, 2, 3, 4], "the resumed run's timeline continues the first one's");

    // The same checkpoint under a single process: the model re-shards, and only the order of
    // the gradient sums changes.
    let resharded = scratch("train-resharded");
    train(&resharded, &["--fleet", "2xh100,1xmi300x", "--steps", "2"]);
    train(&resharded, &["--resume", &resharded.to_string_lossy(), "--fleet", "1xh100", "--steps", "4"]);
    for ((step, loss), (_, expected)) in losses(&resharded).into_iter().zip(reference) {
        assert!((loss - expected).abs() <= 1e-6 * expected, "step {step}: {loss} vs {expected}");
    }
    assert_eq!(timeline_steps(&resharded), [1, 2, 3, 4]);
    assert_eq!(timeline_ranks(&resharded), 3, "the first segment's three workers stay in the timeline");
}

/// An emulation profile of the tiny model, fixed so that the plans it prices are the same on
/// every machine.
const TINY_PROFILE: &str = r#"kind = "emulation"
model = "tiny"

[device.A100-80GB]
matmul = 3.58e-6
attention = 2.63e-6
memory = 1.82e-4

[device.H100-SXM]
matmul = 3.23e-6
attention = 2.31e-6
memory = 1.82e-4

[device.MI300X]
matmul = 2.37e-6
attention = 1.66e-6
memory = 1.82e-4

[device.V100-32GB]
matmul = 9.0e-6
attention = 7.0e-6
memory = 1.82e-4
"#;

/// Issue 33: `medley train` trained the cost model's first plan while `medley plan` recommends
/// the simulator's first: the same inputs now choose the same plan, here one where the two differ.
#[test]
fn train_and_plan_choose_the_same_plan_for_the_same_inputs() {
    let out = scratch("train-chooses-as-plan");
    fs::create_dir_all(&out).unwrap();
    let profile = out.join("profile.toml");
    fs::write(&profile, TINY_PROFILE).unwrap();
    let profile = profile.to_string_lossy().into_owned();
    let run = out.join("run");
    // The V100 has no bf16: a bf16 job on it is refused, and fp16 with loss scaling is taken.
    let fleet = ["--fleet", "1xh100,1xa100,1xv100,1xmi300x", "--steps", "1", "--calibration", &profile];
    let refused = medley(&["train", "--out", &run.to_string_lossy()].into_iter().chain(fleet).collect::<Vec<_>>());
    assert!(stderr(&refused).contains("V100-32GB has none"), "{}", stderr(&refused));
    // Sequences of 64 tokens: inputs where the cost model and the simulator rank differently.
    let run_text = run.to_string_lossy().into_owned();
    let job = ["--seq-len", "64", "--global-batch", "4", "--micro-batch", "1"];
    let quick = ["--no-emulate", "--timeout-s", "10", "--precision", "fp16-mixed"];
    check(&[&["train", "--out", &run_text][..], &job, &quick, &fleet].concat(), 0, "");
    let read = |path: &Path| -> serde_json::Value { serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap() };
    // The fleet as a cluster file: nodes of one GPU.
    let fleet = out.join("fleet.toml");
    let groups = ["h100", "a100", "v100", "mi300x"]
        .map(|device| format!("[[group]]\ndevice = \"{device}\"\nnodes = 1\ngpus_per_node = 1\n"));
    fs::write(&fleet, groups.concat()).unwrap();
    let planned = out.join("planned.json");
    let (fleet, planned_text) = (fleet.to_string_lossy().into_owned(), planned.to_string_lossy().into_owned());
    // What the runtime runs: gradients reduced in fp32.
    let runtime = ["--grad-reduce", "fp32"];
    let args: Vec<&str> =
        ["plan", "--cluster", &fleet, "--model", "tiny", "--calibration", &profile, "--precision", "fp16"]
            .into_iter()
            .chain(job)
            .chain(runtime)
            .chain(["-o", &planned_text])
            .collect();
    let output = medley(&args);
    assert!(
        stdout(&output).contains("the simulator disagrees"),
        "inputs where the rankings differ:\n{}{}",
        stdout(&output),
        stderr(&output)
    );
    assert_eq!(read(&run.join("plan.json")), read(&planned));
}

#[test]
fn corrupt_or_mixed_checkpoints_are_refused_naming_the_file() {
    let out = scratch("train-corrupt");
    train(&out, &["--fleet", "2xh100", "--steps", "4", "--checkpoint-every", "2"]);
    let out_text = out.to_string_lossy().into_owned();
    let resume = || {
        let args: Vec<&str> =
            ["train", "--resume", &out_text].into_iter().chain(QUICK_TRAIN).chain(["10", "--steps", "6"]).collect();
        let output = medley(&args);
        assert_ne!(output.status.code(), Some(0), "resumed from a bad checkpoint:\n{}", stdout(&output));
        stderr(&output)
    };
    let checkpoints = out.join("checkpoints");
    let newest = checkpoints.join("step-00000004/rank-1.safetensors");
    let written = std::fs::read(&newest).unwrap();
    let mut flipped = written.clone();
    let middle = flipped.len() / 2;
    flipped[middle..middle + 16].iter_mut().for_each(|byte| *byte ^= 0xff);
    std::fs::write(&newest, &flipped).unwrap();
    let refused = resume();
    assert!(refused.contains("rank-1.safetensors") && refused.contains("not what was written"), "{refused}");
    // Step 4's file in step 2's checkpoint: another file than the manifest recorded.
    std::fs::write(&newest, &written).unwrap();
    std::fs::copy(&newest, checkpoints.join("step-00000002/rank-1.safetensors")).unwrap();
    std::fs::write(checkpoints.join("latest"), "step-00000002").unwrap();
    let refused = resume();
    assert!(
        refused.contains("step-00000002/rank-1.safetensors") && refused.contains("another checkpoint"),
        "{refused}"
    );
}

/// Two steps of a plan fixed to `degrees` on two H100s, then two more on one, and the other way,
/// against four on one: the checkpoints re-shard, and only the order of sums changes. `label`
/// names the plan in the resumed run's output.
fn checkpoints_resume_under_another_layout(degrees: &str, label: &str) {
    let name = degrees.replace([',', '='], "-");
    let whole = scratch(&format!("{name}-whole"));
    train(&whole, &["--fleet", "1xh100", "--steps", "4"]);
    let reference = losses(&whole);
    let plan = scratch(&format!("{name}.json"));
    let plan_text = plan.to_string_lossy().into_owned();
    let fix =
        ["--cluster", "2xh100", "--model", "tiny", "--seq-len", "32", "--global-batch", "4", "--micro-batch", "1"];
    let args: Vec<&str> = ["plan", "-q", "-o", &plan_text, "--fix", degrees].into_iter().chain(fix).collect();
    let planned = medley(&args);
    assert!(planned.status.success(), "{}", stderr(&planned));
    let split_first = scratch(&format!("{name}-first"));
    let resume = split_first.to_string_lossy().into_owned();
    train(&split_first, &["--plan", &plan_text, "--steps", "2"]);
    train(&split_first, &["--resume", &resume, "--fleet", "1xh100", "--steps", "4"]);
    let whole_first = scratch(&format!("{name}-second"));
    let resume = whole_first.to_string_lossy().into_owned();
    train(&whole_first, &["--fleet", "1xh100", "--steps", "2"]);
    let resumed = train(&whole_first, &["--resume", &resume, "--plan", &plan_text, "--steps", "4"]);
    assert!(stdout(&resumed).contains(label), "{}", stdout(&resumed));
    // Measured at step 4: 3.5e-7 relative with the sequence split over two devices.
    for run in [split_first, whole_first] {
        for ((step, loss), (_, expected)) in losses(&run).into_iter().zip(&reference) {
            assert!((loss - expected).abs() <= 1e-6 * expected, "{}: step {step}: {loss} vs {expected}", run.display());
        }
    }
}

#[test]
fn long_context_checkpoints_resume_under_another_layout() {
    checkpoints_resume_under_another_layout("tp=1,pp=1,dp=1,cp=2", "cp2");
}

#[test]
fn tensor_parallel_checkpoints_resume_under_another_layout() {
    checkpoints_resume_under_another_layout("tp=2,pp=1,dp=1", "tensor parallelism 2");
}

#[test]
fn nonsensical_learning_rates_are_refused() {
    for lr in ["1e10", "0", "-1", "NaN", "inf"] {
        let flag = format!("--lr={lr}");
        check(&["train", &flag, "--steps", "1"], 2, "not a learning rate above 0 and at most 1");
    }
}

#[test]
fn plans_export_to_megatron_or_are_refused_with_the_reason() {
    let plan = scratch("export-uniform.json");
    let plan_text = plan.to_string_lossy().into_owned();
    let planned = medley(&[
        "plan",
        "-q",
        "--cluster",
        "8xh100",
        "--model",
        "llama3-8b",
        "--fix",
        "tp=2,pp=2,dp=2",
        "-o",
        &plan_text,
    ]);
    assert!(planned.status.success(), "{}", stderr(&planned));
    let script = check(&["export", "megatron", "--plan", &plan_text], 0, "pretrain_gpt.py");
    let script = stdout(&script);
    assert!(script.starts_with("#!/usr/bin/env bash") && script.contains("--tensor-model-parallel-size 2"), "{script}");
    let json = medley(&["export", "megatron", "--plan", &plan_text, "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(json["world_size"], 8);
    // A plan across vendors: Megatron runs one NCCL world.
    let mixed = scratch("export-mixed.json");
    let mixed_text = mixed.to_string_lossy().into_owned();
    let planned = medley(&[
        "plan",
        "-q",
        "--cluster",
        "2xh100,2xmi300x",
        "--model",
        "tiny",
        "--seq-len",
        "128",
        "-o",
        &mixed_text,
    ]);
    assert!(planned.status.success(), "{}", stderr(&planned));
    let refused = medley(&["export", "megatron", "--plan", &mixed_text]);
    let reason = stderr(&refused);
    assert_eq!(refused.status.code(), Some(1), "{reason}");
    assert!(reason.contains("Megatron-LM cannot run this plan"), "{reason}");
    // Restricted to what Megatron runs: a plan that exports, and what the restriction costs.
    let planned = medley(&[
        "plan",
        "--cluster",
        "2xh100,2xmi300x",
        "--model",
        "tiny",
        "--seq-len",
        "128",
        "--expressible",
        "megatron",
        "-o",
        &mixed_text,
    ]);
    assert!(planned.status.success(), "{}", stderr(&planned));
    assert!(stderr(&planned).contains("restricted to plans Megatron-LM can run"), "{}", stderr(&planned));
    check(&["export", "megatron", "--plan", &mixed_text], 0, "pretrain_gpt.py");
}

#[test]
fn plans_export_to_torchtitan_and_the_restricted_search_plans_without_zero1() {
    let plan = scratch("export-torchtitan.json");
    let plan_text = plan.to_string_lossy().into_owned();
    let fleet = ["--cluster", "8xh100,8xmi300x", "--model", "llama3-8b", "--global-batch", "64"];
    let planned = medley(&[&["plan", "-q"], &fleet[..], &["--expressible", "torchtitan", "-o", &plan_text]].concat());
    assert!(planned.status.success(), "{}", stderr(&planned));
    let json = medley(&["export", "torchtitan", "--plan", &plan_text, "--json"]);
    assert!(json.status.success(), "{}", stderr(&json));
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(json["base_config"], "llama3_8b");
    check(&["export", "torchtitan", "--plan", &plan_text], 0, "-m torchtitan.train");
    // The unrestricted plan keeps ZeRO-1, which torchtitan refuses naming the way out.
    let planned = medley(&[&["plan", "-q"], &fleet[..], &["--fix", "tp=1,pp=1,dp=8", "-o", &plan_text]].concat());
    assert!(planned.status.success(), "{}", stderr(&planned));
    check(&["export", "torchtitan", "--plan", &plan_text], 1, "--no-zero1");
}

/// The steps the merged timeline has passes of, in the order they start.
fn timeline_steps(out: &std::path::Path) -> Vec<u64> {
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("timeline.json")).unwrap()).unwrap();
    let mut slices: Vec<(f64, u64)> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|event| event["ph"] == "X")
        .map(|event| (event["ts"].as_f64().unwrap(), event["args"]["step"].as_u64().unwrap()))
        .collect();
    slices.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut steps: Vec<u64> = slices.into_iter().map(|(_, step)| step).collect();
    steps.dedup();
    steps
}

/// How many ranks (timeline processes) the merged timeline has.
fn timeline_ranks(out: &std::path::Path) -> usize {
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("timeline.json")).unwrap()).unwrap();
    let pids: std::collections::BTreeSet<u64> =
        trace["traceEvents"].as_array().unwrap().iter().filter_map(|event| event["pid"].as_u64()).collect();
    pids.len()
}

#[test]
fn a_run_directory_is_never_overwritten_by_accident() {
    let out = scratch("train-twice");
    let out_text = out.to_string_lossy().into_owned();
    let first =
        train(&out, &["--fleet", "1xh100", "--steps", "4", "--checkpoint-every", "1", "--keep-checkpoints", "2"]);
    assert!(stdout(&first).contains("step 1/4"), "without a terminal, progress comes as lines:\n{}", stdout(&first));
    let mut checkpoints: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    checkpoints.sort();
    assert_eq!(checkpoints, ["latest", "step-00000003", "step-00000004"], "--keep-checkpoints 2");
    let args: Vec<&str> =
        ["train", "--out", &out_text, "--fleet", "1xh100"].into_iter().chain(QUICK_TRAIN).chain(["10"]).collect();
    check(&args, 2, "already holds a run (a checkpoint at step 4, 4 steps in metrics.jsonl)");
    assert_eq!(losses(&out).len(), 4, "the refused run touched nothing");
    assert!(out.join("checkpoints/step-00000004").is_dir());
    train(&out, &["--fleet", "1xh100", "--steps", "2", "--force"]);
    assert_eq!(losses(&out).len(), 2, "--force starts over");
    // The run directory's own plan can be the new run's input: --force deletes only outputs.
    let plan = out.join("plan.json");
    train(&out, &["--plan", &plan.to_string_lossy(), "--steps", "1", "--force"]);
    assert_eq!(losses(&out).len(), 1);
}

/// Starts `medley train` into `out` for good (100,000 steps) on `fleet` with `extra` flags, its
/// output piped, and waits until `ready` holds of `out` (a minute at most).
fn start_endless_run(out: &Path, fleet: &str, extra: &[&str], ready: impl Fn(&Path) -> bool) -> Child {
    let out_text = out.to_string_lossy().into_owned();
    let args: Vec<&str> = ["train", "--out", &out_text, "--fleet", fleet, "--steps", "100000"]
        .into_iter()
        .chain(QUICK_TRAIN)
        .chain(extra.iter().copied())
        .collect();
    let run = start(&args);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready(out) {
        assert!(Instant::now() < deadline, "{args:?} was not ready within a minute");
        std::thread::sleep(Duration::from_millis(50));
    }
    run
}

/// Whether the run in `dir` has recorded at least `steps` steps.
fn has_steps(dir: &Path, steps: usize) -> bool {
    fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |text| text.lines().count()) >= steps
}

#[test]
fn a_run_directory_in_use_is_refused_naming_its_holder() {
    let out = scratch("train-locked");
    let out_text = out.to_string_lossy().into_owned();
    let mut running = start_endless_run(&out, "1xh100", &["10"], |out| out.join("metrics.jsonl").exists());
    let resume: Vec<&str> = ["train", "--resume", &out_text, "--steps", "1"].into_iter().collect();
    let holder = format!("in use by another medley run (process {})", running.id());
    let output = medley(&resume);
    running.kill().ok();
    running.wait().ok();
    let text = stdout(&output) + &stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(text.contains(&holder), "{text}");
}

#[test]
fn runs_in_different_directories_at_once_never_collide() {
    let runs: Vec<_> = ["train-side-a", "train-side-b"]
        .into_iter()
        .map(|name| {
            let out = scratch(name);
            let out_text = out.to_string_lossy().into_owned();
            let args: Vec<String> = ["train", "--out", &out_text, "--fleet", "2xh100", "--steps", "3"]
                .into_iter()
                .chain(QUICK_TRAIN)
                .chain(["20"])
                .map(String::from)
                .collect();
            (out, start(&args), args)
        })
        .collect();
    for (out, child, args) in runs {
        let output = finish(child, &args);
        assert!(output.status.success(), "{}{}", stdout(&output), stderr(&output));
        assert_eq!(losses(&out).len(), 3);
    }
}

#[test]
fn a_run_that_cannot_fit_in_host_memory_is_refused_before_it_starts() {
    let out = scratch("train-too-big");
    let out_text = out.to_string_lossy().into_owned();
    check(&["train", "--out", &out_text, "--model", "llama3-405b"], 2, "GiB of host memory");
}

/// The processes whose parent is `parent`, with their RANK variable.
fn workers_of(parent: u32) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // The parent pid is the second field after the parenthesised command name.
        let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        if after_name.split_whitespace().nth(1) != Some(parent.to_string().as_str()) {
            continue;
        }
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let rank = environ
            .split(|&b| b == 0)
            .find_map(|var| var.strip_prefix(b"RANK="))
            .map(|rank| String::from_utf8_lossy(rank).into_owned());
        if let Some(rank) = rank {
            found.push((pid, rank));
        }
    }
    found
}

#[test]
fn killing_a_worker_stops_every_rank_and_keeps_the_last_checkpoint() {
    let out = scratch("train-killed");
    let out_text = out.to_string_lossy().into_owned();
    let checkpointed = |out: &Path| out.join("checkpoints").join("latest").exists();
    let mut launcher = start_endless_run(&out, "2xh100,2xmi300x", &["5", "--checkpoint-every", "1"], checkpointed);
    // Checkpoints are written every step, so the kill often lands in the middle of one.
    std::thread::sleep(Duration::from_millis(300));
    let workers = workers_of(launcher.id());
    let (pid, rank) = workers.iter().find(|(_, rank)| rank == "2").expect("worker 2 is running").clone();
    // SAFETY: kill with a pid this test just read and a valid signal has no memory effects.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let stopped = Instant::now();
    while launcher.try_wait().unwrap().is_none() {
        assert!(stopped.elapsed() < Duration::from_secs(60), "the job did not stop within a minute of the kill");
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = launcher.wait_with_output().unwrap();
    let text = stdout(&output) + &stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains(&format!("worker {rank} (")) && text.contains("killed by signal 9"), "{text}");
    // Every other worker stopped on its own, with an error that names the dead one.
    for other in ["0", "1", "3"] {
        assert!(
            text.contains(&format!("worker {other}: ")) && text.contains(&format!("(worker {rank} failed")),
            "worker {other} did not name worker {rank}:\n{text}"
        );
    }
    assert!(!text.contains("killed;"), "a worker had to be killed by the launcher:\n{text}");
    assert!(text.contains("the last complete checkpoint is"), "{text}");
    // The last checkpoint is intact: training resumes from it for one more step.
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    let manifest = std::fs::read_to_string(out.join("checkpoints").join(latest.trim()).join("manifest.json")).unwrap();
    let step = serde_json::from_str::<serde_json::Value>(&manifest).unwrap()["step"].as_u64().unwrap();
    train(&out, &["--resume", &out_text, "--steps", &(step + 1).to_string()]);
    assert_eq!(losses(&out).last().unwrap().0, step + 1);
    let steps: Vec<u64> = (1..=step + 1).collect();
    assert_eq!(timeline_steps(&out), steps, "steps trained again after the resume appear once");
}

/// A cluster of one custom device type whose `field` is `value`.
fn cluster_with(name: &str, field: &str, value: &str) -> String {
    let mut rates = BTreeMap::from([
        ("bf16_tflops", "400"),
        ("fp16_tflops", "400"),
        ("fp32_tflops", "60"),
        ("hbm_gib", "80"),
        ("hbm_tb_s", "3"),
        ("intra_link_gb_s", "450"),
        ("nic_gbit_s", "400"),
    ]);
    rates.insert(field, value);
    let rates: String = rates.iter().map(|(key, value)| format!("{key} = {value}\n")).collect();
    let text = format!(
        "[[group]]\ndevice = \"odd\"\nnodes = 2\ngpus_per_node = 4\n\n[[device]]\nname = \"odd\"\nvendor = \"nvidia\"\n\
         intra_link = \"nvlink\"\nnics_per_node = 8\n{rates}"
    );
    let path = scratch(name);
    fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

#[test]
fn inputs_that_once_panicked_are_refused_or_handled() {
    let no_panic = |output: &Output| {
        let text = stdout(output) + &stderr(output);
        assert_ne!(output.status.code(), Some(101), "panicked:\n{text}");
        assert!(!text.contains("panicked"), "{text}");
        text
    };
    // A zero degree divided the layers by zero (found by fuzzing the measurements CSV).
    check(
        &["simulate", "--cluster", "8xh100", "--model", "llama3-8b", "--pp", "0", "--dp", "8"],
        2,
        "pp must be at least 1",
    );
    check(
        &["simulate", "--cluster", "8xh100", "--model", "llama3-8b", "--pp", "2", "--vpp", "0"],
        2,
        "vpp must be at least 1",
    );
    // Device rates so low a step overflows the simulator's clock.
    let slow = cluster_with("slow-cluster.toml", "bf16_tflops", "1e-12");
    check(&["simulate", "--cluster", &slow, "--model", "llama3-8b"], 2, "beyond what the simulator's clock holds");
    // NICs at a bit a second: the layer partitioner's bounds meet float rounding.
    let nic = cluster_with("nic-cluster.toml", "nic_gbit_s", "1e-9");
    no_panic(&medley(&["plan", "-q", "--cluster", &nic, "--model", "llama3-8b"]));
    // Results into a full disk.
    let full = fs::File::create("/dev/full").unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_medley"))
        .args(["simulate", "--cluster", "8xh100", "--model", "llama3-8b", "--json"])
        .stdout(full)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(no_panic(&output).contains("cannot write the result to standard output"));
    check(&["bench", "comm", "--max-bytes", "16384P"], 2, "");
    check(&["bench", "comm", "--max-bytes", "64G"], 2, "at most 17179869184 bytes");
    check(&["plan", "--cluster", "8xh100", "--global-batch", "100000000"], 2, "from 1 to 1048576");
    check(&["plan", "--cluster", "/dev/zero"], 2, "");
    let groups: String = (0..65).map(|_| "[[group]]\ndevice = \"h100\"\nnodes = 1\n").collect();
    let many = scratch("many-groups.toml");
    fs::write(&many, groups).unwrap();
    check(&["plan", "--cluster", &many.to_string_lossy()], 2, "at most 64");
}

/// Issue 31: numbers that cannot be right, repeated axes, zero steps and doubled messages.
#[test]
fn issue_31_inputs_are_refused_once_and_plainly() {
    let what_if = ["simulate", "--cluster", "8xh100,8xmi300x", "--model", "llama3-8b", "--seq-len", "2048"];
    let with = |extra: [&'static str; 2]| what_if.iter().copied().chain(extra).collect::<Vec<_>>();
    check(&with(["--network-trace", "constant:1e-12"]), 2, "below the floor of 1e-6");
    check(&with(["--steps", "0"]), 2, "--steps");
    check(&with(["--steps", "1000000"]), 2, "simulate at most");
    check(&["plan", "--cluster", "1048576xh100"], 2, "medley plans at most 32768");
    check(&["plan", "-q", "--cluster", "8xh100", "--fix", "tp=8,tp=4"], 2, "`tp` is given twice");
    let output = check(&["plan", "--cluster", "2x\u{1b}[31mh100"], 2, "\\u{1b}[31mh100");
    assert!(!stderr(&output).contains('\u{1b}'), "{}", stderr(&output));
    // A hand-edited plan's problem, said once.
    let plan = scratch("issue-31-plan.json");
    let plan_text = plan.to_string_lossy().to_string();
    let fixed = ["plan", "-q", "--cluster", "8xh100", "--model", "llama3-8b", "--fix", "tp=8", "-o", &plan_text];
    check(&fixed, 0, "");
    let edited = fs::read_to_string(&plan).unwrap().replacen("\"tp\": 8", "\"tp\": 3", 1);
    fs::write(&plan, edited).unwrap();
    for command in ["plan", "simulate"] {
        let output = check(&[command, "--plan", &plan_text], 2, "tp=3 must be");
        assert_eq!(stderr(&output).matches("tp=3 must be").count(), 1, "{}", stderr(&output));
    }
}

#[test]
fn a_stalled_rank_0_is_named_and_killed_within_the_timeout() {
    let out = scratch("train-stalled");
    let mut launcher = start_endless_run(&out, "2xh100,2xmi300x", &["3"], |out| has_steps(out, 2));
    let (pid, _) = workers_of(launcher.id()).into_iter().find(|(_, rank)| rank == "0").expect("worker 0 runs");
    // SAFETY: kill with a pid this test just read and a valid signal has no memory effects.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) }, 0);
    let stopped = Instant::now();
    while launcher.try_wait().unwrap().is_none() {
        // The others give up after the 3 s timeout; the launcher kills rank 0 15 s later.
        assert!(stopped.elapsed() < Duration::from_secs(45), "the job did not end within 45 s of the stop");
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = launcher.wait_with_output().unwrap();
    let text = stdout(&output) + &stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains("worker 0 (") && text.contains("did not stop after the others failed; killed"), "{text}");
    assert!(text.contains("(worker 0 failed or stopped answering)"), "nobody named worker 0:\n{text}");
}

#[test]
fn rank_0_keeps_training_while_nobody_reads_its_output() {
    let plan = scratch("unread-plan.json");
    let plan_text = plan.to_string_lossy().into_owned();
    let shape = ["--seq-len", "8", "--global-batch", "1", "--micro-batch", "1", "--fix", "tp=1,pp=1,dp=1"];
    let args: Vec<&str> =
        ["plan", "-q", "--cluster", "1xh100", "--model", "tiny", "-o", &plan_text].into_iter().chain(shape).collect();
    check(&args, 0, "");
    let out = scratch("unread-run");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    // 500 steps of metrics (about 300 bytes each) overfill a 64 KiB pipe twice.
    let steps = 500;
    let mut worker = Command::new(env!("CARGO_BIN_EXE_medley"))
        .args(["worker", "--plan", &plan_text, "--out", &out.to_string_lossy(), "--print-metrics", "--no-emulate"])
        .args(["--steps", &steps.to_string(), "--checkpoint-every", "0"])
        .envs([
            ("RANK", "0".to_string()),
            ("WORLD_SIZE", "1".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port),
            ("MEDLEY_TOKEN", "cli-test".into()),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // A stall never ends; the debug build takes about a minute for these steps on a quiet
    // 2-core machine, so the deadline leaves room for a loaded one.
    let deadline = Instant::now() + Duration::from_secs(300);
    while !has_steps(&out, steps) {
        assert!(Instant::now() < deadline, "training stalled on its unread output");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut printed = String::new();
    worker.stdout.take().unwrap().read_to_string(&mut printed).unwrap();
    assert!(worker.wait().unwrap().success());
    assert_eq!(printed.lines().count(), steps, "every step's line printed once read");
}

#[test]
fn workers_start_under_an_mpi_launchers_variables() {
    let plan = scratch("mpi-plan.json");
    let plan_text = plan.to_string_lossy().into_owned();
    let fix =
        ["--cluster", "2xh100", "--model", "tiny", "--seq-len", "32", "--global-batch", "4", "--micro-batch", "1"];
    let args: Vec<&str> =
        ["plan"].into_iter().chain(fix).chain(["--fix", "tp=1,pp=2,dp=1", "-o", &plan_text]).collect();
    check(&args, 0, "pipeline");
    let out = scratch("mpi-run");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let workers: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_medley"))
                .args([
                    "worker",
                    "--plan",
                    &plan_text,
                    "--out",
                    &out.to_string_lossy(),
                    "--steps",
                    "2",
                    "--timeout-s",
                    "10",
                ])
                .env_remove("RANK")
                .env_remove("WORLD_SIZE")
                .envs([
                    ("OMPI_COMM_WORLD_RANK", rank.to_string()),
                    ("OMPI_COMM_WORLD_SIZE", "2".into()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.clone()),
                    ("MEDLEY_TOKEN", "cli-test".into()),
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    for mut worker in workers {
        while worker.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "a worker ran past two minutes");
            std::thread::sleep(Duration::from_millis(20));
        }
        let output = worker.wait_with_output().unwrap();
        assert!(output.status.success(), "{}", stderr(&output));
    }
    assert_eq!(losses(&out).iter().map(|s| s.0).collect::<Vec<_>>(), [1, 2]);
}

#[test]
fn a_worker_that_fails_on_its_own_stops_the_others_at_once() {
    let out = scratch("train-own-failure");
    // Worker 1 cannot write its first checkpoint: its file's path is taken by a directory.
    std::fs::create_dir_all(out.join("checkpoints/step-00000001/rank-1.safetensors")).unwrap();
    let out_text = out.to_string_lossy().into_owned();
    let args: Vec<&str> = ["train", "--out", &out_text, "--fleet", "2xh100", "--steps", "3", "--checkpoint-every", "1"]
        .into_iter()
        .chain(QUICK_TRAIN)
        .chain(["60"])
        .collect();
    let started = Instant::now();
    let output = medley(&args);
    let text = stdout(&output) + &stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(started.elapsed() < Duration::from_secs(30), "the others waited for the 60 s timeout:\n{text}");
    assert!(text.contains("rank-1.safetensors"), "{text}");
    assert!(text.contains("worker 0: ") && text.contains("rank 1 failed"), "worker 0 does not name worker 1:\n{text}");
}

#[test]
fn long_context_plans_are_searched_priced_simulated_and_checked() {
    let path = scratch("context-plan.json");
    let path = path.to_str().unwrap();
    let job = ["--model", "llama3-8b", "--seq-len", "131072", "--global-batch", "4"];
    let fleet = ["--cluster", "8xh100,8xa100"];
    // The search splits each sequence over the mixed fleet; the even layouts are its baselines.
    let output = check(&[&["plan", "-o", path][..], &fleet, &job].concat(), 0, "even-ring");
    let text = stdout(&output);
    assert!(text.contains("even-ulysses") && text.contains("even-usp"), "{text}");
    assert!(text.contains("head-parallel group") && text.contains("query heads per device"), "{text}");
    let mut plan: serde_json::Value = serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(plan["version"], 2, "{plan}");
    assert!(plan["replicas"][0]["stages"][0]["context"]["groups"].is_array(), "{plan}");
    // The plan file prices and simulates; the runtime takes it (its ring exchange as an
    // all-gather), and only this machine's memory stops an 8B model at 128K tokens.
    check(&["plan", "--plan", path], 0, "head-parallel group");
    check(&["simulate", "--plan", path], 0, "step");
    let out = scratch("context-train");
    let train = check(&["train", "--plan", path, "--steps", "1", "--out", &out.to_string_lossy()], 2, "host memory");
    assert!(stderr(&train).contains("all-gathers keys and values"), "{}", stderr(&train));
    // A broken split is named.
    plan["replicas"][0]["stages"][0]["context"]["groups"][0]["tokens"] = serde_json::json!(1);
    fs::write(path, plan.to_string()).unwrap();
    check(&["simulate", "--plan", path], 2, "tokens");
    // Pinned degrees, the split still the planner's; tensor parallelism does not mix in.
    check(&[&["plan", "--fix", "tp=1,cp=4,hp=4"][..], &fleet, &job].concat(), 0, "cp4·hp4");
    check(&[&["plan", "--fix", "tp=2,cp=4"][..], &fleet, &job].concat(), 2, "use tp=1");
    // Megatron-LM's --context-parallel-size as a what-if: equal shards around a ring.
    check(&[&["simulate", "--cluster", "16xh100", "--cp", "16"][..], &job].concat(), 0, "step");
    // Optimizer states and gradients sharded over the eight devices of the context-parallel stage
    // (dp × cp, as Megatron's distributed optimizer shards its states) fit (58.5 GiB) where
    // whole fp32 gradients (84.7) or whole states (163.2) do not.
    check(&[&["simulate", "--cluster", "8xh100", "--cp", "8", "--shard-gradients"][..], &job].concat(), 0, "step");
    check(&[&["simulate", "--cluster", "8xh100", "--cp", "8"][..], &job].concat(), 1, "does not fit");
    check(&[&["simulate", "--cluster", "8xh100", "--cp", "8", "--no-zero1"][..], &job].concat(), 1, "does not fit");
    check(&[&["simulate", "--cluster", "8xh100", "--cp", "8", "--tp", "2"][..], &job].concat(), 2, "--tp 1");
}

// ---------------------------------------------------------------------------------------------
// ARCHITECTURE.md's invariants that the sources themselves can show: no crate's modules import
// each other in a cycle, and the runtime does not depend on the simulator.

fn crates_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(sources(&path));
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            files.push(path);
        }
    }
    files
}

/// A module's code without its tests and comments, on one line.
fn code_of(file: &Path) -> String {
    let text = fs::read_to_string(file).unwrap();
    let code = text.split("#[cfg(test)]").next().unwrap();
    code.lines().map(|line| line.split("//").next().unwrap()).collect::<Vec<_>>().join(" ")
}

/// The child modules of the module whose root file is `root` (`lib.rs`, `main.rs` or `x/mod.rs`,
/// whose children sit in its directory; `x.rs`, whose children sit in `x/`): each name with the
/// files it is made of, submodules included, and whether it has children of its own.
fn children(root: &Path) -> BTreeMap<String, Vec<PathBuf>> {
    let stem = root.file_stem().unwrap().to_str().unwrap();
    let dir = match stem {
        "lib" | "main" | "mod" => root.parent().unwrap().to_path_buf(),
        _ => root.with_extension(""),
    };
    let mut found: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    let Ok(entries) = fs::read_dir(&dir) else { return found };
    for entry in entries {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_str().unwrap().to_string();
        if ["lib", "main", "mod", "bin", "tests"].contains(&name.as_str()) {
            continue;
        }
        let files = if path.is_dir() {
            sources(&path)
        } else if path.extension().is_some_and(|e| e == "rs") {
            vec![path.clone()]
        } else {
            continue;
        };
        found.entry(name).or_default().extend(files);
    }
    found
}

/// The names a module's root file re-exports from its children (`pub use child::{A, b::C as D}`):
/// each name with the child it comes from.
fn reexports(root: &Path, children: &BTreeSet<String>) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    for statement in code_of(root).split(';') {
        let Some(path) =
            statement.trim().strip_prefix("pub use ").or_else(|| statement.trim().strip_prefix("pub(crate) use "))
        else {
            continue;
        };
        let path = path.trim().trim_start_matches("crate::").trim_start_matches("self::");
        let Some((child, rest)) = path.split_once("::") else { continue };
        if !children.contains(child) {
            continue;
        }
        for item in rest.replace(['{', '}'], ",").split(',') {
            let item = item.trim();
            let name = item.rsplit_once(" as ").map_or(item, |(_, alias)| alias).rsplit("::").next().unwrap().trim();
            if !name.is_empty() && name != "self" && name != "*" {
                names.insert(name.to_string(), child.to_string());
            }
        }
    }
    names
}

/// For the module whose root file is `root` and which `crate::prefix` names: which of its child
/// modules import which others, through `crate::prefix::child`, `super::child` (from the
/// child's own file) or a name the root re-exports from a child.
fn sibling_imports(root: &Path, prefix: &str) -> BTreeMap<String, BTreeSet<String>> {
    let children = children(root);
    let names: BTreeSet<String> = children.keys().cloned().collect();
    let reexported = reexports(root, &names);
    let resolve = |name: &str| -> Option<String> {
        if names.contains(name) { Some(name.to_string()) } else { reexported.get(name).cloned() }
    };
    let mut imports: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (child, files) in &children {
        for file in files {
            let code = code_of(file);
            let mut targets = paths_after(&code, &format!("crate::{prefix}"));
            // `super::` names this module only from the child's own file.
            let own_file = file.parent() == root.parent() || file.ends_with(format!("{child}/mod.rs"));
            if own_file && (prefix.is_empty() || root.file_stem().is_some_and(|stem| stem != "lib")) {
                targets.extend(paths_after(&code, "super::"));
            }
            for target in targets.iter().filter_map(|name| resolve(name)) {
                if &target != child {
                    imports.entry(child.clone()).or_default().insert(target);
                }
            }
        }
    }
    imports
}

/// Every module root file under `src` with the `crate::` path that names it (`""` for the crate).
fn module_roots(src: &Path) -> Vec<(PathBuf, String)> {
    let mut roots = Vec::new();
    for root in [src.join("lib.rs"), src.join("main.rs")] {
        if root.is_file() {
            roots.push((root, String::new()));
        }
    }
    for file in sources(src) {
        let relative = file.strip_prefix(src).unwrap().with_extension("");
        let parts: Vec<&str> = relative.iter().map(|part| part.to_str().unwrap()).collect();
        if parts.first() == Some(&"bin") || matches!(parts.last(), Some(&"lib") | Some(&"main")) {
            continue;
        }
        let module: Vec<&str> = parts.iter().copied().filter(|part| *part != "mod").collect();
        let has_children = if parts.last() == Some(&"mod") { true } else { file.with_extension("").is_dir() };
        if has_children {
            roots.push((file.clone(), module.iter().map(|part| format!("{part}::")).collect()));
        }
    }
    roots
}

/// The first segment of every path after `prefix` in `code`, including each item of a
/// `prefix{a, b::c, d}` list, nested or spread over lines; names (`crate::Root`) as well as modules.
fn paths_after(code: &str, prefix: &str) -> Vec<String> {
    let segment = |text: &str| -> String {
        text.trim_start().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect()
    };
    let mut names = Vec::new();
    for (idx, _) in code.match_indices(prefix) {
        let rest = &code[idx + prefix.len()..];
        let Some(list) = rest.strip_prefix('{') else {
            names.push(segment(rest));
            continue;
        };
        // The list's top-level items, up to its closing brace.
        let (mut depth, mut item_start) = (0usize, 0usize);
        for (at, c) in list.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    names.push(segment(&list[item_start..at]));
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    names.push(segment(&list[item_start..at]));
                    item_start = at + 1;
                }
                _ => {}
            }
        }
    }
    names.retain(|name| !name.is_empty());
    names
}

/// A cycle among `imports`, if there is one.
fn find_cycle(imports: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        module: &str,
        imports: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|seen| seen == module) {
            let mut cycle = path[start..].to_vec();
            cycle.push(module.to_string());
            return Some(cycle);
        }
        if !done.insert(module.to_string()) {
            return None;
        }
        path.push(module.to_string());
        for next in imports.get(module).into_iter().flatten() {
            if let Some(cycle) = visit(next, imports, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    imports.keys().find_map(|module| visit(module, imports, &mut Vec::new(), &mut done))
}

#[test]
fn no_crate_has_a_module_cycle() {
    let mut checked = 0;
    for entry in fs::read_dir(crates_dir()).unwrap() {
        let src = entry.unwrap().path().join("src");
        if !src.is_dir() {
            continue;
        }
        for (root, prefix) in module_roots(&src) {
            let imports = sibling_imports(&root, &prefix);
            assert_eq!(find_cycle(&imports), None, "{}: modules import each other in a cycle", root.display());
        }
        checked += 1;
    }
    assert!(checked >= 13, "only {checked} crates found");
}

#[test]
fn no_command_imports_another() {
    let src = crates_dir().join("medley/src");
    for file in sources(&src) {
        let code = code_of(&file);
        let commands: Vec<String> = paths_after(&code, "crate::")
            .into_iter()
            .filter(|name| name.ends_with("_cmd") || name == "bench")
            .collect();
        let own = file
            .strip_prefix(&src)
            .unwrap()
            .iter()
            .next()
            .unwrap()
            .to_str()
            .unwrap()
            .trim_end_matches(".rs")
            .to_string();
        let others: Vec<&String> = commands.iter().filter(|name| **name != own).collect();
        assert!(others.is_empty() || own == "main", "{} imports the command modules {others:?}", file.display());
    }
}

#[test]
fn crate_paths_read_lists_over_lines() {
    let code = "use crate::a::X; use crate::{b, c::{D, e}, F,\n  g::H}; let x = crate::Root;";
    assert_eq!(paths_after(code, "crate::"), ["a", "b", "c", "F", "g", "Root"]);
}

#[test]
fn the_cycle_guard_sees_through_reexports_and_into_folders() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    fs::create_dir_all(src.join("search")).unwrap();
    fs::write(src.join("lib.rs"), "mod a; mod b; mod search; pub use a::Alpha; pub use b::{Beta, deep::Gamma as G};")
        .unwrap();
    fs::write(src.join("a.rs"), "use crate::Beta;").unwrap();
    fs::write(src.join("b.rs"), "use crate::{G, Alpha};").unwrap();
    fs::write(src.join("search/mod.rs"), "mod x; mod y; use x::X;").unwrap();
    fs::write(src.join("search/x.rs"), "use super::y::Y;").unwrap();
    fs::write(src.join("search/y.rs"), "use crate::search::x::X; use super::Space;").unwrap();
    let cycles: Vec<_> = module_roots(src)
        .into_iter()
        .filter_map(|(root, prefix)| find_cycle(&sibling_imports(&root, &prefix)))
        .collect();
    assert_eq!(cycles.len(), 2, "{cycles:?}");
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let edges = |pairs: &[(&str, &str)]| {
        let mut imports: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (from, to) in pairs {
            imports.entry(from.to_string()).or_default().insert(to.to_string());
        }
        imports
    };
    assert_eq!(find_cycle(&edges(&[("a", "b"), ("b", "c"), ("a", "c")])), None);
    assert_eq!(find_cycle(&edges(&[("a", "b"), ("b", "c"), ("c", "a")])).map(|cycle| cycle.len()), Some(4));
}

#[test]
fn the_runtime_does_not_depend_on_the_simulator() {
    let manifest = fs::read_to_string(crates_dir().join("medley-runtime/Cargo.toml")).unwrap();
    assert!(!manifest.contains("medley-sim"), "medley-runtime/Cargo.toml names medley-sim");
}

/// The step the newest checkpoint in `out` holds, read from its manifest.
fn latest_checkpoint_step(out: &Path) -> u64 {
    let latest = fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    let manifest = fs::read_to_string(out.join("checkpoints").join(latest.trim()).join("manifest.json")).unwrap();
    serde_json::from_str::<serde_json::Value>(&manifest).unwrap()["step"].as_u64().unwrap()
}

/// The names in a directory, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    names
}

#[test]
fn a_resume_deletes_nothing_before_it_has_verified_the_checkpoint() {
    let out = scratch("train-lying-manifest");
    let out_text = out.to_string_lossy().into_owned();
    train(&out, &["--fleet", "2xh100", "--steps", "6", "--checkpoint-every", "2"]);
    let checkpoints = out.join("checkpoints");
    let before = names_in(&checkpoints);
    assert_eq!(before, ["latest", "step-00000002", "step-00000004", "step-00000006"]);
    let manifest = checkpoints.join("step-00000006/manifest.json");
    let written = fs::read_to_string(&manifest).unwrap();
    for lie in [0, 4, 5] {
        fs::write(&manifest, written.replace("\"step\": 6", &format!("\"step\": {lie}"))).unwrap();
        let args: Vec<&str> =
            ["train", "--resume", &out_text].into_iter().chain(QUICK_TRAIN).chain(["10", "--steps", "8"]).collect();
        let output = medley(&args);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{text}");
        assert!(text.contains("manifest.json") && text.contains(&format!("says step {lie}")), "{text}");
        assert_eq!(names_in(&checkpoints), before, "a resume from a lying manifest (step {lie}) deleted checkpoints");
    }
    fs::write(&manifest, &written).unwrap();

    // A resume into another directory never writes to its source: what an interrupted
    // checkpoint left there stays for the source's own resume to sweep.
    let unfinished = checkpoints.join("step-00000008");
    fs::create_dir(&unfinished).unwrap();
    fs::write(unfinished.join("rank-0.safetensors"), b"half a file").unwrap();
    let elsewhere = scratch("train-lying-manifest-elsewhere");
    train(&elsewhere, &["--resume", &out_text, "--steps", "7"]);
    assert!(unfinished.join("rank-0.safetensors").is_file(), "the source was swept");
    assert_eq!(latest_checkpoint_step(&elsewhere), 7);
    // Resumed in place, it is swept: a rank file and no manifest is a checkpoint cut short.
    train(&out, &["--resume", &out_text, "--steps", "7"]);
    assert!(!unfinished.exists());
}

#[test]
fn a_checkpoint_on_a_read_only_filesystem_resumes_into_another_directory() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: a read-only bind mount needs root (CI runs as root)");
        return;
    }
    let source = scratch("train-read-only");
    let source_text = source.to_string_lossy().into_owned();
    train(&source, &["--fleet", "1xh100", "--steps", "2"]);
    fs::remove_file(source.join(".medley.lock")).unwrap();
    let out = scratch("train-read-only-out");
    let train_args: Vec<String> = ["train", "--resume", &source_text, "--out", &out.to_string_lossy(), "--steps", "3"]
        .into_iter()
        .chain(QUICK_TRAIN)
        .chain(["10"])
        .map(|arg| format!("'{arg}'"))
        .collect();
    // A mount namespace of the command's own: the read-only mount goes when it ends.
    let script = format!(
        "mount --bind -o ro '{source_text}' '{source_text}' && exec '{}' {}",
        env!("CARGO_BIN_EXE_medley"),
        train_args.join(" ")
    );
    let output = Command::new("unshare").args(["-m", "sh", "-c", &script]).output().unwrap();
    let text = stdout(&output) + &stderr(&output);
    assert!(output.status.success(), "{text}");
    assert_eq!(latest_checkpoint_step(&out), 3);
}

#[test]
fn a_rank_stopped_at_start_up_is_named_within_the_timeout() {
    let out = scratch("train-stopped-at-start");
    let out_text = out.to_string_lossy().into_owned();
    let args: Vec<&str> = ["train", "--out", &out_text, "--fleet", "3xh100", "--steps", "2"]
        .into_iter()
        .chain(QUICK_TRAIN)
        .chain(["5"])
        .collect();
    let launcher = start(&args);
    // Stopped as soon as it is seen, before it can have joined.
    let spotted = Instant::now();
    let stopped = loop {
        if let Some((pid, _)) = workers_of(launcher.id()).into_iter().find(|(_, rank)| rank == "1") {
            // SAFETY: kill with a pid this test just read and a valid signal has no memory effects.
            assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) }, 0);
            break Instant::now();
        }
        assert!(spotted.elapsed() < Duration::from_secs(60), "worker 1 never started");
        std::thread::sleep(Duration::from_millis(1));
    };
    let output = finish(launcher, &args);
    let text = stdout(&output) + &stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    // The others name it once the timeout has passed (5 s, or ten predicted steps on a slow
    // machine); the launcher then ends it at once: nobody is left for it to report to.
    assert!(stopped.elapsed() < Duration::from_secs(30), "the job took {:?} to stop:\n{text}", stopped.elapsed());
    assert!(text.contains("rank 1 did not answer within"), "{text}");
    let killed = |line: &str| {
        line.trim_start().starts_with("worker 1 (") && line.ends_with("did not stop after the others failed; killed")
    };
    assert!(text.lines().any(killed), "{text}");
}

/// Sends `signal` to each of `pids`.
fn signal_all(pids: &[u32], signal: i32) {
    for &pid in pids {
        // SAFETY: kill with a pid of a child of this test and a valid signal has no memory effects.
        assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0);
    }
}

#[test]
fn a_launchers_sigterm_before_ctrl_c_still_stops_at_a_step_and_a_second_ctrl_c_stops_at_once() {
    // The launcher's forwarded SIGTERM may reach a worker before the terminal's SIGINT does: that
    // is still the first request, not a second Ctrl-C.
    let out = scratch("train-term-then-int");
    let launcher = start_endless_run(&out, "2xh100", &["10", "--checkpoint-every", "1000"], |out| has_steps(out, 2));
    let workers: Vec<u32> = workers_of(launcher.id()).into_iter().map(|(pid, _)| pid).collect();
    signal_all(&workers, libc::SIGTERM);
    signal_all(&[&[launcher.id()][..], &workers].concat(), libc::SIGINT);
    let output = finish(launcher, &["train", "(SIGTERM, then SIGINT)"]);
    let text = stdout(&output) + &stderr(&output);
    assert_eq!(output.status.code(), Some(130), "{text}");
    assert!(text.contains("stopped at step"), "{text}");
    // Two Ctrl-Cs end the launcher at once, without waiting for a step to end.
    let out = scratch("train-int-twice");
    let launcher = start_endless_run(&out, "1xh100", &["10"], |out| has_steps(out, 1));
    signal_all(&[launcher.id()], libc::SIGINT);
    // Apart, so that they are two signals (one pending signal of a kind absorbs the next), and
    // well within a step.
    std::thread::sleep(Duration::from_millis(100));
    signal_all(&[launcher.id()], libc::SIGINT);
    let output = finish(launcher, &["train", "(SIGINT twice)"]);
    let text = stdout(&output) + &stderr(&output);
    assert_eq!(output.status.code(), Some(130), "{text}");
    assert!(!text.contains("stopped at step"), "{text}");
}

#[test]
fn a_signal_stops_the_run_at_the_end_of_a_step_and_says_how_to_resume() {
    for (signal, code) in [(libc::SIGTERM, 143), (libc::SIGINT, 130)] {
        let out = scratch(&format!("train-signalled-{signal}"));
        let out_text = out.to_string_lossy().into_owned();
        let extra = ["10", "--checkpoint-every", "1000", "--checkpoint-on-signal"];
        let launcher = start_endless_run(&out, "2xh100", &extra, |out| has_steps(out, 2));
        // SIGTERM as `kill` sends it, to the launcher alone; SIGINT as Ctrl-C, to every process.
        let mut pids = vec![launcher.id()];
        if signal == libc::SIGINT {
            pids.extend(workers_of(launcher.id()).into_iter().map(|(pid, _)| pid));
        }
        for pid in pids {
            // SAFETY: kill with a pid of a child of this test and a valid signal has no memory effects.
            assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0);
        }
        let output = finish(launcher, &["train", "(signalled)"]);
        let text = stdout(&output) + &stderr(&output);
        assert_eq!(output.status.code(), Some(code), "{text}");
        let trained = losses(&out).last().unwrap().0;
        assert!(text.contains(&format!("stopped at step {trained} on")), "{text}");
        assert!(text.contains(&format!("--resume {out_text}")), "{text}");
        assert_eq!(latest_checkpoint_step(&out), trained, "the step it stopped at is checkpointed");
        train(&out, &["--resume", &out_text, "--steps", &(trained + 1).to_string()]);
        assert_eq!(losses(&out).len() as u64, trained + 1);
    }
}

#[test]
fn bad_arguments_are_quoted_escaped_and_cut() {
    let escape = "tp=1\u{1b}[31m";
    let huge = "x".repeat(100_000);
    for value in [escape, huge.as_str()] {
        let output = medley(&["plan", "--fix", value]);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{text}");
        assert!(!text.contains('\u{1b}') && text.len() < 2_000, "{text}");
        assert!(text.contains("invalid value"), "{text}");
    }
}

/// A measurements CSV of `rows` (layout and step time) for llama3-8b on eight H100s.
fn measurements(name: &str, rows: &[&str]) -> PathBuf {
    let path = scratch(name);
    let header = "label,cluster,model,seq_len,global_batch,micro_batch,tp,pp,dp,step_s\n";
    fs::write(&path, header.to_string() + &rows.join("\n") + "\n").unwrap();
    path
}

#[test]
fn calibrate_fits_measured_steps_into_a_profile_that_plan_takes() {
    let csv = measurements(
        "measured.csv",
        &[
            "wide,8xh100,llama3-8b,2048,64,1,1,1,8,3.0",
            "deep,8xh100,llama3-8b,2048,64,1,2,2,2,2.5",
            "tp,8xh100,llama3-8b,2048,64,1,8,1,1,4.0",
        ],
    );
    let profile = scratch("fitted.toml");
    let (csv, profile) = (csv.to_str().unwrap(), profile.to_str().unwrap());
    let output = check(&["calibrate", "--measured", csv, "-o", profile], 0, "held out");
    assert!(stdout(&output).contains("H100-SXM"), "{}", stdout(&output));
    let written = fs::read_to_string(profile).unwrap();
    assert!(written.contains("kind = \"gpu\"") && written.contains("[device.H100-SXM]"), "{written}");
    let plan =
        ["plan", "-q", "--cluster", "8xh100", "--model", "llama3-8b", "--seq-len", "2048", "--global-batch", "64"];
    check(&[&plan[..], &["--calibration", profile]].concat(), 0, "");
}

#[test]
fn calibrate_names_the_row_of_a_bad_measurement_and_refuses_an_emulated_run() {
    let csv =
        measurements("bad.csv", &["a,8xh100,llama3-8b,2048,64,1,1,1,8,3.0", "b,8xh100,llama3-8b,2048,64,1,1,1,8,-1"]);
    check(&["calibrate", "--measured", csv.to_str().unwrap()], 2, "row 3");
    let unknown = measurements("unknown.csv", &["a,8xh100,llama3-8b,2048,64,1,1,1,8,3.0,extra"]);
    check(&["calibrate", "--measured", unknown.to_str().unwrap()], 2, "row 2");
    let run = scratch("emulated-run");
    fs::create_dir_all(&run).unwrap();
    fs::write(run.join("emulation.json"), "{}").unwrap();
    check(&["calibrate", "--measured", run.to_str().unwrap()], 2, "emulated run");
}

#[test]
fn one_vocabulary_of_flags_with_the_old_names_kept() {
    // simulate takes plan's --fix as well as its one-by-one degrees, and the two agree.
    let job = [
        "simulate",
        "--cluster",
        "8xh100",
        "--model",
        "llama3-8b",
        "--global-batch",
        "64",
        "--seq-len",
        "2048",
        "--json",
    ];
    let fixed = check(&[&job[..], &["--fix", "tp=2,pp=2,dp=2,vpp=2"]].concat(), 0, "step_time_s");
    let flags = check(&[&job[..], &["--tp", "2", "--pp", "2", "--dp", "2", "--vpp", "2"]].concat(), 0, "step_time_s");
    assert_eq!(stdout(&fixed), stdout(&flags));
    check(&["simulate", "--fix", "tp=2", "--tp", "2"], 2, "cannot be used with");
    // train and calibrate take --cluster as plan and simulate do, a cluster file included;
    // --fleet still works.
    for command in ["train", "calibrate"] {
        check(&[command, "--help"], 0, "[alias: --fleet]");
    }
    let file = scratch("two-h100.toml");
    fs::write(&file, "[[group]]\ndevice = \"h100\"\nnodes = 2\ngpus_per_node = 1\n").unwrap();
    let out = scratch("train-cluster-file");
    train(&out, &["--cluster", file.to_str().unwrap(), "--steps", "1"]);
    let plan: serde_json::Value = serde_json::from_str(&fs::read_to_string(out.join("plan.json")).unwrap()).unwrap();
    assert_eq!(plan["cluster"]["groups"][0]["n_nodes"], 2, "{plan}");
    train(&scratch("train-fleet-alias"), &["--fleet", "2xh100", "--steps", "1"]);
}
