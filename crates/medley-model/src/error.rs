use std::path::PathBuf;

/// What can go wrong building, running or checkpointing a stage.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model `{model}` cannot be trained by medley's runtime: {reason}")]
    Unsupported { model: String, reason: String },
    #[error("{what}: expected shape {expected:?}, got {got:?}")]
    Shape { what: String, expected: Vec<usize>, got: Vec<usize> },
    #[error("data: {0}")]
    Data(String),
    #[error("the checkpoint has no tensor `{name}`: it was taken from another model")]
    MissingTensor { name: String },
    #[error("micro-batch {micro_batch}: {reason}")]
    MicroBatch { micro_batch: u32, reason: String },
    #[error("context parallelism: {0}")]
    Context(String),
    #[error("tensor parallelism: {0}")]
    TensorParallel(String),
    #[error("{what}: {source}")]
    Collective { what: String, source: Box<dyn std::error::Error + Send + Sync> },
    #[error(
        "this medley was built without {device}'s backend: rebuild with `cargo build --release --features {}`",
        device.feature().unwrap_or("cpu")
    )]
    NotBuilt { device: crate::ComputeDevice },
    #[error("tensor library: {0}")]
    Compute(String),
    #[error("{}: {reason}", path.display())]
    Checkpoint { path: PathBuf, reason: String },
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
}
