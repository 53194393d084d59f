use medley_comm::CommError;

/// Why a GPU operation failed: a library that is not there, a call the library refused, or the
/// communicator under a bootstrap or a bridge.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(
        "{what} is not installed here: none of {tried} could be loaded ({reason}); install it or add its folder to LD_LIBRARY_PATH"
    )]
    LibraryMissing { what: &'static str, tried: String, reason: String },
    #[error("{library} has no symbol `{symbol}`: it is older than medley needs ({reason})")]
    SymbolMissing { library: &'static str, symbol: &'static str, reason: String },
    #[error("{call} failed with code {code}: {message}")]
    Call { call: &'static str, code: i32, message: String },
    #[error("there is no {vendor} GPU {index}: this machine has {count}")]
    NoDevice { vendor: crate::Vendor, index: usize, count: usize },
    #[error("{what}: bytes {offset}..{end} are outside the buffer of {len} bytes")]
    OutOfRange { what: &'static str, offset: usize, end: usize, len: usize },
    #[error("{what}: {len} bytes are not whole 4-byte floats")]
    NotFloats { what: &'static str, len: usize },
    #[error("bootstrap: the unique id has {got} bytes, NCCL's has {expected}")]
    BadUniqueId { expected: usize, got: usize },
    #[error(transparent)]
    Comm(#[from] CommError),
}
