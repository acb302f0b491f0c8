// kvcache_decode_tc (the KV-cache page): kvcache_decode's grid and outputs on
// mma.sync for float16/bfloat16 (head_dim a multiple of 16): each warp copies and
// computes its own slice of the keys of a tile; up to 8 packed rows (NARROW) the
// rows are the product's 8-wide side. An FP8 (e4m3) cache (the FP8 page; T =
// E4m3Cache<Q, OUT>, sm_89 and newer) stays e4m3 in shared memory, half the bytes,
// and widens exactly in registers on its way to the products.
#include "decode/decode_common.cuh"

namespace cuflash {

// The element types of kvcache_decode_tc<T, ...>: q's, the caches', out's, and those of
// the two products' operands. A 16-bit T is all of them. An FP8 cache's products run
// on float16 (q . k on bfloat16 with a bfloat16 q, whose range float16 lacks).
template <typename T>
struct DecodeTcTypes {
    using Q = T;
    using KV = T;
    using OUT = T;
    using QK = T;
    using PV = T;
    static constexpr bool FP8 = false;
};
template <typename Q>
struct E4m3ScoreType {
    using type = half_t;
};
template <>
struct E4m3ScoreType<bf16_t> {
    using type = bf16_t;
};
template <typename Q_, typename OUT_>
struct DecodeTcTypes<E4m3Cache<Q_, OUT_>> {
    using Q = Q_;
    using KV = e4m3_t;
    using OUT = OUT_;
    using QK = typename E4m3ScoreType<Q_>::type;
    using PV = half_t;
    static constexpr bool FP8 = true;
};

// The logical column of q's physical column d in an FP8 call's q rows: a thread's
// 4-byte read of a K row (columns 4t .. 4t + 3 of 16) holds the B (or A) operand's
// columns 2t, 2t + 1 (its low half) and 2t + 8, 2t + 9 (its high half), so q's columns
// take the same order and the dot products are unchanged.
__device__ __forceinline__ int e4m3_score_column(int d) {
    const int p = d & 15;
    return (d & ~15) + 2 * (p >> 2) + (p & 1) + 8 * ((p >> 1) & 1);
}

// V's e4m3 values as P V's fragments, widened to float16: lo[i] holds keys key0 + 2t and
// 2t + 1 (the low half the first), hi[i] keys key0 + 2t + 8 and 2t + 9, of column
// col + 4g + i; four 4-byte reads of rows PITCH_BYTES apart and a byte transpose.
template <int PITCH_BYTES>
__device__ __forceinline__ void e4m3_value_fragments(const unsigned char* tile, int key0, int col,
                                                     int g, int t, unsigned (&lo)[4],
                                                     unsigned (&hi)[4]) {
    constexpr int PITCH = PITCH_BYTES;
    const unsigned char* p = tile + (key0 + 2 * t) * PITCH + col + 4 * g;
    const unsigned w0 = *reinterpret_cast<const unsigned*>(p);
    const unsigned w1 = *reinterpret_cast<const unsigned*>(p + PITCH);
    const unsigned w2 = *reinterpret_cast<const unsigned*>(p + 8 * PITCH);
    const unsigned w3 = *reinterpret_cast<const unsigned*>(p + 9 * PITCH);
    // byte i of each of two rows side by side: columns i = 0, 1, then 2, 3
    e4m3x4_to_f16x2(byte_perm<0x5140>(w0, w1), lo[0], lo[1]);
    e4m3x4_to_f16x2(byte_perm<0x7362>(w0, w1), lo[2], lo[3]);
    e4m3x4_to_f16x2(byte_perm<0x5140>(w2, w3), hi[0], hi[1]);
    e4m3x4_to_f16x2(byte_perm<0x7362>(w2, w3), hi[2], hi[3]);
}

// A barrier of the THREADS threads of key slice `slice` (named barrier 1 + slice), a
// warp's own sync where they are one warp.
template <int THREADS>
__device__ __forceinline__ void slice_sync(int slice) {
    if constexpr (THREADS == 32) {
        __syncwarp();
    } else {
        asm volatile("bar.sync %0, %1;\n" ::"r"(1 + slice), "n"(THREADS) : "memory");
    }
}

// The tiles of kvcache_decode_tc<T, D, ROW_WARPS, STAGES, BN> (mirrored by
// cuflash/gpu/decode_tiles.py's decode_tc_shape, which tests/test_shared_layout.py holds to
// SMEM through kvcache_decode_tc_shared_bytes): ROW_WARPS m16 row tiles a block, BN keys
// a K/V tile, STAGES tiles in the pipeline, KEY_WARPS warps sharing each tile by
// keys (each with its own online softmax, merged at the end).
template <typename T, int D, int ROW_WARPS, int STAGES, int BN>
struct DecodeTcShape {
    static constexpr bool FP8 = DecodeTcTypes<T>::FP8;
    static constexpr int CH = D / 8;                 // 16-byte chunks of a 16-bit row (q's)
    static constexpr int PITCH = CH + 1;             // odd: ldmatrix rows hit 8 bank groups
    static constexpr int KV_CH = FP8 ? D / 16 : CH;  // of a cache row
    // An e4m3 row padded to whole 32 columns (P V's fragments read 32 at a time), plus one
    static constexpr int KV_PITCH = FP8 ? round_up(D, 32) / 16 + 1 : PITCH;
    static constexpr int KEY_WARPS_FIT = kDecodeWarps / ROW_WARPS;
    static constexpr int KEY_WARPS = KEY_WARPS_FIT < BN / 16 ? KEY_WARPS_FIT : BN / 16;
    static constexpr int WARP_KEYS = BN / KEY_WARPS;  // keys a warp takes of each tile
    static constexpr int BM = 16 * ROW_WARPS;         // packed query rows a block
    static constexpr int TILE_CHUNKS = BN * KV_PITCH;
    static constexpr int KV_BYTES = 2 * STAGES * TILE_CHUNKS * 16;  // K and V, STAGES deep
    static constexpr int REDUCE_BYTES = KEY_WARPS * BM * D * 4;
    static constexpr int REGION = KV_BYTES > REDUCE_BYTES ? KV_BYTES : REDUCE_BYTES;
    static constexpr int Q_BYTES = BM * PITCH * 16;
    static constexpr int STATS_BYTES = 2 * KEY_WARPS * BM * 4;
    static constexpr int SMEM = REGION + Q_BYTES + STATS_BYTES;
    static_assert(D % 16 == 0 && sizeof(typename DecodeTcTypes<T>::QK) == 2,
                  "mma.sync m16n8k16 on 16-bit types");
    static_assert(WARP_KEYS % 16 == 0, "P feeds the P V product 16 keys at a time");
};

// The dynamic shared memory of kvcache_decode_tc<...> (its own template arguments: a paged
// or narrow instantiation carves the same tiles), for the host's figure.
template <typename T, int D, int ROW_WARPS, int STAGES, int BN, bool PAGED, bool NARROW>
constexpr int kvcache_decode_tc_shared_bytes = DecodeTcShape<T, D, ROW_WARPS, STAGES, BN>::SMEM;

// The tensor-core kernel for float16/bfloat16 and head_dim a multiple of 16: the
// grid, arguments and partial outputs of kvcache_decode, BM packed rows a block.
// Warp (rw, kw) computes S = Q K^T on mma.sync m16n8k16 for query rows
// [16 rw, 16 rw + 16) of the block and keys [kw WARP_KEYS, (kw + 1) WARP_KEYS) of
// each tile, keeps its own online softmax, and accumulates O += P V in registers;
// the KEY_WARPS warps of a row tile merge by log-sum-exp at the end. PAGED: the cache
// is paged (block_table given), else contiguous (its own instantiation: no block ids
// held in registers).
template <typename T, int D, int ROW_WARPS, int STAGES, int BN, bool PAGED, bool NARROW>
__global__ void __launch_bounds__(kDecodeThreads,
                                  (D <= 128 && ROW_WARPS == 1) ? (STAGES == 2 ? 3 : 2) : 1)
    kvcache_decode_tc(CUFLASH_PARAMETERS(CUFLASH_DECODE_PARAMS, typename DecodeTcTypes<T>::Q,
                                         typename DecodeTcTypes<T>::KV,
                                         typename DecodeTcTypes<T>::OUT)) {
    using Shape = DecodeTcShape<T, D, ROW_WARPS, STAGES, BN>;
    using Types = DecodeTcTypes<T>;
    using KV = typename Types::KV;
    using QK = typename Types::QK;
    static_assert(STAGES >= 2, "at least double buffering");
    static_assert(!NARROW || ROW_WARPS == 1, "a narrow block is one tile of 8 rows");
    using Op = TensorOp<QK>;                    // S = Q K^T
    using PvOp = TensorOp<typename Types::PV>;  // O += P V
    constexpr bool FP8 = Types::FP8;
    constexpr int PITCH = Shape::PITCH, KV_CH = Shape::KV_CH, KV_PITCH = Shape::KV_PITCH;
    constexpr int BM = Shape::BM;
    constexpr int KEY_WARPS = Shape::KEY_WARPS, WARP_KEYS = Shape::WARP_KEYS;
    // Tiles of S (keys x rows) a warp a K/V tile: 8-key ones of m16 rows, or (NARROW)
    // 16-key ones of n8 rows; tiles of O: 8 columns of m16 rows, or 16 of n8 rows (an FP8
    // cache's P V covers whole 32 columns).
    constexpr int ST = NARROW ? WARP_KEYS / 16 : WARP_KEYS / 8;
    constexpr int OD = FP8 ? round_up(D, 32) : D;
    constexpr int OT = NARROW ? OD / 16 : OD / 8;
    constexpr int ROWS = NARROW ? 8 : BM;  // packed query rows the block computes
    constexpr int ELEMS = 8;
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* kv_tiles = reinterpret_cast<uint4*>(smem);  // [STAGES][K, V][BN][KV_PITCH] chunks
    float* reduce_s = reinterpret_cast<float*>(smem);  // [KEY_WARPS][BM][D] at the end
    uint4* q_s = reinterpret_cast<uint4*>(smem + Shape::REGION);  // [BM][PITCH] chunks
    float* max_s = reinterpret_cast<float*>(smem + Shape::REGION + Shape::Q_BYTES);
    float* sum_s = max_s + KEY_WARPS * BM;  // both [KEY_WARPS][BM]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    if (tid == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        unsigned dynamic_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
        if (dynamic_bytes < static_cast<unsigned>(Shape::SMEM)) __trap();
    }
    const bool active = warp < ROW_WARPS * KEY_WARPS;
    const int rw = active ? warp / KEY_WARPS : 0, kw = warp % KEY_WARPS;

