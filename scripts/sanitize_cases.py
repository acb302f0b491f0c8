"""Small calls of every kernel of the registry, for compute-sanitizer to watch.

Forward, backward (atomic and deterministic), each dtype, head dims across
the head-dim classes and the general kernels, causal, window and kv_seq_len
cases, on both kernel paths, and every tensor-core kernel, also those the
default dispatch passes over (``cuflash.dispatch.skip_kernels``): the mma.sync
forward and backward where Hopper takes wgmma, the wgmma forward without the
pipelined softmax, the split-D 16-bit backward, float32 on TF32.
Run by scripts/sanitize.sh; exits non-zero on a wrong result. Arguments: the
settings to run (names of SETTINGS; default all); SANITIZE_HEAD_DIMS (comma
separated) narrows the head dims.
"""

import itertools
import os
import sys

import cupy
import numpy as np

import cuflash
from cuflash.dispatch import skip_kernels
from cuflash.problem import BFLOAT16

# name -> (kernel path, kernels skipped, allow_tf32). "auto" runs the defaults (on
# Hopper the wgmma kernels for 16 bits and the float16 pieces for float32).
SETTINGS = {"auto": ("auto", (), False),
            "general": ("general", (), False),
            "mma-sync": ("auto", ("forward_wgmma_pipelined", "forward_wgmma", "backward_wgmma"),
                         False),
            "wg": ("auto", ("forward_wgmma_pipelined",), False),
            "split-d": ("auto", ("backward_wgmma", "backward_mma_sync"), False),
            "tf32": ("auto", (), True)}


def main(settings):
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise SystemExit(f"unknown settings {sorted(unknown)}; expected some of {list(SETTINGS)}")
    rng = np.random.default_rng(0)
    failures = 0
    dtypes = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)
    configs = [dict(causal=False), dict(causal=True, window_size=7), dict(kv_seq_len=50)]
    head_dims = [int(d) for d in os.environ.get("SANITIZE_HEAD_DIMS", "40,64,96,128,200,256")
                 .split(",")]
    for setting, dtype, d, cfg in itertools.product(settings, dtypes, head_dims, configs):
        float32 = dtype == np.float32
        sixteen_bit_only = setting in ("split-d", "mma-sync", "wg")
        if (sixteen_bit_only and float32) or (setting == "tf32" and not float32):
            continue  # 16-bit kernels; float32 kernels
        path, skipped, tf32 = SETTINGS[setting]
        cfg = dict(cfg, allow_tf32=tf32)
        q = cupy.asarray(rng.standard_normal((1, 4, 70, d)).astype(dtype))
        k, v = (cupy.asarray(rng.standard_normal((1, 2, 90, d)).astype(dtype)) for _ in "kv")
        with cuflash.kernel_path(path), skip_kernels(*skipped):
            out, lse = cuflash.flash_attention_fwd(q, k, v, 4, 2, d, **cfg)
            for det in (False, True):
                grads = cuflash.flash_attention_bwd(out, q, k, v, out, lse, 4, 2, d,
                                                    deterministic=det, **cfg)
                if any(bool(cupy.isnan(g).any()) for g in grads):
                    failures += 1
        if bool(cupy.isnan(out).any()):
            failures += 1
        if cfg.get("kv_seq_len") is None:
            failures += packed_calls(rng, dtype, d, path, skipped, cfg)
    print(f"sanitize cases done ({', '.join(settings)}), {failures} with NaN")
    return 1 if failures else 0


# Packed batches: valid offsets (lengths 30, 0, 70, 45), then garbage ones (negative,
# decreasing, past the totals), which the kernels must clamp into the arrays.
PACKED_OFFSETS = ([0, 30, 30, 100, 145], [0, -40, 10**6, 20, 145], [145, 3, 2**31 - 1, -9, 0])


def packed_calls(rng, dtype, d, path, skipped, cfg):
    """Forward and backward (atomic, deterministic) of the packed batches; the count of
    NaN results with valid offsets."""
    q, k, v = (cupy.asarray(rng.standard_normal((145, h, d)).astype(dtype)) for h in (4, 2, 2))
    failures = 0
    for i, offsets in enumerate(PACKED_OFFSETS):
        cu = cupy.asarray(np.array(offsets, dtype=np.int32))
        args = (cu, cu, 70, 70, 4, 2, d)
        with cuflash.kernel_path(path), skip_kernels(*skipped):
            out, lse = cuflash.flash_attention_varlen_fwd(q, k, v, *args, **cfg)
            grads = [cuflash.flash_attention_varlen_bwd(q, q, k, v, out, lse, *args,
                                                        deterministic=det, **cfg)
                     for det in (False, True)]
        if i == 0:
            failures += sum(bool(cupy.isnan(x).any()) for x in (out, *grads[0], *grads[1]))
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(SETTINGS)))
