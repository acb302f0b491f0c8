"""Context-parallel attention on every visible GPU, one process each, over NCCL.

:func:`launch` starts one process a GPU, joins them in an :class:`NcclGroup` and
runs a function on every rank; :func:`check_cases` compares each rank's shard of
a mode's results (ring, Ulysses or hybrid) with the single-GPU call on the whole
sequence, and :func:`measure` times both (and the mode without its transfers, and
one ring step's transfers alone). ``python -m cuflash.distributed`` runs the two and
prints them; the GPU tests call :func:`check_cases` on many options.
"""

import dataclasses
import multiprocessing
import queue
import socket
import statistics
import traceback

import numpy as np

from ..api import flash_attention_bwd, flash_attention_fwd
from ..bench import pool_growth_bytes
from ..core.problem import DTYPES_BY_NAME
from .groups import NcclGroup, Received
from .layout import shard
from .ring import ring_attention_bwd, ring_attention_fwd
from .ulysses import (
    hybrid_attention_bwd,
    hybrid_attention_fwd,
    ulysses_attention_bwd,
    ulysses_attention_fwd,
)

# Relative error bounds against the single-GPU call: the ring rounds each pair's
# partial output (and dQ, dK, dV) to the dtype before it adds them.
BOUNDS = {"float32": 2e-4, "float16": 6e-3, "bfloat16": 3e-2}

#: Each mode's forward and backward: the ring's arguments and results.
MODES = {
    "ring": (ring_attention_fwd, ring_attention_bwd),
    "ulysses": (ulysses_attention_fwd, ulysses_attention_bwd),
    "hybrid": (hybrid_attention_fwd, hybrid_attention_bwd),
}


@dataclasses.dataclass(frozen=True)
class RingCase:
    """One context-parallel problem: the whole sequence's shape and options, and the
    mode that splits it (``ulysses_size`` the hybrid's, None for its default)."""

    seq_len: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    causal: bool = True
    window: object = 0
    layout: str = "zigzag"
    dtype: str = "bfloat16"
    batch: int = 1
    softmax_scale: object = None
    deterministic: bool = False
    mode: str = "ring"
    ulysses_size: object = None

    @property
    def args(self):
        return (self.heads, self.kv_heads, self.head_dim, self.causal, self.window)

    def options(self, group):
        """The mode's keywords for ``group`` (``layout``, ``softmax_scale``, ...)."""
        options = dict(group=group, layout=self.layout, softmax_scale=self.softmax_scale)
        if self.mode == "hybrid":
            options["ulysses_size"] = self.ulysses_size
        return options

    def forward(self, group, q, k, v):
        return MODES[self.mode][0](q, k, v, *self.args, **self.options(group))

    def backward(self, group, dout, q, k, v, out, lse, deterministic=False):
        return MODES[self.mode][1](
            dout, q, k, v, out, lse, *self.args, deterministic=deterministic, **self.options(group)
        )

    def inputs(self, seed=0):
        """q, k, v, dout of the whole sequence, standard normal, the same on every rank."""
        import cupy

        rng = cupy.random.default_rng(seed)
        dtype = DTYPES_BY_NAME[self.dtype]
        return [
            rng.standard_normal(
                (self.batch, h, self.seq_len, self.head_dim), dtype=np.float32
            ).astype(dtype)
            for h in (self.heads, self.kv_heads, self.kv_heads, self.heads)
        ]


