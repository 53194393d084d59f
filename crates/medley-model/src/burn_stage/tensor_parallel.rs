//! [`StageCompute`] for one member of a tensor-parallel stage (see [`crate::tensor_parallel`]):
//! each attention and MLP block is its own autodiff graph, from the all-gathered sequence (a
//! leaf) to the member's partial sum, joined to the next by a reduce-scatter and the residual
//! add on the member's run of the sequence. The backward walks the blocks in reverse, each
//! all-gathering the run's gradient and reduce-scattering the gradient of its input.

use std::collections::HashMap;
use std::ops::Range;

use super::burn::tensor::Bool;
use super::{Tensor, TensorData, Weights, causal_attention, device_to_host};
use crate::compute::take_pending;
use crate::tensor_parallel::{Combine, SequenceRuns, TensorCollectives, TensorSeat};
use crate::{ComputeDevice, HostTensor, MicroBatch, ModelConfig, ModelError, StageCompute, StageOutput};

/// A block's graph: the all-gathered input (a leaf; none for the embedding) and the member's
/// partial output, `[batch · seq, width]`.
struct Block {
    input: Option<Tensor<3>>,
    output: Tensor<2>,
}

/// What a micro-batch's backward needs from its forward.
struct Pending {
    runs: SequenceRuns,
    embedding: Option<Block>,
    blocks: Vec<Block>,
    /// The output head's block and the loss gradient of its logits, `[batch · seq, vocab rows]`.
    head: Option<(Block, HostTensor)>,
}

/// One member of a tensor-parallel stage on burn.
pub struct TensorParallelStage {
    weights: Weights,
    seat: TensorSeat,
    collectives: Box<dyn TensorCollectives>,
    pending: HashMap<u32, Pending>,
    causal_mask: Tensor<2, Bool>,
}

impl TensorParallelStage {
    /// Member `seat` of a stage holding `layers`, exchanging through `collectives`.
    pub fn new(
        config: &ModelConfig,
        layers: Range<usize>,
        seat: TensorSeat,
        collectives: Box<dyn TensorCollectives>,
        device: ComputeDevice,
    ) -> Result<Self, ModelError> {
        let specs = seat.stage_params(config, layers.clone());
        let weights = Weights::with_specs(config, layers, specs, device)?;
        let causal_mask = Tensor::<2, Bool>::tril_mask([config.seq_len, config.seq_len], 0, &weights.device);
        Ok(TensorParallelStage { weights, seat, collectives, pending: HashMap::new(), causal_mask })
    }

    fn runs(&self, batch: usize, seq: usize) -> SequenceRuns {
        SequenceRuns { batch, runs: self.seat.sequence_runs(seq), width: self.weights.config.hidden }
    }

    /// Whole sequences from every member's run, `[batch, seq, hidden]`.
    fn gather(&mut self, runs: &SequenceRuns, run: &[f32]) -> Result<Vec<f32>, ModelError> {
        Ok(runs.to_sequence(&self.collectives.all_gather(run, &runs.counts())?))
    }

    /// [`Self::gather`] onto the device, as a leaf of the next block's graph.
    fn gather_leaf(&mut self, runs: &SequenceRuns, run: &[f32]) -> Result<Tensor<3>, ModelError> {
        let whole = self.gather(runs, run)?;
        let shape = [runs.batch, runs.seq(), runs.width];
        Ok(Tensor::<3>::from_data(TensorData::new(whole, shape), &self.weights.device).require_grad())
    }

    /// This member's run of the sum of every member's `partial` (`[batch · seq, hidden]`).
    fn scatter(&mut self, runs: &SequenceRuns, partial: Vec<f32>) -> Result<Vec<f32>, ModelError> {
        self.collectives.reduce_scatter(&runs.to_members(&partial), &runs.counts())
    }

