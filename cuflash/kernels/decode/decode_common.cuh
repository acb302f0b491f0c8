// The split-KV decode kernels' shared pieces (the KV-cache page): their block
// size, the tile shapes of kvcache_decode, a sequence's cache rows through a
// block table (or a contiguous cache), its length from the host or the device,
// 16-bit chunk unpacking, the K/V tile loads, the kernels' arguments and their
// score modifiers. Lengths and block ids that live on the device are never
// trusted: a length is clamped to [0, capacity - S_new] and a block id to
// [0, num_blocks), so no thread reads or writes outside any buffer whatever
// they hold.
#pragma once
#include "common/common.cuh"
#include "common/params.cuh"
#include "common/mma.cuh"

namespace cuflash {

// kvcache_decode_tc's element types for an FP8 (e4m3) cache: q in Q (e4m3, float16 or
// bfloat16), the output in OUT (float32, float16 or bfloat16).
template <typename Q, typename OUT>
struct E4m3Cache {};

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kDecodeTileBytes = 16384;  // bytes of one K (or V) tile, padding aside

// The tile shapes of kvcache_decode<T, D, RM> (mirrored by cuflash/gpu/decode_tiles.py's
// decode_shape, which tests/test_shared_layout.py holds to SMEM through
// kvcache_decode_shared_bytes; the kernel traps if it is launched with less shared memory).
template <typename T, int D, int RM>
struct DecodeShape {
    static constexpr int ELEMS = 16 / static_cast<int>(sizeof(T));  // elements a 16-byte chunk
    static constexpr int CH = D / ELEMS;                            // chunks a row
    static constexpr int BN_FIT = kDecodeTileBytes / (D * static_cast<int>(sizeof(T)));
    static constexpr int BN = BN_FIT >= 128 ? 128 : BN_FIT >= 64 ? 64 : BN_FIT >= 32 ? 32 : 16;
    static constexpr int DSUB = kDecodeThreads / BN;  // threads sharing one key's dot products
    static constexpr int PITCH = CH + 1;  // chunks a shared-memory row (one chunk of padding)
    static constexpr int KSUB_FIT = kDecodeThreads / CH;
    static constexpr int KSUB = KSUB_FIT < BN ? KSUB_FIT : BN;  // key subsets in P V
    static constexpr int TILE_CHUNKS = BN * PITCH;
    static constexpr int KV_BYTES = 4 * TILE_CHUNKS * 16;  // K and V, two stages
    static constexpr int REDUCE_BYTES = KSUB * RM * (D + 1) * 4;
    static constexpr int REGION = KV_BYTES > REDUCE_BYTES ? KV_BYTES : REDUCE_BYTES;
    static constexpr int Q_BYTES = RM * D * 4;
    static constexpr int P_BYTES = BN * RM * 4;
    static constexpr int MAX_BYTES = kDecodeWarps * RM * 4;
    static constexpr int SMEM = REGION + Q_BYTES + P_BYTES + MAX_BYTES;
    static_assert(D % ELEMS == 0, "head_dim must fill whole 16-byte chunks");
    static_assert(BN <= kDecodeThreads && DSUB <= 32, "one key per group of DSUB lanes");
};

// Where the keys of one sequence live: a contiguous cache (table == nullptr,
// the sequence's own slab) or a paged one (a row of the block table). Made by
// cache_rows; a power-of-two block size takes shifts and masks, not divisions.
struct CacheRows {
    const int* table;  // this sequence's row of the block table, or nullptr
    int batch_index, block_size, num_blocks;
    int block_shift;  // log2(block_size) for a power of two, else -1

