"""Ulysses (all-to-all) attention and the hybrid: the ring's arguments and results,
split over heads.

Each rank holds a shard of the sequence axis with every head (``layout`` as the
ring's). In the **Ulysses** mode an all-to-all over heads gives rank ``r`` of ``N`` the
whole sequence of its group of heads (query heads ``[r H / N, (r + 1) H / N)`` and
their KV heads); one dense call computes them, and an all-to-all back returns each
rank its shard of every head (the Distributed page). The backward does the same with
``dout``, and sends ``dq``, ``dk``, ``dv`` back.

The **hybrid** runs the all-to-all inside sub-groups of ``U`` consecutive ranks (a
node's GPUs) and the ring across the ``N / U`` sub-groups: after the all-to-all the
``U`` shards of a sub-group, joined, are its shard of the sequence in the same layout
over ``N / U`` ranks, and the ring over the ranks that hold the same heads in every
sub-group computes them. ``U = N`` is Ulysses, ``U = 1`` the ring. ``num_heads`` must
be a multiple of ``U``, and ``num_kv_heads`` a multiple (GQA's groups then stay on one
rank) or a divisor (:func:`kv_share`: each of ``U / num_kv_heads`` ranks gets a copy of
the KV head its query heads read, and the copies' dK and dV are summed on the way
back).
"""

from ..api import flash_attention_bwd, flash_attention_fwd
from ..core.problem import check_sinks
from ..errors import InvalidArgumentError
from . import cost_model
from .groups import all_to_all, start_all_to_all, subgroup
from .layout import array_module, gather, shard
from .ring import (
    RingVJP,
    check_group,
    check_shards,
    ring_attention_bwd,
    ring_attention_fwd,
    with_vjp,
)


def _check_heads(num_heads, num_kv_heads, size):
    if isinstance(num_heads, int) and num_heads % size:
        raise InvalidArgumentError(
            "num_heads",
            f"{num_heads} heads do not split over the {size} ranks of an all-to-all "
            "(a multiple of the Ulysses group's size, each rank a group of heads)",
        )
    if isinstance(num_kv_heads, int) and num_kv_heads % size and size % num_kv_heads:
        raise InvalidArgumentError(
            "num_kv_heads",
            f"{num_kv_heads} KV heads neither split over the {size} ranks of an all-to-all "
            "nor divide them (a multiple of the Ulysses group's size, each rank a group of "
            "KV heads, or a divisor, each KV head copied to size / num_kv_heads ranks)",
        )


def kv_share(num_kv_heads, size):
    """Ranks of an all-to-all of ``size`` that hold one KV head: 1 where the KV heads
    split over the ranks, else ``size / num_kv_heads`` (GQA and MQA with fewer KV heads
    than ranks: each rank a copy of the one KV head its query heads read, the gradients
    of the copies summed on the way back)."""
    return 1 if num_kv_heads % size == 0 else size // num_kv_heads


def default_ulysses_size(group, q, num_heads, num_kv_heads, head_dim, causal=False):
    """The hybrid's ``ulysses_size`` when the caller gives none: the one the cost model
    (:mod:`cuflash.distributed.cost_model`) predicts fastest for this call's shape, among
    the divisors of the group's size over which the heads split and that fit in a node
    (``group.local_size`` ranks, all of them when the group does not say; 1 or all of
    them for a group without ``start_send_recv``)."""
    size = group.size
    problem = cost_model.Problem(
        batch=q.shape[0],
        heads=num_heads,
        kv_heads=num_kv_heads,
        head_dim=head_dim,
        seq_len=q.shape[2] * size,
        causal=bool(causal),
        dtype_bytes=q.dtype.itemsize,
    )
    machine = cost_model.Machine(gpus_per_node=getattr(group, "local_size", size) or size)
    # A group without start_send_recv runs no ring over some of its ranks.
    allowed = None if hasattr(group, "start_send_recv") else (1, size)
    return cost_model.best_ulysses_size(problem, size, machine, allowed)


def hybrid_groups(group, ulysses_size):
    """``(ulysses_group, ring_group)`` of this rank for sub-groups of ``ulysses_size``
    consecutive ranks: the sub-group it belongs to, and the ranks at its place in every
    sub-group."""
    rank, size = check_group(group)
    whole = isinstance(ulysses_size, int) and not isinstance(ulysses_size, bool)
    if not whole or ulysses_size < 1 or size % ulysses_size:
        raise InvalidArgumentError(
            "ulysses_size",
            f"expected a divisor of the group's size {size}, got {ulysses_size!r}",
        )
    block, place = divmod(rank, ulysses_size)
    ulysses = subgroup(group, range(block * ulysses_size, (block + 1) * ulysses_size))
    ring = subgroup(group, range(place, size, ulysses_size))
    return ulysses, ring


