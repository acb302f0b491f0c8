// Attention over a KV cache (the KV-cache page): split-KV ("Flash-Decoding") kernels.
//
// kvcache_append   writes k_new / v_new into the cache at each sequence's length
//                  (and applies the rotary embedding to k_new and q, if asked).
// kvcache_decode   one block per (split of the keys, tile of packed query rows,
//                  KV head, sequence): the query rows of all query heads that
//                  share the KV head (times S_q) are packed into one tile, so
//                  each K/V tile is read once for all of them. K and V tiles
//                  move into shared memory with 16-byte cp.async (double
//                  buffered), scores and P V run on CUDA cores in float32, the
//                  softmax is online. With one split the block writes the
//                  output; with several it writes a partial (out, lse) in
//                  float32 that kvcache_combine merges by log-sum-exp, in a
//                  fixed order (the same bits on every run).
// kvcache_decode_tc  the same grid and outputs on mma.sync for float16/bfloat16
//                  (head_dim a multiple of 16): each warp copies and computes its
//                  own slice of the keys of a tile; up to 8 packed rows (NARROW)
//                  the rows are the product's 8-wide side.
//
// Lengths and block ids that live on the device are never trusted: a length
// is clamped to [0, capacity - S_new] and a block id to [0, num_blocks), so no
// thread reads or writes outside any buffer whatever they hold.
#include "common.cuh"
#include "mma.cuh"

namespace cuflash {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kDecodeTileBytes = 16384;  // bytes of one K (or V) tile, padding aside

// The tile shapes of kvcache_decode<T, D, RM> (mirrored by cuflash/kvcache.py's
// decode_shape; the kernel traps if it is launched with less shared memory).
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
// each copy takes its block from `source`.
template <typename T, int BN, int CH, int PITCH, int THREADS, int STRIDE, bool PAGED>
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
            if (full && k_pass == PASS && v_pass == PASS) {  // dense rows: fixed offsets
#pragma unroll
                for (int it = 0; it < Chunks::ITERS; ++it) {
                    const int n = n0 + it * Chunks::ROWS_A_PASS;
                    cp_async_16_stream(k_dst + n * PITCH + c, k_src + it * PASS, true);
                    cp_async_16_stream(v_dst + n * PITCH + c, v_src + it * PASS, true);
                }
            } else {
#pragma unroll
                for (int it = 0; it < Chunks::ITERS; ++it) {
                    const int n = n0 + it * Chunks::ROWS_A_PASS;
                    const bool valid = full || key0 + n < key_end;
                    cp_async_16_stream(k_dst + n * PITCH + c, valid ? k_src : k_head, valid);
                    cp_async_16_stream(v_dst + n * PITCH + c, valid ? v_src : v_head, valid);
                    k_src += k_pass;
                    v_src += v_pass;
                }
            }
            cp_async_commit();
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
                vd[e] = x.valid ? x.v_src[e] : T{};
            }
        }
    }
    cp_async_commit();
}

// Element d of row x after the rotary embedding at table row `row` (see the KV-cache
// page): the first rotary_dim dimensions rotate in pairs (d, d + rotary_dim / 2), or
// (2r, 2r + 1) when interleaved; x1' = x1 cos - x2 sin, x2' = x1 sin + x2 cos in float32
// with each product rounded before the sum (no FMA: the CPU path's arithmetic). The
// tables [S_rot, rotary_dim / 2] hold T (tables_in_t) or float.
template <typename T>
__device__ __forceinline__ float rotary_element(const T* __restrict__ x, int d, int rotary_dim,
                                                bool interleaved,
                                                const void* __restrict__ cos_table,
                                                const void* __restrict__ sin_table,
                                                bool tables_in_t, int row) {
    const float self = to_float(x[d]);
    if (d >= rotary_dim) return self;
    const int half = rotary_dim >> 1;
    const bool first = interleaved ? (d & 1) == 0 : d < half;
    const int pair = interleaved ? d >> 1 : (first ? d : d - half);
    const int partner = interleaved ? d ^ 1 : (first ? d + half : d - half);
    const long long at = static_cast<long long>(row) * half + pair;
    const float c = tables_in_t ? to_float(static_cast<const T*>(cos_table)[at])
                                : static_cast<const float*>(cos_table)[at];
    const float s = tables_in_t ? to_float(static_cast<const T*>(sin_table)[at])
                                : static_cast<const float*>(sin_table)[at];
    const float other = to_float(x[partner]);
    return first ? __fsub_rn(__fmul_rn(self, c), __fmul_rn(other, s))
                 : __fadd_rn(__fmul_rn(other, s), __fmul_rn(self, c));
}