    __device__ __forceinline__ int slot(int j) const {
        return block_shift >= 0 ? j >> block_shift : j / block_size;
    }
    // The block (contiguous: the sequence) and the row within it of key j >= 0.
    __device__ __forceinline__ int page(int j) const {
        if (table == nullptr) return batch_index;
        return min(max(__ldg(table + slot(j)), 0), num_blocks - 1);  // untrusted: clamped
    }
    __device__ __forceinline__ int row(int j) const {
        if (table == nullptr) return j;
        return block_shift >= 0 ? j & (block_size - 1) : j - slot(j) * block_size;
    }
    // Element offsets of key j's row in K and V (head offset not included).
    __device__ __forceinline__ void offsets(int j, long long k_sb, long long k_ss, long long v_sb,
                                            long long v_ss, long long& k_off,
                                            long long& v_off) const {
        const long long block = page(j);
        const int r = row(j);
        k_off = block * k_sb + r * k_ss;
        v_off = block * v_sb + r * v_ss;
    }
};

__device__ __forceinline__ CacheRows cache_rows(const int* block_table, int b, int max_blocks,
                                                int block_size, int num_blocks) {
    const bool power_of_two = (block_size & (block_size - 1)) == 0;
    return CacheRows{
        block_table != nullptr ? block_table + static_cast<long long>(b) * max_blocks : nullptr, b,
        block_size, num_blocks, power_of_two ? __ffs(block_size) - 1 : -1};
}

// A device-held length (or the host's value), clamped so that it and the
// appended rows fit the capacity.
__device__ __forceinline__ int cached_length(const int* seqlens, int seqlen_value, int b,
                                             int new_len, int capacity) {
    const int raw = seqlens != nullptr ? seqlens[b] : seqlen_value;
    return min(max(raw, 0), capacity - new_len);
}

__device__ __forceinline__ void unpack_chunk(const uint4& c, float (&x)[4]) {
    x[0] = __uint_as_float(c.x);
    x[1] = __uint_as_float(c.y);
    x[2] = __uint_as_float(c.z);
    x[3] = __uint_as_float(c.w);
}
__device__ __forceinline__ void unpack_pair(unsigned w, bf16_t, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void unpack_pair(unsigned w, half_t, float& lo, float& hi) {
    asm("{\n .reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
        : "=f"(lo), "=f"(hi)
        : "r"(w));
}
// Four e4m3 values (bytes 0-3 of x) as pairs of T (float16 or bfloat16, each of which
// holds every e4m3 value exactly): bytes 0, 1 in lo (byte 0 the low half), 2, 3 in hi.
template <typename T>
__device__ __forceinline__ void e4m3x4_widen(unsigned x, unsigned& lo, unsigned& hi) {
    e4m3x4_to_f16x2(x, lo, hi);
    if constexpr (TensorOp<T>::wide_exponent) {  // bfloat16: through float32
        float a, b, c, d;
        unpack_pair(lo, half_t{}, a, b);
        unpack_pair(hi, half_t{}, c, d);
        lo = TensorOp<T>::pack(a, b);
        hi = TensorOp<T>::pack(c, d);
    }
}
// One e4m3 value as T, exactly (q rows of an FP8 call); T itself passes through.
template <typename T>
__device__ __forceinline__ T widen_element(T x) {
    return x;
}
template <typename T>
__device__ __forceinline__ T widen_element(e4m3_t x) {
    unsigned lo, hi;
    e4m3x4_widen<T>(x.bits, lo, hi);
    return T{static_cast<unsigned short>(lo & 0xffffu)};
}
template <typename T>
__device__ __forceinline__ void unpack_chunk(const uint4& c, float (&x)[8]) {
    unpack_pair(c.x, T{}, x[0], x[1]);
    unpack_pair(c.y, T{}, x[2], x[3]);
    unpack_pair(c.z, T{}, x[4], x[5]);
    unpack_pair(c.w, T{}, x[6], x[7]);
}
template <typename T, int N>
__device__ __forceinline__ void unpack(const uint4& c, float (&x)[N]) {
    if constexpr (N == 4) {
        unpack_chunk(c, x);
    } else {
        unpack_chunk<T>(c, x);
    }
}

// Which 16-byte chunks of a [BN][CH]-chunk tile thread `thread` of the THREADS that
// copy it takes: chunk (row_of(it), chunk_of(it)) in pass `it` of ITERS, while
// covers(it). Where CH divides THREADS, a thread keeps one chunk column and its rows
// step by ROWS_A_PASS.
template <int BN, int CH, int THREADS>
struct TileChunks {
    static constexpr int ITERS = (BN * CH + THREADS - 1) / THREADS;
    static constexpr bool EVEN = THREADS % CH == 0;
    static constexpr int ROWS_A_PASS = EVEN ? THREADS / CH : 0;
    static_assert(!EVEN || BN % ROWS_A_PASS == 0, "a column's passes cover whole rows");

    __device__ static __forceinline__ bool covers(int it, int thread) {
        return (it + 1) * THREADS <= BN * CH || thread + it * THREADS < BN * CH;
    }
    __device__ static __forceinline__ int row_of(int it, int thread) {
        if constexpr (EVEN) return thread / CH + it * ROWS_A_PASS;
        return (thread + it * THREADS) / CH;
    }
    __device__ static __forceinline__ int chunk_of(int it, int thread) {
        if constexpr (EVEN) return thread % CH;
        return (thread + it * THREADS) % CH;
    }
};

// Blocks of at least this many keys: a thread's rows of one load lie in a few
// consecutive blocks, whose ids TileSource holds (smaller blocks read theirs per copy).
constexpr int kRunBlockKeys = 16;

// Where this thread's chunks of the tiles come from: the BN rows of each load, the
// loads STRIDE rows apart, in order. A contiguous cache: the K and V addresses of the
// chunk in its first row of the next load (where the 16-byte path keeps one chunk
// column a thread). A paged cache (PAGED: the kernel may be given one): the ids of the
// blocks its rows of keys [key0, key0 + BN) lie in (keys past key_end - 1 take its
// block), read a load ahead of their copies so that the block-table reads are not in
// the copies' latency: one a row where the thread has few rows, else the PAGES
// consecutive blocks from the one of its first row (blocks of kRunBlockKeys keys or
// more; below, the ids are read with the copies).
template <typename T, int BN, int CH, int THREADS, int STRIDE, bool PAGED>
struct TileSource {
    using Chunks = TileChunks<BN, CH, THREADS>;
    static constexpr int ELEMS = 16 / static_cast<int>(sizeof(T));
    static constexpr int SPAN = (BN - 1 + kRunBlockKeys - 1) / kRunBlockKeys + 1;
    static constexpr bool BY_ROW = Chunks::ITERS <= SPAN;
    static constexpr int PAGES = BY_ROW ? Chunks::ITERS : SPAN;
    int thread;  // this thread's index among the THREADS that copy the tiles
    const T* k_next;
    const T* v_next;
    int page[PAGED ? PAGES : 1];
    int first_slot;  // the block-table slot of page[0] (not BY_ROW)

    // The contiguous cursor at the load of keys from key0 (unused by a paged cache).
    __device__ __forceinline__ void start(const T* k_head, const T* v_head, const CacheRows& rows,
                                          int key0, long long k_sb, long long k_ss, long long v_sb,
                                          long long v_ss) {
        const long long row = key0 + Chunks::row_of(0, thread);
        const int column = Chunks::chunk_of(0, thread) * ELEMS;
        k_next = k_head + rows.batch_index * k_sb + row * k_ss + column;
        v_next = v_head + rows.batch_index * v_sb + row * v_ss + column;
    }
    __device__ __forceinline__ bool contiguous(const CacheRows& rows) const {
        return !PAGED || rows.table == nullptr;
    }
    // The block ids of the load of keys from key0.
    __device__ __forceinline__ void read(const CacheRows& rows, int key0, int key_end) {
        if constexpr (PAGED) {
            if (rows.table == nullptr) return;
            if constexpr (BY_ROW) {
#pragma unroll
                for (int it = 0; it < PAGES; ++it)
                    page[it] = rows.page(min(key0 + Chunks::row_of(it, thread), key_end - 1));
            } else {
                if (rows.block_size < kRunBlockKeys) return;
                first_slot = rows.slot(min(key0 + Chunks::row_of(0, thread), key_end - 1));
#pragma unroll
                for (int q = 0; q < PAGES; ++q)
                    page[q] = rows.page(min((first_slot + q) * rows.block_size, key_end - 1));
            }
        }
    }
    // The block of key j (< key_end), of row j - key0 = row_of(it) of the load read.
    __device__ __forceinline__ int block_of(const CacheRows& rows, int it, int j) const {
        if constexpr (!PAGED) {
            return rows.batch_index;
        } else {
            if (rows.table == nullptr) return rows.batch_index;
            if constexpr (BY_ROW) {
                return page[it];
            } else {
                if (rows.block_size < kRunBlockKeys) return rows.page(j);
                const int q = rows.slot(j) - first_slot;
                int block = page[0];
#pragma unroll
                for (int p = 1; p < PAGES; ++p) block = q == p ? page[p] : block;
                return block;
            }
        }
    }
};

// Keys [key0, key0 + BN) of one KV head into shared memory ([BN][PITCH] 16-byte
// chunks for K and for V), keys at or past key_end as zeros (never read): 16-byte
// cp.async (one commit group), or element by element where rows are not 16-byte
// aligned. Where the rows are one run of memory rows (a contiguous cache, or a full
// load inside one block of a paged one), each thread keeps its chunk column and steps
// its addresses by a constant, at fixed offsets where the rows are dense; elsewhere
// each copy takes its block from `source`. WITH_V false: K alone (the tile of one
// cache, e.g. absorbed MLA's latent, or a V cache of its own width passed as K);
// COMMIT false: the copies join the next commit group.
template <typename T, int BN, int CH, int PITCH, int THREADS, int STRIDE, bool PAGED,
          bool WITH_V = true, bool COMMIT = true>
__device__ __forceinline__ void load_kv_tile(uint4* k_dst, uint4* v_dst, const T* k_head,
                                             const T* v_head, const CacheRows& rows,
                                             TileSource<T, BN, CH, THREADS, STRIDE, PAGED>& source,
                                             int key0, int key_end, long long k_sb, long long k_ss,
                                             long long v_sb, long long v_ss, bool aligned) {
    using Chunks = TileChunks<BN, CH, THREADS>;
    constexpr int ELEMS = 16 / static_cast<int>(sizeof(T));
    const int thread = source.thread;
    const bool full = key0 + BN <= key_end;
    const bool contiguous = source.contiguous(rows);
    const T* k_src = source.k_next;
    const T* v_src = source.v_next;
    if (contiguous) {  // on to the next load whichever way this one copies
        source.k_next += STRIDE * k_ss;
        source.v_next += STRIDE * v_ss;
    }
    if constexpr (Chunks::EVEN) {
        const bool one_block = !contiguous && full && rows.block_size >= kRunBlockKeys &&
                               rows.slot(key0) == rows.slot(key0 + BN - 1);
        if (aligned && (contiguous || one_block)) {
            const int n0 = Chunks::row_of(0, thread), c = Chunks::chunk_of(0, thread);
            if (!contiguous) {
                const long long block = source.page[0], row = rows.row(key0) + n0;
                k_src = k_head + block * k_sb + row * k_ss + c * ELEMS;
                v_src = v_head + block * v_sb + row * v_ss + c * ELEMS;
            }
            constexpr long long PASS = Chunks::ROWS_A_PASS * CH * ELEMS;  // rows of D elements
            const long long k_pass = Chunks::ROWS_A_PASS * k_ss;
            const long long v_pass = Chunks::ROWS_A_PASS * v_ss;
            if (full && k_pass == PASS &&
                (!WITH_V || v_pass == PASS)) {  // dense rows: fixed offsets
#pragma unroll
                for (int it = 0; it < Chunks::ITERS; ++it) {
                    const int n = n0 + it * Chunks::ROWS_A_PASS;
                    cp_async_16_stream(k_dst + n * PITCH + c, k_src + it * PASS, true);
                    if constexpr (WITH_V)
                        cp_async_16_stream(v_dst + n * PITCH + c, v_src + it * PASS, true);
                }
            } else {
#pragma unroll
                for (int it = 0; it < Chunks::ITERS; ++it) {
                    const int n = n0 + it * Chunks::ROWS_A_PASS;
                    const bool valid = full || key0 + n < key_end;
                    cp_async_16_stream(k_dst + n * PITCH + c, valid ? k_src : k_head, valid);
                    if constexpr (WITH_V)
                        cp_async_16_stream(v_dst + n * PITCH + c, valid ? v_src : v_head, valid);
                    k_src += k_pass;
                    v_src += v_pass;
                }
            }
            if constexpr (COMMIT) cp_async_commit();
            return;
        }
    }
    // Chunk `it`'s place in the tile and its rows in K and V.
    struct Chunk {
        int dst;
        bool valid;
        const T* k_src;
        const T* v_src;
    };
    auto chunk = [&](int it) {
        const int n = Chunks::row_of(it, thread), c = Chunks::chunk_of(it, thread);
        const int j = min(key0 + n, key_end - 1);
        const long long block = source.block_of(rows, it, j);
        const int row = rows.row(j);
        return Chunk{n * PITCH + c, key0 + n < key_end,
                     k_head + block * k_sb + row * k_ss + c * ELEMS,
                     v_head + block * v_sb + row * v_ss + c * ELEMS};
    };
    if (aligned) {
#pragma unroll
        for (int it = 0; it < Chunks::ITERS; ++it) {
            if (!Chunks::covers(it, thread)) break;
            const Chunk x = chunk(it);
            cp_async_16_stream(k_dst + x.dst, x.valid ? x.k_src : k_head, x.valid);
            if constexpr (WITH_V)
                cp_async_16_stream(v_dst + x.dst, x.valid ? x.v_src : v_head, x.valid);
        }
    } else {
        for (int it = 0; it < Chunks::ITERS; ++it) {
            if (!Chunks::covers(it, thread)) break;
            const Chunk x = chunk(it);
            T* kd = reinterpret_cast<T*>(k_dst + x.dst);
            T* vd = reinterpret_cast<T*>(v_dst + x.dst);
#pragma unroll
            for (int e = 0; e < ELEMS; ++e) {
                kd[e] = x.valid ? x.k_src[e] : T{};
                if constexpr (WITH_V) vd[e] = x.valid ? x.v_src[e] : T{};
            }
        }
    }
    if constexpr (COMMIT) cp_async_commit();
}

// The score modifiers (see the Semantics page) of packed row m (query row i = m / group of
// query head h = hk group + m % group) in sequence b: the soft-cap and the
// ALiBi slope in log2 units (they commute with the scaling: c tanh(s / c) and
// slope |p - j| scale linearly), the user's functions and arrays (b, h, i and
// the key j as in the dense call on the sequence's keys).
__device__ __forceinline__ ScoreModifiers decode_modifiers(
    int m, int group, int hk, int b, const Mask& mask, const float* __restrict__ alibi_slopes,
    int alibi_batch_stride, float softcap_log2, const UserModifierArgs& user) {
    const int i = m / group, h = hk * group + (m - i * group);
    const float slope =
        alibi_slopes == nullptr
            ? 0.f
            : alibi_slopes[static_cast<long long>(b) * alibi_batch_stride + h] * kLog2e;
    return ScoreModifiers{softcap_log2,
                          softcap_log2 > 0.f ? 1.f / softcap_log2 : 0.f,
                          slope,
                          static_cast<long long>(mask.kv_len) - mask.q_len,
                          b,
                          h,
                          user.score_arrays,
                          user.mask_arrays,
                          BlockMaskView{}};
}
// Does the call modify the scores (a built-in, or the user's score function)?
__device__ __forceinline__ bool decode_modifies(const float* alibi_slopes, float softcap_log2) {
    return ScoreModifiers::user_score || softcap_log2 > 0.f || alibi_slopes != nullptr;
}
// A score in log2 units (scale log2(e) q.k) of packed row m and key j, modified.
template <typename T>
__device__ __forceinline__ float decode_modified_score(float s, int m, int j, int group, int hk,
                                                       int b, const Mask& mask,
                                                       const float* __restrict__ alibi_slopes,
                                                       int alibi_batch_stride, float softcap_log2,
                                                       const UserModifierArgs& user) {
    const int i = m / group;
    const auto mods = decode_modifiers(m, group, hk, b, mask, alibi_slopes, alibi_batch_stride,
                                       softcap_log2, user);
    float derivative;
    return mods.template apply2 < sizeof(T) ==
           2 > (s, 1.f, i, j, static_cast<float>(i + static_cast<int>(mods.offset) - j),
                derivative);
}
// The user's mask at packed row m and key j (true without one).
__device__ __forceinline__ bool decode_sees(int m, int j, int group, int hk, int b,
                                            const Mask& mask, const UserModifierArgs& user) {
    if constexpr (!ScoreModifiers::user_mask) return true;
    const auto mods = decode_modifiers(m, group, hk, b, mask, nullptr, 0, 0.f, user);
    return mods.sees(m / group, j);
}

// The keys of a thread's two packed rows m[0], m[1] ([lo, hi); a row past rows_total sees
// none) and those that every row of its warp sees ([full_lo, full_hi), over the lanes).
struct RowKeys {
    int lo[2], hi[2], full_lo, full_hi;

    __device__ __forceinline__ RowKeys(const Mask& mask, const int (&m)[2], int rows_total,
                                       int group) {
        full_lo = 0;
        full_hi = 0x7fffffff;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            lo[r] = hi[r] = 0;
            if (m[r] < rows_total) {
                mask.row_keys(m[r] / group, lo[r], hi[r]);
                full_lo = max(full_lo, lo[r]);
                full_hi = min(full_hi, hi[r]);
            }
        }
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            full_lo = max(full_lo, __shfl_xor_sync(0xffffffffu, full_lo, o));
            full_hi = min(full_hi, __shfl_xor_sync(0xffffffffu, full_hi, o));
        }
    }
    // Do keys [key0, key0 + n) need masking for some row of the warp?
    __device__ __forceinline__ bool edge(int key0, int n) const {
        return !(key0 >= full_lo && key0 + n <= full_hi);
    }
};

