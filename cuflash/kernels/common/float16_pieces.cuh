// The float16 pieces of float32 operands, which the float32-pieces kernels
// (sm90/) multiply on the 16-bit wgmma with float32 accuracy: every float32
// operand x is scaled by a power of two and split into two float16 pieces,
// hi = fp16(x) and lo = fp16(x - hi) (22 significant bits), and each product
// runs as three: hi*hi + hi*lo + lo*hi (docs/kernels/float32-pieces.md).
// Before a call's kernel, float16_pieces_abs_max and float16_pieces_split
// (simt/) write each operand's pieces and its heads' scales.
#pragma once
#include "common/mma.cuh"

namespace cuflash {

// k = 14 - e for amax in [2^(e - 1), 2^e), within +-100, so that amax 2^k
// lies in [2^13, 2^14); 0 for zeros and infinities (their pieces are then
// the values themselves, inf or NaN included).
__device__ __forceinline__ int pow2_exponent(float amax) {
    if (!(amax > 0.f) || isinf(amax)) return 0;
    int e;
    frexpf(amax, &e);
    return max(-100, min(100, 14 - e));
}
__device__ __forceinline__ float pow2_scale(float amax) { return ldexpf(1.f, pow2_exponent(amax)); }

// x ~ hi + lo as float16 pairs (x0 in the low half, the lower column).
__device__ __forceinline__ void split_pack(float x0, float x1, unsigned& hi, unsigned& lo) {
    hi = TensorOp<half_t>::pack(x0, x1);
    float h0, h1;
    asm("{\n.reg .f16 a, b;\nmov.b32 {a, b}, %2;\ncvt.f32.f16 %0, a;\ncvt.f32.f16 %1, b;\n}\n"
        : "=f"(h0), "=f"(h1)
        : "r"(hi));
    lo = TensorOp<half_t>::pack(x0 - h0, x1 - h1);
}

// A warpgroup's rows of dK or dV from its float32 accumulator (the m64 fragment
// of COLS 8-column tiles), times out_scale: `dst` is the tile's first row (row
// stride ss); rows at or past valid_rows are skipped, columns past D not written
// (the pieces' padding).
template <int D, int COLS>
__device__ __forceinline__ void store_key_rows(float* dst, long long ss,
                                               const float (&own)[COLS][4], int warp_row, int g,
                                               int t, int valid_rows, float out_scale) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = warp_row + g + 8 * r;
        if (key >= valid_rows) continue;
        float2* row = reinterpret_cast<float2*>(dst + key * ss);
#pragma unroll
        for (int d = 0; d < COLS; ++d)
            if (d * 8 < D)
                row[d * 4 + t] =
                    make_float2(own[d][2 * r] * out_scale, own[d][2 * r + 1] * out_scale);
    }
}

// An m64 accumulator fragment of 2 KSTEPS 8-column tiles as the hi and lo
// pieces of wgmma A fragments, one a k16 step (the columns become the k index).
template <int KSTEPS>
__device__ __forceinline__ void split_fragments(const float (&x)[2 * KSTEPS][4],
                                                unsigned (&hi)[KSTEPS][4],
                                                unsigned (&lo)[KSTEPS][4]) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            split_pack(x[2 * kk + j][0], x[2 * kk + j][1], hi[kk][2 * j], lo[kk][2 * j]);
            split_pack(x[2 * kk + j][2], x[2 * kk + j][3], hi[kk][2 * j + 1], lo[kk][2 * j + 1]);
        }
}

}  // namespace cuflash
