// Tensor-core backward kernel (dK, dV and optionally the atomic dQ) for
// float32 on sm_80 and newer, head_dim a multiple of 8 up to 128: the plan
// of the 16-bit kernel (sm80/backward_mma_sync.cuh) on mma m16n8k8 TF32, at TF32 accuracy
// (allow_tf32=True; see common/mma_tf32.cuh).
//
// One block of BN/16 warps per (key tile of BN keys, KV head, batch); each
// warp owns 16 keys and keeps their dK and dV in registers, looping over the
// query heads of the group and the query tiles of BM rows that see the key
// tile. Per query tile, with K and V resident in shared memory:
//   S^T = K Q^T and dP^T = V dO^T           (A from K/V, B from Q/dO)
//   P^T = exp2(S^T scale log2 e - lse log2 e), dS^T = P^T (dP^T - Delta)
//   dV += P^T dO and dK += dS^T Q            (A straight from the accumulators)
//   dQ += dS K scale (ATOMIC_DQ)            (dS^T through shared memory; warp w
//                                            takes m16 tile w % (BM/16) and a
//                                            1/(NW/(BM/16)) slice of D, 8 d-tiles
//                                            at a time; float32 atomics into dq_accum)
#pragma once
#include "common/params.cuh"
#include "common/mma_tf32.cuh"

