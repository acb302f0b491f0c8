"""Run by tests/test_reliability.py in a fresh process: first calls from many threads.

Each thread takes its own stream and a kernel variant this process has not
loaded yet (so its first call compiles, or loads from the shared CuPy cache,
while other threads launch), runs forward and backward and compares them with
the CPU path. Prints one line per thread; exits non-zero if any disagrees.
"""

import sys
import threading

import cupy
import numpy as np

import cuflash
from cuflash.core.problem import BFLOAT16

VARIANTS = [
    (np.float16, 64),
    (BFLOAT16, 128),
    (np.float32, 40),
    (np.float16, 256),
    (BFLOAT16, 96),
    (np.float32, 128),
    (np.float16, 128),
    (BFLOAT16, 64),
]


def run(index, dtype, head_dim, results):
    rng = np.random.default_rng(index)
    shapes = (
        (2, 4, 150, head_dim),
        (2, 2, 170, head_dim),
        (2, 2, 170, head_dim),
        (2, 4, 150, head_dim),
    )
    host = [rng.standard_normal(s).astype(dtype) for s in shapes]
    cpu_out, cpu_lse = cuflash.flash_attention_fwd(*host[:3], 4, 2, head_dim, causal=True)
    cpu_grads = cuflash.flash_attention_bwd(
        host[3], *host[:3], cpu_out, cpu_lse, 4, 2, head_dim, causal=True
    )
    try:
        with cupy.cuda.Stream(non_blocking=True) as stream:
            q, k, v, dout = (cupy.asarray(a) for a in host)
            out, lse = cuflash.flash_attention_fwd(q, k, v, 4, 2, head_dim, causal=True)
            grads = cuflash.flash_attention_bwd(
                dout, q, k, v, out, lse, 4, 2, head_dim, causal=True
            )
            stream.synchronize()
        worst = 0.0
        for got, want in zip((out, *grads), (cpu_out, *cpu_grads)):
            want = want.astype(np.float64)
            got = cupy.asnumpy(got).astype(np.float64)
            worst = max(worst, float(np.linalg.norm(got - want) / np.linalg.norm(want)))
        limit = 1e-5 if dtype == np.float32 else 2e-2
        results[index] = (worst <= limit, f"{np.dtype(dtype).name} D={head_dim}: {worst:.2e}")
    except Exception as exc:  # reported by the parent test
        results[index] = (False, f"{np.dtype(dtype).name} D={head_dim}: {exc!r}")


def main():
    results = {}
    threads = [
        threading.Thread(target=run, args=(i, dt, d, results)) for i, (dt, d) in enumerate(VARIANTS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(len(VARIANTS)):
        ok, line = results.get(i, (False, f"thread {i} left no result"))
        print(("ok   " if ok else "FAIL ") + line)
    return 0 if all(results.get(i, (False,))[0] for i in range(len(VARIANTS))) else 1


if __name__ == "__main__":
    sys.exit(main())
