//! [`StageCompute`] for one device of a long-context stage (see [`crate::context`]): each layer
//! is three autodiff graphs — up to Q, K and V of the device's tokens; attention of the group's
//! tokens for the device's heads over every group's keys; the output projection and MLP — joined
//! by the all-to-alls and the lane's all-gather, which the backward runs in reverse. Between the
//! matmuls, a layer walks `medley_schedule::long_context_layer`'s steps, the order the simulator times.

use std::collections::HashMap;
use std::ops::Range;

use medley_schedule::long_context_layer::{
    AllToAll, AttentionWork, KvExchange, LayerPass, LayerStep, Recompute, layer_steps,
};

use super::burn::tensor::{Bool, Int};

use super::{Gradients, Tensor, TensorData};
use super::{PendingOutput, Rotation, Weights, device_to_host, input_gradient, softmax_last};
use crate::compute::take_pending;
use crate::long_context::{ContextCollectives, ContextPlacement, HeadsLayout};
use crate::{ComputeDevice, HostTensor, MicroBatch, ModelConfig, ModelError, StageCompute, StageOutput};

/// A stage's graph between two attentions: from the previous layer's attention output (or the
/// stage's input) to this layer's queries, keys and values (or the stage's output).
struct Segment {
    /// The residual stream entering, a leaf (none for the stage's first segment).
    x_in: Option<Tensor<3>>,
    /// The previous layer's attention output for the device's tokens, a leaf.
    attention_in: Option<Tensor<4>>,
    output: SegmentOutput,
}

enum SegmentOutput {
    /// The residual stream on to the next segment, and Q, K, V of the device's tokens.
    Layer {
        x: Tensor<3>,
        qkv: Box<[Tensor<4>; 3]>,
    },
    Stage(PendingOutput),
}

/// One layer's attention on this device: its leaves and output.
struct Attention {
    /// The group's queries for the device's heads, `[batch, group tokens, heads, head_dim]`.
    q: Tensor<4>,
    /// Every group's keys and values for the KV heads those read, `[batch, sequence, kv, head_dim]`.
    k: Tensor<4>,
    v: Tensor<4>,
    out: Tensor<4>,
}

struct Pending {
    input: Option<Tensor<3>>,
    segments: Vec<Segment>,
    attentions: Vec<Attention>,
}

/// One device of a long-context stage on burn's CPU backend.
pub struct ContextStage {
    weights: Weights,
    placement: ContextPlacement,
    collectives: Box<dyn ContextCollectives>,
    pending: HashMap<u32, Pending>,
    rotation: Rotation,
    /// True where a key (every group's position) comes after a query (the group's position).
    future: Tensor<2, Bool>,
    /// For each of the device's query heads, the index of the KV head it reads among its KV heads.
    kv_of_head: Tensor<1, Int>,
}

impl ContextStage {
    /// The device at `placement` of a stage holding `layers`, exchanging through `collectives`.
    pub fn new(
        config: &ModelConfig,
        layers: Range<usize>,
        placement: ContextPlacement,
        collectives: Box<dyn ContextCollectives>,
        device: ComputeDevice,
    ) -> Result<Self, ModelError> {
        let weights = Weights::new(config, layers, device)?;
        let rotation = weights.rotation_at(placement.positions());
        let (group, member) = placement.group_and_member();
        let queries = &placement.groups()[group].positions;
        let keys = placement.key_positions();
        let future: Vec<bool> = queries.iter().flat_map(|&q| keys.iter().map(move |&k| k > q)).collect();
        let future = Tensor::from_data(TensorData::new(future, [queries.len(), keys.len()]), &weights.device);
        let (q_heads, kv_heads) = (placement.q_heads(member), placement.kv_heads(member));
        let per_kv = config.n_heads / config.n_kv_heads;
        let kv_of_head = weights.int_tensor(q_heads.map(|h| (h / per_kv - kv_heads.start) as i64).collect());
        Ok(ContextStage { weights, placement, collectives, pending: HashMap::new(), rotation, future, kv_of_head })
    }

    fn member(&self) -> usize {
        self.placement.group_and_member().1
    }

    fn group(&self) -> usize {
        self.placement.group_and_member().0
    }

