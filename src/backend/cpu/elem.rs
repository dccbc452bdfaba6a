//! Storage element types of the CPU backend. Activations and weights are stored as f32, f16 or
//! bf16; all arithmetic is f32. Conversions go through `half`'s slice routines, which use the
//! F16C instructions when the CPU has them.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::model::Precision;

pub trait Elem: Copy + Send + Sync + Default + 'static {
    const PRECISION: Precision;
    /// A short suffix for kernel names (`f32`, `f16`, `bf16`).
    const SUFFIX: &'static str;
    /// Whether the storage already is f32 (kernels then work in place, without conversions).
    const IS_F32: bool;
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
    /// The slice itself when the storage type is already f32 (no copy needed).
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]>;
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Elem for f32 {
    const PRECISION: Precision = Precision::Fp32;
    const SUFFIX: &'static str = "f32";
    const IS_F32: bool = true;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        Some(s)
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

/// The two half types differ only in their names and formats.
macro_rules! half_elem {
    ($t:ty, $precision:expr, $suffix:literal) => {
        impl Elem for $t {
            const PRECISION: Precision = $precision;
            const SUFFIX: &'static str = $suffix;
            const IS_F32: bool = false;
            fn from_f32(v: f32) -> Self {
                <$t>::from_f32(v)
            }
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }
            fn as_f32(_: &[Self]) -> Option<&[f32]> {
                None
            }
            fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
                None
            }
            fn widen(src: &[Self], dst: &mut [f32]) {
                src.convert_to_f32_slice(dst);
            }
            fn narrow(src: &[f32], dst: &mut [Self]) {
                dst.convert_from_f32_slice(src);
            }
        }
    };
}

half_elem!(f16, Precision::Fp16, "f16");
half_elem!(bf16, Precision::Bf16, "bf16");
