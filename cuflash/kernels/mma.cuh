// PTX wrappers for the tensor-core kernels (sm_80 and newer): cp.async,
// ldmatrix and mma.sync m16n8k16 with float32 accumulators, and the
// swizzled shared-memory layout they share.
#pragma once
#include "common.cuh"

namespace cuflash {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; zeros when !valid (src unread).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// D (16x8, f32) += A (16x16, row) * B (16x8, col) for one 16-bit type.
template <typename T> struct TensorOp;
template <> struct TensorOp<bf16_t> {
    static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4],
                                               unsigned b0, unsigned b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // (lo, hi) -> one register, lo in the low half (the lower column).
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        unsigned r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};
template <> struct TensorOp<half_t> {
    static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4],
                                               unsigned b0, unsigned b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        unsigned r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};

// Element offset of 16-byte chunk `chunk` of row `row` in a [rows][D] tile
// whose chunks are XOR-swizzled by the row, so that the 8 rows an ldmatrix
// reads (and the rows cp.async writes) hit 8 different bank groups.
// Rows of 4 chunks (32 elements) swizzle over 4 rows (2-way conflicts).
template <int D>
__device__ __forceinline__ int swizzled(int row, int chunk) {
    static_assert(D % 64 == 0 || D == 32, "the swizzle needs 4 or a multiple of 8 chunks per row");
    constexpr int MASK = D == 32 ? 3 : 7;
    return row * D + ((chunk ^ (row & MASK)) << 3);
}

// Copy rows [0, ROWS) of a tile (row stride `stride` elements) into shared
// memory with cp.async; rows at or past `valid_rows` become zeros.
template <int ROWS, int D, int NT, typename T>
__device__ __forceinline__ void cp_async_tile(T* dst, const T* __restrict__ src,
                                              long long stride, int valid_rows) {
    constexpr int CH = D / 8;
    for (int idx = threadIdx.x; idx < ROWS * CH; idx += NT) {
        const int r = idx / CH, c = idx % CH;
        const bool valid = r < valid_rows;
        cp_async_16(dst + swizzled<D>(r, c), valid ? src + r * stride + c * 8 : src, valid);
    }
}

}  // namespace cuflash
