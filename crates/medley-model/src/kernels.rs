//! Fused CPU kernels for the element-wise steps that dominate a step after the matmuls: softmax
//! over rows and the SwiGLU gate, forward and backward. burn's CPU backend computes these as
//! chains of single-op passes with a scalar `expf` per element (and autodiff recomputes the
//! `exp` in the backward); here each is one pass over the data with a vectorised `exp`.
//!
//! The loops are plain Rust written so that LLVM vectorises them: `exp` is branch-free, and
//! reductions keep [`LANES`] partial results. [`pulp::Arch::dispatch`] compiles each kernel for
//! the CPU's widest instruction set (AVX-512 or AVX2 with FMA, else the baseline).

/// Partial results a reduction keeps, so that the sum or maximum vectorises (one AVX-512
/// register of `f32`).
const LANES: usize = 16;

/// Below this `exp` is zero in `f32` (its smallest normal result is `exp(-87.33)`).
const EXP_MIN: f32 = -87.33;
/// Above this `exp` is held at `exp(88)`, so that the power-of-two scale stays finite.
const EXP_MAX: f32 = 88.0;

/// `e^x` to within 2 ulp for normal results; 0 below [`EXP_MIN`], `e^88` above [`EXP_MAX`].
///
/// Cody–Waite range reduction `x = n ln 2 + r`, `|r| <= ln 2 / 2`, and a degree-6 polynomial for
/// `e^r` (Cephes' `expf` coefficients); `2^n` is built in the exponent bits. Branch-free, so a
/// loop over it vectorises.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to the nearest integer and leaves it in the low mantissa bits.
    const ROUNDER: f32 = 12_582_912.0;
    let clamped = x.clamp(EXP_MIN, EXP_MAX);
    let shifted = clamped * LOG2_E + ROUNDER;
    let n = shifted - ROUNDER;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    let n_bits = shifted.to_bits().wrapping_sub(ROUNDER.to_bits());
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    if x < EXP_MIN { 0.0 } else { e_r * scale }
}

/// `1 / (1 + e^-x)`, from `e^-|x|` so that it keeps its relative precision for negative `x`
/// and is exactly 0 where `e^x` is (below [`EXP_MIN`]).
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    let e = exp(-x.abs());
    let positive = 1.0 / (1.0 + e);
    if x >= 0.0 { positive } else { e * positive }
}

/// The maximum of `values` (`-inf` when empty).
#[inline(always)]
fn max_of(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = values.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = lane.max(v);
        }
    }
    chunks.remainder().iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// The sum of `a[i] * b[i]`.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let (mut a_chunks, mut b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    for (x, y) in (&mut a_chunks).zip(&mut b_chunks) {
        for ((lane, &x), &y) in lanes.iter_mut().zip(x).zip(y) {
            *lane += x * y;
        }
    }
    let tail: f32 = a_chunks.remainder().iter().zip(b_chunks.remainder()).map(|(x, y)| x * y).sum();
    lanes.iter().sum::<f32>() + tail
}

/// The sum of `a[i] * b[i] * c[i]`.
#[inline(always)]
fn dot3(a: &[f32], b: &[f32], c: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let chunks = a.chunks_exact(LANES).zip(b.chunks_exact(LANES)).zip(c.chunks_exact(LANES));
    for ((a, b), c) in chunks {
        for (((lane, &a), &b), &c) in lanes.iter_mut().zip(a).zip(b).zip(c) {
            *lane += a * b * c;
        }
    }
    let whole = a.len() / LANES * LANES;
    let tail: f32 = (whole..a.len()).map(|i| a[i] * b[i] * c[i]).sum();
    lanes.iter().sum::<f32>() + tail
}

/// The sum of `values`.
#[inline(always)]
fn sum_of(values: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut chunks = values.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += v;
        }
    }
    lanes.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// Runs a kernel compiled for the CPU's widest vector unit: [`pulp`] instantiates
/// `with_simd` per instruction set, and `#[inline(always)]` down the kernel keeps its loops
/// inside that instantiation (a closure would be compiled once, for the baseline).
macro_rules! vectorized {
    ($name:ident { $($field:ident: $ty:ty),* $(,)? } => $body:block) => {{
        struct $name<'a> { $($field: $ty,)* _data: std::marker::PhantomData<&'a ()> }
        impl pulp::WithSimd for $name<'_> {
            type Output = ();
            #[inline(always)]
            fn with_simd<S: pulp::Simd>(self, _: S) {
                let $name { $($field,)* .. } = self;
                $body
            }
        }
        pulp::Arch::new().dispatch($name { $($field,)* _data: std::marker::PhantomData });
    }};
}

