// The kernels of the CUDA and HIP backends, in the C++ subset both compilers take. The dialect
// file that includes this one (cuda/ops.cu, hip/ops.hip) first defines:
//   f16_to_f32(unsigned short), f32_to_f16(float): IEEE half conversions
//   KERNEL(name, Args): opens `extern "C" __global__ void name(const Args a)`
//
//   BLOCK_KERNEL(name, Args): the same for a kernel whose 256 threads cooperate through
//     __shared__ memory and __syncthreads() (the emulator runs those threads as fibers)
// and the build defines WS_FP16 or WS_BF16 for half-precision storage (f32 math throughout).
//
// Layout is NCHW, as PyTorch's. Every kernel takes one struct of arguments, packed by the host
// in declaration order (pointers first, then 32-bit values). Most are one thread, one piece of
// output; the tiled convolution shares tiles between a block's threads. Every block has 256
// threads. Bias vectors stay in f32.

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

// Activations fused into an epilogue: 0 none, 1 ReLU, 2 ReLU6, 3 SiLU, 4 hardswish, 5 GELU
// (exact), 6 sigmoid, 7 hardsigmoid (`Act::code`).
__device__ inline float activate(float v, int act) {
    if (act == 1) return v < 0.0f ? 0.0f : v;  // a NaN stays NaN, as in PyTorch
    if (act == 2) return v < 0.0f ? 0.0f : (v > 6.0f ? 6.0f : v);
    if (act == 3) return v / (1.0f + expf(-v));
    if (act == 4 || act == 7) {
        float r = v + 3.0f;
        float gate = (r < 0.0f ? 0.0f : (r > 6.0f ? 6.0f : r)) / 6.0f;
        return act == 4 ? v * gate : gate;
    }
    if (act == 5) return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    if (act == 6) return 1.0f / (1.0f + expf(-v));
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
    // The tiled kernels: the reduction (and w) runs (ky, kx, ci) instead of (ci, ky, kx), and
    // cin / groups is a multiple of 32, so a k tile is one window position's channels.
    int kc;
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

// The same convolution as an implicit GEMM, tiled for the block: per group, Y (cout × pixels)
// = W (cout × cin·kh·kw) · columns, where the columns (the im2col matrix) are gathered from x
// tile by tile into shared memory and never stored. PW: a 1×1, stride-1, unpadded convolution,
// whose columns are x itself; LIN: PW on 1×1 images (a linear layer), whose columns are x's
// rows, gathered along k as the weights are; kc (an argument): the reduction runs window
// position by position. grid.x covers the pixels of all images, grid.y = groups × blocks of
// BM output channels. The helpers below are shared by the FP32 kernel and the tensor-core one.

// Where a block's BM × BN tile lies, and the column of the im2col matrix that this thread
// gathers for every k tile (rows bk0, bk0 + 256 / BN, ...).
struct ConvTile {
    int cout_g, cin_g, g, m0, K, ohw, bn, bk0, cp, iy0, ix0;
    long long N, n0, hw;
    bool col_ok;
    const elem* xb;  // the column's image, the group's first channel
    const elem* wg;  // the block's first weight row
};

template <int BM, int BN>
__device__ inline ConvTile conv_tile(const ConvArgs& a) {
    ConvTile t;
    t.cout_g = a.cout / a.groups;
    t.cin_g = a.cin / a.groups;
    const int mblocks = (t.cout_g + BM - 1) / BM;
    t.g = blockIdx.y / mblocks;
    t.m0 = (blockIdx.y % mblocks) * BM;
    t.K = t.cin_g * a.kh * a.kw;
    t.ohw = a.oh * a.ow;
    t.N = (long long)a.n * t.ohw;
    t.n0 = (long long)blockIdx.x * BN;
    t.hw = (long long)a.h * a.w_;
    t.bn = threadIdx.x % BN;
    t.bk0 = threadIdx.x / BN;
    const long long col = t.n0 + t.bn;
    t.col_ok = col < t.N;
    const int cb = t.col_ok ? (int)(col / t.ohw) : 0;
    t.cp = (int)(col % t.ohw);
    t.iy0 = (t.cp / a.ow) * a.sh - a.ph;
    t.ix0 = (t.cp % a.ow) * a.sw - a.pw;
    t.xb = a.x + ((long long)cb * a.cin + (long long)t.g * t.cin_g) * t.hw;
    t.wg = a.w + ((long long)t.g * t.cout_g + t.m0) * t.K;
    return t;
}

// With kc, a k tile's window position and where its first channel lies (null: padding).
__device__ inline const elem* conv_tap(const ConvArgs& a, const ConvTile& t, int k0) {
    if (!a.kc) return 0;
    const int rs = k0 / t.cin_g, ky = rs / a.kw;
    const int iy = t.iy0 + ky * a.dh, ix = t.ix0 + (rs - ky * a.kw) * a.dw;
    if (!t.col_ok || iy < 0 || iy >= a.h || ix < 0 || ix >= a.w_) return 0;
    return t.xb + (long long)(k0 - rs * t.cin_g) * t.hw + (long long)iy * a.w_ + ix;
}

// Row k0 + kr of the thread's column, in storage precision (zero outside the input).
template <bool PW>
__device__ inline elem conv_column(const ConvArgs& a, const ConvTile& t, const elem* tap, int k0,
                                   int kr) {
    const elem zero = 0;
    if (!PW && a.kc) return tap ? tap[(long long)kr * t.hw] : zero;
    const int k = k0 + kr;
    if (!t.col_ok || k >= t.K) return zero;
    if (PW) return t.xb[k * t.hw + t.cp];
    const int khw = a.kh * a.kw, ci = k / khw, r = k - ci * khw, ky = r / a.kw, kx = r - ky * a.kw;
    const int iy = t.iy0 + ky * a.dh, ix = t.ix0 + kx * a.dw;
    if (iy < 0 || iy >= a.h || ix < 0 || ix >= a.w_) return zero;
    return t.xb[ci * t.hw + (long long)iy * a.w_ + ix];
}

// LIN: element (k, column c) of the columns, x's row c.
__device__ inline elem lin_column(const ConvArgs& a, const ConvTile& t, long long c, int k) {
    const elem zero = 0;
    return (c < t.N && k < t.K) ? a.x[c * a.cin + (long long)t.g * t.cin_g + k] : zero;
}

// Weight (m0 + am, k) of the block's rows (zero past the last channel or k).
__device__ inline elem conv_weight(const ConvTile& t, int am, int k) {
    const elem zero = 0;
    return (t.m0 + am < t.cout_g && k < t.K) ? t.wg[(long long)am * t.K + k] : zero;
}

// Where output column c starts in y (-1: past the last pixel): the unrolled stores add
// co · oh · ow and divide nothing.
__device__ inline long long conv_out_col(const ConvArgs& a, const ConvTile& t, long long c) {
    return c < t.N ? (c / t.ohw) * a.cout * t.ohw + c % t.ohw : -1;
}

// The epilogue of one output: bias (already in v), residual, activation, storage precision.
__device__ inline void conv_store(const ConvArgs& a, long long o, float v) {
    if (a.has_res) v += ld(a.res[o]);
    a.y[o] = st(activate(v, a.act));
}

// FP32 math: each of the 256 threads (16 × 16) computes a TM × TN piece of the tile, read from
// shared memory as contiguous runs; the next k tile is fetched into registers while the
// current one is multiplied.
template <int BM, int BN, int BK, int TM, int TN, bool PW, bool LIN>
__device__ inline void conv_tiled(const ConvArgs& a) {
    // +4: the transposed stores of a tile land in different banks; rows stay 16-byte aligned
    // for vector loads.
    alignas(16) __shared__ float As[BK][BM + 4];
    alignas(16) __shared__ float Bs[BK][BN + 4];
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const ConvTile t = conv_tile<BM, BN>(a);
    constexpr int AL = BM * BK / 256, BL = BK * BN / 256, BSTEP = 256 / BN;
    float ra[AL], rb[BL];
    auto fetch = [&](int k0) {
        const elem* tap = conv_tap(a, t, k0);
#pragma unroll
        for (int l = 0; l < AL; ++l) {
            const int e = tid + 256 * l;
            ra[l] = ld(conv_weight(t, e / BK, k0 + e % BK));
        }
#pragma unroll
        for (int l = 0; l < BL; ++l) {
            const int e = tid + 256 * l;
            rb[l] = ld(LIN ? lin_column(a, t, t.n0 + e / BK, k0 + e % BK)
                           : conv_column<PW>(a, t, tap, k0, t.bk0 + BSTEP * l));
        }
    };
    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;
    fetch(0);
    for (int k0 = 0; k0 < t.K; k0 += BK) {
#pragma unroll
        for (int l = 0; l < AL; ++l) {
            const int e = tid + 256 * l;
            As[e % BK][e / BK] = ra[l];
        }
#pragma unroll
        for (int l = 0; l < BL; ++l) {
            const int e = tid + 256 * l;
            if (LIN)
                Bs[e % BK][e / BK] = rb[l];
            else
                Bs[t.bk0 + BSTEP * l][t.bn] = rb[l];
        }
        __syncthreads();
        if (k0 + BK < t.K) fetch(k0 + BK);
#pragma unroll
        for (int kk = 0; kk < BK; ++kk) {
            float av[TM], bv[TN];
#pragma unroll
            for (int i = 0; i < TM; ++i) av[i] = As[kk][ty * TM + i];
#pragma unroll
            for (int j = 0; j < TN; ++j) bv[j] = Bs[kk][tx * TN + j];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += av[i] * bv[j];
        }
        __syncthreads();
    }
    long long cols[TN];
#pragma unroll
    for (int j = 0; j < TN; ++j) cols[j] = conv_out_col(a, t, t.n0 + tx * TN + j);
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int m = t.m0 + ty * TM + i;
        if (m >= t.cout_g) continue;
        const int co = t.g * t.cout_g + m;
        const float bias = a.has_bias ? a.bias[co] : 0.0f;
#pragma unroll
        for (int j = 0; j < TN; ++j)
            if (cols[j] >= 0) conv_store(a, cols[j] + (long long)co * t.ohw, acc[i][j] + bias);
    }
}