    /// Tokens of member `member` of this device's group.
    fn member_tokens(&self, member: usize) -> usize {
        self.placement.token_run(self.group(), member).len()
    }

    fn layout(&self, batch: usize, tokens: usize, heads: usize) -> HeadsLayout {
        HeadsLayout { batch, tokens, heads, head_dim: self.weights.config.head_dim() }
    }

    /// Enters layer `layer_offset`'s segment: after the first, the previous layer's output
    /// projection and MLP on `previous` (its attention output, a leaf) and the residual stream
    /// `x`, taken as a leaf; returns the two leaves.
    fn finish_previous(
        &self,
        layer_offset: usize,
        x: &mut Tensor<3>,
        previous: Option<Tensor<4>>,
    ) -> (Option<Tensor<3>>, Option<Tensor<4>>) {
        let Some(attention) = previous else { return (None, None) };
        let carried = x.clone().detach().require_grad();
        *x = self.weights.finish_layer(layer_offset - 1, carried.clone(), attention.clone());
        (Some(carried), Some(attention))
    }

    /// The group's all-to-all; a group of one keeps its input.
    fn group_all_to_all(&mut self, input: Vec<f32>, counts: &[Vec<usize>]) -> Result<Vec<f32>, ModelError> {
        if counts.len() == 1 { Ok(input) } else { self.collectives.group_all_to_all(&input, counts) }
    }

    /// The heads of `kind` member `member` computes attention for.
    fn heads_of(&self, kind: Heads, member: usize) -> Range<usize> {
        match kind {
            Heads::Query => self.placement.q_heads(member),
            Heads::KeyValue => self.placement.kv_heads(member),
        }
    }

    fn all_heads(&self, kind: Heads) -> usize {
        match kind {
            Heads::Query => self.weights.config.n_heads,
            Heads::KeyValue => self.weights.config.n_kv_heads,
        }
    }

    /// Elements of `member`'s heads per token, over `kinds`.
    fn head_width(&self, kinds: &[Heads], member: usize) -> usize {
        kinds.iter().map(|&kind| self.heads_of(kind, member).len()).sum::<usize>() * self.weights.config.head_dim()
    }

    /// The group's all-to-all from tokens to heads: `tensors` (`[batch, tokens, all heads,
    /// head_dim]` of this device's tokens) become `[batch, group tokens, heads, head_dim]` of
    /// this device's heads.
    fn send_to_heads(&mut self, tensors: &[(&HostTensor, Heads)]) -> Result<Vec<HostTensor>, ModelError> {
        let (b, n) = (tensors[0].0.shape[0], tensors[0].0.shape[1]);
        let members = self.placement.group_size();
        let kinds: Vec<Heads> = tensors.iter().map(|&(_, kind)| kind).collect();
        let counts: Vec<Vec<usize>> = (0..members)
            .map(|i| (0..members).map(|j| b * self.member_tokens(i) * self.head_width(&kinds, j)).collect())
            .collect();
        let mut input = Vec::with_capacity(counts[self.member()].iter().sum());
        for j in 0..members {
            for &(tensor, kind) in tensors {
                let layout = self.layout(b, n, self.all_heads(kind));
                layout.copy_out(&tensor.data, 0..n, self.heads_of(kind, j), &mut input);
            }
        }
        let received = self.group_all_to_all(input, &counts)?;
        let runs: Vec<usize> = (0..members).map(|m| self.member_tokens(m)).collect();
        let mut parts = vec![Vec::new(); tensors.len()];
        let mut at = 0;
        for &tokens in &runs {
            for (part, &kind) in parts.iter_mut().zip(&kinds) {
                let len = b * tokens * self.head_width(&[kind], self.member());
                part.push(received.get(at..at + len).ok_or_else(|| short("the group's all-to-all"))?.to_vec());
                at += len;
            }
        }
        let n_group = runs.iter().sum();
        let heads = |kind| self.heads_of(kind, self.member()).len();
        Ok(parts
            .iter()
            .zip(&kinds)
            .map(|(part, &kind)| concat_tokens(part, &runs, self.layout(b, n_group, heads(kind))))
            .collect())
    }

