// A CUDA runtime for the host compiler, just large enough to run cuflash's
// CUDA-core and mma.sync kernels on the CPU (tests/simulator.py builds them).
//
// Every CUDA thread of a block is a fiber (ucontext) on one host thread, run
// in turn by a scheduler until it reaches a barrier or ends; __syncthreads and
// the warp-collective instructions (shuffles, ldmatrix, movmatrix, mma.sync)
// are barriers over the block or the warp, so their results follow PTX's
// definitions lane by lane. cp.async copies are held per thread and done when
// a cp.async.wait_group lets their group complete: a kernel that reads a tile
// before waiting for it reads the poison the shared memory was filled with.
// A shared address (cvta.to.shared, what ldmatrix, cp.async and the wgmma
// descriptors take) is the offset into the block's shared memory, as on the GPU.
// wgmma runs when it is issued, on the warpgroup's 128 threads; its fence,
// commit and wait are no-ops.
#pragma once
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // one block runs at a time: a function's static is its block's
#define __align__(n) alignas(n)
#define __grid_constant__
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 800
#endif

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
    return uint4{x, y, z, w};
}
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

namespace sim {

constexpr size_t kStackBytes = 1 << 20;
constexpr unsigned char kSharedPoison = 0xff;  // NaN in float32, float16 and bfloat16

struct PendingCopy {
    void* dst;
    const void* src;
    int bytes, valid_bytes;
};

// A bulk reduction (cp.reduce.async.bulk ... add.f32): global dst += shared src, `bytes`
// of contiguous floats; or (map != 0) the float32 box of a tensor map at `coords`.
struct PendingReduce {
    float* dst;
    const float* src;
    int bytes;
    unsigned long long map = 0;
    int coords[4] = {0, 0, 0, 0};
    unsigned src_address = 0;
};

struct Barrier {
    int expected = 0, arrived = 0;
    unsigned generation = 0;
};

struct Fiber {
    ucontext_t context;
    void* stack = nullptr;
    dim3 tid;
    int lane = 0, warp = 0;
    bool done = false;
    std::vector<PendingCopy> copies;               // issued, not yet in a committed group
    std::vector<std::vector<PendingCopy>> groups;  // committed, oldest first
    // bulk reductions: the open group, then the committed ones (oldest first)
    std::vector<PendingReduce> reduces;
    std::vector<std::vector<PendingReduce>> reduce_groups;
    int idle_acquires = 0;  // ld_acquire_gpu_b32's reads in a row that nothing moved
};

// The threads of a warp (32) or a warpgroup (128) and the slots of their offers
// to a collective instruction.
template <int THREADS>
struct Group {
    Barrier barrier;
    alignas(16) unsigned char in[THREADS][64];
};
using Warp = Group<32>;
using Warpgroup = Group<128>;

// bar.sync / bar.arrive with an id and a thread count.
struct NamedBarrier {
    int arrived = 0;
    unsigned generation = 0;
};

inline dim3 block_idx, block_dim, grid_dim;
inline Fiber* current = nullptr;
inline ucontext_t scheduler_context;
inline std::vector<Fiber> fibers;
inline std::vector<Warp> warps;
inline std::vector<Warpgroup> warpgroups;
inline NamedBarrier named_barriers[16];
inline Barrier block_barrier;
inline unsigned char* shared_memory = nullptr;
inline size_t shared_capacity = 0;
inline long long progress = 0;
inline const char* failure = nullptr;
// A read or write that faulted (a guard page of a guarded argument, say): its address.
inline sigjmp_buf fault_recovery;
inline volatile uintptr_t fault_address = 0;

inline void yield() { swapcontext(&current->context, &scheduler_context); }

inline void arrive(Barrier& b) {
    const unsigned generation = b.generation;
    ++progress;
    if (++b.arrived >= b.expected) {
        b.arrived = 0;
        ++b.generation;
        return;
    }
    while (b.generation == generation) yield();
}

// A thread that ends no longer counts at its block's and warp's barriers.
inline void leave(Barrier& b) {
    --b.expected;
    if (b.arrived > 0 && b.arrived >= b.expected) {
        b.arrived = 0;
        ++b.generation;
    }
}

inline void* dynamic_shared() { return shared_memory; }

inline size_t shared_address(const void* p) {
    const unsigned char* q = static_cast<const unsigned char*>(p);
    if (q < shared_memory || q > shared_memory + shared_capacity) {
        failure = "cvta.to.shared of a pointer outside the block's shared memory";
        return 0;
    }
    return static_cast<size_t>(q - shared_memory);
}
inline void* shared_pointer(unsigned address) {
    if (address >= shared_capacity) {
        failure = "a shared-memory address outside the block's dynamic shared memory";
        return shared_memory;
    }
    return shared_memory + address;
}

// One collective step of a warp or a warpgroup: each thread offers `mine`, then
// computes its result from every member's offer (offer(r) reads rank r's), then
// the group waits until every member has read before the slots are reused.
template <typename In, typename F, int THREADS>
inline auto collective_of(Group<THREADS>& group, int rank, const In& mine, F&& compute) {
    static_assert(sizeof(In) <= sizeof(group.in[0]), "offer too large");
    memcpy(group.in[rank], &mine, sizeof(In));
    arrive(group.barrier);
    auto offer = [&group](int r) {
        In x;
        memcpy(&x, group.in[r], sizeof(In));
        return x;
    };
    auto result = compute(rank, offer);
    arrive(group.barrier);
    return result;
}
template <typename In, typename F>
inline auto collective(const In& mine, F&& compute) {
    return collective_of(warps[current->warp], current->lane, mine, compute);
}
template <typename In, typename F>
inline auto warpgroup_collective(const In& mine, F&& compute) {
    const int thread = static_cast<int>(current->tid.x);
    return collective_of(warpgroups[thread / 128], thread % 128, mine, compute);
}

// ---- conversions ---------------------------------------------------------------

inline float half_to_float(unsigned short bits) {
    _Float16 h;
    memcpy(&h, &bits, 2);
    return static_cast<float>(h);
}
inline unsigned short float_to_half(float x) {
    const _Float16 h = static_cast<_Float16>(x);  // round to nearest even
    unsigned short bits;
    memcpy(&bits, &h, 2);
    return bits;
}
inline float bf16_to_float(unsigned short bits) {
    const unsigned u = static_cast<unsigned>(bits) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline unsigned short float_to_bf16(float x) {
    unsigned u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);
    return static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float flush_denormal(float x) { return fabsf(x) < 1.17549435e-38f ? copysignf(0.f, x) : x; }

// An instruction the simulator does not model, reached at run time.
inline void unsupported(const char* instruction) {
    failure = instruction;
    yield();
}

}  // namespace sim

// ---- CUDA built-ins --------------------------------------------------------------

#define threadIdx (sim::current->tid)
#define blockIdx (sim::block_idx)
#define blockDim (sim::block_dim)
#define gridDim (sim::grid_dim)

inline void __syncthreads() { sim::arrive(sim::block_barrier); }
inline void __syncwarp(unsigned = 0xffffffffu) {
    sim::arrive(sim::warps[sim::current->warp].barrier);
}
inline unsigned __float_as_uint(float x) {
    unsigned u;
    memcpy(&u, &x, 4);
    return u;
}
inline int __float_as_int(float x) {
    int u;
    memcpy(&u, &x, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}
inline float __int_as_float(int u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}
template <typename T>
inline T __ldg(const T* p) {
    return *p;
}
inline float atomicAdd(float* p, float x) {
    const float old = *p;
    *p = old + x;
    return old;
}
inline unsigned atomicMax(unsigned* p, unsigned x) {
    const unsigned old = *p;
    *p = old > x ? old : x;
    return old;
}
inline size_t __cvta_generic_to_shared(const void* p) { return sim::shared_address(p); }
template <typename A, typename B>
inline auto min(A a, B b) -> std::common_type_t<A, B> {
    return b < a ? b : a;
}
template <typename A, typename B>
inline auto max(A a, B b) -> std::common_type_t<A, B> {
    return b > a ? b : a;
}

inline int __ffs(int x) { return __builtin_ffs(x); }
inline float __fdividef(float x, float y) { return x / y; }
// Rounded float32 arithmetic that never contracts into a fused multiply-add.
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fsub_rn(float x, float y) { return x - y; }
inline int __any_sync(unsigned, int predicate) {
    return sim::collective(predicate != 0, [](int, auto offer) {
        bool any = false;
        for (int lane = 0; lane < 32; ++lane) any = any || offer(lane);
        return static_cast<int>(any);
    });
}
inline void __trap() { sim::unsupported("trap"); }
template <typename T>
inline T __shfl_xor_sync(unsigned, T value, int lane_mask) {
    return sim::collective(value, [&](int lane, auto offer) { return offer(lane ^ lane_mask); });
}
template <typename T>
inline T __shfl_sync(unsigned, T value, int source) {
    return sim::collective(value, [&](int, auto offer) { return offer(source & 31); });
}

// ---- the PTX instructions the kernels' asm statements hold -------------------------
// (tests/simulator.py rewrites each asm statement into a call of one of these)

namespace sim {

inline void cvt_f32_f16(float& out, unsigned short in) { out = half_to_float(in); }
inline void cvt_rn_f16_f32(unsigned short& out, float in) { out = float_to_half(in); }
// d = {upper: a, lower: b}
inline void cvt_rn_f16x2_f32(unsigned& out, float a, float b) {
    out = (static_cast<unsigned>(float_to_half(a)) << 16) | float_to_half(b);
}
inline void cvt_rn_bf16x2_f32(unsigned& out, float a, float b) {
    out = (static_cast<unsigned>(float_to_bf16(a)) << 16) | float_to_bf16(b);
}
// e4m3 (FP8): 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7f / 0xff NaN, no inf.
inline float e4m3_to_float(unsigned char bits) {
    const int e = (bits >> 3) & 15, m = bits & 7;
    if (e == 15 && m == 7) return std::numeric_limits<float>::quiet_NaN();
    const float magnitude =
        e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
    return bits & 0x80 ? -magnitude : magnitude;
}
// Round to nearest even, saturated to +-448 (cvt's .satfinite), NaN to 0x7f.
inline unsigned char float_to_e4m3(float x) {
    if (std::isnan(x)) return 0x7f;
    const unsigned char sign = std::signbit(x) ? 0x80 : 0;
    const double a = std::min(std::fabs(static_cast<double>(x)), 448.0);
    // the spacing of the values near a: 2^-9 below 2^-6 (subnormals), else 2^(e - 3)
    const int e = a < std::ldexp(1.0, -6) ? -6 : std::ilogb(a);
    const double quantum = std::ldexp(1.0, e - 3);
    const double r = std::nearbyint(a / quantum) * quantum;  // ties to even (the default)
    if (r < std::ldexp(1.0, -6)) return sign | static_cast<unsigned char>(r / std::ldexp(1.0, -9));
    const int re = std::ilogb(r);
    const int mantissa = static_cast<int>(r / std::ldexp(1.0, re - 3)) - 8;
    return sign | static_cast<unsigned char>(((re + 7) << 3) | mantissa);
}
// mov.b32 {l, h}, x; cvt.rn.f16x2.e4m3x2 lo, l; cvt.rn.f16x2.e4m3x2 hi, h: each byte of
// x as float16 (exact; a NaN byte a NaN), byte 0 the low half of lo.
inline void e4m3x4_to_f16x2(unsigned& lo, unsigned& hi, unsigned x) {
    unsigned short h[4];
    for (int i = 0; i < 4; ++i) h[i] = float_to_half(e4m3_to_float((x >> (8 * i)) & 0xffu));
    lo = h[0] | (static_cast<unsigned>(h[1]) << 16);
    hi = h[2] | (static_cast<unsigned>(h[3]) << 16);
}
// prmt.b32 d, a, b, c (the default mode): byte i of d is byte (c >> 4 i) & 7 of {b, a}.
inline void prmt_b32(unsigned& out, unsigned a, unsigned b, unsigned selector) {
    const unsigned long long bytes = (static_cast<unsigned long long>(b) << 32) | a;
    out = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned pick = (selector >> (4 * i)) & 7u;
        out |= static_cast<unsigned>((bytes >> (8 * pick)) & 0xffu) << (8 * i);
    }
}
// d = {upper byte: a, lower byte: b}
inline void cvt_rn_satfinite_e4m3x2_f32(unsigned short& out, float a, float b) {
    out = static_cast<unsigned short>((float_to_e4m3(a) << 8) | float_to_e4m3(b));
}
inline void ex2_approx_ftz_f32(float& out, float in) {
    out = flush_denormal(exp2f(flush_denormal(in)));
}
inline void tanh_approx_f32(float& out, float in) { out = tanhf(in); }

inline void cp_async(unsigned dst, const void* src, int bytes, int valid_bytes) {
    current->copies.push_back(PendingCopy{shared_pointer(dst), src, bytes, valid_bytes});
}
// cp.async with the ignore-src predicate: zeros, `src` unread, where `ignore`.
inline void cp_async_ignore_src(unsigned dst, const void* src, int bytes, bool ignore) {
    cp_async(dst, src, bytes, ignore ? 0 : bytes);
}
inline void cp_async_commit_group() {
    current->groups.push_back(std::move(current->copies));
    current->copies.clear();
}
inline void cp_async_wait_group(int pending) {
    auto& groups = current->groups;
    while (static_cast<int>(groups.size()) > pending) {
        for (const PendingCopy& c : groups.front()) {
            if (c.valid_bytes > 0) memcpy(c.dst, c.src, c.valid_bytes);
            memset(static_cast<unsigned char*>(c.dst) + c.valid_bytes, 0, c.bytes - c.valid_bytes);
        }
        groups.erase(groups.begin());
    }
}

// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32: held in the thread's
// open bulk group; the copy engine reads the shared source when the thread waits for
// the group (cp.async.bulk.wait_group[.read]), so a source overwritten before that
// wait adds the wrong values.
inline void bulk_reduce_add_f32(float* dst, unsigned src, unsigned bytes) {
    if (reinterpret_cast<uintptr_t>(dst) % 16 || src % 16 || bytes % 16) {
        failure = "a bulk reduction's address or size not a multiple of 16 bytes";
        return;
    }
    current->reduces.push_back(PendingReduce{dst, static_cast<const float*>(shared_pointer(src)),
                                             static_cast<int>(bytes)});
}
inline void bulk_commit_group() {
    current->reduce_groups.push_back(std::move(current->reduces));
    current->reduces.clear();
}
inline void reduce_tensor_box(const PendingReduce& r);
inline void bulk_wait_group(int pending) {
    auto& groups = current->reduce_groups;
    // The copy engine reads a tensor reduction's box while the other threads run on: the
    // waiting thread lets them run until none can go further, so a thread that writes
    // the box without waiting for it to come back (through an mbarrier, say) has
    // overwritten it by then.
    bool tensor = false;
    for (size_t g = 0; g + pending < groups.size(); ++g)
        for (const PendingReduce& r : groups[g]) tensor = tensor || r.map;
    for (long long before = 0; tensor;) {
        before = ++progress;  // the copy engine's turn: not a wait at a barrier
        yield();
        tensor = progress != before;  // another thread moved: a round more
    }
    while (static_cast<int>(groups.size()) > pending) {
        for (const PendingReduce& r : groups.front()) {
            if (r.map) {
                reduce_tensor_box(r);
                continue;
            }
            for (int i = 0; i < r.bytes / 4; ++i) r.dst[i] += r.src[i];
        }
        groups.erase(groups.begin());
    }
    ++progress;
}

// ld.acquire.gpu in a wait for a counter that earlier blocks raise (wait_counter_at_least
// of kernels/common/mbarrier.cuh): blocks run one at a time in launch order here, so
// what an earlier block raises is already there; the waiting thread lets the block's
// other threads run, and a wait none of them moves fails (on the GPU it would hang).
inline void ld_acquire_gpu_b32(int& value, const int* counter) {
    value = *counter;
    const long long before = progress;
    yield();
    if (progress == before && *counter == value)
        ++current->idle_acquires;
    else
        current->idle_acquires = 0;
    if (current->idle_acquires > 64) failure = "a wait for a counter that no earlier block raised";
}
// red.release.gpu.global.add.s32 [counter], 1.
inline void red_release_add_one(int* counter) {
    ++*counter;
    ++progress;
}

inline void ld_shared_v2_f32(float& x, float& y, unsigned address) {
    const float* p = static_cast<const float*>(shared_pointer(address));
    x = p[0];
    y = p[1];
}

// Four 8x8 b16 matrices; lanes 8 i .. 8 i + 7 give the row addresses of matrix i.
inline void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned address) {
    unsigned* out[4] = {&r0, &r1, &r2, &r3};
    struct Regs {
        unsigned r[4];
    };
    const Regs regs = collective(address, [](int lane, auto offer) {
        Regs x;
        for (int i = 0; i < 4; ++i) {
            const unsigned char* row =
                static_cast<const unsigned char*>(shared_pointer(offer(8 * i + lane / 4)));
            memcpy(&x.r[i], row + 4 * (lane % 4), 4);
        }
        return x;
    });
    for (int i = 0; i < 4; ++i) *out[i] = regs.r[i];
}
inline void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                              unsigned address) {
    unsigned* out[4] = {&r0, &r1, &r2, &r3};
    struct Regs {
        unsigned r[4];
    };
    const Regs regs = collective(address, [](int lane, auto offer) {
        Regs x;
        for (int i = 0; i < 4; ++i) {
            unsigned short e[2];
            for (int j = 0; j < 2; ++j) {
                const unsigned char* row = static_cast<const unsigned char*>(
                    shared_pointer(offer(8 * i + 2 * (lane % 4) + j)));
                memcpy(&e[j], row + 2 * (lane / 4), 2);
            }
            x.r[i] = e[0] | (static_cast<unsigned>(e[1]) << 16);
        }
        return x;
    });
    for (int i = 0; i < 4; ++i) *out[i] = regs.r[i];
}
// An 8x8 b16 matrix a row of two elements a lane (lane 4 i + j: row i, columns
// 2 j, 2 j + 1), transposed in the same layout.
inline void movmatrix_trans(unsigned& out, unsigned in) {
    out = collective(in, [](int lane, auto offer) {
        unsigned short e[2];
        for (int j = 0; j < 2; ++j) {
            const int row = 2 * (lane % 4) + j, col = lane / 4;  // of the source
            const unsigned x = offer(4 * row + col / 2);
            e[j] = static_cast<unsigned short>(col % 2 ? x >> 16 : x & 0xffffu);
        }
        return static_cast<unsigned>(e[0] | (static_cast<unsigned>(e[1]) << 16));
    });
}