    const int hk = blockIdx.y, b = blockIdx.z;
    const int split = blockIdx.x / row_tiles, row0 = (blockIdx.x % row_tiles) * ROWS;
    const int rows_total = q_len * group;
    const int kv_len = cached_length(seqlens, seqlen_value, b, new_len, capacity) + new_len;
    const Mask mask{q_len, kv_len, win_left, win_right};
    const CacheRows rows = cache_rows(block_table, b, max_blocks, block_size, num_blocks);

    // The block's key range (rows are sorted by query index, so the first and the
    // last row bound it), this thread's two rows' ranges, the keys every row of
    // the warp sees. A thread's rows: g and g + 8 of its warp's m16 tile, or
    // (NARROW) columns 2t and 2t + 1 of the n8 tile.
    const int last_row = min(row0 + ROWS, rows_total) - 1;
    int range_lo, range_hi;
    mask.key_range(row0 / group, last_row / group + 1, range_lo, range_hi);
    const int tile_row[2] = {NARROW ? 2 * t : rw * 16 + g, NARROW ? 2 * t + 1 : rw * 16 + g + 8};
    const int my_row[2] = {row0 + tile_row[0], row0 + tile_row[1]};
    const bool modified = decode_modifies(alibi_slopes, softcap_log2);
    const RowKeys keys(mask, my_row, rows_total, group);
    const SplitTiles mine = split_tiles<BN>(range_lo, range_hi, num_splits, split);
    const int first = mine.first, count = mine.count;
    auto tile_of = [&](int step) { return first + step; };

