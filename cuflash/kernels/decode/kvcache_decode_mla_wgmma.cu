// kvcache_decode_mla_wgmma (the KV-cache page, "Absorbed MLA"): kvcache_decode_mla's
// grid, arguments and partial outputs for absorbed MLA on Hopper's wgmma (sm_90a), where a
// KV head has many query heads: the latent view (v_cache = k_cache[..., :DV]), each
// key row read once a block of 64 packed query rows (the query heads of the KV head,
// then the query rows), wgmma's M.
//
// Two warpgroups; Q and two stages of BN keys in shared memory in wgmma's
// 128-byte-swizzled layout (common/wgmma.cuh), filled with cp.async by every thread: four
// threads a key row, one block id each a tile (clamped, read a tile ahead). Per tile:
//   warpgroup 0: S = Q K^T (wgmma m64nBNk16 over DK, both operands from shared
//                memory), the online softmax, P into shared memory in the input type
//                and each row's rescale factor beside it;
//   both:        O[:, DV/2 w : DV/2 (w + 1)] += P V (m64n(DV/2)k16, A = P and B = the
//                latent's first DV columns from shared memory, B N-major): the 512
//                columns of a row would take 256 accumulators a thread in one group.
// Warpgroup 0 keeps the row maxima and sums; the epilogue shares them.
#include "decode/decode_common.cuh"
#include "common/wgmma.cuh"