def _heads(x, part, parts):
    """Heads ``[part n / parts, (part + 1) n / parts)`` of ``x`` ``[B, n, ...]``."""
    count = x.shape[1] // parts
    return x[:, part * count : (part + 1) * count]


def _across_heads(group, layout, arrays, shares, out_shares, calls, compute):
    """``compute`` on this rank's heads of the group's shards joined, its outputs sent
    back as this rank's shard of every head.

    ``arrays[i]`` are shards with every head; for ``shares[i]`` > 1 a rank receives a
    copy of the head ``shares[i]`` ranks read (:func:`kv_share`). The heads go in
    ``calls`` parts: ``compute(local, c)`` gets part ``c`` of this rank's heads and
    returns ``(outputs, extra)``. Every part's all-to-all starts at once, so part ``c +
    1`` travels while part ``c`` computes, and part ``c``'s outputs travel back while
    ``c + 1`` computes. Returns the outputs as shards of every head (for
    ``out_shares[i]`` > 1 the copies' sum, in float32 and in rank order: the same bits
    on every run) and the list of the parts' extras.
    """
    size = group.size
    if size == 1:
        outputs, extra = compute(list(arrays), 0)
        return list(outputs), [extra]

    def part(c):
        return [
            tuple(_heads(_heads(a, j // s, size // s), c, calls) for a, s in zip(arrays, shares))
            for j in range(size)
        ]

    pending = [start_all_to_all(group, part(c)) for c in range(calls)]
    returning, extras = [], []
    for c in range(calls):
        received = pending[c].wait()
        pending[c] = None
        local = [gather([received[j][i] for j in range(size)], layout) for i in range(len(arrays))]
        del received
        outputs, extra = compute(local, c)
        del local
        shards = [tuple(shard(x, layout, j, size) for x in outputs) for j in range(size)]
        returning.append(start_all_to_all(group, shards))
        extras.append(extra)
        del outputs, shards
    arrived = [r.wait() for r in returning]
    xp = array_module(arrived[0][0][0])
    joined = []
    for i, s in enumerate(out_shares):
        per_rank = [
            xp.concatenate([arrived[c][j][i] for c in range(calls)], axis=1)
            if calls > 1
            else arrived[0][j][i]
            for j in range(size)
        ]
        if s > 1:
            per_rank = [_summed(xp, per_rank[h : h + s]) for h in range(0, size, s)]
        joined.append(xp.concatenate(per_rank, axis=1))
    return joined, extras


def _calls(parts, share, kv_local, ring):
    """Parts of a rank's heads computed one after the other, so that the all-to-alls run
    under the kernels: two where the rank holds an even number ``kv_local`` of KV heads
    of its own (no copies) and runs one dense call (a ring overlaps its own transfers,
    and a part more would double its steps' latency), else one."""
    return 2 if parts > 1 and ring.size == 1 and share == 1 and kv_local % 2 == 0 else 1


def _summed(xp, copies):
    total = copies[0].astype(xp.float32)
    for copy in copies[1:]:
        total += copy
    return total.astype(copies[0].dtype)


def _local_sinks(sinks, rank, size):
    return None if sinks is None else _heads(sinks[None], rank, size)[0]


def _checked(group, q, k, v, layout, arguments, sinks, ulysses_size):
    """The groups of a hybrid call, every argument checked before any exchange."""
    _, size = check_group(group)
    check_shards(q, k, v, layout, size)
    num_heads, num_kv_heads, head_dim, causal = arguments[:4]
    if ulysses_size is None:
        plain = all(isinstance(n, int) and n > 0 for n in (num_heads, num_kv_heads, head_dim))
        # Arguments the dense functions will refuse: the ring's checks name them.
        shaped = plain and getattr(q, "ndim", 0) == 4
        ulysses_size = (
            default_ulysses_size(group, q, num_heads, num_kv_heads, head_dim, causal)
            if shaped
            else 1
        )
    groups = hybrid_groups(group, ulysses_size)
    _check_heads(num_heads, num_kv_heads, ulysses_size)
    check_sinks(sinks, q, num_heads)
    return groups


def hybrid_attention_fwd(
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
    ulysses_size=None,
    layout="zigzag",
    softmax_scale=None,
    allow_tf32=False,
    sinks=None,
):
    """:func:`cuflash.distributed.ring_attention_fwd`'s arguments and results, by an
    all-to-all over heads inside sub-groups of ``ulysses_size`` consecutive ranks and
    the ring across them (``None``: :func:`default_ulysses_size`)."""
    heads, ring = _checked(
        group, q, k, v, layout, (num_heads, num_kv_heads, head_dim, causal), sinks, ulysses_size
    )
    parts, share = heads.size, kv_share(num_kv_heads, heads.size)
    kv_local = num_kv_heads * share // parts
    calls = _calls(parts, share, kv_local, ring)
    sinks_local = _local_sinks(sinks, heads.rank, parts)

    def compute(local, c):
        q_h, k_h, v_h = local
        arguments = (num_heads // parts // calls, kv_local // calls, head_dim, causal, window_size)
        options = dict(
            softmax_scale=softmax_scale,
            allow_tf32=allow_tf32,
            sinks=_local_sinks(sinks_local, c, calls),
        )
        if ring.size == 1:
            return flash_attention_fwd(q_h, k_h, v_h, *arguments, **options), None
        return ring_attention_fwd(
            q_h, k_h, v_h, *arguments, group=ring, layout=layout, **options
        ), None

    (out_shard, lse_shard), _ = _across_heads(
        heads, layout, (q, k, v), (1, share, share), (1, 1), calls, compute
    )
    return out_shard, lse_shard


def hybrid_attention_bwd(
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
    ulysses_size=None,
    layout="zigzag",
    softmax_scale=None,
    deterministic=False,
    allow_tf32=False,
    sinks=None,
):
    """:func:`cuflash.distributed.ring_attention_bwd`'s arguments and results: the
    gradients of this rank's shards (and ``dsinks`` fourth with ``sinks``: every head's,
    the same bits on every rank)."""
    heads, ring = _checked(
        group, q, k, v, layout, (num_heads, num_kv_heads, head_dim, causal), sinks, ulysses_size
    )
    parts, share = heads.size, kv_share(num_kv_heads, heads.size)
    kv_local = num_kv_heads * share // parts
    calls = _calls(parts, share, kv_local, ring)
    sinks_local = _local_sinks(sinks, heads.rank, parts)

    def compute(local, c):
        arguments = (num_heads // parts // calls, kv_local // calls, head_dim, causal, window_size)
        options = dict(
            softmax_scale=softmax_scale,
            deterministic=deterministic,
            allow_tf32=allow_tf32,
            sinks=_local_sinks(sinks_local, c, calls),
        )
        dout_h, q_h, k_h, v_h, out_h, lse_h = local
        inputs = (dout_h, q_h, k_h, v_h, out_h, lse_h)
        if ring.size == 1:
            grads = flash_attention_bwd(*inputs, *arguments, **options)
        else:
            grads = ring_attention_bwd(*inputs, *arguments, group=ring, layout=layout, **options)
        return grads[:3], (grads[3] if sinks is not None else None)

    (dq, dk, dv), dsinks = _across_heads(
        heads,
        layout,
        (dout, q, k, v, out, lse),
        (1, 1, share, share, 1, 1),
        (1, share, share),
        calls,
        compute,
    )
    if sinks is None:
        return dq, dk, dv
    xp = array_module(dsinks[0])
    mine = xp.concatenate(dsinks)  # this rank's heads' dsinks, its parts in order
    received = all_to_all(heads, [(mine,)] * parts)
    return dq, dk, dv, xp.concatenate([received[j][0] for j in range(parts)])


class HybridVJP(RingVJP):
    """The residuals of one hybrid forward on one rank; ``dq, dk, dv = vjp(dout)`` (and
    ``dsinks`` fourth with sinks)."""

    backward = staticmethod(hybrid_attention_bwd)


def hybrid_attention_vjp(
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
    ulysses_size=None,
    layout="zigzag",
    softmax_scale=None,
    allow_tf32=False,
    sinks=None,
):
    """:func:`hybrid_attention_fwd` plus a :class:`HybridVJP` for the matching backward."""
    arguments = (num_heads, num_kv_heads, head_dim, causal, window_size)
    options = dict(
        group=group,
        ulysses_size=ulysses_size,
        layout=layout,
        softmax_scale=softmax_scale,
        allow_tf32=allow_tf32,
        sinks=sinks,
    )
    return with_vjp(hybrid_attention_fwd, HybridVJP, q, k, v, arguments, options)


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
    all-to-all over heads across the whole group: this rank's shard ``(out, lse)`` of
    the attention over the whole sequence (:func:`hybrid_attention_fwd` with
    ``ulysses_size`` the group's size)."""
    _, size = check_group(group)
    return hybrid_attention_fwd(
        q,
        k,
        v,
        num_heads,
        num_kv_heads,
        head_dim,
        causal,
        window_size,
        group=group,
        ulysses_size=size,
        layout=layout,
        softmax_scale=softmax_scale,
        allow_tf32=allow_tf32,
        sinks=sinks,
    )


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
    """:func:`cuflash.distributed.ring_attention_bwd`'s arguments and results, by an
    all-to-all over heads across the whole group (and ``dsinks`` fourth with
    ``sinks``: every head's, the same on every rank)."""
    _, size = check_group(group)
    return hybrid_attention_bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        num_heads,
        num_kv_heads,
        head_dim,
        causal,
        window_size,
        group=group,
        ulysses_size=size,
        layout=layout,
        softmax_scale=softmax_scale,
        deterministic=deterministic,
        allow_tf32=allow_tf32,
        sinks=sinks,
    )


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