    // The descales of an FP8 cache (a scalar v descale is out_scale, a scalar q.k one is
    // in scale_log2).
    float score_scale = scale_log2, value_scale = 1.f;
    if constexpr (FP8) {
        const long long head = static_cast<long long>(b) * gridDim.y + hk;
        if (qk_scales != nullptr) score_scale *= qk_scales[head];
        value_scale = out_scale * (v_scales != nullptr ? v_scales[head] : 1.f);
    }

    const KV* k_head = k_cache + hk * k_sh;
    const KV* v_head = v_cache + hk * v_sh;
    // The ROW_WARPS warps of key slice kw copy its rows of each tile themselves and
    // wait for them alone (slice_sync): the slices stream independently, no block
    // barrier a tile. `source` points at the slice's next rows (tiles load in order; a
    // paged cache's block ids read a tile ahead).
    constexpr int SLICE_THREADS = ROW_WARPS * 32;
    const int slice = kw * WARP_KEYS;
    TileSource<KV, WARP_KEYS, KV_CH, SLICE_THREADS, BN, PAGED> source;
    source.thread = rw * 32 + lane;
    source.start(k_head, v_head, rows, range_lo + first * BN + slice, k_sb, k_ss, v_sb, v_ss);
    auto load_tile = [&](int stage, int step) {
        uint4* k_dst = kv_tiles + (2 * stage) * Shape::TILE_CHUNKS + slice * KV_PITCH;
        load_kv_tile<KV, WARP_KEYS, KV_CH, KV_PITCH, SLICE_THREADS, BN, PAGED>(
            k_dst, k_dst + Shape::TILE_CHUNKS, k_head, v_head, rows, source,
            range_lo + tile_of(step) * BN + slice, range_hi, k_sb, k_ss, v_sb, v_ss, aligned != 0);
        if (step + 1 < count)
            source.read(rows, range_lo + tile_of(step + 1) * BN + slice, range_hi);
    };
    // STAGES - 1 tiles in flight while Q loads (empty groups keep the count uniform).
    if (active) {
        if (count > 0) source.read(rows, range_lo + first * BN + slice, range_hi);
#pragma unroll
        for (int st = 0; st < STAGES - 1; ++st) {
            if (st < count) {
                load_tile(st, st);
            } else {
                cp_async_commit();
            }
        }
    }

