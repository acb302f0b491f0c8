// float32 attention backward on the 16-bit wgmma (sm_90a) with float32
// accuracy at head dims 136 to 256, dQ (the dQ pass of
// backward_float32_pieces_wide, same scheme and scales; deterministic): one
// block of two warpgroups per 64-row query tile, Q and dO pieces resident,
// looping over 32-key tiles:
//   warpgroup 0: S = Q K^T, P handed to warpgroup 1
//   warpgroup 1: dP = dO V^T, dS = P (dP - Delta) times 2^e_ds, handed back
//                to warpgroup 0
//   warpgroup w: dQ[:, 128 w, 128 w + 128) += dS K, 64 columns a chunk
#pragma once
#include "common/params.cuh"
#include "common/mma_softmax.cuh"
#include "common/wgmma.cuh"
#include "common/float16_pieces.cuh"
#include "sm90/float32_pieces_wide_steps.cuh"

namespace cuflash {

// backward_dq_float32_pieces_wide's shared memory, from a 1024-byte aligned base: the
// pieces (hi, lo) of Q and dO (BM x 256) and of K and V (BN x 256), P and dS handed
// between the warpgroups ([NTILES][128] float4 each), lse and Delta of the rows, four
// maxima and dS's exponent.
template <int D>
struct BackwardDqFloat32PiecesWideShared {
    static constexpr int DP = 256, BM = 64, BN = 32, NTILES = BN / 8;
    static constexpr int QPLANE = BM * DP, KPLANE = BN * DP;
    static constexpr int E = static_cast<int>(sizeof(half_t)), F = static_cast<int>(sizeof(float));
    static constexpr int HANDOFF = NTILES * 128 * static_cast<int>(sizeof(float4));
    static constexpr int q = 0;
    static constexpr int dout = q + 2 * QPLANE * E;
    static constexpr int k = dout + 2 * QPLANE * E;
    static constexpr int v = k + 2 * KPLANE * E;
    static constexpr int to_second = v + 2 * KPLANE * E;
    static constexpr int to_first = to_second + HANDOFF;
    static constexpr int lse = to_first + HANDOFF;
    static constexpr int delta = lse + BM * F;
    static constexpr int maxima = delta + BM * F;
    static constexpr int ds_exponent = maxima + 4 * F;
    static constexpr int bytes = kSharedAlignSlack + ds_exponent + static_cast<int>(sizeof(int));
};

template <int D>
constexpr int backward_dq_float32_pieces_wide_shared_bytes =
    BackwardDqFloat32PiecesWideShared<D>::bytes;

template <int D>
__global__ void __launch_bounds__(256, 1)
    backward_dq_float32_pieces_wide(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_DQ_PARAMS, half_t, float)) {
    CUFLASH_BACKWARD_PIECES;
    using T = half_t;
    constexpr int DP = 256, BM = 64, BN = 32, NT = 256, NTILES = BN / 8;
    constexpr int KSTEPS = round_up(D, 16) / 16;
    constexpr int LOG2_GAIN = 14;  // P is computed times 2^14
    constexpr int QPLANE = BM * DP, KPLANE = BN * DP;
    static_assert(D % 8 == 0 && D > 128 && D <= DP, "head_dim");
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(dq);
    CUFLASH_SEQUENCE_OF(kv_len);
    extern __shared__ float4 smem4[];
    using Shared = BackwardDqFloat32PiecesWideShared<D>;
    static_assert(Shared::QPLANE == QPLANE && Shared::KPLANE == KPLANE && Shared::BM == BM &&
                      Shared::NTILES == NTILES,
                  "the layout's tiles are the kernel's");
    T* base = reinterpret_cast<T*>((reinterpret_cast<unsigned long long>(smem4) + 1023) & ~1023ull);
    T* Qs = CUFLASH_SHARED_REGION(T, base, Shared::q);  // (hi, lo), as dO, K and V
    T* dOs = CUFLASH_SHARED_REGION(T, base, Shared::dout);
    T* Ks = CUFLASH_SHARED_REGION(T, base, Shared::k);
    T* Vs = CUFLASH_SHARED_REGION(T, base, Shared::v);
    float4* to_second = CUFLASH_SHARED_REGION(float4, base, Shared::to_second);  // P
    float4* to_first = CUFLASH_SHARED_REGION(float4, base, Shared::to_first);    // dS
    float* lse_s = CUFLASH_SHARED_REGION(float, base, Shared::lse);
    float* delta_s = CUFLASH_SHARED_REGION(float, base, Shared::delta);
    float* maxima = CUFLASH_SHARED_REGION(float, base, Shared::maxima);        // 4
    int* ds_exponent = CUFLASH_SHARED_REGION(int, base, Shared::ds_exponent);  // e_ds, warpgroup 0

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wg = warp >> 2, warp_row = (warp & 3) * 16;  // the warp's 16 query rows
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;      // the longest rows first
    const int h = blockIdx.y, b = seq.batch, hk = h / group;
    const int rows = min(BM, mask.q_len - m0);
    if (rows <= 0) return;  // packed: past the sequence's rows
    qh += seq.q_start * q_st.s;
    ql += seq.q_start * q_st.s;
    doh += seq.q_start * dout_st.s;
    dol += seq.q_start * dout_st.s;
    lse += seq.q_start;
    delta += seq.q_start;
    dq += seq.q_start * dq_st.s;
    kh += seq.kv_start * k_st.s;
    kl += seq.kv_start * k_st.s;
    vh += seq.kv_start * v_st.s;
    vl += seq.kv_start * v_st.s;
    const int kv_head = b * (num_heads / group) + hk;
    const int e_q = ilogbf(q_scales[b * num_heads + h]),
              e_do = ilogbf(do_scales[b * num_heads + h]);
    const int e_k = ilogbf(k_scales[kv_head]), e_v = ilogbf(v_scales[kv_head]);
    const float score_log2 = ldexpf(scale_log2, -(e_q + e_k));
    const float dp_unscale = ldexpf(1.f, -(e_do + e_v));

    const long long head_rows = (static_cast<long long>(b) * num_heads + h) * q_len;
    load_row_stats<BM, NT>(lse_s, delta_s, lse + head_rows + m0, delta + head_rows + m0, rows);
    const long long q_at = offset_of(q_st, b, h, m0), do_at = offset_of(dout_st, b, h, m0);
    cp_async_tile_sw128<BM, DP, NT, D>(Qs, qh + q_at, q_st.s, rows);
    cp_async_tile_sw128<BM, DP, NT, D>(Qs + QPLANE, ql + q_at, q_st.s, rows);
    cp_async_tile_sw128<BM, DP, NT, D>(dOs, doh + do_at, dout_st.s, rows);
    cp_async_tile_sw128<BM, DP, NT, D>(dOs + QPLANE, dol + do_at, dout_st.s, rows);
    int n_start, tiles;
    mask.key_tiles<BN>(m0, m0 + rows, n_start, tiles);
    const long long k_head = offset_of(k_st, b, hk, 0), v_head = offset_of(v_st, b, hk, 0);
    auto load_keys = [&](int tile) {
        const int n0 = n_start + tile * BN, keys = mask.kv_len - n0;
        cp_async_tile_sw128<BN, DP, NT, D>(Ks, kh + k_head + n0 * k_st.s, k_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Ks + KPLANE, kl + k_head + n0 * k_st.s, k_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Vs, vh + v_head + n0 * v_st.s, v_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Vs + KPLANE, vl + v_head + n0 * v_st.s, v_st.s, keys);
    };
    if (tiles > 0) load_keys(0);
    cp_async_commit();

    // This warpgroup's 128 columns of dQ, two 64-column chunks.
    float own[16][4];
#pragma unroll
    for (int d = 0; d < 16; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) own[d][e] = 0.f;
    // Warpgroup 0 multiplies Q by K, warpgroup 1 dO by V.
    const T* a_tile = wg == 0 ? Qs : dOs;
    const T* b_tile = wg == 0 ? Ks : Vs;
    // The two rows of this thread: their lse (base 2, less P's gain) and Delta.
    float row_lse[2], row_delta[2];
    int row_lo[2], row_hi[2];  // the keys each row sees
    bool lse_read = false;

    for (int it = 0; it < tiles; ++it) {
        const int n0 = n_start + it * BN;
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // this key tile (and at first Q, dO, lse, Delta) is in
        if (!lse_read) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = warp_row + g + 8 * r;
                row_lse[r] = lse_s[row] - LOG2_GAIN;
                row_delta[r] = delta_s[row];
                mask.row_keys(m0 + row, row_lo[r], row_hi[r]);
            }
            lse_read = true;
        }
        float x[NTILES][4];  // S, then P (warpgroup 0); dP, then dS (warpgroup 1)
        pieces_product<KSTEPS, BM, BN>(x, a_tile, a_tile + QPLANE, b_tile, b_tile + KPLANE);
        const bool edge = !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN);
        int e_ds;
        if (wg == 0) {
#pragma unroll
            for (int n = 0; n < NTILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1, key = n0 + n * 8 + 2 * t + (e & 1);
                    float p = fast_exp2(x[n][e] * score_log2 - row_lse[r]);
                    if (edge && (key < row_lo[r] || key >= row_hi[r])) p = 0.f;
                    x[n][e] = p;
                }
            hand_over(to_second, x);
            barrier_arrive(kHandToSecond);
            barrier_wait(kHandToFirst);
            take_over(to_first, x);
            e_ds = *ds_exponent;
        } else {
            float p[NTILES][4];
            barrier_wait(kHandToSecond);
            take_over(to_second, p);
#pragma unroll
            for (int n = 0; n < NTILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    x[n][e] = p[n][e] * (x[n][e] * dp_unscale - row_delta[e >> 1]);
            e_ds = warpgroup_pow2_exponent(x, maxima);
            const float ds_scale = ldexpf(1.f, e_ds);
#pragma unroll
            for (int n = 0; n < NTILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) x[n][e] *= ds_scale;
            hand_over(to_first, x);
            if (threadIdx.x == 128) *ds_exponent = e_ds;
            barrier_arrive(kHandToFirst);
        }
        // dS (2^(14 + e_ds) times) K (2^e_k times): this warpgroup's columns.
        add_pieces_times<2>(own, x, Ks, Ks + KPLANE, 2 * wg, ldexpf(1.f, -e_ds));
        __syncthreads();  // both warpgroups are done with K, V and the handoffs
        if (it + 1 < tiles) load_keys(it + 1);
        cp_async_commit();
    }
    cp_async_wait<0>();  // Q's copy, when no key tile was read

    // dQ = scale dS K = own scale 2^-(14 + e_k).
    const float out_scale = ldexpf(scale, -(LOG2_GAIN + e_k));
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = warp_row + g + 8 * r;
        if (row >= rows) continue;
        float* dst = dq + offset_of(dq_st, b, h, m0 + row) + wg * (DP / 2);
#pragma unroll
        for (int d = 0; d < 16; ++d)
            if (wg * (DP / 2) + d * 8 < D)  // past D: the pieces' padding columns
                reinterpret_cast<float2*>(dst + d * 8)[t] =
                    make_float2(own[d][2 * r] * out_scale, own[d][2 * r + 1] * out_scale);
    }
}

}  // namespace cuflash
