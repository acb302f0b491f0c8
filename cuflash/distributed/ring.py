"""The ring: each rank's schedule of dense calls, the log-sum-exp merge, and the
forward and backward passes over a process group."""

import dataclasses

import numpy as np

from .. import sinks as attention_sinks
from ..api import flash_attention_bwd, flash_attention_fwd
from ..core.masking import normalize_window
from ..core.problem import check_sinks
from ..errors import InvalidArgumentError
from ..fp8 import check_not_fp8
from ..gpu import standalone
from ..gpu.kernel_build import load_standalone
from .groups import start_exchange
from .layout import array_module, chunk_count, segments, step_calls


def check_group(group):
    """``(rank, size)`` of a process group (rank, size and ``exchange()``), else
    ``InvalidArgumentError``."""
    for attr in ("rank", "size", "exchange"):
        if not hasattr(group, attr):
            raise InvalidArgumentError(
                "group",
                f"expected a process group with rank, size and exchange(), got "
                f"{type(group).__name__}",
            )
    return group.rank, group.size


def check_shards(q, k, v, layout, size):
    """Shards of one sequence: q, k and v of one length, a whole number of the chunks a
    rank holds in ``layout`` (other rank errors are the dense functions')."""
    count = chunk_count(layout, size) // size
    length = q.shape[2] if getattr(q, "ndim", 0) == 4 else None
    if length is None or k.ndim != 4 or v.ndim != 4:
        return  # the dense functions name the rank error
    if k.shape[2] != length or v.shape[2] != length:
        raise InvalidArgumentError(
            "k",
            f"shard length {k.shape[2]} differs from q's {length}: ring attention is "
            "self-attention over one sequence",
        )
    if length % count:
        raise InvalidArgumentError(
            "q",
            f"shard length {length} is not a multiple of the {count} chunks a rank holds "
            f"in the {layout} layout",
        )


def _window(causal, window_size, total):
    """The whole sequence's (left, right), causal folded in."""
    return normalize_window(window_size, causal, total, total)


class _Schedule:
    """One rank's ring: the arguments checked, and the pairs it computes at each step."""

    def __init__(self, group, layout, q, k, v, causal, window_size):
        self.rank, self.size = check_group(group)
        check_not_fp8([("q", q), ("k", k), ("v", v)])  # before any rank exchanges
        chunk_count(layout, self.size)
        check_shards(q, k, v, layout, self.size)
        self.layout, self.shard_length = layout, q.shape[2]
        self.window = _window(causal, window_size, q.shape[2] * self.size)
        self.q_segments = segments(layout, self.rank, self.size, q.shape[2])

    def pairs(self, step):
        """``(rows, keys, window)`` of each dense call at step ``step``, when the rank
        holds rank ``rank - step``'s K/V shard: slices of its q and of that shard
        (:func:`step_calls`: the step's pairs in as few calls as their bands allow)."""
        owner = (self.rank - step) % self.size
        k_segments = segments(self.layout, owner, self.size, self.shard_length)
        for row0, key0, call in step_calls(self.q_segments, k_segments, *self.window):
            yield slice(row0, row0 + call.rows), slice(key0, key0 + call.keys), call.window


def _merge(out_acc, lse_acc, out, lse, rows):
    """Rows ``rows`` of the accumulators (float32 ``[B, H, S_shard, D]`` and ``[B, H,
    S_shard]``) <- their log-sum-exp merge with a partial result of those rows. Rows
    that see no key (lse -inf) on both sides stay 0 and -inf, never NaN."""
    if isinstance(out_acc, np.ndarray):
        acc, acc_lse = out_acc[:, :, rows], lse_acc[:, :, rows]
        new = np.logaddexp(acc_lse, lse)
        base = np.where(np.isneginf(new), np.float32(0), new)
        keep = np.exp(acc_lse - base)[..., None]
        take = np.exp(lse - base)[..., None]
        acc[...] = keep * acc + take * out.astype(np.float32)
        acc_lse[...] = new
        return
    _merge_on_gpu(out_acc, lse_acc, out, lse, rows)


