//! A CPU stage that computes a micro-batch on every thread of the pool it runs in: each thread's
//! copy of the stage takes a contiguous block of the micro-batch's samples, and their gradients
//! are summed. burn's CPU backend threads only large matmuls, so one copy on several threads
//! leaves most of a step (element-wise kernels, small matmuls) on one core; samples are
//! independent, so blocks of them scale with the threads.

use std::collections::HashMap;
use std::ops::Range;

use rayon::prelude::*;

use crate::compute::take_pending;
use crate::{ComputeDevice, HostTensor, MicroBatch, ModelConfig, ModelError, StageCompute, StageOutput};

/// Makes one more copy of the stage.
type MakeStage = Box<dyn Fn() -> Result<Box<dyn StageCompute>, ModelError> + Send + Sync>;

pub(crate) struct RowSplit {
    make: MakeStage,
    hidden: usize,
    /// One copy per thread used so far, each with the parameters last loaded.
    copies: Vec<Box<dyn StageCompute>>,
    params: Vec<HostTensor>,
    /// The sample blocks of each micro-batch whose backward is still to come.
    pending: HashMap<u32, Vec<Range<usize>>>,
}

impl RowSplit {
    pub(crate) fn new(config: &ModelConfig, layers: Range<usize>) -> Result<Self, ModelError> {
        let owned = config.clone();
        let make: MakeStage = Box::new(move || {
            Ok(Box::new(crate::cpu::stage::BurnStage::new(&owned, layers.clone(), ComputeDevice::Cpu)?))
        });
        Ok(RowSplit { copies: vec![make()?], make, hidden: config.hidden, params: Vec::new(), pending: HashMap::new() })
    }

    /// Enough copies for `blocks` blocks, the new ones loaded with the current parameters.
    fn grow(&mut self, blocks: usize) -> Result<(), ModelError> {
        while self.copies.len() < blocks {
            let mut copy = (self.make)()?;
            if !self.params.is_empty() {
                copy.load_parameters(&self.params)?;
            }
            self.copies.push(copy);
        }
        Ok(())
    }
}

/// `rows` split into at most `parts` contiguous blocks, as even as whole rows allow.
fn blocks(rows: usize, parts: usize) -> Vec<Range<usize>> {
    let parts = parts.clamp(1, rows.max(1));
    (0..parts).map(|i| i * rows / parts..(i + 1) * rows / parts).collect()
}

/// Rows `rows` of a tensor whose first dimension is the sample.
fn rows_of(tensor: &HostTensor, rows: &Range<usize>) -> HostTensor {
    let per_row = tensor.data.len() / tensor.shape[0].max(1);
    let mut shape = tensor.shape.clone();
    shape[0] = rows.len();
    HostTensor::new(shape, tensor.data[rows.start * per_row..rows.end * per_row].to_vec())
}

/// The blocks' tensors stacked back along the sample dimension.
fn stack(parts: Vec<HostTensor>) -> HostTensor {
    let mut shape = parts[0].shape.clone();
    shape[0] = parts.iter().map(|part| part.shape[0]).sum();
    HostTensor::new(shape, parts.into_iter().flat_map(|part| part.data).collect())
}

fn sub_batch(batch: &MicroBatch, rows: &Range<usize>) -> MicroBatch {
    let tokens = rows.start * batch.seq..rows.end * batch.seq;
    MicroBatch {
        batch: rows.len(),
        seq: batch.seq,
        tokens: batch.tokens[tokens.clone()].to_vec(),
        targets: batch.targets[tokens].to_vec(),
        loss_scale: batch.loss_scale,
    }
}

impl StageCompute for RowSplit {
    fn load_parameters(&mut self, params: &[HostTensor]) -> Result<(), ModelError> {
        self.params = params.to_vec();
        self.copies.par_iter_mut().try_for_each(|copy| copy.load_parameters(params))
    }

    fn forward(
        &mut self,
        micro_batch: u32,
        batch: &MicroBatch,
        input: Option<HostTensor>,
    ) -> Result<StageOutput, ModelError> {
        let blocks = blocks(batch.batch, rayon::current_num_threads());
        if blocks.len() == 1 {
            self.pending.insert(micro_batch, blocks);
            return self.copies[0].forward(micro_batch, batch, input);
        }
        if let Some(input) = &input {
            input.expect_shape("input activations", &[batch.batch, batch.seq, self.hidden])?;
        }
        self.grow(blocks.len())?;
        let outputs: Vec<StageOutput> = self
            .copies
            .par_iter_mut()
            .zip(&blocks)
            .map(|(copy, rows)| {
                copy.forward(micro_batch, &sub_batch(batch, rows), input.as_ref().map(|input| rows_of(input, rows)))
            })
            .collect::<Result<_, _>>()?;
        self.pending.insert(micro_batch, blocks);
        Ok(match &outputs[0] {
            StageOutput::Loss(_) => StageOutput::Loss(
                outputs.iter().map(|output| if let StageOutput::Loss(loss) = output { *loss } else { 0.0 }).sum(),
            ),
            StageOutput::Activations(_) => StageOutput::Activations(stack(
                outputs
                    .into_iter()
                    .filter_map(|output| if let StageOutput::Activations(out) = output { Some(out) } else { None })
                    .collect(),
            )),
        })
    }

    fn backward(
        &mut self,
        micro_batch: u32,
        upstream: Option<HostTensor>,
        grads: &mut [HostTensor],
    ) -> Result<Option<HostTensor>, ModelError> {
        let blocks = take_pending(&mut self.pending, micro_batch)?;
        if blocks.len() == 1 {
            return self.copies[0].backward(micro_batch, upstream, grads);
        }
        let results: Vec<(Vec<HostTensor>, Option<HostTensor>)> = self
            .copies
            .par_iter_mut()
            .zip(&blocks)
            .map(|(copy, rows)| {
                let mut own: Vec<HostTensor> = grads.iter().map(|grad| HostTensor::zeros(grad.shape.clone())).collect();
                let input_grad = copy.backward(micro_batch, upstream.as_ref().map(|up| rows_of(up, rows)), &mut own)?;
                Ok((own, input_grad))
            })
            .collect::<Result<_, ModelError>>()?;
        let mut input_grads = Vec::new();
        for (own, input_grad) in results {
            grads.iter_mut().zip(&own).for_each(|(sum, part)| sum.add_from(part));
            input_grads.extend(input_grad);
        }
        Ok((!input_grads.is_empty()).then(|| stack(input_grads)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_the_rows_once_and_never_exceed_them() {
        for rows in 0..20 {
            for parts in 1..6 {
                let blocks = blocks(rows, parts);
                assert_eq!(blocks.len(), parts.min(rows.max(1)));
                assert_eq!(blocks.iter().map(Range::len).sum::<usize>(), rows);
                assert!(blocks.windows(2).all(|pair| pair[0].end == pair[1].start));
                assert!(blocks.iter().all(|block| rows == 0 || !block.is_empty()));
            }
        }
    }
}
