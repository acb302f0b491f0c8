"""Side-by-side benchmark: cuflash against PyTorch SDPA and naive CuPy attention.

Usage::

    python -m cuflash.bench [--quick] [--dtype bfloat16,float16] [--head-dims 64,128,256]
                            [--seqlens 512,...,16384] [--no-torch] [--no-first-call]
                            [--no-memory] [--allow-tf32] [--time-budget SECONDS]
                            [--json PATH] [--plots DIR]
    python -m cuflash.bench [--head-dim-sweep] [--small-calls] [--decode] [--varlen]
                            [--head-dim-v] [--mla-decode] [--fp8] [options above]
    python -m cuflash.bench --from-json PATH [--plots DIR]

Every case has ``B * S = 16384`` tokens and ``H = 2048 / D`` heads. For each
case, on the same inputs in one process, it times cuflash's forward and
backward, PyTorch's ``scaled_dot_product_attention`` with each backend forced
through ``torch.nn.attention.sdpa_kernel`` (when torch is importable) and
naive CuPy attention (float32 matmul, softmax, matmul; forward only). Inputs
reach torch through DLPack without copies.

Timing: CUDA events around every call after a warm-up, the median of many
calls, rotating among several input sets so that no call finds its inputs
in the L2 cache. TFLOP/s follow the Performance page's convention: forward ``4*B*H*S*S*D``,
halved when causal; backward 2.5 times that.

Instead of the grid, any of six other tables (each with torch's peers on
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
  paged caches (the KV-cache page): time, cache bytes read per second, torch
  flash and cuDNN on a contiguous cache of the same keys and values; and a
  step appending one token with and without rotary tables (B = 64, 4096 keys,
  contiguous and paged 16), the tables' cost against its 5 % target.
- ``--varlen``: a packed batch of 16384 tokens (the Packed batches page), lengths
  uniform in 64..4096 (fixed seed, the last trimmed) and 8 x 2048, bfloat16,
  ``H = 2048 / D`` for D 64 and 128, causal and not: TFLOP/s (work inside the
  sequences only) of ``flash_attention_varlen_fwd`` / ``_bwd``, of the dense
  kernels on equal lengths of the batch's mean, of torch SDPA (flash) on a
  nested jagged tensor and of compiled ``flex_attention`` with a document
  mask, and cuflash varlen's ratio to each.
- ``--head-dim-v``: the MLA training shape (bfloat16, H = 16, D = 192, v head dim
  128, S = 4096, causal, B * S = 16384) with ``head_dim_v``, against the same call
  with v (and dout, out) padded to 192 columns by the caller, forward and backward
  (cuflash only).
- ``--mla-decode``: absorbed-MLA decoding (bfloat16, one KV head of 576 whose first
  512 columns are the values, one new query row of 16 or 128 query heads, L = 4096
  and 16384, B = 32 and 128): the latent cache's TB/s and the products' TFLOP/s
  (cuflash only: no torch backend takes the shape).
- ``--fp8``: the FP8 (e4m3) forward (the FP8 page) on the grid's shapes, D 64 and
  128, S 1024 and 4096 (or ``--head-dims``, ``--seqlens``), causal and not, bfloat16
  out, against the bfloat16 forward on the same shapes and cuDNN's FP8 attention when
  ``nvidia-cudnn-frontend`` provides it (``cuflash.bench.fp8.cudnn_fp8_peer``).

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
import json
import sys
from pathlib import Path

from ..kvcache import flash_attention_with_kvcache
from .cases import DTYPES, HIDDEN, TOKENS, build_grid
from .decode import decode_table
from .dense import (
    DEFAULT_DTYPES,
    DEFAULT_HEAD_DIMS,
    DEFAULT_SEQLENS,
    QUICK_DTYPES,
    QUICK_HEAD_DIMS,
    QUICK_SEQLENS,
)
from .environment import environment, gpu_unavailable_reason, import_torch
from .first_call import measure_first_call
from .fp8 import FP8_HEAD_DIMS, FP8_SEQLENS, fp8_cases, fp8_report
from .head_dims import SWEEP_DTYPES, head_dim_sweep, head_dim_sweep_cases
from .implementations import implementation_factories
from .measure import Measurement, run_grid
from .memory import MEMORY_SEQLENS, QUICK_MEMORY_SEQLENS, memory_sweep
from .mla_decode import mla_decode_report
from .plots import plot_memory, plot_throughput
from .progress import print_status
from .report import format_report
from .small_calls import small_call_sweep
from .timing import QUICK_TARGET_SECONDS, TARGET_SECONDS, Budget, warm_up_gpu
from .value_dims import value_dim_report
from .varlen import varlen_report

DEFAULT_TIME_BUDGET = 540.0
QUICK_TIME_BUDGET = 180.0

# Default --time-budget of each measured part; a run's default is the sum of its parts.
MODE_TIME_BUDGETS = {
    "head_dim_sweep": 1500.0,
    "small_calls": 60.0,
    "decode": 120.0,
    "varlen": 300.0,
    "head_dim_v": 60.0,
    "mla_decode": 60.0,
    "fp8": 120.0,
}

NO_GPU_MESSAGE = (
    "cuflash.bench: no CUDA GPU is available ({}); nothing was timed. "
    "Run this command on a machine with an NVIDIA GPU."
)


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
        prog="python -m cuflash.bench",
        description=__doc__.splitlines()[0],
        epilog="Methodology: docs/performance.md",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small grid (bfloat16, D 64/128, S 512/2048) for smoke runs",
    )
    parser.add_argument(
        "--dtype",
        dest="dtypes",
        type=_list_of(_dtype_name),
        help="comma-separated dtypes (default bfloat16,float16; "
        "float32 is best run as its own table)",
    )
    parser.add_argument(
        "--head-dims", type=_list_of(int), help="comma-separated head dims (default 64,128,256)"
    )
    parser.add_argument(
        "--seqlens",
        type=_list_of(int),
        help="comma-separated sequence lengths (default 512,...,16384)",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch SDPA")
    parser.add_argument(
        "--no-first-call", action="store_true", help="skip the first-call (compile) measurement"
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the peak-memory sweep up to S=131072"
    )
    parser.add_argument(
        "--allow-tf32",
        action="store_true",
        help="run cuflash with allow_tf32=True (float32 products in TF32)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        help=f"seconds for the whole run (default {DEFAULT_TIME_BUDGET:.0f}, "
        f"quick {QUICK_TIME_BUDGET:.0f}); repeats shrink to fit and "
        "cases past it are reported as not run",
    )
    parser.add_argument(
        "--head-dim-sweep",
        action="store_true",
        help="instead of the grid: every head dim 32..256 (float32: 32..256 "
        "in six steps), S 1024/4096, causal and not, against torch flash "
        "and cuDNN (float32: efficient); --dtype, --head-dims and "
        "--seqlens narrow it (default dtypes bfloat16,float16,float32)",
    )
    parser.add_argument(
        "--small-calls",
        action="store_true",
        help="instead of the grid: GPU time per call of three small causal "
        "bfloat16 cases, and host time per call of a tiny one",
    )
    parser.add_argument(
        "--decode",
        action="store_true",
        help="instead of the grid: decoding from a KV cache (contiguous and "
        "paged) with flash_attention_with_kvcache against torch SDPA",
    )
    parser.add_argument(
        "--varlen",
        action="store_true",
        help="instead of the grid: a packed batch of 16384 tokens (lengths "
        "uniform in 64..4096, and 8 x 2048), bfloat16, D 64/128, causal "
        "and not: cuflash varlen against the dense kernels on equal "
        "lengths, torch SDPA (flash) on nested tensors and flex_attention",
    )
    parser.add_argument(
        "--head-dim-v",
        action="store_true",
        help="instead of the grid: the MLA training shape (bfloat16, D 192, v head dim "
        "128, S 4096, causal) with head_dim_v against v padded to 192",
    )
    parser.add_argument(
        "--mla-decode",
        action="store_true",
        help="instead of the grid: absorbed-MLA decoding (bfloat16, one KV head of 576 "
        "whose first 512 columns are the values, 16 and 128 query heads, L 4096 and "
        "16384, B 32 and 128): the cache's TB/s and TFLOP/s",
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="instead of the grid: the FP8 (e4m3) forward, D 64/128, S 1024/4096, causal "
        "and not, against the bfloat16 forward and cuDNN FP8 (when installed)",
    )
    parser.add_argument("--json", type=Path, help="write the full report as JSON here")
    parser.add_argument("--plots", type=Path, help="write PNG plots into this directory")
    parser.add_argument(
        "--from-json", type=Path, help="no measuring: the tables and plots of this saved report"
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.modes = tuple(mode for mode in MODE_TIME_BUDGETS if getattr(args, mode))
    args.sweep_cases = (
        head_dim_sweep_cases(args.dtypes or SWEEP_DTYPES, args.head_dims, args.seqlens)
        if args.head_dim_sweep
        else []
    )
    args.fp8_cases = (
        fp8_cases(args.head_dims or FP8_HEAD_DIMS, args.seqlens or FP8_SEQLENS) if args.fp8 else []
    )
    args.dtypes = args.dtypes or (QUICK_DTYPES if quick else DEFAULT_DTYPES)
    args.head_dims = args.head_dims or (QUICK_HEAD_DIMS if quick else DEFAULT_HEAD_DIMS)
    args.seqlens = args.seqlens or (QUICK_SEQLENS if quick else DEFAULT_SEQLENS)
    grid_budget = QUICK_TIME_BUDGET if quick else DEFAULT_TIME_BUDGET
    args.time_budget = args.time_budget or (
        sum(MODE_TIME_BUDGETS[mode] for mode in args.modes) if args.modes else grid_budget
    )
    args.target_seconds = QUICK_TARGET_SECONDS if quick else TARGET_SECONDS
    args.memory_seqlens = QUICK_MEMORY_SEQLENS if quick else MEMORY_SEQLENS
    return args


def run(args):
    """Measure everything ``args`` asks for; return the JSON-ready report and Measurements."""
    torch, torch_note = import_torch(not args.no_torch)
    env = environment(torch)
    settings = {
        key: value
        for key, value in vars(args).items()
        if key not in ("json", "plots", "from_json", "sweep_cases", "fp8_cases")
    }
    settings.update(
        torch=torch_note,
        tokens=TOKENS,
        hidden=HIDDEN,
        flop_convention="fwd 4*B*H*S*S*D (halved when causal), bwd 2.5x fwd",
    )
    report = {"environment": env, "settings": settings}
    budget = Budget(args.time_budget, args.target_seconds)
    warm_up_gpu()
    if not args.no_first_call:
        head_dim = 128 if 128 in args.head_dims else args.head_dims[0]
        print_status(f"first-call cost of the {args.dtypes[0]}, D={head_dim} variant")
        report["first_call"] = measure_first_call(args.dtypes[0], head_dim, budget)
    if not args.no_memory:
        print_status("peak memory against S")
        report["memory"] = memory_sweep(args.dtypes[0], args.memory_seqlens, budget)
    if args.small_calls:
        print_status("small calls")
        report["small_calls"] = small_call_sweep(torch, budget, env["l2_bytes"])
    if args.decode:
        print_status("decode table")
        report["decode"] = {
            "note": "",
            "records": decode_table(flash_attention_with_kvcache, torch, budget, env["l2_bytes"]),
        }
    if args.varlen:
        print_status("packed variable-length table")
        report["varlen"] = varlen_report(torch, budget, env["l2_bytes"])
    if args.head_dim_v:
        print_status("head_dim_v: the MLA training shape")
        report["head_dim_v"] = value_dim_report(budget, env["l2_bytes"], torch=torch)
    if args.mla_decode:
        print_status("absorbed-MLA decoding")
        report["mla_decode"] = mla_decode_report(budget)
    if args.fp8:
        print_status("FP8 forward")
        report["fp8"] = fp8_report(budget, env["l2_bytes"], args.fp8_cases)
    if args.head_dim_sweep:
        print_status(f"head-dim sweep, {len(args.sweep_cases)} cases")
        report["head_dim_sweep"] = [
            m.to_dict()
            for m in head_dim_sweep(
                args.sweep_cases, torch, args.allow_tf32, budget, env["l2_bytes"]
            )
        ]
    measurements = []
    if not args.modes:
        cases = build_grid(args.dtypes, args.head_dims, args.seqlens)
        factories = implementation_factories(torch, args.allow_tf32)
        measurements = run_grid(cases, lambda case: factories, budget, env["l2_bytes"], torch)
    report["measurements"] = [m.to_dict() for m in measurements]
    report["elapsed_s"] = args.time_budget - budget.remaining()
    print_status(f"measured for {report['elapsed_s']:.0f} s")
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
        print_status(f"wrote {args.json}")
    if args.plots:
        written = plot_throughput(measurements, args.plots)
        written.append(plot_memory(report.get("memory"), args.plots))
        print_status("wrote " + ", ".join(str(p) for p in written if p is not None))
    return 0
