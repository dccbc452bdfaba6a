// The kernels of a language model's step (src/backend/gpu/decoder.rs), included by ops.cuh.
// A step runs `new` tokens of each of `batch` sequences as rows (sequence-major) from position
// `start`; both come from a small device buffer, `step` = {start, new}, so a decode step's
// launches are the same every step and can be recorded once as a graph.

// Token embeddings, plus GPT-2's learned positions (f32) when there are some.
struct EmbedArgs {
    const elem* table;  // (vocabulary, d)
    const float* pos;   // (positions, d), or unused
    const int* tokens;  // rows
    const int* step;
    elem* y;            // (rows, d)
    int rows, d, has_pos;
};

KERNEL(embed_tokens, EmbedArgs) {
    long long i = linear_index();
    if (i >= (long long)a.rows * a.d) return;
    const int r = (int)(i / a.d), j = (int)(i % a.d);
    const elem v = a.table[(long long)a.tokens[r] * a.d + j];
    if (!a.has_pos) {
        a.y[i] = v;
        return;
    }
    const int p = a.step[0] + r % a.step[1];
    a.y[i] = st(ld(v) + a.pos[(long long)p * a.d + j]);
}

// The maximum (a NaN wins, as in PyTorch) or the sum of `v` over the block's 256 threads, in
// every one of them.
__device__ inline float block_reduce(float* red, float v, bool take_max) {
    const int tid = threadIdx.x;
    red[tid] = v;
    for (int step = 128; step > 0; step /= 2) {
        __syncthreads();
        if (tid < step) {
            const float o = red[tid + step], m = red[tid];
            red[tid] = take_max ? ((o > m || o != o) ? o : m) : m + o;
        }
    }
    __syncthreads();
    const float total = red[0];
    __syncthreads();
    return total;
}

// 16 bytes of storage values, the unit `gemv` loads when rows allow (4 f32 or 8 halves).
#define GEMV_VEC (16 / (int)sizeof(elem))
struct alignas(16) ElemPack {
    elem v[GEMV_VEC];
};

struct RmsNormArgs {
    const elem* x;
    const float* w;
    elem* y;
    int rows, d;
    float eps;
};

// x / √(mean(x²) + eps) · w, in f32: a block of 256 threads a row, 16 bytes of the row a thread
// at a time where the row's length allows. A decode step has a row or a few, and 32 threads a
// row walked each of Llama's 4096 values 128 loads deep on one warp (on an H200 the norms were a
// quarter of a Qwen2.5 decode step); 256 threads loading a value at a time still left them a
// tenth of a Llama 3.1 8B step.
BLOCK_KERNEL(rms_norm_rows, RmsNormArgs) {
    __shared__ float red[256];
    const long long r = linear_index() / 256;
    if (r >= a.rows) return;  // the whole block
    const elem* x = a.x + r * a.d;
    elem* y = a.y + r * a.d;
    const bool packed = a.d % GEMV_VEC == 0;
    float part = 0.0f;
    if (packed) {
        for (int j = threadIdx.x; j < a.d / GEMV_VEC; j += 256) {
            const ElemPack v = ((const ElemPack*)x)[j];
#pragma unroll
            for (int e = 0; e < GEMV_VEC; ++e) part += ld(v.v[e]) * ld(v.v[e]);
        }
    } else {
        for (int j = threadIdx.x; j < a.d; j += 256) part += ld(x[j]) * ld(x[j]);
    }
    const float inv = 1.0f / sqrtf(block_reduce(red, part, false) / (float)a.d + a.eps);
    if (packed) {
        for (int j = threadIdx.x; j < a.d / GEMV_VEC; j += 256) {
            const ElemPack v = ((const ElemPack*)x)[j];
            ElemPack o;
#pragma unroll
            for (int e = 0; e < GEMV_VEC; ++e)
                o.v[e] = st(ld(v.v[e]) * inv * a.w[j * GEMV_VEC + e]);
            ((ElemPack*)y)[j] = o;
        }
    } else {
        for (int j = threadIdx.x; j < a.d; j += 256) y[j] = st(ld(x[j]) * inv * a.w[j]);
    }
}

