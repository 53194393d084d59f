//! [`StageCompute`] on burn: the flex CPU backend with autodiff today; the same model code runs
//! on burn's CUDA and ROCm devices once those features can be built.

use std::collections::HashMap;
use std::ops::Range;

use burn::tensor::activation::{log_softmax, silu, softmax};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

use crate::params::{LAYER_TENSORS, ParamSpec, stage_params};
use crate::{HostTensor, MicroBatch, ModelConfig, ModelError, StageCompute, StageOutput};

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

pub struct BurnStage {
    config: ModelConfig,
    layers: Range<usize>,
    /// The stage's parameters, by name and shape, in the order `load_parameters` takes them.
    specs: Vec<ParamSpec>,
    device: Device,
    params: Vec<DeviceParam>,
    pending: HashMap<u32, Pending>,
    /// RoPE tables, `[seq, head_dim]` each, built once.
    rope_cos: Tensor<2>,
    rope_sin: Tensor<2>,
    /// True above the diagonal: the future positions attention must not see.
    causal_mask: Tensor<2, Bool>,
}

impl BurnStage {
    /// A stage holding `layers` on burn's CPU backend, with autodiff.
    pub fn new(config: &ModelConfig, layers: Range<usize>) -> Self {
        let device = Device::flex().autodiff();
        let (rope_cos, rope_sin) = rope_tables(config, &device);
        let causal_mask = Tensor::<2, Bool>::tril_mask([config.seq_len, config.seq_len], 0, &device);
        BurnStage {
            config: config.clone(),
            specs: stage_params(config, layers.clone()),
            layers,
            device,
            params: Vec::new(),
            pending: HashMap::new(),
            rope_cos,
            rope_sin,
            causal_mask,
        }
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

    fn embed(&self, batch: &MicroBatch) -> Tensor<3> {
        let ids: Vec<i64> = batch.tokens.iter().map(|&t| i64::from(t)).collect();
        let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [batch.tokens.len()]), &self.device);
        self.matrix(0).select(0, ids).reshape([batch.batch, batch.seq, self.config.hidden])
    }

    fn decoder_layer(&self, layer_offset: usize, x: Tensor<3>) -> Tensor<3> {
        let base = self.layer_base(layer_offset);
        let [b, t, d] = x.dims();
        let (h, kv, hd) = (self.config.n_heads, self.config.n_kv_heads, self.config.head_dim());
        let a = rms_norm(x.clone().reshape([b * t, d]), self.vector(base), self.config.norm_eps);
        let heads = |y: Tensor<2>, n: usize| y.reshape([b, t, n, hd]).swap_dims(1, 2);
        let q = self.rope(heads(a.clone().matmul(self.matrix(base + 1)), h));
        let k = self.repeat_kv(self.rope(heads(a.clone().matmul(self.matrix(base + 2)), kv)));
        let v = self.repeat_kv(heads(a.matmul(self.matrix(base + 3)), kv));
        let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(1.0 / (hd as f32).sqrt());
        let mask = self.causal_mask.clone().slice([0..t, 0..t]).reshape([1, 1, t, t]).expand([b, h, t, t]);
        let probs = softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3);
        let attn = probs.matmul(v).swap_dims(1, 2).reshape([b * t, d]).matmul(self.matrix(base + 4));
        let x = x + attn.reshape([b, t, d]);
        let m = rms_norm(x.clone().reshape([b * t, d]), self.vector(base + 5), self.config.norm_eps);
        let gated = silu(m.clone().matmul(self.matrix(base + 6))) * m.matmul(self.matrix(base + 7));
        x + gated.matmul(self.matrix(base + 8)).reshape([b, t, d])
    }

    /// Rotary position embedding (rotate-half form) of `[batch, heads, seq, head_dim]`.
    fn rope(&self, x: Tensor<4>) -> Tensor<4> {
        let [_, _, t, hd] = x.dims();
        let cos = self.rope_cos.clone().slice([0..t, 0..hd]).reshape([1, 1, t, hd]);
        let sin = self.rope_sin.clone().slice([0..t, 0..hd]).reshape([1, 1, t, hd]);
        let halves = x.clone().chunk(2, 3);
        let rotated = Tensor::cat(vec![halves[1].clone().neg(), halves[0].clone()], 3);
        x * cos + rotated * sin
    }

    /// Grouped-query attention: each key/value head serves `n_heads / n_kv_heads` query heads.
    fn repeat_kv(&self, x: Tensor<4>) -> Tensor<4> {
        let [b, kv, t, hd] = x.dims();
        let repeat = self.config.n_heads / kv;
        if repeat == 1 {
            return x;
        }
        x.reshape([b, kv, 1, t, hd]).repeat_dim(2, repeat).reshape([b, kv * repeat, t, hd])
    }

    /// The scaled summed cross-entropy of the last stage's hidden states against the targets.
    fn loss(&self, x: Tensor<3>, batch: &MicroBatch) -> Tensor<1> {
        let [b, t, d] = x.dims();
        let n = self.params.len();
        let x = rms_norm(x.reshape([b * t, d]), self.vector(n - 2), self.config.norm_eps);
        let log_probs = log_softmax(x.matmul(self.matrix(n - 1)), 1);
        let targets: Vec<i64> = batch.targets.iter().map(|&t| i64::from(t)).collect();
        let targets = Tensor::<2, Int>::from_data(TensorData::new(targets, [b * t, 1]), &self.device);
        log_probs.gather(1, targets).sum().mul_scalar(-batch.loss_scale)
    }

    fn host_to_device<const D: usize>(&self, tensor: &HostTensor) -> Tensor<D> {
        Tensor::from_data(TensorData::new(tensor.data.clone(), tensor.shape.clone()), &self.device)
    }
}

