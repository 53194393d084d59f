//! Local jobs of real processes (`sh` scripts standing in for ranks), each bounded in time.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use medley_launch::{LocalJob, RankCommand, job_token};

/// A rank running `script` under `sh -c`, in domain `domain`.
fn rank(script: &str, domain: &str) -> RankCommand {
    RankCommand { args: vec![OsString::from("-c"), OsString::from(script)], domain: domain.into() }
}

const SH: &str = "/bin/sh";

#[test]
fn ranks_get_torchrun_variables_and_a_store_of_the_launchers() {
    let say = "echo $RANK/$WORLD_SIZE $LOCAL_RANK/$LOCAL_WORLD_SIZE $MASTER_ADDR $MEDLEY_DOMAIN $MEDLEY_STORE_HOST";
    let ranks = [rank(say, "nvidia"), rank("exit 0", "amd")];
    let mut job = LocalJob::start(Path::new(SH), &ranks, None).unwrap();
    let lines: Vec<String> = BufReader::new(job.take_rank0_stdout().unwrap()).lines().map_while(Result::ok).collect();
    let end = job.wait(Duration::from_secs(5), Some(Instant::now() + Duration::from_secs(30)));
    assert!(end.succeeded(), "{end:?}");
    assert_eq!(lines, ["0/2 0/2 127.0.0.1 nvidia launcher"]);
}

#[test]
fn a_failing_rank_stops_the_job_within_the_grace_and_its_last_lines_are_kept() {
    let echoed = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&echoed);
    let echo = Arc::new(move |line: &str| sink.lock().unwrap().push(line.to_string()));
    let ranks = [rank("sleep 30", "nvidia"), rank("echo first >&2; echo the reason >&2; exit 3", "nvidia")];
    let started = Instant::now();
    let job = LocalJob::start(Path::new(SH), &ranks, Some(echo)).unwrap();
    let end = job.wait(Duration::from_millis(500), Some(started + Duration::from_secs(30)));
    assert!(started.elapsed() < Duration::from_secs(10), "the sleeping rank was not killed after the grace");
    assert_eq!(end.failed_ranks(), [0, 1]);
    assert_eq!(end.describe(0), "did not stop after the others failed; killed");
    assert_eq!(end.describe(1), "exited with status 3");
    assert_eq!(end.first_error(), Some("the reason"));
    assert_eq!(*echoed.lock().unwrap(), ["first", "the reason"]);
}

#[test]
fn a_job_that_runs_past_its_deadline_is_killed() {
    let started = Instant::now();
    let job = LocalJob::start(Path::new(SH), &[rank("sleep 30", "nvidia")], None).unwrap();
    let end = job.wait(Duration::from_secs(5), Some(started + Duration::from_millis(300)));
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(end.statuses, [None]);
}

#[test]
fn a_program_that_cannot_start_is_an_error_naming_the_rank() {
    let err = LocalJob::start(Path::new("/nonexistent/medley"), &[rank("", "nvidia")], None).err().unwrap();
    assert!(err.to_string().starts_with("cannot start rank 0 (/nonexistent/medley)"), "{err}");
}

#[test]
fn tokens_are_fresh_128_bit_secrets() {
    let (a, b) = (job_token().unwrap(), job_token().unwrap());
    assert_eq!(a.len(), 32);
    assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(a, b);
}
