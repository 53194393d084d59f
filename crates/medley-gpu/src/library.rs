//! Finding a vendor library at run time and reading its entry points into a typed table.

use libloading::Library;

use crate::GpuError;

/// Opens the first of `names` the dynamic loader finds.
pub(crate) fn open_first(what: &'static str, names: &[&str]) -> Result<Library, GpuError> {
    let mut reasons = Vec::new();
    for name in names {
        // SAFETY: loading runs the library's initialisers; these are the vendors' own runtime
        // libraries, whose initialisers only set up their own state.
        match unsafe { Library::new(name) } {
            Ok(library) => return Ok(library),
            Err(err) => reasons.push(err.to_string()),
        }
    }
    Err(GpuError::LibraryMissing { what, tried: names.join(", "), reason: reasons.last().cloned().unwrap_or_default() })
}

/// A failed call's error: `status` with the library's text for it, from `describe`, a C
/// function that returns a static NUL-terminated string (or null) for any code, as
/// `hipGetErrorString` and `ncclGetErrorString` do.
pub(crate) fn call_failed(
    call: &'static str,
    status: i32,
    describe: unsafe extern "C" fn(i32) -> *const std::ffi::c_char,
) -> Result<(), GpuError> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: per this function's contract, `describe` returns null or a pointer to a static
    // NUL-terminated string.
    let message = unsafe {
        let text = describe(status);
        if text.is_null() {
            "unknown error".into()
        } else {
            std::ffi::CStr::from_ptr(text).to_string_lossy().into_owned()
        }
    };
    Err(GpuError::Call { call, code: status, message })
}

/// A struct of C entry points read from one library, which it keeps loaded for as long as the
/// pointers live: `api!(Name from "what" { field = "symbol": fn(args) -> ret; ... })`.
macro_rules! api {
    ($name:ident from $what:literal { $($field:ident = $symbol:literal : fn($($arg:ty),*) -> $ret:ty;)* }) => {
        struct $name {
            $($field: unsafe extern "C" fn($($arg),*) -> $ret,)*
            _library: libloading::Library,
        }

        impl $name {
            fn load(library: libloading::Library) -> Result<Self, $crate::GpuError> {
                Ok($name {
                    $($field: {
                        // SAFETY: the symbol's C signature is the one declared here (from the
                        // vendor's header), and the pointer is only used while `_library`, moved
                        // into the same struct below, keeps the library loaded.
                        let symbol = unsafe {
                            library.get::<unsafe extern "C" fn($($arg),*) -> $ret>(concat!($symbol, "\0").as_bytes())
                        };
                        *symbol.map_err(|err| $crate::GpuError::SymbolMissing {
                            library: $what,
                            symbol: $symbol,
                            reason: err.to_string(),
                        })?
                    },)*
                    _library: library,
                })
            }
        }
    };
}

pub(crate) use api;