// k_new / v_new [B, H_kv, S_new, D] into the cache at rows cached_length(b) ..
// One thread an element; grid (key blocks + query blocks, H_kv, B): the first
// ceil(S_new * D / 128) blocks of x append, k_new's rows rotated at their positions
// with rotary_dim > 0. With rotary_dim > 0 the next ceil(group * S_q * D / 128) rotate
// the query rows of the KV head's query heads at their positions p = i + L_b - S_q
// into q_rotated [B, H, S_q, D] (contiguous), which the attention kernels then read.
// Positions are clamped to the tables' rows [0, rotary_rows) (device-held lengths
// are never trusted; host-held ones were checked). With key_counts (not null), each
// sequence's keys after the append, cached_length + S_new, go there too (the dense
// forward's per-sequence key counts for a chunk of queries).
template <typename T>
__global__ void __launch_bounds__(kDecodeThreads)
    kvcache_append(const T* __restrict__ k_new, const T* __restrict__ v_new,
                   T* __restrict__ k_cache, T* __restrict__ v_cache,
                   const int* __restrict__ seqlens, int seqlen_value,
                   const int* __restrict__ block_table, int* __restrict__ key_counts,
                   const T* __restrict__ q, T* __restrict__ q_rotated,
                   const void* __restrict__ rotary_cos, const void* __restrict__ rotary_sin,
                   long long kn_sb, long long kn_sh, long long kn_ss, long long vn_sb,
                   long long vn_sh, long long vn_ss, long long k_sb, long long k_sh, long long k_ss,
                   long long v_sb, long long v_sh, long long v_ss, long long q_sb, long long q_sh,
                   long long q_ss, int new_len, int head_dim, int capacity, int block_size,
                   int max_blocks, int num_blocks, int q_len, int group, int rotary_dim,
                   int rotary_rows, int interleaved, int tables_in_t) {
    const int hk = blockIdx.y, b = blockIdx.z;
    const long long key_elements = static_cast<long long>(new_len) * head_dim;
    const int key_blocks = static_cast<int>((key_elements + kDecodeThreads - 1) / kDecodeThreads);
    const int length = cached_length(seqlens, seqlen_value, b, new_len, capacity);
    if (static_cast<int>(blockIdx.x) >= key_blocks) {  // the query rows' rotation
        if (rotary_dim == 0) return;
        const long long idx =
            static_cast<long long>(blockIdx.x - key_blocks) * kDecodeThreads + threadIdx.x;
        if (idx >= static_cast<long long>(group) * q_len * head_dim) return;
        const int d = static_cast<int>(idx % head_dim);
        const long long row = idx / head_dim;  // (head in the group, query row)
        const int i = static_cast<int>(row % q_len);
        const int h = hk * group + static_cast<int>(row / q_len);
        const int p = min(max(length + new_len - q_len + i, 0), rotary_rows - 1);
        const T* x = q + b * q_sb + h * q_sh + i * q_ss;
        const long long out = ((static_cast<long long>(b) * gridDim.y * group + h) * q_len + i);
        q_rotated[out * head_dim + d] = from_float<T>(rotary_element(
            x, d, rotary_dim, interleaved != 0, rotary_cos, rotary_sin, tables_in_t != 0, p));
        return;
    }
    const long long idx = static_cast<long long>(blockIdx.x) * kDecodeThreads + threadIdx.x;
    if (idx >= key_elements) return;
    const int t = static_cast<int>(idx / head_dim), d = static_cast<int>(idx % head_dim);
    const int pos = length + t;
    if (key_counts != nullptr && idx == 0 && hk == 0) key_counts[b] = pos + new_len;
    const CacheRows rows = cache_rows(block_table, b, max_blocks, block_size, num_blocks);
    long long k_off, v_off;
    rows.offsets(pos, k_sb, k_ss, v_sb, v_ss, k_off, v_off);
    const T* k_row = k_new + b * kn_sb + hk * kn_sh + t * kn_ss;
    k_cache[k_off + hk * k_sh + d] =
        rotary_dim > 0
            ? from_float<T>(rotary_element(k_row, d, rotary_dim, interleaved != 0, rotary_cos,
                                           rotary_sin, tables_in_t != 0, min(pos, rotary_rows - 1)))
            : k_row[d];
    v_cache[v_off + hk * v_sh + d] = v_new[b * vn_sb + hk * vn_sh + t * vn_ss + d];
}

// The split-KV kernels' arguments (kvcache_decode and kvcache_decode_tc take the
// same; cuflash/kvcache.py passes them in this order).
#define CUFLASH_DECODE_PARAMS(T)                                                                 \
    const T *__restrict__ q, const T *__restrict__ k_cache, const T *__restrict__ v_cache,       \
        const int *__restrict__ seqlens, int seqlen_value, const int *__restrict__ block_table,  \
        T *__restrict__ out, float *__restrict__ lse, float *__restrict__ part_out,              \
        float *__restrict__ part_lse, const float *__restrict__ alibi_slopes,                    \
        const float *__restrict__ sinks, const UserModifierArgs user_args, long long q_sb,       \
        long long q_sh, long long q_ss, long long k_sb, long long k_sh, long long k_ss,          \
        long long v_sb, long long v_sh, long long v_ss, int num_heads, int group, int q_len,     \
        int new_len, int capacity, int block_size, int max_blocks, int num_blocks, int win_left, \
        int win_right, int num_splits, int row_tiles, int aligned, float scale_log2,             \
        int alibi_batch_stride, float softcap_log2

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

// Grid (num_splits * row_tiles, H_kv, B); block x = split * row_tiles + row tile.
// Packed row m of a KV head is query row i = m / group of query head
// hk * group + m % group; a tile holds RM packed rows.
template <typename T, int D, int RM>
__global__ void __launch_bounds__(kDecodeThreads, 1) kvcache_decode(CUFLASH_DECODE_PARAMS(T)) {
    using Shape = DecodeShape<T, D, RM>;
    constexpr int ELEMS = Shape::ELEMS, CH = Shape::CH, BN = Shape::BN, DSUB = Shape::DSUB;
    constexpr int PITCH = Shape::PITCH, KSUB = Shape::KSUB;
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* kv_tiles = reinterpret_cast<uint4*>(smem);  // [stage][K, V][BN][PITCH] chunks
    float* reduce_s = reinterpret_cast<float*>(smem);  // [KSUB][RM][D], then [KSUB][RM] sums
    float* q_s = reinterpret_cast<float*>(smem + Shape::REGION);  // [RM][D], scaled
    float* p_s = q_s + RM * D;                                    // [BN][RM]
    float* max_s = p_s + BN * RM;                                 // [warp][RM]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        unsigned dynamic_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
        if (dynamic_bytes < static_cast<unsigned>(Shape::SMEM)) __trap();
    }

    const int hk = blockIdx.y, b = blockIdx.z;
    const int split = blockIdx.x / row_tiles, row0 = (blockIdx.x % row_tiles) * RM;
    const int rows_total = q_len * group;
    const int kv_len = cached_length(seqlens, seqlen_value, b, new_len, capacity) + new_len;
    const Mask mask{q_len, kv_len, win_left, win_right};
    const CacheRows rows = cache_rows(block_table, b, max_blocks, block_size, num_blocks);

    // Each row's visible keys [lo, hi); the block's range; the keys all rows see.
    int key_lo[RM], key_hi[RM];
    int range_lo = kv_len, range_hi = 0, full_lo = 0, full_hi = kv_len;
