// float32 attention backward (dK, dV and optionally the atomic dQ) on the
// 16-bit wgmma (sm_90a) with float32 accuracy: the scheme of
// sm90/forward_float32_pieces.cuh. Q, K, V and dO arrive as two float16 pieces each, scaled
// by powers of two (float16_pieces_split); every product runs as three,
// hi*hi + hi*lo + lo*hi, and every sum the tensor cores round toward zero
// runs in a fresh accumulator over at most 64 terms (halves of D for S^T and
// dP^T), the cross products first, before a round-to-nearest FADD or atomic.
//
// One block of two warpgroups per (64-key tile, KV head, batch), looping over
// the query heads of the group and their 64-row query tiles that see the
// keys; K, V pieces stay in shared memory, the next query tile's Q, dO
// pieces, lse and Delta load (cp.async) while this one runs: into a second
// buffer at D = 128; at D = 64 (two blocks an SM) into the one buffer once
// dV and dK are done with it, while dQ runs.
// Per query tile:
//   S^T = K Q^T, dP^T = V dO^T   warpgroup w: all 64 keys, queries
//                                [32 w, 32 w + 32) (wgmma m64n32k16, A and
//                                B K-major), each in two fresh halves of D
//   P^T (times 2^14, a gain folded into the exp2, so that small
//   probabilities keep a normal second piece) and dS^T = P^T (dP^T - Delta)
//   dS^T times 2^k_tile, the power of two that puts the tile's max |dS^T| in
//   [2^13, 2^14) (a block-wide max through shared memory)
//   P^T and dS^T pieces to shared memory; then
//   warpgroup 0: dV += P^T dO 2^-e_do,
//   warpgroup 1: dK += dS^T Q 2^-(k_tile + e_q)
//                                (m64nDk16, A K-major and B N-major from
//                                shared memory, a fresh accumulator a tile)
//   dQ += dS K (ATOMIC_DQ)       warpgroup w: keys [32 w, 32 w + 32) of the
//                                tile, all D columns (A = dS M-major), float32
//                                atomics into dq_accum, unscaled (at D = 64
//                                the halves are added in shared memory first)
// Each warpgroup keeps one 64 x D accumulator across the loop (dV or dK): at
// D = 128 dK and dV of 64 keys would not fit one warpgroup's registers
// beside the fresh ones.
#pragma once
#include "common/params.cuh"
#include "common/mma_softmax.cuh"
#include "common/wgmma.cuh"
#include "common/float16_pieces.cuh"

