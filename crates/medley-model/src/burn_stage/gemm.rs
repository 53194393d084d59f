//! Timing one matrix multiply on a device, for `medley bench device`.

use std::time::Instant;

use super::backend::{self, Tensor, burn};
use crate::{ComputeDevice, ModelError};

/// Seconds one `n`×`n` by `n`×`n` multiply takes on `device` in bf16 (else f32): the median of
/// `repeats` timed multiplies after two untimed ones, each waited for by reading one element of
/// its result back (the device runs its queue in order).
pub(crate) fn matmul_seconds(device: ComputeDevice, n: usize, bf16: bool, repeats: usize) -> Result<f64, ModelError> {
    let device = backend::plain_device(device)?;
    let normal = burn::tensor::Distribution::Normal(0.0, 1.0);
    let make = || {
        let tensor = Tensor::<2>::random([n, n], normal, &device);
        if bf16 { tensor.cast(burn::tensor::FloatDType::BF16) } else { tensor }
    };
    let (a, b) = (make(), make());
    let mut times = Vec::new();
    for repeat in 0..repeats.max(1) + 2 {
        let started = Instant::now();
        let product = a.clone().matmul(b.clone());
        backend::floats(product.slice([0..1, 0..1]).cast(burn::tensor::FloatDType::F32).into_data())?;
        if repeat >= 2 {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}