#pragma unroll
    for (int r = 0; r < RM; ++r) {
        const int m = row0 + r;
        key_lo[r] = key_hi[r] = 0;
        if (m < rows_total) {
            mask.row_keys(m / group, key_lo[r], key_hi[r]);
            if (key_hi[r] > key_lo[r]) {
                range_lo = min(range_lo, key_lo[r]);
                range_hi = max(range_hi, key_hi[r]);
            }
            full_lo = max(full_lo, key_lo[r]);
            full_hi = min(full_hi, key_hi[r]);
        }
    }
    const int tiles = range_hi > range_lo ? (range_hi - range_lo + BN - 1) / BN : 0;
    const int per_split = (tiles + num_splits - 1) / num_splits;
    const int tile_begin = min(tiles, split * per_split);
    const int tile_end = min(tiles, tile_begin + per_split);

    const T* k_head = k_cache + hk * k_sh;
    const T* v_head = v_cache + hk * v_sh;
    // The tiles load in order, tile_begin first.
    TileSource<T, BN, CH, kDecodeThreads, BN, true> source;
    source.thread = tid;
    source.start(k_head, v_head, rows, range_lo + tile_begin * BN, k_sb, k_ss, v_sb, v_ss);
    auto load_tile = [&](int stage, int tile) {
        uint4* k_dst = kv_tiles + (2 * stage) * Shape::TILE_CHUNKS;
        source.read(rows, range_lo + tile * BN, range_hi);
        load_kv_tile<T, BN, CH, PITCH, kDecodeThreads, BN, true>(
            k_dst, k_dst + Shape::TILE_CHUNKS, k_head, v_head, rows, source, range_lo + tile * BN,
            range_hi, k_sb, k_ss, v_sb, v_ss, aligned != 0);
    };
    if (tile_begin < tile_end) load_tile(0, tile_begin);  // in flight while Q loads

    // Q rows into shared memory as float32, times scale * log2(e); zeros past the rows.
    for (int idx = tid; idx < RM * D; idx += kDecodeThreads) {
        const int r = idx / D, d = idx - (idx / D) * D, m = row0 + r;
        float x = 0.f;
        if (m < rows_total) {
            const int i = m / group, h = hk * group + (m - i * group);
            x = to_float(q[b * q_sb + h * q_sh + i * q_ss + d]) * scale_log2;
        }
        q_s[idx] = x;
    }

    float row_max[RM], acc[RM][ELEMS], row_sum[RM];
