"""Small calls of every kernel variant kind, for compute-sanitizer to watch.

Forward, backward (atomic and deterministic), each dtype, head dims across
the fast and general kernels, causal, window and kv_seq_len cases, on both
kernel paths, and every tensor-core family, also those the default dispatch
passes over (float32 on TF32 tensor cores in both precisions, the mma.sync
forward where Hopper takes wgmma, the wgmma forward without the pipelined
softmax where the pipelined one serves, the split-D 16-bit backward
everywhere).
Run by scripts/sanitize.sh; exits non-zero on a wrong result. Arguments: the
settings to run (names of SETTINGS; default all).
"""

import itertools
import sys

import cupy
import numpy as np

import cuflash
from cuflash import gpu
from cuflash.problem import BFLOAT16

DEFAULT_SKIP = gpu.SKIP_FAMILIES
# name -> (kernel path, families skipped, prefer the split-D backward, allow_tf32).
# Each family runs in one: "auto" the defaults (forward wgp, and wg at D = 256, on
# Hopper; backward wgb on Hopper, tc elsewhere, tcw at D = 256), "mma-sync" the tc
# forward and backward, "wg" wg at D = 64 and 128, "wide" tcw everywhere, "tc32", "tf32"
# and "wgs" (forward and backward on float16 pieces, float32's default on Hopper) the
# float32 ones.
SETTINGS = {"auto": ("auto", DEFAULT_SKIP, False, False),
            "general": ("general", DEFAULT_SKIP, False, False),
            "tc32": ("auto", frozenset({"wgs"}), False, False),
            "wgs": ("auto", DEFAULT_SKIP, False, False),
            "mma-sync": ("auto", frozenset({"wg", "wgp", "wgb", "wgd"}), False, False),
            "wg": ("auto", DEFAULT_SKIP | {"wgp"}, False, False),
            "wide": ("auto", DEFAULT_SKIP, True, False),
            "tf32": ("auto", DEFAULT_SKIP, False, True)}


def main(settings):
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise SystemExit(f"unknown settings {sorted(unknown)}; expected some of {list(SETTINGS)}")
    rng = np.random.default_rng(0)
    failures = 0
    dtypes = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)
    configs = [dict(causal=False), dict(causal=True, window_size=7), dict(kv_seq_len=50)]
    for setting, dtype, d, cfg in itertools.product(settings, dtypes, (40, 64, 128, 256),
                                                    configs):
        float32 = dtype == np.float32
        sixteen_bit_only = setting in ("wide", "mma-sync", "wg")
        if (sixteen_bit_only and float32) or (setting in ("tc32", "tf32", "wgs") and not float32):
            continue  # 16-bit kernel families; float32 kernel families
        path, gpu.SKIP_FAMILIES, gpu.PREFER_WIDE_BACKWARD, tf32 = SETTINGS[setting]
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
    print(f"sanitize cases done ({', '.join(settings)}), {failures} with NaN")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(SETTINGS)))