// D (16x8, f32) = A (16x16, row) B (16x8, col) + C, the m16n8k16 fragments.
template <bool BF16>
inline void mma_m16n8k16(float& c0, float& c1, float& c2, float& c3, unsigned a0, unsigned a1,
                         unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    struct Offer {
        unsigned a[4], b[2];
        float c[4];
    };
    struct Out {
        float d[4];
    };
    auto element = [](unsigned x, int half) {
        const unsigned short bits = static_cast<unsigned short>(half ? x >> 16 : x & 0xffffu);
        return BF16 ? bf16_to_float(bits) : half_to_float(bits);
    };
    const Offer mine{{a0, a1, a2, a3}, {b0, b1}, {c0, c1, c2, c3}};
    const Out out = collective(mine, [&](int lane, auto offer) {
        // A[r][k]: lane 4 (r % 8) + (k % 8) / 2, register (r >= 8) + 2 (k >= 8), half k % 2.
        auto a_at = [&](int r, int k) {
            return element(offer(4 * (r % 8) + (k % 8) / 2).a[(r >= 8) + 2 * (k >= 8)], k % 2);
        };
        // B[k][n]: lane 4 n + (k % 8) / 2, register k >= 8, half k % 2.
        auto b_at = [&](int k, int n) {
            return element(offer(4 * n + (k % 8) / 2).b[k >= 8], k % 2);
        };
        const int g = lane / 4, t = lane % 4;
        const Offer me = offer(lane);
        Out o;
        for (int e = 0; e < 4; ++e) {
            const int r = g + 8 * (e >> 1), n = 2 * t + (e & 1);
            double sum = me.c[e];
            for (int k = 0; k < 16; ++k) sum += static_cast<double>(a_at(r, k)) * b_at(k, n);
            o.d[e] = static_cast<float>(sum);
        }
        return o;
    });
    c0 = out.d[0];
    c1 = out.d[1];
    c2 = out.d[2];
    c3 = out.d[3];
}
inline void mma_bf16(float& c0, float& c1, float& c2, float& c3, unsigned a0, unsigned a1,
                     unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    mma_m16n8k16<true>(c0, c1, c2, c3, a0, a1, a2, a3, b0, b1);
}
inline void mma_f16(float& c0, float& c1, float& c2, float& c3, unsigned a0, unsigned a1,
                    unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    mma_m16n8k16<false>(c0, c1, c2, c3, a0, a1, a2, a3, b0, b1);
}

