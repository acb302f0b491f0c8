"""Side-by-side benchmark: cuflash against PyTorch SDPA and naive CuPy attention.

Usage::

    python -m cuflash.bench [--quick] [--dtype bfloat16,float16] [--head-dims 64,128,256]
                            [--seqlens 512,...,16384] [--no-torch] [--no-first-call]
                            [--no-memory] [--allow-tf32] [--time-budget SECONDS]
                            [--json PATH] [--plots DIR]
    python -m cuflash.bench [--head-dim-sweep] [--small-calls] [--decode] [--varlen]
                            [options above]
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

Instead of the grid, any of four other tables (each with torch's peers on
the same inputs in the same run, and the ratios):

- ``--head-dim-sweep``: every head dim of ``SWEEP_HEAD_DIMS`` (float32:
  ``FLOAT32_SWEEP_HEAD_DIMS``), S 1024 and 4096, causal and not, on the
  grid's shapes, against torch flash and cuDNN (float32: efficient), with the
  cases below target named. ``--dtype`` (default bfloat16, float16,
  float32), ``--head-dims`` and ``--seqlens`` narrow it.
- ``--small-calls``: GPU time per call of three small causal bfloat16 shapes
  of a training loop, forward, backward and their sum; and the host time per
  call (wall time of 1000 back-to-back calls of a tiny problem, cuflash's
  backward with ``synchronize=False``).
- ``--decode``: ``flash_attention_with_kvcache`` decoding from contiguous and
  paged caches (SPEC section 6): time, cache bytes read per second, torch
  flash and cuDNN on a contiguous cache of the same keys and values.
- ``--varlen``: a packed batch of 16384 tokens (SPEC section 7), lengths
  uniform in 64..4096 (fixed seed, the last trimmed) and 8 x 2048, bfloat16,
  ``H = 2048 / D`` for D 64 and 128, causal and not: TFLOP/s (work inside the
  sequences only) of ``flash_attention_varlen_fwd`` / ``_bwd``, of the dense
  kernels on equal lengths of the batch's mean, of torch SDPA (flash) on a
  nested jagged tensor and of compiled ``flex_attention`` with a document
  mask, and cuflash varlen's ratio to each.

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

from . import __version__, kernel_build, plans
from .api import flash_attention_bwd, flash_attention_fwd
from .problem import DTYPES_BY_NAME
from .varlen import flash_attention_varlen_bwd, flash_attention_varlen_fwd

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

# Head-dim sweep (issue 14): B * S = 16384 and H = max(1, 2048 // D) as in the grid.
SWEEP_DTYPES = ("bfloat16", "float16", "float32")
SWEEP_HEAD_DIMS = (32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
FLOAT32_SWEEP_HEAD_DIMS = (32, 64, 96, 128, 160, 256)
SWEEP_SEQLENS = (1024, 4096)
SWEEP_PEERS = ("FLASH_ATTENTION", "CUDNN_ATTENTION")
FLOAT32_SWEEP_PEERS = ("EFFICIENT_ATTENTION",)
SWEEP_TARGET = ("torch-flash", 1.0)  # cuflash / peer TFLOP/s at least this
FLOAT32_SWEEP_TARGET = ("torch-efficient", 2.0)

# Small calls (issue 14): GPU time per call of small training shapes, and host time per call.
SMALL_CALL_SHAPES = ((1, 8, 128, 64), (4, 12, 256, 64), (8, 16, 512, 128))  # B, H, S, D
SMALL_CALL_PEERS = ("FLASH_ATTENTION", "CUDNN_ATTENTION")
SMALL_CALL_TARGET_PEER = "torch-flash"  # cuflash fwd + bwd at most its time
HOST_TIME_SHAPE = (1, 1, 16, 64)
HOST_TIME_CALLS = 1000
HOST_TIME_TARGET_US = {"fwd": 15.0, "bwd": 30.0}

# Decoding from a KV cache (issue 15, SPEC section 6): bfloat16, D=128, H=32, H_kv=8.
DECODE_BATCH_CACHE = ((1, 32768), (16, 8192), (64, 2048), (256, 512))  # S_q = 1
DECODE_BLOCK_SIZES = (0, 16, 256)  # 0: contiguous
DECODE_LONG_QUERY_CACHE = (16, 8192)  # B, cache length of the longer query blocks
DECODE_LONG_QUERY_LENS = (4, 512)  # speculative decoding, chunked prefill
DECODE_PEERS = ("FLASH_ATTENTION", "CUDNN_ATTENTION")
DECODE_TARGET_TB_PER_S = 3.4  # 80% of the H200's copy rate, where the cache is >= 256 MB
DECODE_TARGET_MIN_BYTES = 256e6

# Packed variable-length batches (issue 16, SPEC section 7): bfloat16, H = 2048 / D.
VARLEN_LENGTH_RANGE = (64, 4096)  # uniform, inclusive; the last length is trimmed
VARLEN_SEED = 0
VARLEN_EQUAL = (8, 2048)  # B, S of the equal-lengths case
VARLEN_HEAD_DIMS = (64, 128)
VARLEN_DTYPE = "bfloat16"
VARLEN_DENSE_MULTIPLE = 8  # the dense-equal S is the mean length rounded to this
VARLEN_TARGET = ("cuflash-dense-equal", 0.95)  # cuflash varlen / dense-equal at least this
VARLEN_IMPLS = ("cuflash-varlen", "cuflash-dense-equal", "torch-nested-flash", "torch-flex")
VARLEN_RECOMPILE_LIMIT = 64  # torch.compile'd flex_attention: one graph per D, mask, grad mode

# Default --time-budget of each measured part; a run's default is the sum of its parts.
MODE_TIME_BUDGETS = {"head_dim_sweep": 1500.0, "small_calls": 60.0, "decode": 120.0,
                     "varlen": 300.0}

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


SMALL_CALL_CASES = tuple(Case("bfloat16", d, s, True, batch=b, heads=h)
                         for b, h, s, d in SMALL_CALL_SHAPES)
HOST_TIME_CASE = Case("bfloat16", HOST_TIME_SHAPE[3], HOST_TIME_SHAPE[2], True,
                      batch=HOST_TIME_SHAPE[0], heads=HOST_TIME_SHAPE[1])


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
    return sets_spanning_l2(4 * math.prod(case.shape) * case.numpy_dtype.itemsize, l2_bytes)


def sets_spanning_l2(set_bytes, l2_bytes):
    """Input sets of ``set_bytes`` each whose round spans several L2 caches (2 at least)."""
    return int(np.clip(math.ceil(L2_ROTATION_FACTOR * l2_bytes / set_bytes), 2, MAX_INPUT_SETS))


# ----------------------------------------------------------- implementations


class CuflashAttention:
    """cuflash's forward and backward (residuals from an untimed forward);
    ``allow_tf32`` and the keyword ``options`` (e.g. score modifiers) are passed to both."""

    name = "cuflash"
    has_backward = True

    def __init__(self, case, allow_tf32=False, **options):
        self.case = case
        self.allow_tf32 = allow_tf32
        self.options = options

    def context(self):
        return contextlib.nullcontext()

    def _fwd(self, x):
        c = self.case
        return flash_attention_fwd(x.q, x.k, x.v, c.heads, c.heads, c.head_dim, c.causal,
                                   allow_tf32=self.allow_tf32, **self.options)

    def forward_call(self, x):
        """A call that enqueues one forward pass on ``x`` and returns the output."""
        return lambda: self._fwd(x)[0]

    def backward_call(self, x):
        """A call that enqueues one backward pass on ``x``."""
        c = self.case
        out, lse = self._fwd(x)
        return functools.partial(flash_attention_bwd, x.dout, x.q, x.k, x.v, out, lse,
                                 c.heads, c.heads, c.head_dim, c.causal, synchronize=False,
                                 allow_tf32=self.allow_tf32, **self.options)


@dataclasses.dataclass(frozen=True)
class StreamPointer:
    """A raw ``cudaStream_t`` offered through the CUDA stream protocol."""

    ptr: int

    def __cuda_stream__(self):
        return (0, self.ptr)


def torch_stream(torch):
    """A context putting CuPy (and so its events) on torch's current stream."""
    return cupy.cuda.Stream.from_external(StreamPointer(torch.cuda.current_stream().cuda_stream))


