// Exercise 12: a depthwise convolution that gives the right answer, slowly.
//
// Each output value is one channel of one pixel: the sum of kh · kw input values of the same
// channel around it, times the filter's taps, plus a bias, through the activation. The host
// launches enough workgroups of 256 invocations to cover every output value (`p.total`) —
// this kernel was ported from a CPU loop, and only the first invocation of each workgroup
// works: it walks the workgroup's 256 outputs one after another while the other 255 return.
//
// Make it fast. Keep what the host relies on: the entry point's name and its workgroup size
// (256), the Params struct and the five bindings. `elem` is the run's storage type (f32 here)
// and `activate` comes from the engine's activate.wgsl. `workshop next` checks your output
// against the engine's kernel first, then times yours against this one.

struct Params {
    total: u32,   // n · oh · ow · c: output values
    h: u32,       // input height and width
    w: u32,
    c: u32,       // channels (innermost: the layout is NHWC)
    oh: u32,      // output height and width
    ow: u32,
    kh: u32,      // filter height and width
    kw: u32,
    sh: u32,      // stride
    sw: u32,
    ph: u32,      // padding
    pw: u32,
    dh: u32,      // dilation
    dw: u32,
    has_bias: u32,
    act: u32,     // the activation's code for activate() (0: none)
}

@group(0) @binding(0) var<uniform> p: Params;
// input: (n, h, w, c)
@group(0) @binding(1) var<storage, read> x: array<elem>;
// filter taps: (ky, kx, c), f32
@group(0) @binding(2) var<storage, read> wt: array<f32>;
// bias: (c), f32
@group(0) @binding(3) var<storage, read> bias: array<f32>;
// output: (n, oh, ow, c)
@group(0) @binding(4) var<storage, read_write> y: array<elem>;

@compute @workgroup_size(256)
fn depthwise(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (lid != 0u) {
        return;
    }
    // The grid is 2-D (x · y workgroups) so that large tensors fit the dispatch limits.
    let first = (wid.y * nwg.x + wid.x) * 256u;
    for (var j = 0u; j < 256u; j++) {
        let i = first + j;
        if (i >= p.total) {
            return;
        }
        // Output value i is channel c of pixel (oy, ox) of image n.
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
}
