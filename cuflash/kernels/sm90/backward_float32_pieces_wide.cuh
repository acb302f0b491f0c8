// float32 attention backward on the 16-bit wgmma (sm_90a) with float32
// accuracy at head dims 136 to 256: the scheme of sm90/backward_float32_pieces.cuh (float16
// pieces, three products each, every sum the tensor cores round in a fresh
// accumulator over at most 64 terms) on tiles that fit shared memory when
// the pieces double every tile. Two kernels, both deterministic:
//
//   backward_float32_pieces_wide     dK and dV: one block of two warpgroups per
//       (64-key tile, KV head, batch), K and V pieces resident, looping over
//       the query heads of the group and their 32-row query tiles that see
//       the keys (Q and dO pieces, lse and Delta loaded a tile at a time):
//         warpgroup 0: S^T = K Q^T, P^T (times 2^14), handed to warpgroup 1
//                      through shared memory; dV += P^T dO
//         warpgroup 1: dP^T = V dO^T, dS^T = P^T (dP^T - Delta) times 2^e_ds
//                      (the tile's max |dS^T| in [2^13, 2^14)); dK += dS^T Q
//       S^T and dP^T: wgmma m64n32k16, A and B K-major from shared memory, in
//       fresh chunks of 4 k16 steps; dV and dK: m64n64k16 a 64-column chunk
//       of the head dim at a time, A = the pieces of P^T or dS^T from
//       registers, B N-major, in a fresh accumulator a query tile.
//   backward_dq_float32_pieces_wide  dQ: one block of two warpgroups per 64-row
//       query tile, Q and dO pieces resident, looping over 32-key tiles:
//         warpgroup 0: S = Q K^T, P handed to warpgroup 1
//         warpgroup 1: dP = dO V^T, dS = P (dP - Delta) times 2^e_ds, handed
//                      back to warpgroup 0
//         warpgroup w: dQ[:, 128 w, 128 w + 128) += dS K, 64 columns a chunk
// The scales: as in sm90/backward_float32_pieces.cuh, every piece is its operand times a
// power of two, which the kernels take out of each product exactly.
#pragma once
#include "common/params.cuh"
#include "sm90/forward_float32_pieces.cuh"

namespace cuflash {

// Named barriers between the two warpgroups (1 and 2 are warpgroup_sync's):
// one warpgroup arrives when its half is in shared memory, the other waits.
constexpr int kHandToSecond = 3, kHandToFirst = 4;
__device__ __forceinline__ void barrier_arrive(int id) {
    asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory");
}
__device__ __forceinline__ void barrier_wait(int id) {
    asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory");
}

// This thread's fragment of an m64 accumulator of TILES 8-column tiles to or
// from shared memory ([tile][thread of the warpgroup] float4s: the other
// warpgroup's thread of the same rank holds the same elements).
template <int TILES>
__device__ __forceinline__ void hand_over(float4* slots, const float (&x)[TILES][4]) {
    const int rank = threadIdx.x & 127;
#pragma unroll
    for (int n = 0; n < TILES; ++n)
        slots[n * 128 + rank] = make_float4(x[n][0], x[n][1], x[n][2], x[n][3]);
}
template <int TILES>
__device__ __forceinline__ void take_over(const float4* slots, float (&x)[TILES][4]) {
    const int rank = threadIdx.x & 127;
#pragma unroll
    for (int n = 0; n < TILES; ++n) {
        const float4 v = slots[n * 128 + rank];
        x[n][0] = v.x;
        x[n][1] = v.y;
        x[n][2] = v.z;
        x[n][3] = v.w;
    }
}

// acc = A B^T over the exact head dim (KSTEPS k16 steps, A: ROWS_A rows and B:
// ROWS_B rows of 256-column pieces, K-major, in shared memory), in fresh
// chunks of 4 steps added in order: the cross products of the pieces first
// in each chunk, then hi * hi.
template <int KSTEPS, int ROWS_A, int ROWS_B>
__device__ __forceinline__ void pieces_product(float (&acc)[ROWS_B / 8][4], const half_t* a_hi,
                                               const half_t* a_lo, const half_t* b_hi,
                                               const half_t* b_lo) {
    constexpr int CHUNK = 4, CHUNKS = (KSTEPS + CHUNK - 1) / CHUNK, TILES = ROWS_B / 8;
    constexpr unsigned ATOM = 1024;
    auto a_at = [](int ks) { return (ks >> 2) * (ROWS_A * 64) + (ks & 3) * 16; };
    auto b_at = [](int ks) { return (ks >> 2) * (ROWS_B * 64) + (ks & 3) * 16; };
    float part[CHUNKS][TILES][4];
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int k0 = c * CHUNK, k1 = min(KSTEPS, k0 + CHUNK);
#pragma unroll
        for (int ks = k0; ks < k1; ++ks) {
            Wgmma<half_t, ROWS_B>::ss(part[c], wgmma_desc(a_hi + a_at(ks), 16, ATOM),
                                      wgmma_desc(b_lo + b_at(ks), 16, ATOM), ks > k0);
            Wgmma<half_t, ROWS_B>::ss(part[c], wgmma_desc(a_lo + a_at(ks), 16, ATOM),
                                      wgmma_desc(b_hi + b_at(ks), 16, ATOM), 1);
        }
#pragma unroll
        for (int ks = k0; ks < k1; ++ks)
            Wgmma<half_t, ROWS_B>::ss(part[c], wgmma_desc(a_hi + a_at(ks), 16, ATOM),
                                      wgmma_desc(b_hi + b_at(ks), 16, ATOM), 1);
    }
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) pin_registers(part[c]);
#pragma unroll
    for (int n = 0; n < TILES; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float sum = part[0][n][e];
#pragma unroll
            for (int c = 1; c < CHUNKS; ++c) sum += part[c][n][e];
            acc[n][e] = sum;
        }
}

