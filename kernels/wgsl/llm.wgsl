// A language model's step (src/backend/webgpu/decoder.rs): `new` tokens of each of the batch's
// sequences as rows (sequence-major) from position `start`, both read from `step` so that a
// decode step's bind groups are made once. One thread per output value, row or (row, head);
// f32 arithmetic whatever `elem` stores. Every entry point has its own bindings among those
// below (the session binds a 16-byte zero buffer where a layer has no bias).

struct Params {
    rows: u32,      // rows of the step (or of the LM head's input)
    d: u32,         // hidden size
    k: u32,         // a linear layer's inputs
    n: u32,         // a linear layer's outputs
    width: u32,     // values per q/k/v row
    heads: u32,     // query heads (rope: the heads it rotates)
    kv_heads: u32,
    head: u32,      // values per head
    context: u32,   // positions the cache holds
    window: u32,    // keys a query sees, or 0 for all
    inner: u32,     // the MLP's hidden size
    flags: u32,     // 1: bias, 2: residual, 4: positions / layer norm, 8: tanh GELU
    stride: u32,    // norm: input row of output row r is r · stride + offset
    offset: u32,
    q_width: u32,   // values of the queries in a q/k/v row
    eps: f32,
    first: u32,     // a matrix cut into slices of rows (the binding limit): this slice's first
    count: u32,     // row (output, or token id of the table) and its rows
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> step: array<u32>;          // {start, new}
@group(0) @binding(2) var<storage, read> x: array<elem>;
@group(0) @binding(3) var<storage, read> w: array<elem>;            // weights, token table, keys
@group(0) @binding(4) var<storage, read> wf: array<f32>;            // norm weight, positions, cos
@group(0) @binding(5) var<storage, read> bf: array<f32>;            // bias, norm bias, sin
@group(0) @binding(6) var<storage, read_write> y: array<elem>;
@group(0) @binding(7) var<storage, read_write> y2: array<elem>;     // the value cache (kv_store)
@group(0) @binding(8) var<storage, read> tokens: array<u32>;
@group(0) @binding(9) var<storage, read> res: array<elem>;
@group(0) @binding(10) var<storage, read_write> logits: array<f32>;
@group(0) @binding(11) var<storage, read> vc: array<elem>;          // the value cache (attention)

fn llm_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid;
}

// The position of row r.
fn position(r: u32) -> u32 {
    return step[0] + r % step[1];
}

// Token embeddings, plus GPT-2's learned positions (flag 4): the rows whose token is in this
// slice of the table.
@compute @workgroup_size(256)
fn embed_tokens(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = llm_index(wid, nwg, lid);
    if (i >= p.rows * p.d) {
        return;
    }
    let r = i / p.d;
    let j = i % p.d;
    let t = tokens[r];
    if (t < p.first || t >= p.first + p.count) {
        return;
    }
    let v = w[(t - p.first) * p.d + j];
    if ((p.flags & 4u) == 0u) {
        y[i] = v;
    } else {
        y[i] = elem(f32(v) + wf[position(r) * p.d + j]);
    }
}

// RMSNorm, or LayerNorm (flag 4, with the bias in bf) as PyTorch computes it; one thread per
// output row, reading input row r · stride + offset.
@compute @workgroup_size(256)
fn llm_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = llm_index(wid, nwg, lid);
    if (r >= p.rows) {
        return;
    }
    let base = (r * p.stride + p.offset) * p.d;
    let layer = (p.flags & 4u) != 0u;
    var mean = 0.0;
    if (layer) {
        for (var j = 0u; j < p.d; j++) {
            mean += f32(x[base + j]);
        }
        mean /= f32(p.d);
    }
    var v = 0.0;
    for (var j = 0u; j < p.d; j++) {
        let e = f32(x[base + j]) - mean;
        v += e * e;
    }
    let inv = 1.0 / sqrt(v / f32(p.d) + p.eps);
    for (var j = 0u; j < p.d; j++) {
        var o = (f32(x[base + j]) - mean) * inv * wf[j];
        if (layer) {
            o += bf[j];
        }
        y[r * p.d + j] = elem(o);
    }
}

// Rotary position embedding in place, as Hugging Face's rotate_half (i pairs with i + head/2);
// cos in wf, sin in bf, (positions, head / 2) each.
@compute @workgroup_size(256)
fn llm_rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let half = p.head / 2u;
    let i = llm_index(wid, nwg, lid);
    if (i >= p.rows * p.heads * half) {
        return;
    }
    let k = i % half;
    let h = (i / half) % p.heads;
    let r = i / (half * p.heads);
    let t = position(r) * half + k;
    let at = r * p.width + h * p.head + k;
    let x1 = f32(y[at]);
    let x2 = f32(y[at + half]);
    y[at] = elem(x1 * wf[t] - x2 * bf[t]);
    y[at + half] = elem(x2 * wf[t] + x1 * bf[t]);
}

