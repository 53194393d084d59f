//! Every parser medley feeds input it did not write, fuzzed from valid seeds: a parser must
//! return a value or an error, never panic; what passes validation is used the way medley uses
//! it (planned, priced, walked, read back) and must not panic either.
//!
//! A short run of each target is part of the test suite; `MEDLEY_FUZZ_SECONDS=600 cargo test -p
//! medley-fuzz --release -- --test-threads 1` runs each for ten minutes.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use medley_cost::Calibration;
use medley_fit::measurements::parse_csv;
use medley_fuzz::fuzz;
use medley_plan::{Plan, SearchOptions, evaluate, search};
use medley_spec::{Cluster, JobSpec, ModelSpec, catalog_model};
use medley_trace::{BandwidthTrace, TraceWalker};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn seeds(texts: &[&str]) -> Vec<Vec<u8>> {
    texts.iter().map(|text| text.as_bytes().to_vec()).collect()
}

/// A small valid plan: llama3-8b on two H100 nodes and one MI300X node, as the search makes it.
fn seed_plan() -> Plan {
    let cluster = Cluster::from_inline("8xh100,8xmi300x", Default::default(), Default::default()).unwrap();
    let job = JobSpec::from_toml("seq_len = 2048\nglobal_batch = 64\n", "job.toml").unwrap();
    let model = catalog_model("llama3-8b").unwrap();
    let options = SearchOptions { top: 1, ..SearchOptions::default() };
    search(&cluster, &model, &job, &Calibration::default(), &options).unwrap().candidates.remove(0).plan
}

#[test]
fn cluster_files_and_the_plans_they_pass() {
    let tiny = catalog_model("tiny").unwrap();
    let job = JobSpec::from_toml("seq_len = 128\nglobal_batch = 16\n", "job.toml").unwrap();
    let options = SearchOptions { top: 1, ..SearchOptions::default() };
    fuzz("cluster TOML", seeds(&[include_str!("../../../examples/cluster.toml")]), |bytes| {
        if let Ok(cluster) = Cluster::from_toml(&text(bytes), "cluster.toml")
            && cluster.n_gpus() <= 256
        {
            let _ = search(&cluster, &tiny, &job, &Calibration::default(), &options);
        }
    });
}

#[test]
fn inline_clusters_and_fleets() {
    fuzz("inline cluster", seeds(&["64xh100,128xa100,32xmi300x", "2xh100,2xmi250x", "4:2xa100"]), |bytes| {
        let _ = Cluster::from_inline(&text(bytes), Default::default(), Default::default());
        let _ = Cluster::from_fleet(&text(bytes));
    });
}

#[test]
fn huggingface_configs() {
    let llama = r#"{"_name_or_path":"meta-llama/Meta-Llama-3-8B","model_type":"llama","num_hidden_layers":32,
        "hidden_size":4096,"num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,
        "vocab_size":128256,"hidden_act":"silu","tie_word_embeddings":false}"#;
    let mixtral = r#"{"model_type":"mixtral","num_hidden_layers":32,"hidden_size":4096,"num_attention_heads":32,
        "num_key_value_heads":8,"intermediate_size":14336,"vocab_size":32000,"num_local_experts":8,
        "num_experts_per_tok":2,"hidden_act":"silu","sliding_window":4096}"#;
    let gpt2 = r#"{"model_type":"gpt2","n_layer":12,"n_embd":768,"n_head":12,"n_inner":null,"vocab_size":50257}"#;
    fuzz("HuggingFace config.json", seeds(&[llama, mixtral, gpt2]), |bytes| {
        if let Ok(model) = ModelSpec::from_hf_config(&text(bytes), "config.json") {
            let _ = medley_cost::params::total_params(&model);
        }
    });
}

#[test]
fn job_files() {
    fuzz(
        "job TOML",
        seeds(&[include_str!("../../../examples/job.toml"), "seq_len = 1\nglobal_batch = 1\n"]),
        |bytes| {
            let _ = JobSpec::from_toml(&text(bytes), "job.toml");
        },
    );
}

