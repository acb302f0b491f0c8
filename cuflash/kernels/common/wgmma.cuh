// The wgmma plumbing of the Hopper (sm_90a) kernels: matrix descriptors,
// fences, commits and waits, warpgroup and divergent-block barriers, the
// generic-to-async proxy fence, register pins, and the copy of a 16-bit tile
// into the canonical 128-byte-swizzled layout (column blocks of 64 elements,
// rows of 128 bytes) that wgmma reads. The instructions themselves are
// common/wgmma_ops.cuh's.
#pragma once
#include "common/mma.cuh"
#include "common/wgmma_ops.cuh"

namespace cuflash {

// A wgmma matrix descriptor: start address, leading and stride byte offsets,
// 128-byte swizzle (the start must lie in a 1024-byte-aligned swizzle atom).
__device__ __forceinline__ unsigned long long wgmma_desc(const void* start, unsigned lead_bytes,
                                                         unsigned stride_bytes) {
    return static_cast<unsigned long long>((smem_addr(start) & 0x3FFFF) >> 4) |
           static_cast<unsigned long long>((lead_bytes & 0x3FFFF) >> 4) << 16 |
           static_cast<unsigned long long>((stride_bytes & 0x3FFFF) >> 4) << 32 | 1ull << 62;
}
// The descriptor of the operand `bytes` past `desc`'s start, with its offsets and
// swizzle: shared memory ends below 256 KB, so the 14-bit start field takes the
// sum without a carry (one add, where wgmma_desc masks and shifts).
__device__ __forceinline__ unsigned long long wgmma_desc_plus(unsigned long long desc,
                                                              unsigned bytes) {
    return desc + (bytes >> 4);
}
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Wait until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void wgmma_wait_all() { wgmma_wait<0>(); }
// ptxas moves register-only arithmetic freely across a wgmma wait and a
// barrier: it sank the pipelined forward's softmax below the wait for P V,
// which serialized the two. A shared-memory store of a value that depends on
// that work keeps the work before the next wait (`slot`: this thread's own
// scratch word, never read).
__device__ __forceinline__ void complete_before_wait(float* slot, float value) {
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(smem_addr(slot)), "f"(value) : "memory");
}
// A barrier of the 128 threads of warpgroup wg only (named barrier 1 + wg).
__device__ __forceinline__ void warpgroup_sync(int wg) {
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
}
// A barrier of the block's NT threads from code the warpgroups may reach at different
// instructions (each running its own copy of a loop): barrier.sync without .aligned.
// __syncthreads is bar.sync 0, the .aligned form, which needs every thread at the same
// instruction (compute-sanitizer's synccheck reports divergent threads there).
template <int NT>
__device__ __forceinline__ void block_sync_divergent() {
    asm volatile("barrier.sync %0, %1;\n" ::"r"(0), "n"(NT) : "memory");
}
// cp.async and plain stores write shared memory through the generic proxy;
// wgmma reads it through the async proxy.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Pin accumulator registers here: the compiler may not move their reads or
// writes across this point (wgmma works on them behind its back).
template <int N>
__device__ __forceinline__ void pin_registers(float (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+f"(x[i][0]), "+f"(x[i][1]), "+f"(x[i][2]), "+f"(x[i][3])::"memory");
}

// Where 16-byte chunk c of row r of a tile of ROWS rows lies in that layout, in chunks.
template <int ROWS>
__device__ __forceinline__ int sw128_chunk(int r, int c) {
    return (c >> 3) * (ROWS * 8) + r * 8 + ((c & 7) ^ (r & 7));
}

// Rows [0, ROWS) of a [rows][COLS] 16-bit tile (row stride `stride` elements)
// in the 128-byte-swizzled layout: element (r, c) goes to column block c / 64,
// row r, 16-byte chunk (c % 64 / 8) xor (r % 8). Columns [0, D) come from
// `src`; columns from D to the power-of-two chunk count that covers COLS
// (whole rows a pass for the copy loop), or to WIDTH where the tile's rows are
// narrower than that, and rows at or past valid_rows, become zeros. Rows whose chunks
// the NT threads cannot split into whole rows (24: WIDTH 192) copy a chunk of each
// 64-column block a thread, whole rows a pass.
template <int ROWS, int COLS, int NT, int D = COLS, bool ROLLED = false,
          int WIDTH = pow2_at_least(COLS / 8) * 8, typename T>
__device__ __forceinline__ void cp_async_tile_sw128(T* dst, const T* __restrict__ src,
                                                    long long stride, int valid_rows) {
    constexpr int CHUNKS =
        pow2_at_least(COLS / 8) < WIDTH / 8 ? pow2_at_least(COLS / 8) : WIDTH / 8;
    static_assert(COLS <= WIDTH, "the tile's rows hold the columns");
    auto to = [](int r, int c) {
        return (c >> 3) * (ROWS * 64) + r * 64 + (((c & 7) ^ (r & 7)) << 3);
    };
    if constexpr (CHUNKS % 8 == 0 && NT % CHUNKS != 0) {
        // Thread x copies chunk x % 8 of each 64-column block, NT / 8 rows a pass: the
        // loop of cp_async_rows, a copy a block and row.
        constexpr int BLOCKS = CHUNKS / 8, ROW_STEP = NT / 8, VALID = D / 8;
        constexpr int PER_CHUNK = 16 / sizeof(T);
        static_assert(NT % 8 == 0 && ROWS % ROW_STEP == 0, "whole rows a pass");
        const int r0 = threadIdx.x / 8, c = threadIdx.x % 8;
        const T* from = src + r0 * stride + c * PER_CHUNK;
        auto copy_row = [&](int i) {
            const int r = r0 + i * ROW_STEP;
#pragma unroll
            for (int block = 0; block < BLOCKS; ++block) {
                const bool valid = r < valid_rows && c + 8 * block < VALID;
                cp_async_16(dst + block * (ROWS * 64) + to(r, c), valid ? from + block * 64 : src,
                            valid);
            }
            from += ROW_STEP * stride;
        };
        repeat<ROWS / ROW_STEP, ROLLED>(copy_row);
    } else {
        cp_async_rows<ROWS, CHUNKS, NT, D / 8, ROLLED>(dst, src, stride, valid_rows, to);
    }
}

}  // namespace cuflash
