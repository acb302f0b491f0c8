// The deterministic dQ on the CUDA cores (every dtype, every head_dim multiple
// of 8 to 256): one block per query tile loops over the key tiles, accumulates
// dQ in registers and writes it once.
#pragma once
#include "common/params.cuh"
#include "common/common.cuh"
#include "simt/backward_general_tiles.cuh"

namespace cuflash {

template <typename T, int D, int BM, int BN, bool MODIFIED>
__global__ void __launch_bounds__(128, 1)
    backward_dq_general(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_DQ_PARAMS, T, T)) {
    constexpr int NT = 128, RM = BM / 16, NE = D / 8, LD = D + 4, LDP = BN + 4;
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(dq);
    CUFLASH_SEQUENCE_OF(kv_len);
    extern __shared__ float4 smem4[];
    float* Ks = reinterpret_cast<float*>(smem4);
    float* Vs = Ks + BN * LD;
    float* Qs = Vs + BN * LD;
    float* dOs = Qs + BM * LD;
    float* dSs = dOs + BM * LD;
    float* lse_s = dSs + BM * LDP;
    float* delta_s = lse_s + BM;

    const int ty = threadIdx.x >> 3, tx = threadIdx.x & 7;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;
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

    load_query_side<T, D, BM>(Qs, dOs, lse_s, delta_s, q, dout, lse, delta, q_st, dout_st, b, h,
                              num_heads, m0, mask.q_len, q_len);
    const auto mods =
        score_modifiers<MODIFIED>(alibi_slopes, alibi_batch_stride, softcap, h, mask, user_args);
    int n_lo, n_hi;
    mask.key_range(m0, m0 + rows, n_lo, n_hi);

    float acc[RM][NE];
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int e = 0; e < NE; ++e) acc[i][e] = 0.f;

    const T* k_head = k + offset_of(k_st, b, hk, 0);
    const T* v_head = v + offset_of(v_st, b, hk, 0);
    for (int n0 = n_lo - n_lo % BN; n0 < n_hi; n0 += BN) {
        __syncthreads();
        const int keys = min(BN, mask.kv_len - n0);
        load_tile<BN, D, LD, NT>(Ks, k_head + n0 * k_st.s, k_st.s, keys);
        load_tile<BN, D, LD, NT>(Vs, v_head + n0 * v_st.s, v_st.s, keys);
        __syncthreads();
        probabilities_and_dscores<D, BM, BN, sizeof(T) == 2>(
            Qs, dOs, Ks, Vs, lse_s, delta_s, nullptr, dSs, mask, m0, n0, scale_log2, ty, tx, mods);
        __syncthreads();
        tile_accumulate<RM, NE, BN, LD, LDP>(dSs, Ks, acc, ty, tx);
    }

    const long long row_base = offset_of(dq_st, b, h, m0);
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        const int r = ty + 16 * i;
        if (r >= rows) continue;
#pragma unroll
        for (int e = 0; e < NE; ++e)
            dq[row_base + r * dq_st.s + tx + 8 * e] = from_float<T>(acc[i][e] * scale);
    }
}

}  // namespace cuflash
