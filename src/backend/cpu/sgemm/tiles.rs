//! The GEMM's register tiles: the portable one, and one macro (`simd_tile!`) that makes the
//! AVX2 and AVX-512 ones, each for f32 and f16 panels.

use super::*;

/// The tile kernel in plain Rust, for CPUs without AVX2 + FMA (the compiler vectorises it for
/// the target's baseline SIMD).
///
/// # Safety
/// Each of the first `ROWS` `a[r]` has `kc` readable floats, `b` has `kc · NR`, `bias` has
/// `NR`, and `c` has `ROWS` rows of `NR` floats spaced `ldc` apart, as has `fin`'s residual
/// where there is one.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile_portable<const ROWS: usize>(
    kc: usize,
    a: &[*const f32; MAX_ROWS],
    (b, _): (*const f32, usize),
    c: *mut f32,
    ldc: usize,
    _valid: (usize, usize),
    init: Init,
    bias: *const f32,
    fin: Option<Finish>,
) {
    let mut acc = [[0f32; NR]; ROWS];
    // SAFETY: the pointer ranges are guaranteed by the caller (see above).
    unsafe {
        for (r, row) in acc.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = if init == Init::Load {
                    *c.add(r * ldc + j)
                } else {
                    *bias.add(j)
                };
            }
        }
        for kk in 0..kc {
            let bk = std::slice::from_raw_parts(b.add(kk * NR), NR);
            for (r, row) in acc.iter_mut().enumerate() {
                let av = *a[r].add(kk);
                for (v, bv) in row.iter_mut().zip(bk) {
                    *v += av * bv;
                }
            }
        }
        for (r, row) in acc.iter_mut().enumerate() {
            if let Some(f) = fin {
                f.apply(row, f.residual.wrapping_add(r * ldc));
            }
            std::ptr::copy_nonoverlapping(row.as_ptr(), c.add(r * ldc), NR);
        }
    }
}

/// The lanes of vector `v` of tile row `r` that lie inside C's valid `rows` × `cols` block
/// (`lanes` a vector): all of them inside, none past the last row, the first few at the edge.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn lanes_in((r, v): (usize, usize), (rows, cols): (usize, usize), lanes: usize) -> usize {
    if r < rows {
        cols.saturating_sub(v * lanes).min(lanes)
    } else {
        0
    }
}

/// Store a register tile's sums (`ROWS` rows of `VECS` vectors of `lanes` floats) into the
/// `valid` rows and columns of C (`c`, rows `ldc` apart), adding the residual laid out as C
/// where `residual` is not null, then applying `op`: one unrolled run of stores for the SIMD
/// tiles, whose accumulators stay in registers as long as every index here is a constant.
///
/// # Safety
/// C and the residual have the `valid` rows and columns `ldc` apart; `ops` are the vector
/// width's unaligned load and store of the first n lanes (n ≤ `lanes`; the path's kernels
/// either mask the rest or are only ever given whole tiles) and its add, which the CPU runs.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn store_tile<V: Copy, const ROWS: usize, const VECS: usize>(
    acc: &[[V; VECS]; ROWS],
    (c, ldc, lanes, valid): (*mut f32, usize, usize, (usize, usize)),
    residual: *const f32,
    (load, add, store): (
        impl Fn(*const f32, usize) -> V,
        impl Fn(V, V) -> V,
        impl Fn(*mut f32, V, usize),
    ),
    op: impl Fn(V) -> V,
) {
    for (r, row) in acc.iter().enumerate() {
        for (v, &x) in row.iter().enumerate() {
            let at = r * ldc + v * lanes;
            let n = lanes_in((r, v), valid, lanes);
            // (Inside the caller's ranges: `load` and `store` dereference them.)
            let x = if residual.is_null() {
                x
            } else {
                add(x, load(residual.wrapping_add(at), n))
            };
            store(c.wrapping_add(at), op(x), n);
        }
    }
}

/// `op` on every vector of a tile of `ROWS` rows of `width` floats (`lanes` a vector), `ldc`
/// apart, in place within its `valid` rows and columns: one loop per activation, not a match
/// per vector.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn map_rows<V: Copy, const ROWS: usize>(
    (c, ldc, width, lanes, valid): (*mut f32, usize, usize, usize, (usize, usize)),
    load: &impl Fn(*const f32, usize) -> V,
    store: &impl Fn(*mut f32, V, usize),
    op: impl Fn(V) -> V,
) {
    for row in 0..ROWS {
        for v in 0..width / lanes {
            let p = c.wrapping_add(row * ldc + v * lanes);
            let n = lanes_in((row, v), valid, lanes);
            store(p, op(load(p, n)), n);
        }
    }
}

/// What the small-K kernels' row loops (`avx2::rows`, `avx512::rows`) take: K; A, its row
/// stride and the rows; the panel's block (of `P`s: f32, or bf16 on AVX2) and bias; C (of
/// `O`s, as `P`), its row stride and the panel's valid columns; the residual laid out as C
/// (null: none).
#[cfg(target_arch = "x86_64")]
pub(super) type RowsCall<O = f32, P = f32> = (
    usize,
    (*const f32, usize, usize),
    *const P,
    *const f32,
    (*mut O, usize, usize),
    *const O,
);

