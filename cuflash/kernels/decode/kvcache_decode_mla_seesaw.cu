// kvcache_decode_mla_seesaw (the KV-cache page, "Absorbed MLA"): kvcache_decode_mla_wgmma's
// grid, arguments, 64 packed query rows a block and partial outputs, with the two
// warpgroups taking turns on the tensor cores ("seesaw", the decode record): the key tiles
// go by pairs, warpgroup w computes S of the pair's tile w while the other computes its
// own, and each keeps its half of O's DV columns (DV / 2 accumulators of 64 rows: a
// whole O would take 256 registers a thread):
//
//   WG0: S0 = Q K0^T; m0 = max(m, rowmax S0); P0 = exp2(S0 - m0);
//        O_L = O_L f0 + P0 V0_L (P0 from registers)          -> m0, f0 to WG1
//   WG1: S1 = Q K1^T; m1 = max(m0, rowmax S1); P1 = exp2(S1 - m1);
//        O_R = O_R f0 f1 + P1 V1_R (P1 from registers)       -> m1, f1, P1 to WG0
//   WG0: P0 f1 into shared memory                             -> P0 to WG1
//        O_L = O_L f1 + P1 V1_L (P1 from shared memory)
//   WG1: O_R = O_R + (P0 f1) V0_R (P0 from shared memory)
//
// (f0 = exp2(m - m0), f1 = exp2(m0 - m1)), so one warpgroup's softmax runs while the
// other's products do. Each warpgroup's row sums are its own P's; the epilogue adds them.
//
// Shared memory (1024-byte aligned base): Q, two stages of BN = 64 keys (tile t in stage
// t % 2) in wgmma's 128-byte swizzle, the rows' statistics and the mbarriers. A tile's P
// goes into its own stage, over the first column block past DV: only S reads that block,
// and P is one such block (64 rows of 64 keys); a second P of its own would not fit. Keys
// arrive by cp.async in column blocks of 64, each with its mbarrier (`full`, 128
// arrivals), so that S starts on the first block to land. A warpgroup reloads the blocks
// that it reads last, once its products are done with them: its half of V's columns in
// both stages, and the columns past DV (P's block) of the stage whose S is the other's.
// The hand-overs between the warpgroups (the factors, P) are mbarriers of 128 arrivals, a
// phase a pair.
#include "decode/decode_common.cuh"
#include "common/mbarrier.cuh"
#include "common/wgmma.cuh"