# ------------------------------------------------------------------ processes


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(target, rank, size, port, args, results):
    try:
        import cupy

        # Rank 0's TCP store (cupyx.distributed) serves from a child process that must be
        # forked: spawning it would pickle the store and its lock.
        multiprocessing.set_start_method("fork", force=True)
        cupy.cuda.Device(rank).use()
        group = NcclGroup(rank, size, host="127.0.0.1", port=port)
        results.put((rank, True, target(group, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


def launch(target, size, *args, timeout=1200):
    """``target(group, *args)`` on ``size`` new processes, process ``r`` on GPU ``r`` with
    rank ``r`` of one :class:`NcclGroup`; their results in rank order. ``target`` and
    the results must pickle; a rank that raises raises here with its traceback."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=_rank_main, args=(target, rank, size, port, args, results))
        for rank in range(size)
    ]
    for process in processes:
        process.start()
    found: dict[int, object] = {}
    failures: list[str] = []
    try:
        for _ in range(size):
            rank, ok, value = results.get(timeout=timeout)
            (found.__setitem__(rank, value) if ok else failures.append(f"rank {rank}:\n{value}"))
            if failures:
                break
    except queue.Empty:
        failures.append(f"no result within {timeout} s")
    finally:
        for process in processes:
            process.join(timeout=5 if failures else None)
            if process.is_alive():
                process.terminate()
    if failures:
        raise RuntimeError("ring attention failed on " + "\n".join(failures))
    return [found[rank] for rank in range(size)]


# ------------------------------------------------------------------ checking


def _run_mode(group, case, q, k, v, dout):
    out, lse = case.forward(group, q, k, v)
    grads = case.backward(group, dout, q, k, v, out, lse, case.deterministic)
    return (out, lse, *grads)


def _relative_error(got, want):
    import cupy

    got, want = got.astype(cupy.float64), want.astype(cupy.float64)
    if not bool(cupy.isfinite(got).all()):
        return float("inf")
    scale = max(float(cupy.linalg.norm(want)), 0.1 * np.sqrt(want.size))
    return float(cupy.linalg.norm(got - want)) / scale


def check_case(group, case, seed=0):
    """Errors of this rank's results (the case's mode) against its shard of the single-GPU call on
    the whole sequence: a dict of name -> relative error (``lse`` absolute, where finite;
    inf when the -inf rows differ or a value is NaN), plus ``"repeat"``: whether a second
    run gave the same bits (always checked; required when deterministic)."""
    import cupy

    full = case.inputs(seed)
    mine = [shard(x, case.layout, group.rank, group.size) for x in full]
    ring = _run_mode(group, case, *mine)
    q, k, v, dout = full
    whole_out, whole_lse = flash_attention_fwd(
        q, k, v, *case.args, softmax_scale=case.softmax_scale
    )
    whole_grads = flash_attention_bwd(
        dout, q, k, v, whole_out, whole_lse, *case.args, softmax_scale=case.softmax_scale
    )
    wanted = [
        shard(x, case.layout, group.rank, group.size)
        for x in (whole_out, whole_lse[..., None], *whole_grads)
    ]
    wanted[1] = wanted[1][..., 0]
    errors = {}
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), ring, wanted):
        if name == "lse":
            dead_got, dead_want = cupy.isneginf(got), cupy.isneginf(want)
            same_dead = bool((dead_got == dead_want).all()) and not bool(cupy.isnan(got).any())
            live = ~dead_want
            errors[name] = (
                (float(cupy.abs(got[live] - want[live]).max()) if bool(live.any()) else 0.0)
                if same_dead
                else float("inf")
            )
        else:
            errors[name] = _relative_error(got, want)
    again = _run_mode(group, case, *mine)
    errors["repeat"] = all(
        bool(cupy.array_equal(a.view(cupy.uint8), b.view(cupy.uint8))) for a, b in zip(ring, again)
    )
    return errors


def case_passes(case, errors):
    """Whether ``check_case``'s errors are inside the case's bounds."""
    bound = BOUNDS[case.dtype]
    return (
        all(errors[n] <= bound for n in ("out", "dq", "dk", "dv"))
        and errors["lse"] <= 1e-3
        and (errors["repeat"] or not case.deterministic)
    )


def check_cases(group, cases):
    """:func:`check_case` of every case, in order: a list of error dicts."""
    return [check_case(group, case, seed) for seed, case in enumerate(cases)]


# ------------------------------------------------------------------ timing


class _NoTransfer:
    """The rank and size of a group whose exchanges hand back what they are given: a
    mode's kernels alone, for timing (its results are not the attention)."""

    def __init__(self, group):
        self.rank, self.size = group.rank, group.size
        self.local_size = getattr(group, "local_size", group.size)

    def exchange(self, arrays):
        return tuple(arrays)

    def start_send_recv(self, arrays, to, source):
        return Received(arrays)

    def all_to_all(self, chunks):
        return [tuple(chunk) for chunk in chunks]

    def start_all_to_all(self, chunks):
        return Received(self.all_to_all(chunks))

    def start_all_to_all_among(self, members, chunks):
        return self.start_all_to_all(chunks)


def _median_ms(call, repeats):
    import cupy

    call()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def measure(group, case, repeats=5):
    """Median milliseconds on this rank: the single-GPU call on the whole sequence and
    the case's mode on this rank's shards (forward, backward; ``cp_*``), the mode's
    kernels without the transfers, and one ring step's transfers alone; and the pool's
    peak bytes of each forward + backward, inputs included (the memory pool's growth)."""
    import cupy

    full = case.inputs()
    mine = [shard(x, case.layout, group.rank, group.size) for x in full]
    timings = {}

    q, k, v, dout = full

    def single_fwd():
        return flash_attention_fwd(q, k, v, *case.args, softmax_scale=case.softmax_scale)

    out, lse = single_fwd()
    timings["single_fwd_ms"] = _median_ms(single_fwd, repeats)
    timings["single_bwd_ms"] = _median_ms(
        lambda: flash_attention_bwd(
            dout, q, k, v, out, lse, *case.args, softmax_scale=case.softmax_scale
        ),
        repeats,
    )
    del out, lse
    for name, mode_group in (("cp", group), ("kernels_only", _NoTransfer(group))):

        def fwd(mode_group=mode_group):
            return case.forward(mode_group, *mine[:3])

        out, lse = fwd()
        timings[f"{name}_fwd_ms"] = _median_ms(fwd, repeats)
        timings[f"{name}_bwd_ms"] = _median_ms(
            lambda mode_group=mode_group: case.backward(mode_group, mine[3], *mine[:3], out, lse),
            repeats,
        )
        del out, lse
    kv = tuple(mine[1:3])
    timings["transfer_kv_ms"] = _median_ms(lambda: group.exchange(kv), repeats)
    accumulators = tuple(x.astype(np.float32) for x in kv)
    timings["transfer_dkdv_ms"] = _median_ms(lambda: group.exchange(accumulators), repeats)
    del accumulators

    def single_step(inputs):
        whole = flash_attention_fwd(*inputs[:3], *case.args)
        return inputs, whole, flash_attention_bwd(inputs[3], *inputs[:3], *whole, *case.args)

    def mode_step():
        result = case.forward(group, *mine[:3])
        return result, case.backward(group, mine[3], *mine[:3], *result)

    del full, q, k, v, dout
    timings["single_peak_bytes"] = pool_growth_bytes(lambda: single_step(case.inputs()))
    timings["cp_peak_bytes"] = pool_growth_bytes(mode_step) + sum(x.nbytes for x in mine)
    cupy.get_default_memory_pool().free_all_blocks()
    return timings


def run_rank(group, cases, repeats):
    """Every case's check and timings on this rank: a list of plain dicts."""
    records = []
    for case in cases:
        errors = check_case(group, case)
        records.append(
            {
                "case": dataclasses.asdict(case),
                "errors": errors,
                "passed": case_passes(case, errors),
                "timings": measure(group, case, repeats),
            }
        )
    return records


__all__ = [
    "BOUNDS",
    "MODES",
    "RingCase",
    "case_passes",
    "check_case",
    "check_cases",
    "launch",
    "measure",
    "run_rank",
]