    /// The vocabulary-parallel embedding of `tokens`: this member's rows looked up, zero for the
    /// others', `[batch · seq, hidden]`.
    fn embed(&self, tokens: &[u32]) -> Tensor<2> {
        let w = &self.weights;
        let rows = self.seat.vocab_rows(&w.config);
        let (ids, held): (Vec<i64>, Vec<f32>) = tokens
            .iter()
            .map(|&token| match rows.contains(&(token as usize)) {
                true => ((token as usize - rows.start) as i64, 1.0),
                false => (0, 0.0),
            })
            .unzip();
        let held = Tensor::<2>::from_data(TensorData::new(held, [tokens.len(), 1]), &w.device);
        w.matrix(0).select(0, w.int_tensor(ids)) * held
    }

    /// A block of layer `layer_offset` on the whole sequences `x`: attention, or the MLP.
    fn block(&self, layer_offset: usize, attention: bool, x: Tensor<3>) -> Tensor<2> {
        let w = &self.weights;
        let [b, t, d] = x.dims();
        if attention {
            let qkv = w.project_qkv(layer_offset, x, &w.rotation_prefix(t));
            w.project_output(layer_offset, causal_attention(qkv, &self.causal_mask))
        } else {
            w.mlp(layer_offset, x.reshape([b * t, d]))
        }
    }

    /// The vocabulary-parallel cross-entropy of `logits` (this member's vocabulary columns)
    /// against `targets`, scaled: the loss, the same on every member, and its gradient with
    /// respect to the logits.
    fn cross_entropy(
        &mut self,
        logits: HostTensor,
        targets: &[u32],
        scale: f32,
    ) -> Result<(f64, HostTensor), ModelError> {
        let rows = self.seat.vocab_rows(&self.weights.config);
        let width = rows.len();
        let by_token = || logits.data.chunks(width);
        let mut max: Vec<f32> = by_token().map(|row| row.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect();
        self.collectives.all_reduce(&mut max, Combine::Max)?;
        let mut norm: Vec<f32> = by_token().zip(&max).map(|(row, m)| row.iter().map(|l| (l - m).exp()).sum()).collect();
        let target_column = |target: u32| rows.contains(&(target as usize)).then(|| target as usize - rows.start);
        let mut target: Vec<f32> =
            by_token().zip(targets).map(|(row, &t)| target_column(t).map_or(0.0, |col| row[col])).collect();
        let mut reduced = norm.iter().chain(&target).copied().collect::<Vec<f32>>();
        self.collectives.all_reduce(&mut reduced, Combine::Sum)?;
        let (sums, targets_sum) = reduced.split_at(norm.len());
        norm.copy_from_slice(sums);
        target.copy_from_slice(targets_sum);
        let loss: f64 = norm.iter().zip(&max).zip(&target).map(|((z, m), t)| f64::from(z.ln() + m - t)).sum::<f64>()
            * f64::from(scale);
        let mut grad = Vec::with_capacity(logits.data.len());
        for (((row, m), z), &t) in by_token().zip(&max).zip(&norm).zip(targets) {
            let start = grad.len();
            grad.extend(row.iter().map(|l| (l - m).exp() / z * scale));
            if let Some(col) = target_column(t) {
                grad[start + col] -= scale;
            }
        }
        Ok((loss, HostTensor::new(logits.shape.clone(), grad)))
    }

    /// The backward of `block` from its output's gradient, `[batch · seq, width]` on the host:
    /// parameter gradients into `grads`, and the gradient of its input, if it has one.
    fn block_backward(
        &self,
        micro_batch: u32,
        block: Block,
        output_grad: Vec<f32>,
        grads: &mut [HostTensor],
    ) -> Result<Option<Vec<f32>>, ModelError> {
        let w = &self.weights;
        let upstream = Tensor::<2>::from_data(TensorData::new(output_grad, block.output.dims()), &w.device);
        let gradients = (block.output * upstream).sum().backward();
        w.add_param_grads(&gradients, grads)?;
        let Some(input) = block.input else { return Ok(None) };
        let reason = "a block's input got no gradient".into();
        let grad = input.grad(&gradients).ok_or(ModelError::MicroBatch { micro_batch, reason })?;
        Ok(Some(device_to_host(grad)?.data))
    }
}

impl StageCompute for TensorParallelStage {
    fn load_parameters(&mut self, params: &[HostTensor]) -> Result<(), ModelError> {
        self.weights.load(params)
    }

