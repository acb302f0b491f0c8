// The steps the float32-pieces backward kernels past head dim 128 share
// (sm90/backward_float32_pieces_wide.cuh, sm90/backward_dq_float32_pieces_wide.cuh):
// the named barriers and the hand-over of fragments between their two
// warpgroups, the products of 256-column pieces in fresh wgmma chunks, and a
// warpgroup's power-of-two scale.
#pragma once
#include "common/wgmma.cuh"
#include "common/float16_pieces.cuh"

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

}  // namespace cuflash
