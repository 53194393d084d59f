//! The fuzzer the parser tests (`tests/parsers.rs`) share: inputs grown from valid seeds by
//! random edits (deleting, inserting, replacing and repeating bytes, splicing in tokens that
//! break parsers: huge and negative numbers, NaN, deep nesting, control characters) and
//! arbitrary bytes, run for a number of cases or, with `MEDLEY_FUZZ_SECONDS`, for that long.
//!
//! proptest catches a panic in the target and shrinks the input that caused it, so a failure
//! names the smallest input found.

use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Tokens spliced into inputs: the values parsers get wrong.
const TOKENS: [&str; 16] = [
    "0",
    "-1",
    "1e308",
    "-1e308",
    "NaN",
    "inf",
    "4294967296",
    "18446744073709551616",
    "99999999999999999999999",
    "0.0000000001",
    "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
    "{\"a\":{\"a\":{\"a\":{\"a\":{}}}}}",
    "\u{1b}[31m",
    "\"",
    "\n[[group]]\n",
    "\u{0}",
];

/// One edit of a seed: where, which kind, a byte or token, and a length.
type Edit = (usize, u8, u8, usize);

fn apply(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut bytes = seed.to_vec();
    for &(at, kind, byte, len) in edits {
        let at = if bytes.is_empty() { 0 } else { at % (bytes.len() + 1) };
        let end = (at + len).min(bytes.len());
        match kind % 5 {
            0 => {
                bytes.drain(at..end);
            }
            1 => bytes.insert(at, byte),
            2 if at < bytes.len() => bytes[at] = byte,
            3 => {
                let chunk = bytes[at..end].to_vec();
                bytes.splice(at..at, chunk.iter().copied().cycle().take(chunk.len() * (byte as usize % 4 + 1)));
            }
            _ => {
                let token = TOKENS[byte as usize % TOKENS.len()].as_bytes();
                bytes.splice(at..end, token.iter().copied());
            }
        }
    }
    bytes
}

/// Inputs from `seeds`: mutated copies of a seed, or arbitrary bytes now and then.
pub fn inputs(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    assert!(!seeds.is_empty(), "a fuzz target needs a seed");
    let n = seeds.len();
    let edits = prop::collection::vec((any::<usize>(), any::<u8>(), any::<u8>(), 1usize..64), 0..12);
    prop_oneof![
        9 => (0..n, edits).prop_map(move |(seed, edits)| apply(&seeds[seed], &edits)),
        1 => prop::collection::vec(any::<u8>(), 0..512),
    ]
}

/// Cases each run of a target makes when no time is given: a short run, as CI's.
const SHORT_RUN_CASES: u32 = 96;

/// Runs `target` on inputs from `seeds` — for `MEDLEY_FUZZ_SECONDS` seconds when set, else for
/// a short run — and fails naming the smallest input that panicked. Returns the cases run.
pub fn fuzz(name: &str, seeds: Vec<Vec<u8>>, target: impl Fn(&[u8])) -> u64 {
    let budget = std::env::var("MEDLEY_FUZZ_SECONDS").ok().and_then(|s| s.parse::<u64>().ok()).map(Duration::from_secs);
    let strategy = inputs(seeds);
    let started = Instant::now();
    let mut cases = 0u64;
    for round in 0u32.. {
        let config = Config { cases: SHORT_RUN_CASES, failure_persistence: None, ..Config::default() };
        let mut runner = TestRunner::new_with_rng(
            config,
            proptest::test_runner::TestRng::from_seed(
                proptest::test_runner::RngAlgorithm::ChaCha,
                &seed_bytes(name, round),
            ),
        );
        if let Err(failure) = runner.run(&strategy, |input| {
            target(&input);
            Ok(())
        }) {
            panic!("fuzzing {name}: {failure}");
        }
        cases += u64::from(SHORT_RUN_CASES);
        if budget.is_none_or(|budget| started.elapsed() >= budget) {
            break;
        }
    }
    eprintln!("{name}: {cases} inputs in {:.1} s, no panic", started.elapsed().as_secs_f64());
    cases
}

/// A different random stream for every target and round, the same on every run.
fn seed_bytes(name: &str, round: u32) -> [u8; 32] {
    let mut seed = [0u8; 32];
    for (idx, byte) in name.bytes().chain(round.to_le_bytes()).enumerate() {
        seed[idx % 32] = seed[idx % 32].wrapping_mul(31).wrapping_add(byte);
    }
    seed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edits_stay_in_bounds_on_any_seed() {
        for seed in [&b""[..], b"a", b"[[group]]\ndevice = \"h100\"\n"] {
            for kind in 0..5 {
                let out = apply(seed, &[(usize::MAX, kind, 200, 63), (0, kind, 7, 1)]);
                assert!(out.len() < seed.len() + 200);
            }
        }
    }

    #[test]
    fn a_panicking_target_is_caught_and_named() {
        let result = std::panic::catch_unwind(|| fuzz("always-panics", vec![b"x".to_vec()], |_| panic!("boom")));
        assert!(result.is_err());
    }
}