// own[c * 8 + d] += factor * (A B) for the 64-column chunks c of [first, first +
// CHUNKS) of B: A = the pieces of a [64][32] fragment in registers (x, m64
// accumulator layout), B the [32][256] pieces in shared memory (N-major), one
// fresh m64n64 accumulator a chunk (cross products first).
template <int CHUNKS, int OWN>
__device__ __forceinline__ void add_pieces_times(float (&own)[OWN][4], const float (&x)[4][4],
                                                 const half_t* b_hi, const half_t* b_lo, int first,
                                                 float factor) {
    constexpr unsigned ATOM = 1024, COLUMN_BLOCK = 32 * 64;  // a 64-column block of B
    unsigned a_hi[2][4], a_lo[2][4];
    split_fragments(x, a_hi, a_lo);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const half_t* hi = b_hi + (first + c) * COLUMN_BLOCK;
        const half_t* lo = b_lo + (first + c) * COLUMN_BLOCK;
        float fresh[8][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            Wgmma<half_t, 64>::rs(fresh, a_hi[kk],
                                  wgmma_desc(lo + kk * 16 * 64, COLUMN_BLOCK * 2, ATOM), kk > 0);
            Wgmma<half_t, 64>::rs(fresh, a_lo[kk],
                                  wgmma_desc(hi + kk * 16 * 64, COLUMN_BLOCK * 2, ATOM), 1);
        }
#pragma unroll
        for (int kk = 0; kk < 2; ++kk)
            Wgmma<half_t, 64>::rs(fresh, a_hi[kk],
                                  wgmma_desc(hi + kk * 16 * 64, COLUMN_BLOCK * 2, ATOM), 1);
        wgmma_commit();
        wgmma_wait_all();
        pin_registers(fresh);
#pragma unroll
        for (int d = 0; d < 8; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                own[c * 8 + d][e] = fmaf(fresh[d][e], factor, own[c * 8 + d][e]);
    }
}

