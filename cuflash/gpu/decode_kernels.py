"""The GPU kernels of a KV-cache call (the KV-cache page): which split-KV kernel serves it
(``kvcache_decode_tc``, ``kvcache_decode`` or ``kvcache_decode_mla``, with its tiles and
shared memory), the append's and the combine's instantiations, the split count, and
each kernel loaded once a device. :mod:`cuflash.gpu.kvcache` launches them; the tile
shapes mirror the kernels' own (:mod:`cuflash.gpu.decode_tiles`).
"""

import functools

import cupy
import numpy as np

from . import standalone
from .decode_tiles import (
    MLA_STAGES,
    MLA_WGMMA_KEYS,
    MLA_WGMMA_ROWS,
    THREADS,
    block_shared_limit,
    decode_mla_keys,
    decode_mla_shape,
    decode_mla_wgmma_shape,
    decode_shape,
    decode_tc_keys,
    decode_tc_shape,
)
from .kernel_build import load_standalone
from .kernel_launch import modifier_compile_errors

ROW_TILES = (1, 2, 4, 8)  # packed query rows a decode block may hold (RM)
NARROW_ROWS = 8  # packed query rows the narrow tensor-core decode kernel takes
MAX_SPLITS = 128  # kMaxSplits of kernels/decode/kvcache_combine.cu: a thread a split
MIN_KEYS_PER_SPLIT = 256
BLOCK_START = 2  # a block's start (Q, first tiles) and end, in tiles' worth of time
# K/V tiles in the tensor-core kernel's pipeline: 2 (three blocks an SM up to head_dim
# 128), or 3 (two blocks an SM) for sequences of LONG_CACHE_KEYS keys or more, whose
# blocks stream long enough that two deeper ones an SM read faster (decode_tc_stages).
TC_STAGES = 2
LONG_CACHE_STAGES = 3
LONG_CACHE_KEYS = 2048
# An FP8 cache paged in blocks of fewer keys takes tiles of a 16-bit tile's keys: a warp's
# 16 keys then lie in one block, whose rows copy at fixed offsets, where the 32 of the
# FP8 tile span two and each copy looks up its block (B = 16, 8192 keys in blocks of 16:
# the kernel alone 91 against 120 us on an H200; the call 0.56 of the bfloat16 step's
# time against 0.67 on an H100).
FP8_RUN_BLOCK_KEYS = 32
# An FP8 cache's tiles of twice the keys stream with two in the pipeline at any length: at
# D = 128 (H100) B = 16, 8192 keys 109.7 us against three's 116.1, in blocks of 256 113.0
# against 116.4, 64 x 2048 and B = 1 level (scripts/decode_variants.py --fp8 bfloat16).
FP8_STAGES = 2
# With this many packed query rows (S_q x group) or more and a contiguous cache, the
# dense tensor-core forward serves the call (see _dense_plan).
DENSE_MIN_ROWS = 64
# Absorbed MLA with this many packed query rows or more takes kvcache_decode_mla_wgmma on
# sm_90 (see takes_mla_wgmma): with 16 query heads (a block's 64 rows mostly padding) it
# ran 1.07x-1.37x faster than kvcache_decode_mla (H100, B = 32 and 128, L = 4096 and
# 16384: python scripts/mla_variants.py --wgmma); fewer rows are not measured.
MLA_WGMMA_MIN_ROWS = 16


def decode_tc_stages(head_dim, longest):
    """K/V tiles in the tensor-core kernel's pipeline for sequences of up to ``longest``
    keys (see :data:`LONG_CACHE_KEYS`)."""
    if head_dim <= 128 and longest >= LONG_CACHE_KEYS:
        return LONG_CACHE_STAGES
    return TC_STAGES


def longest_sequence(problem):
    """Keys of the longest sequence after the append: from host-held lengths, else the
    capacity (device-held lengths may be anything up to it)."""
    if problem.host_lengths is not None and problem.batch:
        return int(problem.host_lengths.max()) + problem.new_len
    return problem.capacity


def decode_tc_name(problem, row_warps, stages, keys, fp8=None):
    """The name expression of ``kvcache_decode_tc`` with these tiles for ``problem``: its
    own instantiation for a paged cache, and the narrow one (the query rows as the MMA's
    8-wide N, K and V as its A operand: half the products) where a block's packed query
    rows fit 8; ``fp8``: an FP8 cache's element types (``standalone.E4m3Cache``)."""
    narrow = row_warps == 1 and problem.q_len * problem.group_size <= NARROW_ROWS
    return standalone.STANDALONE["kvcache_decode_tc"].name_expression(
        dtype=problem.dtype if fp8 is None else fp8,
        head_dim=problem.head_dim,
        row_warps=row_warps,
        stages=stages,
        keys=keys,
        paged=problem.paged,
        narrow=narrow,
    )


