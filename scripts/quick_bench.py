"""Kernel-development timing: cuflash (both paths) vs torch SDPA on a few cases.

Usage: python scripts/quick_bench.py [--float32] [--forward] [--rows=auto,flash] [D,S,causal ...]
e.g. 128,4096,0 64,1024,1 (--rows: only the rows named; --forward: no backward timings)
B*S = 16384 tokens, H = 2048/D, bfloat16 (or float32); median of CUDA-event timings.
Rows: the default dispatch ("auto"; "det" its deterministic backward), the general kernels,
and kernels of the registry the default passes over on this device
(``cuflash.dispatch.skip_kernels``): for 16 bits
"sync" = the default without the warp-specialized forward (forward_wgmma up to
D = 64, the mma.sync forward above), "mma" = the mma.sync forward and backward
where Hopper takes wgmma ("mma-det" its deterministic backward, dQ by the mma.sync
pass), "split-d" = the split-D mma.sync backward; for float32 "tf32" = allow_tf32
(auto is the float16 pieces on Hopper up to head_dim 128); then torch SDPA's
backends. The full comparison is `python -m cuflash.bench`.
"""

import math
import sys

import cupy

import cuflash
from cuflash.bench import time_calls
from cuflash.core.problem import BFLOAT16
from cuflash.dispatch import skip_kernels

# row name -> (kernel path, kernels skipped, allow_tf32, deterministic)
PATHS_16 = {
    "auto": ("auto", (), False, False),
    "det": ("auto", (), False, True),
    # the deterministic backward with its dQ pass where the default adds dQ in launch order
    "det-pass": ("auto", ("backward_wgmma_ws_ordered_dq",), False, True),
    "general": ("general", (), False, False),
    "mma": (
        "auto",
        ("forward_wgmma_ws", "forward_wgmma", "backward_wgmma_ws", "backward_wgmma"),
        False,
        False,
    ),
    "mma-det": (
        "auto",
        ("forward_wgmma_ws", "forward_wgmma", "backward_wgmma_ws", "backward_wgmma"),
        False,
        True,
    ),
    "sync": ("auto", ("forward_wgmma_ws",), False, False),
    # the warp-specialized forward where the default takes forward_wgmma (short D <= 64 calls)
    "ws-fwd": ("auto", ("forward_wgmma",), False, False),
    # backward_wgmma where the default takes the warp-specialized backward (the 128
    # class), atomic and deterministic
    "wgmma": ("auto", ("backward_wgmma_ws",), False, False),
    "wgmma-det": ("auto", ("backward_wgmma_ws",), False, True),
    "split-d": ("auto", ("backward_wgmma_ws", "backward_wgmma", "backward_mma_sync"), False, False),
}
PATHS_32 = {
    "auto": ("auto", (), False, False),
    "general": ("general", (), False, False),
    "tf32": ("auto", (), True, False),
}


def median_ms(fn):
    """Median milliseconds of ``fn`` (the comparison command's timing, 0.2 s of calls)."""
    return time_calls([fn], 0.2).median * 1e3


def main(cases, float32=False, only=None, forward_only=False):
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    print(f"{'D':>4} {'S':>6} {'causal':>6} | {'path':>8} {'fwd TF/s':>9} {'bwd TF/s':>9}")
    for d, s, causal in cases:
        b, h = 16384 // s, 2048 // d
        rng = cupy.random.default_rng(0)
        dtype = cupy.float32 if float32 else BFLOAT16
        q, k, v, do = (
            rng.standard_normal((b, h, s, d), dtype=cupy.float32).astype(dtype) for _ in range(4)
        )
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        rows = []
        for name, (path, skipped, tf32, det) in (PATHS_32 if float32 else PATHS_16).items():
            if only and name not in only:
                continue
            with cuflash.kernel_path(path), skip_kernels(*skipped):
                fwd = median_ms(
                    lambda: cuflash.flash_attention_fwd(q, k, v, h, h, d, causal, allow_tf32=tf32)
                )
                out, lse = cuflash.flash_attention_fwd(q, k, v, h, h, d, causal, allow_tf32=tf32)
                bwd = (
                    math.nan
                    if forward_only
                    else median_ms(
                        lambda: cuflash.flash_attention_bwd(
                            do,
                            q,
                            k,
                            v,
                            out,
                            lse,
                            h,
                            h,
                            d,
                            causal,
                            allow_tf32=tf32,
                            deterministic=det,
                        )
                    )
                )
            rows.append((name, fwd, bwd))
        if torch is not None:
            tq, tk, tv, tdo = (torch.from_dlpack(x) for x in (q, k, v, do))
            backends = (
                (("efficient", SDPBackend.EFFICIENT_ATTENTION),)
                if float32
                else (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))
            )
            for name, backend in backends:
                if only and name not in only:
                    continue
                with sdpa_kernel(backend):
                    f = torch.nn.functional.scaled_dot_product_attention
                    fwd = median_ms(lambda: f(tq, tk, tv, is_causal=causal))
                    if forward_only:
                        rows.append((name, fwd, math.nan))
                        continue
                    tq.requires_grad_(True)
                    tk.requires_grad_(True)
                    tv.requires_grad_(True)
                    o = f(tq, tk, tv, is_causal=causal)
                    bwd = median_ms(
                        lambda: torch.autograd.grad(o, (tq, tk, tv), tdo, retain_graph=True)
                    )
                    tq.requires_grad_(False)
                    tk.requires_grad_(False)
                    tv.requires_grad_(False)
                rows.append((name, fwd, bwd))
        for path, fwd, bwd in rows:
            print(
                f"{d:>4} {s:>6} {int(causal):>6} | {path:>8} {flops / fwd / 1e9:9.1f} "
                f"{2.5 * flops / bwd / 1e9:9.1f}"
            )


if __name__ == "__main__":
    args = sys.argv[1:]
    float32, forward_only = "--float32" in args, "--forward" in args
    only = [a.split("=", 1)[1].split(",") for a in args if a.startswith("--rows=")]
    args = [a for a in args if a[:2] != "--"] or [
        "64,4096,0",
        "128,4096,0",
        "128,4096,1",
        "256,4096,0",
        "128,1024,0",
    ]
    main(
        [(int(d), int(s), bool(int(c))) for d, s, c in (a.split(",") for a in args)],
        float32,
        only[0] if only else None,
        forward_only,
    )
