// PTX wrappers for the tensor-core kernels (sm_80 and newer): cp.async,
// ldmatrix and mma.sync m16n8k16 with float32 accumulators, and the
// swizzled shared-memory layout they share.
#pragma once
#include "common/common.cuh"

namespace cuflash {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// The dynamic shared memory from its first ALIGN-byte boundary (the 128-byte swizzle's
// atoms need 1024). Pointer arithmetic on the shared array itself, not on an integer:
// the compiler then knows every pointer derived from it is shared, and plain stores
// compile to STS, not generic ST (whose proxy fences added a MEMBAR.ALL.CTA each).
template <typename T, unsigned ALIGN = 1024>
__device__ __forceinline__ T* shared_aligned(void* smem) {
    char* base = static_cast<char*>(smem);
    return reinterpret_cast<T*>(base + ((ALIGN - (smem_addr(base) & (ALIGN - 1))) & (ALIGN - 1)));
}

// 16 bytes global -> shared, asynchronously; zeros when !valid (src unread).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
// The same for data read once in long runs (a KV cache): the L2 fetches whole 128-byte
// lines from memory (about 3 % more bandwidth than 32-byte sectors on the H200).
__device__ __forceinline__ void cp_async_16_stream(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(valid ? 16 : 0));
}
// 4 bytes through L1; zeros, and `src` not read, where !valid.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
    asm volatile(
        "{\n .reg .pred ignore;\n setp.eq.u32 ignore, %2, 0;\n"
        " cp.async.ca.shared.global [%0], [%1], 4, ignore;\n}\n" ::"r"(smem_addr(dst)),
        "l"(src), "r"(static_cast<unsigned>(valid)));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// The transpose of an 8x8 b16 matrix held a row of two elements a lane (lane 4i + j:
// row i, columns 2j and 2j + 1), in the same layout.
__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
    unsigned r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
    return r;
}

// D (16x8, f32) += A (16x16, row) * B (16x8, col) for one 16-bit type.
template <typename T>
struct TensorOp;
template <>
struct TensorOp<bf16_t> {
    static constexpr bool wide_exponent = true;  // float32's exponent range
    static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                               unsigned b1) {
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
template <>
struct TensorOp<half_t> {
    static constexpr bool wide_exponent = false;
    static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                               unsigned b1) {
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

// Four floats as e4m3 in one register, a in the lowest byte (round to nearest even,
// saturated to +-448; sm_89 and newer).
__device__ __forceinline__ unsigned pack_e4m3x4(float a, float b, float c, float d) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(d), "f"(c));
    return static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
}

// Bytes of a and b picked by `selector` (prmt.b32: nibble i names result byte i, 0-3
// a's bytes, 4-7 b's).
template <unsigned SELECTOR>
__device__ __forceinline__ unsigned byte_perm(unsigned a, unsigned b) {
    unsigned r;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "n"(SELECTOR));
    return r;
}

// Four e4m3 values (bytes 0-3 of x) as float16 pairs, exactly: bytes 0, 1 in lo (byte 0
// the low half), bytes 2, 3 in hi; NaN stays NaN (sm_89 and newer).
__device__ __forceinline__ void e4m3x4_to_f16x2(unsigned x, unsigned& lo, unsigned& hi) {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
        " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(x));
}

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

// f(i) for i = 0 .. N - 1 in a loop unrolled, or not (ROLLED: for a producer
// warpgroup that keeps few registers).
template <int N, bool ROLLED, typename F>
__device__ __forceinline__ void repeat(F&& f) {
    if constexpr (ROLLED) {
#pragma unroll 1
        for (int i = 0; i < N; ++i) f(i);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) f(i);
    }
}

// Copy rows [0, ROWS) of CH 16-byte chunks each (row stride `stride`
// elements) into shared memory with cp.async, chunk c of row r at element
// offset to(r, c); rows at or past `valid_rows`, and chunks at or past
// VALID_CH (the head_dim's padding up to the tile's width), become zeros
// (their source is not read). The tile layouts below are all this loop with
// another `to`. When the NT threads cover whole rows a pass, each thread
// keeps its chunk column and steps NT / CH rows at a time: one address add a
// chunk, the loop unrolled (ROLLED: not, for a producer warpgroup that keeps
// few registers).
template <int ROWS, int CH, int NT, int VALID_CH = CH, bool ROLLED = false, typename T,
          typename Layout>
