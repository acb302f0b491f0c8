// kvcache_decode_mla (the KV-cache page, "Absorbed MLA"): kvcache_decode's grid,
// arguments and partial outputs for a value head dim of its own (DV != DK) or key
// rows wider than 256, on mma.sync for float16/bfloat16. LATENT: v_cache is the view
// k_cache[..., :DV] (absorbed MLA's latent), so each key row is read once and its
// first DV columns in shared memory are the values.
//
// A block holds 16 packed query rows (the query heads of one KV head, then the query
// rows) and its four warps split the work twice a tile of BN keys: for S = Q K^T each
// of the first BN / 16 warps takes 16 keys (the full DK reduction); the row maxima
// meet in shared memory, so every warp rescales by the same factor; P goes to shared
// memory in the input type; for O += P V each warp takes DV / 4 value columns over all
// BN keys (the accumulator of a 512-wide row would not fit one warp's registers).
#include "decode/decode_common.cuh"

namespace cuflash {

// The tiles of kvcache_decode_mla<T, DK, DV, BN, STAGES, PAGED, LATENT> (mirrored by
// cuflash/gpu/decode_tiles.py's decode_mla_shape, which tests/test_shared_layout.py holds to
// SMEM through kvcache_decode_mla_shared_bytes; the kernel traps if it is launched with
// less shared memory).
template <int DK, int DV, int BN, int STAGES, bool LATENT>
struct DecodeMlaShape {
    static constexpr int ROWS = 16;                   // packed query rows a block
    static constexpr int S_WARPS = BN / 16;           // warps computing S, 16 keys each
    static constexpr int V_COLS = DV / kDecodeWarps;  // value columns a warp
    static constexpr int OT = V_COLS / 8;             // n8 tiles of O a warp
    static constexpr int K_PITCH = DK / 8 + 1;        // odd: ldmatrix rows hit 8 bank groups
    static constexpr int V_PITCH = LATENT ? K_PITCH : DV / 8 + 1;
    static constexpr int K_CHUNKS = BN * K_PITCH;
    static constexpr int V_CHUNKS = LATENT ? 0 : BN * V_PITCH;
    static constexpr int STAGE_CHUNKS = K_CHUNKS + V_CHUNKS;
    static constexpr int P_PITCH = BN / 8 + 1;  // chunks a row of P
    static constexpr int KV_BYTES = STAGES * STAGE_CHUNKS * 16;
    static constexpr int Q_BYTES = ROWS * K_PITCH * 16;
    static constexpr int P_BYTES = ROWS * P_PITCH * 16;
    static constexpr int STATS_BYTES = 2 * kDecodeWarps * ROWS * 4;
    static constexpr int SMEM = KV_BYTES + Q_BYTES + P_BYTES + STATS_BYTES;
    static_assert(DK % 16 == 0 && DV % 64 == 0, "k16 steps over DK, 16-column pairs over DV");
    static_assert(BN % 16 == 0 && S_WARPS >= 1 && S_WARPS <= kDecodeWarps, "16 keys a warp");
    static_assert(!LATENT || DV <= DK, "the values are the first DV columns of the keys");
};

// The dynamic shared memory of kvcache_decode_mla<...>, for the host's figure.
template <typename T, int DK, int DV, int BN, int STAGES, bool PAGED, bool LATENT>
constexpr int kvcache_decode_mla_shared_bytes = DecodeMlaShape<DK, DV, BN, STAGES, LATENT>::SMEM;

template <typename T, int DK, int DV, int BN, int STAGES, bool PAGED, bool LATENT>
__global__ void __launch_bounds__(kDecodeThreads, 1)
    kvcache_decode_mla(CUFLASH_PARAMETERS(CUFLASH_DECODE_PARAMS, T, T, T)) {
    using Shape = DecodeMlaShape<DK, DV, BN, STAGES, LATENT>;
    static_assert(STAGES >= 2, "at least double buffering");
    using Op = TensorOp<T>;
    constexpr int ROWS = Shape::ROWS, OT = Shape::OT, K_PITCH = Shape::K_PITCH;
    constexpr int V_PITCH = Shape::V_PITCH, P_PITCH = Shape::P_PITCH;
    constexpr int ST = 2;  // n8 tiles of S a warp: its 16 keys
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* kv_tiles = reinterpret_cast<uint4*>(smem);               // [STAGES][K (, V)] chunks
    uint4* q_s = reinterpret_cast<uint4*>(smem + Shape::KV_BYTES);  // [ROWS][K_PITCH]
    uint4* p_s = q_s + ROWS * K_PITCH;                              // [ROWS][P_PITCH]
    float* max_s = reinterpret_cast<float*>(p_s + ROWS * P_PITCH);  // [warps][ROWS]
    float* sum_s = max_s + kDecodeWarps * ROWS;                     // [warps][ROWS]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    if (tid == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        unsigned dynamic_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
        if (dynamic_bytes < static_cast<unsigned>(Shape::SMEM)) __trap();
    }

