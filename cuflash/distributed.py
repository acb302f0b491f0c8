"""Sequences longer than one device: ring (context-parallel) attention (SPEC 9).

Each rank holds a shard of the sequence axis of q, k and v (self-attention: one
sequence length). The K/V shards travel around the ring of ranks; at every
step each rank runs the dense flash kernels on its query rows against the K/V
shard it holds and merges the partial outputs by their log-sum-exp, so after
``N`` steps each rank holds its shard of what one call on the whole sequence
gives. The backward sends the dK/dV accumulators around the ring with the K/V
shards, back to their owners.

Two layouts of the sequence axis (``layout=``):

- ``"contiguous"``: ``N`` equal chunks, rank ``r`` holds chunk ``r``;
- ``"zigzag"`` (the default): ``2N`` equal chunks, rank ``r`` holds chunks ``r``
  and ``2N - 1 - r``, one from each end, so that causal attention gives every
  rank the same work.

Each (query chunk, key chunk) pair at global offsets ``a`` and ``c`` sees the
keys of a band ``j - i in [lo, hi]`` of the dense problem's visible-key rule;
:func:`pair_call` turns it into one dense call on views (rows or keys sliced
off a chunk's end shift the band onto the bottom-right diagonal, which the
dense ``window_size`` expresses), or into nothing when no key is visible.

The ranks talk through a *group*: an object with ``rank``, ``size`` and
``exchange(arrays)`` (send a tuple of arrays to the next rank, return the
tuple of the same shapes and dtypes the previous one sent; whose shard a rank
holds at step ``t`` is known: rank ``rank - t``'s). :class:`ThreadGroup` runs ``N`` virtual ranks as threads of one
process (NumPy or CuPy arrays): the simulation the CPU tests check against the
oracle. A group over NCCL, one process a GPU, is the next step (see the
distributed design page).
"""

import dataclasses
import threading

import numpy as np

from .api import flash_attention_bwd, flash_attention_fwd
from .errors import InvalidArgumentError
from .masking import normalize_window

LAYOUTS = ("contiguous", "zigzag")


def chunk_count(layout, size):
    """Chunks the sequence is cut into: ``size`` (contiguous) or ``2 size`` (zigzag)."""
    if layout not in LAYOUTS:
        raise InvalidArgumentError("layout", f"expected one of {LAYOUTS}, got {layout!r}")
    return size if layout == "contiguous" else 2 * size


def rank_chunks(layout, rank, size):
    """The chunk indices rank ``rank`` holds, in the order of its shard."""
    if layout == "contiguous":
        return (rank,)
    chunk_count(layout, size)  # validates the layout
    return (rank, 2 * size - 1 - rank)


def _rows(x, axis, start, stop):
    return x[(slice(None),) * axis + (slice(start, stop),)]


def shard(x, layout, rank, size, axis=2):
    """Rank ``rank``'s shard of the full array ``x`` along ``axis`` (a copy)."""
    count = chunk_count(layout, size)
    length = x.shape[axis]
    if length % count:
        raise InvalidArgumentError(
            "x", f"sequence length {length} is not a multiple of the {count} chunks of the "
            f"{layout} layout over {size} ranks")
    chunk = length // count
    pieces = [_rows(x, axis, c * chunk, (c + 1) * chunk) for c in rank_chunks(layout, rank, size)]
    return _array_module(x).concatenate(pieces, axis=axis)


def gather(shards, layout, axis=2):
    """The full array from every rank's shard (the inverse of :func:`shard`)."""
    size = len(shards)
    count = chunk_count(layout, size)
    chunk = shards[0].shape[axis] // (count // size)
    pieces = [None] * count
    for rank, part in enumerate(shards):
        for slot, c in enumerate(rank_chunks(layout, rank, size)):
            pieces[c] = _rows(part, axis, slot * chunk, (slot + 1) * chunk)
    return _array_module(shards[0]).concatenate(pieces, axis=axis)


