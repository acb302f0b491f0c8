// The steps the CUDA-core backward (backward_general) and its dQ pass
// (backward_dq_general) share: a query tile's loads, and P and dS of a
// (query tile, key tile) pair in shared memory. Same 16 x 8 thread grid and
// shared-memory tiles as the forward kernel (forward_general);
// P = exp2(S * scale * log2(e) - lse * log2(e)), dS = P * (dP - Delta).
#pragma once
#include "common/params.cuh"
#include "common/common.cuh"

namespace cuflash {

// Scores and dP of one (query tile, key tile) pair, turned into P and dS in
// shared memory. Qs/dOs hold the query tile, Ks/Vs the key tile.
template <int D, int BM, int BN, bool APPROX_TANH, typename Mods>
__device__ __forceinline__ void probabilities_and_dscores(const float* Qs, const float* dOs,
                                                          const float* Ks, const float* Vs,
                                                          const float* lse_s, const float* delta_s,
                                                          float* Ps, float* dSs, const Mask& mask,
                                                          int m0, int n0, float scale_log2, int ty,
                                                          int tx, const Mods& mods) {
    constexpr int RM = BM / 16, RN = BN / 8, LD = D + 4, LDP = BN + 4;
    float s[RM][RN], dp[RM][RN];
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RN; ++j) s[i][j] = dp[i][j] = 0.f;
    tile_dot<RM, RN, D, LD>(Qs, Ks, s, ty, tx);
    tile_dot<RM, RN, D, LD>(dOs, Vs, dp, ty, tx);
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        const int r = ty + 16 * i;
#pragma unroll
        for (int j = 0; j < RN; ++j) {
            const int c = tx + 8 * j;
            if constexpr (Mods::active) {  // the modifiers' derivative enters dS
                float derivative;
                const float score = mods.template apply<APPROX_TANH>(s[i][j] * (scale_log2 * kLn2),
                                                                     m0 + r, n0 + c, derivative) *
                                    kLog2e;
                const float p = mask.visible(m0 + r, n0 + c) && mods.sees(m0 + r, n0 + c)
                                    ? exp2f(score - lse_s[r])
                                    : 0.f;
                if (Ps) Ps[r * LDP + c] = p;
                dSs[r * LDP + c] = p * (dp[i][j] - delta_s[r]) * derivative;
            } else {
                const float p =
                    mask.visible(m0 + r, n0 + c) ? exp2f(s[i][j] * scale_log2 - lse_s[r]) : 0.f;
                if (Ps) Ps[r * LDP + c] = p;
                dSs[r * LDP + c] = p * (dp[i][j] - delta_s[r]);
            }
        }
    }
}

// Query rows [m0, m0 + BM) of head h (of q_len; q_rows a head in lse and
// Delta): Q, dO, lse (base 2) and Delta.
template <typename T, int D, int BM>
__device__ __forceinline__ void load_query_side(float* Qs, float* dOs, float* lse_s, float* delta_s,
                                                const T* q, const T* dout, const float* lse,
                                                const float* delta, const Strides& q_st,
                                                const Strides& dout_st, int b, int h, int num_heads,
                                                int m0, int q_len, int q_rows) {
    constexpr int LD = D + 4;
    const int rows = min(BM, q_len - m0);
    load_tile<BM, D, LD, 128>(Qs, q + offset_of(q_st, b, h, m0), q_st.s, rows);
    load_tile<BM, D, LD, 128>(dOs, dout + offset_of(dout_st, b, h, m0), dout_st.s, rows);
    const long long row_base = (static_cast<long long>(b) * num_heads + h) * q_rows + m0;
    for (int r = threadIdx.x; r < BM; r += 128) {
        lse_s[r] = r < rows ? lse[row_base + r] : 0.f;
        delta_s[r] = r < rows ? delta[row_base + r] : 0.f;
    }
}

}  // namespace cuflash
