// The CUDA dialect of our GPU kernels. NVRTC compiles this file at run time for the device's
// compute capability (`workshop dev kernels-check` compiles it without a GPU); the kernels
// themselves are in ../gpu/ops.cuh, shared with HIP.

// IEEE half conversions through PTX, so no CUDA header is needed.
__device__ inline float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ inline unsigned short f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Tensor cores (mma.sync m16n8k16 on FP16 and BF16) from the A100 on; their kernels exist
// only in half-precision builds for compute_80 and later.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#if defined(WS_FP16)
#define WS_MMA_PTX "f16"
#elif defined(WS_BF16)
#define WS_MMA_PTX "bf16"
#endif
#endif

// The sum of v over a warp's 32 lanes, in every lane (a butterfly: the shared-memory tree's
// additions, pair for pair).
#define WS_WARP_SUM 1
__device__ inline float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset /= 2) {
        float other;
        asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;"
                     : "=f"(other)
                     : "f"(v), "r"(offset));
        v += other;
    }
    return v;
}

#define KERNEL(name, Args) extern "C" __global__ void name(const Args a)
#define BLOCK_KERNEL(name, Args) extern "C" __global__ void __launch_bounds__(256) name(const Args a)

#include "../gpu/ops.cuh"