def _array_module(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


@dataclasses.dataclass(frozen=True)
class Segment:
    """A chunk inside a shard: its first position in the whole sequence, its length and
    its first row in the shard."""

    start: int
    length: int
    offset: int


def segments(layout, rank, size, shard_length):
    """The chunks of rank ``rank``'s shard of ``shard_length`` rows."""
    chunks = rank_chunks(layout, rank, size)
    chunk = shard_length // len(chunks)
    return tuple(Segment(c * chunk, chunk, i * chunk) for i, c in enumerate(chunks))


@dataclasses.dataclass(frozen=True)
class PairCall:
    """One dense call of a (query chunk, key chunk) pair: query rows ``[0, rows)`` and keys
    ``[0, keys)`` of the chunks, with the dense ``window_size`` tuple ``window``."""

    rows: int
    keys: int
    window: tuple


def pair_call(q_seg, k_seg, left, right):
    """How the rows of ``q_seg`` see the keys of ``k_seg`` under the visible-key rule of
    the whole sequence (``left``/``right`` the window, -1 unbounded, causal folded in):
    a :class:`PairCall`, or None when no key is visible.

    Query ``i`` of the chunk is at position ``p = q_seg.start + i`` and key ``j`` at
    ``k_seg.start + j``; the key is visible iff ``j - i`` lies in ``[lo, hi]`` with
    ``lo = delta - left`` and ``hi = delta + right`` (``delta = q_seg.start -
    k_seg.start``). Slicing ``y`` keys off the end raises the band by ``y`` against the
    dense call's bottom-right diagonal, slicing ``w`` rows off it lowers it by ``w``: the
    call's window is then ``(-lo', hi')`` with ``lo' <= 0 <= hi'``.
    """
    n, m = q_seg.length, k_seg.length
    delta = q_seg.start - k_seg.start
    lo = None if left < 0 else delta - left
    hi = None if right < 0 else delta + right
    if (hi is not None and hi < -(n - 1)) or (lo is not None and lo > m - 1):
        return None  # the band misses the block
    cut_keys = -hi if hi is not None and hi < 0 else 0  # keys past n - 1 + hi: never seen
    cut_rows = lo if lo is not None and lo > 0 else 0  # rows past m - 1 - lo: see nothing
    rows, keys = n - cut_rows, m - cut_keys
    shift = keys - rows  # the dense call's bottom-right diagonal: p = i + keys - rows
    window_left = -1 if lo is None else shift - lo
    window_right = -1 if hi is None else hi - shift
    return PairCall(rows, keys, (window_left, window_right))


class ThreadGroup:
    """``size`` virtual ranks in one process, one thread each: ``run(fn, per_rank_args)``
    calls ``fn(group_of_rank, *args)`` on every rank at once and returns their results
    in rank order. ``exchange`` passes the arrays around the ring without a copy (a rank
    never changes what it sent)."""

    def __init__(self, size):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidArgumentError("size", f"expected an int >= 1, got {size!r}")
        self.size = size
        self._slots = [None] * size
        self._barrier = threading.Barrier(size)

    def run(self, fn, per_rank_args):
        results, errors = [None] * self.size, []

        def work(rank):
            try:
                results[rank] = fn(_ThreadRank(self, rank), *per_rank_args[rank])
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            raise (real or errors)[0]
        return results


class _ThreadRank:
    def __init__(self, group, rank):
        self.group, self.rank, self.size = group, rank, group.size

    def exchange(self, arrays):
        group = self.group
        group._slots[self.rank] = arrays
        group._barrier.wait()
        received = group._slots[(self.rank - 1) % self.size]
        group._barrier.wait()  # everyone has read before the slots are reused
        return received


def _check_group(group):
    for attr in ("rank", "size", "exchange"):
        if not hasattr(group, attr):
            raise InvalidArgumentError(
                "group", f"expected a process group with rank, size and exchange(), got "
                f"{type(group).__name__}")
    return group.rank, group.size


def _check_shards(q, k, v, layout, size):
    count = chunk_count(layout, size) // size
    length = q.shape[2] if getattr(q, "ndim", 0) == 4 else None
    if length is None or k.ndim != 4 or v.ndim != 4:
        return  # the dense functions name the rank error
    if k.shape[2] != length or v.shape[2] != length:
        raise InvalidArgumentError(
            "k", f"shard length {k.shape[2]} differs from q's {length}: ring attention is "
            "self-attention over one sequence")
    if length % count:
        raise InvalidArgumentError(
            "q", f"shard length {length} is not a multiple of the {count} chunks a rank holds "
            f"in the {layout} layout")


def _window(causal, window_size, total):
    """The whole sequence's (left, right), causal folded in."""
    return normalize_window(window_size, causal, total, total)


class _Schedule:
    """One rank's ring: the arguments checked, and the pairs it computes at each step."""

    def __init__(self, group, layout, q, k, v, causal, window_size):
        self.rank, self.size = _check_group(group)
        chunk_count(layout, self.size)
        _check_shards(q, k, v, layout, self.size)
        self.layout, self.shard_length = layout, q.shape[2]
        self.window = _window(causal, window_size, q.shape[2] * self.size)
        self.q_segments = segments(layout, self.rank, self.size, q.shape[2])

    def pairs(self, step):
        """``(rows, keys, window)`` of each dense call at step ``step``, when the rank
        holds rank ``rank - step``'s K/V shard: slices of its q and of that shard."""
        owner = (self.rank - step) % self.size
        for q_seg in self.q_segments:
            for k_seg in segments(self.layout, owner, self.size, self.shard_length):
                call = pair_call(q_seg, k_seg, *self.window)
                if call is not None:
                    yield (slice(q_seg.offset, q_seg.offset + call.rows),
                           slice(k_seg.offset, k_seg.offset + call.keys), call.window)


def _merge(out_acc, lse_acc, out, lse, xp):
    """out_acc, lse_acc (float32 views) <- the log-sum-exp merge with a partial result;
    rows that see no key (lse -inf) on both sides stay 0 and -inf, never NaN."""
    new = xp.logaddexp(lse_acc, lse)
    base = xp.where(xp.isneginf(new), np.float32(0), new)
    keep = xp.exp(lse_acc - base)[..., None]
    take = xp.exp(lse - base)[..., None]
    out_acc[...] = keep * out_acc + take * out.astype(np.float32)
    lse_acc[...] = new


def ring_attention_fwd(q, k, v, num_heads, num_kv_heads, head_dim, causal=False,
                       window_size=0, *, group, layout="zigzag", softmax_scale=None,
                       allow_tf32=False):
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

    Returns
    -------
    out : array ``[B, H, S_shard, D]``, dtype of ``q``
    lse : float32 array ``[B, H, S_shard]``
        This rank's rows of the single call's results.
    """
    schedule = _Schedule(group, layout, q, k, v, causal, window_size)
    xp = _array_module(q)
    out_acc = xp.zeros(q.shape, dtype=np.float32)
    lse_acc = xp.full(q.shape[:3], -np.inf, dtype=np.float32)
    kv = (k, v)
    for step in range(schedule.size):
        for rows, keys, window in schedule.pairs(step):
            out, lse = flash_attention_fwd(
                q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], num_heads, num_kv_heads,
                head_dim, False, window, softmax_scale=softmax_scale, allow_tf32=allow_tf32)
            _merge(out_acc[:, :, rows], lse_acc[:, :, rows], out, lse, xp)
        if step + 1 < schedule.size:
            kv = group.exchange(kv)
    return out_acc.astype(q.dtype), lse_acc


def ring_attention_bwd(dout, q, k, v, out, lse, num_heads, num_kv_heads, head_dim,
                       causal=False, window_size=0, *, group, layout="zigzag",
                       softmax_scale=None, deterministic=False, allow_tf32=False):
    """Gradients of :func:`ring_attention_fwd` for this rank's shards.

    ``out`` and ``lse`` are this rank's results of the forward (the merged ones: every
    pair's backward takes its probabilities from them). The dK/dV accumulators of each
    K/V shard travel around the ring with it and come back to its owner. With
    ``deterministic`` every rank adds its pairs in a fixed order: the same bits on
    every run.

    Returns
    -------
    dq : array, shape and dtype of ``q``
    dk, dv : arrays, shape and dtype of ``k``
    """
    schedule = _Schedule(group, layout, q, k, v, causal, window_size)
    xp = _array_module(q)
    dq_acc = xp.zeros(q.shape, dtype=np.float32)
    travelling = (k, v, xp.zeros(k.shape, dtype=np.float32),
                  xp.zeros(v.shape, dtype=np.float32))
    for step in range(schedule.size):
        k_now, v_now, dk_acc, dv_acc = travelling
        for rows, keys, window in schedule.pairs(step):
            dq, dk, dv = flash_attention_bwd(
                dout[:, :, rows], q[:, :, rows], k_now[:, :, keys], v_now[:, :, keys],
                out[:, :, rows], xp.ascontiguousarray(lse[:, :, rows]), num_heads,
                num_kv_heads, head_dim, False, window, softmax_scale=softmax_scale,
                deterministic=deterministic, allow_tf32=allow_tf32)
            dq_acc[:, :, rows] += dq
            dk_acc[:, :, keys] += dk
            dv_acc[:, :, keys] += dv
        if step + 1 < schedule.size:
            travelling = group.exchange(travelling)
    # One more exchange, of the accumulators only, brings each home to its owner.
    dk_acc, dv_acc = group.exchange(travelling[2:])
    return dq_acc.astype(q.dtype), dk_acc.astype(k.dtype), dv_acc.astype(v.dtype)


@dataclasses.dataclass(frozen=True)
class RingVJP:
    """The residuals of one ring forward on one rank; ``dq, dk, dv = vjp(dout)``."""

    q: object
    k: object
    v: object
    out: object
    lse: object
    arguments: tuple
    options: dict

    def __call__(self, dout, *, deterministic=False):
        return ring_attention_bwd(dout, self.q, self.k, self.v, self.out, self.lse,
                                  *self.arguments, deterministic=deterministic, **self.options)


def ring_attention_vjp(q, k, v, num_heads, num_kv_heads, head_dim, causal=False,
                       window_size=0, *, group, layout="zigzag", softmax_scale=None,
                       allow_tf32=False):
    """:func:`ring_attention_fwd` plus a :class:`RingVJP` for the matching backward."""
    arguments = (num_heads, num_kv_heads, head_dim, causal, window_size)
    options = dict(group=group, layout=layout, softmax_scale=softmax_scale,
                   allow_tf32=allow_tf32)
    out, lse = ring_attention_fwd(q, k, v, *arguments, **options)
    return out, RingVJP(q, k, v, out, lse, arguments, options)


__all__ = ["LAYOUTS", "RingVJP", "ThreadGroup", "gather", "pair_call", "ring_attention_bwd",
           "ring_attention_fwd", "ring_attention_vjp", "segments", "shard"]


class NcclGroup:
    """One rank of a ring over NCCL: one process a GPU, the communicator from
    ``cupyx.distributed.init_process_group`` (its TCP store on ``host:port``). Arrays
    travel as bytes on a stream of their own, which waits for the compute stream's
    work on them; the compute stream then waits for the received ones."""

    def __init__(self, rank, size, host=None, port=None):
        import cupy
        import cupyx.distributed

        self.rank, self.size = rank, size
        self.backend = cupyx.distributed.init_process_group(size, rank, host=host, port=port)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    @classmethod
    def from_environment(cls):
        """The rank and size torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
        MASTER_PORT) or mpirun (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK) set; the
        process's GPU is its local rank."""
        import os

        import cupy

        env = os.environ
        rank = int(env.get("RANK", env.get("OMPI_COMM_WORLD_RANK", 0)))
        size = int(env.get("WORLD_SIZE", env.get("OMPI_COMM_WORLD_SIZE", 1)))
        local = int(env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", rank)))
        cupy.cuda.Device(local).use()
        port = env.get("MASTER_PORT")
        return cls(rank, size, host=env.get("MASTER_ADDR"),
                   port=int(port) if port else None)

    def exchange(self, arrays):
        import cupy
        from cupy.cuda import nccl

        compute = cupy.cuda.get_current_stream()
        arrays = tuple(cupy.ascontiguousarray(a) for a in arrays)
        received = tuple(cupy.empty_like(a) for a in arrays)
        self.stream.wait_event(compute.record())
        comm = self.backend._comm
        nccl.groupStart()
        for sent, into in zip(arrays, received):
            comm.send(sent.data.ptr, sent.nbytes, nccl.NCCL_UINT8, (self.rank + 1) % self.size,
                      self.stream.ptr)
            comm.recv(into.data.ptr, into.nbytes, nccl.NCCL_UINT8, (self.rank - 1) % self.size,
                      self.stream.ptr)
        nccl.groupEnd()
        compute.wait_event(self.stream.record())
        return received
