//! The GEMM against a plain triple loop: every SIMD path, tile shape, K block and alias case.

use super::*;

/// Every kernel this machine can run, against a plain triple loop, on sizes that cover
/// edge tiles in both directions and several K blocks.
#[test]
fn kernels_match_naive_matmul() {
    let one = |rows, tall, short| Kernels {
        rows,
        panels: 1,
        tall,
        short,
        tall1: tall,
        short1: short,
        stationary: None,
        small_k: 0,
        tails: None,
        edges: None,
        exact: None,
        packed: None,
        pack_from: 0,
        pack_over_k: 0,
    };
    let mut kernels: Vec<(&str, Kernels)> = vec![
        ("portable", kernels_for(Simd::Portable)),
        // The tall-and-short logic, which only AVX-512 uses, on any machine.
        (
            "portable 12",
            one(12, tile_portable::<12>, tile_portable::<MR>),
        ),
    ];
    let best = crate::backend::cpu::simd::best();
    #[cfg(target_arch = "x86_64")]
    if best.has_avx2() {
        kernels.push(("avx2", kernels_for(Simd::Avx2Fma)));
        // Its register tile at every depth, as where the probe declines the small-K kernel
        // (which otherwise takes every single-block K here).
        let tiles = Kernels {
            small_k: 0,
            ..kernels_for(Simd::Avx2Fma)
        };
        kernels.push(("avx2 without its small-K kernel", tiles));
        // Its last short row groups as the 6-row tile on a local copy, and in the small-K
        // kernel repeating a row, as before it had tiles that tall.
        kernels.push((
            "avx2 without tail tiles",
            Kernels {
                tails: None,
                ..kernels_for(Simd::Avx2Fma)
            },
        ));
        // AVX-512's shapes through the same source with AVX2 vectors (they spill
        // registers: correct, not fast), two panels wide with one-panel tiles for an odd
        // last panel, as AVX-512 runs them.
        kernels.push((
            "avx2 12 rows, 2 panels",
            Kernels {
                rows: 12,
                panels: 2,
                tall: avx2::tile::<12, 4, false, false>,
                short: avx2::tile::<MR, 4, false, false>,
                tall1: avx2::tile::<12, 2, false, false>,
                short1: avx2::tile::<MR, 2, false, false>,
                stationary: None,
                small_k: 0,
                tails: None,
                edges: None,
                exact: None,
                packed: None,
                pack_from: 0,
                pack_over_k: 0,
            },
        ));
    }
    if best >= Simd::Avx512 {
        kernels.push(("avx512", kernels_for(Simd::Avx512)));
        // Its register tiles at every K, as where the probe declines the small-K kernel.
        let tiles = Kernels {
            small_k: 0,
            ..kernels_for(Simd::Avx512)
        };
        kernels.push(("avx512 without its small-K kernel", tiles));
        // Its edge tiles on a local copy, as the paths without masks run them.
        let copied = Kernels {
            edges: None,
            ..tiles
        };
        kernels.push(("avx512 with edge tiles copied", copied));
        // Its last rows short of a tall tile as 6-row edge tiles, as before it had tiles
        // exactly as tall (and the small-K kernel repeating its last row).
        let sixes = Kernels {
            exact: None,
            ..kernels_for(Simd::Avx512)
        };
        kernels.push(("avx512 without exact-height tiles", sixes));
        // Its tiles reading A packed in every call that has a whole row group.
        let packed = Kernels {
            pack_from: 1,
            pack_over_k: 0,
            ..tiles
        };
        kernels.push(("avx512 with A packed", packed));
    }
    for &(m, k, n) in &[
        (1, 1, 1),
        (6, 16, 16),
        // AVX-512's B-in-registers depths: rows not a multiple of its 4, a half last panel.
        (31, 24, 40),
        (9, 16, 33),
        // Its depths with the panel loaded a row a step, and the first past them (the tiles;
        // AVX2's small-K kernel goes on to a whole K block).
        (11, 64, 48),
        (8, 65, 16),
        // A last panel of 12 columns: AVX2's small-K kernel finishes it through a local row.
        (10, 40, 28),
        (7, 300, 17),
        (13, 513, 40),
        (5, 3, 33),
        (30, 20, 32),
        (19, 260, 17),
        // Three K blocks, the last a short one.
        (7, 2100, 17),
        // Rows 4 and 8 KiB apart: the K blocks are copied first (`aliases`), or packed.
        (14, 1024, 20),
        (3, 2048, 16),
        (30, 1024, 48),
        // Two whole row groups and a short one over three K blocks, an odd last panel.
        (29, 2100, 40),
    ] {
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0)
            .collect();
        let bm: Vec<f32> = (0..k * n)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 5.0)
            .collect();
        let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.1).collect();
        let packed = PackedB::<f32>::new(k, n, |kk, j| bm[kk * n + j], Some(&bias));
        let packed = packed.view();
        // AVX2's tiles exactly as tall as a GEMM of fewer rows than a tile (`thin`).
        #[cfg(target_arch = "x86_64")]
        let thin = best.has_avx2().then(|| {
            let tiles = Kernels {
                small_k: 0,
                ..kernels_for(Simd::Avx2Fma)
            };
            ("avx2 thin", thin(tiles, m))
        });
        #[cfg(not(target_arch = "x86_64"))]
        let thin = None;
        let kernels: Vec<(&str, Kernels)> = kernels.iter().copied().chain(thin).collect();
        // All the panels, and from the second on (a call that starts on an odd panel).
        let starts = (0..packed.panels().min(2))
            .flat_map(|p0| [Order::RowsOuter, Order::PanelsOuter].map(|order| (p0, order)));
        for ((name, kern), (p0, order)) in kernels
            .iter()
            .flat_map(|k| starts.clone().map(move |s| (k, s)))
        {
            // C has a wider row stride than N, to check that ldc is honoured.
            let ldc = n + 3;
            // C (all NaN first, with rows past the last to catch a tile that stores there)
            // from this call, finished by `fin`.
            let run = |fin: Option<Finish>| {
                let mut c = vec![f32::NAN; (m + MAX_ROWS) * ldc];
                let (panels, out) = ((p0, packed.panels()), c.as_mut_ptr());
                // SAFETY: a is m × k, c is m × ldc with ldc ≥ n − p0·NR, and a residual
                // of `fin` has C's m rows of ldc floats.
                unsafe {
                    gemm_with(
                        *kern,
                        order,
                        m,
                        a.as_ptr(),
                        k,
                        &packed,
                        panels,
                        out,
                        ldc,
                        fin,
                    )
                };
                c
            };
            let c = run(None);
            assert!(
                c[m * ldc..].iter().all(|v| v.is_nan()),
                "{name}: rows past m written"
            );
            for i in 0..m {
                for j in p0 * NR..n {
                    let want: f64 = bias[j] as f64
                        + (0..k)
                            .map(|kk| a[i * k + kk] as f64 * bm[kk * n + j] as f64)
                            .sum::<f64>();
                    let got = c[i * ldc + j - p0 * NR] as f64;
                    assert!(
                        (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "{name} {order:?} from panel {p0} m{m} k{k} n{n} ({i},{j}): {got} \
                         vs {want}"
                    );
                }
                // Nothing past the call's columns is written.
                assert!(
                    c[i * ldc + n - p0 * NR..(i + 1) * ldc]
                        .iter()
                        .all(|v| v.is_nan())
                );
            }
            // Finished in the tiles (a residual, then each activation in turn) as a pass
            // over the plain results finishes them: full tiles in registers, edge tiles and
            // the last of several K blocks alike.
            let residual: Vec<f32> = (0..m * ldc).map(|i| (i % 9) as f32 - 4.0).collect();
            for (x, act) in Act::ALL.into_iter().enumerate() {
                let fin = Finish {
                    act,
                    residual: if x % 2 == 0 {
                        residual.as_ptr()
                    } else {
                        std::ptr::null()
                    },
                    bf16: None,
                };
                let done = run(Some(fin));
                assert!(
                    done[m * ldc..].iter().all(|v| v.is_nan()),
                    "{name}: rows past m"
                );
                for i in 0..m {
                    let width = n - p0 * NR;
                    let mut want = c[i * ldc..][..width].to_vec();
                    // SAFETY: row i of the residual has ldc ≥ width floats.
                    unsafe { fin.apply(&mut want, residual[i * ldc..].as_ptr()) };
                    for (j, (g, w)) in done[i * ldc..][..width].iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                            "{name} {order:?} {act:?} residual {} m{m} k{k} n{n} ({i},{j}): \
                             {g} vs {w}",
                            x % 2 == 0
                        );
                    }
                    assert!(
                        done[i * ldc + width..(i + 1) * ldc]
                            .iter()
                            .all(|v| v.is_nan())
                    );
                }
                // Written over its residual (one K block: C starts as the residual and each
                // value is read as its sum is stored over it), bit for bit what writing apart
                // gives; C's columns past the call's and its rows past m untouched.
                if x % 2 != 0 || !one_k_block(k) {
                    continue;
                }
                let mut over = vec![f32::NAN; (m + MAX_ROWS) * ldc];
                over[..m * ldc].copy_from_slice(&residual);
                let out = over.as_mut_ptr();
                let fin = Finish {
                    act,
                    residual: out.cast_const(),
                    bf16: None,
                };
                // SAFETY: as `run`'s, C being the residual's buffer in one K block.
                unsafe {
                    gemm_with(
                        *kern,
                        order,
                        m,
                        a.as_ptr(),
                        k,
                        &packed,
                        (p0, packed.panels()),
                        out,
                        ldc,
                        Some(fin),
                    )
                };
                assert!(over[m * ldc..].iter().all(|v| v.is_nan()), "{name}: over");
                let width = n - p0 * NR;
                for i in 0..m {
                    let (row, apart) = (&over[i * ldc..(i + 1) * ldc], &done[i * ldc..]);
                    for j in 0..ldc {
                        let want = if j < width {
                            apart[j]
                        } else {
                            residual[i * ldc + j]
                        };
                        assert!(
                            row[j].to_bits() == want.to_bits(),
                            "{name} {order:?} {act:?} over the residual m{m} k{k} n{n} \
                             ({i},{j}): {} vs {want}",
                            row[j]
                        );
                    }
                }
            }
        }
    }
}

