"""The CPU path: NumPy, blocked over queries and keys with an online softmax.

It never holds more than a ``ROWS x COLS`` block of scores per head, so long
sequences fit in memory; it accumulates in float32 like the GPU kernels and
skips key blocks that no query row of the block can see.
"""

import numpy as np

from .. import sinks as attention_sinks
from ..core.masking import key_range, query_range, visible_keys

ROWS = 128  # query rows per block
COLS = 512  # keys per block


def _grouped(x, problem):
    """``[B, H, n, D]`` -> float32 ``[B, H_kv, G, n, D]`` (heads sharing a KV head)."""
    b, _, n, d = x.shape
    return x.astype(np.float32).reshape(b, problem.num_kv_heads, problem.group_size, n, d)


def _kv_block(x, c0, c1):
    """Keys ``[c0, c1)`` as float32 ``[B, H_kv, 1, n, D]``, broadcast over the group."""
    return x[:, :, c0:c1].astype(np.float32)[:, :, None]


def modify_scores(s, r0, r1, c0, c1, q_len, kv_len, softcap, slopes):
    """The score modifiers (see the Semantics page) on float32 scaled scores of rows
    ``[r0, r1)`` and keys ``[c0, c1)``: ``softcap tanh(s / softcap)`` (0: none), then
    ``- slope |p - j|`` with ``p = i + kv_len - q_len`` (``slopes`` broadcasting against
    ``s``, or None). Returns the scores and their derivative with respect to ``s`` (1
    without a soft-cap)."""
    derivative = np.float32(1)
    if softcap:
        cap = np.float32(softcap)
        t = np.tanh(s / cap)
        s, derivative = cap * t, np.float32(1) - t * t
    if slopes is not None:
        position = np.arange(r0, r1)[:, None] + (kv_len - q_len)
        distance = np.abs(position - np.arange(c0, c1)[None, :]).astype(np.float32)
        s = s - slopes * distance
    return s, derivative


def _scores(problem, q_blk, k_blk, r0, r1, c0, c1, slopes):
    """Scaled scores with the score modifiers (see the Semantics page) and invisible
    entries at ``-inf``, the visibility mask, and the modifiers' derivative (1 without a
    soft-cap)."""
    s = (q_blk @ np.swapaxes(k_blk, -1, -2)) * np.float32(problem.softmax_scale)
    s, derivative = modify_scores(
        s, r0, r1, c0, c1, problem.q_len, problem.kv_len, problem.softcap, slopes
    )
    visible = visible_keys(
        np.arange(r0, r1), np.arange(c0, c1), problem.q_len, problem.kv_len, *problem.window
    )
    batches = (np.arange(problem.batch) + problem.first_batch).reshape(-1, 1, 1, 1, 1)
    s, visible, derivative = user_modified(problem, s, visible, derivative, batches, r0, r1, c0, c1)
    return np.where(visible, s, np.float32(-np.inf)), visible, derivative


def user_modified(problem, s, visible, derivative, b, r0, r1, c0, c1):
    """The user's score and mask functions (``problem.score_mod``, ``mask_mod``) on
    scores ``s`` ``[..., H_kv, G, rows, keys]`` of rows ``[r0, r1)`` and keys ``[c0,
    c1)`` (query head h = kv head * G + g) of batch entries ``b`` (an int, or a grid
    broadcasting against ``s``): the scores, the visibility, and the derivative times the
    score function's (None: not wanted)."""
    if problem.score_mod is None and problem.mask_mod is None:
        return s, visible, derivative
    heads = (
        np.arange(problem.num_kv_heads)[:, None] * problem.group_size
        + np.arange(problem.group_size)[None, :]
    )
    grids = (
        b,
        heads.reshape(problem.num_kv_heads, problem.group_size, 1, 1),
        np.arange(r0, r1).reshape(-1, 1),
        np.arange(c0, c1).reshape(1, -1),
    )
    if problem.score_mod is not None:
        if derivative is not None:
            derivative = derivative * problem.score_mod.numpy_grad(s, *grids)
        s = problem.score_mod.numpy_scores(s, *grids)
    if problem.mask_mod is not None:
        visible = visible & problem.mask_mod.numpy_mask(*grids)
    return s, visible, derivative


def _grouped_slopes(problem, alibi_slopes):
    """ALiBi slopes as float32 ``[B or 1, H_kv, G, 1, 1]``, or None."""
    if alibi_slopes is None:
        return None
    slopes = np.asarray(alibi_slopes, dtype=np.float32).reshape(-1, problem.num_heads)
    return slopes.reshape(-1, problem.num_kv_heads, problem.group_size, 1, 1)


# Non-finite inputs propagate by IEEE rules (see the Semantics page), silently
# as on the GPU path: no RuntimeWarning for the NaN a NaN input makes.
QUIET = np.errstate(all="ignore")