__device__ __forceinline__ void cp_async_rows(T* dst, const T* __restrict__ src, long long stride,
                                              int valid_rows, Layout to) {
    constexpr int PER_CHUNK = 16 / sizeof(T);
    static_assert(VALID_CH <= CH, "valid chunks");
    if constexpr (NT % CH == 0 && (ROWS * CH) % NT == 0) {
        constexpr int ROW_STEP = NT / CH;
        const int r0 = threadIdx.x / CH, c = threadIdx.x % CH;
        const bool column_valid = VALID_CH == CH || c < VALID_CH;
        const T* from = src + r0 * stride + c * PER_CHUNK;
        auto copy_row = [&](int i) {
            const int r = r0 + i * ROW_STEP;
            const bool valid = column_valid && r < valid_rows;
            cp_async_16(dst + to(r, c), valid ? from : src, valid);
            from += ROW_STEP * stride;
        };
        repeat<ROWS / ROW_STEP, ROLLED>(copy_row);
    } else {
#pragma unroll 4
        for (int idx = threadIdx.x; idx < ROWS * CH; idx += NT) {
            const int r = idx / CH, c = idx % CH;
            const bool valid = r < valid_rows && (VALID_CH == CH || c < VALID_CH);
            cp_async_16(dst + to(r, c), valid ? src + r * stride + c * PER_CHUNK : src, valid);
        }
    }
}

// A [ROWS][DT] 16-bit tile in the swizzled layout of swizzled<DT>: columns
// [0, D) from `src`, zeros from D to the power-of-two chunk count that covers
// round_up(D, 16) (the padding of the last k16 step, and whole rows a pass
// for the copy loop), the rest not written.
template <int ROWS, int DT, int NT, int D = DT, typename T>
__device__ __forceinline__ void cp_async_tile(T* dst, const T* __restrict__ src, long long stride,
                                              int valid_rows) {
    constexpr int CH = pow2_at_least(round_up(D, 16) / 8);
    static_assert(CH * 8 <= DT, "the tile holds the chunks");
    cp_async_rows<ROWS, CH, NT, D / 8>(dst, src, stride, valid_rows,
                                       [](int r, int c) { return swizzled<DT>(r, c); });
}

// Two products over the head dim (KSTEPS k16 steps) for a warp's 16 rows from row a0
// of tiles A1, A2 against NTILES * 8 rows of tiles B1, B2 (all [rows][DT], swizzled<DT>):
// acc1 += A1 B1^T and acc2 += A2 B2^T, e.g. S = Q K^T and dP = dO V^T of the dQ pass.
// A by ldmatrix, B by pairs of n8 tiles. (sm80/backward_mma_sync.cuh's S^T and dP^T are this loop
// written out: its atomic modified role at D = 128 has 255 registers, and with this
// helper ptxas spilled 12 bytes there.)
template <typename T, int DT, int KSTEPS, int NTILES>
__device__ __forceinline__ void paired_products(const T* A1, const T* A2, const T* B1, const T* B2,
                                                int a0, float (&acc1)[NTILES][4],
                                                float (&acc2)[NTILES][4]) {
    using Op = TensorOp<T>;
    const int lane = threadIdx.x & 31;
    const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_chunk = lane >> 4;
    const int b_row = (lane & 7) + 8 * (lane >> 4), b_chunk = (lane >> 3) & 1;
#pragma unroll 2  // bounds register pressure
    for (int ks = 0; ks < KSTEPS; ++ks) {
        unsigned a1[4], a2[4];
        ldmatrix_x4(a1, A1 + swizzled<DT>(a0 + a_row, 2 * ks + a_chunk));
        ldmatrix_x4(a2, A2 + swizzled<DT>(a0 + a_row, 2 * ks + a_chunk));
#pragma unroll
        for (int n = 0; n < NTILES; n += 2) {
            unsigned b1[4], b2[4];
            ldmatrix_x4(b1, B1 + swizzled<DT>(n * 8 + b_row, 2 * ks + b_chunk));
            ldmatrix_x4(b2, B2 + swizzled<DT>(n * 8 + b_row, 2 * ks + b_chunk));
            Op::mma(acc1[n], a1, b1[0], b1[1]);
            Op::mma(acc1[n + 1], a1, b1[2], b1[3]);
            Op::mma(acc2[n], a2, b2[0], b2[1]);
            Op::mma(acc2[n + 1], a2, b2[2], b2[3]);
        }
    }
}

