// backward_wgmma_ws's parts outside the kernel (sm90/backward_wgmma_ws.cuh has the
// design): the warpgroups' register split, the consumers' meetings, the dQ writer's
// additions, the shared-memory layout and the 256 class's split of the columns.
#pragma once
#include "common/params.cuh"
#include "common/mbarrier.cuh"
#include "common/wgmma.cuh"

namespace cuflash {

// setmaxnreg within the block's launch allocation (384 threads at 168 registers):
// see sm90/forward_wgmma_ws.cuh. The 64 class's producer copies 128-row tiles of Q and
// dO: at 40 its persistent walks spilled 16-24 bytes, at 48 none, and its consumers
// (64 columns of dK and dV) fit 224.
template <int DT>
struct BackwardRegisters {
    static constexpr int producer = DT == 64 ? 48 : 40, consumer = DT == 64 ? 224 : 232;
    static_assert(128 * producer + 256 * consumer <= 384 * 168,
                  "the warpgroups' registers exceed the block's launch allocation");
};

// The two consumers (256 threads) meet: both halves of dS^T are in shared memory.
__device__ __forceinline__ void consumers_meet() {
    asm volatile("bar.sync %0, 256;\n" ::"r"(1) : "memory");
}
// The same where the consumers run their own copies of the step (the 256 class): the
// barrier without .aligned, which bar.sync is (synccheck: divergent threads).
__device__ __forceinline__ void consumers_meet_divergent() {
    asm volatile("barrier.sync %0, 256;\n" ::"r"(1) : "memory");
}
// The dQ writer warp (producer warp 1 with the maps): each step's dQ tile (two buffers
// of BM x DT floats, step s in buffer s % 2, each with its barriers and coordinates), once
// the consumers have filled it and its coordinates (row, head, batch entry; row -1: no
// more tiles), added into dq_accum by the copy engine as DT / 32 boxes of 32 columns by
// BM rows (rows past S_q skipped); the buffer is granted back once the additions have
// read it, so that the consumers wait for the writer only a step behind them.
// The hand-over both ways is by mbarriers: full takes every consumer thread's arrival
// (each wrote part of the tile; racecheck holds a named barrier's bar.arrive to order
// nothing), empty the writer's one, which each consumer thread waits for on its own (a
// barrier all consumers waited at made every warp wait for the slowest: 8 % of the
// stall samples at D = 128).
// ORDERED (the deterministic backward): the additions into each (entry, head, query
// tile) come in the blocks' launch order. Before its additions the writer waits until
// the tile's counter (counter_of(m0, h, b)) has counted the preceding(m0) key tiles
// launched before this block's that add into it (every lane takes part in the count);
// once they have completed, it raises the counter.
// The tiles are BOXES boxes of 32 columns (box_of(buffer, box): the box's floats).
template <int BOXES, bool ORDERED, typename BoxOf, typename Preceding, typename CounterOf>
__device__ __forceinline__ void add_dq_tiles(const TensorMap* map, BoxOf&& box_of, const int* at,
                                             unsigned long long* full, unsigned long long* empty,
                                             Preceding&& preceding, CounterOf&& counter_of) {
    for (int i = 0;; ++i) {
        const int buffer = i & 1;
        mbarrier_wait(full + buffer, (i >> 1) & 1);
        const int* const at_i = at + 4 * buffer;
        // Lane 0 alone reads the coordinates: its arrival on empty hands them back too
        // (racecheck: an arrival orders only the arriving thread's own reads).
        int m0 = 0, h = 0, b = 0;
        if (threadIdx.x % 32 == 0) m0 = at_i[0], h = at_i[1], b = at_i[2];
        const int row = __shfl_sync(0xffffffffu, m0, 0);
        if (row < 0) break;
        int count = 0;
        if constexpr (ORDERED) count = preceding(row);
        if (threadIdx.x % 32 == 0) {
            int* const counter = ORDERED ? counter_of(m0, h, b) : nullptr;
            // More than the count: a key tile after this one's added first (a miscount
            // that would break the order): stop rather than differ from run to run.
            if constexpr (ORDERED)
                if (wait_counter_at_least(counter, count) != count) __trap();
#pragma unroll
            for (int box = 0; box < BOXES; ++box)
                bulk_tensor_reduce_add_4d(map, 32 * box, m0, h, b, box_of(buffer, box));
            bulk_commit();
            bulk_wait_read<0>();
            mbarrier_arrive(empty + buffer);
            if constexpr (ORDERED) {
                bulk_wait<0>();  // the additions done in global memory, then the next may go
                increment_counter(counter);
            }
        }
        __syncwarp();
    }
    if (threadIdx.x % 32 == 0) bulk_wait<0>();  // the additions, before the block exits
}

// backward_wgmma_ws's shared memory, from a 1024-byte aligned base: K and V (BN x DT),
// STAGES buffers of Q and of dO (BM x DT), two of dS^T ([BN keys][BM queries]), the
// float32 dQ tiles (DQ_FLOATS: one of rows DT + 8 floats apart, or two for the dQ
// writer, whichever is larger), STAGES buffers of lse and of Delta, the stage ring, K
// and V's two barriers (full, empty), each dQ tile's two (full, empty) and its
// coordinates for the writer (four ints a tile). The 128 and 256 classes round the base
// up (kSharedAlignSlack); the 64 class's tiles fill the block's 227 KB but for 112 bytes,
// so its launch counts on the array's declared alignment (the kernel traps without it).
// The 256 class (WIDE): 64 keys, P^T and dS^T in the place of the two dS^T buffers, and
// no dQ tiles (the stages take them).
template <typename T, int D, int BM, int STAGES>
struct BackwardWgmmaWsShared {
    using Ring = StageRing<STAGES, 256>;
    static constexpr int DT = head_dim_class(D), E = static_cast<int>(sizeof(T));
    static constexpr bool WIDE = DT == 256;
    static constexpr int BN = WIDE ? 64 : 128;
    static constexpr int DQ_PITCH = DT + 8;
    static constexpr int DQ_TILE = BM * DQ_PITCH, DQ_WRITER = 2 * BM * DT;
    static constexpr int DQ_FLOATS = WIDE ? 0 : DQ_WRITER > DQ_TILE ? DQ_WRITER : DQ_TILE;
    static constexpr int F = static_cast<int>(sizeof(float));
    static constexpr int BARRIER = static_cast<int>(sizeof(unsigned long long));
    static constexpr int k = 0;
    static constexpr int v = k + BN * DT * E;
    static constexpr int q = v + BN * DT * E;
    static constexpr int dout = q + STAGES * BM * DT * E;
    static constexpr int ds = dout + STAGES * BM * DT * E;
    static constexpr int dq = ds + 2 * BN * BM * E;
    static constexpr int lse = dq + DQ_FLOATS * F;
    static constexpr int delta = lse + STAGES * BM * F;
    static constexpr int ring = delta + STAGES * BM * F;
    static constexpr int kv_full = ring + static_cast<int>(sizeof(Ring));
    static constexpr int kv_empty = kv_full + BARRIER;
    static constexpr int dq_full = kv_empty + BARRIER;
    static constexpr int dq_empty = dq_full + 2 * BARRIER;
    static constexpr int dq_at = dq_empty + 2 * BARRIER;
    static constexpr int bytes =
        (DT != 64 ? kSharedAlignSlack : 0) + dq_at + 2 * 4 * static_cast<int>(sizeof(int));
};

template <typename T, int D, int BM, int STAGES, bool ATOMIC_DQ, bool MODIFIED = false,
          bool PERSISTENT = false, bool ORDERED_DQ = false, int DV = D>
constexpr int backward_wgmma_ws_shared_bytes = BackwardWgmmaWsShared<T, D, BM, STAGES>::bytes;

// The 256 class's split of the columns between the consumers: consumer 0 the first dv, dk
// and dq columns of dV (DVK of them), dK (DK) and dQ (DQN = DK rounded up to whole boxes
// of 32), consumer 1 the rest. Each first count starts a 64-column block of the swizzled
// tiles (64 or 128); the second counts are the products' N (16 to 128 of dV and dK, 32 to
// 128 of dQ: Wgmma's ss_nb and ss_mn). The split with the fewest columns on the busier
// consumer (each column is one m64n8 product over 64 keys or query rows), or {0, 0, 0}
// where none fits (the registry sends such a narrower v to backward_wgmma).
struct WidePlan {
    int dv, dk, dq;
};
__host__ __device__ constexpr WidePlan wide_split(int dk, int dvk) {
    const int dqn = (dk + 31) / 32 * 32;
    WidePlan best{0, 0, 0};
    int best_load = 1 << 30;
    for (int dv = 128; dv >= 64; dv -= 64)
        for (int dkc = 128; dkc >= 64; dkc -= 64)
            for (int dq = 128; dq >= 64; dq -= 64) {
                const int first = dv + dkc + dq, second = dk + dvk + dqn - first;
                const int load = first > second ? first : second;
                const bool fits = dvk - dv >= 16 && dvk - dv <= 128 && dk - dkc >= 16 &&
                                  dk - dkc <= 128 && dqn - dq >= 32 && dqn - dq <= 128;
                if (fits && load < best_load) {
                    best_load = load;
                    best = WidePlan{dv, dkc, dq};
                }
            }
    return best;
}
static_assert(wide_split(256, 256).dv == 128 && wide_split(256, 256).dq == 128, "D = 256");
static_assert(wide_split(192, 128).dv == 64, "MLA: D = 192, DV = 128");
static_assert(wide_split(144, 144).dv > 0, "D = 136");

// One consumer's columns: [dv_first, + dv_count) of dV, likewise of dK and dQ.
template <int DV_FIRST, int DV_COUNT, int DK_FIRST, int DK_COUNT, int DQ_FIRST, int DQ_COUNT>
struct WideColumns {
    static constexpr int dv_first = DV_FIRST, dv_count = DV_COUNT, dk_first = DK_FIRST,
                         dk_count = DK_COUNT, dq_first = DQ_FIRST, dq_count = DQ_COUNT;
};

}  // namespace cuflash
