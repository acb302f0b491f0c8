"""Errors of the float32 paths against the float64 oracle, forward and backward each on
the general kernels or on the float16 pieces ("wgs"), in every combination: which side
the pieces' error comes from. Usage: python scripts/float32_error_sources.py
"""

import sys

import cupy
import numpy as np

import cuflash
from cuflash import gpu

sys.path.insert(0, "tests")
from support import Case, oracle, random_inputs, rel_error  # noqa: E402

CASES = [
    Case(batch=2, heads=8, kv_heads=2, q_len=500, kv_len=500, head_dim=64, causal=True),
    Case(batch=1, heads=4, kv_heads=4, q_len=300, kv_len=700, head_dim=128, window=(100, 20)),
    Case(batch=4, heads=4, kv_heads=4, q_len=1024, kv_len=1024, head_dim=64),
    Case(batch=4, heads=4, kv_heads=4, q_len=1024, kv_len=1024, head_dim=128, causal=True),
]
GENERAL = gpu.SKIP_FAMILIES | {"wgs", "tc32"}
PIECES = (gpu.SKIP_FAMILIES | {"tc32"}) - {"wgs"}


def main():
    saved = gpu.SKIP_FAMILIES
    rng = np.random.default_rng(7)
    try:
        for case in CASES:
            q, k, v, dout = random_inputs(case, rng, cupy)
            ref_out, _, ref_grads = oracle(case, q, k, v, dout)
            print(case)
            for fwd_name, fwd_skip in (("general", GENERAL), ("pieces", PIECES)):
                gpu.SKIP_FAMILIES = fwd_skip
                out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args)
                for bwd_name, bwd_skip in (("general", GENERAL), ("pieces", PIECES)):
                    gpu.SKIP_FAMILIES = bwd_skip
                    grads = cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *case.args)
                    errors = [rel_error(x, r) for x, r in zip((out, *grads),
                                                             (ref_out, *ref_grads))]
                    print(f"  fwd {fwd_name:8s} bwd {bwd_name:8s} out/dq/dk/dv "
                          + " ".join(f"{e:.3g}" for e in errors))
    finally:
        gpu.SKIP_FAMILIES = saved


if __name__ == "__main__":
    main()