namespace cuflash {

// The shared memory of kvcache_decode_mla_seesaw<T, DK, DV, BN, PAGED> from a 1024-byte
// aligned base (cuflash/gpu/decode_tiles.py's decode_mla_seesaw_shape mirrors it;
// tests/test_shared_layout.py holds the two together).
template <int DK, int DV, int BN>
struct DecodeMlaSeesawShared {
    static constexpr int ROWS = 64;  // packed query rows a block: wgmma's M
    static constexpr int THREADS = 256;
    static constexpr int E = 2;             // float16 / bfloat16
    static constexpr int BLOCKS = DK / 64;  // column blocks of a key row
    static constexpr int q = 0;
    static constexpr int k = q + ROWS * DK * E;  // two stages of BN x DK
    // Floats a row: the running maximum, the two tiles' factors, the two warpgroups' sums.
    static constexpr int stats = k + 2 * BN * DK * E;
    // mbarriers: full[stage][block], then the hand-overs (factor 0; factor 1 and P1; P0).
    static constexpr int bars = stats + 5 * ROWS * 4;
    static constexpr int bytes = kSharedAlignSlack + bars + (2 * BLOCKS + 3) * 8;
    static_assert(DK % 64 == 0 && DV % 128 == 0 && DV < DK && BN == 64 && BN == ROWS,
                  "column blocks of 64; the values are the keys' first DV columns; P (ROWS x "
                  "BN) over the block past them");
};

template <typename T, int DK, int DV, int BN, bool PAGED>
constexpr int kvcache_decode_mla_seesaw_shared_bytes = DecodeMlaSeesawShared<DK, DV, BN>::bytes;

template <typename T, int DK, int DV, int BN, bool PAGED>
__global__ void __launch_bounds__(256, 1)
    kvcache_decode_mla_seesaw(CUFLASH_PARAMETERS(CUFLASH_DECODE_PARAMS, T, T, T)) {
    using Shared = DecodeMlaSeesawShared<DK, DV, BN>;
    using Op = TensorOp<T>;
    constexpr int ROWS = Shared::ROWS, NT = Shared::THREADS, NTILES = BN / 8;
    constexpr int BLOCKS = Shared::BLOCKS, HALF = DV / 2, OT = HALF / 8, HB = HALF / 64;
    constexpr int PSTEPS = BN / 16;
    constexpr unsigned ATOM = 1024;  // bytes of 8 swizzled rows: the stride between row groups
    static_assert(sizeof(T) == Shared::E, "16-bit inputs");
    static_assert(BN * 2 == NT / 2, "two threads of a warpgroup a key row");
    extern __shared__ float4 smem4[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    if (tid == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        unsigned dynamic_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
        if (dynamic_bytes < static_cast<unsigned>(Shared::bytes)) __trap();
    }
    T* base = reinterpret_cast<T*>((reinterpret_cast<unsigned long long>(smem4) + 1023) & ~1023ull);
    T* q_s = CUFLASH_SHARED_REGION(T, base, Shared::q);
    T* k_s = CUFLASH_SHARED_REGION(T, base, Shared::k);
    float* max_s = CUFLASH_SHARED_REGION(float, base, Shared::stats);
    float* factor_s = max_s + ROWS;      // factor_s[w * ROWS + row]: tile w's factor
    float* sum_s = factor_s + 2 * ROWS;  // sum_s[w * ROWS + row]: warpgroup w's sum
    unsigned long long* full = CUFLASH_SHARED_REGION(unsigned long long, base, Shared::bars);
    unsigned long long* factor0_ready = full + 2 * BLOCKS;
    unsigned long long* factor1_ready = factor0_ready + 1;  // and P1
    unsigned long long* p0_ready = factor0_ready + 2;

    const int wg = warp >> 2, wtid = tid & 127, warp_row = (warp & 3) * 16;
    const int hk = blockIdx.y, b = blockIdx.z;
    const int split = blockIdx.x / row_tiles, row0 = (blockIdx.x % row_tiles) * ROWS;
    const int rows_total = q_len * group;
    const int kv_len = cached_length(seqlens, seqlen_value, b, new_len, capacity) + new_len;
    const Mask mask{q_len, kv_len, win_left, win_right};
    const CacheRows rows = cache_rows(block_table, b, max_blocks, block_size, num_blocks);

    const int last_row = min(row0 + ROWS, rows_total) - 1;
    int range_lo, range_hi;
    mask.key_range(row0 / group, last_row / group + 1, range_lo, range_hi);
    const int tile_row[2] = {warp_row + g, warp_row + g + 8};
    const int my_row[2] = {row0 + tile_row[0], row0 + tile_row[1]};
    const bool modified = decode_modifies(alibi_slopes, softcap_log2);
    const RowKeys keys(mask, my_row, rows_total, group);
    const SplitTiles mine = split_tiles<BN>(range_lo, range_hi, num_splits, split);
    const int first = mine.first, count = mine.count;

    if (tid == 0) {
        for (int i = 0; i < 2 * BLOCKS + 3; ++i) mbarrier_init(full + i, 128);
    }
    if (tid < ROWS) max_s[tid] = neg_inf();

    // The key rows: this thread copies chunks h, h + 2, h + 4, h + 6 of each column block
    // of key row copy_row (one block id a tile, looked up a pair ahead; keys past
    // range_hi become zeros).
    const T* k_head = k_cache + hk * k_sh;
    const int copy_row = wtid >> 1, copy_h = wtid & 1;
    auto page_of = [&](int tile) {
        return tile < count
                   ? rows.page(min(range_lo + (first + tile) * BN + copy_row, range_hi - 1))
                   : 0;
    };
    // Column blocks [lo, hi) of tile `tile` into its stage, each block's arrival on its full
    // barrier once its copies land.
    auto load_blocks = [&](int tile, int page, int lo, int hi) {
        const int stage = tile & 1;
        uint4* dst = reinterpret_cast<uint4*>(k_s + stage * BN * DK);
        const int key = range_lo + (first + tile) * BN + copy_row;
        const bool valid = key < range_hi;
        const T* src = k_head + page * k_sb + rows.row(min(key, range_hi - 1)) * k_ss;
        for (int c = lo; c < hi; ++c) {
            if (aligned) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int chunk = c * 8 + copy_h + 2 * j;
                    cp_async_16_stream(dst + sw128_chunk<BN>(copy_row, chunk),
                                       valid ? src + chunk * 8 : k_head, valid);
                }
                cp_async_arrive(full + stage * BLOCKS + c);
            } else {  // rows off the 16-byte grid: element by element
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int chunk = c * 8 + copy_h + 2 * j;
                    T* d = reinterpret_cast<T*>(dst + sw128_chunk<BN>(copy_row, chunk));
#pragma unroll
                    for (int e = 0; e < 8; ++e) d[e] = valid ? src[chunk * 8 + e] : T{};
                }
                mbarrier_arrive(full + stage * BLOCKS + c);
            }
        }
    };
    // This warpgroup's blocks of a tile: its half of the value columns, and the columns past
    // DV (P's block) where the tile's S is the other's.
    auto reload = [&](int tile, int page) {
        if (tile >= count) return;
        load_blocks(tile, page, wg * HB, (wg + 1) * HB);
        if ((tile & 1) != wg) load_blocks(tile, page, 2 * HB, BLOCKS);
    };

    // Q's rows in the swizzled layout, element by element (q's rows need not be 16-byte
    // aligned; read once a block); zeros past the rows.
    constexpr int CH = DK / 8;
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
    fence_proxy_async();  // Q's stores before wgmma reads them
    __syncthreads();      // Q, the barriers' initialization and the maxima are in

    int pages[2] = {page_of(0), page_of(1)};
    reload(0, pages[0]);
    reload(1, pages[1]);

    float o[OT][4];