#[test]
fn calibration_profiles() {
    let emulation = "kind = \"emulation\"\nmodel = \"tiny\"\n\n[device.H100-SXM]\nmatmul = 0.001\n";
    fuzz("calibration TOML", seeds(&[include_str!("../../../examples/calibration.toml"), emulation]), |bytes| {
        let _ = Calibration::from_toml(&text(bytes), "calibration.toml");
    });
}

#[test]
fn measured_runs_csv() {
    let seed = "label,cluster,model,seq_len,global_batch,micro_batch,tp,pp,dp,step_s\n\
                wide,8xh100,llama3-8b,2048,64,1,1,1,8,3.0\n# a comment\ndeep,8xh100,llama3-8b,2048,64,2,2,2,2,2.5\n";
    let planned = "label,plan,tp,step_s\nuneven,plan.json,,1.5\nboth,plan.json,2,1.5\n";
    let no_files = |name: &str| Err(format!("no file {name} here"));
    fuzz("measured runs CSV", seeds(&[seed, planned]), |bytes| {
        let _ = parse_csv(&text(bytes), Path::new("measured.csv"), &no_files);
    });
}

#[test]
fn bandwidth_traces_and_their_walks() {
    let texts = [
        "constant:0.5",
        "on-off:full=2s,reduced=500ms,fraction=0.1",
        "random:seed=7,full=1s,reduced=40us,fraction=0",
        "time_s,fraction\n0,1\n1.5,0.25\n\"3\",\"1\"\n",
    ];
    fuzz("bandwidth traces", seeds(&texts), |bytes| {
        let text = text(bytes);
        let parsed = [text.parse::<BandwidthTrace>().ok(), BandwidthTrace::from_csv(&text, "trace.csv").ok()];
        for trace in parsed.into_iter().flatten() {
            let mut walker = TraceWalker::new(&trace, 3);
            let mut at_ns = 0;
            for _ in 0..32 {
                at_ns = walker.finish_ns(at_ns, 1e6, 1e9);
            }
        }
    });
}

#[test]
fn plan_files_and_their_predictions() {
    let plan = serde_json::to_string_pretty(&seed_plan()).unwrap();
    fuzz("plan JSON", vec![plan.into_bytes()], |bytes| {
        if let Ok(plan) = serde_json::from_slice::<Plan>(bytes) {
            let _ = evaluate(&plan, &Calibration::default());
        }
    });
}

#[test]
fn checkpoint_manifests_and_pointers() {
    let manifest = serde_json::json!({
        "format": 2, "step": 6, "samples_seen": 96, "optimizer_steps": 6, "seed": 0,
        "plan": seed_plan(), "files": ["rank-0.safetensors"],
        "checksums": {"rank-0.safetensors": {"bytes": 10, "sha256": "00ff"}},
    });
    let seed = format!("step-00000006\n{}", serde_json::to_string(&manifest).unwrap());
    let root = tempfile::tempdir().unwrap();
    fuzz("checkpoint manifest", vec![seed.into_bytes()], |bytes| {
        // The first line is the `latest` pointer, the rest the manifest it points at.
        let text = text(bytes);
        let (pointer, manifest) = text.split_once('\n').unwrap_or((&text, ""));
        let dir = root.path().join("step-00000006");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(root.path().join("latest"), pointer).unwrap();
        std::fs::write(dir.join("manifest.json"), manifest).unwrap();
        if let Ok((dir, manifest)) = medley_runtime::read_latest(root.path()) {
            let _ = medley_runtime::verify_checkpoint(&dir, &manifest);
        }
    });
}

