//! [`StageCompute`] on burn with autodiff. This source is compiled twice: against burn 0.22 for
//! the CPU (`crate::cpu`) and against burn 0.21 for CUDA and ROCm (`crate::gpu`); `backend` is
//! each one's view of its burn version.

use std::collections::HashMap;
use std::ops::Range;

use burn::tensor::activation::{log_softmax, silu, softmax};
use burn::tensor::{Bool, Int};

mod gemm;
mod long_context;
mod tensor_parallel;

pub(crate) use gemm::matmul_seconds;
pub use long_context::ContextStage;
pub use tensor_parallel::TensorParallelStage;

use super::backend::{self, Device, Gradients, Tensor, TensorData, burn};
use crate::compute::take_pending;
use crate::params::{LAYER_TENSORS, ParamSpec, stage_params};
use crate::{ComputeDevice, HostTensor, MicroBatch, ModelConfig, ModelError, StageCompute, StageOutput};
use medley_spec::RopeScaling;

/// A parameter on the device: norm gains are vectors, everything else matrices.
enum DeviceParam {
    Vector(Tensor<1>),
    Matrix(Tensor<2>),
}

/// What a micro-batch's backward pass needs from its forward pass.
struct Pending {
    input: Option<Tensor<3>>,
    output: PendingOutput,
}

enum PendingOutput {
    Activations(Tensor<3>),
    Loss(Tensor<1>),
}

/// A stage's layers on the device and the pieces of a decoder layer around attention, which the
/// whole-sequence and the long-context stages share.
struct Weights {
    config: ModelConfig,
    layers: Range<usize>,
    /// The stage's parameters, by name and shape, in the order `load_parameters` takes them.
    specs: Vec<ParamSpec>,
    device: Device,
    params: Vec<DeviceParam>,
    /// RoPE tables, `[seq, head_dim]` each, built once.
    rope_cos: Tensor<2>,
    rope_sin: Tensor<2>,
}

/// The rotation of a run of positions, `[1, tokens, 1, head_dim]` each.
struct Rotation {
    cos: Tensor<4>,
    sin: Tensor<4>,
}

impl Weights {
    fn new(config: &ModelConfig, layers: Range<usize>, device: ComputeDevice) -> Result<Self, ModelError> {
        Weights::with_specs(config, layers.clone(), stage_params(config, layers), device)
    }

    /// The stage holding `layers` as `specs` give its parameters (a tensor-parallel member's
    /// shards).
    fn with_specs(
        config: &ModelConfig,
        layers: Range<usize>,
        specs: Vec<ParamSpec>,
        device: ComputeDevice,
    ) -> Result<Self, ModelError> {
        let device = backend::device(device)?;
        let (rope_cos, rope_sin) = rope_tables(config, &device);
        Ok(Weights { config: config.clone(), specs, layers, device, params: Vec::new(), rope_cos, rope_sin })
    }

    fn is_first(&self) -> bool {
        self.layers.start == 0
    }

    fn is_last(&self) -> bool {
        self.layers.end == self.config.n_layers
    }

    fn vector(&self, idx: usize) -> Tensor<1> {
        match &self.params[idx] {
            DeviceParam::Vector(tensor) => tensor.clone(),
            DeviceParam::Matrix(_) => unreachable!("parameter {idx} is a matrix by construction"),
        }
    }

    fn matrix(&self, idx: usize) -> Tensor<2> {
        match &self.params[idx] {
            DeviceParam::Matrix(tensor) => tensor.clone(),
            DeviceParam::Vector(_) => unreachable!("parameter {idx} is a vector by construction"),
        }
    }

    /// Index of the first parameter of the stage's `layer_offset`-th layer.
    fn layer_base(&self, layer_offset: usize) -> usize {
        usize::from(self.is_first()) + LAYER_TENSORS.len() * layer_offset
    }

    fn load(&mut self, params: &[HostTensor]) -> Result<(), ModelError> {
        if self.specs.len() != params.len() {
            return Err(ModelError::Shape {
                what: "the stage's parameter list".into(),
                expected: vec![self.specs.len()],
                got: vec![params.len()],
            });
        }
        self.params = self
            .specs
            .iter()
            .zip(params)
            .map(|(spec, param)| {
                param.expect_shape(&spec.name, &spec.shape)?;
                Ok(match spec.shape.len() {
                    1 => DeviceParam::Vector(self.host_to_device::<1>(param).require_grad()),
                    _ => DeviceParam::Matrix(self.host_to_device::<2>(param).require_grad()),
                })
            })
            .collect::<Result<_, ModelError>>()?;
        Ok(())
    }

