// Depthwise convolution (groups = channels) over NHWC, with its bias and activation: one
// thread per output value, channels innermost so neighbouring threads read neighbouring
// channels. A GEMM would waste the GPU:
// each output has only kh · kw taps.

struct Params {
    total: u32,   // n · oh · ow · c
    h: u32,
    w: u32,
    c: u32,
    oh: u32,
    ow: u32,
    kh: u32,
    kw: u32,
    sh: u32,
    sw: u32,
    ph: u32,
    pw: u32,
    dh: u32,
    dw: u32,
    has_bias: u32,
    act: u32,     // epilogue: activate.wgsl's code (0 none)
}

@group(0) @binding(0) var<uniform> p: Params;
// input: (n, h, w, c)
@group(0) @binding(1) var<storage, read> x: array<elem>;
// weights: (ky, kx, c), f32
@group(0) @binding(2) var<storage, read> wt: array<f32>;
// bias: (c), f32
@group(0) @binding(3) var<storage, read> bias: array<f32>;
// output: (n, oh, ow, c)
@group(0) @binding(4) var<storage, read_write> y: array<elem>;

@compute @workgroup_size(256)
fn depthwise(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wid.y * nwg.x + wid.x) * 256u + lid;
    if (i >= p.total) {
        return;
    }
    let c = i % p.c;
    let t = i / p.c;
    let ox = t % p.ow;
    let t2 = t / p.ow;
    let oy = t2 % p.oh;
    let n = t2 / p.oh;
    var acc = 0.0;
    if (p.has_bias != 0u) {
        acc = bias[c];
    }
    for (var ky = 0u; ky < p.kh; ky++) {
        let iy = i32(oy * p.sh + ky * p.dh) - i32(p.ph);
        if (iy < 0 || iy >= i32(p.h)) {
            continue;
        }
        for (var kx = 0u; kx < p.kw; kx++) {
            let ix = i32(ox * p.sw + kx * p.dw) - i32(p.pw);
            if (ix < 0 || ix >= i32(p.w)) {
                continue;
            }
            acc += f32(x[((n * p.h + u32(iy)) * p.w + u32(ix)) * p.c + c]) * wt[(ky * p.kw + kx) * p.c + c];
        }
    }
    y[i] = elem(activate(acc, p.act));
}