#pragma unroll
    for (int r = 0; r < RM; ++r) {
        row_max[r] = neg_inf();
        row_sum[r] = 0.f;
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) acc[r][e] = 0.f;
    }
    const int score_key = tid / DSUB, dsub = tid % DSUB;
    const int pv_sub = tid / CH, pv_chunk = tid % CH;
    const bool pv_active = pv_sub < KSUB;

    for (int tile = tile_begin; tile < tile_end; ++tile) {
        const int stage = (tile - tile_begin) & 1;
        if (tile + 1 < tile_end) {
            load_tile(stage ^ 1, tile + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint4* k_tile = kv_tiles + (2 * stage) * Shape::TILE_CHUNKS;
        const uint4* v_tile = k_tile + Shape::TILE_CHUNKS;
        const int key0 = range_lo + tile * BN;

        // Scores of key score_key for every row: DSUB lanes split the chunks.
        float s[RM];
#pragma unroll
        for (int r = 0; r < RM; ++r) s[r] = 0.f;
        const uint4* k_row = k_tile + score_key * PITCH;
#pragma unroll 2
        for (int c = dsub; c < CH; c += DSUB) {
            float kf[ELEMS];
            unpack<T>(k_row[c], kf);
#pragma unroll
            for (int r = 0; r < RM; ++r) {
                const float4* qr = reinterpret_cast<const float4*>(q_s + r * D + c * ELEMS);
#pragma unroll
                for (int e4 = 0; e4 < ELEMS / 4; ++e4) {
                    const float4 qv = qr[e4];
                    s[r] += qv.x * kf[4 * e4] + qv.y * kf[4 * e4 + 1] + qv.z * kf[4 * e4 + 2] +
                            qv.w * kf[4 * e4 + 3];
                }
            }
        }
#pragma unroll
        for (int r = 0; r < RM; ++r) {
#pragma unroll
            for (int o = DSUB / 2; o > 0; o >>= 1) s[r] += __shfl_xor_sync(0xffffffffu, s[r], o);
        }
        const int j = key0 + score_key;
        const bool edge = !(key0 >= full_lo && key0 + BN <= full_hi);
        if (decode_modifies(alibi_slopes, softcap_log2)) {
#pragma unroll
            for (int r = 0; r < RM; ++r)
                if (row0 + r < rows_total)
                    s[r] = decode_modified_score<T>(s[r], row0 + r, j, group, hk, b, mask,
                                                    alibi_slopes, alibi_batch_stride, softcap_log2,
                                                    user_args);
        }
        float tile_max[RM];
#pragma unroll
        for (int r = 0; r < RM; ++r) {
            if ((edge && (j < key_lo[r] || j >= key_hi[r])) ||
                (row0 + r < rows_total && !decode_sees(row0 + r, j, group, hk, b, mask, user_args)))
                s[r] = neg_inf();
            float x = s[r];
#pragma unroll
            for (int o = 16; o >= DSUB; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
            tile_max[r] = x;
        }
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < RM; ++r) max_s[warp * RM + r] = tile_max[r];
        }
        __syncthreads();
        float alpha[RM];
#pragma unroll
        for (int r = 0; r < RM; ++r) {
            float x = row_max[r];
#pragma unroll
            for (int w = 0; w < kDecodeWarps; ++w) x = fmaxf(x, max_s[w * RM + r]);
            const float base = x == neg_inf() ? 0.f : x;
            alpha[r] = fast_exp2(row_max[r] - base);
            row_max[r] = x;
            s[r] = fast_exp2(s[r] - base);
        }
        if (dsub == 0) {
#pragma unroll
            for (int r = 0; r < RM; ++r) p_s[score_key * RM + r] = s[r];
        }
        __syncthreads();

        // acc[r][:] = alpha acc + sum over this thread's keys of p V[key, chunk].
        if (pv_active) {
#pragma unroll
            for (int r = 0; r < RM; ++r) {
                row_sum[r] *= alpha[r];
#pragma unroll
                for (int e = 0; e < ELEMS; ++e) acc[r][e] *= alpha[r];
            }
            for (int n = pv_sub; n < BN; n += KSUB) {
                float vf[ELEMS];
                unpack<T>(v_tile[n * PITCH + pv_chunk], vf);
                float p[RM];
                if constexpr (RM % 4 == 0) {
#pragma unroll
                    for (int r4 = 0; r4 < RM / 4; ++r4) {
                        const float4 pv = reinterpret_cast<const float4*>(p_s + n * RM)[r4];
                        p[4 * r4] = pv.x;
                        p[4 * r4 + 1] = pv.y;
                        p[4 * r4 + 2] = pv.z;
                        p[4 * r4 + 3] = pv.w;
                    }
                } else {
#pragma unroll
                    for (int r = 0; r < RM; ++r) p[r] = p_s[n * RM + r];
                }
#pragma unroll
                for (int r = 0; r < RM; ++r) {
                    row_sum[r] += p[r];
#pragma unroll
                    for (int e = 0; e < ELEMS; ++e) acc[r][e] += p[r] * vf[e];
                }
            }
        }
        __syncthreads();
    }

    // Sum the KSUB partial accumulators (all in the same scale: the row maxima
    // are the same in every thread) and write the rows.
    cp_async_wait<0>();
    __syncthreads();
    float* sums_s = reduce_s + KSUB * RM * D;
    if (pv_active) {
#pragma unroll
        for (int r = 0; r < RM; ++r) {
#pragma unroll
            for (int e = 0; e < ELEMS; ++e)
                reduce_s[(pv_sub * RM + r) * D + pv_chunk * ELEMS + e] = acc[r][e];
            if (pv_chunk == 0) sums_s[pv_sub * RM + r] = row_sum[r];
        }
    }
    __syncthreads();
    for (int idx = tid; idx < RM * D; idx += kDecodeThreads) {
        const int r = idx / D, d = idx - (idx / D) * D, m = row0 + r;
        if (m >= rows_total) continue;
        float o = 0.f, l = 0.f;
        for (int k = 0; k < KSUB; ++k) {
            o += reduce_s[(k * RM + r) * D + d];
            l += sums_s[k * RM + r];
        }
        float rmax = neg_inf();
#pragma unroll
        for (int rr = 0; rr < RM; ++rr) rmax = rr == r ? row_max[rr] : rmax;
        const int i = m / group, h = hk * group + (m - i * group);
        // Attention sinks enter once a row: here unsplit, else in kvcache_combine.
        if (sinks != nullptr && num_splits == 1) o *= add_sink(sink_log2(sinks, h), rmax, l);
        const bool seen = l != 0.f;  // a NaN sum counts as seen: NaN is never hidden
        const float value = seen ? o / l : 0.f;
        const float row_lse2 = seen ? rmax + log2f(l) : neg_inf();
        const long long row = (static_cast<long long>(b) * num_heads + h) * q_len + i;
        if (num_splits == 1) {
            out[row * D + d] = from_float<T>(value);
            if (d == 0) lse[row] = row_lse2 * kLn2;
        } else {
            const long long part = row * num_splits + split;
            part_out[part * D + d] = value;
            if (d == 0) part_lse[part] = row_lse2;
        }
    }
}

// A barrier of the THREADS threads of key slice `slice` (named barrier 1 + slice), a
// warp's own sync where they are one warp.
template <int THREADS>
__device__ __forceinline__ void slice_sync(int slice) {
    if constexpr (THREADS == 32) {
        __syncwarp();
    } else {
        asm volatile("bar.sync %0, %1;\n" ::"r"(1 + slice), "n"(THREADS) : "memory");
    }
}

