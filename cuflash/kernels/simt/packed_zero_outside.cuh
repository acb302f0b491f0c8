// The rows of a packed output that no sequence covers, zeroed, and -inf in the
// forward's log-sum-exp there (every dtype, every head_dim multiple of 8 to 256).
#pragma once
#include "common/params.cuh"
#include "common/common.cuh"

namespace cuflash {

// Zeros in the rows of a packed [total, H, D] output (contiguous) that no
// sequence covers: those before the first offset and from the last one on
// (with nondecreasing offsets, every other row belongs to a sequence). With
// offsets that keep the rules there are none, and every block returns at once.
// The forward's log-sum-exp rows there (lse, when given) read as rows that see
// no key: the backward reads every row of it, whatever the offsets.
template <typename T, int D>
__global__ void __launch_bounds__(256)
    packed_zero_outside(CUFLASH_PARAMETERS(CUFLASH_ZERO_OUTSIDE_PARAMS, T)) {
    const int first = clamped(offsets[0], 0, total);
    const int last = max(first, clamped(offsets[count], 0, total));
    const long long before = first * row_elements, after = (total - last) * row_elements;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < before + after; i += stride) {
        x[i < before ? i : last * row_elements + (i - before)] = from_float<T>(0.f);
    }
    const long long outside = first + (total - last);
    if (lse == nullptr) return;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < heads * outside; i += stride) {
        const long long h = i / outside, r = i % outside;
        lse[h * total + (r < first ? r : last + (r - first))] = neg_inf();
    }
}

}  // namespace cuflash
