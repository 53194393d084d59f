//! Context and head parallelism against one process: a stage split over devices (each a thread
//! here, exchanging through memory) gives the whole model's loss and, summed over its devices,
//! its gradients — for even and uneven shards, token runs and heads, KV heads shared by several
//! devices, and stages in a pipeline; and each device's collectives are those of the layer order
//! `medley-schedule` defines and the simulator times.

mod common;

use std::ops::Range;
use std::sync::{Arc, Mutex};

use common::{SEED, Seat, batch, config, grads, train};
use medley_model::long_context::{ContextCollectives, ContextGroup, ContextPlacement};
use medley_model::{
    ComputeDevice, HostTensor, MicroBatch, ModelConfig, ModelError, StageState, context_compute, stage_compute,
};
use medley_schedule::long_context_layer::{
    HeadShare, KvExchange, LayerCollective, LayerPass, LayerShape, LayerStep, Recompute,
};

struct InMemory {
    group: Seat,
    lane: Seat,
}

impl ContextCollectives for InMemory {
    fn group_all_to_all(&mut self, input: &[f32], counts: &[Vec<usize>]) -> Result<Vec<f32>, ModelError> {
        let me = self.group.rank;
        let all = self.group.exchange(input);
        Ok(all
            .iter()
            .zip(counts)
            .flat_map(|(sent, row)| {
                let start: usize = row[..me].iter().sum();
                sent[start..start + row[me]].to_vec()
            })
            .collect())
    }

    fn lane_all_gather(&mut self, input: &[f32], _counts: &[usize]) -> Result<Vec<f32>, ModelError> {
        Ok(self.lane.exchange(input).concat())
    }

    fn lane_reduce_scatter(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError> {
        let me = self.lane.rank;
        let all = self.lane.exchange(input);
        let start: usize = counts[..me].iter().sum();
        Ok((start..start + counts[me]).map(|idx| all.iter().map(|sent| sent[idx]).sum()).collect())
    }
}

/// Head–tail shards of `counts` tokens (the planner's), each group's devices holding
/// `device_tokens` of it and every group's devices `q_heads`.
fn head_tail(seq: usize, shards: &[(usize, Vec<usize>)], q_heads: &[usize]) -> Vec<ContextGroup> {
    let mut before = 0;
    shards
        .iter()
        .map(|(count, device_tokens)| {
            let half = count / 2;
            let positions = (before..before + half).chain(seq - before - half..seq - before).collect();
            before += half;
            ContextGroup { positions, device_tokens: device_tokens.clone(), q_heads: q_heads.to_vec() }
        })
        .collect()
}

/// Every device of `groups` trains the stages ending at `stage_ends` (all split alike) on its own
/// thread; the loss and gradients summed over the devices.
fn split_run(
    config: &ModelConfig,
    groups: &[ContextGroup],
    stage_ends: &[usize],
    batches: &[MicroBatch],
) -> (f64, Vec<HostTensor>) {
    let size = groups[0].q_heads.len();
    let cuts: Vec<Range<usize>> =
        stage_ends.iter().scan(0, |start, &end| Some(std::mem::replace(start, end)..end)).collect();
    let group_seats: Vec<Vec<Seat>> = groups.iter().map(|_| Seat::table(size)).collect();
    let lane_seats: Vec<Vec<Seat>> = (0..size).map(|_| Seat::table(groups.len())).collect();
    let handles: Vec<_> = (0..groups.len())
        .flat_map(|g| (0..size).map(move |m| (g, m)))
        .map(|(g, m)| {
            let (config, groups, cuts, batches) = (config.clone(), groups.to_vec(), cuts.clone(), batches.to_vec());
            let seats = (group_seats[g][m].clone(), lane_seats[m][g].clone());
            std::thread::spawn(move || {
                let mut stages: Vec<StageState> = cuts
                    .iter()
                    .map(|layers| {
                        let placement = ContextPlacement::new(&config, groups.clone(), g, m).unwrap();
                        let collectives = Box::new(InMemory { group: seats.0.clone(), lane: seats.1.clone() });
                        let compute =
                            context_compute(&config, layers.clone(), placement, collectives, ComputeDevice::Cpu)
                                .unwrap();
                        StageState::new(&config, layers.clone(), SEED, compute).unwrap()
                    })
                    .collect();
                let loss = train(&mut stages, &batches);
                (loss, grads(&stages))
            })
        })
        .collect();
    let results: Vec<(f64, Vec<HostTensor>)> = handles.into_iter().map(|handle| handle.join().unwrap()).collect();
    let loss = results.iter().map(|(loss, _)| loss).sum();
    let mut summed = results[0].1.clone();
    for (_, device_grads) in &results[1..] {
        for (sum, grad) in summed.iter_mut().zip(device_grads) {
            sum.data.iter_mut().zip(&grad.data).for_each(|(s, g)| *s += g);
        }
    }
    (loss, summed)
}

/// The split run against one process on the whole sequence: loss within 1e-5 relative, every
/// gradient within 1e-4 of its tensor's largest.
fn check_against_one_process(seq: usize, groups: Vec<ContextGroup>, stage_ends: &[usize]) {
    let config = config(seq);
    let batches = [batch(&config, 0, 2), batch(&config, 5, 2)];
    let mut whole =
        vec![StageState::new(&config, 0..4, SEED, stage_compute(&config, 0..4, ComputeDevice::Cpu).unwrap()).unwrap()];
    let whole_loss = train(&mut whole, &batches);
    let (split_loss, split_grads) = split_run(&config, &groups, stage_ends, &batches);
    assert!(((split_loss - whole_loss) / whole_loss).abs() <= 1e-5, "loss {split_loss} vs {whole_loss}");
    for (idx, (a, b)) in grads(&whole).iter().zip(&split_grads).enumerate() {
        let scale = a.data.iter().fold(0f32, |m, g| m.max(g.abs()));
        assert!(scale > 0.0, "parameter {idx} got no gradient");
        let worst = a.data.iter().zip(&b.data).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-4 * scale, "parameter {idx}: gradients differ by {worst} (largest {scale})");
    }
}