/// A run's checkpoint directory grown from bytes: byte 0 picks the step `latest` names (or a
/// link, or junk), then each pair (step, kind) adds a step directory of one kind — a complete
/// checkpoint, one whose manifest lies about its step, one cut short, a link out of the run
/// directory, one whose rank file is a FIFO or a link, one holding a stranger's file, a plain
/// file. A resume in place (read, verify, sweep) must never hang, follow a link, or delete a
/// directory that holds a manifest or a file it did not write.
fn build_run_directory(root: &Path, outside: &Path, template: &Path, bytes: &[u8]) {
    let step_dir = |step: u8| root.join(format!("step-{:08}", step % 12));
    let copy_template = |dir: &Path| {
        std::fs::create_dir_all(dir).unwrap();
        for entry in std::fs::read_dir(template).unwrap().flatten() {
            std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
        }
    };
    for pair in bytes.get(1..).unwrap_or_default().chunks(2).take(8) {
        let (step, kind) = (pair[0], pair.get(1).copied().unwrap_or(0));
        let dir = step_dir(step);
        if std::fs::symlink_metadata(&dir).is_ok() {
            continue;
        }
        match kind % 7 {
            0 => copy_template(&dir),
            1 => {
                copy_template(&dir);
                let manifest = std::fs::read_to_string(dir.join("manifest.json")).unwrap();
                std::fs::write(dir.join("manifest.json"), manifest.replace("\"step\":6", &format!("\"step\":{kind}")))
                    .unwrap();
            }
            2 => {
                std::fs::create_dir(&dir).unwrap();
                std::fs::write(dir.join("rank-0.safetensors"), b"cut short").unwrap();
            }
            3 => std::os::unix::fs::symlink(outside, &dir).unwrap(),
            4 => {
                copy_template(&dir);
                std::fs::remove_file(dir.join("rank-0.safetensors")).unwrap();
                let made = std::process::Command::new("mkfifo").arg(dir.join("rank-0.safetensors")).status().unwrap();
                assert!(made.success());
            }
            5 => {
                copy_template(&dir);
                std::fs::remove_file(dir.join("rank-0.safetensors")).unwrap();
                std::os::unix::fs::symlink("/dev/zero", dir.join("rank-0.safetensors")).unwrap();
            }
            _ => {
                std::fs::create_dir(&dir).unwrap();
                std::fs::write(dir.join("notes.txt"), b"mine").unwrap();
            }
        }
    }
    let pointer = root.join("latest");
    match bytes.first().copied().unwrap_or(6) {
        250.. => std::os::unix::fs::symlink(outside.join("pointer"), &pointer).unwrap(),
        240.. => std::fs::write(&pointer, &bytes[..bytes.len().min(40)]).unwrap(),
        step => std::fs::write(&pointer, format!("step-{:08}", step % 12)).unwrap(),
    }
}

/// What a sweep may never remove: every directory holding a manifest or a file no checkpoint
/// writes, and everything outside the run directory.
fn must_survive(root: &Path, outside: &Path) -> Vec<PathBuf> {
    let mut kept = vec![outside.join("pointer"), outside.join("keep.safetensors")];
    for entry in std::fs::read_dir(root).unwrap().flatten() {
        let path = entry.path();
        let holds = |name: &str| std::fs::symlink_metadata(path.join(name)).is_ok();
        if entry.file_type().unwrap().is_symlink() || !entry.file_type().unwrap().is_dir() {
            kept.push(path);
        } else if holds("manifest.json") || holds("notes.txt") {
            kept.push(path.join(if holds("manifest.json") { "manifest.json" } else { "notes.txt" }));
        }
    }
    kept
}