// {a, b} = the float16 halves of x (low, high), as floats
inline void unpack_f16x2_f32(float& a, float& b, unsigned x) {
    a = half_to_float(static_cast<unsigned short>(x & 0xffffu));
    b = half_to_float(static_cast<unsigned short>(x >> 16));
}
inline void mov_dynamic_smem_size(unsigned& out) { out = static_cast<unsigned>(shared_capacity); }
inline void st_shared_f32(unsigned address, float x) { memcpy(shared_pointer(address), &x, 4); }
// @p red.global.add.v2.f32
inline void red_global_add_v2_f32(float* p, float x, float y, bool predicate) {
    if (predicate) {
        p[0] += x;
        p[1] += y;
    }
}
inline void bar_arrive(unsigned id, unsigned threads) {
    NamedBarrier& b = named_barriers[id % 16];
    ++progress;
    if (++b.arrived >= static_cast<int>(threads)) {
        b.arrived = 0;
        ++b.generation;
    }
}
// mbarrier (shared-memory barriers with phases): the state of each, by its shared
// address, for the block that runs. A phase completes when its expected arrivals
// have come; a wait for parity p passes once the phase of that parity is done, i.e.
// while the current phase's parity is not p.
// Copies tied to a barrier by cp.async.mbarrier.arrive land when a waiter sees
// their phase complete (not when issued): a consumer that reads a stage without
// waiting for it reads the poison or an older tile.
// A phase of a barrier that bulk tensor copies complete also waits for their bytes
// (the transaction count: mbarrier.arrive.expect_tx adds, each copy's complete_tx
// takes away); the phase completes when both the arrivals and the count are done.
struct Mbarrier {
    int expected = 0, pending = 0;
    long long transactions = 0;
    unsigned phase = 0;
    std::vector<PendingCopy> attached, completed;
};
inline std::map<unsigned, Mbarrier> mbarriers;
inline void mbarrier_init(unsigned address, unsigned count) {
    shared_pointer(address);
    if (address % 8) failure = "an mbarrier not 8-byte aligned";
    mbarriers[address] = Mbarrier{static_cast<int>(count), static_cast<int>(count), 0};
    ++progress;
}
inline Mbarrier* mbarrier_at(unsigned address) {
    auto found = mbarriers.find(address);
    if (found != mbarriers.end()) return &found->second;
    failure = "an mbarrier used before its mbarrier.init";
    yield();
    return nullptr;
}
inline void mbarrier_complete_if_done(Mbarrier* m) {
    if (m->pending == 0 && m->transactions == 0) {
        m->pending = m->expected;
        ++m->phase;
        m->completed.insert(m->completed.end(), m->attached.begin(), m->attached.end());
        m->attached.clear();
    }
}
inline void mbarrier_arrive(unsigned address) {
    Mbarrier* m = mbarrier_at(address);
    if (m == nullptr) return;
    ++progress;
    if (m->pending == 0) {
        failure = "an mbarrier arrival past its phase's expected count";
        return;
    }
    --m->pending;
    mbarrier_complete_if_done(m);
}
// mbarrier.arrive.expect_tx: the phase also waits for `bytes` more of bulk copies.
inline void mbarrier_arrive_expect_tx(unsigned address, unsigned bytes) {
    Mbarrier* m = mbarrier_at(address);
    if (m == nullptr) return;
    m->transactions += bytes;
    mbarrier_arrive(address);
}

