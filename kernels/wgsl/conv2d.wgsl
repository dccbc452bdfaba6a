// Convolution as an implicit GEMM over NHWC tensors: C[m, co] = Σ_k A[m, k] · B[k, co] with
// m an output pixel (n, oy, ox), k a tap (ky, kx, ci) and co an output channel. A is never
// materialised: each tile gathers its inputs straight from the NHWC image (zero padding
// included). Linear layers run through the same kernel as 1×1 convolutions on 1×1 images.
//
// Tiling: a 16×16 workgroup computes a 64×64 tile of C, each thread a 4×4 block, stepping
// through K 16 at a time. Per step the workgroup loads (64 + 64) × 16 values into workgroup
// memory and performs 64 × 64 × 16 FMAs: 32 FLOPs per value loaded from global memory
// (8 FLOP/byte in f32, 16 in f16), and each thread does 16 FMAs per 8 values it reads from
// workgroup memory (two vec4 loads). Loads are coalesced: consecutive threads read
// consecutive input channels (A) and consecutive output channels (B).
//
// The host prepends `alias elem = f32;` or `enable f16; alias elem = f16;`: storage is elem,
// arithmetic is always f32.

// ANCHOR: params
struct Params {
    m: u32,        // output pixels: n · oh · ow
    h: u32,
    w: u32,
    cin: u32,      // input channels (all groups)
    oh: u32,
    ow: u32,
    cout: u32,     // output channels (all groups)
    kw: u32,
    sh: u32,
    sw: u32,
    ph: u32,
    pw: u32,
    dh: u32,
    dw: u32,
    cin_g: u32,    // input channels per group
    cout_g: u32,   // output channels per group
    k_g: u32,      // taps per group: kh · kw · cin_g
    has_bias: u32,
    act: u32,      // epilogue: 0 none, 1 ReLU, 2 ReLU6
    _pad: u32,
}
// ANCHOR_END: params

@group(0) @binding(0) var<uniform> p: Params;
// input: (n, h, w, cin), NHWC
@group(0) @binding(1) var<storage, read> x: array<elem>;
// weights: per group g, a (k_g × cout_g) row-major matrix at offset g · k_g · cout_g
@group(0) @binding(2) var<storage, read> wt: array<elem>;
// bias: (cout), f32 (all zeros when has_bias is 0)
@group(0) @binding(3) var<storage, read> bias: array<f32>;
// output: (n, oh, ow, cout), NHWC
@group(0) @binding(4) var<storage, read_write> y: array<elem>;

const BM: u32 = 64u;
const BN: u32 = 64u;
const BK: u32 = 16u;

// A tile as [k][row / 4] and B tile as [k][col / 4]: one vec4 read gives a thread its 4 rows
// (or 4 columns) of one k. (Measured on lavapipe: vec4 reads beat four scalar reads by 40%.)
var<workgroup> As: array<vec4<f32>, 256>;
var<workgroup> Bs: array<vec4<f32>, 256>;

fn load_b(k: u32, col: u32, base: u32) -> f32 {
    if (k >= p.k_g || col >= p.cout_g) {
        return 0.0;
    }
    return f32(wt[base + k * p.cout_g + col]);
}

