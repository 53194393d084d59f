//! A run directory: what `medley train` writes, locked while a run uses it, never overwritten by
//! accident.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{ErrorKind, Read, Seek, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Where a run keeps its outputs, under its directory.
pub const CHECKPOINTS: &str = "checkpoints";
pub const METRICS: &str = "metrics.jsonl";
pub const TIMELINES: &str = "timeline";
pub const TIMELINE: &str = "timeline.json";
pub const PLAN: &str = "plan.json";
pub const CALIBRATION: &str = "calibration.toml";
pub const REPORT: &str = "report.html";
/// The run's time dilation, which prices its prediction.
pub const EMULATION: &str = "emulation.json";
/// Held (flock) while a run uses the directory; holds the holder's pid.
const LOCK: &str = ".medley.lock";

/// A run directory this process holds the lock of (and of the directory it resumes from, when
/// that is another), until dropped.
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    /// The previous run's outputs are to go, once the new run has passed its checks.
    start_over: bool,
    _locks: Vec<File>,
}

impl RunDir {
    /// Creates `out` if needed and locks it for a run that resumes from `resume` (if any). A new
    /// run into a directory that holds one is refused unless `force`, which deletes that run's
    /// outputs — not now, but at [`RunDir::start_over_if_forced`], once every check has passed.
    pub fn claim(out: &Path, resume: Option<&Path>, force: bool) -> Result<RunDir> {
        fs::create_dir_all(out).with_context(|| format!("cannot create the run directory {}", out.display()))?;
        let mut locks = vec![lock(out)?];
        // A run resumed from another directory reads its checkpoint: nobody may change it meanwhile.
        if let Some(source) = resume.filter(|source| !same_dir(source, out) && source.is_dir()) {
            locks.extend(lock_for_reading(source)?);
        }
        let start_over = refuse_a_run_over_another(out, resume, force)?;
        Ok(RunDir { path: out.to_path_buf(), start_over, _locks: locks })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Deletes the previous run's outputs if `--force` asked to start over.
    pub fn start_over_if_forced(&self) -> Result<()> {
        if self.start_over { remove_run(&self.path) } else { Ok(()) }
    }
}

/// Whether a new run into `out` (resuming from `resume`) would overwrite a run it holds: refuses
/// when it would, unless `force`; returns whether that run is to be deleted first.
pub fn refuse_a_run_over_another(out: &Path, resume: Option<&Path>, force: bool) -> Result<bool> {
    if resume.is_some_and(|source| same_dir(source, out)) {
        return Ok(false);
    }
    let Some(found) = describe_run(out) else { return Ok(false) };
    if !force {
        bail!(
            "{} already holds a run ({found}); continue it with --resume {0}, write this run elsewhere with \
             --out DIR, or delete that run and start over with --force",
            out.display()
        );
    }
    Ok(true)
}

/// Whether two paths name one directory (`run1`, `./run1`, its absolute path).
pub fn same_dir(a: &Path, b: &Path) -> bool {
    match (fs::canonicalize(a), fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
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
    if let Err(err) = file.try_lock() {
        return Err(refused_lock(dir, &path, &mut file, err));
    }
    let pid = std::process::id().to_string();
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| file.write_all(pid.as_bytes()))
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(file)
}

/// Takes a shared lock on a directory a run only reads (the checkpoint it resumes from): other
/// readers may hold it too, a run writing there may not. A directory this process cannot write
/// (a read-only mount, another user's) is read without one when it has no lock file to share:
/// nothing of this user's can write a checkpoint there either.
fn lock_for_reading(dir: &Path) -> Result<Option<File>> {
    let path = dir.join(LOCK);
    let opened = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path);
    let mut file = match opened {
        Ok(file) => file,
        Err(err) if matches!(err.kind(), ErrorKind::ReadOnlyFilesystem | ErrorKind::PermissionDenied) => {
            match File::open(&path) {
                Ok(file) => file,
                Err(absent) if absent.kind() == ErrorKind::NotFound => return Ok(None),
                Err(other) => return Err(other).with_context(|| format!("cannot open {}", path.display())),
            }
        }
        Err(err) => return Err(err).with_context(|| format!("cannot open {}", path.display())),
    };
    if let Err(err) = file.try_lock_shared() {
        return Err(refused_lock(dir, &path, &mut file, err));
    }
    Ok(Some(file))
}