// The tiles of kvcache_decode_tc<T, D, ROW_WARPS, STAGES, BN> (mirrored by
// cuflash/kvcache.py's decode_tc_shape): ROW_WARPS m16 row tiles a block, BN keys
// a K/V tile, STAGES tiles in the pipeline, KEY_WARPS warps sharing each tile by
// keys (each with its own online softmax, merged at the end).
template <typename T, int D, int ROW_WARPS, int STAGES, int BN>
struct DecodeTcShape {
    static constexpr int CH = D / 8;  // 16-byte chunks a row
    static constexpr int KEY_WARPS_FIT = kDecodeWarps / ROW_WARPS;
    static constexpr int KEY_WARPS = KEY_WARPS_FIT < BN / 16 ? KEY_WARPS_FIT : BN / 16;
    static constexpr int WARP_KEYS = BN / KEY_WARPS;  // keys a warp takes of each tile
    static constexpr int BM = 16 * ROW_WARPS;         // packed query rows a block
    static constexpr int PITCH = CH + 1;              // odd: ldmatrix rows hit 8 bank groups
    static constexpr int TILE_CHUNKS = BN * PITCH;
    static constexpr int KV_BYTES = 2 * STAGES * TILE_CHUNKS * 16;  // K and V, STAGES deep
    static constexpr int REDUCE_BYTES = KEY_WARPS * BM * D * 4;
    static constexpr int REGION = KV_BYTES > REDUCE_BYTES ? KV_BYTES : REDUCE_BYTES;
    static constexpr int Q_BYTES = BM * PITCH * 16;
    static constexpr int STATS_BYTES = 2 * KEY_WARPS * BM * 4;
    static constexpr int SMEM = REGION + Q_BYTES + STATS_BYTES;
    static_assert(D % 16 == 0 && sizeof(T) == 2, "mma.sync m16n8k16 on 16-bit types");
    static_assert(WARP_KEYS % 16 == 0, "P feeds the P V product 16 keys at a time");
};

// The tensor-core kernel for float16/bfloat16 and head_dim a multiple of 16: the
// grid, arguments and partial outputs of kvcache_decode, BM packed rows a block.
// Warp (rw, kw) computes S = Q K^T on mma.sync m16n8k16 for query rows
// [16 rw, 16 rw + 16) of the block and keys [kw WARP_KEYS, (kw + 1) WARP_KEYS) of
// each tile, keeps its own online softmax, and accumulates O += P V in registers;
// the KEY_WARPS warps of a row tile merge by log-sum-exp at the end. PAGED: the cache
// is paged (block_table given), else contiguous (its own instantiation: no block ids
// held in registers).
template <typename T, int D, int ROW_WARPS, int STAGES, int BN, bool PAGED, bool NARROW>
__global__ void __launch_bounds__(kDecodeThreads,
                                  (D <= 128 && ROW_WARPS == 1) ? (STAGES == 2 ? 3 : 2) : 1)
    kvcache_decode_tc(CUFLASH_DECODE_PARAMS(T)) {
    using Shape = DecodeTcShape<T, D, ROW_WARPS, STAGES, BN>;
    static_assert(STAGES >= 2, "at least double buffering");
    static_assert(!NARROW || ROW_WARPS == 1, "a narrow block is one tile of 8 rows");
    using Op = TensorOp<T>;
    constexpr int CH = Shape::CH, PITCH = Shape::PITCH, BM = Shape::BM;
    constexpr int KEY_WARPS = Shape::KEY_WARPS, WARP_KEYS = Shape::WARP_KEYS;
    // Tiles of S (keys x rows) a warp a K/V tile: 8-key ones of m16 rows, or (NARROW)
    // 16-key ones of n8 rows; tiles of O: 8 columns of m16 rows, or 16 of n8 rows.
    constexpr int ST = NARROW ? WARP_KEYS / 16 : WARP_KEYS / 8;
    constexpr int OT = NARROW ? D / 16 : D / 8;
    constexpr int ROWS = NARROW ? 8 : BM;  // packed query rows the block computes
    constexpr int ELEMS = 8;
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* kv_tiles = reinterpret_cast<uint4*>(smem);  // [STAGES][K, V][BN][PITCH] chunks
    float* reduce_s = reinterpret_cast<float*>(smem);  // [KEY_WARPS][BM][D] at the end
    uint4* q_s = reinterpret_cast<uint4*>(smem + Shape::REGION);  // [BM][PITCH] chunks
    float* max_s = reinterpret_cast<float*>(smem + Shape::REGION + Shape::Q_BYTES);
    float* sum_s = max_s + KEY_WARPS * BM;  // both [KEY_WARPS][BM]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    if (tid == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        unsigned dynamic_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
        if (dynamic_bytes < static_cast<unsigned>(Shape::SMEM)) __trap();
    }
    const bool active = warp < ROW_WARPS * KEY_WARPS;
    const int rw = active ? warp / KEY_WARPS : 0, kw = warp % KEY_WARPS;

    const int hk = blockIdx.y, b = blockIdx.z;
    const int split = blockIdx.x / row_tiles, row0 = (blockIdx.x % row_tiles) * ROWS;
    const int rows_total = q_len * group;
    const int kv_len = cached_length(seqlens, seqlen_value, b, new_len, capacity) + new_len;
    const Mask mask{q_len, kv_len, win_left, win_right};
    const CacheRows rows = cache_rows(block_table, b, max_blocks, block_size, num_blocks);

    // The block's key range (rows are sorted by query index, so the first and the
    // last row bound it), this thread's two rows' ranges, the keys every row of
    // the warp sees. A thread's rows: g and g + 8 of its warp's m16 tile, or
    // (NARROW) columns 2t and 2t + 1 of the n8 tile.
    const int last_row = min(row0 + ROWS, rows_total) - 1;
    int range_lo, range_hi;
    mask.key_range(row0 / group, last_row / group + 1, range_lo, range_hi);
    int my_lo[2], my_hi[2], full_lo = 0, full_hi = 0x7fffffff;
    const int tile_row[2] = {NARROW ? 2 * t : rw * 16 + g, NARROW ? 2 * t + 1 : rw * 16 + g + 8};
    const int my_row[2] = {row0 + tile_row[0], row0 + tile_row[1]};
    const bool modified = decode_modifies(alibi_slopes, softcap_log2);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int m = my_row[r];
        my_lo[r] = my_hi[r] = 0;
        if (m < rows_total) {
            mask.row_keys(m / group, my_lo[r], my_hi[r]);
            full_lo = max(full_lo, my_lo[r]);
            full_hi = min(full_hi, my_hi[r]);
        }
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        full_lo = max(full_lo, __shfl_xor_sync(0xffffffffu, full_lo, o));
        full_hi = min(full_hi, __shfl_xor_sync(0xffffffffu, full_hi, o));
    }
    const int tiles = range_hi > range_lo ? (range_hi - range_lo + BN - 1) / BN : 0;
    // The split's tiles: `count` consecutive ones from `first`.
    const int per_split = (tiles + num_splits - 1) / num_splits;
    const int first = min(tiles, split * per_split);
    const int count = min(tiles, first + per_split) - first;
    auto tile_of = [&](int step) { return first + step; };

    const T* k_head = k_cache + hk * k_sh;
    const T* v_head = v_cache + hk * v_sh;
    // The ROW_WARPS warps of key slice kw copy its rows of each tile themselves and
    // wait for them alone (slice_sync): the slices stream independently, no block
    // barrier a tile. `source` points at the slice's next rows (tiles load in order; a
    // paged cache's block ids read a tile ahead).
    constexpr int SLICE_THREADS = ROW_WARPS * 32;
    const int slice = kw * WARP_KEYS;
    TileSource<T, WARP_KEYS, CH, SLICE_THREADS, BN, PAGED> source;
    source.thread = rw * 32 + lane;
    source.start(k_head, v_head, rows, range_lo + first * BN + slice, k_sb, k_ss, v_sb, v_ss);
    auto load_tile = [&](int stage, int step) {
        uint4* k_dst = kv_tiles + (2 * stage) * Shape::TILE_CHUNKS + slice * PITCH;
        load_kv_tile<T, WARP_KEYS, CH, PITCH, SLICE_THREADS, BN, PAGED>(
            k_dst, k_dst + Shape::TILE_CHUNKS, k_head, v_head, rows, source,
            range_lo + tile_of(step) * BN + slice, range_hi, k_sb, k_ss, v_sb, v_ss, aligned != 0);
        if (step + 1 < count)
            source.read(rows, range_lo + tile_of(step + 1) * BN + slice, range_hi);
    };
    // STAGES - 1 tiles in flight while Q loads (empty groups keep the count uniform).
    if (active) {
        if (count > 0) source.read(rows, range_lo + first * BN + slice, range_hi);
#pragma unroll
        for (int st = 0; st < STAGES - 1; ++st) {
            if (st < count) {
                load_tile(st, st);
            } else {
                cp_async_commit();
            }
        }
    }

    // Q rows into shared memory in the input type; zeros past the rows.
    for (int idx = tid; idx < BM * D; idx += kDecodeThreads) {
        const int r = idx / D, d = idx - (idx / D) * D, m = row0 + r;
        T x{};
        if (m < rows_total) {
            const int i = m / group, h = hk * group + (m - i * group);
            x = q[b * q_sb + h * q_sh + i * q_ss + d];
        }
        reinterpret_cast<T*>(q_s)[r * PITCH * ELEMS + d] = x;
    }

    float o_acc[OT][4];
