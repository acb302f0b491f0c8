"""Read bandwidth of the decode kernel's cache access, by load mechanism, without its math.

Usage: python scripts/decode_stream.py [--spin N] [--cases 16x8192x2,64x2048x1]
       [--blocks-per-sm 0,2,3]

Each block streams one split of one (sequence, KV head)'s keys and values, float16 bits,
D = 128, [B, H_kv, L, D] contiguous (the decode benchmark's cache; a case is
B x keys x splits), in tiles of BN rows into shared memory, and does ``spin`` dependent
FMAs a tile a thread in place of the attention math. Mechanisms:

- ``cp.async``: 16-byte cp.async by every thread, padded rows (the decode kernel's
  loads), a barrier a tile; with the L2 prefetch-size or eviction hints named;
- ``bulk rows``: one producer warp issues one cp.async.bulk a row into padded rows,
  consumer warps wait on a full mbarrier a stage and release it on an empty one;
- ``bulk tile``: the same with one bulk copy a K or V tile (unpadded rows);
- ``linear ld``: the read ceiling, K then V read as flat arrays by every thread of a
  grid-stride loop (nothing to shared memory).

Cache bytes read per second (K and V) next to a device-to-device copy of K.
"""

import argparse

import cupy
import numpy as np
from decode_variants import median_us as time_us  # the same GPU-time median

