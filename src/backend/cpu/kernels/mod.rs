//! The CPU kernels. Images are NHWC (channels innermost, so a pixel's channels are one
//! contiguous run and a convolution is a GEMM over them); features are (N, F). Storage is any
//! [`Elem`](super::elem::Elem); arithmetic is f32. Work is split over the session's rayon pool.
//!
//! Convolution is im2col + GEMM ([`super::sgemm`]), fused per work item: a worker gathers the
//! columns of a chunk of output rows into a thread-local scratch (in f32) and multiplies them
//! by the weights, packed once at prepare time, with the bias folded into the GEMM tile. A 1×1
//! stride-1 convolution in f32 skips the gather: its input already is the column matrix. When
//! there are too few row chunks to keep every worker busy (small batches, late layers), work
//! items also split the output channels. Depthwise convolutions are direct loops (a GEMM with
//! one input channel per group wastes the machine), and so are grouped ones of a few channels
//! a group on AVX-512.
//!
//! One file per op family: `conv.rs` (im2col + GEMM convolutions and their work split),
//! `im2col.rs`, `stem.rs` (BF16 convolutions of a few input channels on bf16 pairs read in
//! place, no gather), `direct.rs` (BF16 stride-1 windows on AMX's tiles read from a
//! zero-bordered copy of the input, no gather), `depthwise.rs`, `grouped.rs` (3×3 layers of 2 to 32 channels a group,
//! direct), `elementwise.rs` (batch norm's affine map, clamps, adds),
//! `pool.rs`, `layout.rs` (NCHW ↔ NHWC), `linear.rs` (linear layers and softmax),
//! `transformer.rs` (layer norm, GELU, class token, positions, fused attention on tokens),
//! `decoder.rs` (a language model's RMSNorm, rotary positions, SwiGLU and attention over its KV
//! cache).

mod activation;
mod conv;
mod decoder;
mod depthwise;
mod direct;
mod elementwise;
mod grouped;
mod im2col;
mod layout;
mod linear;
mod pool;
mod stem;
mod transformer;

use std::cell::RefCell;

pub(crate) use activation::{
    activate, softmax_numerators, softmax_numerators_above, softmax_numerators_bf16,
};
#[cfg(target_arch = "x86_64")]
pub(crate) use activation::{activate_ymm, activate_zmm, with_vec_act};
pub use conv::*;
pub use decoder::*;
use depthwise::*;
pub use depthwise::{
    Projection, can_pair, can_project, fused_band_rows, makes_row_sums, pair_bands,
    pointwise_depthwise, projected_bands,
};
pub use elementwise::*;
use im2col::*;
pub use layout::*;
pub use linear::*;
pub use pool::*;
pub use transformer::*;

/// An NHWC image batch's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nhwc {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
}

impl Nhwc {
    pub fn elems(&self) -> usize {
        self.n * self.h * self.w * self.c
    }

    /// Pixels over all the images: a layer's GEMM rows.
    pub fn pixels(&self) -> usize {
        self.n * self.h * self.w
    }
}

/// Elements per parallel work item of the element-wise kernels.
const ELEMENTWISE_CHUNK: usize = 1 << 16;

thread_local! {
    /// Per-worker scratch for columns and f32 results; reused across calls and iterations so
    /// the hot loop does not allocate.
    pub(super) static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Rows per work item of the row-wise ops (the norms): one f32 row buffer serves them all.
const ROWS: usize = 16;