    /// The group's all-to-all from heads back to tokens: `tensors` (`[batch, group tokens,
    /// heads, head_dim]` of this device's heads) become `[batch, tokens, all heads, head_dim]` of
    /// this device's tokens; KV heads several members hold add up.
    fn send_to_tokens(&mut self, tensors: &[(&HostTensor, Heads)]) -> Result<Vec<HostTensor>, ModelError> {
        let b = tensors[0].0.shape[0];
        let members = self.placement.group_size();
        let kinds: Vec<Heads> = tensors.iter().map(|&(_, kind)| kind).collect();
        let counts: Vec<Vec<usize>> = (0..members)
            .map(|j| (0..members).map(|i| b * self.member_tokens(i) * self.head_width(&kinds, j)).collect())
            .collect();
        let mut input = Vec::new();
        for i in 0..members {
            for &(tensor, _) in tensors {
                let layout = self.layout(b, tensor.shape[1], tensor.shape[2]);
                let run = self.placement.token_run(self.group(), i);
                layout.copy_out(&tensor.data, run, 0..tensor.shape[2], &mut input);
            }
        }
        let received = self.group_all_to_all(input, &counts)?;
        let n = self.member_tokens(self.member());
        let hd = self.weights.config.head_dim();
        let mut outs: Vec<Vec<f32>> =
            kinds.iter().map(|&kind| vec![0.0; self.layout(b, n, self.all_heads(kind)).numel()]).collect();
        let mut at = 0;
        for j in 0..members {
            for (out, &kind) in outs.iter_mut().zip(&kinds) {
                let (layout, heads) = (self.layout(b, n, self.all_heads(kind)), self.heads_of(kind, j));
                let len = b * n * heads.len() * hd;
                let part = received.get(at..at + len).ok_or_else(|| short("the group's all-to-all"))?;
                at += layout.add_in(out, 0..n, heads, part);
            }
        }
        Ok(outs
            .into_iter()
            .zip(&kinds)
            .map(|(data, &kind)| HostTensor::new(vec![b, n, self.all_heads(kind), hd], data))
            .collect())
    }

    /// One layer's attention for this device's tokens' `q`, `k`, `v` (`[batch, tokens, heads,
    /// head_dim]`): the forward's steps between its matmuls, in the schedule's order (to the
    /// heads, the lane's keys and values and attention on them, back to the tokens).
    fn attend(&mut self, [q, k, v]: [HostTensor; 3]) -> Result<(Attention, HostTensor), ModelError> {
        let (mut heads, mut attention, mut tokens) = (None, None, None);
        for step in runtime_steps(LayerPass::Forward) {
            match step {
                // The segments' graphs run the matmuls, before and after.
                LayerStep::Matmuls(_) => {}
                LayerStep::AllToAll(AllToAll::QkvToHeads) => {
                    let tensors = [(&q, Heads::Query), (&k, Heads::KeyValue), (&v, Heads::KeyValue)];
                    heads = Some(self.send_to_heads(&tensors)?);
                }
                LayerStep::KeysValues { copies: 1, attention: AttentionWork::Forward } => {
                    let group = heads.take().ok_or_else(|| out_of_order(step))?;
                    let (k, v) = self.lane_keys_values(&group[1], &group[2])?;
                    let leaf = |t: &HostTensor| self.weights.host_to_device::<4>(t).require_grad();
                    let (q, k, v) = (leaf(&group[0]), leaf(&k), leaf(&v));
                    let out = self.attention(q.clone(), k.clone(), v.clone());
                    attention = Some(Attention { q, k, v, out });
                }
                LayerStep::AllToAll(AllToAll::OutputToTokens) => {
                    let out = &attention.as_ref().ok_or_else(|| out_of_order(step))?.out;
                    let out = device_to_host(out.clone().detach())?;
                    tokens = self.send_to_tokens(&[(&out, Heads::Query)])?.into_iter().next();
                }
                step => return Err(unsupported(step)),
            }
        }
        let last = LayerStep::AllToAll(AllToAll::OutputToTokens);
        attention.zip(tokens).ok_or_else(|| out_of_order(last))
    }

