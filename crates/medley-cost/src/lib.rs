//! medley's analytical cost model: how long a pipeline stage takes on a device type, how much
//! memory it needs, and what communication costs, from the model's shape and datasheet rates.
//!
//! Pure functions of specs: nothing here reads files or the clock. The planner prices candidate
//! plans with it; the simulator takes its compute times per instruction.

pub mod comm;
pub mod context;
mod efficiency;
pub mod flops;
pub mod memory;
pub mod params;

use context::{ContextLayerTime, ContextPass, ContextWork, KvExchange};
use medley_spec::{ModelSpec, NodeGroup, Recompute};

pub use efficiency::{Calibration, CalibrationError, Efficiency, ProfileKind};
pub use memory::{GIB, MemoryBreakdown};

/// How a stage is run: the knobs shared by every stage of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Setting {
    pub micro_batch: u32,
    /// Tensor-parallel degree; sequence parallelism is on whenever it exceeds 1.
    pub tp: u32,
    pub recompute: Recompute,
}

/// Which parts of the model a pipeline stage holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageShape {
    pub n_layers: u32,
    pub embedding: bool,
    pub head: bool,
}

impl StageShape {
    /// Stage `stage_idx` of a pipeline of `n_stages`: the first holds the embedding, the last the
    /// head.
    pub fn in_pipeline(stage_idx: usize, n_stages: usize, n_layers: u32) -> Self {
        StageShape { n_layers, embedding: stage_idx == 0, head: stage_idx + 1 == n_stages }
    }
}

/// Seconds of one micro-batch's forward and backward pass (compute plus tensor-parallel
/// communication, which sits on the critical path).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PassTime {
    pub forward_s: f64,
    /// The whole backward: input gradients, weight gradients and any recomputation.
    pub backward_s: f64,
    /// The part of `backward_s` that computes weight gradients (the dW matmuls), which
    /// zero-bubble schedules run as a separate pass (Qi et al. 2023).
    pub weight_grad_s: f64,
}

impl PassTime {
    pub fn total_s(self) -> f64 {
        self.forward_s + self.backward_s
    }

    fn scaled(self, factor: f64) -> PassTime {
        PassTime {
            forward_s: self.forward_s * factor,
            backward_s: self.backward_s * factor,
            weight_grad_s: self.weight_grad_s * factor,
        }
    }

    pub fn plus(self, other: PassTime) -> PassTime {
        PassTime {
            forward_s: self.forward_s + other.forward_s,
            backward_s: self.backward_s + other.backward_s,
            weight_grad_s: self.weight_grad_s + other.weight_grad_s,
        }
    }
}

/// The cost model for one model and sequence length on any device.
#[derive(Clone, Copy, Debug)]
pub struct CostModel<'a> {
    model: &'a ModelSpec,
    seq_len: u32,
    calibration: &'a Calibration,
}

impl<'a> CostModel<'a> {
    pub fn new(model: &'a ModelSpec, seq_len: u32, calibration: &'a Calibration) -> Self {
        CostModel { model, seq_len, calibration }
    }

