// Swin's and MaxViT's kernels on NHWC tensors: the (shifted or dilated) window attention core
// and the patch merging gather. One thread per (image, head, query) or per output element; f32 arithmetic.

struct Params {
    total: u32,    // threads that do work
    h: u32,        // the input grid
    w: u32,
    hp: u32,       // padded to whole windows (patch_merge: the output grid)
    wp: u32,
    window: u32,
    shift_h: u32,  // 0 along a side one window covers
    shift_w: u32,
    d: u32,        // channels
    heads: u32,
    cosine: u32,   // 1: Swin V2's cosine attention (q and k normalised)
    dilated: u32,  // 1: MaxViT's grid partition (window (a, b) holds pixel (a, b) of each block)
}

@group(0) @binding(0) var<uniform> p: Params;
// window_attention: q, k, v (N, H, W, 3·d); patch_merge: its input (N, H, W, d)
@group(0) @binding(1) var<storage, read> x: array<elem>;
// the relative position bias table ((2·window − 1)², heads)
@group(0) @binding(2) var<storage, read> table: array<f32>;
// the q/k/v projection's bias: what a padded token holds (3·d)
@group(0) @binding(3) var<storage, read> qkv_bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<elem>;
// the scores' scale per head (1/√dh; V2: exp(min(logit_scale, ln 100)))
@group(0) @binding(5) var<storage, read> scales: array<f32>;

fn index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid;
}

// The mask's region along one side of the shifted grid: torchvision's slices (0, −w), (−w, −s),
// (−s, ∞); scores between different regions get −100.
fn side(v: u32, size: u32, s: u32) -> u32 {
    if (s == 0u || v < size - p.window) {
        return 0u;
    }
    if (v < size - s) {
        return 1u;
    }
    return 2u;
}

// The input pixel under token (yy, xx) of the shifted, padded grid (past the input: padding);
// dilated, window (a, b)'s token (i, j) is pixel (i·H/window + a, j·W/window + b).
fn source(yy: u32, xx: u32) -> vec2<u32> {
    let ws = p.window;
    if (p.dilated == 1u) {
        return vec2<u32>(yy % ws * (p.h / ws) + yy / ws, xx % ws * (p.w / ws) + xx / ws);
    }
    return vec2<u32>((yy + p.shift_h) % p.hp, (xx + p.shift_w) % p.wp);
}

// Column `col` of the q/k/v row of the token at (yy, xx) of the shifted, padded grid: the
// projection of its input pixel, or the bias for padding.
fn qkv_at(img: u32, yy: u32, xx: u32, col: u32) -> f32 {
    let s = source(yy, xx);
    if (s.x < p.h && s.y < p.w) {
        return f32(x[((img * p.h + s.x) * p.w + s.y) * 3u * p.d + col]);
    }
    return qkv_bias[col];
}

// softmax(q·kᵀ/√dh + bias + mask)·v over the query's window, streaming over its keys with a
// running maximum and sum (online softmax). Heads of at most 128 values.
@compute @workgroup_size(256)
fn window_attention(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i >= p.total) {
        return;
    }
    let xx = i % p.wp;
    let yy = (i / p.wp) % p.hp;
    let h = (i / (p.wp * p.hp)) % p.heads;
    let img = i / (p.wp * p.hp * p.heads);
    let src = source(yy, xx);
    let y0 = src.x;
    let x0 = src.y;
    if (y0 >= p.h || x0 >= p.w) {
        return; // a padded query: nothing to write
    }
    let ws = p.window;
    let dh = p.d / p.heads;
    let wy = yy / ws * ws;
    let wx = xx / ws * ws;
    let qi = (yy - wy) * ws + (xx - wx);
    let region = side(yy, p.hp, p.shift_h) * 3u + side(xx, p.wp, p.shift_w);
    var q: array<f32, 128>;
    var acc: array<f32, 128>;
    var qq = 0.0;
    for (var j = 0u; j < dh; j++) {
        q[j] = qkv_at(img, yy, xx, h * dh + j);
        qq += q[j] * q[j];
        acc[j] = 0.0;
    }
    // V2 divides q by its norm (and each k by its own, below); the head's scale goes with q.
    var qscale = scales[h];
    if (p.cosine == 1u) {
        qscale /= max(sqrt(qq), 1e-12);
    }
    var m = -3.4028235e38;
    var s = 0.0;
    for (var kj = 0u; kj < ws * ws; kj++) {
        let ky = wy + kj / ws;
        let kx = wx + kj % ws;
        var dot = 0.0;
        var kk = 0.0;
        for (var j = 0u; j < dh; j++) {
            let k = qkv_at(img, ky, kx, p.d + h * dh + j);
            dot += q[j] * k;
            kk += k * k;
        }
        if (p.cosine == 1u) {
            dot /= max(sqrt(kk), 1e-12);
        }
        let row = (qi / ws + ws - 1u - kj / ws) * (2u * ws - 1u) + (qi % ws + ws - 1u - kj % ws);
        var score = dot * qscale + table[row * p.heads + h];
        if (side(ky, p.hp, p.shift_h) * 3u + side(kx, p.wp, p.shift_w) != region) {
            score -= 100.0;
        }
        let m2 = select(m, score, score > m || is_nan(score));
        let corr = exp(m - m2);
        let e = exp(score - m2);
        s = s * corr + e;
        for (var j = 0u; j < dh; j++) {
            acc[j] = acc[j] * corr + e * qkv_at(img, ky, kx, 2u * p.d + h * dh + j);
        }
        m = m2;
    }
    let out = ((img * p.h + y0) * p.w + x0) * p.d + h * dh;
    for (var j = 0u; j < dh; j++) {
        y[out + j] = elem(acc[j] / s);
    }
}

// Each output pixel the channels of its 2×2 block (top-left, bottom-left, top-right,
// bottom-right), zeros past an odd edge: output (N, hp, wp, 4·d).
@compute @workgroup_size(256)
fn patch_merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i >= p.total) {
        return;
    }
    let ch = i % (4u * p.d);
    let px = i / (4u * p.d);
    let ox = px % p.wp;
    let oy = (px / p.wp) % p.hp;
    let img = px / (p.wp * p.hp);
    let q = ch / p.d;
    let yy = 2u * oy + q % 2u;
    let xx = 2u * ox + q / 2u;
    var v = elem(0.0);
    if (yy < p.h && xx < p.w) {
        v = x[((img * p.h + yy) * p.w + xx) * p.d + ch % p.d];
    }
    y[i] = v;
}
