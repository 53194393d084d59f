//! Calibration for emulated fleets: what this machine's CPU does per micro-batch, turned into a
//! cost-model profile under which the plan's fastest device type runs at exactly that speed and
//! every other type at its catalog ratio to it. Planning and simulating with this profile price
//! the emulated fleet the way the runtime runs it.

use std::time::Instant;

use medley_cost::{Calibration, CostModel, Efficiency, Setting, StageShape};
use medley_model::data::{Dataset, loss_scale};
use medley_model::{BurnStage, ModelConfig, Stage};
use medley_spec::{Cluster, ModelSpec, Recompute};

use crate::RuntimeError;

/// What a calibration run measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    /// Median seconds of one micro-batch's forward and backward through the whole model.
    pub pass_s: f64,
    pub micro_batch: u32,
}

/// Times `repeats` forward and backward passes of one `micro_batch` through the whole model on
/// this thread (after one warm-up pass) and keeps the median.
pub fn measure_model_pass(
    model: &ModelSpec,
    seq_len: u32,
    micro_batch: u32,
    repeats: usize,
) -> Result<Measured, RuntimeError> {
    let config = ModelConfig::from_spec(model, seq_len)?;
    let layers = 0..config.n_layers;
    let mut stage = Stage::new(&config, layers.clone(), 0, Box::new(BurnStage::new(&config, layers)))?;
    let dataset = Dataset::shakespeare(config.seq_len, 0)?;
    let scale = loss_scale(u64::from(micro_batch), config.seq_len);
    let mut times = Vec::new();
    for repeat in 0..=repeats.max(1) {
        let batch = dataset.micro_batch(repeat as u64 * u64::from(micro_batch), micro_batch as usize, scale);
        let started = Instant::now();
        stage.forward(0, &batch, None)?;
        stage.backward(0, None)?;
        if repeat > 0 {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(Measured { pass_s: times[times.len() / 2], micro_batch })
}

/// The profile under which the cost model prices the whole-model pass on `cluster`'s fastest
/// device type at `measured.pass_s`: every type's default efficiencies times one common factor,
/// so the types keep the catalog's speed ratios (the runtime's emulated slowdowns).
pub fn emulation_calibration(cluster: &Cluster, model: &ModelSpec, seq_len: u32, measured: Measured) -> Calibration {
    let defaults = Calibration::default();
    let cost = CostModel::new(model, seq_len, &defaults);
    let setting = Setting { micro_batch: measured.micro_batch, tp: 1, recompute: Recompute::None };
    let whole = StageShape { n_layers: model.n_layers(), embedding: true, head: true };
    let fastest_s = cluster
        .groups()
        .iter()
        .map(|group| cost.stage_time(group, whole, setting).total_s())
        .fold(f64::INFINITY, f64::min);
    let factor = (fastest_s / measured.pass_s).min(1.0);
    let mut calibration = Calibration::default();
    for group in cluster.groups() {
        let e = Efficiency::default_for(&group.device);
        let scaled =
            Efficiency { matmul: e.matmul * factor, attention: e.attention * factor, memory: e.memory * factor };
        calibration.set(&group.device, scaled);
    }
    calibration
}