def forced_backend(torch, backend):
    """A context forcing SDPA's ``backend``, with CuPy's events on torch's current stream."""
    from torch.nn.attention import sdpa_kernel

    stack = contextlib.ExitStack()
    stack.enter_context(sdpa_kernel([backend]))
    stack.enter_context(torch_stream(torch))
    return stack


class TorchSDPA:
    """``torch.nn.functional.scaled_dot_product_attention`` with one forced backend."""

    has_backward = True

    def __init__(self, case, torch, backend):
        self.case, self.torch, self.backend = case, torch, backend
        self.name = TORCH_BACKENDS[backend.name]

    def context(self):
        return forced_backend(self.torch, self.backend)

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


def sdpa_backends(torch, names):
    """The ``SDPBackend`` members of ``names`` (keys of ``TORCH_BACKENDS``) torch has."""
    if torch is None:
        return []
    from torch.nn.attention import SDPBackend

    return [getattr(SDPBackend, name) for name in names if hasattr(SDPBackend, name)]


def implementation_factories(torch, allow_tf32=False, torch_backends=tuple(TORCH_BACKENDS),
                             naive=True):
    """Constructors ``case -> implementation``: cuflash, torch's ``torch_backends``, naive CuPy."""
    factories = [functools.partial(CuflashAttention, allow_tf32=allow_tf32)]
    factories += [functools.partial(TorchSDPA, torch=torch, backend=backend)
                  for backend in sdpa_backends(torch, torch_backends)]
    return factories + ([NaiveCupyAttention] if naive else [])


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


def run_or_reason(impl, work):
    """``(work(), "")`` run inside ``impl.context()``, or ``(None, reason)`` when it raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with impl.context():
                return work(), ""
        except Exception as exc:  # noqa: BLE001 - any failure is reported, not raised
            return None, failure_reason(exc, caught)


def measure_direction(impl, direction, input_sets, target_seconds):
    """Time ``impl`` in ``direction`` over ``input_sets``; a failure becomes a note."""
    make_call = impl.forward_call if direction == "fwd" else impl.backward_call
    timing, note = run_or_reason(
        impl, lambda: time_calls([make_call(x) for x in input_sets], target_seconds))
    return Measurement(impl.case, impl.name, direction, timing=timing, note=note)


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


def run_grid(cases, factories_for, budget, l2_bytes, torch):
    """Measurements of every case, with a progress bar on stderr.

    ``factories_for(case)`` gives the implementations' constructors for a case.
    """
    measurements = []
    bar = progress_bar(len(cases), "cases")
    measurements_per_case = [2 * len(factories_for(case)) for case in cases]
    for index, case in enumerate(cases):
        bar.set_postfix_str(f"{case.dtype} D={case.head_dim} S={case.seqlen} "
                            f"causal={case.causal}")
        factories = factories_for(case)
        left = sum(measurements_per_case[index:])
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
    plans.clear()
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


# ---------------------------------------------------------- head-dim sweep


def sweep_peer_backends(dtype):
    """The torch backends a head-dim sweep case of ``dtype`` is compared with."""
    return FLOAT32_SWEEP_PEERS if dtype == "float32" else SWEEP_PEERS


def sweep_target(dtype):
    """``(peer, ratio)``: the sweep's target is cuflash / peer >= ratio."""
    return FLOAT32_SWEEP_TARGET if dtype == "float32" else SWEEP_TARGET


def head_dim_sweep_cases(dtypes, head_dims=None, seqlens=None):
    """The head-dim sweep: every dtype, head dim, causal flag and S with B*S and H*D fixed.

    Without ``head_dims``, 16-bit dtypes take ``SWEEP_HEAD_DIMS`` and float32
    ``FLOAT32_SWEEP_HEAD_DIMS``; without ``seqlens``, ``SWEEP_SEQLENS``.
    """
    cases = []
    for dtype in dtypes:
        dims = head_dims or (FLOAT32_SWEEP_HEAD_DIMS if dtype == "float32" else SWEEP_HEAD_DIMS)
        cases += build_grid([dtype], dims, seqlens or SWEEP_SEQLENS)
    return cases


def head_dim_sweep(cases, torch, allow_tf32, budget, l2_bytes):
    """cuflash and torch's peers of each dtype (``sweep_peer_backends``) on ``cases``."""
    factories = {dtype: implementation_factories(torch, allow_tf32, sweep_peer_backends(dtype),
                                                 naive=False)
                 for dtype in dict.fromkeys(c.dtype for c in cases)}
    return run_grid(cases, lambda case: factories[case.dtype], budget, l2_bytes, torch)


# -------------------------------------------------------------- small calls


def host_seconds_per_call(call, count):
    """Wall seconds per call of ``count`` back-to-back calls, nothing synchronized between.

    One untimed call warms up and the device is idle when the clock starts;
    the clock stops when the last call returns (its GPU work may still run).
    """
    call()
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(count):
        call()
    seconds = time.perf_counter() - start
    cupy.cuda.Device().synchronize()
    return seconds / count


def host_time_records(factories, case=HOST_TIME_CASE, count=HOST_TIME_CALLS):
    """Host microseconds per call of each implementation, forward and backward, on ``case``."""
    x = make_input_sets(case, 1)[0]
    records = []
    for make in factories:
        impl = make(case)
        for direction in DIRECTIONS:
            make_call = impl.forward_call if direction == "fwd" else impl.backward_call
            seconds, note = run_or_reason(
                impl, lambda make_call=make_call: host_seconds_per_call(make_call(x), count))
            records.append({"impl": impl.name, "direction": direction, "calls": count,
                            **dataclasses.asdict(case),
                            "us_per_call": None if seconds is None else 1e6 * seconds,
                            "note": note})
    return records


def small_call_sweep(torch, budget, l2_bytes):
    """GPU time per call of the small cases, and host time per call of a tiny one."""
    factories = implementation_factories(torch, torch_backends=SMALL_CALL_PEERS, naive=False)
    measurements = run_grid(list(SMALL_CALL_CASES), lambda case: factories, budget, l2_bytes,
                            torch)
    _status(f"host time per call ({HOST_TIME_CALLS} calls)")
    return {"measurements": [m.to_dict() for m in measurements],
            "host_time": host_time_records(factories)}


