"""The GPU path of :func:`cuflash.flash_attention_with_kvcache` (the KV-cache page): the append, the
split-KV kernels (``kernels/decode/kvcache_decode_tc.cu``, ``kernels/decode/kvcache_decode.cu``,
``kernels/decode/kvcache_decode_mla.cu``) and the combine of their splits (or, for long query chunks
on a contiguous cache, the dense forward's plan), one call at a time (:func:`gpu_forward`) or as a
launch plan for device-held lengths (:class:`DecodePlan`). Which kernels, their tiles, the split
count and the kernel lookup are :mod:`cuflash.gpu.decode_kernels`'s."""

import dataclasses
import numbers

import cupy
import numpy as np

from .. import rotary as rotary_embedding
from ..core.config import AttentionConfig
from ..core.kvcache_problem import check_block_ids, check_lengths
from ..core.problem import forward_problem, unit_last_stride
from . import decode_kernels, decode_params, kernel_params, registry, standalone
from .decode_kernels import DENSE_MIN_ROWS
from .decode_tiles import THREADS
from .kernel_build import UserFunctors
from .kernel_launch import (
    NO_USER_ARGUMENTS,
    Launch,
    UserArguments,
    address,
    current_stream,
    device_capability,
    element_strides,
    rows_are_16_byte_aligned,
)
from .launch import ForwardPlan


@dataclasses.dataclass(frozen=True)
class Fp8Cache:
    """What an FP8 (e4m3) cache's call adds (the FP8 page): the decode kernel's element
    types (``standalone.E4m3Cache``: q's dtype and the output's) and the descales, q's
    times k's (``qk``) and v's: None (1), a float, or a float32 ``[B, H_kv]`` CuPy
    array."""

    types: standalone.E4m3Cache
    qk: object = None
    v: object = None

    def factors(self):
        """The scalar descales ``(q's times k's, v's)`` (1 for an array or None)."""
        return tuple(float(x) if isinstance(x, float) else 1.0 for x in (self.qk, self.v))

    def arrays(self):
        """The descale arrays, contiguous float32, or None."""
        return tuple(
            None if x is None or isinstance(x, float) else cupy.ascontiguousarray(x, np.float32)
            for x in (self.qk, self.v)
        )


def verify_on_host(problem, cache_seqlens, block_table):
    """``check=True``: one device-to-host copy of the device-held lengths and block ids."""
    parts = []
    if not isinstance(cache_seqlens, numbers.Integral):
        parts.append(cache_seqlens.ravel())
    if block_table is not None:
        parts.append(cupy.ascontiguousarray(block_table).ravel())
    if not parts:
        return
    host = cupy.asnumpy(cupy.concatenate(parts) if len(parts) > 1 else parts[0])
    if isinstance(cache_seqlens, numbers.Integral):
        lengths = problem.host_lengths
    else:
        lengths = host[: problem.batch].astype(np.int64)
        host = host[problem.batch :]
        check_lengths(lengths, problem.new_len, problem.capacity)
        if problem.rotary is not None:
            rotary_embedding.check_positions(
                problem.rotary, lengths, problem.new_len, problem.q_len
            )
    if block_table is not None:
        table = host.reshape(problem.batch, problem.max_blocks)
        check_block_ids(table, lengths, problem.new_len, problem.block_size, problem.num_blocks)


def _length_args(cache_seqlens):
    """``(lengths' device address, their value)``: an int length is a value for every
    sequence (address 0), device-held ones an array (value 0)."""
    if isinstance(cache_seqlens, numbers.Integral):
        return 0, int(cache_seqlens)
    return cache_seqlens.data.ptr, 0


