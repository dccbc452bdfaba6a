//! Intel AMX (Advanced Matrix Extensions, Sapphire Rapids and later Xeons): the tile
//! engine of [`super::bf16_gemm`]' BF16 GEMMs.
//!
//! AMX adds eight tile registers of 16 rows × 64 bytes and `tdpbf16ps`, which multiplies a
//! 16 × 32 bf16 tile of A by a 32 × 16 tile of B (stored as 16 rows of k-pairs: row r holds
//! `B[2r][j]`, `B[2r + 1][j]` for j < 16) into a 16 × 16 f32 tile of C — 16,384 FLOPs in one
//! instruction. A Sapphire Rapids core ran it at 2.5 TFLOP/s from registers and the 32 × 32
//! blocking at 235–390 GFLOP/s from memory, against 120–135 for its best AVX-512 FP32 tile and
//! 78 for `vdpbf16ps` (AVX512_BF16), which is why BF16 sessions use AMX and not AVX512_BF16
//! where both exist.
//!
//! Tiles: tmm0–3 accumulate a 32 × 32 block of C (two row halves × two 16-column panels),
//! tmm4–5 hold A's two row halves, tmm6–7 the two panels of B; `resident` blocks (K of 64)
//! keep A's two steps in tmm4–7 instead and go a panel at a time. The tile instructions are
//! written with `asm!` (Rust's AMX intrinsics are unstable); the compiler never touches the
//! tile registers, so their contents live from one `asm!` block to the next.
//!
//! x86-64 only (the module is compiled there alone).
//!
//! Linux hands AMX's 8 KiB of tile state to a process only when asked
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`): [`available`] asks once.

use half::bf16;

use super::bf16_gemm::{KSTEP, PANEL, PackedPairs};

/// Whether this process can run the AMX BF16 tiles: the CPU has AMX-TILE and AMX-BF16 and the
/// kernel granted the tile state. Asked once.
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    // CPUID leaf 7: EDX bit 22 = AMX-BF16, bit 24 = AMX-TILE.
    let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
    if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// The tile configuration: palette 1, all eight tiles 16 rows × 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

const CONFIG: Config = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64;
        c[48 + t] = 16;
        t += 1;
    }
    Config(c)
};

/// Load the tile configuration: before the first block of a GEMM.
///
/// # Safety
/// [`available`] is true.
pub(super) unsafe fn configure() {
    // SAFETY: `available()` (the contract) means the CPU runs these instructions and the
    // kernel holds tile state for this process; the configuration is 64 aligned bytes.
    unsafe { std::arch::asm!("ldtilecfg [{0}]", in(reg) CONFIG.0.as_ptr(), options(nostack)) };
}

/// Hand the tile state back: after the last block of a GEMM.
///
/// # Safety
/// [`available`] is true.
pub(super) unsafe fn release() {
    // SAFETY: as for `configure`.
    unsafe { std::arch::asm!("tilerelease", options(nostack)) };
}

/// One 32-row block of C for panel p (and p + 1 when `pair`), without B's bias (the caller
/// adds it where it finishes the block, [`super::bf16_gemm::Done`]): the accumulators start
/// from zero, then one step per 32 of K. Started from the bias instead (a stride-0 tile load
/// repeating its 16 values on every row), they spent four tile loads a block, as many as two
/// steps: ResNet-50 BF16 at batch 8 on 2 Sapphire Rapids cores, 40 steps alternating in one
/// process, took 1.05× the time with them, its 1×1 layers from 64 channels 1.2–1.35×.
/// A's 32 values of step s start `s · a_step` values after its row's first: `KSTEP` where a
/// row of A is its K values in a line (a GEMM's), more where each step reads a row of an
/// input of its own (the stems' kernel rows, [`super::kernels`]' implicit stem).
///
/// # Safety
/// The tile configuration is loaded; `a` has 32 rows spaced `lda` apart, each with 32
/// readable values at every `s · a_step` for s < `b.kp() / KSTEP`; `c` has 32 rows of 32
/// (`pair`) or 16 writable floats spaced `ldc` apart.
pub(super) unsafe fn block(
    a: *const bf16,
    (lda, a_step): (usize, usize),
    b: &PackedPairs,
    panels: Panels,
    c: *mut f32,
    ldc: usize,
) {
    // Rows closer than a line (the implicit stem's, a few values apart) share their lines,
    // which the hardware's own prefetchers follow: none asked for there.
    let ahead = (lda >= KSTEP).then_some(a_step);
    // SAFETY: the caller's contract, step s at s · a_step.
    unsafe { steps(a, lda, |s| s * a_step, ahead, b, panels, (c, ldc)) }
}

/// The panels of B a block multiplies: panel `p`, and `p + 1` where `pair`; `first`: the
/// first block of the work item to read them, which asks for B's lines ahead of its tile
/// loads ([`prefetch_b`]) — they come from the last-level cache or memory, where the blocks
/// after it find them in L2.
#[derive(Clone, Copy)]
pub(super) struct Panels {
    pub p: usize,
    pub pair: bool,
    pub first: bool,
}

impl Panels {
    /// Panels whose B is already in L1 or L2 (a stem's few weights, a window's keys and
    /// values): no block asks for them ahead.
    pub fn cached(p: usize, pair: bool) -> Self {
        Panels {
            p,
            pair,
            first: false,
        }
    }
}

/// [`block`] with step s's 32 values of A at `at(s)` values after each row's first, wherever
/// they lie: a direct convolution's taps, each a run of its input's channels
/// ([`super::kernels`]' direct 3×3 layers, rows one pixel apart). No lines are asked for ahead
/// of the loads there: its rows share lines, and a tap's are the input's, read again by the
/// taps after it.
///
/// # Safety
/// As for [`block`], with 32 readable values at `at(s)` in each of A's rows for s <
/// `b.kp() / KSTEP`.
pub(super) unsafe fn block_at(
    a: *const bf16,
    lda: usize,
    at: impl Fn(usize) -> usize,
    b: &PackedPairs,
    panels: Panels,
    (c, ldc): (*mut f32, usize),
) {
    // SAFETY: the caller's contract.
    unsafe { steps(a, lda, at, None, b, panels, (c, ldc)) }
}

/// The body of [`block`] and [`block_at`]: step s's A at `at(s)`; where `ahead` is the step's
/// stride, the lines of step s + 2 are asked for ([`prefetch_a`]), and in a work item's first
/// block those of B's step s + [`B_AHEAD`] ([`prefetch_b`]).
///
/// # Safety
/// As for [`block_at`].
#[inline(always)]
unsafe fn steps(
    a: *const bf16,
    lda: usize,
    at: impl Fn(usize) -> usize,
    ahead: Option<usize>,
    b: &PackedPairs,
    Panels { p, pair, first }: Panels,
    (c, ldc): (*mut f32, usize),
) {
    use std::arch::asm;
    let kp = b.kp();
    let panel = |q: usize| b.panel(q).as_ptr();
    let b0 = panel(p);
    let sa = lda * 2;
    let sc = ldc * 4;
    // SAFETY: the caller's contract; every tile access stays in the ranges it names.
    unsafe {
        let a1 = a.add(16 * lda);
        let c1 = c.add(16 * ldc);
        if pair {
            let b1 = panel(p + 1);
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
            for (s, k0) in (0..kp).step_by(KSTEP).enumerate() {
                if let Some(a_step) = ahead {
                    prefetch_a(a, (lda, a_step), s, kp / KSTEP);
                }
                let at = at(s);
                if first {
                    prefetch_b(b0, s, kp / KSTEP);
                    prefetch_b(b1, s, kp / KSTEP);
                }
                asm!(
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm5, [{a1} + {sa}*1]",
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tileloadd tmm7, [{b1} + {sb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a.add(at), a1 = in(reg) a1.add(at), sa = in(reg) sa,
                    b0 = in(reg) b0.add(k0 * PANEL), b1 = in(reg) b1.add(k0 * PANEL),
                    sb = in(reg) 4 * PANEL,
                    options(nostack, readonly),
                );
            }
            asm!(
                "tilestored [{c0} + {sc}*1], tmm0",
                "tilestored [{c0r} + {sc}*1], tmm1",
                "tilestored [{c1} + {sc}*1], tmm2",
                "tilestored [{c1r} + {sc}*1], tmm3",
                c0 = in(reg) c, c0r = in(reg) c.add(PANEL), c1 = in(reg) c1,
                c1r = in(reg) c1.add(PANEL), sc = in(reg) sc,
                options(nostack),
            );
        } else {
            asm!("tilezero tmm0", "tilezero tmm2", options(nostack, nomem));
            for (s, k0) in (0..kp).step_by(KSTEP).enumerate() {
                if let Some(a_step) = ahead {
                    prefetch_a(a, (lda, a_step), s, kp / KSTEP);
                }
                let at = at(s);
                if first {
                    prefetch_b(b0, s, kp / KSTEP);
                }
                asm!(
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm5, [{a1} + {sa}*1]",
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    a0 = in(reg) a.add(at), a1 = in(reg) a1.add(at), sa = in(reg) sa,
                    b0 = in(reg) b0.add(k0 * PANEL), sb = in(reg) 4 * PANEL,
                    options(nostack, readonly),
                );
            }
            asm!(
                "tilestored [{c0} + {sc}*1], tmm0",
                "tilestored [{c1} + {sc}*1], tmm2",
                c0 = in(reg) c, c1 = in(reg) c1, sc = in(reg) sc,
                options(nostack),
            );
        }
    }
}

/// K (padded) that [`resident`] blocks multiply: two steps, A's 32 rows in four tiles.
pub(super) const RESIDENT_K: usize = 2 * KSTEP;

/// Load a row block's A into the tiles for [`resident`] blocks: its 32 rows (`lda` apart) of
/// [`RESIDENT_K`] values, as tmm4–7 (rows 0–15 and 16–31 of step 0, then of step 1).
///
/// # Safety
/// The tile configuration is loaded; `a` has 32 rows of `RESIDENT_K` readable values spaced
/// `lda` apart.
pub(super) unsafe fn load_resident(a: *const bf16, lda: usize) {
    // SAFETY: the caller's contract; each load reads 16 rows of 64 bytes inside A.
    unsafe {
        let a1 = a.add(16 * lda);
        std::arch::asm!(
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tileloadd tmm5, [{a1} + {sa}*1]",
            "tileloadd tmm6, [{a0s} + {sa}*1]",
            "tileloadd tmm7, [{a1s} + {sa}*1]",
            a0 = in(reg) a, a1 = in(reg) a1, a0s = in(reg) a.add(KSTEP),
            a1s = in(reg) a1.add(KSTEP), sa = in(reg) lda * 2,
            options(nostack, readonly),
        );
    }
}

/// [`block`] for a B of [`RESIDENT_K`] rows, with the row block's A already in the tiles
/// ([`load_resident`]): a panel at a time, its two step tiles of B (tmm2–3) into two 16-row
/// accumulators (tmm0–1), stored as each is done. A 2 × 2 block loads A's four tiles again
/// for every pair of panels, as many tile loads as its products; the wide 1×1 layers from 64
/// channels ([`super::bf16_gemm::Engine::rows_outer`]) walk eight panel pairs or more along
/// one row block, and spent most of their time in loads (on one Sapphire Rapids core these
/// blocks ran 1.5× the rate of the 2 × 2 ones, stores included).
///
/// # Safety
/// As for [`block`], with `b.kp()` equal to `RESIDENT_K` and A loaded by `load_resident`
/// since the last tile instruction of another block.
pub(super) unsafe fn resident(b: &PackedPairs, p: usize, pair: bool, c: *mut f32, ldc: usize) {
    debug_assert_eq!(b.kp(), RESIDENT_K);
    let sc = ldc * 4;
    for q in p..p + 1 + usize::from(pair) {
        let bq = b.panel(q).as_ptr();
        // SAFETY: the caller's contract: panel q has two steps of 16 k-pair rows (64 bytes
        // each); C's 32 rows of the panel's 16 floats are writable.
        unsafe {
            let cq = c.add((q - p) * PANEL);
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tileloadd tmm2, [{b0} + {sb}*1]",
                "tileloadd tmm3, [{b1} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm2",
                "tdpbf16ps tmm1, tmm5, tmm2",
                "tdpbf16ps tmm0, tmm6, tmm3",
                "tdpbf16ps tmm1, tmm7, tmm3",
                "tilestored [{c0} + {sc}*1], tmm0",
                "tilestored [{c1} + {sc}*1], tmm1",
                b0 = in(reg) bq, b1 = in(reg) bq.add(KSTEP * PANEL), sb = in(reg) 4 * PANEL,
                c0 = in(reg) cq, c1 = in(reg) cq.add(16 * ldc), sc = in(reg) sc,
                options(nostack),
            );
        }
    }
}

/// Ask for the cache lines of A's 32 rows that step s + 2 loads, if there is
/// one. The tile loads read A's rows a cache line each, `lda` apart, and a 32-row block walks
/// 32 such streams at once; where K is long (3×3 layers' columns, 576–4608 values) the loads
/// waited on L2 (perf put most of the block's samples on them). ResNet-50 BF16 at batch 8 on
/// 2 Sapphire Rapids cores, 30 steps alternating in one process: its 3×3 layers 0.83–0.87×
/// the time with these, the step 0.95×; four steps ahead rather than two read the same.
/// Measured again once A's rows sat on cache lines (40 steps): those layers' medians still
/// 0.86–0.98× with them.
///
/// # Safety
/// `a` is as [`block`] takes it, with `steps` steps (a prefetch past them would not fault,
/// but none is issued).
#[inline(always)]
unsafe fn prefetch_a(a: *const bf16, (lda, a_step): (usize, usize), s: usize, steps: usize) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    if s + 2 < steps {
        let ahead = (s + 2) * a_step;
        for r in 0..32 {
            // SAFETY: row r's step s + 2 is inside A (the contract).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(a.add(r * lda + ahead).cast()) };
        }
    }
}

/// How many steps ahead of its tile loads a work item's first block asks for B's lines
/// ([`Panels::first`]). A tile load waits for all its 16 lines, and the tiles are not
/// renamed: the next step's load of the same tile waits for this step's products, so a load
/// from memory stalls the block. ResNet-50 BF16 at batch 1 on an Emerald Rapids Xeon (2 vCPU,
/// `bench/ab.py`, the AMX GEMMs' and direct layers' kernel total): 0.937× the time (12 of 16
/// rounds), the step 0.916× (9 of 12); at batch 8, controlled by the stem's kernel, 1.002×
/// (6 of 12). Qwen2.5-0.5B's batch-1 decode forced onto the tiles: TPOT 98–108 → 71–75 ms.
const B_AHEAD: usize = 4;

/// Ask for the 16 lines (one tile) of panel `b`'s step s + [`B_AHEAD`], where there is one.
///
/// # Safety
/// `b` is a panel of `steps` steps (a prefetch past them would not fault, but none is issued).
#[inline(always)]
unsafe fn prefetch_b(b: *const bf16, s: usize, steps: usize) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    if s + B_AHEAD < steps {
        let tile = b.wrapping_add((s + B_AHEAD) * KSTEP * PANEL);
        for line in 0..16 {
            // SAFETY: step s + B_AHEAD is inside the panel (the contract).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(tile.add(line * 2 * PANEL).cast()) };
        }
    }
}

/// `iters` rounds of four independent `tdpbf16ps` on tiles only (tmm0–3 += tmm4 · tmm6 and
/// the like, every input 1/64, no memory traffic between the loads and the one store): the
/// tiles' throughput, which bounds the GEMM as the FMA chains bound the FP32 one. Returns
/// the first `N` floats of tmm0, each 32 · 2⁻¹² · `iters` (exact while below 2²⁴ ulps of it).
///
/// # Safety
/// [`available`] is true.
pub(super) unsafe fn chains<const N: usize>(iters: u64) -> [f32; N] {
    use std::arch::asm;
    #[repr(C, align(64))]
    struct Tile([u8; 1024]);
    // bf16 1/64 is 0x3c80, little-endian.
    let ones = Tile(std::array::from_fn(|i| [0x80, 0x3c][i % 2]));
    let zero = Tile([0; 1024]);
    let mut out = Tile([0; 1024]);
    // SAFETY: `available()` (the contract); every tile load and store covers 16 rows of 64
    // bytes of a 1024-byte buffer (stride 64).
    unsafe {
        configure();
        asm!(
            "tileloadd tmm0, [{z} + {s}*1]",
            "tileloadd tmm1, [{z} + {s}*1]",
            "tileloadd tmm2, [{z} + {s}*1]",
            "tileloadd tmm3, [{z} + {s}*1]",
            "tileloadd tmm4, [{o} + {s}*1]",
            "tileloadd tmm5, [{o} + {s}*1]",
            "tileloadd tmm6, [{o} + {s}*1]",
            "tileloadd tmm7, [{o} + {s}*1]",
            z = in(reg) zero.0.as_ptr(), o = in(reg) ones.0.as_ptr(), s = in(reg) 64usize,
            options(nostack, readonly),
        );
        for _ in 0..iters {
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                options(nostack, nomem),
            );
        }
        asm!(
            "tilestored [{c} + {s}*1], tmm0",
            c = in(reg) out.0.as_mut_ptr(), s = in(reg) 64usize,
            options(nostack),
        );
        release();
    }
    std::array::from_fn(|i| f32::from_le_bytes([0, 1, 2, 3].map(|b| out.0[4 * i + b])))
}

/// FLOPs of one round of [`chains`]: four 16 × 16 × 32 tile products.
pub(super) const CHAIN_FLOPS: u64 = 4 * 16 * 16 * 32 * 2;

#[cfg(test)]
mod tests {
    use super::*;

    /// The tile chains run every round they are asked for: each of tmm0's values is 32
    /// products of 1/64 · 1/64 a round. (Only on a CPU with AMX: elsewhere nothing runs them.)
    #[test]
    fn tile_chains_compute_their_products() {
        if !available() {
            return;
        }
        // SAFETY: `available()`.
        let out: [f32; 20] = unsafe { chains(1000) };
        assert_eq!(out, [1000.0 / 128.0; 20]);
    }
}
