"""First-call cost of one kernel variant: compiled with an empty CuPy kernel cache, then
loaded from a warm one, each in a fresh process."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..api import flash_attention_bwd, flash_attention_fwd
from ..gpu import kernel_build, plans
from .cases import Case, make_input_sets
from .environment import cupy

PROBE_SEQLEN = 256
PROBE_TIMEOUT = 120  # seconds for one first-call process, within the time budget


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
    kernel_build.forget_loaded()
    plans.clear()
    case = Case(dtype, head_dim, PROBE_SEQLEN, False, batch=1, heads=1)
    x = make_input_sets(case, 1)[0]
    cupy.cuda.Device().synchronize()
    args = (1, 1, head_dim)
    (out, lse), fwd_first = _synchronized_seconds(lambda: flash_attention_fwd(x.q, x.k, x.v, *args))
    _, bwd_first = _synchronized_seconds(
        lambda: flash_attention_bwd(x.dout, x.q, x.k, x.v, out, lse, *args)
    )
    _, fwd_second = _synchronized_seconds(lambda: flash_attention_fwd(x.q, x.k, x.v, *args))
    print(
        json.dumps({"fwd_first_s": fwd_first, "bwd_first_s": bwd_first, "fwd_second_s": fwd_second})
    )


def _run_probe(dtype, head_dim, env, timeout):
    """Run :func:`first_call_probe` in a new Python process; its JSON or an error."""
    code = f"from cuflash.bench import first_call_probe; first_call_probe({dtype!r}, {head_dim})"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {
            "error": (done.stderr or done.stdout).strip()[-2000:]
            or f"exit status {done.returncode}"
        }


def measure_first_call(dtype, head_dim, budget):
    """First-call cost of the (dtype, head_dim) variant, cold then with CuPy's cache warm.

    Both runs are new processes sharing a fresh ``CUPY_CACHE_DIR``: the first
    compiles through NVRTC, the second loads the cached binary. Each may take
    ``PROBE_TIMEOUT`` seconds, or half the remaining budget if that is less.
    """
    package_root = str(Path(__file__).resolve().parents[2])
    python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="cuflash-bench-cupy-cache-") as cache_dir:
        env = {**os.environ, "CUPY_CACHE_DIR": cache_dir, "PYTHONPATH": python_path}
        cold = _run_probe(dtype, head_dim, env, min(PROBE_TIMEOUT, budget.remaining() / 2))
        warm = _run_probe(dtype, head_dim, env, min(PROBE_TIMEOUT, budget.remaining() / 2))
    return {"dtype": dtype, "head_dim": head_dim, "cold": cold, "warm_cache": warm}


def format_first_call(record):
    """A Markdown table of the first-call cost, or its errors."""
    lines = [
        f"### First call of the {record['dtype']}, D={record['head_dim']} variant (wall seconds)",
        "",
        "| CuPy kernel cache | first fwd | first bwd | second fwd |",
        "|---|---|---|---|",
    ]
    for label, key in (("empty (compile)", "cold"), ("warm", "warm_cache")):
        run = record[key]
        if "error" in run:
            lines.append(f"| {label} | error: {run['error'].splitlines()[-1][:200]} | | |")
        else:
            lines.append(
                f"| {label} | {run['fwd_first_s']:.2f} | {run['bwd_first_s']:.3f} | "
                f"{run['fwd_second_s']:.4f} |"
            )
    return "\n".join(lines)
