// The kernels of the CUDA and HIP backends, in the C++ subset both compilers take. The dialect
// file that includes this one (cuda/ops.cu, hip/ops.hip) first defines:
//   f16_to_f32(unsigned short), f32_to_f16(float): IEEE half conversions
//   KERNEL(name, Args): opens `extern "C" __global__ void name(const Args a)`
// and the build defines WS_FP16 or WS_BF16 for half-precision storage (f32 math throughout).
//
// Layout is NCHW, as PyTorch's. Every kernel takes one struct of arguments, packed by the host
// in declaration order (pointers first, then 32-bit values), and uses neither shared memory nor
// barriers: one thread, one piece of output. That keeps them simple enough to check on the CPU
// too (the emulator runs them thread by thread). Bias vectors stay in f32.

#if defined(WS_FP16)
typedef unsigned short elem;
__device__ inline float ld(elem v) { return f16_to_f32(v); }
__device__ inline elem st(float v) { return f32_to_f16(v); }
#elif defined(WS_BF16)
typedef unsigned short elem;
__device__ inline float ld(elem v) {
    union { unsigned int u; float f; } c;
    c.u = (unsigned int)v << 16;
    return c.f;
}
// Round to nearest even; NaN stays NaN.
__device__ inline elem st(float v) {
    union { unsigned int u; float f; } c;
    c.f = v;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (elem)((c.u >> 16) | 0x40u);
    return (elem)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}
#else
typedef float elem;
__device__ inline float ld(elem v) { return v; }
__device__ inline elem st(float v) { return v; }
#endif

// Activations fused into an epilogue: 0 none, 1 ReLU, 2 ReLU6.
__device__ inline float activate(float v, int act) {
    if (act == 1) return v > 0.0f ? v : 0.0f;
    if (act == 2) return v < 0.0f ? 0.0f : (v > 6.0f ? 6.0f : v);
    return v;
}

