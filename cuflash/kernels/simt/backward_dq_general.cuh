// The deterministic dQ on the CUDA cores (every dtype, every head_dim multiple
// of 8 to 256): one block per query tile loops over the key tiles, accumulates
// dQ in registers and writes it once.
#pragma once
#include "common/params.cuh"
#include "common/common.cuh"
#include "simt/backward_general_tiles.cuh"

namespace cuflash {

// backward_dq_general's shared memory (float32): K, V, Q and dO in rows of LD = D + 4,
// dS in rows of BN + 4, then lse and Delta of the query tile.
template <int D, int BM, int BN>
struct BackwardDqGeneralShared {
    static constexpr int LD = D + 4, LDP = BN + 4, E = static_cast<int>(sizeof(float));
    static constexpr int k = 0;
    static constexpr int v = k + BN * LD * E;
    static constexpr int q = v + BN * LD * E;
    static constexpr int dout = q + BM * LD * E;
    static constexpr int ds = dout + BM * LD * E;
    static constexpr int lse = ds + BM * LDP * E;
    static constexpr int delta = lse + BM * E;
    static constexpr int bytes = delta + BM * E;
};

template <typename T, int D, int BM, int BN, bool MODIFIED>
constexpr int backward_dq_general_shared_bytes = BackwardDqGeneralShared<D, BM, BN>::bytes;

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
    using Shared = BackwardDqGeneralShared<D, BM, BN>;
    static_assert(Shared::LD == LD && Shared::LDP == LDP, "the layout's tiles are the kernel's");
    float* base = reinterpret_cast<float*>(smem4);
    float* Ks = CUFLASH_SHARED_REGION(float, base, Shared::k);
    float* Vs = CUFLASH_SHARED_REGION(float, base, Shared::v);
    float* Qs = CUFLASH_SHARED_REGION(float, base, Shared::q);
    float* dOs = CUFLASH_SHARED_REGION(float, base, Shared::dout);
    float* dSs = CUFLASH_SHARED_REGION(float, base, Shared::ds);
    float* lse_s = CUFLASH_SHARED_REGION(float, base, Shared::lse);
    float* delta_s = CUFLASH_SHARED_REGION(float, base, Shared::delta);

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
