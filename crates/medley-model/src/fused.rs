//! burn 0.22 operations on the CPU backend (flex, under autodiff) computed by [`crate::kernels`]
//! in one pass each, with their own backward steps: softmax over the last dimension and the
//! SwiGLU gate and RMSNorm. On tensors that live anywhere else each returns `None`, and the
//! stage composes the function from burn's operations.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use burn_flex::FlexTensor;

use crate::kernels;

/// The autodiff CPU backend the stage's tensors live on.
type CpuAutodiff = Autodiff<Flex, NoCheckpointing>;

/// Softmax over the last dimension, where `x` is an f32 autodiff CPU tensor.
pub(crate) fn fused_softmax_last<const D: usize>(x: &Tensor<D>) -> Option<Tensor<D>> {
    Some(Tensor::from_primitive::<CpuAutodiff>(softmax_autodiff(on_cpu(x)?)))
}

/// SwiGLU's gate, `silu(gate) * up`, where both are f32 autodiff CPU tensors.
pub(crate) fn fused_swiglu<const D: usize>(gate: &Tensor<D>, up: &Tensor<D>) -> Option<Tensor<D>> {
    let inputs = (on_cpu(gate)?, on_cpu(up)?);
    Some(Tensor::from_primitive::<CpuAutodiff>(with_two_inputs(SwigluBackward, inputs, swiglu_flex)))
}

/// RMSNorm over the last dimension of `x` (`[rows, hidden]`) times `gain` (`[hidden]`), where
/// both are f32 autodiff CPU tensors.
pub(crate) fn fused_rms_norm(x: &Tensor<2>, gain: &Tensor<1>, eps: f32) -> Option<Tensor<2>> {
    let inputs = (on_cpu(x)?, on_cpu(gain)?);
    let norm = |x: &FlexTensor, gain: &FlexTensor| rms_norm_flex(x, gain, eps);
    Some(Tensor::from_primitive::<CpuAutodiff>(with_two_inputs(RmsNormBackward { eps }, inputs, norm)))
}

