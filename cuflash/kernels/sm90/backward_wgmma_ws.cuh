// Warp-specialized Hopper (sm_90a) backward kernel (dK, dV and optionally the
// atomic dQ) for float16/bfloat16 calls without score modifiers or with a user's
// mask alone (MODIFIED: a module compiled mask-only), every head dim (the 64, 128
// and 256 classes; the 256 class below, WIDE).
//
// One block of three warpgroups per (key tile of BN = 128 keys, KV head,
// batch), looping over the query heads of the group and the query tiles of
// BM rows that see the key tile (BM = 64 in the 128 class; 128 in the 64 class,
// whose 64-row steps left S^T's products too narrow, N = 64, to keep the tensor
// cores fed from shared memory):
//   warpgroup 0, the producer, copies K and V of the tile once, then each
//     query tile's Q, dO, lse and Delta into a ring of STAGES shared-memory
//     stages (cp.async, the 128-byte swizzled layout that wgmma reads); a
//     stage's mbarrier completes when its copies land
//     (cp.async.mbarrier.arrive), and the producer waits only for a stage to
//     come back. Its copy loops are not unrolled: 40 registers a thread. With
//     use_tma one thread copies K, V, Q and dO by bulk tensor copies (boxes of
//     64 columns through the maps; the barriers also await their bytes) and
//     warp 0 lse and Delta by cp.async; the other producer warps exit. The
//     consumers then add dQ through dq_accum_map (below).
//   warpgroups 1 and 2, the consumers, own keys [64 c, 64 c + 64) of the
//     tile and all columns of their dK and dV (in registers, 232 or 224 a
//     thread: BackwardRegisters);
//     they wait on the barriers only, and each thread hands each stage back
//     once its products and its own loads of lse and Delta have read it.
// Per query tile, each consumer (M = 64 keys), as backward_wgmma:
//   S^T = K Q^T, dP^T = V dO^T      wgmma m64nBMk16, A and B K-major (smem)
//   P^T = exp2(S^T scale log2 e - lse log2 e), dS^T = P^T (dP^T - Delta) scale
//   dV += P^T dO, dK += dS^T Q       wgmma m64nDk16, A from the registers;
//                                    with ATOMIC_DQ dK's A is dS^T's shared
//                                    buffer (both A's in registers left too
//                                    few for the products in flight: ptxas
//                                    serialized every wgmma at D = 128, C7512)
//   dQ += dS K (ATOMIC_DQ)           dS^T to one of two shared buffers (the
//                                    consumers meet at named barrier 1 once
//                                    both halves are in), wgmma with A = dS
//                                    M-major, B = K N-major (each consumer 64
//                                    columns of 64 rows over all 128 keys: in
//                                    the 128 class its columns, in the 64
//                                    class its rows); the float32 tile
//                                    to shared memory, added into dq_accum by
//                                    the copy engine (use_tma: the dQ writer
//                                    warp adds the tile as DT / 32 swizzled
//                                    boxes through dq_accum_map, else each
//                                    warp's 16 rows a row of 256 bytes a lane;
//                                    no atomics in the consumers' stream; rows
//                                    of the class's width, the columns past D
//                                    padding, which the conversion skips).
// In the 128 class the split 40 / 232 is the only one that fits the block's
// registers without spills: the producer spills 12 bytes at 32 (and 36 at 24
// with 240 for the consumers); at 232 the consumers of the score modifiers
// spill (8-56 bytes), so those calls stay with backward_wgmma. A user's mask alone
// keeps the plain code: its roles narrow each key tile's query steps to the block
// mask's range and apply the mask on the tiles the block mask marks partial.
// Without ATOMIC_DQ (the deterministic backward, and dQ's own pass) the two
// consumers never wait for each other. The arguments are
// backward_wgmma's (the same launch).
// ORDERED_DQ (the deterministic backward of dense calls through the maps): the atomic
// dQ's additions, each (entry, head, query tile)'s in the blocks' launch order, key
// tiles descending (add_dq_tiles: a counter a query tile after dQ's float32 rows,
// zeroed by backward_delta), so that every run adds the same values in the same order.
// The 256 class (WIDE, D = 136-256, v's head dim DV <= D): dK and dV of 128 keys by D
// columns do not fit two warpgroups' registers, so a block owns BN = 64 keys and the
// consumers share the columns, as backward_wgmma's 256 class: consumer c computes S^T and
// dP^T for all 64 keys and query columns [32 c, 32 c + 32) (m64n32k16), writes its halves
// of P^T and dS^T to shared memory (one buffer of each), the two meet, and each takes
// its columns of dV, dK and dQ (WideColumns, wide_split) with A from there. dQ has no
// room of its own (K, V and two stages fill 208 KB): once both consumers' products are
// done (they meet again, which also frees P^T and dS^T for the next step) the step's
// float32 dQ tile goes into its own stage, Q's and dO's buffers (64 rows by 256 floats
// as eight swizzled boxes of 32 columns), and the dQ writer adds it through the map and
// hands the stage back to the producer (the ring's empty barrier takes its one arrival).
// The atomic dQ needs the maps (the host runs the dQ pass without them, and for the
// deterministic calls, where the pass measured faster than the ordered dQ).
#pragma once
#include "common/params.cuh"
#include "common/mbarrier.cuh"
#include "common/mma_softmax.cuh"
#include "common/wgmma.cuh"
#include "common/work_tiles.cuh"
#include "sm90/backward_wgmma_ws_parts.cuh"

