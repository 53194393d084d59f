//! Stage-wise compute against whole-model compute, gradients against finite differences, and
//! checkpoints across plans.

use std::collections::HashMap;
use std::ops::Range;

use medley_model::data::Dataset;
use medley_model::{AdamW, ComputeDevice, HostTensor, MicroBatch, ModelConfig, StageOutput, StageState, stage_compute};

mod common;

use common::SEED;

fn small_config() -> ModelConfig {
    common::config(16)
}

fn stage(config: &ModelConfig, layers: Range<usize>) -> StageState {
    StageState::new(config, layers.clone(), SEED, stage_compute(config, layers, ComputeDevice::Cpu).unwrap()).unwrap()
}

fn batch(config: &ModelConfig, first: u64, count: usize) -> MicroBatch {
    let data = Dataset::shakespeare(config.seq_len, 7).unwrap();
    data.micro_batch(first, count, 1.0 / (count * config.seq_len) as f32)
}

/// Runs forward and backward of one micro-batch through `stages` in order; returns the loss.
fn train_micro_batch(stages: &mut [StageState], micro_batch: u32, batch: &MicroBatch) -> f64 {
    let mut input = None;
    let mut loss = None;
    for stage in stages.iter_mut() {
        match stage.forward(micro_batch, batch, input.take()).unwrap() {
            StageOutput::Activations(activations) => input = Some(activations),
            StageOutput::Loss(value) => loss = Some(value),
        }
    }
    let mut upstream = None;
    for stage in stages.iter_mut().rev() {
        upstream = stage.backward(micro_batch, upstream).unwrap();
    }
    loss.unwrap()
}

fn all_grads(stages: &[StageState]) -> Vec<HostTensor> {
    stages.iter().flat_map(|stage| stage.grads().to_vec()).collect()
}

#[test]
fn stage_wise_backward_is_bitwise_equal_to_whole_model_backward() {
    let config = small_config();
    let mut whole = vec![stage(&config, 0..4)];
    let mut split = vec![stage(&config, 0..1), stage(&config, 1..3), stage(&config, 3..4)];
    for micro_batch in 0..2 {
        let batch = batch(&config, u64::from(micro_batch) * 3, 3);
        let whole_loss = train_micro_batch(&mut whole, micro_batch, &batch);
        let split_loss = train_micro_batch(&mut split, micro_batch, &batch);
        assert_eq!(whole_loss.to_bits(), split_loss.to_bits());
    }
    let (whole_grads, split_grads) = (all_grads(&whole), all_grads(&split));
    assert_eq!(whole_grads.len(), split_grads.len());
    for (idx, (a, b)) in whole_grads.iter().zip(&split_grads).enumerate() {
        let a_bits: Vec<u32> = a.data.iter().map(|x| x.to_bits()).collect();
        let b_bits: Vec<u32> = b.data.iter().map(|x| x.to_bits()).collect();
        assert!(a_bits == b_bits, "parameter {idx} gradients differ");
        assert!(a.data.iter().any(|&g| g != 0.0), "parameter {idx} got no gradient");
    }
}

/// Uneven data-parallel shares: a replica with 3 samples and one with 1, each scaling its loss by
/// the global batch, sum to the gradients of the 4-sample batch. Only the summation order of each
/// reduction differs, so they agree to f32 rounding (relative 1e-5 of the largest gradient).
#[test]
fn uneven_shares_sum_to_the_whole_batch_gradient() {
    let config = small_config();
    let data = Dataset::shakespeare(config.seq_len, 7).unwrap();
    let scale = medley_model::data::loss_scale(4, config.seq_len);
    let mut whole = vec![stage(&config, 0..config.n_layers)];
    let whole_loss = train_micro_batch(&mut whole, 0, &data.micro_batch(0, 4, scale));
    let layout = medley_model::data::step_layout(&[1, 1], 3, 0);
    assert_eq!(layout, vec![vec![0], vec![3]]);
    let mut big = vec![stage(&config, 0..config.n_layers)];
    let mut small = vec![stage(&config, 0..config.n_layers)];
    let loss = train_micro_batch(&mut big, 0, &data.micro_batch(0, 3, scale))
        + train_micro_batch(&mut small, 0, &data.micro_batch(3, 1, scale));
    assert!((loss - whole_loss).abs() < 1e-5 * whole_loss, "{loss} vs {whole_loss}");
    let largest = all_grads(&whole).iter().flat_map(|g| g.data.clone()).fold(0f32, |m, g| m.max(g.abs()));
    for ((w, b), s) in all_grads(&whole).iter().zip(all_grads(&big)).zip(all_grads(&small)) {
        for ((w, b), s) in w.data.iter().zip(&b.data).zip(&s.data) {
            assert!((w - (b + s)).abs() <= 1e-5 * largest, "{w} vs {b} + {s}");
        }
    }
}

