// Tensor-core backward kernel (dK, dV and optionally the atomic dQ) for
// float16/bfloat16 that splits head_dim across warps, so that D = 256 fits
// in registers (sm80/backward_mma_sync.cuh keeps all D columns of 16 keys in one warp, which
// stops at D = 128).
//
// One block of 8 warps per (key tile of BN = 64 keys, KV head, batch),
// looping over the query heads of the group and the query tiles of BM rows
// that see the key tile; Q, dO, lse and Delta of the next query tile load
// (cp.async, double-buffered) while this one is computed. Per query tile:
//   1. S^T = K Q^T, dP^T = V dO^T: warp w takes keys 16 (w % 4) and a
//      share of the BM queries; P^T and dS^T = P^T (dP^T - Delta) go to
//      shared memory as 16-bit.
//   2. dV += P^T dO, dK += dS^T Q: warp w takes keys 16 (w % 4) and a
//      share of the D columns, kept in registers for the whole block.
//   3. (ATOMIC_DQ) dQ += dS K scale: warp w takes m16 query tile w % (BM/16)
//      and a share of the tile's columns; float32 atomics into dq_accum, whose
//      rows are the tile's width (the head_dim's class: the padding columns
//      take the padding's products, and the conversion to dQ drops them).
// Only tiles that cross a mask boundary are masked element by element.
#pragma once
#include "common/params.cuh"
#include "common/mma.cuh"

