"""Ring attention over NCCL on every visible GPU, against the single-GPU call.

Run with one process a GPU, e.g. ``torchrun --nproc-per-node 2 scripts/ring_demo.py``
or ``mpirun -n 2 python scripts/ring_demo.py``; each rank prints its error and timings.
"""

import sys
import time

import cupy
import numpy as np

import cuflash
from cuflash import distributed as dist
from cuflash.problem import BFLOAT16


def main(seq_len=65536, heads=32, kv_heads=8, head_dim=128, layout="zigzag"):
    group = dist.NcclGroup.from_environment()
    rng = np.random.default_rng(0)  # every rank draws the same whole sequence
    full = [cupy.asarray(rng.standard_normal((1, h, seq_len, head_dim)).astype(BFLOAT16))
            for h in (heads, kv_heads, kv_heads, heads)]
    q, k, v, dout = (dist.shard(x, layout, group.rank, group.size) for x in full)
    args = (heads, kv_heads, head_dim, True)

    def step():
        out, vjp = dist.ring_attention_vjp(q, k, v, *args, group=group, layout=layout)
        return out, vjp(dout)

    step()
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    out, grads = step()
    cupy.cuda.Device().synchronize()
    ring_s = time.perf_counter() - start
    whole, _ = cuflash.flash_attention_fwd(*full[:3], *args)
    mine = dist.shard(whole, layout, group.rank, group.size)
    err = float(cupy.linalg.norm((out - mine).astype(cupy.float32))
                / cupy.linalg.norm(mine.astype(cupy.float32)))
    print(f"rank {group.rank}/{group.size}: out rel. error {err:.2e}, forward + backward "
          f"{ring_s * 1e3:.1f} ms", flush=True)
    return 0 if err < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:2])))
