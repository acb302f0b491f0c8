"""The FP8 (e4m3) forward of the dense, packed and KV-cache functions (the FP8 page).

Each call validates every argument first (the usual checks, with the FP8 dtypes
checked by :mod:`cuflash.fp8`, then the descales and ``out_dtype``). A dense call that
the native FP8 kernel serves on the GPU (an H100/H200, 16-bit output, no score
modifiers: :func:`cuflash.gpu.fp8_plan.serves`) runs it: e4m3 products on the tensor
cores, P rounded to e4m3. A KV-cache call from sm_89 (head dims multiples of 16 up to
256, a 16-bit output) runs the tensor-core decode kernel on the e4m3 cache as it is,
widened exactly to 16 bits in registers. Every other call dequantizes its FP8 arrays to float32
(exactly; ``q`` times ``q_descale * k_descale``) and runs the float32 forward of its
function, whose output it multiplies by ``v_descale`` and rounds to ``out_dtype``; the
CPU path does the same on NumPy arrays.
"""

import numbers

import numpy as np

from . import fp8
from .core.kvcache_problem import kvcache_problem
from .core.problem import array_module, forward_problem
from .core.varlen_problem import varlen_problem, verified_offsets
from .errors import InvalidArgumentError
from .gpu import plans, standalone


def dense_forward(flash_attention_fwd, q, k, v, config, fp8_format, descales, out_dtype):
    """:func:`cuflash.flash_attention_fwd` on FP8 ``q``, ``k``, ``v`` with the options
    ``config`` (``allow_tf32`` checked, then ignored: the float32 forward runs in
    float32), ``descales`` ``(q_descale, k_descale, v_descale)``; the public function
    passes itself as ``flash_attention_fwd``, which runs on the dequantized arrays."""

    named = [("q", q), ("k", k), ("v", v)]
    array_module(named)  # array kinds first, then their dtypes
    storage = fp8.storage_dtype(named, fp8_format)
    problem = forward_problem(q, k, v, config, storage_dtype=storage)
    xp = problem.xp
    q_descale, k_descale, v_descale = fp8.check_descales(
        descales, xp, problem.batch, problem.num_kv_heads
    )
    dtype = fp8.check_out_dtype(out_dtype, fp8.default_out_dtype(q))
    if problem.is_empty:
        return xp.empty(problem.out_shape, dtype=dtype), xp.empty(problem.lse_shape, np.float32)
    if xp is not np:
        from .gpu import fp8_plan  # imported on first GPU use only

        if fp8_plan.serves(problem, (q, k, v), dtype):
            scores = fp8.query_scale(xp, q_descale, k_descale)
            return fp8_plan.forward(problem, q, k, v, config, dtype, scores, v_descale)
    group = problem.group_size
    query_scale = fp8.per_head(xp, fp8.query_scale(xp, q_descale, k_descale), group)
    c = config
    out, lse = flash_attention_fwd(
        fp8.decode(q, query_scale),
        fp8.decode(k),
        fp8.decode(v),
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.causal,
        c.window_size,
        c.kv_seq_len,
        **dict(c.keywords(), allow_tf32=False),
    )
    return fp8.scaled_output(out, fp8.per_head(xp, v_descale, group), dtype), lse


def _token_sequences(xp, cu_seqlens_q, total_q, count):
    """The sequence of each query token, ``[total_q]`` (clamped to ``0 .. count - 1``,
    so device offsets that break the rules index no descale outside its array)."""
    tokens = xp.arange(total_q, dtype=np.int32)
    found = xp.searchsorted(cu_seqlens_q, tokens, side="right") - 1
    return xp.clip(found, 0, count - 1)


