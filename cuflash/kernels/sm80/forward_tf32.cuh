// Tensor-core forward kernel for float32 (sm_80 and newer), any head_dim
// multiple of 8: the 16-bit kernel's plan (sm80/forward_mma_sync.cuh) on mma m16n8k8 TF32,
// at TF32 accuracy (allow_tf32=True; see common/mma_tf32.cuh).
//
// One block of BM / 16 warps per (query tile of BM rows, head, batch), 16
// rows a warp. Q stays in shared memory; K/V tiles of BN keys are
// double-buffered with cp.async. S = Q K^T and O += P V run on mma.sync with
// float32 accumulators; P goes from the S accumulators straight into the A
// fragments of P V (keys reordered to match V's fragment reads).
#pragma once
#include "common/params.cuh"
#include "common/mma_softmax.cuh"
#include "common/mma_tf32.cuh"

namespace cuflash {

// forward_tf32's shared memory: Q, then two buffers of K and of V, rows P = D + 4 floats.
template <int D, int BM, int BN>
struct ForwardTf32Shared {
    static constexpr int P = D + 4, E = static_cast<int>(sizeof(float));
    static constexpr int q = 0;
    static constexpr int k = q + BM * P * E;
    static constexpr int v = k + 2 * BN * P * E;
    static constexpr int bytes = v + 2 * BN * P * E;
};

template <int D, int BM, int BN>
constexpr int forward_tf32_shared_bytes = ForwardTf32Shared<D, BM, BN>::bytes;

template <int D, int BM, int BN>
__global__ void __launch_bounds__(BM * 2, 1)
    forward_tf32(CUFLASH_PARAMETERS(CUFLASH_FORWARD_PARAMS, float, float)) {
    constexpr int NT = BM * 2, P = D + 4, KSTEPS = D / 8, NTILES = BN / 8, DTILES = D / 8;
    static_assert(BM % 16 == 0 && BN % 8 == 0 && D % 8 == 0, "tile shape");
    using FragA = Tf32Frag<4>;
    using FragB = Tf32Frag<2>;
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(out);
    CUFLASH_SEQUENCE_OF(kv_len);
    extern __shared__ float4 smem4[];
    using Shared = ForwardTf32Shared<D, BM, BN>;
    static_assert(Shared::P == P, "the layout's tiles are the kernel's");
    float* base = reinterpret_cast<float*>(smem4);
    float* Qs = CUFLASH_SHARED_REGION(float, base, Shared::q);
    float* Ks = CUFLASH_SHARED_REGION(float, base, Shared::k);  // two buffers of BN x P
    float* Vs = CUFLASH_SHARED_REGION(float, base, Shared::v);  // two buffers of BN x P

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // the longest rows first
    const int h = blockIdx.y, b = seq.batch, hk = h / group;
    const int rows = min(BM, mask.q_len - m0);
    if (rows <= 0) return;  // packed: past the sequence's rows
    q += seq.q_start * q_st.s;
    k += seq.kv_start * k_st.s;
    v += seq.kv_start * v_st.s;
    out += seq.q_start * out_st.s;
    lse += seq.q_start;

    cp_async_tile_f32<BM, D, NT>(Qs, q + offset_of(q_st, b, h, m0), q_st.s, rows);
    int n_start, tiles;
    mask.key_tiles<BN>(m0, m0 + rows, n_start, tiles);
    const float* k_head = k + offset_of(k_st, b, hk, 0);
    const float* v_head = v + offset_of(v_st, b, hk, 0);
    auto load_kv = [&](int tile, int buf) {
        const int n0 = n_start + tile * BN, keys = mask.kv_len - n0;
        cp_async_tile_f32<BN, D, NT>(Ks + buf * BN * P, k_head + n0 * k_st.s, k_st.s, keys);
        cp_async_tile_f32<BN, D, NT>(Vs + buf * BN * P, v_head + n0 * v_st.s, v_st.s, keys);
    };
    if (tiles > 0) load_kv(0, 0);
    cp_async_commit();

    float o[1][DTILES][4], row_max[1][2], row_sum[1][2];
    init_rows(o, row_max, row_sum);

    for (int it = 0; it < tiles; ++it) {
        const int n0 = n_start + it * BN, buf = it & 1;
        if (it + 1 < tiles) load_kv(it + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const float* Kb = Ks + buf * BN * P;
        const float* Vb = Vs + buf * BN * P;

        // One k-step of S = Q K^T into acc.
        auto score_step = [&](int ks, float(&acc)[NTILES][4]) {
            FragA a;
            load_a_f32<P>(a, Qs, warp * 16, ks * 8);
#pragma unroll
            for (int n = 0; n < NTILES; ++n) {
                FragB kb;
                load_b_f32<P>(kb, Kb, n * 8, ks * 8);
                mma_f32(acc[n], a, kb);
            }
        };
        float s[1][NTILES][4];
        zero_tile(s[0]);
#pragma unroll(D <= 64 ? 2 : 1)  // bounds register pressure
        for (int ks = 0; ks < KSTEPS; ++ks) score_step(ks, s[0]);

        const bool edge = !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN);
        softmax_tile(s, o, row_max, row_sum, mask, edge, m0 + warp * 16, n0, scale_log2);

#pragma unroll
        for (int kk = 0; kk < NTILES; ++kk) {
            FragA pa;
            a_from_c(pa, s[0][kk]);
#pragma unroll
            for (int d = 0; d < DTILES; ++d) {
                FragB vb;
                load_b_f32_kmajor<P>(vb, Vb, kk * 8, d * 8);
                mma_f32(o[0][d], pa, vb);
            }
        }
        __syncthreads();  // this buffer is refilled two iterations later
    }
    cp_async_wait<0>();  // Q's copy, when no key tile was read

    const long long row_base = (static_cast<long long>(b) * num_heads + h) * q_len + m0;
    finish_rows(
        o, row_max, row_sum, warp * 16, rows, lse + row_base,
        [&](int row, int d, float x0, float x1) {
            *reinterpret_cast<float2*>(out + offset_of(out_st, b, h, m0 + row) + d * 8 + 2 * t) =
                make_float2(x0, x1);
        },
        sinks, h);
}

}  // namespace cuflash