#pragma unroll
    for (int d = 0; d < OT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float row_sum[2] = {0.f, 0.f};
    const unsigned long long q_desc = wgmma_desc(q_s, 16, ATOM);
    const unsigned long long k_desc = wgmma_desc(k_s, 16, ATOM);
    const unsigned long long v_desc = wgmma_desc(k_s, BN * 64 * sizeof(T), ATOM);
    // P of stage w: the stage's column block 2 HB (the first past DV).
    auto p_of = [&](int w) { return k_s + (w * BN * DK + 2 * HB * BN * 64); };

    // S of this warpgroup's tile (stage wg): its column blocks in the order they are
    // reloaded (its own half of V's, then the others), each once it lands.
    auto scores = [&](unsigned parity, float(&s)[NTILES][4]) {
        const unsigned long long kb = wgmma_desc_plus(k_desc, wg * BN * DK * sizeof(T));
#pragma unroll
        for (int i = 0; i < BLOCKS; ++i) {
            const int c = i < HB ? wg * HB + i : i < 2 * HB ? (1 - wg) * HB + i - HB : i;
            mbarrier_wait(full + wg * BLOCKS + c, parity);
            fence_proxy_async();  // the copies before wgmma reads them
            wgmma_fence();        // not ptxas's own after the wait: every wgmma would be serialized
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
                const unsigned at = (ks * 16) * sizeof(T);
                Wgmma<T, BN>::ss(s, wgmma_desc_plus(q_desc, c * ROWS * 64 * sizeof(T) + at),
                                 wgmma_desc_plus(kb, c * BN * 64 * sizeof(T) + at), i + ks > 0);
            }
        }
        wgmma_commit();
        pin_registers(s);
        wgmma_wait_all();
        pin_registers(s);
    };
    // Scores of tile `tile` in base 2 after the modifiers and masks; each row's maximum
    // (over the quad) raised into top.
    auto tile_scores = [&](int tile, float(&s)[NTILES][4], float(&top)[2]) {
        const int key0 = range_lo + (first + tile) * BN;
        decode_tile_scores<T>(s, top, key0, t, keys.edge(key0, BN), modified, my_row, keys,
                              scale_log2, rows_total, group, hk, b, mask, alibi_slopes,
                              alibi_batch_stride, softcap_log2, user_args);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int o2 = 1; o2 < 4; o2 <<= 1)
                top[r] = fmaxf(top[r], __shfl_xor_sync(0xffffffffu, top[r], o2));
        }
    };
    // P = exp2(s - base) in the input type, as the A fragments of P V's k steps (pa[kk]: keys
    // 16 kk + 2 t, + 1 and 16 kk + 8 + 2 t, + 1 of rows g, g + 8), each row's sum added into
    // row_sum.
    auto probabilities = [&](float(&s)[NTILES][4], const float(&base)[2],
                             unsigned(&pa)[PSTEPS][4]) {
#pragma unroll
        for (int n = 0; n < NTILES; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] = fast_exp2(s[n][e] - base[e >> 1]);
                row_sum[e >> 1] += s[n][e];
            }
            pa[n >> 1][(n & 1) * 2] = Op::pack(s[n][0], s[n][1]);
            pa[n >> 1][(n & 1) * 2 + 1] = Op::pack(s[n][2], s[n][3]);
        }
    };
    // P (times `factor`, a row's, where scaled) into stage w's P block: row r, keys at the
    // swizzled place of one column block.
    auto store_p = [&](int w, const unsigned(&pa)[PSTEPS][4], const float(&factor)[2],
                       bool scaled) {
#pragma unroll
        for (int kk = 0; kk < PSTEPS; ++kk) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int r = j & 1, n = 2 * kk + (j >> 1), row = tile_row[r];
                unsigned word = pa[kk][j];
                if (scaled) {
                    T lo, hi;
                    lo.bits = static_cast<unsigned short>(word & 0xffffu);
                    hi.bits = static_cast<unsigned short>(word >> 16);
                    word = Op::pack(to_float(lo) * factor[r], to_float(hi) * factor[r]);
                }
                const int at = row * 64 + ((n ^ (row & 7)) << 3) + 2 * t;
                reinterpret_cast<unsigned*>(p_of(w))[at / 2] = word;
            }
        }
        fence_proxy_async();  // P's stores before wgmma reads it
    };
    auto scale_o = [&](const float(&f)[2]) {
        // Past the first tiles a row's maximum seldom moves (a NaN factor counts as moved).
        if (__any_sync(0xffffffffu, !(f[0] == 1.f && f[1] == 1.f))) {
#pragma unroll
            for (int d = 0; d < OT; ++d) {
#pragma unroll
                for (int e = 0; e < 4; ++e) o[d][e] *= f[e >> 1];
            }
        }
    };
    // O (this warpgroup's half) += P V of stage `stage`, P from registers.
    auto pv_local = [&](int stage, const unsigned(&pa)[PSTEPS][4]) {
        const unsigned long long vb =
            wgmma_desc_plus(v_desc, (stage * BN * DK + wg * HB * BN * 64) * sizeof(T));
        pin_registers(o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < PSTEPS; ++kk)
            Wgmma<T, HALF>::rs(o, pa[kk], wgmma_desc_plus(vb, kk * 16 * 64 * sizeof(T)), 1);
        wgmma_commit();
        pin_registers(o);
    };
    // O (this warpgroup's half) += P V of stage `stage`, P from the stage's P block.
    auto pv_shared = [&](int stage) {
        const unsigned long long vb =
            wgmma_desc_plus(v_desc, (stage * BN * DK + wg * HB * BN * 64) * sizeof(T));
        const unsigned long long pb = wgmma_desc(p_of(stage), 16, ATOM);
        pin_registers(o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < PSTEPS; ++kk)
            Wgmma<T, HALF>::ss_nb(o, wgmma_desc_plus(pb, kk * 16 * sizeof(T)),
                                  wgmma_desc_plus(vb, kk * 16 * 64 * sizeof(T)), 1);
        wgmma_commit();
        pin_registers(o);
    };

    for (int pair = 0; 2 * pair < count; ++pair) {
        const int t0 = 2 * pair, t1 = t0 + 1;
        const bool has1 = t1 < count;
        const unsigned parity = pair & 1;
        const int next_pages[2] = {page_of(t0 + 2), page_of(t1 + 2)};  // looked up early
        float s[NTILES][4];
        unsigned pa[PSTEPS][4];
        if (wg == 0) {
            scores(parity, s);
            const float m_old[2] = {max_s[tile_row[0]], max_s[tile_row[1]]};
            float top[2] = {m_old[0], m_old[1]};
            tile_scores(t0, s, top);
            float base[2], f0[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                base[r] = top[r] == neg_inf() ? 0.f : top[r];
                f0[r] = fast_exp2(m_old[r] - base[r]);
                row_sum[r] *= f0[r];
            }
            __syncwarp();  // the quad's reads of the maxima before lane t == 0 writes them
            if (t == 0) {
                for (int r = 0; r < 2; ++r) {
                    max_s[tile_row[r]] = top[r];
                    factor_s[tile_row[r]] = f0[r];
                }
            }
            mbarrier_arrive(factor0_ready);
            probabilities(s, base, pa);
            scale_o(f0);
            pv_local(0, pa);
            mbarrier_wait(factor1_ready, parity);
            const float f1[2] = {factor_s[ROWS + tile_row[0]], factor_s[ROWS + tile_row[1]]};
            wgmma_wait_all();  // P0 V0_L done: stage 0's first blocks are free
            pin_registers(o);
            reload(t0 + 2, next_pages[0]);
            store_p(0, pa, f1, true);
            mbarrier_arrive(p0_ready);
            row_sum[0] *= f1[0];
            row_sum[1] *= f1[1];
            scale_o(f1);
            if (has1) {
                fence_proxy_async();  // stage 1's copies (seen through P1's hand-over)
                pv_shared(1);
                wgmma_wait_all();
                pin_registers(o);
                reload(t1 + 2, next_pages[1]);
            }
        } else {
            float top[2] = {neg_inf(), neg_inf()};
            if (has1) {
                scores(parity, s);
                tile_scores(t1, s, top);
            }
            mbarrier_wait(factor0_ready, parity);
            float m0[2], f0[2], f1[2], base[2], f01[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                m0[r] = max_s[tile_row[r]];
                f0[r] = factor_s[tile_row[r]];
                top[r] = fmaxf(top[r], m0[r]);
                base[r] = top[r] == neg_inf() ? 0.f : top[r];
                f1[r] = fast_exp2(m0[r] - base[r]);
                f01[r] = f0[r] * f1[r];
                row_sum[r] *= f01[r];
            }
            __syncwarp();
            if (t == 0) {
                for (int r = 0; r < 2; ++r) {
                    max_s[tile_row[r]] = top[r];
                    factor_s[ROWS + tile_row[r]] = f1[r];
                }
            }
            if (has1) {
                probabilities(s, base, pa);
                store_p(1, pa, f1, false);
            }
            mbarrier_arrive(factor1_ready);
            scale_o(f01);
            if (has1) pv_local(1, pa);
            mbarrier_wait(p0_ready, parity);
            fence_proxy_async();  // stage 0's copies and P0 (seen through the hand-overs)
            pv_shared(0);
            if (has1) {
                wgmma_wait<1>();  // P1 V1_R done: stage 1's blocks of this warpgroup are free
                reload(t1 + 2, next_pages[1]);
            }
            wgmma_wait_all();  // (P0 f1) V0_R done
            pin_registers(o);
            reload(t0 + 2, next_pages[0]);
        }
    }
    cp_async_wait<0>();

    // Each warpgroup's row sums; the maximum is the last tile's. Each writes its columns.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int o2 = 1; o2 < 4; o2 <<= 1)
            row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], o2);
        if (t == 0) sum_s[wg * ROWS + tile_row[r]] = row_sum[r];
    }
    block_sync_divergent<NT>();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int m = my_row[r];
        if (m >= rows_total) continue;
        const int i = m / group, h = hk * group + (m - i * group);
        const int row = tile_row[r];
        const DecodeRowEnd end(sum_s[row] + sum_s[ROWS + row], max_s[row], sinks, h, i, b,
                               num_heads, q_len, num_splits, split);
#pragma unroll
        for (int d = 0; d < OT; ++d)
            end.store(out, part_out, DV, wg * HALF + d * 8 + 2 * t, o[d][2 * r], o[d][2 * r + 1]);
        if (wg == 0 && t == 0) end.store_lse(lse, part_lse);
    }
}

}  // namespace cuflash
