"""The visible-key rule shared by every path (see the Semantics page).

A query row ``i`` sits at absolute position ``p = i + kv_len - q_len``
(bottom-right alignment). Key ``j`` is visible iff ``j < kv_len`` and
``p - left <= j`` (when ``left >= 0``) and ``j <= p + right`` (when
``right >= 0``). ``left = right = -1`` means no window; ``causal`` sets
``right = 0``.
"""

import numbers

import numpy as np

from ..errors import InvalidArgumentError

UNBOUNDED = -1


def _as_int(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(name, f"expected an int, got {type(value).__name__}")
    return int(value)


def normalize_window(window_size, causal, kv_capacity, q_len):
    """Turn ``window_size`` and ``causal`` into ``(left, right)`` bounds.

    ``window_size`` is ``0`` (no window), ``w > 0`` (the ``w`` most recent
    keys including the current one: ``left = w - 1``) or a ``(left, right)``
    tuple with FlashAttention-2's meaning (``-1`` unbounded). ``causal``
    forces ``right = 0``. Bounds at least as wide as the whole problem are
    returned as unbounded, so the kernels only ever see int32 values.
    """
    if isinstance(window_size, (tuple, list)):
        if len(window_size) != 2:
            raise InvalidArgumentError(
                "window_size", f"a tuple must be (left, right), got {len(window_size)} items"
            )
        left = _as_int("window_size", window_size[0])
        right = _as_int("window_size", window_size[1])
        if left < UNBOUNDED or right < UNBOUNDED:
            raise InvalidArgumentError(
                "window_size", f"(left, right) must each be >= -1, got ({left}, {right})"
            )
    else:
        w = _as_int("window_size", window_size)
        if w < 0:
            raise InvalidArgumentError("window_size", f"must be >= 0, got {w}")
        left, right = (w - 1, UNBOUNDED) if w > 0 else (UNBOUNDED, UNBOUNDED)
    if not isinstance(causal, (bool, np.bool_)):
        raise InvalidArgumentError("causal", f"expected a bool, got {type(causal).__name__}")
    if causal:
        right = 0
    reach = int(kv_capacity) + int(q_len)
    if left > reach:
        left = UNBOUNDED
    if right > reach:
        right = UNBOUNDED
    return left, right


def visible_keys(rows, cols, q_len, kv_len, left, right):
    """Boolean mask ``[len(rows), len(cols)]``: may query ``rows[a]`` see key ``cols[b]``?"""
    p = np.asarray(rows, dtype=np.int64)[:, None] + (kv_len - q_len)
    j = np.asarray(cols, dtype=np.int64)[None, :]
    mask = j < kv_len
    if left >= 0:
        mask = mask & (j >= p - left)
    if right >= 0:
        mask = mask & (j <= p + right)
    return mask


def mean_visible_keys(q_len, kv_len, left, right):
    """The keys a query row sees on average (0.0 without rows)."""
    if q_len == 0:
        return 0.0
    last = np.arange(q_len, dtype=np.int64) + (kv_len - q_len)  # each row's aligned key
    lo = np.zeros(q_len, np.int64) if left < 0 else np.maximum(last - left, 0)
    hi = np.full(q_len, kv_len, np.int64) if right < 0 else np.minimum(last + right + 1, kv_len)
    return float(np.maximum(hi - lo, 0).mean())


def key_range(row_lo, row_hi, q_len, kv_len, left, right):
    """Keys ``[lo, hi)`` that any query row in ``[row_lo, row_hi)`` may see."""
    offset = kv_len - q_len
    lo, hi = 0, kv_len
    if left >= 0:
        lo = max(lo, row_lo + offset - left)
    if right >= 0:
        hi = min(hi, row_hi - 1 + offset + right + 1)
    return lo, max(lo, hi)


def query_range(key_lo, key_hi, q_len, kv_len, left, right):
    """Query rows ``[lo, hi)`` that may see any key in ``[key_lo, key_hi)``."""
    key_hi = min(key_hi, kv_len)
    if key_lo >= key_hi:
        return 0, 0
    offset = kv_len - q_len
    lo, hi = 0, q_len
    if right >= 0:
        lo = max(lo, key_lo - right - offset)
    if left >= 0:
        hi = min(hi, key_hi - 1 + left - offset + 1)
    return lo, max(lo, hi)
