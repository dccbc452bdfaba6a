// Copies between the channels of NHWC tensors: one part of a concatenation along the channels
// (DenseNet, Inception, SqueezeNet), a channel slice or a shuffle (ShuffleNetV2). One thread
// per element copied.

struct Params {
    total: u32,   // pixels · count
    count: u32,   // channels copied
    cx: u32,      // the input's channels
    x_from: u32,  // the first channel read
    cy: u32,      // the output's channels
    y_from: u32,  // the first channel written
    step: u32,    // between the channels written
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<elem>;
@group(0) @binding(2) var<storage, read_write> y: array<elem>;

fn index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid;
}

@compute @workgroup_size(256)
fn channel_copy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.total) {
        let px = i / p.count;
        let k = i % p.count;
        y[px * p.cy + p.y_from + k * p.step] = x[px * p.cx + p.x_from + k];
    }
}
