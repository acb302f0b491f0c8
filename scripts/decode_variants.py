"""Time the tensor-core decode kernel's tile variants on the decode benchmark's cases.

Usage: python scripts/decode_variants.py [--variants 64x2,64x3,32x4] [--splits N]
       [--smem-floor BYTES] [--cases 0,1] [--warm] [--fp8 bfloat16|float16|e4m3]

Each variant is ``keys x stages`` of ``kvcache_decode_tc`` (keys a K/V tile, tiles in
the pipeline); ``--splits`` forces the split count, ``--smem-floor`` asks for more shared
memory a block (fewer blocks an SM), ``--warm`` only compiles the kernels (in parallel;
CuPy keeps them on disk). bfloat16, D = 128, 32 query heads on 8 KV heads, one new row
appended a step, lengths on the device (the cache full after the append); GPU time a
call of back-to-back calls. ``--fp8 Q``: the cache (and the appended rows) rounded to
e4m3 (the FP8 page), q in Q; TB/s of the e4m3 bytes.
"""

import argparse

import cupy
import ml_dtypes
import numpy as np

from cuflash.bench.decode import e4m3_bits
from cuflash.gpu import decode_kernels, plans, standalone
from cuflash.gpu.decode_kernels import decode_tc_name
from cuflash.gpu.decode_tiles import decode_tc_shape
from cuflash.kvcache import flash_attention_with_kvcache

CASES = [
    (1, 32768, 0, 1),
    (16, 8192, 0, 1),
    (64, 2048, 0, 1),
    (256, 512, 0, 1),
    (1, 32768, 16, 1),
    (16, 8192, 16, 1),
    (64, 2048, 16, 1),
    (256, 512, 16, 1),
    (16, 8192, 256, 1),
    (16, 8192, 0, 4),
    (1, 8192, 0, 1),
    (4, 8192, 0, 1),
]
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def inputs(batch, keys, block_size, q_len, rng, fp8=None):
    device_rng = cupy.random.default_rng(int(rng.integers(2**31)))

    def normal(shape):
        x = device_rng.standard_normal(shape, dtype=np.float32)
        return e4m3_bits(x) if fp8 else x.astype(ml_dtypes.bfloat16)

    table = None
    if block_size:
        blocks = keys // block_size
        shape = (batch * blocks, KV_HEADS, block_size, HEAD_DIM)
        table = cupy.asarray(
            rng.permutation(batch * blocks).reshape(batch, blocks).astype(np.int32)
        )
    else:
        shape = (batch, KV_HEADS, keys, HEAD_DIM)
    k_cache, v_cache = normal(shape), normal(shape)
    q = normal((batch, HEADS, q_len, HEAD_DIM))
    if fp8 not in (None, "e4m3"):
        dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[fp8]
        q = device_rng.standard_normal(q.shape, dtype=np.float32).astype(dtype)
    k_new, v_new = (normal((batch, KV_HEADS, q_len, HEAD_DIM)) for _ in "kv")
    lengths = cupy.full(batch, keys - q_len, dtype=np.int32)
    options = {"fp8_format": "e4m3"} if fp8 else {}
    return (q, k_cache, v_cache), dict(
        cache_seqlens=lengths, k_new=k_new, v_new=v_new, block_table=table, **options
    )


def median_us(call, rounds=7, calls=20):
    """GPU microseconds a call: the median over ``rounds`` of ``calls`` back-to-back
    calls between two events (the host enqueues faster than the GPU runs them)."""
    for _ in range(3):
        call()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(rounds):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(calls):
            call()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls)
    return float(np.median(times))


def use_variant(original, keys, stages, smem_floor=0):
    """A ``decode_kernel`` that takes ``kvcache_decode_tc`` with these tiles where
    ``original`` takes the tensor-core kernel."""

    def chosen(problem, capability=80, fp8=None):
        name, k, rows, shared = original(problem, capability, fp8)
        if standalone.standalone_of(name).name != "kvcache_decode_tc":
            return name, k, rows, shared
        row_warps = rows // 16
        k, rows, shared = decode_tc_shape(
            problem.head_dim, row_warps, stages, keys, fp8=fp8 is not None
        )
        name = decode_tc_name(problem, row_warps, stages, keys, fp8)
        return (name, k, rows, max(shared, smem_floor))

    return chosen


def _compile(name):
    from cuflash.gpu.kernel_build import load_standalone

    load_standalone(name)
    return name


def warm(variants):
    """Compile every variant's kernels in parallel processes (CuPy keeps them on disk)."""
    from concurrent.futures import ProcessPoolExecutor

    bf16 = np.dtype(ml_dtypes.bfloat16)
    kernels = standalone.STANDALONE
    names = [
        kernels["kvcache_append"].name_expression(dtype=bf16),
        kernels["kvcache_combine"].name_expression(dtype=bf16, head_dim=HEAD_DIM),
    ]
    names += [
        kernels["kvcache_decode_tc"].name_expression(
            dtype=bf16,
            head_dim=HEAD_DIM,
            row_warps=1,
            stages=stages,
            keys=keys,
            paged=paged,
            narrow=narrow,
        )
        for _, keys, stages in variants
        for paged in (False, True)
        for narrow in (False, True)
    ]
    with ProcessPoolExecutor(len(names)) as pool:
        for name in pool.map(_compile, names):
            print("compiled", name, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="64x2,64x3,32x4")
    parser.add_argument("--warm", action="store_true", help="only compile the kernels")
    parser.add_argument("--fp8", default=None, help="an e4m3 cache, q of this dtype")
    parser.add_argument(
        "--cases", default=None, help="comma-separated indices into CASES (default: every case)"
    )
    parser.add_argument(
        "--splits",
        type=int,
        default=None,
        help="force this many splits of each sequence's keys (at most its tiles)",
    )
    parser.add_argument(
        "--smem-floor",
        type=int,
        default=0,
        help="request at least this much shared memory a block (fewer blocks an SM)",
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    variants = [(v, *map(int, v.split("x"))) for v in args.variants.split(",")]
    if args.warm:
        warm(variants)
        return
    original_decode = decode_kernels.decode_kernel
    if args.splits:
        decode_kernels.num_splits = lambda blocks, slots, tiles, cap: min(args.splits, tiles)
    print("case (B, keys, block size, S_q) | " + " | ".join(v[0] for v in variants))
    cases = CASES if args.cases is None else [CASES[int(i)] for i in args.cases.split(",")]
    for case in cases:
        arrays, kwargs = inputs(*case, rng, args.fp8)
        cache_bytes = 2 * arrays[1].nbytes
        row = []
        for _, keys, stages in variants:
            decode_kernels.decode_kernel = use_variant(
                original_decode, keys, stages, args.smem_floor
            )
            plans.clear()

            def call():
                flash_attention_with_kvcache(*arrays, HEADS, KV_HEADS, HEAD_DIM, **kwargs)

            try:
                us = median_us(call)
                row.append(f"{us:7.1f} us {cache_bytes / us / 1e6:4.2f} TB/s")
            except Exception as error:  # a variant that does not fit: say so, go on
                row.append(f"failed: {type(error).__name__}: {str(error)[:60]}")
        decode_kernels.decode_kernel = original_decode
        print(case, "|", " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
