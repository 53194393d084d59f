//! What travels between ranks besides payload bytes: frame headers and connection handshakes.

use std::io::{Read, Write};

use crate::CommError;

const FRAME_MAGIC: u32 = 0x4d44_4c46; // "MDLF"
const HELLO_MAGIC: u32 = 0x4d44_4c48; // "MDLH"
/// The longest token or namespace a handshake carries: more is malformed, not an allocation.
pub(crate) const MAX_HELLO_FIELD: usize = 4096;

/// Every message's header: which operation it belongs to and how long it is. A receiver
/// compares it with what its own step expects before it touches a payload byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// A hash of the operation, element type, counts and algorithm (see [`fingerprint`]).
    pub fingerprint: u64,
    /// Which call of the communicator this is (collectives and point-to-point counted apart).
    pub seq: u64,
    /// Payload bytes.
    pub len: u64,
}

impl FrameHeader {
    pub const BYTES: usize = 32;

    pub fn encode(&self) -> [u8; FrameHeader::BYTES] {
        let mut out = [0u8; FrameHeader::BYTES];
        out[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        out[8..16].copy_from_slice(&self.fingerprint.to_le_bytes());
        out[16..24].copy_from_slice(&self.seq.to_le_bytes());
        out[24..32].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Decodes a header from `rank` and checks it against `expected`.
    pub fn check(bytes: &[u8; FrameHeader::BYTES], rank: usize, expected: FrameHeader) -> Result<(), CommError> {
        let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        if bytes[0..4] != FRAME_MAGIC.to_le_bytes() {
            return Err(CommError::Malformed { rank, reason: format!("bad frame magic {:02x?}", &bytes[0..4]) });
        }
        expected.matches(rank, FrameHeader { fingerprint: word(8), seq: word(16), len: word(24) })
    }

    /// Whether `got` (from `rank`) is the frame this header describes.
    pub fn matches(&self, rank: usize, got: FrameHeader) -> Result<(), CommError> {
        if got == *self {
            return Ok(());
        }
        Err(CommError::Mismatch {
            rank,
            expected_fingerprint: self.fingerprint,
            expected_seq: self.seq,
            expected_bytes: self.len,
            got_fingerprint: got.fingerprint,
            got_seq: got.seq,
            got_bytes: got.len,
        })
    }
}

/// FNV-1a over a description of the call: every rank of a matching call computes the same value.
pub fn fingerprint(description: &str) -> u64 {
    description
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3))
}

/// The first message on every connection: the job token, what the connection is for and who
/// opens it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub token: String,
    pub purpose: String,
    pub rank: u64,
    pub stream: u64,
}

impl Hello {
    pub fn write(&self, out: &mut impl Write) -> std::io::Result<()> {
        let mut bytes = HELLO_MAGIC.to_le_bytes().to_vec();
        for field in [self.token.as_bytes(), self.purpose.as_bytes()] {
            bytes.extend((field.len() as u64).to_le_bytes());
            bytes.extend(field);
        }
        bytes.extend(self.rank.to_le_bytes());
        bytes.extend(self.stream.to_le_bytes());
        out.write_all(&bytes)
    }

    /// Reads a hello; anything else (wrong magic, oversized fields, not UTF-8) is an error.
    pub fn read(input: &mut impl Read) -> Result<Hello, String> {
        let mut magic = [0u8; 4];
        input.read_exact(&mut magic).map_err(|e| e.to_string())?;
        if magic != HELLO_MAGIC.to_le_bytes() {
            return Err("not a medley connection".into());
        }
        let mut field = || -> Result<String, String> {
            let len = read_u64(input)? as usize;
            if len > MAX_HELLO_FIELD {
                return Err(format!("field of {len} bytes exceeds {MAX_HELLO_FIELD}"));
            }
            let mut bytes = vec![0u8; len];
            input.read_exact(&mut bytes).map_err(|e| e.to_string())?;
            String::from_utf8(bytes).map_err(|_| "field is not UTF-8".to_string())
        };
        let (token, purpose) = (field()?, field()?);
        Ok(Hello { token, purpose, rank: read_u64(input)?, stream: read_u64(input)? })
    }
}

pub(crate) fn read_u64(input: &mut impl Read) -> Result<u64, String> {
    let mut bytes = [0u8; 8];
    input.read_exact(&mut bytes).map_err(|e| e.to_string())?;
    Ok(u64::from_le_bytes(bytes))
}

/// Compares tokens in time independent of where they differ.
pub(crate) fn same_token(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_mismatches_name_both_sides() {
        let header = FrameHeader { fingerprint: 7, seq: 3, len: 64 };
        assert_eq!(FrameHeader::check(&header.encode(), 2, header), Ok(()));
        let other = FrameHeader { len: 65, ..header };
        let err = FrameHeader::check(&other.encode(), 2, header).unwrap_err();
        assert!(matches!(err, CommError::Mismatch { rank: 2, expected_bytes: 64, got_bytes: 65, .. }), "{err}");
        let mut garbage = header.encode();
        garbage[0] = 0;
        assert!(matches!(FrameHeader::check(&garbage, 1, header), Err(CommError::Malformed { rank: 1, .. })));
    }

    #[test]
    fn oversized_hello_fields_are_refused_before_allocating() {
        let mut bytes = HELLO_MAGIC.to_le_bytes().to_vec();
        bytes.extend(u64::MAX.to_le_bytes());
        let err = Hello::read(&mut bytes.as_slice()).unwrap_err();
        assert!(err.contains("exceeds"), "{err}");
        let hello = Hello { token: "t".into(), purpose: "p".into(), rank: 3, stream: 1 };
        let mut wire = Vec::new();
        hello.write(&mut wire).unwrap();
        assert_eq!(Hello::read(&mut wire.as_slice()), Ok(hello));
    }
}