struct RopeArgs {
    elem* x;           // (rows, width): the first `heads` head-sized runs are rotated
    const float* cos;  // (positions, head / 2)
    const float* sin;
    const int* step;
    int rows, width, heads, head;
};

// Rotary position embedding as Hugging Face's rotate_half: value i pairs with i + head/2.
KERNEL(rope, RopeArgs) {
    const int half = a.head / 2;
    long long i = linear_index();
    if (i >= (long long)a.rows * a.heads * half) return;
    const int k = (int)(i % half), h = (int)((i / half) % a.heads);
    const int r = (int)(i / ((long long)half * a.heads));
    const int p = a.step[0] + r % a.step[1];
    elem* v = a.x + (long long)r * a.width + h * a.head;
    const float x1 = ld(v[k]), x2 = ld(v[k + half]);
    const float c = a.cos[(long long)p * half + k], s = a.sin[(long long)p * half + k];
    v[k] = st(x1 * c - x2 * s);
    v[k + half] = st(x2 * c + x1 * s);
}

struct KvStoreArgs {
    const elem* qkv;  // (rows, width): q heads, k heads, v heads
    elem* k;          // (batch, KV heads, context, head)
    elem* v;
    const int* step;
    int rows, width, q_width, kv_heads, head, context;
};

// The step's keys and values into the cache at their positions.
KERNEL(kv_store, KvStoreArgs) {
    long long i = linear_index();
    const int kv_width = a.kv_heads * a.head;
    if (i >= (long long)a.rows * kv_width) return;
    const int r = (int)(i / kv_width), c = (int)(i % kv_width), g = c / a.head, j = c % a.head;
    const int fresh = a.step[1], b = r / fresh, p = a.step[0] + r % fresh;
    const long long at = (((long long)b * a.kv_heads + g) * a.context + p) * a.head + j;
    const elem* row = a.qkv + (long long)r * a.width + a.q_width;
    a.k[at] = row[c];
    a.v[at] = row[kv_width + c];
}

struct CachedAttentionArgs {
    const elem* qkv;  // (rows, width): the queries are the first heads · head values
    const elem* k;    // (batch, KV heads, context, head)
    const elem* v;
    const int* step;
    elem* y;          // (rows, heads · head)
    int rows, width, heads, kv_heads, head, context;
    int window;       // keys a query sees (Mistral's sliding window), or 0 for all
};