    // Q rows into shared memory in the type of q . k (an FP8 call's columns in the order
    // of its K fragments, e4m3_score_column); zeros past the rows.
    for (int idx = tid; idx < BM * D; idx += kDecodeThreads) {
        const int r = idx / D, d = idx - (idx / D) * D, m = row0 + r;
        QK x{};
        if (m < rows_total) {
            const int i = m / group, h = hk * group + (m - i * group);
            x = widen_element<QK>(q[b * q_sb + h * q_sh + i * q_ss + d]);
        }
        reinterpret_cast<QK*>(q_s)[r * PITCH * ELEMS + (FP8 ? e4m3_score_column(d) : d)] = x;
    }

    float o_acc[OT][4];
#pragma unroll
    for (int d = 0; d < OT; ++d) o_acc[d][0] = o_acc[d][1] = o_acc[d][2] = o_acc[d][3] = 0.f;
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
    const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_chunk = lane >> 4;
    const int b_row = (lane & 7) + 8 * (lane >> 4), b_chunk = (lane >> 3) & 1;
    const uint4* q_rows = q_s + (rw * 16 + a_row) * PITCH + a_chunk;
    __syncthreads();  // Q is in
    // NARROW: Q^T as the B operand of S^T = K Q^T, in registers for the whole block
    // (lanes 8i..8i+7 address the 8 rows of 16-byte chunk 2 kk + i).
    unsigned q_frag[NARROW ? D / 16 : 1][2];
    if constexpr (NARROW) {
#pragma unroll
        for (int kk = 0; kk < D / 16; kk += 2) {
            unsigned x[4];
            ldmatrix_x4(x, q_s + (lane & 7) * PITCH + 2 * kk + (lane >> 3));
            q_frag[kk][0] = x[0];
            q_frag[kk][1] = x[1];
            if (kk + 1 < D / 16) {
                q_frag[kk + 1][0] = x[2];
                q_frag[kk + 1][1] = x[3];
            }
        }
    }
    // Element e of an S tile n: its row (0 or 1 of the thread's) and key in the warp's
    // slice; element e of an O tile: its row.
    auto row_of = [](int e) { return NARROW ? (e & 1) : (e >> 1); };
    auto key_of = [&](int n, int e) {
        return NARROW ? n * 16 + g + 8 * (e >> 1) : n * 8 + 2 * t + (e & 1);
    };

