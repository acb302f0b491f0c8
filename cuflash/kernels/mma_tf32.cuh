// float32 on the tensor cores (sm_80 and newer): mma.sync m16n8k8 on TF32
// operands with float32 accumulators, and the split that keeps float32
// accuracy. Each float32 x becomes hi = tf32(x) and lo = tf32(x - hi)
// (x - hi is exact), so x = hi + lo to about 2^-22 relative; a product is
// a_hi b_hi + a_hi b_lo + a_lo b_hi, and the dropped a_lo b_lo is below
// 2^-22 of it. PASSES = 3 runs those three mma (small terms first);
// PASSES = 1 runs a_hi b_hi alone (plain TF32, 2^-11 relative).
// Measured on an H200, the three-pass kernels' errors are 3-18x the FFMA
// kernel's, not the 0.7x the split predicts: the tensor cores add into their
// accumulator with truncation, so a long sum drifts by up to 2^-23 of itself
// per mma, always towards zero. Summing a few steps into a fresh accumulator
// and adding that with one FADD (round to nearest) removes most of the bias
// (scripts/tf32_split_model.py: chunks of 4 steps, 0.9-1.3x FFMA's error);
// tc32_fwd.cuh does that (add_tile below), the backward not yet. The dispatch
// passes over "tc32" (gpu.SKIP_FAMILIES) until the GPU measures both.
//
// Fragment layout of m16n8k8 (g = lane / 4, t = lane % 4):
//   A (16 x 8, row):  a0 (g, t)  a1 (g + 8, t)  a2 (g, t + 4)  a3 (g + 8, t + 4)
//   B (8 x 8, col):   b0 (t, g)  b1 (t + 4, g)
//   C (16 x 8):       c0 (g, 2t) c1 (g, 2t + 1) c2 (g + 8, 2t) c3 (g + 8, 2t + 1)
// Tiles live in shared memory as float32 rows of pitch D + 4 words: every
// fragment read below (rows g or 2t, column t or g) then hits 32 banks.
#pragma once
#include "mma.cuh"

namespace cuflash {

__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

// N float32 values as TF32 high parts and (PASSES = 3) low parts.
template <int N, int PASSES>
struct Tf32Frag {
    unsigned hi[N], lo[N];

    __device__ __forceinline__ void set(int i, float x) {
        hi[i] = to_tf32(x);
        if (PASSES == 3) lo[i] = to_tf32(x - __uint_as_float(hi[i]));
    }
};

__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// C (16 x 8) += A (16 x 8) B (8 x 8) in float32 accuracy (PASSES = 3) or TF32.
template <int PASSES>
__device__ __forceinline__ void mma_f32(float (&c)[4], const Tf32Frag<4, PASSES>& a,
                                        const Tf32Frag<2, PASSES>& b) {
    if (PASSES == 3) {
        mma_tf32(c, a.lo, b.hi[0], b.hi[1]);
        mma_tf32(c, a.hi, b.lo[0], b.lo[1]);
    }
    mma_tf32(c, a.hi, b.hi[0], b.hi[1]);
}

template <int N>
__device__ __forceinline__ void zero_tile(float (&acc)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
}

// acc += part, element by element, rounded to nearest (FADD).
__device__ __forceinline__ void add_tile(float (&acc)[4], const float (&part)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] += part[e];
}
template <int N>
__device__ __forceinline__ void add_tile(float (&acc)[N][4], const float (&part)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n) add_tile(acc[n], part[n]);
}

// A fragment of rows [row0, row0 + 16), columns [col0, col0 + 8) of a pitched tile.
template <int PITCH, int PASSES>
__device__ __forceinline__ void load_a_f32(Tf32Frag<4, PASSES>& f, const float* tile, int row0,
                                           int col0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* p = tile + (row0 + g) * PITCH + col0 + t;
    f.set(0, p[0]);
    f.set(1, p[8 * PITCH]);
    f.set(2, p[4]);
    f.set(3, p[8 * PITCH + 4]);
}

// B fragment (k x n = 8 x 8) read from a tile stored n-major: B(k, n) = tile[n0 + n][k0 + k].
template <int PITCH, int PASSES>
__device__ __forceinline__ void load_b_f32(Tf32Frag<2, PASSES>& f, const float* tile, int n0,
                                           int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* p = tile + (n0 + g) * PITCH + k0 + t;
    f.set(0, p[0]);
    f.set(1, p[4]);
}

// B fragment read from a tile stored k-major, B(k, n) = tile[k0 + k'][n0 + n],
// with the k index permuted: k = t -> row 2t, k = t + 4 -> row 2t + 1. An A
// fragment taken from C accumulators (see a_from_c) uses the same order, so
// the product is unchanged, and the reads hit 32 banks.
template <int PITCH, int PASSES>
__device__ __forceinline__ void load_b_f32_kmajor(Tf32Frag<2, PASSES>& f, const float* tile,
                                                  int k0, int n0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* p = tile + (k0 + 2 * t) * PITCH + n0 + g;
    f.set(0, p[0]);
    f.set(1, p[PITCH]);
}

// A fragment (16 x 8) read from a tile stored k-major, A(m, k) = tile[k0 + k'][m0 + m],
// with load_b_f32_kmajor's k order.
template <int PITCH, int PASSES>
__device__ __forceinline__ void load_a_f32_kmajor(Tf32Frag<4, PASSES>& f, const float* tile,
                                                  int k0, int m0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* p = tile + (k0 + 2 * t) * PITCH + m0 + g;
    f.set(0, p[0]);
    f.set(1, p[8]);
    f.set(2, p[PITCH]);
    f.set(3, p[PITCH + 8]);
}

// The C accumulators of an m16n8 tile as the A fragment of the next product
// (its 8 columns become the k index, in load_b_f32_kmajor's order).
template <int PASSES>
__device__ __forceinline__ void a_from_c(Tf32Frag<4, PASSES>& f, const float (&c)[4]) {
    f.set(0, c[0]);
    f.set(1, c[2]);
    f.set(2, c[1]);
    f.set(3, c[3]);
}

// Rows [0, ROWS) of D float32 columns into a tile of pitch D + 4 with
// cp.async; rows at or past valid_rows become zeros.
template <int ROWS, int D, int NT>
__device__ __forceinline__ void cp_async_tile_f32(float* dst, const float* __restrict__ src,
                                                  long long stride, int valid_rows) {
    cp_async_rows<ROWS, D / 4, NT>(dst, src, stride, valid_rows,
                                   [](int r, int c) { return r * (D + 4) + c * 4; });
}

}  // namespace cuflash