    pub fn model(&self) -> &'a ModelSpec {
        self.model
    }

    pub fn seq_len(&self) -> u32 {
        self.seq_len
    }

    /// One transformer layer on one TP group of `group`'s devices: a roofline per kernel class.
    pub fn layer_time(&self, group: &NodeGroup, setting: Setting) -> PassTime {
        let rates = Rates::new(self.calibration, group, setting.tp);
        let flops = flops::layer_forward(self.model, self.seq_len, setting.micro_batch);
        let weight_bytes = 2.0 * params::layer_params(self.model) as f64;
        let matmul_s = rates.matmul_s(flops.matmul).max(rates.memory_s(weight_bytes));
        let attention_s = rates.attention_s(flops.attention);
        let elementwise_s = rates.memory_s(self.elementwise_bytes(setting.micro_batch));
        let tp_comm_s = self.tp_comm_per_pass_s(group, setting);
        let forward_s = matmul_s + attention_s + elementwise_s + tp_comm_s;
        let recompute_s = match setting.recompute {
            Recompute::None => 0.0,
            Recompute::Selective => attention_s,
            Recompute::Full => forward_s,
        };
        // Backward computes input and weight gradients: twice the forward's work. Only the
        // matmuls have weights, so the weight-gradient half is one matmul pass.
        let backward_s = 2.0 * (matmul_s + attention_s + elementwise_s) + tp_comm_s + recompute_s;
        PassTime { forward_s, backward_s, weight_grad_s: matmul_s }
    }

    /// The output projection and loss on the last stage.
    pub fn head_time(&self, group: &NodeGroup, setting: Setting) -> PassTime {
        let rates = Rates::new(self.calibration, group, setting.tp);
        head_pass(self.model, &rates, f64::from(self.seq_len) * f64::from(setting.micro_batch))
    }

    /// The output projection and loss for `tokens` of a long-context stage's sequence.
    pub fn context_head_time(&self, group: &NodeGroup, tokens: f64) -> PassTime {
        head_pass(self.model, &Rates::new(self.calibration, group, 1), tokens)
    }

    /// A whole stage for one micro-batch.
    pub fn stage_time(&self, group: &NodeGroup, shape: StageShape, setting: Setting) -> PassTime {
        let layers = self.layer_time(group, setting).scaled(f64::from(shape.n_layers));
        if shape.head { layers.plus(self.head_time(group, setting)) } else { layers }
    }

    /// Parameters a stage holds before tensor parallelism splits them.
    pub fn stage_params(&self, shape: StageShape) -> f64 {
        let layers = f64::from(shape.n_layers) * params::layer_params(self.model) as f64;
        let embedding = if shape.embedding { params::embedding_params(self.model) as f64 } else { 0.0 };
        let head = match (shape.head, shape.embedding && self.model.tie_embeddings()) {
            (true, true) => f64::from(self.model.hidden()),
            (true, false) => params::head_params(self.model) as f64,
            (false, _) => 0.0,
        };
        layers + embedding + head
    }

    /// Peak memory of one device of a stage that keeps `in_flight` micro-batches' worth of its
    /// layers' activations (fractional when a rank's chunks each hold part of its layers, as in
    /// interleaved 1F1B), with optimizer states sharded over `optimizer_shards` replicas.
    pub fn stage_memory(
        &self,
        shape: StageShape,
        setting: Setting,
        in_flight: f64,
        optimizer_shards: u32,
    ) -> MemoryBreakdown {
        let per_layer = |recompute| {
            memory::layer_activation_bytes(self.model, self.seq_len, setting.micro_batch, setting.tp, recompute)
        };
        let logits = memory::logits_bytes(self.model, self.seq_len, setting.micro_batch, setting.tp);
        let mut breakdown = MemoryBreakdown::model_states(self.stage_params(shape), setting.tp, optimizer_shards);
        breakdown.activations = held_activations(shape, setting.recompute, in_flight, per_layer, logits);
        breakdown
    }

    /// One layer of a long-context stage on a device of `group` doing `work` (tp = 1: context
    /// and head parallelism replace tensor parallelism). The backward computes twice the
    /// forward's matmuls and attention (input and weight gradients; FlashAttention's backward),
    /// sends the all-to-alls' gradients back, and exchanges keys and values twice over: a ring
    /// passes K/V again and dK/dV home (Liu et al. 2023), an all-gather gathers again and
    /// reduce-scatters the gradients (Megatron-LM's `allgather` CP). Selective recomputation
    /// runs attention and its exchange again; full recomputation the whole forward.
    pub fn context_layer_time(&self, group: &NodeGroup, work: ContextWork, recompute: Recompute) -> ContextLayerTime {
        let rates = Rates::new(self.calibration, group, 1);
        let per_token = flops::layer_forward(self.model, 1, 1).matmul;
        let matmul_s = rates.matmul_s(per_token * work.tokens);
        let elementwise_s = rates.memory_s(self.elementwise_bytes_per_token() * work.tokens);
        let attention_s = rates.attention_s(work.attention_flops);
        let forward =
            ContextPass { serial_s: matmul_s + elementwise_s + work.all_to_all_s, attention_s, kv_s: work.kv_s };
        let overlaps = work.kv_exchange == KvExchange::Ring;
        // A ring passes keys and values around again with their gradients; an all-gather keeps
        // them from the forward and reduce-scatters only the gradients.
        let backward_kv = if overlaps { 2.0 } else { 1.0 };
        let mut backward = ContextPass {
            serial_s: 2.0 * (matmul_s + elementwise_s) + work.all_to_all_s,
            attention_s: 2.0 * attention_s,
            kv_s: backward_kv * work.kv_s,
        };
        if recompute != Recompute::None {
            backward.attention_s += forward.attention_s;
            backward.kv_s += forward.kv_s;
        }
        if recompute == Recompute::Full {
            backward.serial_s += forward.serial_s;
        }
        ContextLayerTime { forward, backward, overlaps, weight_grad_s: matmul_s }
    }

    /// Peak memory of one device of a long-context stage holding `tokens` of each sequence
    /// outside attention and `buffer_bytes` of attention buffers (its heads' Q, K, V and output
    /// for its group's shard, the keys and values it receives), with FlashAttention keeping no
    /// scores.
    pub fn context_memory(
        &self,
        shape: StageShape,
        recompute: Recompute,
        in_flight: f64,
        optimizer_shards: u32,
        tokens: f64,
        buffer_bytes: f64,
    ) -> MemoryBreakdown {
        // Per token: a one-token sequence keeps no score matrix, whatever the mode.
        let per_layer = |recompute| tokens * memory::layer_activation_bytes(self.model, 1, 1, 1, recompute);
        let logits = tokens * memory::logits_bytes(self.model, 1, 1, 1);
        let mut breakdown = MemoryBreakdown::model_states(self.stage_params(shape), 1, optimizer_shards);
        breakdown.activations = held_activations(shape, recompute, in_flight, per_layer, logits) + buffer_bytes;
        breakdown
    }

    /// Bytes each tensor-parallel rank sends across a pipeline boundary per micro-batch and
    /// direction: the bf16 activation, split over the TP group by sequence parallelism.
    pub fn boundary_bytes(&self, setting: Setting) -> f64 {
        2.0 * f64::from(self.seq_len) * f64::from(setting.micro_batch) * f64::from(self.model.hidden())
            / f64::from(setting.tp)
    }

    /// Seconds of the optimizer step on one device: Adam streams its 16 bytes of state per
    /// parameter in and most of it out.
    pub fn optimizer_step_s(&self, group: &NodeGroup, params_per_device: f64) -> f64 {
        Rates::new(self.calibration, group, 1).memory_s(32.0 * params_per_device)
    }

    /// Norms, residual adds, rotary embedding, activation functions: read-write traffic in bytes
    /// for one layer's forward, about 16 h-wide and 3 f-wide bf16 passes per token.
    fn elementwise_bytes(&self, micro_batch: u32) -> f64 {
        f64::from(self.seq_len) * f64::from(micro_batch) * self.elementwise_bytes_per_token()
    }

    fn elementwise_bytes_per_token(&self) -> f64 {
        2.0 * (16.0 * f64::from(self.model.hidden()) + 3.0 * self.model.active_ffn_width() as f64)
    }

    /// Megatron tensor parallelism with sequence parallelism: per pass, an all-gather and a
    /// reduce-scatter of the b·s·h activation around attention and again around the MLP.
    fn tp_comm_per_pass_s(&self, group: &NodeGroup, setting: Setting) -> f64 {
        let bytes = 2.0 * f64::from(self.seq_len) * f64::from(setting.micro_batch) * f64::from(self.model.hidden());
        4.0 * comm::reduce_scatter_s(bytes, setting.tp, comm::intra_node_link(group))
    }
}