def _dense_plan(problem, q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes):
    """The dense forward's plan (:class:`cuflash.gpu.launch.ForwardPlan`) for a long query chunk
    on a contiguous cache, or None (the split-KV kernels serve the call). Its tensor-core
    kernels read each key once for a tile of many query rows of one head. With an int
    length the plan reads ``kv_seq_len`` keys; with the lengths on the device its call takes
    each sequence's count of keys as ``offsets=(None, counts)``, which only the kernels of
    the registry's ``reads_key_counts`` read (the Hopper ones)."""
    if block_table is not None or problem.q_len * problem.group_size < DENSE_MIN_ROWS:
        return None
    if problem.own_value_dims:  # kvcache_decode_mla's
        return None

    host_length = isinstance(cache_seqlens, numbers.Integral)
    config = AttentionConfig(
        problem.num_heads,
        problem.num_kv_heads,
        problem.head_dim,
        False,
        problem.window,
        int(cache_seqlens) + problem.new_len if host_length else None,
        problem.softmax_scale,
        problem.allow_tf32,
        problem.softcap,
        alibi_slopes,
        problem.score_mod,
        problem.mask_mod,
    )
    attention = forward_problem(q, k_cache, v_cache, config)
    if problem.block_mask is not None:
        # made for the capacity (checked by kvcache_problem), which the dense problem's
        # kv_seq_len may fall short of: the kernels read its tiles below that length
        attention = dataclasses.replace(attention, block_mask=problem.block_mask)
    plan = ForwardPlan(attention, q, k_cache, v_cache)
    return plan if host_length or plan.spec.reads_key_counts else None


def _key_counts(problem, cache_seqlens):
    """Where the dense forward finds each sequence's keys for device-held lengths: the
    lengths themselves without an append (the kernels clamp them to the capacity), else a
    new int32 ``[B]`` that the append fills with ``clamped length + S_new``."""
    return cupy.empty(problem.batch, np.int32) if problem.new_len else cache_seqlens


def _rotated_query(problem, q):
    """Where the append writes the rotated query rows (the rotary embedding): a new
    contiguous ``[B, H, S_q, D]`` array that the attention then reads, or ``q`` itself."""
    if problem.rotary is None or problem.batch * problem.num_heads == 0:
        return q
    return cupy.empty(problem.q_shape, dtype=problem.dtype)


def _append_params(problem, k_new, v_new, q, k_cache, v_cache):
    """``kvcache_append``'s parameter record (``decode_params.append_params``)."""
    return decode_params.append_params(
        problem, _strides_of(k_new, v_new, k_cache, v_cache, q), _rotary(problem)
    )


def _strides_of(*arrays):
    """The element strides (batch, head, row) of each array, None for None."""
    return tuple(None if x is None else element_strides(x) for x in arrays)


def _rotary(problem):
    return tuple(int(x) for x in rotary_embedding.append_arguments(problem))


# gpu_forward's launches (host-held lengths, user modifiers: no plan serves those calls),
# kept by their kernel, grid and record's arguments: a repeated call packs only its
# addresses into the record, as a plan's launch does; rebuilding the record each call
# would cost more host time than CuPy's positional arguments did. At most _MAX_LAUNCHES.
_LAUNCHES: dict = {}
_MAX_LAUNCHES = 256


def _problem_key(problem):
    """The problem's values that the KV cache's records hold."""
    return (
        problem.num_heads,
        problem.num_kv_heads,
        problem.q_len,
        problem.new_len,
        problem.head_dim,
        problem.head_dim_v,
        problem.window,
        problem.softmax_scale,
        problem.alibi_batch_stride,
        problem.softcap,
        problem.capacity,
        problem.block_size,
        problem.max_blocks,
        problem.num_blocks,
    )


def _on_device(params):
    """``params`` laid out from the current device's parameter base
    (``kernel_launch.Launch.of_role`` does the same for the attention kernels)."""
    sm = registry.generation(device_capability()[1])
    return params.rebased(kernel_params.parameter_base(sm))


def _launch(function, grid, shared, build, problem, *arguments, reuse=True, threads=THREADS):
    """A ``kernel_launch.Launch`` of ``function`` (``threads`` a block) with the record
    ``build(problem, *arguments)``, the one made for the same arguments before where
    ``reuse``."""
    key = (function.ptr, grid, shared, build, _problem_key(problem), arguments)
    found = _LAUNCHES.get(key) if reuse else None
    if found is None:
        params = _on_device(build(problem, *arguments))
        found = Launch(function, grid, threads, shared, params)
        if reuse:
            if len(_LAUNCHES) >= _MAX_LAUNCHES:
                _LAUNCHES.clear()
            _LAUNCHES[key] = found
    return found


