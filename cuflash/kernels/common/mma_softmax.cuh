// The online softmax of the tensor-core forward kernels, on scores held in
// m16n8 accumulator fragments: lane (g = lane / 4, t = lane % 4) holds, for
// each 8-key tile n, c0 c1 = row g, keys 2t and 2t+1 and c2 c3 = row g + 8.
// Shared by the 16-bit kernel (mma m16n8k16) and the float32 one (m16n8k8),
// whose accumulators have this same layout.
#pragma once
#include "common/common.cuh"

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
        for (int d = 0; d < DTILES; ++d)
            o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.f;
    }
}

// The pieces of softmax_tile, for kernels that rescale O later (while a
// product that accumulates into O is still in flight).
// x, or `masked` where key j is outside [lo, hi) or, on a `partial` tile, the
// user's mask hides (row i, key j), with the mask evaluated on every element
// and no short circuit: the compiler then shares its loads (a row's, a key's)
// between the elements of the tile (a partial tile cost about twice a full one
// with a document mask read element by element). The mask-only wgmma forward
// takes it; other kernels have no registers to spare (the mma.sync forward
// spilled 4-8 bytes under its cap at D = 16, 80, 104) and keep the short circuit.
template <typename Mods>
__device__ __forceinline__ float masked_eagerly(float x, float masked, const Mods& mods, int i,
                                                int j, int lo, int hi, bool partial) {
    const bool seen = (j >= lo && j < hi) & (!partial | mods.sees(i, j));
    return seen ? x : masked;
}