    /// The embeddings of `tokens`, `batch` rows of `seq` each.
    fn embed(&self, tokens: &[u32], batch: usize, seq: usize) -> Tensor<3> {
        let ids = self.int_tensor(tokens.iter().map(|&t| i64::from(t)).collect());
        self.matrix(0).select(0, ids).reshape([batch, seq, self.config.hidden])
    }

    fn int_tensor(&self, values: Vec<i64>) -> Tensor<1, Int> {
        let len = values.len();
        Tensor::<1, Int>::from_data(TensorData::new(values, [len]), &self.device)
    }

    /// The rotation of positions `0..seq`.
    fn rotation_prefix(&self, seq: usize) -> Rotation {
        let hd = self.config.head_dim();
        let table = |t: &Tensor<2>| t.clone().slice([0..seq, 0..hd]).reshape([1, seq, 1, hd]);
        Rotation { cos: table(&self.rope_cos), sin: table(&self.rope_sin) }
    }

    /// The rotation of the given positions, in their order.
    fn rotation_at(&self, positions: &[usize]) -> Rotation {
        let (seq, hd) = (positions.len(), self.config.head_dim());
        let ids = self.int_tensor(positions.iter().map(|&p| p as i64).collect());
        let table = |t: &Tensor<2>| t.clone().select(0, ids.clone()).reshape([1, seq, 1, hd]);
        Rotation { cos: table(&self.rope_cos), sin: table(&self.rope_sin) }
    }

    /// Layer `layer_offset`'s queries, keys and values of `x` (`[batch, tokens, hidden]`), with
    /// the rotation of the tokens' positions, each `[batch, tokens, heads, head_dim]`: as many
    /// heads as the stage's projections hold (a tensor-parallel member's share).
    fn project_qkv(&self, layer_offset: usize, x: Tensor<3>, rotation: &Rotation) -> [Tensor<4>; 3] {
        let base = self.layer_base(layer_offset);
        let [b, t, d] = x.dims();
        let hd = self.config.head_dim();
        let (wq, wk, wv) = (self.matrix(base + 1), self.matrix(base + 2), self.matrix(base + 3));
        let (h, kv) = (wq.dims()[1] / hd, wk.dims()[1] / hd);
        let a = rms_norm(x.reshape([b * t, d]), self.vector(base), self.config.norm_eps);
        let q = rope(a.clone().matmul(wq).reshape([b, t, h, hd]), rotation);
        let k = rope(a.clone().matmul(wk).reshape([b, t, kv, hd]), rotation);
        let v = a.matmul(wv).reshape([b, t, kv, hd]);
        [q, k, v]
    }

    /// Layer `layer_offset`'s output projection of `attention` (`[batch, tokens, heads,
    /// head_dim]`), `[batch · tokens, hidden]`.
    fn project_output(&self, layer_offset: usize, attention: Tensor<4>) -> Tensor<2> {
        let [b, t, h, hd] = attention.dims();
        attention.reshape([b * t, h * hd]).matmul(self.matrix(self.layer_base(layer_offset) + 4))
    }

    /// Layer `layer_offset`'s MLP block of `x` (`[rows, hidden]`), without the residual.
    fn mlp(&self, layer_offset: usize, x: Tensor<2>) -> Tensor<2> {
        let base = self.layer_base(layer_offset);
        let m = rms_norm(x, self.vector(base + 5), self.config.norm_eps);
        let gated = swiglu(m.clone().matmul(self.matrix(base + 6)), m.matmul(self.matrix(base + 7)));
        gated.matmul(self.matrix(base + 8))
    }

    /// The rest of layer `layer_offset` after attention: `attention` (`[batch, tokens, heads,
    /// head_dim]`) through the output projection onto the residual `x`, then the MLP block.
    fn finish_layer(&self, layer_offset: usize, x: Tensor<3>, attention: Tensor<4>) -> Tensor<3> {
        let [b, t, d] = x.dims();
        let x = x + self.project_output(layer_offset, attention).reshape([b, t, d]);
        x.clone() + self.mlp(layer_offset, x.reshape([b * t, d])).reshape([b, t, d])
    }

