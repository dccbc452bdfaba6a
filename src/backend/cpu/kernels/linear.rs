//! The classifier head: linear layers (a 1×1 convolution on 1×1 images) and softmax.

use rayon::prelude::*;

use super::*;
use crate::backend::cpu::elem::Elem;
use crate::model::op::{Act, Conv2d, Op};

/// A fully connected layer's weights, packed as those of the 1×1 convolution it is over an
/// n × 1 × 1 × in image: the same GEMM paths (half panels widened a block at a time, bf16
/// pairs where the CPU multiplies them), chunked the same way.
pub struct PackedLinear<T>(PackedConv<T>);

impl<T: Elem> PackedLinear<T> {
    /// From PyTorch's (out × in) weight: a (out, in, 1, 1) convolution's.
    pub fn new(weight: &[f32], bias: Option<&[f32]>, fin: usize, fout: usize) -> Self {
        Self::with_act(weight, bias, (fin, fout), Act::None)
    }

    /// With `act` applied in the GEMM's epilogue; `dims` is (in, out).
    pub fn with_act(weight: &[f32], bias: Option<&[f32]>, dims: (usize, usize), act: Act) -> Self {
        let conv = Op::linear(dims.0, dims.1, bias.is_some()).as_conv();
        let conv = conv.expect("a linear layer is a 1×1 convolution");
        PackedLinear(PackedConv::new(Conv2d { act, ..conv }, weight, bias))
    }

    pub fn bytes(&self) -> u64 {
        self.0.bytes()
    }
}

/// Fully connected layer: y (n × out) = x (n × in) · Wᵀ + b; `dims` is (n, in, out).
pub fn linear<T: Elem>(
    x: &[T],
    w: &PackedLinear<T>,
    (n, fin, fout): (usize, usize, usize),
    y: &mut [T],
    threads: usize,
) {
    let image = |c| Nhwc { n, h: 1, w: 1, c };
    conv2d(&w.0, x, image(fin), y, image(fout), threads, None);
}

/// [`linear`] with `residual` (n × out) added in the GEMM's epilogue: y = x · Wᵀ + b + r.
pub fn linear_add<T: Elem>(
    x: &[T],
    w: &PackedLinear<T>,
    (n, fin, fout): (usize, usize, usize),
    y: &mut [T],
    threads: usize,
    residual: &[T],
) {
    let image = |c| Nhwc { n, h: 1, w: 1, c };
    conv2d(&w.0, x, image(fin), y, image(fout), threads, Some(residual));
}

/// Softmax over rows of length `len`, in f32 with the row maximum subtracted.
pub fn softmax<T: Elem>(x: &[T], len: usize, y: &mut [T]) {
    y.par_chunks_mut(len)
        .zip(x.par_chunks(len))
        .for_each(|(out, row)| {
            let vals: Vec<f32> = row.iter().map(|v| v.to_f32()).collect();
            let m = vals.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let e: Vec<f32> = vals.iter().map(|v| (v - m).exp()).collect();
            let s: f32 = e.iter().sum();
            for (o, v) in out.iter_mut().zip(e) {
                *o = T::from_f32(v / s);
            }
        });
}
