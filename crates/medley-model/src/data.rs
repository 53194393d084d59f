//! Text data: a byte-level tokenizer, the corpus shipped with medley, and samples addressed by
//! index so every plan sees the same global batches in the same order.

use crate::{MicroBatch, ModelError};

/// *Hamlet* and *Macbeth*, public domain; see `data/SOURCE.md`.
pub const SHAKESPEARE: &[u8] = include_bytes!("../data/shakespeare.txt");

/// Tokens the byte-level tokenizer gives: one per byte value, so a trained model's vocabulary
/// holds at least these.
pub const BYTE_TOKENS: u32 = 256;

pub fn encode(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Decodes tokens back to text, replacing invalid UTF-8 and out-of-range tokens.
pub fn decode(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens.iter().map(|&t| u8::try_from(t).unwrap_or(b'?')).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Fixed-length windows of a token stream. Sample `i` is the window at a seeded pseudo-random
/// offset that depends only on `i` and the seed: any process computes any sample on its own.
#[derive(Clone, Debug)]
pub struct Dataset {
    tokens: Vec<u32>,
    seq_len: usize,
    seed: u64,
}

impl Dataset {
    pub fn new(tokens: Vec<u32>, seq_len: usize, seed: u64) -> Result<Self, ModelError> {
        if tokens.len() <= seq_len + 1 {
            return Err(ModelError::Data(format!("{} tokens cannot fill one sample of {} + 1", tokens.len(), seq_len)));
        }
        Ok(Dataset { tokens, seq_len, seed })
    }

    /// The shipped corpus, byte-tokenized.
    pub fn shakespeare(seq_len: usize, seed: u64) -> Result<Self, ModelError> {
        Dataset::new(SHAKESPEARE.iter().map(|&b| u32::from(b)).collect(), seq_len, seed)
    }

    /// Sample `index`: `seq_len` input tokens and the `seq_len` tokens that follow each.
    pub fn sample(&self, index: u64) -> (&[u32], &[u32]) {
        let n_starts = (self.tokens.len() - self.seq_len - 1) as u64;
        let start = (splitmix64(self.seed ^ splitmix64(index)) % n_starts) as usize;
        let window = &self.tokens[start..start + self.seq_len + 1];
        (&window[..self.seq_len], &window[1..])
    }

    /// Samples `first..first + count` as one micro-batch whose losses are scaled by `loss_scale`.
    pub fn micro_batch(&self, first: u64, count: usize, loss_scale: f32) -> MicroBatch {
        let mut tokens = Vec::with_capacity(count * self.seq_len);
        let mut targets = Vec::with_capacity(count * self.seq_len);
        for index in first..first + count as u64 {
            let (input, target) = self.sample(index);
            tokens.extend_from_slice(input);
            targets.extend_from_slice(target);
        }
        MicroBatch { batch: count, seq: self.seq_len, tokens, targets, loss_scale }
    }
}

/// Where each micro-batch of a step starts: replica r's micro-batch j holds samples
/// `layout[r][j]..layout[r][j] + micro_batch`. Replicas take consecutive slices of the step's
/// global batch in replica order, `micro_batches[r] * micro_batch` samples each, so any plan
/// over the same global batch trains on the same samples.
pub fn step_layout(micro_batches: &[u32], micro_batch: u32, step: u64) -> Vec<Vec<u64>> {
    let micro_batch = u64::from(micro_batch);
    let global_batch: u64 = micro_batches.iter().map(|&n| u64::from(n) * micro_batch).sum();
    let mut replica_start = step * global_batch;
    micro_batches
        .iter()
        .map(|&n| {
            let starts = (0..u64::from(n)).map(|j| replica_start + j * micro_batch).collect();
            replica_start += u64::from(n) * micro_batch;
            starts
        })
        .collect()
}

/// The loss scale that makes summed micro-batch losses the mean over the global batch's tokens,
/// whatever the replicas' shares: gradients summed across replicas are then sample-weighted.
pub fn loss_scale(global_batch: u64, seq_len: usize) -> f32 {
    (1.0 / (global_batch as f64 * seq_len as f64)) as f32
}

/// A bijective 64-bit mixer (Steele et al.'s SplitMix64 finaliser).
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_next_token_pairs_from_the_corpus() {
        let data = Dataset::shakespeare(64, 1).unwrap();
        for index in [0, 1, 1000] {
            let (input, target) = data.sample(index);
            assert_eq!(input.len(), 64);
            assert_eq!(input[1..], target[..63]);
        }
        assert_ne!(data.sample(0), data.sample(1));
        assert_eq!(decode(&encode("To be, or not")), "To be, or not");
    }

    proptest::proptest! {
        #[test]
        fn any_split_tiles_the_step_global_batch(
            micro_batches in proptest::collection::vec(1u32..6, 1..6),
            micro_batch in 1u32..5,
            step in 0u64..100,
        ) {
            let layout = step_layout(&micro_batches, micro_batch, step);
            let global: u64 = micro_batches.iter().map(|&n| u64::from(n * micro_batch)).sum();
            let mut samples: Vec<u64> = layout
                .iter()
                .flatten()
                .flat_map(|&first| first..first + u64::from(micro_batch))
                .collect();
            samples.sort_unstable();
            let expected: Vec<u64> = (step * global..(step + 1) * global).collect();
            proptest::prop_assert_eq!(samples, expected);
            for (replica, &n) in layout.iter().zip(&micro_batches) {
                proptest::prop_assert_eq!(replica.len(), n as usize);
            }
        }
    }

    #[test]
    fn a_micro_batch_is_its_samples_in_order() {
        let data = Dataset::shakespeare(16, 3).unwrap();
        let batch = data.micro_batch(10, 3, 0.5);
        assert_eq!(batch.tokens.len(), 48);
        assert_eq!(&batch.tokens[16..32], data.sample(11).0);
        assert_eq!(&batch.targets[32..], data.sample(12).1);
    }
}