// Large layers: 128 × 128 tiles, 8 × 8 outputs per thread.
BLOCK_KERNEL(conv2d_t128, ConvArgs) { conv_tiled<128, 128, 8, 8, 8, false, false>(a); }
BLOCK_KERNEL(conv2d_pw_t128, ConvArgs) { conv_tiled<128, 128, 8, 8, 8, true, false>(a); }
BLOCK_KERNEL(conv2d_lin_t128, ConvArgs) { conv_tiled<128, 128, 8, 8, 8, true, true>(a); }

// Layers with fewer output tiles or channels (late stages, small batches, 64-channel layers):
// 64 × 64 tiles, 4 × 4 per thread.
BLOCK_KERNEL(conv2d_t64, ConvArgs) { conv_tiled<64, 64, 16, 4, 4, false, false>(a); }
BLOCK_KERNEL(conv2d_pw_t64, ConvArgs) { conv_tiled<64, 64, 16, 4, 4, true, false>(a); }
BLOCK_KERNEL(conv2d_lin_t64, ConvArgs) { conv_tiled<64, 64, 16, 4, 4, true, true>(a); }

// ---- matrix units: the tiled convolution on half-precision tensor or matrix cores --------------
//
// NVIDIA: mma.sync m16n8k16 per warp of 32 (compute capability 8.0 on). AMD: MFMA 16×16×16 per
// wavefront of 64 (CDNA 2 and later: gfx90a, gfx94x, gfx950; the HIP dialect defines WS_MFMA for
// those targets). The emulator runs either, in shared memory (WS_EMU_WAVE64: AMD's).

