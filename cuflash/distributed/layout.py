"""Where each rank's rows of the sequence lie (the layouts), and which keys each
(query chunk, key chunk) pair sees: the pure index arithmetic of ring attention."""

import dataclasses

import numpy as np

from ..errors import InvalidArgumentError

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
    return array_module(x).concatenate(pieces, axis=axis)


def gather(shards, layout, axis=2):
    """The full array from every rank's shard (the inverse of :func:`shard`)."""
    size = len(shards)
    count = chunk_count(layout, size)
    chunk = shards[0].shape[axis] // (count // size)
    pieces = [None] * count
    for rank, part in enumerate(shards):
        for slot, c in enumerate(rank_chunks(layout, rank, size)):
            pieces[c] = _rows(part, axis, slot * chunk, (slot + 1) * chunk)
    return array_module(shards[0]).concatenate(pieces, axis=axis)


def array_module(x):
    """NumPy or CuPy, whichever holds ``x``."""
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