/// Half-precision panels give exactly what the same values packed in f32 give, widened in
/// registers by the f16 tiles (each SIMD path's, and `gemm_packed`'s choice) or, bf16 past
/// `FEW_ROWS` rows (`FEW_ROWS_AVX512`), a K block at a time: several K blocks, strides that
/// alias (A's blocks copied, or packed), an edge panel, and a panel range that starts past
/// panel 0.
#[test]
fn packed_halves_match_f32() {
    fn run<T: Elem>(b: &PackedB<T>, a: &[f32], m: usize, p: (usize, usize)) -> Vec<f32> {
        run_finished(b, a, m, p, None)
    }
    /// `run`, finished with ReLU over `residual` (laid out as C) where there is one.
    fn run_finished<T: Elem>(
        b: &PackedB<T>,
        a: &[f32],
        m: usize,
        p: (usize, usize),
        residual: Option<&[f32]>,
    ) -> Vec<f32> {
        let ldc = (p.1 - p.0) * NR;
        let mut c = vec![f32::NAN; m * ldc];
        let fin = residual.map(|r| {
            assert_eq!(r.len(), c.len());
            Finish {
                act: Act::Relu,
                residual: r.as_ptr(),
                bf16: None,
            }
        });
        // SAFETY: a is m × b.k, c (and the residual) m × ldc, wide enough for the panels'
        // columns.
        unsafe { gemm_packed(m, a.as_ptr(), b.k, b, p, c.as_mut_ptr(), ldc, fin) };
        c
    }
    for &(m, k, n) in &[
        (7, 300, 17),
        (14, 1024, 40),
        (3, 2048, 33),
        (5, 2100, 20),
        (31, 2100, 40),
        // Past `FEW_ROWS` (`FEW_ROWS_AVX512`): bf16 widened a K block at a time (AVX-512 and
        // portable), on AVX-512 by the first row group's tile for each whole panel pair.
        (29, 1100, 64),
        (70, 2100, 40),
        (100, 1100, 33),
        // And over `PACK_FROM` panels: A's row groups packed once per K block for all the
        // widened panel groups (`APack::Ready`), a last block too shallow to pack (1050), a
        // stride that aliases (2048, not copied where packed), rows past the last group.
        (75, 1100, 261),
        (80, 1050, 270),
        (75, 2048, 261),
    ] {
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0)
            .collect();
        // Multiples of 1/8 below 2 in magnitude: exact in f16 and bf16.
        let b = |kk: usize, j: usize| ((kk * 5 + j * 3) % 17) as f32 / 8.0 - 1.0;
        let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.25).collect();
        let f = PackedB::<f32>::new(k, n, b, Some(&bias));
        let h = PackedB::<half::f16>::new(k, n, b, Some(&bias));
        let bf = PackedB::<half::bf16>::new(k, n, b, Some(&bias));
        let panels = n.div_ceil(NR);
        for p in [(0, panels), (1, panels)] {
            let want = run(&f, &a, m, p);
            let cols = (p.1 * NR).min(n) - p.0 * NR;
            let ldc = want.len() / m;
            assert!(
                want.chunks(ldc)
                    .all(|row| row[..cols].iter().all(|v| v.is_finite())),
                "m{m} k{k} n{n}: C not all written"
            );
            // The f16 tiles of every SIMD path up to the one in use, called directly (the
            // reference ran on the path in use: with a lesser one forced, the FMA tiles'
            // rounding is not its rounding).
            let best = crate::backend::cpu::simd::simd();
            let mut direct = Vec::new();
            /// C from `kern`'s tiles called directly on `data`'s panels.
            fn direct_run<E>(
                kern: Kernels<E>,
                (data, bias): (&[E], &[f32]),
                (m, k, n): (usize, usize, usize),
                a: &[f32],
                p: (usize, usize),
                (len, ldc): (usize, usize),
            ) -> Vec<f32> {
                let view = Panels { k, n, data, bias };
                let mut c = vec![f32::NAN; len];
                // SAFETY: as for `run`.
                unsafe {
                    gemm_with(
                        kern,
                        Order::ByCache,
                        m,
                        a.as_ptr(),
                        k,
                        &view,
                        p,
                        c.as_mut_ptr(),
                        ldc,
                        None,
                    )
                };
                c
            }
            let sizes = ((m, k, n), &a[..], p, (want.len(), ldc));
            for (name, path) in [("avx2", Simd::Avx2Fma), ("avx512", Simd::Avx512)] {
                let (dims, a, p, out) = sizes;
                if let Some(kern) = kernels_f16_for(path).filter(|_| best >= path) {
                    let c = direct_run(kern, (&h.data, &h.bias), dims, a, p, out);
                    direct.push((format!("f16 {name} tiles"), c));
                    // And reading A packed wherever a call has a whole row group.
                    let kern = Kernels {
                        pack_from: 1,
                        pack_over_k: 0,
                        ..kern
                    };
                    let c = direct_run(kern, (&h.data, &h.bias), dims, a, p, out);
                    direct.push((format!("f16 {name} tiles, A packed"), c));
                }
                if let Some(kern) = kernels_bf16_for(path).filter(|_| best >= path) {
                    let c = direct_run(kern, (&bf.data, &bf.bias), dims, a, p, out);
                    direct.push((format!("bf16 {name} tiles"), c));
                    let kern = Kernels {
                        pack_from: 1,
                        pack_over_k: 0,
                        ..kern
                    };
                    let c = direct_run(kern, (&bf.data, &bf.bias), dims, a, p, out);
                    direct.push((format!("bf16 {name} tiles, A packed"), c));
                }
            }
            // And finished (a residual, ReLU): on the last K block alone, in the bf16 tile
            // that widens a block as well as in the tiles after it.
            let residual: Vec<f32> = (0..want.len())
                .map(|i| ((i * 5 % 9) as f32 - 4.0) / 4.0)
                .collect();
            let finished = run_finished(&f, &a, m, p, Some(&residual));
            let halves = [
                ("f16".to_string(), run(&h, &a, m, p)),
                ("bf16".to_string(), run(&bf, &a, m, p)),
            ];
            let bf16_finished = run_finished(&bf, &a, m, p, Some(&residual));
            for (r, (g, w)) in bf16_finished
                .chunks(ldc)
                .zip(finished.chunks(ldc))
                .enumerate()
            {
                assert_eq!(g[..cols], w[..cols], "bf16 finished m{m} k{k} n{n} row {r}");
            }
            for (name, got) in halves.into_iter().chain(direct) {
                for (r, (g, w)) in got
                    .chunks(want.len() / m)
                    .zip(want.chunks(want.len() / m))
                    .enumerate()
                {
                    assert_eq!(
                        g[..cols],
                        w[..cols],
                        "{name} m{m} k{k} n{n} panels {p:?} row {r}"
                    );
                }
            }
        }
    }
}