SOURCE = r"""
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
template <int HINT>
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
    if constexpr (HINT == 0) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(smem_addr(dst)), "l"(src));
    } else if constexpr (HINT == 128) {
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n"
                     :: "r"(smem_addr(dst)), "l"(src));
    } else if constexpr (HINT == 256) {
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n"
                     :: "r"(smem_addr(dst)), "l"(src));
    } else {  // evict-first policy, 256-byte prefetch
        unsigned long long policy;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
        asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2;\n"
                     :: "r"(smem_addr(dst)), "l"(src), "l"(policy));
    }
}
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile("{\n .reg .pred done;\n wait:\n"
                 " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra wait;\n}\n" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes,
                                          unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ float spin_chain(float x, int spin) {
    for (int i = 0; i < spin; ++i) x = fmaf(x, 0.999f, 0.5f);
    return x;
}

template <int STAGES, int BN, int CH, int THREADS, int HINT>
__global__ void __launch_bounds__(THREADS) stream_cp_async(
    const uint4* __restrict__ k, const uint4* __restrict__ v, float* __restrict__ sink,
    int keys, int splits, int spin) {
    extern __shared__ __align__(16) uint4 smem[];
    constexpr int PITCH = CH + 1, TILE = BN * PITCH;
    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const long long head = (static_cast<long long>(b) * gridDim.y + h) * keys * CH;
    const int tiles = keys / BN, per = (tiles + splits - 1) / splits;
    const int first = min(tiles, split * per), count = min(tiles, first + per) - first;
    const uint4* kh = k + head;
    const uint4* vh = v + head;
    auto load = [&](int stage, int step) {
        uint4* kd = smem + 2 * stage * TILE;
        uint4* vd = kd + TILE;
        const long long base = static_cast<long long>(first + step) * BN * CH;
#pragma unroll
        for (int i = threadIdx.x; i < BN * CH; i += THREADS) {
            const int n = i / CH, c = i % CH;
            cp_async_16<HINT>(kd + n * PITCH + c, kh + base + i);
            cp_async_16<HINT>(vd + n * PITCH + c, vh + base + i);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < count) load(st, st);
        else asm volatile("cp.async.commit_group;\n" ::);
    }
    float acc = 0.f;
    for (int step = 0; step < count; ++step) {
        asm volatile("cp.async.wait_group %0;\n" :: "n"(STAGES - 2));
        __syncthreads();
        if (step + STAGES - 1 < count) load((step + STAGES - 1) % STAGES, step + STAGES - 1);
        else asm volatile("cp.async.commit_group;\n" ::);
        const uint4* kt = smem + 2 * (step % STAGES) * TILE;
        const uint4 x = kt[(threadIdx.x % BN) * PITCH + (threadIdx.x / BN) % CH];
        acc = spin_chain(acc + __uint_as_float(x.x & 0x3f800000u), spin);
    }
    if (acc == 1234.5f) sink[0] = acc;
}

// The read ceiling: every thread reads UNROLL 16-byte chunks a pass over K then V as
// flat arrays (grid-stride), nothing to shared memory.
template <int UNROLL, int HINT>
__global__ void __launch_bounds__(256) stream_linear(const uint4* __restrict__ k,
                                                     const uint4* __restrict__ v,
                                                     float* __restrict__ sink, long long chunks) {
    unsigned acc = 0;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x * UNROLL;
    for (int which = 0; which < 2; ++which) {
        const uint4* src = which ? v : k;
        for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x * UNROLL + threadIdx.x;
             i < chunks; i += stride) {
            uint4 x[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const long long j = i + u * blockDim.x;
                if (j < chunks) {
                    if constexpr (HINT == 256) {
                        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                                     : "=r"(x[u].x), "=r"(x[u].y), "=r"(x[u].z), "=r"(x[u].w)
                                     : "l"(src + j));
                    } else {
                        x[u] = __ldg(src + j);
                    }
                } else {
                    x[u] = make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) acc ^= x[u].x ^ x[u].w;
        }
    }
    if (acc == 0x12345u) sink[0] = 1.f;
}

// CONSUMERS warps wait on full[stage]; warp CONSUMERS loads. ROWS: one bulk copy a
// row (padded rows), else one a tile (unpadded).
template <int STAGES, int BN, int CH, int CONSUMERS, bool ROWS>
__global__ void __launch_bounds__(32 * (CONSUMERS + 1)) stream_bulk(
    const uint4* __restrict__ k, const uint4* __restrict__ v, float* __restrict__ sink,
    int keys, int splits, int spin) {
    extern __shared__ __align__(128) uint4 smem[];
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    constexpr int PITCH = ROWS ? CH + 1 : CH, TILE = BN * PITCH;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const long long head = (static_cast<long long>(b) * gridDim.y + h) * keys * CH;
    const int tiles = keys / BN, per = (tiles + splits - 1) / splits;
    const int first = min(tiles, split * per), count = min(tiles, first + per) - first;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], CONSUMERS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp == CONSUMERS) {
        for (int step = 0; step < count; ++step) {
            const int stage = step % STAGES, round = step / STAGES;
            if (round > 0) mbar_wait(&empty[stage], (round - 1) & 1);
            if (lane == 0) mbar_expect(&full[stage], 2 * BN * CH * 16);
            __syncwarp();
            uint4* kd = smem + 2 * stage * TILE;
            uint4* vd = kd + TILE;
            const long long base = head + static_cast<long long>(first + step) * BN * CH;
            if (ROWS) {
                for (int n = lane; n < BN; n += 32) {
                    bulk_copy(kd + n * PITCH, k + base + n * CH, CH * 16, &full[stage]);
                    bulk_copy(vd + n * PITCH, v + base + n * CH, CH * 16, &full[stage]);
                }
            } else if (lane == 0) {
                bulk_copy(kd, k + base, BN * CH * 16, &full[stage]);
                bulk_copy(vd, v + base, BN * CH * 16, &full[stage]);
            }
        }
    } else {
        float acc = 0.f;
        for (int step = 0; step < count; ++step) {
            const int stage = step % STAGES;
            mbar_wait(&full[stage], (step / STAGES) & 1);
            const uint4* kt = smem + 2 * stage * TILE;
            const uint4 x = kt[(threadIdx.x % BN) * PITCH + (threadIdx.x / BN) % CH];
            acc = spin_chain(acc + __uint_as_float(x.x & 0x3f800000u), spin);
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[stage]);
        }
        if (acc == 1234.5f) sink[0] = acc;
    }
}
"""

