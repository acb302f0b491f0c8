// float32 attention backward on the 16-bit wgmma (sm_90a) with float32
// accuracy at head dims 136 to 256, dK and dV (dQ is
// backward_dq_float32_pieces_wide's): the scheme of
// sm90/backward_float32_pieces.cuh (float16 pieces, three products each, every
// sum the tensor cores round in a fresh accumulator over at most 64 terms) on
// tiles that fit shared memory when the pieces double every tile;
// deterministic. One block of two warpgroups per (64-key tile, KV head,
// batch), K and V pieces resident, looping over the query heads of the group
// and their 32-row query tiles that see the keys (Q and dO pieces, lse and
// Delta loaded a tile at a time):
//   warpgroup 0: S^T = K Q^T, P^T (times 2^14), handed to warpgroup 1
//                through shared memory; dV += P^T dO
//   warpgroup 1: dP^T = V dO^T, dS^T = P^T (dP^T - Delta) times 2^e_ds
//                (the tile's max |dS^T| in [2^13, 2^14)); dK += dS^T Q
// S^T and dP^T: wgmma m64n32k16, A and B K-major from shared memory, in fresh
// chunks of 4 k16 steps; dV and dK: m64n64k16 a 64-column chunk of the head
// dim at a time, A = the pieces of P^T or dS^T from registers, B N-major, in a
// fresh accumulator a query tile. The scales: as in
// sm90/backward_float32_pieces.cuh, every piece is its operand times a power
// of two, which the kernel takes out of each product exactly.
#pragma once
#include "common/params.cuh"
#include "common/mma_softmax.cuh"
#include "common/wgmma.cuh"
#include "common/float16_pieces.cuh"
#include "sm90/float32_pieces_wide_steps.cuh"