def append_name(problem):
    """The name expression of ``kvcache_append`` for ``problem``."""
    return standalone.STANDALONE["kvcache_append"].name_expression(dtype=problem.dtype)


def append_blocks(problem):
    """Blocks along x of ``kvcache_append``'s grid: the new rows' elements, then (with the
    rotary embedding) the elements of a KV head's query rows, 128 a block."""
    blocks = -(-problem.new_len * max(problem.head_dim, problem.head_dim_v) // THREADS)
    if problem.rotary is not None:
        blocks += -(-problem.group_size * problem.q_len * problem.head_dim // THREADS)
    return blocks


def combine_name(problem, out_dtype=None):
    """The name expression of ``kvcache_combine`` (the splits' merge) for ``problem``, its
    output in ``out_dtype`` (default: the problem's dtype)."""
    return standalone.STANDALONE["kvcache_combine"].name_expression(
        dtype=problem.dtype if out_dtype is None else out_dtype, head_dim=problem.head_dim_v
    )


def uses_tensor_cores(problem):
    """float16/bfloat16 with head_dim a multiple of 16 run on mma.sync (kvcache_decode_tc)."""
    return np.dtype(problem.dtype).itemsize == 2 and problem.head_dim % 16 == 0


def reads_fp8(problem, capability, out_dtype):
    """Whether the tensor-core kernel reads ``problem``'s FP8 (e4m3) cache as it is, on a GPU
    of compute ``capability`` (86: sm_86): from sm_89 (its e4m3 conversions), for a head_dim
    a multiple of 16 up to 256 that v shares, with a 16-bit ``out_dtype`` (a float32 one
    asks for the exact computation, as in the dense FP8 call; the kernel rounds P to
    float16). Other FP8 calls dequantize the cache."""
    return (
        capability >= 89
        and np.dtype(out_dtype).itemsize == 2
        and problem.head_dim % 16 == 0
        and problem.head_dim <= 256
        and not problem.own_value_dims
    )


def takes_mla_wgmma(problem, capability):
    """Whether ``kvcache_decode_mla_wgmma`` serves ``problem`` on a GPU of compute
    ``capability``: sm_90 (its wgmma), the latent view (v_cache ``k_cache[..., :head_dim_v]``),
    head_dim a multiple of 64 whose tiles fit a block's shared memory, head_dim_v a
    multiple of 128, and at least MLA_WGMMA_MIN_ROWS packed query rows (a block's 64 are
    wgmma's M)."""
    return (
        capability == 90
        and problem.latent
        and problem.head_dim % 64 == 0
        and problem.head_dim_v % 128 == 0
        and decode_mla_wgmma_shape(problem.head_dim) <= block_shared_limit(capability)
        and problem.q_len * problem.group_size >= MLA_WGMMA_MIN_ROWS
    )


@functools.cache
def block_threads(name):
    """Threads a block of the registry's kernel ``name`` (a name expression); looked up once
    a name (each decoding call asks)."""
    return standalone.standalone_of(name).threads


def decode_kernel(problem, capability=80, fp8=None):
    """``(name expression, keys a tile, packed query rows a block, shared bytes)`` of the
    split-KV kernel that serves ``problem`` on a GPU of compute ``capability``: for a
    value head dim of its own or keys wider than GPU_MAX_HEAD_DIM an MLA one (16 packed
    rows a block, or 64 on wgmma: :func:`takes_mla_wgmma`), else the tensor-core one
    (16-bit, head_dim a multiple of 16; 16, 32 or 64 packed rows a block) or the
    CUDA-core one. ``fp8``: the element types (``standalone.E4m3Cache``) of an FP8 cache
    that the tensor-core kernel reads (see :func:`reads_fp8`)."""
    if fp8 is None and problem.own_value_dims and takes_mla_wgmma(problem, capability):
        name = standalone.STANDALONE["kvcache_decode_mla_wgmma"].name_expression(
            dtype=problem.dtype,
            head_dim=problem.head_dim,
            head_dim_v=problem.head_dim_v,
            keys=MLA_WGMMA_KEYS,
            paged=problem.paged,
        )
        return name, MLA_WGMMA_KEYS, MLA_WGMMA_ROWS, decode_mla_wgmma_shape(problem.head_dim)
    if fp8 is None and problem.own_value_dims:
        keys = decode_mla_keys(problem.head_dim, problem.head_dim_v, problem.latent, capability)
        name = standalone.STANDALONE["kvcache_decode_mla"].name_expression(
            dtype=problem.dtype,
            head_dim=problem.head_dim,
            head_dim_v=problem.head_dim_v,
            keys=keys,
            stages=MLA_STAGES,
            paged=problem.paged,
            latent=problem.latent,
        )
        shared = decode_mla_shape(
            problem.head_dim, problem.head_dim_v, keys, MLA_STAGES, problem.latent
        )
        return name, keys, 16, shared
    packed_rows = problem.q_len * problem.group_size
    if fp8 is not None or uses_tensor_cores(problem):
        row_warps = 1 if packed_rows <= 16 else 2 if packed_rows <= 32 else 4
        stages = decode_tc_stages(problem.head_dim, longest_sequence(problem))
        keys = None
        if fp8 is not None and problem.paged and problem.block_size < FP8_RUN_BLOCK_KEYS:
            keys = decode_tc_keys(problem.head_dim)  # a 16-bit tile's: see FP8_RUN_BLOCK_KEYS
        elif fp8 is not None:
            stages = FP8_STAGES
        keys_per_tile, rows, shared = decode_tc_shape(
            problem.head_dim, row_warps, stages, keys, fp8=fp8 is not None
        )
        name = decode_tc_name(problem, row_warps, stages, keys_per_tile, fp8)
        return name, keys_per_tile, rows, shared
    rows = row_tile(problem)
    keys_per_tile, shared = decode_shape(np.dtype(problem.dtype).itemsize, problem.head_dim, rows)
    name = standalone.STANDALONE["kvcache_decode"].name_expression(
        dtype=problem.dtype, head_dim=problem.head_dim, rows=rows
    )
    return name, keys_per_tile, rows, shared


def row_tile(problem):
    """Packed query rows a decode block holds: the smallest RM >= min(S_q x group, 8)."""
    rows = problem.q_len * problem.group_size
    return next(rm for rm in ROW_TILES if rm >= min(rows, ROW_TILES[-1]))


def num_splits(blocks, slots, tiles, cap):
    """Splits of each sequence's keys for ``blocks`` blocks before splitting, ``slots``
    blocks resident at once on the whole GPU and ``tiles`` key tiles in the longest
    sequence. A block costs about BLOCK_START tiles of latency plus its share of the
    tiles; the count that minimises waves x block time wins (the fewest on a tie), at
    most MAX_SPLITS and none shorter than MIN_KEYS_PER_SPLIT keys (see ``split_cap``)."""
    best, best_cost = 1, None
    for splits in range(1, cap + 1):
        waves = -(-blocks * splits // slots)
        cost = waves * (BLOCK_START + tiles / splits)
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


def split_cap(longest, keys_per_tile):
    """Tiles of the longest sequence, capped so that a split keeps >= MIN_KEYS_PER_SPLIT
    keys and there are at most MAX_SPLITS."""
    tiles = max(1, -(-longest // keys_per_tile))
    return tiles, max(1, min(MAX_SPLITS, -(-longest // max(MIN_KEYS_PER_SPLIT, keys_per_tile))))


_KERNELS: dict = {}


def loaded_kernel(name, shared=0, functors=None):
    """``(kernel, resident blocks an SM, SM count)`` for the current device, looked up once:
    the registry's kernel ``name`` from :func:`cuflash.gpu.kernel_build.load_standalone` (with
    the user's modifier functors, ``kernel_build.UserFunctors``, if given), its occupancy
    from its registers, shared memory and threads a block."""
    device_id = cupy.cuda.runtime.getDevice()
    found = _KERNELS.get((device_id, name, functors))
    if found is None:
        with modifier_compile_errors(functors):
            kernel = load_standalone(name, shared_bytes=shared, functors=functors)
        attributes = cupy.cuda.Device(device_id).attributes
        smem_per_sm = attributes["MaxSharedMemoryPerMultiprocessor"]
        regs_per_warp = -(-kernel.num_regs * 32 // 256) * 256
        threads = block_threads(name)
        per_sm = min(
            smem_per_sm // (shared + 1024) if shared else 16,
            attributes["MaxRegistersPerMultiprocessor"] // (regs_per_warp * threads // 32),
            attributes["MaxThreadsPerMultiProcessor"] // threads,
        )
        found = _KERNELS[(device_id, name, functors)] = (
            kernel,
            max(1, per_sm),
            attributes["MultiProcessorCount"],
        )
    return found
