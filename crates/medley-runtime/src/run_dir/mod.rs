//! A run directory: everything a training run reads and writes, named, written and read through
//! one type, locked while a run uses it and never overwritten by accident.
//!
//! ```text
//! plan.json          the plan the workers run            calibration.toml  the profile they are priced by
//! emulation.json     the run's time dilation             metrics.jsonl     one [`StepMetrics`] a line (rank 0)
//! checkpoints/       step-NNNNNNNN/ and `latest`         timeline/         each rank's Perfetto file per segment
//! timeline.json      the segments merged                 report.html       the run's report
//! ```

mod lock;

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};

use medley_cost::Calibration;
use medley_plan::Plan;
use medley_trace::timeline::{merge_segments, trace_events};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{RuntimeError, StepMetrics, read_latest};

const CHECKPOINTS: &str = "checkpoints";
const METRICS: &str = "metrics.jsonl";
const TIMELINES: &str = "timeline";
const TIMELINE: &str = "timeline.json";
const PLAN: &str = "plan.json";
const CALIBRATION: &str = "calibration.toml";
const REPORT: &str = "report.html";
const EMULATION: &str = "emulation.json";

/// How a run was emulated, which prices its prediction (`emulation.json`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Emulation {
    /// Every emulated pass and link is this many times slower than the device it stands for.
    pub time_dilation: f64,
    pub workers: usize,
    /// The cores of the machine the run trained on.
    pub cores: usize,
}

/// A run directory's files (the directory need not exist yet).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunDir {
    root: PathBuf,
}

fn io_error(path: &Path, error: std::io::Error) -> RuntimeError {
    RuntimeError::Io { path: path.to_path_buf(), error }
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), RuntimeError> {
    fs::write(path, bytes).map_err(|error| io_error(path, error))
}

