// The backward's first kernel (every dtype, every head_dim multiple of 8 to
// 256): Delta = rowsum(dO * O) and lse in base 2 (lse log2 e), float32
// [B, H, S_q] each, the lse every dK/dV and dQ kernel takes; and zeros in the
// float32 dQ rows the atomic kernels add into.
#pragma once
#include "common/params.cuh"
#include "common/common.cuh"

namespace cuflash {

// DV: the head dim of dO and O (v's), D's unless v has its own.
template <typename T, int D, int DV = D>
__global__ void __launch_bounds__(128)
    backward_delta(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_DELTA_PARAMS, T)) {
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(out);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * 4 + warp, h = blockIdx.y, b = blockIdx.z;
    if (row >= q_len) return;
    const long long at = (static_cast<long long>(b) * num_heads + h) * q_len + row;
    // dQ's accumulator rows: accum_width floats (a multiple of 8) each, 16-byte
    // aligned; none when accum_width is 0 (the deterministic backward).
    float4* dq_row = reinterpret_cast<float4*>(dq_accum + at * accum_width);
    for (int c = lane; c < accum_width / 4; c += 32) dq_row[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (dq_counters && lane == 0 && row % 64 == 0)  // the ordered dQ's (common.cuh)
        *ordered_dq_counter(dq_accum, gridDim.z, num_heads, q_len, accum_width, b, h, row) = 0;
    const T* dO = dout + offset_of(dout_st, b, h, row);
    const T* O = out + offset_of(out_st, b, h, row);
    float sum = 0.f;
    for (int d = lane; d < DV; d += 32) sum += to_float(dO[d]) * to_float(O[d]);
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
    if (lane == 0) {
        delta[at] = sum;
        // A row that sees no key (lse -inf) gets +inf: P = exp2(s - inf) = 0 for
        // every score, where -inf would give exp2(-inf + inf) = NaN on a score that
        // a modifier masked with -inf.
        lse_log2[at] = lse[at] == neg_inf() ? -neg_inf() : lse[at] * kLog2e;
    }
}

}  // namespace cuflash
