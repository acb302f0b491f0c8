// float32 attention forward on the 16-bit wgmma (sm_90a) with float32
// accuracy, on the float16 pieces of its operands (common/float16_pieces.cuh:
// each product runs as three, hi*hi + hi*lo + lo*hi). The tensor cores round
// each accumulation toward zero at the scale of the largest addend, the
// accumulator included, so sums run in short chunks in fresh accumulators
// added with round-to-nearest FADDs (docs/kernels/tf32.md and
// float32-pieces.md; scripts/tf32_split_model.py): S in two halves of D, O one
// key tile (64 keys) at a time; and within a chunk the small cross products
// (hi*lo, lo*hi) go first, while the accumulator is small, so that only the
// hi*hi steps round at the scale of the sum.
//
// The third of a call's kernels (cuflash.gpu.launch.forward), after
// float16_pieces_abs_max and float16_pieces_split (simt/) on each operand: one
// block of two warpgroups (64 query rows each) per query tile, 64-key tiles, K
// and V pieces double-buffered, not pipelined. The probabilities are computed
// times 2^14 (a gain folded into the exp2) so that small ones keep a normal
// second piece; the row sums drop that gain before lse is formed, and O drops
// it and s_v as it is stored.
#pragma once
#include "common/params.cuh"
#include "common/mma_softmax.cuh"
#include "common/wgmma.cuh"
#include "common/float16_pieces.cuh"

