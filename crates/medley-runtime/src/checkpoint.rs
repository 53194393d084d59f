//! Checkpoints: one safetensors file per rank plus a manifest, in a directory per step, and a
//! `latest` pointer moved only once the whole checkpoint is on disk.
//!
//! Every file is written atomically (temporary file, fsync, rename, directory fsync). A worker
//! killed while writing step N leaves `latest` naming step N − k, whose files it never touches;
//! what such a kill leaves behind (later step directories, temporary files) is swept when the run
//! resumes. The manifest records each file's size and SHA-256, read back from disk once every
//! rank has written: a resume checks every file it reads (replica copies included) and the step
//! each file says it holds, so a flipped byte or a file from another step is refused, named.
//! Tensors are stored under their global names, so a checkpoint restores into any plan of the
//! same model: the stages of the new plan pick their names out of all the files.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use medley_model::data::Dataset;
use medley_model::{NamedTensors, load_tensors_where, save_tensors, write_atomically};
use medley_plan::Plan;
use serde::{Deserialize, Serialize};

use crate::error::CommContext;
use crate::{RankLayout, RuntimeError, Worker};

/// The manifest format this build writes; it reads format 1 too (no checksums).
const MANIFEST_FORMAT: u32 = 2;
const MANIFEST_FORMAT_WITHOUT_CHECKSUMS: u32 = 1;
/// The file in the checkpoint root that names the newest complete checkpoint.
const LATEST: &str = "latest";

/// What a checkpoint holds besides tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: u32,
    /// Steps completed; training resumes with step `step + 1`.
    pub step: u64,
    /// Samples of the data consumed so far (the data position).
    pub samples_seen: u64,
    /// AdamW updates applied (equal to `step` unless the optimizer state was reset).
    pub optimizer_steps: u64,
    /// Seeds the data order.
    pub seed: u64,
    /// The plan the checkpoint was taken under.
    pub plan: Plan,
    /// The tensor files, relative to the manifest.
    pub files: Vec<String>,
    /// Each file's size and SHA-256 by name (absent in format 1).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub checksums: BTreeMap<String, FileChecksum>,
}

/// A checkpoint file's size and content hash.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileChecksum {
    pub bytes: u64,
    /// SHA-256 of the file, lowercase hex.
    pub sha256: String,
}

impl FileChecksum {
    /// The size and hash of the file at `path`, streamed.
    pub fn of(path: &Path) -> Result<FileChecksum, RuntimeError> {
        use sha2::Digest;
        let mut file = fs::File::open(path).map_err(io_error(path))?;
        let mut hasher = sha2::Sha256::new();
        let bytes = std::io::copy(&mut file, &mut hasher).map_err(io_error(path))?;
        let sha256 = hasher.finalize().iter().map(|byte| format!("{byte:02x}")).collect();
        Ok(FileChecksum { bytes, sha256 })
    }
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
    move |error| RuntimeError::Io { path: path.to_path_buf(), error }
}

fn corrupt(path: &Path, reason: impl Into<String>) -> RuntimeError {
    RuntimeError::Checkpoint { path: path.to_path_buf(), reason: reason.into() }
}

