"""Side-by-side benchmark: cuflash against PyTorch SDPA and naive CuPy attention.

Usage::

    python -m cuflash.bench [--quick] [--dtype bfloat16,float16] [--head-dims 64,128,256]
                            [--seqlens 512,...,16384] [--no-torch] [--no-first-call]
                            [--no-memory] [--allow-tf32] [--time-budget SECONDS]
                            [--json PATH] [--plots DIR]
    python -m cuflash.bench --from-json PATH [--plots DIR]

Every case has ``B * S = 16384`` tokens and ``H = 2048 / D`` heads. For each
case, on the same inputs in one process, it times cuflash's forward and
backward, PyTorch's ``scaled_dot_product_attention`` with each backend forced
through ``torch.nn.attention.sdpa_kernel`` (when torch is importable) and
naive CuPy attention (float32 matmul, softmax, matmul; forward only). Inputs
reach torch through DLPack without copies.

Timing: CUDA events around every call after a warm-up, the median of many
calls, rotating among several input sets so that no call finds its inputs
in the L2 cache. TFLOP/s follow SPEC section 5: forward ``4*B*H*S*S*D``,
halved when causal; backward 2.5 times that.

Also measured: the first-call cost of one kernel variant (compile with an
empty CuPy kernel cache, then with a warm one, each in a fresh process) and
the peak memory of a forward pass against ``S`` up to 131072.

Output: Markdown tables on stdout, a JSON report (``--json``), PNG plots
(``--plots``). ``--from-json`` prints the tables and draws the plots of a saved
report again, without measuring (no GPU needed). Without a GPU a measuring
run prints why and exits 0. See
``docs/performance.md``.
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from . import __version__, kernel_build
from .api import flash_attention_bwd, flash_attention_fwd
from .problem import DTYPES_BY_NAME

try:  # CuPy is optional: without it (or without a GPU) the command only says so.
    import cupy
except ImportError:  # pragma: no cover - exercised only without CuPy
    cupy = None

TOKENS = 16384
HIDDEN = 2048
DTYPES = DTYPES_BY_NAME
DEFAULT_DTYPES = ("bfloat16", "float16")
DEFAULT_HEAD_DIMS = (64, 128, 256)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_DTYPES = ("bfloat16",)
QUICK_HEAD_DIMS = (64, 128)
QUICK_SEQLENS = (512, 2048)
FLOP_FACTORS = {"fwd": 1.0, "bwd": 2.5}
DIRECTIONS = tuple(FLOP_FACTORS)

TARGET_SECONDS = 0.2  # timed calls per measurement, before the time budget shrinks it
QUICK_TARGET_SECONDS = 0.05
MIN_TARGET_SECONDS = 0.02
MIN_REPEATS = 5
MAX_REPEATS = 100
BUDGET_OVERHEAD = 4  # warm-up, sizing round and agreement check, per timed second
DEFAULT_TIME_BUDGET = 540.0
QUICK_TIME_BUDGET = 180.0
L2_ROTATION_FACTOR = 4  # one round of input sets spans this many L2 caches
MAX_INPUT_SETS = 8

MEMORY_SEQLENS = tuple(1024 * 2**i for i in range(8))  # 1k .. 128k
QUICK_MEMORY_SEQLENS = (1024, 4096, 16384)
MEMORY_HEAD_DIM = 128
PROBE_SEQLEN = 256
PROBE_TIMEOUT = 120  # seconds for one first-call process, within the time budget
MAX_NOTE_CHARS = 300

TORCH_BACKENDS = {"FLASH_ATTENTION": "torch-flash", "CUDNN_ATTENTION": "torch-cudnn",
                  "EFFICIENT_ATTENTION": "torch-efficient", "MATH": "torch-math"}
METHOD_LINE = ("Median GPU time (CUDA events) of calls rotating among input sets larger than "
               "the L2 cache; TFLOP/s = FLOPs / median, forward 4*B*H*S*S*D (halved when "
               "causal), backward 2.5x forward.")
NO_GPU_MESSAGE = ("cuflash.bench: no CUDA GPU is available ({}); nothing was timed. "
                  "Run this command on a machine with an NVIDIA GPU.")


# --------------------------------------------------------------------- FLOPs


def attention_flops(batch, heads, seqlen, head_dim, causal, direction="fwd"):
    """FLOPs of one attention pass by FlashAttention's convention (SPEC section 5).

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
        return cls(dtype, head_dim, seqlen, causal, max(1, TOKENS // seqlen),
                   max(1, HIDDEN // head_dim))

    @property
    def shape(self):
        return (self.batch, self.heads, self.seqlen, self.head_dim)

    @property
    def numpy_dtype(self):
        return DTYPES[self.dtype]

    def flops(self, direction):
        """FLOPs of one pass in ``direction`` ("fwd" or "bwd")."""
        return attention_flops(self.batch, self.heads, self.seqlen, self.head_dim,
                               self.causal, direction)


def build_grid(dtypes, head_dims, seqlens):
    """Every case of the grid, in table order (dtype, head_dim, causal, seqlen)."""
    return [Case.in_grid(dtype, head_dim, seqlen, causal)
            for dtype in dtypes for head_dim in head_dims
            for causal in (False, True) for seqlen in seqlens]


def tflops(flops, seconds):
    """Throughput in TFLOP/s."""
    return flops / seconds / 1e12


# -------------------------------------------------------------------- timing


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of each timed call of one measurement."""

    samples: tuple

    @property
    def median(self):
        return statistics.median(self.samples)

    def summary(self):
        """Median, quartiles, minimum (seconds) and the number of calls."""
        p25, _, p75 = np.percentile(self.samples, (25, 50, 75))
        return {"median_s": self.median, "p25_s": float(p25), "p75_s": float(p75),
                "min_s": min(self.samples), "repeats": len(self.samples)}


def event_times(calls, count):
    """Run ``count`` calls, rotating through ``calls``, each between two CUDA events.

    Nothing synchronizes between calls, so the GPU runs them back to back
    whenever the host enqueues faster than the GPU computes.

    Returns
    -------
    list of float
        Seconds of GPU time of each call.
    """
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(count)]
    for index, (start, end) in enumerate(events):
        start.record()
        calls[index % len(calls)]()
        end.record()
    events[-1][1].synchronize()
    return [cupy.cuda.get_elapsed_time(start, end) / 1e3 for start, end in events]


def time_calls(calls, target_seconds):
    """Time ``calls`` (one per input set) in rotation on CuPy's current stream.

    Each call runs once to warm up (compilation, plans, allocator), one
    round is timed to size the run, then enough calls to fill
    ``target_seconds`` (clipped to ``MIN_REPEATS .. MAX_REPEATS``) are timed.
    """
    for call in calls:
        call()
    per_call = statistics.median(event_times(calls, len(calls)))
    repeats = int(np.clip(math.ceil(target_seconds / max(per_call, 1e-9)),
                          MIN_REPEATS, MAX_REPEATS))
    return Timing(tuple(event_times(calls, repeats)))


class Budget:
    """The wall-clock time left to the run, shared out among its measurements."""

    def __init__(self, seconds, target_seconds):
        self.deadline = time.monotonic() + seconds
        self.target_seconds = target_seconds

    def remaining(self):
        return self.deadline - time.monotonic()

    def target_for(self, measurements_left):
        """Seconds of timed calls for the next measurement."""
        share = self.remaining() / max(1, measurements_left) / BUDGET_OVERHEAD
        return float(np.clip(share, MIN_TARGET_SECONDS, self.target_seconds))


# -------------------------------------------------------------------- inputs


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
    set_bytes = 4 * math.prod(case.shape) * case.numpy_dtype.itemsize
    return int(np.clip(math.ceil(L2_ROTATION_FACTOR * l2_bytes / set_bytes), 2, MAX_INPUT_SETS))


# ----------------------------------------------------------- implementations


class CuflashAttention:
    """cuflash's forward and backward (residuals from an untimed forward);
    ``allow_tf32`` is passed to both."""

    name = "cuflash"
    has_backward = True

    def __init__(self, case, allow_tf32=False):
        self.case = case
        self.allow_tf32 = allow_tf32

    def context(self):
        return contextlib.nullcontext()

    def _fwd(self, x):
        c = self.case
        return flash_attention_fwd(x.q, x.k, x.v, c.heads, c.heads, c.head_dim, c.causal,
                                   allow_tf32=self.allow_tf32)

    def forward_call(self, x):
        """A call that enqueues one forward pass on ``x`` and returns the output."""
        return lambda: self._fwd(x)[0]

    def backward_call(self, x):
        """A call that enqueues one backward pass on ``x``."""
        c = self.case
        out, lse = self._fwd(x)
        return functools.partial(flash_attention_bwd, x.dout, x.q, x.k, x.v, out, lse,
                                 c.heads, c.heads, c.head_dim, c.causal, synchronize=False,
                                 allow_tf32=self.allow_tf32)


@dataclasses.dataclass(frozen=True)
class StreamPointer:
    """A raw ``cudaStream_t`` offered through the CUDA stream protocol."""

    ptr: int

    def __cuda_stream__(self):
        return (0, self.ptr)


class TorchSDPA:
    """``torch.nn.functional.scaled_dot_product_attention`` with one forced backend."""

    has_backward = True

    def __init__(self, case, torch, backend):
        self.case, self.torch, self.backend = case, torch, backend
        self.name = TORCH_BACKENDS[backend.name]

    def context(self):
        """Force the backend; make CuPy's events run on torch's current stream."""
        from torch.nn.attention import sdpa_kernel

        stack = contextlib.ExitStack()
        stack.enter_context(sdpa_kernel([self.backend]))
        stack.enter_context(cupy.cuda.Stream.from_external(
            StreamPointer(self.torch.cuda.current_stream().cuda_stream)))
        return stack

    def _leaves(self, x):
        return [self.torch.from_dlpack(a).requires_grad_() for a in (x.q, x.k, x.v)]

    def _sdpa(self, q, k, v):
        return self.torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=self.case.causal)

    def forward_call(self, x):
        """A training-mode forward (inputs require grad), returning the output."""
        q, k, v = self._leaves(x)
        return lambda: self._sdpa(q, k, v)

    def backward_call(self, x):
        """A call of ``torch.autograd.grad`` through the graph of an untimed forward."""
        q, k, v = self._leaves(x)
        out = self._sdpa(q, k, v)
        dout = self.torch.from_dlpack(x.dout)
        return lambda: self.torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def naive_attention(q, k, v, causal_bias=None):
    """Attention the way a CuPy user writes it without this library.

    Inputs are cast to float32, ``scores = q k^T / sqrt(D)`` is materialized
    (``[B, H, S, S]``, plus ``causal_bias`` if given), softmax runs in float32
    and ``softmax @ v`` is cast back to the input dtype.
    """
    scale = np.float32(1 / math.sqrt(q.shape[-1]))
    scores = cupy.matmul(q.astype(np.float32) * scale,
                         k.astype(np.float32).swapaxes(-1, -2))
    if causal_bias is not None:
        scores += causal_bias
    scores -= scores.max(axis=-1, keepdims=True)
    cupy.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return cupy.matmul(scores, v.astype(np.float32, copy=False)).astype(q.dtype)


def causal_bias(seqlen):
    """``[S, S]`` float32: 0 where a key is visible, ``-inf`` above the diagonal."""
    return cupy.triu(cupy.full((seqlen, seqlen), -np.inf, dtype=np.float32), k=1)


class NaiveCupyAttention:
    """:func:`naive_attention`, forward only."""

    name = "cupy-naive"
    has_backward = False

    def __init__(self, case):
        self.case = case

    def context(self):
        return contextlib.nullcontext()

    @functools.cached_property
    def bias(self):
        """The causal bias of the case (built once, untimed), or None."""
        return causal_bias(self.case.seqlen) if self.case.causal else None

    def forward_call(self, x):
        bias = self.bias
        return lambda: naive_attention(x.q, x.k, x.v, bias)


def implementation_factories(torch, allow_tf32=False):
    """Constructors ``case -> implementation``, cuflash first."""
    factories = [functools.partial(CuflashAttention, allow_tf32=allow_tf32)]
    if torch is not None:
        from torch.nn.attention import SDPBackend

        factories += [functools.partial(TorchSDPA, torch=torch, backend=getattr(SDPBackend, b))
                      for b in TORCH_BACKENDS if hasattr(SDPBackend, b)]
    return factories + [NaiveCupyAttention]


# ---------------------------------------------------------------- measuring


@dataclasses.dataclass
class Measurement:
    """One implementation, case and direction: its timing, or why there is none."""

    case: Case
    impl: str
    direction: str
    timing: Timing | None = None
    note: str = ""
    rel_error: float | None = None  # relative L2 distance of the forward output from cuflash's

    @property
    def seconds(self):
        return None if self.timing is None else self.timing.median

    @property
    def tflops(self):
        return None if self.timing is None else tflops(self.case.flops(self.direction),
                                                       self.seconds)

    def to_dict(self):
        """A JSON-ready record."""
        record = {"impl": self.impl, "direction": self.direction,
                  **dataclasses.asdict(self.case), "flops": self.case.flops(self.direction),
                  "tflops": self.tflops, "note": self.note, "rel_error": self.rel_error}
        if self.timing is not None:
            record.update(self.timing.summary())
        return record

    @classmethod
    def from_dict(cls, record):
        """The measurement of a :meth:`to_dict` record, its timing reduced to the median."""
        case = Case(record["dtype"], record["head_dim"], record["seqlen"], record["causal"],
                    record["batch"], record["heads"])
        median = record.get("median_s")
        return cls(case, record["impl"], record["direction"],
                   None if median is None else Timing((median,)), record["note"],
                   record["rel_error"])


def _first_line(text):
    return (str(text).strip().splitlines() or [""])[0]


def failure_reason(exc, caught_warnings):
    """A one-line reason for a failed run: "OOM", or the warnings and the error."""
    if "OutOfMemory" in type(exc).__name__ or "out of memory" in str(exc).lower():
        return "OOM"
    lines = [_first_line(w.message) for w in caught_warnings]
    lines.append(f"{type(exc).__name__}: {_first_line(exc)}")
    return "; ".join(dict.fromkeys(lines))[:MAX_NOTE_CHARS]


def measure_direction(impl, direction, input_sets, target_seconds):
    """Time ``impl`` in ``direction`` over ``input_sets``; a failure becomes a note."""
    make_call = impl.forward_call if direction == "fwd" else impl.backward_call
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with impl.context():
                timing = time_calls([make_call(x) for x in input_sets], target_seconds)
        except Exception as exc:  # noqa: BLE001 - any failure is reported, not raised
            return Measurement(impl.case, impl.name, direction, note=failure_reason(exc, caught))
    return Measurement(impl.case, impl.name, direction, timing=timing)


def forward_output(impl, x):
    """The forward output of ``impl`` on ``x`` as a CuPy array."""
    with impl.context():
        out = impl.forward_call(x)()
    return out if isinstance(out, cupy.ndarray) else cupy.from_dlpack(out.detach())


def relative_error(out, reference):
    """``||out - reference|| / ||reference||`` in float32."""
    out, reference = out.astype(np.float32), reference.astype(np.float32)
    return float(cupy.linalg.norm(out - reference) / cupy.linalg.norm(reference))


def agreement(impl, x, reference):
    """Relative distance of ``impl``'s forward output on ``x`` from ``reference``.

    Returns None, and says why on stderr, if the extra forward call fails.
    """
    try:
        return relative_error(forward_output(impl, x), reference)
    except Exception as exc:  # noqa: BLE001 - the timing stands without the check
        _status(f"{impl.name} {impl.case}: no agreement check: {failure_reason(exc, [])}")
        return None


def free_memory(torch):
    """Return cached blocks of CuPy's pool (and torch's allocator) to the driver."""
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


def measure_implementation(impl, input_sets, target_seconds, reference):
    """Forward and backward Measurements of ``impl``, the forward checked against ``reference``."""
    fwd = measure_direction(impl, "fwd", input_sets, target_seconds)
    if fwd.timing is not None and reference is not None:
        fwd.rel_error = agreement(impl, input_sets[0], reference)
    if not impl.has_backward:
        bwd = Measurement(impl.case, impl.name, "bwd", note="forward only")
    elif fwd.timing is None:
        bwd = Measurement(impl.case, impl.name, "bwd", note=fwd.note)
    else:
        bwd = measure_direction(impl, "bwd", input_sets, target_seconds)
    return [fwd, bwd]


def skipped(impl, note):
    """Measurements of both directions of ``impl`` that did not run."""
    return [Measurement(impl.case, impl.name, d, note=note) for d in DIRECTIONS]


def measure_case(case, factories, budget, measurements_left, l2_bytes, torch):
    """Every implementation on shared input sets of ``case``."""
    input_sets = make_input_sets(case, rotation_count(case, l2_bytes))
    results, reference = [], None
    for index, make in enumerate(factories):
        impl = make(case)
        if budget.remaining() <= 0:
            results += skipped(impl, "time budget exhausted")
            continue
        target = budget.target_for(measurements_left - 2 * index)
        fwd, bwd = measure_implementation(impl, input_sets, target, reference)
        results += [fwd, bwd]
        if impl.name == CuflashAttention.name and fwd.timing is not None:
            reference = forward_output(impl, input_sets[0])
        free_memory(torch)
    return results


def run_grid(cases, factories, budget, l2_bytes, torch):
    """Measurements of every case, with a progress bar on stderr."""
    measurements = []
    bar = progress_bar(len(cases), "cases")
    for index, case in enumerate(cases):
        bar.set_postfix_str(f"{case.dtype} D={case.head_dim} S={case.seqlen} "
                            f"causal={case.causal}")
        left = 2 * len(factories) * (len(cases) - index)
        if budget.remaining() <= 0:
            measurements += [m for make in factories
                             for m in skipped(make(case), "time budget exhausted")]
        else:
            measurements += measure_case(case, factories, budget, left, l2_bytes, torch)
        free_memory(torch)
        bar.update(1)
    bar.close()
    return measurements


class TextProgress:
    """A one-line progress report on stderr, used when tqdm is not installed."""

    def __init__(self, total, desc):
        self.total, self.desc, self.done, self.postfix = total, desc, 0, ""

    def _show(self):
        print(f"\r{self.desc}: {self.done}/{self.total} {self.postfix}", end="",
              file=sys.stderr, flush=True)

    def set_postfix_str(self, text):
        self.postfix = text
        self._show()

    def update(self, count=1):
        self.done += count
        self._show()

    def close(self):
        print(file=sys.stderr)


def progress_bar(total, desc):
    """A tqdm bar on stderr, or :class:`TextProgress` without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return TextProgress(total, desc)
    return tqdm(total=total, desc=desc, file=sys.stderr, unit="case")


# ---------------------------------------------------------- first-call cost


def _synchronized_seconds(call):
    """``(result, wall seconds)`` of ``call()`` up to the end of its GPU work."""
    start = time.perf_counter()
    result = call()
    cupy.cuda.Device().synchronize()
    return result, time.perf_counter() - start


def first_call_probe(dtype, head_dim):
    """Print, as JSON, the wall time of the first and second calls of a variant.

    Meant for a fresh process (see :func:`measure_first_call`): CUDA is
    initialized first, so the first forward's time is compilation (or a
    load from CuPy's kernel cache) plus one small launch.
    """
    kernel_build._MODULES.clear()
    case = Case(dtype, head_dim, PROBE_SEQLEN, False, batch=1, heads=1)
    x = make_input_sets(case, 1)[0]
    cupy.cuda.Device().synchronize()
    args = (1, 1, head_dim)
    (out, lse), fwd_first = _synchronized_seconds(lambda: flash_attention_fwd(x.q, x.k, x.v, *args))
    _, bwd_first = _synchronized_seconds(
        lambda: flash_attention_bwd(x.dout, x.q, x.k, x.v, out, lse, *args))
    _, fwd_second = _synchronized_seconds(lambda: flash_attention_fwd(x.q, x.k, x.v, *args))
    print(json.dumps({"fwd_first_s": fwd_first, "bwd_first_s": bwd_first,
                      "fwd_second_s": fwd_second}))


def _run_probe(dtype, head_dim, env, timeout):
    """Run :func:`first_call_probe` in a new Python process; its JSON or an error."""
    code = f"from cuflash.bench import first_call_probe; first_call_probe({dtype!r}, {head_dim})"
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": (done.stderr or done.stdout).strip()[-2000:]
                or f"exit status {done.returncode}"}


def measure_first_call(dtype, head_dim, budget):
    """First-call cost of the (dtype, head_dim) variant, cold then with CuPy's cache warm.

    Both runs are new processes sharing a fresh ``CUPY_CACHE_DIR``: the first
    compiles through NVRTC, the second loads the cached binary. Each may take
    ``PROBE_TIMEOUT`` seconds, or half the remaining budget if that is less.
    """
    package_root = str(Path(__file__).resolve().parent.parent)
    python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="cuflash-bench-cupy-cache-") as cache_dir:
        env = {**os.environ, "CUPY_CACHE_DIR": cache_dir, "PYTHONPATH": python_path}
        cold = _run_probe(dtype, head_dim, env, min(PROBE_TIMEOUT, budget.remaining() / 2))
        warm = _run_probe(dtype, head_dim, env, min(PROBE_TIMEOUT, budget.remaining() / 2))
    return {"dtype": dtype, "head_dim": head_dim, "cold": cold, "warm_cache": warm}


