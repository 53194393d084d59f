//! Named `f32` tensors in safetensors files, written atomically.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::{HostTensor, ModelError};

/// Tensors by checkpoint name.
pub type NamedTensors = HashMap<String, HostTensor>;

/// Writes `tensors` and `metadata` to `path` so that a crash at any moment leaves either the old
/// file or the complete new one: a temporary file beside it, fsynced, renamed over, the
/// directory fsynced.
pub fn save_tensors(
    path: &Path,
    tensors: &[(String, &HostTensor)],
    metadata: HashMap<String, String>,
) -> Result<(), ModelError> {
    let bytes: Vec<Vec<u8>> =
        tensors.iter().map(|(_, t)| t.data.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, tensor), data)| {
            let view =
                TensorView::new(Dtype::F32, tensor.shape.clone(), data).map_err(|err| checkpoint_error(path, err))?;
            Ok((name.clone(), view))
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let encoded = safetensors::serialize(views, Some(metadata)).map_err(|err| checkpoint_error(path, err))?;
    write_atomically(path, &encoded)
}

/// Reads every tensor and the metadata of a safetensors file written by [`save_tensors`].
pub fn load_tensors(path: &Path) -> Result<(NamedTensors, HashMap<String, String>), ModelError> {
    let bytes = fs::read(path).map_err(|error| ModelError::Io { path: path.into(), error })?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|err| checkpoint_error(path, err))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let file = SafeTensors::deserialize(&bytes).map_err(|err| checkpoint_error(path, err))?;
    let mut tensors = HashMap::new();
    for (name, view) in file.tensors() {
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
    let io = |error| ModelError::Io { path: path.into(), error };
    let tmp = temporary_path(path);
    let mut file = File::create(&tmp).map_err(io)?;
    file.write_all(bytes).map_err(io)?;
    file.sync_all().map_err(io)?;
    drop(file);
    fs::rename(&tmp, path).map_err(io)?;
    if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
        File::open(dir).and_then(|dir| dir.sync_all()).map_err(io)?;
    }
    Ok(())
}

fn temporary_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp{}", std::process::id()));
    path.with_file_name(name)
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
}