    for (int step = 0; active && step < count; ++step) {
        const int tile = tile_of(step), stage = step % STAGES;
        cp_async_wait<STAGES - 2>();
        // The slice's rows of tile `step` are in; its warps are done with step - 1's stage.
        slice_sync<SLICE_THREADS>(kw);
        if (step + STAGES - 1 < count) {
            load_tile((step + STAGES - 1) % STAGES, step + STAGES - 1);
        } else {
            cp_async_commit();
        }
        {
            const uint4* k_tile =
                kv_tiles + (2 * stage) * Shape::TILE_CHUNKS + kw * WARP_KEYS * KV_PITCH;
            const uint4* v_tile = k_tile + Shape::TILE_CHUNKS;
            float s[ST][4];
#pragma unroll
            for (int n = 0; n < ST; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            if constexpr (FP8) {
                // A 16-byte chunk of a K row is one k16 step: ldmatrix reads steps kk and
                // kk + 1 (past an odd count, the row's padding, unused) of 16 keys at once,
                // rows g and g + 8 of each as matrices 0 and 1, then 2 and 3.
#pragma unroll
                for (int kk = 0; kk < D / 16; kk += 2) {
                    constexpr int STEPS = D / 16;
                    const bool pair = kk + 1 < STEPS;
                    if constexpr (NARROW) {  // S^T = K Q^T: K the A operand
#pragma unroll
                        for (int n = 0; n < ST; ++n) {
                            unsigned x[4], ka[4];
                            ldmatrix_x4(x, k_tile + (n * 16 + a_row) * KV_PITCH + kk + a_chunk);
                            e4m3x4_widen<QK>(x[0], ka[0], ka[2]);
                            e4m3x4_widen<QK>(x[1], ka[1], ka[3]);
                            Op::mma(s[n], ka, q_frag[kk][0], q_frag[kk][1]);
                            if (pair) {
                                e4m3x4_widen<QK>(x[2], ka[0], ka[2]);
                                e4m3x4_widen<QK>(x[3], ka[1], ka[3]);
                                Op::mma(s[n], ka, q_frag[pair ? kk + 1 : kk][0],
                                        q_frag[pair ? kk + 1 : kk][1]);
                            }
                        }
                    } else {  // keys 8n .. 8n + 15 as the B operands of tiles n and n + 1
                        unsigned qa[2][4];
                        ldmatrix_x4(qa[0], q_rows + 2 * kk);
                        if (pair) ldmatrix_x4(qa[1], q_rows + 2 * kk + 2);
#pragma unroll
                        for (int n = 0; n < ST; n += 2) {
                            unsigned x[4], kb[2];
                            ldmatrix_x4(x, k_tile + (n * 8 + a_row) * KV_PITCH + kk + a_chunk);
#pragma unroll
                            for (int m = 0; m < (pair ? 4 : 2); ++m) {
                                e4m3x4_widen<QK>(x[m], kb[0], kb[1]);
                                Op::mma(s[n + (m & 1)], qa[m >> 1], kb[0], kb[1]);
                            }
                        }
                    }
                }
            }
#pragma unroll
            for (int kk = 0; kk < (FP8 ? 0 : D / 16); ++kk) {
                if constexpr (NARROW) {  // S^T = K Q^T: K the A operand
#pragma unroll
                    for (int n = 0; n < ST; ++n) {
                        unsigned ka[4];
                        ldmatrix_x4(ka, k_tile + (n * 16 + a_row) * KV_PITCH + 2 * kk + a_chunk);
                        Op::mma(s[n], ka, q_frag[kk][0], q_frag[kk][1]);
                    }
                } else {
                    unsigned qa[4];
                    ldmatrix_x4(qa, q_rows + 2 * kk);
#pragma unroll
                    for (int n = 0; n < ST; n += 2) {
                        unsigned kb[4];
                        ldmatrix_x4(kb, k_tile + (n * 8 + b_row) * KV_PITCH + 2 * kk + b_chunk);
                        Op::mma(s[n], qa, kb[0], kb[1]);
                        Op::mma(s[n + 1], qa, kb[2], kb[3]);
                    }
                }
            }
            const int key0 = range_lo + tile * BN + kw * WARP_KEYS;
            const bool edge = keys.edge(key0, WARP_KEYS);
            float new_max[2] = {row_max[0], row_max[1]};
            if (!edge && !modified && !ScoreModifiers::user_mask) {  // every score as it is
#pragma unroll
                for (int n = 0; n < ST; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[n][e] *= score_scale;
                        new_max[row_of(e)] = fmaxf(new_max[row_of(e)], s[n][e]);
                    }
                }
            } else {
#pragma unroll
                for (int n = 0; n < ST; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = row_of(e), key = key0 + key_of(n, e);
                        const float x = decode_score<QK>(
                            s[n][e] * score_scale, edge, modified, my_row[r], key, keys.lo[r],
                            keys.hi[r], rows_total, group, hk, b, mask, alibi_slopes,
                            alibi_batch_stride, softcap_log2, user_args);
                        s[n][e] = x;
                        new_max[r] = fmaxf(new_max[r], x);
                    }
                }
            }
            float base[2], alpha[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                // Over the lanes that hold the row: those of one g, or (NARROW) of one t.
#pragma unroll
                for (int o = NARROW ? 4 : 1; o < (NARROW ? 32 : 4); o <<= 1)
                    new_max[r] = fmaxf(new_max[r], __shfl_xor_sync(0xffffffffu, new_max[r], o));
                base[r] = new_max[r] == neg_inf() ? 0.f : new_max[r];
                alpha[r] = fast_exp2(row_max[r] - base[r]);
                row_max[r] = new_max[r];
                row_sum[r] *= alpha[r];
            }
            // Past the first tiles a row's maximum seldom moves: the warp rescales its
            // accumulator only when some row's does (a NaN scale counts as moved).
            if (__any_sync(0xffffffffu, !(alpha[0] == 1.f && alpha[1] == 1.f))) {
#pragma unroll
                for (int d = 0; d < OT; ++d) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) o_acc[d][e] *= alpha[row_of(e)];
                }
            }
