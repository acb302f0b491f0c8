// The host-kernel contract of the attention kernels: one member list per kernel
// kind (an X-macro), which makes both the kernels' parameter lists and a C struct
// of the same members in the same order. The host lays out one record of each
// list by the C rules, which are also the rules of a kernel's parameter space
// (each parameter at a multiple of its alignment), and passes it whole as the
// launch's parameter buffer (cuLaunchKernel's `extra`,
// CU_LAUNCH_PARAM_BUFFER_POINTER: "This buffer needs to honor all
// alignment/padding requirements of the individual parameters", CUDA driver API).
// cuflash/gpu/kernel_params.py reads the lists from this file, and a test holds its
// layout against the C++ compiler's offsetof and the PTX parameter lists. The
// docs' API and semantics pages say what each option means.
//
// Why not one struct argument: a kernel that reads its pointers and scalars from
// a __grid_constant__ struct does not compile as the same kernel taking them
// as parameters: NVRTC drops the __restrict__ of the pointers (no ld.global.nc)
// and allocates registers otherwise (more, and spills in some backward kernels).
// Positional parameters keep the code of the kernels as it was.
//
// A list's entries, one a line: X(KIND, type, name) with KIND
//   PTR      a pointer to `type` (a kernel's parameter is `type* __restrict__`)
//   VAL      a scalar (int, float, long long) or a record by value
//   STRIDES  the element strides of array `name` (Strides name_st in the struct; a
//            kernel takes long long name_sb, name_sh, name_ss, CUFLASH_STRIDES)
//   MAP      a TMA tensor map (a kernel takes it as a grid constant, so that the
//            bulk tensor copies read it in the parameter space by its address)
// The device addresses a call writes come first; the rest is fixed by a launch
// plan. A list's macro parameters after X name the types its kernels differ in
// (the struct takes void for them).
#pragma once
#include "common/common.cuh"

