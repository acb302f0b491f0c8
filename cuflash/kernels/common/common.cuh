// Shared pieces of the general kernels: storage types, conversions, the
// visible-key rule, tile loads into shared memory and the register
// micro-tile product. Everything accumulates in float32.
#pragma once
#include "common/modifier_prelude.cuh"

namespace cuflash {

// Head-dim arithmetic of the tensor-core kernels: any multiple of 8 from 8 to
// 256 runs on the tile shapes of its class (64, 128 or 256 columns); products
// over the head_dim (S = Q K^T, dP^T = V dO^T) take round_up(D, 16) / 16 k16
// steps, the padding columns zeros in shared memory; products whose N is the
// head_dim cover the columns up to the class width where they cannot be exact,
// and the columns past D are never stored.
__host__ __device__ constexpr int round_up(int x, int multiple) {
    return (x + multiple - 1) / multiple * multiple;
}
__host__ __device__ constexpr int head_dim_class(int d) {
    return d <= 64 ? 64 : d <= 128 ? 128 : 256;
}

// A kernel's dynamic shared memory, laid out once: its layout struct (<Kernel>Shared,
// next to the kernel) names the byte offset of each region in carve order and `bytes`,
// the last region's end (plus kSharedAlignSlack where the carve rounds its base up to
// 1024 bytes): what a launch must give. The kernel takes each region at its offset
// from a base of its first region's type (CUFLASH_SHARED_REGION: a macro, as the carves
// were written, so that the compiled code is theirs; a function or byte arithmetic
// changed it), and <kernel>_shared_bytes, which takes the kernel's own template
// arguments, is `bytes` for the host: tests/test_shared_layout.py holds the figures of
// cuflash/gpu/tile_traits.py to it.
constexpr int kSharedAlignSlack = 1024;
template <typename T, int UNIT, int OFFSET>
struct SharedUnits {  // OFFSET bytes in units of the base's elements
    static_assert(OFFSET % UNIT == 0 && OFFSET % alignof(T) == 0,
                  "a region at a whole element of the base, aligned for its type");
    static constexpr int value = OFFSET / UNIT;
};
#define CUFLASH_SHARED_REGION(T, base, offset) \
    reinterpret_cast<T*>((base) +              \
                         SharedUnits<T, static_cast<int>(sizeof(*(base))), (offset)>::value)

// The ordered dQ's counters (the deterministic backward of sm90/backward_wgmma_ws.cuh):
// one int a 64-row query tile of each (batch entry, head), after the float32 dQ
// accumulator's rows ([batch, heads, q_len, width]) in the same workspace; the counter
// of (b, h, query row m) counts the key tiles whose dQ additions into that tile have
// completed. backward_delta zeroes them.
__device__ __forceinline__ int* ordered_dq_counter(float* dq_accum, int batch, int heads, int q_len,
                                                   int width, int b, int h, int m) {
    int* const counters =
        reinterpret_cast<int*>(dq_accum + static_cast<long long>(batch) * heads * q_len * width);
    return counters + (static_cast<long long>(b) * heads + h) * ((q_len + 63) / 64) + m / 64;
}

// The smallest power of two >= x: tile loads move this many 16-byte chunks a
// row (the columns past the head_dim as zeros), so that the threads of a
// block cover whole rows a pass (the unrolled copy loop of cp_async_rows).
__host__ __device__ constexpr int pow2_at_least(int x) {
    return x <= 1 ? 1 : 2 * pow2_at_least((x + 1) / 2);
}

// 16-bit storage types; converted with PTX or bit arithmetic so that no
// CUDA header is needed at run-time compile.
struct half_t {
    unsigned short bits;
};
struct bf16_t {
    unsigned short bits;
};
// FP8 (e4m3) storage, one byte; E4m3<OUT> names the roles that read it and write
// OUT (sm90/forward_wgmma_ws.cuh's ForwardElements).
struct e4m3_t {
    unsigned char bits;
};
template <typename OUT>
struct E4m3 {};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(half_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_float(bf16_t x) {
    return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
    return x;
}
template <>
__device__ __forceinline__ half_t from_float<half_t>(float x) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
}
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
    unsigned u = __float_as_uint(x);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a quiet NaN
        r.bits = static_cast<unsigned short>((u >> 16) | 0x40u);
    } else {  // round to nearest even
        r.bits = static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return r;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

// 2^x in one instruction (MUFU.EX2); results below 2^-126 flush to zero,
// which no probability of the softmax notices (exp2f adds a scaling path).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// The visible-key rule of the Semantics page (bottom-right aligned; -1 = unbounded).
struct Mask {
    int q_len, kv_len, left, right;

    __device__ __forceinline__ bool visible(int i, int j) const {
        const long long p = static_cast<long long>(i) + kv_len - q_len;
        return i < q_len && j < kv_len && (left < 0 || j >= p - left) &&
               (right < 0 || j <= p + right);
    }
    // Does every row of [row_lo, row_hi) see every key of [key_lo, key_hi)?
    __device__ __forceinline__ bool tile_all_visible(int row_lo, int row_hi, int key_lo,
                                                     int key_hi) const {
        const long long offset = static_cast<long long>(kv_len) - q_len;
        return key_hi <= kv_len && (right < 0 || key_hi - 1 <= row_lo + offset + right) &&
               (left < 0 || key_lo >= row_hi - 1 + offset - left);
    }
    // Keys [lo, hi) that any row of [row_lo, row_hi) may see.
    __device__ __forceinline__ void key_range(int row_lo, int row_hi, int& lo, int& hi) const {
        const long long offset = static_cast<long long>(kv_len) - q_len;
        long long a = 0, b = kv_len;
        if (left >= 0) a = max(a, row_lo + offset - left);
        if (right >= 0) b = min(b, row_hi - 1 + offset + right + 1);
        lo = static_cast<int>(a);
        hi = static_cast<int>(max(a, b));
    }
    // The BN-key tiles (aligned to BN) that rows [row_lo, row_hi) may see:
    // `count` tiles from key `start`.
    template <int BN>
    __device__ __forceinline__ void key_tiles(int row_lo, int row_hi, int& start,
                                              int& count) const {
        int lo, hi;
        key_range(row_lo, row_hi, lo, hi);
        start = lo - lo % BN;
        count = hi > lo ? (hi - start + BN - 1) / BN : 0;
    }
    // Keys [lo, hi) that row i sees, none past q_len: for j >= 0,
    // visible(i, j) is lo <= j < hi (two compares an element on edge tiles).
    __device__ __forceinline__ void row_keys(int i, int& lo, int& hi) const {
        key_range(i, i + 1, lo, hi);
        if (i >= q_len) hi = lo;
    }
    // Rows [lo, hi) that see key j, none past kv_len: for i >= 0, visible(i, j)
    // is lo <= i < hi.
    __device__ __forceinline__ void key_rows(int j, int& lo, int& hi) const {
        query_range(j, j + 1, lo, hi);
    }
    // Rows [lo, hi) that may see any key of [key_lo, key_hi).
    __device__ __forceinline__ void query_range(int key_lo, int key_hi, int& lo, int& hi) const {
        key_hi = min(key_hi, kv_len);
        if (key_lo >= key_hi) {
            lo = hi = 0;
            return;
        }
        const long long offset = static_cast<long long>(kv_len) - q_len;
        long long a = 0, b = q_len;
        if (right >= 0) a = max(a, key_lo - right - offset);
        if (left >= 0) b = min(b, key_hi - 1 + left - offset + 1);
        lo = static_cast<int>(a);
        hi = static_cast<int>(max(a, b));
    }
};

// The attention problem of one block's batch entry (blockIdx.z).
// Dense calls (no offsets): entry b of [B, H, S, D] arrays, its rows from 0;
// with KEY_COUNTS (the kernels that take CUFLASH_FORWARD_SEQUENCE) also
// offsets_k alone, for a chunk of queries over a KV cache: entry b sees its
// first offsets_k[b] keys, clamped into [0, kv_len].
// Packed calls: the arrays hold every sequence's rows end to end as one batch
// entry ([1, H, total, D] views: the q_len and kv_len arguments are the totals)
// and sequence b is rows [offsets[b], offsets[b + 1]) of q (and of out, lse,
// dO, dQ) and of k, v (dK, dV). The offsets live on the device and are not
// trusted: they are clamped into [0, total] and made nondecreasing, so that no
// value they hold moves a read or a write outside the arrays.
struct Sequence {
    int batch;     // the arrays' batch index (0 when packed)
    int q_start;   // the sequence's first row of q
    int kv_start;  // and of k, v
    int key_rows;  // rows of dK, dV it writes: the capacity (dense) or its keys (packed)
    Mask mask;     // its lengths and window
};

__device__ __forceinline__ int clamped(int x, int lo, int hi) { return min(max(x, lo), hi); }

template <bool KEY_COUNTS>
__device__ __forceinline__ Sequence sequence_of(int b, const int* __restrict__ offsets_q,
                                                const int* __restrict__ offsets_k, int q_len,
                                                int kv_len, int kv_capacity, int left, int right) {
    if (offsets_q == nullptr) {
        int keys = kv_len;
        if constexpr (KEY_COUNTS) {
            if (offsets_k != nullptr) keys = clamped(offsets_k[b], 0, kv_len);
        }
        return Sequence{b, 0, 0, kv_capacity, Mask{q_len, keys, left, right}};
    }
    const int q0 = clamped(offsets_q[b], 0, q_len), q1 = clamped(offsets_q[b + 1], q0, q_len);
    const int k0 = clamped(offsets_k[b], 0, kv_len), k1 = clamped(offsets_k[b + 1], k0, kv_len);
    return Sequence{0, q0, k0, k1 - k0, Mask{q1 - q0, k1 - k0, left, right}};
}

// The score modifiers of the Semantics page, applied to a scaled score s = scale q.k of
// query row i and key j (positions within the block's sequence): a soft-cap,
// s -> softcap tanh(s / softcap), then ALiBi, s -> s - slope |i + kv_len -
// q_len - j|, then the user's score function (cuflash.modifiers), and the
// user's mask function (false: -inf). Kernels compiled with modifiers (their
// MODIFIED template flag) take the scores through `apply` wherever
// `modifies_scores()` and mask with `sees` on tiles that `partial_tile` names;
// the others take NoModifiers, whose code is the plain kernels' own.
//
// The user's functors are compiled in by name: a module built for them
// defines CUFLASH_USER_SCORE_MOD / CUFLASH_USER_MASK_MOD (-D options) and puts
// their source before this file; otherwise the identities stand in.
#ifndef CUFLASH_USER_SCORE_MOD
#define CUFLASH_USER_SCORE_MOD NoScoreMod
#endif
#ifndef CUFLASH_USER_MASK_MOD
#define CUFLASH_USER_MASK_MOD NoMaskMod
#endif

// A block mask's view for one kernel's tiles (cuflash.block_mask): `outer`
// tiles are the ones a block owns (query tiles forward, key tiles backward),
// `inner` the ones it visits. classes[b, h, outer, inner]: 0 empty, 1 partial,
// 2 full (the user's mask true on every element); ranges[b, h', outer] =
// inner tiles [lo, hi) past which every tile is empty. Null classes: every
// tile partial, no range. Device values are not trusted: a range only narrows
// the tiles the kernel would visit anyway, and a class only says whether the
// user's mask is evaluated.
struct BlockMaskView {
    const unsigned char* classes;
    const int* ranges;                                // pairs
    long long class_batch_stride, class_head_stride;  // 0: broadcast
    long long range_batch_stride, range_head_stride;
    int outer_tiles, inner_tiles;
};
constexpr unsigned char kFullTile = 2;
// The arguments of a user's modifiers: the arrays of the score function and
// of the mask function, and a block mask; one kernel argument passed by value
// (cuflash.gpu.launch packs it; zeros without).
struct UserModifierArgs {
    ModifierArrays score_arrays, mask_arrays;
    BlockMaskView blocks;
};

// The states of a built-in modifier in a tile's code (ScoreModifiers::apply2):
// compiled out, compiled in, or read at run time; and the pair a tile's code is
// specialized for (ScoreModifiers::kinds).
// kRawUnits (ALiBi alone): the bias is added to the raw score q.k, divided by
// the scale (mask_scores; saves the scaling of every score).
constexpr int kOff = 0, kOn = 1, kRuntime = 2, kRawUnits = 3;
template <int SOFTCAP, int ALIBI>
struct BuiltIns {
    static constexpr int softcap = SOFTCAP, alibi = ALIBI;
};

__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
struct NoModifiers {
    static constexpr bool active = false;
    static constexpr bool user_mask = false;
    static constexpr bool mask_only = false;
    static constexpr bool user_score = false;
    static constexpr float softcap2 = 0.f, inv_softcap2 = 0.f, slope2 = 0.f;
    static constexpr long long offset = 0;
    __device__ __forceinline__ constexpr bool modifies_scores() const { return false; }
    __device__ __forceinline__ constexpr bool chain_rule() const { return false; }
    __device__ __forceinline__ constexpr bool sees(int, int) const { return true; }
    __device__ __forceinline__ constexpr bool partial_tile(int, int) const { return false; }
    template <int TILE>
    __device__ __forceinline__ void narrow(int, int, int&, int&) const {}
    template <bool APPROX_TANH, int SOFTCAP = kRuntime, int ALIBI = kRuntime>
    __device__ __forceinline__ float apply2(float s, float scale2, int, int, float,
                                            float& derivative) const {
        derivative = 1.f;
        return s * scale2;
    }
    template <typename F>
    __device__ __forceinline__ void kinds(F&& f, bool = false) const {
        f(BuiltIns<kOff, kOff>{});
    }
};
// MASK_ONLY: compiled for a call whose only modifier is the user's mask (no
// soft-cap, ALiBi or score function): scores are never modified, so the
// kernels keep their plain code and take the mask on the tiles it cuts.
template <typename UserScore, typename UserMask, bool MASK_ONLY>
struct ScoreModifiersOf {
    static constexpr bool active = true;
    static constexpr bool user_mask = !UserMask::is_identity;
    static constexpr bool mask_only = MASK_ONLY;
    static constexpr bool user_score = !UserScore::is_identity;
    // In base 2 (scores times log2 e, as the kernels' softmax takes them):
    float softcap2, inv_softcap2;              // softcap log2 e and its inverse; 0: no cap
    float slope2;                              // ALiBi's slope for the head times log2 e; 0: none
    long long offset;                          // kv_len - q_len of the sequence: p = i + offset
    int batch, head;                           // the user's b (batch entry or sequence) and h
    ModifierArrays score_arrays, mask_arrays;  // the user's (fields used only are read)
    BlockMaskView blocks;

    // Does anything change the scores (else `apply2` is the identity)?
    __device__ __forceinline__ bool modifies_scores() const {
        if constexpr (MASK_ONLY) return false;
        return softcap2 > 0.f || slope2 != 0.f || !UserScore::is_identity;
    }
    // May the modified score's derivative differ from 1 (the backward's dS
    // then takes it)? Not for ALiBi, a shift of the scores.
    __device__ __forceinline__ bool chain_rule() const {
        if constexpr (MASK_ONLY) return false;
        return softcap2 > 0.f || !UserScore::is_identity;
    }
    // The modified score of score s (row i, key j) whose base-2 value is s
    // scale2 (scale2: the softmax scale times log2 e, or just log2 e), in base
    // 2, and its derivative d(result)/d(s scale2) (that of the natural-units
    // function). SOFTCAP, ALIBI: kOn or kOff when the code is specialized (see
    // `kinds`), kRuntime to read the arguments an element at a time (one copy
    // of the code: the backward kernels, short of registers for four).
    // `distance` is i + offset - j as a float (the caller's, from a few
    // conversions a tile: an int-to-float conversion runs at a quarter of the
    // FMA rate). APPROX_TANH: the hardware's tanh (one MUFU instruction,
    // relative error 2^-11), for 16-bit inputs, as FlashAttention does; tanhf
    // otherwise.
    template <bool APPROX_TANH, int SOFTCAP = kRuntime, int ALIBI = kRuntime>
    __device__ __forceinline__ float apply2(float s, float scale2, int i, int j, float distance,
                                            float& derivative) const {
        derivative = 1.f;
        float s2;
        if (SOFTCAP == kOn || (SOFTCAP == kRuntime && softcap2 > 0.f)) {
            const float x = s * (scale2 * inv_softcap2);  // one product an element
            const float t = APPROX_TANH ? tanh_approx(x) : tanhf(x);
            s2 = softcap2 * t;
            derivative = 1.f - t * t;
        } else {
            s2 = s * scale2;
        }
        if (ALIBI == kOn || (ALIBI == kRuntime && slope2 != 0.f)) s2 -= slope2 * fabsf(distance);
        if constexpr (!UserScore::is_identity) {  // the user's function in natural units
            const UserScore score_mod{};
            const float natural = s2 * kLn2;
            derivative *= score_mod.grad(natural, batch, head, i, j, score_arrays);
            s2 = score_mod(natural, batch, head, i, j, score_arrays) * kLog2e;
        }
        return s2;
    }
    // Call f(BuiltIns<SOFTCAP, ALIBI>{}) for the built-ins this call has: a
    // kernel branches once a tile, and each element's code holds only what
    // applies. raw_units_ok: ALiBi alone (no user score function) may take
    // kRawUnits (the caller's scale is finite and not 0).
    template <typename F>
    __device__ __forceinline__ void kinds(F&& f, bool raw_units_ok = false) const {
        if (softcap2 > 0.f) {
            if (slope2 != 0.f)
                f(BuiltIns<kOn, kOn>{});
            else
                f(BuiltIns<kOn, kOff>{});
        } else if (slope2 != 0.f) {
            if constexpr (UserScore::is_identity) {
                if (raw_units_ok) {
                    f(BuiltIns<kOff, kRawUnits>{});
                    return;
                }
            }
            f(BuiltIns<kOff, kOn>{});
        } else {
            f(BuiltIns<kOff, kOff>{});
        }
    }
    // In natural units, the built-ins read at run time (the CUDA-core kernels).
    template <bool APPROX_TANH = false>
    __device__ __forceinline__ float apply(float s, int i, int j, float& derivative) const {
        return apply2<APPROX_TANH>(s, kLog2e, i, j, static_cast<float>(i + offset - j),
                                   derivative) *
               kLn2;
    }
    // The user's mask at (row i, key j).
    __device__ __forceinline__ bool sees(int i, int j) const {
        if constexpr (user_mask) return UserMask{}(batch, head, i, j, mask_arrays);
        return true;
    }
    // Must tile (outer, inner) of the block mask take the user's mask element by element?
    __device__ __forceinline__ bool partial_tile(int outer, int inner) const {
        if constexpr (!user_mask) return false;
        if (blocks.classes == nullptr || outer < 0 || outer >= blocks.outer_tiles || inner < 0 ||
            inner >= blocks.inner_tiles)
            return true;
        return blocks.classes[batch * blocks.class_batch_stride + head * blocks.class_head_stride +
                              static_cast<long long>(outer) * blocks.inner_tiles + inner] !=
               kFullTile;
    }
    // Narrow `count` inner tiles of TILE elements from element `start` (a
    // multiple of TILE) to the block mask's range of tile `outer` (range head
    // `range_head`).
    template <int TILE>
    __device__ __forceinline__ void narrow(int outer, int range_head, int& start,
                                           int& count) const {
        if constexpr (!user_mask) return;
        if (blocks.ranges == nullptr || outer < 0 || outer >= blocks.outer_tiles) return;
        const int* range = blocks.ranges + batch * blocks.range_batch_stride +
                           range_head * blocks.range_head_stride + 2ll * outer;
        const int first = start / TILE;
        const int lo = max(first, range[0]), hi = min(first + count, range[1]);
        start = lo * TILE;
        count = max(0, hi - lo);
    }
};
#ifdef CUFLASH_USER_MASK_ONLY
constexpr bool kUserMaskOnly = true;
#else
constexpr bool kUserMaskOnly = false;
#endif
using ScoreModifiers =
    ScoreModifiersOf<CUFLASH_USER_SCORE_MOD, CUFLASH_USER_MASK_MOD, kUserMaskOnly>;
template <bool B, typename T, typename F>
struct pick_type {
    using type = T;
};
template <typename T, typename F>
struct pick_type<false, T, F> {
    using type = F;
};
template <bool MODIFIED>
using Modifiers = typename pick_type<MODIFIED, ScoreModifiers, NoModifiers>::type;

// The modifiers of query head h in the block's sequence (blockIdx.z): slopes
// [B, H] (batch_stride H) or [H] (0), or none (null); the user's arguments.
template <bool MODIFIED>
__device__ __forceinline__ Modifiers<MODIFIED> score_modifiers(
    const float* __restrict__ alibi_slopes, int alibi_batch_stride, float softcap, int h,
    const Mask& mask, const UserModifierArgs& user) {
    if constexpr (MODIFIED) {
        const float slope =
            alibi_slopes == nullptr ? 0.f : alibi_slopes[blockIdx.z * alibi_batch_stride + h];
        return ScoreModifiers{softcap * kLog2e,
                              softcap > 0.f ? 1.f / (softcap * kLog2e) : 0.f,
                              slope * kLog2e,
                              static_cast<long long>(mask.kv_len) - mask.q_len,
                              static_cast<int>(blockIdx.z),
                              h,
                              user.score_arrays,
                              user.mask_arrays,
                              user.blocks};
    } else {
        return NoModifiers{};
    }
}

// Attention sinks (gpt-oss): a logit a query head that joins every row's
// softmax with a zero value vector. At a row's end, with its max `row_max` in
// base 2 and its sum `total` relative to it, add exp2(sink2 - max) for sink2 =
// sink log2 e, moving the max where the sink is above it (a row that saw no
// key, total 0 whatever its max: max = sink2, total = 1 exactly, O = 0, lse =
// sink2 ln 2 = sink to two roundings); returns the factor O's row takes. A
// -inf sink changes nothing; NaN propagates.
__device__ __forceinline__ float add_sink(float sink2, float& row_max, float& total) {
    if (total == 0.f) row_max = neg_inf();
    const float new_max = fmaxf(row_max, sink2);
    const float base = new_max == neg_inf() ? 0.f : new_max;  // no -inf - -inf
    const float alpha = fast_exp2(row_max - base);
    total = fmaf(total, alpha, fast_exp2(sink2 - base));
    row_max = new_max;
    return alpha;
}
// Head h's sink in base 2, or -inf without sinks (add_sink then changes nothing).
__device__ __forceinline__ float sink_log2(const float* __restrict__ sinks, int h) {
    return sinks == nullptr ? neg_inf() : sinks[h] * kLog2e;
}

// Strides in elements of a [B, H, S, D] tensor whose last stride is 1.
struct Strides {
    long long b, h, s;
};

// A kernel takes an array's strides as three long long parameters (the STRIDES
// entries of kernels/common/params.cuh) and its body reads them as one Strides.
#define CUFLASH_STRIDES(x) long long x##_sb, long long x##_sh, long long x##_ss
#define CUFLASH_STRIDES_OF(x) \
    const Strides x##_st { x##_sb, x##_sh, x##_ss }
// The block's Sequence `seq` and its Mask `mask`; q_len (kv_len) stays the
// rows a head of the arrays. The Hopper forward kernels (the registry's
// `reads_key_counts`) take CUFLASH_FORWARD_SEQUENCE, which also reads
// per-entry key counts (sequence_of). The others do not: a key count read from
// memory holds a register for the whole kernel, and the mma.sync forward has
// none to spare at some head dims.
#define CUFLASH_SEQUENCE_OF(kv_capacity)                                                     \
    const Sequence seq = sequence_of<false>(blockIdx.z, offsets_q, offsets_k, q_len, kv_len, \
                                            kv_capacity, win_left, win_right);               \
    const Mask mask = seq.mask
#define CUFLASH_FORWARD_SEQUENCE                                                            \
    const Sequence seq = sequence_of<true>(blockIdx.z, offsets_q, offsets_k, q_len, kv_len, \
                                           kv_len, win_left, win_right);                    \
    const Mask mask = seq.mask

__device__ __forceinline__ long long offset_of(const Strides& st, int b, int h, int s) {
    return b * st.b + h * st.h + s * st.s;
}

// Load rows [row0, row0 + ROWS) of one head into shared memory as float32,
// row pitch LD; rows at or past `valid_rows` become zeros.
template <int ROWS, int D, int LD, int NT, typename T>
__device__ __forceinline__ void load_tile(float* dst, const T* __restrict__ src,
                                          long long row_stride, int valid_rows) {
    for (int idx = threadIdx.x; idx < ROWS * D; idx += NT) {
        const int r = idx / D, d = idx - (idx / D) * D;
        float x = 0.f;
        if (r < valid_rows) x = to_float(src[r * row_stride + d]);
        dst[r * LD + d] = x;
    }
}

// acc[i][j] += sum_d A[(ty + 16 i) * LD + d] * B[(tx + 8 j) * LD + d]
// (a 16 x 8 grid of threads; each owns RM rows and RN columns).
template <int RM, int RN, int D, int LD>
__device__ __forceinline__ void tile_dot(const float* A, const float* B, float (&acc)[RM][RN],
                                         int ty, int tx) {
#pragma unroll 2
    for (int d = 0; d < D; d += 4) {
        float4 a[RM], b[RN];
#pragma unroll
        for (int i = 0; i < RM; ++i)
            a[i] = *reinterpret_cast<const float4*>(A + (ty + 16 * i) * LD + d);
#pragma unroll
        for (int j = 0; j < RN; ++j)
            b[j] = *reinterpret_cast<const float4*>(B + (tx + 8 * j) * LD + d);
#pragma unroll
        for (int i = 0; i < RM; ++i)
#pragma unroll
            for (int j = 0; j < RN; ++j)
                acc[i][j] += a[i].x * b[j].x + a[i].y * b[j].y + a[i].z * b[j].z + a[i].w * b[j].w;
    }
}

// acc[i][e] += sum_j P[(ty + 16 i) * LDP + j] * V[j * LD + tx + 8 e]
// (P is BM x BN, V is BN x D; each thread owns RM rows and NE = D/8 columns).
template <int RM, int NE, int BN, int LD, int LDP>
__device__ __forceinline__ void tile_accumulate(const float* P, const float* V,
                                                float (&acc)[RM][NE], int ty, int tx) {
#pragma unroll 4
    for (int j = 0; j < BN; ++j) {
        float p[RM];
#pragma unroll
        for (int i = 0; i < RM; ++i) p[i] = P[(ty + 16 * i) * LDP + j];
#pragma unroll
        for (int e = 0; e < NE; ++e) {
            const float x = V[j * LD + tx + 8 * e];
#pragma unroll
            for (int i = 0; i < RM; ++i) acc[i][e] += p[i] * x;
        }
    }
}

// Reduce over the 8 lanes (tx) that share a row.
__device__ __forceinline__ float row_max8(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
}
__device__ __forceinline__ float row_sum8(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x + __shfl_xor_sync(0xffffffffu, x, 4);
}

}  // namespace cuflash