    fn forward(
        &mut self,
        micro_batch: u32,
        batch: &MicroBatch,
        input: Option<HostTensor>,
    ) -> Result<StageOutput, ModelError> {
        let runs = self.runs(batch.batch, batch.seq);
        if batch.seq > self.weights.config.seq_len {
            let reason = "its sequences are longer than the model's sequence length".into();
            return Err(ModelError::MicroBatch { micro_batch, reason });
        }
        let mine = runs.runs[self.seat.member].clone();
        let run_shape = [batch.batch, mine.len(), runs.width];
        let input = self.weights.checked_input(micro_batch, input, run_shape)?;
        let mut pending = Pending { runs: runs.clone(), embedding: None, blocks: Vec::new(), head: None };
        let mut x = match input {
            Some(activations) => activations.data,
            None => {
                let output = self.embed(&batch.tokens);
                let partial = device_to_host(output.clone().detach())?.data;
                pending.embedding = Some(Block { input: None, output });
                self.scatter(&runs, partial)?
            }
        };
        for layer_offset in 0..self.weights.layers.len() {
            for attention in [true, false] {
                let whole = self.gather_leaf(&runs, &x)?;
                let output = self.block(layer_offset, attention, whole.clone());
                let partial = self.scatter(&runs, device_to_host(output.clone().detach())?.data)?;
                x.iter_mut().zip(&partial).for_each(|(residual, add)| *residual += add);
                pending.blocks.push(Block { input: Some(whole), output });
            }
        }
        let result = if self.weights.is_last() {
            let whole = self.gather_leaf(&runs, &x)?;
            let [b, t, d] = whole.dims();
            let output = self.weights.logits(whole.clone().reshape([b * t, d]));
            let logits = device_to_host(output.clone().detach())?;
            let (loss, logits_grad) = self.cross_entropy(logits, &batch.targets, batch.loss_scale)?;
            pending.head = Some((Block { input: Some(whole), output }, logits_grad));
            StageOutput::Loss(loss)
        } else {
            StageOutput::Activations(HostTensor::new(run_shape.to_vec(), x))
        };
        self.pending.insert(micro_batch, pending);
        Ok(result)
    }

    fn backward(
        &mut self,
        micro_batch: u32,
        upstream: Option<HostTensor>,
        grads: &mut [HostTensor],
    ) -> Result<Option<HostTensor>, ModelError> {
        let mut pending = take_pending(&mut self.pending, micro_batch)?;
        self.weights.check_accumulators(micro_batch, grads)?;
        let runs = pending.runs.clone();
        let mine = runs.runs[self.seat.member].clone();
        let run_shape = vec![runs.batch, mine.len(), runs.width];
        let bad = |reason: &str| ModelError::MicroBatch { micro_batch, reason: reason.into() };
        let mut grad = match (pending.head.take(), upstream) {
            (Some((head, logits_grad)), None) => {
                let input_grad = self
                    .block_backward(micro_batch, head, logits_grad.data, grads)?
                    .ok_or_else(|| bad("no head input"))?;
                self.scatter(&runs, input_grad)?
            }
            (None, Some(upstream)) => {
                upstream.expect_shape("output gradient", &run_shape)?;
                upstream.data
            }
            (Some(_), Some(_)) => return Err(bad("the last stage's output is the loss: no upstream gradient")),
            (None, None) => return Err(bad("a stage before the last needs the output gradient")),
        };
        while let Some(block) = pending.blocks.pop() {
            let output_grad = self.gather(&runs, &grad)?;
            let input_grad =
                self.block_backward(micro_batch, block, output_grad, grads)?.ok_or_else(|| bad("no block input"))?;
            let scattered = self.scatter(&runs, input_grad)?;
            grad.iter_mut().zip(&scattered).for_each(|(sum, add)| *sum += add);
        }
        match pending.embedding {
            Some(embedding) => {
                let output_grad = self.gather(&runs, &grad)?;
                self.block_backward(micro_batch, embedding, output_grad, grads)?;
                Ok(None)
            }
            None => Ok(Some(HostTensor::new(run_shape, grad))),
        }
    }
}