#[test]
fn even_context_shards_match_one_process() {
    check_against_one_process(32, head_tail(32, &[(8, vec![8]), (8, vec![8]), (8, vec![8]), (8, vec![8])], &[4]), &[4]);
}

#[test]
fn uneven_context_shards_of_a_length_not_divisible_by_twice_the_degree_match_one_process() {
    check_against_one_process(
        30,
        head_tail(30, &[(12, vec![12]), (6, vec![6]), (4, vec![4]), (8, vec![8])], &[4]),
        &[4],
    );
}

#[test]
fn even_and_uneven_heads_match_one_process() {
    check_against_one_process(30, head_tail(30, &[(30, vec![15, 15])], &[2, 2]), &[4]);
    check_against_one_process(30, head_tail(30, &[(30, vec![10, 12, 8])], &[1, 2, 1]), &[4]);
}

#[test]
fn more_head_parallel_devices_than_kv_heads_match_one_process() {
    check_against_one_process(30, head_tail(30, &[(30, vec![7, 8, 7, 8])], &[1, 1, 1, 1]), &[4]);
}

#[test]
fn context_times_head_parallelism_in_a_pipeline_matches_one_process() {
    let groups = head_tail(30, &[(18, vec![10, 8]), (12, vec![5, 7])], &[1, 3]);
    check_against_one_process(30, groups, &[1, 3, 4]);
}

// ---------------------------------------------------------------------------------------------
// The runtime's order of collectives is the schedule's, which the simulator times.

/// One collective a device ran: which, and its counts (a row per sender for an all-to-all).
type Called = (LayerCollective, Vec<Vec<usize>>);

/// [`InMemory`], writing down each collective it runs.
struct Recording {
    inner: InMemory,
    calls: Arc<Mutex<Vec<Called>>>,
}

impl ContextCollectives for Recording {
    fn group_all_to_all(&mut self, input: &[f32], counts: &[Vec<usize>]) -> Result<Vec<f32>, ModelError> {
        self.calls.lock().unwrap().push((LayerCollective::GroupAllToAll, counts.to_vec()));
        self.inner.group_all_to_all(input, counts)
    }