// softmax(q·kᵀ/√head)·v over the cached keys up to each query's position (causal; grouped
// query heads share a KV head). One block per (row, head): the keys go by in tiles of 256, a
// thread scoring one key of a tile (its row read 16 bytes at a time where the head's size
// allows), then the tile's weighted values are summed by groups of threads, each thread of a
// group holding `width` dims (16 bytes of a value row where the head allows, else one), each
// group every groups-th key of the tile; the groups meet once at the end. A running maximum and
// sum rescale what came before (online softmax), so no score outlives its tile. On an H200 a
// thread a dim (two groups at Llama's head of 128, each walking half the tile's keys one load
// after another) kept attention a fifth of a Llama 3.1 8B decode step at 144 positions.
BLOCK_KERNEL(cached_attention, CachedAttentionArgs) {
    __shared__ float q[256];
    __shared__ float p[256];
    __shared__ float red[256];
    __shared__ float sums[256 * GEMV_VEC];
    const int tid = threadIdx.x;
    const long long item = linear_index() / 256;
    if (item >= (long long)a.rows * a.heads) return;  // the whole block
    const int r = (int)(item / a.heads), h = (int)(item % a.heads);
    const int fresh = a.step[1], b = r / fresh, pos = a.step[0] + r % fresh;
    const int g = h / (a.heads / a.kv_heads);
    const int first = (a.window > 0 && pos + 1 > a.window) ? pos + 1 - a.window : 0;
    const long long cache = ((long long)b * a.kv_heads + g) * a.context * a.head;
    const elem* kc = a.k + cache;
    const elem* vc = a.v + cache;
    const bool packed = a.head % GEMV_VEC == 0;
    // This thread's group and its dims of the values: units of `width` dims, threads past the
    // last whole group idle.
    const int width = packed ? GEMV_VEC : 1, units = a.head / width;
    const int groups = 256 / units, group = tid / units, unit = tid % units;
    if (tid < a.head) q[tid] = ld(a.qkv[(long long)r * a.width + h * a.head + tid]);
    __syncthreads();
    const float scale = 1.0f / sqrtf((float)a.head), lowest = -3.402823466e38f;
    float m = lowest, s = 0.0f, acc[GEMV_VEC];
#pragma unroll
    for (int e = 0; e < GEMV_VEC; ++e) acc[e] = 0.0f;
    for (int k0 = first; k0 <= pos; k0 += 256) {
        const int key = k0 + tid;
        float score = lowest;
        if (key <= pos) {
            const elem* kr = kc + (long long)key * a.head;
            float dot = 0.0f;
            if (packed) {
                const ElemPack* kp = (const ElemPack*)kr;
                for (int j = 0; j < units; ++j) {
                    const ElemPack w = kp[j];
#pragma unroll
                    for (int e = 0; e < GEMV_VEC; ++e) dot += q[j * GEMV_VEC + e] * ld(w.v[e]);
                }
            } else {
                for (int j = 0; j < a.head; ++j) dot += q[j] * ld(kr[j]);
            }
            score = dot * scale;
        }
        const float tile = block_reduce(red, score, true);
        const float m2 = (tile > m || tile != tile) ? tile : m;
        const float e = key <= pos ? expf(score - m2) : 0.0f;
        p[tid] = e;
        const float corr = expf(m - m2);
        s = s * corr + block_reduce(red, e, false);
        if (group < groups) {
            const int n = min(256, pos + 1 - k0);
            const elem* vt = vc + (long long)k0 * a.head + unit * width;
#pragma unroll
            for (int d = 0; d < GEMV_VEC; ++d) acc[d] *= corr;
            if (packed) {
                for (int i = group; i < n; i += groups) {
                    const ElemPack w = *(const ElemPack*)(vt + (long long)i * a.head);
                    const float pi = p[i];
#pragma unroll
                    for (int d = 0; d < GEMV_VEC; ++d) acc[d] += pi * ld(w.v[d]);
                }
            } else {
                for (int i = group; i < n; i += groups)
                    acc[0] += p[i] * ld(vt[(long long)i * a.head]);
            }
        }
        m = m2;
        __syncthreads();
    }
    // The groups' sums, in group order.
    if (group < groups)
        for (int d = 0; d < width; ++d) sums[group * a.head + unit * width + d] = acc[d];
    __syncthreads();
    if (tid < a.head) {
        float sum = 0.0f;
        for (int i = 0; i < groups; ++i) sum += sums[i * a.head + tid];
        a.y[((long long)r * a.heads + h) * a.head + tid] = st(sum / s);
    }
}

struct GluArgs {
    const elem* x;  // (rows, 2·inner): gate, then up (SwiGLU); (rows, inner) for GELU
    elem* y;        // (rows, inner)
    int rows, inner;
    int tanh_gelu;  // GPT-2's tanh GELU of x alone, instead of silu(gate)·up
};

KERNEL(glu, GluArgs) {
    long long i = linear_index();
    if (i >= (long long)a.rows * a.inner) return;
    if (a.tanh_gelu) {
        const float x = ld(a.x[i]), u = 0.7978845608f * (x + 0.044715f * x * x * x);
        a.y[i] = st(0.5f * x * (1.0f + tanhf(u)));
        return;
    }
    const long long r = i / a.inner, j = i % a.inner;
    const float g = ld(a.x[r * 2 * a.inner + j]), u = ld(a.x[r * 2 * a.inner + a.inner + j]);
    a.y[i] = st(g / (1.0f + expf(-g)) * u);
}

// The most rows `gemv` takes: a decode step of up to 8 sequences.
#define GEMV_ROWS 8