// The step's keys (into y) and values (into y2) at their positions of the cache
// (batch, KV heads, context, head).
@compute @workgroup_size(256)
fn kv_store(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let kv_width = p.kv_heads * p.head;
    let i = llm_index(wid, nwg, lid);
    if (i >= p.rows * kv_width) {
        return;
    }
    let r = i / kv_width;
    let c = i % kv_width;
    let b = r / step[1];
    let at = ((b * p.kv_heads + c / p.head) * p.context + position(r)) * p.head + c % p.head;
    let row = r * p.width + p.q_width;
    y[at] = x[row + c];
    y2[at] = x[row + kv_width + c];
}

// softmax(q·kᵀ/√head)·v over the cached keys (w) and values (vc) up to the query's position,
// one thread per (row, head), streaming over the keys with a running maximum and sum; grouped
// query heads share a KV head. Heads of at most 128 values.
@compute @workgroup_size(256)
fn cached_attention(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = llm_index(wid, nwg, lid);
    if (i >= p.rows * p.heads) {
        return;
    }
    let r = i / p.heads;
    let h = i % p.heads;
    let pos = position(r);
    let b = r / step[1];
    let g = h / (p.heads / p.kv_heads);
    var first = 0u;
    if (p.window > 0u && pos + 1u > p.window) {
        first = pos + 1u - p.window;
    }
    let cache = (b * p.kv_heads + g) * p.context * p.head;
    let q = r * p.width + h * p.head;
    let scale = 1.0 / sqrt(f32(p.head));
    var acc: array<f32, 128>;
    for (var j = 0u; j < p.head; j++) {
        acc[j] = 0.0;
    }
    var m = -3.4028235e38;
    var s = 0.0;
    for (var key = first; key <= pos; key++) {
        let kr = cache + key * p.head;
        var score = 0.0;
        for (var j = 0u; j < p.head; j++) {
            score += f32(x[q + j]) * f32(w[kr + j]);
        }
        score *= scale;
        let m2 = select(m, score, score > m || is_nan(score));
        let corr = exp(m - m2);
        let e = exp(score - m2);
        s = s * corr + e;
        for (var j = 0u; j < p.head; j++) {
            acc[j] = acc[j] * corr + e * f32(vc[kr + j]);
        }
        m = m2;
    }
    let out = (r * p.heads + h) * p.head;
    for (var j = 0u; j < p.head; j++) {
        y[out + j] = elem(acc[j] / s);
    }
}

// silu(gate)·up of (rows, 2·inner) rows, or GPT-2's tanh GELU of (rows, inner) (flag 8).
@compute @workgroup_size(256)
fn glu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = llm_index(wid, nwg, lid);
    if (i >= p.rows * p.inner) {
        return;
    }
    if ((p.flags & 8u) != 0u) {
        let v = f32(x[i]);
        let u = 0.7978845608 * (v + 0.044715 * v * v * v);
        y[i] = elem(0.5 * v * (1.0 + tanh(u)));
        return;
    }
    let r = i / p.inner;
    let j = i % p.inner;
    let g = f32(x[r * 2u * p.inner + j]);
    let u = f32(x[r * 2u * p.inner + p.inner + j]);
    y[i] = elem(g / (1.0 + exp(-g)) * u);
}

// x (rows, k) · wᵀ for the slice w (count, k) of the outputs from `first`: the dot product of
// row r and the slice's output o.
fn dot_row(r: u32, o: u32) -> f32 {
    var acc = 0.0;
    let xr = r * p.k;
    let wr = o * p.k;
    for (var j = 0u; j < p.k; j++) {
        acc += f32(x[xr + j]) * f32(w[wr + j]);
    }
    return acc;
}

// y = x·wᵀ (+ bias, flag 1) (+ res, flag 2) for the slice's outputs, one thread per output;
// y has n values a row.
@compute @workgroup_size(256)
fn llm_linear(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = llm_index(wid, nwg, lid);
    if (i >= p.rows * p.count) {
        return;
    }
    let r = i / p.count;
    let o = i % p.count;
    let at = r * p.n + p.first + o;
    var v = dot_row(r, o);
    if ((p.flags & 1u) != 0u) {
        v += bf[p.first + o];
    }
    if ((p.flags & 2u) != 0u) {
        v += f32(res[at]);
    }
    y[at] = elem(v);
}

// The LM head on the slice's outputs: x·wᵀ rounded to the storage type, as f32 logits.
@compute @workgroup_size(256)
fn lm_head(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = llm_index(wid, nwg, lid);
    if (i < p.rows * p.count) {
        let r = i / p.count;
        let o = i % p.count;
        logits[r * p.n + p.first + o] = f32(elem(dot_row(r, o)));
    }
}
