// The shared-memory barriers of the warp-specialized Hopper kernels (sm_90):
// a producer warpgroup fills stages of shared memory, consumer warpgroups
// wait for them and hand them back, with no block-wide barrier in the loop.
//
// An mbarrier is 8 bytes of shared memory with an expected arrival count and
// a phase bit: the phase completes when that many arrivals have come, and
// the next one begins. A waiter names the parity of the phase it waits for;
// a fresh barrier is in phase 0, and a wait for parity 1 passes at once (the
// "previous" phase counts as done), which is how a producer's first pass
// over the empty stages goes through.
#pragma once
#include "common/mma.cuh"
#include "common/params.cuh"

namespace cuflash {

__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
                 : "memory");
}
// One arrival of the executing thread (release: its earlier writes are
// visible to a thread whose wait sees the phase complete).
__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Wait until the phase of parity `parity` has completed (acquire).
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

// One arrival once every cp.async this thread has issued so far has landed (the
// arrival counts towards the phase: .noinc). The consumer that waits on the
// barrier then fences (fence.proxy.async) before wgmma reads the tile.
__device__ __forceinline__ void cp_async_arrive(unsigned long long* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar))
                 : "memory");
}

// One arrival that also makes the phase wait for `bytes` more of bulk tensor copies
// (the transaction count their complete_tx takes back).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}

// The box of `map` at coordinates (c0, c1, c2, c3) (elements, dimension 0 first) into
// shared memory at `dst` (the map's swizzle applied, zeros outside the tensor) by the
// copy engine (TMA); its bytes complete `bar`'s transaction count. `map` lives in
// the kernel's parameter space (a __grid_constant__ parameter).
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap* map, int c0, int c1, int c2,
                                            int c3, unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_addr(dst)),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
        "r"(smem_addr(bar))
        : "memory");
}

// dst[0, bytes) += src[0, bytes) in float32 (global += shared) by the copy engine,
// in this thread's open bulk group; both addresses 16-byte aligned, bytes a multiple
// of 16. The thread fences (fence_proxy_async) its own generic writes of `src` first,
// and may overwrite `src` once bulk_wait_read has seen the group read.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, unsigned bytes) {
    asm volatile(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
        "r"(smem_addr(src)), "r"(bytes)
        : "memory");
}
// The box of `map` at coordinates (c0, c1, c2, c3) += the float32 box at `src` (the
// map's swizzle applied; elements outside the tensor skipped) by the copy engine, in
// this thread's open bulk group, as bulk_reduce_add_f32 (`src` 1024-byte aligned).
__device__ __forceinline__ void bulk_tensor_reduce_add_4d(const TensorMap* map, int c0, int c1,
                                                          int c2, int c3, const float* src) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
        " [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(reinterpret_cast<unsigned long long>(map)),
        "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(src))
        : "memory");
}
// This thread's bulk operations since the last commit form a group.
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Wait until at most PENDING of this thread's bulk groups have not yet read their
// shared memory (bulk_wait_read), or not yet completed (bulk_wait: their global
// writes done; before the block exits, which frees the shared memory).
template <int PENDING>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(PENDING) : "memory");
}
template <int PENDING>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// Counters in global memory that order work across blocks (the ordered dQ of
// sm90/backward_wgmma_ws.cuh): a wait until *counter >= count (acquire, then a proxy
// fence so that this thread's bulk operations after it see what the copy engine of the
// blocks it waited for wrote; it returns the value seen), and an increment (release)
// after a proxy fence that orders this thread's completed bulk operations before it. A
// wait only ever waits for blocks launched earlier, which the hardware has made
// resident or finished.
__device__ __forceinline__ int wait_counter_at_least(const int* counter, int count) {
    int value;
    do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n"
                     : "=r"(value)
                     : "l"(counter)
                     : "memory");
    } while (value < count);
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
    return value;
}
__device__ __forceinline__ void increment_counter(int* counter) {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}

// Registers move from the producer warpgroup to the consumers (sm_90a; each
// role one branch, the kernel capped at entry by __launch_bounds__(n, 1)).
template <int REGISTERS>
__device__ __forceinline__ void registers_down() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
}
template <int REGISTERS>
__device__ __forceinline__ void registers_up() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
}

// The ring of STAGES shared-memory stages of one operand: `full[s]` completes
// when the copies into stage s have landed (those of the producer's 128 threads,
// or one thread's bulk tensor copies: init's `producers`); `empty[s]`
// after CONSUMERS arrivals: one a consumer warpgroup where only its wgmma read the
// stage (the forward), one a consumer thread where threads also load from it (the
// backward's lse and Delta). Use i of the ring (0, 1, ...) is stage i % STAGES in
// phase (i / STAGES) & 1.
template <int STAGES, int CONSUMERS>
struct StageRing {
    unsigned long long full[STAGES], empty[STAGES];

    __device__ __forceinline__ void init(unsigned producers = 128) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&full[s], producers);
            mbarrier_init(&empty[s], CONSUMERS);
        }
    }
    static __device__ __forceinline__ int stage(int use) { return use % STAGES; }
    static __device__ __forceinline__ unsigned parity(int use) { return (use / STAGES) & 1; }
    // Producer: wait until use `use` may overwrite its stage.
    __device__ __forceinline__ void wait_empty(int use) {
        mbarrier_wait(&empty[stage(use)], parity(use) ^ 1);
    }
    // Producer: use `use`'s copies are issued; the stage is full once they land.
    __device__ __forceinline__ void filled(int use) { cp_async_arrive(&full[stage(use)]); }
    // Producer (one thread, bulk tensor copies): the stage of use `use` is full once
    // `bytes` have landed; returns its barrier, for the copies to complete.
    __device__ __forceinline__ unsigned long long* expect(int use, unsigned bytes) {
        mbarrier_arrive_expect_tx(&full[stage(use)], bytes);
        return &full[stage(use)];
    }
    // Consumer: wait until use `use`'s stage holds its tile.
    __device__ __forceinline__ void wait_full(int use) {
        mbarrier_wait(&full[stage(use)], parity(use));
    }
    // Consumer: an arrival (`signalling`), once this thread's (or warpgroup's) reads
    // are done.
    __device__ __forceinline__ void release(int use, bool signalling) {
        if (signalling) mbarrier_arrive(&empty[stage(use)]);
    }
};

}  // namespace cuflash
