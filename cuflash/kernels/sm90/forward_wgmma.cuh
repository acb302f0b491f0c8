// Hopper (sm_90a) forward kernel for float16/bfloat16 on wgmma, for calls
// without score modifiers up to head_dim 64 (two blocks an SM); the
// warp-specialized sm90/forward_wgmma_ws.cuh serves the others (both on the
// wgmma plumbing of common/wgmma.cuh).
//
// One block of WG warpgroups per (query tile of 64 WG rows, head, batch);
// warpgroup w owns rows [64 w, 64 w + 64), each of its warps 16 of them.
// Q and double-buffered K/V tiles of BN keys sit in shared memory in the
// canonical 128-byte-swizzled layout (column blocks of 64 elements, rows of
// 128 bytes), filled with cp.async. Per key tile:
//   S = Q K^T    wgmma m64nBNk16, A and B from shared memory (K-major)
//   online softmax on the S accumulators (common/mma_softmax.cuh: same layout)
//   O += P V     wgmma m64nDk16, A = P from registers, B = V (N-major)
// Only tiles that cross a mask boundary are masked element by element;
// query tiles are issued most expensive first.
#pragma once
#include "common/params.cuh"
#include "common/mma.cuh"
#include "common/mma_softmax.cuh"
#include "common/wgmma.cuh"

