// x * scale -> hi, lo float16 [B, H, S, D] (contiguous, the same first rows as
// float16_pieces_abs_max's), scale = 2^(14 - e) for the head's max |x| in
// [2^(e - 1), 2^e), so the pieces stay in float16's normal range; the scales
// [B, H] are written for the kernel that reads the pieces
// (common/float16_pieces.cuh).
#pragma once
#include "common/params.cuh"
#include "common/float16_pieces.cuh"

namespace cuflash {

// One warp a row, 4 rows a block; pieces written [B, H, seq_len, D] contiguous
// (the kernels that read them fill their tiles' padding columns with zeros),
// rows [0, rows) of each head.
template <int D>
__global__ void __launch_bounds__(128)
    float16_pieces_split(CUFLASH_PARAMETERS(CUFLASH_PIECES_SPLIT_PARAMS, float)) {
    CUFLASH_STRIDES_OF(x);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * 4 + warp, h = blockIdx.y, b = blockIdx.z;
    const float scale = pow2_scale(abs_max[b * num_heads + h]);  // a head's own
    if (blockIdx.x == 0 && threadIdx.x == 0) scale_out[b * num_heads + h] = scale;
    if (row >= rows) return;
    const float* src = x + offset_of(x_st, b, h, row);
    const long long at = ((static_cast<long long>(b) * num_heads + h) * seq_len + row) * D;
#pragma unroll
    for (int d = 2 * lane; d < D; d += 64) {
        unsigned pair_hi, pair_lo;
        split_pack(src[d] * scale, src[d + 1] * scale, pair_hi, pair_lo);
        *reinterpret_cast<unsigned*>(hi + at + d) = pair_hi;
        *reinterpret_cast<unsigned*>(lo + at + d) = pair_lo;
    }
}

}  // namespace cuflash