/// The error for a lock not taken: a held lock names its holder (the pid in the file).
fn refused_lock(dir: &Path, path: &Path, file: &mut File, err: TryLockError) -> anyhow::Error {
    match err {
        TryLockError::WouldBlock => {
            let mut holder = String::new();
            file.read_to_string(&mut holder).ok();
            let holder = match holder.trim() {
                "" => "another process".to_string(),
                pid => format!("process {}", pid.escape_debug()),
            };
            anyhow::anyhow!(
                "{} is in use by another medley run ({holder}); wait for it to finish or give this run another --out",
                dir.display()
            )
        }
        TryLockError::Error(err) => anyhow::Error::new(err).context(format!("cannot lock {}", path.display())),
    }
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
    let steps =
        fs::read_to_string(dir.join(METRICS)).map_or(0, |text| text.lines().filter(|l| !l.trim().is_empty()).count());
    if steps > 0 {
        found.push(format!("{} in {METRICS}", crate::render::count(steps, "step")));
    }
    (!found.is_empty()).then(|| found.join(", "))
}

/// Removes a run's outputs (and nothing else the directory holds: its plan and profile are
/// written anew by the run that starts over, and may be that run's inputs).
fn remove_run(dir: &Path) -> Result<()> {
    for name in [CHECKPOINTS, TIMELINES] {
        let path = dir.join(name);
        if path.exists() {
            fs::remove_dir_all(&path).with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    for name in [METRICS, TIMELINE, REPORT, EMULATION] {
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
        let held = RunDir::claim(dir.path(), None, false).unwrap();
        let err = RunDir::claim(dir.path(), Some(dir.path()), false).unwrap_err().to_string();
        assert!(err.contains(&format!("process {}", std::process::id())), "{err}");
        drop(held);
        RunDir::claim(dir.path(), Some(dir.path()), false).unwrap();
    }

    #[test]
    fn a_fresh_run_refuses_a_directory_that_holds_one() {
        let dir = scratch();
        fs::write(dir.path().join(METRICS), "{\"step\":1}\n{\"step\":2}\n").unwrap();
        let err = RunDir::claim(dir.path(), None, false).unwrap_err().to_string();
        assert!(err.contains("2 steps in metrics.jsonl") && err.contains("--resume"), "{err}");
        assert!(dir.path().join(METRICS).is_file(), "nothing is deleted");
        // The same directory under another spelling is a resume.
        let spelled = dir.path().join(".");
        RunDir::claim(dir.path(), Some(&spelled), false).unwrap();
    }

    #[test]
    fn force_removes_only_the_runs_outputs_and_only_when_asked_to_start() {
        let dir = scratch();
        fs::create_dir_all(dir.path().join(CHECKPOINTS).join("step-00000001")).unwrap();
        fs::write(dir.path().join(PLAN), "{}").unwrap();
        fs::write(dir.path().join(METRICS), "{\"step\":1}\n").unwrap();
        fs::write(dir.path().join("notes.txt"), "mine").unwrap();
        let run = RunDir::claim(dir.path(), None, true).unwrap();
        assert!(dir.path().join(METRICS).is_file(), "claiming deletes nothing");
        run.start_over_if_forced().unwrap();
        assert!(![CHECKPOINTS, METRICS].iter().any(|name| dir.path().join(name).exists()));
        assert!(dir.path().join("notes.txt").is_file() && dir.path().join(PLAN).is_file());
    }

    #[test]
    fn an_empty_or_new_directory_is_no_run() {
        let dir = scratch();
        RunDir::claim(&dir.path().join("new"), None, false).unwrap();
        fs::write(dir.path().join(METRICS), "").unwrap();
        RunDir::claim(dir.path(), None, false).unwrap();
    }

    #[test]
    fn the_directory_a_run_resumes_from_is_locked_too() {
        let (source, out) = (scratch(), scratch());
        let _resuming = RunDir::claim(out.path(), Some(source.path()), false).unwrap();
        let err = RunDir::claim(source.path(), Some(source.path()), false).unwrap_err().to_string();
        assert!(err.contains("in use by another medley run"), "{err}");
    }
}
