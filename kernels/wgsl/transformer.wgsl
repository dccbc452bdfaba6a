// Transformer ops on tokens (N, T, D), row-major — which an NHWC image batch already is, so a
// patch grid needs no kernel to become tokens. One thread per output element, per row (layer
// norm) or per (image, head, query) (attention); f32 arithmetic whatever `elem` stores.

struct Params {
    total: u32,    // threads that do work
    t: u32,        // tokens per image (class_token: before the class token)
    d: u32,        // model dimension
    heads: u32,    // attention heads
    index: u32,    // the token select_token takes
    eps: f32,      // layer norm's epsilon
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<elem>;
// the class token, the position embedding, or layer norm's weight (f32)
@group(0) @binding(2) var<storage, read> w: array<f32>;
// layer norm's bias (f32)
@group(0) @binding(3) var<storage, read> b: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<elem>;

fn index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid;
}

// (N, T, D) → (N, 1 + T, D), the class token in front.
@compute @workgroup_size(256)
fn class_token(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i >= p.total) {
        return;
    }
    let per = (p.t + 1u) * p.d;
    let img = i / per;
    let r = i % per;
    if (r < p.d) {
        y[i] = elem(w[r]);
    } else {
        y[i] = x[img * p.t * p.d + r - p.d];
    }
}

// x + the position embedding (T·D values, the same for every image).
@compute @workgroup_size(256)
fn positions(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.total) {
        y[i] = elem(f32(x[i]) + w[i % (p.t * p.d)]);
    }
}

// One thread per row of D: the mean, then the biased variance, as PyTorch.
@compute @workgroup_size(256)
fn layer_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = index(wid, nwg, lid);
    if (r >= p.total) {
        return;
    }
    let base = r * p.d;
    var mean = 0.0;
    for (var j = 0u; j < p.d; j++) {
        mean += f32(x[base + j]);
    }
    mean /= f32(p.d);
    var v = 0.0;
    for (var j = 0u; j < p.d; j++) {
        let e = f32(x[base + j]) - mean;
        v += e * e;
    }
    let inv = 1.0 / sqrt(v / f32(p.d) + p.eps);
    for (var j = 0u; j < p.d; j++) {
        y[base + j] = elem((f32(x[base + j]) - mean) * inv * w[j] + b[j]);
    }
}

// x · Φ(x), the exact form of nn.GELU().
@compute @workgroup_size(256)
fn gelu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.total) {
        y[i] = elem(activate(f32(x[i]), 5u));
    }
}

// (N, T, D) → (N, D): token `index` of each image.
@compute @workgroup_size(256)
fn select_token(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.total) {
        y[i] = x[((i / p.d) * p.t + p.index) * p.d + i % p.d];
    }
}

// softmax(q·kᵀ/√dh)·v on x = (N, T, 3·D) (q, k, v side by side, heads side by side in each),
// one thread per (image, head, query), streaming over the keys with a running maximum and sum
// (FlashAttention's online softmax): no score is stored. Heads of at most 128 values.
@compute @workgroup_size(256)
fn attention(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i >= p.total) {
        return;
    }
    let q = i % p.t;
    let h = (i / p.t) % p.heads;
    let img = i / (p.t * p.heads);
    let dh = p.d / p.heads;
    let base = img * p.t * 3u * p.d;
    let qrow = base + q * 3u * p.d + h * dh;
    let scale = 1.0 / sqrt(f32(dh));
    var acc: array<f32, 128>;
    for (var j = 0u; j < dh; j++) {
        acc[j] = 0.0;
    }
    var m = -3.4028235e38;
    var s = 0.0;
    for (var k = 0u; k < p.t; k++) {
        let krow = base + k * 3u * p.d + p.d + h * dh;
        var score = 0.0;
        for (var j = 0u; j < dh; j++) {
            score += f32(x[qrow + j]) * f32(x[krow + j]);
        }
        score *= scale;
        let m2 = select(m, score, score > m || is_nan(score));
        let corr = exp(m - m2);
        let e = exp(score - m2);
        s = s * corr + e;
        let vrow = krow + p.d;
        for (var j = 0u; j < dh; j++) {
            acc[j] = acc[j] * corr + e * f32(x[vrow + j]);
        }
        m = m2;
    }
    let out = (img * p.t + q) * p.d + h * dh;
    for (var j = 0u; j < dh; j++) {
        y[out + j] = elem(acc[j] / s);
    }
}
