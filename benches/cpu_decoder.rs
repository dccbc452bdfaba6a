//! The CPU backend's language-model kernels alone, on Qwen2.5-0.5B's shapes (14 query heads
//! over 2 KV heads of 64, hidden 896, MLP 4864), FP32, median of 7 calls after one: cached
//! attention for a prompt of 128 (batch 1 and 8), 2048 and 8192, and a decode step 2048 tokens
//! into the cache (batch 1 and 8) and 32768 (batch 1); then the linear layers' GEMMs (q/k/v fused, o, gate/up
//! fused, down) over a batch-8 prefill's 1024 rows, and SwiGLU over those rows (`-- activation`:
//! GB/s of its f32 reads and writes); and a decode step's linear layers at 1 and 8 rows over
//! all its layers' bf16 weights, more than the caches hold (`-- stream`, `-- stream llama` for
//! Llama-3.2-1B's: GB/s of the weights read, to hold against `workshop peak`'s bandwidth).
//!
//!     cargo bench --bench cpu_decoder                  # every kernel, 2 threads
//!     cargo bench --bench cpu_decoder -- attention     # attention alone
//!     cargo bench --bench cpu_decoder -- decode        # its decode steps alone
//!     cargo bench --bench cpu_decoder -- stream        # decode's linears from memory
//!     cargo bench --bench cpu_decoder -- stream llama  # Llama-3.2-1B's
//!     WORKSHOP_CPU_SIMD=avx2 cargo bench --bench cpu_decoder -- attention
//!
//! Attention's GFLOP/s count 4 × head FLOPs per (query head, key it sees): the scores and the
//! weighted values, not the softmax.

use half::bf16;
use std::time::Instant;

use workshop::backend::cpu::kernels::{
    AttentionTiles, CacheView, PackedLinear, cached_attention, linear, swiglu,
};

const THREADS: usize = 2;

/// Median seconds of 7 calls of `f`, after one untimed.
fn median(mut f: impl FnMut()) -> f64 {
    f();
    let mut times: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[3]
}

fn wave(n: usize, f: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * f).sin()).collect()
}

fn main() {
    let only: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let only = only.as_deref();
    let wants = |what: &str| only.is_none_or(|o| o == what);
    rayon::ThreadPoolBuilder::new()
        .num_threads(THREADS)
        .build_global()
        .expect("the first pool");
    let (heads, kv_heads, head) = (14, 2, 64);
    let cases = [
        (1, 128, 0),
        (8, 128, 0),
        (1, 2048, 0),
        (1, 8192, 0),
        (1, 1, 2047),
        (8, 1, 2047),
        (1, 1, 32767),
    ];
    for (batch, tokens, start) in cases {
        if wants("attention") || (only == Some("decode") && tokens == 1) {
            let context = start + tokens;
            let c = CacheView {
                batch,
                tokens,
                start,
                context,
                heads,
                kv_heads,
                head,
                window: None,
            };
            let qs = (heads + 2 * kv_heads) * head;
            let q = wave(batch * tokens * qs, 0.37);
            let k = wave(batch * kv_heads * context * head, 0.11);
            let v = wave(batch * kv_heads * context * head, 0.23);
            let mut y = vec![0f32; batch * tokens * heads * head];
            let kept = &mut AttentionTiles::default();
            let seen: usize = (start + 1..=start + tokens).sum();
            let flops = (4 * head * seen * batch * heads) as f64;
            let show = |what: &str, s: f64| {
                println!(
                    "attention {what} batch {batch}, {tokens} new at {start}: {:8.3} ms {:6.1} GFLOP/s",
                    s * 1e3,
                    flops / s / 1e9
                )
            };
            show(
                "f32 ",
                median(|| cached_attention(&q, qs, (&k, &v), c, &mut y, kept)),
            );
            // BF16 storage: the caches a BF16 session keeps (and, where the CPU multiplies
            // bf16 pairs, its prefill's products on them).
            let half = |x: &[f32]| -> Vec<bf16> { x.iter().map(|&v| bf16::from_f32(v)).collect() };
            let (q, k, v) = (half(&q), half(&k), half(&v));
            let mut y = vec![bf16::ZERO; y.len()];
            show(
                "bf16",
                median(|| cached_attention(&q, qs, (&k, &v), c, &mut y, kept)),
            );
        }
    }
    if wants("activation") {
        let (rows, inner) = (1024, 4864);
        let x = wave(rows * 2 * inner, 0.29);
        let mut y = vec![0f32; rows * inner];
        let s = median(|| swiglu(&x, inner, &mut y));
        let bytes = (rows * 3 * inner * 4) as f64;
        println!(
            "swiglu {rows} × {inner}: {:8.3} ms {:6.1} GB/s",
            s * 1e3,
            bytes / s / 1e9
        );
    }
    if wants("stream") {
        // A decode step's linear layers, visited in turn as the step does, over bf16 weights
        // that the caches do not hold: Qwen2.5-0.5B's 24 layers (683 MiB), or with `llama`
        // Llama-3.2-1B's 16 (1.8 GiB). The pool here sleeps between calls, as a session's
        // does not (`install_awake`), which costs the smallest layers most.
        let llama = std::env::args().any(|a| a == "llama");
        let (shapes, count) = if llama {
            (
                [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)],
                16,
            )
        } else {
            ([(896, 1152), (896, 896), (896, 9728), (4864, 896)], 24)
        };
        let layers: Vec<(usize, usize, PackedLinear<bf16>)> = (0..count)
            .flat_map(|l| shapes.map(|(fin, fout)| (l, fin, fout)))
            .map(|(l, fin, fout)| {
                let w = wave(fin * fout, 0.013 + l as f32 * 1e-4);
                (fin, fout, PackedLinear::<bf16>::new(&w, None, fin, fout))
            })
            .collect();
        let bytes: u64 = layers.iter().map(|(_, _, p)| p.bytes()).sum();
        let widest = shapes
            .iter()
            .map(|&(fin, fout)| fin.max(fout))
            .max()
            .unwrap_or(0);
        for rows in [1, 8] {
            let x: Vec<bf16> = wave(rows * widest, 0.71)
                .into_iter()
                .map(bf16::from_f32)
                .collect();
            let mut y = vec![bf16::ZERO; rows * widest];
            let s = median(|| {
                for (fin, fout, w) in &layers {
                    let (x, y) = (&x[..rows * fin], &mut y[..rows * fout]);
                    linear(x, w, (rows, *fin, *fout), y, THREADS);
                }
            });
            println!(
                "stream {rows} row(s) over {} MiB of bf16 weights: {:8.3} ms {:6.1} GB/s",
                bytes >> 20,
                s * 1e3,
                bytes as f64 / s / 1e9
            );
        }
    }
    if wants("linear") {
        let rows = 1024;
        for (fin, fout) in [(896, 1152), (896, 896), (896, 9728), (4864, 896)] {
            let w = wave(fin * fout, 0.013);
            let packed = PackedLinear::<f32>::new(&w, None, fin, fout);
            let x = wave(rows * fin, 0.71);
            let mut y = vec![0f32; rows * fout];
            let s = median(|| linear(&x, &packed, (rows, fin, fout), &mut y, THREADS));
            let flops = 2.0 * (rows * fin * fout) as f64;
            println!(
                "linear {rows} × {fin} → {fout}: {:8.3} ms {:6.1} GFLOP/s",
                s * 1e3,
                flops / s / 1e9
            );
        }
    }
}
