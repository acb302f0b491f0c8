// Hopper (sm_90a) dQ of the deterministic backward for float16/bfloat16 on
// wgmma: no atomics, each block owns its query rows' dQ and writes it once.
//
// One block of two warpgroups per 128-row query tile (64 rows a warpgroup) of a
// query head, looping over the key tiles its rows see (BN keys: 64, or 32 in the
// 256 class, where Q, dO and two buffers of K and V fill shared memory). Q and
// dO stay in shared memory; K and V of the next tile load (cp.async, two
// buffers) while this one is computed. The 128-byte-swizzled tiles of
// common/wgmma.cuh; per key tile, for each warpgroup (M = 64 query rows):
//   S = Q K^T, dP = dO V^T           wgmma m64nBNk16, A and B K-major (smem)
//   P = exp2(S scale log2 e - lse log2 e), dS = P (dP - Delta) (registers;
//   lse and Delta of the thread's two rows are read once)
//   dQ += dS K                       wgmma m64nDk16, A = dS from the registers,
//                                    B = K N-major (smem), as O += P V forward
// and dQ times the softmax scale is stored in the inputs' dtype at the end.
// With score modifiers dS takes their derivative (ScoreModifiers::apply2); a
// block mask's view is the forward's (the same query and key tiles). The
// mma.sync kernel of the same pass is sm80/backward_dq_mma_sync.cuh.
#pragma once
#include "common/params.cuh"
#include "common/mma_softmax.cuh"
#include "common/wgmma.cuh"