CH = 16  # D = 128 in 16-byte chunks
VARIANTS = {  # name: (template, threads, stages, keys a tile)
    "cp.async 2st": ("stream_cp_async<2, 64, 16, 128, 0>", 128, 2, 64),
    "cp.async 3st": ("stream_cp_async<3, 64, 16, 128, 0>", 128, 3, 64),
    "cp.async 3st L2::128B": ("stream_cp_async<3, 64, 16, 128, 128>", 128, 3, 64),
    "cp.async 3st L2::256B": ("stream_cp_async<3, 64, 16, 128, 256>", 128, 3, 64),
    "cp.async 3st evict-first": ("stream_cp_async<3, 64, 16, 128, 1>", 128, 3, 64),
    "cp.async 2st BN128 L2::128B": ("stream_cp_async<2, 128, 16, 128, 128>", 128, 2, 128),
    "cp.async 4st BN32 L2::128B": ("stream_cp_async<4, 32, 16, 128, 128>", 128, 4, 32),
    "bulk rows 3st": ("stream_bulk<3, 64, 16, 4, true>", 160, 3, 64),
    "bulk tile 4st": ("stream_bulk<4, 64, 16, 4, false>", 160, 4, 64),
}
LINEAR = {
    "linear ld 4x": "stream_linear<4, 0>",
    "linear ld 8x": "stream_linear<8, 0>",
    "linear ld 8x L2::256B": "stream_linear<8, 256>",
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--spin", default="100")
    parser.add_argument("--cases", default="16x8192x2,64x2048x1,256x512x1,1x32768x16")
    parser.add_argument(
        "--blocks-per-sm",
        default="0",
        help="0: as the shared memory allows; else pad to fit this many",
    )
    args = parser.parse_args()
    module = cupy.RawModule(
        code=SOURCE,
        options=("-std=c++17", "--gpu-architecture=sm_90a"),
        name_expressions=[v[0] for v in VARIANTS.values()] + list(LINEAR.values()),
    )
    sink = cupy.zeros(1, dtype=np.float32)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    smem_sm = props["sharedMemPerMultiprocessor"]
    for case in args.cases.split(","):
        batch, keys, splits = (int(x) for x in case.split("x"))
        shape = (batch, 8, keys, 128)
        k = cupy.random.standard_normal(shape, dtype=np.float32).astype(cupy.float16)
        v = cupy.random.standard_normal(shape, dtype=np.float32).astype(cupy.float16)
        nbytes = 2 * k.nbytes
        dst = cupy.empty_like(k)
        copy = time_us(lambda: dst.__setitem__(Ellipsis, k))
        print(
            f"\nB={batch} keys={keys} splits={splits}: cache {nbytes / 1e6:.0f} MB; "
            f"d2d copy of K {2 * k.nbytes / copy / 1e6:.2f} TB/s (read+write)"
        )
        del dst
        for spin in (int(s) for s in args.spin.split(",")):
            for name, template in LINEAR.items():
                kernel = module.get_function(template)
                chunks = k.nbytes // 16
                for blocks_per_sm in (4, 8):
                    grid = (props["multiProcessorCount"] * blocks_per_sm,)
                    us = time_us(lambda: kernel(grid, (256,), (k, v, sink, np.int64(chunks))))
                    print(
                        f"  {name:30s} {blocks_per_sm} blocks/SM: {us:8.1f} us "
                        f"{nbytes / us / 1e6:5.2f} TB/s"
                    )
            for name, (template, threads, stages, BN) in VARIANTS.items():
                pitch = CH + 1 if ("rows" in name or "cp.async" in name) else CH
                tiles_bytes = 2 * stages * BN * pitch * 16
                for per_sm in (int(x) for x in args.blocks_per_sm.split(",")):
                    shared = tiles_bytes
                    if per_sm:
                        want = smem_sm // per_sm - 1024 - 64
                        if want < tiles_bytes:
                            continue
                        shared = want
                    kernel = module.get_function(template)
                    kernel.max_dynamic_shared_size_bytes = shared
                    fits = smem_sm // (shared + 1024 + 64)
                    grid = (splits, 8, batch)
                    us = time_us(
                        lambda: kernel(
                            grid,
                            (threads,),
                            (k, v, sink, np.int32(keys), np.int32(splits), np.int32(spin)),
                            shared_mem=shared,
                        )
                    )
                    print(
                        f"  spin {spin:4d} {name:30s} {fits} blocks/SM: {us:8.1f} us "
                        f"{nbytes / us / 1e6:5.2f} TB/s"
                    )
        del k, v


if __name__ == "__main__":
    main()