namespace cuflash {

template <typename T, int D, int BM, int STAGES, bool ATOMIC_DQ, bool MODIFIED = false,
          bool PERSISTENT = false, bool ORDERED_DQ = false, int DV = D>
__global__ void __launch_bounds__(384, 1)
    backward_wgmma_ws(CUFLASH_PARAMETERS(CUFLASH_BACKWARD_PARAMS, T, T)) {
    using Op = TensorOp<T>;
    constexpr int DT = head_dim_class(D), DK = round_up(D, 16);
    constexpr bool WIDE = DT == 256;  // the 256 class (above)
    constexpr int BN = WIDE ? 64 : 128, QTILES = BM / 8, KSTEPS = DK / 16, DTILES = DK / 8;
    // v's (and dO's, dV's) head dim DV may be below D in the 256 class (MLA): V and dO fill
    // DVK columns of the same tiles.
    constexpr int DVK = round_up(DV, 16), DVSTEPS = DVK / 16;
    static_assert(DV % 8 == 0 && DV <= D && (WIDE || DV == D), "v's head dim");
    // Boxes of 64 columns the copy engine loads of K and Q, and of V and dO.
    constexpr int KBOXES = (DK + 63) / 64, VBOXES = (DVK + 63) / 64;
    constexpr unsigned ATOM = 1024;  // bytes of 8 swizzled rows: the stride between row groups
    static_assert((DT == 128 && BM == 64) || (DT == 64 && BM == 128) || (WIDE && BM == 64),
                  "tile shape");
    static_assert(!WIDE || STAGES == 2, "the 256 class's dQ tiles are its two stages");
    // The ordered dQ: dense calls through the maps, a block a tile, launched with key
    // tiles descending (the host launches it only with use_tma).
    static_assert(!ORDERED_DQ || (ATOMIC_DQ && !PERSISTENT), "the ordered dQ's instantiation");
    // MODIFIED: a user's mask alone (a module compiled mask-only), a block a tile; the
    // scores keep the plain code and the mask cuts the tiles the block mask names.
    static_assert(!MODIFIED || (Modifiers<MODIFIED>::mask_only && !PERSISTENT && !ORDERED_DQ),
                  "the modified roles: a user's mask alone, a block a tile");
    // The atomic dQ: consumer c adds 64 columns of 64 rows over all 128 keys (at D = 128
    // columns [64 c, + 64) of the BM = 64 rows; at D = 64 rows [64 c, + 64) of the
    // BM = 128, all columns), through a float32 tile of BM rows DQ_PITCH apart (8
    // floats of padding: the fragments' 8-byte stores of a half-warp meet 32 different
    // banks), or with the maps two tiles of swizzled boxes that the dQ writer adds
    // (DQ_FLOATS: the larger).
    constexpr bool DQ_SPLIT_QUERIES = BM == 128;
    constexpr int DQ_COLS = 64, DQ_KSTEPS = BN / 16, DQ_PITCH = DT + 8;
    constexpr int DQ_FLOATS = WIDE ? 0 : 2 * BM * DT > BM * DQ_PITCH ? 2 * BM * DT : BM * DQ_PITCH;
    // A stage's empty barrier takes an arrival from every consumer thread: each reads the
    // stage's lse and Delta with its own loads (racecheck found one thread a warpgroup
    // handing the stage back while other warps still read them). The 256 class's atomic
    // dQ: the writer's one, once its additions have read the stage.
    using Ring = StageRing<STAGES, WIDE && ATOMIC_DQ ? 1 : 256>;
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(dout);
    CUFLASH_STRIDES_OF(dkv);
    // 1024-byte aligned (the swizzled tiles' atoms): the 64 class's tiles fill the
    // block's 227 KB but for 112 bytes, no room to align them here, so its launch
    // counts on the declared alignment and stops where the array lacks it.
    extern __shared__ __align__(1024) float4 smem_ws[];
    if (DT == 64 && (smem_addr(smem_ws) & 1023) != 0) __trap();
    using Shared = BackwardWgmmaWsShared<T, D, BM, STAGES>;
    static_assert(Shared::DT == DT && Shared::BN == BN && Shared::DQ_FLOATS == DQ_FLOATS,
                  "the layout's tiles are the kernel's");
    T* base = shared_aligned<T>(smem_ws);
    T* Ks = CUFLASH_SHARED_REGION(T, base, Shared::k);
    T* Vs = CUFLASH_SHARED_REGION(T, base, Shared::v);
    T* Qs = CUFLASH_SHARED_REGION(T, base, Shared::q);               // STAGES buffers of BM x DT
    T* dOs = CUFLASH_SHARED_REGION(T, base, Shared::dout);           // STAGES buffers of BM x DT
    T* dSs = CUFLASH_SHARED_REGION(T, base, Shared::ds);             // two buffers of dS^T
    float* dq_s = CUFLASH_SHARED_REGION(float, base, Shared::dq);    // DQ_FLOATS (above)
    float* lse_s = CUFLASH_SHARED_REGION(float, base, Shared::lse);  // STAGES buffers of BM
    float* delta_s = CUFLASH_SHARED_REGION(float, base, Shared::delta);  // STAGES buffers of BM
    Ring* ring = CUFLASH_SHARED_REGION(Ring, base, Shared::ring);
    using Barrier = unsigned long long;
    Barrier* kv_full = CUFLASH_SHARED_REGION(Barrier, base, Shared::kv_full);
    // PERSISTENT: K and V read by every consumer
    Barrier* kv_empty = CUFLASH_SHARED_REGION(Barrier, base, Shared::kv_empty);
    // two: the dQ tiles, written by the consumers
    Barrier* dq_full = CUFLASH_SHARED_REGION(Barrier, base, Shared::dq_full);
    // two: read by the writer's additions
    Barrier* dq_empty = CUFLASH_SHARED_REGION(Barrier, base, Shared::dq_empty);
    // Each dQ tile's coordinates for the writer (four ints a tile): row, head, batch
    // entry; row -1 ends.
    int* dq_at = CUFLASH_SHARED_REGION(int, base, Shared::dq_at);

    // With use_tma (dense calls whose arrays the copy engine can address: cuflash/gpu/launch.py)
    // thread 0 copies the tiles through the maps (boxes of 64 columns; rows past the
    // arrays' and columns past D land as zeros) and warp 0 lse and Delta by cp.async: a
    // stage is full after the 32 lanes' cp.async arrivals and thread 0's expect_tx one.
    const bool tma = use_tma != 0;
    if (WIDE && ATOMIC_DQ && !tma) __trap();  // the 256 class adds dQ through the maps only
    if (threadIdx.x == 0) {
        ring->init(tma ? 33 : 128);
        mbarrier_init(kv_full, tma ? 1 : 128);
        mbarrier_init(kv_empty, 256);
        for (int buffer = 0; buffer < 2; ++buffer) {
            mbarrier_init(dq_full + buffer, 256);
            mbarrier_init(dq_empty + buffer, 1);
        }
    }
    __syncthreads();  // the barriers' initialization, seen by every thread

    // A work tile's keys and query steps, as the producer and the consumers both see them.
    struct Tile {
        int n0, hk;
        Sequence seq;
    };
    auto tile_of = [&](const WorkTile& w, Tile& tile) {
        tile.seq = sequence_of<false>(w.z, offsets_q, offsets_k, q_len, kv_len, kv_capacity,
                                      win_left, win_right);
        tile.n0 = w.tile * BN;
        tile.hk = w.h;
        return tile.n0 < tile.seq.key_rows;  // packed: past the sequence's keys
    };
    // Every work tile of the block that holds keys, in order: fn(tile, steps, uses, t),
    // with `uses` the stage ring's uses and `t` the tiles with query steps before it.
    // The producer, the dQ writer and the consumers walk the same tiles by it.
    auto for_each_tile = [&](auto&& fn) {
        WorkTile w;
        for (int round = 0, t = 0, uses = 0;
             work_tile<PERSISTENT, !ORDERED_DQ>(round, key_tiles, work_tiles, num_heads / group, w,
                                                reinterpret_cast<const int*>(schedule));
             ++round) {
            Tile tile;
            if (!tile_of(w, tile)) continue;
            QuerySteps<BM> steps(tile.seq.mask, tile.n0, tile.n0 + BN, tile.hk, group);
            if constexpr (MODIFIED)  // the block mask's range of query tiles for this key tile
                steps.narrow(score_modifiers<MODIFIED>(alibi_slopes, alibi_batch_stride, softcap,
                                                       tile.hk * group, tile.seq.mask, user_args),
                             tile.n0 / BN, tile.hk, group);
            fn(tile, steps, uses, t);
            if (steps.count == 0) continue;
            ++t;
            uses += steps.count;
        }
    };

    if (threadIdx.x < 128) {  // ---- the producer
        registers_down<BackwardRegisters<DT>::producer>();
        // The warp's index as a value ptxas knows is the same in every lane: split on
        // threadIdx.x it took the dQ writer for a divergent branch of the copy walks'
        // warp and spilled 120 bytes of the walks at the producer's 40 registers.
        const int producer_warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0);
        if (tma && producer_warp != 0) {
            if (ATOMIC_DQ && producer_warp == 1) {  // the dQ writer
                // ORDERED_DQ: the key tiles launched before this block's (those after it)
                // that add into query tile m0, by the walk's own test of their steps.
                auto preceding = [&](int m0) {
                    WorkTile w;
                    work_tile<false, false>(0, key_tiles, work_tiles, num_heads / group, w);
                    int count = 0;
                    for (int k = w.tile + 1 + threadIdx.x % 32; k < gridDim.x; k += 32) {
                        Tile other;
                        if (!tile_of(WorkTile{k, w.h, w.z}, other)) continue;
                        const QuerySteps<BM> steps(other.seq.mask, other.n0, other.n0 + BN,
                                                   other.hk, group);
                        count += steps.count > 0 && m0 >= steps.m_first &&
                                 m0 < steps.m_first + steps.per_head * BM;
                    }
#pragma unroll
                    for (int lanes = 16; lanes > 0; lanes >>= 1)
                        count += __shfl_xor_sync(0xffffffffu, count, lanes);
                    return count;
                };
                auto counter_of = [&](int m0, int h, int b) {
                    return ordered_dq_counter(dq_accum, gridDim.z, num_heads, q_len, DT, b, h, m0);
                };
                if constexpr (WIDE) {  // the stages: Q's four blocks, then dO's
                    auto box_of = [&](int stage, int box) {
                        const T* tile = (box < 4 ? Qs : dOs) + stage * BM * DT;
                        return reinterpret_cast<const float*>(tile) + (box & 3) * (BM * 32);
                    };
                    add_dq_tiles<(DK + 31) / 32, ORDERED_DQ>(&dq_accum_map, box_of, dq_at, dq_full,
                                                             ring->empty, preceding, counter_of);
                } else {
                    auto box_of = [&](int buffer, int box) {
                        return dq_s + buffer * (BM * DT) + box * (BM * 32);
                    };
                    add_dq_tiles<DT / 32, ORDERED_DQ>(&dq_accum_map, box_of, dq_at, dq_full,
                                                      dq_empty, preceding, counter_of);
                }
            }
            return;
        }
        // Each work tile with query steps: its K and V, then each step's stage. The copy
        // engine's loop and cp.async's are two walks (one loop holding both kept the
        // state of both: 24 bytes spilled at the producer's 40 registers).
        auto walk = [&](auto&& copy_tile) {
            for_each_tile([&](const Tile& tile, const QuerySteps<BM>& steps, int uses, int t) {
                if (steps.count == 0) return;
                if constexpr (PERSISTENT) mbarrier_wait(kv_empty, (t & 1) ^ 1);
                copy_tile(tile, steps, uses);
            });
        };
        if (tma) {
            walk([&](const Tile& tile, const QuerySteps<BM>& steps, int uses) {
                const Mask& mask = tile.seq.mask;
                const int n0 = tile.n0, hk = tile.hk, b = tile.seq.batch;
                constexpr unsigned KV_BYTES = (KBOXES + VBOXES) * BN * 64 * sizeof(T),
                                   STEP_BYTES = (KBOXES + VBOXES) * BM * 64 * sizeof(T);
                if (threadIdx.x == 0) {
                    mbarrier_arrive_expect_tx(kv_full, KV_BYTES);
                    for (int c = 0; c < KBOXES; ++c) {  // VBOXES <= KBOXES
                        tma_load_4d(Ks + c * BN * 64, &k_map, c * 64, n0, hk, b, kv_full);
                        if (c < VBOXES)
                            tma_load_4d(Vs + c * BN * 64, &v_map, c * 64, n0, hk, b, kv_full);
                    }
                }
                for (int step = 0; step < steps.count; ++step) {
                    const int use = uses + step, stage = Ring::stage(use);
                    const int h = steps.head(step), m0 = steps.row0(step);
                    const int rows = min(BM, mask.q_len - m0);
                    const long long head_rows =
                        (static_cast<long long>(b) * num_heads + h) * q_len + tile.seq.q_start;
                    ring->wait_empty(use);
                    load_row_stats<BM, 32>(lse_s + stage * BM, delta_s + stage * BM,
                                           lse + head_rows + m0, delta + head_rows + m0, rows);
                    if (threadIdx.x == 0) {
                        unsigned long long* full = ring->expect(use, STEP_BYTES);
                        for (int c = 0; c < KBOXES; ++c) {
                            tma_load_4d(Qs + stage * BM * DT + c * BM * 64, &q_map, c * 64, m0, h,
                                        b, full);
                            if (c < VBOXES)
                                tma_load_4d(dOs + stage * BM * DT + c * BM * 64, &dout_map, c * 64,
                                            m0, h, b, full);
                        }
                    }
                    ring->filled(use);  // the lanes' lse and Delta
                }
            });
        } else {
            walk([&](const Tile& tile, const QuerySteps<BM>& steps, int uses) {
                const Mask& mask = tile.seq.mask;
                const int n0 = tile.n0, hk = tile.hk, b = tile.seq.batch;
                const int q_start = tile.seq.q_start;
                const int keys = mask.kv_len - n0;
                const long long kv_rows = static_cast<long long>(tile.seq.kv_start) * k_st.s;
                cp_async_tile_sw128<BN, DK, 128, D, true>(
                    Ks, k + kv_rows + offset_of(k_st, b, hk, n0), k_st.s, keys);
                cp_async_tile_sw128<BN, DVK, 128, DV, true>(
                    Vs, v + tile.seq.kv_start * v_st.s + offset_of(v_st, b, hk, n0), v_st.s, keys);
                cp_async_arrive(kv_full);
                for (int step = 0; step < steps.count; ++step) {
                    const int use = uses + step, stage = Ring::stage(use);
                    const int h = steps.head(step), m0 = steps.row0(step),
                              rows = min(BM, mask.q_len - m0);
                    const long long head_rows =
                        (static_cast<long long>(b) * num_heads + h) * q_len + q_start;
                    ring->wait_empty(use);
                    load_row_stats<BM, 128>(lse_s + stage * BM, delta_s + stage * BM,
                                            lse + head_rows + m0, delta + head_rows + m0, rows);
                    cp_async_tile_sw128<BM, DK, 128, D, true>(
                        Qs + stage * BM * DT, q + q_start * q_st.s + offset_of(q_st, b, h, m0),
                        q_st.s, rows);
                    cp_async_tile_sw128<BM, DVK, 128, DV, true>(
                        dOs + stage * BM * DT,
                        dout + q_start * dout_st.s + offset_of(dout_st, b, h, m0), dout_st.s, rows);
                    ring->filled(use);
                }
            });
        }
        return;
    }