namespace cuflash {

// backward_dq_wgmma's shared memory, from a 1024-byte aligned base: Q and dO (BM x DL),
// then two buffers of K and of V (BN x DL; DL: the head_dim's class).
template <typename T, int D, int BN>
struct BackwardDqWgmmaShared {
    static constexpr int DL = head_dim_class(D), BM = 128, E = static_cast<int>(sizeof(T));
    static constexpr int q = 0;
    static constexpr int dout = q + BM * DL * E;
    static constexpr int k = dout + BM * DL * E;
    static constexpr int v = k + 2 * BN * DL * E;
    static constexpr int bytes = kSharedAlignSlack + v + 2 * BN * DL * E;
};

template <typename T, int D, int BN, bool MODIFIED, int DV = D>
constexpr int backward_dq_wgmma_shared_bytes = BackwardDqWgmmaShared<T, D, BN>::bytes;

template <typename T, int D, int BN, bool MODIFIED, int DV = D>
__global__ void __launch_bounds__(256, 1)
    backward_dq_wgmma(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_DQ_PARAMS, T, T)) {
    using Op = TensorOp<T>;
    // The exact head_dim in k16 steps (DK columns, padding zeros) in tiles of the
    // head_dim's class (DL columns, in blocks of 64).
    constexpr int DK = round_up(D, 16), DL = head_dim_class(D);
    constexpr int BM = 128, NT = 256, NTILES = BN / 8, DTILES = DK / 8, KSTEPS = DK / 16;
    constexpr unsigned ATOM = 1024;  // bytes of 8 swizzled rows: the stride between row groups
    static_assert(D % 8 == 0 && D <= 256 && (BN == 32 || BN == 64), "tile shape");
    // v's (and dO's) head dim DV may be below D (MLA): dO and V fill DVK columns of the
    // same tiles and dP = dO V^T takes DVK / 16 steps.
    constexpr int DVK = round_up(DV, 16), DVSTEPS = DVK / 16;
    static_assert(DV % 8 == 0 && DV <= D, "v's head dim: a multiple of 8, at most D");
    // Scores the modifiers change take the per-element path on every tile.
    constexpr bool SCORES_MODIFIED = MODIFIED && !Modifiers<MODIFIED>::mask_only;
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(dq);
    CUFLASH_SEQUENCE_OF(kv_len);
    extern __shared__ float4 smem4[];
    using Shared = BackwardDqWgmmaShared<T, D, BN>;
    static_assert(Shared::DL == DL && Shared::BM == BM, "the layout's tiles are the kernel's");
    T* base = reinterpret_cast<T*>((reinterpret_cast<unsigned long long>(smem4) + 1023) & ~1023ull);
    T* Qs = CUFLASH_SHARED_REGION(T, base, Shared::q);
    T* dOs = CUFLASH_SHARED_REGION(T, base, Shared::dout);
    T* Ks = CUFLASH_SHARED_REGION(T, base, Shared::k);  // two buffers of BN x DL
    T* Vs = CUFLASH_SHARED_REGION(T, base, Shared::v);  // two buffers of BN x DL

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wg = warp >> 2, warp_row = wg * 64 + (warp & 3) * 16;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // the longest rows first
    const int h = blockIdx.y, b = seq.batch, hk = h / group;
    const int rows = min(BM, mask.q_len - m0);
    if (rows <= 0) return;  // packed: past the sequence's rows
    q += seq.q_start * q_st.s;
    dout += seq.q_start * dout_st.s;
    lse += seq.q_start;
    delta += seq.q_start;
    dq += seq.q_start * dq_st.s;
    k += seq.kv_start * k_st.s;
    v += seq.kv_start * v_st.s;
    const auto mods =
        score_modifiers<MODIFIED>(alibi_slopes, alibi_batch_stride, softcap, h, mask, user_args);

    cp_async_tile_sw128<BM, DK, NT, D>(Qs, q + offset_of(q_st, b, h, m0), q_st.s, rows);
    cp_async_tile_sw128<BM, DVK, NT, DV>(dOs, dout + offset_of(dout_st, b, h, m0), dout_st.s, rows);
    int n_start, tiles;
    mask.key_tiles<BN>(m0, m0 + rows, n_start, tiles);
    mods.template narrow<BN>(m0 / BM, h, n_start, tiles);  // the block mask's range
    const T* k_head = k + offset_of(k_st, b, hk, 0);
    const T* v_head = v + offset_of(v_st, b, hk, 0);
    auto load_kv = [&](int tile, int buf) {
        const int n0 = n_start + tile * BN, keys = mask.kv_len - n0;
        cp_async_tile_sw128<BN, DK, NT, D>(Ks + buf * BN * DL, k_head + n0 * k_st.s, k_st.s, keys);
        cp_async_tile_sw128<BN, DVK, NT, DV>(Vs + buf * BN * DL, v_head + n0 * v_st.s, v_st.s,
                                             keys);
    };
    if (tiles > 0) load_kv(0, 0);
    cp_async_commit();

    const long long head_row0 = (static_cast<long long>(b) * num_heads + h) * q_len + m0;
    float row_lse[2], row_delta[2];
    query_row_stats(lse, delta, head_row0, warp_row + g, rows, row_lse, row_delta);

    float acc[DTILES][4];
#pragma unroll
    for (int d = 0; d < DTILES; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[d][e] = 0.f;

    for (int it = 0; it < tiles; ++it) {
        const int n0 = n_start + it * BN, buf = it & 1;
        if (it + 1 < tiles) load_kv(it + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        fence_proxy_async();
        __syncthreads();  // tile `it` (and Q, dO) are in shared memory
        const T* Kb = Ks + buf * BN * DL;
        const T* Vb = Vs + buf * BN * DL;

        // S = Q K^T and dP = dO V^T for this warpgroup's 64 rows, two groups.
        float s[NTILES][4], dp[NTILES][4];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            const int q_at = (ks >> 2) * (BM * 64) + wg * (64 * 64) + (ks & 3) * 16;
            const int kv_at = (ks >> 2) * (BN * 64) + (ks & 3) * 16;
            Wgmma<T, BN>::ss(s, wgmma_desc(Qs + q_at, 16, ATOM), wgmma_desc(Kb + kv_at, 16, ATOM),
                             ks > 0);
        }
        wgmma_commit();
#pragma unroll
        for (int ks = 0; ks < DVSTEPS; ++ks) {
            const int q_at = (ks >> 2) * (BM * 64) + wg * (64 * 64) + (ks & 3) * 16;
            const int kv_at = (ks >> 2) * (BN * 64) + (ks & 3) * 16;
            Wgmma<T, BN>::ss(dp, wgmma_desc(dOs + q_at, 16, ATOM), wgmma_desc(Vb + kv_at, 16, ATOM),
                             ks > 0);
        }
        wgmma_commit();
        const bool partial = mods.partial_tile(m0 / BM, n0 / BN);
        const bool edge = !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN) || partial;
        wgmma_wait<0>();
        pin_registers(s);
        pin_registers(dp);
        query_tile_dscores<SCORES_MODIFIED>(s, dp, mask, mods, edge, m0 + warp_row + g, n0, t,
                                            row_lse, row_delta, scale_log2, partial);

        // dQ += dS K: dS as the A fragments, 16 keys a step.
        unsigned dsa[BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            dsa[kk][0] = Op::pack(dp[2 * kk][0], dp[2 * kk][1]);
            dsa[kk][1] = Op::pack(dp[2 * kk][2], dp[2 * kk][3]);
            dsa[kk][2] = Op::pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
            dsa[kk][3] = Op::pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
        }
        pin_registers(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            Wgmma<T, DK>::rs(acc, dsa[kk], wgmma_desc(Kb + kk * 16 * 64, BN * 64 * sizeof(T), ATOM),
                             1);
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(acc);
        __syncthreads();  // this buffer is refilled in the next iteration
    }
    cp_async_wait<0>();  // Q's and dO's copies, when no key tile was read

    store_fragment_rows<T, D, DTILES>(dq + offset_of(dq_st, b, h, m0), dq_st.s, warp_row, rows, 0,
                                      acc, scale);
}

}  // namespace cuflash
