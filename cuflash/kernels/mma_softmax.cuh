// The online softmax of the tensor-core forward kernels, on scores held in
// m16n8 accumulator fragments: lane (g = lane / 4, t = lane % 4) holds, for
// each 8-key tile n, c0 c1 = row g, keys 2t and 2t+1 and c2 c3 = row g + 8.
// Shared by the 16-bit kernel (mma m16n8k16) and the float32 one (m16n8k8),
// whose accumulators have this same layout.
#pragma once
#include "common.cuh"

namespace cuflash {

// The running state of the rows before the first key tile: O = 0, max = -inf, sum = 0.
template <int MT, int DTILES>
__device__ __forceinline__ void init_rows(float (&o)[MT][DTILES][4], float (&row_max)[MT][2],
                                          float (&row_sum)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        row_max[mt][0] = row_max[mt][1] = neg_inf();
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
#pragma unroll
        for (int d = 0; d < DTILES; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.f;
    }
}

// The pieces of softmax_tile, for kernels that rescale O later (while a
// product that accumulates into O is still in flight).
// 1. Scores of m16 tile mt, masked (only when `edge`). Returns the factor that
// takes them to base 2 in exp_row: on an edge tile they are scaled here (and
// masked with -inf), so 1; elsewhere they stay raw and exp_row folds the
// scale into the FFMA before each exp2 (one instruction a score fewer).
// With score modifiers that change the scores (mods.modifies_scores()) every
// tile takes the per-element path: the scores are scaled, modified and taken
// to base 2 here (and masked on an edge tile). A tile that a user's block mask
// calls `partial` takes the user's mask too (the kernels count it as an edge).
// SPECIALIZE: one copy of the element code per combination of the built-ins
// (a branch a tile); else one copy that reads them per element (fewer
// registers: the mma.sync forward).
template <int MT, int NTILES, typename Mods = NoModifiers, bool SPECIALIZE = true>
__device__ __forceinline__ float mask_scores(float (&s)[MT][NTILES][4], int mt,
                                             const Mask& mask, bool edge, int row0, int n0,
                                             float scale_log2, const Mods& mods = Mods{},
                                             bool partial = true) {
    const bool modify = mods.modifies_scores();
    if (!modify && !edge) return scale_log2;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int lo[2], hi[2];  // the keys rows g and g + 8 see
#pragma unroll
    for (int r = 0; r < 2; ++r) mask.row_keys(row0 + mt * 16 + g + 8 * r, lo[r], hi[r]);
    auto each = [&](auto built_ins, bool modified) {
        constexpr int SOFTCAP = decltype(built_ins)::softcap, ALIBI = decltype(built_ins)::alibi;
        // ALiBi's distances i + offset - j as floats: specialized, a conversion a row
        // and one a tile, then exact additions of small integers; read at run time,
        // a conversion an element (fewer registers live across the tile).
        const int offset = static_cast<int>(mods.offset);  // kv_len - q_len: an int
        float row_pos[2] = {0.f, 0.f}, key_base = 0.f;
        if constexpr (ALIBI == kOn) {
#pragma unroll
            for (int r = 0; r < 2; ++r)
                row_pos[r] = static_cast<float>(row0 + mt * 16 + g + 8 * r + offset);
            key_base = static_cast<float>(n0 + 2 * t);
        }
#pragma unroll
        for (int n = 0; n < NTILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = n0 + n * 8 + 2 * t + (e & 1),
                          row = row0 + mt * 16 + g + 8 * (e >> 1);
                if (modified) {
                    float derivative;
                    const float distance =
                        ALIBI == kOn
                            ? row_pos[e >> 1] - (key_base + static_cast<float>(n * 8 + (e & 1)))
                            : static_cast<float>(row - key + offset);
                    s[mt][n][e] = mods.template apply2<true, SOFTCAP, ALIBI>(
                        s[mt][n][e] * scale_log2, row, key, distance, derivative);
                } else {
                    s[mt][n][e] *= scale_log2;
                }
                if (edge && (key < lo[e >> 1] || key >= hi[e >> 1] ||
                             (partial && !mods.sees(row, key))))
                    s[mt][n][e] = neg_inf();
            }
    };
    if (Mods::active && modify) {
        if constexpr (SPECIALIZE)
            mods.kinds([&](auto built_ins) { each(built_ins, true); });
        else
            each(BuiltIns<kRuntime, kRuntime>{}, true);
    } else {
        each(BuiltIns<kOff, kOff>{}, false);
    }
    return 1.f;
}

// 2. Row r (g or g + 8) of m16 tile mt, scores times `score_scale` (from
// mask_scores) in base 2: update the running max and sum, leave
// P = exp2(s score_scale - max) in s (times 2^LOG2_GAIN, in the sum too),
// and return alpha, the factor O's row must take. The row's largest scaled
// score is the largest raw score times a positive scale, or the smallest
// times a negative one.
template <int MT, int NTILES, int LOG2_GAIN = 0>
__device__ __forceinline__ float exp_row(float (&s)[MT][NTILES][4], float (&row_max)[MT][2],
                                         float (&row_sum)[MT][2], int mt, int r,
                                         float score_scale) {
    float mx = neg_inf();
    if (score_scale >= 0.f) {
#pragma unroll
        for (int n = 0; n < NTILES; ++n)
            mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
    } else {
#pragma unroll
        for (int n = 0; n < NTILES; ++n)
            mx = fmaxf(mx, fmaxf(-s[mt][n][2 * r], -s[mt][n][2 * r + 1]));
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float new_max = fmaxf(row_max[mt][r], fabsf(score_scale) * mx);
    const float base = new_max == neg_inf() ? 0.f : new_max;
    const float alpha = fast_exp2(row_max[mt][r] - base);
    row_max[mt][r] = new_max;
    const float shift = LOG2_GAIN ? static_cast<float>(LOG2_GAIN) - base : -base;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < NTILES; ++n) {
        s[mt][n][2 * r] = fast_exp2(fmaf(s[mt][n][2 * r], score_scale, shift));
        s[mt][n][2 * r + 1] = fast_exp2(fmaf(s[mt][n][2 * r + 1], score_scale, shift));
        sum += s[mt][n][2 * r] + s[mt][n][2 * r + 1];
    }
    row_sum[mt][r] = row_sum[mt][r] * alpha + sum;
    return alpha;
}

// 3. O's row r of m16 tile mt times alpha.
template <int MT, int DTILES>
__device__ __forceinline__ void rescale_row(float (&o)[MT][DTILES][4], int mt, int r,
                                            float alpha) {
#pragma unroll
    for (int d = 0; d < DTILES; ++d) {
        o[mt][d][2 * r] *= alpha;
        o[mt][d][2 * r + 1] *= alpha;
    }
}

// One tile of BN = 8 NTILES keys from key n0, for the MT m16 tiles of a warp
// whose first row is row0: mask (only when `edge`), scale to base 2, update
// the running max and sum, rescale O, and leave P = exp2(s - max) in s.
template <int MT, int NTILES, int DTILES, typename Mods = NoModifiers, bool SPECIALIZE = true>
__device__ __forceinline__ void softmax_tile(float (&s)[MT][NTILES][4], float (&o)[MT][DTILES][4],
                                             float (&row_max)[MT][2], float (&row_sum)[MT][2],
                                             const Mask& mask, bool edge, int row0, int n0,
                                             float scale_log2, const Mods& mods = Mods{},
                                             bool partial = true) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const float score_scale =
            mask_scores<MT, NTILES, Mods, SPECIALIZE>(s, mt, mask, edge, row0, n0, scale_log2,
                                                      mods, partial);
#pragma unroll
        for (int r = 0; r < 2; ++r)
            rescale_row(o, mt, r, exp_row(s, row_max, row_sum, mt, r, score_scale));
    }
}

