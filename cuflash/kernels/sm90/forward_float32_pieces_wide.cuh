// float32 attention forward on the 16-bit wgmma (sm_90a) with float32
// accuracy at head dims 136 to 256: the scheme of sm90/forward_float32_pieces.cuh (float16
// pieces, three products each, short sums in fresh accumulators) on tiles
// that fit shared memory at 256 columns, where the pieces double every tile.
//
// One block of two warpgroups per 64-row query tile; both warpgroups own all
// 64 rows and split the head dim between them:
//   S = Q K^T      warpgroup w: k16 steps [w KW, w KW + KW) of the head dim
//                  (KW = half the exact steps, rounded up), in fresh chunks of
//                  at most 4 steps (64 terms), cross products first; the two
//                  halves meet in shared memory and each warpgroup adds the
//                  other's (a + b = b + a: both hold the same bits of S)
//   softmax        both warpgroups, on the same S: the same P and row sums
//   O += P V       warpgroup w: columns [128 w, 128 w + 128), a fresh
//                  accumulator a key tile (m64n128k16, A = P pieces from
//                  registers, B = V N-major)
// Q, one K tile and one V tile (hi and lo pieces, 64 keys) sit in shared
// memory (64 KB each at 256 columns); K(it + 1) loads while the softmax and
// P V(it) run, V(it + 1) while S(it + 1) does.
#pragma once
#include "common/params.cuh"
#include "common/mma_softmax.cuh"
#include "common/wgmma.cuh"
#include "common/float16_pieces.cuh"