namespace cuflash {

// A TMA tensor map (CUDA's CUtensorMap): 128 opaque bytes the host encodes
// (cuflash/gpu/tensor_maps.py); the bulk tensor copies read it from the kernel's
// parameter space.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// A list's entries as kernel parameters (each after a comma; CUFLASH_PARAMETERS
// drops the first) and as struct members.
#define CUFLASH_PARAMETER(KIND, type, name) , CUFLASH_PARAMETER_##KIND(type, name)
#define CUFLASH_PARAMETER_PTR(type, name) type* __restrict__ name
#define CUFLASH_PARAMETER_VAL(type, name) type name
#define CUFLASH_PARAMETER_STRIDES(type, name) CUFLASH_STRIDES(name)
#define CUFLASH_PARAMETER_MAP(type, name) const __grid_constant__ type name
#define CUFLASH_MEMBER(KIND, type, name) CUFLASH_MEMBER_##KIND(type, name);
#define CUFLASH_MEMBER_PTR(type, name) type* name
#define CUFLASH_MEMBER_VAL(type, name) type name
#define CUFLASH_MEMBER_STRIDES(type, name) Strides name##_st
#define CUFLASH_MEMBER_MAP(type, name) type name
#define CUFLASH_DROP_FIRST_(first, ...) __VA_ARGS__
#define CUFLASH_DROP_FIRST(...) CUFLASH_DROP_FIRST_(__VA_ARGS__)
// A kernel's parameter list: CUFLASH_PARAMETERS(CUFLASH_FORWARD_PARAMS, T, T).
#define CUFLASH_PARAMETERS(LIST, ...) CUFLASH_DROP_FIRST(LIST(CUFLASH_PARAMETER, __VA_ARGS__))

// The forward kernels: out = softmax(scale Q K^T + modifiers) V and its lse. IN: q's,
// k's and v's type (T; the float32 pieces kernels: half_t, the high pieces); OUT:
// out's (T; the pieces kernels: float). The arrays are [B, H, S, D] views (a packed
// call's [1, H, total, D]), null where a call has none.
#define CUFLASH_FORWARD_PARAMS(X, IN, OUT)                                               \
    X(PTR, const IN, q)                                                                  \
    X(PTR, const half_t, q_lo) /* the pieces kernels' low float16 pieces, else null */   \
    X(PTR, const IN, k)                                                                  \
    X(PTR, const half_t, k_lo)                                                           \
    X(PTR, const IN, v)                                                                  \
    X(PTR, const half_t, v_lo)                                                           \
    X(PTR, OUT, out)              /* v's head dim */                                     \
    X(PTR, float, lse)            /* float32 [B, H, S_q] */                              \
    X(PTR, const float, q_scales) /* the pieces' scales, float32 [B, H] each */          \
    X(PTR, const float, k_scales)                                                        \
    X(PTR, const float, v_scales)                                                        \
    X(PTR, const int, offsets_q)      /* a packed call's cu_seqlens_q (int32 [B + 1]) */ \
    X(PTR, const int, offsets_k)      /* and cu_seqlens_k */                             \
    X(PTR, const float, alibi_slopes) /* float32 [B, H] or [H] */                        \
    X(PTR, const float, sinks)        /* float32 [H] (see add_sink) */                   \
    /* Fixed by the plan: */                                                             \
    X(VAL, const UserModifierArgs, user_args)                                            \
    X(STRIDES, Strides, q) /* element strides of the batch, head and row axes */         \
    X(STRIDES, Strides, k)                                                               \
    X(STRIDES, Strides, v)                                                               \
    X(STRIDES, Strides, out)                                                             \
    X(VAL, int, num_heads)                                                               \
    X(VAL, int, group)  /* query heads a KV head */                                      \
    X(VAL, int, q_len)  /* rows a head of the arrays (a packed call's: the total) */     \
    X(VAL, int, kv_len) /* see Sequence */                                               \
    X(VAL, int, win_left)                                                                \
    X(VAL, int, win_right)                                                               \
    X(VAL, float, scale_log2) /* the softmax scale times log2 e */                       \
    X(VAL, int, alibi_batch_stride)                                                      \
    X(VAL, float, softcap)                                                               \
    X(VAL, int, use_tma) /* forward_wgmma_ws: q, k and v by the maps (0: cp.async) */    \
    /* forward_wgmma_ws's persistent roles: query tiles a (head, entry), and all the */  \
    /* launch's (query tile, head, entry) tiles, which its blocks walk (work_tile). */   \
    X(VAL, int, query_tiles)                                                             \
    X(VAL, int, work_tiles)                                                              \
    /* q's, k's and v's maps (use_tma): dims (head dim, rows, heads, batch), boxes */    \
    /* of 64 columns by the kernel's query or key tile, the 128-byte swizzle. */         \
    X(MAP, TensorMap, q_map)                                                             \
    X(MAP, TensorMap, k_map)                                                             \
    X(MAP, TensorMap, v_map)
struct ForwardParams {
    CUFLASH_FORWARD_PARAMS(CUFLASH_MEMBER, void, void)
};

// The backward's dK/dV kernels (and dQ by float32 atomics: ATOMIC_DQ). IN: q's, k's,
// v's and dout's type (T; the float32 pieces kernels: half_t, the high pieces); OUT:
// dk's and dv's (T; the pieces kernels: float). Arrays as the forward's.
#define CUFLASH_BACKWARD_PARAMS(X, IN, OUT)                                               \
    X(PTR, const IN, q)                                                                   \
    X(PTR, const half_t, q_lo) /* the pieces kernels' low float16 pieces, else null */    \
    X(PTR, const IN, k)                                                                   \
    X(PTR, const half_t, k_lo)                                                            \
    X(PTR, const IN, v)                                                                   \
    X(PTR, const half_t, v_lo)                                                            \
    X(PTR, const IN, dout) /* dO, v's head dim */                                         \
    X(PTR, const half_t, dout_lo)                                                         \
    X(PTR, const float, lse)   /* lse log2 e, float32 [B, H, S_q] (backward_delta's) */   \
    X(PTR, const float, delta) /* Delta = rowsum(dO O), float32 [B, H, S_q] */            \
    X(PTR, float, dq_accum)    /* ATOMIC_DQ: float32 dQ rows (see backward_delta) */      \
    X(PTR, OUT, dk)                                                                       \
    X(PTR, OUT, dv)               /* in rows of the head dim as dk's (dkv strides) */     \
    X(PTR, const float, q_scales) /* the pieces' scales, float32 [B, H] each */           \
    X(PTR, const float, k_scales)                                                         \
    X(PTR, const float, v_scales)                                                         \
    X(PTR, const float, dout_scales)                                                      \
    X(PTR, const int, offsets_q)      /* a packed call's cu_seqlens_q (int32 [B + 1]) */  \
    X(PTR, const int, offsets_k)      /* and cu_seqlens_k */                              \
    X(PTR, const float, alibi_slopes) /* float32 [B, H] or [H] */                         \
    /* Fixed by the plan: */                                                              \
    X(VAL, const UserModifierArgs, user_args)                                             \
    X(STRIDES, Strides, q) /* element strides of the batch, head and row axes */          \
    X(STRIDES, Strides, k)                                                                \
    X(STRIDES, Strides, v)                                                                \
    X(STRIDES, Strides, dout)                                                             \
    X(STRIDES, Strides, dkv) /* dk's and dv's */                                          \
    X(VAL, int, num_heads)                                                                \
    X(VAL, int, group)       /* query heads a KV head */                                  \
    X(VAL, int, kv_capacity) /* rows a head of dk and dv (see Sequence) */                \
    X(VAL, int, q_len)       /* rows a head of the arrays (a packed call's: the total) */ \
    X(VAL, int, kv_len)                                                                   \
    X(VAL, int, win_left)                                                                 \
    X(VAL, int, win_right)                                                                \
    X(VAL, float, scale)      /* the softmax scale */                                     \
    X(VAL, float, scale_log2) /* and times log2 e */                                      \
    X(VAL, int, alibi_batch_stride)                                                       \
    X(VAL, float, softcap)                                                                \
    X(VAL, int, use_tma) /* backward_wgmma_ws: q, k, v, dout by the maps (0: cp.async) */ \
    /* backward_wgmma_ws's persistent roles: key tiles a (KV head, entry), and all */     \
    /* the launch's (key tile, KV head, entry) tiles, which its blocks walk. */           \
    X(VAL, int, key_tiles)                                                                \
    X(VAL, int, work_tiles)                                                               \
    /* and where the plan balanced them (cuflash/gpu/schedules.py), its device array */   \
    /* of each block's tiles (work_tile's schedule; 0: every block's static walk) */      \
    X(VAL, long long, schedule)                                                           \
    /* q's, k's, v's and dout's maps (use_tma): as the forward's, boxes of 64 */          \
    /* columns by the kernel's query or key tile. */                                      \
    X(MAP, TensorMap, q_map)                                                              \
    X(MAP, TensorMap, k_map)                                                              \
    X(MAP, TensorMap, v_map)                                                              \
    X(MAP, TensorMap, dout_map)                                                           \
    /* dq_accum's (use_tma with ATOMIC_DQ): float32 [B, H, S_q, 128], boxes of 32 */      \
    /* columns by 16 rows (a warp's), reduced into by the copy engine. */                 \
    X(MAP, TensorMap, dq_accum_map)
struct BackwardParams {
    CUFLASH_BACKWARD_PARAMS(CUFLASH_MEMBER, void, void)
};

// The backward's dQ passes (the deterministic backward's, and that of the kernels
// without atomics). IN: as the dK/dV kernels'; OUT: dq's (T; the pieces: float).
#define CUFLASH_BACKWARD_DQ_PARAMS(X, IN, OUT)                                         \
    X(PTR, const IN, q)                                                                \
    X(PTR, const half_t, q_lo) /* the pieces kernels' low float16 pieces, else null */ \
    X(PTR, const IN, k)                                                                \
    X(PTR, const half_t, k_lo)                                                         \
    X(PTR, const IN, v)                                                                \
    X(PTR, const half_t, v_lo)                                                         \
    X(PTR, const IN, dout)                                                             \
    X(PTR, const half_t, dout_lo)                                                      \
    X(PTR, const float, lse)                                                           \
    X(PTR, const float, delta)                                                         \
    X(PTR, OUT, dq)                                                                    \
    X(PTR, const float, q_scales)                                                      \
    X(PTR, const float, k_scales)                                                      \
    X(PTR, const float, v_scales)                                                      \
    X(PTR, const float, dout_scales)                                                   \
    X(PTR, const int, offsets_q)                                                       \
    X(PTR, const int, offsets_k)                                                       \
    X(PTR, const float, alibi_slopes)                                                  \
    /* Fixed by the plan: */                                                           \
    X(VAL, const UserModifierArgs, user_args)                                          \
    X(STRIDES, Strides, q)                                                             \
    X(STRIDES, Strides, k)                                                             \
    X(STRIDES, Strides, v)                                                             \
    X(STRIDES, Strides, dout)                                                          \
    X(STRIDES, Strides, dq)                                                            \
    X(VAL, int, num_heads)                                                             \
    X(VAL, int, group)                                                                 \
    X(VAL, int, q_len)                                                                 \
    X(VAL, int, kv_len)                                                                \
    X(VAL, int, win_left)                                                              \
    X(VAL, int, win_right)                                                             \
    X(VAL, float, scale)                                                               \
    X(VAL, float, scale_log2)                                                          \
    X(VAL, int, alibi_batch_stride)                                                    \
    X(VAL, float, softcap)
struct BackwardDqParams {
    CUFLASH_BACKWARD_DQ_PARAMS(CUFLASH_MEMBER, void, void)
};

// The backward's first kernel, backward_delta (T: dout's and out's type):
// Delta and lse log2 e, and zeros in the atomic dQ's rows.
#define CUFLASH_BACKWARD_DELTA_PARAMS(X, T)                                           \
    X(PTR, const T, dout)                                                             \
    X(PTR, const T, out)                                                              \
    X(PTR, const float, lse) /* the forward's, float32 [B, H, S_q] */                 \
    X(PTR, float, delta)     /* Delta, float32 [B, H, S_q] */                         \
    X(PTR, float, lse_log2)  /* lse log2 e, as delta */                               \
    X(PTR, float, dq_accum)  /* the atomic dQ's rows (accum_width floats), or null */ \
    /* Fixed by the plan: */                                                          \
    X(STRIDES, Strides, dout)                                                         \
    X(STRIDES, Strides, out)                                                          \
    X(VAL, int, num_heads)                                                            \
    X(VAL, int, q_len)                                                                \
    X(VAL, int, accum_width) /* 0: no atomic dQ */                                    \
    X(VAL, int, dq_counters) /* the ordered dQ's counters, zeroed (backward_wgmma_ws) */
struct BackwardDeltaParams {
    CUFLASH_BACKWARD_DELTA_PARAMS(CUFLASH_MEMBER, void)
};

// The atomic dQ's conversion, backward_dq_convert (T: dq's type).
#define CUFLASH_DQ_CONVERT_PARAMS(X, T)          \
    X(PTR, const float, dq_accum)                \
    X(PTR, T, dq)                                \
    /* Fixed by the plan: */                     \
    X(STRIDES, Strides, dq)                      \
    X(VAL, long long, count) /* dQ's elements */ \
    X(VAL, int, accum_width)                     \
    X(VAL, int, num_heads)                       \
    X(VAL, int, q_len)
struct DqConvertParams {
    CUFLASH_DQ_CONVERT_PARAMS(CUFLASH_MEMBER, void)
};

// Zeros in the rows of a packed output outside every sequence (and -inf in its
// log-sum-exp's), packed_zero_outside (T: x's type).
#define CUFLASH_ZERO_OUTSIDE_PARAMS(X, T)                                          \
    X(PTR, T, x)               /* the output, [total, H, D] contiguous */          \
    X(PTR, const int, offsets) /* its cu_seqlens (int32 [count + 1]) */            \
    X(PTR, float, lse)         /* the forward's [H, total] log-sum-exp, or null */ \
    /* Fixed by the plan: */                                                       \
    X(VAL, int, count) /* sequences */                                             \
    X(VAL, int, total) /* rows */                                                  \
    X(VAL, int, heads)                                                             \
    X(VAL, long long, row_elements)
struct ZeroOutsideParams {
    CUFLASH_ZERO_OUTSIDE_PARAMS(CUFLASH_MEMBER, void)
};

// The float16 pieces of a float32 operand: each head's largest |x|,
// float16_pieces_abs_max, then the pieces and their scales, float16_pieces_split
// (T: float).
#define CUFLASH_PIECES_ABS_MAX_PARAMS(X, T)                                  \
    X(PTR, const T, x)                                                       \
    X(PTR, unsigned, abs_max_bits) /* zeroed floats [B, H], as their bits */ \
    /* Fixed by the plan: */                                                 \
    X(STRIDES, Strides, x)                                                   \
    X(VAL, int, rows) /* the rows of each head read */
struct PiecesAbsMaxParams {
    CUFLASH_PIECES_ABS_MAX_PARAMS(CUFLASH_MEMBER, void)
};
#define CUFLASH_PIECES_SPLIT_PARAMS(X, T)                            \
    X(PTR, const T, x)                                               \
    X(PTR, const float, abs_max) /* float16_pieces_abs_max's */      \
    X(PTR, half_t, hi)           /* [B, H, seq_len, D] contiguous */ \
    X(PTR, half_t, lo)                                               \
    X(PTR, float, scale_out) /* [B, H] */                            \
    /* Fixed by the plan: */                                         \
    X(STRIDES, Strides, x)                                           \
    X(VAL, int, num_heads)                                           \
    X(VAL, int, seq_len)                                             \
    X(VAL, int, rows)
struct PiecesSplitParams {
    CUFLASH_PIECES_SPLIT_PARAMS(CUFLASH_MEMBER, void)
};

// The KV cache's split-KV decode kernels (kvcache_decode, kvcache_decode_tc and
// kvcache_decode_mla; Q: q's type, KV: the caches', OUT: out's, all one type but in
// kvcache_decode_tc's FP8 instantiations): the query rows over each sequence's cached
// keys, the splits' partial rows and lse (num_splits > 1) or out and lse.
#define CUFLASH_DECODE_PARAMS(X, Q, KV, OUT)                                    \
    X(PTR, const Q, q)                                                          \
    X(PTR, const KV, k_cache)                                                   \
    X(PTR, const KV, v_cache)                                                   \
    X(PTR, const int, seqlens)     /* cached lengths, int32 [B] (or null) */    \
    X(PTR, const int, block_table) /* a paged cache's, int32 [B, max_blocks] */ \
    X(PTR, OUT, out)                                                            \
    X(PTR, float, lse)                                                          \
    X(PTR, float, part_out) /* the splits' rows, float32 */                     \
    X(PTR, float, part_lse)                                                     \
    X(PTR, const float, alibi_slopes)                                           \
    X(PTR, const float, sinks)                                                  \
    /* An FP8 cache's descales as float32 [B, H_kv] arrays, or null (the FP8 */ \
    /* page): q's times k's multiply the scores, v's the output. */             \
    X(PTR, const float, qk_scales)                                              \
    X(PTR, const float, v_scales)                                               \
    X(VAL, int, seqlen_value) /* the lengths without seqlens: one for all */    \
    /* Fixed by the plan: */                                                    \
    X(VAL, const UserModifierArgs, user_args)                                   \
    X(STRIDES, Strides, q)                                                      \
    X(STRIDES, Strides, k)                                                      \
    X(STRIDES, Strides, v)                                                      \
    X(VAL, int, num_heads)                                                      \
    X(VAL, int, group)                                                          \
    X(VAL, int, q_len)                                                          \
    X(VAL, int, new_len)                                                        \
    X(VAL, int, capacity)                                                       \
    X(VAL, int, block_size)                                                     \
    X(VAL, int, max_blocks)                                                     \
    X(VAL, int, num_blocks)                                                     \
    X(VAL, int, win_left)                                                       \
    X(VAL, int, win_right)                                                      \
    X(VAL, int, num_splits)                                                     \
    X(VAL, int, row_tiles)                                                      \
    X(VAL, int, aligned) /* k_cache and v_cache take 16-byte copies */          \
    X(VAL, float, scale_log2)                                                   \
    X(VAL, int, alibi_batch_stride)                                             \
    X(VAL, float, softcap_log2)                                                 \
    X(VAL, float, out_scale) /* an FP8 cache's scalar v descale (1 otherwise) */
struct DecodeParams {
    CUFLASH_DECODE_PARAMS(CUFLASH_MEMBER, void, void, void)
};

// The KV cache's append, kvcache_append (T: the arrays' type): k_new and v_new into
// the cache, and the rotary embedding of them and of the query rows.
#define CUFLASH_KVCACHE_APPEND_PARAMS(X, T)                             \
    X(PTR, const T, k_new)                                              \
    X(PTR, const T, v_new)                                              \
    X(PTR, T, k_cache)                                                  \
    X(PTR, T, v_cache)                                                  \
    X(PTR, const int, seqlens)                                          \
    X(PTR, const int, block_table)                                      \
    X(PTR, int, key_counts) /* the lengths after the append, or null */ \
    X(PTR, const T, q)                                                  \
    X(PTR, T, q_rotated)                                                \
    X(PTR, const void, rotary_cos) /* of T (tables_in_t) or float */    \
    X(PTR, const void, rotary_sin)                                      \
    X(VAL, int, seqlen_value)                                           \
    /* Fixed by the plan: */                                            \
    X(STRIDES, Strides, kn)                                             \
    X(STRIDES, Strides, vn)                                             \
    X(STRIDES, Strides, k)                                              \
    X(STRIDES, Strides, v)                                              \
    X(STRIDES, Strides, q)                                              \
    X(VAL, int, new_len)                                                \
    X(VAL, int, head_dim)                                               \
    X(VAL, int, head_dim_v)                                             \
    X(VAL, int, capacity)                                               \
    X(VAL, int, block_size)                                             \
    X(VAL, int, max_blocks)                                             \
    X(VAL, int, num_blocks)                                             \
    X(VAL, int, q_len)                                                  \
    X(VAL, int, group)                                                  \
    X(VAL, int, rotary_dim)                                             \
    X(VAL, int, rotary_rows)                                            \
    X(VAL, int, interleaved)                                            \
    X(VAL, int, tables_in_t)
struct KvcacheAppendParams {
    CUFLASH_KVCACHE_APPEND_PARAMS(CUFLASH_MEMBER, void)
};

// The splits' merge, kvcache_combine (T: out's type).
#define CUFLASH_KVCACHE_COMBINE_PARAMS(X, T) \
    X(PTR, const float, part_out)            \
    X(PTR, const float, part_lse)            \
    X(PTR, T, out)                           \
    X(PTR, float, lse)                       \
    X(PTR, const float, sinks)               \
    /* Fixed by the plan: */                 \
    X(VAL, long long, rows)                  \
    X(VAL, int, num_splits)                  \
    X(VAL, int, num_heads)                   \
    X(VAL, int, q_len)
struct KvcacheCombineParams {
    CUFLASH_KVCACHE_COMBINE_PARAMS(CUFLASH_MEMBER, void)
};

// The FP8 forward's V^T (fp8_transpose_v): v's rows as the columns of vt, each 16
// keys permuted for P's registers (sm90/forward_wgmma_ws.cuh's FP8 roles).
#define CUFLASH_FP8_TRANSPOSE_V_PARAMS(X, T)                                    \
    X(PTR, const T, v) /* e4m3 [B, H_kv, kv_len, head_dim_v] */                 \
    X(PTR, T, vt)      /* [B, H_kv, rows, keys], contiguous */                  \
    /* Fixed by the plan: */                                                    \
    X(STRIDES, Strides, v)                                                      \
    X(VAL, int, kv_heads)                                                       \
    X(VAL, int, kv_len)                                                         \
    X(VAL, int, head_dim_v) /* a multiple of 16: v's rows in 16-byte pieces */  \
    X(VAL, int, rows)       /* vt's rows a head: head_dim_v rounded up to 16 */ \
    X(VAL, int, keys)       /* vt's columns: kv_len rounded up to 16, zeros past it */
struct Fp8TransposeVParams {
    CUFLASH_FP8_TRANSPOSE_V_PARAMS(CUFLASH_MEMBER, void)
};

// The float32 pieces kernels' names of their inputs: q's high and low float16 pieces
// qh and ql, ..., dout's doh and dol, and dout's scales do_scales.
#define CUFLASH_FORWARD_PIECES \
    const half_t* __restrict__ qh = q, * __restrict__ ql = q_lo, * __restrict__ kh = k, * __restrict__ kl = k_lo, * __restrict__ vh = v, * __restrict__ vl = v_lo
#define CUFLASH_BACKWARD_PIECES                                          \
    CUFLASH_FORWARD_PIECES;                                              \
    const half_t* __restrict__ doh = dout, * __restrict__ dol = dout_lo; \
    const float* __restrict__ do_scales = dout_scales

}  // namespace cuflash
