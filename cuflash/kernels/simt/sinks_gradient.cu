// The attention sinks' gradient (the semantics page, "Attention sinks"), one block a head:
//
//   dsinks[h] = -sum over (o, i) of exp(sinks[h] - lse[o, h, i]) Delta[o, h, i]
//
// lse and Delta contiguous float32 [outer, H, inner]; a row whose lse is -inf (a -inf
// sink and no key) adds nothing, NaN propagates. Each thread sums its rows in a fixed
// order and the block's tree is fixed: the same bits on every run.
#include "common/common.cuh"

namespace cuflash {

constexpr int kSinksThreads = 512;

__global__ void __launch_bounds__(kSinksThreads)
    sinks_gradient(const float* __restrict__ sinks, const float* __restrict__ lse,
                   const float* __restrict__ delta, float* __restrict__ dsinks, int outer,
                   int heads, int inner) {
    __shared__ float partial[kSinksThreads];
    const int h = blockIdx.x;
    const float sink = sinks[h];
    float sum = 0.f;
    for (int o = 0; o < outer; ++o) {
        const long long base = (static_cast<long long>(o) * heads + h) * inner;
#pragma unroll 4
        for (int i = threadIdx.x; i < inner; i += kSinksThreads) {
            const float row_lse = lse[base + i];
            if (row_lse != neg_inf()) sum = fmaf(expf(sink - row_lse), delta[base + i], sum);
        }
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
#pragma unroll
    for (int width = kSinksThreads / 2; width > 0; width >>= 1) {
        if (threadIdx.x < width) partial[threadIdx.x] += partial[threadIdx.x + width];
        __syncthreads();
    }
    if (threadIdx.x == 0) dsinks[h] = -partial[0];
}

}  // namespace cuflash
