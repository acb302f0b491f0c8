// Tensor-core dQ of the deterministic backward for float16/bfloat16 on sm_80
// and newer (mma.sync): no atomics, each block owns its query rows' dQ and
// writes it once. The same pass as sm90/backward_dq_wgmma.cuh, on the instructions
// before Hopper.
//
// One block of BM / 16 warps per (query tile of BM rows, query head, batch
// entry), 16 rows a warp, looping over the key tiles its rows see (BN keys);
// launch bounds of two blocks an SM (ptxas spilled the modified role at the
// default's register target).
// Q and dO stay in swizzled shared memory; K and V of the next tile load by
// cp.async into a second buffer while this one is computed. Per key tile, on
// a warp's rows:
//   S = Q K^T, dP = dO V^T   mma m16n8k16; A (Q, dO) and B (K, V) by ldmatrix
//   P = exp2(S scale log2 e - lse log2 e), dS = P (dP - Delta)
//                            (query_tile_dscores: lse and Delta of the lane's
//                            two rows read once)
//   dQ += dS K               A = dS from the registers, B = K by ldmatrix.trans,
//                            as O += P V forward (sm80/forward_mma_sync.cuh)
// and dQ times the softmax scale is stored in the inputs' dtype at the end.
// With score modifiers dS takes their derivative; a block mask's view has the
// block's query tiles and key tiles.
#pragma once
#include "common/params.cuh"
#include "common/mma.cuh"

namespace cuflash {

// backward_dq_mma_sync's shared memory: Q and dO, then two buffers of K and of V, tiles
// DT columns wide.
template <typename T, int D, int BM, int BN>
struct BackwardDqMmaSyncShared {
    static constexpr int DT = head_dim_class(D), E = static_cast<int>(sizeof(T));
    static constexpr int q = 0;
    static constexpr int dout = q + BM * DT * E;
    static constexpr int k = dout + BM * DT * E;
    static constexpr int v = k + 2 * BN * DT * E;
    static constexpr int bytes = v + 2 * BN * DT * E;
};

template <typename T, int D, int BM, int BN, bool MODIFIED>
constexpr int backward_dq_mma_sync_shared_bytes = BackwardDqMmaSyncShared<T, D, BM, BN>::bytes;

template <typename T, int D, int BM, int BN, bool MODIFIED>
__global__ void __launch_bounds__(BM * 2, 2)
    backward_dq_mma_sync(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_DQ_PARAMS, T, T)) {
    using Op = TensorOp<T>;
    // Tiles DT = 64, 128 or 256 columns wide (the head_dim's class); products
    // over the head_dim and dQ's columns on its exact width DK (padding zeros).
    constexpr int DT = head_dim_class(D), DK = round_up(D, 16);
    constexpr int NT = BM * 2, NTILES = BN / 8, DTILES = DK / 8, KSTEPS = DK / 16;
    static_assert(BM % 16 == 0 && BN % 16 == 0 && D % 8 == 0 && D <= 256, "tile shape");
    // Scores the modifiers change take the per-element path on every tile.
    constexpr bool SCORES_MODIFIED = MODIFIED && !Modifiers<MODIFIED>::mask_only;
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(dq);
    CUFLASH_SEQUENCE_OF(kv_len);
    extern __shared__ float4 smem4[];
    using Shared = BackwardDqMmaSyncShared<T, D, BM, BN>;
    static_assert(Shared::DT == DT, "the layout's tiles are the kernel's");
    T* base = reinterpret_cast<T*>(smem4);
    T* Qs = CUFLASH_SHARED_REGION(T, base, Shared::q);
    T* dOs = CUFLASH_SHARED_REGION(T, base, Shared::dout);
    T* Ks = CUFLASH_SHARED_REGION(T, base, Shared::k);  // two buffers of BN x DT
    T* Vs = CUFLASH_SHARED_REGION(T, base, Shared::v);  // two buffers of BN x DT

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
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

    cp_async_tile<BM, DT, NT, D>(Qs, q + offset_of(q_st, b, h, m0), q_st.s, rows);
    cp_async_tile<BM, DT, NT, D>(dOs, dout + offset_of(dout_st, b, h, m0), dout_st.s, rows);
    int n_start, tiles;
    mask.key_tiles<BN>(m0, m0 + rows, n_start, tiles);
    mods.template narrow<BN>(m0 / BM, h, n_start, tiles);  // the block mask's range
    const T* k_head = k + offset_of(k_st, b, hk, 0);
    const T* v_head = v + offset_of(v_st, b, hk, 0);
    auto load_kv = [&](int tile, int buf) {
        load_kv_tiles<BN, DT, NT, D>(Ks, Vs, buf, k_head, k_st.s, v_head, v_st.s,
                                     n_start + tile * BN, mask.kv_len);
    };
    if (tiles > 0) load_kv(0, 0);
    cp_async_commit();

    const long long head_row0 = (static_cast<long long>(b) * num_heads + h) * q_len + m0;
    float row_lse[2], row_delta[2];
    query_row_stats(lse, delta, head_row0, warp * 16 + g, rows, row_lse, row_delta);

    float acc[DTILES][4];
#pragma unroll
    for (int d = 0; d < DTILES; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[d][e] = 0.f;

    // ldmatrix row and chunk of this lane for K's transposed fragments (dQ += dS K's B).
    const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_chunk = lane >> 4;
    for (int it = 0; it < tiles; ++it) {
        const int n0 = n_start + it * BN, buf = it & 1;
        if (it + 1 < tiles) load_kv(it + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();  // tile `it` (and Q, dO) are in shared memory
        const T* Kb = Ks + buf * BN * DT;
        const T* Vb = Vs + buf * BN * DT;

        float s[NTILES][4], dp[NTILES][4];
#pragma unroll
        for (int n = 0; n < NTILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
        paired_products<T, DT, KSTEPS, NTILES>(Qs, dOs, Kb, Vb, warp * 16, s, dp);
        const bool partial = mods.partial_tile(m0 / BM, n0 / BN);
        const bool edge = !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN) || partial;
        query_tile_dscores<SCORES_MODIFIED>(s, dp, mask, mods, edge, m0 + warp * 16 + g, n0, t,
                                            row_lse, row_delta, scale_log2, partial);

        // dQ += dS K: dS as the A fragments, 16 keys a step.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const unsigned da[4] = {Op::pack(dp[2 * kk][0], dp[2 * kk][1]),
                                    Op::pack(dp[2 * kk][2], dp[2 * kk][3]),
                                    Op::pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                    Op::pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
            for (int d = 0; d < DTILES; d += 2) {
                unsigned kb[4];
                ldmatrix_x4_trans(kb, Kb + swizzled<DT>(kk * 16 + a_row, d + a_chunk));
                Op::mma(acc[d], da, kb[0], kb[1]);
                Op::mma(acc[d + 1], da, kb[2], kb[3]);
            }
        }
        __syncthreads();  // this buffer is refilled in the next iteration
    }
    cp_async_wait<0>();  // Q's and dO's copies, when no key tile was read

    store_fragment_rows<T, D, DTILES>(dq + offset_of(dq_st, b, h, m0), dq_st.s, warp * 16, rows, 0,
                                      acc, scale);
}

}  // namespace cuflash