/// A register-tile kernel for one SIMD width: `ROWS` rows of `VECS` vectors (`VECS` × lanes =
/// `NR` for one panel, a multiple of it for several side by side), all accumulators in
/// registers. Per k: `VECS` loads of B, `ROWS` broadcasts of A, `ROWS · VECS` FMAs. One source
/// for every x86 width, so the AVX2 instances that every x86 machine here tests are the same
/// code as the AVX-512 ones; each width gets `tile` (f32 panels), `tile_h` (f16 panels,
/// widened by `$load_h` as B is loaded) and `tile_b` (bf16 panels, widened by `$load_b`: a
/// zero extension and a shift) from one invocation.
#[cfg(target_arch = "x86_64")]
macro_rules! simd_tile {
    // The tiles of one width: `tile` reads f32 panels, `tile_h` f16 ones through `$load_h`,
    // `tile_b` bf16 ones through `$load_b`.
    ($features:literal, $features_h:literal, $lanes:literal, $vec:ty, $zero:ident, $load:ident,
     $load_part:ident, $store_part:ident, $splat:ident, $fma:ident, $add:ident, $act:path,
     $load_h:ident, $load_b:ident) => {
        use super::{
            B_PREFETCH, Finish, Init, MAX_PANELS, MAX_ROWS, MR, NR, lanes_in, map_rows, store_tile,
        };
        use crate::model::op::Act;
        use half::{bf16, f16};
        use std::arch::x86_64::*;

        /// `act` (not ReLU or ReLU6, which the tiles apply in registers) on a stored tile of
        /// `ROWS` rows of `width` floats `ldc` apart, within its `valid` rows and columns:
        /// one loop per activation, not a match per vector, and apart from the tiles (never
        /// inlined), whose K loops otherwise kept these activations' constants in registers
        /// and spilled their accumulators (a 1024³ GEMM at 133 GFLOP/s instead of 300).
        #[target_feature(enable = $features)]
        #[inline(never)]
        unsafe fn activate_stored<const ROWS: usize>(
            (c, ldc, width, valid): (*mut f32, usize, usize, (usize, usize)),
            act: Act,
        ) {
            // SAFETY: the caller's: the valid part of the tile is C's, the features enabled.
            unsafe {
                let load = |p: *const f32, n| $load_part(p, n);
                let store = |p: *mut f32, x, n| $store_part(p, x, n);
                let rows = (c, ldc, width, $lanes, valid);
                match act {
                    Act::Hardswish => {
                        map_rows::<_, ROWS>(rows, &load, &store, |x| $act(Act::Hardswish, x))
                    }
                    Act::Hardsigmoid => {
                        map_rows::<_, ROWS>(rows, &load, &store, |x| $act(Act::Hardsigmoid, x))
                    }
                    Act::Silu => map_rows::<_, ROWS>(rows, &load, &store, |x| $act(Act::Silu, x)),
                    Act::Sigmoid => {
                        map_rows::<_, ROWS>(rows, &load, &store, |x| $act(Act::Sigmoid, x))
                    }
                    Act::Gelu => map_rows::<_, ROWS>(rows, &load, &store, |x| $act(Act::Gelu, x)),
                    Act::None | Act::Relu | Act::Relu6 => unreachable!("the tiles apply these"),
                }
            }
        }

        /// A tile's sums into C's `valid` rows and columns (`c`, rows `ldc` apart), finished by
        /// `fin` (see [`super::store_tile`]): inlined into the whole tiles, whose accumulators
        /// are then stored straight from registers.
        #[inline(always)]
        unsafe fn finish<const ROWS: usize, const VECS: usize>(
            acc: &[[$vec; VECS]; ROWS],
            (c, ldc): (*mut f32, usize),
            valid: (usize, usize),
            fin: Option<Finish>,
        ) {
            let fix = (c, ldc, $lanes, valid);
            // SAFETY: the caller's (a tile's function, with the features enabled).
            unsafe {
                let ops = (
                    |p: *const f32, n| $load_part(p, n),
                    |x, y| $add(x, y),
                    |p: *mut f32, x, n| $store_part(p, x, n),
                );
                let Some(f) = fin else {
                    return store_tile(acc, fix, std::ptr::null(), ops, |x| x);
                };
                if let Some(o) = f.bf16 {
                    return store_bf16::<ROWS, VECS>(*acc, (o.out, ldc), valid, o.residual, f.act);
                }
                let r = f.residual;
                // Each arm unrolls its stores to constant indices, the accumulators leaving
                // registers once. The other activations on the stored rows, from L1, one loop
                // per activation (`activate_stored`): a division (hardswish's, hardsigmoid's)
                // or a polynomial in the unrolled stores made them too long to unroll, and the
                // accumulators lived in memory through the K loop, every FMA storing its
                // result (1024³ at 89 GFLOP/s instead of 210); with one match per vector in
                // the loop, EfficientNet-B0 FP32's SiLU layers took 1.08–1.12× as long.
                match f.act {
                    Act::None => store_tile(acc, fix, r, ops, |x| x),
                    Act::Relu => store_tile(acc, fix, r, ops, |x| $act(Act::Relu, x)),
                    Act::Relu6 => store_tile(acc, fix, r, ops, |x| $act(Act::Relu6, x)),
                    other => {
                        store_tile(acc, fix, r, ops, |x| x);
                        activate_stored::<ROWS>((c, ldc, VECS * $lanes, valid), other);
                    }
                }
            }
        }

        /// [`finish`] for an edge tile, never inlined (see the tiles), its sums passed by
        /// value: by reference, the K loop stored every accumulator after each FMA.
        #[target_feature(enable = $features)]
        #[inline(never)]
        unsafe fn finish_edge<const ROWS: usize, const VECS: usize>(
            acc: [[$vec; VECS]; ROWS],
            c: (*mut f32, usize),
            valid: (usize, usize),
            fin: Option<Finish>,
        ) {
            // SAFETY: the caller's.
            unsafe { finish(&acc, c, valid, fin) }
        }

        simd_tile!(@tile tile, tile_copying, f32, $features, $lanes, $zero, $load, $load_part,
            $store_part, $splat, $fma, $add, $act, $load);
        simd_tile!(@tile tile_h, tile_h_copying, f16, $features_h, $lanes, $zero, $load, $load_part,
            $store_part, $splat, $fma, $add, $act, $load_h);
        simd_tile!(@tile tile_b, tile_b_copying, bf16, $features, $lanes, $zero, $load, $load_part,
            $store_part, $splat, $fma, $add, $act, $load_b);
    };
    (@tile $name:ident, $copying:ident, $e:ty, $features:literal, $lanes:literal, $zero:ident,
     $load:ident, $load_part:ident, $store_part:ident, $splat:ident, $fma:ident, $add:ident,
     $act:path, $load_b:ident) => {
        /// # Safety
        /// The CPU has this function's features (checked by `kernels_for`'s and
        /// `kernels_f16_for`'s callers), and the pointer ranges are as for `tile_portable`
        /// within the `valid` rows and columns of C (and of the residual): the tile reads and
        /// writes no others (AVX-512's mask them; AVX2's are only given whole tiles).
        /// `fin` is applied on the way out: the residual added and ReLU or ReLU6 in
        /// registers, the other activations on the stored tile (see the store's match).
        /// `PACKED`: A is one row group packed k-major (`pack_groups`): `a[0]` alone is read,
        /// row r's k-th value at `a[0] + k·ROWS + r`, `kc · ROWS` readable floats.
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        pub(in crate::backend::cpu::sgemm) unsafe fn $name<
            const ROWS: usize,
            const VECS: usize,
            const EDGE: bool,
            const PACKED: bool,
        >(
            kc: usize,
            a: &[*const f32; MAX_ROWS],
            b: (*const $e, usize),
            c: *mut f32,
            ldc: usize,
            valid: (usize, usize),
            init: Init,
            bias: *const f32,
            fin: Option<Finish>,
        ) {
            let none = (std::ptr::null_mut(), 0);
            // SAFETY: the caller's; nothing is copied.
            unsafe {
                $copying::<ROWS, VECS, EDGE, PACKED, false>(
                    kc, a, b, c, ldc, valid, init, bias, fin, none,
                )
            }
        }

        /// [`$name`], and where `COPY`, each of B's rows as the tile widens it stored
        /// into `copy`: panel q's K block at `copy.0 + q · copy.1`, row k `k · NR` into it
        /// (f32 panels as the f32 tiles read them). The first row group over a bf16 panel
        /// block so widens it for the row groups after it (see `sgemm::gemm_packed_to`).
        ///
        /// # Safety
        /// As for [`$name`]; where `COPY`, `copy` has `VECS · lanes / NR` panels' blocks of
        /// `kc · NR` writable floats, `copy.1` apart.
        #[target_feature(enable = $features)]
        #[inline]
        #[allow(clippy::too_many_arguments)]
        pub(in crate::backend::cpu::sgemm) unsafe fn $copying<
            const ROWS: usize,
            const VECS: usize,
            const EDGE: bool,
            const PACKED: bool,
            const COPY: bool,
        >(
            kc: usize,
            a: &[*const f32; MAX_ROWS],
            (b, bstride): (*const $e, usize),
            c: *mut f32,
            ldc: usize,
            valid: (usize, usize),
            init: Init,
            bias: *const f32,
            fin: Option<Finish>,
            copy: (*mut f32, usize),
        ) {
            const {
                assert!((VECS * $lanes).is_multiple_of(NR) && VECS * $lanes <= MAX_PANELS * NR);
                assert!(ROWS <= MAX_ROWS);
            };
            // A whole tile's extents as constants, which keep its code as without masks.
            let valid = if EDGE { valid } else { (ROWS, VECS * $lanes) };
            // Vector v reads panel v·lanes / NR's block, (v·lanes) mod NR into its row.
            let bv: [*const $e; VECS] = std::array::from_fn(|v| {
                b.wrapping_add(v * $lanes / NR * bstride + v * $lanes % NR)
            });
            // SAFETY: the features are enabled for this function; every load and store stays
            // inside the ranges the caller guarantees (unaligned accesses throughout).
            unsafe {
                let mut acc = [[$zero(); VECS]; ROWS];
                for (r, row) in acc.iter_mut().enumerate() {
                    for (v, x) in row.iter_mut().enumerate() {
                        *x = if init == Init::Load {
                            let n = super::lanes_in((r, v), valid, $lanes);
                            $load_part(c.add(r * ldc + v * $lanes), n)
                        } else {
                            $load(bias.add(v * $lanes))
                        };
                    }
                }
                // Packed, one pointer a row apart: the broadcasts read one stream at constant
                // offsets from it.
                let a: [*const f32; ROWS] = std::array::from_fn(|r| match PACKED {
                    true => a[0].wrapping_add(r),
                    false => a[r],
                });
                let step = if PACKED { ROWS } else { 1 };
                // Not in the thin tiles (fewer rows than MR: AVX2's, for a decode step) on f32
                // panels, which streamed faster without the hint: the four GEMMs of
                // Qwen2.5-0.5B's 24 layers at one row, two threads on a Zen 3, 1.43 GB
                // from memory, took 0.91× as long (medians of 15, alternating, in two runs).
                // Their f16 and bf16 tiles (a line every second k) keep it: without it, 1.10×
                // and 1.09–1.14× as long.
                let prefetch = ROWS >= MR || size_of::<$e>() < size_of::<f32>();
                for kk in 0..kc {
                    // Each panel's row B_PREFETCH k ahead (a hint: past the end reads nothing).
                    for q in 0..VECS * $lanes / NR {
                        let ahead = bv[q * NR / $lanes].wrapping_add((kk + B_PREFETCH) * NR);
                        if prefetch {
                            _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                        }
                    }
                    let bk: [_; VECS] = std::array::from_fn(|v| $load_b(bv[v].add(kk * NR)));
                    if COPY {
                        for (v, x) in bk.iter().enumerate() {
                            let at = v * $lanes / NR * copy.1 + kk * NR + v * $lanes % NR;
                            $store_part(copy.0.add(at), *x, $lanes);
                        }
                    }
                    for (row, a) in acc.iter_mut().zip(a) {
                        let av = $splat(*a.add(kk * step));
                        for (x, bv) in row.iter_mut().zip(bk) {
                            *x = $fma(av, bv, *x);
                        }
                    }
                }
                // An edge tile's finish apart (never inlined), so that its masks do not
                // crowd the K loop's registers (kept inline, they spilled the row pointers:
                // MobileNetV3's 24-column GEMM ran at 44 GFLOP/s against 105 on a copy).
                if EDGE {
                    return finish_edge(acc, (c, ldc), valid, fin);
                }
                finish(&acc, (c, ldc), valid, fin);
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    simd_tile!(
        "avx2,fma",
        "avx2,fma,f16c",
        8,
        __m256,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        load_part,
        store_part,
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        _mm256_add_ps,
        crate::backend::cpu::kernels::activate_ymm,
        load_h,
        load_b
    );

    use crate::backend::cpu::elem::Wide;

    /// 8 values from `p`: AVX2's tiles are given whole tiles only (`n` is 8).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load_part(p: *const f32, n: usize) -> __m256 {
        debug_assert_eq!(n, 8, "AVX2 tiles are whole");
        // SAFETY: the caller's.
        unsafe { _mm256_loadu_ps(p) }
    }

    /// `x` stored at `p`, all 8 lanes (see [`load_part`]).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn store_part(p: *mut f32, x: __m256, n: usize) {
        debug_assert_eq!(n, 8, "AVX2 tiles are whole");
        // SAFETY: the caller's.
        unsafe { _mm256_storeu_ps(p, x) }
    }

    /// A whole tile's sums finished into bf16 (see `Finish::bf16`): the residual's (null:
    /// none) added, `act` applied, rounded as they are stored. Never inlined, the sums passed
    /// by value (see `finish_edge`).
    #[target_feature(enable = "avx2,fma")]
    #[inline(never)]
    unsafe fn store_bf16<const ROWS: usize, const VECS: usize>(
        acc: [[__m256; VECS]; ROWS],
        (out, ldc): (*mut bf16, usize),
        valid: (usize, usize),
        residual: *const bf16,
        act: Act,
    ) {
        use crate::backend::cpu::kernels::{activate_ymm, with_vec_act};
        // SAFETY: the caller's. One loop per common activation, not a match per vector.
        unsafe {
            with_vec_act!(act, activate_ymm, |op| store_bf16_with(
                &acc,
                (out, ldc),
                valid,
                residual,
                op
            ))
        }
    }

    /// [`store_bf16`] with the activation `op`, inlined into each of its arms.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn store_bf16_with<const ROWS: usize, const VECS: usize>(
        acc: &[[__m256; VECS]; ROWS],
        (out, ldc): (*mut bf16, usize),
        valid: (usize, usize),
        residual: *const bf16,
        op: impl Fn(__m256) -> __m256,
    ) {
        for (r, row) in acc.iter().enumerate() {
            for (v, &x) in row.iter().enumerate() {
                let at = r * ldc + v * 8;
                debug_assert_eq!(lanes_in((r, v), valid, 8), 8, "AVX2 tiles are whole");
                // SAFETY: the caller's: a whole tile's places in the output and residual.
                unsafe {
                    let x = match residual.is_null() {
                        true => x,
                        false => _mm256_add_ps(x, <bf16 as Wide>::load8(residual.add(at))),
                    };
                    <bf16 as Wide>::store8(out.add(at), op(x));
                }
            }
        }
    }

    /// The AVX2 small-K kernel (see `avx512::stationary`, whose loop this is at half the
    /// width): C[m × cols] of one panel, A's rows streaming past the panel's block 6 at a
    /// time (the last group repeating the last row), 12 accumulators of two vectors a row (a
    /// last panel of at most 8 columns: 12 rows of one vector), B's rows loaded at each step
    /// (from L1 where the block fits: 16 KiB at K 256; prefetched a page ahead as the tile's
    /// are, for deeper blocks and a first pass from memory). The register tile's per-tile
    /// costs (the row pointers built for 14 rows, C's prefetches, the call through a pointer)
    /// stay out of the loop. A partial width (`cols` under 16 or 8) goes through
    /// a local row: AVX2's masked stores are slow on AMD cores. The panel is f32, or bf16
    /// widened in registers as it is loaded (as `tile_b` does): for a GEMM of few rows, whose
    /// few row groups would not share the cost of widening the block into a buffer first
    /// (`sgemm::FEW_ROWS`).
    ///
    /// # Safety
    /// As for `avx512::stationary`, with AVX2 and FMA in place of AVX-512F, the panel of `P`s.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(in crate::backend::cpu::sgemm) unsafe fn stationary<P: Wide>(
        k: usize,
        (a, lda, m): (*const f32, usize, usize),
        panel: *const P,
        bias: *const f32,
        (c, ldc, cols): (*mut f32, usize, usize),
        fin: Option<Finish>,
    ) {
        let residual = fin.map_or(std::ptr::null(), |f| f.residual);
        let act = fin.map_or(Act::None, |f| f.act);
        // SAFETY: the caller's.
        unsafe { stationary_to((k, (a, lda, m), panel, bias, (c, ldc, cols), residual), act) }
    }

    /// [`stationary`] for C of `O`s: f32, or bf16, C's rows rounded in registers as they are
    /// stored (ties to even, as `Elem::narrow`) rather than stored in f32 and narrowed by a
    /// pass over them afterwards.
    ///
    /// # Safety
    /// As for [`stationary`], C and the residual of `O`s.
    #[target_feature(enable = "avx2,fma")]
    pub(in crate::backend::cpu::sgemm) unsafe fn stationary_to<O: Wide, P: Wide>(
        call: super::RowsCall<O, P>,
        act: Act,
    ) {
        let cols = call.4.2;
        // One copy of the loop per activation kept in registers (see the AVX-512 kernel), and per
        // whole or partial width: with the width known, a row's store is its vectors (a check of
        // the width on every row, and the local row's traffic, were a tenth of a K-24 layer's
        // time). A last panel of at most 8 columns (MobileNetV3's 24, 40, 72, 120, 184 and 200)
        // takes one vector a row, 12 rows at a time: half the FMAs (alone on a Zen 3 core, in one
        // process, 768-row chunks at K 24–480: 0.55–0.75× the time of two vectors a row).
        // MobileNetV3's hardswish and EfficientNet's SiLU have their own copies too (see
        // `with_vec_act`).
        use crate::backend::cpu::kernels::{activate_ymm, with_vec_act};
        macro_rules! by_width {
            ($op:ident) => {
                match cols {
                    NR => rows::<O, P, 2, 6, true>(call, $op),
                    8 => rows::<O, P, 1, 12, true>(call, $op),
                    ..8 => rows::<O, P, 1, 12, false>(call, $op),
                    _ => rows::<O, P, 2, 6, false>(call, $op),
                }
            };
        }
        // SAFETY: the caller's.
        unsafe { with_vec_act!(act, activate_ymm, |op| by_width!(op)) }
    }

    /// [`stationary`]'s loop, `R` rows at a time of `V` vectors each, finishing each row with
    /// `op` after its residual; `WHOLE`: `cols` is `V` · 8.
    ///
    /// # Safety
    /// As for [`stationary`], with `cols` at most `V` · 8.
    #[inline(always)]
    unsafe fn rows<O: Wide, P: Wide, const V: usize, const R: usize, const WHOLE: bool>(
        (k, (a, lda, m), panel, bias, (c, ldc, cols), residual): super::RowsCall<O, P>,
        op: impl Fn(__m256) -> __m256,
    ) {
        // SAFETY: the caller's (every access inside the ranges it guarantees; a partial
        // width's residual and C through a local row).
        unsafe {
            let start: [__m256; V] = std::array::from_fn(|v| _mm256_loadu_ps(bias.add(v * 8)));
            for r0 in (0..m).step_by(R) {
                // The next group's lines of C, and of the residual, while this group's K runs:
                // both stream from memory for a large layer, and its stores and the residual's
                // loads otherwise wait for them after every short K. ResNet-50 FP32 at batch 32
                // on a Zen 3 (2 threads, compiled): the 1×1 layers' time over the unchanged
                // Winograd layers' in the same run, 0.94–1.00× (8 alternating pairs, median
                // 0.96) with this and the tile's residual prefetch against without.
                super::super::prefetch_c_rows((c, residual), ldc, 0, r0 + R, R, m);
                let ar: [*const f32; R] = std::array::from_fn(|i| a.add((r0 + i).min(m - 1) * lda));
                let mut acc = [start; R];
                for kk in 0..k {
                    let ahead = panel.wrapping_add((kk + super::B_PREFETCH) * NR);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                    let bk: [__m256; V] =
                        std::array::from_fn(|v| P::load8(panel.add(kk * NR + v * 8)));
                    for (x, ar) in acc.iter_mut().zip(&ar) {
                        let av = _mm256_set1_ps(*ar.add(kk));
                        for (x, &b) in x.iter_mut().zip(&bk) {
                            *x = _mm256_fmadd_ps(av, b, *x);
                        }
                    }
                }
                for (i, x) in acc.iter().enumerate().take(m - r0) {
                    let at = (r0 + i) * ldc;
                    // A whole width's row in place; a partial one through `row`.
                    let mut row = [O::default(); NR];
                    let (from, to) = if WHOLE {
                        (residual.wrapping_add(at), c.add(at))
                    } else {
                        if !residual.is_null() {
                            std::ptr::copy_nonoverlapping(residual.add(at), row.as_mut_ptr(), cols);
                        }
                        (row.as_ptr(), row.as_mut_ptr())
                    };
                    let finish = |v: usize| {
                        let x = if residual.is_null() {
                            x[v]
                        } else {
                            _mm256_add_ps(x[v], O::load8(from.add(v * 8)))
                        };
                        op(x)
                    };
                    if O::PACKS_16 && V == 2 {
                        O::store16(to, [finish(0), finish(1)]);
                    } else {
                        // Each vector stored as it is finished: building the row first kept
                        // two SiLU results live at once, and FP32 EfficientNet-B0's 1×1
                        // layers took 1.07× as long.
                        for v in 0..V {
                            O::store8(to.add(v * 8), finish(v));
                        }
                    }
                    if !WHOLE {
                        std::ptr::copy_nonoverlapping(row.as_ptr(), c.add(at), cols);
                    }
                }
            }
        }
    }

    /// 8 f16 values widened to f32.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn load_h(p: *const f16) -> __m256 {
        // SAFETY: the caller's: 8 readable values at p.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }

    /// 8 bf16 values widened to f32 (each the top half of its float).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load_b(p: *const bf16) -> __m256 {
        // SAFETY: the caller's: 8 readable values at p.
        unsafe { <bf16 as Wide>::load8(p) }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use crate::backend::cpu::elem::Wide;

    simd_tile!(
        "avx512f",
        "avx512f",
        16,
        __m512,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        load_part,
        store_part,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_add_ps,
        crate::backend::cpu::kernels::activate_zmm,
        load_h,
        load_b
    );

    /// The first `n` (≤ 16) values from `p`, the other lanes zero (nothing read there).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load_part(p: *const f32, n: usize) -> __m512 {
        // SAFETY: the caller's: n readable values at p.
        unsafe {
            if n >= 16 {
                _mm512_loadu_ps(p)
            } else {
                _mm512_maskz_loadu_ps(((1u32 << n) - 1) as __mmask16, p)
            }
        }
    }

    /// The first `n` (≤ 16) lanes of `x` stored at `p` (nothing written past them).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store_part(p: *mut f32, x: __m512, n: usize) {
        // SAFETY: the caller's: n writable values at p.
        unsafe {
            if n >= 16 {
                _mm512_storeu_ps(p, x)
            } else {
                _mm512_mask_storeu_ps(p, ((1u32 << n) - 1) as __mmask16, x)
            }
        }
    }

    /// A tile's sums finished into bf16 within its `valid` rows and columns (see
    /// `Finish::bf16`): the residual's (null: none) added, `act` applied, rounded as they are
    /// stored (masked past the valid columns, as C's stores are). Never inlined, the sums
    /// passed by value (see `finish_edge`): the tiles' K loops keep their registers.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline(never)]
    unsafe fn store_bf16<const ROWS: usize, const VECS: usize>(
        acc: [[__m512; VECS]; ROWS],
        (out, ldc): (*mut bf16, usize),
        valid: (usize, usize),
        residual: *const bf16,
        act: Act,
    ) {
        use crate::backend::cpu::kernels::{activate_zmm, with_vec_act};
        // SAFETY: the caller's. One loop per common activation, not a match per vector.
        unsafe {
            with_vec_act!(act, activate_zmm, |op| store_bf16_with(
                &acc,
                (out, ldc),
                valid,
                residual,
                op
            ))
        }
    }

    /// [`store_bf16`] with the activation `op`, inlined into each of its arms.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn store_bf16_with<const ROWS: usize, const VECS: usize>(
        acc: &[[__m512; VECS]; ROWS],
        (out, ldc): (*mut bf16, usize),
        valid: (usize, usize),
        residual: *const bf16,
        op: impl Fn(__m512) -> __m512,
    ) {
        for (r, row) in acc.iter().enumerate() {
            for (v, &x) in row.iter().enumerate() {
                let at = r * ldc + v * 16;
                let n = lanes_in((r, v), valid, 16);
                let mask = ((1u32 << n) - 1) as __mmask16;
                // SAFETY: the caller's: the valid lanes' places in the output and residual;
                // the masked loads and stores touch no others.
                unsafe {
                    let x = match residual.is_null() {
                        true => x,
                        false => _mm512_add_ps(x, <bf16 as Wide>::load(residual.add(at), mask)),
                    };
                    <bf16 as Wide>::store(out.add(at), mask, op(x));
                }
            }
        }
    }

    /// Rows `row` (`R` ≤ 16 of them) of A, columns 0..kc, k-major into `out` (row r's
    /// column k at k·R + r), as [`super::super::pack_groups`] lays a group out for the packed
    /// tiles: 16 columns of every row loaded at once (masked past kc), the 16 × 16 block
    /// transposed in registers (lanes, pairs of lanes, then 128-bit quarters: 64 shuffles)
    /// and each of its columns stored as R lanes. One value at a time, the copy took 3% of
    /// ConvNeXt-T's FP32 step (perf). Against that, on a Zen 4 (2 vCPUs, FP32 batch 8,
    /// compiled, `bench/ab.py`, 8 rounds of alternating processes): ConvNeXt-T 0.974× the
    /// step time (7 of 8 rounds), ResNet-50 0.969× (7 of 8), ViT-B/16 0.986× (7 of 8).
    ///
    /// # Safety
    /// The CPU has AVX-512F; each of `row`'s pointers has kc readable floats, and `out`
    /// kc · R writable ones.
    #[target_feature(enable = "avx512f")]
    pub(in crate::backend::cpu::sgemm) unsafe fn pack_group<const R: usize>(
        row: &[*const f32; R],
        kc: usize,
        out: *mut f32,
    ) {
        const { assert!(R <= 16) };
        // SAFETY: the caller's: loads of n ≤ kc − k0 values at each row's k0, stores of R
        // values at (k0 + c)·R for c < n.
        unsafe {
            for k0 in (0..kc).step_by(16) {
                let n = (kc - k0).min(16);
                let mut v = [_mm512_setzero_ps(); 16];
                for (v, row) in v.iter_mut().zip(row) {
                    *v = load_part(row.add(k0), n);
                }
                let v = transpose(v);
                for (c, v) in v.iter().enumerate().take(n) {
                    store_part(out.add((k0 + c) * R), *v, R);
                }
            }
        }
    }

    /// The 16 × 16 block whose rows are `r` transposed: lane j of result i is lane i of
    /// `r[j]`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn transpose(r: [__m512; 16]) -> [__m512; 16] {
        // Within each 128-bit quarter q: pairs of rows' lanes interleaved ...
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // ... then pairs of pairs: u[4i + j]'s quarter q holds rows 4i..4i+3 at column 4q + j.
        let mut u = [_mm512_setzero_ps(); 16];
        let pd = _mm512_castps_pd;
        for i in 0..4 {
            let [a, b, c, d] = [t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]];
            u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(a), pd(c)));
            u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(a), pd(c)));
            u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(b), pd(d)));
            u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(b), pd(d)));
        }
        // Column 4q + j gathers quarter q of u[j], u[4 + j], u[8 + j] and u[12 + j]: quarters
        // 0 and 2 (0x88) or 1 and 3 (0xDD) of two vectors, twice.
        let mut out = [_mm512_setzero_ps(); 16];
        for j in 0..4 {
            let even = _mm512_shuffle_f32x4::<0x88>(u[j], u[4 + j]);
            let odd = _mm512_shuffle_f32x4::<0xDD>(u[j], u[4 + j]);
            let even2 = _mm512_shuffle_f32x4::<0x88>(u[8 + j], u[12 + j]);
            let odd2 = _mm512_shuffle_f32x4::<0xDD>(u[8 + j], u[12 + j]);
            out[j] = _mm512_shuffle_f32x4::<0x88>(even, even2);
            out[8 + j] = _mm512_shuffle_f32x4::<0xDD>(even, even2);
            out[4 + j] = _mm512_shuffle_f32x4::<0x88>(odd, odd2);
            out[12 + j] = _mm512_shuffle_f32x4::<0xDD>(odd, odd2);
        }
        out
    }

    /// 16 f16 values widened to f32.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load_h(p: *const f16) -> __m512 {
        // SAFETY: the caller's: 16 readable values at p.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }

    /// 16 bf16 values widened to f32 (each the top half of its float).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load_b(p: *const bf16) -> __m512 {
        // SAFETY: the caller's: 16 readable values at p.
        unsafe {
            let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
        }
    }

    /// C[m × cols] = bias + A[m × k] · one panel's block (k × NR, f32), finished (the residual
    /// laid out as C added, the activation applied) and stored by masked stores, for a K up
    /// to `STATIONARY_MAX_K`: A's rows stream past the panel 6 at a time (the last group
    /// repeating the last row), each row a chain of k FMAs into one accumulator; at K 16 and
    /// 24 the panel stays in registers (as many of its rows as the compiler keeps there
    /// beside the accumulators), at other depths each row of it is loaded at its step. The
    /// register tile's fixed costs per tile (its accumulators started from the bias, B's
    /// prefetches, the caller's row pointers and C's prefetches, 14 rows at a time) weighed as
    /// much as a few steps of K: alone at batch 8 (FP32, alternating in one process), 24 → 72
    /// at 56² with ReLU took 0.75× the time, 16 → 64 at 112² with hardswish 0.71×, SiLU
    /// layers (16 → 96, 24 → 144) 0.85–0.91×, 8 → 32 0.59×, 40 → 120 0.76×, 64 → 256 0.90×;
    /// MobileNetV3-Large's 16 → 64 0.64× in the network. The panel in registers was 9%
    /// faster than loaded at K 16 with ReLU, level at 24.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `a` has `m` rows of `k` readable floats `lda` apart, `panel`
    /// k × NR floats and `bias` NR; C (and the residual, laid out as C) `m` rows of `cols` ≤
    /// NR floats `ldc` apart, C's this caller's alone.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(in crate::backend::cpu::sgemm) unsafe fn stationary(
        k: usize,
        (a, lda, m): (*const f32, usize, usize),
        panel: *const f32,
        bias: *const f32,
        (c, ldc, cols): (*mut f32, usize, usize),
        fin: Option<Finish>,
    ) {
        let residual = fin.map_or(std::ptr::null(), |f| f.residual);
        let act = fin.map_or(Act::None, |f| f.act);
        let call = (k, (a, lda, m), panel, bias, (c, ldc, cols), residual);
        // One copy of the loop per depth held and activation: a match per vector would not
        // keep the panel in registers.
        macro_rules! by_act {
            ($k:literal) => {
                match act {
                    Act::None => rows::<$k>(call, |x| x),
                    Act::Relu => rows::<$k>(call, |x| {
                        crate::backend::cpu::kernels::activate_zmm(Act::Relu, x)
                    }),
                    other => rows::<$k>(call, |x| {
                        crate::backend::cpu::kernels::activate_zmm(other, x)
                    }),
                }
            };
        }
        // SAFETY: the caller's.
        unsafe {
            match k {
                16 => by_act!(16),
                24 => by_act!(24),
                _ => by_act!(0),
            }
        }
    }

    /// [`stationary`] with the panel's `HELD` rows in registers (`HELD` = k), or none
    /// (`HELD` = 0), finishing each row with `op` after its residual.
    ///
    /// # Safety
    /// As for [`stationary`].
    #[inline(always)]
    unsafe fn rows<const HELD: usize>(
        (k, (a, lda, m), panel, bias, (c, ldc, cols), residual): super::RowsCall,
        op: impl Fn(__m512) -> __m512,
    ) {
        // Rows at a time: 4 chains of 4-cycle FMAs just fill Zen 4's one zmm FMA a cycle; 6
        // ran SiLU layers in 0.90–0.95× the time of 4, hardswish and ReLU ones level.
        const R: usize = 6;
        // SAFETY: the caller's (every access inside the ranges it guarantees; the stores and
        // the residual's loads masked to `cols`).
        unsafe {
            let mask = (u32::MAX >> (32 - cols.min(NR))) as __mmask16;
            let held: [__m512; HELD] =
                std::array::from_fn(|kk| _mm512_loadu_ps(panel.add(kk * NR)));
            let start = _mm512_loadu_ps(bias);
            for r0 in (0..m).step_by(R) {
                // The next group's lines of C and of the residual, as AVX2's kernel asks for
                // them (measured there, on a Zen 3; not yet on an AVX-512 core).
                super::super::prefetch_c_rows((c, residual), ldc, 0, r0 + R, R, m);
                let ar: [*const f32; R] = std::array::from_fn(|i| a.add((r0 + i).min(m - 1) * lda));
                let mut acc = [start; R];
                let mut step = |kk: usize, bk: __m512| {
                    for (x, ar) in acc.iter_mut().zip(&ar) {
                        *x = _mm512_fmadd_ps(_mm512_set1_ps(*ar.add(kk)), bk, *x);
                    }
                };
                if HELD > 0 {
                    for (kk, &bk) in held.iter().enumerate() {
                        step(kk, bk);
                    }
                } else {
                    for kk in 0..k {
                        step(kk, _mm512_loadu_ps(panel.add(kk * NR)));
                    }
                }
                for (i, &x) in acc.iter().enumerate().take(m - r0) {
                    let at = (r0 + i) * ldc;
                    let x = if residual.is_null() {
                        x
                    } else {
                        _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, residual.add(at)))
                    };
                    _mm512_mask_storeu_ps(c.add(at), mask, op(x));
                }
            }
        }
    }
}
