//! The network side of the engine, free of any backend: the op set, the graph IR, the model
//! zoo, weights, and a plain f64 reference implementation that the tests hold kernels against.

pub mod buffers;
pub mod graph;
pub mod llm;
pub mod op;
pub mod passes;
pub mod reference;
pub mod tensor_file;
pub mod weights;
pub mod zoo;

pub use graph::{Graph, MemoryEstimate, Plan, ValueId};
pub use op::{Op, ShapeError};
pub use weights::Weights;

use serde::{Deserialize, Serialize};

/// Numeric precision of weights and activations. Every backend accumulates in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    /// IEEE half: f16 storage, f32 accumulation.
    Fp16,
    /// bfloat16: bf16 storage, f32 accumulation.
    Bf16,
}

impl Precision {
    pub fn bytes(self) -> usize {
        match self {
            Precision::Fp32 => 4,
            Precision::Fp16 | Precision::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
        }
    }

    /// Rounds a value to what this precision can store (used by references and tests).
    pub fn round(self, x: f32) -> f32 {
        match self {
            Precision::Fp32 => x,
            Precision::Fp16 => half::f16::from_f32(x).to_f32(),
            Precision::Bf16 => half::bf16::from_f32(x).to_f32(),
        }
    }

    /// `v` converted to this precision's storage type, as the bytes a device reads
    /// (little-endian: the only byte order the project builds for).
    pub fn storage_bytes(self, v: &[f32]) -> Vec<u8> {
        match self {
            Precision::Fp32 => bytemuck::cast_slice(v).to_vec(),
            Precision::Fp16 => {
                let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
                bytemuck::cast_slice(&h).to_vec()
            }
            Precision::Bf16 => {
                let h: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
                bytemuck::cast_slice(&h).to_vec()
            }
        }
    }
}

// Weights files (safetensors), device uploads and read-backs are little-endian and are cast
// to and from bytes in place (bytemuck): a big-endian build would read them wrong.
#[cfg(not(target_endian = "little"))]
compile_error!(
    "workshop reads and writes little-endian tensors: big-endian targets are not supported"
);

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A dense f32 host tensor in row-major order with PyTorch's logical shape. This is what
/// crosses the backend seam (inputs, logits) and what weights are kept as on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "tensor data does not match its shape"
        );
        Tensor { shape, data }
    }

    pub fn zeros(shape: Vec<usize>) -> Self {
        let n = shape.iter().product();
        Tensor {
            shape,
            data: vec![0.0; n],
        }
    }

    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Largest absolute element-wise difference to `other` (infinite on a shape mismatch).
    pub fn max_abs_diff(&self, other: &Tensor) -> f32 {
        if self.shape != other.shape {
            return f32::INFINITY;
        }
        self.data
            .iter()
            .zip(&other.data)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max)
    }
}

/// A small deterministic generator (SplitMix64) for seeded weights and inputs. It is ours on
/// purpose: a seed must give the same network in every version of the runner, which a
/// dependency's generator does not promise across releases.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize % n.max(1)
    }

    /// A tensor of standard-normal values.
    pub fn normal_tensor(&mut self, shape: Vec<usize>) -> Tensor {
        let n = shape.iter().product();
        let data = (0..n).map(|_| self.normal() as f32).collect();
        Tensor { shape, data }
    }
}
