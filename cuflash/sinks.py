"""Attention sinks (gpt-oss style): a learned logit a query head that joins the softmax
of every row with a zero value vector.

With ``sinks[h]`` each row ``i`` of head ``h`` normalizes over one more term::

    out_i = sum_j exp(s_ij) v_j / (exp(sinks[h]) + sum_j exp(s_ij))
    lse_i = log(exp(sinks[h]) + sum_j exp(s_ij))

so a row that sees no key gives zeros and ``lse = sinks[h]``. The backward of q, k and v
is unchanged given that lse (its probabilities ``exp(s - lse)`` already leave the sink's
share out), and the sinks' own gradient is a reduction over the rows::

    dsinks[h] = -sum_{b, i} exp(sinks[h] - lse_bhi) Delta_bhi,  Delta = rowsum(dout * out)

These helpers serve every path: the CPU path folds the sink into its running softmax
state (:func:`fold_into_rows`, as the kernels' ``add_sink`` does), and every backward
reduces :func:`gradient` with the array module of its arrays (a CuPy sum over a fixed
shape: the same bits on every run).
"""

import math

import numpy as np

from .gpu import kernel_build, standalone


def grouped(sinks, num_kv_heads, group_size):
    """The sinks as float32 ``[1, H_kv, G, 1, 1]`` (the CPU path's grouped heads)."""
    return np.asarray(sinks, dtype=np.float32).reshape(1, num_kv_heads, group_size, 1, 1)


def fold_into_rows(row_max, row_sum, acc, sink):
    """Add ``exp(sink)`` with a zero value vector to rows in their online-softmax state
    (``row_max``, ``row_sum`` relative to it, the unnormalized ``acc``), all float32 and
    broadcasting against ``sink``: the new ``(row_max, row_sum, acc)``. A row that saw no
    key then has ``row_sum = 1`` at ``row_max = sink`` and ``acc = 0``; a ``-inf`` sink
    changes nothing."""
    new_max = np.maximum(row_max, sink)
    base = np.where(np.isfinite(new_max), new_max, np.float32(0))
    alpha = np.exp(row_max - base)
    return new_max, row_sum * alpha + np.exp(sink - base), acc * alpha


def row_deltas(dout, out):
    """``Delta = rowsum(dout * out)`` in float32 (the last axis summed)."""
    return (dout.astype(np.float32) * out.astype(np.float32)).sum(axis=-1)


def gradient(xp, sinks, lse, delta, head_axis):
    """``dsinks`` float32 ``[H]``: ``-sum exp(sinks[h] - lse) delta`` over every axis of
    ``lse`` and ``delta`` (one shape) but ``head_axis``, with ``xp`` (numpy or cupy). Rows
    whose lse is ``-inf`` (a ``-inf`` sink and no key) add nothing. With CuPy it is the
    registry's ``sinks_gradient`` kernel (a block a head, a fixed order: the same bits on
    every run; the element-wise chain it replaced cost the backward about 85 us)."""
    if xp is not np:
        return _gradient_on_gpu(xp, sinks, lse, delta, head_axis)
    shape = [1] * lse.ndim
    shape[head_axis] = -1
    sink = sinks.astype(xp.float32).reshape(shape)
    with np.errstate(all="ignore"):
        share = xp.where(xp.isneginf(lse), xp.float32(0), xp.exp(sink - lse))
    axes = tuple(a for a in range(lse.ndim) if a != head_axis)
    return -(share * delta.astype(xp.float32)).sum(axis=axes).astype(xp.float32)


def _gradient_on_gpu(cupy, sinks, lse, delta, head_axis):
    shape = lse.shape
    outer, inner = math.prod(shape[:head_axis]), math.prod(shape[head_axis + 1 :])
    heads = shape[head_axis]
    sinks = cupy.ascontiguousarray(sinks, dtype=cupy.float32)
    lse = cupy.ascontiguousarray(lse, dtype=cupy.float32)
    delta = cupy.ascontiguousarray(delta, dtype=cupy.float32)
    dsinks = cupy.empty(heads, dtype=cupy.float32)
    kernel = kernel_build.load_standalone(standalone.STANDALONE["sinks_gradient"].name_expression())
    args = (sinks, lse, delta, dsinks, np.int32(outer), np.int32(heads), np.int32(inner))
    kernel((heads,), (512,), args)
    return dsinks