/// Softmax of each `row`-long row of `input` into `output`. A row that is all `-inf` (attends
/// to nothing) comes out all zero.
pub(crate) fn softmax_rows(input: &[f32], output: &mut [f32], row: usize) {
    assert_eq!(input.len(), output.len(), "softmax: input and output lengths differ");
    if row == 0 {
        return;
    }
    vectorized!(SoftmaxRows { input: &'a [f32], output: &'a mut [f32], row: usize } => {
        for (x, y) in input.chunks_exact(row).zip(output.chunks_exact_mut(row)) {
            let max = max_of(x);
            if max == f32::NEG_INFINITY {
                y.fill(0.0);
                continue;
            }
            for (y, &x) in y.iter_mut().zip(x) {
                *y = exp(x - max);
            }
            let scale = 1.0 / sum_of(y);
            y.iter_mut().for_each(|y| *y *= scale);
        }
    });
}

/// The input gradient of a row softmax from its output `y` and output gradient `grad`:
/// `y * (grad - sum(grad * y))` per row.
pub(crate) fn softmax_rows_backward(y: &[f32], grad: &[f32], input_grad: &mut [f32], row: usize) {
    assert!(y.len() == grad.len() && y.len() == input_grad.len(), "softmax backward: lengths differ");
    if row == 0 {
        return;
    }
    vectorized!(SoftmaxRowsBackward { y: &'a [f32], grad: &'a [f32], input_grad: &'a mut [f32], row: usize } => {
        let rows = y.chunks_exact(row).zip(grad.chunks_exact(row)).zip(input_grad.chunks_exact_mut(row));
        for ((y, g), dx) in rows {
            let along = dot(y, g);
            for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(g) {
                *dx = y * (g - along);
            }
        }
    });
}

/// SwiGLU's gate, `silu(gate) * up` element-wise.
pub(crate) fn swiglu(gate: &[f32], up: &[f32], output: &mut [f32]) {
    assert!(gate.len() == up.len() && gate.len() == output.len(), "swiglu: lengths differ");
    vectorized!(Swiglu { gate: &'a [f32], up: &'a [f32], output: &'a mut [f32] } => {
        for ((out, &a), &b) in output.iter_mut().zip(gate).zip(up) {
            *out = a * sigmoid(a) * b;
        }
    });
}

/// The gradients of [`swiglu`]'s two inputs from its output gradient `grad`:
/// `d gate = grad * up * s * (1 + gate * (1 - s))` with `s = sigmoid(gate)`, `d up = grad * silu(gate)`.
pub(crate) fn swiglu_backward(gate: &[f32], up: &[f32], grad: &[f32], gate_grad: &mut [f32], up_grad: &mut [f32]) {
    let n = gate.len();
    assert!(
        [up.len(), grad.len(), gate_grad.len(), up_grad.len()].iter().all(|&len| len == n),
        "swiglu backward: lengths differ"
    );
    vectorized!(SwigluBackward {
        gate: &'a [f32], up: &'a [f32], grad: &'a [f32], gate_grad: &'a mut [f32], up_grad: &'a mut [f32]
    } => {
        let inputs = gate.iter().zip(up).zip(grad);
        for (((&a, &b), &g), (d_gate, d_up)) in inputs.zip(gate_grad.iter_mut().zip(up_grad.iter_mut())) {
            let s = sigmoid(a);
            *d_gate = g * b * s * (1.0 + a * (1.0 - s));
            *d_up = g * a * s;
        }
    });
}

/// RMSNorm of each row of `x` (rows as long as `gain`): `x / sqrt(mean(x^2) + eps) * gain`.
pub(crate) fn rms_norm_rows(x: &[f32], gain: &[f32], eps: f32, output: &mut [f32]) {
    assert_eq!(x.len(), output.len(), "rms_norm: input and output lengths differ");
    let row = gain.len();
    if row == 0 {
        return;
    }
    vectorized!(RmsNormRows { x: &'a [f32], gain: &'a [f32], eps: f32, output: &'a mut [f32], row: usize } => {
        for (x, y) in x.chunks_exact(row).zip(output.chunks_exact_mut(row)) {
            let inv_rms = inverse_rms(x, eps);
            for ((y, &x), &g) in y.iter_mut().zip(x).zip(gain) {
                *y = x * inv_rms * g;
            }
        }
    });
}

