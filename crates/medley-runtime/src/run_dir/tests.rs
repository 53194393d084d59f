//! The run directory's refusals and its lock.

use std::fs;

use super::*;

fn scratch() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn a_locked_directory_names_its_holder() {
    let dir = scratch();
    let held = RunDir::at(dir.path()).claim(None, false).unwrap();
    let err = RunDir::at(dir.path()).claim(Some(dir.path()), false).unwrap_err().to_string();
    assert!(err.contains(&format!("process {}", std::process::id())), "{err}");
    drop(held);
    RunDir::at(dir.path()).claim(Some(dir.path()), false).unwrap();
}

#[test]
fn a_fresh_run_refuses_a_directory_that_holds_one() {
    let dir = scratch();
    fs::write(dir.path().join(METRICS), "{\"step\":1}\n{\"step\":2}\n").unwrap();
    let err = RunDir::at(dir.path()).claim(None, false).unwrap_err().to_string();
    assert!(err.contains("2 steps in metrics.jsonl") && err.contains("--resume"), "{err}");
    assert!(dir.path().join(METRICS).is_file(), "nothing is deleted");
    // The same directory under another spelling is a resume.
    let spelled = dir.path().join(".");
    RunDir::at(dir.path()).claim(Some(&spelled), false).unwrap();
}

#[test]
fn force_removes_only_the_runs_outputs_and_only_when_asked_to_start() {
    let dir = scratch();
    fs::create_dir_all(dir.path().join(CHECKPOINTS).join("step-00000001")).unwrap();
    fs::write(dir.path().join(PLAN), "{}").unwrap();
    fs::write(dir.path().join(METRICS), "{\"step\":1}\n").unwrap();
    fs::write(dir.path().join("notes.txt"), "mine").unwrap();
    let run = RunDir::at(dir.path()).claim(None, true).unwrap();
    assert!(dir.path().join(METRICS).is_file(), "claiming deletes nothing");
    run.start_over_if_forced().unwrap();
    assert!(![CHECKPOINTS, METRICS].iter().any(|name| dir.path().join(name).exists()));
    assert!(dir.path().join("notes.txt").is_file() && dir.path().join(PLAN).is_file());
}

#[test]
fn an_empty_or_new_directory_is_no_run() {
    let dir = scratch();
    RunDir::at(dir.path().join("new")).claim(None, false).unwrap();
    fs::write(dir.path().join(METRICS), "").unwrap();
    RunDir::at(dir.path()).claim(None, false).unwrap();
}

#[test]
fn the_directory_a_run_resumes_from_is_locked_too() {
    let (source, out) = (scratch(), scratch());
    let _resuming = RunDir::at(out.path()).claim(Some(source.path()), false).unwrap();
    let err = RunDir::at(source.path()).claim(Some(source.path()), false).unwrap_err().to_string();
    assert!(err.contains("in use by another medley run"), "{err}");
}

#[test]
fn timeline_file_names_tell_their_segment() {
    let run = RunDir::at("run");
    for (rank, resumed_at) in [(0, None), (3, None), (1, Some(40))] {
        let path = run.rank_timeline(rank, resumed_at);
        assert_eq!(timeline_segment(path.file_name().unwrap().to_str().unwrap()), Some(resumed_at));
    }
    assert_eq!(timeline_segment("rank-x.json"), None);
    assert_eq!(timeline_segment("timeline.json"), None);
}

#[test]
fn metrics_read_back_as_written_and_a_broken_line_is_named() {
    let dir = scratch();
    let run = RunDir::at(dir.path());
    let step = StepMetrics {
        step: 3,
        loss: 2.5,
        tokens_per_s: 100.0,
        step_time_s: 0.25,
        schedule: "1f1b".into(),
        pipeline_wait_fraction: 0.0,
        ranks: Vec::new(),
    };
    fs::write(run.metrics(), serde_json::to_string(&step).unwrap() + "\n\n").unwrap();
    assert_eq!(run.read_metrics().unwrap(), vec![step]);
    fs::write(run.metrics(), "{\"step\": 1}\n").unwrap();
    let err = run.read_metrics().unwrap_err().to_string();
    assert!(err.contains("metrics.jsonl: line 1: a step's metrics does not read"), "{err}");
}