    /// The final norm and output head of `x` (`[rows, hidden]`): logits over the vocabulary the
    /// head holds.
    fn logits(&self, x: Tensor<2>) -> Tensor<2> {
        let n = self.params.len();
        rms_norm(x, self.vector(n - 2), self.config.norm_eps).matmul(self.matrix(n - 1))
    }

    /// The scaled summed cross-entropy of the last stage's hidden states against `targets`.
    fn loss(&self, x: Tensor<3>, targets: &[u32], loss_scale: f32) -> Tensor<1> {
        let [b, t, d] = x.dims();
        let log_probs = log_softmax(self.logits(x.reshape([b * t, d])), 1);
        let targets: Vec<i64> = targets.iter().map(|&t| i64::from(t)).collect();
        let targets = Tensor::<2, Int>::from_data(TensorData::new(targets, [b * t, 1]), &self.device);
        log_probs.gather(1, targets).sum().mul_scalar(-loss_scale)
    }

    fn host_to_device<const D: usize>(&self, tensor: &HostTensor) -> Tensor<D> {
        Tensor::from_data(TensorData::new(tensor.data.clone(), tensor.shape.clone()), &self.device)
    }

    /// Adds the parameters' gradients in `gradients` into `grads`.
    fn add_param_grads(&self, gradients: &Gradients, grads: &mut [HostTensor]) -> Result<(), ModelError> {
        for (param, acc) in self.params.iter().zip(grads.iter_mut()) {
            let grad = match param {
                DeviceParam::Vector(tensor) => tensor.grad(gradients).map(device_to_host),
                DeviceParam::Matrix(tensor) => tensor.grad(gradients).map(device_to_host),
            };
            if let Some(grad) = grad.transpose()? {
                acc.add_from(&grad);
            }
        }
        Ok(())
    }
}

pub struct BurnStage {
    weights: Weights,
    pending: HashMap<u32, Pending>,
    /// True above the diagonal: the future positions attention must not see.
    causal_mask: Tensor<2, Bool>,
}

impl BurnStage {
    /// A stage holding `layers` on `device`, with autodiff.
    pub fn new(config: &ModelConfig, layers: Range<usize>, device: ComputeDevice) -> Result<Self, ModelError> {
        let weights = Weights::new(config, layers, device)?;
        let causal_mask = Tensor::<2, Bool>::tril_mask([config.seq_len, config.seq_len], 0, &weights.device);
        Ok(BurnStage { weights, pending: HashMap::new(), causal_mask })
    }

    fn decoder_layer(&self, layer_offset: usize, x: Tensor<3>) -> Tensor<3> {
        let w = &self.weights;
        let [q, k, v] = w.project_qkv(layer_offset, x.clone(), &w.rotation_prefix(x.dims()[1]));
        w.finish_layer(layer_offset, x, causal_attention([q, k, v], &self.causal_mask))
    }
}

/// Causal grouped-query attention of `[batch, tokens, heads, head_dim]` queries over keys and
/// values of fewer heads, each serving consecutive query heads alike; `causal_mask` is true
/// above the diagonal, at least `tokens` square. The output is `[batch, tokens, heads, head_dim]`.
fn causal_attention([q, k, v]: [Tensor<4>; 3], causal_mask: &Tensor<2, Bool>) -> Tensor<4> {
    let [b, t, h, hd] = q.dims();
    let (q, k, v) = (q.swap_dims(1, 2), repeat_kv(k.swap_dims(1, 2), h), repeat_kv(v.swap_dims(1, 2), h));
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(1.0 / (hd as f32).sqrt());
    let mask = causal_mask.clone().slice([0..t, 0..t]).reshape([1, 1, t, t]).expand([b, h, t, t]);
    let probs = softmax_last(scores.mask_fill(mask, f32::NEG_INFINITY));
    probs.matmul(v).swap_dims(1, 2)
}

/// Grouped-query attention's keys or values `[batch, kv heads, tokens, head_dim]` repeated for
/// `heads` query heads, each KV head serving `heads / kv heads` consecutive ones.
fn repeat_kv(x: Tensor<4>, heads: usize) -> Tensor<4> {
    let [b, kv, t, hd] = x.dims();
    let repeat = heads / kv;
    if repeat == 1 {
        return x;
    }
    x.reshape([b, kv, 1, t, hd]).repeat_dim(2, repeat).reshape([b, kv * repeat, t, hd])
}