#[test]
fn gradients_match_finite_differences() {
    let config = small_config();
    let batch = batch(&config, 0, 2);
    let mut model = vec![stage(&config, 0..config.n_layers)];
    train_micro_batch(&mut model, 0, &batch);
    let grads = model[0].grads().to_vec();
    let params = model[0].params().to_vec();
    // f32 central differences: a step of 1e-2 balances truncation against rounding.
    let h = 1e-2f32;
    for (param_idx, element) in [(0, 5 * 32 + 3), (2, 17), (5, 40), (9, 100), (params.len() - 1, 77)] {
        let loss_at = |delta: f32| {
            let mut shifted = params.clone();
            shifted[param_idx].data[element] += delta;
            let mut compute = stage_compute(&config, 0..config.n_layers, ComputeDevice::Cpu).unwrap();
            medley_model::StageCompute::load_parameters(&mut compute, &shifted).unwrap();
            match medley_model::StageCompute::forward(&mut compute, 0, &batch, None).unwrap() {
                StageOutput::Loss(loss) => loss,
                StageOutput::Activations(_) => unreachable!(),
            }
        };
        let numeric = (loss_at(h) - loss_at(-h)) / (2.0 * f64::from(h));
        let analytic = f64::from(grads[param_idx].data[element]);
        let tolerance = 2e-3 + 0.05 * analytic.abs();
        assert!(
            (numeric - analytic).abs() < tolerance,
            "param {param_idx}[{element}]: numeric {numeric}, analytic {analytic}"
        );
    }
}

/// On the CPU a stage computes blocks of a micro-batch's samples on every thread of its pool:
/// whatever the thread count (more threads than samples too), the loss and every gradient match
/// one thread's up to float summation order, through a pipeline whose middle stage takes
/// activations and returns their gradient.
#[test]
fn samples_split_over_threads_match_one_thread() {
    let config = small_config();
    let batch = batch(&config, 3, 5);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let mut stages = vec![stage(&config, 0..1), stage(&config, 1..3), stage(&config, 3..4)];
            (train_micro_batch(&mut stages, 0, &batch), all_grads(&stages))
        })
    };
    let (loss, grads) = run(1);
    for threads in [2, 3, 7] {
        let (split_loss, split_grads) = run(threads);
        assert!((split_loss - loss).abs() <= 1e-6 * loss.abs(), "{threads} threads: loss {split_loss} vs {loss}");
        for (a, b) in split_grads.iter().zip(&grads) {
            assert_eq!(a.shape, b.shape);
            let scale = b.data.iter().fold(0f32, |m, g| m.max(g.abs()));
            let worst = a.data.iter().zip(&b.data).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                worst <= 1e-5 * scale.max(1e-12),
                "{threads} threads: a gradient differs by {worst} (scale {scale})"
            );
        }
    }
}

#[test]
fn attention_is_causal() {
    let config = small_config();
    let mut first = stage_compute(&config, 0..2, ComputeDevice::Cpu).unwrap();
    let specs = medley_model::params::stage_params(&config, 0..2);
    let params: Vec<HostTensor> = specs.iter().map(|spec| spec.initial_value(SEED)).collect();
    medley_model::StageCompute::load_parameters(&mut first, &params).unwrap();
    let mut batch = batch(&config, 0, 1);
    let mut hidden =
        |batch: &MicroBatch, mb| match medley_model::StageCompute::forward(&mut first, mb, batch, None).unwrap() {
            StageOutput::Activations(activations) => activations.data,
            StageOutput::Loss(_) => unreachable!(),
        };
    let before = hidden(&batch, 0);
    batch.tokens[10] = (batch.tokens[10] + 1) % 256;
    let after = hidden(&batch, 1);
    let width = config.hidden;
    assert_eq!(before[..10 * width], after[..10 * width], "positions before the change must not see it");
    assert_ne!(before[10 * width..11 * width], after[10 * width..11 * width]);
}

#[test]
fn training_lowers_the_loss() {
    let config = small_config();
    let mut model = vec![stage(&config, 0..config.n_layers)];
    let adamw = AdamW::default();
    let batch = batch(&config, 0, 4);
    let first = train_micro_batch(&mut model, 0, &batch);
    model[0].optimizer_step(&adamw).unwrap();
    let mut last = first;
    for step in 1..15 {
        last = train_micro_batch(&mut model, step, &batch);
        model[0].optimizer_step(&adamw).unwrap();
    }
    assert!((first - (256f64).ln()).abs() < 0.1, "initial loss {first} should be near ln(256)");
    assert!(last < first - 1.0, "loss went from {first} to {last}");
}

#[test]
fn a_checkpoint_restores_under_another_split() {
    let config = small_config();
    let adamw = AdamW::default();
    let mut whole = vec![stage(&config, 0..4)];
    train_micro_batch(&mut whole, 0, &batch(&config, 0, 2));
    whole[0].optimizer_step(&adamw).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stage0.safetensors");
    medley_model::save_tensors(&path, &whole[0].checkpoint_tensors(), HashMap::new()).unwrap();
    let (tensors, _) = medley_model::load_tensors(&path).unwrap();
    let mut split = vec![stage(&config, 0..3), stage(&config, 3..4)];
    for part in &mut split {
        part.restore(&tensors, whole[0].optimizer_step_count()).unwrap();
    }
    let next = batch(&config, 10, 2);
    let whole_loss = train_micro_batch(&mut whole, 1, &next);
    let split_loss = train_micro_batch(&mut split, 1, &next);
    assert_eq!(whole_loss.to_bits(), split_loss.to_bits());
    let mut incomplete = tensors.clone();
    incomplete.remove("layers.3.wq");
    let err = split[1].restore(&incomplete, 1).err().unwrap().to_string();
    assert!(err.contains("layers.3.wq"), "{err}");
}
