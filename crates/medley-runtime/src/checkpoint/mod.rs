//! Checkpoints: one safetensors file per rank plus a manifest, in a directory per step, and a
//! `latest` pointer moved only once the whole checkpoint is on disk.
//!
//! Every file is written atomically (temporary file, fsync, rename, directory fsync). A worker
//! killed while writing step N leaves `latest` naming step N − k, whose files it never touches;
//! what such a kill leaves behind (later step directories, temporary files) is swept when the run
//! resumes in place — after the checkpoint it resumes from is verified, and only what is proven
//! an unfinished write (no manifest, nothing but rank files and temporaries); a `--resume` source
//! other than the run directory is never written to. The manifest records each file's size and
//! SHA-256, read back from disk once every rank has written: a resume checks every file it reads
//! (replica copies included), that it is a regular file and not a link, and the step each file,
//! the manifest and its directory say, so a flipped byte, a file from another step or a lying
//! manifest is refused, named, before anything is deleted.
//! Tensors are stored under their global names, so a checkpoint restores into any plan of the
//! same model: the stages of the new plan pick their names out of all the files.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use medley_model::data::Dataset;
use medley_model::{HostTensor, NamedTensors, load_tensors_where, save_tensors, write_atomically};
use medley_plan::Plan;
use serde::{Deserialize, Serialize};

use crate::error::CommContext;
use crate::worker::zero_shards;
use crate::{RankLayout, RuntimeError, Worker};

/// The manifest format this build writes and reads. Format 1 recorded no checksums: a resume
/// could not tell its files from corrupt ones, so it is refused.
const MANIFEST_FORMAT: u32 = 2;
const MANIFEST_FORMAT_WITHOUT_CHECKSUMS: u32 = 1;
/// The file in the checkpoint root that names the newest complete checkpoint.
const LATEST: &str = "latest";
const MANIFEST: &str = "manifest.json";
/// A manifest holds the plan (a few kilobytes per node group): more is not one medley wrote.
const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// `latest` holds one directory name.
const MAX_POINTER_BYTES: u64 = 4096;

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
    /// The size and hash of the regular file at `path`, streamed.
    pub fn of(path: &Path) -> Result<FileChecksum, RuntimeError> {
        let (file, _) = open_regular(path)?;
        hash(path, file)
    }
}

fn hash(path: &Path, mut file: fs::File) -> Result<FileChecksum, RuntimeError> {
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    let bytes = std::io::copy(&mut file, &mut hasher).map_err(io_error(path))?;
    let sha256 = hasher.finalize().iter().map(|byte| format!("{byte:02x}")).collect();
    Ok(FileChecksum { bytes, sha256 })
}

/// Opens `path` for reading if it is a regular file, and its size: never through a symbolic
/// link (which may lead out of the run directory), and never waiting on a FIFO or a device.
fn open_regular(path: &Path) -> Result<(fs::File, u64), RuntimeError> {
    let opened = fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path);
    let file = match opened {
        Ok(file) => file,
        Err(err) if err.raw_os_error() == Some(libc::ELOOP) => {
            return Err(corrupt(
                path,
                "is a symbolic link: a checkpoint reads only regular files inside its run directory",
            ));
        }
        Err(err) => return Err(io_error(path)(err)),
    };
    let metadata = file.metadata().map_err(io_error(path))?;
    if !metadata.is_file() {
        return Err(corrupt(
            path,
            format!(
                "is {}, not a regular file: a checkpoint reads only the files training wrote",
                kind_of(&metadata.file_type())
            ),
        ));
    }
    Ok((file, metadata.len()))
}

/// What a file that is not a regular file is, in words.
fn kind_of(file_type: &fs::FileType) -> &'static str {
    if file_type.is_dir() {
        "a directory"
    } else if file_type.is_symlink() {
        "a symbolic link"
    } else if file_type.is_fifo() {
        "a FIFO"
    } else if file_type.is_socket() {
        "a socket"
    } else if file_type.is_char_device() || file_type.is_block_device() {
        "a device"
    } else {
        "not a regular file"
    }
}