// K and V of the BN keys from key n0 (of kv_len) into buffer `buf` of two [BN][DT]
// buffers each, as cp_async_tile lays them out (not committed).
template <int BN, int DT, int NT, int D, typename T>
__device__ __forceinline__ void load_kv_tiles(T* Ks, T* Vs, int buf, const T* __restrict__ k_head,
                                              long long k_stride, const T* __restrict__ v_head,
                                              long long v_stride, int n0, int kv_len) {
    const int keys = kv_len - n0;
    cp_async_tile<BN, DT, NT, D>(Ks + buf * BN * DT, k_head + n0 * k_stride, k_stride, keys);
    cp_async_tile<BN, DT, NT, D>(Vs + buf * BN * DT, v_head + n0 * v_stride, v_stride, keys);
}

// lse (base 2, from the Delta pass) and Delta of query rows [0, BM) of a tile
// into shared memory with cp.async (in the caller's group), from lse_rows /
// delta_rows (the tile's first row). Plain loads stalled the warps that
// issued them until the values came back (a store waits for its load).
// Padding rows get zeros: their Q and dO rows are zeros too, so their
// P^T = 1 meets dO = 0 in dV and dP^T - Delta = 0 in dS^T.
template <int BM, int NT>
__device__ __forceinline__ void load_row_stats(float* lse_s, float* delta_s,
                                               const float* __restrict__ lse_rows,
                                               const float* __restrict__ delta_rows, int rows) {
    for (int r = threadIdx.x; r < BM; r += NT) {
        cp_async_4(lse_s + r, lse_rows + r, r < rows);
        cp_async_4(delta_s + r, delta_rows + r, r < rows);
    }
}

// Two consecutive floats of shared memory (8-byte aligned) through ld.shared:
// the compiler does not always see that a pointer into the dynamic shared
// array is one, and then issues generic loads.
__device__ __forceinline__ float2 load_shared_float2(const float* p) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(smem_addr(p)));
    return v;
}