#[inline(always)]
fn inverse_rms(row: &[f32], eps: f32) -> f32 {
    1.0 / (dot(row, row) / row.len() as f32 + eps).sqrt()
}

/// The gradients of [`rms_norm_rows`] from its output gradient `grad`: `input_grad` per row
/// `r (grad * gain) - x r^3 sum(grad * gain * x) / n` with `r` the row's inverse RMS, and
/// `gain_grad` (overwritten) the sum over rows of `grad * x * r`.
pub(crate) fn rms_norm_rows_backward(
    x: &[f32],
    gain: &[f32],
    eps: f32,
    grad: &[f32],
    input_grad: &mut [f32],
    gain_grad: &mut [f32],
) {
    let row = gain.len();
    assert!(x.len() == grad.len() && x.len() == input_grad.len(), "rms_norm backward: lengths differ");
    assert_eq!(gain_grad.len(), row, "rms_norm backward: the gain's gradient is not as long as the gain");
    gain_grad.fill(0.0);
    if row == 0 {
        return;
    }
    vectorized!(RmsNormRowsBackward {
        x: &'a [f32], gain: &'a [f32], eps: f32, grad: &'a [f32], input_grad: &'a mut [f32],
        gain_grad: &'a mut [f32], row: usize
    } => {
        let rows = x.chunks_exact(row).zip(grad.chunks_exact(row)).zip(input_grad.chunks_exact_mut(row));
        for ((x, g), dx) in rows {
            let inv_rms = inverse_rms(x, eps);
            let correction = inv_rms * inv_rms * inv_rms * dot3(g, gain, x) / row as f32;
            for ((((dx, dw), &x), &g), &w) in dx.iter_mut().zip(gain_grad.iter_mut()).zip(x).zip(g).zip(gain) {
                *dx = inv_rms * g * w - x * correction;
                *dw += g * x * inv_rms;
            }
        }
    });
}