    const int hk = blockIdx.y, b = blockIdx.z;
    const int split = blockIdx.x / row_tiles, row0 = (blockIdx.x % row_tiles) * ROWS;
    const int rows_total = q_len * group;
    const int kv_len = cached_length(seqlens, seqlen_value, b, new_len, capacity) + new_len;
    const Mask mask{q_len, kv_len, win_left, win_right};
    const CacheRows rows = cache_rows(block_table, b, max_blocks, block_size, num_blocks);

    // The block's key range (rows are sorted by query index), this thread's two rows
    // (g and g + 8) and their ranges, the keys every row of the block sees.
    const int last_row = min(row0 + ROWS, rows_total) - 1;
    int range_lo, range_hi;
    mask.key_range(row0 / group, last_row / group + 1, range_lo, range_hi);
    const int tile_row[2] = {g, g + 8};
    const int my_row[2] = {row0 + g, row0 + g + 8};
    const bool modified = decode_modifies(alibi_slopes, softcap_log2);
    const RowKeys keys(mask, my_row, rows_total, group);
    const SplitTiles mine = split_tiles<BN>(range_lo, range_hi, num_splits, split);
    const int first = mine.first, count = mine.count;

    // Every thread copies its chunks of each tile (one commit group a tile: K, then V
    // where it is a cache of its own).
    const T* k_head = k_cache + hk * k_sh;
    const T* v_head = v_cache + hk * v_sh;
    TileSource<T, BN, DK / 8, kDecodeThreads, BN, PAGED> k_source;
    TileSource<T, BN, DV / 8, kDecodeThreads, BN, PAGED> v_source;
    k_source.thread = v_source.thread = tid;
    const int key_start = range_lo + first * BN;
    k_source.start(k_head, k_head, rows, key_start, k_sb, k_ss, k_sb, k_ss);
    if constexpr (!LATENT) v_source.start(v_head, v_head, rows, key_start, v_sb, v_ss, v_sb, v_ss);
    auto read_ids = [&](int step) {
        k_source.read(rows, range_lo + (first + step) * BN, range_hi);
        if constexpr (!LATENT) v_source.read(rows, range_lo + (first + step) * BN, range_hi);
    };
    auto load_tile = [&](int stage, int step) {
        uint4* k_dst = kv_tiles + stage * Shape::STAGE_CHUNKS;
        const int key0 = range_lo + (first + step) * BN;
        load_kv_tile<T, BN, DK / 8, K_PITCH, kDecodeThreads, BN, PAGED, false, LATENT>(
            k_dst, k_dst, k_head, k_head, rows, k_source, key0, range_hi, k_sb, k_ss, k_sb, k_ss,
            aligned != 0);
        if constexpr (!LATENT) {
            uint4* v_dst = k_dst + Shape::K_CHUNKS;
            load_kv_tile<T, BN, DV / 8, V_PITCH, kDecodeThreads, BN, PAGED, false, true>(
                v_dst, v_dst, v_head, v_head, rows, v_source, key0, range_hi, v_sb, v_ss, v_sb,
                v_ss, aligned != 0);
        }
        if (step + 1 < count) read_ids(step + 1);
    };
    if (count > 0) read_ids(0);
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < count) {
            load_tile(st, st);
        } else {
            cp_async_commit();
        }
    }

    // Q rows into shared memory in the input type; zeros past the rows.
    for (int idx = tid; idx < ROWS * DK; idx += kDecodeThreads) {
        const int r = idx / DK, d = idx - (idx / DK) * DK, m = row0 + r;
        T x{};
        if (m < rows_total) {
            const int i = m / group, h = hk * group + (m - i * group);
            x = q[b * q_sb + h * q_sh + i * q_ss + d];
        }
        reinterpret_cast<T*>(q_s)[r * K_PITCH * 8 + d] = x;
    }

    float o_acc[OT][4];
