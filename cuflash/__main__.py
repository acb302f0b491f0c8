"""``python -m cuflash``: run forward and backward on a realistic size and check them.

On a GPU: bfloat16, B=4, H=16 (GQA with 4 KV heads), S=2048, D=128, causal;
the result is checked on sampled heads against the float64 oracle and the
time of each pass is printed. Without a GPU: the CPU path on a smaller size.
"""

import argparse
import time

import numpy as np

import cuflash
from cuflash.reference import attention_reference, attention_reference_grad

from .core.problem import BFLOAT16


def _gpu_available():
    try:
        import cupy

        return cupy.is_available()
    except ImportError:
        return False


def _rel(x, ref):
    x = np.asarray(x, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m cuflash", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="use the CPU path even with a GPU")
    args = parser.parse_args(argv)
    on_gpu = _gpu_available() and not args.cpu
    if on_gpu:
        import cupy

        xp, dtype, (b, h, hk, s, d) = cupy, BFLOAT16, (4, 16, 4, 2048, 128)
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        where = f"GPU: {props['name'].decode()} (CuPy {cupy.__version__})"
        to_host = cupy.asnumpy
    else:
        xp, dtype, (b, h, hk, s, d) = np, np.dtype(np.float32), (1, 4, 2, 512, 64)
        where = "CPU path (NumPy)" + ("" if args.cpu else ": no CUDA GPU was found")
        to_host = np.asarray
    print(f"cuflash {cuflash.__version__} on {where}")
    print(f"causal attention, {dtype.name}, B={b} H={h} H_kv={hk} S={s} D={d}")

    rng = np.random.default_rng()
    q, k, v, dout = (
        xp.asarray(rng.standard_normal(shape).astype(dtype))
        for shape in ((b, h, s, d), (b, hk, s, d), (b, hk, s, d), (b, h, s, d))
    )

    def timed(fn, repeats=10):
        """Result of ``fn`` and its mean wall time over ``repeats`` calls after a warm-up."""
        fn()  # warm-up: compiles the kernels on first use
        if on_gpu:
            xp.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            result = fn()
        if on_gpu:
            xp.cuda.Device().synchronize()
        return result, (time.perf_counter() - start) / repeats

    (out, vjp), t_fwd = timed(lambda: cuflash.flash_attention_vjp(q, k, v, h, hk, d, True))
    (dq, dk, dv), t_bwd = timed(lambda: vjp(dout))
    flops = 4 * b * h * s * s * d / 2
    print(f"forward  {t_fwd * 1e3:8.2f} ms  {flops / t_fwd / 1e12:7.2f} TFLOP/s")
    print(f"backward {t_bwd * 1e3:8.2f} ms  {2.5 * flops / t_bwd / 1e12:7.2f} TFLOP/s")

    # Check batch 0, KV head 0 and its query heads against the float64 oracle.
    group = h // hk
    pick = lambda x, heads: to_host(x[:1, :heads]).astype(np.float64)  # noqa: E731
    ref_out, _ = attention_reference(pick(q, group), pick(k, 1), pick(v, 1), causal=True)
    ref_dq, ref_dk, ref_dv = attention_reference_grad(
        pick(dout, group), pick(q, group), pick(k, 1), pick(v, 1), causal=True
    )
    errors = {
        "out": _rel(pick(out, group), ref_out),
        "dq": _rel(pick(dq, group), ref_dq),
        "dk": _rel(to_host(dk[:1, :1]), ref_dk),
        "dv": _rel(to_host(dv[:1, :1]), ref_dv),
    }
    bound = 2e-2 if dtype == BFLOAT16 else 1e-5
    print(
        "relative error vs float64 oracle: "
        + ", ".join(f"{name} {err:.2e}" for name, err in errors.items())
    )
    ok = all(err < bound for err in errors.values())
    print("check passed" if ok else f"CHECK FAILED (bound {bound})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