#if (defined(WS_FP16) || defined(WS_BF16)) && \
    (defined(WS_MMA_PTX) || defined(WS_MFMA) || defined(WS_EMULATOR))
#define WS_MMA 1

__device__ inline unsigned pack2(const elem* p) { return (unsigned)p[0] | ((unsigned)p[1] << 16); }

#if defined(WS_MFMA) || defined(WS_EMU_WAVE64)
// One wavefront: D (16 × 16, f32) += A (16 × 16) · B (16 × 16), as v_mfma_f32_16x16x16f16 (and
// its bf16 twin, _1k). With r = lane % 16 and q = lane / 16, a lane holds in a[0..1] A's row r,
// columns 4q .. 4q + 3 (two halves per register, lower column in the low bits); in b[0..1] B's
// column r, rows 4q .. 4q + 3; in d[0..3] D's rows 4q .. 4q + 3 of column r.
struct MmaShape {
    static constexpr int LANES = 64, WAVES_N = 2, TN = 16, A_REGS = 2;
    // Where a lane's accumulator r sits in its 16 × TN tile.
    __device__ static int row(int lane, int r) { return 4 * (lane / 16) + r; }
    __device__ static int col(int lane, int r) { return lane % 16; }
    // The lane and register holding A[row][k], and B[k][col] (the same shape).
    __device__ static int a_lane(int row, int k) { return row + 16 * (k / 4); }
    __device__ static int a_reg(int row, int k) { return (k % 4) / 2; }
    __device__ static int b_lane(int k, int col) { return a_lane(col, k); }
    __device__ static int b_reg(int k, int col) { return a_reg(col, k); }
};

// A lane's fragment of the 16 × 16 piece of A at row m (or of B, n-major, at column m), from
// k: the same shape for both.
template <int LD>
__device__ inline void mma_a(const elem (*As)[LD], int m, int k, int lane, unsigned* af) {
    const int r = lane % 16, kk = k + 4 * (lane / 16);
    af[0] = pack2(&As[m + r][kk]);
    af[1] = pack2(&As[m + r][kk + 2]);
}
template <int LD>
__device__ inline void mma_b(const elem (*Bs)[LD], int n, int k, int lane, unsigned* bf) {
    mma_a<LD>(Bs, n, k, lane, bf);
}
#else
// One warp: D (16 × 8, f32) += A (16 × 16, row-major) · B (16 × 8, column-major), as PTX's
// mma.sync m16n8k16. With g = lane / 4 and t = lane % 4, a lane holds in a[0..3] A's
// (row g, columns 2t, 2t+1), (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..), two halves per
// register, lower column in the low bits; in b[0..1] B's (rows 2t, 2t+1, column g) and
// (2t + 8.., g); in d[0..3] D's (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
struct MmaShape {
    static constexpr int LANES = 32, WAVES_N = 4, TN = 8, A_REGS = 4;
    __device__ static int row(int lane, int r) { return lane / 4 + 8 * (r / 2); }
    __device__ static int col(int lane, int r) { return (lane % 4) * 2 + r % 2; }
    __device__ static int a_lane(int row, int k) { return (row % 8) * 4 + (k % 8) / 2; }
    __device__ static int a_reg(int row, int k) { return row / 8 + 2 * (k / 8); }
    __device__ static int b_lane(int k, int col) { return col * 4 + (k % 8) / 2; }
    __device__ static int b_reg(int k, int col) { return k / 8; }
};

// A lane's fragment of the 16 × 16 piece of A at row m, and of the 16 × 8 piece of B
// (n-major) at column n, from k.
template <int LD>
__device__ inline void mma_a(const elem (*As)[LD], int m, int k, int lane, unsigned* af) {
    const int g = lane / 4, kk = k + 2 * (lane % 4);
    af[0] = pack2(&As[m + g][kk]);
    af[1] = pack2(&As[m + g + 8][kk]);
    af[2] = pack2(&As[m + g][kk + 8]);
    af[3] = pack2(&As[m + g + 8][kk + 8]);
}
template <int LD>
__device__ inline void mma_b(const elem (*Bs)[LD], int n, int k, int lane, unsigned* bf) {
    const int g = lane / 4, kk = k + 2 * (lane % 4);
    bf[0] = pack2(&Bs[n + g][kk]);
    bf[1] = pack2(&Bs[n + g][kk + 8]);
}
#endif

#if defined(WS_MFMA)
typedef _Float16 ws_half4 __attribute__((ext_vector_type(4)));
typedef short ws_short4 __attribute__((ext_vector_type(4)));
typedef float ws_float4 __attribute__((ext_vector_type(4)));
struct ws_pair { unsigned lo, hi; };
#endif

// d += the 16 × 16 piece of A times the 16 × TN piece of B, in the fragments MmaShape describes.
__device__ inline void mma_tile(float* d, const unsigned* a, const unsigned* b) {
#if defined(WS_MMA_PTX)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32." WS_MMA_PTX "." WS_MMA_PTX ".f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(WS_MFMA)
    const ws_pair pa = {a[0], a[1]}, pb = {b[0], b[1]};
    ws_float4 c = {d[0], d[1], d[2], d[3]};
#if defined(WS_FP16)
    c = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(ws_half4, pa),
                                              __builtin_bit_cast(ws_half4, pb), c, 0, 0, 0);
