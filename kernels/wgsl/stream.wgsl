// Memory-bandwidth probe (`workshop peak`): a copy and a STREAM-style triad over arrays far
// larger than any cache, one vec4 (16 bytes) per invocation so neighbouring invocations read
// neighbouring 16-byte runs. The host counts 2 (copy) or 3 (triad) bytes moved per byte of an
// array. Always f32: the probe measures memory, not arithmetic.

struct Params {
    n4: u32,       // vec4s per array
    row: u32,      // invocations per row of the 2-D grid
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> c: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> b: array<vec4<f32>>;

@compute @workgroup_size(256)
fn copy(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.y * p.row + id.x;
    if (i < p.n4) {
        b[i] = a[i];
    }
}

@compute @workgroup_size(256)
fn triad(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.y * p.row + id.x;
    if (i < p.n4) {
        b[i] = a[i] + 0.5 * c[i];
    }
}
