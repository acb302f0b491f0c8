"""The GPU launch plans of the packed (varlen) calls: the dense plans of
``cuflash.gpu.launch`` over ``[1, H, total, D]`` views of the packed ``[tokens, H, D]``
arrays (:func:`heads_first`), a block per (query tile, head, sequence), the outputs
written in the packed layout (the packed-batches page)."""

import numpy as np

from ..core.varlen_problem import heads_first


class PackedForward:
    """The launches of one packed forward signature: the dense forward's kernels over
    ``[1, H, total, D]`` views, a block per (query tile, head, sequence), writing the
    outputs in the packed layout."""

    def __init__(self, problem, q, k, v):
        from . import launch as gpu  # imported on first GPU use only

        self.problem = problem
        self.dense = None
        if problem.has_rows:
            self.dense = gpu.ForwardPlan(problem.attention, *map(heads_first, (q, k, v)))

    @staticmethod
    def takes_value_dims(problem, q, k, v):
        """``ForwardPlan.takes_value_dims`` of the dense plan (see ``cuflash.gpu.value_dims``)."""
        from . import launch as gpu

        views = map(heads_first, (q, k, v))
        return not problem.has_rows or gpu.ForwardPlan.takes_value_dims(problem.attention, *views)

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks=None):
        xp = self.problem.xp
        attention = self.problem.attention
        if self.dense is None:  # no query row to compute
            return (
                xp.zeros((*q.shape[:2], attention.head_dim_v), dtype=attention.dtype),
                xp.full((attention.num_heads, self.problem.total_q), -np.inf, dtype=np.float32),
            )
        out, lse = self.dense(
            *map(heads_first, (q, k, v)),
            offsets=(cu_seqlens_q, cu_seqlens_k),
            alibi_slopes=alibi_slopes,
            sinks=sinks,
        )
        return out, lse[0]


class PackedBackward:
    """The launches of one packed backward signature (see :class:`PackedForward`)."""

    def __init__(self, problem, dout, q, k, v, out, lse, deterministic):
        from . import launch as gpu  # imported on first GPU use only

        self.problem = problem
        self.dense = None
        if problem.has_rows:
            self.dense = gpu.BackwardPlan(
                problem.attention,
                *map(heads_first, (dout, q, k, v, out)),
                lse.flags.c_contiguous,
                deterministic,
            )

    @staticmethod
    def takes_value_dims(problem, dout, q, k, v, out, *rest, deterministic=False):
        """``BackwardPlan.takes_value_dims`` of the dense plan (see ``cuflash.gpu.value_dims``)."""
        from . import launch as gpu

        views = map(heads_first, (dout, q, k, v, out))
        return not problem.has_rows or gpu.BackwardPlan.takes_value_dims(
            problem.attention, *views, deterministic=deterministic
        )

    def __call__(
        self,
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        synchronize,
        alibi_slopes,
        sinks=None,
    ):
        xp = self.problem.xp
        if self.dense is None:  # no query row: no gradient anywhere
            grads = tuple(xp.zeros(x.shape, dtype=x.dtype) for x in (q, k, v))
            if sinks is not None:
                grads += (xp.zeros(sinks.shape, dtype=np.float32),)
        else:
            grads = self.dense(
                *map(heads_first, (dout, q, k, v, out)),
                lse[None],
                False,
                offsets=(cu_seqlens_q, cu_seqlens_k),
                alibi_slopes=alibi_slopes,
                sinks=sinks,
            )
        if synchronize:
            xp.cuda.get_current_stream().synchronize()
        return grads
