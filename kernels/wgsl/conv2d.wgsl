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
    act: u32,      // epilogue: activate.wgsl's code (0 none)
    col_base: u32, // first output channel of this launch (weights too large for one binding
                   // run as several launches over column slices; 0 otherwise)
    has_res: u32,  // epilogue: add `res` (a residual of the output's shape) before the activation
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
// residual: the output's shape (a tiny unused buffer when has_res is 0)
@group(0) @binding(5) var<storage, read> res: array<elem>;

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
        store1(row, g * p.cout_g + col + j, v[j]);
    }
}

// Bias, activation and store of one output (oc counts from this launch's first channel).
fn store1(row: u32, oc: u32, v: f32) {
    let c = p.col_base + oc;
    var o = v;
    if (p.has_bias != 0u) {
        o += bias[c];
    }
    if (p.has_res != 0u) {
        o += f32(res[row * p.cout + c]);
    }
    y[row * p.cout + c] = elem(activate(o, p.act));
}
// ANCHOR_END: kernel

// ANCHOR: rows
// The same product for a few output rows (a linear layer at batch 1–8, a tiny feature map):
// a 64-row tile would waste up to 63/64 of its work there. Reading B is what costs, so every
// B value read feeds all eight rows: a thread takes 4 neighbouring columns (one 16-byte run;
// 16 threads read 256 contiguous bytes of a row of B) and one of 4 slices of K, and the four
// partial sums of each output meet in workgroup memory. A workgroup covers 64 columns: fc6 of
// VGG makes 64 workgroups, few for a large GPU, which would want K split across workgroups too.
const ROWS: u32 = 8u;
var<workgroup> partial: array<vec4<f32>, 512>; // ROWS × 64 threads

// A[row, k] of a linear layer, or 0 past the last row.
// A linear layer: 1×1 images in and out, a 1×1 kernel (a padded k×k kernel on a 1×1 image
// reads its centre tap only, and takes the general path).
fn is_linear() -> bool {
    return p.h * p.w == 1u && p.oh * p.ow == 1u && p.k_g == p.cin_g;
}

fn a_row(row: u32, k: u32) -> f32 {
    if (row >= p.m) {
        return 0.0;
    }
    return f32(x[row * p.cin + k]);
}

// A[row, k] of the implicit GEMM, or 0 outside the image, the rows or the taps.
fn a_at(row: u32, ky: u32, kx: u32, ci: u32) -> f32 {
    if (row >= p.m) {
        return 0.0;
    }
    if (is_linear()) {
        return f32(x[row * p.cin + ci]);
    }
    let ox = row % p.ow;
    let rest = row / p.ow;
    let iy = i32((rest % p.oh) * p.sh + ky * p.dh) - i32(p.ph);
    let ix = i32(ox * p.sw + kx * p.dw) - i32(p.pw);
    if (iy < 0 || ix < 0 || iy >= i32(p.h) || ix >= i32(p.w)) {
        return 0.0;
    }
    return f32(x[(rest / p.oh) * p.h * p.w * p.cin + (u32(iy) * p.w + u32(ix)) * p.cin + ci]);
}

// B[k, col..col + 4], zero past the last column. Clamped loads and a select instead of
// branches: CPU drivers run both sides of a branch that differs between invocations.
fn b4(k: u32, col: u32, base: u32) -> vec4<f32> {
    let o = base + k * p.cout_g;
    let last = p.cout_g - 1u;
    let cols = vec4<u32>(col, col + 1u, col + 2u, col + 3u);
    let c = min(cols, vec4<u32>(last));
    let v = vec4<f32>(f32(wt[o + c.x]), f32(wt[o + c.y]), f32(wt[o + c.z]), f32(wt[o + c.w]));
    return select(vec4<f32>(0.0), v, cols <= vec4<u32>(last));
}

@compute @workgroup_size(16, 4)
fn conv2d_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = wid.z;
    let row0 = wid.x * ROWS;
    let col = wid.y * 64u + lid.x * 4u;
    let wbase = g * p.k_g * p.cout_g;
    let cin_g = p.cin_g;
    var s0 = vec4<f32>(0.0);
    var s1 = vec4<f32>(0.0);
    var s2 = vec4<f32>(0.0);
    var s3 = vec4<f32>(0.0);
    var s4 = vec4<f32>(0.0);
    var s5 = vec4<f32>(0.0);
    var s6 = vec4<f32>(0.0);
    var s7 = vec4<f32>(0.0);
    if (col < p.cout_g && is_linear()) {
        // A linear layer: A[row, k] is x[row, k].
        for (var k = lid.y; k < p.k_g; k += 4u) {
            let b = b4(k, col, wbase);
            let ci = g * cin_g + k;
            s0 += a_row(row0 + 0u, ci) * b;
            s1 += a_row(row0 + 1u, ci) * b;
            s2 += a_row(row0 + 2u, ci) * b;
            s3 += a_row(row0 + 3u, ci) * b;
            s4 += a_row(row0 + 4u, ci) * b;
            s5 += a_row(row0 + 5u, ci) * b;
            s6 += a_row(row0 + 6u, ci) * b;
            s7 += a_row(row0 + 7u, ci) * b;
        }
    } else if (col < p.cout_g) {
        // The tap k as (ky, kx, ci), stepped without dividing (no vector division on CPUs).
        var ci = lid.y;
        var kx = 0u;
        var ky = 0u;
        for (var k = lid.y; k < p.k_g; k += 4u) {
            while (ci >= cin_g) {
                ci -= cin_g;
                kx += 1u;
                if (kx == p.kw) {
                    kx = 0u;
                    ky += 1u;
                }
            }
            let b = b4(k, col, wbase);
            s0 += a_at(row0 + 0u, ky, kx, g * cin_g + ci) * b;
            s1 += a_at(row0 + 1u, ky, kx, g * cin_g + ci) * b;
            s2 += a_at(row0 + 2u, ky, kx, g * cin_g + ci) * b;
            s3 += a_at(row0 + 3u, ky, kx, g * cin_g + ci) * b;
            s4 += a_at(row0 + 4u, ky, kx, g * cin_g + ci) * b;
            s5 += a_at(row0 + 5u, ky, kx, g * cin_g + ci) * b;
            s6 += a_at(row0 + 6u, ky, kx, g * cin_g + ci) * b;
            s7 += a_at(row0 + 7u, ky, kx, g * cin_g + ci) * b;
            ci += 4u;
        }
    }
    let t = lid.y * 16u + lid.x;
    partial[t] = s0;
    partial[64u + t] = s1;
    partial[128u + t] = s2;
    partial[192u + t] = s3;
    partial[256u + t] = s4;
    partial[320u + t] = s5;
    partial[384u + t] = s6;
    partial[448u + t] = s7;
    workgroupBarrier();
    // Thread (x, y) sums rows y and y + 4 over the four slices.
    for (var h = 0u; h < 2u; h++) {
        let r = lid.y + 4u * h;
        let row = row0 + r;
        let sum = partial[r * 64u + lid.x] + partial[r * 64u + 16u + lid.x]
            + partial[r * 64u + 32u + lid.x] + partial[r * 64u + 48u + lid.x];
        if (row < p.m) {
            for (var j = 0u; j < 4u; j++) {
                if (col + j < p.cout_g) {
                    store1(row, g * p.cout_g + col + j, sum[j]);
                }
            }
        }
    }
}
// ANCHOR_END: rows
