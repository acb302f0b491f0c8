"""Small calls of every kernel variant kind, for compute-sanitizer to watch.

Forward, backward (atomic and deterministic), each dtype, head dims across
the fast and general kernels, causal, window and kv_seq_len cases, on both
kernel paths. Run by scripts/sanitize.sh; exits non-zero on a wrong result.
"""

import itertools
import sys

import cupy
import numpy as np

import cuflash
from cuflash.problem import BFLOAT16


def main():
    rng = np.random.default_rng(0)
    failures = 0
    dtypes = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)
    configs = [dict(causal=False), dict(causal=True, window_size=7), dict(kv_seq_len=50)]
    for path, dtype, d, cfg in itertools.product(("auto", "general"), dtypes, (40, 64, 128, 256),
                                                 configs):
        q = cupy.asarray(rng.standard_normal((1, 4, 70, d)).astype(dtype))
        k, v = (cupy.asarray(rng.standard_normal((1, 2, 90, d)).astype(dtype)) for _ in "kv")
        with cuflash.kernel_path(path):
            out, lse = cuflash.flash_attention_fwd(q, k, v, 4, 2, d, **cfg)
            for det in (False, True):
                grads = cuflash.flash_attention_bwd(out, q, k, v, out, lse, 4, 2, d,
                                                    deterministic=det, **cfg)
                if any(bool(cupy.isnan(g).any()) for g in grads):
                    failures += 1
        if bool(cupy.isnan(out).any()):
            failures += 1
    print(f"sanitize cases done, {failures} with NaN")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
