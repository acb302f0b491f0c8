"""Small calls of every kernel variant kind, for compute-sanitizer to watch.

Forward, backward (atomic and deterministic), each dtype, head dims across
the fast and general kernels, causal, window and kv_seq_len cases, on both
kernel paths, and the kernel families pending GPU validation (float32 on
tensor cores in both precisions, the split-D 16-bit backward).
Run by scripts/sanitize.sh; exits non-zero on a wrong result.
"""

import itertools
import sys

import cupy
import numpy as np

import cuflash
from cuflash import gpu
from cuflash.problem import BFLOAT16

# name -> (kernel path, run pending kernels, prefer the split-D backward, allow_tf32)
SETTINGS = {"auto": ("auto", False, False, False), "general": ("general", False, False, False),
            "pending": ("auto", True, False, False), "wide": ("auto", True, True, False),
            "tf32": ("auto", True, False, True)}


def main():
    rng = np.random.default_rng(0)
    failures = 0
    dtypes = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)
    configs = [dict(causal=False), dict(causal=True, window_size=7), dict(kv_seq_len=50)]
    for setting, dtype, d, cfg in itertools.product(SETTINGS, dtypes, (40, 64, 128, 256),
                                                    configs):
        if (setting == "wide") == (dtype == np.float32) and setting in ("wide", "tf32"):
            continue  # the split-D backward is 16-bit only; allow_tf32 matters for float32
        path, gpu.RUN_PENDING_KERNELS, gpu.PREFER_WIDE_BACKWARD, tf32 = SETTINGS[setting]
        cfg = dict(cfg, allow_tf32=tf32)
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