namespace cuflash {

// forward_wgmma's shared memory, from a 1024-byte aligned base: Q, then two buffers of K
// and of V, BN x DL each (DL: the head_dim's class).
template <typename T, int D, int BN, int WG>
struct ForwardWgmmaShared {
    static constexpr int DL = head_dim_class(D), BM = 64 * WG, E = static_cast<int>(sizeof(T));
    static constexpr int q = 0;
    static constexpr int k = q + BM * DL * E;
    static constexpr int v = k + 2 * BN * DL * E;
    static constexpr int bytes = kSharedAlignSlack + v + 2 * BN * DL * E;
};

template <typename T, int D, int BN, int WG>
constexpr int forward_wgmma_shared_bytes = ForwardWgmmaShared<T, D, BN, WG>::bytes;

// Up to D = 32, and up to D = 96 on 64-key tiles, two blocks an SM (128 registers):
// they hide each other's softmax where a key tile's products are short.
template <typename T, int D, int BN, int WG>
__global__ void __launch_bounds__(128 * WG, (D <= 32 || (D <= 96 && BN <= 64)) ? 2 : 1)
    forward_wgmma(CUFLASH_PARAMETERS(CUFLASH_FORWARD_PARAMS, T, T)) {
    using Op = TensorOp<T>;
    // The exact head_dim, in k16 steps (DK columns; the padding columns are zeros),
    // in shared memory tiles of the head_dim's class (DL columns, in blocks of 64).
    constexpr int DK = round_up(D, 16), DL = head_dim_class(D);
    constexpr int BM = 64 * WG, NT = 128 * WG, NTILES = BN / 8, DTILES = DK / 8, KSTEPS = DK / 16;
    constexpr unsigned ATOM = 1024;  // bytes of 8 swizzled rows: the stride between row groups
    static_assert(D % 8 == 0 && D <= 256 && BN % 64 == 0, "tile shape");
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(out);
    CUFLASH_FORWARD_SEQUENCE;
    extern __shared__ float4 smem4[];
    using Shared = ForwardWgmmaShared<T, D, BN, WG>;
    static_assert(Shared::DL == DL && Shared::BM == BM, "the layout's tiles are the kernel's");
    T* base = reinterpret_cast<T*>((reinterpret_cast<unsigned long long>(smem4) + 1023) & ~1023ull);
    T* Qs = CUFLASH_SHARED_REGION(T, base, Shared::q);
    T* Ks = CUFLASH_SHARED_REGION(T, base, Shared::k);  // two buffers of BN x DL
    T* Vs = CUFLASH_SHARED_REGION(T, base, Shared::v);  // two buffers of BN x DL

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const int wg = warp >> 2, warp_row = wg * 64 + (warp & 3) * 16;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // the longest rows first
    const int h = blockIdx.y, b = seq.batch, hk = h / group;
    const int rows = min(BM, mask.q_len - m0);
    if (rows <= 0) return;  // packed: past the sequence's rows
    q += seq.q_start * q_st.s;
    k += seq.kv_start * k_st.s;
    v += seq.kv_start * v_st.s;
    out += seq.q_start * out_st.s;
    lse += seq.q_start;
    const auto mods =
        score_modifiers<false>(alibi_slopes, alibi_batch_stride, softcap, h, mask, user_args);

    cp_async_tile_sw128<BM, DK, NT, D>(Qs, q + offset_of(q_st, b, h, m0), q_st.s, rows);
    int n_start, tiles;
    mask.key_tiles<BN>(m0, m0 + rows, n_start, tiles);
    mods.template narrow<BN>(m0 / BM, h, n_start, tiles);  // the block mask's range
    const T* k_head = k + offset_of(k_st, b, hk, 0);
    const T* v_head = v + offset_of(v_st, b, hk, 0);
    auto load_k = [&](int tile, int buf) {
        const int n0 = n_start + tile * BN, keys = mask.kv_len - n0;
        cp_async_tile_sw128<BN, DK, NT, D>(Ks + buf * BN * DL, k_head + n0 * k_st.s, k_st.s, keys);
    };
    auto load_v = [&](int tile, int buf) {
        const int n0 = n_start + tile * BN, keys = mask.kv_len - n0;
        cp_async_tile_sw128<BN, DK, NT, D>(Vs + buf * BN * DL, v_head + n0 * v_st.s, v_st.s, keys);
    };
    auto load_kv = [&](int tile, int buf) {
        load_k(tile, buf);
        load_v(tile, buf);
    };
    if (tiles > 0) load_kv(0, 0);
    cp_async_commit();

    float o[1][DTILES][4], row_max[1][2], row_sum[1][2];
    init_rows(o, row_max, row_sum);

    // S = Q K^T of key buffer `buf` for this warpgroup's 64 rows (D / 16 steps
    // of k16), committed as one group, not waited for.
    auto issue_scores = [&](int buf, float(&s)[1][NTILES][4]) {
        const T* Kb = Ks + buf * BN * DL;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            const T* qa = Qs + (ks >> 2) * (BM * 64) + wg * (64 * 64) + (ks & 3) * 16;
            const T* kb = Kb + (ks >> 2) * (BN * 64) + (ks & 3) * 16;
            Wgmma<T, BN>::ss(s[0], wgmma_desc(qa, 16, ATOM), wgmma_desc(kb, 16, ATOM), ks > 0);
        }
        wgmma_commit();
        pin_registers(s[0]);
    };
    // P from the S accumulators as the A fragments of P V, 16 keys per step.
    auto pack_probs = [&](const float(&s)[1][NTILES][4], unsigned(&pa)[BN / 16][4]) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            pa[kk][0] = Op::pack(s[0][2 * kk][0], s[0][2 * kk][1]);
            pa[kk][1] = Op::pack(s[0][2 * kk][2], s[0][2 * kk][3]);
            pa[kk][2] = Op::pack(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
            pa[kk][3] = Op::pack(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
        }
    };
    // O += P V of value buffer `buf`, committed as one group, not waited for.
    auto issue_pv = [&](int buf, const unsigned(&pa)[BN / 16][4]) {
        const T* Vb = Vs + buf * BN * DL;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            Wgmma<T, DK>::rs(o[0], pa[kk], wgmma_desc(Vb + kk * 16 * 64, BN * 64 * sizeof(T), ATOM),
                             1);
        wgmma_commit();
        pin_registers(o[0]);
    };
    // Whether tile `tile` is masked element by element (an edge), and whether by the
    // user's mask (partial in the block mask).
    auto edge_tile = [&](int tile, bool& partial) {
        const int n0 = n_start + tile * BN;
        partial = mods.partial_tile(m0 / BM, n0 / BN);
        return !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN) || partial;
    };

    for (int it = 0; it < tiles; ++it) {
        const int n0 = n_start + it * BN, buf = it & 1;
        if (it + 1 < tiles) load_kv(it + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        fence_proxy_async();
        __syncthreads();

        float s[1][NTILES][4];
        wgmma_fence();
        issue_scores(buf, s);
        wgmma_wait_all();
        pin_registers(s[0]);
        bool partial;
        const bool edge = edge_tile(it, partial);
        softmax_tile(s, o, row_max, row_sum, mask, edge, m0 + warp_row, n0, scale_log2, mods,
                     partial);

        unsigned pa[BN / 16][4];
        pack_probs(s, pa);
        pin_registers(o[0]);
        wgmma_fence();
        issue_pv(buf, pa);
        wgmma_wait_all();
        pin_registers(o[0]);
        __syncthreads();  // this buffer is refilled two iterations later
    }
    cp_async_wait<0>();  // Q's copy, when no key tile was read

    const long long row_base = (static_cast<long long>(b) * num_heads + h) * q_len + m0;
    finish_rows(
        o, row_max, row_sum, warp_row, rows, lse + row_base,
        [&](int row, int d, float x0, float x1) {
            if (d * 8 < D)  // the last n8 tile of a D = 16 j + 8 is padding
                reinterpret_cast<unsigned*>(out + offset_of(out_st, b, h, m0 + row))[d * 4 + t] =
                    Op::pack(x0, x1);
        },
        sinks, h);
}

}  // namespace cuflash