/// Rotary position embedding (rotate-half form) of `x` (`[batch, tokens, heads, head_dim]`)
/// with the constant tables `cos` and `sin` (`[1, tokens, 1, head_dim]`), where all three are f32
/// autodiff CPU tensors.
pub(crate) fn fused_rope(x: &Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Option<Tensor<4>> {
    let tables = (on_cpu(cos)?.into_primitive(), on_cpu(sin)?.into_primitive());
    Some(Tensor::from_primitive::<CpuAutodiff>(rope_autodiff(on_cpu(x)?, tables)))
}

/// The autodiff CPU tensor behind `x`, if it is one and holds f32.
fn on_cpu<const D: usize>(x: &Tensor<D>) -> Option<FloatTensor<CpuAutodiff>> {
    if x.dtype() != DType::F32 {
        return None;
    }
    x.clone().try_into_primitive::<CpuAutodiff>().ok()
}

/// The contiguous `f32` elements of `x`.
fn values(x: &FlexTensor) -> (FlexTensor, Vec<usize>) {
    let contiguous = x.to_contiguous();
    let shape = contiguous.layout().shape().to_vec();
    (contiguous, shape)
}

fn slice(x: &FlexTensor) -> &[f32] {
    x.as_slice::<f32>().expect("an f32 tensor made contiguous has a contiguous f32 slice")
}

fn tensor_of(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// The row softmax of `x` over its last dimension.
fn softmax_flex(x: &FlexTensor) -> FlexTensor {
    let (x, shape) = values(x);
    let mut y = vec![0.0; slice(&x).len()];
    kernels::softmax_rows(slice(&x), &mut y, shape.last().copied().unwrap_or(1));
    tensor_of(y, shape)
}

#[derive(Debug)]
struct SoftmaxBackward;

impl Backward<Flex, 1> for SoftmaxBackward {
    /// The forward's output.
    type State = FlexTensor;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        let Some(parent) = parent else { return };
        let (grad, shape) = values(&grad);
        let y = ops.state.to_contiguous();
        let mut dx = vec![0.0; slice(&y).len()];
        kernels::softmax_rows_backward(slice(&y), slice(&grad), &mut dx, shape.last().copied().unwrap_or(1));
        grads.register::<Flex>(parent.id, tensor_of(dx, shape));
    }
}

fn softmax_autodiff(x: FloatTensor<CpuAutodiff>) -> FloatTensor<CpuAutodiff> {
    match SoftmaxBackward.prepare::<NoCheckpointing>([x.node()]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let y = softmax_flex(x.primitive());
            prep.finish(y.clone(), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(softmax_flex(x.primitive())),
    }
}

/// Registers `values` (of `shape`) as the gradient of the parent `node`, if it takes one.
fn register(grads: &mut Gradients, node: Option<NodeId>, values: Vec<f32>, shape: Vec<usize>) {
    if let Some(id) = node {
        grads.register::<Flex>(id, tensor_of(values, shape));
    }
}

/// `forward` of two inputs under autodiff, the inputs kept for `backward`'s step.
fn with_two_inputs<B>(
    backward: B,
    (a, b): (FloatTensor<CpuAutodiff>, FloatTensor<CpuAutodiff>),
    forward: impl Fn(&FlexTensor, &FlexTensor) -> FlexTensor,
) -> FloatTensor<CpuAutodiff>
where
    B: Backward<Flex, 2, State = (FlexTensor, FlexTensor)>,
{
    let prepared = backward.prepare::<NoCheckpointing>([a.node(), b.node()]).compute_bound().stateful();
    let inputs = (a.primitive().clone(), b.primitive().clone());
    match prepared {
        OpsKind::Tracked(prep) => {
            let out = forward(&inputs.0, &inputs.1);
            prep.finish(inputs, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(&inputs.0, &inputs.1)),
    }
}

fn swiglu_flex(gate: &FlexTensor, up: &FlexTensor) -> FlexTensor {
    let ((gate, shape), (up, _)) = (values(gate), values(up));
    let mut out = vec![0.0; slice(&gate).len()];
    kernels::swiglu(slice(&gate), slice(&up), &mut out);
    tensor_of(out, shape)
}

#[derive(Debug)]
struct SwigluBackward;

impl Backward<Flex, 2> for SwigluBackward {
    /// The forward's inputs, gate and up.
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [gate_node, up_node] = ops.parents.map(|node| node.map(|node| node.id));
        let grad = grads.consume::<Flex>(&ops.node);
        let ((gate, shape), (up, _), (grad, _)) = (values(&ops.state.0), values(&ops.state.1), values(&grad));
        let n = slice(&gate).len();
        let (mut gate_grad, mut up_grad) = (vec![0.0; n], vec![0.0; n]);
        kernels::swiglu_backward(slice(&gate), slice(&up), slice(&grad), &mut gate_grad, &mut up_grad);
        register(grads, gate_node, gate_grad, shape.clone());
        register(grads, up_node, up_grad, shape);
    }
}

fn rms_norm_flex(x: &FlexTensor, gain: &FlexTensor, eps: f32) -> FlexTensor {
    let ((x, shape), (gain, _)) = (values(x), values(gain));
    let mut out = vec![0.0; slice(&x).len()];
    kernels::rms_norm_rows(slice(&x), slice(&gain), eps, &mut out);
    tensor_of(out, shape)
}

#[derive(Debug)]
struct RmsNormBackward {
    eps: f32,
}

impl Backward<Flex, 2> for RmsNormBackward {
    /// The forward's inputs, rows and gain.
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_node, gain_node] = ops.parents.map(|node| node.map(|node| node.id));
        let grad = grads.consume::<Flex>(&ops.node);
        let ((x, shape), (gain, gain_shape), (grad, _)) = (values(&ops.state.0), values(&ops.state.1), values(&grad));
        let (mut x_grad, mut gain_grad) = (vec![0.0; slice(&x).len()], vec![0.0; slice(&gain).len()]);
        kernels::rms_norm_rows_backward(slice(&x), slice(&gain), self.eps, slice(&grad), &mut x_grad, &mut gain_grad);
        register(grads, x_node, x_grad, shape);
        register(grads, gain_node, gain_grad, gain_shape);
    }
}

/// `x` (`[batch, tokens, heads, head_dim]`) rotated by `tables`, or by their adjoint.
fn rope_flex(x: &FlexTensor, (cos, sin): &(FlexTensor, FlexTensor), transpose: bool) -> FlexTensor {
    let ((x, shape), (cos, _), (sin, _)) = (values(x), values(cos), values(sin));
    let mut out = vec![0.0; slice(&x).len()];
    let (heads, head_dim) = (shape[2], shape[3]);
    kernels::rope(slice(&x), slice(&cos), slice(&sin), heads, head_dim, transpose, &mut out);
    tensor_of(out, shape)
}

#[derive(Debug)]
struct RopeBackward;

impl Backward<Flex, 1> for RopeBackward {
    /// The cosine and sine tables.
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        if let Some(node) = parent {
            grads.register::<Flex>(node.id, rope_flex(&grad, &ops.state, true));
        }
    }
}