// The power of two e with max |x| 2^e in [2^13, 2^14) over the fragments of
// one warpgroup (`maxima`: 4 floats of shared memory for it).
__device__ __forceinline__ int warpgroup_pow2_exponent(const float (&x)[4][4], float* maxima) {
    float m = 0.f;
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) m = fmaxf(m, fabsf(x[n][e]));
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, s));
    const int warp = (threadIdx.x >> 5) & 3;
    if ((threadIdx.x & 31) == 0) maxima[warp] = m;
    warpgroup_sync(threadIdx.x >> 7);
    m = fmaxf(fmaxf(maxima[0], maxima[1]), fmaxf(maxima[2], maxima[3]));
    return pow2_exponent(m);
}

template <int D>
__global__ void __launch_bounds__(256, 1)
    backward_float32_pieces_wide(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_PARAMS, half_t, float)) {
    CUFLASH_BACKWARD_PIECES;
    using T = half_t;
    constexpr int DP = 256, BN = 64, BM = 32, NT = 256, QTILES = BM / 8;
    constexpr int KSTEPS = round_up(D, 16) / 16, COLUMN_CHUNKS = round_up(D, 64) / 64;
    constexpr int LOG2_GAIN = 14;  // P^T is computed times 2^14
    constexpr int KPLANE = BN * DP, QPLANE = BM * DP;
    static_assert(D % 8 == 0 && D > 128 && D <= DP, "head_dim");
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(dkv);
    CUFLASH_SEQUENCE_OF(kv_capacity);
    extern __shared__ float4 smem4[];
    T* Ks = reinterpret_cast<T*>((reinterpret_cast<unsigned long long>(smem4) + 1023) & ~1023ull);
    T* Vs = Ks + 2 * KPLANE;                                        // (hi, lo)
    T* Qs = Vs + 2 * KPLANE;                                        // (hi, lo)
    T* dOs = Qs + 2 * QPLANE;                                       // (hi, lo)
    float4* handoff = reinterpret_cast<float4*>(dOs + 2 * QPLANE);  // P^T: [QTILES][128]
    float* lse_s = reinterpret_cast<float*>(handoff + QTILES * 128);
    float* delta_s = lse_s + BM;
    float* maxima = delta_s + BM;  // 4

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wg = warp >> 2, warp_row = (warp & 3) * 16;  // the warp's 16 keys
    const int n0 = blockIdx.x * BN, hk = blockIdx.y, b = seq.batch;
    if (n0 >= seq.key_rows) return;  // packed: past the sequence's keys
    qh += seq.q_start * q_st.s;
    ql += seq.q_start * q_st.s;
    doh += seq.q_start * dout_st.s;
    dol += seq.q_start * dout_st.s;
    lse += seq.q_start;
    delta += seq.q_start;
    kh += seq.kv_start * k_st.s;
    kl += seq.kv_start * k_st.s;
    vh += seq.kv_start * v_st.s;
    vl += seq.kv_start * v_st.s;
    dk += seq.kv_start * dkv_st.s;
    dv += seq.kv_start * dkv_st.s;
    const int kv_head = b * gridDim.y + hk;
    const int e_k = ilogbf(k_scales[kv_head]), e_v = ilogbf(v_scales[kv_head]);

    const QuerySteps<BM> steps(mask, n0, n0 + BN, hk, group);
    auto load_step = [&](int step) {
        const int h = steps.head(step), m0 = steps.row0(step), rows = min(BM, mask.q_len - m0);
        const long long head_rows = (static_cast<long long>(b) * num_heads + h) * q_len;
        load_row_stats<BM, NT>(lse_s, delta_s, lse + head_rows + m0, delta + head_rows + m0, rows);
        const long long q_at = offset_of(q_st, b, h, m0), do_at = offset_of(dout_st, b, h, m0);
        cp_async_tile_sw128<BM, DP, NT, D>(Qs, qh + q_at, q_st.s, rows);
        cp_async_tile_sw128<BM, DP, NT, D>(Qs + QPLANE, ql + q_at, q_st.s, rows);
        cp_async_tile_sw128<BM, DP, NT, D>(dOs, doh + do_at, dout_st.s, rows);
        cp_async_tile_sw128<BM, DP, NT, D>(dOs + QPLANE, dol + do_at, dout_st.s, rows);
    };
    if (steps.count > 0) {
        const int keys = mask.kv_len - n0;
        const long long k_at = offset_of(k_st, b, hk, n0), v_at = offset_of(v_st, b, hk, n0);
        cp_async_tile_sw128<BN, DP, NT, D>(Ks, kh + k_at, k_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Ks + KPLANE, kl + k_at, k_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Vs, vh + v_at, v_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Vs + KPLANE, vl + v_at, v_st.s, keys);
        load_step(0);
    }
    cp_async_commit();

    // dV (warpgroup 0) or dK (warpgroup 1) of the 64 keys, 64-column chunks.
    float own[COLUMN_CHUNKS * 8][4];
#pragma unroll
    for (int d = 0; d < COLUMN_CHUNKS * 8; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) own[d][e] = 0.f;
    // Warpgroup 0 multiplies K by Q and then P^T by dO; warpgroup 1 V by dO, then dS^T by Q.
    const T* a_tile = wg == 0 ? Ks : Vs;
    const T* b_tile = wg == 0 ? Qs : dOs;
    const T* c_tile = wg == 0 ? dOs : Qs;

    for (int step = 0; step < steps.count; ++step) {
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // this step's tile is in shared memory
        const int h = steps.head(step), m0 = steps.row0(step), rows = min(BM, mask.q_len - m0);
        const int e_q = ilogbf(q_scales[b * num_heads + h]);
        const int e_do = ilogbf(do_scales[b * num_heads + h]);

        float x[QTILES][4];  // S^T, then P^T (warpgroup 0); dP^T, then dS^T (warpgroup 1)
        pieces_product<KSTEPS, BN, BM>(x, a_tile, a_tile + KPLANE, b_tile, b_tile + QPLANE);
        float factor;
        if (wg == 0) {
            probs<QTILES, LOG2_GAIN>(x, mask, !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN),
                                     m0, n0 + warp_row + g, t, lse_s,
                                     ldexpf(scale_log2, -(e_q + e_k)));
            hand_over(handoff, x);
            barrier_arrive(kHandToSecond);
            factor = ldexpf(1.f, -e_do);  // dV's products are 2^(14 + e_do) times
        } else {
            const float dp_unscale = ldexpf(1.f, -(e_do + e_v));
            float p[QTILES][4];
            barrier_wait(kHandToSecond);
            take_over(handoff, p);
#pragma unroll
            for (int n = 0; n < QTILES; ++n) {
                const float2 delta2 = load_shared_float2(delta_s + n * 8 + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    x[n][e] = p[n][e] * (x[n][e] * dp_unscale - ((e & 1) ? delta2.y : delta2.x));
            }
            const int e_ds = warpgroup_pow2_exponent(x, maxima);
            const float ds_scale = ldexpf(1.f, e_ds);
#pragma unroll
            for (int n = 0; n < QTILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) x[n][e] *= ds_scale;
            factor = ldexpf(1.f, -(e_ds + e_q));  // dK's: 2^(14 + e_ds + e_q) times
        }
        add_pieces_times<COLUMN_CHUNKS>(own, x, c_tile, c_tile + QPLANE, 0, factor);
        __syncthreads();  // both warpgroups are done with Q, dO and the handoff
        if (step + 1 < steps.count) load_step(step + 1);
        cp_async_commit();
    }
    cp_async_wait<0>();

    // dV = own 2^-14; dK = scale own 2^-14. Keys past the capacity are
    // skipped; every other row is written, zeros included.
    float* dst = wg == 0 ? dv : dk;
    const float out_scale = (wg == 0 ? 1.f : scale) * (1.f / (1 << LOG2_GAIN));
    store_key_rows<D>(dst + offset_of(dkv_st, b, hk, n0), dkv_st.s, own, warp_row, g, t,
                      seq.key_rows - n0, out_scale);
}