    /// The backward of one layer's attention from its output's gradient for this device's tokens,
    /// in the schedule's order (to the heads, attention's backward, the keys' and values'
    /// gradients over the lane, back to the tokens): the gradients of those tokens' Q, K and V.
    fn attend_backward(&mut self, attention: Attention, d_out: &HostTensor) -> Result<[HostTensor; 3], ModelError> {
        let (mut attention, mut d_heads, mut grads, mut tokens) = (Some(attention), None, None, None);
        for step in runtime_steps(LayerPass::Backward) {
            match step {
                LayerStep::Matmuls(_) => {}
                LayerStep::AllToAll(AllToAll::OutputGradToHeads) => {
                    d_heads = self.send_to_heads(&[(d_out, Heads::Query)])?.into_iter().next();
                }
                LayerStep::Attention(AttentionWork::Backward { recomputed: false }) => {
                    let (attention, d_out) = attention.take().zip(d_heads.take()).ok_or_else(|| out_of_order(step))?;
                    let gradients = (attention.out * self.weights.host_to_device::<4>(&d_out)).sum().backward();
                    let grad = |leaf: &Tensor<4>| {
                        let grad = leaf
                            .grad(&gradients)
                            .ok_or_else(|| ModelError::Context("attention left a leaf without gradient".into()))?;
                        device_to_host(grad)
                    };
                    grads = Some([grad(&attention.q)?, grad(&attention.k)?, grad(&attention.v)?]);
                }
                LayerStep::KvGradients => {
                    let [dq, dk, dv] = grads.take().ok_or_else(|| out_of_order(step))?;
                    let (dk, dv) = self.lane_gradients(&dk, &dv)?;
                    grads = Some([dq, dk, dv]);
                }
                LayerStep::AllToAll(AllToAll::QkvGradToTokens) => {
                    let [dq, dk, dv] = grads.take().ok_or_else(|| out_of_order(step))?;
                    let tensors = [(&dq, Heads::Query), (&dk, Heads::KeyValue), (&dv, Heads::KeyValue)];
                    tokens = Some(self.send_to_tokens(&tensors)?);
                }
                step => return Err(unsupported(step)),
            }
        }
        let tokens = tokens.ok_or_else(|| out_of_order(LayerStep::AllToAll(AllToAll::QkvGradToTokens)))?;
        Ok(tokens.try_into().expect("three tensors in, three out"))
    }

    /// Causal attention of the group's queries over every key, by global position.
    fn attention(&self, q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
        let [b, n_group, heads, hd] = q.dims();
        let n_keys = k.dims()[1];
        let q = q.swap_dims(1, 2);
        let k = k.swap_dims(1, 2).select(1, self.kv_of_head.clone());
        let v = v.swap_dims(1, 2).select(1, self.kv_of_head.clone());
        let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(1.0 / (hd as f32).sqrt());
        let mask = self.future.clone().reshape([1, 1, n_group, n_keys]).expand([b, heads, n_group, n_keys]);
        let probs = softmax_last(scores.mask_fill(mask, f32::NEG_INFINITY));
        probs.matmul(v).swap_dims(1, 2)
    }

    /// Elements per group of the lane's exchange of keys and values (both), `[batch, group
    /// tokens, kv heads, head_dim]` each.
    fn lane_counts(&self, b: usize, kv_heads: usize) -> Vec<usize> {
        let width = kv_heads * self.weights.config.head_dim();
        self.placement.groups().iter().map(|g| 2 * b * g.positions.len() * width).collect()
    }

    /// Every group's keys and values for this device's KV heads, all-gathered over its lane, in
    /// group order.
    fn lane_keys_values(&mut self, k: &HostTensor, v: &HostTensor) -> Result<(HostTensor, HostTensor), ModelError> {
        if self.placement.groups().len() == 1 {
            return Ok((k.clone(), v.clone()));
        }
        let (b, kv_heads) = (k.shape[0], k.shape[2]);
        let counts = self.lane_counts(b, kv_heads);
        let gathered = self.collectives.lane_all_gather(&[k.data.as_slice(), &v.data].concat(), &counts)?;
        if gathered.len() != counts.iter().sum::<usize>() {
            return Err(short("the lane's all-gather"));
        }
        let runs: Vec<usize> = self.placement.groups().iter().map(|g| g.positions.len()).collect();
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        let mut at = 0;
        for &count in &counts {
            keys.push(gathered[at..at + count / 2].to_vec());
            values.push(gathered[at + count / 2..at + count].to_vec());
            at += count;
        }
        let layout = self.layout(b, runs.iter().sum(), kv_heads);
        Ok((concat_tokens(&keys, &runs, layout), concat_tokens(&values, &runs, layout)))
    }

