// The CUDA-core backward, dK and dV (every dtype, every head_dim multiple of
// 8 to 256): one block per (key tile, KV head, batch) loops over the query
// heads sharing the KV head and over the query tiles that can see the key
// tile, keeps dK and dV in registers and writes them once (no atomics). With
// ATOMIC_DQ it also adds dS K * scale into a float32 dQ buffer with atomics
// (backward_dq_convert turns it into the dtype); otherwise dQ is
// backward_dq_general's.
#pragma once
#include "common/params.cuh"
#include "common/common.cuh"
#include "simt/backward_general_tiles.cuh"

namespace cuflash {

// backward_general's shared memory (float32): K, V, Q and dO in rows of LD = D + 4, P
// and dS in rows of BN + 4, then lse and Delta of the query tile.
template <int D, int BM, int BN>
struct BackwardGeneralShared {
    static constexpr int LD = D + 4, LDP = BN + 4, E = static_cast<int>(sizeof(float));
    static constexpr int k = 0;
    static constexpr int v = k + BN * LD * E;
    static constexpr int q = v + BN * LD * E;
    static constexpr int dout = q + BM * LD * E;
    static constexpr int p = dout + BM * LD * E;
    static constexpr int ds = p + BM * LDP * E;
    static constexpr int lse = ds + BM * LDP * E;
    static constexpr int delta = lse + BM * E;
    static constexpr int bytes = delta + BM * E;
};

template <typename T, int D, int BM, int BN, bool ATOMIC_DQ, bool MODIFIED>
constexpr int backward_general_shared_bytes = BackwardGeneralShared<D, BM, BN>::bytes;

template <typename T, int D, int BM, int BN, bool ATOMIC_DQ, bool MODIFIED>
__global__ void __launch_bounds__(128, 1)
    backward_general(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_PARAMS, T, T)) {
    constexpr int NT = 128, NA = BN / 16, NE = D / 8, LD = D + 4, LDP = BN + 4;
    static_assert(BM % 16 == 0 && BN % 16 == 0 && D % 8 == 0, "tile shape");
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(dkv);
    CUFLASH_SEQUENCE_OF(kv_capacity);
    extern __shared__ float4 smem4[];
    using Shared = BackwardGeneralShared<D, BM, BN>;
    static_assert(Shared::LD == LD && Shared::LDP == LDP, "the layout's tiles are the kernel's");
    float* base = reinterpret_cast<float*>(smem4);
    float* Ks = CUFLASH_SHARED_REGION(float, base, Shared::k);
    float* Vs = CUFLASH_SHARED_REGION(float, base, Shared::v);
    float* Qs = CUFLASH_SHARED_REGION(float, base, Shared::q);
    float* dOs = CUFLASH_SHARED_REGION(float, base, Shared::dout);
    float* Ps = CUFLASH_SHARED_REGION(float, base, Shared::p);
    float* dSs = CUFLASH_SHARED_REGION(float, base, Shared::ds);
    float* lse_s = CUFLASH_SHARED_REGION(float, base, Shared::lse);
    float* delta_s = CUFLASH_SHARED_REGION(float, base, Shared::delta);

    const int ty = threadIdx.x >> 3, tx = threadIdx.x & 7;
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

    float dk_acc[NA][NE], dv_acc[NA][NE];
#pragma unroll
    for (int a = 0; a < NA; ++a)
#pragma unroll
        for (int e = 0; e < NE; ++e) dk_acc[a][e] = dv_acc[a][e] = 0.f;

    int m_lo, m_hi;
    mask.query_range(n0, n0 + BN, m_lo, m_hi);
    if (m_lo < m_hi) {
        const int keys = min(BN, mask.kv_len - n0);
        load_tile<BN, D, LD, NT>(Ks, k + offset_of(k_st, b, hk, n0), k_st.s, keys);
        load_tile<BN, D, LD, NT>(Vs, v + offset_of(v_st, b, hk, n0), v_st.s, keys);
    }
    for (int h = hk * group; h < (hk + 1) * group && m_lo < m_hi; ++h) {
        for (int m0 = m_lo - m_lo % BM; m0 < m_hi; m0 += BM) {
            __syncthreads();  // the previous tile's readers are done
            load_query_side<T, D, BM>(Qs, dOs, lse_s, delta_s, q, dout, lse, delta, q_st, dout_st,
                                      b, h, num_heads, m0, mask.q_len, q_len);
            __syncthreads();
            probabilities_and_dscores<D, BM, BN, sizeof(T) == 2>(
                Qs, dOs, Ks, Vs, lse_s, delta_s, Ps, dSs, mask, m0, n0, scale_log2, ty, tx,
                score_modifiers<MODIFIED>(alibi_slopes, alibi_batch_stride, softcap, h, mask,
                                          user_args));
            __syncthreads();
            // dV[j] += sum_r P[r][j] dO[r];  dK[j] += sum_r dS[r][j] Q[r]
#pragma unroll 2
            for (int r = 0; r < BM; ++r) {
#pragma unroll
                for (int a = 0; a < NA; ++a) {
                    const float p = Ps[r * LDP + ty + 16 * a];
                    const float ds = dSs[r * LDP + ty + 16 * a];
#pragma unroll
                    for (int e = 0; e < NE; ++e) {
                        dv_acc[a][e] += p * dOs[r * LD + tx + 8 * e];
                        dk_acc[a][e] += ds * Qs[r * LD + tx + 8 * e];
                    }
                }
            }
            if (ATOMIC_DQ) {  // dQ[r] += scale * sum_j dS[r][j] K[j]
                const long long row_base = (static_cast<long long>(b) * num_heads + h) * q_len + m0;
                const int rows = min(BM, mask.q_len - m0);
                for (int r = ty; r < rows; r += 16) {
#pragma unroll 4
                    for (int e = 0; e < NE; ++e) {
                        float sum = 0.f;
#pragma unroll
                        for (int j = 0; j < BN; ++j)
                            sum += dSs[r * LDP + j] * Ks[j * LD + tx + 8 * e];
                        atomicAdd(dq_accum + (row_base + r) * D + tx + 8 * e, sum * scale);
                    }
                }
            }
        }
    }

    // Every key row of the tile inside the capacity (the sequence, packed) is
    // written, zeros included.
    const long long row_base = offset_of(dkv_st, b, hk, n0);
#pragma unroll
    for (int a = 0; a < NA; ++a) {
        const int j = ty + 16 * a;
        if (n0 + j >= seq.key_rows) continue;
#pragma unroll
        for (int e = 0; e < NE; ++e) {
            dk[row_base + j * dkv_st.s + tx + 8 * e] = from_float<T>(dk_acc[a][e] * scale);
            dv[row_base + j * dkv_st.s + tx + 8 * e] = from_float<T>(dv_acc[a][e]);
        }
    }
}

}  // namespace cuflash