def _merge_on_gpu(out_acc, lse_acc, out, lse, rows):
    """:func:`_merge` in one pass of the registry's ``ring_merge`` (a warp a row)."""
    import cupy

    out, lse = cupy.ascontiguousarray(out), cupy.ascontiguousarray(lse)
    batch, heads, shard_len, head_dim = out_acc.shape
    count = rows.stop - rows.start
    heads_total = batch * heads
    kernel = load_standalone(standalone.STANDALONE["ring_merge"].name_expression(dtype=out.dtype))
    threads = 256
    blocks = -(-heads_total * count * 32 // threads)
    kernel(
        (blocks,),
        (threads,),
        (
            out_acc,
            lse_acc,
            out,
            lse,
            np.int64(heads_total),
            np.int32(count),
            np.int32(rows.start),
            np.int32(shard_len),
            np.int32(head_dim),
        ),
    )


def _add_sinks(xp, out_acc, lse_acc, sinks):
    """The merged rows (float32 ``[B, H, S_shard, D]``, ``[B, H, S_shard]``) with the
    attention sinks joined once: ``lse <- logaddexp(lse, sinks[h])`` and the output
    rescaled by ``exp(old lse - new lse)`` (a row that saw no key: zeros, lse the sink)."""
    sink = sinks.astype(np.float32)[None, :, None]
    new = xp.logaddexp(lse_acc, sink)
    with np.errstate(invalid="ignore"):
        keep = xp.where(xp.isneginf(new), xp.float32(0), xp.exp(lse_acc - new))
    return out_acc * keep[..., None], new.astype(np.float32)


def _summed_in_rank_order(group, rank, size, part):
    """The sum over the ranks of each one's ``part`` (an array of one shape), passed
    around the ring and added in rank order: the same bits on every rank and run."""
    parts = {rank: part}
    held = part
    for step in range(size - 1):
        (held,) = start_exchange(group, (held,)).wait()  # rank - 1 - step's part
        parts[(rank - 1 - step) % size] = held
    total = parts[0]
    for r in range(1, size):
        total = total + parts[r]
    return total


def _no_keys_seen(xp, q):
    """Accumulators of rows that have seen no key yet: float32 zeros and lse -inf."""
    return xp.zeros(q.shape, dtype=np.float32), xp.full(q.shape[:3], -np.inf, np.float32)


def _forward_pair(xp, q, k, v, rows, keys, window, arguments, out_acc, lse_acc):
    """One pair's dense call merged into the accumulators (made by the first pair: its
    results where it covers every row); returns them. The pair's own results die here,
    before the next call allocates its own."""
    num_heads, num_kv_heads, head_dim, softmax_scale, allow_tf32 = arguments
    out, lse = flash_attention_fwd(
        q[:, :, rows],
        k[:, :, keys],
        v[:, :, keys],
        num_heads,
        num_kv_heads,
        head_dim,
        False,
        window,
        softmax_scale=softmax_scale,
        allow_tf32=allow_tf32,
    )
    if out_acc is None and rows.stop - rows.start == q.shape[2]:
        return out.astype(np.float32), lse  # the first covers every row
    if out_acc is None:
        out_acc, lse_acc = _no_keys_seen(xp, q)
    _merge(out_acc, lse_acc, out, lse, rows)
    return out_acc, lse_acc


def _backward_pairs(xp, schedule, step, arrays, k, v, arguments, dq_acc):
    """The dense backward of each pair of ``step``: dQ added into ``dq_acc`` at once,
    the ``(keys, dk, dv)`` of each pair returned for the shard's accumulators (which are
    still on their way). No pair's dQ outlives its addition."""
    dout, q, out, lse = arrays
    num_heads, num_kv_heads, head_dim, softmax_scale, deterministic, allow_tf32 = arguments
    partial = []
    for rows, keys, window in schedule.pairs(step):
        dq, dk, dv = flash_attention_bwd(
            dout[:, :, rows],
            q[:, :, rows],
            k[:, :, keys],
            v[:, :, keys],
            out[:, :, rows],
            xp.ascontiguousarray(lse[:, :, rows]),
            num_heads,
            num_kv_heads,
            head_dim,
            False,
            window,
            softmax_scale=softmax_scale,
            deterministic=deterministic,
            allow_tf32=allow_tf32,
        )
        dq_acc[:, :, rows] += dq
        del dq
        partial.append((keys, dk, dv))
    return partial


def ring_attention_fwd(
    q,
    k,
    v,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=False,
    window_size=0,
    *,
    group,
    layout="zigzag",
    softmax_scale=None,
    allow_tf32=False,
    sinks=None,
):
    """This rank's shard of the attention over the whole sequence, forward pass.

    Parameters
    ----------
    q, k, v : arrays ``[B, H, S_shard, D]`` and ``[B, H_kv, S_shard, D]``
        This rank's shard of the sequence axis in ``layout`` (see :func:`shard`).
    num_heads, num_kv_heads, head_dim, causal, window_size, softmax_scale, allow_tf32
        As in :func:`cuflash.flash_attention_fwd`, for the whole sequence
        (``S = S_shard * size``; causal and windows by global positions).
    group : process group
        ``rank``, ``size`` and ``exchange(arrays)``: e.g. a rank of :class:`ThreadGroup`.
    layout : {"zigzag", "contiguous"}
    sinks : float32 array ``[num_heads]``, optional
        Attention sinks, as in :func:`cuflash.flash_attention_fwd` (the same on every
        rank): they join each row once, after the steps' merge.

    Returns
    -------
    out : array ``[B, H, S_shard, D]``, dtype of ``q``
    lse : float32 array ``[B, H, S_shard]``
        This rank's rows of the single call's results.
    """
    schedule = _Schedule(group, layout, q, k, v, causal, window_size)
    check_sinks(sinks, q, num_heads)
    xp = array_module(q)
    out_acc = lse_acc = None
    k_now, v_now = k, v
    for step in range(schedule.size):
        last = step + 1 == schedule.size
        # The next step's shards travel while this step's kernels run.
        incoming = None if last else start_exchange(group, (k_now, v_now))
        arguments = (num_heads, num_kv_heads, head_dim, softmax_scale, allow_tf32)
        for rows, keys, window in schedule.pairs(step):
            out_acc, lse_acc = _forward_pair(
                xp, q, k_now, v_now, rows, keys, window, arguments, out_acc, lse_acc
            )
        if incoming is not None:
            k_now, v_now = incoming.wait()
    if out_acc is None:  # no row sees any key
        out_acc, lse_acc = _no_keys_seen(xp, q)
    if sinks is not None:
        out_acc, lse_acc = _add_sinks(xp, out_acc, lse_acc, sinks)
    return out_acc.astype(q.dtype), lse_acc


def ring_attention_bwd(
    dout,
    q,
    k,
    v,
    out,
    lse,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=False,
    window_size=0,
    *,
    group,
    layout="zigzag",
    softmax_scale=None,
    deterministic=False,
    allow_tf32=False,
    sinks=None,
):
    """Gradients of :func:`ring_attention_fwd` for this rank's shards.

    ``out`` and ``lse`` are this rank's results of the forward (the merged ones: every
    pair's backward takes its probabilities from them). The dK/dV accumulators of each
    K/V shard travel around the ring with it and come back to its owner. With
    ``deterministic`` every rank adds its pairs in a fixed order: the same bits on
    every run. With ``sinks`` (the forward's), ``dsinks`` comes fourth: every rank's rows'
    share summed around the ring in rank order, the same on every rank (the gradient of
    the whole sequence's loss).

    Returns
    -------
    dq : array, shape and dtype of ``q``
    dk, dv : arrays, shape and dtype of ``k``
    dsinks : float32 array ``[num_heads]``, only with ``sinks``
    """
    schedule = _Schedule(group, layout, q, k, v, causal, window_size)
    check_sinks(sinks, q, num_heads)
    xp = array_module(q)
    dq_acc = xp.zeros(q.shape, dtype=np.float32)
    k_now, v_now = k, v
    sending = None  # the dK/dV accumulators on their way to the next rank
    arguments = (num_heads, num_kv_heads, head_dim, softmax_scale, deterministic, allow_tf32)
    for step in range(schedule.size):
        last = step + 1 == schedule.size
        incoming = None if last else start_exchange(group, (k_now, v_now))
        partial = _backward_pairs(
            xp, schedule, step, (dout, q, out, lse), k_now, v_now, arguments, dq_acc
        )
        # The accumulators of the shard held now (rank - step's) come from the previous
        # rank, which held that shard one step ago; they travelled during the kernels.
        if sending is None:
            dk_acc = xp.zeros(k.shape, dtype=np.float32)
            dv_acc = xp.zeros(v.shape, dtype=np.float32)
        else:
            dk_acc, dv_acc = sending.wait()
        for keys, dk, dv in partial:
            dk_acc[:, :, keys] += dk
            dv_acc[:, :, keys] += dv
        partial = dk = dv = None  # the step's gradients, before the next step's calls
        # After the last step the next rank is the shard's owner: the accumulators go home.
        sending = start_exchange(group, (dk_acc, dv_acc))
        dk_acc = dv_acc = None  # the exchange holds them until they have left
        if incoming is not None:
            k_now, v_now = incoming.wait()
    assert sending is not None  # a group has at least one rank: one step at least
    dq = dq_acc.astype(q.dtype)
    del dq_acc
    dk_acc, dv_acc = sending.wait()
    grads = dq, dk_acc.astype(k.dtype), dv_acc.astype(v.dtype)
    if sinks is None:
        return grads
    part = attention_sinks.gradient(xp, sinks, lse, attention_sinks.row_deltas(dout, out), 1)
    return (*grads, _summed_in_rank_order(group, schedule.rank, schedule.size, part))


@dataclasses.dataclass(frozen=True)
class RingVJP:
    """The residuals of one ring forward on one rank; ``dq, dk, dv = vjp(dout)`` (and
    ``dsinks`` fourth with sinks)."""

    q: object
    k: object
    v: object
    out: object
    lse: object
    arguments: tuple
    options: dict
    backward = staticmethod(ring_attention_bwd)  # the matching backward of the mode

    def __call__(self, dout, *, deterministic=False):
        return self.backward(
            dout,
            self.q,
            self.k,
            self.v,
            self.out,
            self.lse,
            *self.arguments,
            deterministic=deterministic,
            **self.options,
        )


def with_vjp(forward, residuals, q, k, v, arguments, options):
    """``forward(q, k, v, *arguments, **options)``'s ``out`` and its ``residuals`` object
    (a :class:`RingVJP` or one of its modes') for the matching backward."""
    out, lse = forward(q, k, v, *arguments, **options)
    return out, residuals(q, k, v, out, lse, arguments, options)


def ring_attention_vjp(
    q,
    k,
    v,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=False,
    window_size=0,
    *,
    group,
    layout="zigzag",
    softmax_scale=None,
    allow_tf32=False,
    sinks=None,
):
    """:func:`ring_attention_fwd` plus a :class:`RingVJP` for the matching backward."""
    arguments = (num_heads, num_kv_heads, head_dim, causal, window_size)
    options = dict(
        group=group, layout=layout, softmax_scale=softmax_scale, allow_tf32=allow_tf32, sinks=sinks
    )
    return with_vjp(ring_attention_fwd, RingVJP, q, k, v, arguments, options)
