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

// A tile as [k][row/4] and B tile as [k][col/4]: one vec4 read gives a thread its 4 rows
// (or 4 columns) of one k.
var<workgroup> As: array<vec4<f32>, 256>;
var<workgroup> Bs: array<vec4<f32>, 256>;

fn load_a(row: u32, k: u32, ci0: u32) -> f32 {
    if (row >= p.m || k >= p.k_g) {
        return 0.0;
    }
    let ci = k % p.cin_g;
    let kxy = k / p.cin_g;
    let kx = kxy % p.kw;
    let ky = kxy / p.kw;
    let ox = row % p.ow;
    let t = row / p.ow;
    let oy = t % p.oh;
    let n = t / p.oh;
    let iy = i32(oy * p.sh + ky * p.dh) - i32(p.ph);
    let ix = i32(ox * p.sw + kx * p.dw) - i32(p.pw);
    if (iy < 0 || ix < 0 || iy >= i32(p.h) || ix >= i32(p.w)) {
        return 0.0;
    }
    return f32(x[((n * p.h + u32(iy)) * p.w + u32(ix)) * p.cin + ci0 + ci]);
}

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
    var acc: array<vec4<f32>, 4>;
    for (var k0 = 0u; k0 < p.k_g; k0 += BK) {
        // 256 threads load the 64×16 A tile: thread t reads k = t % 16 of row t / 16 (and of
        // the rows 16, 32, 48 further), so 16 neighbouring threads read 16 neighbouring
        // channels of one pixel.
        let kk = tid % BK;
        for (var i = 0u; i < 4u; i++) {
            let r = tid / BK + i * 16u;
            let v = load_a(row0 + r, k0 + kk, ci0);
            As[kk * 16u + r / 4u][r % 4u] = v;
        }
        // ...and the 16×64 B tile: thread t reads column t % 64 of k = t / 64 (+4, +8, +12).
        let c = tid % BN;
        for (var i = 0u; i < 4u; i++) {
            let kb = tid / BN + i * 4u;
            Bs[kb * 16u + c / 4u][c % 4u] = load_b(k0 + kb, col0 + c, wbase);
        }
        workgroupBarrier();
        for (var k = 0u; k < BK; k++) {
            let a = As[k * 16u + lid.y];
            let b = Bs[k * 16u + lid.x];
            acc[0] += a.x * b;
            acc[1] += a.y * b;
            acc[2] += a.z * b;
            acc[3] += a.w * b;
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let row = row0 + lid.y * 4u + i;
        if (row >= p.m) {
            continue;
        }
        for (var j = 0u; j < 4u; j++) {
            let col = col0 + lid.x * 4u + j;
            if (col >= p.cout_g) {
                continue;
            }
            let oc = g * p.cout_g + col;
            var v = acc[i][j];
            if (p.has_bias != 0u) {
                v += bias[oc];
            }
            if (p.act == 1u) {
                v = max(v, 0.0);
            } else if (p.act == 2u) {
                v = clamp(v, 0.0, 6.0);
            }
            y[row * p.cout + oc] = elem(v);
        }
    }
}
// ANCHOR_END: kernel
