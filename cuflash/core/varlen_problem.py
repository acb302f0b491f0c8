"""The validated call of the packed functions (the Packed batches page): the problem
object and the checks of the offsets, shared by the packed front ends, their FP8
forward and the simulator."""

import dataclasses

import numpy as np

from ..errors import InvalidArgumentError
from .problem import (
    MAX_GRID_YZ,
    AttentionProblem,
    PackedSequences,
    array_module,
    check_count,
    check_dims,
    check_dtypes,
    check_flag,
    check_head_counts,
    check_head_dim_v,
    check_int32,
    check_rank,
    forward_problem,
)


def heads_first(x, start=None, stop=None):
    """Tokens ``[start, stop)`` of a packed ``[tokens, heads, D]`` array as a
    ``[1, heads, n, D]`` view (unit last stride: the dense functions take it as it is)."""
    return x[start:stop][None].transpose(0, 2, 1, 3)


@dataclasses.dataclass(frozen=True)
class VarlenProblem:
    """A validated packed call: the problem over the packed arrays (``attention``, whose
    ``packed`` field says how they split) and, on the CPU path, the offsets as host
    ints (None on the GPU, where the kernels read them)."""

    attention: AttentionProblem  # over [1, H, total, D] views
    offsets_q: tuple | None  # host ints, B + 1 of them, or None
    offsets_k: tuple | None

    @property
    def xp(self):
        return self.attention.xp

    @property
    def total_q(self):
        return self.attention.q_len

    @property
    def has_rows(self):
        """Does any sequence have a query row to compute?"""
        packed = self.attention.packed
        assert packed is not None  # a packed problem always says how it splits
        return self.attention.num_heads * packed.count * packed.max_q_len * self.total_q > 0

    def sequences(self):
        """``(b, q0, q1, k0, k1)`` for every sequence with at least one query row (host
        offsets only)."""
        offsets_q, offsets_k = self.offsets_q, self.offsets_k
        assert offsets_q is not None and offsets_k is not None, "host offsets only"
        for b in range(len(offsets_q) - 1):
            q0, q1 = offsets_q[b], offsets_q[b + 1]
            if q1 > q0:
                yield b, q0, q1, offsets_k[b], offsets_k[b + 1]


def _host_offsets(offsets, xp):
    """The offsets as host ints (one device-to-host copy for a CuPy array)."""
    host = offsets if xp is np else xp.asnumpy(offsets)
    return tuple(int(x) for x in np.asarray(host))


def _check_offsets(name, offsets, total, max_name, max_seqlen, tokens):
    """0 first, nondecreasing, ``total`` last, every length within ``max_seqlen``."""
    if offsets[0] != 0:
        raise InvalidArgumentError(name, f"must start at 0, got {offsets[0]}")
    for b in range(len(offsets) - 1):
        length = offsets[b + 1] - offsets[b]
        if length < 0:
            raise InvalidArgumentError(
                name, f"sequence {b}: offsets decrease ({offsets[b]} then {offsets[b + 1]})"
            )
        if length > max_seqlen:
            raise InvalidArgumentError(
                name, f"sequence {b}: length {length} exceeds {max_name} = {max_seqlen}"
            )
    if offsets[-1] != total:
        raise InvalidArgumentError(
            name, f"the last offset {offsets[-1]} differs from {tokens}'s {total} tokens"
        )


def varlen_problem(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    config,
    check,
    extra_arrays=(),
    storage_dtype=None,
):
    """Validate a packed call of the options ``config`` (an ``AttentionConfig`` without
    ``kv_seq_len``); host offsets (the CPU path) are read and verified too. Nothing runs
    on a device: device offsets are verified by the callers with ``check``
    (:func:`verified_offsets`). ``storage_dtype``: as in ``forward_problem``."""
    check_flag("check", check)
    named = [("q", q), ("k", k), ("v", v), *extra_arrays]
    xp = array_module(named + [("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)])
    for name, a in (("q", q), ("k", k), ("v", v), *extra_arrays):
        check_rank(name, a, 3, "[tokens, heads, head_dim]")
    if storage_dtype is None:
        check_dtypes(named)
    num_heads, num_kv_heads, head_dim = check_head_counts(
        config.num_heads, config.num_kv_heads, config.head_dim
    )
    width_v = check_head_dim_v(config.head_dim_v, head_dim)
    labels = ("tokens", "heads", "head_dim")
    check_dims("q", q, (None, num_heads, head_dim), labels)
    check_dims("k", k, (k.shape[0], num_kv_heads, head_dim), labels)
    check_dims("v", v, (k.shape[0], num_kv_heads, width_v), labels)
    for name, a in extra_arrays:  # dout and out: v's head dim
        check_dims(name, a, (q.shape[0], num_heads, width_v), labels)
    for name, offsets in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_rank(name, offsets, 1, "[B + 1]")
    check_int32("cu_seqlens_q", cu_seqlens_q, (max(1, cu_seqlens_q.shape[0]),), "[B + 1]")
    check_int32("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape, "[B + 1]")
    count = cu_seqlens_q.shape[0] - 1
    if count > MAX_GRID_YZ:
        raise InvalidArgumentError(
            "cu_seqlens_q", f"too many sequences for the device: at most {MAX_GRID_YZ}, got {count}"
        )
    max_seqlen_q = check_count("max_seqlen_q", max_seqlen_q, 0)
    max_seqlen_k = check_count("max_seqlen_k", max_seqlen_k, 0)
    attention = forward_problem(
        heads_first(q),
        heads_first(k),
        heads_first(v),
        config,
        extra_arrays=[(name, heads_first(a)) for name, a in extra_arrays],
        alibi_batch=count,
        modifier_sizes=(count, max_seqlen_q, max_seqlen_k),
        storage_dtype=storage_dtype,
    )
    attention = dataclasses.replace(
        attention, packed=PackedSequences(count, max_seqlen_q, max_seqlen_k)
    )
    offsets_q = offsets_k = None
    if xp is np:
        offsets_q, offsets_k = verified_offsets(
            q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        )
    return VarlenProblem(attention=attention, offsets_q=offsets_q, offsets_k=offsets_k)


def verified_offsets(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Both offsets as host ints, verified (one copy each from a device)."""
    xp = array_module([("q", q)])
    offsets_q = _host_offsets(cu_seqlens_q, xp)
    offsets_k = _host_offsets(cu_seqlens_k, xp)
    _check_offsets("cu_seqlens_q", offsets_q, q.shape[0], "max_seqlen_q", max_seqlen_q, "q")
    _check_offsets("cu_seqlens_k", offsets_k, k.shape[0], "max_seqlen_k", max_seqlen_k, "k")
    return offsets_q, offsets_k
