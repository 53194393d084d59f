//! medley's analytical cost model: how long a pipeline stage takes on a device type, how much
//! memory it needs, and what communication costs, from the model's shape and datasheet rates.
//!
//! Pure functions of specs: nothing here reads files or the clock. The planner prices candidate
//! plans with it; the simulator takes its compute times per instruction.

pub mod comm;
mod efficiency;
pub mod flops;
pub mod gemm;
pub mod long_context;
pub mod memory;
pub mod params;

use gemm::{Gemm, GemmGeometry};
use long_context::{ContextLayerTime, ContextPass, ContextWork, KvExchange};
use medley_spec::{AttentionKernel, GradReduce, JobSpec, ModelSpec, NodeGroup, Precision, Recompute};

pub use efficiency::{Calibration, CalibrationError, Efficiency, Overheads, ProfileKind, assumptions};
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

/// How a job keeps each parameter's states: its precision, the format gradients accumulate and
/// reduce in (Megatron-LM keeps its main gradients in it), and whether they are sharded over the
/// replicas with the optimizer states (ZeRO-2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StateFormat {
    pub precision: Precision,
    pub grad_reduce: GradReduce,
    pub shard_gradients: bool,
}

impl StateFormat {
    /// `precision` with Megatron-LM's gradient format for it, unsharded.
    pub fn new(precision: Precision) -> Self {
        StateFormat { precision, grad_reduce: GradReduce::default_for(precision), shard_gradients: false }
    }

    pub fn of_job(job: &JobSpec) -> Self {
        StateFormat {
            precision: job.precision(),
            grad_reduce: job.grad_reduce(),
            shard_gradients: job.shard_gradients(),
        }
    }

    /// Bytes of one gradient as kept: a mixed-precision job's in its reduction format (Megatron's
    /// main gradients: fp32 with `--accumulate-allreduce-grads-in-fp32`, bf16 or fp16 without), an
    /// fp32 job's fp32.
    pub fn gradient_bytes(&self) -> f64 {
        if self.precision.is_mixed() { self.grad_reduce.bytes() } else { 4.0 }
    }

    /// Bytes of weights, gradients and optimizer states a parameter, none of them sharded.
    pub fn unsharded_bytes(&self) -> f64 {
        self.precision.element_bytes() + self.gradient_bytes() + self.precision.optimizer_bytes()
    }
}

impl Default for StateFormat {
    fn default() -> Self {
        StateFormat::new(Precision::Bf16Mixed)
    }
}

/// The cost model for one model and sequence length on any device.
#[derive(Clone, Copy, Debug)]
pub struct CostModel<'a> {
    model: &'a ModelSpec,
    seq_len: u32,
    calibration: &'a Calibration,
    attention: AttentionKernel,
    states: StateFormat,
}

/// FlashAttention's backward recomputes the scores and runs four more matmuls: 2.5 times the
/// forward's work (Dao 2023, arXiv 2307.08691).
pub const FUSED_ATTENTION_BACKWARD: f64 = 2.5;

/// Bytes an unfused attention moves per score (one query–key pair of one head) in the forward:
/// QKᵀ writes it (2), the fused scale-mask-softmax reads and writes it (4), dropout reads it,
/// writes it and its mask (5), score × V reads it (2).
const UNFUSED_SCORE_BYTES_FORWARD: f64 = 13.0;

/// The same in the backward: dV's matmul reads the probabilities and the score gradient is
/// written (4), dropout's backward (5), softmax's reads probabilities and gradient and writes
/// one (6), dQ's and dK's matmuls each read it (4).
const UNFUSED_SCORE_BYTES_BACKWARD: f64 = 19.0;

impl<'a> CostModel<'a> {
    /// The cost model with a fused attention kernel (see [`CostModel::with_attention`]).
    pub fn new(model: &'a ModelSpec, seq_len: u32, calibration: &'a Calibration) -> Self {
        CostModel { model, seq_len, calibration, attention: AttentionKernel::Fused, states: StateFormat::default() }
    }

