"""A cost model of context parallelism: predicted times and memory of ring, Ulysses and
hybrid attention over many GPUs (the Distributed page's "Design for many GPUs").

Predictions, not measurements. Every input is a field of :class:`Machine` (links,
kernel rates, latency) or :class:`Problem` (the attention shape). The modes:

- ``"ring"``: the sequence sharded over ``N`` ranks (zigzag); ``N`` steps, each a
  query shard against one K/V shard (``F / N^2`` of the total FLOPs ``F``) while the
  K/V shard travels to the next rank: a step takes ``max(compute, transfer)`` plus a
  latency. The backward sends K, V and the float32 dK/dV accumulators (3x the
  forward's bytes against 2.5x its work); the last accumulators' trip is exposed.
- ``"ulysses"``: an all-to-all over heads, one dense call on the whole sequence with
  ``H / N`` heads, an all-to-all back; not overlapped.
- ``"hybrid"``: Ulysses inside groups of ``U`` GPUs, the ring across the ``R = N / U``
  groups. ``U = 1`` is the ring, ``U = N`` Ulysses.

The dense kernels' rate falls for short calls: ``rate(L) = peak * L / (L + half)``,
``L`` the tokens of a call's query and key chunk (``S`` for one call on the whole
sequence, ``S / (2 R)`` for a ring step's zigzag chunks). The defaults fit the 2-GPU
measurement in :data:`MEASURED_H200X2`; :func:`calibrate` compares the two.

``python -m cuflash.distributed.predictions`` prints the prediction tables.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

GIB = 2.0**30
MODES = ("ring", "ulysses", "hybrid")
BACKWARD_WORK = 2.5  # the backward's FLOPs over the forward's
ACC_BYTES = 4  # float32 accumulators (dQ, dK/dV) and lse


@dataclass(frozen=True)
class Machine:
    """The GPUs, their links and the dense kernels' rates (defaults: H200s, bfloat16,
    D = 128). Bandwidths in GB/s a GPU, one direction; rates in TFLOP/s."""

    nvlink_gbs: float = 394.0  # peer bandwidth inside a node (measured, two H200s)
    inter_node_gbs: float = 50.0  # a GPU's share across nodes (400 Gb/s InfiniBand)
    gpus_per_node: int = 8
    forward_tflops: float = 465.0  # the forward's rate on long calls
    forward_half_tokens: float = 1300.0  # call length at which it is half that
    backward_tflops: float = 390.0
    backward_half_tokens: float = 1600.0
    latency_us: float = 20.0  # a ring step's or an all-to-all's fixed cost

    def rate(self, tokens: float, backward: bool = False) -> float:
        """FLOP/s of a dense call on chunks of ``tokens`` queries and keys."""
        peak, half = self.forward_tflops, self.forward_half_tokens
        if backward:
            peak, half = self.backward_tflops, self.backward_half_tokens
        return peak * 1e12 * tokens / (tokens + half)

    def link(self, gpus: int) -> float:
        """Bytes/s of a ring over ``gpus`` GPUs: its slowest hop's."""
        return 1e9 * (self.nvlink_gbs if gpus <= self.gpus_per_node else self.inter_node_gbs)


@dataclass(frozen=True)
class Problem:
    """One self-attention call: q ``[B, H, S, D]``, k and v ``[B, H_kv, S, D]``."""

    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    seq_len: int = 131072
    causal: bool = True
    dtype_bytes: int = 2  # q, k, v, out and the gradients; accumulators are float32

    @property
    def flops(self) -> float:
        """The forward's FLOPs, ``4 B H S^2 D``, halved when causal."""
        whole = 4.0 * self.batch * self.heads * self.seq_len**2 * self.head_dim
        return whole / 2 if self.causal else whole

    def values(self, heads: float, tokens: float) -> float:
        """Elements of a ``[B, heads, tokens, D]`` array."""
        return self.batch * heads * tokens * self.head_dim


