"""Errors of the float32 paths against the float64 oracle, forward and backward each on
the general kernels or on the float16 pieces (``forward_float32_pieces``,
``backward_float32_pieces``), in every combination: which side the pieces' error comes
from. Usage: python scripts/float32_error_sources.py
"""

import sys

import cupy
import numpy as np

import cuflash

sys.path.insert(0, "tests")
from support import Case, oracle, random_inputs, rel_error  # noqa: E402

CASES = [
    Case(batch=2, heads=8, kv_heads=2, q_len=500, kv_len=500, head_dim=64, causal=True),
    Case(batch=1, heads=4, kv_heads=4, q_len=300, kv_len=700, head_dim=128, window=(100, 20)),
    Case(batch=4, heads=4, kv_heads=4, q_len=1024, kv_len=1024, head_dim=64),
    Case(batch=4, heads=4, kv_heads=4, q_len=1024, kv_len=1024, head_dim=128, causal=True),
]
PATHS = (("general", "general"), ("pieces", "auto"))  # (name, kernel path)


def main():
    rng = np.random.default_rng(7)
    for case in CASES:
        q, k, v, dout = random_inputs(case, rng, cupy)
        ref_out, _, ref_grads = oracle(case, q, k, v, dout)
        print(case)
        for fwd_name, fwd_path in PATHS:
            with cuflash.kernel_path(fwd_path):
                out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args)
            for bwd_name, bwd_path in PATHS:
                with cuflash.kernel_path(bwd_path):
                    grads = cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *case.args)
                errors = [rel_error(x, r) for x, r in zip((out, *grads), (ref_out, *ref_grads))]
                print(
                    f"  fwd {fwd_name:8s} bwd {bwd_name:8s} out/dq/dk/dv "
                    + " ".join(f"{e:.3g}" for e in errors)
                )


if __name__ == "__main__":
    main()
