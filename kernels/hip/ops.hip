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

#define KERNEL(name, Args) extern "C" __global__ void name(const Args a)
#define BLOCK_KERNEL(name, Args) extern "C" __global__ void __launch_bounds__(256) name(const Args a)

#include "../gpu/ops.cuh"