// The simulator's tensor map: what the host encodes in the 128 bytes of a CUtensorMap
// (tests/simulator's encode_tensor_map writes it; the driver's format is opaque). A
// tiled map of a 4-dimensional tensor, dimension 0 innermost and contiguous.
struct SimTensorMap {
    unsigned long long base;
    unsigned long long dims[4];
    unsigned long long strides[4];  // bytes; [0] is the element size
    unsigned box[4];
    unsigned swizzle128;  // 1: the 128-byte swizzle
    unsigned magic;       // kTensorMapMagic: a map the host encoded
};
constexpr unsigned kTensorMapMagic = 0x7e450a9u;
static_assert(sizeof(SimTensorMap) <= 128, "a tensor map is 128 bytes");

// cp.async.bulk.tensor.4d ... mbarrier::complete_tx::bytes: the box at coordinates c
// (element units, dimension 0 first) lands at `dst` row by row (rows of box[0]
// elements, each 16-byte chunk moved by the 128-byte swizzle: XOR with address bits
// 7-9), elements outside the tensor as zeros; the copies join the barrier's phase
// and land when a waiter sees it complete; the box's bytes complete its count.
inline void tma_load_4d(unsigned dst, unsigned long long map_address, int c0, int c1, int c2,
                        int c3, unsigned bar) {
    const SimTensorMap& map = *reinterpret_cast<const SimTensorMap*>(map_address);
    Mbarrier* m = mbarrier_at(bar);
    if (m == nullptr) return;
    if (map.magic != kTensorMapMagic) {
        failure = "a bulk tensor copy through a tensor map the host did not encode";
        return;
    }
    const unsigned long long element = map.strides[0], row_bytes = map.box[0] * element;
    if (dst % 128 || row_bytes % 16 || (map.swizzle128 && row_bytes != 128)) {
        failure = "a bulk tensor copy's box or destination the hardware refuses";
        return;
    }
    const int coords[4] = {c0, c1, c2, c3};
    unsigned long long offset = 0;
    for (unsigned i3 = 0; i3 < map.box[3]; ++i3)
        for (unsigned i2 = 0; i2 < map.box[2]; ++i2)
            for (unsigned i1 = 0; i1 < map.box[1]; ++i1) {
                const long long at[4] = {0, coords[1] + static_cast<long long>(i1),
                                         coords[2] + static_cast<long long>(i2),
                                         coords[3] + static_cast<long long>(i3)};
                bool inside = true;
                unsigned long long row = map.base;
                for (int d = 1; d < 4; ++d) {
                    inside = inside && at[d] >= 0 && at[d] < static_cast<long long>(map.dims[d]);
                    row += at[d] * map.strides[d];
                }
                for (unsigned long long chunk = 0; chunk < row_bytes; chunk += 16, offset += 16) {
                    const long long first = c0 + static_cast<long long>(chunk / element);
                    long long valid = 0;  // elements of the chunk inside dimension 0
                    if (inside && first >= 0)
                        valid = std::min<long long>(16 / element,
                                                    static_cast<long long>(map.dims[0]) - first);
                    unsigned address = dst + static_cast<unsigned>(offset);
                    if (map.swizzle128) address ^= ((address >> 7) & 7u) << 4;
                    const void* src = reinterpret_cast<const void*>(row + first * element);
                    m->attached.push_back(
                        PendingCopy{shared_pointer(address), src, 16,
                                    static_cast<int>(std::max(0ll, valid) * element)});
                }
            }
    ++progress;
    m->transactions -= static_cast<long long>(offset);
    mbarrier_complete_if_done(m);
}
// cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group: the float32 box
// of the map at coordinates c += the box at `src` (rows of box[0] elements, each
// 16-byte chunk moved by the 128-byte swizzle), elements outside the tensor skipped;
// held in the thread's open bulk group and applied when the thread waits for it.
inline void bulk_tensor_reduce_add_4d(unsigned long long map_address, int c0, int c1, int c2,
                                      int c3, unsigned src) {
    const SimTensorMap& map = *reinterpret_cast<const SimTensorMap*>(map_address);
    if (map.magic != kTensorMapMagic) {
        failure = "a bulk tensor reduction through a tensor map the host did not encode";
        return;
    }
    if (map.strides[0] != 4 || src % 1024 || map.box[0] * 4 != 128) {
        failure = "a bulk tensor reduction's box or source the simulator does not model";
        return;
    }
    shared_pointer(src);
    PendingReduce r{nullptr, nullptr, 0};
    r.map = map_address;
    r.coords[0] = c0;
    r.coords[1] = c1;
    r.coords[2] = c2;
    r.coords[3] = c3;
    r.src_address = src;
    current->reduces.push_back(r);
}
inline void reduce_tensor_box(const PendingReduce& r) {
    const SimTensorMap& map = *reinterpret_cast<const SimTensorMap*>(r.map);
    unsigned long long offset = 0;
    for (unsigned i3 = 0; i3 < map.box[3]; ++i3)
        for (unsigned i2 = 0; i2 < map.box[2]; ++i2)
            for (unsigned i1 = 0; i1 < map.box[1]; ++i1) {
                const long long at[4] = {0, r.coords[1] + static_cast<long long>(i1),
                                         r.coords[2] + static_cast<long long>(i2),
                                         r.coords[3] + static_cast<long long>(i3)};
                bool inside = true;
                unsigned long long row = map.base;
                for (int d = 1; d < 4; ++d) {
                    inside = inside && at[d] >= 0 && at[d] < static_cast<long long>(map.dims[d]);
                    row += at[d] * map.strides[d];
                }
                for (unsigned e = 0; e < map.box[0]; ++e, offset += 4) {
                    const long long col = r.coords[0] + static_cast<long long>(e);
                    unsigned address = r.src_address + static_cast<unsigned>(offset);
                    address ^= ((address >> 7) & 7u) << 4;
                    if (!inside || col < 0 || col >= static_cast<long long>(map.dims[0])) continue;
                    float value;
                    memcpy(&value, shared_pointer(address), 4);
                    reinterpret_cast<float*>(row)[col] += value;
                }
            }
}
inline void land(const PendingCopy& c) {
    if (c.valid_bytes > 0) memcpy(c.dst, c.src, c.valid_bytes);
    memset(static_cast<unsigned char*>(c.dst) + c.valid_bytes, 0, c.bytes - c.valid_bytes);
}
// cp.async.mbarrier.arrive.noinc: every cp.async of this thread so far, committed
// or not, joins the barrier's phase, and the thread arrives.
inline void cp_async_mbarrier_arrive(unsigned address) {
    Mbarrier* m = mbarrier_at(address);
    if (m == nullptr) return;
    for (auto& group : current->groups)
        m->attached.insert(m->attached.end(), group.begin(), group.end());
    m->attached.insert(m->attached.end(), current->copies.begin(), current->copies.end());
    current->groups.clear();
    current->copies.clear();
    mbarrier_arrive(address);
}
inline void mbarrier_wait(unsigned address, unsigned parity) {
    Mbarrier* m = mbarrier_at(address);
    if (m == nullptr) return;
    while ((m->phase & 1u) == (parity & 1u)) yield();
    for (const PendingCopy& c : m->completed) land(c);
    m->completed.clear();
}
inline void bar_sync(unsigned id, unsigned threads) {
    NamedBarrier& b = named_barriers[id % 16];
    const unsigned generation = b.generation;
    bar_arrive(id, threads);
    while (b.generation == generation) yield();
}