// 1. Scores of m16 tile mt, masked (only when `edge`). Returns the factor that
// takes them to base 2 in exp_row: on an edge tile they are scaled here (and
// masked with -inf), so 1; elsewhere they stay raw and exp_row folds the
// scale into the FFMA before each exp2 (one instruction a score fewer).
// With score modifiers that change the scores (mods.modifies_scores()) every
// tile takes the per-element path, which returns the factor of its units:
// a soft-cap alone leaves tanh(s scale / softcap) (factor softcap log2 e), ALiBi
// alone (kRawUnits) the raw score plus the bias over the scale (factor: the
// scale), anything else the modified score in base 2 (factor 1). A tile that
// a user's block mask calls `partial` takes the user's mask too (the kernels
// count it as an edge).
// SPECIALIZE: one copy of the element code per combination of the built-ins
// (a branch a tile); else one copy that reads them per element (fewer
// registers: the mma.sync forward).
template <int MT, int NTILES, typename Mods = NoModifiers, bool SPECIALIZE = true>
__device__ __forceinline__ float mask_scores(float (&s)[MT][NTILES][4], int mt, const Mask& mask,
                                             bool edge, int row0, int n0, float scale_log2,
                                             const Mods& mods = Mods{}, bool partial = true) {
    const bool modify = mods.modifies_scores();
    if (!modify && !edge) return scale_log2;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int lo[2], hi[2];  // the keys rows g and g + 8 see
#pragma unroll
    for (int r = 0; r < 2; ++r) mask.row_keys(row0 + mt * 16 + g + 8 * r, lo[r], hi[r]);
    float factor = 1.f;
    auto each = [&](auto built_ins, bool modified) {
        constexpr int SOFTCAP = decltype(built_ins)::softcap, ALIBI = decltype(built_ins)::alibi;
        constexpr bool CAP_ONLY = SOFTCAP == kOn && ALIBI == kOff && !Mods::user_score;
        constexpr bool RAW_UNITS = ALIBI == kRawUnits;
        // ALiBi's distances i + offset - j as floats: specialized, a conversion a row
        // and one a tile, then an exact subtraction of a small integer an element;
        // read at run time, a conversion an element (fewer registers live across
        // the tile).
        const int offset = static_cast<int>(mods.offset);  // kv_len - q_len: an int
        float row_distance[2] = {0.f, 0.f};                // of key n0 + 2 t
        if constexpr (ALIBI == kOn || RAW_UNITS) {
            const float key_base = static_cast<float>(n0 + 2 * t);
#pragma unroll
            for (int r = 0; r < 2; ++r)
                row_distance[r] =
                    static_cast<float>(row0 + mt * 16 + g + 8 * r + offset) - key_base;
        }
        // The units of this kind's result (see above) and its masked value.
        float cap_scale = 0.f, bias_per_key = 0.f, masked = neg_inf();
        if constexpr (CAP_ONLY) {
            cap_scale = scale_log2 * mods.inv_softcap2;
            factor = mods.softcap2;
        } else if constexpr (RAW_UNITS) {
            bias_per_key = -mods.slope2 / scale_log2;
            factor = scale_log2;
            if (scale_log2 < 0.f) masked = -neg_inf();
        }
#pragma unroll
        for (int n = 0; n < NTILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = n0 + n * 8 + 2 * t + (e & 1),
                          row = row0 + mt * 16 + g + 8 * (e >> 1);
                const float distance =
                    ALIBI == kOn || RAW_UNITS
                        ? row_distance[e >> 1] - static_cast<float>(n * 8 + (e & 1))
                        : static_cast<float>(row - key + offset);
                if (!modified) {
                    s[mt][n][e] *= scale_log2;
                } else if constexpr (CAP_ONLY) {
                    s[mt][n][e] = tanh_approx(s[mt][n][e] * cap_scale);
                } else if constexpr (RAW_UNITS) {
                    s[mt][n][e] = fmaf(bias_per_key, fabsf(distance), s[mt][n][e]);
                } else {
                    float derivative;
                    s[mt][n][e] = mods.template apply2<true, SOFTCAP, ALIBI>(
                        s[mt][n][e], scale_log2, row, key, distance, derivative);
                }
                if constexpr (Mods::mask_only && SPECIALIZE) {
                    if (edge)
                        s[mt][n][e] = masked_eagerly(s[mt][n][e], masked, mods, row, key,
                                                     lo[e >> 1], hi[e >> 1], partial);
                } else if (edge && (key < lo[e >> 1] || key >= hi[e >> 1] ||
                                    (partial && !mods.sees(row, key)))) {
                    s[mt][n][e] = masked;
                }
            }
    };
    if (Mods::active && modify) {
        if constexpr (SPECIALIZE) {
            // ALiBi in raw units needs the slope over a scale that is not 0 (nor
            // tiny) and stays finite
            const bool raw_units_ok =
                fabsf(scale_log2) >= 1e-6f && fabsf(mods.slope2) <= 1e30f * fabsf(scale_log2);
            mods.kinds([&](auto built_ins) { each(built_ins, true); }, raw_units_ok);
        } else {
            each(BuiltIns<kRuntime, kRuntime>{}, true);
        }
    } else {
        each(BuiltIns<kOff, kOff>{}, false);
    }
    return factor;
}

constexpr float kMaxSlack = 8.f;  // see exp_row

// A soft-cap alone bounds the scores: softcap tanh(.) < softcap, so every row
// of a block can take softcap log2 e as its max (exp_row's `bound`): no max to
// reduce, no rescale. Then P = exp2(softcap2 (t - 1)) >= 2^(-2 softcap2),
// which float32 and bfloat16 hold while softcap2 <= 60 (P >= 2^-120: nothing
// underflows, not even a row whose scores all sit near -softcap); float16's
// range would not (WIDE_EXPONENT false). -inf: track the max.
template <bool WIDE_EXPONENT, typename Mods>
__device__ __forceinline__ float scores_bound(const Mods& mods) {
    if constexpr (!Mods::active || Mods::user_score || Mods::mask_only || !WIDE_EXPONENT)
        return neg_inf();
    else
        return mods.softcap2 > 0.f && mods.softcap2 <= 60.f && mods.slope2 == 0.f ? mods.softcap2
                                                                                  : neg_inf();
}