impl RunDir {
    pub fn at(root: impl Into<PathBuf>) -> RunDir {
        RunDir { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn checkpoints(&self) -> PathBuf {
        self.root.join(CHECKPOINTS)
    }

    pub fn metrics(&self) -> PathBuf {
        self.root.join(METRICS)
    }

    /// The per-rank timelines' directory.
    pub fn timelines(&self) -> PathBuf {
        self.root.join(TIMELINES)
    }

    /// The whole run's timeline, merged from the per-rank ones.
    pub fn timeline(&self) -> PathBuf {
        self.root.join(TIMELINE)
    }

    pub fn plan(&self) -> PathBuf {
        self.root.join(PLAN)
    }

    pub fn calibration(&self) -> PathBuf {
        self.root.join(CALIBRATION)
    }

    pub fn report(&self) -> PathBuf {
        self.root.join(REPORT)
    }

    pub fn emulation(&self) -> PathBuf {
        self.root.join(EMULATION)
    }

    /// Writes the plan and the profile the workers read.
    pub fn write_inputs(&self, plan: &Plan, calibration: &Calibration) -> Result<(), RuntimeError> {
        let plan_json = serde_json::to_string_pretty(plan).expect("a plan serialises") + "\n";
        write(&self.plan(), plan_json.as_bytes())?;
        write(&self.calibration(), calibration.to_toml().as_bytes())
    }

    pub fn write_emulation(&self, emulation: &Emulation) -> Result<(), RuntimeError> {
        let json = serde_json::to_string_pretty(emulation).expect("numbers serialise") + "\n";
        write(&self.emulation(), json.as_bytes())
    }

    /// How the run was emulated; `None` for a run from before it was recorded.
    pub fn read_emulation(&self) -> Result<Option<Emulation>, RuntimeError> {
        let path = self.emulation();
        let Ok(text) = fs::read_to_string(&path) else { return Ok(None) };
        serde_json::from_str(&text).map(Some).map_err(|err| malformed(&path, "a record of the run's emulation", err))
    }

    /// Every step `metrics.jsonl` records, in order.
    pub fn read_metrics(&self) -> Result<Vec<StepMetrics>, RuntimeError> {
        let path = self.metrics();
        let text = fs::read_to_string(&path).map_err(|error| io_error(&path, error))?;
        text.lines()
            .enumerate()
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(idx, line)| {
                serde_json::from_str(line)
                    .map_err(|err| malformed(&path, &format!("line {}: a step's metrics", idx + 1), err))
            })
            .collect()
    }

    /// The metrics file, fresh, or after a resume at `resumed_at` keeping only the steps up to it
    /// (a run that stopped after its last checkpoint recorded steps that are trained again now);
    /// open for appending.
    pub fn open_metrics(&self, resumed_at: Option<u64>) -> Result<File, RuntimeError> {
        let path = self.metrics();
        let kept: Vec<String> = match resumed_at {
            None => Vec::new(),
            Some(step) => fs::read_to_string(&path)
                .unwrap_or_default()
                .lines()
                .filter(|line| {
                    let recorded = serde_json::from_str::<Value>(line).ok().and_then(|v| v["step"].as_u64());
                    recorded.is_some_and(|recorded| recorded <= step)
                })
                .map(|line| format!("{line}\n"))
                .collect(),
        };
        medley_model::write_atomically(&path, kept.concat().as_bytes())?;
        OpenOptions::new().append(true).open(&path).map_err(|error| io_error(&path, error))
    }

    /// Where rank `rank` writes its timeline of one run segment: a fresh run's, or a resumed one's
    /// from the step it resumed at (each segment has its own clock; [`RunDir::merge_timelines`]
    /// merges them in order).
    pub fn rank_timeline(&self, rank: usize, resumed_at: Option<u64>) -> PathBuf {
        let name = match resumed_at {
            None => format!("rank-{rank}.json"),
            Some(step) => format!("rank-{rank}.from-step-{step:08}.json"),
        };
        self.timelines().join(name)
    }

    /// One Perfetto file of the whole run from the workers' per-rank files: each segment (the
    /// first run, then every resumption in step order) after the one before. As in
    /// `metrics.jsonl`, a segment's steps past the checkpoint the next one resumed from are left
    /// out: they were trained again.
    pub fn merge_timelines(&self) -> Result<(), RuntimeError> {
        let dir = self.timelines();
        let mut segments: BTreeMap<Option<u64>, Vec<PathBuf>> = BTreeMap::new();
        for entry in fs::read_dir(&dir).map_err(|error| io_error(&dir, error))? {
            let path = entry.map_err(|error| io_error(&dir, error))?.path();
            if let Some(start) = path.file_name().and_then(|name| name.to_str()).and_then(timeline_segment) {
                segments.entry(start).or_default().push(path);
            }
        }
        let starts: Vec<Option<u64>> = segments.keys().copied().collect();
        let mut merged = Vec::new();
        for (idx, paths) in segments.into_values().enumerate() {
            let superseded_after = starts.get(idx + 1).copied().flatten().unwrap_or(u64::MAX);
            let mut events = Vec::new();
            for path in paths {
                let text = fs::read_to_string(&path).map_err(|error| io_error(&path, error))?;
                let kept = trace_events(&text).into_iter().filter(|event| {
                    event.pointer("/args/step").and_then(Value::as_u64).is_none_or(|step| step <= superseded_after)
                });
                events.extend(kept);
            }
            merged.push(events);
        }
        write(&self.timeline(), &serde_json::to_vec(&merge_segments(merged)).expect("events serialise"))
    }

    /// What run the directory holds, in words; `None` when it holds none. A run is what training
    /// produced — checkpoints, metrics — not the inputs (plan, profile) written before it started.
    fn describe_run(&self) -> Option<String> {
        let mut found = Vec::new();
        let checkpoints = self.checkpoints();
        match read_latest(&checkpoints) {
            Ok((_, manifest)) => found.push(format!("a checkpoint at step {}", manifest.step)),
            // Even a checkpoint that does not read is not for a new run to delete.
            Err(_) if checkpoints.join("latest").exists() => found.push("a checkpoint".into()),
            Err(_) => {}
        }
        let steps = fs::read_to_string(self.metrics())
            .map_or(0, |text| text.lines().filter(|line| !line.trim().is_empty()).count());
        match steps {
            0 => {}
            1 => found.push(format!("1 step in {METRICS}")),
            n => found.push(format!("{n} steps in {METRICS}")),
        }
        (!found.is_empty()).then(|| found.join(", "))
    }

    /// Removes a run's outputs (and nothing else the directory holds: its plan and profile are
    /// written anew by the run that starts over, and may be that run's inputs).
    fn remove_run(&self) -> Result<(), RuntimeError> {
        for path in [self.checkpoints(), self.timelines()] {
            if path.exists() {
                fs::remove_dir_all(&path).map_err(|error| io_error(&path, error))?;
            }
        }
        for path in [self.metrics(), self.timeline(), self.report(), self.emulation()] {
            if path.exists() {
                fs::remove_file(&path).map_err(|error| io_error(&path, error))?;
            }
        }
        Ok(())
    }

    /// Creates the directory if needed and locks it for a run that resumes from `resume` (if
    /// any). A new run into a directory that holds one is refused unless `force`, which deletes
    /// that run's outputs — not now, but at [`ClaimedRun::start_over_if_forced`], once every
    /// check has passed.
    pub fn claim(self, resume: Option<&Path>, force: bool) -> Result<ClaimedRun, RuntimeError> {
        fs::create_dir_all(&self.root).map_err(|error| io_error(&self.root, error))?;
        let mut locks = vec![lock::lock(&self.root)?];
        // A run resumed from another directory reads its checkpoint: nobody may change it meanwhile.
        if let Some(source) = resume.filter(|source| !same_dir(source, &self.root) && source.is_dir()) {
            locks.extend(lock::lock_for_reading(source)?);
        }
        let start_over = self.refuse_a_run_over_another(resume, force)?;
        Ok(ClaimedRun { dir: self, start_over, _locks: locks })
    }

    /// Whether a new run here (resuming from `resume`) would overwrite a run the directory holds:
    /// refuses when it would, unless `force`; returns whether that run is to be deleted first.
    pub fn refuse_a_run_over_another(&self, resume: Option<&Path>, force: bool) -> Result<bool, RuntimeError> {
        if resume.is_some_and(|source| same_dir(source, &self.root)) {
            return Ok(false);
        }
        let Some(found) = self.describe_run() else { return Ok(false) };
        if !force {
            return Err(RuntimeError::RunDirectory(format!(
                "{} already holds a run ({found}); continue it with --resume {0}, write this run elsewhere with \
                 --out DIR, or delete that run and start over with --force",
                self.root.display()
            )));
        }
        Ok(true)
    }
}

/// A run directory this process holds the lock of (and of the directory it resumes from, when
/// that is another), until dropped.
#[derive(Debug)]
pub struct ClaimedRun {
    dir: RunDir,
    /// The previous run's outputs are to go, once the new run has passed its checks.
    start_over: bool,
    _locks: Vec<File>,
}

impl ClaimedRun {
    pub fn dir(&self) -> &RunDir {
        &self.dir
    }

    /// Deletes the previous run's outputs if `--force` asked to start over.
    pub fn start_over_if_forced(&self) -> Result<(), RuntimeError> {
        if self.start_over { self.dir.remove_run() } else { Ok(()) }
    }
}

/// The segment a file named by [`RunDir::rank_timeline`] belongs to: `Some(None)` for the first
/// run's, `Some(Some(step))` for one resumed at `step`; `None` for other files.
pub fn timeline_segment(file_name: &str) -> Option<Option<u64>> {
    let rest = file_name.strip_prefix("rank-")?.strip_suffix(".json")?;
    match rest.split_once(".from-step-") {
        None => rest.parse::<usize>().ok().map(|_| None),
        Some((rank, step)) => {
            rank.parse::<usize>().ok()?;
            step.parse().ok().map(Some)
        }
    }
}

/// Whether two paths name one directory (`run1`, `./run1`, its absolute path).
pub fn same_dir(a: &Path, b: &Path) -> bool {
    match (fs::canonicalize(a), fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

fn malformed(path: &Path, what: &str, err: serde_json::Error) -> RuntimeError {
    RuntimeError::RunDirectory(format!("{}: {what} does not read: {err}", path.display()))
}

#[cfg(test)]
mod tests;
