//! A run directory's lock: a run holds it (flock, with its pid in the file) while it writes there,
//! a resume holds the directory it reads from shared.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{ErrorKind, Read, Seek, Write};
use std::path::Path;

use crate::RuntimeError;

/// Held while a run uses the directory; holds the holder's pid.
const LOCK: &str = ".medley.lock";

fn io_error(path: &Path, error: std::io::Error) -> RuntimeError {
    RuntimeError::Io { path: path.to_path_buf(), error }
}

/// Takes the directory's lock without waiting, writing this process's pid into it; a held lock
/// names its holder.
pub(super) fn lock(dir: &Path) -> Result<File, RuntimeError> {
    let path = dir.join(LOCK);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|error| io_error(&path, error))?;
    if let Err(err) = file.try_lock() {
        return Err(refused_lock(dir, &path, &mut file, err));
    }
    let pid = std::process::id().to_string();
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| file.write_all(pid.as_bytes()))
        .map_err(|error| io_error(&path, error))?;
    Ok(file)
}

/// Takes a shared lock on a directory a run only reads (the checkpoint it resumes from): other
/// readers may hold it too, a run writing there may not. A directory this process cannot write
/// (a read-only mount, another user's) is read without one when it has no lock file to share:
/// nothing of this user's can write a checkpoint there either.
pub(super) fn lock_for_reading(dir: &Path) -> Result<Option<File>, RuntimeError> {
    let path = dir.join(LOCK);
    let opened = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path);
    let mut file = match opened {
        Ok(file) => file,
        Err(err) if matches!(err.kind(), ErrorKind::ReadOnlyFilesystem | ErrorKind::PermissionDenied) => {
            match File::open(&path) {
                Ok(file) => file,
                Err(absent) if absent.kind() == ErrorKind::NotFound => return Ok(None),
                Err(other) => return Err(io_error(&path, other)),
            }
        }
        Err(err) => return Err(io_error(&path, err)),
    };
    if let Err(err) = file.try_lock_shared() {
        return Err(refused_lock(dir, &path, &mut file, err));
    }
    Ok(Some(file))
}

/// The error for a lock not taken: a held lock names its holder (the pid in the file).
fn refused_lock(dir: &Path, path: &Path, file: &mut File, err: TryLockError) -> RuntimeError {
    match err {
        TryLockError::WouldBlock => {
            let mut holder = String::new();
            file.read_to_string(&mut holder).ok();
            let holder = match holder.trim() {
                "" => "another process".to_string(),
                pid => format!("process {}", pid.escape_debug()),
            };
            RuntimeError::RunDirectory(format!(
                "{} is in use by another medley run ({holder}); wait for it to finish or give this run another --out",
                dir.display()
            ))
        }
        TryLockError::Error(err) => io_error(path, err),
    }
}
