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

    /// The memory the layer's weights take, as bytes: its panels (or bf16 pairs) and its
    /// bias, all that [`Self::bytes`] counts and that a pass over few rows streams through.
    pub fn storage(&self) -> Vec<&[u8]> {
        let p = &self.0;
        let pairs = p.pairs.iter().flat_map(|a| a.storage());
        p.groups
            .iter()
            .flat_map(|g| g.storage())
            .chain(pairs)
            .collect()
    }

    /// Whether [`linear_over_residual`] can run this layer ([`writes_over_residual`]).
    pub fn writes_over_residual(&self) -> bool {
        writes_over_residual(&self.0)
    }

    /// Output j's weights (row j of PyTorch's (out × in) weight), as stored, into `out` (in
    /// values): how a language model whose token table is its LM head's weight (tied) looks a
    /// token up, rather than keeping the table twice.
    pub fn weights_of(&self, j: usize, out: &mut [T]) {
        let p = &self.0;
        if let Some(pairs) = &p.pairs {
            let out = T::as_bf16_mut(out).expect("bf16-pair layers store bf16");
            if super::stem::is_stem(&p.conv) {
                super::stem::column(&p.conv, pairs, j, out);
            } else {
                pairs.column(j, out);
            }
        } else {
            p.groups[0].column(j, out);
        }
    }
}

/// Fully connected layer: y (n × out) = x (n × in) · Wᵀ + b; `dims` is (n, in, out).
pub fn linear<T: Elem>(
    x: &[T],
    w: &PackedLinear<T>,
    dims: (usize, usize, usize),
    y: &mut [T],
    threads: usize,
) {
    linear_residual(x, w, dims, y, threads, None);
}

/// [`linear`] with `residual` (n × out) added in the GEMM's epilogue: y = x · Wᵀ + b + r.
pub fn linear_add<T: Elem>(
    x: &[T],
    w: &PackedLinear<T>,
    dims: (usize, usize, usize),
    y: &mut [T],
    threads: usize,
    residual: &[T],
) {
    linear_residual(x, w, dims, y, threads, Some(residual));
}

/// [`linear`], or [`linear_add`] where there is a `residual`.
pub fn linear_residual<T: Elem>(
    x: &[T],
    w: &PackedLinear<T>,
    (n, fin, fout): (usize, usize, usize),
    y: &mut [T],
    threads: usize,
    residual: Option<&[T]>,
) {
    let image = |c| Nhwc { n, h: 1, w: 1, c };
    conv2d(&w.0, x, image(fin), y, image(fout), threads, residual);
}

/// [`linear_add`] with the residual's buffer as the output: `y` holds the residual (n × out)
/// when it starts and x · Wᵀ + b + r after ([`conv2d_over_residual`]).
///
/// # Panics
/// Where [`PackedLinear::writes_over_residual`] says the layer cannot.
pub fn linear_over_residual<T: Elem>(
    x: &[T],
    w: &PackedLinear<T>,
    (n, fin, fout): (usize, usize, usize),
    y: &mut [T],
    threads: usize,
) {
    let image = |c| Nhwc { n, h: 1, w: 1, c };
    conv2d_over_residual(&w.0, x, image(fin), y, image(fout), threads);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::bf16_gemm::PackedPairs;
    use crate::backend::cpu::sgemm::PackedB;
    use half::{bf16, f16};

    /// A weight whose every value says where it is: output j, input i.
    fn weight(fin: usize, fout: usize) -> Vec<f32> {
        (0..fout * fin)
            .map(|x| (x / fin) as f32 + (x % fin) as f32 / 1024.0)
            .collect()
    }

    fn rows_read_back<T: Elem>(fin: usize, fout: usize) {
        let w = weight(fin, fout);
        let packed = PackedLinear::<T>::new(&w, None, fin, fout);
        let mut out = vec![T::from_f32(-1.0); fin];
        for j in 0..fout {
            packed.weights_of(j, &mut out);
            for (i, v) in out.iter().enumerate() {
                let want = T::from_f32(w[j * fin + i]);
                assert_eq!(
                    bytemuck::bytes_of(v),
                    bytemuck::bytes_of(&want),
                    "{} {fin}→{fout}: output {j}, input {i}",
                    T::SUFFIX
                );
            }
        }
    }

    /// A tied LM head's rows come back as the token table stores them, bit for bit, whichever
    /// packing this CPU gives the layer, for widths that fill panels and widths that do not.
    #[test]
    fn a_linear_layer_gives_back_each_output_s_weights() {
        for (fin, fout) in [(1, 1), (7, 5), (16, 16), (33, 40), (64, 100)] {
            rows_read_back::<f32>(fin, fout);
            rows_read_back::<bf16>(fin, fout);
            rows_read_back::<f16>(fin, fout);
        }
    }

    /// The same for both packings on any CPU: panels of `NR` columns, and bf16 k-pairs (K odd,
    /// padded, and columns past the last whole panel).
    #[test]
    fn packed_columns_read_back_from_both_layouts() {
        for (k, n) in [(1, 1), (5, 17), (32, 16), (9, 40)] {
            let b = |kk: usize, j: usize| (j * 100 + kk) as f32;
            let fill = |j: usize, col: &mut [f32]| {
                col.iter_mut().enumerate().for_each(|(kk, v)| *v = b(kk, j))
            };
            let panels = PackedB::<f32>::new(k, n, b, None);
            let pairs = PackedPairs::with_step(k, n, 32, fill, None);
            let (mut f, mut h) = (vec![0f32; k], vec![bf16::ZERO; k]);
            for j in 0..n {
                panels.column(j, &mut f);
                pairs.column(j, &mut h);
                let want: Vec<f32> = (0..k).map(|kk| b(kk, j)).collect();
                assert_eq!(f, want, "panels {k}×{n}, column {j}");
                let got: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
                let rounded: Vec<f32> = want.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
                assert_eq!(got, rounded, "pairs {k}×{n}, column {j}");
            }
        }
    }
}
