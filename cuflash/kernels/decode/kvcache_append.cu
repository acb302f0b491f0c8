// kvcache_append (the KV-cache page): writes k_new / v_new into the cache at each
// sequence's length, and applies the rotary embedding to k_new and q if asked.
#include "decode/decode_common.cuh"

namespace cuflash {

// Element d of row x after the rotary embedding at table row `row` (see the KV-cache
// page): the first rotary_dim dimensions rotate in pairs (d, d + rotary_dim / 2), or
// (2r, 2r + 1) when interleaved; x1' = x1 cos - x2 sin, x2' = x1 sin + x2 cos in float32
// with each product rounded before the sum (no FMA: the CPU path's arithmetic). The
// tables [S_rot, rotary_dim / 2] hold T (tables_in_t) or float.
template <typename T>
__device__ __forceinline__ float rotary_element(const T* __restrict__ x, int d, int rotary_dim,
                                                bool interleaved,
                                                const void* __restrict__ cos_table,
                                                const void* __restrict__ sin_table,
                                                bool tables_in_t, int row) {
    const float self = to_float(x[d]);
    if (d >= rotary_dim) return self;
    const int half = rotary_dim >> 1;
    const bool first = interleaved ? (d & 1) == 0 : d < half;
    const int pair = interleaved ? d >> 1 : (first ? d : d - half);
    const int partner = interleaved ? d ^ 1 : (first ? d + half : d - half);
    const long long at = static_cast<long long>(row) * half + pair;
    const float c = tables_in_t ? to_float(static_cast<const T*>(cos_table)[at])
                                : static_cast<const float*>(cos_table)[at];
    const float s = tables_in_t ? to_float(static_cast<const T*>(sin_table)[at])
                                : static_cast<const float*>(sin_table)[at];
    const float other = to_float(x[partner]);
    return first ? __fsub_rn(__fmul_rn(self, c), __fmul_rn(other, s))
                 : __fadd_rn(__fmul_rn(other, s), __fmul_rn(self, c));
}

// k_new [B, H_kv, S_new, D] / v_new [.., D_v] into the cache at rows cached_length(b) ..
// One thread an element of the wider row; grid (key blocks + query blocks, H_kv, B): the
// first ceil(S_new * max(D, D_v) / 128) blocks of x append (k first, then v: where
// v_cache is k_cache's first D_v columns, absorbed MLA's latent, v_new's values win), k_new's rows rotated at their positions
// with rotary_dim > 0. With rotary_dim > 0 the next ceil(group * S_q * D / 128) rotate
// the query rows of the KV head's query heads at their positions p = i + L_b - S_q
// into q_rotated [B, H, S_q, D] (contiguous), which the attention kernels then read.
// Positions are clamped to the tables' rows [0, rotary_rows) (device-held lengths
// are never trusted; host-held ones were checked). With key_counts (not null), each
// sequence's keys after the append, cached_length + S_new, go there too (the dense
// forward's per-sequence key counts for a chunk of queries).
template <typename T>
__global__ void __launch_bounds__(kDecodeThreads)
    kvcache_append(CUFLASH_PARAMETERS(CUFLASH_KVCACHE_APPEND_PARAMS, T)) {
    const int hk = blockIdx.y, b = blockIdx.z;
    const int width = max(head_dim, head_dim_v);
    const long long key_elements = static_cast<long long>(new_len) * width;
    const int key_blocks = static_cast<int>((key_elements + kDecodeThreads - 1) / kDecodeThreads);
    const int length = cached_length(seqlens, seqlen_value, b, new_len, capacity);
    // An FP8 (e4m3) cache takes no rotary embedding (refused on the host): a copy.
    constexpr bool ROTATES = sizeof(T) > 1;
    if (static_cast<int>(blockIdx.x) >= key_blocks) {  // the query rows' rotation
        if (!ROTATES || rotary_dim == 0) return;
        const long long idx =
            static_cast<long long>(blockIdx.x - key_blocks) * kDecodeThreads + threadIdx.x;
        if (idx >= static_cast<long long>(group) * q_len * head_dim) return;
        const int d = static_cast<int>(idx % head_dim);
        const long long row = idx / head_dim;  // (head in the group, query row)
        const int i = static_cast<int>(row % q_len);
        const int h = hk * group + static_cast<int>(row / q_len);
        const int p = min(max(length + new_len - q_len + i, 0), rotary_rows - 1);
        const T* x = q + b * q_sb + h * q_sh + i * q_ss;
        const long long out = ((static_cast<long long>(b) * gridDim.y * group + h) * q_len + i);
        if constexpr (ROTATES)
            q_rotated[out * head_dim + d] = from_float<T>(rotary_element(
                x, d, rotary_dim, interleaved != 0, rotary_cos, rotary_sin, tables_in_t != 0, p));
        return;
    }
    const long long idx = static_cast<long long>(blockIdx.x) * kDecodeThreads + threadIdx.x;
    if (idx >= key_elements) return;
    const int t = static_cast<int>(idx / width), d = static_cast<int>(idx % width);
    const int pos = length + t;
    if (key_counts != nullptr && idx == 0 && hk == 0) key_counts[b] = pos + new_len;
    const CacheRows rows = cache_rows(block_table, b, max_blocks, block_size, num_blocks);
    long long k_off, v_off;
    rows.offsets(pos, k_sb, k_ss, v_sb, v_ss, k_off, v_off);
    const T* k_row = k_new + b * kn_sb + hk * kn_sh + t * kn_ss;
    if (d < head_dim) {
        T x = k_row[d];
        if constexpr (ROTATES) {
            if (rotary_dim > 0)
                x = from_float<T>(rotary_element(k_row, d, rotary_dim, interleaved != 0, rotary_cos,
                                                 rotary_sin, tables_in_t != 0,
                                                 min(pos, rotary_rows - 1)));
        }
        k_cache[k_off + hk * k_sh + d] = x;
    }
    if (d < head_dim_v)
        v_cache[v_off + hk * v_sh + d] = v_new[b * vn_sb + hk * vn_sh + t * vn_ss + d];
}

}  // namespace cuflash