#else
    c = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(ws_short4, pa),
                                                  __builtin_bit_cast(ws_short4, pb), c, 0, 0, 0);
#endif
    for (int r = 0; r < 4; ++r) d[r] = c[r];
#else
    // The emulator: the warp's (wavefront's) fragments meet in shared memory, each lane
    // computes its four outputs from the lanes and registers MmaShape says hold them.
    __shared__ unsigned fa[256][4], fb[256][2];
    const int tid = threadIdx.x, lane = tid % MmaShape::LANES, first = tid - lane;
    for (int r = 0; r < MmaShape::A_REGS; ++r) fa[tid][r] = a[r];
    fb[tid][0] = b[0];
    fb[tid][1] = b[1];
    __syncthreads();
    for (int r = 0; r < 4; ++r) {
        const int row = MmaShape::row(lane, r), col = MmaShape::col(lane, r);
        float sum = 0.0f;
        for (int k = 0; k < 16; ++k) {
            const unsigned ar = fa[first + MmaShape::a_lane(row, k)][MmaShape::a_reg(row, k)];
            const unsigned br = fb[first + MmaShape::b_lane(k, col)][MmaShape::b_reg(k, col)];
            sum += ld((elem)(k % 2 ? ar >> 16 : ar & 0xffffu)) *
                   ld((elem)(k % 2 ? br >> 16 : br & 0xffffu));
        }
        d[r] += sum;
    }
    __syncthreads();
#endif
}

// conv_tiled's implicit GEMM on matrix units: tiles of BM × BN outputs and 32-deep slices of
// the reduction in shared memory as half-precision values (A row-major, the columns n-major),
// the block's 256 threads as warps (wavefronts) in 2 rows × WAVES_N, each multiplying a
// (BM / 2) × (BN / WAVES_N) piece in 16 × TN steps. Accumulation, bias, residual and
// activation in f32, as everywhere.
template <int BM, int BN, bool PW, bool LIN>
__device__ inline void conv_mma(const ConvArgs& a) {
    constexpr int BK = 32, LD = BK + 8;  // +8: the fragment loads of a warp hit 32 banks
    constexpr int WN = MmaShape::WAVES_N, TN = MmaShape::TN;
    constexpr int MT = BM / 32, NT = BN / WN / TN;
    alignas(16) __shared__ elem As[BM][LD];
    alignas(16) __shared__ elem Bs[BN][LD];
    const int tid = threadIdx.x, lane = tid % MmaShape::LANES, warp = tid / MmaShape::LANES;
    const int wm = warp / WN, wn = warp % WN;
    const ConvTile t = conv_tile<BM, BN>(a);
    constexpr int AL = BM * BK / 256, BL = BK * BN / 256, BSTEP = 256 / BN;
    elem ra[AL], rb[BL];
    auto fetch = [&](int k0) {
        const elem* tap = conv_tap(a, t, k0);
#pragma unroll
        for (int l = 0; l < AL; ++l) {
            const int e = tid + 256 * l;
            ra[l] = conv_weight(t, e / BK, k0 + e % BK);
        }
#pragma unroll
        for (int l = 0; l < BL; ++l) {
            const int e = tid + 256 * l;
            rb[l] = LIN ? lin_column(a, t, t.n0 + e / BK, k0 + e % BK)
                        : conv_column<PW>(a, t, tap, k0, t.bk0 + BSTEP * l);
        }
    };
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;
    fetch(0);
    for (int k0 = 0; k0 < t.K; k0 += BK) {
#pragma unroll
        for (int l = 0; l < AL; ++l) {
            const int e = tid + 256 * l;
            As[e / BK][e % BK] = ra[l];
        }
#pragma unroll
        for (int l = 0; l < BL; ++l) {
            const int e = tid + 256 * l;
            if (LIN)
                Bs[e / BK][e % BK] = rb[l];
            else
                Bs[t.bn][t.bk0 + BSTEP * l] = rb[l];
        }
        __syncthreads();
        if (k0 + BK < t.K) fetch(k0 + BK);
#pragma unroll
        for (int ks = 0; ks < BK; ks += 16) {
            unsigned af[MT][4], bf[NT][2];
#pragma unroll
            for (int i = 0; i < MT; ++i) mma_a<LD>(As, wm * (BM / 2) + i * 16, ks, lane, af[i]);
#pragma unroll
            for (int j = 0; j < NT; ++j) mma_b<LD>(Bs, wn * (BN / WN) + j * TN, ks, lane, bf[j]);
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j) mma_tile(acc[i][j], af[i], bf[j]);
        }
        __syncthreads();
    }
    // Each accumulator's output column, found once.
    long long cols[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r)
            cols[j][r] = conv_out_col(a, t, t.n0 + wn * (BN / WN) + j * TN + MmaShape::col(lane, r));
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int m = t.m0 + wm * (BM / 2) + i * 16 + MmaShape::row(lane, r);
            if (m >= t.cout_g) continue;
            const int co = t.g * t.cout_g + m;
            const float bias = a.has_bias ? a.bias[co] : 0.0f;
#pragma unroll
            for (int j = 0; j < NT; ++j)
                if (cols[j][r] >= 0)
                    conv_store(a, cols[j][r] + (long long)co * t.ohw, acc[i][j][r] + bias);
        }
}

