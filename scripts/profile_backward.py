"""Time the 16-bit backward's dK/dV kernels one by one, for kernel development.

Usage: python scripts/profile_backward.py [D S causal] [--ncu]
B*S = 16384 tokens, H = 2048/D, bfloat16. Prints the median time of each
backward kernel of the registry that serves the case on this GPU (the wgmma
one on Hopper, the mma.sync one, the split-D one), with and without the atomic
dQ, as TFLOP/s of its share of the products (dK, dV: 4 of the 5; with dQ: all
5). With --ncu it runs each once more for Nsight Compute (use under `ncu`).
"""

import sys

import cupy

import cuflash
from cuflash.bench import time_calls
from cuflash.core.problem import BFLOAT16, backward_problem
from cuflash.dispatch import skip_kernels
from cuflash.gpu import launch as gpu
from cuflash.gpu import registry
from cuflash.gpu.kernel_launch import current_stream


def main(d=128, s=4096, causal=False, ncu=False):
    b, h = 16384 // s, 2048 // d
    rng = cupy.random.default_rng(0)
    q, k, v, do = (
        rng.standard_normal((b, h, s, d), dtype=cupy.float32).astype(BFLOAT16) for _ in range(4)
    )
    out, lse = cuflash.flash_attention_fwd(q, k, v, h, h, d, causal)
    config = cuflash.AttentionConfig(h, h, d, causal)
    problem = backward_problem(do, q, k, v, out, lse, config, False, False)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)  # one product pass
    print(f"D={d} S={s} causal={int(causal)} B={b} H={h}")
    tried = []
    for spec in registry.KERNELS:
        if spec.direction != "backward" or spec.instruction == "cuda cores":
            continue
        with skip_kernels(*tried):
            tried.append(spec.name)
            if gpu.choose(problem, "backward", True) is not spec:
                continue
            for deterministic in (True, False):
                plan = gpu.BackwardPlan(problem, do, q, k, v, out, True, deterministic)
                if deterministic != (not plan.atomic):
                    continue  # past head_dim 128 every call is the deterministic one
                passes = 5 if plan.atomic else 4
                delta = cupy.empty(problem.lse_shape, dtype=cupy.float32)
                lse_log2 = cupy.empty(problem.lse_shape, dtype=cupy.float32)
                dk, dv = cupy.empty_like(k), cupy.empty_like(v)
                dq = cupy.cuda.alloc(max(plan.dq_bytes, 4 * q.size))  # zeroed by delta
                stream = current_stream()
                plan.delta(
                    stream,
                    do.data.ptr,
                    out.data.ptr,
                    lse.data.ptr,
                    delta.data.ptr,
                    lse_log2.data.ptr,
                    dq.ptr if plan.atomic else 0,
                )
                pointers = [x.data.ptr for x in (q, k, v, do, lse_log2, delta)]

                def call(plan=plan, pointers=pointers):
                    plan.dkdv(stream, *pointers, dq.ptr, dk.data.ptr, dv.data.ptr, 0, 0, 0)

                if ncu:
                    call()
                    continue
                ms = time_calls([call], 0.3).median * 1e3
                name = spec.role(atomic_dq=plan.atomic)
                print(f"  {name:38s} {ms:8.3f} ms  {passes * flops / 4 / ms / 1e9:7.1f} TFLOP/s")
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if a != "--ncu"]
    main(*(int(x) for x in argv[:2]), *(bool(int(x)) for x in argv[2:3]), ncu="--ncu" in sys.argv)