// An element of a wgmma operand in shared memory through its matrix descriptor
// (start address, leading and stride byte offsets, 128-byte swizzle): K-major,
// element (row, k) of a [rows][16] operand (8-row groups SBO apart, rows 128
// bytes apart); MN-major, element (k, mn) (64-element blocks of MN LBO apart,
// 8-k groups SBO apart, k rows 128 bytes apart). The swizzle XORs the 16-byte
// chunk with the row within its 1024-byte atom.
struct Descriptor {
    unsigned start, lead, stride;
    bool swizzle128;
    explicit Descriptor(unsigned long long d)
        : start(static_cast<unsigned>(d & 0x3fff) << 4),
          lead(static_cast<unsigned>((d >> 16) & 0x3fff) << 4),
          stride(static_cast<unsigned>((d >> 32) & 0x3fff) << 4),
          swizzle128((d >> 62) == 1) {
        if (!swizzle128) failure = "a wgmma descriptor without the 128-byte swizzle";
    }
    static unsigned swizzled(unsigned a) { return a ^ (((a >> 7) & 7u) << 4); }
    unsigned k_major(int row, int k, int element_bytes = 2) const {
        return swizzled(start + (row / 8) * stride + (row % 8) * 128 + element_bytes * k);
    }
    unsigned mn_major(int k, int mn) const {
        return swizzled(start + (mn / 64) * lead + (k / 8) * stride + (k % 8) * 128 +
                        2 * (mn % 64));
    }
};
template <bool BF16>
inline float shared_element(unsigned address) {
    unsigned short bits;
    memcpy(&bits, shared_pointer(address), 2);
    return BF16 ? bf16_to_float(bits) : half_to_float(bits);
}

