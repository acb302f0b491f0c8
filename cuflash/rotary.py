"""Rotary position embedding at the append of :func:`cuflash.flash_attention_with_kvcache`
(the KV-cache page's "Rotary embedding").

With ``rotary_cos`` and ``rotary_sin`` ``[S_rot, rotary_dim / 2]`` the call rotates the
first ``rotary_dim`` dimensions of each new key row at its position before writing it
to the cache, and of each query row at its position, as FlashAttention-2's
``flash_attn_with_kvcache`` does. Pairs are ``(x[r], x[r + rotary_dim / 2])``
(GPT-NeoX, the default) or ``(x[2r], x[2r + 1])`` (GPT-J, ``rotary_interleaved=True``);
the pair ``(x1, x2)`` at position ``p`` becomes::

    x1' = x1 cos[p, r] - x2 sin[p, r]
    x2' = x1 sin[p, r] + x2 cos[p, r]

in float32 (each product rounded, then the sum: no fused multiply-add, on the CPU and in
the append kernel alike), rounded to the arrays' dtype. This module validates the
arguments, checks host-held positions and holds the CPU path's rotation;
``kvcache_append`` (``kernels/decode/kvcache_append.cu``) is the GPU's.
"""

import dataclasses

import numpy as np

from .core.problem import array_module, check_flag, check_rank
from .errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class Rotary:
    """The validated rotary arguments of a call."""

    dim: int  # rotary_dim: the leading dimensions that rotate (even, <= head_dim)
    rows: int  # S_rot: positions the tables hold
    interleaved: bool  # GPT-J pairs (2r, 2r + 1); else GPT-NeoX pairs (r, r + dim / 2)
    tables_in_dtype: bool  # the tables are in q's dtype (else float32)


def check_rotary(rotary_cos, rotary_sin, rotary_interleaved, q, head_dim, dtype):
    """A :class:`Rotary` for the call's tables (``[S_rot, rotary_dim / 2]``, float32 or
    ``dtype``, of ``q``'s array kind and device), or None without them."""
    check_flag("rotary_interleaved", rotary_interleaved)
    if rotary_cos is None and rotary_sin is None:
        return None
    if rotary_cos is None or rotary_sin is None:
        missing = "rotary_cos" if rotary_cos is None else "rotary_sin"
        raise InvalidArgumentError(missing, "rotary_cos and rotary_sin must be given together")
    named = [("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)]
    array_module([("q", q), *named])
    for name, table in named:
        check_rank(name, table, 2, "[S_rot, rotary_dim / 2]")
        if table.dtype not in (np.dtype(np.float32), np.dtype(dtype)):
            raise InvalidArgumentError(
                name, f"expected dtype float32 or q's {np.dtype(dtype)}, got {table.dtype}"
            )
    if tuple(rotary_sin.shape) != tuple(rotary_cos.shape) or rotary_sin.dtype != rotary_cos.dtype:
        raise InvalidArgumentError(
            "rotary_sin",
            f"{rotary_sin.dtype} {tuple(rotary_sin.shape)} differs from rotary_cos's "
            f"{rotary_cos.dtype} {tuple(rotary_cos.shape)}",
        )
    rows, half = rotary_cos.shape
    if rows < 1 or not 1 <= half <= head_dim // 2:
        raise InvalidArgumentError(
            "rotary_cos",
            f"expected shape [S_rot >= 1, rotary_dim / 2] with 1 <= rotary_dim / 2 <= "
            f"head_dim / 2 = {head_dim // 2}, got {tuple(rotary_cos.shape)}",
        )
    return Rotary(
        dim=2 * half,
        rows=rows,
        interleaved=bool(rotary_interleaved),
        tables_in_dtype=rotary_cos.dtype != np.float32,
    )


def check_positions(rotary, host_lengths, new_len, q_len):
    """Host-held lengths: every position rotated, ``cache_seqlens[b] .. L_b - 1`` of the
    new keys and ``L_b - S_q .. L_b - 1`` of the query rows, is a row of the tables."""
    for b, length in enumerate(host_lengths):
        keys = int(length) + new_len  # L_b
        if keys - q_len < 0:
            raise InvalidArgumentError(
                "rotary_cos",
                f"sequence {b}: query row 0 sits at position {keys - q_len} < 0 "
                f"(S_q = {q_len} query rows, L_b = {keys} keys)",
            )
        if keys > rotary.rows:
            raise InvalidArgumentError(
                "rotary_cos",
                f"sequence {b}: position {keys - 1} is past the tables' last row "
                f"(S_rot = {rotary.rows})",
            )


def rotate(x, rotary_cos, rotary_sin, positions, interleaved):
    """``x`` ``[..., n, D]`` with row ``t`` rotated at position ``positions[t]``: float32
    arithmetic, rounded to ``x``'s dtype; a new array (``x`` is not modified)."""
    half = rotary_cos.shape[1]
    cos = rotary_cos[positions].astype(np.float32)
    sin = rotary_sin[positions].astype(np.float32)
    rotated = x.astype(np.float32)  # a copy
    if interleaved:
        first, second = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    else:
        first, second = slice(0, half), slice(half, 2 * half)
    x1, x2 = rotated[..., first].copy(), rotated[..., second].copy()
    rotated[..., first] = x1 * cos - x2 * sin
    rotated[..., second] = x1 * sin + x2 * cos
    return rotated.astype(x.dtype)


def rotated_inputs(problem, q, k_new, rotary_cos, rotary_sin):
    """The CPU path's ``(q, k_new)`` rotated at their positions (host-held lengths,
    validated): new arrays; ``k_new`` stays None without new rows."""
    rotary = problem.rotary
    rotated_q = np.empty(q.shape, q.dtype)
    rotated_k = None if k_new is None else np.empty(k_new.shape, k_new.dtype)
    for b, length in enumerate(problem.host_lengths):
        keys = int(length) + problem.new_len
        queries = np.arange(keys - problem.q_len, keys)
        rotated_q[b] = rotate(q[b], rotary_cos, rotary_sin, queries, rotary.interleaved)
        if rotated_k is not None:
            new = np.arange(int(length), keys)
            rotated_k[b] = rotate(k_new[b], rotary_cos, rotary_sin, new, rotary.interleaved)
    return rotated_q, rotated_k


def append_arguments(problem):
    """``kvcache_append``'s rotary scalars: rotary_dim (0: none), S_rot, interleaved, the
    tables' element type (1: q's dtype, 0: float32)."""
    rotary = problem.rotary
    if rotary is None:
        return (np.int32(0), np.int32(1), np.int32(0), np.int32(0))
    return (
        np.int32(rotary.dim),
        np.int32(rotary.rows),
        np.int32(rotary.interleaved),
        np.int32(rotary.tables_in_dtype),
    )


def tables(positions, rotary_dim, base=10000.0, xp=np, dtype=np.float32):
    """The usual rotary tables ``(cos, sin)`` ``[positions, rotary_dim / 2]``: angle
    ``p * base ** (-2 r / rotary_dim)`` for position ``p`` and pair ``r``, computed in
    float64, as ``dtype`` arrays of ``xp`` (numpy or cupy).

    >>> cos, sin = tables(16, 8)
    >>> cos.shape, cos.dtype
    ((16, 4), dtype('float32'))
    """
    inverse = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = np.arange(positions, dtype=np.float64)[:, None] * inverse[None, :]
    return xp.asarray(np.cos(angles).astype(dtype)), xp.asarray(np.sin(angles).astype(dtype))
