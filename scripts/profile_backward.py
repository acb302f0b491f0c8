"""Time the 16-bit backward's kernels one by one, for kernel development.

Usage: python scripts/profile_backward.py [D S causal] [--ncu]
B*S = 16384 tokens, H = 2048/D, bfloat16. Prints the median time of each
backward kernel role that serves the case (the wgmma backward on Hopper, the
mma.sync one, the split-D one), with and without the atomic dQ, as TFLOP/s of
its share of the products (dK, dV: 4 of the 5; with dQ: all 5). With --ncu it
runs each role once more for Nsight Compute (use under `ncu`).
"""

import functools
import math
import sys

import cupy
import numpy as np

import cuflash
from cuflash import gpu, kernel_build
from cuflash.bench import time_calls
from cuflash.problem import BFLOAT16, backward_problem


def main(d=128, s=4096, causal=False, ncu=False):
    b, h = 16384 // s, 2048 // d
    rng = cupy.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((b, h, s, d), dtype=cupy.float32).astype(BFLOAT16)
                   for _ in range(4))
    out, lse = cuflash.flash_attention_fwd(q, k, v, h, h, d, causal)
    problem = backward_problem(do, q, k, v, out, lse, h, h, d, causal, 0, None, None,
                               False, False)
    module = kernel_build.load(gpu._variant(problem))
    tiles = module.variant.tiles
    flops = 4 * b * h * s * s * d / (2 if causal else 1)  # one product pass
    delta, lse_log2 = gpu.backward_delta(module, problem, do, out, lse)
    dk, dv = cupy.empty_like(k), cupy.empty_like(v)
    dq_accum = cupy.zeros(q.shape, dtype=np.float32)
    args = gpu.dkdv_args(problem, q, k, v, do, lse_log2, delta, dq_accum, dk, dv)
    print(f"D={d} S={s} causal={int(causal)} B={b} H={h}")
    for family in ("wgb", "wgd", "tc", "tcw"):
        for suffix, passes in (("", 4), ("_atomic_dq", 5)):
            role = f"dkdv_{family}{suffix}"
            if role not in module.names:
                continue
            keys, threads = tiles.fast_bwd(family)
            grid = (math.ceil(s / keys), h, b)

            call = functools.partial(gpu._launch, module, role, grid, args, threads=threads)
            if ncu:
                call()
                continue
            ms = time_calls([call], 0.3).median * 1e3
            print(f"  {role:22s} {ms:8.3f} ms  {passes * flops / 4 / ms / 1e9:7.1f} TFLOP/s")
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if a != "--ncu"]
    main(*(int(x) for x in argv[:2]), *(bool(int(x)) for x in argv[2:3]),
         ncu="--ncu" in sys.argv)