// 2. Row r (g or g + 8) of m16 tile mt, scores times `score_scale` (from
// mask_scores) in base 2: update the running max and sum, leave
// P = exp2(s score_scale - max) in s (times 2^LOG2_GAIN, in the sum too),
// and return alpha, the factor O's row must take. The row's largest scaled
// score is the largest raw score times a positive scale, or the smallest
// times a negative one.
// `bound`: an upper bound of the scaled scores that stands for the max of
// every row (see scores_bound), or -inf to track the max. LAZY: see below
// (for a caller that skips O's rescale by 1).
template <int MT, int NTILES, int LOG2_GAIN = 0, bool LAZY = false>
__device__ __forceinline__ float exp_row(float (&s)[MT][NTILES][4], float (&row_max)[MT][2],
                                         float (&row_sum)[MT][2], int mt, int r, float score_scale,
                                         float bound = neg_inf()) {
    float new_max = bound;
    if (bound == neg_inf()) {
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
        // LAZY: the running max moves only when this tile's passes it by more
        // than kMaxSlack (in base 2; the first tile's always does): below that,
        // P = exp2(s - max) stays under 2^kMaxSlack, and alpha = 1 (O's rescale
        // can be skipped). Not with a gain (the float32 pieces keep P in
        // float16's range).
        static_assert(!LAZY || LOG2_GAIN == 0, "a lazy max keeps P under 2^kMaxSlack");
        const float tile_max = fabsf(score_scale) * mx;
        new_max = LAZY ? (tile_max > row_max[mt][r] + kMaxSlack ? tile_max : row_max[mt][r])
                       : fmaxf(row_max[mt][r], tile_max);
    }
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

// exp_rows' partial maxima of both rows of m16 tile mt, over CHAINS chains a row: of
// the raw scores, or of their negations for a negative scale (the largest scaled
// score; the comparisons take the sign for free).
template <bool NEGATE, int MT, int NTILES, int CHAINS>
__device__ __forceinline__ void partial_maxima(const float (&s)[MT][NTILES][4], int mt,
                                               float (&mx)[2][CHAINS]) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) mx[r][c] = neg_inf();
#pragma unroll
    for (int n = 0; n < NTILES; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float a = s[mt][n][2 * r], b = s[mt][n][2 * r + 1];
            float& m = mx[r][n % CHAINS];
            m = NEGATE ? fmaxf(m, fmaxf(-a, -b)) : fmaxf(m, fmaxf(a, b));
        }
}

// 2'. exp_row for both rows of m16 tile mt at once, each alpha in `alpha`: the same
// values but for the order of the sums, with the two rows' dependency chains side by
// side and the maxima and sums taken over four partial chains a row (a chain of
// 2 NTILES dependent FMNMX or FADD a row stalls a consumer of the warp-specialized
// forward on their latency; Nsight Compute: docs/kernels/forward-sm90-wgmma.md).
template <int MT, int NTILES, int LOG2_GAIN = 0, bool LAZY = false>
__device__ __forceinline__ void exp_rows(float (&s)[MT][NTILES][4], float (&row_max)[MT][2],
                                         float (&row_sum)[MT][2], int mt, float score_scale,
                                         float bound, float (&alpha)[2]) {
    static_assert(!LAZY || LOG2_GAIN == 0, "a lazy max keeps P under 2^kMaxSlack");
    constexpr int CHAINS = NTILES >= 4 ? 4 : NTILES;
    float new_max[2] = {bound, bound};
    if (bound == neg_inf()) {
        float mx[2][CHAINS];
        if (score_scale >= 0.f)
            partial_maxima<false>(s, mt, mx);
        else
            partial_maxima<true>(s, mt, mx);
        float m[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            m[r] = mx[r][0];
#pragma unroll
            for (int c = 1; c < CHAINS; ++c) m[r] = fmaxf(m[r], mx[r][c]);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 1));
#pragma unroll
        for (int r = 0; r < 2; ++r) m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 2));
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float tile_max = fabsf(score_scale) * m[r];
            new_max[r] = LAZY ? (tile_max > row_max[mt][r] + kMaxSlack ? tile_max : row_max[mt][r])
                              : fmaxf(row_max[mt][r], tile_max);
        }
    }
    float shift[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float base = new_max[r] == neg_inf() ? 0.f : new_max[r];
        alpha[r] = fast_exp2(row_max[mt][r] - base);
        row_max[mt][r] = new_max[r];
        shift[r] = LOG2_GAIN ? static_cast<float>(LOG2_GAIN) - base : -base;
    }
    float sum[2][CHAINS];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) sum[r][c] = 0.f;