namespace cuflash {

// forward_float32_pieces_wide's shared memory, from a 1024-byte aligned base: the
// pieces (hi, lo) of Q, K and V, 256 columns wide, then each warpgroup's half of S
// ([warpgroup][8-key tile][thread of the warpgroup] float4).
template <int D>
struct ForwardFloat32PiecesWideShared {
    static constexpr int DP = 256, BM = 64, BN = 64, NTILES = BN / 8;
    static constexpr int E = static_cast<int>(sizeof(half_t));
    static constexpr int q_hi = 0;
    static constexpr int q_lo = q_hi + BM * DP * E;
    static constexpr int k_hi = q_lo + BM * DP * E;
    static constexpr int k_lo = k_hi + BN * DP * E;
    static constexpr int v_hi = k_lo + BN * DP * E;
    static constexpr int v_lo = v_hi + BN * DP * E;
    static constexpr int halves = v_lo + BN * DP * E;
    static constexpr int bytes =
        kSharedAlignSlack + halves + 2 * NTILES * 128 * static_cast<int>(sizeof(float4));
};

template <int D>
constexpr int forward_float32_pieces_wide_shared_bytes = ForwardFloat32PiecesWideShared<D>::bytes;

template <int D>
__global__ void __launch_bounds__(256, 1)
    forward_float32_pieces_wide(CUFLASH_PARAMETERS(CUFLASH_FORWARD_PARAMS, half_t, float)) {
    CUFLASH_FORWARD_PIECES;
    using T = half_t;
    constexpr int DP = 256, BM = 64, BN = 64, NT = 256;  // DP: the tiles' width
    constexpr int NTILES = BN / 8, OTILES = DP / 2 / 8;  // O: 128 columns a warpgroup
    constexpr int KW = (round_up(D, 16) / 16 + 1) / 2;   // k16 steps a warpgroup
    constexpr int CHUNK = 4;                             // k16 steps a fresh S sum
    constexpr int LOG2_GAIN = 14;                        // P is computed times 2^14
    constexpr unsigned ATOM = 1024;
    static_assert(D % 8 == 0 && D > 128 && D <= DP, "head_dim");
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(out);
    CUFLASH_FORWARD_SEQUENCE;
    extern __shared__ float4 smem4[];
    using Shared = ForwardFloat32PiecesWideShared<D>;
    static_assert(Shared::DP == DP && Shared::BM == BM && Shared::BN == BN,
                  "the layout's tiles are the kernel's");
    T* base = reinterpret_cast<T*>((reinterpret_cast<unsigned long long>(smem4) + 1023) & ~1023ull);
    T* Qh = CUFLASH_SHARED_REGION(T, base, Shared::q_hi);
    T* Ql = CUFLASH_SHARED_REGION(T, base, Shared::q_lo);
    T* Kh = CUFLASH_SHARED_REGION(T, base, Shared::k_hi);
    T* Kl = CUFLASH_SHARED_REGION(T, base, Shared::k_lo);
    T* Vh = CUFLASH_SHARED_REGION(T, base, Shared::v_hi);
    T* Vl = CUFLASH_SHARED_REGION(T, base, Shared::v_lo);
    // Each warpgroup's half of S: [warpgroup][8-key tile][thread of the warpgroup].
    float4* halves = CUFLASH_SHARED_REGION(float4, base, Shared::halves);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const int wg = warp >> 2, wg_thread = threadIdx.x & 127, warp_row = (warp & 3) * 16;
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

    // Columns [0, D) of every tile; past D the copies write zeros.
    cp_async_tile_sw128<BM, DP, NT, D>(Qh, qh + offset_of(q_st, b, h, m0), q_st.s, rows);
    cp_async_tile_sw128<BM, DP, NT, D>(Ql, ql + offset_of(q_st, b, h, m0), q_st.s, rows);
    int n_start, tiles;
    mask.key_tiles<BN>(m0, m0 + rows, n_start, tiles);
    const long long k_head = offset_of(k_st, b, hk, 0), v_head = offset_of(v_st, b, hk, 0);
    auto load_k = [&](int tile) {
        const int n0 = n_start + tile * BN, keys = mask.kv_len - n0;
        cp_async_tile_sw128<BN, DP, NT, D>(Kh, kh + k_head + n0 * k_st.s, k_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Kl, kl + k_head + n0 * k_st.s, k_st.s, keys);
    };
    auto load_v = [&](int tile) {
        const int n0 = n_start + tile * BN, keys = mask.kv_len - n0;
        cp_async_tile_sw128<BN, DP, NT, D>(Vh, vh + v_head + n0 * v_st.s, v_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Vl, vl + v_head + n0 * v_st.s, v_st.s, keys);
    };
    // Groups in flight: Q with K(0), then V(0); in the loop K(it + 1), then V(it + 1).
    if (tiles > 0) load_k(0);
    cp_async_commit();
    if (tiles > 0) load_v(0);
    cp_async_commit();

    float o[1][OTILES][4], row_max[1][2], row_sum[1][2];
    init_rows(o, row_max, row_sum);
    // Scores of the scaled inputs are s_q s_k times the true ones.
    const float score_log2 = scale_log2 / (s_q * s_k);
    const int first_step = wg * KW;

    // acc = this warpgroup's steps [first_step + c0, first_step + c1) of Q K^T,
    // fresh: the cross products of the pieces first, then hi * hi.
    auto score_chunk = [&](float(&acc)[NTILES][4], int c0, int c1) {
        auto q_at = [](int ks) { return (ks >> 2) * (BM * 64) + (ks & 3) * 16; };
        auto k_at = [](int ks) { return (ks >> 2) * (BN * 64) + (ks & 3) * 16; };
#pragma unroll
        for (int c = c0; c < c1; ++c) {
            const int ks = first_step + c;
            Wgmma<T, BN>::ss(acc, wgmma_desc(Qh + q_at(ks), 16, ATOM),
                             wgmma_desc(Kl + k_at(ks), 16, ATOM), c > c0);
            Wgmma<T, BN>::ss(acc, wgmma_desc(Ql + q_at(ks), 16, ATOM),
                             wgmma_desc(Kh + k_at(ks), 16, ATOM), 1);
        }
#pragma unroll
        for (int c = c0; c < c1; ++c) {
            const int ks = first_step + c;
            Wgmma<T, BN>::ss(acc, wgmma_desc(Qh + q_at(ks), 16, ATOM),
                             wgmma_desc(Kh + k_at(ks), 16, ATOM), 1);
        }
    };

    for (int it = 0; it < tiles; ++it) {
        const int n0 = n_start + it * BN;
        cp_async_wait<1>();  // K(it) (and Q) are in; V(it) may still be on its way
        fence_proxy_async();
        __syncthreads();

        float s[1][NTILES][4];
        {
            float s_rest[NTILES][4];
            wgmma_fence();
            score_chunk(s[0], 0, KW < CHUNK ? KW : CHUNK);
            if constexpr (KW > CHUNK) score_chunk(s_rest, CHUNK, KW);
            wgmma_commit();
            wgmma_wait_all();
            pin_registers(s[0]);
            if constexpr (KW > CHUNK) {
                pin_registers(s_rest);
#pragma unroll
                for (int n = 0; n < NTILES; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[0][n][e] += s_rest[n][e];
            }
        }
        float4* mine = halves + wg * NTILES * 128 + wg_thread;
#pragma unroll
        for (int n = 0; n < NTILES; ++n)
            mine[n * 128] = make_float4(s[0][n][0], s[0][n][1], s[0][n][2], s[0][n][3]);
        __syncthreads();  // both halves are in; both warpgroups are done with K(it)
        if (it + 1 < tiles) load_k(it + 1);
        cp_async_commit();
        const float4* other = halves + (wg ^ 1) * NTILES * 128 + wg_thread;
#pragma unroll
        for (int n = 0; n < NTILES; ++n) {
            const float4 x = other[n * 128];
            s[0][n][0] += x.x;
            s[0][n][1] += x.y;
            s[0][n][2] += x.z;
            s[0][n][3] += x.w;
        }

        const float score_scale =
            mask_scores(s, 0, mask, !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN),
                        m0 + warp_row, n0, score_log2);
        const float alpha0 = exp_row<1, NTILES, LOG2_GAIN>(s, row_max, row_sum, 0, 0, score_scale);
        const float alpha1 = exp_row<1, NTILES, LOG2_GAIN>(s, row_max, row_sum, 0, 1, score_scale);

        // P (times 2^14) as hi and lo A fragments, 16 keys a step.
        unsigned p_hi[BN / 16][4], p_lo[BN / 16][4];
        split_fragments(s[0], p_hi, p_lo);

        cp_async_wait<1>();  // V(it) is in; K(it + 1) may still be on its way
        fence_proxy_async();
        __syncthreads();
        // This warpgroup's 128 columns of P V in a fresh accumulator (cross
        // products first), then O = O alpha + it.
        const T* v_hi = Vh + wg * 2 * (BN * 64);  // column blocks 2 wg and 2 wg + 1
        const T* v_lo = Vl + wg * 2 * (BN * 64);
        float o_tile[OTILES][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            Wgmma<T, DP / 2>::rs(o_tile, p_hi[kk],
                                 wgmma_desc(v_lo + kk * 16 * 64, BN * 64 * sizeof(T), ATOM),
                                 kk > 0);
            Wgmma<T, DP / 2>::rs(o_tile, p_lo[kk],
                                 wgmma_desc(v_hi + kk * 16 * 64, BN * 64 * sizeof(T), ATOM), 1);
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            Wgmma<T, DP / 2>::rs(o_tile, p_hi[kk],
                                 wgmma_desc(v_hi + kk * 16 * 64, BN * 64 * sizeof(T), ATOM), 1);
        wgmma_commit();
        wgmma_wait_all();
        pin_registers(o_tile);
#pragma unroll
        for (int d = 0; d < OTILES; ++d) {
            o[0][d][0] = fmaf(o[0][d][0], alpha0, o_tile[d][0]);
            o[0][d][1] = fmaf(o[0][d][1], alpha0, o_tile[d][1]);
            o[0][d][2] = fmaf(o[0][d][2], alpha1, o_tile[d][2]);
            o[0][d][3] = fmaf(o[0][d][3], alpha1, o_tile[d][3]);
        }
        __syncthreads();  // both warpgroups are done with V(it) and with the halves of S
        if (it + 1 < tiles) load_v(it + 1);
        cp_async_commit();
    }
    cp_async_wait<0>();  // Q's copy, when no key tile was read
    __syncthreads();     // warpgroup 1 writes its lse into the halves below

    // O carries 2^14 s_v and the sums 2^14 (see sm90/forward_float32_pieces.cuh). Both
    // warpgroups hold the same row sums: warpgroup 0 writes lse, warpgroup 1
    // into scratch.
#pragma unroll
    for (int r = 0; r < 2; ++r) row_sum[0][r] *= 1.f / (1 << LOG2_GAIN);
    const float out_scale = ldexpf(1.f, -(LOG2_GAIN + ilogbf(s_v)));  // s_v = 2^k
    const long long row_base = (static_cast<long long>(b) * num_heads + h) * q_len + m0;
    float* lse_rows = wg == 0 ? lse + row_base : reinterpret_cast<float*>(halves);
    const int first_column = wg * (DP / 2);
    finish_rows(
        o, row_max, row_sum, warp_row, rows, lse_rows,
        [&](int row, int d, float x0, float x1) {
            const int column = first_column + d * 8;
            if (column < D)  // past D: the pieces' padding columns
                reinterpret_cast<float2*>(out + offset_of(out_st, b, h, m0 + row) + column)[t] =
                    make_float2(x0 * out_scale, x1 * out_scale);
        },
        sinks, h);
}

}  // namespace cuflash
