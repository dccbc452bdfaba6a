// Pooling over NHWC: max, average (PyTorch's divisor rules), and adaptive average (PyTorch's
// floor/ceil bin edges). One thread per output value, channels innermost.

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
    count_include_pad: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// input: (n, h, w, c)
@group(0) @binding(1) var<storage, read> x: array<elem>;
// output: (n, oh, ow, c)
@group(0) @binding(2) var<storage, read_write> y: array<elem>;

struct Pos {
    n: u32,
    oy: u32,
    ox: u32,
    c: u32,
}

fn position(i: u32) -> Pos {
    let c = i % p.c;
    let t = i / p.c;
    let ox = t % p.ow;
    let t2 = t / p.ow;
    return Pos(t2 / p.oh, t2 % p.oh, ox, c);
}

fn at(n: u32, iy: u32, ix: u32, c: u32) -> f32 {
    return f32(x[((n * p.h + iy) * p.w + ix) * p.c + c]);
}

fn index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid;
}

@compute @workgroup_size(256)
fn max_pool(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i >= p.total) {
        return;
    }
    let q = position(i);
    var best = -3.4028235e38;
    for (var ky = 0u; ky < p.kh; ky++) {
        let iy = i32(q.oy * p.sh + ky) - i32(p.ph);
        for (var kx = 0u; kx < p.kw; kx++) {
            let ix = i32(q.ox * p.sw + kx) - i32(p.pw);
            if (iy >= 0 && ix >= 0 && iy < i32(p.h) && ix < i32(p.w)) {
                let v = at(q.n, u32(iy), u32(ix), q.c);
                best = select(best, v, v > best || is_nan(v));
            }
        }
    }
    y[i] = elem(best);
}

@compute @workgroup_size(256)
fn avg_pool(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i >= p.total) {
        return;
    }
    let q = position(i);
    var sum = 0.0;
    var inside = 0u;
    var count = 0u;
    for (var ky = 0u; ky < p.kh; ky++) {
        let iy = i32(q.oy * p.sh + ky) - i32(p.ph);
        for (var kx = 0u; kx < p.kw; kx++) {
            let ix = i32(q.ox * p.sw + kx) - i32(p.pw);
            // PyTorch divides by the window clipped to the padded input.
            if (iy < i32(p.h + p.ph) && ix < i32(p.w + p.pw)) {
                count += 1u;
            }
            if (iy >= 0 && ix >= 0 && iy < i32(p.h) && ix < i32(p.w)) {
                sum += at(q.n, u32(iy), u32(ix), q.c);
                inside += 1u;
            }
        }
    }
    var div = f32(inside);
    if (p.count_include_pad != 0u) {
        div = f32(count);
    }
    y[i] = elem(sum / div);
}

@compute @workgroup_size(256)
fn adaptive_avg_pool(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i >= p.total) {
        return;
    }
    let q = position(i);
    let y0 = q.oy * p.h / p.oh;
    let y1 = ((q.oy + 1u) * p.h + p.oh - 1u) / p.oh;
    let x0 = q.ox * p.w / p.ow;
    let x1 = ((q.ox + 1u) * p.w + p.ow - 1u) / p.ow;
    var sum = 0.0;
    for (var iy = y0; iy < y1; iy++) {
        for (var ix = x0; ix < x1; ix++) {
            sum += at(q.n, iy, ix, q.c);
        }
    }
    y[i] = elem(sum / f32((y1 - y0) * (x1 - x0)));
}
