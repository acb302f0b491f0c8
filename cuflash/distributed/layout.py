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
            "x",
            f"sequence length {length} is not a multiple of the {count} chunks of the "
            f"{layout} layout over {size} ranks",
        )
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


def pair_band(q_seg, k_seg, left, right):
    """The band ``[lo, hi]`` of ``j - i`` (key ``j`` of ``k_seg``, query ``i`` of ``q_seg``,
    indices within the chunks) that the whole sequence's visible-key rule lets through:
    ``lo = delta - left``, ``hi = delta + right`` with ``delta = q_seg.start -
    k_seg.start``; None for an unbounded side (``left``/``right`` -1)."""
    delta = q_seg.start - k_seg.start
    return (None if left < 0 else delta - left), (None if right < 0 else delta + right)


def band_call(rows, keys, lo, hi, fused=False):
    """The dense call of a ``rows`` x ``keys`` block that sees the keys ``j - i in [lo, hi]``
    (None: unbounded): a :class:`PairCall`, or None when no key is visible (or, with
    ``fused``, for a rectangle of several pairs, when no dense window expresses the
    band: one that misses the call's bottom-right diagonal).

    Slicing ``y`` keys off the end raises the band by ``y`` against the dense call's
    bottom-right diagonal, slicing ``w`` rows off it lowers it by ``w``: the call's
    window is then ``(-lo', hi')`` with ``lo' <= 0 <= hi'``.
    """
    if (hi is not None and hi < -(rows - 1)) or (lo is not None and lo > keys - 1):
        return None  # the band misses the block
    # Keys past rows - 1 + hi are never seen, rows past keys - 1 - lo see nothing.
    cut_keys = 0 if hi is None else max(0, keys - (rows + hi))
    cut_rows = 0 if lo is None else max(0, rows - (keys - lo))
    rows, keys = rows - cut_rows, keys - cut_keys
    shift = keys - rows  # the dense call's bottom-right diagonal: p = i + keys - rows
    window_left = -1 if lo is None else shift - lo
    window_right = -1 if hi is None else hi - shift
    if (
        window_left < -1
        or window_right < -1
        or (window_left == -1 and lo is not None)
        or (window_right == -1 and hi is not None)
    ):
        return None if fused else _unrepresentable(rows, keys, lo, hi)
    return PairCall(rows, keys, (window_left, window_right))


def _unrepresentable(rows, keys, lo, hi):
    raise AssertionError(
        f"the band [{lo}, {hi}] of a {rows} x {keys} pair misses its diagonal"
    )  # a pair's band always holds it (tested)


def pair_call(q_seg, k_seg, left, right):
    """How the rows of ``q_seg`` see the keys of ``k_seg`` under the visible-key rule of
    the whole sequence (``left``/``right`` the window, -1 unbounded, causal folded in):
    a :class:`PairCall`, or None when no key is visible (:func:`pair_band`,
    :func:`band_call`)."""
    return band_call(q_seg.length, k_seg.length, *pair_band(q_seg, k_seg, left, right))


def _clipped(lo, hi, rows, keys):
    """The band ``[lo, hi]`` clipped to a ``rows`` x ``keys`` block; None when empty."""
    lo = -(rows - 1) if lo is None else max(lo, -(rows - 1))
    hi = keys - 1 if hi is None else min(hi, keys - 1)
    return None if lo > hi else (lo, hi)


def _shifted(bound, shift):
    return None if bound is None else bound + shift


def block_call(q_segs, k_segs, left, right):
    """One dense call for the rectangle of consecutive chunks ``q_segs`` x ``k_segs`` of
    the shards, when its visible keys form one band in the rectangle's own indices:
    ``(row offset, key offset, PairCall)``, or None (no band fits, or nothing visible).

    Each pair's band, moved into the rectangle's indices, must equal the candidate
    band on the pair's block (both clipped to it); the candidates are the pairs' own
    bounds and unbounded.
    """
    row0, key0 = q_segs[0].offset, k_segs[0].offset
    blocks = [
        (q, k, *pair_band(q, k, left, right), k.offset - key0 - (q.offset - row0))
        for q in q_segs
        for k in k_segs
    ]
    if all(_clipped(lo, hi, q.length, k.length) is None for q, k, lo, hi, _ in blocks):
        return None
    lows = {None} | {_shifted(lo, shift) for _, _, lo, _, shift in blocks}
    highs = {None} | {_shifted(hi, shift) for _, _, _, hi, shift in blocks}
    for low in sorted(lows, key=lambda x: (x is not None, x)):
        for high in sorted(highs, key=lambda x: (x is not None, x)):
            if all(
                _clipped(_shifted(low, -shift), _shifted(high, -shift), q.length, k.length)
                == _clipped(lo, hi, q.length, k.length)
                for q, k, lo, hi, shift in blocks
            ):
                call = band_call(
                    sum(q.length for q in q_segs),
                    sum(k.length for k in k_segs),
                    low,
                    high,
                    fused=True,
                )
                if call is not None:
                    return row0, key0, call
    return None


def step_calls(q_segs, k_segs, left, right):
    """The dense calls of one ring step (a rank's chunks against the chunks of the shard
    it holds): ``(row offset, key offset, PairCall)`` each, as few as bands allow.

    The whole rectangle in one call where one band covers it; else a call for each
    query chunk's row or each key chunk's column (whichever needs fewer), else a call
    for each pair. Every visible (query, key) falls in exactly one call.
    """
    whole = block_call(q_segs, k_segs, left, right)
    if whole is not None or all(
        pair_call(q, k, left, right) is None for q in q_segs for k in k_segs
    ):
        return [whole] if whole is not None else []
    options = []
    for lines in ([[(q,), k_segs] for q in q_segs], [[q_segs, (k,)] for k in k_segs]):
        calls = []
        for line_q, line_k in lines:
            if all(pair_call(q, k, left, right) is None for q in line_q for k in line_k):
                continue
            call = block_call(tuple(line_q), tuple(line_k), left, right)
            if call is None:
                break
            calls.append(call)
        else:
            options.append(calls)
    if options:
        return min(options, key=len)
    return [
        (q.offset, k.offset, call)
        for q in q_segs
        for k in k_segs
        if (call := pair_call(q, k, left, right)) is not None
    ]