#[test]
fn run_directories_a_resume_reads_and_sweeps() {
    let template = tempfile::tempdir().unwrap();
    let tensor = medley_model::HostTensor::new(vec![2], vec![1.0, 6.0]);
    let file = template.path().join("rank-0.safetensors");
    medley_model::save_tensors(&file, &[("w".into(), &tensor)], [("step".to_string(), "6".to_string())].into())
        .unwrap();
    let checksum = medley_runtime::FileChecksum::of(&file).unwrap();
    let manifest = serde_json::json!({
        "format": 2, "step": 6, "samples_seen": 96, "optimizer_steps": 6, "seed": 0,
        "plan": seed_plan(), "files": ["rank-0.safetensors"],
        "checksums": {"rank-0.safetensors": checksum},
    });
    std::fs::write(template.path().join("manifest.json"), serde_json::to_string(&manifest).unwrap()).unwrap();
    let seeds =
        vec![vec![6, 6, 0, 8, 2, 4, 0], vec![6, 6, 4, 8, 1, 9, 3], vec![4, 4, 0, 6, 0, 8, 6, 10, 5], vec![255, 6, 0]];
    fuzz("run directories", seeds, |bytes| {
        let (run, outside) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        std::fs::write(outside.path().join("pointer"), "step-00000006").unwrap();
        std::fs::write(outside.path().join("keep.safetensors"), b"not the run's").unwrap();
        let root = run.path().join("checkpoints");
        std::fs::create_dir(&root).unwrap();
        build_run_directory(&root, outside.path(), template.path(), bytes);
        let kept = must_survive(&root, outside.path());
        if let Ok((dir, manifest)) = medley_runtime::read_latest(&root)
            && medley_runtime::verify_checkpoint(&dir, &manifest).is_ok()
        {
            let _ = medley_runtime::sweep_incomplete(&root, manifest.step);
        }
        for path in kept {
            assert!(std::fs::symlink_metadata(&path).is_ok(), "{} was deleted", path.display());
        }
    });
}

#[test]
fn checkpoint_tensor_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rank-0.safetensors");
    let tensor = medley_model::HostTensor::new(vec![2, 3], vec![1.0, -2.0, 3.5, 0.0, 1e-30, 7.0]);
    let metadata = [("step".to_string(), "6".to_string())].into();
    medley_model::save_tensors(&path, &[("layers.0.w".into(), &tensor)], metadata).unwrap();
    let seed = std::fs::read(&path).unwrap();
    fuzz("safetensors checkpoint file", vec![seed], |bytes| {
        std::fs::write(&path, bytes).unwrap();
        let _ = medley_model::load_tensors(&path);
    });
}

#[test]
fn greetings_store_requests_and_frame_headers() {
    let mut request = vec![1u8];
    for field in [&b"world/inbox/0"[..], b""] {
        request.extend((field.len() as u64).to_le_bytes());
        request.extend(field);
    }
    let seeds = vec![medley_comm::greeting_bytes("secret", "store", 3), request, [0x46, 0x4c, 0x44, 0x4d].repeat(8)];
    fuzz("wire frames and store requests", seeds, medley_comm::decode_untrusted);
}

/// Panics anywhere in this process, the store's own threads included.
static PANICS: AtomicUsize = AtomicUsize::new(0);

#[test]
fn a_live_store_takes_any_bytes_and_keeps_serving() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        default_hook(info);
    }));
    let server = medley_comm::StoreServer::bind("127.0.0.1:0", "secret").unwrap();
    let addr = format!("127.0.0.1:{}", server.port());
    let greeting = medley_comm::greeting_bytes("secret", "store", 3);
    let mut request = greeting.clone();
    request.push(1);
    for field in [&b"k"[..], b"v"] {
        request.extend((field.len() as u64).to_le_bytes());
        request.extend(field);
    }
    fuzz("live store connections", vec![greeting, request], |bytes| {
        let mut stream = TcpStream::connect(&addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let _ = stream.write_all(bytes);
        let _ = stream.shutdown(Shutdown::Write);
        let mut reply = Vec::new();
        let _ = stream.read_to_end(&mut reply);
    });
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a store thread panicked");
    // The store still answers a well-behaved client.
    let mut stream = TcpStream::connect(&addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    stream.write_all(&medley_comm::greeting_bytes("secret", "store", 0)).unwrap();
    let mut accepted = [9u8; 1];
    stream.read_exact(&mut accepted).unwrap();
    assert_eq!(accepted, [0], "greeted and accepted after the fuzzing");
}