// In place on a warp's S^T accumulators (16 keys from key0, rows g and g + 8;
// QTILES tiles of 8 queries from m0; t = lane % 4): P^T = exp2(S^T
// scale_log2 - lse), with lse (base 2) per query column from shared memory
// (lse_s, 8-byte aligned); masked only when `edge` (two straight-line
// versions, so that the unmasked one has no per-element branch), by the
// user's mask too (`mods`, a mask-only kernel's). With LOG2_GAIN, P^T comes
// times 2^LOG2_GAIN. ALIBI: the scores take ALiBi's bias (mods.slope2, the
// call's only modifier of the scores: its derivative is 1, so dscores
// follows as in the plain kernels).
template <bool EDGE, int QTILES, int LOG2_GAIN = 0, typename Mods = NoModifiers, bool ALIBI = false>
__device__ __forceinline__ void probs_of(float (&st)[QTILES][4], const Mask& mask, int m0, int key0,
                                         int t, const float* lse_s, float scale_log2,
                                         const Mods& mods = Mods{}, bool partial = true) {
    int lo[2] = {0, 0}, hi[2] = {0, 0};  // the queries keys key0 and key0 + 8 are seen by
    if (EDGE) {
#pragma unroll
        for (int r = 0; r < 2; ++r) mask.key_rows(key0 + 8 * r, lo[r], hi[r]);
    }
    // ALiBi's distances query + offset - key of query m0 + 2 t, as floats
    float distance0[2] = {0.f, 0.f};
    if constexpr (ALIBI) {
        const float query_pos = static_cast<float>(m0 + 2 * t + static_cast<int>(mods.offset));
#pragma unroll
        for (int r = 0; r < 2; ++r) distance0[r] = query_pos - static_cast<float>(key0 + 8 * r);
    }
#pragma unroll
    for (int n = 0; n < QTILES; ++n) {
        const float2 lse2 = load_shared_float2(lse_s + n * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float lse_e = (e & 1) ? lse2.y : lse2.x;
            if constexpr (LOG2_GAIN != 0) lse_e -= LOG2_GAIN;
            if constexpr (ALIBI) {
                const float distance = distance0[e >> 1] + static_cast<float>(n * 8 + (e & 1));
                lse_e = fmaf(mods.slope2, fabsf(distance), lse_e);
            }
            float p = fast_exp2(st[n][e] * scale_log2 - lse_e);
            const int query = m0 + n * 8 + 2 * t + (e & 1);
            if (EDGE && (query < lo[e >> 1] || query >= hi[e >> 1] ||
                         (partial && !mods.sees(query, key0 + 8 * (e >> 1)))))
                p = 0.f;
            st[n][e] = p;
        }
    }
}
template <int QTILES, int LOG2_GAIN = 0, typename Mods = NoModifiers, bool ALIBI = false>
__device__ __forceinline__ void probs(float (&st)[QTILES][4], const Mask& mask, bool edge, int m0,
                                      int key0, int t, const float* lse_s, float scale_log2,
                                      const Mods& mods = Mods{}, bool partial = true) {
    if (edge)
        probs_of<true, QTILES, LOG2_GAIN, Mods, ALIBI>(st, mask, m0, key0, t, lse_s, scale_log2,
                                                       mods, partial);
    else
        probs_of<false, QTILES, LOG2_GAIN, Mods, ALIBI>(st, mask, m0, key0, t, lse_s, scale_log2,
                                                        mods);
}
// With score modifiers, both in one pass on every tile (the modifiers'
// derivative enters dS^T): P^T = exp2(mod2(S^T scale_log2) - lse) (mod2: the
// modifiers in base 2), masked element by element (by the user's mask too
// where `partial`), and dS^T = P^T (dP^T - Delta) mod'.
template <int QTILES, int LOG2_GAIN = 0, typename Mods>
__device__ __forceinline__ void modified_probs_and_dscores(float (&st)[QTILES][4],
                                                           float (&dpt)[QTILES][4],
                                                           const Mask& mask, const Mods& mods,
                                                           int m0, int key0, int t,
                                                           const float* lse_s, const float* delta_s,
                                                           float scale_log2, bool partial = true) {
    int lo[2], hi[2];  // the queries keys key0 and key0 + 8 are seen by
#pragma unroll
    for (int r = 0; r < 2; ++r) mask.key_rows(key0 + 8 * r, lo[r], hi[r]);
    {
        // ALiBi's distances query + offset - key as floats (see mask_scores).
        const int offset = static_cast<int>(mods.offset);  // kv_len - q_len: an int
        const float query_base = static_cast<float>(m0 + 2 * t + offset);
        const float key_pos[2] = {static_cast<float>(key0), static_cast<float>(key0 + 8)};
#pragma unroll
        for (int n = 0; n < QTILES; ++n) {
            const float2 lse2 = load_shared_float2(lse_s + n * 8 + 2 * t);
            const float2 delta2 = load_shared_float2(delta_s + n * 8 + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float lse_e = (e & 1) ? lse2.y : lse2.x;
                if constexpr (LOG2_GAIN != 0) lse_e -= LOG2_GAIN;
                const int query = m0 + n * 8 + 2 * t + (e & 1), key = key0 + 8 * (e >> 1);
                const float distance =
                    query_base + static_cast<float>(n * 8 + (e & 1)) - key_pos[e >> 1];
                float derivative;
                const float score2 = mods.template apply2<true>(st[n][e], scale_log2, query, key,
                                                                distance, derivative);
                float p = fast_exp2(score2 - lse_e);
                if (query < lo[e >> 1] || query >= hi[e >> 1] ||
                    (partial && !mods.sees(query, key)))
                    p = 0.f;
                st[n][e] = p;
                dpt[n][e] = p * (dpt[n][e] - ((e & 1) ? delta2.y : delta2.x)) * derivative;
            }
        }
    }
}
// Then dS^T = P^T (dP^T - Delta) in place on the dP^T accumulators, Delta per
// query column from delta_s (8-byte aligned); times `scale` where given (dS^T's
// products then come out scaled: the softmax scale folded in once, as an FFMA).
template <int QTILES>
__device__ __forceinline__ void dscores(const float (&pt)[QTILES][4], float (&dpt)[QTILES][4],
                                        int t, const float* delta_s) {
#pragma unroll
    for (int n = 0; n < QTILES; ++n) {
        const float2 delta2 = load_shared_float2(delta_s + n * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e)
            dpt[n][e] = pt[n][e] * (dpt[n][e] - ((e & 1) ? delta2.y : delta2.x));
    }
}
template <int QTILES>
__device__ __forceinline__ void dscores(const float (&pt)[QTILES][4], float (&dpt)[QTILES][4],
                                        int t, const float* delta_s, float scale) {
#pragma unroll
    for (int n = 0; n < QTILES; ++n) {
        const float2 delta2 = load_shared_float2(delta_s + n * 8 + 2 * t);
        const float scaled[2] = {delta2.x * scale, delta2.y * scale};
#pragma unroll
        for (int e = 0; e < 4; ++e) dpt[n][e] = pt[n][e] * fmaf(dpt[n][e], scale, -scaled[e & 1]);
    }
}
// Both steps.
template <int QTILES, typename Mods = NoModifiers>
__device__ __forceinline__ void probs_and_dscores(float (&st)[QTILES][4], float (&dpt)[QTILES][4],
                                                  const Mask& mask, bool edge, int m0, int key0,
                                                  int t, const float* lse_s, const float* delta_s,
                                                  float scale_log2, const Mods& mods = Mods{}) {
    probs(st, mask, edge, m0, key0, t, lse_s, scale_log2, mods);
    dscores(st, dpt, t, delta_s);
}

