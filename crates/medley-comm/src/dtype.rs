//! Element types and the reduction kernels over them.

use half::{bf16, f16};
use medley_collective::Combine;

/// The element types a collective can carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I32,
    I64,
    U8,
}

impl DType {
    pub const ALL: [DType; 7] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U8];

    pub fn size_bytes(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// The name nccl-tests prints.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F64 => "double",
            DType::F16 => "half",
            DType::BF16 => "bfloat16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
        }
    }

    /// `into[i] = into[i] ∘ from[i]` over whole elements of this type; both slices hold the same
    /// number of bytes, a multiple of the element size. `from` may be unaligned (a receive buffer).
    pub(crate) fn combine_bytes(self, into: &mut [u8], from: &[u8], how: Combine) {
        match self {
            DType::F32 => combine_typed::<f32>(into, from, how),
            DType::F64 => combine_typed::<f64>(into, from, how),
            DType::F16 => combine_typed::<f16>(into, from, how),
            DType::BF16 => combine_typed::<bf16>(into, from, how),
            DType::I32 => combine_typed::<i32>(into, from, how),
            DType::I64 => combine_typed::<i64>(into, from, how),
            DType::U8 => combine_typed::<u8>(into, from, how),
        }
    }

    /// `into[i] = base[i] ∘ from[i]`: a reduce whose left operand is still in the input buffer,
    /// saving the copy into the output first. `base` is aligned; `from` may not be.
    pub(crate) fn combine_from_bytes(self, into: &mut [u8], base: &[u8], from: &[u8], how: Combine) {
        match self {
            DType::F32 => combine_from_typed::<f32>(into, base, from, how),
            DType::F64 => combine_from_typed::<f64>(into, base, from, how),
            DType::F16 => combine_from_typed::<f16>(into, base, from, how),
            DType::BF16 => combine_from_typed::<bf16>(into, base, from, how),
            DType::I32 => combine_from_typed::<i32>(into, base, from, how),
            DType::I64 => combine_from_typed::<i64>(into, base, from, how),
            DType::U8 => combine_from_typed::<u8>(into, base, from, how),
        }
    }

    /// Divides every element of `bytes` (aligned, whole elements) by `divisor`.
    pub(crate) fn divide_bytes(self, bytes: &mut [u8], divisor: usize) {
        match self {
            DType::F32 => divide_typed::<f32>(bytes, divisor),
            DType::F64 => divide_typed::<f64>(bytes, divisor),
            DType::F16 => divide_typed::<f16>(bytes, divisor),
            DType::BF16 => divide_typed::<bf16>(bytes, divisor),
            DType::I32 => divide_typed::<i32>(bytes, divisor),
            DType::I64 => divide_typed::<i64>(bytes, divisor),
            DType::U8 => divide_typed::<u8>(bytes, divisor),
        }
    }
}

/// A type a collective can carry: plain bytes (`Pod`) with a combine and a divide.
pub trait Element: bytemuck::Pod + PartialEq + std::fmt::Debug + Send + Sync {
    const DTYPE: DType;
    fn combine(self, other: Self, how: Combine) -> Self;
    fn divide(self, divisor: usize) -> Self;
}

fn combine_typed<T: Element>(into: &mut [u8], from: &[u8], how: Combine) {
    let into: &mut [T] = bytemuck::cast_slice_mut(into);
    match bytemuck::try_cast_slice::<u8, T>(from) {
        Ok(from) => combine_slices(into, from, how),
        Err(_) => {
            for (slot, bytes) in into.iter_mut().zip(from.chunks_exact(size_of::<T>())) {
                *slot = slot.combine(bytemuck::pod_read_unaligned(bytes), how);
            }
        }
    }
}

/// Expands `$body` once per combine, with `$how` a constant, so the loops vectorise.
macro_rules! per_combine {
    ($how:ident, $body:expr) => {
        match $how {
            Combine::Sum => {
                let $how = Combine::Sum;
                $body
            }
            Combine::Prod => {
                let $how = Combine::Prod;
                $body
            }
            Combine::Max => {
                let $how = Combine::Max;
                $body
            }
            Combine::Min => {
                let $how = Combine::Min;
                $body
            }
        }
    };
}

fn combine_slices<T: Element>(into: &mut [T], from: &[T], how: Combine) {
    per_combine!(how, into.iter_mut().zip(from).for_each(|(a, &b)| *a = a.combine(b, how)))
}