#pragma unroll
            for (int n = 0; n < ST; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = fast_exp2(s[n][e] - base[row_of(e)]);
                    s[n][e] = p;
                    row_sum[row_of(e)] += p;
                }
            }
            // An FP8 cache's V in 32 columns at a time (e4m3_value_fragments): column
            // 32 j + 4 g + i is row 16 (2 j + i / 2) + g + 8 (i % 2) of the narrow O^T's
            // tiles, column 8 (4 j + i) + g of the wide O's.
            const unsigned char* v_bytes = reinterpret_cast<const unsigned char*>(v_tile);
            if constexpr (NARROW) {
                // O^T += V^T P^T: V^T the A operand (transposed loads), P^T the B operand
                // (each 8x8 block of S^T transposed in registers).
#pragma unroll
                for (int n = 0; n < ST; ++n) {
                    const unsigned p_lo = movmatrix_trans(PvOp::pack(s[n][0], s[n][1]));
                    const unsigned p_hi = movmatrix_trans(PvOp::pack(s[n][2], s[n][3]));
                    if constexpr (FP8) {
#pragma unroll
                        for (int j = 0; j < OD / 32; ++j) {
                            unsigned lo[4], hi[4];
                            e4m3_value_fragments<KV_PITCH * 16>(v_bytes, n * 16, 32 * j, g, t, lo,
                                                                hi);
                            const unsigned va0[4] = {lo[0], lo[1], hi[0], hi[1]};
                            const unsigned va1[4] = {lo[2], lo[3], hi[2], hi[3]};
                            PvOp::mma(o_acc[2 * j], va0, p_lo, p_hi);
                            PvOp::mma(o_acc[2 * j + 1], va1, p_lo, p_hi);
                        }
                    } else {
#pragma unroll
                        for (int d = 0; d < OT; ++d) {
                            unsigned va[4];
                            ldmatrix_x4_trans(
                                va, v_tile + (n * 16 + b_row) * KV_PITCH + 2 * d + b_chunk);
                            PvOp::mma(o_acc[d], va, p_lo, p_hi);
                        }
                    }
                }
            }