/// Which calls the AVX-512 tiles read A packed in: whole row groups of calls with
/// `PACK_FROM` panels or more over K blocks deeper than `PACK_OVER_K`, none elsewhere.
#[cfg(target_arch = "x86_64")]
/// Tiles that finish into a bf16 output (`Finish::bf16`) store, bit for bit, what the f32
/// finish rounded afterwards gives: the residual (bf16, widened) added, each activation, whole
/// tiles and masked edges, bf16 and f32 panels, a call from the second panel on. Only where
/// the path does it (`narrows_in_tiles`: AVX-512); elsewhere there is nothing to compare.
#[test]
fn tiles_round_into_bf16_as_the_f32_finish_does() {
    use crate::backend::cpu::elem::{bf16_f32, f32_bf16};
    for (m, k, n) in [(31, 260, 40), (14, 96, 64), (45, 1024, 33), (5, 200, 16)] {
        if !narrows_in_tiles(k) {
            continue;
        }
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0)
            .collect();
        let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.1 - 1.0).collect();
        // Exact in bf16, so both packings hold the same values.
        let b = |kk: usize, j: usize| ((kk * n + j) * 5 % 11) as f32 / 4.0 - 1.0;
        let residual: Vec<bf16> = (0..m * n)
            .map(|i| bf16::from_f32((i % 9) as f32 * 0.37 - 1.5))
            .collect();
        let wide: Vec<f32> = residual.iter().map(|&r| bf16_f32(r)).collect();
        let f32s = PackedB::<f32>::new(k, n, b, Some(&bias));
        let bf16s = PackedB::<bf16>::new(k, n, b, Some(&bias));
        for (x, act) in Act::ALL.into_iter().enumerate() {
            let with_residual = x % 2 == 0;
            for p0 in 0..2.min(n.div_ceil(NR)) {
                let cols = n - p0 * NR;
                // C, then the output, have n columns; a call from panel p0 writes cols of them.
                let mut c = vec![0f32; m * n];
                let fin = Finish {
                    act,
                    residual: match with_residual {
                        true => wide[p0 * NR..].as_ptr(),
                        false => std::ptr::null(),
                    },
                    bf16: None,
                };
                let panels = (p0, f32s.panels());
                // SAFETY: a is m × k, c and the residual m × n; the panels cover n columns.
                unsafe {
                    gemm_packed(
                        m,
                        a.as_ptr(),
                        k,
                        &f32s,
                        panels,
                        c[p0 * NR..].as_mut_ptr(),
                        n,
                        Some(fin),
                    )
                };
                for (name, both) in [("f32 panels", false), ("bf16 panels", true)] {
                    let mut out = vec![bf16::from_f32(7.0); m * n];
                    let mut unused = vec![0f32; m * n];
                    let fin = Finish {
                        act,
                        residual: std::ptr::null(),
                        bf16: Some(Bf16Out {
                            out: out[p0 * NR..].as_mut_ptr(),
                            residual: match with_residual {
                                true => residual[p0 * NR..].as_ptr(),
                                false => std::ptr::null(),
                            },
                        }),
                    };
                    let c_none = unused[p0 * NR..].as_mut_ptr();
                    // SAFETY: as above, the output and its residual m × n bf16s.
                    unsafe {
                        match both {
                            true => {
                                gemm_packed(m, a.as_ptr(), k, &bf16s, panels, c_none, n, Some(fin))
                            }
                            false => {
                                gemm_packed(m, a.as_ptr(), k, &f32s, panels, c_none, n, Some(fin))
                            }
                        }
                    };
                    assert!(unused.iter().all(|&v| v == 0.0), "{name}: C written");
                    for i in 0..m {
                        for j in 0..n {
                            let got = out[i * n + j].to_bits();
                            let want = match j < p0 * NR {
                                true => bf16::from_f32(7.0).to_bits(),
                                false => f32_bf16(c[i * n + j]).to_bits(),
                            };
                            assert_eq!(
                                got, want,
                                "{name} {act:?} residual {with_residual} m{m} k{k} n{n} from \
                                 panel {p0} ({i},{j}), {cols} columns"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_is_packed_for_wide_calls_over_deep_k_blocks() {
    let kern = kernels_for(Simd::Avx512);
    let wide = (0, PACK_FROM);
    assert_eq!(packed_groups(&kern, 30, wide, PACK_OVER_K + 1), 2);
    assert_eq!(packed_groups(&kern, 30, wide, KC), 2);
    assert_eq!(packed_groups(&kern, 30, wide, PACK_OVER_K), 0);
    assert_eq!(packed_groups(&kern, 30, (1, PACK_FROM), KC), 0);
    assert_eq!(packed_groups(&kern, 13, wide, KC), 0);
    assert_eq!(packed_groups(&kernels_for(Simd::Avx2Fma), 30, wide, KC), 0);
}

/// `pack_groups` lays each group out k-major (group g's row r, column k at g·rows·kc +
/// k·rows + r) on the path in use (AVX-512's transposes 16 columns in registers, masking the
/// last ones) and on any other row count, at depths around and between its blocks of 16 and
/// with rows further apart than the depth.
#[test]
fn groups_of_a_are_packed_k_major() {
    for rows in [MAX_ROWS, MR] {
        for kc in [1, 5, 15, 16, 17, 31, 32, 65, 300] {
            let (groups, lda) = (3, kc + 7);
            let a: Vec<f32> = (0..groups * rows * lda).map(|i| i as f32).collect();
            // Garbage first: every value of the packed groups is written.
            let mut pack = vec![f32::NAN; groups * rows * kc + 5];
            // SAFETY: `a` has groups · rows rows of lda ≥ kc floats.
            unsafe { pack_groups(a.as_ptr(), lda, (groups, rows), kc, &mut pack) };
            for g in 0..groups {
                for r in 0..rows {
                    for k in 0..kc {
                        let at = g * rows * kc + k * rows + r;
                        let want = a[(g * rows + r) * lda + k];
                        assert_eq!(pack[at], want, "rows {rows}, kc {kc}: group {g} ({r}, {k})");
                    }
                }
            }
            assert!(
                pack[groups * rows * kc..].iter().all(|v| v.is_nan()),
                "kc {kc}"
            );
        }
    }
}

/// Both packers lay the panels out as the kernels read them (panel p, row kk, column jj
/// at `(p·K + kk)·NR + jj`), including the zero padding of the last panel.
#[test]
fn packers_lay_out_panels() {
    let b = |i: usize, kk: usize, j: usize| (i * 1000 + kk * 37 + j) as f32 * 0.5;
    for &(count, k, n) in &[(3usize, 5usize, 37usize), (1, 1, 16), (2, 300, 5)] {
        let expected = |i: usize| {
            let mut data = vec![0f32; n.div_ceil(NR) * k * NR];
            for j in 0..n {
                for kk in 0..k {
                    data[((j / NR) * k + kk) * NR + j % NR] = b(i, kk, j);
                }
            }
            data
        };
        let rows = PackedB::<f32>::many_from_rows(count, k, n, |kk, j0, values| {
            for (i, v) in values.chunks_mut(NR).enumerate() {
                for (jj, v) in v.iter_mut().enumerate() {
                    *v = b(i, kk, j0 + jj);
                }
            }
        });
        assert_eq!(rows.len(), count);
        for (i, packed) in rows.iter().enumerate() {
            assert_eq!(
                packed.data[..],
                expected(i)[..],
                "rows: matrix {i} of {count}, {k}×{n}"
            );
            assert!(packed.bias.iter().all(|&v| v == 0.0));
            let bias: Vec<f32> = (0..n).map(|j| j as f32).collect();
            let by_col = PackedB::<f32>::from_columns(
                k,
                n,
                |j, col| {
                    col.iter_mut()
                        .enumerate()
                        .for_each(|(kk, v)| *v = b(i, kk, j))
                },
                Some(&bias),
            );
            assert_eq!(
                by_col.data[..],
                expected(i)[..],
                "columns: matrix {i}, {k}×{n}"
            );
            assert_eq!(by_col.bias[..n], bias[..]);
        }
    }
}

/// The small-K probe times both kernels on a real GEMM: a ratio no core could be far from,
/// where the path has the kernel.
#[test]
fn the_small_k_probe_measures_a_plausible_ratio() {
    match stationary_over_tile(24) {
        Some(r) => assert!((0.2..5.0).contains(&r), "{r}"),
        None => assert!(kernels_for(simd()).stationary.is_none()),
    }
}

/// The small-K kernel's bf16 rows ([`gemm_packed_bf16`]) are bit for
/// bit the f32 way: [`gemm_packed`] into f32 rows, the residual added and the activation
/// applied to them, then each value rounded to bf16 (`Elem::narrow`). Partial last panels, row
/// counts that end in a short group, every activation the kernel keeps a copy for, a row of
/// NaNs (rounded and made quiet as `f32_bf16` does), and a panel range past panel 0.
#[test]
fn bf16_rows_match_the_f32_way() {
    use crate::backend::cpu::elem::{bf16_f32, f32_bf16};
    use half::bf16;
    // Up to `FEW_ROWS` rows on the panels in place, more on their widened blocks.
    for &(m, k, n) in &[
        (13, 24, 40),
        (20, 72, 24),
        (6, 200, 16),
        (50, 600, 33),
        (49, 27, 16),
        (131, 72, 40),
    ] {
        let mut a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0)
            .collect();
        a[k * (m / 2)] = f32::NAN;
        let b = |kk: usize, j: usize| ((kk * 5 + j * 3) % 17) as f32 / 8.0 - 1.0;
        let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.25 - 2.0).collect();
        let packed = PackedB::<bf16>::new(k, n, b, Some(&bias));
        let residual: Vec<bf16> = (0..m * n)
            .map(|i| bf16::from_f32(((i % 11) as f32 - 5.0) / 3.0))
            .collect();
        let panels = n.div_ceil(NR);
        let runs = kernels().small_k >= k && simd() == Simd::Avx2Fma;
        for act in [Act::None, Act::Relu, Act::Hardswish, Act::Silu, Act::Gelu] {
            for with_residual in [false, true] {
                for p in [(0, panels), (1, panels)].into_iter().filter(|p| p.0 < p.1) {
                    let col0 = p.0 * NR;
                    let cols = n - col0;
                    let mut f = vec![0f32; m * n];
                    // SAFETY: A is m × k, C m × n from column col0 on, wide enough.
                    unsafe {
                        gemm_packed(
                            m,
                            a.as_ptr(),
                            k,
                            &packed,
                            p,
                            f[col0..].as_mut_ptr(),
                            n,
                            None,
                        )
                    };
                    let mut want = vec![bf16::ZERO; m * n];
                    for r in 0..m {
                        let row = &mut f[r * n + col0..][..cols];
                        if with_residual {
                            let res = &residual[r * n + col0..][..cols];
                            row.iter_mut()
                                .zip(res)
                                .for_each(|(v, x)| *v += bf16_f32(*x));
                        }
                        crate::backend::cpu::kernels::activate(act, row);
                        for (j, v) in row.iter().enumerate() {
                            want[r * n + col0 + j] = f32_bf16(*v);
                        }
                    }
                    let mut got = vec![bf16::ZERO; m * n];
                    let res = if with_residual {
                        residual[col0..].as_ptr()
                    } else {
                        std::ptr::null()
                    };
                    // SAFETY: as above; the residual is laid out as C.
                    let ran = unsafe {
                        gemm_packed_bf16(
                            m,
                            a.as_ptr(),
                            k,
                            &packed,
                            p,
                            got[col0..].as_mut_ptr(),
                            n,
                            act,
                            res,
                        )
                    };
                    assert_eq!(ran, runs, "m{m} k{k} n{n}: ran");
                    if !ran {
                        continue;
                    }
                    let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    let what =
                        format!("m{m} k{k} n{n} {act:?} residual {with_residual} panels {p:?}");
                    assert_eq!(bits(&got), bits(&want), "{what}");
                }
            }
        }
    }
}
