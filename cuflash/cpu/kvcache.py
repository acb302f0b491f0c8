"""The CPU path of :func:`cuflash.flash_attention_with_kvcache` (the KV-cache page): NumPy
arrays, host-held lengths already validated by :func:`cuflash.core.kvcache_problem.kvcache_problem`;
the append (rotating the new keys with rotary tables), then a blocked online softmax in
float32 one sequence at a time."""

import numpy as np

from .. import rotary as rotary_embedding
from .. import sinks as attention_sinks
from ..core.masking import key_range, visible_keys
from .dense import modify_scores, user_modified

CPU_KEY_BLOCK = 512
CPU_ROW_BLOCK = 256


def _key_index(problem, block_table, b, positions):
    """(blocks, rows) of positions ``positions`` of sequence ``b`` in the cache."""
    if not problem.paged:
        return np.full(positions.shape, b), positions
    return block_table[b, positions // problem.block_size], positions % problem.block_size


def _gather(problem, cache, block_table, b, length):
    """Sequence ``b``'s first ``length`` keys as float32 ``[H_kv, length, D]``."""
    blocks, rows = _key_index(problem, block_table, b, np.arange(length))
    return cache[blocks, :, rows].astype(np.float32).transpose(1, 0, 2)


@np.errstate(all="ignore")
def _attend(problem, q_seq, keys, values, kv_len, slopes=None, b=0, sink=None):
    """One sequence (batch entry ``b``): q ``[H, S_q, D]``, keys float32 ``[H_kv, L, D]``,
    values ``[H_kv, L, D_v]`` -> out ``[H, S_q, D_v]``, lse; ``slopes`` the sequence's
    ALiBi slopes as float32 ``[H_kv, G, 1, 1]`` or None; the user's functions
    (``problem.score_mod``, ``mask_mod``) after them; ``sink`` the attention sinks as
    float32 ``[1, H_kv, G, 1, 1]``, or None.

    Blocked over query rows and keys with an online softmax in float32.
    """
    h_kv, group, q_len, d, dv = (
        problem.num_kv_heads,
        problem.group_size,
        problem.q_len,
        problem.head_dim,
        problem.head_dim_v,
    )
    scale = np.float32(problem.softmax_scale)
    out = np.zeros((h_kv, group, q_len, dv), dtype=np.float32)
    lse = np.full((h_kv, group, q_len), -np.inf, dtype=np.float32)
    q_grouped = q_seq.astype(np.float32).reshape(h_kv, group, q_len, d)
    for r0 in range(0, q_len, CPU_ROW_BLOCK):
        r1 = min(r0 + CPU_ROW_BLOCK, q_len)
        q_blk = q_grouped[:, :, r0:r1]
        row_max = np.full((h_kv, group, r1 - r0, 1), -np.inf, dtype=np.float32)
        row_sum = np.zeros((h_kv, group, r1 - r0, 1), dtype=np.float32)
        acc = np.zeros((h_kv, group, r1 - r0, dv), dtype=np.float32)
        lo, hi = key_range(r0, r1, q_len, kv_len, *problem.window)
        for c0 in range(lo, hi, CPU_KEY_BLOCK):
            c1 = min(c0 + CPU_KEY_BLOCK, hi)
            k_blk = keys[:, None, c0:c1]
            s = (q_blk @ np.swapaxes(k_blk, -1, -2)) * scale
            s, _ = modify_scores(s, r0, r1, c0, c1, q_len, kv_len, problem.softcap, slopes)
            visible = visible_keys(
                np.arange(r0, r1), np.arange(c0, c1), q_len, kv_len, *problem.window
            )
            s, visible, _ = user_modified(problem, s, visible, None, np.int64(b), r0, r1, c0, c1)
            s = np.where(visible, s, np.float32(-np.inf))
            new_max = np.maximum(row_max, s.max(axis=-1, keepdims=True))
            base = np.where(np.isfinite(new_max), new_max, np.float32(0))
            alpha = np.exp(row_max - base)
            p = np.exp(s - base)
            row_sum = row_sum * alpha + p.sum(axis=-1, keepdims=True)
            acc = acc * alpha + p @ values[:, None, c0:c1]
            row_max = new_max
        if sink is not None:
            row_max, row_sum, acc = attention_sinks.fold_into_rows(row_max, row_sum, acc, sink[0])
        seen = row_sum != 0  # a NaN sum counts as seen: NaN is never hidden
        out[:, :, r0:r1] = np.where(seen, acc / row_sum, np.float32(0))
        lse[:, :, r0:r1] = np.where(seen, row_max + np.log(row_sum), np.float32(-np.inf))[..., 0]
    return out.reshape(-1, q_len, dv), lse.reshape(-1, q_len)


def _append_cpu(problem, cache, new, block_table, lengths):
    positions = np.arange(problem.new_len)
    for b, length in enumerate(lengths):
        blocks, rows = _key_index(problem, block_table, b, int(length) + positions)
        cache[blocks, :, rows] = new[b].transpose(1, 0, 2)


def cpu_forward(
    problem,
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
):
    """Return ``(out, lse)`` on NumPy arrays; appends first (lengths already validated),
    with ``problem.rotary`` rotating copies of ``q`` and ``k_new`` at their positions."""
    lengths = problem.host_lengths
    if problem.rotary is not None:
        q, k_new = rotary_embedding.rotated_inputs(problem, q, k_new, rotary_cos, rotary_sin)
    if problem.new_len:
        _append_cpu(problem, k_cache, k_new, block_table, lengths)
        _append_cpu(problem, v_cache, v_new, block_table, lengths)
    out = np.empty(problem.out_shape, dtype=problem.dtype)
    lse = np.empty(problem.lse_shape, dtype=np.float32)
    if problem.num_heads == 0:
        return out, lse
    sink = (
        None
        if sinks is None
        else attention_sinks.grouped(sinks, problem.num_kv_heads, problem.group_size)
    )
    for b in range(problem.batch):
        kv_len = int(lengths[b]) + problem.new_len
        keys = _gather(problem, k_cache, block_table, b, kv_len)
        values = _gather(problem, v_cache, block_table, b, kv_len)
        slopes = None
        if alibi_slopes is not None:
            row = alibi_slopes[b] if alibi_slopes.ndim == 2 else alibi_slopes
            slopes = row.astype(np.float32).reshape(problem.num_kv_heads, problem.group_size, 1, 1)
        out_b, lse_b = _attend(problem, q[b], keys, values, kv_len, slopes, b, sink)
        out[b] = out_b.astype(problem.dtype)
        lse[b] = lse_b
    return out, lse