/// Reads the regular file at `path` as text, refusing one longer than `max_bytes`.
fn read_small(path: &Path, max_bytes: u64) -> Result<String, RuntimeError> {
    let (file, len) = open_regular(path)?;
    if len > max_bytes {
        return Err(corrupt(path, format!("is {len} bytes, more than the {max_bytes} medley ever writes there")));
    }
    let mut text = String::new();
    file.take(max_bytes).read_to_string(&mut text).map_err(io_error(path))?;
    Ok(text)
}

/// Checks that `path` is a directory itself, not a link to one.
fn real_dir(path: &Path) -> Result<(), RuntimeError> {
    let file_type = fs::symlink_metadata(path).map_err(io_error(path))?.file_type();
    if file_type.is_dir() {
        Ok(())
    } else {
        Err(corrupt(
            path,
            format!(
                "is {}, not a directory: a checkpoint lives in a directory of its run directory",
                kind_of(&file_type)
            ),
        ))
    }
}

/// The name of step `step`'s checkpoint directory.
fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step a checkpoint directory's name says (`step-00000006`: 6).
fn step_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.len() < 8 || !digits.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
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
    /// A rank that cannot write its file (a full disk) removes it, and nobody publishes the
    /// checkpoint; when rank 0 fails before publishing, every rank removes its file; a peer that
    /// dies otherwise leaves the written files for a resume to sweep, as rank 0 may still publish
    /// them.
    pub fn save_checkpoint(&mut self, root: &Path, keep: usize) -> Result<PathBuf, RuntimeError> {
        let name = step_dir_name(self.step);
        let dir = root.join(&name);
        let own_file = dir.join(rank_file(self.layout.job_rank));
        if let Err(err) = self.write_rank_file(&dir) {
            // This rank never reaches the barrier before publishing: nobody publishes the
            // checkpoint, and its file is no use.
            fs::remove_file(&own_file).ok();
            // Empty once every rank has removed its file; whoever is last removes it.
            fs::remove_dir(&dir).ok();
            return Err(err);
        }
        // Once written, a rank's file stays when a peer fails — rank 0 may still publish the
        // checkpoint from it (a resume sweeps an unpublished directory) — unless rank 0, the
        // only one that publishes, is the rank that failed, without having published.
        let published = self.publish(root, &name, keep);
        if let Err(err) = &published {
            let publisher_failed = self.layout.job_rank == 0 || err.blamed_rank() == Some(0);
            if publisher_failed && !is_published(root, &name) {
                if self.layout.job_rank == 0 {
                    fs::remove_file(dir.join(MANIFEST)).ok();
                }
                fs::remove_file(&own_file).ok();
                fs::remove_dir(&dir).ok();
            }
        }
        published.map(|()| dir)
    }

    /// Writes this rank's file of the checkpoint in `dir` (the first device of a long-context
    /// stage writes the stage's; the first member of a tensor-parallel group the whole tensors
    /// its members' shards make).
    fn write_rank_file(&mut self, dir: &Path) -> Result<(), RuntimeError> {
        fs::create_dir_all(dir).map_err(io_error(dir))?;
        let gathered = match self.checkpoint_gathers() {
            true => Some(self.checkpoint_tensors()?),
            false => None,
        };
        if writes_checkpoint(&self.layout) {
            let tensors: Vec<(String, &HostTensor)> = match &gathered {
                Some(whole) => whole.iter().map(|(name, tensor)| (name.clone(), tensor)).collect(),
                None => self.stages.iter().flat_map(|stage| stage.checkpoint_tensors()).collect(),
            };
            let metadata = HashMap::from([("step".to_string(), self.step.to_string())]);
            save_tensors(&dir.join(rank_file(self.layout.job_rank)), &tensors, metadata)?;
        }
        Ok(())
    }

    /// Once every rank has written its file, rank 0 writes the manifest, moves `latest` to the
    /// checkpoint and removes all but the `keep` newest; every rank waits until it has.
    fn publish(&mut self, root: &Path, name: &str, keep: usize) -> Result<(), RuntimeError> {
        let dir = root.join(name);
        self.world.barrier().during(|| format!("waiting for every rank to write {}", dir.display()))?;
        let files: Vec<String> = self
            .layouts
            .iter()
            .filter(|layout| writes_checkpoint(layout))
            .map(|layout| rank_file(layout.job_rank))
            .collect();
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
            let path = dir.join(MANIFEST);
            let json = serde_json::to_string_pretty(&manifest).expect("a manifest serialises");
            write_atomically(&path, json.as_bytes())?;
            write_atomically(&root.join(LATEST), name.as_bytes())?;
            remove_older(root, self.step, keep)?;
        }
        // Nobody resumes from a checkpoint whose `latest` is not yet written.
        self.world.barrier().during(|| format!("waiting for {} to be published", dir.display()))?;
        Ok(())
    }

    /// Continues from the newest checkpoint under `root`, taken under this plan or another one
    /// of the same model, sequence length and global batch. It only reads `root`: sweeping what
    /// an interrupted checkpoint left is [`sweep_incomplete`]'s, for a run resumed in place.
    pub fn resume(&mut self, root: &Path) -> Result<Manifest, RuntimeError> {
        let (dir, manifest) = read_latest(root)?;
        check_resumable(&dir, &manifest, &self.plan)?;
        let mut tensors = NamedTensors::new();
        for file in &manifest.files {
            let path = dir.join(file);
            verify_file(&path, &manifest)?;
            let wanted = |name: &str| self.stages.iter().any(|stage| stage.restores(name));
            let (file_tensors, metadata) = load_tensors_where(&path, wanted)?;
            check_file_step(&path, &metadata, manifest.step)?;
            tensors.extend(file_tensors);
        }
        for stage in &mut self.stages {
            stage.restore(&tensors, manifest.optimizer_steps)?;
        }
        // The stages took the whole moments: ZeRO-1 takes this rank's share again.
        self.zero = zero_shards(&self.plan, &self.dp, &mut self.stages, self.config.n_layers);
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

/// Checks the file at `path` against the size and SHA-256 the manifest recorded for it.
pub fn verify_file(path: &Path, manifest: &Manifest) -> Result<(), RuntimeError> {
    let name = path.file_name().and_then(|name| name.to_str()).unwrap_or_default();
    matches_recorded(path, manifest.checksums.get(name))
}

/// Whether the file at `path` is a regular file with the `recorded` size and hash; a file of
/// another size is refused before it is read.
fn matches_recorded(path: &Path, recorded: Option<&FileChecksum>) -> Result<(), RuntimeError> {
    let Some(recorded) = recorded else {
        return Err(corrupt(path, "the manifest records no checksum for this file"));
    };
    let (file, len) = open_regular(path)?;
    if len != recorded.bytes {
        return Err(corrupt(
            path,
            format!(
                "it is {len} bytes, the manifest says {}: the file is truncated or from another checkpoint; resume \
                 from an earlier one by pointing `latest` at it",
                recorded.bytes
            ),
        ));
    }
    let found = hash(path, file)?;
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

/// Checks that a tensor file's own record of its step (its `metadata`) is the manifest's.
fn check_file_step(path: &Path, metadata: &HashMap<String, String>, step: u64) -> Result<(), RuntimeError> {
    let found = metadata.get("step").map(String::as_str);
    if found == Some(step.to_string().as_str()) {
        return Ok(());
    }
    Err(corrupt(path, format!("it holds step {}, the manifest step {step}", found.unwrap_or("(none)"))))
}

/// Checks every file of the checkpoint in `dir` — a regular file, its recorded size and hash,
/// the step it holds — before anything acts on it (what `medley train --resume` does before
/// it starts workers, and what a resume in place does before it sweeps).
pub fn verify_checkpoint(dir: &Path, manifest: &Manifest) -> Result<(), RuntimeError> {
    manifest.files.iter().try_for_each(|file| {
        let path = dir.join(file);
        verify_file(&path, manifest)?;
        let (_, metadata) = load_tensors_where(&path, |_| false)?;
        check_file_step(&path, &metadata, manifest.step)
    })
}

/// Removes what a run stopped while writing a checkpoint left in `root`, its own checkpoint
/// directory, which it resumes from at step `latest` (verified first): the step directories
/// after it that are proven unfinished ([`unfinished_later_checkpoints`]: any other later one
/// refuses the sweep, and nothing is removed) and temporary files of atomic writes (a dot, the
/// name being written, a random tail), which would otherwise hold their disk space for good.
pub fn sweep_incomplete(root: &Path, latest: u64) -> Result<(), RuntimeError> {
    for dir in unfinished_later_checkpoints(root, latest)? {
        fs::remove_dir_all(&dir).map_err(io_error(&dir))?;
    }
    for (step, dir) in step_dirs(root)? {
        if step <= latest {
            sweep_temporary(&dir)?;
        }
    }
    sweep_temporary(root)
}

/// The checkpoint directories in `root` after step `latest`, each proven to be a checkpoint
/// whose writing stopped before it was published: a directory (not a link), no manifest (rank
/// 0 writes it after every rank file, before `latest`), nothing but rank files and temporaries.
/// Any other later entry is refused, named: it may be a checkpoint someone wants.
pub fn unfinished_later_checkpoints(root: &Path, latest: u64) -> Result<Vec<PathBuf>, RuntimeError> {
    let mut unfinished = Vec::new();
    for entry in fs::read_dir(root).map_err(io_error(root))? {
        let path = entry.map_err(io_error(root))?.path();
        let step = path.file_name().and_then(|name| name.to_str()).and_then(step_of);
        if step.is_none_or(|step| step <= latest) {
            continue;
        }
        let later = |why: String| {
            corrupt(
                &path,
                format!(
                    "{why}, later than the checkpoint `latest` names (step {latest}); move it out of {} to resume \
                     from step {latest}, or write its name into `latest` to resume from it",
                    root.display()
                ),
            )
        };
        real_dir(&path).map_err(|_| later("it is not a directory of its own".into()))?;
        for inner in fs::read_dir(&path).map_err(io_error(&path))? {
            let inner = inner.map_err(io_error(&path))?;
            let name = inner.file_name().to_string_lossy().into_owned();
            let regular = inner.file_type().map_err(io_error(&inner.path()))?.is_file();
            if name == MANIFEST {
                return Err(later("it holds a manifest: a checkpoint that may be complete".into()));
            }
            if !regular || !(is_rank_file(&name) || is_temporary(&name)) {
                return Err(later(format!("it holds `{name}`, which no checkpoint writes")));
            }
        }
        unfinished.push(path);
    }
    unfinished.sort();
    Ok(unfinished)
}

/// `rank-3.safetensors`.
fn is_rank_file(name: &str) -> bool {
    let rank = name.strip_prefix("rank-").and_then(|rest| rest.strip_suffix(".safetensors"));
    rank.is_some_and(|rank| !rank.is_empty() && rank.bytes().all(|byte| byte.is_ascii_digit()))
}

/// The temporary file of an atomic write of a checkpoint's file: `.rank-3.safetensors.Ab12Cd`,
/// `.manifest.json.Ab12Cd`, `.latest.Ab12Cd`.
fn is_temporary(name: &str) -> bool {
    let Some((written, tail)) = name.strip_prefix('.').and_then(|rest| rest.rsplit_once('.')) else {
        return false;
    };
    !tail.is_empty() && (is_rank_file(written) || written == MANIFEST || written == LATEST)
}

/// The checkpoint directories in `root` (directories themselves, not links), by step.
fn step_dirs(root: &Path) -> Result<Vec<(u64, PathBuf)>, RuntimeError> {
    let mut steps = Vec::new();
    for entry in fs::read_dir(root).map_err(io_error(root))? {
        let entry = entry.map_err(io_error(root))?;
        let step = entry.file_name().to_str().and_then(step_of);
        if let Some(step) = step
            && entry.file_type().map_err(io_error(&entry.path()))?.is_dir()
        {
            steps.push((step, entry.path()));
        }
    }
    steps.sort();
    Ok(steps)
}

/// Removes the temporary files of atomic writes of a checkpoint's files in `dir`.
fn sweep_temporary(dir: &Path) -> Result<(), RuntimeError> {
    for entry in fs::read_dir(dir).map_err(io_error(dir))? {
        let entry = entry.map_err(io_error(dir))?;
        let temporary = entry.file_name().to_str().is_some_and(is_temporary);
        if temporary && entry.file_type().map_err(io_error(&entry.path()))?.is_file() {
            fs::remove_file(entry.path()).map_err(io_error(&entry.path()))?;
        }
    }
    Ok(())
}

/// Whether this rank writes a file of the checkpoint: a long-context stage's devices hold the same
/// weights, and its first device writes them; a tensor-parallel group's first member writes the
/// whole tensors of its members' shards.
fn writes_checkpoint(layout: &RankLayout) -> bool {
    layout.context.as_ref().is_none_or(|seat| seat.device_index == 0)
        && layout.tensor.is_none_or(|seat| seat.member == 0)
}

/// The file rank `rank` writes in a checkpoint directory.
fn rank_file(rank: usize) -> String {
    format!("rank-{rank}.safetensors")
}

/// Whether `latest` in `root` names the checkpoint directory `name`.
fn is_published(root: &Path, name: &str) -> bool {
    read_small(&root.join(LATEST), MAX_POINTER_BYTES).is_ok_and(|pointer| pointer.trim() == name)
}

/// The newest complete checkpoint under `root` and its manifest.
/// Reads only regular files and directories, not links, and checks that the step the manifest
/// says is the step its directory is named for.
pub fn read_latest(root: &Path) -> Result<(PathBuf, Manifest), RuntimeError> {
    let pointer = root.join(LATEST);
    if fs::symlink_metadata(&pointer).is_err() {
        return Err(corrupt(
            root,
            "no complete checkpoint here (no `latest` file): resume from a run directory that training wrote a checkpoint into",
        ));
    }
    let name = read_small(&pointer, MAX_POINTER_BYTES)?;
    let name = name.trim();
    let Some(step) = step_of(name) else {
        return Err(corrupt(
            &pointer,
            format!("`{}` is not a checkpoint directory name (step-NNNNNNNN)", name.escape_debug()),
        ));
    };
    let dir = root.join(name);
    real_dir(&dir)?;
    let path = dir.join(MANIFEST);
    let text = read_small(&path, MAX_MANIFEST_BYTES)?;
    let manifest: Manifest = serde_json::from_str(&text).map_err(|err| corrupt(&path, err.to_string()))?;
    if manifest.format == MANIFEST_FORMAT_WITHOUT_CHECKSUMS {
        return Err(corrupt(
            &path,
            "manifest format 1 records no checksums, so its files cannot be told from corrupt ones; this medley \
             resumes only checkpoints it can verify (format 2): start over, or resume it with the medley that wrote it",
        ));
    }
    if manifest.format != MANIFEST_FORMAT {
        return Err(corrupt(&path, format!("manifest format {} is not {MANIFEST_FORMAT}", manifest.format)));
    }
    if manifest.step != step {
        return Err(corrupt(
            &path,
            format!(
                "the manifest says step {}, its directory `{name}` step {step}: the manifest was changed or moved; \
                 nothing was resumed or deleted",
                manifest.step
            ),
        ));
    }
    if let Some(outside) = manifest.files.iter().find(|file| file.contains(['/', '\\']) || file.starts_with('.')) {
        return Err(corrupt(&path, format!("`{outside}` is not a file of this checkpoint (names only, no paths)")));
    }
    Ok((dir, manifest))
}

/// Once step `latest` is published: keeps the `keep` newest checkpoints up to it and removes
/// the older ones, and the later ones when each is proven unfinished (left by a run that
/// stopped while writing them, since a resume starts from `latest`); otherwise all later ones
/// are kept.
fn remove_older(root: &Path, latest: u64, keep: usize) -> Result<(), RuntimeError> {
    let steps = step_dirs(root)?;
    let kept_from = steps.iter().filter(|(step, _)| *step <= latest).count().saturating_sub(keep.max(1));
    let older = steps.iter().take(kept_from).map(|(_, path)| path.clone());
    let unfinished = unfinished_later_checkpoints(root, latest).unwrap_or_default();
    for path in older.chain(unfinished) {
        fs::remove_dir_all(&path).map_err(io_error(&path))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
