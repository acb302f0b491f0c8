// Tensor-core forward kernel for float16/bfloat16 (sm_80 and newer).
//
// One block of BM / (16 MT) warps per (query tile of BM rows, head, batch);
// each warp owns MT m16 tiles (16 MT query rows), so every K and V fragment
// read from shared memory feeds MT mma instructions. Q is loaded once with
// cp.async; its A fragments stay in registers when Q_REGS, else they are
// re-read from shared memory per tile (registers go to O). K/V tiles of BN
// keys are double-buffered in swizzled shared memory with cp.async so the
// next tile loads while this one is computed. S = Q K^T and O += P V run on
// mma.sync m16n8k16 with float32 accumulators; the online softmax runs in
// registers in base 2, and P goes from the S accumulators straight into the
// A fragments of P V. Only tiles that cross a mask boundary are masked
// element by element; query tiles are issued most expensive first.
#pragma once
#include "common/params.cuh"
#include "common/mma.cuh"
#include "common/mma_softmax.cuh"

namespace cuflash {

// forward_mma_sync's shared memory: Q, then two buffers of K and of V, BN x DT each.
template <typename T, int D, int BM, int BN>
struct ForwardMmaSyncShared {
    static constexpr int DT = head_dim_class(D), E = static_cast<int>(sizeof(T));
    static constexpr int q = 0;
    static constexpr int k = q + BM * DT * E;
    static constexpr int v = k + 2 * BN * DT * E;
    static constexpr int bytes = v + 2 * BN * DT * E;
};

template <typename T, int D, int BM, int BN, int MT, bool Q_REGS, bool MODIFIED>
constexpr int forward_mma_sync_shared_bytes = ForwardMmaSyncShared<T, D, BM, BN>::bytes;

template <typename T, int D, int BM, int BN, int MT, bool Q_REGS, bool MODIFIED>
__global__ void __launch_bounds__(BM * 2 / MT, 1)
    forward_mma_sync(CUFLASH_PARAMETERS(CUFLASH_FORWARD_PARAMS, T, T)) {
    using Op = TensorOp<T>;
    // Tiles DT = 64, 128 or 256 columns wide (the head_dim's class); products
    // over the head_dim on its exact width DK (padding columns zeros).
    constexpr int DT = head_dim_class(D), DK = round_up(D, 16);
    constexpr int WM = 16 * MT, NT = BM / WM * 32;
    constexpr int KSTEPS = DK / 16, NTILES = BN / 8, DTILES = DK / 8, QF = Q_REGS ? KSTEPS : 1;
    static_assert(BM % WM == 0 && BN % 16 == 0 && D % 8 == 0 && D <= 256, "tile shape");
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(out);
    CUFLASH_SEQUENCE_OF(kv_len);
    extern __shared__ float4 smem4[];
    using Shared = ForwardMmaSyncShared<T, D, BM, BN>;
    static_assert(Shared::DT == DT, "the layout's tiles are the kernel's");
    T* base = reinterpret_cast<T*>(smem4);
    T* Qs = CUFLASH_SHARED_REGION(T, base, Shared::q);
    T* Ks = CUFLASH_SHARED_REGION(T, base, Shared::k);  // two buffers of BN x DT
    T* Vs = CUFLASH_SHARED_REGION(T, base, Shared::v);  // two buffers of BN x DT

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
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
        score_modifiers<MODIFIED>(alibi_slopes, alibi_batch_stride, softcap, h, mask, user_args);

    cp_async_tile<BM, DT, NT, D>(Qs, q + offset_of(q_st, b, h, m0), q_st.s, rows);
    int n_start, tiles;
    mask.key_tiles<BN>(m0, m0 + rows, n_start, tiles);
    mods.template narrow<BN>(m0 / BM, h, n_start, tiles);  // the block mask's range
    const T* k_head = k + offset_of(k_st, b, hk, 0);
    const T* v_head = v + offset_of(v_st, b, hk, 0);
    auto load_kv = [&](int tile, int buf) {
        load_kv_tiles<BN, DT, NT, D>(Ks, Vs, buf, k_head, k_st.s, v_head, v_st.s,
                                     n_start + tile * BN, mask.kv_len);
    };
    if (tiles > 0) load_kv(0, 0);
    cp_async_commit();

    float o[MT][DTILES][4], row_max[MT][2], row_sum[MT][2];
    init_rows(o, row_max, row_sum);

    // A fragment of Q for (m tile, k step): rows of the warp, columns 16 ks.
    auto load_q_fragment = [&](unsigned(&f)[4], int mt, int ks) {
        const int row = warp * WM + mt * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
        ldmatrix_x4(f, Qs + swizzled<DT>(row, 2 * ks + (lane >> 4)));
    };
    cp_async_wait<0>();
    __syncthreads();
    unsigned qf[MT][QF][4];
    if (Q_REGS) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int ks = 0; ks < QF; ++ks) load_q_fragment(qf[mt][ks], mt, ks);
    }

    for (int it = 0; it < tiles; ++it) {
        const int n0 = n_start + it * BN, buf = it & 1;
        if (it + 1 < tiles) load_kv(it + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const T* Kb = Ks + buf * BN * DT;
        const T* Vb = Vs + buf * BN * DT;

        float s[MT][NTILES][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NTILES; ++n)
                s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll(Q_REGS ? KSTEPS : 2)  // bounds register pressure
        for (int ks = 0; ks < KSTEPS; ++ks) {
            unsigned a_smem[MT][4];
            if (!Q_REGS) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) load_q_fragment(a_smem[mt], mt, ks);
            }
#pragma unroll
            for (int n = 0; n < NTILES; n += 2) {
                unsigned kb[4];
                ldmatrix_x4(kb, Kb + swizzled<DT>(n * 8 + (lane & 7) + 8 * (lane >> 4),
                                                  2 * ks + ((lane >> 3) & 1)));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const unsigned(&a)[4] = Q_REGS ? qf[mt][ks % QF] : a_smem[mt];
                    Op::mma(s[mt][n], a, kb[0], kb[1]);
                    Op::mma(s[mt][n + 1], a, kb[2], kb[3]);
                }
            }
        }

        const bool partial = mods.partial_tile(m0 / BM, n0 / BN);
        const bool edge = !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN) || partial;
        // One copy of the modified element code: four exceed the register cap of
        // the D = 64 class's three blocks an SM.
        softmax_tile<MT, NTILES, DTILES, Modifiers<MODIFIED>, false>(
            s, o, row_max, row_sum, mask, edge, m0 + warp * WM, n0, scale_log2, mods, partial);

#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                pa[mt][0] = Op::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][1] = Op::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][2] = Op::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][3] = Op::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int d = 0; d < DTILES; d += 2) {
                unsigned vb[4];
                ldmatrix_x4_trans(vb,
                                  Vb + swizzled<DT>(kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1),
                                                    d + (lane >> 4)));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Op::mma(o[mt][d], pa[mt], vb[0], vb[1]);
                    Op::mma(o[mt][d + 1], pa[mt], vb[2], vb[3]);
                }
            }
        }
        __syncthreads();  // this buffer is refilled two iterations later
    }

    const long long row_base = (static_cast<long long>(b) * num_heads + h) * q_len + m0;
    finish_rows(
        o, row_max, row_sum, warp * WM, rows, lse + row_base,
        [&](int row, int d, float x0, float x1) {
            if (d * 8 < D)  // the last n8 tile of a D = 16 j + 8 is padding
                reinterpret_cast<unsigned*>(out + offset_of(out_st, b, h, m0 + row))[d * 4 + t] =
                    Op::pack(x0, x1);
        },
        sinks, h, !MODIFIED);
}

}  // namespace cuflash