namespace cuflash {

// forward_float32_pieces's shared memory, from a 1024-byte aligned base: Q's two
// pieces (hi, lo), then two buffers of K's and of V's, BN x DP each (DP: the head_dim's
// class).
template <int D, int BN>
struct ForwardFloat32PiecesShared {
    static constexpr int DP = head_dim_class(D), BM = 128;
    static constexpr int E = static_cast<int>(sizeof(half_t));
    static constexpr int q_hi = 0;
    static constexpr int q_lo = q_hi + BM * DP * E;
    static constexpr int k = q_lo + BM * DP * E;
    static constexpr int v = k + 4 * BN * DP * E;
    static constexpr int bytes = kSharedAlignSlack + v + 4 * BN * DP * E;
};

template <int D, int BN>
constexpr int forward_float32_pieces_shared_bytes = ForwardFloat32PiecesShared<D, BN>::bytes;

// The forward on the pieces. q_scales, k_scales, v_scales: each head's scale
// from the split kernels ([B, H] and [B, H_kv]);
// scale_log2 = softmax_scale log2 e for the unscaled inputs.
template <int D, int BN>
__global__ void __launch_bounds__(256, D <= 64 ? 2 : 1)
    forward_float32_pieces(CUFLASH_PARAMETERS(CUFLASH_FORWARD_PARAMS, half_t, float)) {
    CUFLASH_FORWARD_PIECES;
    using T = half_t;
    // The tiles are DP = 64 or 128 columns wide (the head_dim's class), zeros past D.
    constexpr int DP = head_dim_class(D);
    constexpr int WG = 2, BM = 64 * WG, NT = 128 * WG, NTILES = BN / 8, DTILES = DP / 8;
    constexpr int KSTEPS = DP / 16, HALF = KSTEPS / 2;
    constexpr int LOG2_GAIN = 14;  // P is computed times 2^14
    constexpr unsigned ATOM = 1024;
    static_assert(D % 8 == 0 && D <= 128 && BN == 64, "tile shape");
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(out);
    CUFLASH_FORWARD_SEQUENCE;
    extern __shared__ float4 smem4[];
    using Shared = ForwardFloat32PiecesShared<D, BN>;
    static_assert(Shared::DP == DP && Shared::BM == BM, "the layout's tiles are the kernel's");
    T* base = reinterpret_cast<T*>((reinterpret_cast<unsigned long long>(smem4) + 1023) & ~1023ull);
    T* Qh = CUFLASH_SHARED_REGION(T, base, Shared::q_hi);
    T* Ql = CUFLASH_SHARED_REGION(T, base, Shared::q_lo);
    T* Ks = CUFLASH_SHARED_REGION(T, base, Shared::k);  // two buffers of (hi, lo), BN x DP each
    T* Vs = CUFLASH_SHARED_REGION(T, base, Shared::v);  // two buffers of (hi, lo)

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const int wg = warp >> 2, warp_row = wg * 64 + (warp & 3) * 16;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // the longest rows first
    const int h = blockIdx.y, b = seq.batch, hk = h / group;
    const int rows = min(BM, mask.q_len - m0);
    if (rows <= 0) return;  // packed: past the sequence's rows
    qh += seq.q_start * q_st.s;
    ql += seq.q_start * q_st.s;
    kh += seq.kv_start * k_st.s;
    kl += seq.kv_start * k_st.s;
    vh += seq.kv_start * v_st.s;
    vl += seq.kv_start * v_st.s;
    out += seq.q_start * out_st.s;
    lse += seq.q_start;
    const int kv_head = b * (num_heads / group) + hk;
    const float s_q = q_scales[b * num_heads + h], s_k = k_scales[kv_head], s_v = v_scales[kv_head];

    cp_async_tile_sw128<BM, DP, NT, D>(Qh, qh + offset_of(q_st, b, h, m0), q_st.s, rows);
    cp_async_tile_sw128<BM, DP, NT, D>(Ql, ql + offset_of(q_st, b, h, m0), q_st.s, rows);
    int n_start, tiles;
    mask.key_tiles<BN>(m0, m0 + rows, n_start, tiles);
    const long long k_head = offset_of(k_st, b, hk, 0), v_head = offset_of(v_st, b, hk, 0);
    auto load_kv = [&](int tile, int buf) {  // buffer `buf`: K hi, K lo, V hi, V lo
        const int n0 = n_start + tile * BN, keys = mask.kv_len - n0;
        T* kb = Ks + buf * 2 * BN * DP;
        T* vb = Vs + buf * 2 * BN * DP;
        cp_async_tile_sw128<BN, DP, NT, D>(kb, kh + k_head + n0 * k_st.s, k_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(kb + BN * DP, kl + k_head + n0 * k_st.s, k_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(vb, vh + v_head + n0 * v_st.s, v_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(vb + BN * DP, vl + v_head + n0 * v_st.s, v_st.s, keys);
    };
    if (tiles > 0) load_kv(0, 0);
    cp_async_commit();

    float o[1][DTILES][4], row_max[1][2], row_sum[1][2];
    init_rows(o, row_max, row_sum);
    // Scores of the scaled inputs are s_q s_k times the true ones.
    const float score_log2 = scale_log2 / (s_q * s_k);

    for (int it = 0; it < tiles; ++it) {
        const int n0 = n_start + it * BN, buf = it & 1;
        if (it + 1 < tiles) load_kv(it + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        fence_proxy_async();
        __syncthreads();
        const T* Kh = Ks + buf * 2 * BN * DP;
        const T* Kl = Kh + BN * DP;
        const T* Vh = Vs + buf * 2 * BN * DP;
        const T* Vl = Vh + BN * DP;

        // S = Q K^T in two chunks of DP / 2, each in a fresh accumulator: the
        // small cross products of a chunk first, then hi * hi (see the top).
        float s[1][NTILES][4], s_rest[1][NTILES][4];
        auto score_chunk = [&](float(&acc)[NTILES][4], int ks0) {
#pragma unroll
            for (int ks = ks0; ks < ks0 + HALF; ++ks) {
                const int q_at = (ks >> 2) * (BM * 64) + wg * (64 * 64) + (ks & 3) * 16;
                const int k_at = (ks >> 2) * (BN * 64) + (ks & 3) * 16;
                Wgmma<T, BN>::ss(acc, wgmma_desc(Qh + q_at, 16, ATOM),
                                 wgmma_desc(Kl + k_at, 16, ATOM), ks > ks0);
                Wgmma<T, BN>::ss(acc, wgmma_desc(Ql + q_at, 16, ATOM),
                                 wgmma_desc(Kh + k_at, 16, ATOM), 1);
            }
#pragma unroll
            for (int ks = ks0; ks < ks0 + HALF; ++ks) {
                const int q_at = (ks >> 2) * (BM * 64) + wg * (64 * 64) + (ks & 3) * 16;
                const int k_at = (ks >> 2) * (BN * 64) + (ks & 3) * 16;
                Wgmma<T, BN>::ss(acc, wgmma_desc(Qh + q_at, 16, ATOM),
                                 wgmma_desc(Kh + k_at, 16, ATOM), 1);
            }
        };
        wgmma_fence();
        score_chunk(s[0], 0);
        score_chunk(s_rest[0], HALF);
        wgmma_commit();
        wgmma_wait_all();
        pin_registers(s[0]);
        pin_registers(s_rest[0]);
#pragma unroll
        for (int n = 0; n < NTILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][n][e] += s_rest[0][n][e];

        const float score_scale =
            mask_scores(s, 0, mask, !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN),
                        m0 + warp_row, n0, score_log2);
        const float alpha0 = exp_row<1, NTILES, LOG2_GAIN>(s, row_max, row_sum, 0, 0, score_scale);
        const float alpha1 = exp_row<1, NTILES, LOG2_GAIN>(s, row_max, row_sum, 0, 1, score_scale);

        // P (times 2^14) as hi and lo A fragments, 16 keys a step.
        unsigned p_hi[BN / 16][4], p_lo[BN / 16][4];
        split_fragments(s[0], p_hi, p_lo);

        // This tile's P V in a fresh accumulator (cross products first), then
        // O = O alpha + it.
        float o_tile[DTILES][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            Wgmma<T, DP>::rs(o_tile, p_hi[kk],
                             wgmma_desc(Vl + kk * 16 * 64, BN * 64 * sizeof(T), ATOM), kk > 0);
            Wgmma<T, DP>::rs(o_tile, p_lo[kk],
                             wgmma_desc(Vh + kk * 16 * 64, BN * 64 * sizeof(T), ATOM), 1);
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            Wgmma<T, DP>::rs(o_tile, p_hi[kk],
                             wgmma_desc(Vh + kk * 16 * 64, BN * 64 * sizeof(T), ATOM), 1);
        wgmma_commit();
        wgmma_wait_all();
        pin_registers(o_tile);
#pragma unroll
        for (int d = 0; d < DTILES; ++d) {
            o[0][d][0] = fmaf(o[0][d][0], alpha0, o_tile[d][0]);
            o[0][d][1] = fmaf(o[0][d][1], alpha0, o_tile[d][1]);
            o[0][d][2] = fmaf(o[0][d][2], alpha1, o_tile[d][2]);
            o[0][d][3] = fmaf(o[0][d][3], alpha1, o_tile[d][3]);
        }
        __syncthreads();  // this buffer is refilled two iterations later
    }
    cp_async_wait<0>();  // Q's copy, when no key tile was read

    // O carries 2^14 s_v and the sums 2^14. The sums drop their gain
    // (exactly: a power of two), so that finish_rows writes lse = max ln 2 +
    // ln(sum) with no large terms that cancel (their rounding would reach
    // every gradient through P in the backward), and O drops 2^14 s_v as
    // it is stored.
#pragma unroll
    for (int r = 0; r < 2; ++r) row_sum[0][r] *= 1.f / (1 << LOG2_GAIN);
    const float out_scale = ldexpf(1.f, -(LOG2_GAIN + ilogbf(s_v)));  // s_v = 2^k
    const long long row_base = (static_cast<long long>(b) * num_heads + h) * q_len + m0;
    finish_rows(
        o, row_max, row_sum, warp_row, rows, lse + row_base,
        [&](int row, int d, float x0, float x1) {
            if (d * 8 < D)  // past D: the pieces' padding columns
                reinterpret_cast<float2*>(out + offset_of(out_st, b, h, m0 + row))[d * 4 + t] =
                    make_float2(x0 * out_scale, x1 * out_scale);
        },
        sinks, h);
}

}  // namespace cuflash