# -------------------------------------------------------------------- memory


def pool_growth_bytes(call):
    """Bytes CuPy's memory pool grows by while ``call()`` runs.

    The pool keeps freed blocks until ``free_all_blocks``, so its growth
    from an emptied state is the high-water mark of the call's allocations
    (outputs included, arrays that existed before excluded).
    """
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    result = call()
    cupy.cuda.Device().synchronize()
    del result
    return pool.total_bytes() - before


def memory_record(impl, case, call):
    """Peak extra memory of one forward call, or "OOM"."""
    record = {"impl": impl, "seqlen": case.seqlen, "batch": case.batch, "heads": case.heads,
              "head_dim": case.head_dim, "dtype": case.dtype, "peak_bytes": None, "note": ""}
    try:
        record["peak_bytes"] = pool_growth_bytes(call)
    except Exception as exc:  # noqa: BLE001 - any failure is reported, not raised
        record["note"] = failure_reason(exc, [])
    cupy.get_default_memory_pool().free_all_blocks()
    return record


def memory_records(case):
    """Peak forward memory of cuflash and naive attention on one draw of ``case``."""
    x = make_input_sets(case, 1)[0]
    heads = (case.heads, case.heads, case.head_dim)
    return [memory_record("cuflash", case, lambda: flash_attention_fwd(x.q, x.k, x.v, *heads)),
            memory_record("cupy-naive", case, lambda: naive_attention(x.q, x.k, x.v))]