namespace cuflash {

// The shared memory of kvcache_decode_mla_wgmma<T, DK, DV, BN, PAGED> from a 1024-byte
// aligned base (cuflash/gpu/decode_tiles.py's decode_mla_wgmma_shape mirrors it;
// tests/test_shared_layout.py holds the two together): Q, two stages of keys, P, then
// three float rows (each row's rescale factor of the tile, sum and maximum).
template <int DK, int DV, int BN>
struct DecodeMlaWgmmaShared {
    static constexpr int ROWS = 64;  // packed query rows a block: wgmma's M
    static constexpr int THREADS = 256;
    static constexpr int E = 2;  // float16 / bfloat16
    static constexpr int q = 0;
    static constexpr int k = q + ROWS * DK * E;
    static constexpr int p = k + 2 * BN * DK * E;
    static constexpr int stats = p + ROWS * BN * E;
    static constexpr int bytes = kSharedAlignSlack + stats + 3 * ROWS * 4;
    static_assert(DK % 64 == 0 && DV % 128 == 0 && DV <= DK && BN == 64,
                  "column blocks of 64; the values are the keys' first DV columns; one "
                  "column block of P");
};

template <typename T, int DK, int DV, int BN, bool PAGED>
constexpr int kvcache_decode_mla_wgmma_shared_bytes = DecodeMlaWgmmaShared<DK, DV, BN>::bytes;

template <typename T, int DK, int DV, int BN, bool PAGED>
__global__ void __launch_bounds__(256, 1)
    kvcache_decode_mla_wgmma(CUFLASH_PARAMETERS(CUFLASH_DECODE_PARAMS, T, T, T)) {
    using Shared = DecodeMlaWgmmaShared<DK, DV, BN>;
    using Op = TensorOp<T>;
    constexpr int ROWS = Shared::ROWS, NT = Shared::THREADS, NTILES = BN / 8;
    constexpr int KSTEPS = DK / 16, HALF = DV / 2, OT = HALF / 8, CH = DK / 8;
    constexpr unsigned ATOM = 1024;  // bytes of 8 swizzled rows: the stride between row groups
    static_assert(sizeof(T) == Shared::E, "16-bit inputs");
    extern __shared__ float4 smem4[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    if (tid == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        unsigned dynamic_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
        if (dynamic_bytes < static_cast<unsigned>(Shared::bytes)) __trap();
    }
    T* base = reinterpret_cast<T*>((reinterpret_cast<unsigned long long>(smem4) + 1023) & ~1023ull);
    T* q_s = CUFLASH_SHARED_REGION(T, base, Shared::q);
    T* k_s = CUFLASH_SHARED_REGION(T, base, Shared::k);  // two stages of BN x DK
    T* p_s = CUFLASH_SHARED_REGION(T, base, Shared::p);
    float* scale_s = CUFLASH_SHARED_REGION(float, base, Shared::stats);
    float* sum_s = scale_s + ROWS;
    float* max_s = sum_s + ROWS;

    const int wg = warp >> 2, warp_row = (warp & 3) * 16;
    const int hk = blockIdx.y, b = blockIdx.z;
    const int split = blockIdx.x / row_tiles, row0 = (blockIdx.x % row_tiles) * ROWS;
    const int rows_total = q_len * group;
    const int kv_len = cached_length(seqlens, seqlen_value, b, new_len, capacity) + new_len;
    const Mask mask{q_len, kv_len, win_left, win_right};
    const CacheRows rows = cache_rows(block_table, b, max_blocks, block_size, num_blocks);

    // The block's key range (rows are sorted by query index), this thread's two rows
    // of the tile (g and g + 8 of its warp's 16) and their keys.
    const int last_row = min(row0 + ROWS, rows_total) - 1;
    int range_lo, range_hi;
    mask.key_range(row0 / group, last_row / group + 1, range_lo, range_hi);
    const int tile_row[2] = {warp_row + g, warp_row + g + 8};
    const int my_row[2] = {row0 + tile_row[0], row0 + tile_row[1]};
    const bool modified = decode_modifies(alibi_slopes, softcap_log2);
    const RowKeys keys(mask, my_row, rows_total, group);
    const SplitTiles mine = split_tiles<BN>(range_lo, range_hi, num_splits, split);
    const int first = mine.first, count = mine.count;

    // This thread copies chunks copy_c0 + 4 j of key row copy_row of each tile: one
    // block a tile (`page`, of key range_hi - 1 past the keys, which become zeros).
    static_assert(BN * 4 == NT && CH % 4 == 0, "four threads a key row");
    const T* k_head = k_cache + hk * k_sh;
    const int copy_row = tid >> 2, copy_c0 = tid & 3;
    int page = 0;
    auto read_page = [&](int step) {
        page = rows.page(min(range_lo + (first + step) * BN + copy_row, range_hi - 1));
    };
    auto load_tile = [&](int stage, int step) {
        uint4* dst = reinterpret_cast<uint4*>(k_s + stage * BN * DK);
        const int key = range_lo + (first + step) * BN + copy_row;
        const bool valid = key < range_hi;
        const T* src = k_head + page * k_sb + rows.row(min(key, range_hi - 1)) * k_ss + copy_c0 * 8;
        if (aligned) {
#pragma unroll
            for (int j = 0; j < CH / 4; ++j)
                cp_async_16_stream(dst + sw128_chunk<BN>(copy_row, copy_c0 + 4 * j),
                                   valid ? src + 32 * j : k_head, valid);
        } else {  // rows off the 16-byte grid: element by element
            for (int j = 0; j < CH / 4; ++j) {
                T* d = reinterpret_cast<T*>(dst + sw128_chunk<BN>(copy_row, copy_c0 + 4 * j));
#pragma unroll
                for (int e = 0; e < 8; ++e) d[e] = valid ? src[32 * j + e] : T{};
            }
        }
        cp_async_commit();
        if (step + 1 < count) read_page(step + 1);
    };
    if (count > 0) {
        read_page(0);
        load_tile(0, 0);
    } else {
        cp_async_commit();
    }

    // Q's rows in the swizzled layout, element by element (q's rows need not be 16-byte
    // aligned; read once a block); zeros past the rows.
    for (int idx = tid; idx < ROWS * CH; idx += NT) {
        const int r = idx / CH, c = idx - r * CH, m = row0 + r;
        T x[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = T{};
        if (m < rows_total) {
            const int i = m / group, h = hk * group + (m - i * group);
            const T* src = q + b * q_sb + h * q_sh + i * q_ss + c * 8;
#pragma unroll
            for (int e = 0; e < 8; ++e) x[e] = src[e];
        }
        reinterpret_cast<uint4*>(q_s)[sw128_chunk<ROWS>(r, c)] = *reinterpret_cast<const uint4*>(x);
    }

    float o[OT][4];
#pragma unroll
    for (int d = 0; d < OT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
    unsigned* p_words = reinterpret_cast<unsigned*>(p_s);
    // This warpgroup's value columns: its first column block of the latent tile.
    const int v_block = wg * (HALF / 64);

    for (int step = 0; step < count; ++step) {
        const int stage = step & 1;
        cp_async_wait<0>();
        fence_proxy_async();  // this thread's copies (and Q's stores) before wgmma reads them
        __syncthreads();      // tile `step` is in; the other stage and P are free
        if (step + 1 < count) {
            load_tile(stage ^ 1, step + 1);
        } else {
            cp_async_commit();
        }
        const T* k_tile = k_s + stage * BN * DK;
        if (wg == 0) {
            float s[NTILES][4];
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                const T* qa = q_s + (ks >> 2) * (ROWS * 64) + (ks & 3) * 16;
                const T* kb = k_tile + (ks >> 2) * (BN * 64) + (ks & 3) * 16;
                Wgmma<T, BN>::ss(s, wgmma_desc(qa, 16, ATOM), wgmma_desc(kb, 16, ATOM), ks > 0);
            }
            wgmma_commit();
            pin_registers(s);
            wgmma_wait_all();
            pin_registers(s);
            const int key0 = range_lo + (first + step) * BN;
            const bool edge = keys.edge(key0, BN);
            float top[2] = {row_max[0], row_max[1]};
            decode_tile_scores<T>(s, top, key0, t, edge, modified, my_row, keys, scale_log2,
                                  rows_total, group, hk, b, mask, alibi_slopes, alibi_batch_stride,
                                  softcap_log2, user_args);
            float row_base[2], alpha[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
#pragma unroll
                for (int o2 = 1; o2 < 4; o2 <<= 1)
                    top[r] = fmaxf(top[r], __shfl_xor_sync(0xffffffffu, top[r], o2));
                row_base[r] = top[r] == neg_inf() ? 0.f : top[r];
                alpha[r] = fast_exp2(row_max[r] - row_base[r]);
                row_max[r] = top[r];
                row_sum[r] *= alpha[r];
            }
            // P in the input type: row r, keys c at the swizzled place of one column block.
#pragma unroll
            for (int n = 0; n < NTILES; ++n) {
                float p[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    p[e] = fast_exp2(s[n][e] - row_base[e >> 1]);
                    row_sum[e >> 1] += p[e];
                }
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = tile_row[r];
                    const int at = row * 64 + (((n ^ (row & 7))) << 3) + 2 * t;  // even
                    p_words[at / 2] = Op::pack(p[2 * r], p[2 * r + 1]);
                }
            }
            if (t == 0) {
                scale_s[tile_row[0]] = alpha[0];
                scale_s[tile_row[1]] = alpha[1];
            }
            if (__any_sync(0xffffffffu, !(alpha[0] == 1.f && alpha[1] == 1.f))) {
#pragma unroll
                for (int d = 0; d < OT; ++d) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) o[d][e] *= alpha[e >> 1];
                }
            }
            fence_proxy_async();  // P's stores before wgmma reads it
        }
        __syncthreads();  // P and the factors are in
        if (wg == 1) {
            const float alpha[2] = {scale_s[tile_row[0]], scale_s[tile_row[1]]};
            // Past the first tiles a row's maximum seldom moves (a NaN factor counts as moved).
            if (__any_sync(0xffffffffu, !(alpha[0] == 1.f && alpha[1] == 1.f))) {
#pragma unroll
                for (int d = 0; d < OT; ++d) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) o[d][e] *= alpha[e >> 1];
                }
            }
        }
        pin_registers(o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            Wgmma<T, HALF>::ss_nb(
                o, wgmma_desc(p_s + kk * 16, 16, ATOM),
                wgmma_desc(k_tile + v_block * (BN * 64) + kk * 16 * 64, BN * 64 * sizeof(T), ATOM),
                1);
        wgmma_commit();
        pin_registers(o);
        wgmma_wait_all();
        pin_registers(o);
    }
    cp_async_wait<0>();

    // Warpgroup 0's row sums and maxima to both; each warpgroup writes its columns.
    if (wg == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int o2 = 1; o2 < 4; o2 <<= 1)
                row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], o2);
            if (t == 0) {
                sum_s[tile_row[r]] = row_sum[r];
                max_s[tile_row[r]] = row_max[r];
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int m = my_row[r];
        if (m >= rows_total) continue;
        const int i = m / group, h = hk * group + (m - i * group);
        const DecodeRowEnd end(sum_s[tile_row[r]], max_s[tile_row[r]], sinks, h, i, b, num_heads,
                               q_len, num_splits, split);
#pragma unroll
        for (int d = 0; d < OT; ++d)
            end.store(out, part_out, DV, wg * HALF + d * 8 + 2 * t, o[d][2 * r], o[d][2 * r + 1]);
        if (wg == 0 && t == 0) end.store_lse(lse, part_lse);
    }
}

}  // namespace cuflash