# ----------------------------------------------------------------- decoding


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decoding step from a KV cache of ``cache_len`` keys a sequence (SPEC section 6).

    ``block_size`` 0 is a contiguous cache ``[B, H_kv, L, D]``; otherwise the
    cache is paged in blocks of that many keys.
    """

    batch: int
    cache_len: int
    q_len: int = 1
    block_size: int = 0
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"

    @property
    def layout(self):
        return "contiguous" if self.block_size == 0 else f"paged {self.block_size}"

    @property
    def group(self):
        """The same step on a contiguous cache: the case torch is timed on."""
        return dataclasses.replace(self, block_size=0)

    @property
    def cache_bytes(self):
        """Bytes of keys and values the step reads: ``2 * B * H_kv * L * D * itemsize``."""
        return (2 * self.batch * self.kv_heads * self.cache_len * self.head_dim
                * DTYPES[self.dtype].itemsize)


def decode_cases():
    """The decode table: S_q = 1 on every layout, then longer query blocks (contiguous)."""
    cases = [DecodeCase(batch, cache_len, block_size=block_size)
             for batch, cache_len in DECODE_BATCH_CACHE for block_size in DECODE_BLOCK_SIZES]
    batch, cache_len = DECODE_LONG_QUERY_CACHE
    return cases + [DecodeCase(batch, cache_len, q_len) for q_len in DECODE_LONG_QUERY_LENS]


def kvcache_function():
    """``(flash_attention_with_kvcache, "")``, or ``(None, why)`` while cuflash has none."""
    import cuflash

    function = getattr(cuflash, "flash_attention_with_kvcache", None)
    if function is not None:
        return function, ""
    try:
        from .kvcache import flash_attention_with_kvcache
    except Exception as exc:  # noqa: BLE001 - absent or broken: the table is skipped
        return None, (f"cuflash.flash_attention_with_kvcache is not available "
                      f"({type(exc).__name__}: {_first_line(exc)})")
    return flash_attention_with_kvcache, ""


@dataclasses.dataclass(frozen=True)
class DecodeInputSet:
    """Queries, the cache as cuflash reads it, and the same keys and values contiguous."""

    q: object
    k: object  # [B, H_kv, L, D], contiguous: what torch reads
    v: object
    cache_seqlens: object  # int32 [B] on the device
    k_cache: object  # k itself, or its paged copy
    v_cache: object
    block_table: object = None


def make_decode_sets(case, count, seed=0):
    """``count`` standard-normal input sets of ``case`` on a contiguous cache."""
    rng = cupy.random.default_rng(seed)
    dtype = DTYPES[case.dtype]

    def draw(heads, rows):
        shape = (case.batch, heads, rows, case.head_dim)
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    sets = []
    for _ in range(count):
        k, v = draw(case.kv_heads, case.cache_len), draw(case.kv_heads, case.cache_len)
        sets.append(DecodeInputSet(draw(case.heads, case.q_len), k, v,
                                   cupy.full(case.batch, case.cache_len, dtype=np.int32), k, v))
    return sets


def paged_input_set(x, block_size, seed=0):
    """``x`` with its cache copied into shuffled blocks of ``block_size`` keys.

    Blocks ``[num_blocks, H_kv, block_size, D]``; ``block_table[b, j]`` holds
    keys ``j * block_size ..`` of sequence ``b``. The cache length must be a
    multiple of ``block_size``.
    """
    xp = cupy.get_array_module(x.k)  # NumPy arrays work too
    batch, kv_heads, cache_len, head_dim = x.k.shape
    if cache_len % block_size:
        raise ValueError(f"cache length {cache_len} is not a multiple of {block_size}")
    per_sequence = cache_len // block_size
    order = xp.asarray(np.random.default_rng(seed).permutation(batch * per_sequence))
    block_table = order.astype(np.int32).reshape(batch, per_sequence)

    def paged(cache):
        blocks = cache.reshape(batch, kv_heads, per_sequence, block_size, head_dim)
        blocks = blocks.transpose(0, 2, 1, 3, 4).reshape(-1, kv_heads, block_size, head_dim)
        out = xp.empty_like(blocks)
        out[order] = blocks
        return out

    return dataclasses.replace(x, k_cache=paged(x.k), v_cache=paged(x.v),
                               block_table=block_table)


class CuflashDecode:
    """``cuflash.flash_attention_with_kvcache``: bottom-right causal, no appended rows."""

    name = "cuflash"

    def __init__(self, case, function):
        self.case, self.function = case, function

    def context(self):
        return contextlib.nullcontext()

    def forward_call(self, x):
        c = self.case
        return functools.partial(self.function, x.q, x.k_cache, x.v_cache, c.heads, c.kv_heads,
                                 c.head_dim, True, cache_seqlens=x.cache_seqlens,
                                 block_table=x.block_table)


class TorchDecode:
    """SDPA with one forced backend on the contiguous cache, bottom-right causal.

    ``S_q = 1`` sees every key (no mask); longer query blocks take
    ``causal_lower_right``. GQA by ``enable_gqa=True``, or, when the backend
    refuses it, by k and v repeated to the query heads (copied once, untimed);
    ``gqa`` says which.
    """

    def __init__(self, case, torch, backend):
        self.case, self.torch, self.backend = case, torch, backend
        self.name = TORCH_BACKENDS[backend.name]
        self.gqa = None

    def context(self):
        return forced_backend(self.torch, self.backend)

    def forward_call(self, x):
        torch, c = self.torch, self.case
        sdpa = torch.nn.functional.scaled_dot_product_attention
        q, k, v = (torch.from_dlpack(a) for a in (x.q, x.k, x.v))
        mask = None
        if c.q_len > 1:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(c.q_len, c.cache_len)
        try:
            sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
            self.gqa = "enable_gqa=True"
            return lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        except Exception:  # noqa: BLE001 - the backend's refusal; repeat k/v instead
            group = c.heads // c.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            self.gqa = "k/v repeated"
            return lambda: sdpa(q, k, v, attn_mask=mask)


def decode_record(case, impl, timing, note, rel_error=None):
    """A JSON-ready record of one decode measurement."""
    record = {"impl": impl.name, **dataclasses.asdict(case), "layout": case.layout,
              "cache_bytes": case.cache_bytes, "note": note, "rel_error": rel_error,
              "gqa": getattr(impl, "gqa", None), "median_s": None}
    if timing is not None:
        record.update(timing.summary())
    return record


def decode_table(function, torch, budget, l2_bytes):
    """Decode records: cuflash on every case, torch's peers once a contiguous group."""
    cases = decode_cases()
    groups = list(dict.fromkeys(c.group for c in cases))
    peers = sdpa_backends(torch, DECODE_PEERS)
    left = len(cases) + len(groups) * len(peers)
    records = []
    bar = progress_bar(len(cases), "decode cases")
    for group in groups:
        if budget.remaining() <= 0:
            records += [decode_record(c, CuflashDecode(c, function), None,
                                      "time budget exhausted") for c in cases if c.group == group]
            bar.update(sum(c.group == group for c in cases))
            continue
        set_bytes = 2 * group.cache_bytes  # q is small; out too
        contiguous_sets = make_decode_sets(group, sets_spanning_l2(set_bytes, l2_bytes))
        reference = None
        for case in (c for c in cases if c.group == group):
            bar.set_postfix_str(f"B={case.batch} L={case.cache_len} S_q={case.q_len} "
                                f"{case.layout}")
            impls = [CuflashDecode(case, function)]
            if case.block_size == 0:
                impls += [TorchDecode(case, torch, backend) for backend in peers]
            inputs = contiguous_sets if case.block_size == 0 else [
                paged_input_set(x, case.block_size) for x in contiguous_sets]
            for impl in impls:
                timing, note = None, "time budget exhausted"
                if budget.remaining() > 0:
                    timing, note = run_or_reason(impl, lambda impl=impl: time_calls(
                        [impl.forward_call(x) for x in inputs], budget.target_for(left)))
                left -= 1
                rel_error = None
                if timing is not None and reference is not None:
                    rel_error = agreement(impl, inputs[0], reference)
                elif timing is not None:  # the first output of the group is the reference
                    reference, _ = run_or_reason(impl, lambda impl=impl: forward_output(
                        impl, inputs[0]))
                records.append(decode_record(case, impl, timing, note, rel_error))
            del inputs
            free_memory(torch)
            bar.update(1)
        del contiguous_sets, reference
        free_memory(torch)
    bar.close()
    return records