@dataclass(frozen=True)
class Prediction:
    """One mode's predicted cost on ``gpus`` GPUs (times in ms, memory in bytes a GPU:
    inputs, outputs, gradients, the float32 dQ accumulator and the buffers in flight)."""

    mode: str
    gpus: int
    ulysses_size: int
    ring_size: int
    forward_ms: float
    backward_ms: float
    forward_compute_ms: float
    backward_compute_ms: float
    one_gpu_ms: float  # forward + backward of the whole call on one GPU
    memory_bytes: float

    @property
    def compute_ms(self) -> float:
        """The kernels' time, forward plus backward."""
        return self.forward_compute_ms + self.backward_compute_ms

    @property
    def exposed_ms(self) -> float:
        """Communication (and latency) not hidden under the kernels, both passes."""
        return self.forward_ms + self.backward_ms - self.compute_ms

    @property
    def speedup(self) -> float:
        """One GPU's forward plus backward over this mode's."""
        return self.one_gpu_ms / (self.forward_ms + self.backward_ms)


def kv_copies(problem: Problem, u: int) -> int:
    """KV heads over an all-to-all of ``u`` GPUs: ``H_kv``, or ``u`` where fewer KV heads
    than GPUs are each copied to ``u / H_kv`` of them (``kv_share`` of the hybrid)."""
    return max(problem.kv_heads, u)


def splits(problem: Problem, u: int) -> bool:
    """Whether the heads split over an all-to-all of ``u`` GPUs: ``H`` a multiple of
    ``u``, and ``H_kv`` a multiple or a divisor of it."""
    kv = problem.kv_heads
    return problem.heads % u == 0 and (kv % u == 0 or u % kv == 0)


def _all_to_all_s(machine: Machine, size: int, nbytes: float) -> float:
    """Seconds of an all-to-all in which each of ``size`` GPUs holds ``nbytes`` and sends
    ``(size - 1) / size`` of them: the peers off the node over the slower link."""
    if size == 1:
        return 0.0
    local = min(size, machine.gpus_per_node)
    on_node = nbytes * (local - 1) / size / (machine.nvlink_gbs * 1e9)
    off_node = nbytes * (size - local) / size / (machine.inter_node_gbs * 1e9)
    return max(on_node, off_node) + machine.latency_us * 1e-6


def _pipelined(transfer: float, compute: float, parts: int) -> float:
    """Exposed seconds of an all-to-all of ``transfer`` seconds sent in ``parts`` beside
    ``parts`` calls of ``compute`` seconds in all: the first part's, and whatever of the
    others a part's call does not cover."""
    each = transfer / parts
    return each + (parts - 1) * max(0.0, each - compute / parts)


def _ring_s(problem: Problem, machine: Machine, gpus: int, u: int, r: int) -> tuple[float, ...]:
    """(forward, backward, forward kernels, backward kernels) seconds of the ring over
    ``r`` groups with ``H / u`` heads a GPU (``r = 1``: one dense call)."""
    tokens = problem.seq_len if r == 1 else problem.seq_len / (2 * r)
    f = problem.flops / (u * r * r)  # a step's forward FLOPs
    fwd = f / machine.rate(tokens)
    bwd = BACKWARD_WORK * f / machine.rate(tokens, backward=True)
    if r == 1:
        return fwd, bwd, fwd, bwd
    shard = problem.values(kv_copies(problem, u) / u, problem.seq_len / r)
    kv = 2 * shard * problem.dtype_bytes / machine.link(gpus)  # K and V
    acc = 2 * shard * ACC_BYTES / machine.link(gpus)  # the dK/dV accumulators
    lat = machine.latency_us * 1e-6
    forward = (r - 1) * (max(fwd, kv) + lat) + fwd
    backward = max(bwd, kv) + lat  # step 0 receives K/V for step 1
    backward += (r - 2) * (max(bwd, kv + acc) + lat)  # K/V in, accumulators out
    backward += max(bwd, acc) + lat + acc + lat  # the last step; the accumulators home
    return forward, backward, r * fwd, r * bwd