/// Activations a stage holds: `in_flight` micro-batches of its layers at `per_layer` bytes each,
/// one layer re-materialised at a time under full recomputation, and the logits on the last stage.
fn held_activations(
    shape: StageShape,
    recompute: Recompute,
    in_flight: f64,
    per_layer: impl Fn(Recompute) -> f64,
    logits_bytes: f64,
) -> f64 {
    let mut activations = in_flight * f64::from(shape.n_layers) * per_layer(recompute);
    if recompute == Recompute::Full && shape.n_layers > 0 {
        activations += per_layer(Recompute::Selective);
    }
    if shape.head {
        activations += logits_bytes;
    }
    activations
}

/// The output projection and loss over `tokens` at `rates`.
fn head_pass(model: &ModelSpec, rates: &Rates, tokens: f64) -> PassTime {
    let matmul_s = rates.matmul_s(tokens * flops::head_forward(model, 1, 1));
    let logits_s = rates.memory_s(tokens * memory::logits_bytes(model, 1, 1, 1));
    PassTime { forward_s: matmul_s + logits_s, backward_s: 2.0 * matmul_s + logits_s, weight_grad_s: matmul_s }
}

/// A TP group's achievable rates: the device's peaks times its efficiencies, split over TP ranks.
struct Rates {
    efficiency: Efficiency,
    flops_per_s: f64,
    bytes_per_s: f64,
    tp: f64,
}

