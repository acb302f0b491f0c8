// Warp-specialized Hopper (sm_90a) forward kernel for float16/bfloat16.
//
// One block of 1 + CONSUMERS warpgroups per (query tile of BM = 64 CONSUMERS
// rows, head, batch): two consumers in the 128 and 256 classes, three in the 64
// class (cuflash/gpu/tile_traits.py; short products need more rows to hide a softmax):
//   warpgroup 0, the producer, copies Q once and each key tile's K and V
//     into rings of STAGES shared-memory stages (the 128-byte swizzled layout
//     that wgmma reads); each stage's mbarrier completes when the copies land,
//     so the producer never waits for them, only for a stage to come back. It
//     keeps 24 registers a thread. With use_tma (dense calls whose
//     arrays the copy engine can address: cuflash/gpu/launch.py) one thread issues
//     bulk tensor copies of 64-column boxes through the maps q_map, k_map and
//     v_map (rows past the array's, columns past the head dim land as zeros),
//     each stage's barrier awaiting their bytes; otherwise the 128 threads
//     copy with cp.async (cp.async.mbarrier.arrive; the loop not unrolled).
//   warpgroups 1 to CONSUMERS, the consumers, own 64 query rows each, wait on
//     the barriers only, and hand each stage back once their products have
//     read it; they take the producer's registers (WarpgroupRegisters).
// Each consumer overlaps within itself: S(j + 1) = Q K(j + 1)^T and
// O += P(j) V(j) are issued together and the softmax of S(j + 1) runs while
// P V does (as forward_wgmma's pipelined loop). The consumers also take
// turns on the tensor cores (ping-pong, round robin with three): named
// barriers 8 to 7 + CONSUMERS order their issues, so that one's products run
// while the others' softmax does.
// The arguments are forward_wgmma's (every path that launches that
// kernel launches this one).
// PERSISTENT (the plain roles of short calls: cuflash/gpu/registry.py): a block of
// each SM walks the launch's work tiles (query tile, head, entry) in rounds of
// gridDim.x, every other round in reverse (WorkTile), so that while its
// consumers finish one tile's rows the producer already loads the next tile's Q
// (once every consumer has issued its last S: the q_empty barrier) and K and V
// (the rings run on across tiles), and the consumers' turns go on round robin
// (common/work_tiles.cuh).
// DV, v's head dim (the output's), may be below D (MLA: D = 192, DV = 128): the
// V stages, P V and the O accumulators are DV wide, on the tiles of D (BN, STAGES);
// the launch's shared memory is D's, which holds the narrower V stages.
// FP8 roles (T = E4m3<OUT>: cuflash/gpu/fp8_plan.py): q and k e4m3 [B, H, S, D],
// v e4m3 and transposed by fp8_transpose_v ([B, H_kv, DV rounded up to 16, keys],
// each 16 keys permuted so that P's registers are the A operand as the S
// accumulators leave them), copied by the copy engine only; both products
// k32 steps with K-major operands, P in e4m3 (at most 2^kMaxSlack = 256, the lazy
// max), the scale times q_scales[b, h] (q's descale times k's) and out times
// v_scales[b, h], written as OUT. Dense calls, plain roles, block a tile.
#pragma once
#include "common/params.cuh"
#include "common/mbarrier.cuh"
#include "common/mma_softmax.cuh"
#include "common/wgmma.cuh"
#include "common/work_tiles.cuh"

