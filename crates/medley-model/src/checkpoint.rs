//! Named `f32` tensors in safetensors files, written atomically.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::{self, File};
use std::path::Path;

use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors, View};

use crate::{HostTensor, ModelError};

/// Tensors by checkpoint name.
pub type NamedTensors = HashMap<String, HostTensor>;

/// Writes `tensors` and `metadata` to `path` so that a crash at any moment leaves either the old
/// file or the complete new one: a temporary file beside it, fsynced, renamed over, the
/// directory fsynced. The tensors stream into the file from where they are, so a checkpoint
/// costs no second copy of the state in memory.
pub fn save_tensors(
    path: &Path,
    tensors: &[(String, &HostTensor)],
    metadata: HashMap<String, String>,
) -> Result<(), ModelError> {
    let views = tensors.iter().map(|(name, tensor)| (name.as_str(), F32View(tensor)));
    publish_atomically(path, |tmp| {
        safetensors::serialize_to_file(views, Some(metadata), tmp).map_err(|err| checkpoint_error(path, err))
    })
}

/// A host tensor as safetensors serialises it: little-endian `f32`s.
struct F32View<'t>(&'t HostTensor);

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.0.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        if cfg!(target_endian = "little") {
            Cow::Borrowed(bytemuck::cast_slice(&self.0.data))
        } else {
            Cow::Owned(self.0.data.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
    }

    fn data_len(&self) -> usize {
        4 * self.0.data.len()
    }
}

/// Reads every tensor and the metadata of a safetensors file written by [`save_tensors`].
pub fn load_tensors(path: &Path) -> Result<(NamedTensors, HashMap<String, String>), ModelError> {
    load_tensors_where(path, |_| true)
}

/// Reads the tensors whose names `wanted` accepts, and the metadata, of a safetensors file
/// written by [`save_tensors`]; the file is mapped, so only the wanted tensors take memory.
pub fn load_tensors_where(
    path: &Path,
    wanted: impl Fn(&str) -> bool,
) -> Result<(NamedTensors, HashMap<String, String>), ModelError> {
    let file = File::open(path).map_err(|error| ModelError::Io { path: path.into(), error })?;
    // SAFETY: checkpoint files are written once, beside their final name, and renamed into
    // place complete; nothing writes to a published file while it is mapped here.
    let bytes = unsafe { Mmap::map(&file) }.map_err(|error| ModelError::Io { path: path.into(), error })?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|err| checkpoint_error(path, err))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let file = SafeTensors::deserialize(&bytes).map_err(|err| checkpoint_error(path, err))?;
    let mut tensors = HashMap::new();
    for (name, view) in file.tensors().into_iter().filter(|(name, _)| wanted(name)) {
        if view.dtype() != Dtype::F32 {
            return Err(checkpoint_error(path, format!("tensor `{name}` is {:?}, expected F32", view.dtype())));
        }
        let data = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        tensors.insert(name, HostTensor::new(view.shape().to_vec(), data));
    }
    Ok((tensors, metadata))
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, fsynced, renamed over, the
/// directory fsynced.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    publish_atomically(path, |tmp| fs::write(tmp, bytes).map_err(|error| ModelError::Io { path: path.into(), error }))
}

/// Has `write` fill a temporary file beside `path` (tempfile's: a fresh name, removed again if
/// anything fails before it is published), then fsyncs it, renames it over `path` and fsyncs
/// the directory.
fn publish_atomically(path: &Path, write: impl FnOnce(&Path) -> Result<(), ModelError>) -> Result<(), ModelError> {
    let io = |error| ModelError::Io { path: path.into(), error };
    let dir = path.parent().filter(|dir| !dir.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = tempfile::Builder::new().prefix(&format!(".{name}.")).tempfile_in(dir).map_err(io)?;
    write(tmp.path())?;
    tmp.as_file().sync_all().map_err(io)?;
    tmp.persist(path).map_err(|err| io(err.error))?;
    File::open(dir).and_then(|dir| dir.sync_all()).map_err(io)?;
    Ok(())
}

fn checkpoint_error(path: &Path, err: impl std::fmt::Display) -> ModelError {
    ModelError::Checkpoint { path: path.into(), reason: err.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_tensors_and_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stage.safetensors");
        let a = HostTensor::new(vec![2, 2], vec![1.0, -2.5, 3.25, f32::MIN_POSITIVE]);
        let b = HostTensor::new(vec![3], vec![0.0, 1e-30, 7.0]);
        let metadata = HashMap::from([("step".to_string(), "12".to_string())]);
        save_tensors(&path, &[("a".into(), &a), ("b".into(), &b)], metadata.clone()).unwrap();
        let (tensors, read_metadata) = load_tensors(&path).unwrap();
        assert_eq!(tensors["a"], a);
        assert_eq!(tensors["b"], b);
        assert_eq!(read_metadata, metadata);
    }

    #[test]
    fn a_truncated_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stage.safetensors");
        let a = HostTensor::new(vec![64], vec![1.0; 64]);
        save_tensors(&path, &[("a".into(), &a)], HashMap::new()).unwrap();
        let bytes = fs::read(&path).unwrap();
        fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
        let err = load_tensors(&path).unwrap_err().to_string();
        assert!(err.contains("stage.safetensors"), "{err}");
    }

    #[test]
    fn a_failed_write_publishes_nothing_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("latest");
        let failed = publish_atomically(&path, |tmp| {
            fs::write(tmp, b"half").unwrap();
            Err(ModelError::Checkpoint { path: tmp.into(), reason: "disk full".into() })
        });
        assert!(failed.is_err());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
        write_atomically(&path, b"whole").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"whole");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
