// kvcache_decode (the KV-cache page): one block per (split of the keys, tile of
// packed query rows, KV head, sequence): the query rows of all query heads that
// share the KV head (times S_q) are packed into one tile, so each K/V tile is
// read once for all of them. K and V tiles move into shared memory with 16-byte
// cp.async (double buffered), scores and P V run on CUDA cores in float32, the
// softmax is online. With one split the block writes the output; with several
// it writes a partial (out, lse) in float32 that kvcache_combine merges.
#include "decode/decode_common.cuh"

namespace cuflash {

// The dynamic shared memory of kvcache_decode<T, D, RM>, for the host's figure.
template <typename T, int D, int RM>
constexpr int kvcache_decode_shared_bytes = DecodeShape<T, D, RM>::SMEM;

// Grid (num_splits * row_tiles, H_kv, B); block x = split * row_tiles + row tile.
// Packed row m of a KV head is query row i = m / group of query head
// hk * group + m % group; a tile holds RM packed rows.
template <typename T, int D, int RM>
__global__ void __launch_bounds__(kDecodeThreads, 1)
    kvcache_decode(CUFLASH_PARAMETERS(CUFLASH_DECODE_PARAMS, T, T, T)) {
    using Shape = DecodeShape<T, D, RM>;
    constexpr int ELEMS = Shape::ELEMS, CH = Shape::CH, BN = Shape::BN, DSUB = Shape::DSUB;
    constexpr int PITCH = Shape::PITCH, KSUB = Shape::KSUB;
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* kv_tiles = reinterpret_cast<uint4*>(smem);  // [stage][K, V][BN][PITCH] chunks
    float* reduce_s = reinterpret_cast<float*>(smem);  // [KSUB][RM][D], then [KSUB][RM] sums
    float* q_s = reinterpret_cast<float*>(smem + Shape::REGION);  // [RM][D], scaled
    float* p_s = q_s + RM * D;                                    // [BN][RM]
    float* max_s = p_s + BN * RM;                                 // [warp][RM]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        unsigned dynamic_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
        if (dynamic_bytes < static_cast<unsigned>(Shape::SMEM)) __trap();
    }

    const int hk = blockIdx.y, b = blockIdx.z;
    const int split = blockIdx.x / row_tiles, row0 = (blockIdx.x % row_tiles) * RM;
    const int rows_total = q_len * group;
    const int kv_len = cached_length(seqlens, seqlen_value, b, new_len, capacity) + new_len;
    const Mask mask{q_len, kv_len, win_left, win_right};
    const CacheRows rows = cache_rows(block_table, b, max_blocks, block_size, num_blocks);

    // Each row's visible keys [lo, hi); the block's range; the keys all rows see.
    int key_lo[RM], key_hi[RM];
    int range_lo = kv_len, range_hi = 0, full_lo = 0, full_hi = kv_len;
#pragma unroll
    for (int r = 0; r < RM; ++r) {
        const int m = row0 + r;
        key_lo[r] = key_hi[r] = 0;
        if (m < rows_total) {
            mask.row_keys(m / group, key_lo[r], key_hi[r]);
            if (key_hi[r] > key_lo[r]) {
                range_lo = min(range_lo, key_lo[r]);
                range_hi = max(range_hi, key_hi[r]);
            }
            full_lo = max(full_lo, key_lo[r]);
            full_hi = min(full_hi, key_hi[r]);
        }
    }
    const int tiles = range_hi > range_lo ? (range_hi - range_lo + BN - 1) / BN : 0;
    const int per_split = (tiles + num_splits - 1) / num_splits;
    const int tile_begin = min(tiles, split * per_split);
    const int tile_end = min(tiles, tile_begin + per_split);