/// Rotary position embedding (rotate-half form) of `x`, `heads * head_dim` values per token,
/// with `cos` and `sin` tables of `head_dim` per token of a sample: per head, halves
/// `(x1, x2)` become `(x1 cos1 - x2 sin1, x2 cos2 + x1 sin2)`. With `transpose`, the adjoint
/// (the input gradient from an output gradient `x`): `(x1 cos1 + x2 sin2, x2 cos2 - x1 sin1)`.
pub(crate) fn rope(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    heads: usize,
    head_dim: usize,
    transpose: bool,
    output: &mut [f32],
) {
    assert_eq!(x.len(), output.len(), "rope: input and output lengths differ");
    assert!(cos.len() == sin.len() && head_dim.is_multiple_of(2), "rope: tables differ or an odd head size");
    let token_width = heads * head_dim;
    if x.is_empty() || token_width == 0 {
        return;
    }
    let tokens = cos.len() / head_dim;
    assert!(
        cos.len() == tokens * head_dim && x.len().is_multiple_of(tokens * token_width),
        "rope: the tables do not fit the input"
    );
    vectorized!(Rope {
        x: &'a [f32], cos: &'a [f32], sin: &'a [f32], head_dim: usize, transpose: bool,
        output: &'a mut [f32], token_width: usize, tokens: usize
    } => {
        let half = head_dim / 2;
        let rows = x.chunks_exact(token_width).zip(output.chunks_exact_mut(token_width));
        for (token, (x, y)) in rows.enumerate() {
            let position = token % tokens * head_dim;
            let (cos, sin) = (&cos[position..position + head_dim], &sin[position..position + head_dim]);
            let (cos1, cos2) = cos.split_at(half);
            let (sin1, sin2) = sin.split_at(half);
            for (x, y) in x.chunks_exact(head_dim).zip(y.chunks_exact_mut(head_dim)) {
                let (x1, x2) = x.split_at(half);
                let (y1, y2) = y.split_at_mut(half);
                let sign = if transpose { -1.0 } else { 1.0 };
                let (first_sin, second_sin) = if transpose { (sin2, sin1) } else { (sin1, sin2) };
                for i in 0..half {
                    y1[i] = x1[i] * cos1[i] - sign * x2[i] * first_sin[i];
                    y2[i] = x2[i] * cos2[i] + sign * x1[i] * second_sin[i];
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn close(got: f32, want: f32, rel: f32) -> bool {
        (got - want).abs() <= rel * want.abs().max(1e-30) || (got - want).abs() <= 1e-37
    }

    #[test]
    fn exp_matches_the_library_across_the_range() {
        let mut x = -87.0f32;
        while x < 88.0 {
            assert!(close(exp(x), x.exp(), 3e-7), "exp({x}) = {} vs {}", exp(x), x.exp());
            x += 0.0137;
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1000.0), 0.0);
        assert!(exp(1000.0).is_finite() && exp(1000.0) > 1e38);
    }

    #[test]
    fn rope_rotates_each_head_by_its_position_and_its_transpose_undoes_it() {
        let (heads, head_dim, tokens, samples) = (3, 4, 5, 2);
        let angle = |token: usize, dim: usize| (token * (dim % 2 + 1)) as f32 * 0.3;
        let table = |f: fn(f32) -> f32| -> Vec<f32> {
            (0..tokens).flat_map(|t| (0..head_dim).map(move |d| f(angle(t, d % (head_dim / 2))))).collect()
        };
        let (cos, sin) = (table(f32::cos), table(f32::sin));
        let x: Vec<f32> = (0..samples * tokens * heads * head_dim).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y = vec![0.0; x.len()];
        rope(&x, &cos, &sin, heads, head_dim, false, &mut y);
        for (row, (x, y)) in x.chunks(heads * head_dim).zip(y.chunks(heads * head_dim)).enumerate() {
            let token = row % tokens;
            for (x, y) in x.chunks(head_dim).zip(y.chunks(head_dim)) {
                for i in 0..head_dim / 2 {
                    let (c, s) = (angle(token, i).cos(), angle(token, i).sin());
                    let (x1, x2) = (x[i], x[i + head_dim / 2]);
                    assert!((y[i] - (x1 * c - x2 * s)).abs() < 1e-6);
                    assert!((y[i + head_dim / 2] - (x2 * c + x1 * s)).abs() < 1e-6);
                }
            }
        }
        // A rotation's adjoint is its inverse.
        let mut back = vec![0.0; x.len()];
        rope(&y, &cos, &sin, heads, head_dim, true, &mut back);
        for (got, want) in back.iter().zip(&x) {
            assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        }
    }

    #[test]
    fn a_row_that_attends_to_nothing_comes_out_zero() {
        let mut y = [1.0; 6];
        softmax_rows(&[f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0, 1.0, 2.0], &mut y, 3);
        assert_eq!(y[..3], [0.0; 3]);
        assert!((y[3..].iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    fn softmax_reference(x: &[f32]) -> Vec<f32> {
        let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let e: Vec<f64> = x.iter().map(|&v| f64::from(v - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        e.iter().map(|&v| (v / sum) as f32).collect()
    }

    /// Rows of any length, some entries masked to `-inf` (never a whole row).
    fn rows() -> impl Strategy<Value = (usize, Vec<f32>)> {
        (1usize..70, 1usize..6).prop_flat_map(|(row, rows)| {
            let value = prop_oneof![9 => -30.0f32..30.0, 1 => Just(f32::NEG_INFINITY)];
            (Just(row), prop::collection::vec(value, row * rows)).prop_map(|(row, mut values)| {
                for chunk in values.chunks_mut(row) {
                    chunk[0] = chunk[0].max(0.0);
                }
                (row, values)
            })
        })
    }

    proptest! {
        #[test]
        fn softmax_rows_match_a_double_precision_reference((row, x) in rows()) {
            let mut y = vec![0.0; x.len()];
            softmax_rows(&x, &mut y, row);
            for (x, y) in x.chunks(row).zip(y.chunks(row)) {
                for (got, want) in y.iter().zip(softmax_reference(x)) {
                    prop_assert!((got - want).abs() <= 1e-6 + 1e-5 * want, "{got} vs {want}");
                }
            }
        }

        #[test]
        fn softmax_backward_matches_the_jacobian((row, x) in rows(), seed in any::<u64>()) {
            let mut y = vec![0.0; x.len()];
            softmax_rows(&x, &mut y, row);
            let grad: Vec<f32> = (0..x.len()).map(|i| (((i as u64 * 2_654_435_761) ^ seed) % 1000) as f32 / 500.0 - 1.0).collect();
            let mut dx = vec![0.0; x.len()];
            softmax_rows_backward(&y, &grad, &mut dx, row);
            for ((y, g), dx) in y.chunks(row).zip(grad.chunks(row)).zip(dx.chunks(row)) {
                // dx_j = sum_i g_i * dy_i/dx_j, with dy_i/dx_j = y_i * (delta_ij - y_j).
                for j in 0..row {
                    let want: f64 = (0..row)
                        .map(|i| f64::from(g[i]) * f64::from(y[i]) * (f64::from(u8::from(i == j)) - f64::from(y[j])))
                        .sum();
                    prop_assert!((f64::from(dx[j]) - want).abs() <= 1e-5, "{} vs {want}", dx[j]);
                }
            }
        }

        #[test]
        fn rms_norm_and_its_gradients_match_a_double_precision_reference(
            (row, x, gain, grad) in (1usize..70, 1usize..5).prop_flat_map(|(row, rows)| (
                Just(row),
                prop::collection::vec(-4.0f32..4.0, row * rows),
                prop::collection::vec(-2.0f32..2.0, row),
                prop::collection::vec(-1.0f32..1.0, row * rows),
            ))
        ) {
            let eps = 1e-5f32;
            let mut y = vec![0.0; x.len()];
            rms_norm_rows(&x, &gain, eps, &mut y);
            let (mut dx, mut d_gain) = (vec![0.0; x.len()], vec![7.0; row]);
            rms_norm_rows_backward(&x, &gain, eps, &grad, &mut dx, &mut d_gain);
            let mut want_gain = vec![0.0f64; row];
            for ((x, g), (y, dx)) in x.chunks(row).zip(grad.chunks(row)).zip(y.chunks(row).zip(dx.chunks(row))) {
                let x: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
                let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / row as f64 + f64::from(eps)).sqrt();
                // d y_i / d x_j = gain_i (r delta_ij - x_i x_j r^3 / n).
                for j in 0..row {
                    let want_y = x[j] * r * f64::from(gain[j]);
                    prop_assert!((f64::from(y[j]) - want_y).abs() <= 1e-5 * (1.0 + want_y.abs()));
                    let want_dx: f64 = (0..row)
                        .map(|i| {
                            let delta = f64::from(u8::from(i == j));
                            f64::from(g[i]) * f64::from(gain[i]) * (r * delta - x[i] * x[j] * r * r * r / row as f64)
                        })
                        .sum();
                    prop_assert!((f64::from(dx[j]) - want_dx).abs() <= 1e-4 * (1.0 + want_dx.abs()), "{} vs {want_dx}", dx[j]);
                    want_gain[j] += f64::from(g[j]) * x[j] * r;
                }
            }
            for (got, want) in d_gain.iter().zip(&want_gain) {
                prop_assert!((f64::from(*got) - want).abs() <= 1e-4 * (1.0 + want.abs()), "{got} vs {want}");
            }
        }

        #[test]
        fn swiglu_and_its_gradients_match_finite_differences(
            pairs in prop::collection::vec((-12.0f32..12.0, -3.0f32..3.0, -2.0f32..2.0), 1..80)
        ) {
            let gate: Vec<f32> = pairs.iter().map(|p| p.0).collect();
            let up: Vec<f32> = pairs.iter().map(|p| p.1).collect();
            let grad: Vec<f32> = pairs.iter().map(|p| p.2).collect();
            let mut out = vec![0.0; gate.len()];
            swiglu(&gate, &up, &mut out);
            let (mut d_gate, mut d_up) = (vec![0.0; gate.len()], vec![0.0; gate.len()]);
            swiglu_backward(&gate, &up, &grad, &mut d_gate, &mut d_up);
            let f = |a: f64, b: f64| a / (1.0 + (-a).exp()) * b;
            for i in 0..gate.len() {
                let (a, b, g) = (f64::from(gate[i]), f64::from(up[i]), f64::from(grad[i]));
                prop_assert!((f64::from(out[i]) - f(a, b)).abs() <= 1e-5 * (1.0 + f(a, b).abs()));
                let h = 1e-4;
                let want_gate = g * (f(a + h, b) - f(a - h, b)) / (2.0 * h);
                let want_up = g * (f(a, b + h) - f(a, b - h)) / (2.0 * h);
                prop_assert!((f64::from(d_gate[i]) - want_gate).abs() <= 1e-4 * (1.0 + want_gate.abs()), "{} vs {want_gate}", d_gate[i]);
                prop_assert!((f64::from(d_up[i]) - want_up).abs() <= 1e-4 * (1.0 + want_up.abs()), "{} vs {want_up}", d_up[i]);
            }
        }
    }
}