#pragma unroll
    for (int d = 0; d < OT; ++d) o_acc[d][0] = o_acc[d][1] = o_acc[d][2] = o_acc[d][3] = 0.f;
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
    const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_chunk = lane >> 4;
    const int b_row = (lane & 7) + 8 * (lane >> 4), b_chunk = (lane >> 3) & 1;
    const uint4* q_rows = q_s + (rw * 16 + a_row) * PITCH + a_chunk;
    __syncthreads();  // Q is in
    // NARROW: Q^T as the B operand of S^T = K Q^T, in registers for the whole block
    // (lanes 8i..8i+7 address the 8 rows of 16-byte chunk 2 kk + i).
    unsigned q_frag[NARROW ? D / 16 : 1][2];
    if constexpr (NARROW) {
#pragma unroll
        for (int kk = 0; kk < D / 16; kk += 2) {
            unsigned x[4];
            ldmatrix_x4(x, q_s + (lane & 7) * PITCH + 2 * kk + (lane >> 3));
            q_frag[kk][0] = x[0];
            q_frag[kk][1] = x[1];
            if (kk + 1 < D / 16) {
                q_frag[kk + 1][0] = x[2];
                q_frag[kk + 1][1] = x[3];
            }
        }
    }
    // Element e of an S tile n: its row (0 or 1 of the thread's) and key in the warp's
    // slice; element e of an O tile: its row.
    auto row_of = [](int e) { return NARROW ? (e & 1) : (e >> 1); };
    auto key_of = [&](int n, int e) {
        return NARROW ? n * 16 + g + 8 * (e >> 1) : n * 8 + 2 * t + (e & 1);
    };

    for (int step = 0; active && step < count; ++step) {
        const int tile = tile_of(step), stage = step % STAGES;
        cp_async_wait<STAGES - 2>();
        // The slice's rows of tile `step` are in; its warps are done with step - 1's stage.
        slice_sync<SLICE_THREADS>(kw);
        if (step + STAGES - 1 < count) {
            load_tile((step + STAGES - 1) % STAGES, step + STAGES - 1);
        } else {
            cp_async_commit();
        }
        {
            const uint4* k_tile =
                kv_tiles + (2 * stage) * Shape::TILE_CHUNKS + kw * WARP_KEYS * PITCH;
            const uint4* v_tile = k_tile + Shape::TILE_CHUNKS;
            float s[ST][4];
#pragma unroll
            for (int n = 0; n < ST; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                if constexpr (NARROW) {  // S^T = K Q^T: K the A operand
#pragma unroll
                    for (int n = 0; n < ST; ++n) {
                        unsigned ka[4];
                        ldmatrix_x4(ka, k_tile + (n * 16 + a_row) * PITCH + 2 * kk + a_chunk);
                        Op::mma(s[n], ka, q_frag[kk][0], q_frag[kk][1]);
                    }
                } else {
                    unsigned qa[4];
                    ldmatrix_x4(qa, q_rows + 2 * kk);
#pragma unroll
                    for (int n = 0; n < ST; n += 2) {
                        unsigned kb[4];
                        ldmatrix_x4(kb, k_tile + (n * 8 + b_row) * PITCH + 2 * kk + b_chunk);
                        Op::mma(s[n], qa, kb[0], kb[1]);
                        Op::mma(s[n + 1], qa, kb[2], kb[3]);
                    }
                }
            }
            const int key0 = range_lo + tile * BN + kw * WARP_KEYS;
            const bool edge = !(key0 >= full_lo && key0 + WARP_KEYS <= full_hi);
            float new_max[2] = {row_max[0], row_max[1]};
            if (!edge && !modified && !ScoreModifiers::user_mask) {  // every score as it is
#pragma unroll
                for (int n = 0; n < ST; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[n][e] *= scale_log2;
                        new_max[row_of(e)] = fmaxf(new_max[row_of(e)], s[n][e]);
                    }
                }
            } else {
#pragma unroll
                for (int n = 0; n < ST; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = row_of(e), key = key0 + key_of(n, e);
                        float x = s[n][e] * scale_log2;
                        const bool row_live = my_row[r] < rows_total;
                        if (modified && row_live)
                            x = decode_modified_score<T>(x, my_row[r], key, group, hk, b, mask,
                                                         alibi_slopes, alibi_batch_stride,
                                                         softcap_log2, user_args);
                        if ((edge && (key < my_lo[r] || key >= my_hi[r])) ||
                            (row_live &&
                             !decode_sees(my_row[r], key, group, hk, b, mask, user_args)))
                            x = neg_inf();
                        s[n][e] = x;
                        new_max[r] = fmaxf(new_max[r], x);
                    }
                }
            }
            float base[2], alpha[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                // Over the lanes that hold the row: those of one g, or (NARROW) of one t.
#pragma unroll
                for (int o = NARROW ? 4 : 1; o < (NARROW ? 32 : 4); o <<= 1)
                    new_max[r] = fmaxf(new_max[r], __shfl_xor_sync(0xffffffffu, new_max[r], o));
                base[r] = new_max[r] == neg_inf() ? 0.f : new_max[r];
                alpha[r] = fast_exp2(row_max[r] - base[r]);
                row_max[r] = new_max[r];
                row_sum[r] *= alpha[r];
            }
            // Past the first tiles a row's maximum seldom moves: the warp rescales its
            // accumulator only when some row's does (a NaN scale counts as moved).
            if (__any_sync(0xffffffffu, !(alpha[0] == 1.f && alpha[1] == 1.f))) {
#pragma unroll
                for (int d = 0; d < OT; ++d) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) o_acc[d][e] *= alpha[row_of(e)];
                }
            }
