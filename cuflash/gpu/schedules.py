"""Tile schedules of the persistent backward (``backward_wgmma_ws``'s persistent roles):
which of the launch's (key tile, KV head, batch entry) work tiles each block walks.

A block an SM walks its tiles one after another, so the launch lasts as long as its
busiest block. The static walk of ``kernels/common/work_tiles.cuh`` deals the tiles out
in rounds, whatever their lengths; under a causal mask a key tile's query steps run
from one to all of them, and the rounds leave some blocks far behind others (the
persistent roles lost to a block a tile by 3-29 %, the backward-sm90-wgmma record).
Here the plan knows every tile's work before the launch, for dense calls: the query
steps that see the key tile (``core.masking.query_range``, the kernels' visibility
rule) and its own loads and stores. It deals the tiles out longest first, each to the
block with the least work so far (longest processing time first), and each block walks
its tiles in that order. Packed calls, whose sequence lengths live on the device, keep
the static walk.
"""

import heapq
import math

import numpy as np

from ..core.masking import query_range

# A tile's own work in query steps' worth: K and V in, dK and dV out.
TILE_OVERHEAD_STEPS = 2


def backward_tile_steps(problem, keys, rows):
    """Query steps of ``rows`` rows (every query head of a KV head's group) that see each
    key tile of ``keys`` keys of a dense ``problem``, key tile 0 first."""
    left, right = problem.window
    tiles = math.ceil(problem.kv_capacity / keys)
    steps = np.zeros(tiles, dtype=np.int64)
    for t in range(tiles):
        lo, hi = query_range(t * keys, (t + 1) * keys, problem.q_len, problem.kv_len, left, right)
        if lo < hi:
            steps[t] = (hi - (lo - lo % rows) + rows - 1) // rows
    return steps * problem.group_size


def longest_first(costs, blocks):
    """``int32 [blocks + 1 + len(costs)]``: each block's first position in the list that
    follows (then the end), then the tiles (indices into ``costs``) block by block,
    dealt out longest first to the block with the least cost so far (ties: the lower
    block), each block's in the order dealt."""
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    loads = [(0, b) for b in range(blocks)]
    taken: list[list[int]] = [[] for _ in range(blocks)]
    for i in order:
        load, b = heapq.heappop(loads)
        taken[b].append(i)
        heapq.heappush(loads, (load + int(costs[i]), b))
    offsets = np.cumsum([0] + [len(t) for t in taken])
    return np.concatenate([offsets, [i for t in taken for i in t]]).astype(np.int32)


def backward_schedule(problem, keys, rows, blocks):
    """The schedule (:func:`longest_first`) of a dense ``problem``'s persistent backward
    on ``blocks`` blocks, its tiles indexed as ``work_tile`` reads them ((entry *
    KV heads + KV head) * key tiles + key tile); None for a packed problem."""
    if problem.packed is not None:
        return None
    per_head = backward_tile_steps(problem, keys, rows)
    per_head = np.where(per_head > 0, per_head + TILE_OVERHEAD_STEPS, 0)
    costs = np.tile(per_head, problem.batch * problem.num_kv_heads)
    return longest_first(costs, blocks)