impl Rates {
    fn new(calibration: &Calibration, group: &NodeGroup, tp: u32) -> Self {
        Rates {
            efficiency: calibration.efficiency(&group.device),
            flops_per_s: group.device.half_precision_tflops() * 1e12,
            bytes_per_s: group.device.hbm_tb_s * 1e12,
            tp: f64::from(tp),
        }
    }

    fn matmul_s(&self, flops: f64) -> f64 {
        flops / self.tp / (self.flops_per_s * self.efficiency.matmul)
    }

    fn attention_s(&self, flops: f64) -> f64 {
        flops / self.tp / (self.flops_per_s * self.efficiency.attention)
    }

    fn memory_s(&self, bytes: f64) -> f64 {
        bytes / self.tp / (self.bytes_per_s * self.efficiency.memory)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use medley_spec::{catalog_device, catalog_model};

    fn group(device: &str) -> NodeGroup {
        NodeGroup::with_defaults(catalog_device(device).unwrap(), 1, 8)
    }

    #[test]
    fn faster_devices_take_less_time_and_tp_splits_work() {
        let model = catalog_model("llama3-8b").unwrap();
        let calibration = Calibration::default();
        let cost = CostModel::new(&model, 4096, &calibration);
        let setting = Setting { micro_batch: 1, tp: 1, recompute: Recompute::None };
        let h100 = cost.layer_time(&group("h100"), setting).total_s();
        let a100 = cost.layer_time(&group("a100"), setting).total_s();
        assert!(h100 < a100 / 2.0, "{h100} vs {a100}");
        let tp2 = cost.layer_time(&group("h100"), Setting { tp: 2, ..setting }).total_s();
        assert!(tp2 < h100 && tp2 > h100 / 2.0, "{tp2} vs {h100}");
    }

    #[test]
    fn h100_layer_time_is_plausible() {
        // Llama 3 8B, one 4K-token sequence: 0.44 GFLOP per token per layer forward, so 5.4 TFLOP
        // forward and backward: 5.5 ms at H100's peak, ~8 ms at 70% of it, plus attention.
        let model = catalog_model("llama3-8b").unwrap();
        let calibration = Calibration::default();
        let cost = CostModel::new(&model, 4096, &calibration);
        let setting = Setting { micro_batch: 1, tp: 1, recompute: Recompute::None };
        let layer_s = cost.layer_time(&group("h100"), setting).total_s();
        assert!((6e-3..12e-3).contains(&layer_s), "{layer_s}");
    }

    #[test]
    fn recompute_trades_time_for_memory() {
        let model = catalog_model("llama3-70b").unwrap();
        let calibration = Calibration::default();
        let cost = CostModel::new(&model, 4096, &calibration);
        let shape = StageShape { n_layers: 10, embedding: false, head: false };
        let results: Vec<(f64, f64)> = Recompute::ALL
            .into_iter()
            .map(|recompute| {
                let setting = Setting { micro_batch: 1, tp: 8, recompute };
                (
                    cost.stage_time(&group("h100"), shape, setting).total_s(),
                    cost.stage_memory(shape, setting, 4.0, 8).total(),
                )
            })
            .collect();
        assert!(results[0].0 < results[1].0 && results[1].0 < results[2].0, "{results:?}");
        assert!(results[0].1 > results[1].1 && results[1].1 > results[2].1, "{results:?}");
    }
}
