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
    Some(Tensor::from_primitive::<CpuAutodiff>(swiglu_autodiff(on_cpu(gate)?, on_cpu(up)?)))
}

/// RMSNorm over the last dimension of `x` (`[rows, hidden]`) times `gain` (`[hidden]`), where
/// both are f32 autodiff CPU tensors.
pub(crate) fn fused_rms_norm(x: &Tensor<2>, gain: &Tensor<1>, eps: f32) -> Option<Tensor<2>> {
    Some(Tensor::from_primitive::<CpuAutodiff>(rms_norm_autodiff(on_cpu(x)?, on_cpu(gain)?, eps)))
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
        let [gate_node, up_node] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        let ((gate, shape), (up, _), (grad, _)) = (values(&ops.state.0), values(&ops.state.1), values(&grad));
        let n = slice(&gate).len();
        let (mut gate_grad, mut up_grad) = (vec![0.0; n], vec![0.0; n]);
        kernels::swiglu_backward(slice(&gate), slice(&up), slice(&grad), &mut gate_grad, &mut up_grad);
        let mut register = |node: Option<NodeId>, values| {
            if let Some(id) = node {
                grads.register::<Flex>(id, tensor_of(values, shape.clone()));
            }
        };
        register(gate_node.map(|node| node.id), gate_grad);
        register(up_node.map(|node| node.id), up_grad);
    }
}

fn swiglu_autodiff(gate: FloatTensor<CpuAutodiff>, up: FloatTensor<CpuAutodiff>) -> FloatTensor<CpuAutodiff> {
    let prepared = SwigluBackward.prepare::<NoCheckpointing>([gate.node(), up.node()]).compute_bound().stateful();
    let (gate, up) = (gate.primitive().clone(), up.primitive().clone());
    match prepared {
        OpsKind::Tracked(prep) => {
            let out = swiglu_flex(&gate, &up);
            prep.finish((gate, up), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(swiglu_flex(&gate, &up)),
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
        let [x_node, gain_node] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        let ((x, shape), (gain, gain_shape), (grad, _)) = (values(&ops.state.0), values(&ops.state.1), values(&grad));
        let (mut x_grad, mut gain_grad) = (vec![0.0; slice(&x).len()], vec![0.0; slice(&gain).len()]);
        kernels::rms_norm_rows_backward(slice(&x), slice(&gain), self.eps, slice(&grad), &mut x_grad, &mut gain_grad);
        if let Some(node) = x_node {
            grads.register::<Flex>(node.id, tensor_of(x_grad, shape));
        }
        if let Some(node) = gain_node {
            grads.register::<Flex>(node.id, tensor_of(gain_grad, gain_shape));
        }
    }
}

fn rms_norm_autodiff(
    x: FloatTensor<CpuAutodiff>,
    gain: FloatTensor<CpuAutodiff>,
    eps: f32,
) -> FloatTensor<CpuAutodiff> {
    let prepared =
        RmsNormBackward { eps }.prepare::<NoCheckpointing>([x.node(), gain.node()]).compute_bound().stateful();
    let (x, gain) = (x.primitive().clone(), gain.primitive().clone());
    match prepared {
        OpsKind::Tracked(prep) => {
            let out = rms_norm_flex(&x, &gain, eps);
            prep.finish((x, gain), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(rms_norm_flex(&x, &gain, eps)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;
    use burn::tensor::activation::{silu, softmax};

    use crate::cpu::stage::rms_norm_composite;

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
    fn a_constant_input_gets_no_gradient_and_the_other_still_does() {
        let (gate, up) = (leaf([4, 4], 3.0, 0.0), constant([4, 4], 1.0, 2.0));
        let grads = fused_swiglu(&gate, &up).expect("fused").sum().backward();
        assert!(gate.grad(&grads).is_some());
        assert!(up.grad(&grads).is_none());
    }
}