// The dQ passes (sm80/backward_dq_mma_sync.cuh, sm90/backward_dq_wgmma.cuh), on
// a warp's S and dP accumulators in the m16n8 layout of mma.sync and wgmma
// alike (rows row0 + g and row0 + g + 8, BN = 8 NTILES keys from n0): P =
// exp2(S scale_log2 - lse) masked, then dS = P (dP - Delta) in place of dP. lse
// (base 2; +inf for a row that sees nothing or is padding) and Delta per row.
// EDGE: keys outside a row's interval (and, on a `partial` tile, where the
// user's mask hides them) get P = 0. MODIFIED: the modifiers' scores and
// derivative (apply2) on every element.
template <bool EDGE, bool MODIFIED, int NTILES, typename Mods>
__device__ __forceinline__ void query_dscores(float (&s)[NTILES][4], float (&dp)[NTILES][4],
                                              const Mask& mask, const Mods& mods, int row0, int n0,
                                              int t, const float (&row_lse)[2],
                                              const float (&row_delta)[2], float scale_log2,
                                              bool partial) {
    int lo[2] = {0, 0}, hi[2] = {0, 0};
    if (EDGE) {
#pragma unroll
        for (int r = 0; r < 2; ++r) mask.row_keys(row0 + 8 * r, lo[r], hi[r]);
    }
    const int offset = static_cast<int>(mods.offset);  // kv_len - q_len (ALiBi): an int
#pragma unroll
    for (int n = 0; n < NTILES; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = e >> 1, row = row0 + 8 * r, key = n0 + n * 8 + 2 * t + (e & 1);
            float p, derivative = 1.f;
            if constexpr (MODIFIED) {
                const float distance = static_cast<float>(row + offset - key);
                const float score2 =
                    mods.template apply2<true>(s[n][e], scale_log2, row, key, distance, derivative);
                p = fast_exp2(score2 - row_lse[r]);
            } else {
                p = fast_exp2(fmaf(s[n][e], scale_log2, -row_lse[r]));
            }
            if (EDGE && (key < lo[r] || key >= hi[r] || (partial && !mods.sees(row, key)))) p = 0.f;
            dp[n][e] = p * (dp[n][e] - row_delta[r]);
            if constexpr (MODIFIED) dp[n][e] *= derivative;
        }
}
// One key tile's P and dS in a dQ pass (query_dscores): with score modifiers that change
// the scores on every element; else masked on an edge tile (`edge`: the rows' intervals
// cut it, or the block mask calls it partial) and straight elsewhere.
template <bool SCORES_MODIFIED, int NTILES, typename Mods>
__device__ __forceinline__ void query_tile_dscores(float (&s)[NTILES][4], float (&dp)[NTILES][4],
                                                   const Mask& mask, const Mods& mods, bool edge,
                                                   int row0, int n0, int t,
                                                   const float (&row_lse)[2],
                                                   const float (&row_delta)[2], float scale_log2,
                                                   bool partial) {
    if (SCORES_MODIFIED)
        query_dscores<true, SCORES_MODIFIED>(s, dp, mask, mods, row0, n0, t, row_lse, row_delta,
                                             scale_log2, partial);
    else if (edge)
        query_dscores<true, false>(s, dp, mask, mods, row0, n0, t, row_lse, row_delta, scale_log2,
                                   partial);
    else
        query_dscores<false, false>(s, dp, mask, mods, row0, n0, t, row_lse, row_delta, scale_log2,
                                    false);
}

