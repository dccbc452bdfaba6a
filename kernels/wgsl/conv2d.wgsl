// Convolution as an implicit GEMM over NHWC tensors: C[m, co] = Σ_k A[m, k] · B[k, co] with
// m an output pixel (n, oy, ox), k a tap (ky, kx, ci) and co an output channel. A is never
// materialised: each tile gathers its inputs straight from the NHWC image (zero padding
// included). Linear layers run through the same kernel as 1×1 convolutions on 1×1 images.
//
// Tiling: an 8×8 workgroup computes a 64×64 tile of C, each thread an 8×8 block, stepping
// through K 16 at a time. Per step the workgroup loads (64 + 64) × 16 values into workgroup
// memory and performs 64 × 64 × 16 FMAs: 32 FLOPs per value loaded from global memory
// (8 FLOP/byte in f32, 16 in f16), and each thread does 64 FMAs per 16 values it reads from
// workgroup memory (four vec4 loads). Each thread loads one pixel's 16 consecutive taps of
// A (a 64-byte run of NHWC channels) and one output channel's 16 taps of B (neighbouring
// threads, neighbouring channels). The large per-thread block matters most on CPU drivers
// (lavapipe), where every workgroup-memory read at a per-thread address is a gather.
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

// A tile as [k][row / 4] and B tile as [k][col / 4]: one vec4 read gives a thread 4 rows (or
// 4 columns) of one k.
var<workgroup> As: array<vec4<f32>, 256>;
var<workgroup> Bs: array<vec4<f32>, 256>;

fn load_b(k: u32, col: u32, base: u32) -> f32 {
    if (k >= p.k_g || col >= p.cout_g) {
        return 0.0;
    }
    return f32(wt[base + k * p.cout_g + col]);
}

// ANCHOR: kernel
@compute @workgroup_size(8, 8)
fn conv2d(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = wid.z;
    let row0 = wid.x * BM;
    let col0 = wid.y * BN;
    let t = lid.y * 8u + lid.x;
    let ci0 = g * p.cin_g;
    let wbase = g * p.k_g * p.cout_g;
    // This thread loads row t of every A tile: decode its output pixel once.
    let row = row0 + t;
    let live = row < p.m;
    let ox = row % p.ow;
    let rest = row / p.ow;
    let iy0 = i32((rest % p.oh) * p.sh) - i32(p.ph);
    let ix0 = i32(ox * p.sw) - i32(p.pw);
    let img = (rest / p.oh) * p.h * p.w * p.cin;
    // The tap k0 as (ky, kx, ci), advanced one tap at a time without dividing.
    var ci = 0u;
    var kx = 0u;
    var ky = 0u;
    var acc: array<vec4<f32>, 16>;
    for (var k0 = 0u; k0 < p.k_g; k0 += BK) {
        for (var kk = 0u; kk < BK; kk++) {
            let iy = iy0 + i32(ky * p.dh);
            let ix = ix0 + i32(kx * p.dw);
            var v = 0.0;
            if (live && k0 + kk < p.k_g && iy >= 0 && ix >= 0 && iy < i32(p.h) && ix < i32(p.w)) {
                v = f32(x[img + (u32(iy) * p.w + u32(ix)) * p.cin + ci0 + ci]);
            }
            As[kk * 16u + t / 4u][t % 4u] = v;
            Bs[kk * 16u + t / 4u][t % 4u] = load_b(k0 + kk, col0 + t, wbase);
            ci += 1u;
            if (ci == p.cin_g) {
                ci = 0u;
                kx += 1u;
                if (kx == p.kw) {
                    kx = 0u;
                    ky += 1u;
                }
            }
        }
        workgroupBarrier();
        for (var k = 0u; k < BK; k++) {
            let a0 = As[k * 16u + 2u * lid.y];
            let a1 = As[k * 16u + 2u * lid.y + 1u];
            let b0 = Bs[k * 16u + 2u * lid.x];
            let b1 = Bs[k * 16u + 2u * lid.x + 1u];
            acc[0] += a0.x * b0;
            acc[1] += a0.x * b1;
            acc[2] += a0.y * b0;
            acc[3] += a0.y * b1;
            acc[4] += a0.z * b0;
            acc[5] += a0.z * b1;
            acc[6] += a0.w * b0;
            acc[7] += a0.w * b1;
            acc[8] += a1.x * b0;
            acc[9] += a1.x * b1;
            acc[10] += a1.y * b0;
            acc[11] += a1.y * b1;
            acc[12] += a1.z * b0;
            acc[13] += a1.z * b1;
            acc[14] += a1.w * b0;
            acc[15] += a1.w * b1;
        }
        workgroupBarrier();
    }
    let r = row0 + 8u * lid.y;
    let c = col0 + 8u * lid.x;
    // Constant indices only: an accumulator array indexed at run time would be kept in memory.
    store4(r, c, g, acc[0]);
    store4(r, c + 4u, g, acc[1]);
    store4(r + 1u, c, g, acc[2]);
    store4(r + 1u, c + 4u, g, acc[3]);
    store4(r + 2u, c, g, acc[4]);
    store4(r + 2u, c + 4u, g, acc[5]);
    store4(r + 3u, c, g, acc[6]);
    store4(r + 3u, c + 4u, g, acc[7]);
    store4(r + 4u, c, g, acc[8]);
    store4(r + 4u, c + 4u, g, acc[9]);
    store4(r + 5u, c, g, acc[10]);
    store4(r + 5u, c + 4u, g, acc[11]);
    store4(r + 6u, c, g, acc[12]);
    store4(r + 6u, c + 4u, g, acc[13]);
    store4(r + 7u, c, g, acc[14]);
    store4(r + 7u, c + 4u, g, acc[15]);
}

// Bias, activation and store of four neighbouring outputs of one row.
fn store4(row: u32, col: u32, g: u32, v: vec4<f32>) {
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
