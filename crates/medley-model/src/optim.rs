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
    /// One update of `params` from `grads`; `decays[i]` says whether parameter i gets weight decay.
    pub fn update(&self, state: &mut AdamWState, params: &mut [HostTensor], grads: &[HostTensor], decays: &[bool]) {
        state.step += 1;
        let step = state.step as i32;
        let (bias1, bias2) = (1.0 - self.beta1.powi(step), 1.0 - self.beta2.powi(step));
        for (idx, param) in params.iter_mut().enumerate() {
            let decay = if decays[idx] { 1.0 - self.lr * self.weight_decay } else { 1.0 };
            let (m, v) = (&mut state.m[idx].data, &mut state.v[idx].data);
            for (((w, &g), m), v) in param.data.iter_mut().zip(&grads[idx].data).zip(m.iter_mut()).zip(v.iter_mut()) {
                *m = self.beta1 * *m + (1.0 - self.beta1) * g;
                *v = self.beta2 * *v + (1.0 - self.beta2) * g * g;
                let update = (*m / bias1) / ((*v / bias2).sqrt() + self.eps);
                *w = *w * decay - self.lr * update;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_step_moves_each_weight_by_the_learning_rate_against_its_gradient() {
        let adamw = AdamW { weight_decay: 0.0, ..AdamW::default() };
        let mut params = vec![HostTensor::new(vec![3], vec![1.0, 1.0, 1.0])];
        let grads = vec![HostTensor::new(vec![3], vec![0.5, -2.0, 0.0])];
        let mut state = AdamWState::zeros_like(&params);
        adamw.update(&mut state, &mut params, &grads, &[false]);
        let expected = [1.0 - adamw.lr, 1.0 + adamw.lr, 1.0];
        for (got, want) in params[0].data.iter().zip(expected) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
        assert_eq!(state.step, 1);
    }

    #[test]
    fn weight_decay_shrinks_only_decaying_parameters() {
        let adamw = AdamW::default();
        let mut params = vec![HostTensor::new(vec![1], vec![2.0]), HostTensor::new(vec![1], vec![2.0])];
        let grads = vec![HostTensor::zeros(vec![1]), HostTensor::zeros(vec![1])];
        let mut state = AdamWState::zeros_like(&params);
        adamw.update(&mut state, &mut params, &grads, &[true, false]);
        assert!(params[0].data[0] < 2.0);
        assert_eq!(params[1].data[0], 2.0);
    }
}