def break_even_tokens(
    problem: Problem, machine: Machine, gpus: int, backward: bool = False
) -> float:
    """The shard length (tokens a ring rank holds, ``S / R``) above which a ring step's
    kernels outlast its transfer over the link of ``gpus`` GPUs (0: always hidden).

    A step computes ``k B (H / U) D s^2`` FLOPs (``k`` 2 causal, 4 not; times 2.5
    backward) at ``rate(s / 2)`` and sends ``2 B (H_kv / U) s D`` values (bytes
    ``b``, plus 4 for the backward's dK/dV), so they balance at
    ``s = 2 (H_kv / H) b rate / (k W) - 2 half`` (rate and half of :class:`Machine`,
    ``W`` the link): ``(H_kv / H) (2 rate / W)`` for causal bfloat16, less the
    short-call loss that lengthens short steps.
    """
    k = 2.0 if problem.causal else 4.0
    peak, half, b = machine.forward_tflops, machine.forward_half_tokens, problem.dtype_bytes
    if backward:
        peak, half, b = machine.backward_tflops, machine.backward_half_tokens, b + ACC_BYTES
        k *= BACKWARD_WORK
    ratio = problem.kv_heads / problem.heads
    return max(0.0, 2 * ratio * b * peak * 1e12 / (k * machine.link(gpus)) - 2 * half)


def _memory(problem: Problem, gpus: int, u: int, r: int) -> float:
    """Bytes a GPU at the backward's peak (the target design, no per-step copies)."""
    p, s, b = problem, problem.seq_len / gpus, problem.dtype_bytes
    # q, k, v, dout, out, dq, dk, dv shards and the lse
    shards = p.values(4 * p.heads + 4 * p.kv_heads, s) * b + p.batch * p.heads * s * ACC_BYTES
    total = shards + p.values(p.heads, s) * ACC_BYTES  # the float32 dQ accumulator
    if u > 1:
        total += shards  # the head-split copies the all-to-alls produce
    if r > 1:
        kv = p.values(2 * kv_copies(p, u), s)  # a K/V shard (H_kv / u heads, S / r tokens)
        total += 2 * kv * b + 3 * kv * ACC_BYTES  # K/V held and coming; dK/dV x3
    return total