// lse (base 2) and Delta of a dQ pass's lane rows row0 and row0 + 8 of its query
// tile (`rows` of them real; the tile's first row at `head_row0` of lse and Delta);
// padding rows get lse = +inf (P = 0) and Delta = 0.
__device__ __forceinline__ void query_row_stats(const float* __restrict__ lse,
                                                const float* __restrict__ delta,
                                                long long head_row0, int row0, int rows,
                                                float (&row_lse)[2], float (&row_delta)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r;
        row_lse[r] = row < rows ? lse[head_row0 + row] : -neg_inf();
        row_delta[r] = row < rows ? delta[head_row0 + row] : 0.f;
    }
}

// The steps of a backward block over its key tile [n0, n1): each query head of
// KV head hk in turn, each with its tiles of BM query rows that see the keys.
template <int BM>
struct QuerySteps {
    int h_first, m_first, per_head, count;

    __device__ __forceinline__ QuerySteps(const Mask& mask, int n0, int n1, int hk, int group) {
        int m_lo, m_hi;
        mask.query_range(n0, n1, m_lo, m_hi);
        h_first = hk * group;
        m_first = m_lo - m_lo % BM;
        per_head = m_lo < m_hi ? (m_hi - m_first + BM - 1) / BM : 0;
        count = per_head * group;
    }
    // Only the query tiles in the block mask's range of key tile `outer` (kv
    // head hk's ranges: the union over its group's query heads).
    template <typename Mods>
    __device__ __forceinline__ void narrow(const Mods& mods, int outer, int hk, int group) {
        mods.template narrow<BM>(outer, hk, m_first, per_head);
        count = per_head * group;
    }
    __device__ __forceinline__ int head(int step) const { return h_first + step / per_head; }
    __device__ __forceinline__ int row0(int step) const { return m_first + (step % per_head) * BM; }
};

// Q and dO, lse and Delta (cp.async, not committed) of the query tile at
// rows [m0, m0 + BM) of head h (q_len rows; q_rows a head in lse and Delta)
// into one set of buffers.
template <int BM, int DT, int D, int NT, typename T>
__device__ __forceinline__ void load_query_tile(T* Qb, T* dOb, float* lse_b, float* delta_b,
                                                const T* __restrict__ q, const Strides& q_st,
                                                const T* __restrict__ dout, const Strides& dout_st,
                                                const float* __restrict__ lse,
                                                const float* __restrict__ delta, int b, int h,
                                                int m0, int num_heads, int q_len, int q_rows) {
    const int rows = min(BM, q_len - m0);
    const long long head_rows = (static_cast<long long>(b) * num_heads + h) * q_rows;
    cp_async_tile<BM, DT, NT, D>(Qb, q + offset_of(q_st, b, h, m0), q_st.s, rows);
    cp_async_tile<BM, DT, NT, D>(dOb, dout + offset_of(dout_st, b, h, m0), dout_st.s, rows);
    load_row_stats<BM, NT>(lse_b, delta_b, lse + head_rows + m0, delta + head_rows + m0, rows);
}

// dst[0] += x, dst[1] += y in float32 atomics (dst 8-byte aligned) where
// `pred`, without a branch: one predicated vector reduction on sm_90 and
// newer, two scalar ones before.
__device__ __forceinline__ void atomic_add_float2(float* dst, float x, float y, bool pred = true) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %3, 0;\n"
        "@p red.global.add.v2.f32 [%0], {%1, %2};\n}\n" ::"l"(dst),
        "f"(x), "f"(y), "r"(static_cast<int>(pred))
        : "memory");