namespace cuflash {

// backward_tf32's shared memory (float32): K, V, Q and dO in rows of P = D + 4, dS^T
// ([BN keys] rows of BM + 4), then lse and Delta of the query tile.
template <int D, int BM, int BN>
struct BackwardTf32Shared {
    static constexpr int P = D + 4, PQ = BM + 4, E = static_cast<int>(sizeof(float));
    static constexpr int k = 0;
    static constexpr int v = k + BN * P * E;
    static constexpr int q = v + BN * P * E;
    static constexpr int dout = q + BM * P * E;
    static constexpr int ds = dout + BM * P * E;
    static constexpr int lse = ds + BN * PQ * E;
    static constexpr int delta = lse + BM * E;
    static constexpr int bytes = delta + BM * E;
};

template <int D, int BM, int BN, bool ATOMIC_DQ>
constexpr int backward_tf32_shared_bytes = BackwardTf32Shared<D, BM, BN>::bytes;

template <int D, int BM, int BN, bool ATOMIC_DQ>
__global__ void __launch_bounds__(BN * 2, 1)
    backward_tf32(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_PARAMS, float, float)) {
    constexpr int NT = BN * 2, NW = BN / 16, P = D + 4, PQ = BM + 4;
    constexpr int KSTEPS = D / 8, QTILES = BM / 8, DTILES = D / 8;
    // dQ work split: warp w takes m16 tile w % QM and a slice of DQ_SLICE d-tiles.
    constexpr int QM = BM / 16, DQ_SLICE = (DTILES + NW / QM - 1) / (NW / QM);
    constexpr int DQ_CHUNK = DQ_SLICE < 8 ? DQ_SLICE : 8;  // accumulators at a time
    static_assert(BN % 16 == 0 && BM % 16 == 0 && NW % QM == 0, "tile shape");
    using FragA = Tf32Frag<4>;
    using FragB = Tf32Frag<2>;
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(dkv);
    CUFLASH_SEQUENCE_OF(kv_capacity);
    extern __shared__ float4 smem4[];
    using Shared = BackwardTf32Shared<D, BM, BN>;
    static_assert(Shared::P == P && Shared::PQ == PQ, "the layout's tiles are the kernel's");
    float* base = reinterpret_cast<float*>(smem4);
    float* Ks = CUFLASH_SHARED_REGION(float, base, Shared::k);
    float* Vs = CUFLASH_SHARED_REGION(float, base, Shared::v);
    float* Qs = CUFLASH_SHARED_REGION(float, base, Shared::q);
    float* dOs = CUFLASH_SHARED_REGION(float, base, Shared::dout);
    float* dSs = CUFLASH_SHARED_REGION(float, base, Shared::ds);  // dS^T, [BN keys][PQ]
    float* lse_s = CUFLASH_SHARED_REGION(float, base, Shared::lse);
    float* delta_s = CUFLASH_SHARED_REGION(float, base, Shared::delta);

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

    float dk_acc[DTILES][4], dv_acc[DTILES][4];
#pragma unroll
    for (int d = 0; d < DTILES; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[d][e] = dv_acc[d][e] = 0.f;

    int m_lo, m_hi;
    mask.query_range(n0, n0 + BN, m_lo, m_hi);
    if (m_lo < m_hi) {
        const int keys = mask.kv_len - n0;
        cp_async_tile_f32<BN, D, NT>(Ks, k + offset_of(k_st, b, hk, n0), k_st.s, keys);
        cp_async_tile_f32<BN, D, NT>(Vs, v + offset_of(v_st, b, hk, n0), v_st.s, keys);
    }
    for (int h = hk * group; h < (hk + 1) * group && m_lo < m_hi; ++h) {
        const long long head_rows = (static_cast<long long>(b) * num_heads + h) * q_len;
        for (int m0 = m_lo - m_lo % BM; m0 < m_hi; m0 += BM) {
            const int rows = min(BM, mask.q_len - m0);
            __syncthreads();  // the previous query tile's readers are done
            cp_async_tile_f32<BM, D, NT>(Qs, q + offset_of(q_st, b, h, m0), q_st.s, rows);
            cp_async_tile_f32<BM, D, NT>(dOs, dout + offset_of(dout_st, b, h, m0), dout_st.s, rows);
            load_row_stats<BM, NT>(lse_s, delta_s, lse + head_rows + m0, delta + head_rows + m0,
                                   rows);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();

            float st[QTILES][4], dpt[QTILES][4];
#pragma unroll
            for (int n = 0; n < QTILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
#pragma unroll 2
            for (int ks = 0; ks < KSTEPS; ++ks) {
                FragA ka, va;
                load_a_f32<P>(ka, Ks, warp * 16, ks * 8);
                load_a_f32<P>(va, Vs, warp * 16, ks * 8);
#pragma unroll
                for (int n = 0; n < QTILES; ++n) {
                    FragB qb, ob;
                    load_b_f32<P>(qb, Qs, n * 8, ks * 8);
                    load_b_f32<P>(ob, dOs, n * 8, ks * 8);
                    mma_f32(st[n], ka, qb);
                    mma_f32(dpt[n], va, ob);
                }
            }

            probs_and_dscores(st, dpt, mask, !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN), m0,
                              n0 + warp * 16 + g, t, lse_s, delta_s, scale_log2);

            // dV += P^T dO and dK += dS^T Q: A from the accumulators, B = dO / Q.
#pragma unroll
            for (int kk = 0; kk < QTILES; ++kk) {
                FragA pa, sa;
                a_from_c(pa, st[kk]);
                a_from_c(sa, dpt[kk]);
                if (ATOMIC_DQ) {  // keep dS^T for the dQ product
                    float* row = dSs + (warp * 16 + g) * PQ + kk * 8 + 2 * t;
                    *reinterpret_cast<float2*>(row) = make_float2(dpt[kk][0], dpt[kk][1]);
                    *reinterpret_cast<float2*>(row + 8 * PQ) = make_float2(dpt[kk][2], dpt[kk][3]);
                }
#pragma unroll
                for (int d = 0; d < DTILES; ++d) {
                    FragB ob, qb;
                    load_b_f32_kmajor<P>(ob, dOs, kk * 8, d * 8);
                    load_b_f32_kmajor<P>(qb, Qs, kk * 8, d * 8);
                    mma_f32(dv_acc[d], pa, ob);
                    mma_f32(dk_acc[d], sa, qb);
                }
            }

            if (ATOMIC_DQ) {  // dQ[m16 tile qm, d slice] += scale * dS K, 8 d-tiles at a time
                __syncthreads();
                const int qm = warp % QM, d_first = (warp / QM) * DQ_SLICE;
                const int d_count = min(DQ_SLICE, DTILES - d_first);
#pragma unroll 1
                for (int c0 = 0; c0 < d_count; c0 += DQ_CHUNK) {
                    float dq_acc[DQ_CHUNK][4];
#pragma unroll
                    for (int d = 0; d < DQ_CHUNK; ++d)
                        dq_acc[d][0] = dq_acc[d][1] = dq_acc[d][2] = dq_acc[d][3] = 0.f;
#pragma unroll 2
                    for (int kk = 0; kk < BN / 8; ++kk) {
                        FragA da;  // A = dS (queries x keys), read from dS^T
                        load_a_f32_kmajor<PQ>(da, dSs, kk * 8, qm * 16);
#pragma unroll
                        for (int d = 0; d < DQ_CHUNK; ++d) {
                            if (c0 + d >= d_count) break;
                            FragB kb;
                            load_b_f32_kmajor<P>(kb, Ks, kk * 8, (d_first + c0 + d) * 8);
                            mma_f32(dq_acc[d], da, kb);
                        }
                    }
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int row = qm * 16 + g + 8 * r;
                        if (row >= rows) continue;
                        float* dst =
                            dq_accum + (head_rows + m0 + row) * D + (d_first + c0) * 8 + 2 * t;
#pragma unroll
                        for (int d = 0; d < DQ_CHUNK; ++d) {
                            if (c0 + d >= d_count) break;
                            atomic_add_float2(dst + d * 8, dq_acc[d][2 * r] * scale,
                                              dq_acc[d][2 * r + 1] * scale);
                        }
                    }
                }
            }
        }
    }

    // Every key row of the tile inside the capacity is written, zeros included.
    const long long key_base = offset_of(dkv_st, b, hk, n0);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = warp * 16 + g + 8 * r;
        if (n0 + key >= seq.key_rows) continue;
        float* dk_row = dk + key_base + key * dkv_st.s + 2 * t;
        float* dv_row = dv + key_base + key * dkv_st.s + 2 * t;
#pragma unroll
        for (int d = 0; d < DTILES; ++d) {
            *reinterpret_cast<float2*>(dk_row + d * 8) =
                make_float2(dk_acc[d][2 * r] * scale, dk_acc[d][2 * r + 1] * scale);
            *reinterpret_cast<float2*>(dv_row + d * 8) =
                make_float2(dv_acc[d][2 * r], dv_acc[d][2 * r + 1]);
        }
    }
}

}  // namespace cuflash