BLOCK_KERNEL(conv2d_mma_t128, ConvArgs) { conv_mma<128, 128, false, false>(a); }
BLOCK_KERNEL(conv2d_pw_mma_t128, ConvArgs) { conv_mma<128, 128, true, false>(a); }
BLOCK_KERNEL(conv2d_lin_mma_t128, ConvArgs) { conv_mma<128, 128, true, true>(a); }
BLOCK_KERNEL(conv2d_mma_t64, ConvArgs) { conv_mma<64, 64, false, false>(a); }
BLOCK_KERNEL(conv2d_pw_mma_t64, ConvArgs) { conv_mma<64, 64, true, false>(a); }
BLOCK_KERNEL(conv2d_lin_mma_t64, ConvArgs) { conv_mma<64, 64, true, true>(a); }
#endif

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

struct SigmoidArgs {
    const elem* x;  // (total)
    elem* y;        // (total)
    int total;
};

// 1 / (1 + e^-x), in f32.
KERNEL(sigmoid, SigmoidArgs) {
    long long i = linear_index();
    if (i >= a.total) return;
    a.y[i] = st(1.0f / (1.0f + expf(-ld(a.x[i]))));
}

struct UnaryArgs {
    const elem* x;
    elem* y;
    int total, code;  // 0 hardswish, 1 hardsigmoid, 2 SiLU, 3 tanh
};

// The newer networks' activations, in f32; comparisons keep a NaN NaN.
KERNEL(unary, UnaryArgs) {
    long long i = linear_index();
    if (i >= a.total) return;
    float v = ld(a.x[i]);
    float r = v + 3.0f;
    r = r < 0.0f ? 0.0f : (r > 6.0f ? 6.0f : r);
    float out = a.code == 0 ? v * r / 6.0f : (a.code == 1 ? r / 6.0f : v / (1.0f + expf(-v)));
    if (a.code == 3) out = tanhf(v);
    a.y[i] = st(out);
}

struct ScaleChannelsArgs {
    const elem* x;  // (N, C, H, W)
    const elem* s;  // (N, C)
    elem* y;
    int total, hw;
};