@QUIET
def forward(problem, q, k, v, alibi_slopes=None, sinks=None):
    """Return ``(out, lse)`` for a validated problem on NumPy arrays (``sinks``: float32
    ``[H]`` attention sinks, or None)."""
    slopes = _grouped_slopes(problem, alibi_slopes)
    sink = (
        None
        if sinks is None
        else attention_sinks.grouped(sinks, problem.num_kv_heads, problem.group_size)
    )
    out = np.empty(problem.out_shape, dtype=problem.dtype)
    lse = np.empty(problem.lse_shape, dtype=np.float32)
    shape5 = (problem.batch, problem.num_kv_heads, problem.group_size)
    for r0 in range(0, problem.q_len, ROWS):
        r1 = min(r0 + ROWS, problem.q_len)
        q_blk = _grouped(q[:, :, r0:r1], problem)
        row_max = np.full(shape5 + (r1 - r0, 1), -np.inf, dtype=np.float32)
        row_sum = np.zeros(shape5 + (r1 - r0, 1), dtype=np.float32)
        acc = np.zeros(shape5 + (r1 - r0, problem.head_dim_v), dtype=np.float32)
        lo, hi = key_range(r0, r1, problem.q_len, problem.kv_len, *problem.window)
        for c0 in range(lo, hi, COLS):
            c1 = min(c0 + COLS, hi)
            s, _, _ = _scores(problem, q_blk, _kv_block(k, c0, c1), r0, r1, c0, c1, slopes)
            new_max = np.maximum(row_max, s.max(axis=-1, keepdims=True))
            safe_max = np.where(np.isfinite(new_max), new_max, np.float32(0))
            alpha = np.exp(row_max - safe_max)
            p = np.exp(s - safe_max)
            row_sum = row_sum * alpha + p.sum(axis=-1, keepdims=True)
            acc = acc * alpha + p @ _kv_block(v, c0, c1)
            row_max = new_max
        if sink is not None:
            row_max, row_sum, acc = attention_sinks.fold_into_rows(row_max, row_sum, acc, sink)
        seen = row_sum != 0  # a NaN sum (from a NaN input) counts as seen: never hidden
        o = np.where(seen, acc / row_sum, np.float32(0))
        block_lse = np.where(seen, row_max + np.log(row_sum), np.float32(-np.inf))
        out[:, :, r0:r1] = o.reshape(problem.batch, problem.num_heads, r1 - r0, -1)
        lse[:, :, r0:r1] = block_lse.reshape(problem.batch, problem.num_heads, r1 - r0)
    return out, lse


@QUIET
def backward(problem, dout, q, k, v, output, lse, alibi_slopes=None, sinks=None):
    """Return ``(dq, dk, dv)`` for a validated problem on NumPy arrays, and ``dsinks``
    (float32 ``[H]``) after them with ``sinks``."""
    slopes = _grouped_slopes(problem, alibi_slopes)
    scale = np.float32(problem.softmax_scale)
    dq = np.zeros(problem.q_shape, dtype=np.float32)
    dk = np.zeros(problem.kv_shape, dtype=np.float32)
    dv = np.zeros(problem.v_shape, dtype=np.float32)
    grouped_dq = dq.reshape(
        problem.batch, problem.num_kv_heads, problem.group_size, problem.q_len, problem.head_dim
    )
    for c0 in range(0, problem.kv_len, COLS):
        c1 = min(c0 + COLS, problem.kv_len)
        k_blk, v_blk = _kv_block(k, c0, c1), _kv_block(v, c0, c1)
        lo, hi = query_range(c0, c1, problem.q_len, problem.kv_len, *problem.window)
        for r0 in range(lo, hi, ROWS):
            r1 = min(r0 + ROWS, hi)
            q_blk = _grouped(q[:, :, r0:r1], problem)
            do_blk = _grouped(dout[:, :, r0:r1], problem)
            o_blk = _grouped(output[:, :, r0:r1], problem)
            row_lse = _grouped(lse[:, :, r0:r1, None], problem)
            delta = (do_blk * o_blk).sum(axis=-1, keepdims=True)
            s, visible, derivative = _scores(problem, q_blk, k_blk, r0, r1, c0, c1, slopes)
            p = np.where(visible, np.exp(s - row_lse), np.float32(0))
            dp = do_blk @ np.swapaxes(v_blk, -1, -2)
            ds = p * (dp - delta) * derivative
            dv[:, :, c0:c1] += (np.swapaxes(p, -1, -2) @ do_blk).sum(axis=2)
            dk[:, :, c0:c1] += scale * (np.swapaxes(ds, -1, -2) @ q_blk).sum(axis=2)
            grouped_dq[:, :, :, r0:r1] += scale * (ds @ k_blk)
    cast = problem.dtype
    grads = dq.astype(cast), dk.astype(cast), dv.astype(cast)
    if sinks is None:
        return grads
    delta = attention_sinks.row_deltas(dout, output)
    return (*grads, attention_sinks.gradient(np, sinks, lse, delta, 1))