namespace cuflash {

// Blocks an SM: two at D = 64 (128 registers a thread, one buffer of Q and
// dO, which then loads while dQ runs), one elsewhere (ptxas spills some
// smaller head dims at 128 registers).
template <int D>
__host__ __device__ constexpr int split_bwd_blocks() {
    return D == 64 ? 2 : 1;
}

// backward_float32_pieces's shared memory, from a 1024-byte aligned base: the pieces (hi,
// lo) of K and V and QBUF buffers of Q's and dO's (64 x DP each), P^T's and dS^T's
// ([BN keys][BM queries]), QBUF buffers of lse and of Delta, and each warp's max |dS^T|.
template <int D>
struct BackwardFloat32PiecesShared {
    static constexpr int DP = head_dim_class(D), BM = 64, BN = 64, PLANE = 64 * DP;
    static constexpr int QBUF = split_bwd_blocks<D>() == 2 ? 1 : 2;
    static constexpr int E = static_cast<int>(sizeof(half_t)), F = static_cast<int>(sizeof(float));
    static constexpr int k = 0;
    static constexpr int v = k + 2 * PLANE * E;
    static constexpr int q = v + 2 * PLANE * E;
    static constexpr int dout = q + QBUF * 2 * PLANE * E;
    static constexpr int pt = dout + QBUF * 2 * PLANE * E;
    static constexpr int dst = pt + 2 * BN * BM * E;
    static constexpr int lse = dst + 2 * BN * BM * E;
    static constexpr int delta = lse + QBUF * BM * F;
    static constexpr int warp_max = delta + QBUF * BM * F;
    static constexpr int bytes = kSharedAlignSlack + warp_max + 8 * F;
};

template <int D, bool ATOMIC_DQ>
constexpr int backward_float32_pieces_shared_bytes = BackwardFloat32PiecesShared<D>::bytes;

template <int D, bool ATOMIC_DQ>
__global__ void __launch_bounds__(256, split_bwd_blocks<D>())
    backward_float32_pieces(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_PARAMS, half_t, float)) {
    CUFLASH_BACKWARD_PIECES;
    using T = half_t;
    // The tiles are DP = 64 or 128 columns wide (the head_dim's class), zeros past D.
    constexpr int DP = head_dim_class(D);
    constexpr int BM = 64, BN = 64, NT = 256, KSTEPS = DP / 16, HALF = KSTEPS / 2;
    constexpr int SN = BM / 2, STILES = SN / 8, DTILES = DP / 8;
    constexpr int LOG2_GAIN = 14;   // P is computed times 2^14
    constexpr int PLANE = 64 * DP;  // elements of one 64-row piece of Q, K, V or dO
    constexpr int QBUF = split_bwd_blocks<D>() == 2 ? 1 : 2;  // buffers of Q, dO, lse, Delta
    constexpr unsigned ATOM = 1024;
    static_assert(D % 8 == 0 && D <= 128, "head_dim");
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(dkv);
    CUFLASH_SEQUENCE_OF(kv_capacity);
    extern __shared__ float4 smem4[];
    using Shared = BackwardFloat32PiecesShared<D>;
    static_assert(
        Shared::PLANE == PLANE && Shared::QBUF == QBUF && Shared::BM == BM && Shared::BN == BN,
        "the layout's tiles are the kernel's");
    T* base = reinterpret_cast<T*>((reinterpret_cast<unsigned long long>(smem4) + 1023) & ~1023ull);
    T* Ks = CUFLASH_SHARED_REGION(T, base, Shared::k);
    T* Vs = CUFLASH_SHARED_REGION(T, base, Shared::v);                   // (hi, lo)
    T* Qs = CUFLASH_SHARED_REGION(T, base, Shared::q);                   // QBUF buffers of (hi, lo)
    T* dOs = CUFLASH_SHARED_REGION(T, base, Shared::dout);               // QBUF buffers of (hi, lo)
    T* Pt = CUFLASH_SHARED_REGION(T, base, Shared::pt);                  // P^T (hi, lo), [BN][BM]
    T* dSt = CUFLASH_SHARED_REGION(T, base, Shared::dst);                // dS^T (hi, lo)
    float* lse_s = CUFLASH_SHARED_REGION(float, base, Shared::lse);      // QBUF buffers of BM
    float* delta_s = CUFLASH_SHARED_REGION(float, base, Shared::delta);  // QBUF buffers of BM
    float* warp_max = CUFLASH_SHARED_REGION(float, base, Shared::warp_max);  // 8: max |dS^T| a warp

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wg = warp >> 2, warp_row = (warp & 3) * 16;  // the warp's keys (and dQ rows)
    const int q0 = wg * SN;                                // the warpgroup's first S^T query column
    const int n0 = blockIdx.x * BN, hk = blockIdx.y, b = seq.batch;
    if (n0 >= seq.key_rows) return;  // packed: past the sequence's keys
    qh += seq.q_start * q_st.s;
    ql += seq.q_start * q_st.s;
    doh += seq.q_start * dout_st.s;
    dol += seq.q_start * dout_st.s;
    lse += seq.q_start;
    delta += seq.q_start;
    dq_accum += seq.q_start * D;
    kh += seq.kv_start * k_st.s;
    kl += seq.kv_start * k_st.s;
    vh += seq.kv_start * v_st.s;
    vl += seq.kv_start * v_st.s;
    dk += seq.kv_start * dkv_st.s;
    dv += seq.kv_start * dkv_st.s;
    // The pieces' scales are powers of two, 2^e_x, one a head: K's and V's
    // here, Q's and dO's per step. Scores of the scaled pieces are
    // 2^(e_q + e_k) times the true ones, dP^T 2^(e_do + e_v) times, the dQ
    // products 2^(14 + e_k + e_ds) times (e_ds: dS^T's tile scale), the dV
    // products 2^(14 + e_do) and the dK ones 2^(14 + e_ds + e_q).
    const int kv_head = b * gridDim.y + hk;
    const int e_k = ilogbf(k_scales[kv_head]), e_v = ilogbf(v_scales[kv_head]);
    const float dq_unscale = ldexpf(scale, -(LOG2_GAIN + e_k));

    const QuerySteps<BM> steps(mask, n0, n0 + BN, hk, group);
    auto load_step = [&](int step, int buf) {
        const int h = steps.head(step), m0 = steps.row0(step), rows = min(BM, mask.q_len - m0);
        const long long head_rows = (static_cast<long long>(b) * num_heads + h) * q_len;
        load_row_stats<BM, NT>(lse_s + buf * BM, delta_s + buf * BM, lse + head_rows + m0,
                               delta + head_rows + m0, rows);
        const long long q_at = offset_of(q_st, b, h, m0), do_at = offset_of(dout_st, b, h, m0);
        T* Qb = Qs + buf * 2 * PLANE;
        T* dOb = dOs + buf * 2 * PLANE;
        cp_async_tile_sw128<BM, DP, NT, D>(Qb, qh + q_at, q_st.s, rows);
        cp_async_tile_sw128<BM, DP, NT, D>(Qb + PLANE, ql + q_at, q_st.s, rows);
        cp_async_tile_sw128<BM, DP, NT, D>(dOb, doh + do_at, dout_st.s, rows);
        cp_async_tile_sw128<BM, DP, NT, D>(dOb + PLANE, dol + do_at, dout_st.s, rows);
    };
    if (steps.count > 0) {
        const int keys = mask.kv_len - n0;
        const long long k_at = offset_of(k_st, b, hk, n0), v_at = offset_of(v_st, b, hk, n0);
        cp_async_tile_sw128<BN, DP, NT, D>(Ks, kh + k_at, k_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Ks + PLANE, kl + k_at, k_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Vs, vh + v_at, v_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Vs + PLANE, vl + v_at, v_st.s, keys);
        load_step(0, 0);
    }
    cp_async_commit();

    // dV (warpgroup 0) or dK (warpgroup 1) of the 64 keys, all DP columns.
    float own[DTILES][4];
#pragma unroll
    for (int d = 0; d < DTILES; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) own[d][e] = 0.f;

    for (int step = 0; step < steps.count; ++step) {
        const int buf = QBUF == 2 ? step & 1 : 0;
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // this step's tile is in shared memory; the previous step is done
        if (QBUF == 2) {
            if (step + 1 < steps.count) load_step(step + 1, buf ^ 1);
            cp_async_commit();
        }
        const int h = steps.head(step), m0 = steps.row0(step), rows = min(BM, mask.q_len - m0);
        const int e_q = ilogbf(q_scales[b * num_heads + h]);
        const int e_do = ilogbf(do_scales[b * num_heads + h]);
        const float score_log2 = ldexpf(scale_log2, -(e_q + e_k));
        const float dp_unscale = ldexpf(1.f, -(e_do + e_v));
        const T* Qb = Qs + buf * 2 * PLANE;
        const T* dOb = dOs + buf * 2 * PLANE;

        // A (64 keys, K-major) times B^T (queries [q0, q0 + 32), K-major) over
        // k16 steps [ks0, ks0 + HALF) in a fresh accumulator: the cross
        // products of the pieces first, then hi * hi.
        auto product_chunk = [&](float(&acc)[STILES][4], const T* a, const T* bm, int ks0) {
            auto a_at = [](int ks) { return (ks >> 2) * (BN * 64) + (ks & 3) * 16; };
            auto b_at = [&](int ks) { return (ks >> 2) * (BM * 64) + q0 * 64 + (ks & 3) * 16; };
#pragma unroll
            for (int ks = ks0; ks < ks0 + HALF; ++ks) {
                Wgmma<T, SN>::ss(acc, wgmma_desc(a + a_at(ks), 16, ATOM),
                                 wgmma_desc(bm + PLANE + b_at(ks), 16, ATOM), ks > ks0);
                Wgmma<T, SN>::ss(acc, wgmma_desc(a + PLANE + a_at(ks), 16, ATOM),
                                 wgmma_desc(bm + b_at(ks), 16, ATOM), 1);
            }
#pragma unroll
            for (int ks = ks0; ks < ks0 + HALF; ++ks)
                Wgmma<T, SN>::ss(acc, wgmma_desc(a + a_at(ks), 16, ATOM),
                                 wgmma_desc(bm + b_at(ks), 16, ATOM), 1);
        };
        float st[STILES][4], st_rest[STILES][4], dpt[STILES][4], dpt_rest[STILES][4];
        wgmma_fence();
        product_chunk(st, Ks, Qb, 0);
        product_chunk(st_rest, Ks, Qb, HALF);
        wgmma_commit();
        product_chunk(dpt, Vs, dOb, 0);
        product_chunk(dpt_rest, Vs, dOb, HALF);
        wgmma_commit();
        wgmma_wait<1>();  // S^T is done: P^T while dP^T runs
        pin_registers(st);
        pin_registers(st_rest);
#pragma unroll
        for (int n = 0; n < STILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[n][e] += st_rest[n][e];
        probs<STILES, LOG2_GAIN>(st, mask, !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN),
                                 m0 + q0, n0 + warp_row + g, t, lse_s + buf * BM + q0, score_log2);
        wgmma_wait<0>();
        pin_registers(dpt);
        pin_registers(dpt_rest);
        // dS^T times 2^14 (P^T's gain), and this thread's max of its magnitudes.
        float dmax = 0.f;
#pragma unroll
        for (int n = 0; n < STILES; ++n) {
            const float2 delta2 = load_shared_float2(delta_s + buf * BM + q0 + n * 8 + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float dp = (dpt[n][e] + dpt_rest[n][e]) * dp_unscale;
                dpt[n][e] = st[n][e] * (dp - ((e & 1) ? delta2.y : delta2.x));
                dmax = fmaxf(dmax, fabsf(dpt[n][e]));
            }
        }
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) dmax = fmaxf(dmax, __shfl_xor_sync(0xffffffffu, dmax, s));
        if (lane == 0) warp_max[warp] = dmax;

        // Element pair (key, query chunk of 8) of a [BN keys][BM queries] piece.
        auto store_pair = [&](T* tile, int key, int chunk, unsigned pair) {
            *reinterpret_cast<unsigned*>(tile + key * 64 + ((chunk ^ (key & 7)) << 3) + 2 * t) =
                pair;
        };
        // Rows g, g + 8 of the warp's 16 keys, queries q0 + 8 n + 2 t, + 1.
        auto store_pieces = [&](T* tile, const float(&x)[STILES][4]) {
#pragma unroll
            for (int n = 0; n < STILES; ++n)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    unsigned hi, lo;
                    split_pack(x[n][2 * r], x[n][2 * r + 1], hi, lo);
                    store_pair(tile, warp_row + g + 8 * r, q0 / 8 + n, hi);
                    store_pair(tile + BN * BM, warp_row + g + 8 * r, q0 / 8 + n, lo);
                }
        };
        store_pieces(Pt, st);
        __syncthreads();  // every warp's max is in
        float tile_max = warp_max[0];
