// General forward kernel (every dtype, every head_dim multiple of 8 to 256).
//
// One block of 128 threads per (query tile of BM rows, head, batch). The
// threads form a 16 x 8 grid: for a BM x BN score tile each owns BM/16 rows
// and BN/8 columns, for the BM x D output each owns the same rows and D/8
// columns. Q, K, V tiles and the probabilities P sit in shared memory as
// float32; the online softmax runs in registers in base 2 with the scale
// folded into one multiply. Key tiles no row of the block can see are never
// visited; query tiles are issued most expensive first.
#pragma once
#include "common/common.cuh"
#include "common/params.cuh"

namespace cuflash {

// forward_general's shared memory (float32): Q, K and V in rows of LD = D + 4, then P
// in rows of BN + 4.
template <int D, int BM, int BN>
struct ForwardGeneralShared {
    static constexpr int LD = D + 4, LDP = BN + 4, E = static_cast<int>(sizeof(float));
    static constexpr int q = 0;
    static constexpr int k = q + BM * LD * E;
    static constexpr int v = k + BN * LD * E;
    static constexpr int p = v + BN * LD * E;
    static constexpr int bytes = p + BM * LDP * E;
};

template <typename T, int D, int BM, int BN, bool MODIFIED>
constexpr int forward_general_shared_bytes = ForwardGeneralShared<D, BM, BN>::bytes;

template <typename T, int D, int BM, int BN, bool MODIFIED>
__global__ void __launch_bounds__(128, 1)
    forward_general(CUFLASH_PARAMETERS(CUFLASH_FORWARD_PARAMS, T, T)) {
    constexpr int NT = 128, RM = BM / 16, RN = BN / 8, NE = D / 8;
    constexpr int LD = D + 4, LDP = BN + 4;
    static_assert(BM % 16 == 0 && BN % 8 == 0 && D % 8 == 0, "tile shape");
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(out);
    CUFLASH_SEQUENCE_OF(kv_len);
    extern __shared__ float4 smem4[];
    using Shared = ForwardGeneralShared<D, BM, BN>;
    static_assert(Shared::LD == LD && Shared::LDP == LDP, "the layout's tiles are the kernel's");
    float* base = reinterpret_cast<float*>(smem4);
    float* Qs = CUFLASH_SHARED_REGION(float, base, Shared::q);
    float* Ks = CUFLASH_SHARED_REGION(float, base, Shared::k);
    float* Vs = CUFLASH_SHARED_REGION(float, base, Shared::v);
    float* Ps = CUFLASH_SHARED_REGION(float, base, Shared::p);

    const int ty = threadIdx.x >> 3, tx = threadIdx.x & 7;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // the longest rows first
    const int h = blockIdx.y, b = seq.batch, hk = h / group;
    const int rows = min(BM, mask.q_len - m0);
    if (rows <= 0) return;  // packed: past the sequence's rows
    q += seq.q_start * q_st.s;
    k += seq.kv_start * k_st.s;
    v += seq.kv_start * v_st.s;
    out += seq.q_start * out_st.s;
    lse += seq.q_start;
    const auto mods =
        score_modifiers<MODIFIED>(alibi_slopes, alibi_batch_stride, softcap, h, mask, user_args);

    load_tile<BM, D, LD, NT>(Qs, q + offset_of(q_st, b, h, m0), q_st.s, rows);
    int n_lo, n_hi;
    mask.key_range(m0, m0 + rows, n_lo, n_hi);

    float acc[RM][NE], row_max[RM], row_sum[RM];
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        row_max[i] = neg_inf();
        row_sum[i] = 0.f;
#pragma unroll
        for (int e = 0; e < NE; ++e) acc[i][e] = 0.f;
    }

    const T* k_head = k + offset_of(k_st, b, hk, 0);
    const T* v_head = v + offset_of(v_st, b, hk, 0);
    for (int n0 = n_lo - n_lo % BN; n0 < n_hi; n0 += BN) {
        __syncthreads();  // the previous tile's readers are done
        const int keys = min(BN, mask.kv_len - n0);
        load_tile<BN, D, LD, NT>(Ks, k_head + n0 * k_st.s, k_st.s, keys);
        load_tile<BN, D, LD, NT>(Vs, v_head + n0 * v_st.s, v_st.s, keys);
        __syncthreads();

        float s[RM][RN];
#pragma unroll
        for (int i = 0; i < RM; ++i)
#pragma unroll
            for (int j = 0; j < RN; ++j) s[i][j] = 0.f;
        tile_dot<RM, RN, D, LD>(Qs, Ks, s, ty, tx);

#pragma unroll
        for (int i = 0; i < RM; ++i) {
            const int row = m0 + ty + 16 * i;
            float tile_max = neg_inf();
#pragma unroll
            for (int j = 0; j < RN; ++j) {
                if constexpr (MODIFIED) {
                    const int key = n0 + tx + 8 * j;
                    float derivative;
                    s[i][j] =
                        mask.visible(row, key) && mods.sees(row, key)
                            ? mods.template apply < sizeof(T) ==
                                  2 > (s[i][j] * (scale_log2 * kLn2), row, key, derivative) * kLog2e
                            : neg_inf();
                } else {
                    s[i][j] = mask.visible(row, n0 + tx + 8 * j) ? s[i][j] * scale_log2 : neg_inf();
                }
                tile_max = fmaxf(tile_max, s[i][j]);
            }
            const float new_max = fmaxf(row_max[i], row_max8(tile_max));
            const float base = new_max == neg_inf() ? 0.f : new_max;  // no -inf - -inf
            const float alpha = exp2f(row_max[i] - base);
            row_max[i] = new_max;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < RN; ++j) {
                const float p = exp2f(s[i][j] - base);
                sum += p;
                Ps[(ty + 16 * i) * LDP + tx + 8 * j] = p;
            }
            row_sum[i] = row_sum[i] * alpha + sum;  // this thread's columns only
#pragma unroll
            for (int e = 0; e < NE; ++e) acc[i][e] *= alpha;
        }
        __syncthreads();

        tile_accumulate<RM, NE, BN, LD, LDP>(Ps, Vs, acc, ty, tx);
    }

    const long long row_base = (static_cast<long long>(b) * num_heads + h) * q_len;
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        const int r = ty + 16 * i;
        float total = row_sum8(row_sum[i]);
        if (r >= rows) continue;
        float top = row_max[i], o_scale = 1.f;
        if (sinks != nullptr) o_scale = add_sink(sink_log2(sinks, h), top, total);  // sinks
        // A row that sees no key sums to exactly 0 (out 0, lse -inf); a NaN
        // from a NaN input is not 0, so it reaches out and lse, never hidden.
        const float inv = total != 0.f ? o_scale / total : 0.f;
        T* o_row = out + offset_of(out_st, b, h, m0 + r);
#pragma unroll
        for (int e = 0; e < NE; ++e) o_row[tx + 8 * e] = from_float<T>(acc[i][e] * inv);
        if (tx == 0) lse[row_base + m0 + r] = total != 0.f ? top * kLn2 + logf(total) : neg_inf();
    }
}

}  // namespace cuflash