    fn lane_all_gather(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError> {
        self.calls.lock().unwrap().push((LayerCollective::LaneAllGather, vec![counts.to_vec()]));
        self.inner.lane_all_gather(input, counts)
    }

    fn lane_reduce_scatter(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError> {
        self.calls.lock().unwrap().push((LayerCollective::LaneReduceScatter, vec![counts.to_vec()]));
        self.inner.lane_reduce_scatter(input, counts)
    }
}

/// What device (`group`, `member`) of `groups` runs for one micro-batch of `batch` sequences
/// through `n_layers` layers, by the schedule: every layer's forward steps, then every layer's
/// backward steps, each collective with its counts (a group of one and a lane of one skip theirs).
fn scheduled(config: &ModelConfig, groups: &[ContextGroup], group: usize, member: usize, batch: usize) -> Vec<Called> {
    let placement = ContextPlacement::new(config, groups.to_vec(), group, member).unwrap();
    let heads: Vec<HeadShare> = (0..placement.group_size())
        .map(|m| HeadShare { q_heads: placement.q_heads(m).len() as u32, kv_heads: placement.kv_heads(m).len() as u32 })
        .collect();
    let sizes = groups.iter().map(|g| (g.positions.len(), g.device_tokens.clone())).collect();
    let shape = LayerShape::new(config.head_dim(), sizes, &heads, KvExchange::AllGather, Recompute::None).unwrap();
    let times_batch = |counts: Vec<usize>| counts.into_iter().map(|count| count * batch).collect::<Vec<_>>();
    let mut calls = Vec::new();
    for pass in [LayerPass::Forward, LayerPass::Backward] {
        for _ in 0..config.n_layers {
            for step in shape.steps(pass) {
                let counts = match (step, step.collective()) {
                    (LayerStep::AllToAll(all_to_all), Some(collective)) if heads.len() > 1 => {
                        let counts = shape.all_to_all_counts(group, all_to_all).into_iter().map(times_batch);
                        Some((collective, counts.collect()))
                    }
                    (_, Some(collective @ (LayerCollective::LaneAllGather | LayerCollective::LaneReduceScatter)))
                        if groups.len() > 1 =>
                    {
                        Some((collective, vec![times_batch(shape.lane_counts(member, 1))]))
                    }
                    _ => None,
                };
                calls.extend(counts);
            }
        }
    }
    calls
}

/// Every device of `groups` runs one micro-batch's forward and backward through the whole model;
/// each device's collectives, in order, are the schedule's.
fn check_collectives_follow_the_schedule(seq: usize, groups: Vec<ContextGroup>) {
    let config = config(seq);
    let micro_batch = batch(&config, 0, 2);
    let size = groups[0].q_heads.len();
    let group_seats: Vec<Vec<Seat>> = groups.iter().map(|_| Seat::table(size)).collect();
    let lane_seats: Vec<Vec<Seat>> = (0..size).map(|_| Seat::table(groups.len())).collect();
    let handles: Vec<_> = (0..groups.len())
        .flat_map(|g| (0..size).map(move |m| (g, m)))
        .map(|(g, m)| {
            let (config, groups, micro_batch) = (config.clone(), groups.clone(), micro_batch.clone());
            let inner = InMemory { group: group_seats[g][m].clone(), lane: lane_seats[m][g].clone() };
            std::thread::spawn(move || {
                let calls = Arc::new(Mutex::new(Vec::new()));
                let collectives = Box::new(Recording { inner, calls: calls.clone() });
                let placement = ContextPlacement::new(&config, groups.clone(), g, m).unwrap();
                let layers = 0..config.n_layers;
                let compute = context_compute(&config, layers.clone(), placement, collectives, ComputeDevice::Cpu);
                let mut stage = StageState::new(&config, layers, SEED, compute.unwrap()).unwrap();
                train(std::slice::from_mut(&mut stage), &[micro_batch]);
                let expected = scheduled(&config, &groups, g, m, 2);
                assert_eq!(*calls.lock().unwrap(), expected, "group {g} member {m}");
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
}

#[test]
fn the_runtimes_collectives_follow_the_schedules_layer_order() {
    // Uneven shards over a lane of three; uneven tokens and heads in groups of two; a group of
    // more devices than KV heads; every device on its own.
    check_collectives_follow_the_schedule(30, head_tail(30, &[(12, vec![12]), (10, vec![10]), (8, vec![8])], &[4]));
    check_collectives_follow_the_schedule(30, head_tail(30, &[(18, vec![10, 8]), (12, vec![5, 7])], &[1, 3]));
    check_collectives_follow_the_schedule(30, head_tail(30, &[(30, vec![7, 8, 7, 8])], &[1, 1, 1, 1]));
}