#pragma unroll
        for (int w = 1; w < 8; ++w) tile_max = fmaxf(tile_max, warp_max[w]);
        const int e_ds = pow2_exponent(tile_max);  // dS^T pieces are 2^e_ds dS^T 2^14
        const float ds_scale = ldexpf(1.f, e_ds);
#pragma unroll
        for (int n = 0; n < STILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dpt[n][e] *= ds_scale;
        store_pieces(dSt, dpt);
        fence_proxy_async();
        __syncthreads();  // P^T and dS^T pieces of both warpgroups are in

        // dV (warpgroup 0: P^T dO) or dK (warpgroup 1: dS^T Q) of this tile,
        // 16 queries a step.
        const T* a_tile = wg == 0 ? Pt : dSt;
        const T* b_tile = wg == 0 ? dOb : Qb;
        float fresh[DTILES][4];
        constexpr unsigned COLUMN_BLOCKS = BM * 64 * sizeof(T);  // = BN * 64 * sizeof(T)
        auto a_tile_desc = [&](int piece, int kk) {
            return wgmma_desc(a_tile + piece * BN * BM + kk * 16, 16, ATOM);
        };
        auto b_tile_desc = [&](int piece, int kk) {
            return wgmma_desc(b_tile + piece * PLANE + kk * 16 * 64, COLUMN_BLOCKS, ATOM);
        };
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {  // cross products first
            Wgmma<T, DP>::ss_nb(fresh, a_tile_desc(0, kk), b_tile_desc(1, kk), kk > 0);
            Wgmma<T, DP>::ss_nb(fresh, a_tile_desc(1, kk), b_tile_desc(0, kk), 1);
        }
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
            Wgmma<T, DP>::ss_nb(fresh, a_tile_desc(0, kk), b_tile_desc(0, kk), 1);
        wgmma_commit();
        // dQ of the tile's 64 queries over this warpgroup's 32 keys, 16 a step
        // (A = dS M-major, B = K N-major).
        float dq[DTILES][4];
        if (ATOMIC_DQ) {
            auto ds_desc = [&](int piece, int kk) {
                return wgmma_desc(dSt + piece * BN * BM + (wg * 32 + kk * 16) * 64, COLUMN_BLOCKS,
                                  ATOM);
            };
            auto k_desc = [&](int piece, int kk) {
                return wgmma_desc(Ks + piece * PLANE + (wg * 32 + kk * 16) * 64, COLUMN_BLOCKS,
                                  ATOM);
            };
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) {
                Wgmma<T, DP>::ss_mn(dq, ds_desc(0, kk), k_desc(1, kk), kk > 0);
                Wgmma<T, DP>::ss_mn(dq, ds_desc(1, kk), k_desc(0, kk), 1);
            }
#pragma unroll
            for (int kk = 0; kk < 2; ++kk)
                Wgmma<T, DP>::ss_mn(dq, ds_desc(0, kk), k_desc(0, kk), 1);
            wgmma_commit();
            wgmma_wait<1>();
        } else {
            wgmma_wait<0>();
        }
        pin_registers(fresh);
        const float own_factor = ldexpf(1.f, wg == 0 ? -e_do : -(e_ds + e_q));
