"""Ready-made modifiers: causal, document, prefix-LM and chunked masks, their
combinations, soft-capping, ALiBi and a relative-position bias. Each is an ordinary
modifier: a function of the language, its numbers baked in."""

import math

import numpy as np

from ..errors import InvalidArgumentError
from .api import MaskMod, ScoreMod, require_int
from .frontend import is_array
from .functions import abs, maximum, minimum, tanh


def _require_array(name, value, ndims, dtypes):
    if not is_array(value):
        raise InvalidArgumentError(
            name, f"expected a numpy or cupy array, got {type(value).__name__}"
        )
    if value.ndim not in ndims:
        shapes = " or ".join(f"{ndim}-D" for ndim in ndims)
        raise InvalidArgumentError(name, f"expected {shapes}, got {value.ndim}-D")
    if np.dtype(value.dtype) not in dtypes:
        names = " or ".join(np.dtype(dtype).name for dtype in dtypes)
        raise InvalidArgumentError(name, f"expected dtype {names}, got {value.dtype}")
    return value


_INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_FLOAT_DTYPES = (np.dtype(np.float32),)


def causal_mask(offset=0):
    """Keys at or before the query's position ``q_idx + offset`` (``offset = kv_len -
    q_len`` aligns the last query with the last key, as ``causal=True`` does)."""
    offset = require_int("offset", offset, -(2**31))

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return MaskMod(causal)


def document_mask(doc_ids, kv_doc_ids=None):
    """Keys of the query's own document (packed sequences of several documents).

    Parameters
    ----------
    doc_ids : int32 or int64 array, ``[S_q]`` or ``[B, S_q]``
        The document of each query (and key, without ``kv_doc_ids``).
    kv_doc_ids : array like ``doc_ids``, optional
        The document of each key, ``[S_k]`` or ``[B, S_k]``.

    Combine with :func:`causal_mask` through :func:`and_masks` for causal
    attention inside each document.
    """
    query_ids = _require_array("doc_ids", doc_ids, (1, 2), _INDEX_DTYPES)
    key_ids = (
        query_ids
        if kv_doc_ids is None
        else _require_array("kv_doc_ids", kv_doc_ids, (query_ids.ndim,), _INDEX_DTYPES)
    )
    if query_ids.ndim == 1:

        def same_document(b, h, q_idx, kv_idx):
            return query_ids[q_idx] == key_ids[kv_idx]
    else:

        def same_document(b, h, q_idx, kv_idx):
            return query_ids[b, q_idx] == key_ids[b, kv_idx]

    return MaskMod(same_document)


def prefix_lm_mask(prefix_len, offset=0):
    """Prefix-LM attention: every key of the prefix, causal after it.

    Parameters
    ----------
    prefix_len : int or int32/int64 array ``[B]``
        The prefix's length (per batch entry for an array).
    offset : int
        The query's position is ``q_idx + offset``.
    """
    offset = require_int("offset", offset, -(2**31))
    if is_array(prefix_len):
        lengths = _require_array("prefix_len", prefix_len, (1,), _INDEX_DTYPES)

        def prefix_or_causal(b, h, q_idx, kv_idx):
            return kv_idx < lengths[b] or kv_idx <= q_idx + offset
    else:
        length = require_int("prefix_len", prefix_len, 0)

        def prefix_or_causal(b, h, q_idx, kv_idx):
            return kv_idx < length or kv_idx <= q_idx + offset

    return MaskMod(prefix_or_causal)


def chunked_mask(chunk, causal=True, offset=0):
    """Chunked local attention: query and key in the same chunk of ``chunk`` positions
    (and the key not after the query with ``causal``). The query's position is
    ``q_idx + offset``."""
    chunk = require_int("chunk", chunk, 1)
    offset = require_int("offset", offset, -(2**31))
    if not isinstance(causal, (bool, np.bool_)):
        raise InvalidArgumentError("causal", f"expected a bool, got {type(causal).__name__}")
    causal = bool(causal)

    def same_chunk(b, h, q_idx, kv_idx):
        position = q_idx + offset
        return position // chunk == kv_idx // chunk and (kv_idx <= position or not causal)

    return MaskMod(same_chunk)


def _joined(masks, operation):
    if not masks or not all(isinstance(mask, MaskMod) for mask in masks):
        raise InvalidArgumentError("masks", "expected one or more MaskMod objects")
    result = masks[0]
    for other in masks[1:]:
        first, second = result, other
        if operation == "and":

            def both(b, h, q_idx, kv_idx):
                return first(b, h, q_idx, kv_idx) and second(b, h, q_idx, kv_idx)

            result = MaskMod(both)
        else:

            def either(b, h, q_idx, kv_idx):
                return first(b, h, q_idx, kv_idx) or second(b, h, q_idx, kv_idx)

            result = MaskMod(either)
    return result


def and_masks(*masks):
    """A key is visible where every one of ``masks`` shows it."""
    return _joined(masks, "and")


def or_masks(*masks):
    """A key is visible where any one of ``masks`` shows it."""
    return _joined(masks, "or")


def softcap_score(cap):
    """Soft-capping, ``cap * tanh(score / cap)`` (the built-in ``softcap``)."""
    if (
        isinstance(cap, (bool, np.bool_))
        or not isinstance(cap, (int, float, np.number))
        or not math.isfinite(cap)
        or cap <= 0
    ):
        raise InvalidArgumentError("cap", f"expected a finite number > 0, got {cap!r}")
    cap = float(cap)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * tanh(score / cap)

    return ScoreMod(softcap)


def alibi_score(slopes, offset=0):
    """ALiBi, ``score - slope * |q_idx + offset - kv_idx|`` (the built-in
    ``alibi_slopes``, with ``offset = kv_len - q_len``).

    Parameters
    ----------
    slopes : float32 array ``[H]`` or ``[B, H]``
    offset : int
    """
    slopes = _require_array("slopes", slopes, (1, 2), _FLOAT_DTYPES)
    offset = require_int("offset", offset, -(2**31))
    if slopes.ndim == 1:

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * abs(q_idx + offset - kv_idx)
    else:

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[b, h] * abs(q_idx + offset - kv_idx)

    return ScoreMod(alibi)


def relative_bias_score(table, offset=0):
    """A learned bias per head and relative distance, ``score + table[h, d + R]``.

    Parameters
    ----------
    table : float32 array ``[H, 2 R + 1]``
        The bias of distance ``d = kv_idx - (q_idx + offset)`` from ``-R`` to
        ``R``; farther keys get the bias of ``-R`` or ``R`` (distances are
        clipped, so every size passes :meth:`Modifier.check_bounds`).
    offset : int
    """
    table = _require_array("table", table, (2,), _FLOAT_DTYPES)
    if table.shape[1] % 2 == 0:
        raise InvalidArgumentError(
            "table", f"expected an odd number of distances (2 R + 1), got {table.shape[1]}"
        )
    reach = (table.shape[1] - 1) // 2
    offset = require_int("offset", offset, -(2**31))

    def relative_bias(score, b, h, q_idx, kv_idx):
        distance = minimum(maximum(kv_idx - q_idx - offset, -reach), reach)
        return score + table[h, distance + reach]

    return ScoreMod(relative_bias)