fn device_to_host<const D: usize>(tensor: Tensor<D>) -> Result<HostTensor, ModelError> {
    let shape = tensor.dims().to_vec();
    let data = backend::floats(tensor.into_data())?;
    Ok(HostTensor::new(shape, data))
}

/// Softmax over the last dimension: the backend's fused kernel where it has one.
fn softmax_last<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    backend::fused_softmax_last(&x).unwrap_or_else(|| softmax(x, D - 1))
}

/// SwiGLU's gate, `silu(gate) * up`: the backend's fused kernel where it has one.
fn swiglu(gate: Tensor<2>, up: Tensor<2>) -> Tensor<2> {
    backend::fused_swiglu(&gate, &up).unwrap_or_else(|| silu(gate) * up)
}

/// RMSNorm over the last dimension of `[rows, hidden]`: the backend's fused kernel where it has
/// one.
fn rms_norm(x: Tensor<2>, gain: Tensor<1>, eps: f32) -> Tensor<2> {
    backend::fused_rms_norm(&x, &gain, eps).unwrap_or_else(|| rms_norm_composite(x, gain, eps))
}

/// RMSNorm from burn's operations.
pub(crate) fn rms_norm_composite(x: Tensor<2>, gain: Tensor<1>, eps: f32) -> Tensor<2> {
    let rms = x.clone().square().mean_dim(1).add_scalar(eps).sqrt();
    x / rms * gain.unsqueeze::<2>()
}

/// Rotary position embedding (rotate-half form) of `[batch, tokens, heads, head_dim]`: the
/// backend's fused kernel where it has one.
fn rope(x: Tensor<4>, rotation: &Rotation) -> Tensor<4> {
    backend::fused_rope(&x, &rotation.cos, &rotation.sin)
        .unwrap_or_else(|| rope_composite(x, rotation.cos.clone(), rotation.sin.clone()))
}

/// Rotary position embedding from burn's operations.
pub(crate) fn rope_composite(x: Tensor<4>, cos: Tensor<4>, sin: Tensor<4>) -> Tensor<4> {
    let halves = x.clone().chunk(2, 3);
    let rotated = Tensor::cat(vec![halves[1].clone().neg(), halves[0].clone()], 3);
    x * cos + rotated * sin
}