#pragma unroll
            for (int kk = 0; kk < (NARROW ? 0 : WARP_KEYS / 16); ++kk) {
                const unsigned pa[4] = {PvOp::pack(s[2 * kk][0], s[2 * kk][1]),
                                        PvOp::pack(s[2 * kk][2], s[2 * kk][3]),
                                        PvOp::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                        PvOp::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                if constexpr (FP8) {
#pragma unroll
                    for (int j = 0; j < OD / 32; ++j) {
                        unsigned lo[4], hi[4];
                        e4m3_value_fragments<KV_PITCH * 16>(v_bytes, kk * 16, 32 * j, g, t, lo, hi);
#pragma unroll
                        for (int i = 0; i < 4; ++i) PvOp::mma(o_acc[4 * j + i], pa, lo[i], hi[i]);
                    }
                } else {
#pragma unroll
                    for (int d = 0; d < OT; d += 2) {
                        unsigned vb[4];
                        ldmatrix_x4_trans(vb, v_tile + (kk * 16 + a_row) * KV_PITCH + d + a_chunk);
                        PvOp::mma(o_acc[d], pa, vb[0], vb[1]);
                        PvOp::mma(o_acc[d + 1], pa, vb[2], vb[3]);
                    }
                }
            }
        }
    }

    // Merge the KEY_WARPS warps of each row tile (log-sum-exp), then write.
    cp_async_wait<0>();
    __syncthreads();
    if (active) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int o = NARROW ? 4 : 1; o < (NARROW ? 32 : 4); o <<= 1)
                row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], o);
            if ((NARROW ? g : t) == 0) {
                max_s[kw * BM + tile_row[r]] = row_max[r];
                sum_s[kw * BM + tile_row[r]] = row_sum[r];
            }
        }
    }
    __syncthreads();
    if (active) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = tile_row[r];
            float top = neg_inf();
#pragma unroll
            for (int k = 0; k < KEY_WARPS; ++k) top = fmaxf(top, max_s[k * BM + row]);
            const float factor = fast_exp2(row_max[r] - (top == neg_inf() ? 0.f : top));
            float* dst = reduce_s + (kw * BM + row) * D;
#pragma unroll
            for (int d = 0; d < OT; ++d) {
                if constexpr (FP8 && NARROW) {  // see e4m3_value_fragments; none past D
                    const int col = 32 * (d / 2) + 4 * g + 2 * (d % 2);
                    if (col < D)
                        *reinterpret_cast<float2*>(dst + col) =
                            make_float2(o_acc[d][r] * factor, o_acc[d][2 + r] * factor);
                } else if constexpr (FP8) {
                    const int col = 32 * (d / 4) + 8 * t + d % 4;
                    if (col < D) {
                        dst[col] = o_acc[d][2 * r] * factor;
                        dst[col + 4] = o_acc[d][2 * r + 1] * factor;
                    }
                } else if constexpr (NARROW) {  // columns 16 d + g and 16 d + g + 8 of row 2t + r
                    dst[16 * d + g] = o_acc[d][r] * factor;
                    dst[16 * d + g + 8] = o_acc[d][2 + r] * factor;
                } else {
                    *reinterpret_cast<float2*>(dst + d * 8 + 2 * t) =
                        make_float2(o_acc[d][2 * r] * factor, o_acc[d][2 * r + 1] * factor);
                }
            }
        }
    }
    __syncthreads();
    for (int idx = tid; idx < ROWS * D; idx += kDecodeThreads) {
        const int r = idx / D, d = idx - (idx / D) * D, m = row0 + r;
        if (m >= rows_total) continue;
        float top = neg_inf();
#pragma unroll
        for (int k = 0; k < KEY_WARPS; ++k) top = fmaxf(top, max_s[k * BM + r]);
        float base = top == neg_inf() ? 0.f : top;
        float o = 0.f, l = 0.f;
#pragma unroll
        for (int k = 0; k < KEY_WARPS; ++k) {
            o += reduce_s[(k * BM + r) * D + d];
            l += sum_s[k * BM + r] * fast_exp2(max_s[k * BM + r] - base);
        }
        const int i = m / group, h = hk * group + (m - i * group);
        // Attention sinks enter once a row: here unsplit, else in kvcache_combine.
        if (sinks != nullptr && num_splits == 1) o *= add_sink(sink_log2(sinks, h), base, l);
        const bool seen = l != 0.f;  // a NaN sum counts as seen: NaN is never hidden
        const float value = seen ? o / l * value_scale : 0.f;
        const float row_lse2 = seen ? base + log2f(l) : neg_inf();
        const long long row = (static_cast<long long>(b) * num_heads + h) * q_len + i;
        if (num_splits == 1) {
            out[row * D + d] = from_float<typename Types::OUT>(value);
            if (d == 0) lse[row] = row_lse2 * kLn2;
        } else {
            const long long part = row * num_splits + split;
            part_out[part * D + d] = value;
            if (d == 0) part_lse[part] = row_lse2;
        }
    }
}

}  // namespace cuflash
