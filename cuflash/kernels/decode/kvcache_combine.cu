// kvcache_combine (the KV-cache page): merges the split-KV kernels' partial
// (out, lse) rows by log-sum-exp, in a fixed order (the same bits on every run).
#include "decode/decode_common.cuh"

namespace cuflash {

// Merge the num_splits (at most kMaxSplits) partials of each output row by
// log-sum-exp, in a fixed order (the same bits on every run). One block a row: a
// thread a split's weight, then a thread a column, its partials' loads in flight
// together. Grid (rows). Attention sinks (`sinks` not null; row = (b H + h) S_q
// + i) join as one more partial whose output is zero.
constexpr int kMaxSplits = kDecodeThreads;  // cuflash/gpu/decode_kernels.py's MAX_SPLITS

template <typename T, int D>
__global__ void __launch_bounds__(kDecodeThreads, 4)
    kvcache_combine(CUFLASH_PARAMETERS(CUFLASH_KVCACHE_COMBINE_PARAMS, T)) {
    __shared__ float weight_s[kMaxSplits];
    __shared__ float warp_max_s[kDecodeWarps], warp_sum_s[kDecodeWarps];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const int splits = min(num_splits, kMaxSplits);
    const float split_lse = tid < splits ? part_lse[row * num_splits + tid] : neg_inf();
    const float sink2 =
        sinks == nullptr ? neg_inf() : sink_log2(sinks, static_cast<int>(row / q_len % num_heads));
    float top = fmaxf(split_lse, sink2);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    if (lane == 0) warp_max_s[warp] = top;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) top = fmaxf(top, warp_max_s[w]);
    const float base = top == neg_inf() ? 0.f : top;
    const float weight = tid < splits ? fast_exp2(split_lse - base) : 0.f;
    weight_s[tid] = weight;
    float total = weight;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    if (lane == 0) warp_sum_s[warp] = total;
    __syncthreads();
    total = sinks == nullptr ? 0.f : fast_exp2(sink2 - base);
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) total += warp_sum_s[w];
    const bool seen = total != 0.f;  // a NaN total counts as seen: NaN is never hidden
    // total is in [1, splits + 1] where seen (the top split or the sink weighs 1): the
    // fast reciprocal is within 2 ulp there, and a division routine's call would spill
    const float inv = seen ? __fdividef(1.f, total) : 0.f;
    if (tid == 0) lse[row] = seen ? (base + log2f(total)) * kLn2 : neg_inf();
    constexpr int BATCH = 8;  // partials in flight at once
#pragma unroll
    for (int pass = 0; pass < (D + kDecodeThreads - 1) / kDecodeThreads; ++pass) {
        const int d = tid + pass * kDecodeThreads;
        if (d >= D) break;
        const float* column = part_out + row * num_splits * D + d;
        float o = 0.f;
        int s = 0;
        for (; s + BATCH <= splits; s += BATCH) {
            float x[BATCH];
#pragma unroll
            for (int k = 0; k < BATCH; ++k) x[k] = column[(s + k) * D];
#pragma unroll
            for (int k = 0; k < BATCH; ++k) o += weight_s[s + k] * x[k];
        }
        for (; s < splits; ++s) o += weight_s[s] * column[s * D];
        out[row * D + d] = from_float<T>(o * inv);
    }
}

}  // namespace cuflash