#else
    if (pred) {
        atomicAdd(dst, x);
        atomicAdd(dst + 1, y);
    }
#endif
}

// dQ[m16 query tile qm, d tiles [d_first, d_first + DQN)] += scale dS K for
// one (query tile, key tile), added with float32 atomics to dq_rows (the
// tile's first row, row stride D; rows < rows only). dS comes from dS^T in
// shared memory ([BN keys][BM queries], swizzled), K from Ks ([BN][D], swizzled).
template <typename T, int D, int BM, int BN, int DQN>
__device__ __forceinline__ void atomic_dq_tile(const T* dSs, const T* Ks,
                                               float* __restrict__ dq_rows, int qm, int d_first,
                                               int rows, float scale) {
    using Op = TensorOp<T>;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_chunk = lane >> 4;
    const int b_row = (lane & 7) + 8 * (lane >> 4), b_chunk = (lane >> 3) & 1;
    float dq_acc[DQN][4];
#pragma unroll
    for (int d = 0; d < DQN; ++d) dq_acc[d][0] = dq_acc[d][1] = dq_acc[d][2] = dq_acc[d][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        unsigned da[4];  // A = dS (queries x keys) = dS^T transposed
        ldmatrix_x4_trans(da, dSs + swizzled<BM>(kk * 16 + b_row, 2 * qm + b_chunk));
#pragma unroll
        for (int d = 0; d < DQN; d += 2) {
            unsigned kb[4];
            ldmatrix_x4_trans(kb, Ks + swizzled<D>(kk * 16 + a_row, d_first + d + a_chunk));
            Op::mma(dq_acc[d], da, kb[0], kb[1]);
            Op::mma(dq_acc[d + 1], da, kb[2], kb[3]);
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = qm * 16 + g + 8 * r;
        if (row >= rows) continue;
        float* dst = dq_rows + static_cast<long long>(row) * D + d_first * 8 + 2 * t;
#pragma unroll
        for (int d = 0; d < DQN; ++d) {
            atomic_add_float2(dst + d * 8, dq_acc[d][2 * r] * scale, dq_acc[d][2 * r + 1] * scale);
        }
    }
}

// Rows g and g + 8 of a warp's 16 rows of an output tile from its accumulator
// fragment (the keys of a dK or dV tile, or the query rows of a dQ pass): from
// row row0 of a tile whose first row `out` points at, rows row_stride elements
// apart, `rows` of them inside the output, TILES 8-column tiles from column
// col0, times scale. Rows past the output and columns past D (a tile's
// padding) are skipped; every other row is written, zeros included.
template <typename T, int D, int TILES>
__device__ __forceinline__ void store_fragment_rows(T* __restrict__ out, long long row_stride,
                                                    int row0, int rows, int col0,
                                                    const float (&acc)[TILES][4], float scale) {
    using Op = TensorOp<T>;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int index = row0 + g + 8 * r;
        if (index >= rows) continue;
        unsigned* row = reinterpret_cast<unsigned*>(out + index * row_stride + col0);
#pragma unroll
        for (int d = 0; d < TILES; ++d) {
            if (col0 + d * 8 >= D) continue;  // padding columns of the tile
            row[d * 4 + t] = Op::pack(acc[d][2 * r] * scale, acc[d][2 * r + 1] * scale);
        }
    }
}

// The end of a dK/dV block: dK times scale and dV of the same DN tiles from
// column col0 (store_fragment_rows).
template <typename T, int D, int DN>
__device__ __forceinline__ void store_dkdv(T* __restrict__ dk, T* __restrict__ dv,
                                           long long row_stride, int key0, int keys, int col0,
                                           const float (&dk_acc)[DN][4],
                                           const float (&dv_acc)[DN][4], float scale) {
    store_fragment_rows<T, D, DN>(dk, row_stride, key0, keys, col0, dk_acc, scale);
    store_fragment_rows<T, D, DN>(dv, row_stride, key0, keys, col0, dv_acc, 1.f);
}

}  // namespace cuflash
