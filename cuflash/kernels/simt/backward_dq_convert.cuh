// The atomic dQ's float32 accumulator into the dtype (every dtype, every
// head_dim multiple of 8 to 256).
#pragma once
#include "common/params.cuh"
#include "common/common.cuh"

namespace cuflash {

// dQ in the storage dtype (and layout) from the float32 accumulator of the
// atomic backward: `count` elements of the [B, H, q_len, D] rows, two a
// thread; the accumulator's rows are contiguous, `accum_width` floats each (D,
// or a tile width past D), dQ's at its strides.
template <typename T, int D>
__global__ void __launch_bounds__(256)
    backward_dq_convert(CUFLASH_PARAMETERS(CUFLASH_DQ_CONVERT_PARAMS, T)) {
    CUFLASH_STRIDES_OF(dq);
    const long long i = (static_cast<long long>(blockIdx.x) * 256 + threadIdx.x) * 2;
    if (i < count) {
        const long long row = i / D, head_row = row / q_len;  // head_row = b H + h
        const int col = static_cast<int>(i - row * D), s = static_cast<int>(row - head_row * q_len);
        const int b = static_cast<int>(head_row / num_heads);
        const int h = static_cast<int>(head_row - static_cast<long long>(b) * num_heads);
        const float2 x = *reinterpret_cast<const float2*>(dq_accum + row * accum_width + col);
        T* dst = dq + offset_of(dq_st, b, h, s) + col;
        dst[0] = from_float<T>(x.x);
        dst[1] = from_float<T>(x.y);
    }
}

}  // namespace cuflash