def _user_modifiers(problem):
    """The user's functors (``kernel_build.UserFunctors``, or None) and the decode kernels'
    ``UserModifierArgs`` argument (``kernel_launch.UserArguments``: their arrays, or zeros)."""
    if problem.score_mod is None and problem.mask_mod is None:
        return None, NO_USER_ARGUMENTS
    functors = UserFunctors.of(
        problem.score_mod, problem.mask_mod, built_ins=problem.softcap > 0 or problem.alibi
    )
    return functors, UserArguments(problem)


def gpu_forward(
    problem,
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    k_new,
    v_new,
    block_table,
    check,
    alibi_slopes=None,
    sinks=None,
    rotary_cos=None,
    rotary_sin=None,
    fp8=None,
):
    """Return ``(out, lse)`` on the current device and stream: append (rotating the new
    keys and a copy of the query rows with ``rotary_cos`` / ``rotary_sin``), attend,
    combine (``sinks``: the attention sinks, which the unsplit kernel or the combine
    adds). ``fp8``: an FP8 cache's :class:`Fp8Cache` (the tensor-core kernel reads it:
    ``decode_kernels.reads_fp8``; the kernel takes any output dtype, the library's path
    a 16-bit one)."""
    if check:
        verify_on_host(problem, cache_seqlens, block_table)
    if block_table is not None:
        block_table = cupy.ascontiguousarray(block_table)
    if not isinstance(cache_seqlens, numbers.Integral):
        cache_seqlens = cupy.ascontiguousarray(cache_seqlens)
    seqlen_ptr, seqlen_value = _length_args(cache_seqlens)
    table_ptr = address(block_table)
    stream = current_stream()
    q = unit_last_stride(cupy, q)
    attended = _rotated_query(problem, q)  # the query rows the attention reads
    dense = None
    if problem.batch * problem.num_heads and fp8 is None:
        dense = _dense_plan(
            problem, attended, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes
        )
    key_counts = None
    if dense is not None and not isinstance(cache_seqlens, numbers.Integral):
        key_counts = _key_counts(problem, cache_seqlens)
    if decode_kernels.append_blocks(problem) and problem.batch and problem.num_kv_heads:
        if problem.new_len:
            k_new, v_new = (unit_last_stride(cupy, a) for a in (k_new, v_new))
        tables = (None, None)
        if problem.rotary is not None:  # held until the launch is queued
            tables = tuple(cupy.ascontiguousarray(t) for t in (rotary_cos, rotary_sin))
        append = decode_kernels.loaded_kernel(decode_kernels.append_name(problem))[0]
        _launch(
            append.kernel,
            (decode_kernels.append_blocks(problem), problem.num_kv_heads, problem.batch),
            0,
            decode_params.append_params,
            problem,
            _strides_of(k_new, v_new, k_cache, v_cache, q),
            _rotary(problem),
        )(
            stream,
            address(k_new),
            address(v_new),
            k_cache.data.ptr,
            v_cache.data.ptr,
            seqlen_ptr,
            table_ptr,
            address(key_counts) if problem.new_len else 0,
            q.data.ptr,
            attended.data.ptr,
            *map(address, tables),
            seqlen_value,
        )
    q = attended
    out_dtype = problem.dtype if fp8 is None else fp8.types.out
    if problem.batch * problem.num_heads == 0:
        return (
            cupy.empty(problem.out_shape, dtype=out_dtype),
            cupy.empty(problem.lse_shape, dtype=np.float32),
        )
    if dense is not None:  # key_counts None: an int length
        return dense(
            q, k_cache, v_cache, offsets=(None, key_counts), alibi_slopes=alibi_slopes, sinks=sinks
        )
    name, keys_per_tile, rows, shared = decode_kernels.decode_kernel(
        problem, device_capability()[1], None if fp8 is None else fp8.types
    )
    row_tiles = -(-problem.q_len * problem.group_size // rows)
    functors, user = _user_modifiers(problem)
    decode, per_sm, sm_count = decode_kernels.loaded_kernel(name, shared, functors)
    blocks = problem.batch * problem.num_kv_heads * row_tiles
    splits = decode_kernels.num_splits(
        blocks,
        per_sm * sm_count,
        *decode_kernels.split_cap(decode_kernels.longest_sequence(problem), keys_per_tile),
    )
    out = cupy.empty(problem.out_shape, dtype=out_dtype)
    lse = cupy.empty(problem.lse_shape, dtype=np.float32)
    part_rows = problem.batch * problem.num_heads * problem.q_len
    part_out = part_lse = None
    if splits > 1:
        part_out = cupy.empty((part_rows * splits, problem.head_dim_v), dtype=np.float32)
        part_lse = cupy.empty(part_rows * splits, dtype=np.float32)
    slopes, sinks = (
        None if a is None else cupy.ascontiguousarray(a) for a in (alibi_slopes, sinks)
    )
    factors, descales = ((1.0, 1.0), (None, None)) if fp8 is None else (fp8.factors(), fp8.arrays())
    _launch(
        decode.kernel,
        (splits * row_tiles, problem.num_kv_heads, problem.batch),
        shared,
        decode_params.decode_params,
        problem,
        _strides_of(q, k_cache, v_cache),
        splits,
        row_tiles,
        rows_are_16_byte_aligned((k_cache, v_cache)),
        user,
        *factors,
        reuse=functors is None,  # a user's arguments are the call's
        threads=decode_kernels.block_threads(name),
    )(
        stream,
        q.data.ptr,
        k_cache.data.ptr,
        v_cache.data.ptr,
        seqlen_ptr,
        table_ptr,
        out.data.ptr,
        lse.data.ptr,
        *map(address, (part_out, part_lse, slopes, sinks, *descales)),
        seqlen_value,
    )
    if splits > 1:
        combine = decode_kernels.loaded_kernel(decode_kernels.combine_name(problem, out_dtype))[0]
        _launch(
            combine.kernel,
            (part_rows,),
            0,
            decode_params.combine_params,
            problem,
            part_rows,
            splits,
        )(stream, *map(address, (part_out, part_lse, out, lse, sinks)))
    return out, lse


class DecodePlan:
    """The launches of one call signature with device-held lengths (``check=False``):
    the append, the split-KV kernel and the combine with their grids and scalar arguments
    fixed (or, for long query chunks on a contiguous cache, the dense forward's plan), so
    that a decoding step only allocates its outputs and launches. (Host-held lengths
    change every step and size the split count, so those calls take
    :func:`gpu_forward`.) ``fp8``: an FP8 cache's :class:`Fp8Cache` (its descales'
    floats fixed, its arrays the call's: ``plan(..., fp8_descales=(qk, v))``)."""

    def __init__(
        self,
        problem,
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        k_new,
        v_new,
        block_table,
        alibi_slopes=None,
        fp8=None,
    ):
        self.problem = problem
        self.out_dtype = problem.dtype if fp8 is None else fp8.types.out
        self.copies = (
            any(a is not None and a.strides[-1] != a.itemsize for a in (q, k_new, v_new))
            or not cache_seqlens.flags.c_contiguous
            or (block_table is not None and not block_table.flags.c_contiguous)
        )
        q = unit_last_stride(cupy, q)
        self.append = None
        if decode_kernels.append_blocks(problem) and problem.num_kv_heads:
            if problem.new_len:
                k_new, v_new = (unit_last_stride(cupy, a) for a in (k_new, v_new))
            self.append = Launch(
                decode_kernels.loaded_kernel(decode_kernels.append_name(problem))[0].kernel,
                (decode_kernels.append_blocks(problem), problem.num_kv_heads, problem.batch),
                THREADS,
                0,
                _on_device(_append_params(problem, k_new, v_new, q, k_cache, v_cache)),
            )
        q = _rotated_query(problem, q)  # the layout the attention reads (rotated: its own)
        self.dense = None
        if fp8 is None:
            self.dense = _dense_plan(
                problem, q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes
            )
        if self.dense is not None:
            return
        name, keys_per_tile, rows, shared = decode_kernels.decode_kernel(
            problem, device_capability()[1], None if fp8 is None else fp8.types
        )
        row_tiles = -(-problem.q_len * problem.group_size // rows)
        decode, per_sm, sm_count = decode_kernels.loaded_kernel(name, shared)
        blocks = problem.batch * problem.num_kv_heads * row_tiles
        self.splits = decode_kernels.num_splits(
            blocks, per_sm * sm_count, *decode_kernels.split_cap(problem.capacity, keys_per_tile)
        )
        self.decode = Launch(
            decode.kernel,
            (self.splits * row_tiles, problem.num_kv_heads, problem.batch),
            decode_kernels.block_threads(name),
            shared,
            _on_device(
                decode_params.decode_params(
                    problem,
                    _strides_of(q, k_cache, v_cache),
                    self.splits,
                    row_tiles,
                    rows_are_16_byte_aligned((k_cache, v_cache)),
                    NO_USER_ARGUMENTS,  # plans serve calls without user modifiers
                    *((1.0, 1.0) if fp8 is None else fp8.factors()),
                )
            ),
        )
        self.part_rows = problem.batch * problem.num_heads * problem.q_len
        self.combine = None
        if self.splits > 1:
            self.combine = Launch(
                decode_kernels.loaded_kernel(decode_kernels.combine_name(problem, self.out_dtype))[
                    0
                ].kernel,
                (self.part_rows,),
                THREADS,
                0,
                _on_device(decode_params.combine_params(problem, self.part_rows, self.splits)),
            )
            # The splits' partial rows and their lse in one workspace (256-byte aligned).
            self.part_lse_offset = (
                -(-4 * self.part_rows * self.splits * problem.head_dim_v // 256) * 256
            )
            self.workspace_bytes = self.part_lse_offset + 4 * self.part_rows * self.splits

    def __call__(
        self,
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        k_new,
        v_new,
        block_table,
        alibi_slopes=None,
        sinks=None,
        rotary_cos=None,
        rotary_sin=None,
        fp8_descales=(None, None),
    ):
        problem = self.problem
        if self.copies:  # the signature fixes which
            q, k_new, v_new = (
                a if a is None else unit_last_stride(cupy, a) for a in (q, k_new, v_new)
            )
            cache_seqlens = cupy.ascontiguousarray(cache_seqlens)
            if block_table is not None:
                block_table = cupy.ascontiguousarray(block_table)

        stream = current_stream()
        table = address(block_table)
        slopes, sink_ptr = (
            0 if a is None else cupy.ascontiguousarray(a).data.ptr for a in (alibi_slopes, sinks)
        )
        lengths = cache_seqlens.data.ptr
        key_counts = None if self.dense is None else _key_counts(problem, cache_seqlens)
        attended = _rotated_query(problem, q)
        if self.append is not None:  # 0: the lengths' value (they are on the device)
            tables = (None, None)
            if problem.rotary is not None:  # held until the launch is queued
                tables = tuple(cupy.ascontiguousarray(t) for t in (rotary_cos, rotary_sin))
            self.append(
                stream,
                address(k_new),
                address(v_new),
                k_cache.data.ptr,
                v_cache.data.ptr,
                lengths,
                table,
                address(key_counts) if problem.new_len else 0,
                q.data.ptr,
                attended.data.ptr,
                *map(address, tables),
                0,  # the lengths are on the device
            )
        q = attended
        if self.dense is not None:
            out, lse = self.dense(
                q,
                k_cache,
                v_cache,
                offsets=(None, key_counts),
                alibi_slopes=alibi_slopes,
                sinks=sinks,
            )
            return (out, lse) if problem.return_lse else out
        out = cupy.empty(problem.out_shape, dtype=self.out_dtype)
        lse = cupy.empty(problem.lse_shape, dtype=np.float32)
        descales = tuple(address(d) for d in fp8_descales)  # contiguous float32 or None
        inputs = (
            q.data.ptr,
            k_cache.data.ptr,
            v_cache.data.ptr,
            lengths,
            table,
            out.data.ptr,
            lse.data.ptr,
        )
        if self.combine is None:
            self.decode(stream, *inputs, 0, 0, slopes, sink_ptr, *descales, 0)
        else:
            workspace = cupy.cuda.alloc(self.workspace_bytes)
            part_lse = workspace.ptr + self.part_lse_offset
            self.decode(stream, *inputs, workspace.ptr, part_lse, slopes, sink_ptr, *descales, 0)
            self.combine(stream, workspace.ptr, part_lse, out.data.ptr, lse.data.ptr, sink_ptr)
        return (out, lse) if problem.return_lse else out
