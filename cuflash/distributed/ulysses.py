"""Ulysses (all-to-all) attention: the ring's arguments and results, split over heads.

Each rank holds a shard of the sequence axis with every head (``layout`` as the
ring's). An all-to-all over heads gives rank ``r`` the whole sequence of its group of
heads (query heads ``[r H / N, (r + 1) H / N)`` and their KV heads ``[r H_kv / N, (r +
1) H_kv / N)``); one dense call computes them, and an all-to-all back returns each
rank its shard of every head (the Distributed page). The backward does the same with
``dout``, and sends ``dq``, ``dk``, ``dv`` back. ``num_heads`` and ``num_kv_heads``
must be multiples of the group size (GQA's groups then stay on one rank).

The all-to-all runs over the group's ring exchange: ``N - 1`` steps pass each rank's
chunks for every rank along, so a rank receives what each other rank holds for it
(with two ranks one exchange, the all-to-all itself; with more, ``N / 2`` times an
all-to-all's bytes on average: a group with its own all-to-all is the next step).
"""

from ..api import flash_attention_bwd, flash_attention_fwd
from ..core.problem import check_sinks
from ..errors import InvalidArgumentError
from .groups import start_exchange
from .layout import array_module, gather, shard
from .ring import RingVJP, check_group, check_shards, with_vjp


def _check_heads(num_heads, num_kv_heads, size):
    for name, count in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(count, int) and count % size:
            raise InvalidArgumentError(
                name,
                f"{count} heads do not split over the {size} ranks of Ulysses attention "
                "(a multiple of the group size, each rank a group of heads)",
            )


def all_to_all(group, chunks):
    """``chunks[j]`` (a tuple of arrays) goes to rank ``j``; returns ``received`` with
    ``received[j]`` the tuple rank ``j`` sent here, over ``size - 1`` ring exchanges."""
    rank, size = group.rank, group.size
    received = [None] * size
    received[rank] = chunks[rank]
    held = tuple(a for chunk in chunks for a in chunk)
    width = len(chunks[rank])
    for step in range(1, size):
        held = start_exchange(group, held).wait()  # rank (rank - step)'s chunks
        source = (rank - step) % size
        received[source] = held[rank * width : (rank + 1) * width]
    return received


def _heads(x, part, parts):
    """Heads ``[part n / parts, (part + 1) n / parts)`` of ``x`` ``[B, n, ...]``."""
    count = x.shape[1] // parts
    return x[:, part * count : (part + 1) * count]


def _to_heads(group, layout, arrays):
    """Shards with every head -> the whole sequence of this rank's heads (per array)."""
    size = group.size
    chunks = [tuple(_heads(a, j, size) for a in arrays) for j in range(size)]
    received = all_to_all(group, chunks)
    return [gather([received[j][i] for j in range(size)], layout) for i in range(len(arrays))]


def _to_shards(group, layout, arrays):
    """The whole sequence of this rank's heads -> this rank's shard with every head."""
    size, xp = group.size, array_module(arrays[0])
    chunks = [tuple(shard(a, layout, j, size) for a in arrays) for j in range(size)]
    received = all_to_all(group, chunks)
    return [
        xp.concatenate([received[j][i] for j in range(size)], axis=1) for i in range(len(arrays))
    ]


def _local_sinks(sinks, rank, size):
    return None if sinks is None else _heads(sinks[None], rank, size)[0]


def ulysses_attention_fwd(
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
    """:func:`cuflash.distributed.ring_attention_fwd`'s arguments and results, by an
    all-to-all over heads: this rank's shard ``(out, lse)`` of the attention over the
    whole sequence."""
    rank, size = check_group(group)
    check_shards(q, k, v, layout, size)
    _check_heads(num_heads, num_kv_heads, size)
    check_sinks(sinks, q, num_heads)
    q_all, k_all, v_all = _to_heads(group, layout, (q, k, v))
    out, lse = flash_attention_fwd(
        q_all,
        k_all,
        v_all,
        num_heads // size,
        num_kv_heads // size,
        head_dim,
        causal,
        window_size,
        softmax_scale=softmax_scale,
        allow_tf32=allow_tf32,
        sinks=_local_sinks(sinks, rank, size),
    )
    out_shard, lse_shard = _to_shards(group, layout, (out, lse))
    return out_shard, lse_shard


def ulysses_attention_bwd(
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
    """:func:`cuflash.distributed.ring_attention_bwd`'s arguments and results: the
    gradients of this rank's shards (and ``dsinks`` fourth with ``sinks``: every head's,
    the same on every rank)."""
    rank, size = check_group(group)
    check_shards(q, k, v, layout, size)
    _check_heads(num_heads, num_kv_heads, size)
    check_sinks(sinks, q, num_heads)
    arrays = _to_heads(group, layout, (dout, q, k, v, out, lse))
    grads = flash_attention_bwd(
        *arrays,
        num_heads // size,
        num_kv_heads // size,
        head_dim,
        causal,
        window_size,
        softmax_scale=softmax_scale,
        deterministic=deterministic,
        allow_tf32=allow_tf32,
        sinks=_local_sinks(sinks, rank, size),
    )
    dq, dk, dv = _to_shards(group, layout, grads[:3])
    if sinks is None:
        return dq, dk, dv
    received = all_to_all(group, [(grads[3],)] * size)  # each rank's heads' dsinks
    xp = array_module(grads[3])
    return dq, dk, dv, xp.concatenate([received[j][0] for j in range(size)])


class UlyssesVJP(RingVJP):
    """The residuals of one Ulysses forward on one rank; ``dq, dk, dv = vjp(dout)`` (and
    ``dsinks`` fourth with sinks)."""

    backward = staticmethod(ulysses_attention_bwd)


def ulysses_attention_vjp(
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
    """:func:`ulysses_attention_fwd` plus a :class:`UlyssesVJP` for the matching backward."""
    arguments = (num_heads, num_kv_heads, head_dim, causal, window_size)
    options = dict(
        group=group, layout=layout, softmax_scale=softmax_scale, allow_tf32=allow_tf32, sinks=sinks
    )
    return with_vjp(ulysses_attention_fwd, UlyssesVJP, q, k, v, arguments, options)