/// Cosine and sine tables `[seq, head_dim]` for rotate-half RoPE: frequency i (Llama 3.1's
/// rescaled one where the model has it) serves dimensions i and i + head_dim / 2.
fn rope_tables(config: &ModelConfig, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let (seq, hd) = (config.seq_len, config.head_dim());
    let freqs = RopeScaling::inverse_frequencies(config.rope_scaling, config.rope_theta, hd as u32);
    let mut cos = Vec::with_capacity(seq * hd);
    let mut sin = Vec::with_capacity(seq * hd);
    for pos in 0..seq {
        for dim in 0..hd {
            let angle = (pos as f64 * freqs[dim % freqs.len()]) as f32;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    let table = |values| Tensor::from_data(TensorData::new(values, [seq, hd]), device);
    (table(cos), table(sin))
}

impl Weights {
    /// The stage's input: the tokens on the first stage (none here), else `input` of `shape`, on
    /// the device as a leaf.
    fn stage_input(
        &self,
        micro_batch: u32,
        input: Option<HostTensor>,
        shape: [usize; 3],
    ) -> Result<Option<Tensor<3>>, ModelError> {
        let input = self.checked_input(micro_batch, input, shape)?;
        Ok(input.map(|activations| self.host_to_device::<3>(&activations).require_grad()))
    }

    /// The stage's input checked: none on the first stage (it takes tokens), else `input` of
    /// `shape`.
    fn checked_input(
        &self,
        micro_batch: u32,
        input: Option<HostTensor>,
        shape: [usize; 3],
    ) -> Result<Option<HostTensor>, ModelError> {
        let bad = |reason: &str| ModelError::MicroBatch { micro_batch, reason: reason.into() };
        if self.params.is_empty() {
            return Err(bad("the stage has no parameters loaded"));
        }
        match (self.is_first(), input) {
            (true, None) => Ok(None),
            (false, Some(activations)) => {
                activations.expect_shape("input activations", &shape)?;
                Ok(Some(activations))
            }
            (true, Some(_)) => Err(bad("the first stage takes tokens, not activations")),
            (false, None) => Err(bad("a stage after the first needs input activations")),
        }
    }

    /// The stage's output `x`: the loss on the last stage, activations for the next otherwise.
    fn stage_output(
        &self,
        x: Tensor<3>,
        targets: &[u32],
        loss_scale: f32,
    ) -> Result<(PendingOutput, StageOutput), ModelError> {
        Ok(if self.is_last() {
            let loss = self.loss(x, targets, loss_scale);
            let value = backend::scalar(loss.clone());
            (PendingOutput::Loss(loss), StageOutput::Loss(f64::from(value)))
        } else {
            (PendingOutput::Activations(x.clone()), StageOutput::Activations(device_to_host(x.detach())?))
        })
    }

    /// The backward of the stage's output from `upstream`, plus `extra` (a sum of outputs times
    /// their gradients) when the output is not the graph's only one.
    fn output_backward(
        &self,
        micro_batch: u32,
        output: PendingOutput,
        upstream: Option<HostTensor>,
        extra: Option<Tensor<1>>,
    ) -> Result<Gradients, ModelError> {
        let bad = |reason: &str| ModelError::MicroBatch { micro_batch, reason: reason.into() };
        let objective = match (output, upstream) {
            (PendingOutput::Loss(loss), None) => loss,
            (PendingOutput::Activations(output), Some(upstream)) => {
                upstream.expect_shape("output gradient", &output.dims())?;
                // d/d(output) of sum(output * upstream) is exactly `upstream`.
                (output * self.host_to_device::<3>(&upstream)).sum()
            }
            (PendingOutput::Loss(_), Some(_)) => {
                return Err(bad("the last stage's output is the loss: no upstream gradient"));
            }
            (PendingOutput::Activations(_), None) => {
                return Err(bad("a stage before the last needs the output gradient"));
            }
        };
        Ok(match extra {
            Some(extra) => (objective + extra).backward(),
            None => objective.backward(),
        })
    }

    fn check_accumulators(&self, micro_batch: u32, grads: &[HostTensor]) -> Result<(), ModelError> {
        if grads.len() == self.params.len() {
            return Ok(());
        }
        let reason = "the gradient accumulators do not match the stage's parameters".into();
        Err(ModelError::MicroBatch { micro_batch, reason })
    }
}

/// The gradient of the stage's `input` leaf in `gradients`, for the previous stage.
fn input_gradient(
    micro_batch: u32,
    input: Option<Tensor<3>>,
    gradients: &Gradients,
) -> Result<Option<HostTensor>, ModelError> {
    let Some(input) = input else { return Ok(None) };
    let reason = "the input activations got no gradient".into();
    let grad = input.grad(gradients).ok_or(ModelError::MicroBatch { micro_batch, reason })?;
    Ok(Some(device_to_host(grad)?))
}

impl StageCompute for BurnStage {
    fn load_parameters(&mut self, params: &[HostTensor]) -> Result<(), ModelError> {
        self.weights.load(params)
    }

    fn forward(
        &mut self,
        micro_batch: u32,
        batch: &MicroBatch,
        input: Option<HostTensor>,
    ) -> Result<StageOutput, ModelError> {
        let w = &self.weights;
        if batch.seq > w.config.seq_len {
            let reason = "its sequences are longer than the model's sequence length".into();
            return Err(ModelError::MicroBatch { micro_batch, reason });
        }
        let input = w.stage_input(micro_batch, input, [batch.batch, batch.seq, w.config.hidden])?;
        let mut x = match &input {
            Some(activations) => activations.clone(),
            None => w.embed(&batch.tokens, batch.batch, batch.seq),
        };
        for layer_offset in 0..w.layers.len() {
            x = self.decoder_layer(layer_offset, x);
        }
        let (output, result) = w.stage_output(x, &batch.targets, batch.loss_scale)?;
        self.pending.insert(micro_batch, Pending { input, output });
        Ok(result)
    }

    fn backward(
        &mut self,
        micro_batch: u32,
        upstream: Option<HostTensor>,
        grads: &mut [HostTensor],
    ) -> Result<Option<HostTensor>, ModelError> {
        let w = &self.weights;
        let pending = take_pending(&mut self.pending, micro_batch)?;
        let gradients = w.output_backward(micro_batch, pending.output, upstream, None)?;
        w.check_accumulators(micro_batch, grads)?;
        w.add_param_grads(&gradients, grads)?;
        input_gradient(micro_batch, pending.input, &gradients)
    }
}