namespace cuflash {

// What an instantiation reads and writes: T (16 bits) both, or for E4m3<OUT> e4m3
// inputs and an OUT output.
template <typename T>
struct ForwardElements {
    using in = T;
    using out = T;
    static constexpr bool fp8 = false;
};
template <typename OUT>
struct ForwardElements<E4m3<OUT>> {
    using in = e4m3_t;
    using out = OUT;
    static constexpr bool fp8 = true;
};

// forward_wgmma_ws's shared memory, from a 1024-byte aligned base: Q (BM rows of DL),
// STAGES stages of K (BN rows of DL) and of V (V_STAGE elements: BN rows of DVL, or
// FP8 V^T's DVK rows of BN keys), the K and V stage rings, Q's two barriers (full,
// empty) and the consumers' order slots (BM * 2 floats: complete_before_wait).
template <typename T, int D, int BN, int STAGES, int CONSUMERS, int DV = D>
struct ForwardWsShared {
    using E = ForwardElements<T>;
    using Ring = StageRing<STAGES, CONSUMERS>;
    static constexpr int EB = static_cast<int>(sizeof(typename E::in)), CHUNK = 128 / EB;
    static constexpr int DL = round_up(D, CHUNK);
    static constexpr int DVK = round_up(DV, 16), DVL = round_up(DV, 64), BM = 64 * CONSUMERS;
    static constexpr int V_STAGE = E::fp8 ? DVK * BN : BN * DVL;
    static constexpr int BARRIER = static_cast<int>(sizeof(unsigned long long));
    static constexpr int q = 0;
    static constexpr int k = q + BM * DL * EB;
    static constexpr int v = k + STAGES * BN * DL * EB;
    static constexpr int k_ring = v + STAGES * V_STAGE * EB;
    static constexpr int v_ring = k_ring + static_cast<int>(sizeof(Ring));
    static constexpr int q_full = v_ring + static_cast<int>(sizeof(Ring));
    static constexpr int q_empty = q_full + BARRIER;
    static constexpr int order_slots = q_empty + BARRIER;
    static constexpr int bytes =
        kSharedAlignSlack + order_slots + BM * 2 * static_cast<int>(sizeof(float));
};

template <typename T, int D, int BN, int STAGES, int CONSUMERS, bool MODIFIED,
          bool PERSISTENT = false, int DV = D>
constexpr int forward_wgmma_ws_shared_bytes =
    ForwardWsShared<T, D, BN, STAGES, CONSUMERS, DV>::bytes;

// setmaxnreg moves registers within the block's launch allocation only: 384
// threads capped at 168 registers (__launch_bounds__(384, 1)) hold 64512, 512
// threads at 128 hold 65536, and a consumer's setmaxnreg.inc past what the
// producer gave up waits forever.
// The producer's copy loops are not unrolled, so that it runs in 24 registers and
// two consumers get 240 (at 224 they spill with a user's score or mask function
// compiled in; at 232 bfloat16 D = 256 with modifiers spilled 44 bytes). A V
// narrower than Q and K (DV < D) copies tiles of two widths, which spills at 24
// (4 bytes at D = 96, DV = 40), and the persistent producer's walk over the work
// tiles spilled 8 bytes, and so did 176-key tiles' copies (4 bytes): there the
// split is 32 / 232. Three consumers (the 64 class: 64-column O) take 160 each,
// the producer 32.
template <bool NARROW_V, int CONSUMERS, bool PERSISTENT, int BN>
struct WarpgroupRegisters {
    static constexpr int threads = 128 * (CONSUMERS + 1);
    static constexpr bool wide_producer = NARROW_V || PERSISTENT || CONSUMERS == 3 || BN > 128;
    static constexpr int producer = wide_producer ? 32 : 24;
    static constexpr int consumer = CONSUMERS == 3 ? 160 : wide_producer ? 232 : 240;
    static_assert(CONSUMERS == 2 || CONSUMERS == 3, "two or three consumers");
    static_assert(128 * producer + 128 * CONSUMERS * consumer <=
                      threads * (65536 / threads / 8 * 8),
                  "the warpgroups' registers exceed the block's launch allocation");
};

// The consumers' turns on the tensor cores: consumer c waits at barrier 8 + c
// before it issues a tile's products and, once they are issued, lets the
// next one go (each barrier meets the 128 threads of two consumers).
__device__ __forceinline__ void wait_turn(int consumer) {
    asm volatile("bar.sync %0, 256;\n" ::"r"(8 + consumer) : "memory");
}
template <int CONSUMERS>
__device__ __forceinline__ void pass_turn(int consumer) {
    const int next = consumer + 1 == CONSUMERS ? 0 : consumer + 1;
    asm volatile("bar.arrive %0, 256;\n" ::"r"(8 + next) : "memory");
}

template <typename T, int D, int BN, int STAGES, int CONSUMERS, bool MODIFIED,
          bool PERSISTENT = false, int DV = D>
__global__ void __launch_bounds__(128 * (CONSUMERS + 1), 1)
    forward_wgmma_ws(CUFLASH_PARAMETERS(CUFLASH_FORWARD_PARAMS, typename ForwardElements<T>::in,
                                        typename ForwardElements<T>::out)) {
    using E = ForwardElements<T>;
    using In = typename E::in;
    using Op = TensorOp<typename E::out>;
    // A 128-byte swizzle row holds CHUNK elements, a wgmma k step 32 bytes of KSTEP.
    constexpr int EB = sizeof(In), CHUNK = 128 / EB, KSTEP = 32 / EB;
    // Rows of whole 128-byte swizzle rows (64-column boxes): D = 136-192 in 192 columns.
    constexpr int DK = round_up(D, KSTEP), DL = round_up(D, CHUNK);
    constexpr int DVK = round_up(DV, 16), DVL = round_up(DV, 64);  // V's, as DK and DL
    constexpr int BM = 64 * CONSUMERS, NTILES = BN / 8, DVTILES = DVK / 8, KSTEPS = DK / KSTEP;
    constexpr int PSTEPS = BN / KSTEP;  // k steps of P V
    // A V stage: BN rows of DVL (16 bits, N-major for P V), or V^T's DVK rows of BN keys
    // (FP8, K-major).
    constexpr int V_STAGE = E::fp8 ? DVK * BN : BN * DVL;
    constexpr unsigned ATOM = 1024;  // bytes of 8 swizzled rows: the stride between row groups
    static_assert(D % 8 == 0 && D <= 256 && BN % 16 == 0, "tile shape");
    static_assert(!E::fp8 || (BN % CHUNK == 0 && !MODIFIED && !PERSISTENT),
                  "FP8 roles: plain, block a tile, keys in whole 128-byte rows of V^T");
    static_assert(DV % 8 == 0 && DV <= D, "v's head dim: a multiple of 8, at most D");
    static_assert(!(PERSISTENT && MODIFIED), "score_modifiers read the entry from blockIdx.z");
    using Ring = StageRing<STAGES, CONSUMERS>;  // a consumer warpgroup an arrival
    using Registers = WarpgroupRegisters<(DV < D), CONSUMERS, PERSISTENT, BN>;
    CUFLASH_STRIDES_OF(q);
    CUFLASH_STRIDES_OF(k);
    CUFLASH_STRIDES_OF(v);
    CUFLASH_STRIDES_OF(out);
    extern __shared__ float4 smem4[];
    using Shared = ForwardWsShared<T, D, BN, STAGES, CONSUMERS, DV>;
    static_assert(Shared::DL == DL && Shared::BM == BM && Shared::V_STAGE == V_STAGE,
                  "the layout's tiles are the kernel's");
    In* base =
        reinterpret_cast<In*>((reinterpret_cast<unsigned long long>(smem4) + 1023) & ~1023ull);
    In* Qs = CUFLASH_SHARED_REGION(In, base, Shared::q);
    In* Ks = CUFLASH_SHARED_REGION(In, base, Shared::k);  // STAGES buffers of BN x DL
    In* Vs = CUFLASH_SHARED_REGION(In, base, Shared::v);  // STAGES buffers of V_STAGE
    Ring* k_ring = CUFLASH_SHARED_REGION(Ring, base, Shared::k_ring);
    Ring* v_ring = CUFLASH_SHARED_REGION(Ring, base, Shared::v_ring);
    using Barrier = unsigned long long;
    Barrier* q_full = CUFLASH_SHARED_REGION(Barrier, base, Shared::q_full);
    // PERSISTENT: Q read by every consumer
    Barrier* q_empty = CUFLASH_SHARED_REGION(Barrier, base, Shared::q_empty);
    // BM * 2: complete_before_wait
    float* order_slots = CUFLASH_SHARED_REGION(float, base, Shared::order_slots);

    const bool tma = use_tma != 0;
    if constexpr (E::fp8) {
        if (!tma) __trap();  // FP8 launches have their maps (cuflash/gpu/fp8_plan.py)
    }
    if (threadIdx.x == 0) {
        const unsigned producers = tma ? 1 : 128;  // one thread issues the bulk copies
        k_ring->init(producers);
        v_ring->init(producers);
        mbarrier_init(q_full, producers);
        mbarrier_init(q_empty, CONSUMERS);
    }
    __syncthreads();  // the barriers' initialization, seen by every thread

    // A work tile's rows and key tiles, as the producer and the consumers both see them
    // (its sequence's from the device-held offsets, clamped: Sequence).
    struct Tile {
        int m0, h, b, rows, n_start, tiles;
        Sequence seq;
    };
    auto tile_of = [&](const WorkTile& w, Tile& tile) {
        tile.seq = sequence_of<true>(w.z, offsets_q, offsets_k, q_len, kv_len, kv_len, win_left,
                                     win_right);
        tile.m0 = w.tile * BM;
        tile.h = w.h;
        tile.b = tile.seq.batch;
        tile.rows = min(BM, tile.seq.mask.q_len - tile.m0);
        if (tile.rows <= 0) return false;  // packed: past the sequence's rows
        tile.seq.mask.template key_tiles<BN>(tile.m0, tile.m0 + tile.rows, tile.n_start,
                                             tile.tiles);
        return true;
    };

    if (threadIdx.x < 128) {  // ---- the producer
        registers_down<Registers::producer>();
        if (tma && threadIdx.x != 0) return;  // one thread issues the bulk copies
        WorkTile w;
        for (int round = 0, t = 0, uses = 0;
             work_tile<PERSISTENT, false>(round, query_tiles, work_tiles, num_heads, w); ++round) {
            Tile tile;
            if (!tile_of(w, tile)) continue;
            const Mask& mask = tile.seq.mask;
            const int m0 = tile.m0, h = tile.h, b = tile.b, hk = h / group;
            const auto mods = score_modifiers<MODIFIED>(alibi_slopes, alibi_batch_stride, softcap,
                                                        h, mask, user_args);
            mods.template narrow<BN>(m0 / BM, h, tile.n_start, tile.tiles);
            const int n_start = tile.n_start, tiles = tile.tiles;
            if constexpr (PERSISTENT) mbarrier_wait(q_empty, (t & 1) ^ 1);
            if (tma) {  // the copy engine: boxes of 64 columns (dense calls only)
                constexpr unsigned Q_BYTES = BM * DL * EB, K_BYTES = BN * DL * EB;
                constexpr unsigned V_BYTES = V_STAGE * EB;
                mbarrier_arrive_expect_tx(q_full, Q_BYTES);
                for (int c = 0; c < DL / CHUNK; ++c)
                    tma_load_4d(Qs + c * BM * CHUNK, &q_map, c * CHUNK, m0, h, b, q_full);
                for (int j = 0; j < tiles; ++j) {
                    const int n0 = n_start + j * BN, use = uses + j, st = Ring::stage(use);
                    k_ring->wait_empty(use);
                    unsigned long long* k_full = k_ring->expect(use, K_BYTES);
                    for (int c = 0; c < DL / CHUNK; ++c)
                        tma_load_4d(Ks + (st * DL + c * CHUNK) * BN, &k_map, c * CHUNK, n0, hk, b,
                                    k_full);
                    v_ring->wait_empty(use);
                    unsigned long long* v_full = v_ring->expect(use, V_BYTES);
                    if constexpr (E::fp8) {  // V^T: boxes of 128 keys by DVK rows
                        for (int c = 0; c < BN / CHUNK; ++c)
                            tma_load_4d(Vs + st * V_STAGE + c * DVK * CHUNK, &v_map, n0 + c * CHUNK,
                                        0, hk, b, v_full);
                    } else {
                        for (int c = 0; c < DVL / CHUNK; ++c)
                            tma_load_4d(Vs + (st * DVL + c * CHUNK) * BN, &v_map, c * CHUNK, n0, hk,
                                        b, v_full);
                    }
                }
            } else if constexpr (!E::fp8) {
                const Sequence& seq = tile.seq;
                const In* k_head = k + seq.kv_start * k_st.s + offset_of(k_st, b, hk, 0);
                const In* v_head = v + seq.kv_start * v_st.s + offset_of(v_st, b, hk, 0);
                cp_async_tile_sw128<BM, DK, 128, D, true, DL>(
                    Qs, q + seq.q_start * q_st.s + offset_of(q_st, b, h, m0), q_st.s, tile.rows);
                cp_async_arrive(q_full);
                // Every stage refilled as soon as every consumer has handed it back; the
                // producer never waits for its own copies.
                for (int j = 0; j < tiles; ++j) {
                    const int n0 = n_start + j * BN, keys = mask.kv_len - n0, use = uses + j;
                    k_ring->wait_empty(use);
                    cp_async_tile_sw128<BN, DK, 128, D, true, DL>(
                        Ks + Ring::stage(use) * BN * DL, k_head + n0 * k_st.s, k_st.s, keys);
                    k_ring->filled(use);
                    v_ring->wait_empty(use);
                    cp_async_tile_sw128<BN, DVK, 128, DV, true, DVL>(
                        Vs + Ring::stage(use) * BN * DVL, v_head + n0 * v_st.s, v_st.s, keys);
                    v_ring->filled(use);
                }
            }
            ++t;
            uses += tiles;
        }
        return;
    }

    // ---- the consumers
    registers_up<Registers::consumer>();
    const int consumer = (threadIdx.x >> 7) - 1, thread = threadIdx.x - 128;
    const int warp = (threadIdx.x >> 5) & 3, t = threadIdx.x & 3;
    const int warp_row = consumer * 64 + warp * 16;
    const bool signalling = (threadIdx.x & 127) == 0;  // hands the stages back

    float o[1][DVTILES][4], row_max[1][2], row_sum[1][2];

    // The operands' descriptors: each k16 step's and stage's a constant past these
    // (wgmma_desc_plus: one add, not a descriptor built anew for each product).
    const unsigned long long q_desc = wgmma_desc(Qs + consumer * (64 * CHUNK), 16, ATOM);
    const unsigned long long k_desc = wgmma_desc(Ks, 16, ATOM);
    const unsigned long long v_desc = wgmma_desc(Vs, E::fp8 ? 16 : BN * 128, ATOM);
    // S = Q K^T of key stage `stage` for this consumer's 64 rows, committed, not waited for.
    auto issue_scores = [&](int stage, float(&s)[1][NTILES][4]) {
        const unsigned long long kb = wgmma_desc_plus(k_desc, stage * BN * DL * EB);
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {  // four 32-byte steps a 128-byte row
            const unsigned qa = (ks >> 2) * (BM * 128) + (ks & 3) * 32;
            const unsigned ka = (ks >> 2) * (BN * 128) + (ks & 3) * 32;
            Wgmma<In, BN>::ss(s[0], wgmma_desc_plus(q_desc, qa), wgmma_desc_plus(kb, ka), ks > 0);
        }
        wgmma_commit();
        pin_registers(s[0]);
    };
    // P as the A operand of P V. FP8: a k32 step's registers hold this thread's columns
    // 2t, 2t + 1, 8 + 2t, 9 + 2t of each 16 keys (rows g, g + 8), which fp8_transpose_v's
    // permutation of V^T's keys makes the operand's k = 4t .. 4t + 3.
    auto pack_probs = [&](const float(&s)[1][NTILES][4], unsigned(&pa)[PSTEPS][4]) {
#pragma unroll
        for (int kk = 0; kk < PSTEPS; ++kk) {
            if constexpr (E::fp8) {
                const float(&a)[4] = s[0][4 * kk], (&b)[4] = s[0][4 * kk + 1];
                const float(&c)[4] = s[0][4 * kk + 2], (&d)[4] = s[0][4 * kk + 3];
                pa[kk][0] = pack_e4m3x4(a[0], a[1], b[0], b[1]);
                pa[kk][1] = pack_e4m3x4(a[2], a[3], b[2], b[3]);
                pa[kk][2] = pack_e4m3x4(c[0], c[1], d[0], d[1]);
                pa[kk][3] = pack_e4m3x4(c[2], c[3], d[2], d[3]);
            } else {
                pa[kk][0] = Op::pack(s[0][2 * kk][0], s[0][2 * kk][1]);
                pa[kk][1] = Op::pack(s[0][2 * kk][2], s[0][2 * kk][3]);
                pa[kk][2] = Op::pack(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
                pa[kk][3] = Op::pack(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
            }
        }
    };
    // O += P V of value stage `stage`, committed, not waited for.
    auto issue_pv = [&](int stage, const unsigned(&pa)[PSTEPS][4]) {
        const unsigned long long vb = wgmma_desc_plus(v_desc, stage * V_STAGE * EB);
#pragma unroll
        for (int kk = 0; kk < PSTEPS; ++kk) {  // 16 key rows of V, or 32 keys of V^T's rows
            const unsigned va = E::fp8 ? (kk >> 2) * (DVK * 128) + (kk & 3) * 32 : kk * 16 * 128;
            Wgmma<In, DVK>::rs(o[0], pa[kk], wgmma_desc_plus(vb, va), 1);
        }
        wgmma_commit();
        pin_registers(o[0]);
    };
    // PERSISTENT: this consumer has read Q for the last time in this tile (its last S done).
    auto release_q = [&]() {
        if constexpr (PERSISTENT) {
            if (signalling) mbarrier_arrive(q_empty);
        }
    };

    if (consumer == CONSUMERS - 1) pass_turn<CONSUMERS>(consumer);  // consumer 0 issues first
    WorkTile w;
    for (int round = 0, q_phase = 0, uses = 0;
         work_tile<PERSISTENT, false>(round, query_tiles, work_tiles, num_heads, w); ++round) {
        Tile tile;
        if (!tile_of(w, tile)) continue;
        const Mask& mask = tile.seq.mask;
        const int m0 = tile.m0, h = tile.h, b = tile.b, rows = tile.rows;
        const auto mods = score_modifiers<MODIFIED>(alibi_slopes, alibi_batch_stride, softcap, h,
                                                    mask, user_args);
        // FP8: the scores' descale (q's times k's) and the output's (v's) of (b, h).
        float head_scale_log2 = scale_log2, out_scale = 1.f;
        if constexpr (E::fp8) {
            const long long head = static_cast<long long>(b) * num_heads + h;
            head_scale_log2 *= q_scales[head];
            out_scale = v_scales[head];
        }
        mods.template narrow<BN>(m0 / BM, h, tile.n_start, tile.tiles);  // the block mask's range
        const int n_start = tile.n_start, tiles = tile.tiles;
        auto edge_tile = [&](int j, bool& partial) {
            const int n0 = n_start + j * BN;
            partial = mods.partial_tile(m0 / BM, n0 / BN);
            return !mask.tile_all_visible(m0, m0 + rows, n0, n0 + BN) || partial;
        };

        init_rows(o, row_max, row_sum);
        mbarrier_wait(q_full, q_phase);
        q_phase ^= 1;
        // The producer's cp.async writes, read by wgmma (the async proxy); the copy
        // engine's are the async proxy's already.
        if (!tma) fence_proxy_async();
        float s[1][NTILES][4];
        unsigned pa[PSTEPS][4];
        const float bound = scores_bound<Op::wide_exponent>(mods);
        if (tiles == 0) release_q();
        if (tiles > 0) {
            k_ring->wait_full(uses);
            if (!tma) fence_proxy_async();
            wait_turn(consumer);
            wgmma_fence();
            issue_scores(Ring::stage(uses), s);
            pass_turn<CONSUMERS>(consumer);
            wgmma_wait_all();
            pin_registers(s[0]);
            if (tiles == 1) release_q();
            k_ring->release(uses, signalling);
            bool partial;
            const bool edge = edge_tile(0, partial);
            softmax_tile(s, o, row_max, row_sum, mask, edge, m0 + warp_row, n_start,
                         head_scale_log2, mods, partial);
            pack_probs(s, pa);
        }
        // Every tile but the last: S(j + 1) and P V(j) in flight together.
        for (int j = 0; j + 1 < tiles; ++j) {
            const int use = uses + j;
            bool partial;
            const bool edge = edge_tile(j + 1, partial);
            k_ring->wait_full(use + 1);
            v_ring->wait_full(use);
            if (!tma) fence_proxy_async();
            wait_turn(consumer);
            pin_registers(o[0]);
            wgmma_fence();
            issue_scores(Ring::stage(use + 1), s);
            issue_pv(Ring::stage(use), pa);
            pass_turn<CONSUMERS>(consumer);
            wgmma_wait<1>();  // S(j + 1) is done; P V(j) may still run
            pin_registers(s[0]);
            if (j + 2 == tiles) release_q();
            k_ring->release(use + 1, signalling);
            const float score_scale =
                mask_scores(s, 0, mask, edge, m0 + warp_row, n_start + (j + 1) * BN,
                            head_scale_log2, mods, partial);
            float alpha[2];
            exp_rows<1, NTILES, 0, true>(s, row_max, row_sum, 0, score_scale, bound, alpha);
            complete_before_wait(order_slots + thread, row_sum[0][0] + row_sum[0][1]);
            wgmma_wait_all();
            pin_registers(o[0]);
            v_ring->release(use, signalling);
            if (alpha[0] != 1.f) rescale_row(o, 0, 0, alpha[0]);  // mostly 1 (exp_rows)
            if (alpha[1] != 1.f) rescale_row(o, 0, 1, alpha[1]);
            pack_probs(s, pa);
        }
        if (tiles > 0) {  // P V of the last tile
            const int use = uses + tiles - 1;
            v_ring->wait_full(use);
            if (!tma) fence_proxy_async();
            wait_turn(consumer);
            pin_registers(o[0]);
            wgmma_fence();
            issue_pv(Ring::stage(use), pa);
            pass_turn<CONSUMERS>(consumer);
            wgmma_wait_all();
            pin_registers(o[0]);
            v_ring->release(use, signalling);
        }
        uses += tiles;

        const long long row_base = (static_cast<long long>(b) * num_heads + h) * q_len + m0;
        auto* const out_rows = out + tile.seq.q_start * out_st.s;
        finish_rows(
            o, row_max, row_sum, warp_row, rows, lse + tile.seq.q_start + row_base,
            [&](int row, int d, float x0, float x1) {
                if constexpr (E::fp8) {
                    x0 *= out_scale;
                    x1 *= out_scale;
                }
                if (d * 8 < DV)  // the last n8 tile of a DV = 16 j + 8 is padding
                    reinterpret_cast<unsigned*>(
                        out_rows + offset_of(out_st, b, h, m0 + row))[d * 4 + t] = Op::pack(x0, x1);
            },
            sinks, h);
    }
    if (consumer == 0) wait_turn(consumer);  // the last consumer's last pass
}

}  // namespace cuflash
