//! AdamW on host tensors: every replica applies the same update to the same all-reduced
//! gradients, so replicas stay bit-identical without broadcasting weights.

use serde::{Deserialize, Serialize};

use crate::HostTensor;

/// AdamW's hyper-parameters (Loshchilov & Hutter): decoupled weight decay on matrices only.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamW {
    /// Small-model settings: a high learning rate, GPT-3's betas and decay.
    fn default() -> Self {
        AdamW { lr: 3e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }
    }
}

/// The moments of every parameter and the number of updates so far.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamWState {
    pub step: u64,
    pub m: Vec<HostTensor>,
    pub v: Vec<HostTensor>,
}

impl AdamWState {
    pub fn zeros_like(params: &[HostTensor]) -> Self {
        let zeros = || params.iter().map(|p| HostTensor::zeros(p.shape.clone())).collect();
        AdamWState { step: 0, m: zeros(), v: zeros() }
    }
}

impl AdamW {
    /// Update number `step` (from 1) of the weights `weights` from `grads`, with their moments:
    /// a whole parameter's, or a run of one (ZeRO-1's shard).
    pub fn update_slice(&self, step: u64, weights: &mut [f32], grads: &[f32], moments: Moments<'_>, decays: bool) {
        let step = step as i32;
        let (bias1, bias2) = (1.0 - self.beta1.powi(step), 1.0 - self.beta2.powi(step));
        let decay = if decays { 1.0 - self.lr * self.weight_decay } else { 1.0 };
        let Moments { m, v } = moments;
        for (((w, &g), m), v) in weights.iter_mut().zip(grads).zip(m.iter_mut()).zip(v.iter_mut()) {
            *m = self.beta1 * *m + (1.0 - self.beta1) * g;
            *v = self.beta2 * *v + (1.0 - self.beta2) * g * g;
            let update = (*m / bias1) / ((*v / bias2).sqrt() + self.eps);
            *w = *w * decay - self.lr * update;
        }
    }
}

/// AdamW's first and second moments of a run of weights.
pub struct Moments<'a> {
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(adamw: &AdamW, weights: &mut [f32], grads: &[f32], decays: bool) {
        let (mut m, mut v) = (vec![0.0; weights.len()], vec![0.0; weights.len()]);
        adamw.update_slice(1, weights, grads, Moments { m: &mut m, v: &mut v }, decays);
    }

    #[test]
    fn first_step_moves_each_weight_by_the_learning_rate_against_its_gradient() {
        let adamw = AdamW { weight_decay: 0.0, ..AdamW::default() };
        let mut weights = [1.0, 1.0, 1.0];
        update(&adamw, &mut weights, &[0.5, -2.0, 0.0], false);
        let expected = [1.0 - adamw.lr, 1.0 + adamw.lr, 1.0];
        for (got, want) in weights.iter().zip(expected) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
    }

    #[test]
    fn weight_decay_shrinks_only_decaying_parameters() {
        let adamw = AdamW::default();
        let (mut decaying, mut kept) = ([2.0], [2.0]);
        update(&adamw, &mut decaying, &[0.0], true);
        update(&adamw, &mut kept, &[0.0], false);
        assert!(decaying[0] < 2.0);
        assert_eq!(kept[0], 2.0);
    }
}