    /// The same model keeping a job's states as `states` say, and pricing its matmuls at its
    /// precision's rate. Every device it prices must have that format: where a job meets a
    /// cluster, [`medley_spec::Cluster::check_precision`] refuses one that does not.
    pub fn with_states(self, states: StateFormat) -> Self {
        CostModel { states, ..self }
    }

    pub fn states(&self) -> StateFormat {
        self.states
    }

    pub fn precision(&self) -> Precision {
        self.states.precision
    }

    /// A TP group of `group`'s devices, `tp` wide, at this model's precision.
    fn rates(&self, group: &NodeGroup, tp: u32) -> Rates {
        Rates::new(self.calibration, group, tp, self.states.precision)
    }

    /// The same model pricing the attention core as `attention` runs it.
    pub fn with_attention(self, attention: AttentionKernel) -> Self {
        CostModel { attention, ..self }
    }

    pub fn model(&self) -> &'a ModelSpec {
        self.model
    }

    pub fn seq_len(&self) -> u32 {
        self.seq_len
    }

    /// One transformer layer on one TP group of `group`'s devices: a roofline per kernel class.
    pub fn layer_time(&self, group: &NodeGroup, setting: Setting) -> PassTime {
        let rates = self.rates(group, setting.tp);
        let flops = flops::layer_forward(self.model, self.seq_len, setting.micro_batch);
        let tokens = f64::from(self.seq_len) * f64::from(setting.micro_batch);
        let matmuls = rates.matmuls(&gemm::layer_gemms(self.model, tokens, setting.tp));
        let weight_bytes = self.states.precision.element_bytes() * params::layer_params(self.model) as f64;
        let matmul_s = matmuls.forward_s.max(rates.memory_s(weight_bytes));
        let attention = self.attention_core(&rates, flops.attention, setting);
        let elementwise_s = rates.memory_s(self.elementwise_bytes(setting.micro_batch));
        let tp_comm_s = self.tp_comm_per_pass_s(group, setting);
        let forward_s = matmul_s + attention.forward_s + elementwise_s + tp_comm_s;
        let recompute_s = match setting.recompute {
            Recompute::None => 0.0,
            Recompute::Selective => attention.forward_s,
            Recompute::Full => forward_s,
        };
        // Backward computes input and weight gradients: twice the forward's work. Only the
        // matmuls have weights, so the weight-gradient half is their weight-gradient multiplies.
        let backward_s = matmuls.backward_s() + 2.0 * elementwise_s + attention.backward_s + tp_comm_s + recompute_s;
        PassTime { forward_s, backward_s, weight_grad_s: matmuls.weight_grad_s }
    }

    /// The attention core of one layer for one micro-batch whose causal attention does
    /// `causal_flops`, as the job's kernel runs it: fused, only the causal half at the attention
    /// efficiency; unfused, every score computed by batched matmuls (the mask comes after them)
    /// and every score moved through memory by softmax and dropout.
    fn attention_core(&self, rates: &Rates, causal_flops: f64, setting: Setting) -> PassTime {
        match self.attention {
            AttentionKernel::Fused => {
                let forward_s = rates.attention_s(causal_flops, self.model, f64::from(self.seq_len));
                PassTime { forward_s, backward_s: FUSED_ATTENTION_BACKWARD * forward_s, weight_grad_s: 0.0 }
            }
            AttentionKernel::Unfused => {
                let gemms = gemm::unfused_attention_gemms(self.model, self.seq_len, setting.micro_batch, setting.tp);
                let matmuls = rates.matmuls(&gemms);
                // The constants count 16-bit scores; fp32 ones move twice the bytes.
                let scores = memory::scores(self.model, self.seq_len, setting.micro_batch)
                    * (self.states.precision.element_bytes() / 2.0);
                PassTime {
                    forward_s: matmuls.forward_s + rates.memory_s(UNFUSED_SCORE_BYTES_FORWARD * scores),
                    backward_s: matmuls.backward_s() + rates.memory_s(UNFUSED_SCORE_BYTES_BACKWARD * scores),
                    weight_grad_s: 0.0,
                }
            }
        }
    }

    /// The output projection and loss on the last stage.
    pub fn head_time(&self, group: &NodeGroup, setting: Setting) -> PassTime {
        let rates = self.rates(group, setting.tp);
        head_pass(
            self.model,
            &rates,
            f64::from(self.seq_len) * f64::from(setting.micro_batch),
            setting.tp,
            self.states.precision,
        )
    }

    /// The output projection and loss for `tokens` of a long-context stage's sequence.
    pub fn context_head_time(&self, group: &NodeGroup, tokens: f64) -> PassTime {
        // At the whole sequence's shapes, scaled: linear in tokens, as for the layers.
        let whole = f64::from(self.seq_len);
        head_pass(self.model, &self.rates(group, 1), whole, 1, self.states.precision).scaled(tokens / whole)
    }

    /// A whole stage for one micro-batch.
    pub fn stage_time(&self, group: &NodeGroup, shape: StageShape, setting: Setting) -> PassTime {
        let head = if shape.head { self.head_time(group, setting) } else { PassTime::default() };
        self.stage_pass(shape, self.layer_time(group, setting), head)
    }

    /// A stage's pass from one layer's and the head's: its layers, the head if it has it, and
    /// the framework's overheads.
    pub fn stage_pass(&self, shape: StageShape, layer: PassTime, head: PassTime) -> PassTime {
        let layers = layer.scaled(f64::from(shape.n_layers)).plus(self.pass_overhead(shape));
        if shape.head { layers.plus(head) } else { layers }
    }

    /// The framework's overheads on one micro-batch's forward and backward through a stage of
    /// `shape` (see [`Overheads`]); none of it computes weight gradients.
    fn pass_overhead(&self, shape: StageShape) -> PassTime {
        let overheads = self.calibration.overheads();
        let per_pass_s = overheads.per_micro_batch_s + f64::from(shape.n_layers) * overheads.per_layer_s;
        PassTime { forward_s: per_pass_s, backward_s: per_pass_s, weight_grad_s: 0.0 }
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
            let shape =
                memory::ActivationShape { seq_len: self.seq_len, micro_batch: setting.micro_batch, tp: setting.tp };
            memory::layer_activation_bytes(self.model, shape, recompute, self.attention, self.states.precision)
        };
        let logits =
            memory::logits_bytes(self.model, self.seq_len, setting.micro_batch, setting.tp, self.states.precision);
        let mut breakdown =
            MemoryBreakdown::model_states(self.stage_params(shape), setting.tp, optimizer_shards, self.states);
        breakdown.activations = held_activations(shape, setting.recompute, in_flight, per_layer, logits);
        breakdown
    }

    /// One layer of a long-context stage on a device of `group` doing `work` (tp = 1: context
    /// and head parallelism replace tensor parallelism). The backward computes twice the
    /// forward's matmuls (input and weight gradients) and FlashAttention's backward,
    /// sends the all-to-alls' gradients back, and exchanges keys and values twice over: a ring
    /// passes K/V again and dK/dV home (Liu et al. 2023), an all-gather gathers again and
    /// reduce-scatters the gradients (Megatron-LM's `allgather` CP). Selective recomputation
    /// runs attention and its exchange again; full recomputation the whole forward.
    pub fn context_layer_time(&self, group: &NodeGroup, work: ContextWork, recompute: Recompute) -> ContextLayerTime {
        let rates = self.rates(group, 1);
        // Priced at the whole sequence's shapes and scaled to the shard, so that time stays
        // linear in tokens as the shard split's linear program needs; shards of thousands of
        // tokens quantise little.
        let whole = f64::from(self.seq_len);
        let matmuls = rates.matmuls(&gemm::layer_gemms(self.model, whole, 1)).scaled(work.tokens / whole);
        let matmul_s = matmuls.forward_s;
        let elementwise_s = rates.memory_s(self.elementwise_bytes_per_token() * work.tokens);
        let attention_s = rates.attention_s(work.attention_flops, self.model, f64::from(self.seq_len));
        let forward =
            ContextPass { serial_s: matmul_s + elementwise_s + work.all_to_all_s, attention_s, kv_s: work.kv_s };
        let overlaps = work.kv_exchange == KvExchange::Ring;
        // A ring passes keys and values around again with their gradients; an all-gather keeps
        // them from the forward and reduce-scatters only the gradients.
        let backward_kv = if overlaps { 2.0 } else { 1.0 };
        let mut backward = ContextPass {
            serial_s: matmuls.backward_s() + 2.0 * elementwise_s + work.all_to_all_s,
            attention_s: FUSED_ATTENTION_BACKWARD * attention_s,
            kv_s: backward_kv * work.kv_s,
        };
        if recompute != Recompute::None {
            backward.attention_s += forward.attention_s;
            backward.kv_s += forward.kv_s;
        }
        if recompute == Recompute::Full {
            backward.serial_s += forward.serial_s;
        }
        ContextLayerTime { forward, backward, overlaps, weight_grad_s: matmuls.weight_grad_s }
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
        let one_token = memory::ActivationShape { seq_len: 1, micro_batch: 1, tp: 1 };
        let per_layer = |recompute| {
            tokens
                * memory::layer_activation_bytes(
                    self.model,
                    one_token,
                    recompute,
                    AttentionKernel::Fused,
                    self.states.precision,
                )
        };
        let logits = tokens * memory::logits_bytes(self.model, 1, 1, 1, self.states.precision);
        let mut breakdown = MemoryBreakdown::model_states(self.stage_params(shape), 1, optimizer_shards, self.states);
        breakdown.activations = held_activations(shape, recompute, in_flight, per_layer, logits) + buffer_bytes;
        breakdown
    }

    /// Bytes each tensor-parallel rank sends across a pipeline boundary per micro-batch and
    /// direction: the activation, split over the TP group by sequence parallelism.
    pub fn boundary_bytes(&self, setting: Setting) -> f64 {
        self.states.precision.element_bytes()
            * f64::from(self.seq_len)
            * f64::from(setting.micro_batch)
            * f64::from(self.model.hidden())
            / f64::from(setting.tp)
    }

    /// Seconds of the optimizer step on one device: Adam streams its 16 bytes of state per
    /// parameter (in every precision) in and most of it out.
    pub fn optimizer_step_s(&self, group: &NodeGroup, params_per_device: f64) -> f64 {
        self.rates(group, 1).memory_s(32.0 * params_per_device)
    }

    /// Norms, residual adds, rotary embedding, activation functions: read-write traffic in bytes
    /// for one layer's forward, about 16 h-wide and 3 f-wide passes per token.
    fn elementwise_bytes(&self, micro_batch: u32) -> f64 {
        f64::from(self.seq_len) * f64::from(micro_batch) * self.elementwise_bytes_per_token()
    }

    fn elementwise_bytes_per_token(&self) -> f64 {
        self.states.precision.element_bytes()
            * (16.0 * f64::from(self.model.hidden()) + 3.0 * self.model.active_ffn_width() as f64)
    }

    /// Megatron tensor parallelism with sequence parallelism: per pass, an all-gather and a
    /// reduce-scatter of the b·s·h activation around attention and again around the MLP.
    fn tp_comm_per_pass_s(&self, group: &NodeGroup, setting: Setting) -> f64 {
        let bytes = self.boundary_bytes(Setting { tp: 1, ..setting });
        4.0 * comm::reduce_scatter_s(bytes, setting.tp, comm::tensor_parallel_link(group, setting.tp))
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

/// The output projection and loss over `tokens` at `rates` in `precision`.
fn head_pass(model: &ModelSpec, rates: &Rates, tokens: f64, tp: u32, precision: Precision) -> PassTime {
    let matmuls = rates.matmuls(&[gemm::head_gemm(model, tokens, tp)]);
    let logits_s = rates.memory_s(tokens * memory::logits_bytes(model, 1, 1, 1, precision));
    PassTime {
        forward_s: matmuls.forward_s + logits_s,
        backward_s: matmuls.backward_s() + logits_s,
        weight_grad_s: matmuls.weight_grad_s,
    }
}

/// Seconds of a set of multiplies in the forward and of the backward's two kinds.
struct MatmulTime {
    forward_s: f64,
    input_grad_s: f64,
    weight_grad_s: f64,
}

impl MatmulTime {
    fn backward_s(&self) -> f64 {
        self.input_grad_s + self.weight_grad_s
    }

    fn scaled(self, factor: f64) -> MatmulTime {
        MatmulTime {
            forward_s: self.forward_s * factor,
            input_grad_s: self.input_grad_s * factor,
            weight_grad_s: self.weight_grad_s * factor,
        }
    }
}

/// A TP group's achievable rates: the device's peaks times its efficiencies, split over TP ranks.
struct Rates {
    efficiency: Efficiency,
    flops_per_s: f64,
    bytes_per_s: f64,
    tp: f64,
    /// Shapes count on GPUs; an emulation profile was measured on its one model's shapes, on a
    /// CPU, and prices them as measured.
    shape_aware: bool,
    geometry: Option<GemmGeometry>,
}

impl Rates {
    fn new(calibration: &Calibration, group: &NodeGroup, tp: u32, precision: Precision) -> Self {
        let tflops = group.device.tensor_tflops(precision).unwrap_or_else(|| {
            panic!(
                "{} has no {}: the job's precision is checked against its cluster first",
                group.device.name, precision
            )
        });
        Rates {
            efficiency: calibration.efficiency(&group.device),
            flops_per_s: tflops * 1e12,
            bytes_per_s: group.device.hbm_tb_s * 1e12,
            tp: f64::from(tp),
            shape_aware: *calibration.kind() == ProfileKind::Gpu,
            geometry: GemmGeometry::of(&group.device),
        }
    }

    /// `gemms`, already split over the TP ranks, at the device's matmul rate for their shapes.
    fn matmuls(&self, gemms: &[Gemm]) -> MatmulTime {
        let seconds = |gemm: Gemm| {
            let factor = if self.shape_aware { gemm::gemm_shape_factor(self.geometry, &gemm) } else { 1.0 };
            gemm.flops() / (self.flops_per_s * self.efficiency.matmul * factor)
        };
        let sum = |shape: fn(Gemm) -> Gemm| gemms.iter().map(|&gemm| seconds(shape(gemm))).sum();
        MatmulTime {
            forward_s: sum(|gemm| gemm),
            input_grad_s: sum(Gemm::input_gradient),
            weight_grad_s: sum(Gemm::weight_gradient),
        }
    }

    /// Fused attention's `flops` (of the whole TP group) with `model`'s heads over `key_len` keys.
    fn attention_s(&self, flops: f64, model: &ModelSpec, key_len: f64) -> f64 {
        let factor = if self.shape_aware { gemm::attention_shape_factor(model, key_len) } else { 1.0 };
        flops / self.tp / (self.flops_per_s * self.efficiency.attention * factor)
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
        let shape = StageShape { n_layers: 10, embedding: false, head: false };
        let priced = |attention| -> Vec<(f64, f64)> {
            let cost = CostModel::new(&model, 4096, &calibration).with_attention(attention);
            Recompute::ALL
                .into_iter()
                .map(|recompute| {
                    let setting = Setting { micro_batch: 1, tp: 8, recompute };
                    (
                        cost.stage_time(&group("h100"), shape, setting).total_s(),
                        cost.stage_memory(shape, setting, 4.0, 8).total(),
                    )
                })
                .collect()
        };
        let unfused = priced(AttentionKernel::Unfused);
        assert!(unfused[0].0 < unfused[1].0 && unfused[1].0 < unfused[2].0, "{unfused:?}");
        assert!(unfused[0].1 > unfused[1].1 && unfused[1].1 > unfused[2].1, "{unfused:?}");
        // A fused kernel keeps no scores: selective recomputation only costs time.
        let fused = priced(AttentionKernel::Fused);
        assert!(fused[0].0 < fused[1].0 && fused[1].0 < fused[2].0, "{fused:?}");
        assert!(fused[0].1 == fused[1].1 && fused[1].1 > fused[2].1, "{fused:?}");
        assert!(fused[0].1 < unfused[0].1 && fused[0].0 < unfused[0].0, "{fused:?} vs {unfused:?}");
    }

    /// Issue 33: tf32 runs an A100's matmuls at 156 TFLOP/s (half its bf16 rate) and fp32 at
    /// 19.5; both move and keep 4-byte tensors.
    #[test]
    fn tf32_and_fp32_price_their_rates_and_their_bytes() {
        let model = catalog_model("llama3-8b").unwrap();
        let calibration = Calibration::default();
        let setting = Setting { micro_batch: 1, tp: 2, recompute: Recompute::None };
        let cost = |precision| CostModel::new(&model, 4096, &calibration).with_states(StateFormat::new(precision));
        let a100 = group("a100");
        let layer = |precision| cost(precision).layer_time(&a100, setting).total_s();
        let (bf16, tf32, fp32) = (layer(Precision::Bf16Mixed), layer(Precision::Tf32), layer(Precision::Fp32));
        // Matmul-bound: about the rates' ratios, a little less where memory-bound work doubles too.
        assert!((1.7..2.1).contains(&(tf32 / bf16)), "{tf32} vs {bf16}");
        assert!((10.0..16.5).contains(&(fp32 / bf16)), "{fp32} vs {bf16}");
        let shape = StageShape { n_layers: 4, embedding: false, head: false };
        let memory = |precision| cost(precision).stage_memory(shape, setting, 2.0, 4);
        let (mixed, full) = (memory(Precision::Bf16Mixed), memory(Precision::Tf32));
        // bf16's gradients are fp32 already (Megatron's main gradients under fp32 reduction).
        assert_eq!((full.weights, full.gradients), (2.0 * mixed.weights, mixed.gradients));
        assert_eq!(full.optimizer, mixed.optimizer * 8.0 / 12.0);
        assert!((1.9..2.0).contains(&(full.activations / mixed.activations)), "fp32 statistics do not double");
        assert_eq!(
            cost(Precision::Fp32).boundary_bytes(setting),
            2.0 * cost(Precision::Bf16Mixed).boundary_bytes(setting)
        );
    }

    #[test]
    fn the_unfused_kernel_computes_and_moves_every_score() {
        // GPT-3 175B's attention at 2K on 8 A100s: unfused, the s² scores pass through memory
        // about 32 bytes each and both matmuls run over all of them; fused, half the work.
        let model = catalog_model("gpt3-175b").unwrap();
        let calibration = Calibration::default();
        let setting = Setting { micro_batch: 1, tp: 8, recompute: Recompute::None };
        let time = |attention| {
            CostModel::new(&model, 2048, &calibration).with_attention(attention).layer_time(&group("a100"), setting)
        };
        let (fused, unfused) = (time(AttentionKernel::Fused), time(AttentionKernel::Unfused));
        let a100 = catalog_device("a100").unwrap();
        let memory_s = 32.0 * memory::scores(&model, 2048, 1) / 8.0 / (a100.hbm_tb_s * 1e12 * 0.8);
        let extra = unfused.total_s() - fused.total_s();
        assert!(extra > memory_s * 0.9, "{extra} vs {memory_s}");
    }
}
