// General backward kernels (every dtype, every head_dim multiple of 8 to 256).
//
//   backward_delta       Delta = rowsum(dO * O) and lse in base 2 (lse
//                        log2 e), float32 [B, H, S_q] each: the lse every
//                        dK/dV and dQ kernel takes; and zeros in the
//                        float32 dQ rows the atomic kernels add into.
//   backward_general     one block per (key tile, KV head, batch): loops over
//                        the query heads sharing the KV head and over the
//                        query tiles that can see the key tile, keeps dK and
//                        dV in registers and writes them once (no atomics).
//                        With ATOMIC_DQ it also adds dS K * scale into a
//                        float32 dQ buffer with atomics.
//   backward_dq_general  the deterministic dQ: one block per query tile,
//                        loops over key tiles, accumulates dQ in registers.
//   backward_dq_convert  the atomic dQ's float32 buffer into the dtype.
//
// Same 16 x 8 thread grid and shared-memory tiles as the forward kernel;
// P = exp2(S * scale * log2(e) - lse * log2(e)), dS = P * (dP - Delta).
#pragma once
#include "common/params.cuh"
#include "common/common.cuh"

namespace cuflash {

// DV: the head dim of dO and O (v's), D's unless v has its own.
template <typename T, int D, int DV = D>
__global__ void __launch_bounds__(128)
    backward_delta(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_DELTA_PARAMS, T)) {
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(out);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * 4 + warp, h = blockIdx.y, b = blockIdx.z;
    if (row >= q_len) return;
    const long long at = (static_cast<long long>(b) * num_heads + h) * q_len + row;
    // dQ's accumulator rows: accum_width floats (a multiple of 8) each, 16-byte
    // aligned; none when accum_width is 0 (the deterministic backward).
    float4* dq_row = reinterpret_cast<float4*>(dq_accum + at * accum_width);
    for (int c = lane; c < accum_width / 4; c += 32) dq_row[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    const T* dO = dout + offset_of(dout_st, b, h, row);
    const T* O = out + offset_of(out_st, b, h, row);
    float sum = 0.f;
    for (int d = lane; d < DV; d += 32) sum += to_float(dO[d]) * to_float(O[d]);
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
    if (lane == 0) {
        delta[at] = sum;
        // A row that sees no key (lse -inf) gets +inf: P = exp2(s - inf) = 0 for
        // every score, where -inf would give exp2(-inf + inf) = NaN on a score that
        // a modifier masked with -inf.
        lse_log2[at] = lse[at] == neg_inf() ? -neg_inf() : lse[at] * kLog2e;
    }
}

// dQ in the storage dtype (and layout) from the float32 accumulator of the
// atomic backward: `count` elements of the [B, H, q_len, D] rows, two a
// thread; the accumulator's rows are contiguous, `accum_width` floats each (D,
// or a tile width past D), dQ's at its strides.
template <typename T, int D>
__global__ void __launch_bounds__(256)
    backward_dq_convert(CUFLASH_PARAMETERS(CUFLASH_DQ_CONVERT_PARAMS, T)) {
    CUFLASH_STRIDES_OF(dq);
    const long long i = (static_cast<long long>(blockIdx.x) * 256 + threadIdx.x) * 2;
    if (i < count) {
        const long long row = i / D, head_row = row / q_len;  // head_row = b H + h
        const int col = static_cast<int>(i - row * D), s = static_cast<int>(row - head_row * q_len);
        const int b = static_cast<int>(head_row / num_heads);
        const int h = static_cast<int>(head_row - static_cast<long long>(b) * num_heads);
        const float2 x = *reinterpret_cast<const float2*>(dq_accum + row * accum_width + col);
        T* dst = dq + offset_of(dq_st, b, h, s) + col;
        dst[0] = from_float<T>(x.x);
        dst[1] = from_float<T>(x.y);
    }
}

// Zeros in the rows of a packed [total, H, D] output (contiguous) that no
// sequence covers: those before the first offset and from the last one on
// (with nondecreasing offsets, every other row belongs to a sequence). With
// offsets that keep the rules there are none, and every block returns at once.
template <typename T, int D>
__global__ void __launch_bounds__(256)
    packed_zero_outside(CUFLASH_PARAMETERS(CUFLASH_ZERO_OUTSIDE_PARAMS, T)) {
    const int first = clamped(offsets[0], 0, total);
    const int last = max(first, clamped(offsets[count], 0, total));
    const long long before = first * row_elements, after = (total - last) * row_elements;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < before + after; i += stride) {
        x[i < before ? i : last * row_elements + (i - before)] = from_float<T>(0.f);
    }
}

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
    float* Ks = reinterpret_cast<float*>(smem4);
    float* Vs = Ks + BN * LD;
    float* Qs = Vs + BN * LD;
    float* dOs = Qs + BM * LD;
    float* Ps = dOs + BM * LD;
    float* dSs = Ps + BM * LDP;
    float* lse_s = dSs + BM * LDP;
    float* delta_s = lse_s + BM;

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
