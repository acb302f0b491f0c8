// Tensor-core backward kernel (dK, dV and optionally the atomic dQ) for
// float16/bfloat16 on sm_80 and newer.
//
// One block of BN/16 warps per (key tile of BN keys, KV head, batch); each
// warp owns 16 keys and keeps their dK and dV in registers for the whole
// block, looping over the query heads of the group and the query tiles
// (BM rows) that can see the key tile. K and V stay resident in swizzled
// shared memory; Q, dO, lse and Delta of the next query tile load by
// cp.async into a second buffer while this one is computed (as
// sm80/backward_mma_sync_split_d.cuh does). Per query tile:
//   S^T = K Q^T and dP^T = V dO^T           (mma, A from K/V, B from Q/dO)
//   P^T = exp2(S^T scale log2 e - lse log2 e), dS^T = P^T (dP^T - Delta)
//   dV += P^T dO and dK += dS^T Q            (A straight from the registers)
//   dQ += dS K scale (ATOMIC_DQ)            (dS^T through shared memory,
//                                            float32 atomics into dq_accum;
//                                            warp w takes m16 tile w % (BM/16)
//                                            and a 1/(NW/(BM/16)) slice of D)
// Only tiles that cross a mask boundary are masked element by element.
#pragma once
#include "common/params.cuh"
#include "common/mma.cuh"

