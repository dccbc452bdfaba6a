// The activations of kernel epilogues, appended to every module (WGSL's declarations may come
// in any order, so a kernel file's own line numbers stay as written). Codes as `Act::code`:
// 0 none, 1 ReLU, 2 ReLU6, 3 SiLU, 4 hardswish, 5 GELU (exact), 6 sigmoid, 7 hardsigmoid.

// erf by Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7; WGSL has no erf); NaN stays.
fn erf_as(v: f32) -> f32 {
    let a = abs(v);
    let t = 1.0 / (1.0 + 0.3275911 * a);
    let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    let e = 1.0 - poly * exp(-a * a);
    return select(e, -e, v < 0.0);
}

// Whether v is a NaN, read from its bits: on GL, Mesa's llvmpipe takes floats never to be NaN,
// folds `v != v` to false and a compare-and-select into max or clamp (which return the number
// where one operand is a NaN); integer compares it leaves as written.
fn is_nan(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
}

// Compares and selects rather than max/clamp, whose NaN result WGSL leaves open; a NaN goes
// through as it is (on GL the selects alone dropped it: see is_nan).
fn activate(v: f32, act: u32) -> f32 {
    if (is_nan(v)) {
        return v;
    }
    let r0 = v + 3.0;
    let relu6 = select(select(r0, 6.0, r0 > 6.0), 0.0, r0 < 0.0);
    switch act {
        case 1u: { return select(v, 0.0, v < 0.0); }
        case 2u: { return select(select(v, 6.0, v > 6.0), 0.0, v < 0.0); }
        case 3u: { return v / (1.0 + exp(-v)); }
        case 4u: { return v * relu6 / 6.0; }
        case 5u: { return 0.5 * v * (1.0 + erf_as(v * 0.70710678118654752)); }
        case 6u: { return 1.0 / (1.0 + exp(-v)); }
        case 7u: { return relu6 / 6.0; }
        default: { return v; }
    }
}