fn combine_from_typed<T: Element>(into: &mut [u8], base: &[u8], from: &[u8], how: Combine) {
    let into: &mut [T] = bytemuck::cast_slice_mut(into);
    let base: &[T] = bytemuck::cast_slice(base);
    match bytemuck::try_cast_slice::<u8, T>(from) {
        Ok(from) => per_combine!(
            how,
            into.iter_mut().zip(base.iter().zip(from)).for_each(|(out, (&a, &b))| *out = a.combine(b, how))
        ),
        Err(_) => {
            for ((out, &a), bytes) in into.iter_mut().zip(base).zip(from.chunks_exact(size_of::<T>())) {
                *out = a.combine(bytemuck::pod_read_unaligned(bytes), how);
            }
        }
    }
}

fn divide_typed<T: Element>(bytes: &mut [u8], divisor: usize) {
    for slot in bytemuck::cast_slice_mut::<u8, T>(bytes) {
        *slot = slot.divide(divisor);
    }
}

macro_rules! float_element {
    ($t:ty, $dtype:expr, $from_f64:expr, $to_f64:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dtype;
            #[inline(always)]
            fn combine(self, other: $t, how: Combine) -> $t {
                match how {
                    Combine::Sum => self + other,
                    Combine::Prod => self * other,
                    Combine::Max => {
                        if other > self {
                            other
                        } else {
                            self
                        }
                    }
                    Combine::Min => {
                        if other < self {
                            other
                        } else {
                            self
                        }
                    }
                }
            }
            fn divide(self, divisor: usize) -> $t {
                $from_f64($to_f64(self) / divisor as f64)
            }
        }
    };
}

float_element!(f32, DType::F32, |v: f64| v as f32, |v: f32| f64::from(v));
float_element!(f64, DType::F64, |v: f64| v, |v: f64| v);
float_element!(f16, DType::F16, f16::from_f64, f16::to_f64);
float_element!(bf16, DType::BF16, bf16::from_f64, bf16::to_f64);

/// Integers wrap on overflow, as NCCL's do; the average truncates toward zero.
macro_rules! int_element {
    ($t:ty, $dtype:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dtype;
            #[inline(always)]
            fn combine(self, other: $t, how: Combine) -> $t {
                match how {
                    Combine::Sum => self.wrapping_add(other),
                    Combine::Prod => self.wrapping_mul(other),
                    Combine::Max => self.max(other),
                    Combine::Min => self.min(other),
                }
            }
            fn divide(self, divisor: usize) -> $t {
                (self as i128 / divisor as i128) as $t
            }
        }
    };
}

int_element!(i32, DType::I32);
int_element!(i64, DType::I64);
int_element!(u8, DType::U8);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unaligned_sources_combine_like_aligned_ones() {
        let mut into = vec![1.0f32, 2.0, 3.0];
        let from = [10.0f32, 20.0, 30.0];
        let mut shifted = [0u8; 13];
        shifted[1..].copy_from_slice(bytemuck::cast_slice(&from));
        DType::F32.combine_bytes(bytemuck::cast_slice_mut(&mut into), &shifted[1..], Combine::Sum);
        assert_eq!(into, [11.0, 22.0, 33.0]);
        let mut out = [0f32; 3];
        DType::F32.combine_from_bytes(
            bytemuck::cast_slice_mut(&mut out),
            bytemuck::cast_slice(&into),
            &shifted[1..],
            Combine::Max,
        );
        assert_eq!(out, [11.0, 22.0, 33.0]);
    }

    #[test]
    fn half_types_reduce_and_average() {
        let mut into = vec![bf16::from_f32(3.0), bf16::from_f32(-1.0)];
        let from = [bf16::from_f32(5.0), bf16::from_f32(-4.0)];
        DType::BF16.combine_bytes(bytemuck::cast_slice_mut(&mut into), bytemuck::cast_slice(&from), Combine::Max);
        assert_eq!(into, [bf16::from_f32(5.0), bf16::from_f32(-1.0)]);
        let mut halves = vec![f16::from_f32(3.0)];
        DType::F16.divide_bytes(bytemuck::cast_slice_mut(&mut halves), 2);
        assert_eq!(halves, [f16::from_f32(1.5)]);
    }

    #[test]
    fn integers_wrap_and_truncate() {
        assert_eq!(250u8.combine(10, Combine::Sum), 4);
        assert_eq!((-7i32).divide(2), -3);
        assert_eq!(i64::MAX.combine(1, Combine::Sum), i64::MIN);
    }
}
