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

#define KERNEL(name, Args) extern "C" __global__ void name(const Args a)
#define BLOCK_KERNEL(name, Args) extern "C" __global__ void __launch_bounds__(256) name(const Args a)

#include "../gpu/ops.cuh"
