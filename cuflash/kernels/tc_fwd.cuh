// Tensor-core forward kernel for float16/bfloat16 (sm_80 and newer).
//
// One block of BM/16 warps per (query tile of BM rows, head, batch); each
// warp owns 16 query rows. Q is loaded once (cp.async) and, up to D = 128,
// held in registers as mma A fragments (re-read from shared memory per tile
// above that, where the registers are needed for O); K/V tiles of BN keys are double-buffered in swizzled
// shared memory with cp.async so the next tile loads while this one is
// computed. S = Q K^T and O += P V run on mma.sync m16n8k16 with float32
// accumulators; the online softmax runs in registers in base 2, and P goes
// from the S accumulators to the A fragments of P V without shared memory.
// Only tiles that cross a mask boundary are masked element by element.
#pragma once
#include "mma.cuh"

namespace cuflash {

template <typename T, int D, int BM, int BN>
__global__ void __launch_bounds__(BM * 2) attention_fwd_tc(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse,
    CUFLASH_STRIDES(q), CUFLASH_STRIDES(k), CUFLASH_STRIDES(v),
    int num_heads, int group, CUFLASH_MASK_PARAMS, float scale_log2) {
    using Op = TensorOp<T>;
    constexpr int NT = BM * 2, KSTEPS = D / 16, NTILES = BN / 8, DTILES = D / 8;
    static_assert(BM % 16 == 0 && BN % 16 == 0 && D % 64 == 0, "tile shape");
    CUFLASH_STRIDES_OF(q); CUFLASH_STRIDES_OF(k); CUFLASH_STRIDES_OF(v);
    CUFLASH_MASK_OF;
    extern __shared__ float4 smem4[];
    T* Qs = reinterpret_cast<T*>(smem4);
    T* Ks = Qs + BM * D;      // two buffers of BN x D
    T* Vs = Ks + 2 * BN * D;  // two buffers of BN x D

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // the longest rows first
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
    const int rows = min(BM, mask.q_len - m0);

    cp_async_tile<BM, D, NT>(Qs, q + offset_of(q_st, b, h, m0), q_st.s, rows);
    int n_lo, n_hi;
    mask.key_range(m0, m0 + rows, n_lo, n_hi);
    const int n_start = n_lo - n_lo % BN;
    const int tiles = n_hi > n_lo ? (n_hi - n_start + BN - 1) / BN : 0;
    const T* k_head = k + offset_of(k_st, b, hk, 0);
    const T* v_head = v + offset_of(v_st, b, hk, 0);
    auto load_kv = [&](int tile, int buf) {
        const int n0 = n_start + tile * BN, keys = mask.kv_len - n0;
        cp_async_tile<BN, D, NT>(Ks + buf * BN * D, k_head + n0 * k_st.s, k_st.s, keys);
        cp_async_tile<BN, D, NT>(Vs + buf * BN * D, v_head + n0 * v_st.s, v_st.s, keys);
    };
    if (tiles > 0) load_kv(0, 0);
    cp_async_commit();

    float o[DTILES][4], row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int d = 0; d < DTILES; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;

    cp_async_wait<0>();
    __syncthreads();
    constexpr bool Q_IN_REGISTERS = D <= 128;
    constexpr int QF = Q_IN_REGISTERS ? KSTEPS : 1;
    auto load_q_fragment = [&](unsigned (&f)[4], int ks) {
        const int row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
        ldmatrix_x4(f, Qs + swizzled<D>(row, 2 * ks + (lane >> 4)));
    };
    unsigned qf[QF][4];
    if (Q_IN_REGISTERS) {
#pragma unroll
        for (int ks = 0; ks < QF; ++ks) load_q_fragment(qf[ks], ks);
    }

    for (int it = 0; it < tiles; ++it) {
        const int n0 = n_start + it * BN, buf = it & 1;
        if (it + 1 < tiles) load_kv(it + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const T* Kb = Ks + buf * BN * D;
        const T* Vb = Vs + buf * BN * D;

        float s[NTILES][4];
#pragma unroll
        for (int n = 0; n < NTILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            unsigned a_smem[4];
            if (!Q_IN_REGISTERS) load_q_fragment(a_smem, ks);
            const unsigned (&a)[4] = Q_IN_REGISTERS ? qf[ks % QF] : a_smem;
#pragma unroll
            for (int n = 0; n < NTILES; n += 2) {
                unsigned kb[4];
                ldmatrix_x4(kb, Kb + swizzled<D>(n * 8 + (lane & 7) + 8 * (lane >> 4),
                                                 2 * ks + ((lane >> 3) & 1)));
                Op::mma(s[n], a, kb[0], kb[1]);
                Op::mma(s[n + 1], a, kb[2], kb[3]);
            }
        }

        const bool edge = !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN);
        const int row0 = m0 + warp * 16 + g;
#pragma unroll
        for (int n = 0; n < NTILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] *= scale_log2;
                if (edge && !mask.visible(row0 + 8 * (e >> 1), n0 + n * 8 + 2 * t + (e & 1)))
                    s[n][e] = neg_inf();
            }

#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = neg_inf();
#pragma unroll
            for (int n = 0; n < NTILES; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float new_max = fmaxf(row_max[r], mx);
            const float base = new_max == neg_inf() ? 0.f : new_max;
            const float alpha = exp2f(row_max[r] - base);
            row_max[r] = new_max;
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < NTILES; ++n) {
                s[n][2 * r] = exp2f(s[n][2 * r] - base);
                s[n][2 * r + 1] = exp2f(s[n][2 * r + 1] - base);
                sum += s[n][2 * r] + s[n][2 * r + 1];
            }
            row_sum[r] = row_sum[r] * alpha + sum;
#pragma unroll
            for (int d = 0; d < DTILES; ++d) {
                o[d][2 * r] *= alpha;
                o[d][2 * r + 1] *= alpha;
            }
        }

#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const unsigned pa[4] = {Op::pack(s[2 * kk][0], s[2 * kk][1]),
                                    Op::pack(s[2 * kk][2], s[2 * kk][3]),
                                    Op::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    Op::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int d = 0; d < DTILES; d += 2) {
                unsigned vb[4];
                ldmatrix_x4_trans(vb, Vb + swizzled<D>(kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1),
                                                       d + (lane >> 4)));
                Op::mma(o[d], pa, vb[0], vb[1]);
                Op::mma(o[d + 1], pa, vb[2], vb[3]);
            }
        }
        __syncthreads();  // this buffer is refilled two iterations later
    }

    const long long row_base = (static_cast<long long>(b) * num_heads + h) * mask.q_len;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float total = row_sum[r];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        const int row = warp * 16 + g + 8 * r;
        if (row >= rows) continue;
        const float inv = total > 0.f ? 1.f / total : 0.f;
        unsigned* o_row = reinterpret_cast<unsigned*>(out + (row_base + m0 + row) * D);
#pragma unroll
        for (int d = 0; d < DTILES; ++d)
            o_row[d * 4 + t] = Op::pack(o[d][2 * r] * inv, o[d][2 * r + 1] * inv);
        if (t == 0)
            lse[row_base + m0 + row] = total > 0.f ? row_max[r] * kLn2 + logf(total) : neg_inf();
    }
}

}  // namespace cuflash