// Squeeze-and-excitation's scale · input, channel by channel.
KERNEL(scale_channels, ScaleChannelsArgs) {
    long long i = linear_index();
    if (i >= a.total) return;
    a.y[i] = st(ld(a.x[i]) * ld(a.s[i / a.hw]));
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
            best = (v > best || v != v) ? v : best;  // NaN wins, as in PyTorch
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

// ---- transformer ops on tokens (N, T, D), row-major -------------------------------------------

struct TokensArgs {
    const elem* x;  // (N, C, H·W)
    elem* y;        // (N, H·W, C)
    int n, c, hw;
};

// A patch grid as tokens: (N, C, H, W) → (N, H·W, C).
KERNEL(tokens, TokensArgs) {
    long long i = linear_index();
    if (i >= (long long)a.n * a.c * a.hw) return;
    long long ch = i % a.c, p = (i / a.c) % a.hw, img = i / ((long long)a.c * a.hw);
    a.y[i] = a.x[(img * a.c + ch) * a.hw + p];
}

struct ChannelCopyArgs {
    const elem* x;  // (N, cx, H·W)
    elem* y;        // (N, cy, H·W)
    int n, hw, cx, from, cy, to, count, step;
};

// Channels [from, from + count) of x into channels to, to + step, … of y: one part of a
// concatenation, a channel slice or a shuffle.
KERNEL(channel_copy, ChannelCopyArgs) {
    long long i = linear_index();
    long long per = (long long)a.count * a.hw;
    if (i >= a.n * per) return;
    long long img = i / per, r = i % per;
    long long k = r / a.hw, q = r % a.hw;
    a.y[(img * a.cy + a.to + k * a.step) * a.hw + q] = a.x[(img * a.cx + a.from + k) * a.hw + q];
}

struct ClassTokenArgs {
    const elem* x;       // (N, T, D)
    const float* token;  // (D)
    elem* y;             // (N, 1 + T, D)
    int n, t, d;
};

KERNEL(class_token, ClassTokenArgs) {
    long long i = linear_index();
    long long per = (long long)(a.t + 1) * a.d;
    if (i >= a.n * per) return;
    long long img = i / per, r = i % per;
    a.y[i] = r < a.d ? st(a.token[r]) : a.x[img * a.t * a.d + (r - a.d)];
}

struct PositionsArgs {
    const elem* x;
    const float* pos;  // (T·D), added to every image
    elem* y;
    int total, per_image;
};

KERNEL(positions, PositionsArgs) {
    long long i = linear_index();
    if (i >= a.total) return;
    a.y[i] = st(ld(a.x[i]) + a.pos[i % a.per_image]);
}

struct LayerNormArgs {
    const elem* x;
    const float* w;
    const float* b;
    elem* y;
    int rows, d;
    // How far apart a row's elements lie: 1 for tokens, H·W for the channels of an NCHW image
    // (ConvNeXt's LayerNorm2d).
    int inner;
    float eps;
};

// One thread per row, in f32: the mean, then the biased variance, as PyTorch.
KERNEL(layer_norm, LayerNormArgs) {
    long long r = linear_index();
    if (r >= a.rows) return;
    long long base = (r / a.inner) * a.d * a.inner + r % a.inner;
    const elem* x = a.x + base;
    float mean = 0.0f;
    for (int j = 0; j < a.d; ++j) mean += ld(x[(long long)j * a.inner]);
    mean /= (float)a.d;
    float var = 0.0f;
    for (int j = 0; j < a.d; ++j) {
        float v = ld(x[(long long)j * a.inner]) - mean;
        var += v * v;
    }
    float inv = 1.0f / sqrtf(var / (float)a.d + a.eps);
    for (int j = 0; j < a.d; ++j) {
        long long k = (long long)j * a.inner;
        a.y[base + k] = st((ld(x[k]) - mean) * inv * a.w[j] + a.b[j]);
    }
}

// Rows of tokens (inner = 1): 32 threads a row, 8 rows a block, so a row's elements are read
// side by side by neighbouring threads; its sums are reduced in shared memory, in f32 (mean,
// then the biased variance, as PyTorch).
// The sum of `part` over the 32 threads of this thread's row (8 rows a block), in every one of
// them; `red` is the block's 256 floats of shared memory.
__device__ inline float row_sum32(float* red, float part) {
    const int tid = threadIdx.x, lane = tid % 32;
    red[tid] = part;
    for (int step = 16; step > 0; step /= 2) {
        __syncthreads();
        if (lane < step) red[tid] += red[tid + step];
    }
    __syncthreads();
    const float total = red[tid - lane];
    __syncthreads();
    return total;
}

BLOCK_KERNEL(layer_norm_rows, LayerNormArgs) {
    __shared__ float red[256];
    const int lane = threadIdx.x % 32;
    const long long r = linear_index() / 32;
    const bool live = r < a.rows;
    const elem* x = a.x + (live ? r : 0) * a.d;
    auto row_sum = [&](float part) { return row_sum32(red, part); };
    float part = 0.0f;
    for (int j = lane; live && j < a.d; j += 32) part += ld(x[j]);
    const float mean = row_sum(part) / (float)a.d;
    part = 0.0f;
    for (int j = lane; live && j < a.d; j += 32) {
        const float v = ld(x[j]) - mean;
        part += v * v;
    }
    const float inv = 1.0f / sqrtf(row_sum(part) / (float)a.d + a.eps);
    for (int j = lane; live && j < a.d; j += 32)
        a.y[r * a.d + j] = st((ld(x[j]) - mean) * inv * a.w[j] + a.b[j]);
}

struct GeluArgs {
    const elem* x;
    elem* y;
    int total;
};

// x · Φ(x) with the exact error function (nn.GELU()).
KERNEL(gelu, GeluArgs) {
    long long i = linear_index();
    if (i >= a.total) return;
    a.y[i] = st(activate(ld(a.x[i]), 5));
}

struct SelectTokenArgs {
    const elem* x;  // (N, T, D)
    elem* y;        // (N, D)
    int n, t, d, index;
};

KERNEL(select_token, SelectTokenArgs) {
    long long i = linear_index();
    if (i >= (long long)a.n * a.d) return;
    long long img = i / a.d, j = i % a.d;
    a.y[i] = a.x[(img * a.t + a.index) * a.d + j];
}

struct WindowArgs {
    const elem* qkv;        // (N, H, W, 3·d), tokens row-major
    const float* table;     // the relative position bias ((2·window − 1)², heads)
    const float* qkv_bias;  // what a padded token holds (3·d)
    const float* scales;    // the scores' scale per head (1/√dh; V2: exp(min(logit_scale, ln 100)))
    elem* y;                // (N, H, W, d)
    int n, h, w, hp, wp, window, shift_h, shift_w, d, heads;
    int cosine;             // 1: Swin V2's cosine attention (q and k normalised)
    int dilated;            // 1: MaxViT's grid partition (window (a, b): pixel (a, b) of each block)
};

// The mask's region along one side of the shifted grid: torchvision's slices (0, −w), (−w, −s),
// (−s, ∞).
__device__ inline int window_side(int v, int size, int s, int window) {
    if (s == 0 || v < size - window) return 0;
    return v < size - s ? 1 : 2;
}

// The input pixel (y0, x0) under token (yy, xx) of the shifted, padded grid (past the input:
// padding); dilated, window (a, b)'s token (i, j) is pixel (i·H/window + a, j·W/window + b).
__device__ inline void window_source(const WindowArgs& a, int yy, int xx, int& y0, int& x0) {
    int ws = a.window;
    if (a.dilated) {
        y0 = yy % ws * (a.h / ws) + yy / ws;
        x0 = xx % ws * (a.w / ws) + xx / ws;
    } else {
        y0 = (yy + a.shift_h) % a.hp;
        x0 = (xx + a.shift_w) % a.wp;
    }
}

// Column `col` of the q/k/v row under (yy, xx) of the shifted, padded grid, or the bias.
__device__ inline float window_qkv(const WindowArgs& a, long long img, int yy, int xx, int col) {
    int y0, x0;
    window_source(a, yy, xx, y0, x0);
    if (y0 < a.h && x0 < a.w) return ld(a.qkv[((img * a.h + y0) * a.w + x0) * 3 * a.d + col]);
    return a.qkv_bias[col];
}

// Swin's shifted (or MaxViT's dilated) window attention core: softmax(q·kᵀ/√dh + bias + mask)·v over the query's
// window, one thread per (image, head, query of the padded grid), online softmax.
KERNEL(window_attention, WindowArgs) {
    long long i = linear_index();
    if (i >= (long long)a.n * a.heads * a.hp * a.wp) return;
    int xx = (int)(i % a.wp), yy = (int)((i / a.wp) % a.hp);
    int h = (int)((i / ((long long)a.wp * a.hp)) % a.heads);
    long long img = i / ((long long)a.wp * a.hp * a.heads);
    int y0, x0;
    window_source(a, yy, xx, y0, x0);
    if (y0 >= a.h || x0 >= a.w) return;  // a padded query
    int ws = a.window, dh = a.d / a.heads;
    int wy = yy / ws * ws, wx = xx / ws * ws, qi = (yy - wy) * ws + (xx - wx);
    int region = window_side(yy, a.hp, a.shift_h, ws) * 3 + window_side(xx, a.wp, a.shift_w, ws);
    float q[128], acc[128], qq = 0.0f;
    for (int j = 0; j < dh; ++j) {
        q[j] = window_qkv(a, img, yy, xx, h * dh + j);
        qq += q[j] * q[j];
        acc[j] = 0.0f;
    }
    // V2 divides q by its norm (and each k by its own, below); the head's scale goes with q.
    float qscale = a.scales[h];
    if (a.cosine) qscale /= fmaxf(sqrtf(qq), 1e-12f);
    float m = -3.4028235e38f, s = 0.0f;
    for (int kj = 0; kj < ws * ws; ++kj) {
        int ky = wy + kj / ws, kx = wx + kj % ws;
        float dot = 0.0f, kk = 0.0f;
        for (int j = 0; j < dh; ++j) {
            float k = window_qkv(a, img, ky, kx, a.d + h * dh + j);
            dot += q[j] * k;
            kk += k * k;
        }
        if (a.cosine) dot /= fmaxf(sqrtf(kk), 1e-12f);
        int row = (qi / ws + ws - 1 - kj / ws) * (2 * ws - 1) + (qi % ws + ws - 1 - kj % ws);
        float score = dot * qscale + a.table[row * a.heads + h];
        if (window_side(ky, a.hp, a.shift_h, ws) * 3 + window_side(kx, a.wp, a.shift_w, ws) != region)
            score -= 100.0f;
        float m2 = (score > m || score != score) ? score : m;
        float corr = expf(m - m2), e = expf(score - m2);
        s = s * corr + e;
        for (int j = 0; j < dh; ++j)
            acc[j] = acc[j] * corr + e * window_qkv(a, img, ky, kx, 2 * a.d + h * dh + j);
        m = m2;
    }
    long long out = ((img * a.h + y0) * a.w + x0) * a.d + h * dh;
    for (int j = 0; j < dh; ++j) a.y[out + j] = st(acc[j] / s);
}

struct PatchMergeArgs {
    const elem* x;  // (N, C, H, W)
    elem* y;        // (N, 4·C, ⌈H/2⌉, ⌈W/2⌉)
    int n, c, h, w, oh, ow;
};

// Each output pixel the channels of its 2×2 block (top-left, bottom-left, top-right,
// bottom-right), zeros past an odd edge.
KERNEL(patch_merge, PatchMergeArgs) {
    long long i = linear_index();
    if (i >= (long long)a.n * 4 * a.c * a.oh * a.ow) return;
    int ox = (int)(i % a.ow), oy = (int)((i / a.ow) % a.oh);
    int ch4 = (int)((i / ((long long)a.ow * a.oh)) % (4 * a.c));
    long long img = i / ((long long)a.ow * a.oh * 4 * a.c);
    int q = ch4 / a.c, ch = ch4 % a.c;
    int yy = 2 * oy + q % 2, xx = 2 * ox + q / 2;
    a.y[i] = (yy < a.h && xx < a.w) ? a.x[((img * a.c + ch) * a.h + yy) * a.w + xx] : st(0.0f);
}

// The largest head the attention kernel holds in registers (ViT-H: 80).
#define ATTENTION_MAX_DH 128

struct AttentionArgs {
    const elem* qkv;  // (N, T, 3·D): q, k, v side by side, heads side by side in each
    elem* y;          // (N, T, D): the heads side by side
    int n, t, d, heads;
};

// softmax(q·kᵀ/√dh)·v, one thread per (image, head, query), streaming over the keys with a
// running maximum and sum (FlashAttention's online softmax): no score is stored anywhere.
// A NaN score wins the maximum and spreads, as in PyTorch.
KERNEL(attention, AttentionArgs) {
    long long i = linear_index();
    if (i >= (long long)a.n * a.heads * a.t) return;
    int q = (int)(i % a.t), h = (int)((i / a.t) % a.heads);
    long long img = i / ((long long)a.t * a.heads);
    int dh = a.d / a.heads;
    const elem* base = a.qkv + img * a.t * 3 * a.d;
    const elem* qrow = base + (long long)q * 3 * a.d + h * dh;
    float scale = 1.0f / sqrtf((float)dh);
    float acc[ATTENTION_MAX_DH];
    for (int j = 0; j < dh; ++j) acc[j] = 0.0f;
    float m = -3.402823466e38f, s = 0.0f;
    for (int k = 0; k < a.t; ++k) {
        const elem* krow = base + (long long)k * 3 * a.d + a.d + h * dh;
        float score = 0.0f;
        for (int j = 0; j < dh; ++j) score += ld(qrow[j]) * ld(krow[j]);
        score *= scale;
        float m2 = (score > m || score != score) ? score : m;
        float corr = expf(m - m2), p = expf(score - m2);
        s = s * corr + p;
        const elem* vrow = krow + a.d;
        for (int j = 0; j < dh; ++j) acc[j] = acc[j] * corr + p * ld(vrow[j]);
        m = m2;
    }
    elem* out = a.y + (img * a.t + q) * a.d + h * dh;
    for (int j = 0; j < dh; ++j) out[j] = st(acc[j] / s);
}

// The tiled attention core for a head size known when compiling (ViT-B and -L: 64, ViT-H: 80):
// a block of 256 threads takes 128 queries of one (image, head), two threads per query, and
// walks the keys in tiles of 32 that it loads once into shared memory (in f32) for all of them.
// Each thread keeps its query and its running output in registers and takes every other key of
// a tile (scores for 16 keys at once, one rescale per tile); at the end the two halves of a
// query merge their running maxima, sums and outputs through shared memory. Same arithmetic
// as `attention` above, in another order: softmax(q·kᵀ/√dh)·v, a NaN spreading as in PyTorch.
#define ATTENTION_QT 128
#define ATTENTION_KT 32

template <int DH>
__device__ inline void attention_tiled(const AttentionArgs& a) {
    // Key and value tiles and each thread's scores while the keys stream by; the second
    // halves' states at the end. (Scores in shared memory, not registers: the key loops stay
    // rolled, which keeps NVRTC's compile time down.)
    constexpr int HALF = ATTENTION_KT / 2;
    constexpr int TILE = 2 * ATTENTION_KT * DH + HALF * 256, MERGE = ATTENTION_QT * (DH + 2);
    alignas(16) __shared__ float sh[TILE > MERGE ? TILE : MERGE];
    float* ks = sh;
    float* vs = sh + ATTENTION_KT * DH;
    float* score = vs + ATTENTION_KT * DH;  // [HALF][256]: conflict-free by thread
    const int tid = threadIdx.x, half = tid / ATTENTION_QT;
    const int h = blockIdx.y % a.heads;
    const long long img = blockIdx.y / a.heads;
    const int q = blockIdx.x * ATTENTION_QT + tid % ATTENTION_QT;
    const bool live = q < a.t;
    const elem* base = a.qkv + img * a.t * 3 * a.d + h * DH;
    const float scale = 1.0f / sqrtf((float)DH);
    float qv[DH], acc[DH];
#pragma unroll
    for (int j = 0; j < DH; ++j) {
        qv[j] = live ? ld(base[(long long)q * 3 * a.d + j]) : 0.0f;
        acc[j] = 0.0f;
    }
    float m = -3.402823466e38f, s = 0.0f;
    for (int k0 = 0; k0 < a.t; k0 += ATTENTION_KT) {
        for (int e = tid; e < ATTENTION_KT * DH; e += 256) {
            const int k = k0 + e / DH, j = e % DH;
            const elem* row = base + (long long)k * 3 * a.d + a.d;
            ks[e] = k < a.t ? ld(row[j]) : 0.0f;
            vs[e] = k < a.t ? ld(row[a.d + j]) : 0.0f;
        }
        __syncthreads();
        const int valid = (a.t - k0 - half + 1) / 2;  // this thread's keys in the tile
        const int n = valid < HALF ? valid : HALF;
        float m2 = m;
#pragma unroll 1
        for (int i = 0; i < n; ++i) {
            const float* kr = ks + (2 * i + half) * DH;
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < DH; ++j) dot += qv[j] * kr[j];
            dot *= scale;
            score[i * 256 + tid] = dot;
            if (dot > m2 || dot != dot) m2 = dot;
        }
        const float corr = expf(m - m2);
        s *= corr;
#pragma unroll
        for (int j = 0; j < DH; ++j) acc[j] *= corr;
#pragma unroll 1
        for (int i = 0; i < n; ++i) {
            const float p = expf(score[i * 256 + tid] - m2);
            const float* vr = vs + (2 * i + half) * DH;
            s += p;
#pragma unroll
            for (int j = 0; j < DH; ++j) acc[j] += p * vr[j];
        }
        m = m2;
        __syncthreads();
    }
    float* mine = sh + (tid % ATTENTION_QT) * (DH + 2);
    if (half == 1) {
        mine[0] = m;
        mine[1] = s;
#pragma unroll
        for (int j = 0; j < DH; ++j) mine[2 + j] = acc[j];
    }
    __syncthreads();
    if (half == 1 || !live) return;
    const float mo = mine[0], mm = (mo > m || mo != mo) ? mo : m;
    const float c0 = expf(m - mm), c1 = expf(mo - mm), sum = s * c0 + mine[1] * c1;
    elem* out = a.y + (img * a.t + q) * a.d + h * DH;
#pragma unroll
    for (int j = 0; j < DH; ++j) out[j] = st((acc[j] * c0 + mine[2 + j] * c1) / sum);
}