struct GemvArgs {
    const elem* x;      // (rows, k)
    const elem* w;      // (n, k): a linear layer's (out, in) rows
    const float* bias;  // n, or unused
    const elem* res;    // (rows, n), or unused
    elem* y;            // (rows, n)
    int rows, k, n, has_bias, has_res;
};

// y = x·wᵀ (+ bias) (+ res) for a few rows, reading each weight once: 32 threads (a warp) per
// output, 8 outputs a block, walk its weight row side by side, 16 bytes each at a time when the
// row length allows, four such loads issued before the first is used (so enough bytes are in
// flight to stream at the memory's bandwidth: one at a time reached 45% of an H200's; eight, then
// four, made a Qwen2.5-1.5B decode step 1.19x as long there), every row of x at once. The lanes'
// sums meet through warp shuffles where the dialect has them (WS_WARP_SUM), else in shared memory
// (the emulator), in the same order: the same bits either way. Buffers start 16-byte aligned.
BLOCK_KERNEL(gemv, GemvArgs) {
    const int tid = threadIdx.x, lane = tid % 32;
    const long long o = linear_index() / 32;
    const bool live = o < a.n;
    float acc[GEMV_ROWS];
    for (int r = 0; r < GEMV_ROWS; ++r) acc[r] = 0.0f;
    if (live && a.k % GEMV_VEC == 0) {
        const ElemPack* wr = (const ElemPack*)(a.w + o * a.k);
        const ElemPack* x = (const ElemPack*)a.x;
        const int packs = a.k / GEMV_VEC;
        int j = lane;
        for (; j + 96 < packs; j += 128) {
            ElemPack wp[4];
            for (int u = 0; u < 4; ++u) wp[u] = wr[j + 32 * u];
            for (int r = 0; r < GEMV_ROWS; ++r) {
                if (r >= a.rows) break;
                for (int u = 0; u < 4; ++u) {
                    const ElemPack xp = x[(long long)r * packs + j + 32 * u];
#pragma unroll
                    for (int e = 0; e < GEMV_VEC; ++e) acc[r] += ld(wp[u].v[e]) * ld(xp.v[e]);
                }
            }
        }
        for (; j < packs; j += 32) {
            const ElemPack wp = wr[j];
            for (int r = 0; r < GEMV_ROWS; ++r) {
                if (r >= a.rows) break;
                const ElemPack xp = x[(long long)r * packs + j];
#pragma unroll
                for (int e = 0; e < GEMV_VEC; ++e) acc[r] += ld(wp.v[e]) * ld(xp.v[e]);
            }
        }
    } else if (live) {
        const elem* wr = a.w + o * a.k;
        for (int j = lane; j < a.k; j += 32) {
            const float wv = ld(wr[j]);
            for (int r = 0; r < GEMV_ROWS; ++r)
                if (r < a.rows) acc[r] += wv * ld(a.x[(long long)r * a.k + j]);
        }
    }
#if defined(WS_WARP_SUM)
    // A warp's lanes share one output: all of them live or none.
    if (!live) return;
    float v = 0.0f;
    for (int r = 0; r < GEMV_ROWS; ++r) {
        if (r >= a.rows) break;
        const float sum = warp_sum(acc[r]);
        if (lane == r) v = sum;
    }
    if (lane >= a.rows) return;
#else
    __shared__ float red[GEMV_ROWS][256];
    for (int r = 0; r < GEMV_ROWS; ++r) red[r][tid] = acc[r];
    for (int step = 16; step > 0; step /= 2) {
        __syncthreads();
        if (lane < step)
            for (int r = 0; r < GEMV_ROWS; ++r) red[r][tid] += red[r][tid + step];
    }
    __syncthreads();
    if (!live || lane >= a.rows) return;
    float v = red[lane][tid - lane];
#endif
    // Lane r writes row r's output.
    v += a.has_bias ? a.bias[o] : 0.0f;
    const long long at = (long long)lane * a.n + o;
    if (a.has_res) v += ld(a.res[at]);
    a.y[at] = st(v);
}