    const T* k_head = k_cache + hk * k_sh;
    const T* v_head = v_cache + hk * v_sh;
    // The tiles load in order, tile_begin first.
    TileSource<T, BN, CH, kDecodeThreads, BN, true> source;
    source.thread = tid;
    source.start(k_head, v_head, rows, range_lo + tile_begin * BN, k_sb, k_ss, v_sb, v_ss);
    auto load_tile = [&](int stage, int tile) {
        uint4* k_dst = kv_tiles + (2 * stage) * Shape::TILE_CHUNKS;
        source.read(rows, range_lo + tile * BN, range_hi);
        load_kv_tile<T, BN, CH, PITCH, kDecodeThreads, BN, true>(
            k_dst, k_dst + Shape::TILE_CHUNKS, k_head, v_head, rows, source, range_lo + tile * BN,
            range_hi, k_sb, k_ss, v_sb, v_ss, aligned != 0);
    };
    if (tile_begin < tile_end) load_tile(0, tile_begin);  // in flight while Q loads

    // Q rows into shared memory as float32, times scale * log2(e); zeros past the rows.
    for (int idx = tid; idx < RM * D; idx += kDecodeThreads) {
        const int r = idx / D, d = idx - (idx / D) * D, m = row0 + r;
        float x = 0.f;
        if (m < rows_total) {
            const int i = m / group, h = hk * group + (m - i * group);
            x = to_float(q[b * q_sb + h * q_sh + i * q_ss + d]) * scale_log2;
        }
        q_s[idx] = x;
    }