// This thread's accumulators (`rank` in the warpgroup; n8 tile j, element e: row 16
// warp + g + 8 (e >> 1), column 8 j + 2 t + (e & 1)) of D (64 x N) (+)= A (64 x K, the
// warpgroup's, gathered) B, element (k, column) of B from `b_of`; the products summed
// in float64.
template <int N, int K, typename BOf>
inline void wgmma_accumulate(float* const* d, int rank, const float (&a)[64][K], BOf b_of,
                             bool accumulate) {
    const int warp = rank / 32, g = (rank % 32) / 4, t = rank % 4;
    for (int j = 0; j < N / 8; ++j)
        for (int e = 0; e < 4; ++e) {
            const int row = 16 * warp + g + 8 * (e >> 1), col = 8 * j + 2 * t + (e & 1);
            double sum = 0;
            for (int k = 0; k < K; ++k) sum += static_cast<double>(a[row][k]) * b_of(k, col);
            float* out = d[4 * j + e];
            *out = static_cast<float>(accumulate ? *out + sum : sum);
        }
}

// wgmma.mma_async m64nNk16 with float32 accumulators on the warpgroup: D (64 x N)
// (+)= A (64 x 16) B (16 x N). `d`: this thread's N / 2 accumulators in the
// operand order (n8 tile j, element e: row 16 warp + g + 8 (e >> 1), column 8 j +
// 2 t + (e & 1)); A from shared memory (`a_desc`, K-major or, TRANS_A, M-major) or
// from registers (`a_regs`: each warp its 16 rows in the mma.sync A layout); B
// K-major or, TRANS_B, N-major.
template <int N, bool BF16, bool A_REGISTERS, bool TRANS_A, bool TRANS_B>
inline void wgmma(float* const* d, const unsigned (&a_regs)[4], unsigned long long a_desc,
                  unsigned long long b_desc, bool accumulate) {
    struct Offer {
        unsigned a[4];
    };
    Offer mine;
    memcpy(mine.a, a_regs, sizeof(mine.a));
    warpgroup_collective(mine, [&](int rank, auto offer) {
        const Descriptor a_layout(A_REGISTERS ? b_desc : a_desc), b_layout(b_desc);
        float a[64][16];
        for (int r = 0; r < 64; ++r)
            for (int k = 0; k < 16; ++k) {
                if (A_REGISTERS) {
                    const unsigned x = offer(32 * (r / 16) + 4 * (r % 8) + (k % 8) / 2)
                                           .a[((r % 16) >= 8) + 2 * (k >= 8)];
                    const unsigned short bits =
                        static_cast<unsigned short>(k % 2 ? x >> 16 : x & 0xffffu);
                    a[r][k] = BF16 ? bf16_to_float(bits) : half_to_float(bits);
                } else {
                    a[r][k] = shared_element<BF16>(TRANS_A ? a_layout.mn_major(k, r)
                                                           : a_layout.k_major(r, k));
                }
            }
        wgmma_accumulate<N>(
            d, rank, a,
            [&](int k, int col) {
                return shared_element<BF16>(TRANS_B ? b_layout.mn_major(k, col)
                                                    : b_layout.k_major(col, k));
            },
            accumulate);
        return 0;
    });
}

