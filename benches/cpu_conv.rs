//! The CPU backend's convolution variants side by side, on ResNet-50's stride-1 3×3 layers:
//! im2col + GEMM (`rows-x1`), Winograd F(2×2, 3×3) and F(4×4, 3×3), each forced on a one-layer
//! network, interleaved round by round, best of the rounds.
//!
//!     cargo bench --bench cpu_conv                 # batches 1 and 8
//!     cargo bench --bench cpu_conv -- 32           # other batches
//!     cargo bench --bench cpu_conv -- bf16 8       # BF16 (pairs where the CPU has them)
//!     WORKSHOP_CPU_SIMD=portable cargo bench --bench cpu_conv
//!
//! Effective GFLOP/s count the direct convolution's 2 × MACs, whatever algorithm ran. Each
//! step also converts the layer's input and output (NCHW f32 in and out), which weighs more
//! beside a BF16 layer: read the BF16 rows as a ranking, and a network's `--trace` for times.

use std::time::Instant;

use workshop::backend::{self, BackendKind, ExecOptions};
use workshop::model::graph::{ConvInit, GraphBuilder, LinearInit};
use workshop::model::op::Conv2d;
use workshop::model::{Precision, Rng, Weights};

const VARIANTS: [&str; 3] = ["rows-x1", "winograd-f2x2", "winograd-f4x4"];
const ROUNDS: usize = 5;

fn main() {
    // `cargo bench` passes `--bench`; numbers are batch sizes.
    let mut batches: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if batches.is_empty() {
        batches = vec![1, 8];
    }
    let precision = if std::env::args().any(|a| a == "bf16") {
        Precision::Bf16
    } else {
        Precision::Fp32
    };
    let cpu = backend::open(BackendKind::Cpu).expect("the CPU backend always opens");
    println!(
        "layer                 {:>22} {:>22} {:>22}",
        VARIANTS[0], VARIANTS[1], VARIANTS[2]
    );
    for &n in &batches {
        for (c, hw) in [(64usize, 56usize), (128, 28), (256, 14), (512, 7)] {
            let mut g =
                GraphBuilder::new("layer", c, ConvInit::TorchDefault, LinearInit::TorchDefault);
            let x = g.input();
            let y = g.conv("conv", x, Conv2d::new(c, c, 3, 1, 1));
            let graph = g.finish(y);
            let plan = graph.plan(n, hw, hw).expect("a valid plan");
            let weights = Weights::init(&graph, 0);
            let input = Rng::new(1).normal_tensor(plan.input_shape().to_vec());
            let mut sessions: Vec<_> = VARIANTS
                .iter()
                .map(|v| {
                    let opt = ExecOptions {
                        variants: [("conv".to_string(), v.to_string())].into(),
                        precision,
                        ..Default::default()
                    };
                    cpu.prepare(0, &plan, &weights, &opt).expect("prepared")
                })
                .collect();
            let mut best = [f64::MAX; VARIANTS.len()];
            for _ in 0..ROUNDS {
                for (s, b) in sessions.iter_mut().zip(&mut best) {
                    let t = Instant::now();
                    s.run(&input).expect("ran");
                    s.sync().expect("synced");
                    *b = b.min(t.elapsed().as_secs_f64());
                }
            }
            let flops = 2.0 * (n * hw * hw * c * c * 9) as f64;
            print!("b{n:<3} {c:>3}ch {hw:>2}×{hw:<2}      ");
            for t in best {
                print!(" {:>9.2} ms {:>5.0} GF/s", t * 1e3, flops / t / 1e9);
            }
            println!();
        }
    }
}