// Grid: (query tiles of 128, images × heads).
BLOCK_KERNEL(attention_t32, AttentionArgs) { attention_tiled<32>(a); }
BLOCK_KERNEL(attention_t64, AttentionArgs) { attention_tiled<64>(a); }
BLOCK_KERNEL(attention_t80, AttentionArgs) { attention_tiled<80>(a); }

#include "llm.cuh"

// ---- the memory-bandwidth probe --------------------------------------------------------------

struct StreamArgs {
    const float* a_;
    const float* c;
    float* b;
    int n, triad;
};

// b = a (copy) or b = a + 0.5·c (triad), four values a thread: one 16-byte load of each array
// where all four are in range (so enough bytes are in flight to reach the memory's bandwidth:
// one 4-byte load a thread stopped at about half of an H200's), one at a time in the tail.
// Buffers start 16-byte aligned.
struct alignas(16) Float4 {
    float v[4];
};

KERNEL(stream, StreamArgs) {
    const long long i = linear_index() * 4;
    if (i + 4 <= a.n) {
        const Float4 x = *(const Float4*)(a.a_ + i);
        Float4 y = x;
        if (a.triad) {
            const Float4 z = *(const Float4*)(a.c + i);
            for (int e = 0; e < 4; ++e) y.v[e] = x.v[e] + 0.5f * z.v[e];
        }
        *(Float4*)(a.b + i) = y;
        return;
    }
    for (long long j = i; j < a.n; ++j) a.b[j] = a.triad ? a.a_[j] + 0.5f * a.c[j] : a.a_[j];
}
