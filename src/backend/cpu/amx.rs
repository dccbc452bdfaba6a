//! BF16 GEMMs on Intel AMX (Advanced Matrix Extensions, Sapphire Rapids and later Xeons), for
//! BF16 sessions' convolutions: C (f32) = A (bf16) · B (bf16) + bias, f32 accumulation.
//!
//! AMX adds eight tile registers of 16 rows × 64 bytes and `tdpbf16ps`, which multiplies a
//! 16 × 32 bf16 tile of A by a 32 × 16 tile of B (stored as 16 rows of k-pairs: row r holds
//! B[2r][j], B[2r + 1][j] for j < 16) into a 16 × 16 f32 tile of C — 16,384 FLOPs in one
//! instruction. A Sapphire Rapids core ran it at 2.5 TFLOP/s from registers and this module's
//! 32 × 32 blocking at 235–390 GFLOP/s from memory, against 120–135 for its best AVX-512 FP32
//! tile and 78 for `vdpbf16ps` (AVX512_BF16), which is why BF16 sessions use AMX and not
//! AVX512_BF16 where both exist.
//!
//! Tiles: tmm0–3 accumulate a 32 × 32 block of C (two row halves × two 16-column panels),
//! tmm4–5 hold A's two row halves, tmm6–7 the two panels of B. The tile instructions are
//! written with `asm!` (Rust's AMX intrinsics are unstable); the compiler never touches the
//! tile registers, so their contents live from one `asm!` block to the next.
//!
//! Linux hands AMX's 8 KiB of tile state to a process only when asked
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`): [`available`] asks once.

use half::bf16;
use rayon::prelude::*;

/// Columns of a panel (one B tile's width, one C tile's width).
pub const PANEL: usize = 16;
/// K per tile step (32 bf16 = one 64-byte tile row of A).
pub const KSTEP: usize = 32;
/// Rows of a C block (two 16-row tiles).
pub const BLOCK_ROWS: usize = 32;

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

/// B (K × N) packed for the tiles: K padded with zeros to a multiple of [`KSTEP`], N to a
/// multiple of [`PANEL`]; panel p holds Kp/2 rows of 16 k-pairs (64 bytes, one tile row).
/// The bias is padded alike and kept in f32 (zeros when there is none).
pub struct PackedAmx {
    pub k: usize,
    pub n: usize,
    kp: usize,
    data: Vec<bf16>,
    bias: Vec<f32>,
}

impl PackedAmx {
    /// Pack B given column by column: `fill(j, col)` writes column j (K values), as for
    /// [`super::sgemm::PackedB::from_columns`].
    pub fn from_columns(
        k: usize,
        n: usize,
        fill: impl Fn(usize, &mut [f32]) + Sync,
        bias: Option<&[f32]>,
    ) -> Self {
        let kp = k.div_ceil(KSTEP).max(1) * KSTEP;
        let panels = n.div_ceil(PANEL);
        let mut data = vec![bf16::ZERO; panels * kp * PANEL];
        data.par_chunks_mut(kp * PANEL)
            .enumerate()
            .for_each_init(Vec::new, |col, (p, panel)| {
                col.resize(k, 0.0);
                for jj in 0..PANEL.min(n - p * PANEL) {
                    fill(p * PANEL + jj, col);
                    for (kk, &v) in col.iter().enumerate() {
                        panel[(kk / 2) * 2 * PANEL + jj * 2 + kk % 2] = bf16::from_f32(v);
                    }
                }
            });
        let mut padded = vec![0f32; panels * PANEL];
        if let Some(bias) = bias {
            padded[..n].copy_from_slice(&bias[..n]);
        }
        PackedAmx {
            k,
            n,
            kp,
            data,
            bias: padded,
        }
    }

    /// K padded to the tile step: the row length A's rows must have (zeros past `k`).
    pub fn kp(&self) -> usize {
        self.kp
    }

    pub fn panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    pub fn bytes(&self) -> u64 {
        (self.data.len() * 2 + self.bias.len() * 4) as u64
    }
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

thread_local! {
    /// The last rows of A copied and zero-padded to a whole block when fewer than 32 are left.
    static EDGE: std::cell::RefCell<Vec<bf16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A finished block of C: its first row and row count, its first column (from panel p0's) and
/// valid column count, and its values (32 rows of [`BLOCK_COLS`] f32, `cols` valid per row).
pub struct Done<'a> {
    pub row: usize,
    pub rows: usize,
    pub col: usize,
    pub cols: usize,
    pub values: &'a mut [f32],
}

/// Row length of a finished block's values.
pub const BLOCK_COLS: usize = 2 * PANEL;

/// C = A[0..m, 0..Kp] · B[.., panels p0..p1] + bias, single-threaded, in f32, handed to `done`
/// one block (up to 32 × 32) at a time while it is in L1: the caller applies its epilogue and
/// stores the block wherever it belongs.
///
/// Panels are the outer loop: a pair of B panels (Kp × 32 bf16) is reused by every row block
/// of A, which streams from L2.
///
/// # Safety
/// [`available`] is true; `a` points to `m` rows of at least `b.kp()` readable bf16 spaced
/// `lda` apart, zero past `b.k` (finite at least: they meet B's zero padding).
#[cfg(target_arch = "x86_64")]
pub unsafe fn gemm(
    m: usize,
    a: *const bf16,
    lda: usize,
    b: &PackedAmx,
    (p0, p1): (usize, usize),
    done: &mut impl FnMut(Done<'_>),
) {
    use std::arch::asm;
    let kp = b.kp;
    let whole = m / BLOCK_ROWS * BLOCK_ROWS;
    // SAFETY: `available()` (the contract) means the CPU runs these instructions and the
    // kernel holds tile state for this process; the configuration is 64 aligned bytes.
    unsafe { asm!("ldtilecfg [{0}]", in(reg) CONFIG.0.as_ptr(), options(nostack)) };
    EDGE.with_borrow_mut(|edge| {
        if whole < m {
            edge.clear();
            edge.resize(BLOCK_ROWS * kp, bf16::ZERO);
            for r in 0..m - whole {
                // SAFETY: rows whole..m of A have kp readable values (the contract).
                let src = unsafe { std::slice::from_raw_parts(a.add((whole + r) * lda), kp) };
                edge[r * kp..(r + 1) * kp].copy_from_slice(src);
            }
        }
        let mut values = [0f32; BLOCK_ROWS * BLOCK_COLS];
        let mut p = p0;
        while p < p1 {
            let pair = p + 1 < p1;
            let cols = (if pair { 2 } else { 1 } * PANEL).min(b.n - p * PANEL);
            let mut i = 0;
            while i < m {
                let (ab, ldab) = if i < whole {
                    // SAFETY: row i exists (the contract).
                    (unsafe { a.add(i * lda) }, lda)
                } else {
                    (edge.as_ptr(), kp)
                };
                // SAFETY: the block's A rows have kp values (above), panels p (and p + 1) of
                // B exist, `values` holds 32 rows of BLOCK_COLS floats.
                unsafe { block(ab, ldab, b, p, pair, values.as_mut_ptr(), BLOCK_COLS) };
                let rows = BLOCK_ROWS.min(m - i);
                done(Done {
                    row: i,
                    rows,
                    col: (p - p0) * PANEL,
                    cols,
                    values: &mut values,
                });
                i += rows;
            }
            p += if pair { 2 } else { 1 };
        }
    });
    // SAFETY: as above; hands the tile state back.
    unsafe { asm!("tilerelease", options(nostack)) };
}

/// One 32-row block of C for panel p (and p + 1 when `pair`): the accumulators start from the
/// bias (a stride-0 tile load repeats its 16 values on every row), then one step per 32 of K.
///
/// # Safety
/// The tile configuration is loaded; `a` has 32 rows of `b.kp` values spaced `lda` apart;
/// `c` has 32 rows of 32 (`pair`) or 16 writable floats spaced `ldc` apart.
#[cfg(target_arch = "x86_64")]
unsafe fn block(
    a: *const bf16,
    lda: usize,
    b: &PackedAmx,
    p: usize,
    pair: bool,
    c: *mut f32,
    ldc: usize,
) {
    use std::arch::asm;
    let kp = b.kp;
    let panel = |q: usize| b.data[q * kp * PANEL..].as_ptr();
    let (b0, bias0) = (panel(p), b.bias[p * PANEL..].as_ptr());
    let sa = lda * 2;
    let sc = ldc * 4;
    // SAFETY: the caller's contract; every tile access stays in the ranges it names.
    unsafe {
        let a1 = a.add(16 * lda);
        let c1 = c.add(16 * ldc);
        if pair {
            let (b1, bias1) = (panel(p + 1), b.bias[(p + 1) * PANEL..].as_ptr());
            asm!(
                "tileloadd tmm0, [{z0} + {zero}*1]",
                "tileloadd tmm1, [{z1} + {zero}*1]",
                "tileloadd tmm2, [{z0} + {zero}*1]",
                "tileloadd tmm3, [{z1} + {zero}*1]",
                z0 = in(reg) bias0, z1 = in(reg) bias1, zero = in(reg) 0usize,
                options(nostack, readonly),
            );
            for k0 in (0..kp).step_by(KSTEP) {
                asm!(
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm5, [{a1} + {sa}*1]",
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tileloadd tmm7, [{b1} + {sb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a.add(k0), a1 = in(reg) a1.add(k0), sa = in(reg) sa,
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
            asm!(
                "tileloadd tmm0, [{z0} + {zero}*1]",
                "tileloadd tmm2, [{z0} + {zero}*1]",
                z0 = in(reg) bias0, zero = in(reg) 0usize,
                options(nostack, readonly),
            );
            for k0 in (0..kp).step_by(KSTEP) {
                asm!(
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm5, [{a1} + {sa}*1]",
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    a0 = in(reg) a.add(k0), a1 = in(reg) a1.add(k0), sa = in(reg) sa,
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

/// Never called: [`available`] is false off x86-64.
///
/// # Safety
/// None needed; it panics.
#[cfg(not(target_arch = "x86_64"))]
pub unsafe fn gemm(
    _m: usize,
    _a: *const bf16,
    _lda: usize,
    _b: &PackedAmx,
    _panels: (usize, usize),
    _done: &mut impl FnMut(Done<'_>),
) {
    unreachable!("AMX is x86-64 only")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shape class the tiles meet (row tails, single panels, K and N padding, a panel
    /// range that starts on an odd panel), against a plain f64 sum of the same bf16 values.
    /// Runs where AMX is available (Sapphire Rapids and later); elsewhere it says so and
    /// checks only the packing.
    #[test]
    fn amx_gemm_matches_naive() {
        for &(m, k, n, p0, p1) in &[
            (1, 3, 16, 0, 1),
            (17, 64, 40, 0, 3),
            (32, 147, 64, 0, 4),
            (45, 600, 72, 1, 5),
            (100, 256, 1000, 0, 63),
            (64, 32, 48, 1, 2),
        ] {
            let av: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919 % 29) as f32 - 14.0) / 8.0)
                .collect();
            let bv: Vec<f32> = (0..k * n)
                .map(|i| ((i * 104_729 % 23) as f32 - 11.0) / 16.0)
                .collect();
            let bias: Vec<f32> = (0..n).map(|j| j as f32 / 4.0 - 3.0).collect();
            let packed = PackedAmx::from_columns(
                k,
                n,
                |j, col| {
                    col.iter_mut()
                        .enumerate()
                        .for_each(|(kk, v)| *v = bv[kk * n + j])
                },
                Some(&bias),
            );
            assert_eq!(packed.kp() % KSTEP, 0);
            assert!(packed.kp() >= k);
            if !available() {
                continue;
            }
            let kp = packed.kp();
            let lda = kp + 32;
            let mut a = vec![bf16::ZERO; m * lda];
            for r in 0..m {
                for kk in 0..k {
                    a[r * lda + kk] = bf16::from_f32(av[r * k + kk]);
                }
            }
            let width = (p1 * PANEL).min(n) - p0 * PANEL;
            let ldc = width + 5;
            let mut c = vec![f32::NAN; m * ldc];
            let mut seen = 0;
            // SAFETY: AMX is available; A has m rows of kp values (zeros past k).
            unsafe {
                gemm(m, a.as_ptr(), lda, &packed, (p0, p1), &mut |d: Done<'_>| {
                    assert!(d.col + d.cols <= width && d.row + d.rows <= m);
                    for r in 0..d.rows {
                        let row = (d.row + r) * ldc + d.col;
                        c[row..row + d.cols].copy_from_slice(&d.values[r * BLOCK_COLS..][..d.cols]);
                    }
                    seen += d.rows * d.cols;
                })
            };
            assert_eq!(seen, m * width, "every element handed over once");
            for r in 0..m {
                for jj in 0..width {
                    let j = p0 * PANEL + jj;
                    let want: f64 = bias[j] as f64
                        + (0..k)
                            .map(|kk| {
                                a[r * lda + kk].to_f64() * bf16::from_f32(bv[kk * n + j]).to_f64()
                            })
                            .sum::<f64>();
                    let got = c[r * ldc + jj] as f64;
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "m{m} k{k} n{n} panels {p0}..{p1}: C[{r}][{j}] = {got}, want {want}"
                    );
                }
                // Nothing past the panels' columns is written.
                assert!(c[r * ldc + width..(r + 1) * ldc].iter().all(|v| v.is_nan()));
            }
        }
        if !available() {
            eprintln!("AMX not available on this machine: only the packing was checked");
        }
    }
}
