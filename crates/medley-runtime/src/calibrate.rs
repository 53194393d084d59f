//! Calibration for emulated fleets: what this machine's CPU does per micro-batch and per
//! optimizer step, turned into a cost-model profile under which the fleet's fastest device type
//! runs at exactly that speed and every other type keeps its catalog ratios to it. Planning and
//! simulating with this profile price the emulated fleet the way the runtime runs it, and the
//! workers take their slowdowns from the same profile.

use std::time::Instant;

use medley_cost::{Calibration, CostModel, Efficiency, Setting, StageShape, StateFormat};
use medley_model::data::{Dataset, loss_scale};
use medley_model::{AdamW, ComputeDevice, ModelConfig, StageState, stage_compute};
use medley_spec::{Cluster, ModelSpec, NodeGroup, Precision, Recompute};
use statrs::statistics::{Data, OrderStatistics};

use crate::RuntimeError;

/// What a calibration run measured on this machine, one compute thread.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    /// Median seconds of one micro-batch's forward and backward through the whole model.
    pub pass_s: f64,
    /// Median seconds of one AdamW step over the whole model.
    pub optimizer_s: f64,
    pub micro_batch: u32,
}

/// Passes before timing starts: they settle the allocator and caches.
const WARM_UP: usize = 2;

/// Times `repeats` passes of one `micro_batch` through the whole model and as many optimizer
/// steps, after a warm-up, on `concurrency` threads at once (as many as the workers that will
/// share this machine's cores: they slow each other down through shared caches and memory
/// bandwidth), each computing on one thread as an emulating worker does, on `device`; keeps the
/// medians over all of them.
pub fn measure_model_pass(
    model: &ModelSpec,
    seq_len: u32,
    micro_batch: u32,
    repeats: usize,
    concurrency: usize,
    device: ComputeDevice,
) -> Result<Measured, RuntimeError> {
    let config = ModelConfig::from_spec(model, seq_len)?;
    let one_thread = || {
        rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .map_err(|err| RuntimeError::Launch(format!("starting a compute thread: {err}")))
    };
    let timings: Vec<Result<Timings, RuntimeError>> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..concurrency.max(1))
            .map(|_| scope.spawn(|| one_thread()?.install(|| time_passes(&config, micro_batch, repeats, device))))
            .collect();
        threads.into_iter().map(|thread| thread.join().expect("a timing thread does not panic")).collect()
    });
    let (mut passes, mut updates) = (Vec::new(), Vec::new());
    for timing in timings {
        let (pass, update) = timing?;
        passes.extend(pass);
        updates.extend(update);
    }
    Ok(Measured { pass_s: Data::new(passes).median(), optimizer_s: Data::new(updates).median(), micro_batch })
}

/// One thread's pass times and optimizer-step times, seconds.
type Timings = (Vec<f64>, Vec<f64>);

fn time_passes(
    config: &ModelConfig,
    micro_batch: u32,
    repeats: usize,
    device: ComputeDevice,
) -> Result<Timings, RuntimeError> {
    let layers = 0..config.n_layers;
    let mut stage = StageState::new(config, layers.clone(), 0, stage_compute(config, layers, device)?)?;
    let dataset = Dataset::shakespeare(config.seq_len, 0)?;
    let scale = loss_scale(u64::from(micro_batch), config.seq_len);
    let (mut passes, mut updates) = (Vec::new(), Vec::new());
    for repeat in 0..WARM_UP + repeats.max(1) {
        let batch = dataset.micro_batch(repeat as u64 * u64::from(micro_batch), micro_batch as usize, scale);
        let started = Instant::now();
        stage.forward(0, &batch, None)?;
        stage.backward(0, None)?;
        let passed = Instant::now();
        stage.optimizer_step(&AdamW::default())?;
        if repeat >= WARM_UP {
            passes.push((passed - started).as_secs_f64());
            updates.push(passed.elapsed().as_secs_f64());
        }
    }
    Ok((passes, updates))
}