namespace cuflash {

// backward_mma_sync_split_d's shared memory: K and V, two buffers of Q and of dO (tiles
// DT columns wide), P^T and dS^T ([BN keys][BM queries]), then two buffers of lse and of
// Delta.
template <typename T, int D, int BM, int BN>
struct BackwardMmaSyncSplitDShared {
    static constexpr int DT = head_dim_class(D), E = static_cast<int>(sizeof(T));
    static constexpr int k = 0;
    static constexpr int v = k + BN * DT * E;
    static constexpr int q = v + BN * DT * E;
    static constexpr int dout = q + 2 * BM * DT * E;
    static constexpr int p = dout + 2 * BM * DT * E;
    static constexpr int ds = p + BN * BM * E;
    static constexpr int lse = ds + BN * BM * E;
    static constexpr int delta = lse + 2 * BM * static_cast<int>(sizeof(float));
    static constexpr int bytes = delta + 2 * BM * static_cast<int>(sizeof(float));
};

template <typename T, int D, int BM, int BN, bool ATOMIC_DQ>
constexpr int backward_mma_sync_split_d_shared_bytes =
    BackwardMmaSyncSplitDShared<T, D, BM, BN>::bytes;

template <typename T, int D, int BM, int BN, bool ATOMIC_DQ>
__global__ void __launch_bounds__(256, 1)
    backward_mma_sync_split_d(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_PARAMS, T, T)) {
    using Op = TensorOp<T>;
    // Tiles DT = 64, 128 or 256 columns wide (the head_dim's class); products
    // over the head_dim on its exact width DK (padding columns zeros).
    constexpr int DT = head_dim_class(D), DK = round_up(D, 16);
    constexpr int NT = 256, NW = 8, KSTEPS = DK / 16;
    constexpr int KT = BN / 16;              // key m16 tiles; warp w has key tile w % KT
    constexpr int SPLIT = NW / KT;           // warps sharing a key tile
    constexpr int QN = BM / 8 / SPLIT;       // phase 1: query n8 tiles per warp
    constexpr int DN = DT / 8 / SPLIT;       // phase 2: d n8 tiles per warp
    constexpr int QM = BM / 16;              // phase 3: query m16 tiles
    constexpr int DQN = DT / 8 / (NW / QM);  // phase 3: d n8 tiles per warp
    static_assert(NW % KT == 0 && NW % QM == 0 && QN % 2 == 0 && DN % 2 == 0 && DQN % 2 == 0 &&
                      D % 8 == 0 && (BM == 32 || BM == 64),
                  "tile shape");
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(dkv);
    CUFLASH_SEQUENCE_OF(kv_capacity);
    extern __shared__ float4 smem4[];
    using Shared = BackwardMmaSyncSplitDShared<T, D, BM, BN>;
    static_assert(Shared::DT == DT, "the layout's tiles are the kernel's");
    T* base = reinterpret_cast<T*>(smem4);
    T* Ks = CUFLASH_SHARED_REGION(T, base, Shared::k);
    T* Vs = CUFLASH_SHARED_REGION(T, base, Shared::v);
    T* Qs = CUFLASH_SHARED_REGION(T, base, Shared::q);               // two buffers of BM x DT
    T* dOs = CUFLASH_SHARED_REGION(T, base, Shared::dout);           // two buffers of BM x DT
    T* Ps = CUFLASH_SHARED_REGION(T, base, Shared::p);               // P^T, [BN keys][BM queries]
    T* dSs = CUFLASH_SHARED_REGION(T, base, Shared::ds);             // dS^T, [BN keys][BM queries]
    float* lse_s = CUFLASH_SHARED_REGION(float, base, Shared::lse);  // two buffers of BM
    float* delta_s = CUFLASH_SHARED_REGION(float, base, Shared::delta);  // two buffers of BM

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * BN, hk = blockIdx.y, b = seq.batch;
    if (n0 >= seq.key_rows) return;  // packed: past the sequence's keys
    // The sequence's first rows enter each address where it is formed (pointers
    // moved once here would each hold two registers through the loop).
    const int kw = warp % KT, share = warp / KT;
    // ldmatrix row/chunk of this lane for an A fragment and for a B pair.
    const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_chunk = lane >> 4;
    const int b_row = (lane & 7) + 8 * (lane >> 4), b_chunk = (lane >> 3) & 1;

    float dk_acc[DN][4], dv_acc[DN][4];
#pragma unroll
    for (int d = 0; d < DN; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[d][e] = dv_acc[d][e] = 0.f;

    // The (query head, query tile) pairs that see this key tile, in order.
    int m_lo, m_hi;
    mask.query_range(n0, n0 + BN, m_lo, m_hi);
    const int m_first = m_lo - m_lo % BM;
    const int per_head = m_lo < m_hi ? (m_hi - m_first + BM - 1) / BM : 0;
    const int steps = per_head * group;
    auto load_query_tile = [&](int step, int buf) {
        const int h = hk * group + step / per_head, m0 = m_first + (step % per_head) * BM;
        const int rows = min(BM, mask.q_len - m0);
        const long long head_rows =
            (static_cast<long long>(b) * num_heads + h) * q_len + seq.q_start;
        const int row0 = seq.q_start + m0;
        cp_async_tile<BM, DT, NT, D>(Qs + buf * BM * DT, q + offset_of(q_st, b, h, row0), q_st.s,
                                     rows);
        cp_async_tile<BM, DT, NT, D>(dOs + buf * BM * DT, dout + offset_of(dout_st, b, h, row0),
                                     dout_st.s, rows);
        load_row_stats<BM, NT>(lse_s + buf * BM, delta_s + buf * BM, lse + head_rows + m0,
                               delta + head_rows + m0, rows);
    };
    if (steps > 0) {
        const int keys = mask.kv_len - n0;
        const int key0 = seq.kv_start + n0;
        cp_async_tile<BN, DT, NT, D>(Ks, k + offset_of(k_st, b, hk, key0), k_st.s, keys);
        cp_async_tile<BN, DT, NT, D>(Vs, v + offset_of(v_st, b, hk, key0), v_st.s, keys);
        load_query_tile(0, 0);
    }
    cp_async_commit();

    for (int step = 0; step < steps; ++step) {
        const int buf = step & 1;
        if (step + 1 < steps) load_query_tile(step + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const int h = hk * group + step / per_head, m0 = m_first + (step % per_head) * BM;
        const int rows = min(BM, mask.q_len - m0);
        const long long head_rows =
            (static_cast<long long>(b) * num_heads + h) * q_len + seq.q_start;
        const T* Qb = Qs + buf * BM * DT;
        const T* dOb = dOs + buf * BM * DT;
        const float* lse_b = lse_s + buf * BM;
        const float* delta_b = delta_s + buf * BM;

        // 1. S^T and dP^T for keys of tile kw and queries [QN 8 share, +QN 8).
        {
            float st[QN][4], dpt[QN][4];
#pragma unroll
            for (int n = 0; n < QN; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
#pragma unroll 4
            for (int ks = 0; ks < KSTEPS; ++ks) {
                unsigned ka[4], va[4];
                ldmatrix_x4(ka, Ks + swizzled<DT>(kw * 16 + a_row, 2 * ks + a_chunk));
                ldmatrix_x4(va, Vs + swizzled<DT>(kw * 16 + a_row, 2 * ks + a_chunk));
#pragma unroll
                for (int n = 0; n < QN; n += 2) {
                    const int qrow = (share * QN + n) * 8 + b_row;
                    unsigned qb[4], ob[4];
                    ldmatrix_x4(qb, Qb + swizzled<DT>(qrow, 2 * ks + b_chunk));
                    ldmatrix_x4(ob, dOb + swizzled<DT>(qrow, 2 * ks + b_chunk));
                    Op::mma(st[n], ka, qb[0], qb[1]);
                    Op::mma(st[n + 1], ka, qb[2], qb[3]);
                    Op::mma(dpt[n], va, ob[0], ob[1]);
                    Op::mma(dpt[n + 1], va, ob[2], ob[3]);
                }
            }
            const bool edge = !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN);
            const int key0 = n0 + kw * 16 + g;
#pragma unroll
            for (int n = 0; n < QN; ++n) {
                const int chunk = share * QN + n;  // query n8 tile in the block
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = chunk * 8 + 2 * t + (e & 1);
                    const bool keep = !edge || mask.visible(m0 + col, key0 + 8 * (e >> 1));
                    const float p = keep ? exp2f(st[n][e] * scale_log2 - lse_b[col]) : 0.f;
                    st[n][e] = p;
                    dpt[n][e] = p * (dpt[n][e] - delta_b[col]);
                }
                T* p_lo = Ps + swizzled<BM>(kw * 16 + g, chunk) + 2 * t;
                T* p_hi = Ps + swizzled<BM>(kw * 16 + g + 8, chunk) + 2 * t;
                T* s_lo = dSs + swizzled<BM>(kw * 16 + g, chunk) + 2 * t;
                T* s_hi = dSs + swizzled<BM>(kw * 16 + g + 8, chunk) + 2 * t;
                *reinterpret_cast<unsigned*>(p_lo) = Op::pack(st[n][0], st[n][1]);
                *reinterpret_cast<unsigned*>(p_hi) = Op::pack(st[n][2], st[n][3]);
                *reinterpret_cast<unsigned*>(s_lo) = Op::pack(dpt[n][0], dpt[n][1]);
                *reinterpret_cast<unsigned*>(s_hi) = Op::pack(dpt[n][2], dpt[n][3]);
            }
        }
        __syncthreads();

        // 2. dV += P^T dO and dK += dS^T Q for keys of tile kw, d tiles [DN share, +DN).
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            unsigned pa[4], sa[4];
            ldmatrix_x4(pa, Ps + swizzled<BM>(kw * 16 + a_row, 2 * kk + a_chunk));
            ldmatrix_x4(sa, dSs + swizzled<BM>(kw * 16 + a_row, 2 * kk + a_chunk));
#pragma unroll
            for (int d = 0; d < DN; d += 2) {
                const int dchunk = share * DN + d;
                unsigned ob[4], qb[4];
                ldmatrix_x4_trans(ob, dOb + swizzled<DT>(kk * 16 + a_row, dchunk + a_chunk));
                ldmatrix_x4_trans(qb, Qb + swizzled<DT>(kk * 16 + a_row, dchunk + a_chunk));
                Op::mma(dv_acc[d], pa, ob[0], ob[1]);
                Op::mma(dv_acc[d + 1], pa, ob[2], ob[3]);
                Op::mma(dk_acc[d], sa, qb[0], qb[1]);
                Op::mma(dk_acc[d + 1], sa, qb[2], qb[3]);
            }
        }

        // 3. dQ[m16 tile warp % QM, d tiles [DQN (warp / QM), +DQN)] += scale * dS K.
        if (ATOMIC_DQ)
            atomic_dq_tile<T, DT, BM, BN, DQN>(dSs, Ks, dq_accum + (head_rows + m0) * DT, warp % QM,
                                               (warp / QM) * DQN, rows, scale);
        __syncthreads();  // P^T, dS^T and this query buffer are rewritten next
    }

    const long long tile_key = offset_of(dkv_st, b, hk, seq.kv_start + n0);
    store_dkdv<T, D, DN>(dk + tile_key, dv + tile_key, dkv_st.s, kw * 16, seq.key_rows - n0,
                         share * DN * 8, dk_acc, dv_acc, scale);
}

}  // namespace cuflash