namespace cuflash {

// backward_mma_sync's shared memory: K and V, two buffers of Q and of dO (tiles DT
// columns wide), dS^T ([BN keys][BM queries]), then two buffers of lse and of Delta.
template <typename T, int D, int BM, int BN>
struct BackwardMmaSyncShared {
    static constexpr int DT = head_dim_class(D), E = static_cast<int>(sizeof(T));
    static constexpr int k = 0;
    static constexpr int v = k + BN * DT * E;
    static constexpr int q = v + BN * DT * E;
    static constexpr int dout = q + 2 * BM * DT * E;
    static constexpr int ds = dout + 2 * BM * DT * E;
    static constexpr int lse = ds + BN * BM * E;
    static constexpr int delta = lse + 2 * BM * static_cast<int>(sizeof(float));
    static constexpr int bytes = delta + 2 * BM * static_cast<int>(sizeof(float));
};

template <typename T, int D, int BM, int BN, bool ATOMIC_DQ, bool MODIFIED>
constexpr int backward_mma_sync_shared_bytes = BackwardMmaSyncShared<T, D, BM, BN>::bytes;

template <typename T, int D, int BM, int BN, bool ATOMIC_DQ, bool MODIFIED>
__global__ void __launch_bounds__(BN * 2)
    backward_mma_sync(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_PARAMS, T, T)) {
    using Op = TensorOp<T>;
    // Tiles DT = 64 or 128 columns wide (the head_dim's class); products over
    // the head_dim and dK, dV on its exact width DK (padding columns zeros).
    constexpr int DT = head_dim_class(D), DK = round_up(D, 16);
    constexpr int NT = BN * 2, NW = BN / 16, KSTEPS = DK / 16, QTILES = BM / 8, DTILES = DK / 8;
    constexpr int QM = BM / 16, DQ_TILES = DT / 8 / (NW / QM);  // dQ work split
    static_assert(BN % 16 == 0 && BM % 32 == 0 && NW % QM == 0 && D % 8 == 0 && DT <= 128,
                  "tile shape");
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(dkv);
    CUFLASH_SEQUENCE_OF(kv_capacity);
    extern __shared__ float4 smem4[];
    using Shared = BackwardMmaSyncShared<T, D, BM, BN>;
    static_assert(Shared::DT == DT, "the layout's tiles are the kernel's");
    T* base = reinterpret_cast<T*>(smem4);
    T* Ks = CUFLASH_SHARED_REGION(T, base, Shared::k);
    T* Vs = CUFLASH_SHARED_REGION(T, base, Shared::v);
    T* Qs = CUFLASH_SHARED_REGION(T, base, Shared::q);               // two buffers of BM x DT
    T* dOs = CUFLASH_SHARED_REGION(T, base, Shared::dout);           // two buffers of BM x DT
    T* dSs = CUFLASH_SHARED_REGION(T, base, Shared::ds);             // dS^T, [BN keys][BM queries]
    float* lse_s = CUFLASH_SHARED_REGION(float, base, Shared::lse);  // two buffers of BM
    float* delta_s = CUFLASH_SHARED_REGION(float, base, Shared::delta);  // two buffers of BM

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
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
    // ldmatrix row/chunk of this lane for an A fragment and for a B pair.
    const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_chunk = lane >> 4;
    const int b_row = (lane & 7) + 8 * (lane >> 4), b_chunk = (lane >> 3) & 1;

    float dk_acc[DTILES][4], dv_acc[DTILES][4];
#pragma unroll
    for (int d = 0; d < DTILES; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[d][e] = dv_acc[d][e] = 0.f;

    // One query tile: the products, the softmax and the dK, dV (and dQ) updates.
    auto query_tile = [&](const T* Qb, const T* dOb, const float* lse_b, const float* delta_b,
                          long long head_rows, int m0, int rows, int h) {
        float st[QTILES][4], dpt[QTILES][4];
#pragma unroll
        for (int n = 0; n < QTILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
#pragma unroll 2
        for (int ks = 0; ks < KSTEPS; ++ks) {
            unsigned ka[4], va[4];
            ldmatrix_x4(ka, Ks + swizzled<DT>(warp * 16 + a_row, 2 * ks + a_chunk));
            ldmatrix_x4(va, Vs + swizzled<DT>(warp * 16 + a_row, 2 * ks + a_chunk));
#pragma unroll
            for (int n = 0; n < QTILES; n += 2) {
                unsigned qb[4], ob[4];
                ldmatrix_x4(qb, Qb + swizzled<DT>(n * 8 + b_row, 2 * ks + b_chunk));
                ldmatrix_x4(ob, dOb + swizzled<DT>(n * 8 + b_row, 2 * ks + b_chunk));
                Op::mma(st[n], ka, qb[0], qb[1]);
                Op::mma(st[n + 1], ka, qb[2], qb[3]);
                Op::mma(dpt[n], va, ob[0], ob[1]);
                Op::mma(dpt[n + 1], va, ob[2], ob[3]);
            }
        }

        const auto mods = score_modifiers<MODIFIED>(alibi_slopes, alibi_batch_stride, softcap, h,
                                                    mask, user_args);
        if constexpr (MODIFIED && !Modifiers<MODIFIED>::mask_only)
            modified_probs_and_dscores(st, dpt, mask, mods, m0, n0 + warp * 16 + g, t, lse_b,
                                       delta_b, scale_log2);
        else  // a mask-only kernel takes the user's mask as an edge (no block mask here)
            probs_and_dscores(st, dpt, mask,
                              !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN) ||
                                  Modifiers<MODIFIED>::user_mask,
                              m0, n0 + warp * 16 + g, t, lse_b, delta_b, scale_log2, mods);

        // dV += P^T dO and dK += dS^T Q: A from the registers, B = dO / Q transposed.
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            const unsigned pa[4] = {Op::pack(st[2 * kk][0], st[2 * kk][1]),
                                    Op::pack(st[2 * kk][2], st[2 * kk][3]),
                                    Op::pack(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                                    Op::pack(st[2 * kk + 1][2], st[2 * kk + 1][3])};
            const unsigned sa[4] = {Op::pack(dpt[2 * kk][0], dpt[2 * kk][1]),
                                    Op::pack(dpt[2 * kk][2], dpt[2 * kk][3]),
                                    Op::pack(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                                    Op::pack(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
            if (ATOMIC_DQ) {  // keep dS^T for the dQ product
                unsigned* row_lo =
                    reinterpret_cast<unsigned*>(dSs + swizzled<BM>(warp * 16 + g, 2 * kk) + 2 * t);
                unsigned* row_hi = reinterpret_cast<unsigned*>(
                    dSs + swizzled<BM>(warp * 16 + g + 8, 2 * kk) + 2 * t);
                unsigned* row_lo2 = reinterpret_cast<unsigned*>(
                    dSs + swizzled<BM>(warp * 16 + g, 2 * kk + 1) + 2 * t);
                unsigned* row_hi2 = reinterpret_cast<unsigned*>(
                    dSs + swizzled<BM>(warp * 16 + g + 8, 2 * kk + 1) + 2 * t);
                *row_lo = sa[0];
                *row_hi = sa[1];
                *row_lo2 = sa[2];
                *row_hi2 = sa[3];
            }
#pragma unroll
            for (int d = 0; d < DTILES; d += 2) {
                unsigned ob[4], qb[4];
                ldmatrix_x4_trans(ob, dOb + swizzled<DT>(kk * 16 + a_row, d + a_chunk));
                ldmatrix_x4_trans(qb, Qb + swizzled<DT>(kk * 16 + a_row, d + a_chunk));
                Op::mma(dv_acc[d], pa, ob[0], ob[1]);
                Op::mma(dv_acc[d + 1], pa, ob[2], ob[3]);
                Op::mma(dk_acc[d], sa, qb[0], qb[1]);
                Op::mma(dk_acc[d + 1], sa, qb[2], qb[3]);
            }
        }

        if (ATOMIC_DQ) {  // dQ[m16 tile warp % QM, d slice] += scale * dS K
            __syncthreads();
            atomic_dq_tile<T, D, BM, BN, DQ_TILES>(dSs, Ks, dq_accum + (head_rows + m0) * D,
                                                   warp % QM, (warp / QM) * DQ_TILES, rows, scale);
        }
    };

    const QuerySteps<BM> steps(mask, n0, n0 + BN, hk, group);
    auto load_step = [&](int step, int buf) {
        load_query_tile<BM, DT, D, NT>(Qs + buf * BM * DT, dOs + buf * BM * DT, lse_s + buf * BM,
                                       delta_s + buf * BM, q, q_st, dout, dout_st, lse, delta, b,
                                       steps.head(step), steps.row0(step), num_heads, mask.q_len,
                                       q_len);
    };
    if (steps.count > 0) {
        const int keys = mask.kv_len - n0;
        cp_async_tile<BN, DT, NT, D>(Ks, k + offset_of(k_st, b, hk, n0), k_st.s, keys);
        cp_async_tile<BN, DT, NT, D>(Vs, v + offset_of(v_st, b, hk, n0), v_st.s, keys);
        load_step(0, 0);
    }
    cp_async_commit();
    for (int step = 0; step < steps.count; ++step) {
        const int buf = step & 1;
        if (step + 1 < steps.count) load_step(step + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const int h = steps.head(step), m0 = steps.row0(step);
        const long long head_rows = (static_cast<long long>(b) * num_heads + h) * q_len;
        query_tile(Qs + buf * BM * DT, dOs + buf * BM * DT, lse_s + buf * BM, delta_s + buf * BM,
                   head_rows, m0, min(BM, mask.q_len - m0), h);
        __syncthreads();  // dS^T and this query buffer are rewritten next
    }

    const long long tile_key = offset_of(dkv_st, b, hk, n0);
    store_dkdv<T, D, DTILES>(dk + tile_key, dv + tile_key, dkv_st.s, warp * 16, seq.key_rows - n0,
                             0, dk_acc, dv_acc, scale);
}

}  // namespace cuflash
