// Hopper (sm_90a) backward kernel (dK, dV and optionally the atomic dQ) for
// float16/bfloat16 on wgmma.
//
// One block of two warpgroups per (key tile, KV head, batch), looping over
// the query heads of the group and the query tiles (BM = 128 rows at D = 64,
// 64 at D = 128 and 256) that see the key tile; each warp owns 16 keys
// and keeps their dK and dV (or its warpgroup's columns of them) in
// registers. K and V stay in shared memory;
// Q, dO, lse and Delta of the next query tile load (cp.async, two buffers)
// while this one is computed. All 16-bit tiles use the 128-byte-swizzled
// layout of common/wgmma.cuh. Two shapes:
// - D = 64 and 128: BN = 128 keys, warpgroup w owns keys [64 w, 64 w + 64)
//   and all D columns of their dK and dV.
// - D = 136 to 256 (SPLIT_D): dK and dV of 64 keys by D columns do not fit
//   one warpgroup's registers, so BN = 64 keys and the warpgroups share the
//   columns of all 64 keys' dK and dV (WarpgroupColumns: at D = 256 warpgroup
//   w owns columns [128 w, 128 w + 128) of each, at D = 192 warpgroup 0 owns
//   dV's first 128 and dK's first 64; below DK = 256 each warpgroup runs its
//   own copy of the loop, its columns compiled in). Warpgroup w computes S^T
//   and dP^T for query columns [32 w, 32 w + 32) only (EXCHANGE), both write
//   their P^T and dS^T halves to shared memory, and dV, dK take A from there.
//   dQ is backward_dq_wgmma's (sm90/backward_dq_wgmma.cuh), for every call: the
//   atomics of 64-key tiles were slower than that second pass
//   (docs/kernels/backward-sm90-wgmma.md).
// Per query tile, for each warpgroup (M = 64 keys):
//   S^T = K Q^T, dP^T = V dO^T      wgmma m64nBMk16, A and B K-major (smem)
//   P^T = exp2(S^T scale log2 e - lse log2 e), dS^T = P^T (dP^T - Delta)
//   dV += P^T dO, dK += dS^T Q       wgmma m64n{D or 128}k16, A from the
//                                    registers, B = dO / Q N-major (smem)
//   dQ += dS K scale (ATOMIC_DQ,     dS^T to shared memory (16-bit), then
//   D <= 128)                        wgmma with A = dS M-major and B = K
//                                    N-major, float32 atomics into dq_accum:
//                                    at D = 128 warpgroup w takes columns
//                                    [64 w, 64 w + 64) over all 128 keys.
// At D = 64 (BM = 128) each query tile carries twice the work per barrier of
// 64-row tiles, and dQ splits by queries: warpgroup w adds rows
// [64 w, 64 w + 64) over all 128 keys (one atomic an element).
// Only tiles that cross a mask boundary are masked element by element.
#pragma once
#include "common/params.cuh"
#include "common/mma_softmax.cuh"
#include "common/wgmma.cuh"