def memory_sweep(dtype, seqlens, budget):
    """Peak forward memory of cuflash and naive attention (B=1, H=16, D=128) against S."""
    records = []
    for seqlen in seqlens:
        if budget.remaining() <= 0:
            break
        records += memory_records(Case(dtype, MEMORY_HEAD_DIM, seqlen, False, batch=1,
                                       heads=HIDDEN // MEMORY_HEAD_DIM))
    return records


# ----------------------------------------------------------------- reporting


def _format_tflops(value):
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _cell(measurement, baseline):
    """Table cell: TFLOP/s, and for a peer the ratio cuflash / peer."""
    if measurement is None or measurement.tflops is None:
        return "–"
    text = _format_tflops(measurement.tflops)
    if measurement.impl != CuflashAttention.name and baseline is not None \
            and baseline.tflops is not None:
        text += f" ({baseline.tflops / measurement.tflops:.2f}x)"
    return text


def format_throughput_table(measurements, dtype, direction):
    """A Markdown table of TFLOP/s for one dtype and direction, with its notes."""
    rows = [m for m in measurements if m.case.dtype == dtype and m.direction == direction]
    impls = list(dict.fromkeys(m.impl for m in rows))
    by_key = {(m.case, m.impl): m for m in rows}
    cases = sorted({m.case for m in rows}, key=lambda c: (c.head_dim, c.causal, c.seqlen))
    title = {"fwd": "Forward", "bwd": "Backward"}[direction]
    lines = [f"### {title}, {dtype}: TFLOP/s (peer cells: cuflash / peer)", "",
             "| D | S | causal | B | H | " + " | ".join(impls) + " |",
             "|---|---|---|---|---|" + "---|" * len(impls)]
    for case in cases:
        baseline = by_key.get((case, CuflashAttention.name))
        cells = [_cell(by_key.get((case, impl)), baseline) for impl in impls]
        lines.append(f"| {case.head_dim} | {case.seqlen} | {case.causal} | {case.batch} | "
                     f"{case.heads} | " + " | ".join(cells) + " |")
    return "\n".join(lines + format_agreement(rows) + format_notes(rows))


def format_agreement(rows):
    """Lines giving each peer's largest forward-output distance from cuflash."""
    worst = {}
    for m in rows:
        if m.rel_error is not None:
            worst[m.impl] = max(worst.get(m.impl, 0.0), m.rel_error)
    if not worst:
        return []
    return ["", "Largest relative L2 distance of a forward output from cuflash's: "
            + ", ".join(f"{impl} {error:.1e}" for impl, error in worst.items())]


def format_notes(rows):
    """Lines saying why cells are empty, grouped by implementation and reason."""
    notes = {}
    for m in rows:
        if m.timing is None:
            notes[(m.impl, m.note)] = notes.get((m.impl, m.note), 0) + 1
    if not notes:
        return []
    return ["", "Not measured (–):", ""] + [
        f"- {impl}: {note} ({count} case{'s' if count > 1 else ''})"
        for (impl, note), count in notes.items()]


def format_first_call(record):
    """A Markdown table of the first-call cost, or its errors."""
    lines = [f"### First call of the {record['dtype']}, D={record['head_dim']} variant "
             "(wall seconds)", "",
             "| CuPy kernel cache | first fwd | first bwd | second fwd |", "|---|---|---|---|"]
    for label, key in (("empty (compile)", "cold"), ("warm", "warm_cache")):
        run = record[key]
        if "error" in run:
            lines.append(f"| {label} | error: {run['error'].splitlines()[-1][:200]} | | |")
        else:
            lines.append(f"| {label} | {run['fwd_first_s']:.2f} | {run['bwd_first_s']:.3f} | "
                         f"{run['fwd_second_s']:.4f} |")
    return "\n".join(lines)


def format_memory(records):
    """A Markdown table of peak forward memory (GiB) against S."""
    impls = list(dict.fromkeys(r["impl"] for r in records))
    by_key = {(r["seqlen"], r["impl"]): r for r in records}
    first = records[0]
    lines = [f"### Peak extra memory of one forward pass (GiB; {first['dtype']}, "
             f"B={first['batch']}, H={first['heads']}, D={first['head_dim']})", "",
             "| S | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    for seqlen in sorted({r["seqlen"] for r in records}):
        cells = []
        for impl in impls:
            r = by_key.get((seqlen, impl))
            cells.append("–" if r is None else r["note"] if r["peak_bytes"] is None
                         else f"{r['peak_bytes'] / 2**30:.3f}")
        lines.append(f"| {seqlen} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_environment(env):
    """One Markdown line naming the GPU and the versions that matter."""
    return (f"GPU: {env.get('gpu')} (driver {env.get('driver')}, CUDA runtime "
            f"{env.get('cuda_runtime')}); cuflash {env.get('cuflash')}, CuPy {env.get('cupy')}, "
            f"torch {env.get('torch')}, cuDNN {env.get('cudnn')}")


def format_report(report, measurements):
    """The whole Markdown report printed on stdout."""
    parts = ["## cuflash benchmark", "", format_environment(report["environment"]), "",
             METHOD_LINE]
    if report.get("settings", {}).get("allow_tf32"):
        parts += ["", "cuflash ran with `allow_tf32=True`: float32 products in TF32."]
    for dtype in dict.fromkeys(m.case.dtype for m in measurements):
        for direction in DIRECTIONS:
            parts += ["", format_throughput_table(measurements, dtype, direction)]
    if report.get("first_call"):
        parts += ["", format_first_call(report["first_call"])]
    if report.get("memory"):
        parts += ["", format_memory(report["memory"])]
    return "\n".join(parts)


def _pyplot():
    """matplotlib's pyplot on the Agg backend, or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("cuflash.bench: matplotlib is not installed; no plots written", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(measurements, directory):
    """One PNG per (dtype, direction): TFLOP/s against S, a panel per (D, causal)."""
    plt = _pyplot()
    if plt is None:
        return []
    paths = []
    for dtype in dict.fromkeys(m.case.dtype for m in measurements):
        for direction in DIRECTIONS:
            rows = [m for m in measurements if m.case.dtype == dtype
                    and m.direction == direction and m.tflops is not None]
            if rows:
                paths.append(_plot_panels(plt, rows, Path(directory)
                                          / f"throughput-{dtype}-{direction}.png"))
    return paths


def _plot_panels(plt, rows, path):
    head_dims = sorted({m.case.head_dim for m in rows})
    fig, axes = plt.subplots(len(head_dims), 2, figsize=(11, 3.4 * len(head_dims)),
                             squeeze=False, sharex=True)
    for (row, head_dim), (col, causal) in ((r, c) for r in enumerate(head_dims)
                                            for c in enumerate((False, True))):
        ax = axes[row][col]
        panel = [m for m in rows if m.case.head_dim == head_dim and m.case.causal == causal]
        for impl in dict.fromkeys(m.impl for m in rows):
            points = sorted((m.case.seqlen, m.tflops) for m in panel if m.impl == impl)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={head_dim}, causal={causal}")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("sequence length S")
    axes[0][0].legend(fontsize="small")
    first = rows[0]
    fig.suptitle(f"{first.case.dtype} {'forward' if first.direction == 'fwd' else 'backward'}"
                 f" (B*S={TOKENS}, H={HIDDEN}/D)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_memory(records, directory):
    """``memory.png``: peak extra forward memory against S; OOM noted in the legend."""
    plt = _pyplot()
    if plt is None or not records:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl in dict.fromkeys(r["impl"] for r in records):
        mine = [r for r in records if r["impl"] == impl]
        points = [(r["seqlen"], r["peak_bytes"] / 2**30) for r in mine
                  if r["peak_bytes"] is not None]
        failed = [r for r in mine if r["peak_bytes"] is None]
        label = impl + (f" ({failed[0]['note']} from S={failed[0]['seqlen']})" if failed else "")
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("peak extra memory (GiB)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = Path(directory) / "memory.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------- environment


def _cuda_version(number):
    """CUDA's integer version (e.g. 13000) as "13.0"."""
    return f"{number // 1000}.{number % 1000 // 10}"


def _module_version(name):
    try:
        module = __import__(name)
    except ImportError:
        return None
    return getattr(module, "__version__", None)


def _driver_release():
    """The NVIDIA driver release from nvidia-smi, or None."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else None


def environment(torch):
    """Versions of every package involved and the GPU's name and sizes."""
    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    name = props["name"]
    env = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(), "platform": platform.platform(),
        "cuflash": __version__, "numpy": np.__version__, "cupy": cupy.__version__,
        "ml_dtypes": _module_version("ml_dtypes"), "matplotlib": _module_version("matplotlib"),
        "tqdm": _module_version("tqdm"),
        "cuda_runtime": _cuda_version(cupy.cuda.runtime.runtimeGetVersion()),
        "cuda_driver_api": _cuda_version(cupy.cuda.runtime.driverGetVersion()),
        "driver": _driver_release(),
        "nvrtc": ".".join(map(str, cupy.cuda.nvrtc.getVersion())),
        "gpu": name.decode() if isinstance(name, bytes) else name,
        "compute_capability": device.compute_capability,
        "multiprocessors": props["multiProcessorCount"], "l2_bytes": props["l2CacheSize"],
        "memory_bytes": props["totalGlobalMem"],
        "torch": None, "torch_cuda": None, "cudnn": None,
    }
    if torch is not None:
        env.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
    return env


def import_torch(enabled):
    """``(torch, note)``: the module when it can run SDPA on this GPU, else None and why."""
    if not enabled:
        return None, "disabled by --no-torch"
    try:
        import torch
        from torch.nn.attention import sdpa_kernel  # noqa: F401 - torch >= 2.3 needed
    except ImportError as exc:
        return None, f"not importable: {exc}"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA GPU"
    return torch, "ok"


def gpu_unavailable_reason():
    """Why no GPU can be used, or None when CuPy sees one."""
    if cupy is None:
        return "CuPy is not installed"
    try:
        return None if cupy.is_available() else "cupy.is_available() is False"
    except Exception as exc:  # noqa: BLE001 - any CUDA failure means no GPU
        return f"CUDA failed: {exc}"


# ----------------------------------------------------------------------- CLI


def _list_of(convert):
    def parse(text):
        try:
            return tuple(convert(item) for item in text.split(",") if item)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"bad list {text!r}: {exc}") from exc
    return parse


def _dtype_name(name):
    if name not in DTYPES or DTYPES[name] is None:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return name


def parse_args(argv=None):
    """Parse the command line; unset grid options take their (quick) defaults."""
    parser = argparse.ArgumentParser(
        prog="python -m cuflash.bench", description=__doc__.splitlines()[0],
        epilog="Methodology: docs/performance.md")
    parser.add_argument("--quick", action="store_true",
                        help="a small grid (bfloat16, D 64/128, S 512/2048) for smoke runs")
    parser.add_argument("--dtype", dest="dtypes", type=_list_of(_dtype_name),
                        help="comma-separated dtypes (default bfloat16,float16; "
                             "float32 is best run as its own table)")
    parser.add_argument("--head-dims", type=_list_of(int),
                        help="comma-separated head dims (default 64,128,256)")
    parser.add_argument("--seqlens", type=_list_of(int),
                        help="comma-separated sequence lengths (default 512,...,16384)")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch SDPA")
    parser.add_argument("--no-first-call", action="store_true",
                        help="skip the first-call (compile) measurement")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory sweep up to S=131072")
    parser.add_argument("--allow-tf32", action="store_true",
                        help="run cuflash with allow_tf32=True (float32 products in TF32)")
    parser.add_argument("--time-budget", type=float,
                        help=f"seconds for the whole run (default {DEFAULT_TIME_BUDGET:.0f}, "
                             f"quick {QUICK_TIME_BUDGET:.0f}); repeats shrink to fit and "
                             "cases past it are reported as not run")
    parser.add_argument("--json", type=Path, help="write the full report as JSON here")
    parser.add_argument("--plots", type=Path, help="write PNG plots into this directory")
    parser.add_argument("--from-json", type=Path,
                        help="no measuring: the tables and plots of this saved report")
    args = parser.parse_args(argv)
    quick = args.quick
    args.dtypes = args.dtypes or (QUICK_DTYPES if quick else DEFAULT_DTYPES)
    args.head_dims = args.head_dims or (QUICK_HEAD_DIMS if quick else DEFAULT_HEAD_DIMS)
    args.seqlens = args.seqlens or (QUICK_SEQLENS if quick else DEFAULT_SEQLENS)
    args.time_budget = args.time_budget or (QUICK_TIME_BUDGET if quick else DEFAULT_TIME_BUDGET)
    args.target_seconds = QUICK_TARGET_SECONDS if quick else TARGET_SECONDS
    args.memory_seqlens = QUICK_MEMORY_SEQLENS if quick else MEMORY_SEQLENS
    return args


def _status(text):
    print(f"cuflash.bench: {text}", file=sys.stderr, flush=True)


def run(args):
    """Measure everything ``args`` asks for; return the JSON-ready report and Measurements."""
    torch, torch_note = import_torch(not args.no_torch)
    env = environment(torch)
    settings = {key: value for key, value in vars(args).items()
                if key not in ("json", "plots", "from_json")}
    settings.update(torch=torch_note, tokens=TOKENS, hidden=HIDDEN,
                    flop_convention="fwd 4*B*H*S*S*D (halved when causal), bwd 2.5x fwd")
    report = {"environment": env, "settings": settings}
    budget = Budget(args.time_budget, args.target_seconds)
    if not args.no_first_call:
        head_dim = 128 if 128 in args.head_dims else args.head_dims[0]
        _status(f"first-call cost of the {args.dtypes[0]}, D={head_dim} variant")
        report["first_call"] = measure_first_call(args.dtypes[0], head_dim, budget)
    if not args.no_memory:
        _status("peak memory against S")
        report["memory"] = memory_sweep(args.dtypes[0], args.memory_seqlens, budget)
    cases = build_grid(args.dtypes, args.head_dims, args.seqlens)
    measurements = run_grid(cases, implementation_factories(torch, args.allow_tf32), budget,
                            env["l2_bytes"], torch)
    report["measurements"] = [m.to_dict() for m in measurements]
    report["elapsed_s"] = args.time_budget - budget.remaining()
    _status(f"measured for {report['elapsed_s']:.0f} s")
    return report, measurements


def main(argv=None):
    """Entry point of ``python -m cuflash.bench``; returns the exit status."""
    args = parse_args(argv)
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        measurements = [Measurement.from_dict(r) for r in report["measurements"]]
    else:
        reason = gpu_unavailable_reason()
        if reason is not None:
            print(NO_GPU_MESSAGE.format(reason), file=sys.stderr)
            return 0
        report, measurements = run(args)
    print(format_report(report, measurements))
    if args.json and not args.from_json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        _status(f"wrote {args.json}")
    if args.plots:
        written = plot_throughput(measurements, args.plots)
        written.append(plot_memory(report.get("memory"), args.plots))
        _status("wrote " + ", ".join(str(p) for p in written if p is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