// The thread's index in a 1-D launch folded into a 2-D grid (x fastest).
__device__ inline long long linear_index() {
    return ((long long)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
}

// ---- conversions at the edges of the network -------------------------------------------------

struct ConvertArgs {
    const void* x;
    void* y;
    int total;
};

KERNEL(to_elem, ConvertArgs) {
    long long i = linear_index();
    if (i >= a.total) return;
    ((elem*)a.y)[i] = st(((const float*)a.x)[i]);
}

KERNEL(to_f32, ConvertArgs) {
    long long i = linear_index();
    if (i >= a.total) return;
    ((float*)a.y)[i] = ld(((const elem*)a.x)[i]);
}

// ---- convolution (and linear layers, as 1×1 convolutions of 1×1 images) ----------------------

// Output channels per thread: each input value a thread loads feeds this many FMAs, and threads
// of a warp share the channel block, so the weight loads are broadcasts.
#define CONV_CO_TILE 8

struct ConvArgs {
    const elem* x;
    const elem* w;       // (cout, cin / groups, kh, kw)
    const float* bias;   // cout values, or unused
    const elem* res;     // the residual input (output's shape), or unused
    elem* y;
    int n, cin, h, w_, cout, oh, ow;
    int kh, kw, sh, sw, ph, pw, dh, dw;
    int groups, act, has_bias, has_res;
};

// grid.x · block.x covers the output pixels (n, oy, ox); grid.y = groups × channel blocks.
KERNEL(conv2d, ConvArgs) {
    long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long pixels = (long long)a.n * a.oh * a.ow;
    if (p >= pixels) return;
    int cout_g = a.cout / a.groups;
    int cin_g = a.cin / a.groups;
    int blocks = (cout_g + CONV_CO_TILE - 1) / CONV_CO_TILE;
    int g = blockIdx.y / blocks;
    int co0 = g * cout_g + (blockIdx.y % blocks) * CONV_CO_TILE;
    int co_end = min(co0 + CONV_CO_TILE, (g + 1) * cout_g);
    int ox = (int)(p % a.ow);
    int oy = (int)((p / a.ow) % a.oh);
    int b = (int)(p / ((long long)a.ow * a.oh));
    float acc[CONV_CO_TILE];
    for (int j = 0; j < CONV_CO_TILE; ++j) acc[j] = 0.0f;
    long long wstride = (long long)cin_g * a.kh * a.kw;
    for (int ci = 0; ci < cin_g; ++ci) {
        const elem* xc = a.x + ((long long)b * a.cin + (long long)g * cin_g + ci) * a.h * a.w_;
        for (int ky = 0; ky < a.kh; ++ky) {
            int iy = oy * a.sh - a.ph + ky * a.dh;
            if (iy < 0 || iy >= a.h) continue;
            for (int kx = 0; kx < a.kw; ++kx) {
                int ix = ox * a.sw - a.pw + kx * a.dw;
                if (ix < 0 || ix >= a.w_) continue;
                float v = ld(xc[(long long)iy * a.w_ + ix]);
                const elem* wk = a.w + (long long)co0 * wstride + ((long long)ci * a.kh + ky) * a.kw + kx;
                for (int j = 0; j < CONV_CO_TILE; ++j) {
                    if (co0 + j < co_end) acc[j] += v * ld(wk[j * wstride]);
                }
            }
        }
    }
    for (int j = 0; j < CONV_CO_TILE; ++j) {
        int co = co0 + j;
        if (co >= co_end) break;
        long long o = (((long long)b * a.cout + co) * a.oh + oy) * a.ow + ox;
        float r = acc[j];
        if (a.has_bias) r += a.bias[co];
        if (a.has_res) r += ld(a.res[o]);
        a.y[o] = st(activate(r, a.act));
    }
}

// ---- the vendor path's helpers: im2col in front of a library GEMM, the epilogue behind it ----

struct Im2colArgs {
    const elem* x;
    elem* col;           // per image: (cin · kh · kw) rows × (oh · ow) columns
    int n, cin, h, w_, oh, ow;
    int kh, kw, sh, sw, ph, pw, dh, dw;
};

KERNEL(im2col, Im2colArgs) {
    long long i = linear_index();
    long long cols = (long long)a.oh * a.ow;
    long long rows = (long long)a.cin * a.kh * a.kw;
    if (i >= (long long)a.n * rows * cols) return;
    long long q = i % cols;
    long long r = (i / cols) % rows;
    int b = (int)(i / (cols * rows));
    int ox = (int)(q % a.ow), oy = (int)(q / a.ow);
    int kx = (int)(r % a.kw), ky = (int)((r / a.kw) % a.kh), ci = (int)(r / ((long long)a.kw * a.kh));
    int iy = oy * a.sh - a.ph + ky * a.dh;
    int ix = ox * a.sw - a.pw + kx * a.dw;
    float v = 0.0f;
    if (iy >= 0 && iy < a.h && ix >= 0 && ix < a.w_)
        v = ld(a.x[(((long long)b * a.cin + ci) * a.h + iy) * a.w_ + ix]);
    a.col[i] = st(v);
}

// y = act(y + bias[channel] + res), in place on a GEMM's output.
struct EpilogueArgs {
    const float* bias;
    const elem* res;
    elem* y;
    int total, channels, plane;
    int act, has_bias, has_res;
};

KERNEL(epilogue, EpilogueArgs) {
    long long i = linear_index();
    if (i >= a.total) return;
    float r = ld(a.y[i]);
    if (a.has_bias) r += a.bias[(i / a.plane) % a.channels];
    if (a.has_res) r += ld(a.res[i]);
    a.y[i] = st(activate(r, a.act));
}

// ---- element-wise ----------------------------------------------------------------------------

// Batch norm in inference mode as y = x · scale[c] + shift[c].
struct AffineArgs {
    const elem* x;
    const float* scale;
    const float* shift;
    elem* y;
    int total, channels, plane;
};

KERNEL(affine, AffineArgs) {
    long long i = linear_index();
    if (i >= a.total) return;
    int c = (int)((i / a.plane) % a.channels);
    a.y[i] = st(ld(a.x[i]) * a.scale[c] + a.shift[c]);
}

struct ClampArgs {
    const elem* x;
    elem* y;
    int total;
    float lo, hi;
};

KERNEL(clamp, ClampArgs) {
    long long i = linear_index();
    if (i >= a.total) return;
    float v = ld(a.x[i]);
    a.y[i] = st(v < a.lo ? a.lo : (v > a.hi ? a.hi : v));
}

struct AddArgs {
    const elem* x;
    const elem* z;
    elem* y;
    int total;
};

KERNEL(add, AddArgs) {
    long long i = linear_index();
    if (i >= a.total) return;
    a.y[i] = st(ld(a.x[i]) + ld(a.z[i]));
}

// ---- pooling ---------------------------------------------------------------------------------

struct PoolArgs {
    const elem* x;
    elem* y;
    int planes, h, w_, oh, ow;
    int kh, kw, sh, sw, ph, pw;
    int count_include_pad;
};

KERNEL(max_pool, PoolArgs) {
    long long i = linear_index();
    if (i >= (long long)a.planes * a.oh * a.ow) return;
    int ox = (int)(i % a.ow), oy = (int)((i / a.ow) % a.oh);
    long long plane = i / ((long long)a.ow * a.oh);
    float best = -3.402823466e38f;
    for (int ky = 0; ky < a.kh; ++ky) {
        int iy = oy * a.sh - a.ph + ky;
        if (iy < 0 || iy >= a.h) continue;
        for (int kx = 0; kx < a.kw; ++kx) {
            int ix = ox * a.sw - a.pw + kx;
            if (ix < 0 || ix >= a.w_) continue;
            float v = ld(a.x[(plane * a.h + iy) * a.w_ + ix]);
            best = v > best ? v : best;
        }
    }
    a.y[i] = st(best);
}

// The divisor counts the window clipped to the padded input (PyTorch), or only the inside.
KERNEL(avg_pool, PoolArgs) {
    long long i = linear_index();
    if (i >= (long long)a.planes * a.oh * a.ow) return;
    int ox = (int)(i % a.ow), oy = (int)((i / a.ow) % a.oh);
    long long plane = i / ((long long)a.ow * a.oh);
    float sum = 0.0f;
    int padded = 0, inside = 0;
    for (int ky = 0; ky < a.kh; ++ky) {
        int iy = oy * a.sh - a.ph + ky;
        for (int kx = 0; kx < a.kw; ++kx) {
            int ix = ox * a.sw - a.pw + kx;
            if (iy < a.h + a.ph && ix < a.w_ + a.pw) ++padded;
            if (iy < 0 || iy >= a.h || ix < 0 || ix >= a.w_) continue;
            ++inside;
            sum += ld(a.x[(plane * a.h + iy) * a.w_ + ix]);
        }
    }
    int count = a.count_include_pad ? padded : inside;
    a.y[i] = st(sum / (float)(count > 0 ? count : 1));
}

// PyTorch's adaptive bins: start = ⌊i·H/oh⌋, end = ⌈(i+1)·H/oh⌉.
KERNEL(adaptive_avg_pool, PoolArgs) {
    long long i = linear_index();
    if (i >= (long long)a.planes * a.oh * a.ow) return;
    int ox = (int)(i % a.ow), oy = (int)((i / a.ow) % a.oh);
    long long plane = i / ((long long)a.ow * a.oh);
    int y0 = oy * a.h / a.oh, y1 = ((oy + 1) * a.h + a.oh - 1) / a.oh;
    int x0 = ox * a.w_ / a.ow, x1 = ((ox + 1) * a.w_ + a.ow - 1) / a.ow;
    float sum = 0.0f;
    for (int iy = y0; iy < y1; ++iy)
        for (int ix = x0; ix < x1; ++ix) sum += ld(a.x[(plane * a.h + iy) * a.w_ + ix]);
    a.y[i] = st(sum / (float)((y1 - y0) * (x1 - x0)));
}

// ---- softmax over the last dimension: one thread per row, stable (max subtracted) ------------

struct SoftmaxArgs {
    const elem* x;
    elem* y;
    int rows, cols;
};

KERNEL(softmax, SoftmaxArgs) {
    long long r = linear_index();
    if (r >= a.rows) return;
    const elem* x = a.x + r * a.cols;
    float m = -3.402823466e38f;
    for (int j = 0; j < a.cols; ++j) m = fmaxf(m, ld(x[j]));
    float s = 0.0f;
    for (int j = 0; j < a.cols; ++j) s += expf(ld(x[j]) - m);
    for (int j = 0; j < a.cols; ++j) a.y[r * a.cols + j] = st(expf(ld(x[j]) - m) / s);
}

// ---- the memory-bandwidth probe --------------------------------------------------------------

struct StreamArgs {
    const float* a_;
    const float* c;
    float* b;
    int n, triad;
};

// b = a (copy) or b = a + 0.5·c (triad).
KERNEL(stream, StreamArgs) {
    long long i = linear_index();
    if (i >= a.n) return;
    a.b[i] = a.triad ? a.a_[i] + 0.5f * a.c[i] : a.a_[i];
}