fn device_to_host<const D: usize>(tensor: Tensor<D>) -> Result<HostTensor, ModelError> {
    let shape = tensor.dims().to_vec();
    let data = tensor.into_data().try_into_vec::<f32>().map_err(|err| ModelError::Compute(format!("{err:?}")))?;
    Ok(HostTensor::new(shape, data))
}

/// RMSNorm over the last dimension of `[rows, hidden]`.
fn rms_norm(x: Tensor<2>, gain: Tensor<1>, eps: f32) -> Tensor<2> {
    let rms = x.clone().square().mean_dim(1).add_scalar(eps).sqrt();
    x / rms * gain.unsqueeze::<2>()
}

/// Cosine and sine tables `[seq, head_dim]` for rotate-half RoPE: frequency i serves dimensions i
/// and i + head_dim / 2.
fn rope_tables(config: &ModelConfig, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let (seq, hd) = (config.seq_len, config.head_dim());
    let half = hd / 2;
    let mut cos = Vec::with_capacity(seq * hd);
    let mut sin = Vec::with_capacity(seq * hd);
    for pos in 0..seq {
        for dim in 0..hd {
            let freq = config.rope_theta.powf(-((dim % half) as f32) / half as f32);
            let angle = pos as f32 * freq;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    let table = |values| Tensor::from_data(TensorData::new(values, [seq, hd]), device);
    (table(cos), table(sin))
}

impl StageCompute for BurnStage {
    fn load_parameters(&mut self, params: &[HostTensor]) -> Result<(), ModelError> {
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

    fn forward(
        &mut self,
        micro_batch: u32,
        batch: &MicroBatch,
        input: Option<HostTensor>,
    ) -> Result<StageOutput, ModelError> {
        let bad = |reason: &str| ModelError::MicroBatch { micro_batch, reason: reason.into() };
        if self.params.is_empty() {
            return Err(bad("the stage has no parameters loaded"));
        }
        if batch.seq > self.config.seq_len {
            return Err(bad("its sequences are longer than the model's sequence length"));
        }
        let input = match (self.is_first(), input) {
            (true, None) => None,
            (false, Some(activations)) => {
                activations.expect_shape("input activations", &[batch.batch, batch.seq, self.config.hidden])?;
                Some(self.host_to_device::<3>(&activations).require_grad())
            }
            (true, Some(_)) => return Err(bad("the first stage takes tokens, not activations")),
            (false, None) => return Err(bad("a stage after the first needs input activations")),
        };
        let mut x = match &input {
            Some(activations) => activations.clone(),
            None => self.embed(batch),
        };
        for layer_offset in 0..self.layers.len() {
            x = self.decoder_layer(layer_offset, x);
        }
        let (output, result) = if self.is_last() {
            let loss = self.loss(x, batch);
            let value = loss.clone().into_scalar::<f32>();
            (PendingOutput::Loss(loss), StageOutput::Loss(f64::from(value)))
        } else {
            (PendingOutput::Activations(x.clone()), StageOutput::Activations(device_to_host(x.detach())?))
        };
        self.pending.insert(micro_batch, Pending { input, output });
        Ok(result)
    }

    fn backward(
        &mut self,
        micro_batch: u32,
        upstream: Option<HostTensor>,
        grads: &mut [HostTensor],
    ) -> Result<Option<HostTensor>, ModelError> {
        let bad = |reason: &str| ModelError::MicroBatch { micro_batch, reason: reason.into() };
        let pending = self.pending.remove(&micro_batch).ok_or_else(|| bad("backward before its forward"))?;
        let gradients = match (pending.output, upstream) {
            (PendingOutput::Loss(loss), None) => loss.backward(),
            (PendingOutput::Activations(output), Some(upstream)) => {
                upstream.expect_shape("output gradient", &output.dims())?;
                // d/d(output) of sum(output * upstream) is exactly `upstream`.
                (output * self.host_to_device::<3>(&upstream)).sum().backward()
            }
            (PendingOutput::Loss(_), Some(_)) => {
                return Err(bad("the last stage's output is the loss: no upstream gradient"));
            }
            (PendingOutput::Activations(_), None) => {
                return Err(bad("a stage before the last needs the output gradient"));
            }
        };
        if grads.len() != self.params.len() {
            return Err(bad("the gradient accumulators do not match the stage's parameters"));
        }
        for (param, acc) in self.params.iter().zip(grads.iter_mut()) {
            let grad = match param {
                DeviceParam::Vector(tensor) => tensor.grad(&gradients).map(device_to_host),
                DeviceParam::Matrix(tensor) => tensor.grad(&gradients).map(device_to_host),
            };
            if let Some(grad) = grad.transpose()? {
                acc.data.iter_mut().zip(&grad.data).for_each(|(sum, g)| *sum += g);
            }
        }
        match pending.input {
            Some(input) => {
                let grad = input.grad(&gradients).ok_or_else(|| bad("the input activations got no gradient"))?;
                Ok(Some(device_to_host(grad)?))
            }
            None => Ok(None),
        }
    }
}
