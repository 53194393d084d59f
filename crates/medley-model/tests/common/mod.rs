//! What the multi-device stage tests share: the model they split, in-memory collectives, and
//! training stages on micro-batches.

#![allow(dead_code)] // each test binary uses its own part

use std::sync::{Arc, Barrier, Mutex};

use medley_model::data::Dataset;
use medley_model::{HostTensor, MicroBatch, ModelConfig, StageOutput, StageState};

pub const SEED: u64 = 42;

pub fn config(seq_len: usize) -> ModelConfig {
    ModelConfig {
        n_layers: 4,
        hidden: 32,
        n_heads: 4,
        n_kv_heads: 2,
        ffn_hidden: 64,
        vocab: 256,
        seq_len,
        rope_theta: 10_000.0,
        rope_scaling: None,
        norm_eps: 1e-5,
    }
}

/// The members of one in-memory collective: each posts its input, then reads everyone's.
pub struct Board {
    slots: Mutex<Vec<Vec<f32>>>,
    barrier: Barrier,
}

#[derive(Clone)]
pub struct Seat {
    board: Arc<Board>,
    pub rank: usize,
}

impl Seat {
    pub fn table(size: usize) -> Vec<Seat> {
        let board = Arc::new(Board { slots: Mutex::new(vec![Vec::new(); size]), barrier: Barrier::new(size) });
        (0..size).map(|rank| Seat { board: board.clone(), rank }).collect()
    }

    pub fn exchange(&self, input: &[f32]) -> Vec<Vec<f32>> {
        self.board.slots.lock().unwrap()[self.rank] = input.to_vec();
        self.board.barrier.wait();
        let all = self.board.slots.lock().unwrap().clone();
        self.board.barrier.wait();
        all
    }
}

pub fn batch(config: &ModelConfig, first: u64, count: usize) -> MicroBatch {
    let data = Dataset::shakespeare(config.seq_len, 7).unwrap();
    data.micro_batch(first, count, 1.0 / (4 * config.seq_len) as f32)
}

/// Forward and backward of `batches` through `stages` in order; the summed loss.
pub fn train(stages: &mut [StageState], batches: &[MicroBatch]) -> f64 {
    let mut total = 0.0;
    for (micro_batch, batch) in batches.iter().enumerate() {
        let mut input = None;
        for stage in stages.iter_mut() {
            match stage.forward(micro_batch as u32, batch, input.take()).unwrap() {
                StageOutput::Activations(activations) => input = Some(activations),
                StageOutput::Loss(loss) => total += loss,
            }
        }
        let mut upstream = None;
        for stage in stages.iter_mut().rev() {
            upstream = stage.backward(micro_batch as u32, upstream).unwrap();
        }
    }
    total
}

pub fn grads(stages: &[StageState]) -> Vec<HostTensor> {
    stages.iter().flat_map(|stage| stage.grads().to_vec()).collect()
}
