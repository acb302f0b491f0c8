// max |x| of each head of a float32 [B, H, S, D] tensor over its first `rows`
// rows (the keys past kv_seq_len are never read, whatever they hold; atomicMax
// on the bits, into zeroed floats [B, H]): the first of a float32-pieces call's
// kernels (cuflash.gpu.launch.forward, common/float16_pieces.cuh). Scales a head
// apiece: a non-finite value reaches no other head's results.
#pragma once
#include "common/params.cuh"

namespace cuflash {

// 32 rows a block (8 a warp, their loads issued together), one atomic a warp.
template <int D>
__global__ void __launch_bounds__(128)
    float16_pieces_abs_max(CUFLASH_PARAMETERS(CUFLASH_PIECES_ABS_MAX_PARAMS, float)) {
    CUFLASH_STRIDES_OF(x);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float m = 0.f;
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        const int row = blockIdx.x * 32 + warp * 8 + r;
        if (row < rows) {
            const float* src = x + offset_of(x_st, blockIdx.z, blockIdx.y, row);
#pragma unroll
            for (int d = lane; d < D; d += 32) m = fmaxf(m, fabsf(src[d]));
        }
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, s));
    if (lane == 0)  // m >= 0: bits order as values; one maximum a head
        atomicMax(abs_max_bits + blockIdx.z * gridDim.y + blockIdx.y, __float_as_uint(m));
}

}  // namespace cuflash
