//! The `medley` binary as a person or script runs it: exit codes, JSON shape, plan files.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs the binary, killing it (and failing) if it takes longer than two minutes.
fn medley(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_medley"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("medley starts");
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

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("medley-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
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
    for key in ["step_time_s", "tokens_per_s", "mfu", "peak_memory_gib"] {
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
fn fixed_layouts_are_evaluated_or_refused() {
    check(&["plan", "--cluster", "16xh100", "--model", "llama3-8b", "--fix", "tp=2,pp=2,dp=4"], 0, "uniform");
    check(&["plan", "--cluster", "16xh100", "--model", "llama3-8b", "--fix", "tp=3"], 2, "one node");
    check(&["plan", "--cluster", "16xh100", "--model", "llama3-8b", "--fix", "tp=2,pp=2,dp=8"], 2, "needs 32 devices");
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