    /// The keys' and values' gradients (`[batch, sequence, kv heads, head_dim]`, every group's
    /// tokens) summed over the lane, this group's tokens to this device.
    fn lane_gradients(&mut self, dk: &HostTensor, dv: &HostTensor) -> Result<(HostTensor, HostTensor), ModelError> {
        if self.placement.groups().len() == 1 {
            return Ok((dk.clone(), dv.clone()));
        }
        let (b, kv_heads) = (dk.shape[0], dk.shape[2]);
        let counts = self.lane_counts(b, kv_heads);
        let layout = self.layout(b, dk.shape[1], kv_heads);
        let mut input = Vec::with_capacity(counts.iter().sum());
        let mut start = 0;
        for group in self.placement.groups() {
            let run = start..start + group.positions.len();
            layout.copy_out(&dk.data, run.clone(), 0..kv_heads, &mut input);
            layout.copy_out(&dv.data, run, 0..kv_heads, &mut input);
            start += group.positions.len();
        }
        let mut mine = self.collectives.lane_reduce_scatter(&input, &counts)?;
        if mine.len() != counts[self.group()] {
            return Err(short("the lane's reduce-scatter"));
        }
        let values = mine.split_off(mine.len() / 2);
        let shape = vec![b, self.placement.groups()[self.group()].positions.len(), kv_heads, dk.shape[3]];
        Ok((HostTensor::new(shape.clone(), mine), HostTensor::new(shape, values)))
    }
}

/// Which heads a tensor's third dimension counts.
#[derive(Clone, Copy, Debug)]
enum Heads {
    Query,
    KeyValue,
}

/// `[batch, runs[i], width]` parts joined along the tokens, batch row by batch row.
fn concat_tokens(parts: &[Vec<f32>], runs: &[usize], layout: HeadsLayout) -> HostTensor {
    let width = layout.heads * layout.head_dim;
    let mut data = Vec::with_capacity(layout.numel());
    for b in 0..layout.batch {
        for (part, &tokens) in parts.iter().zip(runs) {
            data.extend_from_slice(&part[b * tokens * width..(b + 1) * tokens * width]);
        }
    }
    HostTensor::new(vec![layout.batch, layout.tokens, layout.heads, layout.head_dim], data)
}

/// The runtime's order of a layer's steps: the schedule's, with keys and values all-gathered
/// and nothing recomputed (the autodiff graphs keep the forward's activations).
fn runtime_steps(pass: LayerPass) -> Vec<LayerStep> {
    layer_steps(pass, KvExchange::AllGather, Recompute::None)
}

/// A step this stage does not run.
fn unsupported(step: LayerStep) -> ModelError {
    ModelError::Context(format!("the long-context stage does not run the layer step {step:?}"))
}

/// A step whose inputs no earlier step produced.
fn out_of_order(step: LayerStep) -> ModelError {
    broken(&format!("layer step {step:?} out of order"))
}

/// A broken promise of this module's own bookkeeping, reported rather than panicking.
fn broken(what: &str) -> ModelError {
    ModelError::Context(format!("internal: {what}"))
}

fn short(what: &str) -> ModelError {
    ModelError::Context(format!("{what} delivered fewer elements than its counts promise"))
}

/// `Σ tensor · gradient` over `pairs`: its backward puts each gradient on its tensor.
fn weighted_sum<const D: usize>(weights: &Weights, pairs: &[(&Tensor<D>, &HostTensor)]) -> Option<Tensor<1>> {
    pairs
        .iter()
        .map(|(tensor, grad)| ((*tensor).clone() * weights.host_to_device::<D>(grad)).sum())
        .reduce(|a, b| a + b)
}

/// The data of `tensor` for `positions` of each of its `batch` rows of `seq`.
fn at_positions(values: &[u32], batch: usize, seq: usize, positions: &[usize]) -> Vec<u32> {
    (0..batch).flat_map(|row| positions.iter().map(move |&p| values[row * seq + p])).collect()
}