// wgmma.mma_async m64nNk32 .e4m3.e4m3 with float32 accumulators: as wgmma above with
// k32 steps of one-byte elements, both operands K-major; A from registers in the 8-bit
// layout (each warp its 16 rows: register (r >= 8) + 2 (k >= 16) of lane 4 (r % 8) +
// (k % 16) / 4, byte k % 4).
template <int N, bool A_REGISTERS>
inline void wgmma_e4m3(float* const* d, const unsigned (&a_regs)[4], unsigned long long a_desc,
                       unsigned long long b_desc, bool accumulate) {
    struct Offer {
        unsigned a[4];
    };
    Offer mine;
    memcpy(mine.a, a_regs, sizeof(mine.a));
    warpgroup_collective(mine, [&](int rank, auto offer) {
        const Descriptor a_layout(A_REGISTERS ? b_desc : a_desc), b_layout(b_desc);
        float a[64][32];
        for (int r = 0; r < 64; ++r)
            for (int k = 0; k < 32; ++k) {
                unsigned char bits;
                if (A_REGISTERS) {
                    const unsigned x = offer(32 * (r / 16) + 4 * (r % 8) + (k % 16) / 4)
                                           .a[((r % 16) >= 8) + 2 * (k >= 16)];
                    bits = static_cast<unsigned char>(x >> (8 * (k % 4)));
                } else {
                    memcpy(&bits, shared_pointer(a_layout.k_major(r, k, 1)), 1);
                }
                a[r][k] = e4m3_to_float(bits);
            }
        wgmma_accumulate<N>(
            d, rank, a,
            [&](int k, int col) {
                unsigned char bits;
                memcpy(&bits, shared_pointer(b_layout.k_major(col, k, 1)), 1);
                return e4m3_to_float(bits);
            },
            accumulate);
        return 0;
    });
}

// ---- launches ----------------------------------------------------------------------

inline void fiber_entry(unsigned lo, unsigned hi) {
    auto* body = reinterpret_cast<std::function<void()>*>(static_cast<uintptr_t>(lo) |
                                                          (static_cast<uintptr_t>(hi) << 32));
    (*body)();
    ++progress;
    if (!current->reduces.empty() || !current->reduce_groups.empty())
        failure = "a thread exits with bulk reductions it has not waited for";
    current->done = true;
    leave(block_barrier);
    leave(warps[current->warp].barrier);
    leave(warpgroups[current->tid.x / 128].barrier);
    // returns to uc_link: the scheduler
}

inline void on_fault(int, siginfo_t* info, void*) {
    fault_address = reinterpret_cast<uintptr_t>(info->si_addr);
    siglongjmp(fault_recovery, 1);
}