/// The profile that makes the cost model match `measured` on `cluster`'s fastest device type:
/// the memory efficiency from the optimizer step (which only streams memory), then the matmul and
/// attention efficiencies so that the whole-model pass takes `measured.pass_s`. Every device
/// type gets its defaults times the same two factors, so the catalog's ratios stay.
pub fn emulation_calibration(
    cluster: &Cluster,
    model: &ModelSpec,
    seq_len: u32,
    precision: Precision,
    measured: Measured,
) -> Calibration {
    let setting = Setting { micro_batch: measured.micro_batch, tp: 1, recompute: Recompute::None };
    let whole = StageShape { n_layers: model.n_layers(), embedding: true, head: true };
    let scaled = |memory: f64, compute: f64| {
        let mut calibration = Calibration::emulation(model.name());
        for group in cluster.groups() {
            let e = Efficiency::default_for(&group.device);
            let efficiency = Efficiency {
                matmul: (e.matmul * compute).min(1.0),
                attention: (e.attention * compute).min(1.0),
                memory: (e.memory * memory).min(1.0),
            };
            calibration.set(&group.device, efficiency);
        }
        calibration
    };
    let price = |calibration: &Calibration, group: &NodeGroup| {
        let cost = CostModel::new(model, seq_len, calibration).with_states(StateFormat::new(precision));
        (cost.stage_time(group, whole, setting).total_s(), cost.optimizer_step_s(group, cost.stage_params(whole)))
    };
    let defaults = Calibration::default();
    let fastest = cluster
        .groups()
        .iter()
        .min_by(|a, b| price(&defaults, a).0.total_cmp(&price(&defaults, b).0))
        .expect("a cluster has a group");
    let memory = price(&defaults, fastest).1 / measured.optimizer_s;
    // The pass time falls monotonically as the compute factor grows (each kernel is the slower
    // of its compute and its memory time): bisect on its logarithm for the measured pass.
    let pass_at = |compute: f64| price(&scaled(memory, compute), fastest).0;
    let (mut low, mut high) = (1e-12f64.ln(), 0.0f64);
    if pass_at(1.0) >= measured.pass_s {
        // Memory-bound parts alone exceed the measured pass: scale everything by one factor.
        let factor = pass_at(1.0) / measured.pass_s;
        return scaled(memory * factor, factor);
    }
    for _ in 0..100 {
        let mid = 0.5 * (low + high);
        if pass_at(mid.exp()) > measured.pass_s { low = mid } else { high = mid }
    }
    scaled(memory, high.exp())
}

#[cfg(test)]
mod tests {
    use super::*;
    use medley_spec::catalog_model;

    #[test]
    fn the_profile_prices_the_fastest_device_at_the_measured_times() {
        let cluster = Cluster::from_fleet("1xh100,2xa100").unwrap();
        let model = catalog_model("tiny").unwrap();
        let measured = Measured { pass_s: 0.05, optimizer_s: 0.004, micro_batch: 2 };
        let calibration = emulation_calibration(&cluster, &model, 128, Precision::Bf16Mixed, measured);
        let cost = CostModel::new(&model, 128, &calibration);
        let whole = StageShape { n_layers: 8, embedding: true, head: true };
        let setting = Setting { micro_batch: 2, tp: 1, recompute: Recompute::None };
        let h100 = &cluster.groups()[0];
        let pass = cost.stage_time(h100, whole, setting).total_s();
        let optimizer = cost.optimizer_step_s(h100, cost.stage_params(whole));
        assert!((pass / 0.05 - 1.0).abs() < 1e-6, "{pass}");
        assert!((optimizer / 0.004 - 1.0).abs() < 1e-6, "{optimizer}");
        let a100 = &cluster.groups()[1];
        let a100_pass = cost.stage_time(a100, whole, setting).total_s();
        // Compute-bound here, the A100 keeps its default compute ratio to the H100: peak times
        // the default matmul efficiency.
        let rate =
            |device: &medley_spec::DeviceSpec| device.bf16_tflops.unwrap() * Efficiency::default_for(device).matmul;
        let ratio = rate(&h100.device) / rate(&a100.device);
        assert!((a100_pass / pass / ratio - 1.0).abs() < 0.1, "{a100_pass} vs {pass} × {ratio}");
    }
}