#pragma unroll
    for (int d = 0; d < OT; ++d) o_acc[d][0] = o_acc[d][1] = o_acc[d][2] = o_acc[d][3] = 0.f;
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
    const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_chunk = lane >> 4;
    const int b_row = (lane & 7) + 8 * (lane >> 4), b_chunk = (lane >> 3) & 1;
    const bool computes_s = warp < Shape::S_WARPS;
    const int v_column0 = warp * OT;  // the warp's first 8-column chunk of V and O

    for (int step = 0; step < count; ++step) {
        const int stage = step % STAGES;
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile `step` is in; every warp is done with step - 1's stage and P
        if (step + STAGES - 1 < count) {
            load_tile((step + STAGES - 1) % STAGES, step + STAGES - 1);
        } else {
            cp_async_commit();
        }
        const uint4* k_tile = kv_tiles + stage * Shape::STAGE_CHUNKS;
        const uint4* v_tile = LATENT ? k_tile : k_tile + Shape::K_CHUNKS;
        float s[ST][4];
        float new_max[2] = {neg_inf(), neg_inf()};
        const int key0 = range_lo + (first + step) * BN + warp * 16;
        if (computes_s) {
#pragma unroll
            for (int n = 0; n < ST; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            const uint4* k_rows = k_tile + warp * 16 * K_PITCH;
#pragma unroll 4
            for (int kk = 0; kk < DK / 16; ++kk) {
                unsigned qa[4], kb[4];
                ldmatrix_x4(qa, q_s + a_row * K_PITCH + 2 * kk + a_chunk);
                ldmatrix_x4(kb, k_rows + b_row * K_PITCH + 2 * kk + b_chunk);
                Op::mma(s[0], qa, kb[0], kb[1]);
                Op::mma(s[1], qa, kb[2], kb[3]);
            }
            const bool edge = keys.edge(key0, 16);
            decode_tile_scores<T>(s, new_max, key0, t, edge, modified, my_row, keys, scale_log2,
                                  rows_total, group, hk, b, mask, alibi_slopes, alibi_batch_stride,
                                  softcap_log2, user_args);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
#pragma unroll
                for (int o = 1; o < 4; o <<= 1)
                    new_max[r] = fmaxf(new_max[r], __shfl_xor_sync(0xffffffffu, new_max[r], o));
                if (t == 0) max_s[warp * ROWS + tile_row[r]] = new_max[r];
            }
        }
        __syncthreads();  // the S warps' maxima are in
        float base[2], alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float top = row_max[r];
#pragma unroll
            for (int w = 0; w < Shape::S_WARPS; ++w)
                top = fmaxf(top, max_s[w * ROWS + tile_row[r]]);
            base[r] = top == neg_inf() ? 0.f : top;
            alpha[r] = fast_exp2(row_max[r] - base[r]);
            row_max[r] = top;
            row_sum[r] *= alpha[r];
        }
        if (computes_s) {  // P in the input type, row-major [ROWS][BN]
            unsigned* p_words = reinterpret_cast<unsigned*>(p_s);
#pragma unroll
            for (int n = 0; n < ST; ++n) {
                float p[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    p[e] = fast_exp2(s[n][e] - base[e >> 1]);
                    row_sum[e >> 1] += p[e];
                }
                const int column = warp * 16 + n * 8 + 2 * t;  // even: one 32-bit word
                p_words[(tile_row[0] * P_PITCH * 8 + column) / 2] = Op::pack(p[0], p[1]);
                p_words[(tile_row[1] * P_PITCH * 8 + column) / 2] = Op::pack(p[2], p[3]);
            }
        }
        __syncthreads();  // P is in
        // Past the first tiles a row's maximum seldom moves: the warp rescales its
        // accumulator only when some row's does (a NaN scale counts as moved).
        if (__any_sync(0xffffffffu, !(alpha[0] == 1.f && alpha[1] == 1.f))) {
#pragma unroll
            for (int d = 0; d < OT; ++d) {
#pragma unroll
                for (int e = 0; e < 4; ++e) o_acc[d][e] *= alpha[e >> 1];
            }
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned pa[4];
            ldmatrix_x4(pa, p_s + a_row * P_PITCH + 2 * kk + a_chunk);
#pragma unroll
            for (int d = 0; d < OT; d += 2) {
                unsigned vb[4];
                ldmatrix_x4_trans(vb,
                                  v_tile + (kk * 16 + a_row) * V_PITCH + v_column0 + d + a_chunk);
                Op::mma(o_acc[d], pa, vb[0], vb[1]);
                Op::mma(o_acc[d + 1], pa, vb[2], vb[3]);
            }
        }
    }

    // The warps' row sums (each of its own keys), then each warp writes its columns.
    cp_async_wait<0>();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], o);
    }
    if (t == 0) {
        sum_s[warp * ROWS + tile_row[0]] = row_sum[0];
        sum_s[warp * ROWS + tile_row[1]] = row_sum[1];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int m = my_row[r];
        if (m >= rows_total) continue;
        float l = 0.f;
#pragma unroll
        for (int w = 0; w < kDecodeWarps; ++w) l += sum_s[w * ROWS + tile_row[r]];
        const int i = m / group, h = hk * group + (m - i * group);
        const DecodeRowEnd end(l, row_max[r], sinks, h, i, b, num_heads, q_len, num_splits, split);
#pragma unroll
        for (int d = 0; d < OT; ++d)
            end.store(out, part_out, DV, (v_column0 + d) * 8 + 2 * t, o_acc[d][2 * r],
                      o_acc[d][2 * r + 1]);
        if (warp == 0 && t == 0) end.store_lse(lse, part_lse);
    }
}

}  // namespace cuflash