namespace cuflash {

// The columns of dV and dK a warpgroup owns, DK = round_up(D, 16) of each:
// [dv_first, dv_first + dv_count) of dV and likewise of dK. The counts are compiled
// in; every first column starts a 64-column block of the swizzled tiles.
template <int DV_COUNT, int DK_COUNT>
struct WarpgroupColumns {
    static constexpr int dv_count = DV_COUNT, dk_count = DK_COUNT;
    int dv_first, dk_first;
};

// Past head_dim 128 the warpgroups share the columns of dV (DVK of them) and dK (DK):
// warpgroup 0 the first 64 or 128 of each, warpgroup 1 the rest, the split with the
// fewest columns on the busier warpgroup (at DK = 256 128 of each; at DK = 192
// warpgroup 0 owns dV's first 128 and dK's first 64; at DK = 192, DVK = 128 (MLA)
// 64 of dV and 128 of dK).
struct SplitPlan {
    int dv_first, dk_first;
};
// The split must leave each warpgroup 32 to 144 columns of each (the N of
// Wgmma::ss_nb); none does: dv_first 0 (the registry pads such a v).
__host__ __device__ constexpr SplitPlan best_split(int dk, int dvk) {
    SplitPlan best{0, 0};
    int best_load = 1 << 30;
    for (int dv = 128; dv >= 64; dv -= 64)
        for (int dkc = 128; dkc >= 64; dkc -= 64) {
            const int first = dv + dkc, second = dk + dvk - dv - dkc;
            const int load = first > second ? first : second;
            const bool fits =
                dvk - dv >= 32 && dvk - dv <= 144 && dk - dkc >= 32 && dk - dkc <= 144;
            if (fits && load < best_load) {
                best_load = load;
                best = SplitPlan{dv, dkc};
            }
        }
    return best;
}
static_assert(best_split(256, 256).dv_first == 128 && best_split(256, 256).dk_first == 128,
              "DK = 256");
static_assert(best_split(192, 192).dv_first + best_split(192, 192).dk_first == 192, "DK = 192");
static_assert(best_split(192, 128).dv_first + best_split(192, 128).dk_first == 192, "MLA");

// backward_wgmma's shared memory, from a 1024-byte aligned base: K and V (BN x DT), two
// buffers of Q and of dO (BM x DT), dS^T and, past D = 128 (the warpgroups exchange
// them), P^T ([BN keys][BM queries]), then two buffers of lse and of Delta.
template <typename T, int D, int BM>
struct BackwardWgmmaShared {
    static constexpr int DT = head_dim_class(D), E = static_cast<int>(sizeof(T));
    static constexpr bool EXCHANGE = DT == 256;
    static constexpr int BN = EXCHANGE ? 64 : 128, F = static_cast<int>(sizeof(float));
    static constexpr int k = 0;
    static constexpr int v = k + BN * DT * E;
    static constexpr int q = v + BN * DT * E;
    static constexpr int dout = q + 2 * BM * DT * E;
    static constexpr int ds = dout + 2 * BM * DT * E;
    static constexpr int p = ds + BN * BM * E;
    static constexpr int lse = p + (EXCHANGE ? BN * BM : 0) * E;
    static constexpr int delta = lse + 2 * BM * F;
    static constexpr int bytes = kSharedAlignSlack + delta + 2 * BM * F;
};

template <typename T, int D, int BM, bool ATOMIC_DQ, bool MODIFIED, int DV = D>
constexpr int backward_wgmma_shared_bytes = BackwardWgmmaShared<T, D, BM>::bytes;

template <typename T, int D, int BM, bool ATOMIC_DQ, bool MODIFIED, int DV = D>
__global__ void __launch_bounds__(256, 1)
    backward_wgmma(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_PARAMS, T, T)) {
    using Op = TensorOp<T>;
    // Tiles are DT = 64, 128 or 256 columns wide (the head_dim's class); the
    // products over the head_dim take DK / 16 k16 steps (padding columns zeros).
    constexpr int DT = head_dim_class(D), DK = round_up(D, 16);
    // v's (and dO's, dV's) head dim DV may be below D (MLA): V and dO fill DVK columns
    // of the same tiles, dP^T takes DVK / 16 steps and dV has DVK columns.
    constexpr int DVK = round_up(DV, 16), DVSTEPS = DVK / 16;
    static_assert(DV % 8 == 0 && DV <= D, "v's head dim: a multiple of 8, at most D");
    constexpr bool SPLIT_D = DT == 256;  // warpgroups split the columns, not the keys
    constexpr bool EXCHANGE = SPLIT_D;   // and S^T, dP^T by queries, P^T, dS^T via smem
    constexpr int BN = SPLIT_D ? 64 : 128, NT = 256, QTILES = BM / 8, KSTEPS = DK / 16;
    constexpr unsigned ATOM = 1024;  // bytes of 8 swizzled rows: the stride between row groups
    // The atomic dQ per warpgroup: at D = 64 (BM = 128) split by queries (M = 64 of
    // them); at D = 128 by columns.
    constexpr bool DQ_SPLIT_QUERIES = BM == 128;
    constexpr int DQ_KSTEPS = BN / 16;
    static_assert((DT == 64 && BM == 128) || ((DT == 128 || DT == 256) && BM == 64), "tile shape");
    static_assert(!(SPLIT_D && ATOMIC_DQ), "past D = 128 dQ is backward_dq_wgmma's");
    // Query columns of S^T and dP^T a warpgroup computes: all, or with EXCHANGE
    // its half [SN w, SN w + SN) (P^T and dS^T then meet in shared memory).
    constexpr int SN = EXCHANGE ? BM / 2 : BM, STILES = SN / 8;
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(dkv);
    CUFLASH_SEQUENCE_OF(kv_capacity);
    extern __shared__ float4 smem4[];
    using Shared = BackwardWgmmaShared<T, D, BM>;
    static_assert(Shared::DT == DT && Shared::BN == BN && Shared::EXCHANGE == EXCHANGE,
                  "the layout's tiles are the kernel's");
    T* base = reinterpret_cast<T*>((reinterpret_cast<unsigned long long>(smem4) + 1023) & ~1023ull);
    T* Ks = CUFLASH_SHARED_REGION(T, base, Shared::k);
    T* Vs = CUFLASH_SHARED_REGION(T, base, Shared::v);
    T* Qs = CUFLASH_SHARED_REGION(T, base, Shared::q);               // two buffers of BM x DT
    T* dOs = CUFLASH_SHARED_REGION(T, base, Shared::dout);           // two buffers of BM x DT
    T* dSs = CUFLASH_SHARED_REGION(T, base, Shared::ds);             // dS^T, [BN keys][BM queries]
    T* Ps = CUFLASH_SHARED_REGION(T, base, Shared::p);               // P^T (EXCHANGE only)
    float* lse_s = CUFLASH_SHARED_REGION(float, base, Shared::lse);  // two buffers of BM
    float* delta_s = CUFLASH_SHARED_REGION(float, base, Shared::delta);  // two buffers of BM

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wg = warp >> 2, warp_row = (warp & 3) * 16;
    const int wg_key0 = SPLIT_D ? 0 : wg * 64;  // the warpgroup's first key in the tile
    const int key_row = wg_key0 + warp_row;     // the warp's
    const int q0 = EXCHANGE ? wg * SN : 0;      // and first S^T query column
    const int n0 = blockIdx.x * BN, hk = blockIdx.y, b = seq.batch;
    if (n0 >= seq.key_rows) return;  // packed: past the sequence's keys
    q += seq.q_start * q_st.s;
    dout += seq.q_start * dout_st.s;
    lse += seq.q_start;
    delta += seq.q_start;
    dq_accum += seq.q_start * D;
    k += seq.kv_start * k_st.s;
    v += seq.kv_start * v_st.s;
    dk += seq.kv_start * dkv_st.s;
    dv += seq.kv_start * dkv_st.s;

    QuerySteps<BM> steps(mask, n0, n0 + BN, hk, group);
    steps.narrow(score_modifiers<MODIFIED>(alibi_slopes, alibi_batch_stride, softcap, hk * group,
                                           mask, user_args),
                 blockIdx.x, hk, group);
    auto load_step = [&](int step, int buf) {
        const int h = steps.head(step), m0 = steps.row0(step), rows = min(BM, mask.q_len - m0);
        const long long head_rows = (static_cast<long long>(b) * num_heads + h) * q_len;
        load_row_stats<BM, NT>(lse_s + buf * BM, delta_s + buf * BM, lse + head_rows + m0,
                               delta + head_rows + m0, rows);
        cp_async_tile_sw128<BM, DK, NT, D>(Qs + buf * BM * DT, q + offset_of(q_st, b, h, m0),
                                           q_st.s, rows);
        cp_async_tile_sw128<BM, DVK, NT, DV>(dOs + buf * BM * DT,
                                             dout + offset_of(dout_st, b, h, m0), dout_st.s, rows);
    };
    if (steps.count > 0) {
        const int keys = mask.kv_len - n0;
        cp_async_tile_sw128<BN, DK, NT, D>(Ks, k + offset_of(k_st, b, hk, n0), k_st.s, keys);
        cp_async_tile_sw128<BN, DVK, NT, DV>(Vs, v + offset_of(v_st, b, hk, n0), v_st.s, keys);
        load_step(0, 0);
    }
    cp_async_commit();

    // The loop over query tiles for one warpgroup's columns (WarpgroupColumns):
    // with SPLIT_D below DK = 256 each warpgroup runs its own copy, its columns
    // compiled in.
    auto run = [&](auto columns) {
        using Columns = decltype(columns);
        constexpr int DV_TILES = Columns::dv_count / 8, DK_TILES = Columns::dk_count / 8;
        float dk_acc[DK_TILES][4], dv_acc[DV_TILES][4];
#pragma unroll
        for (int d = 0; d < DK_TILES; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk_acc[d][e] = 0.f;
#pragma unroll
        for (int d = 0; d < DV_TILES; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) dv_acc[d][e] = 0.f;

        // dQ (ATOMIC_DQ, up to D = 128): this warpgroup's 64 columns from dq_col over
        // all BN keys for queries [64 dq_block, + 64) of the tile.
        constexpr int DQ_COLS = 64;
        const int dq_col = DQ_SPLIT_QUERIES ? 0 : 64 * wg;
        const int dq_block = DQ_SPLIT_QUERIES ? wg : 0;

        // Per step: the next step's query tile starts loading, S^T and dP^T are
        // computed, then dQ and dV, dK are issued together and dQ is added to
        // dq_accum while dV and dK run. Every product of a step is waited for
        // within the step: a wgmma in flight across the loop's back edge, or an
        // accumulator read in the next step, makes ptxas serialize them all.
        for (int step = 0; step < steps.count; ++step) {
            const int buf = step & 1;
            cp_async_wait<0>();
            fence_proxy_async();
            // this step's tile is in shared memory; the previous step is done
            block_sync_divergent<NT>();
            if (step + 1 < steps.count) load_step(step + 1, buf ^ 1);
            cp_async_commit();
            const int h = steps.head(step), m0 = steps.row0(step), rows = min(BM, mask.q_len - m0);
            const T* Qb = Qs + buf * BM * DT;
            const T* dOb = dOs + buf * BM * DT;

            // S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys (queries from q0).
            float st[STILES][4], dpt[STILES][4];
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                const int kv_at = (ks >> 2) * (BN * 64) + wg_key0 * 64 + (ks & 3) * 16;
                const int q_at = (ks >> 2) * (BM * 64) + q0 * 64 + (ks & 3) * 16;
                Wgmma<T, SN>::ss(st, wgmma_desc(Ks + kv_at, 16, ATOM),
                                 wgmma_desc(Qb + q_at, 16, ATOM), ks > 0);
            }
            wgmma_commit();
#pragma unroll
            for (int ks = 0; ks < DVSTEPS; ++ks) {
                const int kv_at = (ks >> 2) * (BN * 64) + wg_key0 * 64 + (ks & 3) * 16;
                const int q_at = (ks >> 2) * (BM * 64) + q0 * 64 + (ks & 3) * 16;
                Wgmma<T, SN>::ss(dpt, wgmma_desc(Vs + kv_at, 16, ATOM),
                                 wgmma_desc(dOb + q_at, 16, ATOM), ks > 0);
            }
            wgmma_commit();
            const auto mods = score_modifiers<MODIFIED>(alibi_slopes, alibi_batch_stride, softcap,
                                                        h, mask, user_args);
            const bool partial = mods.partial_tile(blockIdx.x, m0 / BM);
            // Modified scores take P^T and dS^T in one pass after both products (the
            // modifiers' derivative enters dS^T); ALiBi alone (derivative 1) may take
            // the plain kernel's order, P^T while dP^T runs: not with a user's score
            // function, nor where the registers hold one path, not two (compile
            // reports: the D = 64 class, BM = 128, and the atomic kernels of the D =
            // 128 class short of 128 columns spill).
            constexpr bool SCORES_MODIFIED = MODIFIED && !Modifiers<MODIFIED>::mask_only;
            constexpr bool ALIBI_OVERLAPS = SCORES_MODIFIED && !Modifiers<MODIFIED>::user_score &&
                                            BM == 64 && !(ATOMIC_DQ && DT == 128 && DK < DT);
            if (SCORES_MODIFIED && (!ALIBI_OVERLAPS || mods.chain_rule())) {
                wgmma_wait<0>();
                pin_registers(st);
                pin_registers(dpt);
                modified_probs_and_dscores(st, dpt, mask, mods, m0 + q0, n0 + key_row + g, t,
                                           lse_s + buf * BM + q0, delta_s + buf * BM + q0,
                                           scale_log2, partial);
            } else {
                wgmma_wait<1>();  // S^T is done: P^T while dP^T runs
                pin_registers(st);
                const int key_lo = n0 + wg_key0;
                const bool edge =
                    !mask.tile_all_visible(m0, m0 + rows, key_lo, key_lo + 64) || partial;
                probs<STILES, 0, Modifiers<MODIFIED>, ALIBI_OVERLAPS>(
                    st, mask, edge, m0 + q0, n0 + key_row + g, t, lse_s + buf * BM + q0, scale_log2,
                    mods, partial);
                wgmma_wait<0>();
                pin_registers(dpt);
                dscores(st, dpt, t, delta_s + buf * BM + q0);
            }

            // Element (key, query) of a [BN keys][BM queries] tile in the swizzled
            // layout (column blocks of 64 queries); chunk = query / 8.
            auto store_pair = [&](T* tile, int key, int chunk, unsigned pair) {
                *reinterpret_cast<unsigned*>(tile + (chunk >> 3) * (BN * 64) + key * 64 +
                                             (((chunk & 7) ^ (key & 7)) << 3) + 2 * t) = pair;
            };
            // P^T and dS^T as A fragments (16 queries a step); dS^T (and with
            // EXCHANGE P^T) also to shared memory.
            unsigned pa[SN / 16][4], sa[SN / 16][4];
#pragma unroll
            for (int kk = 0; kk < SN / 16; ++kk) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int j = 2 * kk + half;
                    pa[kk][2 * half] = Op::pack(st[j][0], st[j][1]);
                    pa[kk][2 * half + 1] = Op::pack(st[j][2], st[j][3]);
                    sa[kk][2 * half] = Op::pack(dpt[j][0], dpt[j][1]);
                    sa[kk][2 * half + 1] = Op::pack(dpt[j][2], dpt[j][3]);
                    if (EXCHANGE) {
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            store_pair(Ps, key_row + g + 8 * r, q0 / 8 + j, pa[kk][2 * half + r]);
                            store_pair(dSs, key_row + g + 8 * r, q0 / 8 + j, sa[kk][2 * half + r]);
                        }
                    } else if (ATOMIC_DQ) {
#pragma unroll
                        for (int r = 0; r < 2; ++r)
                            store_pair(dSs, key_row + g + 8 * r, j, sa[kk][2 * half + r]);
                    }
                }
            }

            // dQ = dS K from dS^T in shared memory.
            float dq[DQ_COLS / 8][4];
            float* dq_rows =
                dq_accum + ((static_cast<long long>(b) * num_heads + h) * q_len + m0) * D;
            auto issue_dq = [&]() {
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < DQ_KSTEPS; ++kk)
                    Wgmma<T, DQ_COLS>::ss_mn(
                        dq,
                        wgmma_desc(dSs + dq_block * (BN * 64) + kk * 16 * 64, BN * 64 * sizeof(T),
                                   ATOM),
                        wgmma_desc(Ks + (dq_col / 64) * (BN * 64) + kk * 16 * 64,
                                   BN * 64 * sizeof(T), ATOM),
                        kk > 0);
                wgmma_commit();
            };
            auto add_dq = [&]() {  // once dQ's wgmma is done
                pin_registers(dq);
                const int col = dq_col;  // columns past D are padding
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = dq_block * 64 + warp_row + g + 8 * r;
                    float* dst = dq_rows + static_cast<long long>(row) * D + col + 2 * t;
#pragma unroll
                    for (int j = 0; j < DQ_COLS / 8; ++j)
                        atomic_add_float2(dst + j * 8, dq[j][2 * r] * scale,
                                          dq[j][2 * r + 1] * scale,
                                          row < rows && (D == DT || col + j * 8 < D));
                }
            };
            if (ATOMIC_DQ || EXCHANGE) {  // both warpgroups' halves are read
                fence_proxy_async();
                block_sync_divergent<NT>();
            }
            // With BM = 128 dQ goes after dV and dK: P^T and dS^T of 128 queries in
            // registers next to dQ's accumulators spill.
            constexpr bool DQ_AFTER = DQ_SPLIT_QUERIES;
            if (ATOMIC_DQ && !DQ_AFTER) issue_dq();

            // dV += P^T dO and dK += dS^T Q (16 queries a step; the warpgroup's
            // columns): A from the registers, or with EXCHANGE from shared memory (all
            // BM queries, both warpgroups' halves).
            wgmma_fence();
            constexpr int DV_N = Columns::dv_count, DK_N = Columns::dk_count;
            constexpr unsigned B_STRIDE = BM * 64 * sizeof(T);  // between 64-column blocks
            const T* dO_cols = dOb + (columns.dv_first / 64) * (BM * 64);
            const T* Q_cols = Qb + (columns.dk_first / 64) * (BM * 64);
            if constexpr (EXCHANGE) {
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk)
                    Wgmma<T, DV_N>::ss_nb(dv_acc, wgmma_desc(Ps + kk * 16, 16, ATOM),
                                          wgmma_desc(dO_cols + kk * 16 * 64, B_STRIDE, ATOM), 1);
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk)
                    Wgmma<T, DK_N>::ss_nb(dk_acc, wgmma_desc(dSs + kk * 16, 16, ATOM),
                                          wgmma_desc(Q_cols + kk * 16 * 64, B_STRIDE, ATOM), 1);
            } else {
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk)
                    Wgmma<T, DV_N>::rs(dv_acc, pa[kk],
                                       wgmma_desc(dO_cols + kk * 16 * 64, B_STRIDE, ATOM), 1);
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk)
                    Wgmma<T, DK_N>::rs(dk_acc, sa[kk],
                                       wgmma_desc(Q_cols + kk * 16 * 64, B_STRIDE, ATOM), 1);
            }
            wgmma_commit();

            if (ATOMIC_DQ && DQ_AFTER) {
                issue_dq();
                wgmma_wait<0>();
                add_dq();
            } else if (ATOMIC_DQ) {  // dQ is done (dV, dK may still run): add it
                wgmma_wait<1>();
                add_dq();
            }
            wgmma_wait<0>();
            pin_registers(dv_acc);
            pin_registers(dk_acc);
        }
        cp_async_wait<0>();

        const long long tile_key = offset_of(dkv_st, b, hk, n0);
        store_fragment_rows<T, D, DK_TILES>(dk + tile_key, dkv_st.s, key_row, seq.key_rows - n0,
                                            columns.dk_first, dk_acc, scale);
        store_fragment_rows<T, DV, DV_TILES>(dv + tile_key, dkv_st.s, key_row, seq.key_rows - n0,
                                             columns.dv_first, dv_acc, 1.f);
    };
    constexpr SplitPlan plan = best_split(DK, DVK);
    static_assert(!SPLIT_D || plan.dv_first > 0, "no split of dV and dK between the warpgroups");
    if constexpr (SPLIT_D && (DK < 256 || DVK < 256)) {  // a copy of the loop a warpgroup
        using First = WarpgroupColumns<plan.dv_first, plan.dk_first>;
        using Second = WarpgroupColumns<DVK - plan.dv_first, DK - plan.dk_first>;
        // The warpgroup index made warp-uniform for ptxas (each copy holds wgmma).
        if (__shfl_sync(0xffffffffu, wg, 0) == 0)
            run(First{0, 0});
        else
            run(Second{plan.dv_first, plan.dk_first});
    } else if constexpr (SPLIT_D) {  // 128 columns of each a warpgroup: one copy
        run(WarpgroupColumns<128, 128>{128 * wg, 128 * wg});
    } else {
        run(WarpgroupColumns<DVK, DK>{0, 0});
    }
}

}  // namespace cuflash