impl Worker {
    /// Writes this rank's stages into `root/step-NNNNNNNN/`; rank 0 then writes the manifest,
    /// moves `latest` to it and removes all but the `keep` newest checkpoints. Every rank must
    /// call it.
    pub fn save_checkpoint(&mut self, root: &Path, keep: usize) -> Result<PathBuf, RuntimeError> {
        let name = format!("step-{:08}", self.step);
        let dir = root.join(&name);
        fs::create_dir_all(&dir).map_err(io_error(&dir))?;
        // A long-context stage's devices hold the same weights: its first device writes them.
        let writes = |layout: &RankLayout| layout.context.as_ref().is_none_or(|seat| seat.device_index == 0);
        let file = |rank: usize| format!("rank-{rank}.safetensors");
        let files: Vec<String> =
            self.layouts.iter().filter(|layout| writes(layout)).map(|layout| file(layout.job_rank)).collect();
        if writes(&self.layout) {
            let tensors: Vec<_> = self.stages.iter().flat_map(|stage| stage.checkpoint_tensors()).collect();
            let metadata = HashMap::from([("step".to_string(), self.step.to_string())]);
            save_tensors(&dir.join(file(self.layout.job_rank)), &tensors, metadata)?;
        }
        self.world.barrier().during(|| format!("waiting for every rank to write {}", dir.display()))?;
        if self.layout.job_rank == 0 {
            let checksums = files
                .iter()
                .map(|name| FileChecksum::of(&dir.join(name)).map(|checksum| (name.clone(), checksum)))
                .collect::<Result<_, _>>()?;
            let manifest = Manifest {
                format: MANIFEST_FORMAT,
                step: self.step,
                samples_seen: self.step * u64::from(self.plan.global_batch()),
                optimizer_steps: self.stages[0].optimizer_step_count(),
                seed: self.options.seed,
                plan: self.plan.clone(),
                files,
                checksums,
            };
            let path = dir.join("manifest.json");
            let json = serde_json::to_string_pretty(&manifest).expect("a manifest serialises");
            write_atomically(&path, json.as_bytes())?;
            write_atomically(&root.join(LATEST), name.as_bytes())?;
            remove_older(root, self.step, keep)?;
        }
        // Nobody resumes from a checkpoint whose `latest` is not yet written.
        self.world.barrier().during(|| format!("waiting for {} to be published", dir.display()))?;
        Ok(dir)
    }

    /// Continues from the newest checkpoint under `root`, taken under this plan or another one
    /// of the same model, sequence length and global batch.
    pub fn resume(&mut self, root: &Path) -> Result<Manifest, RuntimeError> {
        let (dir, manifest) = read_latest(root)?;
        check_resumable(&dir, &manifest, &self.plan)?;
        if self.layout.job_rank == 0 {
            sweep_incomplete(root, manifest.step)?;
        }
        let mut tensors = NamedTensors::new();
        for file in &manifest.files {
            let path = dir.join(file);
            verify_file(&path, &manifest)?;
            let wanted = |name: &str| self.stages.iter().any(|stage| stage.restores(name));
            let (file_tensors, metadata) = load_tensors_where(&path, wanted)?;
            let step = metadata.get("step").map(String::as_str);
            if step != Some(manifest.step.to_string().as_str()) {
                return Err(corrupt(
                    &path,
                    format!("it holds step {}, the manifest step {}", step.unwrap_or("(none)"), manifest.step),
                ));
            }
            tensors.extend(file_tensors);
        }
        for stage in &mut self.stages {
            stage.restore(&tensors, manifest.optimizer_steps)?;
        }
        if manifest.seed != self.options.seed {
            self.options.seed = manifest.seed;
            self.dataset = Dataset::shakespeare(self.plan.seq_len() as usize, manifest.seed)?;
        }
        self.step = manifest.step;
        Ok(manifest)
    }
}

/// Whether the checkpoint in `dir` can continue under `plan`: the same model and sequence length
/// (the tensors), the same global batch (the data position).
pub fn check_resumable(dir: &Path, manifest: &Manifest, plan: &Plan) -> Result<(), RuntimeError> {
    let taken = &manifest.plan;
    if taken.model() != plan.model() || taken.seq_len() != plan.seq_len() {
        return Err(corrupt(
            dir,
            format!(
                "it is of model `{}` at sequence length {}, this plan trains `{}` at {}",
                taken.model().name(),
                taken.seq_len(),
                plan.model().name(),
                plan.seq_len()
            ),
        ));
    }
    if taken.global_batch() != plan.global_batch() {
        return Err(corrupt(
            dir,
            format!(
                "it was trained with a global batch of {}, this plan has {}: the data position would not carry over",
                taken.global_batch(),
                plan.global_batch()
            ),
        ));
    }
    Ok(())
}