def varlen_forward(
    flash_attention_varlen_fwd,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    config,
    check,
    fp8_format,
    descales,
    out_dtype,
):
    """:func:`cuflash.flash_attention_varlen_fwd` on FP8 ``q``, ``k``, ``v`` with the
    options ``config``: the descales are ``[B, num_kv_heads]`` with ``B`` the sequences;
    ``flash_attention_varlen_fwd``: the public function, which passes itself."""

    named = [("q", q), ("k", k), ("v", v)]
    array_module(named)
    storage = fp8.storage_dtype(named, fp8_format)
    offsets = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    problem = varlen_problem(q, k, v, *offsets, config, check, storage_dtype=storage)
    xp = problem.xp
    count = problem.attention.packed.count
    group = problem.attention.group_size
    q_descale, k_descale, v_descale = fp8.check_descales(
        descales, xp, count, problem.attention.num_kv_heads
    )
    dtype = fp8.check_out_dtype(out_dtype, fp8.default_out_dtype(q))
    if check and xp is not np:  # before any kernel (the dequantization) runs
        verified_offsets(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    query_scale = fp8.query_scale(xp, q_descale, k_descale)
    rows = None
    if count == 0:  # no sequence: every output row is zero, whatever the scales
        query_scale = v_descale = None
    elif any(hasattr(s, "dtype") for s in (query_scale, v_descale)):
        rows = _token_sequences(xp, cu_seqlens_q, q.shape[0], count)
    c = config
    out, lse = flash_attention_varlen_fwd(
        fp8.decode(q, fp8.per_head(xp, query_scale, group, rows)),
        fp8.decode(k),
        fp8.decode(v),
        *offsets,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.causal,
        c.window_size,
        **dict(c.keywords(), allow_tf32=False),
        check=False,
    )
    return fp8.scaled_output(out, fp8.per_head(xp, v_descale, group, rows), dtype), lse


def fp8_decode_key(given, descales, options, fp8_options):
    """The plan signature of a KV-cache call on an FP8 cache with device-held lengths
    (``given``: q, the caches, the lengths, the new rows, the block table, ALiBi's slopes,
    the sinks and the rotary tables, None where absent), or None where no plan may serve
    it (an int length, NumPy arrays). The descales enter by kind: a float's value (it is
    fixed in the plan's record), an array's signature (its values are the call's)."""
    if isinstance(given[3], numbers.Integral) or given[9] is not None or given[10] is not None:
        return None
    kinds = tuple(
        None if d is None else float(d) if isinstance(d, numbers.Real) else "array"
        for d in descales
    )
    arrays = [a for a in given if a is not None]
    arrays += [d for d in descales if d is not None and not isinstance(d, numbers.Real)]
    scalars = ("kvcache-fp8", tuple(a is None for a in given), kinds, *options, *fp8_options)
    return plans.signature(arrays, scalars)


class Fp8DecodeStep:
    """A decoding step on an FP8 cache through its plan (``cuflash.gpu.kvcache.DecodePlan``
    made with the call's ``Fp8Cache``): each call's descale arrays (q's times k's, v's)
    as the kernel reads them."""

    def __init__(self, plan):
        self.plan = plan

    def __call__(self, given, descales):
        """``given``: q, the caches, the lengths, the new rows, the block table, ALiBi's
        slopes and the sinks; ``descales``: q's, k's and v's (floats fixed by the plan)."""
        import cupy

        q_descale, k_descale, v_descale = (
            float(d) if isinstance(d, numbers.Real) else d for d in descales
        )
        scales = (fp8.query_scale(cupy, q_descale, k_descale), v_descale)
        arrays = tuple(
            None if x is None or isinstance(x, float) else cupy.ascontiguousarray(x, np.float32)
            for x in scales
        )
        return self.plan(*given, fp8_descales=arrays)


def _append(xp, problem, cache, new, block_table, lengths):
    """Write ``new`` ``[B, H_kv, S_new, D]`` into the FP8 ``cache`` at each sequence's
    ``lengths`` (an int array ``[B]``, already clamped to ``0 .. capacity - S_new``); a
    paged cache's block ids are clamped to its blocks, as the GPU kernels clamp them."""
    positions = lengths[:, None] + xp.arange(problem.new_len)[None, :]
    sequences = xp.arange(problem.batch)[:, None]
    if problem.paged:
        blocks = xp.clip(
            block_table[sequences, positions // problem.block_size], 0, problem.num_blocks - 1
        )
        rows = positions % problem.block_size
    else:
        blocks, rows = sequences, positions
    # [blocks, rows, H_kv, D] views: the two index arrays lead, side by side
    cache.transpose(0, 2, 1, 3)[blocks, rows] = new.transpose(0, 2, 1, 3)


def kvcache_forward(
    flash_attention_with_kvcache,
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
    rotary_tables,
    fp8_format,
    descales,
    out_dtype,
    plan_key=None,
):
    """:func:`cuflash.flash_attention_with_kvcache` with an FP8 cache (``q`` FP8, float16
    or bfloat16; ``k_new``, ``v_new`` of the cache's dtype) and the options ``config``
    (``allow_tf32`` checked, then ignored): the append into the FP8 cache in place, then
    attention over it. From sm_89 the tensor-core decode kernel reads the cache as it is
    (head dims multiples of 16 up to 256, v's the same, a 16-bit output:
    ``cuflash.gpu.decode_kernels.reads_fp8``); elsewhere, and on the CPU path, attention
    runs over the whole cache dequantized to float32. ``rotary_tables``:
    ``(rotary_cos, rotary_sin)``, which an FP8 cache does not take;
    ``flash_attention_with_kvcache``: the public function, which passes itself;
    ``plan_key``: the signature (:func:`fp8_decode_key`) under which a call with
    device-held lengths that the kernel reads natively keeps its plan."""

    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    if k_new is not None and v_new is not None:
        named += [("k_new", k_new), ("v_new", v_new)]
    array_module(named)
    storage = fp8.storage_dtype(named, fp8_format, sixteen_bit_first=True)
    if any(t is not None for t in rotary_tables):
        raise InvalidArgumentError(
            "rotary_cos",
            "not with an FP8 cache: the rotated keys would be rounded to e4m3; rotate "
            "k before quantizing it",
        )
    cache = (cache_seqlens, k_new, v_new, block_table, return_lse, check)
    problem = kvcache_problem(q, k_cache, v_cache, config, *cache, storage_dtype=storage)
    xp = problem.xp
    q_descale, k_descale, v_descale = fp8.check_descales(
        descales, xp, problem.batch, problem.num_kv_heads
    )
    dtype = fp8.check_out_dtype(out_dtype, fp8.default_out_dtype(q))
    if check and xp is not np:  # before the append writes the cache
        from .gpu.kvcache import verify_on_host

        verify_on_host(problem, cache_seqlens, block_table)
    if xp is not np:
        from .gpu import decode_kernels  # these import CuPy: on first GPU use only
        from .gpu import kvcache as gpu_kvcache
        from .gpu.kernel_launch import device_capability

        if decode_kernels.reads_fp8(problem, device_capability()[1], dtype):
            call = gpu_kvcache.Fp8Cache(
                standalone.E4m3Cache(q.dtype, dtype),
                fp8.query_scale(xp, q_descale, k_descale),
                v_descale,
            )
            given = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
            if plan_key is not None and problem.batch * problem.num_heads:
                plan = Fp8DecodeStep(
                    gpu_kvcache.DecodePlan(problem, *given, config.alibi_slopes, fp8=call)
                )
                plans.remember(plan_key, plan)
                return plan((*given, config.alibi_slopes, config.sinks), descales)
            out, lse = gpu_kvcache.gpu_forward(
                problem, *given, False, config.alibi_slopes, config.sinks, fp8=call
            )  # the lengths and block ids were verified above
            return (out, lse) if return_lse else out
    if isinstance(cache_seqlens, numbers.Integral):
        lengths = xp.full(problem.batch, int(cache_seqlens), dtype=np.int32)
        attended = int(cache_seqlens) + problem.new_len
    else:  # host-held lengths are verified; device-held ones clamped like the kernels'
        lengths = xp.clip(cache_seqlens, 0, problem.capacity - problem.new_len).astype(np.int32)
        attended = lengths + np.int32(problem.new_len)
    if problem.new_len and problem.batch:
        _append(xp, problem, k_cache, k_new, block_table, lengths)
        _append(xp, problem, v_cache, v_new, block_table, lengths)
    group = problem.group_size
    query_scale = fp8.per_head(xp, fp8.query_scale(xp, q_descale, k_descale), group)
    if fp8.is_storage(q.dtype):
        queries = fp8.decode(q, query_scale)
    else:
        queries = q.astype(np.float32)
        if query_scale is not None:
            queries *= query_scale if hasattr(query_scale, "dtype") else np.float32(query_scale)
    c = config
    out, lse = flash_attention_with_kvcache(
        queries,
        fp8.decode(k_cache),
        fp8.decode(v_cache),
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.causal,
        c.window_size,
        cache_seqlens=attended,
        block_table=block_table,
        return_lse=True,
        **dict(c.keywords(), allow_tf32=False),
    )
    out = fp8.scaled_output(out, fp8.per_head(xp, v_descale, group), dtype)
    return (out, lse) if return_lse else out