#pragma unroll
        for (int d = 0; d < DTILES; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) own[d][e] = fmaf(fresh[d][e], own_factor, own[d][e]);
        if (QBUF == 1) {  // both warpgroups are done with Q and dO: the next tile loads
            __syncthreads();
            if (step + 1 < steps.count) load_step(step + 1, 0);
            cp_async_commit();
        }
        if (ATOMIC_DQ) {
            wgmma_wait<0>();
            pin_registers(dq);
            const float dq_scale = dq_unscale * ldexpf(1.f, -e_ds);  // dQ = scale dS K
            float* dq_rows =
                dq_accum + ((static_cast<long long>(b) * num_heads + h) * q_len + m0) * D;
            // At DP = 64 the two warpgroups' halves meet in shared memory (P^T's,
            // free now) and each row takes one atomic: warpgroup 0 adds rows
            // [0, 32), warpgroup 1 rows [32, 64); the other warps hand theirs over.
            bool adds = true;
            if constexpr (QBUF == 1) {
                float* handed = reinterpret_cast<float*>(Pt);  // [64 rows][DP], 8-column
                                                               // groups swizzled by row
                // row = warp_row + g + 8 r: row % 8 = g
                auto at = [&](int row, int d) { return row * DP + ((d ^ g) << 3) + 2 * t; };
                adds = (warp & 3) / 2 == wg;
                if (!adds) {
#pragma unroll
                    for (int r = 0; r < 2; ++r)
#pragma unroll
                        for (int d = 0; d < DTILES; ++d)
                            *reinterpret_cast<float2*>(handed + at(warp_row + g + 8 * r, d)) =
                                make_float2(dq[d][2 * r], dq[d][2 * r + 1]);
                }
                __syncthreads();
                if (adds) {
#pragma unroll
                    for (int r = 0; r < 2; ++r)
#pragma unroll
                        for (int d = 0; d < DTILES; ++d) {
                            const float2 other =
                                load_shared_float2(handed + at(warp_row + g + 8 * r, d));
                            dq[d][2 * r] += other.x;
                            dq[d][2 * r + 1] += other.y;
                        }
                }
            }
            if (adds) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = warp_row + g + 8 * r;
                    float* dst = dq_rows + static_cast<long long>(row) * D + 2 * t;
#pragma unroll
                    for (int d = 0; d < DTILES; ++d)
                        atomic_add_float2(dst + d * 8, dq[d][2 * r] * dq_scale,
                                          dq[d][2 * r + 1] * dq_scale,
                                          row < rows && (D == DP || d * 8 < D));
                }
            }
        }
        pin_registers(own);
    }
    cp_async_wait<0>();

    // dV = own 2^-14; dK = scale own 2^-14. Keys past the capacity are
    // skipped; every other row is written, zeros included.
    float* dst = wg == 0 ? dv : dk;
    const float out_scale = (wg == 0 ? 1.f : scale) * (1.f / (1 << LOG2_GAIN));
    store_key_rows<D>(dst + offset_of(dkv_st, b, hk, n0), dkv_st.s, own, warp_row, g, t,
                      seq.key_rows - n0, out_scale);
}

}  // namespace cuflash