/// Checks the file at `path` against the size and SHA-256 the manifest recorded for it (a
/// format-1 manifest recorded none: nothing to check).
pub fn verify_file(path: &Path, manifest: &Manifest) -> Result<(), RuntimeError> {
    if manifest.format == MANIFEST_FORMAT_WITHOUT_CHECKSUMS {
        return Ok(());
    }
    let name = path.file_name().and_then(|name| name.to_str()).unwrap_or_default();
    matches_recorded(path, manifest.checksums.get(name))
}

/// Whether the file at `path` has the `recorded` size and hash.
fn matches_recorded(path: &Path, recorded: Option<&FileChecksum>) -> Result<(), RuntimeError> {
    let Some(recorded) = recorded else {
        return Err(corrupt(path, "the manifest records no checksum for this file"));
    };
    let found = FileChecksum::of(path)?;
    if found != *recorded {
        return Err(corrupt(
            path,
            format!(
                "its content is not what was written ({} bytes, SHA-256 {}…; the manifest says {} bytes, {}…): \
                 the file is corrupt or from another checkpoint; resume from an earlier one by pointing `latest` at it",
                found.bytes,
                &found.sha256[..12],
                recorded.bytes,
                &recorded.sha256[..recorded.sha256.len().min(12)]
            ),
        ));
    }
    Ok(())
}

/// Checks every file of the checkpoint in `dir` (what `medley train --resume` does before it
/// starts workers).
pub fn verify_checkpoint(dir: &Path, manifest: &Manifest) -> Result<(), RuntimeError> {
    manifest.files.iter().try_for_each(|file| verify_file(&dir.join(file), manifest))
}

/// Removes what a run stopped while writing a checkpoint left under `root`: step directories
/// after the `latest` one and temporary files (a dot, the name being written, a random tail),
/// which would otherwise hold their disk space for good.
pub fn sweep_incomplete(root: &Path, latest: u64) -> Result<(), RuntimeError> {
    for entry in fs::read_dir(root).map_err(io_error(root))? {
        let path = entry.map_err(io_error(root))?.path();
        let name = path.file_name().and_then(|name| name.to_str()).unwrap_or_default();
        let step = name.strip_prefix("step-").and_then(|step| step.parse::<u64>().ok());
        if path.is_dir() && step.is_some_and(|step| step > latest) {
            fs::remove_dir_all(&path).map_err(io_error(&path))?;
        } else if path.is_dir() && step.is_some() {
            sweep_temporary(&path)?;
        }
    }
    sweep_temporary(root)
}

/// Removes the temporary files (`.NAME.XXXXXX`) of an atomic write in `dir`.
fn sweep_temporary(dir: &Path) -> Result<(), RuntimeError> {
    for entry in fs::read_dir(dir).map_err(io_error(dir))? {
        let path = entry.map_err(io_error(dir))?.path();
        let hidden = path.file_name().and_then(|name| name.to_str()).is_some_and(|name| name.starts_with('.'));
        if hidden && path.is_file() {
            fs::remove_file(&path).map_err(io_error(&path))?;
        }
    }
    Ok(())
}

/// The newest complete checkpoint under `root` and its manifest.
pub fn read_latest(root: &Path) -> Result<(PathBuf, Manifest), RuntimeError> {
    let pointer = root.join(LATEST);
    if !pointer.is_file() {
        return Err(corrupt(
            root,
            "no complete checkpoint here (no `latest` file): resume from a run directory that training wrote a checkpoint into",
        ));
    }
    let name = fs::read_to_string(&pointer).map_err(io_error(&pointer))?;
    let name = name.trim();
    if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
        return Err(corrupt(&pointer, format!("`{name}` is not a checkpoint directory name")));
    }
    let dir = root.join(name);
    let path = dir.join("manifest.json");
    let text = fs::read_to_string(&path).map_err(io_error(&path))?;
    let manifest: Manifest = serde_json::from_str(&text).map_err(|err| corrupt(&path, err.to_string()))?;
    if ![MANIFEST_FORMAT, MANIFEST_FORMAT_WITHOUT_CHECKSUMS].contains(&manifest.format) {
        return Err(corrupt(
            &path,
            format!(
                "manifest format {} is neither {MANIFEST_FORMAT} nor {MANIFEST_FORMAT_WITHOUT_CHECKSUMS}",
                manifest.format
            ),
        ));
    }
    if let Some(outside) = manifest.files.iter().find(|file| file.contains(['/', '\\']) || file.starts_with('.')) {
        return Err(corrupt(&path, format!("`{outside}` is not a file of this checkpoint (names only, no paths)")));
    }
    Ok((dir, manifest))
}

