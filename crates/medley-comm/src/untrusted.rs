//! Entry points for the fuzz tests (`crates/medley-fuzz`) into the decoders a stranger on a
//! socket reaches. Not an API.

use crate::wire::{FrameHeader, Hello};

/// Decodes `bytes` as everything a stranger on a socket could send — a greeting, a store
/// request's fields, a frame header — for the fuzz tests (`crates/medley-fuzz`): each decoder
/// returns an error or a value, never panics or allocates more than its caps. Not an API.
#[doc(hidden)]
pub fn decode_untrusted(bytes: &[u8]) {
    let _ = Hello::read(&mut &bytes[..]);
    let _ = crate::store::read_request(&mut &bytes[..]);
    if let Some(header) = bytes.get(..FrameHeader::BYTES) {
        let header: &[u8; FrameHeader::BYTES] = header.try_into().expect("32 bytes");
        let _ = FrameHeader::check(header, 0, FrameHeader { fingerprint: 0, seq: 0, len: 0 });
    }
}

/// A well-formed greeting, as a seed for the fuzz tests to mutate. Not an API.
#[doc(hidden)]
pub fn greeting_bytes(token: &str, purpose: &str, rank: u64) -> Vec<u8> {
    let mut bytes = Vec::new();
    Hello { token: token.into(), purpose: purpose.into(), rank, stream: 0 }
        .write(&mut bytes)
        .expect("writing to a Vec");
    bytes
}