// The end of packed row m (query row i of head h, sequence b) in split `split`: the factor
// its accumulator takes (1 / l, and the sink's where the sequence is not split: the sink
// enters once a row, here or in kvcache_combine), its lse in base 2 and its rows in out
// and part_out. l: the row's sum (a NaN sum counts as seen: NaN is never hidden); top:
// its maximum in base 2.
struct DecodeRowEnd {
    float inv, lse2;
    long long row, part;
    int num_splits;

    __device__ __forceinline__ DecodeRowEnd(float l, float top, const float* __restrict__ sinks,
                                            int h, int i, int b, int num_heads, int q_len,
                                            int splits, int split)
        : num_splits(splits) {
        float base = top == neg_inf() ? 0.f : top;
        float factor = 1.f;
        if (sinks != nullptr && num_splits == 1) factor = add_sink(sink_log2(sinks, h), base, l);
        const bool seen = l != 0.f;
        inv = seen ? factor / l : 0.f;
        lse2 = seen ? base + log2f(l) : neg_inf();
        row = (static_cast<long long>(b) * num_heads + h) * q_len + i;
        part = row * num_splits + split;
    }
    // Columns `column` and `column` + 1 of the row (DV columns) from accumulators x0, x1:
    // the output in T, or a split's float32 partial.
    template <typename T>
    __device__ __forceinline__ void store(T* out, float* part_out, int dv, int column, float x0,
                                          float x1) const {
        x0 *= inv;
        x1 *= inv;
        if (num_splits == 1) {
            out[row * dv + column] = from_float<T>(x0);
            out[row * dv + column + 1] = from_float<T>(x1);
        } else {
            *reinterpret_cast<float2*>(part_out + part * dv + column) = make_float2(x0, x1);
        }
    }
    // The row's lse: natural-log in lse, or base 2 in the split's part_lse.
    __device__ __forceinline__ void store_lse(float* lse, float* part_lse) const {
        if (num_splits == 1) {
            lse[row] = lse2 * kLn2;
        } else {
            part_lse[part] = lse2;
        }
    }
};

