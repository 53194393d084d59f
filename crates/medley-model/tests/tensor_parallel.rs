//! Tensor parallelism with sequence parallelism against one process: a stage split over a group
//! of devices (each a thread here, exchanging through memory) gives the whole model's loss on
//! every member and, its members' shards placed together and replicated parameters' summed, its
//! gradients — at two and four devices (more than the KV heads), with uneven sequence runs and
//! FFN columns, and for stages in a pipeline.

mod common;

use std::ops::Range;

use common::{SEED, Seat, batch, config, grads, train};
use medley_model::tensor_parallel::{Combine, TensorCollectives, TensorSeat};
use medley_model::{
    ComputeDevice, HostTensor, ModelConfig, ModelError, ParamSpec, StageState, stage_compute, tensor_parallel_compute,
};

struct InMemory(Seat);

impl TensorCollectives for InMemory {
    fn all_gather(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError> {
        let all = self.0.exchange(input);
        assert!(all.iter().zip(counts).all(|(part, &count)| part.len() == count));
        Ok(all.concat())
    }

    fn reduce_scatter(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError> {
        let all = self.0.exchange(input);
        let start: usize = counts[..self.0.rank].iter().sum();
        Ok((start..start + counts[self.0.rank]).map(|idx| all.iter().map(|sent| sent[idx]).sum()).collect())
    }

    fn all_reduce(&mut self, values: &mut [f32], combine: Combine) -> Result<(), ModelError> {
        let all = self.0.exchange(values);
        for (idx, value) in values.iter_mut().enumerate() {
            let column = all.iter().map(|sent| sent[idx]);
            *value = match combine {
                Combine::Sum => column.sum(),
                Combine::Max => column.fold(f32::NEG_INFINITY, f32::max),
            };
        }
        Ok(())
    }
}

/// Every member of a group of `size` trains the stages ending at `stage_ends` on its own
/// thread; each member's loss, and the gradients of the whole parameters.
fn split_run(config: &ModelConfig, size: usize, stage_ends: &[usize]) -> (Vec<f64>, Vec<HostTensor>) {
    let cuts: Vec<Range<usize>> =
        stage_ends.iter().scan(0, |start, &end| Some(std::mem::replace(start, end)..end)).collect();
    let batches = [batch(config, 0, 2), batch(config, 5, 2)];
    let seats = Seat::table(size);
    let handles: Vec<_> = (0..size)
        .map(|member| {
            let (config, cuts, batches, seat) = (config.clone(), cuts.clone(), batches.to_vec(), seats[member].clone());
            std::thread::spawn(move || {
                let tp = TensorSeat::new(&config, member, size).unwrap();
                let mut stages: Vec<StageState> = cuts
                    .iter()
                    .map(|layers| {
                        let collectives = Box::new(InMemory(seat.clone()));
                        let compute =
                            tensor_parallel_compute(&config, layers.clone(), tp, collectives, ComputeDevice::Cpu)
                                .unwrap();
                        StageState::with_specs(tp.stage_params(&config, layers.clone()), SEED, compute).unwrap()
                    })
                    .collect();
                let loss = train(&mut stages, &batches);
                let specs: Vec<ParamSpec> = stages.iter().flat_map(|stage| stage.specs().to_vec()).collect();
                (loss, specs, grads(&stages))
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|handle| handle.join().unwrap()).collect();
    let mut whole: Vec<HostTensor> =
        results[0].1.iter().map(|spec| HostTensor::zeros(spec.full_shape().to_vec())).collect();
    for (_, specs, shard_grads) in &results {
        for ((spec, grad), sum) in specs.iter().zip(shard_grads).zip(&mut whole) {
            let mut placed = vec![0.0; sum.data.len()];
            spec.shard.as_ref().unwrap().place(&grad.data, &mut placed);
            sum.data.iter_mut().zip(&placed).for_each(|(s, g)| *s += g);
        }
    }
    (results.iter().map(|(loss, ..)| *loss).collect(), whole)
}

/// The split run against one process: every member's loss within 1e-5 relative, every gradient
/// within 1e-4 of its tensor's largest.
fn check_against_one_process(seq: usize, size: usize, stage_ends: &[usize]) {
    let config = ModelConfig { ffn_hidden: 66, ..config(seq) };
    let batches = [batch(&config, 0, 2), batch(&config, 5, 2)];
    let compute = stage_compute(&config, 0..4, ComputeDevice::Cpu).unwrap();
    let mut whole = vec![StageState::new(&config, 0..4, SEED, compute).unwrap()];
    let whole_loss = train(&mut whole, &batches);
    let (losses, split_grads) = split_run(&config, size, stage_ends);
    for loss in losses {
        assert!(((loss - whole_loss) / whole_loss).abs() <= 1e-5, "tp = {size}: loss {loss} vs {whole_loss}");
    }
    for (idx, (a, b)) in grads(&whole).iter().zip(&split_grads).enumerate() {
        let scale = a.data.iter().fold(0f32, |m, g| m.max(g.abs()));
        assert!(scale > 0.0, "parameter {idx} got no gradient");
        let worst = a.data.iter().zip(&b.data).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-4 * scale, "tp = {size}, parameter {idx}: gradients differ by {worst} (largest {scale})");
    }
}

#[test]
fn two_devices_match_one_process() {
    check_against_one_process(32, 2, &[4]);
}

#[test]
fn four_devices_sharing_kv_heads_with_uneven_runs_match_one_process() {
    check_against_one_process(30, 4, &[4]);
}

#[test]
fn tensor_parallel_stages_in_a_pipeline_match_one_process() {
    check_against_one_process(30, 2, &[1, 3, 4]);
}