    // ---- the consumers
    registers_up<BackwardRegisters<DT>::consumer>();
    const int consumer = (threadIdx.x >> 7) - 1;
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int warp_row = warp * 16;
    int all_uses = 0;  // the ring's uses of every tile so far: the dQ tiles handed over
    if constexpr (WIDE) {
        // S^T and dP^T of all BN keys for query columns [q0, q0 + SN); P^T and dS^T
        // ([BN keys][BM queries], one buffer each) where the two dS^T buffers are.
        constexpr int SN = BM / 2, STILES = SN / 8;
        const int q0 = consumer * SN;
        T* const Ps = dSs;
        T* const dSw = dSs + BN * BM;
        // One work tile on this consumer's columns (a copy of the step a consumer; not a
        // lambda inside this one: GCC 12, which compiles the CPU simulator, fails there).
        auto wide_tile = [&](auto columns, const Tile& tile, const QuerySteps<BM>& steps, int uses,
                             int t_kv) {
            using Columns = decltype(columns);
            constexpr int DV_N = Columns::dv_count, DK_N = Columns::dk_count;
            constexpr int DQ_N = Columns::dq_count;
            {
                const Mask& mask = tile.seq.mask;
                const int n0 = tile.n0, hk = tile.hk, b = tile.seq.batch;
                float dk_acc[DK_N / 8][4], dv_acc[DV_N / 8][4];
#pragma unroll
                for (int d = 0; d < DK_N / 8; ++d)
#pragma unroll
                    for (int e = 0; e < 4; ++e) dk_acc[d][e] = 0.f;
#pragma unroll
                for (int d = 0; d < DV_N / 8; ++d)
#pragma unroll
                    for (int e = 0; e < 4; ++e) dv_acc[d][e] = 0.f;
                if (steps.count > 0) {
                    mbarrier_wait(kv_full, t_kv & 1);
                    fence_proxy_async();
                }
                for (int step = 0; step < steps.count; ++step) {
                    const int use = uses + step, stage = Ring::stage(use);
                    const int h = steps.head(step), m0 = steps.row0(step);
                    const int rows = min(BM, mask.q_len - m0);
                    const T* Qb = Qs + stage * BM * DT;
                    const T* dOb = dOs + stage * BM * DT;
                    ring->wait_full(use);
                    fence_proxy_async();

                    float st[STILES][4], dpt[STILES][4];
                    wgmma_fence();
#pragma unroll
                    for (int ks = 0; ks < KSTEPS; ++ks) {
                        const int kv_at = (ks >> 2) * (BN * 64) + (ks & 3) * 16;
                        const int q_at = (ks >> 2) * (BM * 64) + q0 * 64 + (ks & 3) * 16;
                        Wgmma<T, SN>::ss(st, wgmma_desc(Ks + kv_at, 16, ATOM),
                                         wgmma_desc(Qb + q_at, 16, ATOM), ks > 0);
                    }
                    wgmma_commit();
#pragma unroll
                    for (int ks = 0; ks < DVSTEPS; ++ks) {
                        const int kv_at = (ks >> 2) * (BN * 64) + (ks & 3) * 16;
                        const int q_at = (ks >> 2) * (BM * 64) + q0 * 64 + (ks & 3) * 16;
                        Wgmma<T, SN>::ss(dpt, wgmma_desc(Vs + kv_at, 16, ATOM),
                                         wgmma_desc(dOb + q_at, 16, ATOM), ks > 0);
                    }
                    wgmma_commit();
                    const auto mods = score_modifiers<MODIFIED>(alibi_slopes, alibi_batch_stride,
                                                                softcap, h, mask, user_args);
                    const bool partial = mods.partial_tile(n0 / BN, m0 / BM);
                    wgmma_wait<1>();  // S^T is done: P^T while dP^T runs
                    pin_registers(st);
                    const bool edge = !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN) || partial;
                    probs<STILES, 0, Modifiers<MODIFIED>, false>(
                        st, mask, edge, m0 + q0, n0 + warp_row + g, t, lse_s + stage * BM + q0,
                        scale_log2, mods, partial);
                    wgmma_wait<0>();
                    pin_registers(dpt);
                    dscores(st, dpt, t, delta_s + stage * BM + q0, scale);

                    // This consumer's query columns of P^T and dS^T: element (key, query)
                    // of [BN keys][BM queries] in the swizzled layout, chunk = query / 8.
#pragma unroll
                    for (int j = 0; j < STILES; ++j)
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const int key = warp_row + g + 8 * r, chunk = q0 / 8 + j;
                            const int at = key * 64 + ((chunk ^ (key & 7)) << 3) + 2 * t;
                            *reinterpret_cast<unsigned*>(Ps + at) =
                                Op::pack(st[j][2 * r], st[j][2 * r + 1]);
                            *reinterpret_cast<unsigned*>(dSw + at) =
                                Op::pack(dpt[j][2 * r], dpt[j][2 * r + 1]);
                        }
                    fence_proxy_async();
                    consumers_meet_divergent();  // both halves are in

                    // dQ = dS K, dV += P^T dO and dK += dS^T Q on this consumer's columns,
                    // A from shared memory.
                    float dq[DQ_N / 8][4];
                    wgmma_fence();
                    if constexpr (ATOMIC_DQ) {
#pragma unroll
                        for (int kk = 0; kk < BN / 16; ++kk)
                            Wgmma<T, DQ_N>::ss_mn(
                                dq, wgmma_desc(dSw + kk * 16 * 64, BN * 64 * sizeof(T), ATOM),
                                wgmma_desc(Ks + (Columns::dq_first / 64) * (BN * 64) + kk * 16 * 64,
                                           BN * 64 * sizeof(T), ATOM),
                                kk > 0);
                    }
                    constexpr unsigned B_STRIDE = BM * 64 * sizeof(T);  // 64-column blocks
                    const T* dO_cols = dOb + (Columns::dv_first / 64) * (BM * 64);
                    const T* Q_cols = Qb + (Columns::dk_first / 64) * (BM * 64);
#pragma unroll
                    for (int kk = 0; kk < BM / 16; ++kk)
                        Wgmma<T, DV_N>::ss_nb(dv_acc, wgmma_desc(Ps + kk * 16, 16, ATOM),
                                              wgmma_desc(dO_cols + kk * 16 * 64, B_STRIDE, ATOM),
                                              1);
#pragma unroll
                    for (int kk = 0; kk < BM / 16; ++kk)
                        Wgmma<T, DK_N>::ss_nb(dk_acc, wgmma_desc(dSw + kk * 16, 16, ATOM),
                                              wgmma_desc(Q_cols + kk * 16 * 64, B_STRIDE, ATOM), 1);
                    wgmma_commit();
                    wgmma_wait<0>();
                    pin_registers(dv_acc);
                    pin_registers(dk_acc);
                    if constexpr (!ATOMIC_DQ) ring->release(use, true);
                    // Both consumers' products are done: P^T, dS^T and the stage are free.
                    consumers_meet_divergent();
                    if constexpr (ATOMIC_DQ) {
                        pin_registers(dq);
                        // dQ into the stage as boxes of 32 columns by BM rows (box i: Q's
                        // block i, then dO's; the 128-byte swizzle: chunk c of row r at
                        // chunk c ^ (r % 8)), which the dQ writer adds.
                        float* const q_boxes = reinterpret_cast<float*>(Qs + stage * BM * DT);
                        float* const do_boxes = reinterpret_cast<float*>(dOs + stage * BM * DT);
#pragma unroll
                        for (int j = 0; j < DQ_N / 8; ++j) {
                            constexpr int FIRST_BOX = Columns::dq_first / 32;
                            const int box = FIRST_BOX + (j >> 2);
                            float* const boxes = box < 4 ? q_boxes : do_boxes;
#pragma unroll
                            for (int r = 0; r < 2; ++r) {
                                const int row = warp_row + g + 8 * r;
                                *reinterpret_cast<float2*>(
                                    boxes + (box & 3) * (BM * 32) + row * 32 +
                                    (((2 * (j & 3) + (t >> 1)) ^ (row & 7)) << 2) + 2 * (t & 1)) =
                                    make_float2(dq[j][2 * r], dq[j][2 * r + 1]);
                            }
                        }
                        fence_proxy_async();  // this thread's writes, read by the copy engine
                        if (threadIdx.x == 128) {
                            dq_at[4 * stage] = m0;
                            dq_at[4 * stage + 1] = h;
                            dq_at[4 * stage + 2] = b;
                        }
                        mbarrier_arrive(dq_full + stage);
                    }
                }
                if (PERSISTENT && steps.count > 0) mbarrier_arrive(kv_empty);
                all_uses = uses + steps.count;
                const long long tile_key =
                    tile.seq.kv_start * dkv_st.s + offset_of(dkv_st, b, hk, n0);
                store_fragment_rows<T, D, DK_N / 8>(dk + tile_key, dkv_st.s, warp_row,
                                                    tile.seq.key_rows - n0, Columns::dk_first,
                                                    dk_acc, 1.f);
                store_fragment_rows<T, DV, DV_N / 8>(dv + tile_key, dkv_st.s, warp_row,
                                                     tile.seq.key_rows - n0, Columns::dv_first,
                                                     dv_acc, 1.f);
            }
        };
        constexpr WidePlan plan = wide_split(DK, DVK);
        static_assert(!WIDE || plan.dv > 0, "no split of the columns between the consumers");
        constexpr int DQN = (DK + 31) / 32 * 32;
        using First = WideColumns<0, plan.dv, 0, plan.dk, 0, plan.dq>;
        using Second =
            WideColumns<plan.dv, DVK - plan.dv, plan.dk, DK - plan.dk, plan.dq, DQN - plan.dq>;
        // The consumer index made warp-uniform for ptxas (each copy holds wgmma).
        const bool first = __shfl_sync(0xffffffffu, consumer, 0) == 0;
        for_each_tile([&](const Tile& tile, const QuerySteps<BM>& steps, int uses, int t_kv) {
            if (first)
                wide_tile(First{}, tile, steps, uses, t_kv);
            else
                wide_tile(Second{}, tile, steps, uses, t_kv);
        });
    } else {
        const int wg_key0 = consumer * 64;       // the consumer's first key in the tile
        const int key_row = wg_key0 + warp_row;  // the warp's
        const int dq_col = DQ_SPLIT_QUERIES ? 0 : 64 * consumer;   // the consumer's dQ columns
        const int dq_row0 = DQ_SPLIT_QUERIES ? 64 * consumer : 0;  // and first dQ row of the tile

        for_each_tile([&](const Tile& tile, const QuerySteps<BM>& steps, int uses, int t_kv) {
            const Mask& mask = tile.seq.mask;
            const int n0 = tile.n0, hk = tile.hk, b = tile.seq.batch;
            float* const dq_seq = dq_accum + tile.seq.q_start * DT;  // rows of the class's width

            float dk_acc[DTILES][4], dv_acc[DTILES][4];
#pragma unroll
            for (int d = 0; d < DTILES; ++d)
#pragma unroll
                for (int e = 0; e < 4; ++e) dk_acc[d][e] = dv_acc[d][e] = 0.f;

            if (steps.count > 0) {
                mbarrier_wait(kv_full, t_kv & 1);
                fence_proxy_async();  // the producer's cp.async writes, read by wgmma (async proxy)
            }
            for (int step = 0; step < steps.count; ++step) {
                const int use = uses + step, stage = Ring::stage(use);
                const int h = steps.head(step), m0 = steps.row0(step),
                          rows = min(BM, mask.q_len - m0);
                const T* Qb = Qs + stage * BM * DT;
                const T* dOb = dOs + stage * BM * DT;
                const float* lse_b = lse_s + stage * BM;
                const float* delta_b = delta_s + stage * BM;
                // dS^T's buffers alternate by the ring's use, also across work tiles
                T* dSb = dSs + (use & 1) * BN * BM;
                ring->wait_full(use);
                fence_proxy_async();

                // S^T = K Q^T and dP^T = V dO^T for this consumer's 64 keys.
                float st[QTILES][4], dpt[QTILES][4];
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < KSTEPS; ++ks) {
                    const int kv_at = (ks >> 2) * (BN * 64) + wg_key0 * 64 + (ks & 3) * 16;
                    const int q_at = (ks >> 2) * (BM * 64) + (ks & 3) * 16;
                    Wgmma<T, BM>::ss(st, wgmma_desc(Ks + kv_at, 16, ATOM),
                                     wgmma_desc(Qb + q_at, 16, ATOM), ks > 0);
                }
                wgmma_commit();
#pragma unroll
                for (int ks = 0; ks < KSTEPS; ++ks) {
                    const int kv_at = (ks >> 2) * (BN * 64) + wg_key0 * 64 + (ks & 3) * 16;
                    const int q_at = (ks >> 2) * (BM * 64) + (ks & 3) * 16;
                    Wgmma<T, BM>::ss(dpt, wgmma_desc(Vs + kv_at, 16, ATOM),
                                     wgmma_desc(dOb + q_at, 16, ATOM), ks > 0);
                }
                wgmma_commit();
                // With a user's mask, the tiles the block mask marks partial take it too.
                const auto mods = score_modifiers<MODIFIED>(alibi_slopes, alibi_batch_stride,
                                                            softcap, h, mask, user_args);
                const bool partial = mods.partial_tile(n0 / BN, m0 / BM);
                wgmma_wait<1>();  // S^T is done: P^T while dP^T runs
                pin_registers(st);
                const int key_lo = n0 + wg_key0;
                const bool edge =
                    !mask.tile_all_visible(m0, m0 + rows, key_lo, key_lo + 64) || partial;
                probs<QTILES, 0, Modifiers<MODIFIED>, false>(st, mask, edge, m0, n0 + key_row + g,
                                                             t, lse_b, scale_log2, mods, partial);
                wgmma_wait<0>();
                pin_registers(dpt);
                dscores(st, dpt, t, delta_b, scale);  // dS^T scale: dQ and dK come out scaled

                // P^T and dS^T as A fragments (16 queries a step); with ATOMIC_DQ dS^T also to
                // shared memory: element (key, query) of [BN keys][BM queries] in the swizzled
                // layout (column blocks of 64 queries), chunk = query / 8.
                unsigned pa[BM / 16][4], sa[BM / 16][4];
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk) {
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int j = 2 * kk + half;
                        pa[kk][2 * half] = Op::pack(st[j][0], st[j][1]);
                        pa[kk][2 * half + 1] = Op::pack(st[j][2], st[j][3]);
                        sa[kk][2 * half] = Op::pack(dpt[j][0], dpt[j][1]);
                        sa[kk][2 * half + 1] = Op::pack(dpt[j][2], dpt[j][3]);
                        if (ATOMIC_DQ) {
#pragma unroll
                            for (int r = 0; r < 2; ++r) {
                                const int key = key_row + g + 8 * r;
                                *reinterpret_cast<unsigned*>(dSb + (j >> 3) * (BN * 64) + key * 64 +
                                                             (((j & 7) ^ (key & 7)) << 3) + 2 * t) =
                                    sa[kk][2 * half + r];
                            }
                        }
                    }
                }

                // dQ = dS K from dS^T in shared memory (both consumers' halves).
                float dq[DQ_COLS / 8][4];
                float* dq_rows =
                    dq_seq + ((static_cast<long long>(b) * num_heads + h) * q_len + m0) * DT;
                auto issue_dq = [&]() {
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < DQ_KSTEPS; ++kk)
                        Wgmma<T, DQ_COLS>::ss_mn(
                            dq,
                            wgmma_desc(dSb + (dq_row0 / 64) * (BN * 64) + kk * 16 * 64,
                                       BN * 64 * sizeof(T), ATOM),
                            wgmma_desc(Ks + (dq_col / 64) * (BN * 64) + kk * 16 * 64,
                                       BN * 64 * sizeof(T), ATOM),
                            kk > 0);
                    wgmma_commit();
                };
                auto add_dq = [&]() {  // once dQ's wgmma is done
                    pin_registers(dq);
                    // The tile is free once the last additions have read it: with the maps the
                    // writer grants it, else each warp waits for its own rows'.
                    const int buffer = use & 1;
                    if (tma) {
                        mbarrier_wait(dq_empty + buffer, ((use >> 1) & 1) ^ 1);  // step use - 2's
                    } else {
                        if (lane < 16) bulk_wait_read<0>();
                        __syncwarp();
                    }
                    // With the maps: four boxes of 32 columns by BM rows (8 KB each, the
                    // 128-byte swizzle: chunk c of row r at chunk c ^ (r % 8)), which the dQ
                    // writer adds; else rows DQ_PITCH apart, one bulk reduction a row.
                    float* const boxes = dq_s + buffer * (BM * DT) + (dq_col / 32) * (BM * 32);
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int row = g + 8 * r, tile_row = dq_row0 + warp_row + row;
                        float* dst = dq_s + tile_row * DQ_PITCH + dq_col + 2 * t;
#pragma unroll
                        for (int j = 0; j < DQ_COLS / 8; ++j) {
                            const float2 value = make_float2(dq[j][2 * r], dq[j][2 * r + 1]);
                            if (tma)
                                *reinterpret_cast<float2*>(
                                    boxes + (j >> 2) * (BM * 32) + tile_row * 32 +
                                    (((2 * (j & 3) + (t >> 1)) ^ (row & 7)) << 2) + 2 * (t & 1)) =
                                    value;
                            else
                                *reinterpret_cast<float2*>(dst + j * 8) = value;
                        }
                    }
                    fence_proxy_async();  // this thread's writes, then read by the copy engine
                    if (tma) {
                        if (threadIdx.x == 128) {
                            dq_at[4 * buffer] = m0;
                            dq_at[4 * buffer + 1] = h;
                            dq_at[4 * buffer + 2] = b;
                        }
                        mbarrier_arrive(dq_full + buffer);
                        return;
                    }
                    __syncwarp();
                    const int row = dq_row0 + warp_row + lane;  // lane < 16 adds row `row`
                    if (lane < 16) {
                        if (row < rows)
                            bulk_reduce_add_f32(dq_rows + static_cast<long long>(row) * DT + dq_col,
                                                dq_s + row * DQ_PITCH + dq_col,
                                                DQ_COLS * sizeof(float));
                        bulk_commit();
                    }
                };
                if (ATOMIC_DQ) {  // the other consumer's half of dS^T is read too
                    fence_proxy_async();
                    consumers_meet();
                }
                if (ATOMIC_DQ) issue_dq();

                // dV += P^T dO and dK += dS^T Q (16 queries a step): A from the registers, or
                // dK's from dS^T's buffer (ATOMIC_DQ).
                wgmma_fence();
                constexpr unsigned B_STRIDE = BM * 64 * sizeof(T);  // between 64-column blocks
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk)
                    Wgmma<T, DK>::rs(dv_acc, pa[kk], wgmma_desc(dOb + kk * 16 * 64, B_STRIDE, ATOM),
                                     1);
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk) {
                    const unsigned long long q_desc = wgmma_desc(Qb + kk * 16 * 64, B_STRIDE, ATOM);
                    if (ATOMIC_DQ)  // dS^T from its shared buffer (this consumer's 64 keys, K-major)
                        Wgmma<T, DK>::ss_nb(
                            dk_acc,
                            wgmma_desc(dSb + (kk >> 2) * (BN * 64) + wg_key0 * 64 + (kk & 3) * 16,
                                       16, ATOM),
                            q_desc, 1);
                    else
                        Wgmma<T, DK>::rs(dk_acc, sa[kk], q_desc, 1);
                }
                wgmma_commit();

                if (ATOMIC_DQ) {  // dQ is done (dV, dK may still run): add it
                    wgmma_wait<1>();
                    add_dq();
                }
                wgmma_wait<0>();
                pin_registers(dv_acc);
                pin_registers(dk_acc);
                ring->release(use, true);  // this thread's products and loads have read the stage
            }
            if (PERSISTENT && steps.count > 0)  // K and V read for the last time in this tile
                mbarrier_arrive(kv_empty);
            all_uses = uses + steps.count;

            const long long tile_key = tile.seq.kv_start * dkv_st.s + offset_of(dkv_st, b, hk, n0);
            store_fragment_rows<T, D, DTILES>(dk + tile_key, dkv_st.s, key_row,
                                              tile.seq.key_rows - n0, 0, dk_acc, 1.f);
            store_fragment_rows<T, D, DTILES>(dv + tile_key, dkv_st.s, key_row,
                                              tile.seq.key_rows - n0, 0, dv_acc, 1.f);
        });
    }
    if (ATOMIC_DQ && tma) {  // the writer's last tile: none
        const int buffer = all_uses & 1;
        // once the writer has read the coordinates of use all_uses - 2 (the 256 class's
        // are in its stage's: the ring's empty barrier)
        if constexpr (WIDE)
            ring->wait_empty(all_uses);
        else
            mbarrier_wait(dq_empty + buffer, ((all_uses >> 1) & 1) ^ 1);
        if (threadIdx.x == 128) dq_at[4 * buffer] = -1;
        mbarrier_arrive(dq_full + buffer);
    }
    if (ATOMIC_DQ && !tma && lane < 16) bulk_wait<0>();  // dQ's additions, before the exit
}

}  // namespace cuflash