// Split `split` of num_splits of the BN-key tiles over [range_lo, range_hi): `count`
// consecutive tiles from `first`.
struct SplitTiles {
    int first, count;
};
template <int BN>
__device__ __forceinline__ SplitTiles split_tiles(int range_lo, int range_hi, int num_splits,
                                                  int split) {
    const int tiles = range_hi > range_lo ? (range_hi - range_lo + BN - 1) / BN : 0;
    const int per_split = (tiles + num_splits - 1) / num_splits;
    const int first = min(tiles, split * per_split);
    return SplitTiles{first, min(tiles, first + per_split) - first};
}

// Score x (scale log2(e) q.k) of packed row m and key j after the call's modifiers
// (`modified`: decode_modifies) and masks: -inf outside the row's keys [lo, hi) where the
// tile is an edge one, or where the user's mask hides it.
template <typename T>
__device__ __forceinline__ float decode_score(float x, bool edge, bool modified, int m, int j,
                                              int lo, int hi, int rows_total, int group, int hk,
                                              int b, const Mask& mask,
                                              const float* __restrict__ alibi_slopes,
                                              int alibi_batch_stride, float softcap_log2,
                                              const UserModifierArgs& user) {
    const bool row_live = m < rows_total;
    if (modified && row_live)
        x = decode_modified_score<T>(x, m, j, group, hk, b, mask, alibi_slopes, alibi_batch_stride,
                                     softcap_log2, user);
    if ((edge && (j < lo || j >= hi)) || (row_live && !decode_sees(m, j, group, hk, b, mask, user)))
        x = neg_inf();
    return x;
}