    float row_max[RM], acc[RM][ELEMS], row_sum[RM];
#pragma unroll
    for (int r = 0; r < RM; ++r) {
        row_max[r] = neg_inf();
        row_sum[r] = 0.f;
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) acc[r][e] = 0.f;
    }
    const int score_key = tid / DSUB, dsub = tid % DSUB;
    const int pv_sub = tid / CH, pv_chunk = tid % CH;
    const bool pv_active = pv_sub < KSUB;

    for (int tile = tile_begin; tile < tile_end; ++tile) {
        const int stage = (tile - tile_begin) & 1;
        if (tile + 1 < tile_end) {
            load_tile(stage ^ 1, tile + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint4* k_tile = kv_tiles + (2 * stage) * Shape::TILE_CHUNKS;
        const uint4* v_tile = k_tile + Shape::TILE_CHUNKS;
        const int key0 = range_lo + tile * BN;

        // Scores of key score_key for every row: DSUB lanes split the chunks.
        float s[RM];
#pragma unroll
        for (int r = 0; r < RM; ++r) s[r] = 0.f;
        const uint4* k_row = k_tile + score_key * PITCH;
#pragma unroll 2
        for (int c = dsub; c < CH; c += DSUB) {
            float kf[ELEMS];
            unpack<T>(k_row[c], kf);
#pragma unroll
            for (int r = 0; r < RM; ++r) {
                const float4* qr = reinterpret_cast<const float4*>(q_s + r * D + c * ELEMS);
#pragma unroll
                for (int e4 = 0; e4 < ELEMS / 4; ++e4) {
                    const float4 qv = qr[e4];
                    s[r] += qv.x * kf[4 * e4] + qv.y * kf[4 * e4 + 1] + qv.z * kf[4 * e4 + 2] +
                            qv.w * kf[4 * e4 + 3];
                }
            }
        }
#pragma unroll
        for (int r = 0; r < RM; ++r) {
#pragma unroll
            for (int o = DSUB / 2; o > 0; o >>= 1) s[r] += __shfl_xor_sync(0xffffffffu, s[r], o);
        }
        const int j = key0 + score_key;
        const bool edge = !(key0 >= full_lo && key0 + BN <= full_hi);
        if (decode_modifies(alibi_slopes, softcap_log2)) {
#pragma unroll
            for (int r = 0; r < RM; ++r)
                if (row0 + r < rows_total)
                    s[r] = decode_modified_score<T>(s[r], row0 + r, j, group, hk, b, mask,
                                                    alibi_slopes, alibi_batch_stride, softcap_log2,
                                                    user_args);
        }
        float tile_max[RM];
#pragma unroll
        for (int r = 0; r < RM; ++r) {
            if ((edge && (j < key_lo[r] || j >= key_hi[r])) ||
                (row0 + r < rows_total && !decode_sees(row0 + r, j, group, hk, b, mask, user_args)))
                s[r] = neg_inf();
            float x = s[r];
#pragma unroll
            for (int o = 16; o >= DSUB; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
            tile_max[r] = x;
        }
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < RM; ++r) max_s[warp * RM + r] = tile_max[r];
        }
        __syncthreads();
        float alpha[RM];
#pragma unroll
        for (int r = 0; r < RM; ++r) {
            float x = row_max[r];
#pragma unroll
            for (int w = 0; w < kDecodeWarps; ++w) x = fmaxf(x, max_s[w * RM + r]);
            const float base = x == neg_inf() ? 0.f : x;
            alpha[r] = fast_exp2(row_max[r] - base);
            row_max[r] = x;
            s[r] = fast_exp2(s[r] - base);
        }
        if (dsub == 0) {
#pragma unroll
            for (int r = 0; r < RM; ++r) p_s[score_key * RM + r] = s[r];
        }
        __syncthreads();

        // acc[r][:] = alpha acc + sum over this thread's keys of p V[key, chunk].
        if (pv_active) {
#pragma unroll
            for (int r = 0; r < RM; ++r) {
                row_sum[r] *= alpha[r];
#pragma unroll
                for (int e = 0; e < ELEMS; ++e) acc[r][e] *= alpha[r];
            }
            for (int n = pv_sub; n < BN; n += KSUB) {
                float vf[ELEMS];
                unpack<T>(v_tile[n * PITCH + pv_chunk], vf);
                float p[RM];
                if constexpr (RM % 4 == 0) {
#pragma unroll
                    for (int r4 = 0; r4 < RM / 4; ++r4) {
                        const float4 pv = reinterpret_cast<const float4*>(p_s + n * RM)[r4];
                        p[4 * r4] = pv.x;
                        p[4 * r4 + 1] = pv.y;
                        p[4 * r4 + 2] = pv.z;
                        p[4 * r4 + 3] = pv.w;
                    }
                } else {
#pragma unroll
                    for (int r = 0; r < RM; ++r) p[r] = p_s[n * RM + r];
                }
#pragma unroll
                for (int r = 0; r < RM; ++r) {
                    row_sum[r] += p[r];
#pragma unroll
                    for (int e = 0; e < ELEMS; ++e) acc[r][e] += p[r] * vf[e];
                }
            }
        }
        __syncthreads();
    }

    // Sum the KSUB partial accumulators (all in the same scale: the row maxima
    // are the same in every thread) and write the rows.
    cp_async_wait<0>();
    __syncthreads();
    float* sums_s = reduce_s + KSUB * RM * D;
    if (pv_active) {
#pragma unroll
        for (int r = 0; r < RM; ++r) {
#pragma unroll
            for (int e = 0; e < ELEMS; ++e)
                reduce_s[(pv_sub * RM + r) * D + pv_chunk * ELEMS + e] = acc[r][e];
            if (pv_chunk == 0) sums_s[pv_sub * RM + r] = row_sum[r];
        }
    }
    __syncthreads();
    for (int idx = tid; idx < RM * D; idx += kDecodeThreads) {
        const int r = idx / D, d = idx - (idx / D) * D, m = row0 + r;
        if (m >= rows_total) continue;
        float o = 0.f, l = 0.f;
        for (int k = 0; k < KSUB; ++k) {
            o += reduce_s[(k * RM + r) * D + d];
            l += sums_s[k * RM + r];
        }
        float rmax = neg_inf();
#pragma unroll
        for (int rr = 0; rr < RM; ++rr) rmax = rr == r ? row_max[rr] : rmax;
        const int i = m / group, h = hk * group + (m - i * group);
        // Attention sinks enter once a row: here unsplit, else in kvcache_combine.
        if (sinks != nullptr && num_splits == 1) o *= add_sink(sink_log2(sinks, h), rmax, l);
        const bool seen = l != 0.f;  // a NaN sum counts as seen: NaN is never hidden
        const float value = seen ? o / l : 0.f;
        const float row_lse2 = seen ? rmax + log2f(l) : neg_inf();
        const long long row = (static_cast<long long>(b) * num_heads + h) * q_len + i;
        if (num_splits == 1) {
            out[row * D + d] = from_float<T>(value);
            if (d == 0) lse[row] = row_lse2 * kLn2;
        } else {
            const long long part = row * num_splits + split;
            part_out[part * D + d] = value;
            if (d == 0) part_lse[part] = row_lse2;
        }
    }
}

}  // namespace cuflash