# ------------------------------------------------------ packed variable-length


def draw_varlen_lengths(total=TOKENS, low=VARLEN_LENGTH_RANGE[0], high=VARLEN_LENGTH_RANGE[1],
                        seed=VARLEN_SEED):
    """Sequence lengths drawn uniformly from ``low .. high`` (inclusive) until they sum to
    ``total``; the last is trimmed so that the sum is exactly ``total`` (it may fall below
    ``low``)."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(int(rng.integers(low, high, endpoint=True)), total - sum(lengths)))
    return tuple(lengths)


def varlen_flops(lengths, heads, head_dim, causal, direction="fwd"):
    """FLOPs of a packed batch: :func:`attention_flops` of each sequence alone, summed
    (only the work inside the sequences counts; causal halves each one's square)."""
    return sum(attention_flops(1, heads, n, head_dim, causal, direction) for n in lengths)


@dataclasses.dataclass(frozen=True)
class VarlenCase:
    """One packed batch: ``q``, ``k``, ``v`` ``[sum(lengths), heads, head_dim]`` of ``dtype``.

    ``kind`` is "uniform" (lengths drawn by :func:`draw_varlen_lengths`) or
    "equal" (``VARLEN_EQUAL``).
    """

    kind: str
    lengths: tuple
    head_dim: int
    heads: int
    causal: bool
    dtype: str = VARLEN_DTYPE

    @property
    def tokens(self):
        return sum(self.lengths)

    @property
    def batch(self):
        return len(self.lengths)

    @property
    def max_seqlen(self):
        return max(self.lengths)

    @property
    def mean_seqlen(self):
        return self.tokens / self.batch

    @property
    def cu_seqlens(self):
        """int32 offsets ``[B + 1]`` on the host: 0, then the running sums of the lengths."""
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int32)

    @property
    def numpy_dtype(self):
        return DTYPES[self.dtype]

    @property
    def label(self):
        if self.kind == "equal":
            return f"equal {self.batch} x {self.lengths[0]}"
        low, high = VARLEN_LENGTH_RANGE
        return f"uniform {low}..{high} ({self.batch} seqs)"

    @property
    def dense_case(self):
        """The dense problem on equal lengths of the batch's mean: ``B = round(tokens /
        mean)`` sequences of the mean rounded to a multiple of ``VARLEN_DENSE_MULTIPLE``."""
        mean = self.mean_seqlen
        seqlen = VARLEN_DENSE_MULTIPLE * max(1, round(mean / VARLEN_DENSE_MULTIPLE))
        return Case(self.dtype, self.head_dim, seqlen, self.causal,
                    batch=round(self.tokens / mean), heads=self.heads)

    def flops(self, direction):
        """FLOPs of one pass in ``direction`` ("fwd" or "bwd"), summed over the sequences."""
        return varlen_flops(self.lengths, self.heads, self.head_dim, self.causal, direction)


def varlen_cases(head_dims=VARLEN_HEAD_DIMS, seed=VARLEN_SEED):
    """The varlen table's cases: uniform lengths, then equal ones; by head dim, causal."""
    batch, seqlen = VARLEN_EQUAL
    lengths = {"uniform": draw_varlen_lengths(seed=seed), "equal": (seqlen,) * batch}
    return [VarlenCase(kind, lengths[kind], head_dim, max(1, HIDDEN // head_dim), causal)
            for kind in lengths for head_dim in head_dims for causal in (False, True)]


def make_packed_sets(case, count, seed=0):
    """``count`` standard-normal packed input sets ``[tokens, heads, head_dim]`` of ``case``."""
    rng = cupy.random.default_rng(seed)
    shape = (case.tokens, case.heads, case.head_dim)

    def draw():
        return rng.standard_normal(shape, dtype=np.float32).astype(case.numpy_dtype)

    return [InputSet(draw(), draw(), draw(), draw()) for _ in range(count)]


class CuflashVarlen:
    """``flash_attention_varlen_fwd`` / ``_bwd`` (backward with ``synchronize=False``),
    device-held int32 offsets, ``max_seqlen`` the longest sequence."""

    name = "cuflash-varlen"
    has_backward = True

    def __init__(self, case):
        self.case = case
        self.cu_seqlens = cupy.asarray(case.cu_seqlens)

    def context(self):
        return contextlib.nullcontext()

    def _args(self):
        c = self.case
        return (self.cu_seqlens, self.cu_seqlens, c.max_seqlen, c.max_seqlen, c.heads, c.heads,
                c.head_dim, c.causal)

    def forward_call(self, x):
        return lambda: flash_attention_varlen_fwd(x.q, x.k, x.v, *self._args())[0]

    def backward_call(self, x):
        out, lse = flash_attention_varlen_fwd(x.q, x.k, x.v, *self._args())
        return functools.partial(flash_attention_varlen_bwd, x.dout, x.q, x.k, x.v, out, lse,
                                 *self._args(), synchronize=False)


class CuflashDenseEqual(CuflashAttention):
    """cuflash's dense kernels on the equal-lengths problem of a packed case."""

    name = "cuflash-dense-equal"


class TorchNestedSDPA:
    """SDPA with one forced backend on nested jagged tensors ``[B, H, {S}, D]`` viewing the
    packed arrays (``nested_tensor_from_jagged`` with the offsets and the min/max lengths
    cached, so no call reads them back); the output is returned as ``[tokens, H, D]``."""

    has_backward = True

    def __init__(self, case, torch, backend):
        self.case, self.torch, self.backend = case, torch, backend
        self.name = f"torch-nested-{TORCH_BACKENDS[backend.name].removeprefix('torch-')}"
        self.offsets = torch.as_tensor(case.cu_seqlens.astype(np.int64), device="cuda")

    def context(self):
        return forced_backend(self.torch, self.backend)

    def _inputs(self, x):
        """Leaves ``[tokens, H, D]`` (through DLPack) and their nested ``[B, H, {S}, D]`` views."""
        c, nested = self.case, self.torch.nested
        leaves = [self.torch.from_dlpack(a).requires_grad_() for a in (x.q, x.k, x.v)]
        views = [nested.nested_tensor_from_jagged(a, self.offsets, min_seqlen=min(c.lengths),
                                                  max_seqlen=c.max_seqlen).transpose(1, 2)
                 for a in leaves]
        return leaves, views

    def _attention(self, q, k, v):
        out = self.torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                    is_causal=self.case.causal)
        return out.transpose(1, 2).values()

    def forward_call(self, x):
        _, (q, k, v) = self._inputs(x)
        return lambda: self._attention(q, k, v)

    def backward_call(self, x):
        leaves, views = self._inputs(x)
        out = self._attention(*views)
        dout = self.torch.from_dlpack(x.dout)
        return lambda: self.torch.autograd.grad(out, leaves, dout, retain_graph=True)


@functools.cache
def compiled_flex_attention(torch):
    """``torch.compile(flex_attention, dynamic=False)``, once a process, with room for a
    graph per head dim, mask and grad mode."""
    import torch._dynamo.config as config
    from torch.nn.attention.flex_attention import flex_attention

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), VARLEN_RECOMPILE_LIMIT))
            break
    return torch.compile(flex_attention, dynamic=False)


