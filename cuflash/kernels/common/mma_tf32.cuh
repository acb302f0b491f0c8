// float32 on the tensor cores (sm_80 and newer) at TF32 accuracy, for calls
// with allow_tf32=True: mma.sync m16n8k8 on TF32 operands (each float32
// rounded to 10 stored mantissa bits, 2^-11 relative) with float32
// accumulators. (A three-pass hi/lo split for float32 accuracy was measured
// at 3-18x the general kernel's error, the tensor cores truncating as they
// accumulate; float32 accuracy now runs on two float16 pieces and the wgmma,
// sm90/forward_float32_pieces.cuh. docs/kernels/tf32.md keeps the measurements.)
//
// Fragment layout of m16n8k8 (g = lane / 4, t = lane % 4):
//   A (16 x 8, row):  a0 (g, t)  a1 (g + 8, t)  a2 (g, t + 4)  a3 (g + 8, t + 4)
//   B (8 x 8, col):   b0 (t, g)  b1 (t + 4, g)
//   C (16 x 8):       c0 (g, 2t) c1 (g, 2t + 1) c2 (g + 8, 2t) c3 (g + 8, 2t + 1)
// Tiles live in shared memory as float32 rows of pitch D + 4 words: every
// fragment read below (rows g or 2t, column t or g) then hits 32 banks.
#pragma once
#include "common/mma.cuh"

namespace cuflash {

__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

// N float32 values rounded to TF32.
template <int N>
struct Tf32Frag {
    unsigned v[N];

    __device__ __forceinline__ void set(int i, float x) { v[i] = to_tf32(x); }
};

__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// C (16 x 8) += A (16 x 8) B (8 x 8) in TF32.
__device__ __forceinline__ void mma_f32(float (&c)[4], const Tf32Frag<4>& a, const Tf32Frag<2>& b) {
    mma_tf32(c, a.v, b.v[0], b.v[1]);
}

template <int N>
__device__ __forceinline__ void zero_tile(float (&acc)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
}

// A fragment of rows [row0, row0 + 16), columns [col0, col0 + 8) of a pitched tile.
template <int PITCH>
__device__ __forceinline__ void load_a_f32(Tf32Frag<4>& f, const float* tile, int row0, int col0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* p = tile + (row0 + g) * PITCH + col0 + t;
    f.set(0, p[0]);
    f.set(1, p[8 * PITCH]);
    f.set(2, p[4]);
    f.set(3, p[8 * PITCH + 4]);
}

// B fragment (k x n = 8 x 8) read from a tile stored n-major: B(k, n) = tile[n0 + n][k0 + k].
template <int PITCH>
__device__ __forceinline__ void load_b_f32(Tf32Frag<2>& f, const float* tile, int n0, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* p = tile + (n0 + g) * PITCH + k0 + t;
    f.set(0, p[0]);
    f.set(1, p[4]);
}

// B fragment read from a tile stored k-major, B(k, n) = tile[k0 + k'][n0 + n],
// with the k index permuted: k = t -> row 2t, k = t + 4 -> row 2t + 1. An A
// fragment taken from C accumulators (see a_from_c) uses the same order, so
// the product is unchanged, and the reads hit 32 banks.
template <int PITCH>
__device__ __forceinline__ void load_b_f32_kmajor(Tf32Frag<2>& f, const float* tile, int k0,
                                                  int n0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* p = tile + (k0 + 2 * t) * PITCH + n0 + g;
    f.set(0, p[0]);
    f.set(1, p[PITCH]);
}

// A fragment (16 x 8) read from a tile stored k-major, A(m, k) = tile[k0 + k'][m0 + m],
// with load_b_f32_kmajor's k order.
template <int PITCH>
__device__ __forceinline__ void load_a_f32_kmajor(Tf32Frag<4>& f, const float* tile, int k0,
                                                  int m0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* p = tile + (k0 + 2 * t) * PITCH + m0 + g;
    f.set(0, p[0]);
    f.set(1, p[8]);
    f.set(2, p[PITCH]);
    f.set(3, p[PITCH + 8]);
}

// The C accumulators of an m16n8 tile as the A fragment of the next product
// (its 8 columns become the k index, in load_b_f32_kmajor's order).
__device__ __forceinline__ void a_from_c(Tf32Frag<4>& f, const float (&c)[4]) {
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