// A tile of scores s (N n8 tiles in the mma.sync C layout: this thread's rows my_row[0] and
// my_row[1], keys key0 + 8 n + 2 t and the next) in base 2 after the call's modifiers and
// masks (decode_score, where the tile is an edge one or a modifier asks), each row's
// maximum raised into top.
template <typename T, int N>
__device__ __forceinline__ void decode_tile_scores(
    float (&s)[N][4], float (&top)[2], int key0, int t, bool edge, bool modified,
    const int (&my_row)[2], const RowKeys& keys, float scale_log2, int rows_total, int group,
    int hk, int b, const Mask& mask, const float* __restrict__ alibi_slopes, int alibi_batch_stride,
    float softcap_log2, const UserModifierArgs& user) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = e >> 1, key = key0 + n * 8 + 2 * t + (e & 1);
            float x = s[n][e] * scale_log2;
            if (edge || modified || ScoreModifiers::user_mask)
                x = decode_score<T>(x, edge, modified, my_row[r], key, keys.lo[r], keys.hi[r],
                                    rows_total, group, hk, b, mask, alibi_slopes,
                                    alibi_batch_stride, softcap_log2, user);
            s[n][e] = x;
            top[r] = fmaxf(top[r], x);
        }
    }
}

}  // namespace cuflash
