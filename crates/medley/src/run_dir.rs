//! A run directory: what `medley train` writes, locked while a run uses it, never overwritten by
//! accident.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Where a run keeps its outputs, under its directory.
pub const CHECKPOINTS: &str = "checkpoints";
pub const METRICS: &str = "metrics.jsonl";
pub const TIMELINES: &str = "timeline";
pub const TIMELINE: &str = "timeline.json";
pub const PLAN: &str = "plan.json";
pub const CALIBRATION: &str = "calibration.toml";
/// Held (flock) while a run uses the directory; holds the holder's pid.
const LOCK: &str = ".medley.lock";

/// What a run is about to do with its directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// A new run: the directory must not hold one, unless `force` starts over.
    Fresh { force: bool },
    /// Continuing the run the directory holds.
    Resume,
}

/// A run directory this process holds the lock of, until dropped.
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    _lock: File,
}

impl RunDir {
    /// Creates `path` if needed and locks it; a fresh run refuses a directory that holds a run
    /// unless forced, which then removes that run's outputs.
    pub fn claim(path: &Path, wanted: Use) -> Result<RunDir> {
        fs::create_dir_all(path).with_context(|| format!("cannot create the run directory {}", path.display()))?;
        let lock = lock(path)?;
        if let Use::Fresh { force } = wanted
            && let Some(found) = describe_run(path)
        {
            if !force {
                bail!(
                    "{} already holds a run ({found}); continue it with --resume {0}, write this run elsewhere \
                     with --out DIR, or delete that run and start over with --force",
                    path.display()
                );
            }
            remove_run(path)?;
        }
        Ok(RunDir { path: path.to_path_buf(), _lock: lock })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Takes the directory's lock without waiting, writing this process's pid into it; a held lock
/// names its holder.
fn lock(dir: &Path) -> Result<File> {
    let path = dir.join(LOCK);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let mut holder = String::new();
            file.read_to_string(&mut holder).ok();
            let holder = match holder.trim() {
                "" => "another process".to_string(),
                pid => format!("process {pid}"),
            };
            bail!(
                "{} is in use by another medley run ({holder}); wait for it to finish or give this run another --out",
                dir.display()
            );
        }
        Err(TryLockError::Error(err)) => return Err(err).with_context(|| format!("cannot lock {}", path.display())),
    }
    let pid = std::process::id().to_string();
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| file.write_all(pid.as_bytes()))
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(file)
}

/// What run the directory holds, in words; `None` when it holds none. A run is what training
/// produced — checkpoints, metrics — not the inputs (plan, profile) written before it started.
fn describe_run(dir: &Path) -> Option<String> {
    let mut found = Vec::new();
    let checkpoints = dir.join(CHECKPOINTS);
    match medley_runtime::read_latest(&checkpoints) {
        Ok((_, manifest)) => found.push(format!("a checkpoint at step {}", manifest.step)),
        // Even a checkpoint that does not read is not for a new run to delete.
        Err(_) if checkpoints.join("latest").exists() => found.push("a checkpoint".into()),
        Err(_) => {}
    }
    if let Ok(text) = fs::read_to_string(dir.join(METRICS)) {
        let steps = text.lines().filter(|line| !line.trim().is_empty()).count();
        found.push(format!("{} in {METRICS}", crate::render::count(steps, "step")));
    }
    (!found.is_empty()).then(|| found.join(", "))
}

/// Removes a run's outputs (and nothing else the directory holds).
fn remove_run(dir: &Path) -> Result<()> {
    for name in [CHECKPOINTS, TIMELINES] {
        let path = dir.join(name);
        if path.exists() {
            fs::remove_dir_all(&path).with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    for name in [METRICS, TIMELINE, PLAN, CALIBRATION] {
        let path = dir.join(name);
        if path.exists() {
            fs::remove_file(&path).with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    #[test]
    fn a_locked_directory_names_its_holder() {
        let dir = scratch();
        let held = RunDir::claim(dir.path(), Use::Fresh { force: false }).unwrap();
        let err = RunDir::claim(dir.path(), Use::Resume).unwrap_err().to_string();
        assert!(err.contains(&format!("process {}", std::process::id())), "{err}");
        drop(held);
        RunDir::claim(dir.path(), Use::Resume).unwrap();
    }

    #[test]
    fn a_fresh_run_refuses_a_directory_that_holds_one() {
        let dir = scratch();
        fs::write(dir.path().join(METRICS), "{\"step\":1}\n{\"step\":2}\n").unwrap();
        let err = RunDir::claim(dir.path(), Use::Fresh { force: false }).unwrap_err().to_string();
        assert!(err.contains("2 steps in metrics.jsonl") && err.contains("--resume"), "{err}");
        assert!(dir.path().join(METRICS).is_file(), "nothing is deleted");
        RunDir::claim(dir.path(), Use::Resume).unwrap();
    }

    #[test]
    fn force_removes_only_the_runs_outputs() {
        let dir = scratch();
        fs::create_dir_all(dir.path().join(CHECKPOINTS).join("step-00000001")).unwrap();
        fs::write(dir.path().join(PLAN), "{}").unwrap();
        fs::write(dir.path().join(METRICS), "{\"step\":1}\n").unwrap();
        fs::write(dir.path().join("notes.txt"), "mine").unwrap();
        RunDir::claim(dir.path(), Use::Fresh { force: true }).unwrap();
        assert!(![CHECKPOINTS, PLAN, METRICS].iter().any(|name| dir.path().join(name).exists()));
        assert!(dir.path().join("notes.txt").is_file());
    }

    #[test]
    fn an_empty_or_new_directory_is_no_run() {
        let dir = scratch();
        RunDir::claim(&dir.path().join("new"), Use::Fresh { force: false }).unwrap();
    }
}
