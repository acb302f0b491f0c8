"""The benchmarked shapes: :class:`Case`, the grid, FLOP counts (the Performance page's
conventions), and the input sets, enough of them that a round of calls spans several L2
caches."""

import dataclasses
import math

import numpy as np

from ..core.problem import DTYPES_BY_NAME
from .environment import cupy

TOKENS = 16384
HIDDEN = 2048
DTYPES = DTYPES_BY_NAME
FLOP_FACTORS = {"fwd": 1.0, "bwd": 2.5}
DIRECTIONS = tuple(FLOP_FACTORS)

L2_ROTATION_FACTOR = 4  # one round of input sets spans this many L2 caches
MAX_INPUT_SETS = 8


def attention_flops(batch, heads, seqlen, head_dim, causal, direction="fwd"):
    """FLOPs of one attention pass by FlashAttention's convention (see the Performance page).

    Parameters
    ----------
    batch, heads, seqlen, head_dim : int
        ``B``, ``H``, ``S`` (queries and keys) and ``D``.
    causal : bool
        Halves the count.
    direction : {"fwd", "bwd"}
        The backward pass counts 2.5 times the forward.

    Returns
    -------
    float
    """
    flops = 4 * batch * heads * seqlen * seqlen * head_dim * FLOP_FACTORS[direction]
    return flops / 2 if causal else flops


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmarked shape: arrays ``[batch, heads, seqlen, head_dim]`` of ``dtype``."""

    dtype: str
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int

    @classmethod
    def in_grid(cls, dtype, head_dim, seqlen, causal):
        """The case with ``B * S = 16384`` tokens and ``H = 2048 / D`` heads."""
        return cls(
            dtype, head_dim, seqlen, causal, max(1, TOKENS // seqlen), max(1, HIDDEN // head_dim)
        )

    @property
    def shape(self):
        return (self.batch, self.heads, self.seqlen, self.head_dim)

    @property
    def numpy_dtype(self):
        return DTYPES[self.dtype]

    def flops(self, direction):
        """FLOPs of one pass in ``direction`` ("fwd" or "bwd")."""
        return attention_flops(
            self.batch, self.heads, self.seqlen, self.head_dim, self.causal, direction
        )


def build_grid(dtypes, head_dims, seqlens):
    """Every case of the grid, in table order (dtype, head_dim, causal, seqlen)."""
    return [
        Case.in_grid(dtype, head_dim, seqlen, causal)
        for dtype in dtypes
        for head_dim in head_dims
        for causal in (False, True)
        for seqlen in seqlens
    ]


def tflops(flops, seconds):
    """Throughput in TFLOP/s."""
    return flops / seconds / 1e12


@dataclasses.dataclass(frozen=True)
class InputSet:
    """One draw of the arrays of a case: q, k, v and the output gradient."""

    q: object
    k: object
    v: object
    dout: object


def make_input_sets(case, count, seed=0):
    """``count`` independent standard-normal input sets for ``case`` on the GPU."""
    rng = cupy.random.default_rng(seed)

    def draw():
        return rng.standard_normal(case.shape, dtype=np.float32).astype(case.numpy_dtype)

    return [InputSet(draw(), draw(), draw(), draw()) for _ in range(count)]


def rotation_count(case, l2_bytes):
    """Input sets to rotate among so that one round spans several L2 caches."""
    return sets_spanning_l2(4 * math.prod(case.shape) * case.numpy_dtype.itemsize, l2_bytes)


def sets_spanning_l2(set_bytes, l2_bytes):
    """Input sets of ``set_bytes`` each whose round spans several L2 caches (2 at least)."""
    return int(np.clip(math.ceil(L2_ROTATION_FACTOR * l2_bytes / set_bytes), 2, MAX_INPUT_SETS))