fn leaf_grad<const D: usize>(
    leaf: &Option<Tensor<D>>,
    gradients: &Gradients,
) -> Result<Option<HostTensor>, ModelError> {
    leaf.as_ref().and_then(|leaf| leaf.grad(gradients)).map(device_to_host).transpose()
}

impl StageCompute for ContextStage {
    fn load_parameters(&mut self, params: &[HostTensor]) -> Result<(), ModelError> {
        self.weights.load(params)
    }

    fn forward(
        &mut self,
        micro_batch: u32,
        batch: &MicroBatch,
        input: Option<HostTensor>,
    ) -> Result<StageOutput, ModelError> {
        let (b, seq, hidden) = (batch.batch, batch.seq, self.weights.config.hidden);
        if seq != self.weights.config.seq_len {
            let reason = format!("its sequences have {seq} tokens; the stage splits {}", self.weights.config.seq_len);
            return Err(ModelError::MicroBatch { micro_batch, reason });
        }
        let positions = self.placement.positions().to_vec();
        let input = self.weights.stage_input(micro_batch, input, [b, positions.len(), hidden])?;
        let mut x = match &input {
            Some(activations) => activations.clone(),
            None => self.weights.embed(&at_positions(&batch.tokens, b, seq, &positions), b, positions.len()),
        };
        let (mut segments, mut attentions) = (Vec::new(), Vec::new());
        let mut previous = None;
        for layer_offset in 0..self.weights.layers.len() {
            let (x_in, attention_in) = self.finish_previous(layer_offset, &mut x, previous.take());
            let qkv = self.weights.project_qkv(layer_offset, x.clone(), &self.rotation);
            let [q, k, v] = [0, 1, 2].map(|idx| device_to_host(qkv[idx].clone().detach()));
            let (attention, tokens) = self.attend([q?, k?, v?])?;
            attentions.push(attention);
            segments.push(Segment {
                x_in,
                attention_in,
                output: SegmentOutput::Layer { x: x.clone(), qkv: Box::new(qkv) },
            });
            previous = Some(self.weights.host_to_device::<4>(&tokens).require_grad());
        }
        let (x_in, attention_in) = self.finish_previous(self.weights.layers.len(), &mut x, previous);
        let targets = at_positions(&batch.targets, b, seq, &positions);
        let (output, result) = self.weights.stage_output(x, &targets, batch.loss_scale)?;
        segments.push(Segment { x_in, attention_in, output: SegmentOutput::Stage(output) });
        self.pending.insert(micro_batch, Pending { input, segments, attentions });
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
        let mut upstream = upstream;
        // The gradients flowing into the segment below: its residual stream's and its Q, K, V's.
        let mut carried: Option<(HostTensor, [HostTensor; 3])> = None;
        for segment in pending.segments.into_iter().rev() {
            let gradients = match (segment.output, carried.take()) {
                (SegmentOutput::Stage(output), None) => {
                    self.weights.output_backward(micro_batch, output, upstream.take(), None)?
                }
                (SegmentOutput::Layer { x, qkv }, Some((dx, [dq, dk, dv]))) => {
                    let stream = weighted_sum(&self.weights, &[(&x, &dx)]);
                    let heads = weighted_sum(&self.weights, &[(&qkv[0], &dq), (&qkv[1], &dk), (&qkv[2], &dv)]);
                    stream.zip(heads).map(|(a, b)| a + b).ok_or_else(|| broken("a segment without outputs"))?.backward()
                }
                _ => return Err(broken("segments out of order")),
            };
            self.weights.add_param_grads(&gradients, grads)?;
            let Some(attention) = pending.attentions.pop() else {
                return input_gradient(micro_batch, pending.input, &gradients);
            };
            let dx =
                leaf_grad(&segment.x_in, &gradients)?.ok_or_else(|| broken("a residual stream without gradient"))?;
            let d_attention = leaf_grad(&segment.attention_in, &gradients)?
                .ok_or_else(|| broken("an attention output without gradient"))?;
            carried = Some((dx, self.attend_backward(attention, &d_attention)?));
        }
        Err(broken("a stage without segments"))
    }
}
