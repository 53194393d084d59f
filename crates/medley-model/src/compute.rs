//! The thin trait between medley and a tensor library.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::ModelError;

/// A dense row-major `f32` tensor in host memory: what crosses stages, the network and disk.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl HostTensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        HostTensor { shape, data }
    }

    pub fn zeros(shape: Vec<usize>) -> Self {
        let numel = shape.iter().product();
        HostTensor { shape, data: vec![0.0; numel] }
    }

    /// Adds `other`, of the same shape, element by element.
    pub fn add_from(&mut self, other: &HostTensor) {
        debug_assert_eq!(self.shape, other.shape);
        self.data.iter_mut().zip(&other.data).for_each(|(sum, value)| *sum += value);
    }

    /// Checks the shape before the data is trusted: received tensors come from other processes.
    pub fn expect_shape(&self, what: &str, expected: &[usize]) -> Result<(), ModelError> {
        if self.shape == expected && self.data.len() == expected.iter().product::<usize>() {
            return Ok(());
        }
        Err(ModelError::Shape { what: what.into(), expected: expected.to_vec(), got: self.shape.clone() })
    }
}

/// What `micro_batch`'s forward left in `pending` for its backward.
pub(crate) fn take_pending<T>(pending: &mut HashMap<u32, T>, micro_batch: u32) -> Result<T, ModelError> {
    let reason = "backward before its forward".into();
    pending.remove(&micro_batch).ok_or(ModelError::MicroBatch { micro_batch, reason })
}

/// The samples of one micro-batch: `batch` rows of `seq` input tokens and their next-token targets.
#[derive(Clone, Debug, PartialEq)]
pub struct MicroBatch {
    pub batch: usize,
    pub seq: usize,
    pub tokens: Vec<u32>,
    pub targets: Vec<u32>,
    /// Multiplies the summed token losses: 1 / (tokens in the global batch), so that summing every
    /// micro-batch's loss and gradients over every replica gives the global mean.
    pub loss_scale: f32,
}

/// What a stage's forward pass produces.
#[derive(Clone, Debug, PartialEq)]
pub enum StageOutput {
    /// Hidden states for the next stage, `[batch, seq, hidden]`.
    Activations(HostTensor),
    /// The last stage's scaled loss for the micro-batch.
    Loss(f64),
}

/// One pipeline stage's compute on one tensor library. Parameters and gradients are host
/// tensors in the canonical order of [`crate::params::stage_params`].
pub trait StageCompute: Send {
    /// Replaces the stage's parameters (after an optimizer step, a load or at the start).
    fn load_parameters(&mut self, params: &[HostTensor]) -> Result<(), ModelError>;

    /// Runs the forward pass of `micro_batch`: from its tokens on the first stage, from `input`
    /// activations otherwise. Keeps what the backward pass needs until it runs.
    fn forward(
        &mut self,
        micro_batch: u32,
        batch: &MicroBatch,
        input: Option<HostTensor>,
    ) -> Result<StageOutput, ModelError>;

    /// Runs the backward pass of `micro_batch` from `upstream`, the loss gradient of this stage's
    /// output (none on the last stage, whose output is the loss). Adds the parameter gradients
    /// into `grads` and returns the gradient of the input activations (none on the first stage).
    fn backward(
        &mut self,
        micro_batch: u32,
        upstream: Option<HostTensor>,
        grads: &mut [HostTensor],
    ) -> Result<Option<HostTensor>, ModelError>;
}

/// A boxed stage is a stage: the constructors return them boxed, whichever device they chose.
impl<T: StageCompute + ?Sized> StageCompute for Box<T> {
    fn load_parameters(&mut self, params: &[HostTensor]) -> Result<(), ModelError> {
        (**self).load_parameters(params)
    }

    fn forward(
        &mut self,
        micro_batch: u32,
        batch: &MicroBatch,
        input: Option<HostTensor>,
    ) -> Result<StageOutput, ModelError> {
        (**self).forward(micro_batch, batch, input)
    }

    fn backward(
        &mut self,
        micro_batch: u32,
        upstream: Option<HostTensor>,
        grads: &mut [HostTensor],
    ) -> Result<Option<HostTensor>, ModelError> {
        (**self).backward(micro_batch, upstream, grads)
    }
}