fn rope_autodiff(x: FloatTensor<CpuAutodiff>, tables: (FlexTensor, FlexTensor)) -> FloatTensor<CpuAutodiff> {
    match RopeBackward.prepare::<NoCheckpointing>([x.node()]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let out = rope_flex(x.primitive(), &tables, false);
            prep.finish(tables, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(rope_flex(x.primitive(), &tables, false)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;
    use burn::tensor::activation::{silu, softmax};

    use crate::cpu::stage::{rms_norm_composite, rope_composite};

    fn device() -> Device {
        Device::flex().autodiff()
    }

    /// A constant of `shape` with deterministic, varied values around zero times `scale`.
    fn constant<const D: usize>(shape: [usize; D], scale: f32, seed: f32) -> Tensor<D> {
        let n = shape.iter().product::<usize>();
        let values: Vec<f32> = (0..n).map(|i| ((i as f32 + seed) * 0.7).sin() * scale).collect();
        Tensor::<D>::from_data(TensorData::new(values, shape), &device())
    }

    /// The same values as a leaf that takes gradients.
    fn leaf<const D: usize>(shape: [usize; D], scale: f32, seed: f32) -> Tensor<D> {
        constant(shape, scale, seed).require_grad()
    }

    fn floats<const D: usize>(x: Tensor<D>) -> Vec<f32> {
        x.into_data().try_into_vec::<f32>().expect("f32 data")
    }

    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{what}[{i}]: {g} vs {w}");
        }
    }

    #[test]
    fn the_stage_device_takes_the_fused_path() {
        assert!(on_cpu(&leaf([2, 3], 1.0, 0.0)).is_some(), "an autodiff CPU tensor must reach the fused kernels");
    }

    #[test]
    fn fused_softmax_matches_burn_in_value_and_gradient() {
        let weights = constant([2, 3, 5, 7], 1.0, 11.0);
        let run = |fused: bool| {
            let x = leaf([2, 3, 5, 7], 6.0, 0.0);
            let y = if fused { fused_softmax_last(&x).expect("fused") } else { softmax(x.clone(), 3) };
            let grads = (y.clone() * weights.clone()).sum().backward();
            (floats(y), floats(x.grad(&grads).expect("x has a gradient")))
        };
        let ((y, dx), (want_y, want_dx)) = (run(true), run(false));
        assert_close(&y, &want_y, "softmax");
        assert_close(&dx, &want_dx, "softmax gradient");
    }

    #[test]
    fn fused_swiglu_matches_burn_in_value_and_gradients() {
        let weights = constant([6, 9], 1.0, 5.0);
        let run = |fused: bool| {
            let (gate, up) = (leaf([6, 9], 8.0, 0.0), leaf([6, 9], 2.0, 3.0));
            let y = if fused { fused_swiglu(&gate, &up).expect("fused") } else { silu(gate.clone()) * up.clone() };
            let grads = (y.clone() * weights.clone()).sum().backward();
            let grad = |x: &Tensor<2>| floats(x.grad(&grads).expect("an input has a gradient"));
            (floats(y.clone()), grad(&gate), grad(&up))
        };
        let ((y, d_gate, d_up), (want_y, want_gate, want_up)) = (run(true), run(false));
        assert_close(&y, &want_y, "swiglu");
        assert_close(&d_gate, &want_gate, "swiglu gate gradient");
        assert_close(&d_up, &want_up, "swiglu up gradient");
    }

    #[test]
    fn fused_rms_norm_matches_burn_in_value_and_gradients() {
        let weights = constant([5, 24], 1.0, 4.0);
        let run = |fused: bool| {
            let (x, gain) = (leaf([5, 24], 3.0, 0.0), leaf([24], 1.5, 9.0));
            let y = if fused {
                fused_rms_norm(&x, &gain, 1e-5).expect("fused")
            } else {
                rms_norm_composite(x.clone(), gain.clone(), 1e-5)
            };
            let grads = (y.clone() * weights.clone()).sum().backward();
            (
                floats(y),
                floats(x.grad(&grads).expect("x has a gradient")),
                floats(gain.grad(&grads).expect("gain has one")),
            )
        };
        let ((y, dx, d_gain), (want_y, want_dx, want_gain)) = (run(true), run(false));
        assert_close(&y, &want_y, "rms_norm");
        assert_close(&dx, &want_dx, "rms_norm input gradient");
        assert_close(&d_gain, &want_gain, "rms_norm gain gradient");
    }

    #[test]
    fn fused_rope_matches_burn_in_value_and_gradient() {
        let weights = constant([2, 5, 3, 8], 1.0, 2.0);
        let angles: Vec<f32> = (0..5 * 8).map(|i| (i / 8) as f32 * ((i % 4) as f32 + 1.0) * 0.2).collect();
        let table = |f: fn(f32) -> f32| {
            let values: Vec<f32> = angles.iter().map(|&a| f(a)).collect();
            Tensor::<4>::from_data(TensorData::new(values, [1, 5, 1, 8]), &device())
        };
        let (cos, sin) = (table(f32::cos), table(f32::sin));
        let run = |fused: bool| {
            let x = leaf([2, 5, 3, 8], 2.0, 0.0);
            let y = if fused {
                fused_rope(&x, &cos, &sin).expect("fused")
            } else {
                rope_composite(x.clone(), cos.clone(), sin.clone())
            };
            let grads = (y.clone() * weights.clone()).sum().backward();
            (floats(y), floats(x.grad(&grads).expect("x has a gradient")))
        };
        let ((y, dx), (want_y, want_dx)) = (run(true), run(false));
        assert_close(&y, &want_y, "rope");
        assert_close(&dx, &want_dx, "rope gradient");
    }

    #[test]
    fn a_constant_input_gets_no_gradient_and_the_other_still_does() {
        let (gate, up) = (leaf([4, 4], 3.0, 0.0), constant([4, 4], 1.0, 2.0));
        let grads = fused_swiglu(&gate, &up).expect("fused").sum().backward();
        assert!(gate.grad(&grads).is_some());
        assert!(up.grad(&grads).is_none());
    }
}
