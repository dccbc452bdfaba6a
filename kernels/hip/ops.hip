// The HIP dialect of our GPU kernels. hiprtc compiles this file at run time for the device's gfx
// target (`workshop dev kernels-check` compiles it for gfx90a, gfx908 and gfx1030 without a
// GPU); the kernels themselves are in ../gpu/ops.cuh, shared with CUDA.

// IEEE half conversions through clang's _Float16, so no HIP header is needed.
__device__ inline float f16_to_f32(unsigned short h) {
    return (float)__builtin_bit_cast(_Float16, h);
}

__device__ inline unsigned short f32_to_f16(float f) {
    return __builtin_bit_cast(unsigned short, (_Float16)f);
}

// Matrix cores (MFMA 16×16×16 on FP16 and BF16, per wavefront of 64) on CDNA 2 and later; the
// matrix kernels exist only in half-precision builds for these targets.
#if (defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || \
     defined(__gfx950__)) && (defined(WS_FP16) || defined(WS_BF16))
#define WS_MFMA 1
#endif

#define KERNEL(name, Args) extern "C" __global__ void name(const Args a)
#define BLOCK_KERNEL(name, Args) extern "C" __global__ void __launch_bounds__(256) name(const Args a)

#include "../gpu/ops.cuh"