namespace cuflash {

// backward_float32_pieces_wide's shared memory, from a 1024-byte aligned base: the pieces
// (hi, lo) of K and V (BN x 256) and of Q and dO (BM x 256), P^T handed between the
// warpgroups ([QTILES][128] float4), lse and Delta of the query tile, four maxima.
template <int D>
struct BackwardFloat32PiecesWideShared {
    static constexpr int DP = 256, BN = 64, BM = 32, QTILES = BM / 8;
    static constexpr int KPLANE = BN * DP, QPLANE = BM * DP;
    static constexpr int E = static_cast<int>(sizeof(half_t)), F = static_cast<int>(sizeof(float));
    static constexpr int k = 0;
    static constexpr int v = k + 2 * KPLANE * E;
    static constexpr int q = v + 2 * KPLANE * E;
    static constexpr int dout = q + 2 * QPLANE * E;
    static constexpr int handoff = dout + 2 * QPLANE * E;
    static constexpr int lse = handoff + QTILES * 128 * static_cast<int>(sizeof(float4));
    static constexpr int delta = lse + BM * F;
    static constexpr int maxima = delta + BM * F;
    static constexpr int bytes = kSharedAlignSlack + maxima + 4 * F;
};

template <int D>
constexpr int backward_float32_pieces_wide_shared_bytes = BackwardFloat32PiecesWideShared<D>::bytes;

template <int D>
__global__ void __launch_bounds__(256, 1)
    backward_float32_pieces_wide(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_PARAMS, half_t, float)) {
    CUFLASH_BACKWARD_PIECES;
    using T = half_t;
    constexpr int DP = 256, BN = 64, BM = 32, NT = 256, QTILES = BM / 8;
    constexpr int KSTEPS = round_up(D, 16) / 16, COLUMN_CHUNKS = round_up(D, 64) / 64;
    constexpr int LOG2_GAIN = 14;  // P^T is computed times 2^14
    constexpr int KPLANE = BN * DP, QPLANE = BM * DP;
    static_assert(D % 8 == 0 && D > 128 && D <= DP, "head_dim");
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(dkv);
    CUFLASH_SEQUENCE_OF(kv_capacity);
    extern __shared__ float4 smem4[];
    using Shared = BackwardFloat32PiecesWideShared<D>;
    static_assert(Shared::KPLANE == KPLANE && Shared::QPLANE == QPLANE && Shared::BM == BM,
                  "the layout's tiles are the kernel's");
    T* base = reinterpret_cast<T*>((reinterpret_cast<unsigned long long>(smem4) + 1023) & ~1023ull);
    T* Ks = CUFLASH_SHARED_REGION(T, base, Shared::k);
    T* Vs = CUFLASH_SHARED_REGION(T, base, Shared::v);                       // (hi, lo)
    T* Qs = CUFLASH_SHARED_REGION(T, base, Shared::q);                       // (hi, lo)
    T* dOs = CUFLASH_SHARED_REGION(T, base, Shared::dout);                   // (hi, lo)
    float4* handoff = CUFLASH_SHARED_REGION(float4, base, Shared::handoff);  // P^T: [QTILES][128]
    float* lse_s = CUFLASH_SHARED_REGION(float, base, Shared::lse);
    float* delta_s = CUFLASH_SHARED_REGION(float, base, Shared::delta);
    float* maxima = CUFLASH_SHARED_REGION(float, base, Shared::maxima);  // 4

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wg = warp >> 2, warp_row = (warp & 3) * 16;  // the warp's 16 keys
    const int n0 = blockIdx.x * BN, hk = blockIdx.y, b = seq.batch;
    if (n0 >= seq.key_rows) return;  // packed: past the sequence's keys
    qh += seq.q_start * q_st.s;
    ql += seq.q_start * q_st.s;
    doh += seq.q_start * dout_st.s;
    dol += seq.q_start * dout_st.s;
    lse += seq.q_start;
    delta += seq.q_start;
    kh += seq.kv_start * k_st.s;
    kl += seq.kv_start * k_st.s;
    vh += seq.kv_start * v_st.s;
    vl += seq.kv_start * v_st.s;
    dk += seq.kv_start * dkv_st.s;
    dv += seq.kv_start * dkv_st.s;
    const int kv_head = b * gridDim.y + hk;
    const int e_k = ilogbf(k_scales[kv_head]), e_v = ilogbf(v_scales[kv_head]);

    const QuerySteps<BM> steps(mask, n0, n0 + BN, hk, group);
    auto load_step = [&](int step) {
        const int h = steps.head(step), m0 = steps.row0(step), rows = min(BM, mask.q_len - m0);
        const long long head_rows = (static_cast<long long>(b) * num_heads + h) * q_len;
        load_row_stats<BM, NT>(lse_s, delta_s, lse + head_rows + m0, delta + head_rows + m0, rows);
        const long long q_at = offset_of(q_st, b, h, m0), do_at = offset_of(dout_st, b, h, m0);
        cp_async_tile_sw128<BM, DP, NT, D>(Qs, qh + q_at, q_st.s, rows);
        cp_async_tile_sw128<BM, DP, NT, D>(Qs + QPLANE, ql + q_at, q_st.s, rows);
        cp_async_tile_sw128<BM, DP, NT, D>(dOs, doh + do_at, dout_st.s, rows);
        cp_async_tile_sw128<BM, DP, NT, D>(dOs + QPLANE, dol + do_at, dout_st.s, rows);
    };
    if (steps.count > 0) {
        const int keys = mask.kv_len - n0;
        const long long k_at = offset_of(k_st, b, hk, n0), v_at = offset_of(v_st, b, hk, n0);
        cp_async_tile_sw128<BN, DP, NT, D>(Ks, kh + k_at, k_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Ks + KPLANE, kl + k_at, k_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Vs, vh + v_at, v_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Vs + KPLANE, vl + v_at, v_st.s, keys);
        load_step(0);
    }
    cp_async_commit();

    // dV (warpgroup 0) or dK (warpgroup 1) of the 64 keys, 64-column chunks.
    float own[COLUMN_CHUNKS * 8][4];
#pragma unroll
    for (int d = 0; d < COLUMN_CHUNKS * 8; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) own[d][e] = 0.f;
    // Warpgroup 0 multiplies K by Q and then P^T by dO; warpgroup 1 V by dO, then dS^T by Q.
    const T* a_tile = wg == 0 ? Ks : Vs;
    const T* b_tile = wg == 0 ? Qs : dOs;
    const T* c_tile = wg == 0 ? dOs : Qs;

    for (int step = 0; step < steps.count; ++step) {
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // this step's tile is in shared memory
        const int h = steps.head(step), m0 = steps.row0(step), rows = min(BM, mask.q_len - m0);
        const int e_q = ilogbf(q_scales[b * num_heads + h]);
        const int e_do = ilogbf(do_scales[b * num_heads + h]);

        float x[QTILES][4];  // S^T, then P^T (warpgroup 0); dP^T, then dS^T (warpgroup 1)
        pieces_product<KSTEPS, BN, BM>(x, a_tile, a_tile + KPLANE, b_tile, b_tile + QPLANE);
        float factor;
        if (wg == 0) {
            probs<QTILES, LOG2_GAIN>(x, mask, !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN),
                                     m0, n0 + warp_row + g, t, lse_s,
                                     ldexpf(scale_log2, -(e_q + e_k)));
            hand_over(handoff, x);
            barrier_arrive(kHandToSecond);
            factor = ldexpf(1.f, -e_do);  // dV's products are 2^(14 + e_do) times
        } else {
            const float dp_unscale = ldexpf(1.f, -(e_do + e_v));
            float p[QTILES][4];
            barrier_wait(kHandToSecond);
            take_over(handoff, p);
#pragma unroll
            for (int n = 0; n < QTILES; ++n) {
                const float2 delta2 = load_shared_float2(delta_s + n * 8 + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    x[n][e] = p[n][e] * (x[n][e] * dp_unscale - ((e & 1) ? delta2.y : delta2.x));
            }
            const int e_ds = warpgroup_pow2_exponent(x, maxima);
            const float ds_scale = ldexpf(1.f, e_ds);
#pragma unroll
            for (int n = 0; n < QTILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) x[n][e] *= ds_scale;
            factor = ldexpf(1.f, -(e_ds + e_q));  // dK's: 2^(14 + e_ds + e_q) times
        }
        add_pieces_times<COLUMN_CHUNKS>(own, x, c_tile, c_tile + QPLANE, 0, factor);
        __syncthreads();  // both warpgroups are done with Q, dO and the handoff
        if (step + 1 < steps.count) load_step(step + 1);
        cp_async_commit();
    }
    cp_async_wait<0>();

    // dV = own 2^-14; dK = scale own 2^-14. Keys past the capacity are
    // skipped; every other row is written, zeros included.
    float* dst = wg == 0 ? dv : dk;
    const float out_scale = (wg == 0 ? 1.f : scale) * (1.f / (1 << LOG2_GAIN));
    store_key_rows<D>(dst + offset_of(dkv_st, b, hk, n0), dkv_st.s, own, warp_row, g, t,
                      seq.key_rows - n0, out_scale);
}

}  // namespace cuflash