#pragma unroll
            for (int n = 0; n < ST; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = fast_exp2(s[n][e] - base[row_of(e)]);
                    s[n][e] = p;
                    row_sum[row_of(e)] += p;
                }
            }
            if constexpr (NARROW) {
                // O^T += V^T P^T: V^T the A operand (transposed loads), P^T the B operand
                // (each 8x8 block of S^T transposed in registers).
#pragma unroll
                for (int n = 0; n < ST; ++n) {
                    const unsigned p_lo = movmatrix_trans(Op::pack(s[n][0], s[n][1]));
                    const unsigned p_hi = movmatrix_trans(Op::pack(s[n][2], s[n][3]));
#pragma unroll
                    for (int d = 0; d < OT; ++d) {
                        unsigned va[4];
                        ldmatrix_x4_trans(va, v_tile + (n * 16 + b_row) * PITCH + 2 * d + b_chunk);
                        Op::mma(o_acc[d], va, p_lo, p_hi);
                    }
                }
            }
#pragma unroll
            for (int kk = 0; kk < (NARROW ? 0 : WARP_KEYS / 16); ++kk) {
                const unsigned pa[4] = {Op::pack(s[2 * kk][0], s[2 * kk][1]),
                                        Op::pack(s[2 * kk][2], s[2 * kk][3]),
                                        Op::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                        Op::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (int d = 0; d < OT; d += 2) {
                    unsigned vb[4];
                    ldmatrix_x4_trans(vb, v_tile + (kk * 16 + a_row) * PITCH + d + a_chunk);
                    Op::mma(o_acc[d], pa, vb[0], vb[1]);
                    Op::mma(o_acc[d + 1], pa, vb[2], vb[3]);
                }
            }
        }
    }

    // Merge the KEY_WARPS warps of each row tile (log-sum-exp), then write.
    cp_async_wait<0>();
    __syncthreads();
    if (active) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int o = NARROW ? 4 : 1; o < (NARROW ? 32 : 4); o <<= 1)
                row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], o);
            if ((NARROW ? g : t) == 0) {
                max_s[kw * BM + tile_row[r]] = row_max[r];
                sum_s[kw * BM + tile_row[r]] = row_sum[r];
            }
        }
    }
    __syncthreads();
    if (active) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = tile_row[r];
            float top = neg_inf();
