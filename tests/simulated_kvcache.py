"""``flash_attention_with_kvcache``'s GPU path in the CPU simulator (``tests/simulator``) on
NumPy arrays: the append, the split-KV decode kernel the library chooses (tensor cores or
CUDA cores) and the combine of its splits, or for long query chunks on a contiguous cache
the dense forward's kernels, with ``cuflash.kvcache.gpu_forward``'s arguments. The
lengths and block ids the kernels read may differ from the ones the call is validated
with (``device_lengths``, ``device_table``), as garbage on a GPU would.
"""

import numbers

import numpy as np
import simulated_attention
import simulator

from cuflash import rotary
from cuflash.core.config import AttentionConfig
from cuflash.core.kvcache_problem import kvcache_problem
from cuflash.core.problem import forward_problem
from cuflash.gpu import decode_kernels, decode_params, registry, standalone

#: What the split count is chosen for (cuflash.gpu.decode_kernels.num_splits): a small GPU, so that
#: the test shapes take several splits and the combine.
RESIDENT_BLOCKS, SM_COUNT = 2, 4


def _strides(a):
    return tuple(np.int64(s // a.itemsize) for s in a.strides[:3])


def _module(name, capability):
    source = standalone.standalone_of(name).source
    return simulator.build([name], headers=(source,), arch=capability)


def forward(
    q,
    k_cache,
    v_cache,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=True,
    window_size=0,
    *,
    cache_seqlens,
    k_new=None,
    v_new=None,
    block_table=None,
    softmax_scale=None,
    return_lse=False,
    check=False,
    softcap=0.0,
    alibi_slopes=None,
    capability=80,
    device_lengths=None,
    device_table=None,
    guard=False,
    sinks=None,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved=False,
    head_dim_v=None,
    fp8=None,
):
    """As ``cuflash.flash_attention_with_kvcache`` on the simulated kernels of
    ``capability`` (no user modifiers). ``fp8``: an FP8 cache's call as the library makes
    it on a GPU from sm_89, ``cuflash.gpu.kvcache.Fp8Cache`` with NumPy descale arrays."""
    config = AttentionConfig(
        num_heads,
        num_kv_heads,
        head_dim,
        causal,
        window_size,
        softmax_scale=softmax_scale,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        head_dim_v=head_dim_v,
    )
    problem = kvcache_problem(
        q,
        k_cache,
        v_cache,
        config,
        cache_seqlens,
        k_new,
        v_new,
        block_table,
        return_lse,
        check,
        rotary_cos,
        rotary_sin,
        rotary_interleaved,
        storage_dtype=None if fp8 is None else k_cache.dtype,
    )
    lengths = cache_seqlens if device_lengths is None else device_lengths
    table = block_table if device_table is None else device_table
    if isinstance(lengths, numbers.Integral):
        lengths_array, length_value = None, int(lengths)
    else:
        lengths_array, length_value = np.ascontiguousarray(lengths, np.int32), 0
    table = None if table is None else np.ascontiguousarray(table, np.int32)
    q = np.ascontiguousarray(q)
    attended = q  # the query rows the attention reads: the append's rotated copy, poisoned
    if problem.rotary is not None and problem.batch * problem.num_heads:
        attended = np.full(problem.q_shape, np.nan, problem.dtype)

    attention = None  # the dense forward's problem, for a long query chunk
    long_chunk = problem.q_len * problem.group_size >= decode_kernels.DENSE_MIN_ROWS
    if block_table is None and long_chunk and not problem.own_value_dims and fp8 is None:
        dense_config = AttentionConfig(
            num_heads,
            num_kv_heads,
            head_dim,
            False,
            problem.window,
            int(lengths) + problem.new_len if lengths_array is None else None,
            problem.softmax_scale,
            softcap=problem.softcap,
            alibi_slopes=alibi_slopes,
        )
        attention = forward_problem(attended, k_cache, v_cache, dense_config)
        spec = registry.choose(
            "forward", attention.dtype, head_dim, capability, modified=attention.modified
        )
        if lengths_array is not None and not spec.reads_key_counts:
            attention = None  # device-held lengths: the split-KV kernels
    dense = attention is not None
    key_counts = None
    if dense and lengths_array is not None:
        key_counts = np.full(problem.batch, -1, np.int32) if problem.new_len else lengths_array
    if decode_kernels.append_blocks(problem) and problem.batch and problem.num_kv_heads:
        name = decode_kernels.append_name(problem)
        strides = [None if x is None else _strides(x) for x in (k_new, v_new)]
        strides += [_strides(x) for x in (k_cache, v_cache, q)]
        params = decode_params.append_params(problem, strides, rotary.append_arguments(problem))
        _module(name, capability).launch(
            name,
            (decode_kernels.append_blocks(problem), problem.num_kv_heads, problem.batch),
            decode_kernels.THREADS,
            0,
            (
                params,
                (
                    k_new,
                    v_new,
                    k_cache,
                    v_cache,
                    lengths_array,
                    table,
                    key_counts if problem.new_len else None,
                    q,
                    attended,
                    rotary_cos,
                    rotary_sin,
                    length_value,
                ),
            ),
            guard,
        )
    if dense:  # the dense forward over the cache, its key counts per entry
        out, lse = simulated_attention.run_forward(
            attention,
            attended,
            k_cache,
            v_cache,
            offsets=(None, key_counts),
            alibi_slopes=alibi_slopes,
            capability=capability,
            guard=guard,
            sinks=sinks,
        )
        return (out, lse) if return_lse else out

    types = None if fp8 is None else fp8.types
    name, keys_per_tile, rows, shared = decode_kernels.decode_kernel(problem, capability, types)
    row_tiles = -(-problem.q_len * problem.group_size // rows)
    blocks = problem.batch * problem.num_kv_heads * row_tiles
    splits = decode_kernels.num_splits(
        blocks,
        RESIDENT_BLOCKS * SM_COUNT,
        *decode_kernels.split_cap(decode_kernels.longest_sequence(problem), keys_per_tile),
    )
    out_dtype = problem.dtype if fp8 is None else fp8.types.out
    out = np.full(problem.out_shape, np.nan, out_dtype)
    lse = np.full(problem.lse_shape, np.nan, np.float32)
    part_rows = problem.batch * problem.num_heads * problem.q_len
    part_out = part_lse = None
    if splits > 1:
        part_out = np.full((part_rows * splits, problem.head_dim_v), np.nan, np.float32)
        part_lse = np.full(part_rows * splits, np.nan, np.float32)
    slopes = None if alibi_slopes is None else np.ascontiguousarray(alibi_slopes)
    aligned = all(
        a.ctypes.data % 16 == 0 and all(s % 16 == 0 for s in a.strides[:3])
        for a in (k_cache, v_cache)
    )
    params = decode_params.decode_params(
        problem,
        [_strides(x) for x in (attended, k_cache, v_cache)],
        splits,
        row_tiles,
        aligned,
        simulated_attention.NO_USER_ARGUMENTS,
        *((1.0, 1.0) if fp8 is None else fp8.factors()),
    )
    descales = [None, None]
    if fp8 is not None:
        descales = [
            None if x is None or isinstance(x, float) else np.ascontiguousarray(x, np.float32)
            for x in (fp8.qk, fp8.v)
        ]
    _module(name, capability).launch(
        name,
        (splits * row_tiles, problem.num_kv_heads, problem.batch),
        decode_kernels.block_threads(name),
        shared,
        (
            params,
            (
                attended,
                k_cache,
                v_cache,
                lengths_array,
                table,
                out,
                lse,
                part_out,
                part_lse,
                slopes,
                sinks,
                *descales,
                length_value,
            ),
        ),
        guard,
    )
    if splits > 1:
        combine = decode_kernels.combine_name(problem, out_dtype)
        _module(combine, capability).launch(
            combine,
            (part_rows,),
            decode_kernels.THREADS,
            0,
            (
                decode_params.combine_params(problem, part_rows, splits),
                (part_out, part_lse, out, lse, sinks),
            ),
            guard,
        )
    return (out, lse) if return_lse else out
