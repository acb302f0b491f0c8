"""Host time per call on a tiny problem, and where it goes (cProfile).

Usage: python scripts/profile_host.py [--calls 1000] [--profile] [--parts] [--import-torch]
       python scripts/profile_host.py --against TREE [--rounds 6] [--calls 3000]

Times ``flash_attention_fwd`` and ``flash_attention_bwd(..., synchronize=False)`` on
the host: calls run in batches of ``BATCH``, the clock stops before the stream is
synchronized, so the time is the host's even where the GPU's work of the tiny problem
takes longer (a full launch queue would otherwise make every launch wait for the GPU).
The back-to-back time per call (the host's or the GPU's, whichever is longer) is
printed next to it. ``--profile`` prints the functions that take the most time under
cProfile, the forward's and the backward's apart; ``--parts`` times the pieces of a
cached call. ``--against TREE`` compares this tree's host time with another tree's
(a directory holding an older ``cuflash`` package, e.g. from ``git archive REV
cuflash``): each round runs the timing once in a fresh process of each tree, in turn,
so that both see the machine in the same state; the medians over the rounds are
printed.
"""

import argparse
import cProfile
import os
import pstats
import re
import statistics
import subprocess
import sys
import time

import cupy
import ml_dtypes
import numpy as np

import cuflash

BATCH = 50  # calls between synchronizations: their launches fit the launch queue


def tiny_inputs(dtype=ml_dtypes.bfloat16, batch=1, heads=1, seq_len=16, head_dim=64):
    rng = np.random.default_rng(0)
    shape = (batch, heads, seq_len, head_dim)
    return [cupy.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(4)]


def tiny_calls(**kw):
    """The forward and the backward call of the tiny problem, each run once."""
    q, k, v, dout = tiny_inputs(**kw)
    heads, head_dim = q.shape[1], q.shape[3]
    args = (heads, heads, head_dim, True)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *args)
    cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *args, synchronize=False)
    cupy.cuda.get_current_stream().synchronize()
    return (
        lambda: cuflash.flash_attention_fwd(q, k, v, *args),
        lambda: cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *args, synchronize=False),
    )


def timed(fn, calls):
    """``(host, back_to_back)`` microseconds per call of ``fn`` over ``calls`` calls."""
    stream = cupy.cuda.get_current_stream()
    host = 0.0
    for _ in range(max(1, calls // BATCH)):
        start = time.perf_counter()
        for _ in range(BATCH):
            fn()
        host += time.perf_counter() - start
        stream.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    stream.synchronize()
    back_to_back = time.perf_counter() - start
    runs = max(1, calls // BATCH) * BATCH
    return host / runs * 1e6, back_to_back / calls * 1e6


def primitive_costs(calls):
    """Microseconds per call of the host-side pieces a cached call is made of."""
    from cuflash.gpu import plans  # this tree's layout only (--against runs older ones)

    q, k, v, _ = tiny_inputs()
    seen = []
    signature = plans.signature

    def recording(arrays, scalars):  # the forward's own key arguments
        seen.append((arrays, scalars))
        return signature(arrays, scalars)

    plans.signature = recording
    try:
        cuflash.flash_attention_fwd(q, k, v, 1, 1, 64, True)
    finally:
        plans.signature = signature
    arrays, scalars = seen[0]
    plan = plans.get(signature(arrays, scalars))
    if plan is None:
        raise RuntimeError("the forward's plan is not cached")

    def per_call(fn):
        fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    costs = {
        "signature": per_call(lambda: signature(arrays, scalars)),
        "plans.get": per_call(lambda: plans.get(signature(arrays, scalars))),
        "cupy.empty": per_call(lambda: cupy.empty((1, 1, 16, 64), dtype=np.float32)),
        "cupy.cuda.alloc": per_call(lambda: cupy.cuda.alloc(4096)),
        "the forward plan's call": per_call(lambda: plan(q, k, v)),
    }
    cupy.cuda.get_current_stream().synchronize()
    return costs


LINE = re.compile(r"forward ([0-9.]+) us, backward ([0-9.]+) us")


def host_times(tree, calls):
    """``(forward, backward)`` host microseconds of one fresh process importing the
    cuflash package under ``tree``."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--calls", str(calls)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.abspath(tree),
    )
    found = LINE.search(result.stdout)
    if found is None:
        raise RuntimeError(f"no timing from {tree}: {result.stdout}{result.stderr}")
    return float(found.group(1)), float(found.group(2))


def compare_trees(other, rounds, calls):
    """Host time of this tree and ``other``, alternating fresh processes, with medians."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    times = {here: [], other: []}
    for i in range(rounds):
        for tree in (here, other) if i % 2 == 0 else (other, here):
            times[tree].append(host_times(tree, calls))
            f, b = times[tree][-1]
            print(f"round {i + 1} {tree}: forward {f:.1f} us, backward {b:.1f} us", flush=True)
    for tree, pairs in times.items():
        f = statistics.median(p[0] for p in pairs)
        b = statistics.median(p[1] for p in pairs)
        print(f"median {tree}: forward {f:.1f} us, backward {b:.1f} us ({rounds} processes)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--parts",
        action="store_true",
        help="also time the pieces of a cached call (signature, allocation, the plan's call)",
    )
    parser.add_argument(
        "--import-torch",
        action="store_true",
        help="import torch and touch its CUDA first, as the benchmark's process "
        "does (its host times run higher than this script's)",
    )
    parser.add_argument(
        "--against",
        metavar="TREE",
        help="compare with the cuflash package under TREE, a fresh process each in turn",
    )
    parser.add_argument("--rounds", type=int, default=6, help="rounds of --against")
    args = parser.parse_args()
    if args.against:
        compare_trees(args.against, args.rounds, args.calls)
        return
    if args.import_torch:
        import torch

        torch.zeros(1, device="cuda")
    forward, backward = tiny_calls()
    (f_host, f_wall), (b_host, b_wall) = timed(forward, args.calls), timed(backward, args.calls)
    print(
        f"host time per call: forward {f_host:.1f} us, backward {b_host:.1f} us; back to "
        f"back {f_wall:.1f} / {b_wall:.1f} us (bfloat16, B=1 H=1 S=16 D=64, causal, "
        f"{args.calls} calls)"
    )
    if args.parts:
        for name, us in primitive_costs(args.calls).items():
            print(f"  {name:34s} {us:6.2f} us")
    if args.profile:
        for name, fn in (("forward", forward), ("backward", backward)):
            profiler = cProfile.Profile()
            profiler.enable()
            timed(fn, args.calls)
            profiler.disable()
            print(f"\n--- {name}")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