#pragma unroll
    for (int n = 0; n < NTILES; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            s[mt][n][2 * r] = fast_exp2(fmaf(s[mt][n][2 * r], score_scale, shift[r]));
            s[mt][n][2 * r + 1] = fast_exp2(fmaf(s[mt][n][2 * r + 1], score_scale, shift[r]));
            sum[r][n % CHAINS] += s[mt][n][2 * r] + s[mt][n][2 * r + 1];
        }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float total = sum[r][0];
#pragma unroll
        for (int c = 1; c < CHAINS; ++c) total += sum[r][c];
        row_sum[mt][r] = row_sum[mt][r] * alpha[r] + total;
    }
}

// 3. O's row r of m16 tile mt times alpha (1 where exp_row's running max did
// not move: a caller with registers to spare on the branch skips the call).
template <int MT, int DTILES>
__device__ __forceinline__ void rescale_row(float (&o)[MT][DTILES][4], int mt, int r, float alpha) {
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
        const float score_scale = mask_scores<MT, NTILES, Mods, SPECIALIZE>(
            s, mt, mask, edge, row0, n0, scale_log2, mods, partial);
#pragma unroll
        for (int r = 0; r < 2; ++r)
            rescale_row(o, mt, r, exp_row(s, row_max, row_sum, mt, r, score_scale));
    }
}

// The end of a row block: O / sum through store(row, d, x0, x1) (columns
// 8d + 2t and 8d + 2t + 1 of tile row `row`, rows < rows only) and
// lse[row] = max ln 2 + ln(sum), at lse_rows + row. With attention sinks
// (`sinks` not null) head h's sink joins each row's sum first (add_sink).
template <int MT, int DTILES, typename Store>
__device__ __forceinline__ void finish_rows(const float (&o)[MT][DTILES][4],
                                            const float (&row_max)[MT][2],
                                            const float (&row_sum)[MT][2], int row0, int rows,
                                            float* __restrict__ lse_rows, Store store,
                                            const float* __restrict__ sinks = nullptr, int h = 0,
                                            bool hoist_sink = true) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // The sink read once before the rows (-inf without sinks), or per row where that
    // spills less (`hoist_sink` false: the mma.sync forward's modified role; ptxas
    // spilled 8-16 bytes with either form in one of the two roles).
    const float sink2 = hoist_sink ? sink_log2(sinks, h) : neg_inf();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float total = row_sum[mt][r];
            total += __shfl_xor_sync(0xffffffffu, total, 1);
            total += __shfl_xor_sync(0xffffffffu, total, 2);
            const int row = row0 + mt * 16 + g + 8 * r;
            if (row >= rows) continue;
            float top = row_max[mt][r], o_scale = 1.f;
            if (hoist_sink ? sink2 != neg_inf() : sinks != nullptr)
                o_scale = add_sink(hoist_sink ? sink2 : sink_log2(sinks, h), top, total);
            // A row that sees no key sums to exactly 0 (out 0, lse -inf); a NaN
            // from a NaN input is not 0, so it reaches out and lse, never hidden.
            const float inv = total != 0.f ? o_scale / total : 0.f;
#pragma unroll
            for (int d = 0; d < DTILES; ++d)
                store(row, d, o[mt][d][2 * r] * inv, o[mt][d][2 * r + 1] * inv);
            if (t == 0) lse_rows[row] = total != 0.f ? top * kLn2 + logf(total) : neg_inf();
        }
}

}  // namespace cuflash