def predict(
    mode: str,
    problem: Problem,
    gpus: int,
    machine: Machine | None = None,
    ulysses_size: int | None = None,
) -> Prediction:
    """The predicted cost of ``mode`` (``"ring"``, ``"ulysses"`` or ``"hybrid"``) on
    ``gpus`` GPUs. ``"hybrid"`` takes ``ulysses_size`` (default: the best,
    :func:`best_ulysses_size`). Raises ValueError where the heads do not split (Ulysses,
    hybrid) or the mode is unknown.

    >>> p = predict("ring", Problem(seq_len=131072), 2)
    >>> round(p.speedup, 2), p.ring_size
    (1.93, 2)
    """
    machine = machine or Machine()
    if mode == "ring":
        u = 1
    elif mode == "ulysses":
        u = gpus
    elif mode == "hybrid":
        u = best_ulysses_size(problem, gpus, machine) if ulysses_size is None else ulysses_size
    else:
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    if gpus < 1 or u < 1 or gpus % u:
        raise ValueError(f"a Ulysses size of {u} does not divide {gpus} GPUs")
    if not splits(problem, u):
        raise ValueError(
            f"{problem.heads} heads and {problem.kv_heads} KV heads do not split over {u} "
            "GPUs (Ulysses needs H a multiple of its size, H_kv a multiple or a divisor)"
        )
    r = gpus // u
    fwd, bwd, fwd_kernels, bwd_kernels = _ring_s(problem, machine, gpus, u, r)
    p, s, b = problem, problem.seq_len / gpus, problem.dtype_bytes
    lse = p.batch * p.heads * s * ACC_BYTES

    def a2a(heads: int, extra: float = 0.0) -> float:  # arrays of ``heads`` heads in all
        return _all_to_all_s(machine, u, p.values(heads, s) * b + extra)

    if u > 1:
        kv = kv_copies(p, u)
        # Ulysses alone computes a rank's heads in two parts where it holds an even
        # number of KV heads of its own: a part's all-to-all runs under the other's call.
        parts = 2 if r == 1 and kv == p.kv_heads and (kv // u) % 2 == 0 else 1
        fwd_in, fwd_out = a2a(p.heads + 2 * kv), a2a(p.heads, lse)  # q, k, v; out, lse
        bwd_in = a2a(3 * p.heads + 2 * kv, lse)  # dout, q, k, v, out, lse
        bwd_out = a2a(p.heads + 2 * kv)  # dq, dk, dv back
        fwd += _pipelined(fwd_in, fwd, parts) + _pipelined(fwd_out, fwd, parts)
        bwd += _pipelined(bwd_in, bwd, parts) + _pipelined(bwd_out, bwd, parts)
    one_fwd, one_bwd, _, _ = _ring_s(p, machine, 1, 1, 1)
    ms = [1e3 * x for x in (fwd, bwd, fwd_kernels, bwd_kernels, one_fwd + one_bwd)]
    return Prediction(mode, gpus, u, r, ms[0], ms[1], ms[2], ms[3], ms[4], _memory(p, gpus, u, r))


def ulysses_sizes(problem: Problem, gpus: int, machine: Machine) -> list[int]:
    """The Ulysses sizes a hybrid may use: divisors of ``gpus`` over which the heads
    split (:func:`splits`) that fit in a node (1, the plain ring, always)."""
    fits = range(1, min(gpus, machine.gpus_per_node) + 1)
    return [u for u in fits if gpus % u == 0 and splits(problem, u)]


@functools.lru_cache(maxsize=256)  # the hybrid asks once a call, forward and backward
def best_ulysses_size(
    problem: Problem,
    gpus: int,
    machine: Machine | None = None,
    allowed: tuple[int, ...] | None = None,
) -> int:
    """The Ulysses size (of :func:`ulysses_sizes`, and of ``allowed`` where given) with
    the least predicted forward plus backward time (the smaller on a tie)."""
    machine = machine or Machine()
    sizes = [u for u in ulysses_sizes(problem, gpus, machine) if allowed is None or u in allowed]

    def total(u: int) -> float:
        p = predict("hybrid", problem, gpus, machine, ulysses_size=u)
        return p.forward_ms + p.backward_ms

    return min(sizes, key=total)


@dataclass(frozen=True)
class Measurement:
    """One row of the 2-GPU measurement (ms, the slower rank; peak GiB a GPU)."""

    seq_len: int
    one_gpu: tuple[float, float]  # forward, backward
    ring: tuple[float, float]
    kernels_only: tuple[float, float]  # the ring without transfers
    transfers: tuple[float, float]  # one step's K,V and dK,dV alone
    peak_gib: tuple[float, float]  # one GPU, ring


#: Two H200s over NVLink, bfloat16, causal, zigzag, B = 1, H = 32, H_kv = 8, D = 128
#: (``python -m cuflash.distributed --repeats 9``).
MEASURED_H200X2 = (
    Measurement(65536, (75.3, 230.0), (41.2, 124.7), (40.0, 121.6), (0.57, 1.01), (3.52, 3.14)),
    Measurement(131072, (306.1, 908.9), (161.4, 475.5), (156.6, 471.2), (1.00, 1.82), (7.03, 6.29)),
)


class Check(NamedTuple):
    """A predicted number next to its measured one."""

    seq_len: int
    quantity: str
    predicted: float
    measured: float

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured


def calibrate(machine: Machine | None = None) -> list[Check]:
    """The model against each number of :data:`MEASURED_H200X2` (``ratio``: predicted
    over measured)."""
    machine = machine or Machine()
    rows = []
    for m in MEASURED_H200X2:
        problem = Problem(seq_len=m.seq_len)
        one, ring = predict("ring", problem, 1, machine), predict("ring", problem, 2, machine)
        shard = problem.values(problem.kv_heads, m.seq_len / 2)
        link = machine.link(2) / 1e3  # bytes a millisecond
        pairs = {
            "one GPU forward ms": (one.forward_ms, m.one_gpu[0]),
            "one GPU backward ms": (one.backward_ms, m.one_gpu[1]),
            "ring forward ms": (ring.forward_ms, m.ring[0]),
            "ring backward ms": (ring.backward_ms, m.ring[1]),
            "ring kernels forward ms": (ring.forward_compute_ms, m.kernels_only[0]),
            "ring kernels backward ms": (ring.backward_compute_ms, m.kernels_only[1]),
            "K,V transfer ms": (2 * shard * problem.dtype_bytes / link, m.transfers[0]),
            "dK,dV transfer ms": (2 * shard * ACC_BYTES / link, m.transfers[1]),
            "one GPU peak GiB": (one.memory_bytes / GIB, m.peak_gib[0]),
            "ring peak GiB": (ring.memory_bytes / GIB, m.peak_gib[1]),
        }
        rows += [Check(m.seq_len, name, *pair) for name, pair in pairs.items()]
    return rows
