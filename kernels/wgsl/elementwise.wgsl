// Element-wise kernels and layout changes. One thread per element; the launch grid is 2-D
// (x · y workgroups of 256) so tensors larger than 65535 · 256 elements fit the dispatch limits.

struct Params {
    total: u32,   // elements
    c: u32,       // channels (innermost dimension), or row length for softmax
    hw: u32,      // h · w, for layout changes
    lo: f32,      // clamp bounds
    hi: f32,
    code: u32,    // `unary`: 0 hardswish, 1 hardsigmoid, 2 SiLU, 3 tanh
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// input (layout per entry point)
@group(0) @binding(1) var<storage, read> x: array<elem>;
// second input of `add`
@group(0) @binding(2) var<storage, read> x2: array<elem>;
// per-channel scale and shift of `affine` (batch norm), f32
@group(0) @binding(3) var<storage, read> scale: array<f32>;
@group(0) @binding(4) var<storage, read> shift: array<f32>;
// output
@group(0) @binding(5) var<storage, read_write> y: array<elem>;
// f32 input of `nchw_to_nhwc` (the seam's layout) and f32 output of `to_f32`
@group(0) @binding(6) var<storage, read> xf: array<f32>;
@group(0) @binding(7) var<storage, read_write> yf: array<f32>;

fn index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid;
}

@compute @workgroup_size(256)
fn affine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.total) {
        let c = i % p.c;
        y[i] = elem(f32(x[i]) * scale[c] + shift[c]);
    }
}

@compute @workgroup_size(256)
fn clamp_op(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.total) {
        let v = f32(x[i]);
        let r = select(select(v, p.hi, v > p.hi), p.lo, v < p.lo);
        y[i] = elem(select(r, v, is_nan(v)));
    }
}

// 1 / (1 + e^-x), in f32.
@compute @workgroup_size(256)
fn sigmoid(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.total) {
        y[i] = elem(1.0 / (1.0 + exp(-f32(x[i]))));
    }
}

@compute @workgroup_size(256)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.total) {
        y[i] = elem(f32(x[i]) + f32(x2[i]));
    }
}

// (n, c, hw) f32 → (n, hw, c) elem: the input image into the backend's layout.
@compute @workgroup_size(256)
fn nchw_to_nhwc(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.total) {
        let c = i % p.c;
        let t = i / p.c;
        let s = t % p.hw;
        let n = t / p.hw;
        y[i] = elem(xf[(n * p.c + c) * p.hw + s]);
    }
}

// (n, hw, c) → (n, c, hw): PyTorch's flatten order of a spatial map.
@compute @workgroup_size(256)
fn nhwc_to_nchw(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.total) {
        let s = i % p.hw;
        let t = i / p.hw;
        let c = t % p.c;
        let n = t / p.c;
        y[i] = x[(n * p.hw + s) * p.c + c];
    }
}

// elem → f32, for reading the output back.
@compute @workgroup_size(256)
fn to_f32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.total) {
        yf[i] = f32(x[i]);
    }
}

// Softmax of each row of length c, one thread per row (rows are few: one per image).
@compute @workgroup_size(256)
fn softmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = index(wid, nwg, lid);
    if (r * p.c >= p.total) {
        return;
    }
    let base = r * p.c;
    var m = -3.4028235e38;
    for (var j = 0u; j < p.c; j++) {
        m = max(m, f32(x[base + j]));
    }
    var s = 0.0;
    for (var j = 0u; j < p.c; j++) {
        s += exp(f32(x[base + j]) - m);
    }
    for (var j = 0u; j < p.c; j++) {
        y[base + j] = elem(exp(f32(x[base + j]) - m) / s);
    }
}

// The newer networks' activations, in f32; a NaN stays NaN (`is_nan`, as `activate`).
@compute @workgroup_size(256)
fn unary(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.total) {
        let v = f32(x[i]);
        let r0 = v + 3.0;
        let r = select(select(r0, 6.0, r0 > 6.0), 0.0, r0 < 0.0);
        var out = v / (1.0 + exp(-v));
        if (p.code == 0u) {
            out = v * r / 6.0;
        } else if (p.code == 1u) {
            out = r / 6.0;
        } else if (p.code == 3u) {
            // tanh(±10) is ±1 in f32; clamping keeps sinh/cosh forms from overflowing.
            out = tanh(clamp(v, -10.0, 10.0));
        }
        y[i] = elem(select(out, v, is_nan(v)));
    }
}

// Squeeze-and-excitation's scale · input on NHWC: x2 holds one scale per image and channel.
@compute @workgroup_size(256)
fn scale_channels(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.total) {
        let image = i / (p.hw * p.c);
        y[i] = elem(f32(x[i]) * f32(x2[image * p.c + i % p.c]));
    }
}