// Memory of `bytes` whose end lies against an inaccessible page (and whose first page
// follows one), 16-byte aligned: a kernel's access past an argument's end faults.
inline void* guarded_alloc(size_t bytes) {
    const size_t page = 4096, data = (bytes + 15) / 16 * 16, pages = (data + page - 1) / page;
    unsigned char* base = static_cast<unsigned char*>(mmap(
        nullptr, (pages + 2) * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (base == MAP_FAILED) return nullptr;
    mprotect(base, page, PROT_NONE);
    mprotect(base + (pages + 1) * page, page, PROT_NONE);
    return base + (pages + 1) * page - data;
}
inline void guarded_free(void* p, size_t bytes) {
    const size_t page = 4096, data = (bytes + 15) / 16 * 16, pages = (data + page - 1) / page;
    unsigned char* base = static_cast<unsigned char*>(p) + data - (pages + 1) * page;
    munmap(base, (pages + 2) * page);
}

// Runs `thread_body()` as every thread of every block of the grid; returns 0, 1 with
// `failure` set (a deadlock, an address outside shared memory), or 2 when an access
// faulted (`fault_address`).
template <typename F>
inline int run_grid(dim3 grid, dim3 block, size_t shared_bytes, F&& thread_body) {
    const int threads = static_cast<int>(block.x * block.y * block.z);
    if (threads % 32 != 0 || block.y != 1 || block.z != 1) {
        failure = "blocks of whole warps along x only";
        return 1;
    }
    failure = nullptr;
    grid_dim = grid;
    block_dim = block;
    shared_capacity = std::max<size_t>(shared_bytes, 16);
    void* shared =
        mmap(nullptr, shared_capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) {
        failure = "no memory for the block's shared memory";
        return 1;
    }
    shared_memory = static_cast<unsigned char*>(shared);
    fibers.assign(threads, Fiber{});
    for (Fiber& f : fibers)
        f.stack = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    std::function<void()> body = thread_body;
    const uintptr_t body_address = reinterpret_cast<uintptr_t>(&body);
    volatile int status = 0;
    struct sigaction on_segv = {}, before_segv, before_bus;
    on_segv.sa_sigaction = on_fault;
    on_segv.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigaction(SIGSEGV, &on_segv, &before_segv);
    sigaction(SIGBUS, &on_segv, &before_bus);
    if (sigsetjmp(fault_recovery, 1)) {
        failure = "an access faulted";
        status = 2;
    }
    for (unsigned z = 0; z < grid.z && !status; ++z)
        for (unsigned y = 0; y < grid.y && !status; ++y)
            for (unsigned x = 0; x < grid.x && !status; ++x) {
                block_idx = dim3{x, y, z};
                memset(shared_memory, kSharedPoison, shared_capacity);
                block_barrier = Barrier{threads, 0, 0};
                warps.assign(threads / 32, Warp{});
                for (Warp& w : warps) w.barrier = Barrier{32, 0, 0};
                warpgroups.assign((threads + 127) / 128, Warpgroup{});
                for (size_t i = 0; i < warpgroups.size(); ++i)
                    warpgroups[i].barrier =
                        Barrier{std::min(128, threads - 128 * static_cast<int>(i)), 0, 0};
                for (NamedBarrier& b : named_barriers) b = NamedBarrier{};
                mbarriers.clear();
                for (int i = 0; i < threads; ++i) {
                    Fiber& f = fibers[i];
                    f.tid = dim3{static_cast<unsigned>(i), 0, 0};
                    f.lane = i % 32;
                    f.warp = i / 32;
                    f.done = false;
                    f.copies.clear();
                    f.groups.clear();
                    f.reduces.clear();
                    f.reduce_groups.clear();
                    getcontext(&f.context);
                    f.context.uc_stack.ss_sp = f.stack;
                    f.context.uc_stack.ss_size = kStackBytes;
                    f.context.uc_link = &scheduler_context;
                    makecontext(&f.context, reinterpret_cast<void (*)()>(fiber_entry), 2,
                                static_cast<unsigned>(body_address & 0xffffffffu),
                                static_cast<unsigned>(body_address >> 32));
                }
                for (int live = threads; live > 0 && !status;) {
                    const long long before = progress;
                    live = 0;
                    for (Fiber& f : fibers) {
                        if (f.done) continue;
                        current = &f;
                        swapcontext(&scheduler_context, &f.context);
                        live += !f.done;
                        if (failure) status = 1;
                    }
                    if (live > 0 && progress == before && !status) {
                        failure = "deadlock: every live thread waits at a barrier";
                        status = 1;
                    }
                }
            }
    sigaction(SIGSEGV, &before_segv, nullptr);
    sigaction(SIGBUS, &before_bus, nullptr);
    for (Fiber& f : fibers) munmap(f.stack, kStackBytes);
    munmap(shared, shared_capacity);
    current = nullptr;
    return status;
}

// A kernel launch as cuLaunchKernel takes it: `params[i]` points at argument i.
template <typename... Args, size_t... I>
inline int launch_with(void (*kernel)(Args...), dim3 grid, dim3 block, size_t shared_bytes,
                       void** params, std::index_sequence<I...>) {
    return run_grid(grid, block, shared_bytes, [&]() {
        kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<Args>>*>(params[I])...);
    });
}
template <typename... Args>
inline int launch(void (*kernel)(Args...), dim3 grid, dim3 block, size_t shared_bytes,
                  void** params) {
    return launch_with(kernel, grid, block, shared_bytes, params,
                       std::index_sequence_for<Args...>{});
}

// A kernel launch from one parameter buffer, as cuLaunchKernel's `extra` passes it
// (CU_LAUNCH_PARAM_BUFFER_POINTER): argument i at the next multiple of its alignment
// after argument i - 1 ends. A buffer whose `size` is not where the last argument
// ends was laid out for other parameters: the launch fails.
template <typename... Args, size_t... I>
inline int launch_buffer_with(void (*kernel)(Args...), dim3 grid, dim3 block, size_t shared_bytes,
                              const unsigned char* buffer, size_t size, std::index_sequence<I...>) {
    using Values = std::tuple<std::remove_cv_t<Args>...>;
    size_t offsets[sizeof...(Args) + 1] = {}, end = 0;
    ((end = (end + alignof(std::tuple_element_t<I, Values>) - 1) /
            alignof(std::tuple_element_t<I, Values>) * alignof(std::tuple_element_t<I, Values>),
      offsets[I] = end, end += sizeof(std::tuple_element_t<I, Values>)),
     ...);
    if (end != size) {
        static char message[128];
        snprintf(message, sizeof message,
                 "a parameter buffer of %zu bytes for parameters that end at byte %zu", size, end);
        failure = message;
        return 1;
    }
    Values values;
    (memcpy(&std::get<I>(values), buffer + offsets[I], sizeof(std::tuple_element_t<I, Values>)),
     ...);
    return run_grid(grid, block, shared_bytes, [&]() { kernel(std::get<I>(values)...); });
}
template <typename... Args>
inline int launch_buffer(void (*kernel)(Args...), dim3 grid, dim3 block, size_t shared_bytes,
                         const void* buffer, size_t size) {
    return launch_buffer_with(kernel, grid, block, shared_bytes,
                              static_cast<const unsigned char*>(buffer), size,
                              std::index_sequence_for<Args...>{});
}

}  // namespace sim