template <int D>
__global__ void __launch_bounds__(256, 1)
    backward_dq_float32_pieces_wide(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_DQ_PARAMS, half_t, float)) {
    CUFLASH_BACKWARD_PIECES;
    using T = half_t;
    constexpr int DP = 256, BM = 64, BN = 32, NT = 256, NTILES = BN / 8;
    constexpr int KSTEPS = round_up(D, 16) / 16;
    constexpr int LOG2_GAIN = 14;  // P is computed times 2^14
    constexpr int QPLANE = BM * DP, KPLANE = BN * DP;
    static_assert(D % 8 == 0 && D > 128 && D <= DP, "head_dim");
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(dq);
    CUFLASH_SEQUENCE_OF(kv_len);
    extern __shared__ float4 smem4[];
    T* Qs = reinterpret_cast<T*>((reinterpret_cast<unsigned long long>(smem4) + 1023) & ~1023ull);
    T* dOs = Qs + 2 * QPLANE;                                        // (hi, lo)
    T* Ks = dOs + 2 * QPLANE;                                        // (hi, lo)
    T* Vs = Ks + 2 * KPLANE;                                         // (hi, lo)
    float4* to_second = reinterpret_cast<float4*>(Vs + 2 * KPLANE);  // P: [NTILES][128]
    float4* to_first = to_second + NTILES * 128;                     // dS: [NTILES][128]
    float* lse_s = reinterpret_cast<float*>(to_first + NTILES * 128);
    float* delta_s = lse_s + BM;
    float* maxima = delta_s + BM;                           // 4
    int* ds_exponent = reinterpret_cast<int*>(maxima + 4);  // e_ds, for warpgroup 0

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wg = warp >> 2, warp_row = (warp & 3) * 16;  // the warp's 16 query rows
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;      // the longest rows first
    const int h = blockIdx.y, b = seq.batch, hk = h / group;
    const int rows = min(BM, mask.q_len - m0);
    if (rows <= 0) return;  // packed: past the sequence's rows
    qh += seq.q_start * q_st.s;
    ql += seq.q_start * q_st.s;
    doh += seq.q_start * dout_st.s;
    dol += seq.q_start * dout_st.s;
    lse += seq.q_start;
    delta += seq.q_start;
    dq += seq.q_start * dq_st.s;
    kh += seq.kv_start * k_st.s;
    kl += seq.kv_start * k_st.s;
    vh += seq.kv_start * v_st.s;
    vl += seq.kv_start * v_st.s;
    const int kv_head = b * (num_heads / group) + hk;
    const int e_q = ilogbf(q_scales[b * num_heads + h]),
              e_do = ilogbf(do_scales[b * num_heads + h]);
    const int e_k = ilogbf(k_scales[kv_head]), e_v = ilogbf(v_scales[kv_head]);
    const float score_log2 = ldexpf(scale_log2, -(e_q + e_k));
    const float dp_unscale = ldexpf(1.f, -(e_do + e_v));

    const long long head_rows = (static_cast<long long>(b) * num_heads + h) * q_len;
    load_row_stats<BM, NT>(lse_s, delta_s, lse + head_rows + m0, delta + head_rows + m0, rows);
    const long long q_at = offset_of(q_st, b, h, m0), do_at = offset_of(dout_st, b, h, m0);
    cp_async_tile_sw128<BM, DP, NT, D>(Qs, qh + q_at, q_st.s, rows);
    cp_async_tile_sw128<BM, DP, NT, D>(Qs + QPLANE, ql + q_at, q_st.s, rows);
    cp_async_tile_sw128<BM, DP, NT, D>(dOs, doh + do_at, dout_st.s, rows);
    cp_async_tile_sw128<BM, DP, NT, D>(dOs + QPLANE, dol + do_at, dout_st.s, rows);
    int n_start, tiles;
    mask.key_tiles<BN>(m0, m0 + rows, n_start, tiles);
    const long long k_head = offset_of(k_st, b, hk, 0), v_head = offset_of(v_st, b, hk, 0);
    auto load_keys = [&](int tile) {
        const int n0 = n_start + tile * BN, keys = mask.kv_len - n0;
        cp_async_tile_sw128<BN, DP, NT, D>(Ks, kh + k_head + n0 * k_st.s, k_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Ks + KPLANE, kl + k_head + n0 * k_st.s, k_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Vs, vh + v_head + n0 * v_st.s, v_st.s, keys);
        cp_async_tile_sw128<BN, DP, NT, D>(Vs + KPLANE, vl + v_head + n0 * v_st.s, v_st.s, keys);
    };
    if (tiles > 0) load_keys(0);
    cp_async_commit();

    // This warpgroup's 128 columns of dQ, two 64-column chunks.
    float own[16][4];
#pragma unroll
    for (int d = 0; d < 16; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) own[d][e] = 0.f;
    // Warpgroup 0 multiplies Q by K, warpgroup 1 dO by V.
    const T* a_tile = wg == 0 ? Qs : dOs;
    const T* b_tile = wg == 0 ? Ks : Vs;
    // The two rows of this thread: their lse (base 2, less P's gain) and Delta.
    float row_lse[2], row_delta[2];
    int row_lo[2], row_hi[2];  // the keys each row sees
    bool lse_read = false;

    for (int it = 0; it < tiles; ++it) {
        const int n0 = n_start + it * BN;
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // this key tile (and at first Q, dO, lse, Delta) is in
        if (!lse_read) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = warp_row + g + 8 * r;
                row_lse[r] = lse_s[row] - LOG2_GAIN;
                row_delta[r] = delta_s[row];
                mask.row_keys(m0 + row, row_lo[r], row_hi[r]);
            }
            lse_read = true;
        }
        float x[NTILES][4];  // S, then P (warpgroup 0); dP, then dS (warpgroup 1)
        pieces_product<KSTEPS, BM, BN>(x, a_tile, a_tile + QPLANE, b_tile, b_tile + KPLANE);
        const bool edge = !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN);
        int e_ds;
        if (wg == 0) {
#pragma unroll
            for (int n = 0; n < NTILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1, key = n0 + n * 8 + 2 * t + (e & 1);
                    float p = fast_exp2(x[n][e] * score_log2 - row_lse[r]);
                    if (edge && (key < row_lo[r] || key >= row_hi[r])) p = 0.f;
                    x[n][e] = p;
                }
            hand_over(to_second, x);
            barrier_arrive(kHandToSecond);
            barrier_wait(kHandToFirst);
            take_over(to_first, x);
            e_ds = *ds_exponent;
        } else {
            float p[NTILES][4];
            barrier_wait(kHandToSecond);
            take_over(to_second, p);
#pragma unroll
            for (int n = 0; n < NTILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    x[n][e] = p[n][e] * (x[n][e] * dp_unscale - row_delta[e >> 1]);
            e_ds = warpgroup_pow2_exponent(x, maxima);
            const float ds_scale = ldexpf(1.f, e_ds);
#pragma unroll
            for (int n = 0; n < NTILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) x[n][e] *= ds_scale;
            hand_over(to_first, x);
            if (threadIdx.x == 128) *ds_exponent = e_ds;
            barrier_arrive(kHandToFirst);
        }
        // dS (2^(14 + e_ds) times) K (2^e_k times): this warpgroup's columns.
        add_pieces_times<2>(own, x, Ks, Ks + KPLANE, 2 * wg, ldexpf(1.f, -e_ds));
        __syncthreads();  // both warpgroups are done with K, V and the handoffs
        if (it + 1 < tiles) load_keys(it + 1);
        cp_async_commit();
    }
    cp_async_wait<0>();  // Q's copy, when no key tile was read

    // dQ = scale dS K = own scale 2^-(14 + e_k).
    const float out_scale = ldexpf(scale, -(LOG2_GAIN + e_k));
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = warp_row + g + 8 * r;
        if (row >= rows) continue;
        float* dst = dq + offset_of(dq_st, b, h, m0 + row) + wg * (DP / 2);
#pragma unroll
        for (int d = 0; d < 16; ++d)
            if (wg * (DP / 2) + d * 8 < D)  // past D: the pieces' padding columns
                reinterpret_cast<float2*>(dst + d * 8)[t] =
                    make_float2(own[d][2 * r] * out_scale, own[d][2 * r + 1] * out_scale);
    }
}

}  // namespace cuflash
