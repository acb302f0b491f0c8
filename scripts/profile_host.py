"""Host time per call on a tiny problem, and where it goes (cProfile).

Usage: python scripts/profile_host.py [--calls 1000] [--profile] [--parts] [--import-torch]

Times ``flash_attention_fwd`` and ``flash_attention_bwd(..., synchronize=False)`` as
wall time over ``--calls`` calls (the GPU work of the tiny problem takes a few
microseconds, so the host's time is what is measured), then with ``--profile`` prints
the functions that take the most time under cProfile.
"""

import argparse
import cProfile
import pstats
import time

import cupy
import ml_dtypes
import numpy as np

import cuflash


def tiny_inputs(dtype=ml_dtypes.bfloat16, batch=1, heads=1, seq_len=16, head_dim=64):
    rng = np.random.default_rng(0)
    shape = (batch, heads, seq_len, head_dim)
    return [cupy.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(4)]


def host_times(calls, **kw):
    """Microseconds per call of the forward and the backward (wall time over ``calls``)."""
    q, k, v, dout = tiny_inputs(**kw)
    heads, head_dim = q.shape[1], q.shape[3]
    args = (heads, heads, head_dim, True)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *args)
    cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *args, synchronize=False)
    cupy.cuda.get_current_stream().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        cuflash.flash_attention_fwd(q, k, v, *args)
    cupy.cuda.get_current_stream().synchronize()
    forward = (time.perf_counter() - start) / calls * 1e6
    start = time.perf_counter()
    for _ in range(calls):
        cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *args, synchronize=False)
    cupy.cuda.get_current_stream().synchronize()
    backward = (time.perf_counter() - start) / calls * 1e6
    return forward, backward


def primitive_costs(calls):
    """Microseconds per call of the host-side pieces a cached call is made of."""
    from cuflash.gpu import launch as gpu
    from cuflash.gpu import plans

    q, k, v, _ = tiny_inputs()
    key_args = (1, 1, 64, True, 0, None, None, False, 0.0, None, None, None)

    def per_call(fn):
        fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    cuflash.flash_attention_fwd(q, k, v, 1, 1, 64, True)
    plan = plans.get(plans.signature((q, k, v), key_args))
    out, lse = cupy.empty_like(q), cupy.empty(q.shape[:3], dtype=np.float32)
    costs = {
        "signature (3 arrays, 12 scalars)": per_call(lambda: plans.signature((q, k, v), key_args)),
        "plans.get": per_call(lambda: plans.get(plans.signature((q, k, v), key_args))),
        "cupy.empty": per_call(lambda: cupy.empty((1, 1, 16, 64), dtype=np.float32)),
        "cupy.cuda.alloc": per_call(lambda: cupy.cuda.alloc(4096)),
        "one kernel launch": per_call(
            lambda: plan.main(
                gpu.current_stream(), *(x.data.ptr for x in (q, k, v, out, lse)), 0, 0, 0
            )
        ),
        "the forward plan's call": per_call(lambda: plan(q, k, v)),
    }
    cupy.cuda.get_current_stream().synchronize()
    return costs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--parts",
        action="store_true",
        help="also time the pieces of a cached call (signature, allocation, launch)",
    )
    parser.add_argument(
        "--import-torch",
        action="store_true",
        help="import torch and touch its CUDA first, as the benchmark's process "
        "does (its host times run higher than this script's)",
    )
    args = parser.parse_args()
    if args.import_torch:
        import torch

        torch.zeros(1, device="cuda")
    forward, backward = host_times(args.calls)
    print(
        f"host time per call: forward {forward:.1f} us, backward {backward:.1f} us "
        f"(bfloat16, B=1 H=1 S=16 D=64, causal, {args.calls} calls)"
    )
    if args.parts:
        for name, us in primitive_costs(args.calls).items():
            print(f"  {name:34s} {us:6.2f} us")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        host_times(args.calls)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