def document_mask_mod(document, causal):
    """flex_attention's mask: the same document and, when causal, ``q_idx >= kv_idx``
    (bottom-right and top-left alignment coincide, q and k lengths being equal)."""

    def same_document(b, h, q_idx, kv_idx):
        return document[q_idx] == document[kv_idx]

    def causal_same_document(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    return causal_same_document if causal else same_document


class TorchFlex:
    """Compiled ``flex_attention`` on ``[1, H, tokens, D]`` (contiguous copies, untimed) with
    a block mask of the document ids of the tokens (built once, untimed)."""

    name = "torch-flex"
    has_backward = True

    def __init__(self, case, torch):
        self.case, self.torch = case, torch

    def context(self):
        return torch_stream(self.torch)

    @functools.cached_property
    def block_mask(self):
        from torch.nn.attention.flex_attention import create_block_mask

        torch, c = self.torch, self.case
        lengths = torch.as_tensor(c.lengths, device="cuda")
        document = torch.repeat_interleave(
            torch.arange(c.batch, device="cuda", dtype=torch.int32), lengths)
        return create_block_mask(document_mask_mod(document, c.causal), None, None, c.tokens,
                                 c.tokens, device="cuda")

    def _heads_first(self, a):
        return self.torch.from_dlpack(a).unsqueeze(0).transpose(1, 2).contiguous()

    def _attention(self, q, k, v):
        return compiled_flex_attention(self.torch)(q, k, v, block_mask=self.block_mask)

    def forward_call(self, x):
        """A training-mode forward, its output viewed as ``[tokens, H, D]``."""
        q, k, v = (self._heads_first(a).requires_grad_() for a in (x.q, x.k, x.v))
        return lambda: self._attention(q, k, v)[0].transpose(0, 1)

    def backward_call(self, x):
        leaves = [self._heads_first(a).requires_grad_() for a in (x.q, x.k, x.v)]
        out = self._attention(*leaves)
        dout = self._heads_first(x.dout)
        return lambda: self.torch.autograd.grad(out, leaves, dout, retain_graph=True)


def varlen_record(case, measurement):
    """A JSON-ready record of one varlen table measurement (``measurement.case`` is the
    packed case, or the dense-equal :class:`Case`)."""
    measured = measurement.case
    dense = isinstance(measured, Case)
    record = {"kind": case.kind, "label": case.label, "dtype": case.dtype,
              "head_dim": case.head_dim, "heads": case.heads, "causal": case.causal,
              "tokens": case.tokens, "batch": measured.batch,
              "seqlen": measured.seqlen if dense else None,
              "max_seqlen": measured.seqlen if dense else case.max_seqlen,
              "impl": measurement.impl, "direction": measurement.direction,
              "flops": measured.flops(measurement.direction), "tflops": measurement.tflops,
              "note": measurement.note, "rel_error": measurement.rel_error, "median_s": None}
    if measurement.timing is not None:
        record.update(measurement.timing.summary())
    return record


def varlen_ratios(records):
    """cuflash varlen's TFLOP/s over each peer's, a record per case and direction."""
    by_key = {(r["kind"], r["head_dim"], r["causal"], r["direction"], r["impl"]): r
              for r in records}
    ratios = []
    for key in dict.fromkeys(k[:4] for k in by_key):
        mine = by_key.get((*key, VARLEN_IMPLS[0]), {}).get("tflops")
        ratio = {"kind": key[0], "head_dim": key[1], "causal": key[2], "direction": key[3]}
        for impl in VARLEN_IMPLS[1:]:
            theirs = by_key.get((*key, impl), {}).get("tflops")
            ratio[impl] = mine / theirs if mine is not None and theirs else None
        ratios.append(ratio)
    return ratios


def varlen_table(torch, budget, l2_bytes, cases=None):
    """The varlen table: cuflash varlen, torch nested (flash) and compiled flex_attention on
    the packed inputs of each case (their forward outputs checked against cuflash varlen's),
    and cuflash's dense kernels on the case's equal lengths."""
    cases = varlen_cases() if cases is None else cases
    peers = [] if torch is None else [
        functools.partial(TorchNestedSDPA, torch=torch, backend=backend)
        for backend in sdpa_backends(torch, ("FLASH_ATTENTION",))]
    peers += [] if torch is None else [functools.partial(TorchFlex, torch=torch)]
    left = len(cases) * 2 * (2 + len(peers))
    records = []
    bar = progress_bar(len(cases), "varlen cases")
    for case in cases:
        bar.set_postfix_str(f"{case.label} D={case.head_dim} causal={case.causal}")
        impls = [CuflashVarlen(case)] + [make(case) for make in peers]
        if budget.remaining() <= 0:
            records += [varlen_record(case, m) for impl in impls + [CuflashDenseEqual(
                case.dense_case)] for m in skipped(impl, "time budget exhausted")]
            bar.update(1)
            continue
        packed = make_packed_sets(case, sets_spanning_l2(
            4 * case.tokens * case.heads * case.head_dim * case.numpy_dtype.itemsize, l2_bytes))
        reference = None
        for impl in impls:
            if budget.remaining() <= 0:
                measurements = skipped(impl, "time budget exhausted")
            else:
                measurements = measure_implementation(impl, packed, budget.target_for(left),
                                                      reference)
                if impl.name == CuflashVarlen.name and measurements[0].timing is not None:
                    reference = forward_output(impl, packed[0])
            left -= 2
            records += [varlen_record(case, m) for m in measurements]
            free_memory(torch)
        del packed, reference
        free_memory(torch)
        dense = CuflashDenseEqual(case.dense_case)
        if budget.remaining() <= 0:
            measurements = skipped(dense, "time budget exhausted")
        else:
            sets = make_input_sets(dense.case, rotation_count(dense.case, l2_bytes))
            measurements = measure_implementation(dense, sets, budget.target_for(left), None)
            del sets
        left -= 2
        records += [varlen_record(case, m) for m in measurements]
        free_memory(torch)
        bar.update(1)
    bar.close()
    return records


def varlen_report(torch, budget, l2_bytes):
    """The JSON-ready varlen section: the lengths, every record and the ratios."""
    cases = varlen_cases()
    records = varlen_table(torch, budget, l2_bytes, cases)
    return {"lengths": {case.kind: list(case.lengths) for case in cases},
            "seed": VARLEN_SEED, "records": records, "ratios": varlen_ratios(records)}



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


def _ratio(measurement, peer):
    """cuflash's throughput over ``peer``'s (peer time / cuflash time), or None."""
    if measurement is None or peer is None or measurement.seconds is None \
            or peer.seconds is None:
        return None
    return peer.seconds / measurement.seconds


def _format_ratio(ratio):
    return "–" if ratio is None else f"{ratio:.2f}x"


def _case_label(case):
    return f"D={case.head_dim} S={case.seqlen}{' causal' if case.causal else ''}"


def format_head_dim_sweep_table(measurements, dtype, direction):
    """Head-dim sweep, one dtype and direction: TFLOP/s, cuflash / peer, cases below target."""
    rows = [m for m in measurements if m.case.dtype == dtype and m.direction == direction]
    impls = list(dict.fromkeys(m.impl for m in rows))
    peers = [impl for impl in impls if impl != CuflashAttention.name]
    by_key = {(m.case, m.impl): m for m in rows}
    cases = sorted({m.case for m in rows}, key=lambda c: (c.head_dim, c.causal, c.seqlen))
    target_peer, target_ratio = sweep_target(dtype)
    title = {"fwd": "forward", "bwd": "backward"}[direction]
    lines = [f"### Head-dim sweep, {title}, {dtype}: TFLOP/s and cuflash / peer "
             f"(target: cuflash / {target_peer} >= {target_ratio:g})", "",
             "| D | S | causal | B | H | " + " | ".join(impls) + " | "
             + " | ".join(f"cuflash / {peer}" for peer in peers) + " |",
             "|---|---|---|---|---|" + "---|" * (len(impls) + len(peers))]
    below, target_measured = [], False
    for case in cases:
        baseline = by_key.get((case, CuflashAttention.name))
        throughput = [by_key.get((case, impl)) for impl in impls]
        ratios = {peer: _ratio(baseline, by_key.get((case, peer))) for peer in peers}
        lines.append(f"| {case.head_dim} | {case.seqlen} | {case.causal} | {case.batch} | "
                     f"{case.heads} | "
                     + " | ".join("–" if m is None or m.tflops is None
                                  else _format_tflops(m.tflops) for m in throughput) + " | "
                     + " | ".join(_format_ratio(r) for r in ratios.values()) + " |")
        ratio = ratios.get(target_peer)
        target_measured = target_measured or ratio is not None
        if ratio is not None and ratio < target_ratio:
            below.append(f"{_case_label(case)} ({ratio:.2f}x)")
    if target_measured:
        lines += ["", f"Below target (cuflash / {target_peer} < {target_ratio:g}): "
                  + (", ".join(below) if below else "none") + "."]
    return "\n".join(lines + format_agreement(rows) + format_notes(rows))


def format_head_dim_sweep(records):
    """Every table of a head-dim sweep's JSON records."""
    measurements = [Measurement.from_dict(r) for r in records]
    return "\n\n".join(format_head_dim_sweep_table(measurements, dtype, direction)
                       for dtype in dict.fromkeys(m.case.dtype for m in measurements)
                       for direction in DIRECTIONS)


def _format_us(seconds):
    return "–" if seconds is None else f"{seconds * 1e6:.1f}"


def format_small_calls(record):
    """GPU time per call of the small cases (fwd, bwd, sum, ratio) and the host time table."""
    measurements = [Measurement.from_dict(r) for r in record["measurements"]]
    by_key = {(m.case, m.impl, m.direction): m for m in measurements}
    cases = list(dict.fromkeys(m.case for m in measurements))
    impls = list(dict.fromkeys(m.impl for m in measurements))

    def total(case, impl):
        seconds = [getattr(by_key.get((case, impl, d)), "seconds", None) for d in DIRECTIONS]
        return None if None in seconds else sum(seconds)

    lines = ["### Small calls, causal: time per call in us (median of CUDA events around "
             "back-to-back calls: the GPU's time, or the host's where that is longer)", "",
             "| dtype | B | H | S | D | impl | fwd | bwd | fwd+bwd | peer / cuflash (fwd+bwd) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    below = []
    for case in cases:
        mine = total(case, CuflashAttention.name)
        for impl in impls:
            fwd, bwd = (getattr(by_key.get((case, impl, d)), "seconds", None)
                        for d in DIRECTIONS)
            theirs = total(case, impl)
            ratio = None if impl == CuflashAttention.name or mine is None or theirs is None \
                else theirs / mine
            lines.append(f"| {case.dtype} | {case.batch} | {case.heads} | {case.seqlen} | "
                         f"{case.head_dim} | {impl} | {_format_us(fwd)} | {_format_us(bwd)} | "
                         f"{_format_us(theirs)} | {_format_ratio(ratio)} |")
            if impl == SMALL_CALL_TARGET_PEER and ratio is not None and ratio < 1:
                below.append(f"B={case.batch} H={case.heads} S={case.seqlen} D={case.head_dim} "
                             f"({ratio:.2f}x)")
    lines += ["", f"Target: cuflash fwd+bwd <= {SMALL_CALL_TARGET_PEER}'s (ratio >= 1). "
              f"Below target: {', '.join(below) if below else 'none'}."]
    lines += format_notes(measurements)
    if record.get("host_time"):
        lines += ["", format_host_time(record["host_time"])]
    return "\n".join(lines)


def format_host_time(records):
    """Host microseconds per call, forward and backward, with cuflash's targets."""
    first = records[0]
    by_key = {(r["impl"], r["direction"]): r for r in records}
    impls = list(dict.fromkeys(r["impl"] for r in records))
    lines = [f"### Host time per call in us: wall time of {first['calls']} back-to-back calls "
             f"(B={first['batch']} H={first['heads']} S={first['seqlen']} D={first['head_dim']} "
             f"{first['dtype']}{' causal' if first['causal'] else ''}; cuflash's backward with "
             "synchronize=False)", "", "| impl | fwd | bwd |", "|---|---|---|"]
    verdicts = []
    for impl in impls:
        cells = []
        for direction in DIRECTIONS:
            r = by_key.get((impl, direction))
            cells.append("–" if r is None or r["us_per_call"] is None
                         else f"{r['us_per_call']:.1f}")
            if impl == CuflashAttention.name and r is not None and r["us_per_call"] is not None:
                target = HOST_TIME_TARGET_US[direction]
                verdicts.append(f"{direction} <= {target:g} us "
                                f"({'met' if r['us_per_call'] <= target else 'missed'})")
        lines.append(f"| {impl} | " + " | ".join(cells) + " |")
    if verdicts:
        lines += ["", "cuflash's targets: " + ", ".join(verdicts) + "."]
    failed = [f"- {r['impl']} {r['direction']}: {r['note']}" for r in records
              if r["us_per_call"] is None]
    return "\n".join(lines + (["", "Not measured (–):", ""] + failed if failed else []))


def format_decode(record):
    """The decode table: time, cache bytes per second, torch's times and the ratio."""
    title = ("### Decoding from a KV cache (forward time in us; TB/s = cache bytes read / "
             "cuflash time)")
    if not record.get("records"):
        return f"{title}\n\nNot measured: {record.get('note') or 'no cases'}."
    records = record["records"]
    peers = list(dict.fromkeys(r["impl"] for r in records if r["impl"] != "cuflash"))
    torch_by_group = {}
    for r in records:
        if r["impl"] != "cuflash":
            torch_by_group[(r["batch"], r["cache_len"], r["q_len"], r["impl"])] = r
    first = records[0]
    lines = [title, "",
             f"{first['dtype']}, D={first['head_dim']}, H={first['heads']}, "
             f"H_kv={first['kv_heads']}, causal (bottom-right); torch SDPA on a contiguous "
             "cache of the same keys and values, without a mask at S_q = 1 (every key "
             "visible), with `causal_lower_right(S_q, L)` above.", "",
             "| B | cache | S_q | layout | cuflash | TB/s | " + " | ".join(peers)
             + " | faster torch / cuflash |", "|---|---|---|---|---|---|" + "---|" * len(peers)
             + "---|"]
    below = []
    for r in (r for r in records if r["impl"] == "cuflash"):
        mine = r["median_s"]
        theirs = [torch_by_group.get((r["batch"], r["cache_len"], r["q_len"], peer), {})
                  .get("median_s") for peer in peers]
        measured = [t for t in theirs if t is not None]
        ratio = min(measured) / mine if measured and mine is not None else None
        rate = None if mine is None else r["cache_bytes"] / mine / 1e12
        lines.append(f"| {r['batch']} | {r['cache_len']} | {r['q_len']} | {r['layout']} | "
                     f"{_format_us(mine)} | {'–' if rate is None else f'{rate:.2f}'} | "
                     + " | ".join(_format_us(t) for t in theirs)
                     + f" | {_format_ratio(ratio)} |")
        misses = [f"{ratio:.2f}x"] if ratio is not None and ratio < 1 else []
        if rate is not None and r["q_len"] == 1 and r["cache_bytes"] >= DECODE_TARGET_MIN_BYTES \
                and rate < DECODE_TARGET_TB_PER_S:
            misses.append(f"{rate:.2f} TB/s")
        if misses:
            below.append(f"B={r['batch']} cache {r['cache_len']} S_q={r['q_len']} {r['layout']} "
                         f"({', '.join(misses)})")
    lines += ["", "Targets: cuflash time <= the faster torch backend's (ratio >= 1); "
              f">= {DECODE_TARGET_TB_PER_S:g} TB/s where the cache is >= "
              f"{DECODE_TARGET_MIN_BYTES / 1e6:.0f} MB. Below target: "
              + (", ".join(below) if below else "none") + "."]
    modes = {}
    for r in records:
        if r.get("gqa"):
            modes.setdefault(r["impl"], {}).setdefault(r["gqa"], 0)
            modes[r["impl"]][r["gqa"]] += 1
    if modes:
        lines += ["", "torch's grouped-query attention: " + "; ".join(
            f"{impl} " + ", ".join(f"{mode} ({count} case{'s' if count > 1 else ''})"
                                   for mode, count in by_mode.items())
            for impl, by_mode in modes.items()) + "."]
    errors = {}
    for r in records:
        if r["rel_error"] is not None:
            key = f"{r['impl']} {r['layout']}" if r["impl"] == "cuflash" else r["impl"]
            errors[key] = max(errors.get(key, 0.0), r["rel_error"])
    if errors:
        lines += ["", "Largest relative L2 distance of an output from the first of its keys "
                  "and values (cuflash contiguous where it ran): "
                  + ", ".join(f"{key} {error:.1e}" for key, error in errors.items())]
    notes = {}
    for r in records:
        if r["median_s"] is None:
            notes[(r["impl"], r["note"])] = notes.get((r["impl"], r["note"]), 0) + 1
    if notes:
        lines += ["", "Not measured (–):", ""] + [
            f"- {impl}: {note} ({count} case{'s' if count > 1 else ''})"
            for (impl, note), count in notes.items()]
    return "\n".join(lines)


def _count_cases(count):
    return f"{count} case{'s' if count > 1 else ''}"


def format_varlen_intro(record):
    """The lines above the varlen tables: the problem, the lengths, the peers."""
    records = record["records"]
    first = records[0]
    heads = ", ".join(f"{h} at D = {d}" for d, h in sorted(
        {(r["head_dim"], r["heads"]) for r in records}))
    lines = [f"{first['dtype']}, {first['tokens']} tokens packed, H = {HIDDEN} / D ({heads}), "
             "causal and not."]
    dense = {r["kind"]: (r["batch"], r["seqlen"]) for r in records
             if r["impl"] == CuflashDenseEqual.name}
    for kind, lengths in record.get("lengths", {}).items():
        shape = dense.get(kind)
        dense_text = "" if shape is None else f"; dense-equal B={shape[0]} S={shape[1]}"
        if kind == "uniform":
            low, high = VARLEN_LENGTH_RANGE
            lines.append(f"Uniform: {len(lengths)} sequences, lengths drawn uniformly from "
                         f"{low}..{high} (seed {record.get('seed')}, the last trimmed): "
                         f"{', '.join(map(str, lengths))}; mean "
                         f"{sum(lengths) / len(lengths):.1f}{dense_text}.")
        else:
            lines.append(f"Equal: {len(lengths)} x {lengths[0]}{dense_text}.")
    lines.append("TFLOP/s count only the work inside each sequence (causal: half of its "
                 "square), summed over the sequences. cuflash-dense-equal: the dense kernels "
                 "on equal lengths of the batch's mean (rounded to a multiple of "
                 f"{VARLEN_DENSE_MULTIPLE}), its own FLOPs. torch-nested-flash: SDPA with the "
                 "flash backend forced on nested jagged tensors; torch-flex: torch.compile'd "
                 "flex_attention with a document mask (block mask built once, untimed).")
    return lines


def format_varlen_table(records, direction):
    """One direction of the varlen table: TFLOP/s, cuflash varlen / each peer, the target."""
    rows = [r for r in records if r["direction"] == direction]
    impls = [impl for impl in VARLEN_IMPLS if any(r["impl"] == impl for r in rows)]
    peers = impls[1:]
    by_key = {(r["kind"], r["head_dim"], r["causal"], r["impl"]): r for r in rows}
    ratios = {(r["kind"], r["head_dim"], r["causal"]): r
              for r in varlen_ratios(rows)}
    target_peer, target_ratio = VARLEN_TARGET
    title = {"fwd": "forward", "bwd": "backward"}[direction]
    lines = [f"#### {title.capitalize()}: TFLOP/s and cuflash-varlen / peer (target: "
             f"cuflash-varlen / {target_peer} >= {target_ratio:g})", "",
             "| lengths | D | H | causal | dense B x S | " + " | ".join(impls) + " | "
             + " | ".join(f"varlen / {peer}" for peer in peers) + " |",
             "|---|---|---|---|---|" + "---|" * (len(impls) + len(peers))]
    below, target_measured = [], False
    for key, ratio in ratios.items():
        cells = [by_key.get((*key, impl), {}).get("tflops") for impl in impls]
        dense = by_key.get((*key, CuflashDenseEqual.name))
        first = next(r for r in rows if (r["kind"], r["head_dim"], r["causal"]) == key)
        lines.append(f"| {first['label']} | {key[1]} | {first['heads']} | {key[2]} | "
                     + ("–" if dense is None else f"{dense['batch']} x {dense['seqlen']}")
                     + " | " + " | ".join("–" if t is None else _format_tflops(t)
                                          for t in cells) + " | "
                     + " | ".join(_format_ratio(ratio.get(peer)) for peer in peers) + " |")
        value = ratio.get(target_peer)
        target_measured = target_measured or value is not None
        if value is not None and value < target_ratio:
            below.append(f"{first['label']} D={key[1]}{' causal' if key[2] else ''} "
                         f"({value:.2f}x)")
    if target_measured:
        lines += ["", f"Below target (cuflash-varlen / {target_peer} < {target_ratio:g}): "
                  + (", ".join(below) if below else "none") + "."]
    errors = {}
    for r in rows:
        if r["rel_error"] is not None:
            errors[r["impl"]] = max(errors.get(r["impl"], 0.0), r["rel_error"])
    if errors:
        lines += ["", "Largest relative L2 distance of a forward output from cuflash-varlen's: "
                  + ", ".join(f"{impl} {error:.1e}" for impl, error in errors.items())]
    notes = {}
    for r in rows:
        if r["median_s"] is None:
            notes[(r["impl"], r["note"])] = notes.get((r["impl"], r["note"]), 0) + 1
    if notes:
        lines += ["", "Not measured (–):", ""] + [
            f"- {impl}: {note} ({_count_cases(count)})" for (impl, note), count in notes.items()]
    return "\n".join(lines)


def format_varlen(record):
    """The packed variable-length tables (forward, backward) of a report's varlen section."""
    title = "### Packed variable-length batch (SPEC section 7)"
    if not record.get("records"):
        return f"{title}\n\nNot measured: {record.get('note') or 'no cases'}."
    return "\n\n".join([title, "\n".join(format_varlen_intro(record))]
                       + [format_varlen_table(record["records"], d) for d in DIRECTIONS])


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
    if report.get("small_calls"):
        parts += ["", format_small_calls(report["small_calls"])]
    if report.get("decode"):
        parts += ["", format_decode(report["decode"])]
    if report.get("varlen"):
        parts += ["", format_varlen(report["varlen"])]
    if report.get("head_dim_sweep"):
        parts += ["", format_head_dim_sweep(report["head_dim_sweep"])]
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


def add_peer_options(parser):
    """The options of the benchmarks that time cuflash next to ``flex_attention``:
    ``--no-torch``, ``--time``, ``--json``."""
    parser.add_argument("--no-torch", action="store_true", help="cuflash only")
    parser.add_argument("--time", type=float, default=0.5, help="seconds a measurement")
    parser.add_argument("--json", default=None)


def no_gpu_to_measure():
    """True (printing why) when there is no GPU to time on."""
    reason = gpu_unavailable_reason()
    if reason is not None:
        print(f"nothing to measure: {reason}")
    return reason is not None


def flex_peer_torch(enabled):
    """torch for a ``flex_attention`` peer, or None (printing why it is left out)."""
    torch, note = import_torch(enabled)
    if torch is None:
        print(f"flex_attention left out: {note}")
    return torch


def print_report(title, table_text, records, json_path=None):
    """Print a benchmark's title and table; write its records to ``json_path`` if given."""
    print(title)
    print(table_text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)


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
    parser.add_argument("--head-dim-sweep", action="store_true",
                        help="instead of the grid: every head dim 32..256 (float32: 32..256 "
                             "in six steps), S 1024/4096, causal and not, against torch flash "
                             "and cuDNN (float32: efficient); --dtype, --head-dims and "
                             "--seqlens narrow it (default dtypes bfloat16,float16,float32)")
    parser.add_argument("--small-calls", action="store_true",
                        help="instead of the grid: GPU time per call of three small causal "
                             "bfloat16 cases, and host time per call of a tiny one")
    parser.add_argument("--decode", action="store_true",
                        help="instead of the grid: decoding from a KV cache (contiguous and "
                             "paged) with flash_attention_with_kvcache against torch SDPA")
    parser.add_argument("--varlen", action="store_true",
                        help="instead of the grid: a packed batch of 16384 tokens (lengths "
                             "uniform in 64..4096, and 8 x 2048), bfloat16, D 64/128, causal "
                             "and not: cuflash varlen against the dense kernels on equal "
                             "lengths, torch SDPA (flash) on nested tensors and flex_attention")
    parser.add_argument("--json", type=Path, help="write the full report as JSON here")
    parser.add_argument("--plots", type=Path, help="write PNG plots into this directory")
    parser.add_argument("--from-json", type=Path,
                        help="no measuring: the tables and plots of this saved report")
    args = parser.parse_args(argv)
    quick = args.quick
    args.modes = tuple(mode for mode in MODE_TIME_BUDGETS if getattr(args, mode))
    args.sweep_cases = head_dim_sweep_cases(args.dtypes or SWEEP_DTYPES, args.head_dims,
                                            args.seqlens) if args.head_dim_sweep else []
    args.dtypes = args.dtypes or (QUICK_DTYPES if quick else DEFAULT_DTYPES)
    args.head_dims = args.head_dims or (QUICK_HEAD_DIMS if quick else DEFAULT_HEAD_DIMS)
    args.seqlens = args.seqlens or (QUICK_SEQLENS if quick else DEFAULT_SEQLENS)
    grid_budget = QUICK_TIME_BUDGET if quick else DEFAULT_TIME_BUDGET
    args.time_budget = args.time_budget or (
        sum(MODE_TIME_BUDGETS[mode] for mode in args.modes) if args.modes else grid_budget)
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
                if key not in ("json", "plots", "from_json", "sweep_cases")}
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
    if args.small_calls:
        _status("small calls")
        report["small_calls"] = small_call_sweep(torch, budget, env["l2_bytes"])
    if args.decode:
        function, note = kvcache_function()
        _status("decode table" if function else f"no decode table: {note}")
        report["decode"] = {"note": note, "records": [] if function is None else decode_table(
            function, torch, budget, env["l2_bytes"])}
    if args.varlen:
        _status("packed variable-length table")
        report["varlen"] = varlen_report(torch, budget, env["l2_bytes"])
    if args.head_dim_sweep:
        _status(f"head-dim sweep, {len(args.sweep_cases)} cases")
        report["head_dim_sweep"] = [m.to_dict() for m in head_dim_sweep(
            args.sweep_cases, torch, args.allow_tf32, budget, env["l2_bytes"])]
    measurements = []
    if not args.modes:
        cases = build_grid(args.dtypes, args.head_dims, args.seqlens)
        factories = implementation_factories(torch, args.allow_tf32)
        measurements = run_grid(cases, lambda case: factories, budget, env["l2_bytes"], torch)
    report["measurements"] = [m.to_dict() for m in measurements]
    report["elapsed_s"] = args.time_budget - budget.remaining()
    _status(f"measured for {report['elapsed_s']:.0f} s")
    return report, measurements


def main(argv=None):
    """Entry point of ``python -m cuflash.bench``; returns the exit status."""
    args = parse_args(argv)
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        measurements = [Measurement.from_dict(r) for r in report.get("measurements", [])]
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