/// Once step `latest` is published: keeps the `keep` newest checkpoints up to it and removes
/// the older ones, and any of later steps — left incomplete by a run that stopped while writing
/// them, since a resume starts from `latest`.
fn remove_older(root: &Path, latest: u64, keep: usize) -> Result<(), RuntimeError> {
    let mut steps = Vec::new();
    for entry in fs::read_dir(root).map_err(io_error(root))? {
        let entry = entry.map_err(io_error(root))?;
        let name = entry.file_name();
        let step = name.to_str().and_then(|name| name.strip_prefix("step-")).and_then(|step| step.parse::<u64>().ok());
        if let Some(step) = step
            && entry.path().is_dir()
        {
            steps.push((step, entry.path()));
        }
    }
    steps.sort();
    let kept_from = steps.iter().filter(|(step, _)| *step <= latest).count().saturating_sub(keep.max(1));
    for (idx, (step, path)) in steps.iter().enumerate() {
        if idx < kept_from || *step > latest {
            fs::remove_dir_all(path).map_err(io_error(path))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_keeps_the_newest_up_to_latest() {
        let root = tempfile::tempdir().unwrap();
        for step in [2, 4, 6, 8, 10] {
            fs::create_dir(root.path().join(format!("step-{step:08}"))).unwrap();
        }
        fs::write(root.path().join(LATEST), "step-00000008").unwrap();
        remove_older(root.path(), 8, 2).unwrap();
        let mut left: Vec<String> =
            fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        assert_eq!(left, ["latest", "step-00000006", "step-00000008"], "10 was never published");
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> =
            fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    #[test]
    fn a_resume_sweeps_what_an_interrupted_checkpoint_left() {
        let root = tempfile::tempdir().unwrap();
        for step in [4, 6, 8] {
            fs::create_dir(root.path().join(format!("step-{step:08}"))).unwrap();
        }
        fs::write(root.path().join(LATEST), "step-00000006").unwrap();
        fs::write(root.path().join(".latest.Ab12Cd"), "step-0000000").unwrap();
        fs::write(root.path().join("step-00000006").join(".rank-1.safetensors.x9Y8z7"), [0u8; 64]).unwrap();
        fs::write(root.path().join("step-00000006").join("rank-0.safetensors"), [1u8; 8]).unwrap();
        sweep_incomplete(root.path(), 6).unwrap();
        assert_eq!(names(root.path()), ["latest", "step-00000004", "step-00000006"]);
        assert_eq!(names(&root.path().join("step-00000006")), ["rank-0.safetensors"]);
    }

    #[test]
    fn files_are_checked_against_their_recorded_size_and_hash() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rank-0.safetensors");
        fs::write(&path, b"the weights of step six").unwrap();
        let checksum = FileChecksum::of(&path).unwrap();
        assert_eq!(checksum.bytes, 23);
        matches_recorded(&path, Some(&checksum)).unwrap();
        fs::write(&path, b"the weights of step sIx").unwrap();
        let err = matches_recorded(&path, Some(&checksum)).unwrap_err().to_string();
        assert!(err.contains("rank-0.safetensors") && err.contains("not what was written"), "{err}");
        assert!(matches_recorded(&path, None).is_err(), "a file the manifest does not record is refused");
    }
}