// The end of a row block: O / sum through store(row, d, x0, x1) (columns
// 8d + 2t and 8d + 2t + 1 of tile row `row`, rows < rows only) and
// lse[row] = max ln 2 + ln(sum), at lse_rows + row.
template <int MT, int DTILES, typename Store>
__device__ __forceinline__ void finish_rows(const float (&o)[MT][DTILES][4],
                                            const float (&row_max)[MT][2],
                                            const float (&row_sum)[MT][2], int row0, int rows,
                                            float* __restrict__ lse_rows, Store store) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float total = row_sum[mt][r];
            total += __shfl_xor_sync(0xffffffffu, total, 1);
            total += __shfl_xor_sync(0xffffffffu, total, 2);
            const int row = row0 + mt * 16 + g + 8 * r;
            if (row >= rows) continue;
            // A row that sees no key sums to exactly 0 (out 0, lse -inf); a NaN
            // from a NaN input is not 0, so it reaches out and lse, never hidden.
            const float inv = total != 0.f ? 1.f / total : 0.f;
#pragma unroll
            for (int d = 0; d < DTILES; ++d)
                store(row, d, o[mt][d][2 * r] * inv, o[mt][d][2 * r + 1] * inv);
            if (t == 0)
                lse_rows[row] = total != 0.f ? row_max[mt][r] * kLn2 + logf(total) : neg_inf();
        }
}

}  // namespace cuflash