#pragma unroll
            for (int k = 0; k < KEY_WARPS; ++k) top = fmaxf(top, max_s[k * BM + row]);
            const float factor = fast_exp2(row_max[r] - (top == neg_inf() ? 0.f : top));
            float* dst = reduce_s + (kw * BM + row) * D;
#pragma unroll
            for (int d = 0; d < OT; ++d) {
                if constexpr (NARROW) {  // columns 16 d + g and 16 d + g + 8 of row 2t + r
                    dst[16 * d + g] = o_acc[d][r] * factor;
                    dst[16 * d + g + 8] = o_acc[d][2 + r] * factor;
                } else {
                    *reinterpret_cast<float2*>(dst + d * 8 + 2 * t) =
                        make_float2(o_acc[d][2 * r] * factor, o_acc[d][2 * r + 1] * factor);
                }
            }
        }
    }
    __syncthreads();
    for (int idx = tid; idx < ROWS * D; idx += kDecodeThreads) {
        const int r = idx / D, d = idx - (idx / D) * D, m = row0 + r;
        if (m >= rows_total) continue;
        float top = neg_inf();
#pragma unroll
        for (int k = 0; k < KEY_WARPS; ++k) top = fmaxf(top, max_s[k * BM + r]);
        float base = top == neg_inf() ? 0.f : top;
        float o = 0.f, l = 0.f;
#pragma unroll
        for (int k = 0; k < KEY_WARPS; ++k) {
            o += reduce_s[(k * BM + r) * D + d];
            l += sum_s[k * BM + r] * fast_exp2(max_s[k * BM + r] - base);
        }
        const int i = m / group, h = hk * group + (m - i * group);
        // Attention sinks enter once a row: here unsplit, else in kvcache_combine.
        if (sinks != nullptr && num_splits == 1) o *= add_sink(sink_log2(sinks, h), base, l);
        const bool seen = l != 0.f;  // a NaN sum counts as seen: NaN is never hidden
        const float value = seen ? o / l : 0.f;
        const float row_lse2 = seen ? base + log2f(l) : neg_inf();
        const long long row = (static_cast<long long>(b) * num_heads + h) * q_len + i;
        if (num_splits == 1) {
            out[row * D + d] = from_float<T>(value);
            if (d == 0) lse[row] = row_lse2 * kLn2;
        } else {
            const long long part = row * num_splits + split;
            part_out[part * D + d] = value;
            if (d == 0) part_lse[part] = row_lse2;
        }
    }
}

// Merge the num_splits (at most kMaxSplits) partials of each output row by
// log-sum-exp, in a fixed order (the same bits on every run). One block a row: a
// thread a split's weight, then a thread a column, its partials' loads in flight
// together. Grid (rows). Attention sinks (`sinks` not null; row = (b H + h) S_q
// + i) join as one more partial whose output is zero.
constexpr int kMaxSplits = kDecodeThreads;  // cuflash/kvcache.py's MAX_SPLITS

template <typename T, int D>
__global__ void __launch_bounds__(kDecodeThreads, 4)
    kvcache_combine(const float* __restrict__ part_out, const float* __restrict__ part_lse,
                    T* __restrict__ out, float* __restrict__ lse, const float* __restrict__ sinks,
                    long long rows, int num_splits, int num_heads, int q_len) {
    __shared__ float weight_s[kMaxSplits];
    __shared__ float warp_max_s[kDecodeWarps], warp_sum_s[kDecodeWarps];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const int splits = min(num_splits, kMaxSplits);
    const float split_lse = tid < splits ? part_lse[row * num_splits + tid] : neg_inf();
    const float sink2 =
        sinks == nullptr ? neg_inf() : sink_log2(sinks, static_cast<int>(row / q_len % num_heads));
    float top = fmaxf(split_lse, sink2);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    if (lane == 0) warp_max_s[warp] = top;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) top = fmaxf(top, warp_max_s[w]);
    const float base = top == neg_inf() ? 0.f : top;
    const float weight = tid < splits ? fast_exp2(split_lse - base) : 0.f;
    weight_s[tid] = weight;
    float total = weight;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    if (lane == 0) warp_sum_s[warp] = total;
    __syncthreads();
    total = sinks == nullptr ? 0.f : fast_exp2(sink2 - base);
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) total += warp_sum_s[w];
    const bool seen = total != 0.f;  // a NaN total counts as seen: NaN is never hidden
    // total is in [1, splits + 1] where seen (the top split or the sink weighs 1): the
    // fast reciprocal is within 2 ulp there, and a division routine's call would spill
    const float inv = seen ? __fdividef(1.f, total) : 0.f;
    if (tid == 0) lse[row] = seen ? (base + log2f(total)) * kLn2 : neg_inf();
    constexpr int BATCH = 8;  // partials in flight at once
#pragma unroll
    for (int pass = 0; pass < (D + kDecodeThreads - 1) / kDecodeThreads; ++pass) {
        const int d = tid + pass * kDecodeThreads;
        if (d >= D) break;
        const float* column = part_out + row * num_splits * D + d;
        float o = 0.f;
        int s = 0;
        for (; s + BATCH <= splits; s += BATCH) {
            float x[BATCH];
#pragma unroll
            for (int k = 0; k < BATCH; ++k) x[k] = column[(s + k) * D];
#pragma unroll
            for (int k = 0; k < BATCH; ++k) o += weight_s[s + k] * x[k];
        }
        for (; s < splits; ++s) o += weight_s[s] * column[s * D];
        out[row * D + d] = from_float<T>(o * inv);
    }
}

}  // namespace cuflash
