"""A value head dim of its own (``head_dim_v``) on the GPU where a kernel does not take it.

The kernels that take v narrower than q and k natively (``KernelSpec.takes_value_dims``:
the Hopper forward ``forward_wgmma_ws``, the Hopper backward ``backward_wgmma`` with its
dQ pass) run such calls as they are. Every other kernel takes one head dim for q, k and v: a
call whose v is narrower or wider than q and k runs them on a problem of the
wider width, the narrower operands padded with zero columns on the device, and
slices the results back:

* ``head_dim_v < head_dim``: v (and, in the backward, dout and the output) gain
  zero columns. The output's padding columns are then exact zeros, Delta =
  rowsum(dout * out) is unchanged, and dv's padding columns (P^T dout) are
  zeros that are cut off.
* ``head_dim_v > head_dim``: q and k gain zero columns, which add nothing to
  any score; dq's and dk's padding columns are cut off.

So the results are those of the unpadded problem, exactly (the softmax scale was
fixed from the true ``head_dim`` before padding). Each call pays for the copies
and the wider products. Where the plans are built (``forward_plan``,
``backward_plan``) the plan's ``takes_value_dims`` says which calls run natively;
calls with equal widths get the plain plan and pay nothing here.
"""

import dataclasses

try:  # CuPy is optional: the CPU path needs only NumPy.
    import cupy
except ImportError:  # pragma: no cover - exercised only without CuPy
    cupy = None


def _attention(problem):
    """The :class:`cuflash.core.problem.AttentionProblem` of a dense problem, or of a packed
    call's ``cuflash.core.varlen_problem.VarlenProblem`` (which holds it as ``attention``)."""
    return getattr(problem, "attention", problem)


def pads_values(problem):
    """Does this problem (dense or packed) run through the padding?"""
    attention = _attention(problem)
    return attention.head_dim != attention.head_dim_v


def widened(problem):
    """``problem`` (dense or packed) with both head dims at the wider one."""
    attention = _attention(problem)
    width = max(attention.head_dim, attention.head_dim_v)
    wide = dataclasses.replace(attention, head_dim=width, head_dim_v=width)
    return wide if attention is problem else dataclasses.replace(problem, attention=wide)


def with_columns(a, width):
    """``a`` itself when its last dimension is ``width``, else a contiguous copy with
    zero columns appended up to ``width``."""
    columns = a.shape[-1]
    if columns == width:
        return a
    wide = cupy.empty((*a.shape[:-1], width), dtype=a.dtype)
    wide[..., columns:] = 0
    wide[..., :columns] = a
    return wide


def first_columns(a, width):
    """The first ``width`` columns of ``a`` as a contiguous array (``a`` itself when it
    has no more)."""
    if a.shape[-1] == width:
        return a
    return cupy.ascontiguousarray(a[..., :width])


class _Padding:
    """The two head dims of a call: its arrays widened to the common width (those of
    that width pass as they are)."""

    def __init__(self, problem):
        attention = _attention(problem)
        self.head_dim = attention.head_dim
        self.head_dim_v = attention.head_dim_v
        self.width = max(self.head_dim, self.head_dim_v)

    def widen(self, *arrays):
        return tuple(with_columns(a, self.width) for a in arrays)


def forward_plan(build, problem, q, k, v):
    """``build(problem, q, k, v)``, a forward plan (``gpu.ForwardPlan``,
    ``packed_plans.PackedForward``), for a problem of equal widths or one its kernel takes
    natively (``build.takes_value_dims``); else that plan built at the common width,
    wrapped in the padding."""
    if not pads_values(problem) or build.takes_value_dims(problem, q, k, v):
        return build(problem, q, k, v)
    padding = _Padding(problem)
    return PaddedForward(build(widened(problem), *padding.widen(q, k, v)), padding)


def backward_plan(build, problem, dout, q, k, v, out, *rest):
    """The same for a backward plan, ``build(problem, dout, q, k, v, out, *rest)``
    (``gpu.BackwardPlan``, ``packed_plans.PackedBackward``; ``rest`` ends with the call's
    ``deterministic``), natively where ``build.takes_value_dims`` says so."""
    deterministic = bool(rest[-1]) if rest else False
    if not pads_values(problem) or build.takes_value_dims(
        problem, dout, q, k, v, out, deterministic=deterministic
    ):
        return build(problem, dout, q, k, v, out, *rest)
    padding = _Padding(problem)
    plan = build(widened(problem), *padding.widen(dout, q, k, v, out), *rest)
    return PaddedBackward(plan, padding)


class PaddedForward:
    """A forward plan at the common width: pads a call's inputs and cuts the output to
    ``head_dim_v`` columns (the lse is the unpadded problem's as it is)."""

    def __init__(self, plan, padding):
        self.plan = plan
        self.padding = padding

    def __call__(self, q, k, v, *args, **kwargs):
        out, lse = self.plan(*self.padding.widen(q, k, v), *args, **kwargs)
        return first_columns(out, self.padding.head_dim_v), lse


class PaddedBackward:
    """A backward plan at the common width: pads a call's inputs and cuts dq, dk to
    ``head_dim`` and dv to ``head_dim_v`` columns (dsinks, if any, as they are). The plan
    runs unsynchronized; the stream is synchronized after the cutting when the call asks
    for it, so the gradients are complete for a consumer on any stream."""

    def __init__(self, plan, padding):
        self.plan = plan
        self.padding = padding

    def __call__(self, dout, q, k, v, out, *args, synchronize, **kwargs):
        padding = self.padding
        wide = padding.widen(dout, q, k, v, out)
        dq, dk, dv, *dsinks = self.plan(*wide, *args, synchronize=False, **kwargs)
        grads = (
            first_columns(dq, padding.head_dim),
            first_columns(dk, padding.head_dim),
            first_columns(dv, padding.head_dim_v),
            *dsinks,
        )
        if synchronize:
            cupy.cuda.get_current_stream().synchronize()
        return grads