// ANCHOR: kernel
@compute @workgroup_size(16, 16)
fn conv2d(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = wid.z;
    let row0 = wid.x * BM;
    let col0 = wid.y * BN;
    let tid = lid.y * 16u + lid.x;
    let ci0 = g * p.cin_g;
    let wbase = g * p.k_g * p.cout_g;
    // This thread loads tap kk of rows tid / 16 + {0, 16, 32, 48} of every A tile: decode
    // those four output pixels once (integer division is slow, on a CPU driver most of all).
    let kk = tid % BK;
    var img: array<u32, 4>;     // offset of the pixel's image in x
    var iy0: array<i32, 4>;     // top-left input row and column of its window
    var ix0: array<i32, 4>;
    var live: array<bool, 4>;
    for (var i = 0u; i < 4u; i++) {
        let row = row0 + tid / BK + i * 16u;
        live[i] = row < p.m;
        let ox = row % p.ow;
        let t = row / p.ow;
        iy0[i] = i32((t % p.oh) * p.sh) - i32(p.ph);
        ix0[i] = i32(ox * p.sw) - i32(p.pw);
        img[i] = (t / p.oh) * p.h * p.w * p.cin;
    }
    // The tap k = k0 + kk as (ky, kx, ci), advanced by BK each step without dividing.
    var ci = kk % p.cin_g;
    var kx = (kk / p.cin_g) % p.kw;
    var ky = (kk / p.cin_g) / p.kw;
    // Four named accumulators (rows) of four lanes (columns): an array indexed at run time
    // would live in memory instead of registers.
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < p.k_g; k0 += BK) {
        // A tile (64 rows × 16 taps): 16 neighbouring threads read 16 neighbouring channels
        // of one pixel.
        let k_live = k0 + kk < p.k_g;
        let dy = i32(ky * p.dh);
        let dx = i32(kx * p.dw);
        for (var i = 0u; i < 4u; i++) {
            let r = tid / BK + i * 16u;
            let iy = iy0[i] + dy;
            let ix = ix0[i] + dx;
            var v = 0.0;
            if (live[i] && k_live && iy >= 0 && ix >= 0 && iy < i32(p.h) && ix < i32(p.w)) {
                v = f32(x[img[i] + (u32(iy) * p.w + u32(ix)) * p.cin + ci0 + ci]);
            }
            As[kk * 16u + r / 4u][r % 4u] = v;
        }
        ci += BK;
        while (ci >= p.cin_g) {
            ci -= p.cin_g;
            kx += 1u;
            if (kx == p.kw) {
                kx = 0u;
                ky += 1u;
            }
        }
        // B tile (16 taps × 64 channels): thread t reads column t % 64 of taps t / 64 + {0, 4, 8, 12}.
        let c = tid % BN;
        for (var i = 0u; i < 4u; i++) {
            let kb = tid / BN + i * 4u;
            Bs[kb * 16u + c / 4u][c % 4u] = load_b(k0 + kb, col0 + c, wbase);
        }
        workgroupBarrier();
        // Unrolled by four: CPU drivers run every loop as masked SIMD code, so fewer loop
        // trips cost less; GPU compilers unroll anyway.
        for (var k = 0u; k < BK; k += 4u) {
            fma_step(k, lid, &acc0, &acc1, &acc2, &acc3);
            fma_step(k + 1u, lid, &acc0, &acc1, &acc2, &acc3);
            fma_step(k + 2u, lid, &acc0, &acc1, &acc2, &acc3);
            fma_step(k + 3u, lid, &acc0, &acc1, &acc2, &acc3);
        }
        workgroupBarrier();
    }
    let r = row0 + lid.y * 4u;
    let c0 = col0 + lid.x * 4u;
    store_row(r, c0, g, acc0);
    store_row(r + 1u, c0, g, acc1);
    store_row(r + 2u, c0, g, acc2);
    store_row(r + 3u, c0, g, acc3);
}

// One k of the tile product: thread (x, y) owns rows 4y..4y+3 and columns 4x..4x+3.
fn fma_step(k: u32, lid: vec3<u32>, acc0: ptr<function, vec4<f32>>, acc1: ptr<function, vec4<f32>>, acc2: ptr<function, vec4<f32>>, acc3: ptr<function, vec4<f32>>) {
    let a = As[k * 16u + lid.y];
    let b = Bs[k * 16u + lid.x];
    *acc0 += a.x * b;
    *acc1 += a.y * b;
    *acc2 += a.z * b;
    *acc3 += a.w * b;
}

// Bias, activation and store of a row's four outputs, at columns col..col+3.
fn store_row(row: u32, col: u32, g: u32, v: vec4<f32>) {
    if (row >= p.m) {
        return;
    }
    for (var j = 0u; j < 4u; j++) {
        if (col + j >= p.cout_g) {
            return;
        }
        let oc = g * p.cout_g + col + j;
        var o = v[j];
        if (p.has_bias != 0u) {
            o += bias[oc];
        }
        if (p.act == 1u) {
            o = max(o, 0.0);
        } else if (p.act == 2u) {
            o = clamp(o, 0.0, 6.0);
        }
        y[row * p.cout + oc] = elem(o);
    }
}
// ANCHOR_END: kernel
