// The host-kernel contract of the attention kernels: one parameter struct per
// kernel kind, the kernel's one argument (a grid constant). The host lays out its
// records from these definitions (cuflash/kernel_params.py reads this file), and a
// test holds that layout against the C++ compiler's offsetof. The docs' API and
// semantics pages say what each option means.
//
// Each member is declared on a line of its own, of a type the host knows
// (pointers, int, float, long long, Strides, UserModifierArgs). The device
// addresses a call writes come first; the rest is fixed by a launch plan.
#pragma once
#include "common.cuh"

namespace cuflash {

// A TMA tensor map (CUDA's CUtensorMap): 128 opaque bytes the host encodes
// (cuflash/tensor_maps.py); the bulk tensor copies read it from the kernel's
// parameter space.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// The forward kernels: out = softmax(scale Q K^T + modifiers) V and its lse.
struct ForwardParams {
    // The arrays ([B, H, S, D] views; a packed call's [1, H, total, D]); null where
    // a call has none.
    const void* q;  // of T (the float32 pieces kernels: the high float16 pieces)
    const void* k;
    const void* v;
    const void* q_lo;  // the float32 pieces kernels' low float16 pieces, else null
    const void* k_lo;
    const void* v_lo;
    const float* q_scales;  // and their scales, float32 [B, H] each
    const float* k_scales;
    const float* v_scales;
    void* out;                  // of T (float32 for the pieces kernels), v's head dim
    float* lse;                 // float32 [B, H, S_q]
    const int* offsets_q;       // a packed call's cu_seqlens_q (int32 [B + 1]), null dense
    const int* offsets_k;       // and cu_seqlens_k
    const float* alibi_slopes;  // float32 [B, H] or [H], null without
    const float* sinks;         // float32 [H] (see add_sink), null without
    // Fixed by the plan:
    Strides q_st;  // element strides of the batch, head and row axes
    Strides k_st;
    Strides v_st;
    Strides out_st;
    int num_heads;
    int group;   // query heads a KV head
    int q_len;   // rows a head of the arrays (a packed call's: the total)
    int kv_len;  // see Sequence
    int win_left;
    int win_right;
    float scale_log2;  // the softmax scale times log2 e
    int alibi_batch_stride;
    float softcap;
    int use_tma;  // forward_wgmma_ws: q, k and v come by the maps below (0: cp.async)
    UserModifierArgs user_args;
    // q's, k's and v's maps (use_tma): dims (head dim, rows, heads, batch), boxes
    // of 64 columns by the kernel's query or key tile, the 128-byte swizzle.
    TensorMap q_map;
    TensorMap k_map;
    TensorMap v_map;
};

// The forward kernels' arguments as the locals their bodies read: q, k and v of T
// (CUFLASH_FORWARD_INPUTS), or the float32 pieces (CUFLASH_FORWARD_PIECES: qh, ql,
// ..., q_scales, ...); then out of OUT, lse, the strides, the mask and modifier
// scalars (CUFLASH_FORWARD_REST).
#define CUFLASH_FORWARD_INPUTS(T)                              \
    const T* __restrict__ q = static_cast<const T*>(params.q); \
    const T* __restrict__ k = static_cast<const T*>(params.k); \
    const T* __restrict__ v = static_cast<const T*>(params.v)
#define CUFLASH_FORWARD_PIECES                                               \
    const half_t* __restrict__ qh = static_cast<const half_t*>(params.q);    \
    const half_t* __restrict__ ql = static_cast<const half_t*>(params.q_lo); \
    const half_t* __restrict__ kh = static_cast<const half_t*>(params.k);    \
    const half_t* __restrict__ kl = static_cast<const half_t*>(params.k_lo); \
    const half_t* __restrict__ vh = static_cast<const half_t*>(params.v);    \
    const half_t* __restrict__ vl = static_cast<const half_t*>(params.v_lo); \
    const float* __restrict__ q_scales = params.q_scales;                    \
    const float* __restrict__ k_scales = params.k_scales;                    \
    const float* __restrict__ v_scales = params.v_scales
#define CUFLASH_FORWARD_REST(OUT)                                             \
    OUT* __restrict__ out = static_cast<OUT*>(params.out);                    \
    float* __restrict__ lse = params.lse;                                     \
    const int* __restrict__ offsets_q = params.offsets_q;                     \
    const int* __restrict__ offsets_k = params.offsets_k;                     \
    const float* __restrict__ alibi_slopes = params.alibi_slopes;             \
    const float* __restrict__ sinks = params.sinks;                           \
    const UserModifierArgs& user_args = params.user_args;                     \
    const Strides q_st = params.q_st, k_st = params.k_st, v_st = params.v_st; \
    const Strides out_st = params.out_st;                                     \
    const int num_heads = params.num_heads, group = params.group;             \
    const int q_len = params.q_len, kv_len = params.kv_len;                   \
    const int win_left = params.win_left, win_right = params.win_right;       \
    const float scale_log2 = params.scale_log2;                               \
    const int alibi_batch_stride = params.alibi_batch_stride;                 \
    const float softcap = params.softcap

}  // namespace cuflash
