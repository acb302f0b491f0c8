// Ring attention (the Distributed page): one pass that merges a partial result into a rank's
// accumulators by log-sum-exp, in place.
//
// ring_merge<T>  one warp per query row. The accumulators hold a contiguous
//                [B, H, S_shard, D] float32 output and a [B, H, S_shard] lse;
//                the partial result covers rows [row_offset, row_offset + rows)
//                of the shard ([B, H, rows, D] of T and [B, H, rows] float32,
//                contiguous). A row whose lse is -inf on both sides keeps 0 and
//                -inf: no NaN from rows that see no key.
#include "common/common.cuh"

namespace cuflash {

template <typename T>
__global__ void ring_merge(float* __restrict__ out_acc, float* __restrict__ lse_acc,
                           const T* __restrict__ out, const float* __restrict__ lse,
                           long long heads_total, int rows, int row_offset, int shard_len,
                           int head_dim) {
    const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= heads_total * rows) return;
    const long long head = warp / rows;
    const int row = static_cast<int>(warp % rows);
    const long long acc_row = head * shard_len + row_offset + row;
    const float old_lse = lse_acc[acc_row];
    const float new_part = lse[warp];
    const float high = fmaxf(old_lse, new_part);
    float keep = 0.f, take = 0.f, merged = neg_inf();
    if (high != neg_inf()) {
        keep = expf(old_lse - high);
        take = expf(new_part - high);
        merged = high + logf(keep + take);
        const float total = keep + take;
        keep /= total;
        take /= total;
    }
    float* acc = out_acc + acc_row * head_dim;
    const T* part = out + warp * head_dim;
    for (int d = lane; d < head_dim; d += 32) acc[d] = keep * acc[d] + take * to_float(part[d]);
    if (lane == 0) lse_acc[acc_row] = merged;
}

}  // namespace cuflash
