"""Sequences longer than one device: ring (context-parallel) attention (the Distributed page).

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
Where the pairs of a step together form one band (a causal zigzag step's
diagonal chunk and the full chunk before it, say), :func:`step_calls` makes
them one call, so a step is one or two calls and few merges.

The ranks talk through a *group*: an object with ``rank``, ``size`` and
``exchange(arrays)`` (send a tuple of arrays to the next rank, return the
tuple of the same shapes and dtypes the previous one sent; whose shard a rank
holds at step ``t`` is known: rank ``rank - t``'s), and optionally
``start_exchange(arrays)`` returning a handle whose ``wait()`` gives that tuple,
so that a step's kernels run while the next step's shards travel.
:class:`NcclGroup` is one process a GPU over NCCL (through CuPy);
:class:`ThreadGroup` runs ``N`` virtual ranks as threads of one process (NumPy
or CuPy arrays): the simulation the CPU tests check against the oracle.
``python -m cuflash.distributed`` runs ring attention on every visible GPU
against the single-GPU call and prints the timings.

:func:`ulysses_attention_fwd` (and ``_bwd``, ``_vjp``) take the ring's arguments and
give its results by an all-to-all over heads instead (DeepSpeed-Ulysses): each rank
computes the whole sequence of its group of heads in one dense call.
:func:`hybrid_attention_fwd` (and ``_bwd``, ``_vjp``) run that all-to-all inside
sub-groups of ``ulysses_size`` ranks (a node's GPUs) and the ring across them.
"""

from . import cost_model
from .groups import (
    Alone,
    InFlight,
    NcclGroup,
    Received,
    SubGroup,
    ThreadGroup,
    all_to_all,
    start_all_to_all,
    start_exchange,
    subgroup,
)
from .layout import (
    LAYOUTS,
    PairCall,
    Segment,
    band_call,
    block_call,
    chunk_count,
    gather,
    pair_band,
    pair_call,
    rank_chunks,
    segments,
    shard,
    step_calls,
)
from .ring import RingVJP, ring_attention_bwd, ring_attention_fwd, ring_attention_vjp
from .ulysses import (
    HybridVJP,
    UlyssesVJP,
    default_ulysses_size,
    hybrid_attention_bwd,
    hybrid_attention_fwd,
    hybrid_attention_vjp,
    hybrid_groups,
    kv_share,
    ulysses_attention_bwd,
    ulysses_attention_fwd,
    ulysses_attention_vjp,
)

__all__ = [
    "Alone",
    "HybridVJP",
    "SubGroup",
    "cost_model",
    "default_ulysses_size",
    "hybrid_attention_bwd",
    "hybrid_attention_fwd",
    "hybrid_attention_vjp",
    "hybrid_groups",
    "kv_share",
    "subgroup",
    "UlyssesVJP",
    "all_to_all",
    "ulysses_attention_bwd",
    "ulysses_attention_fwd",
    "ulysses_attention_vjp",
    "LAYOUTS",
    "InFlight",
    "NcclGroup",
    "PairCall",
    "Received",
    "RingVJP",
    "Segment",
    "ThreadGroup",
    "band_call",
    "block_call",
    "chunk_count",
    "gather",
    "pair_band",
    "pair_call",
    "rank_chunks",
    "ring_attention_bwd",
    "ring_attention_fwd",
    "ring_attention_vjp",
    "segments",
    "shard",
    "start_all_to_all",
    "start_exchange",
    "step_calls",
]
