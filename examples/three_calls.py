#!/usr/bin/env python
"""The three calls of cuflash -- forward, backward, vjp -- on random inputs.

::

    out, lse = cuflash.flash_attention_fwd(q, k, v, H, H_kv, D, causal=True)
    dq, dk, dv = cuflash.flash_attention_bwd(dout, q, k, v, out, lse, H, H_kv, D, causal=True)
    out, vjp = cuflash.flash_attention_vjp(q, k, v, H, H_kv, D, causal=True)
    dq, dk, dv = vjp(dout)

The inputs live in ``[B, S, H, D]`` buffers and are passed as
``x.transpose(0, 2, 1, 3)`` views, without a copy. The script then checks:

- the forward pass against the float64 oracle :mod:`cuflash.reference`;
- that ``vjp(dout)`` gives exactly the gradients of ``flash_attention_bwd``;
- ``flash_attention_bwd`` against central finite differences of the scalar
  loss ``L(q, k, v) = sum(dout * attention(q, k, v))`` (whose gradients are
  the backward pass of ``dout``), evaluated in float64 with the oracle.

It runs on a GPU (CuPy) when one is usable, else on the CPU path (NumPy)::

    python examples/three_calls.py
    python examples/three_calls.py --device cpu --seq-len 33
    python examples/three_calls.py --device gpu --dtype bfloat16

Exits with status 1 if a check fails.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

try:
    import cuflash
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import cuflash
from cuflash.reference import attention_reference, attention_reference_grad

try:
    import cupy
except Exception:  # CuPy is optional: the CPU path needs only NumPy
    cupy = None

# Largest accepted error, relative to the largest reference value, per dtype:
# float32 results are close to float64; half precision rounds inputs and outputs.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


def to_numpy(a):
    """Copy a CuPy or NumPy array to a float64 NumPy array."""
    return np.asarray(a.get() if hasattr(a, "get") else a, dtype=np.float64)


def random_bshd(rng, xp, shape, dtype):
    """A random ``[B, S, H, D]`` buffer, returned as its ``[B, H, S, D]`` view."""
    x = rng.standard_normal(shape).astype(dtype)
    return xp.asarray(x).transpose(0, 2, 1, 3)


def scaled_error(actual, reference):
    """``max |actual - reference| / max |reference|`` (both as float64)."""
    actual, reference = to_numpy(actual), to_numpy(reference)
    return float(np.abs(actual - reference).max() / max(np.abs(reference).max(), 1e-30))


def finite_difference_check(q, k, v, dout, grads, causal, samples, rng, eps=1e-6):
    """Compare gradients with central differences of ``sum(dout * attention)``.

    The loss is evaluated in float64 by the oracle at the (possibly rounded)
    input values, at ``samples`` random entries of each of q, k and v.

    Parameters
    ----------
    q, k, v, dout : arrays
        Attention inputs and the loss weights, any dtype, NumPy or CuPy.
    grads : (dq, dk, dv)
        The gradients to check.
    causal : bool
    samples : int
        Entries checked per tensor.
    rng : numpy.random.Generator
    eps : float
        Finite-difference step.

    Returns
    -------
    dict
        ``{"dq": err, "dk": err, "dv": err}``: the largest
        ``|analytic - numeric|`` over the sampled entries, divided by the
        largest ``|analytic|`` of that gradient.
    """
    inputs = [to_numpy(a).copy() for a in (q, k, v)]
    weights = to_numpy(dout)

    def loss():
        out, _ = attention_reference(*inputs, causal=causal)
        return float((weights * out).sum())

    errors = {}
    for name, x, grad in zip(("dq", "dk", "dv"), inputs, grads):
        grad = to_numpy(grad)
        flat_x, flat_g = x.reshape(-1), grad.reshape(-1)
        worst = 0.0
        for i in rng.choice(flat_x.size, size=min(samples, flat_x.size), replace=False):
            saved = flat_x[i]
            flat_x[i] = saved + eps
            plus = loss()
            flat_x[i] = saved - eps
            minus = loss()
            flat_x[i] = saved
            worst = max(worst, abs(flat_g[i] - (plus - minus) / (2 * eps)))
        errors[name] = worst / max(np.abs(grad).max(), 1e-30)
    return errors


def select_array_module(device):
    """numpy or cupy for ``--device``; exits if ``gpu`` is asked for and absent."""
    usable = cupy is not None and cupy.is_available()
    if device == "gpu" and not usable:
        raise SystemExit("error: --device gpu, but CuPy sees no CUDA device")
    return cupy if usable and device != "cpu" else np


def parse_args(argv=None):
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    p.add_argument("--dtype", choices=tuple(TOLERANCE), default="float32")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=100)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument(
        "--samples",
        type=int,
        default=8,
        help="entries of each of q, k, v checked by finite differences",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    """Run the three calls and the checks; return the exit status."""
    args = parse_args(argv)
    xp = select_array_module(args.device)
    if args.dtype == "bfloat16":
        import ml_dtypes

        dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(args.seed)
    b, s, h, h_kv, d = args.batch, args.seq_len, args.num_heads, args.num_kv_heads, args.head_dim
    q = random_bshd(rng, xp, (b, s, h, d), dtype)
    k = random_bshd(rng, xp, (b, s, h_kv, d), dtype)
    v = random_bshd(rng, xp, (b, s, h_kv, d), dtype)
    dout = random_bshd(rng, xp, (b, s, h, d), dtype)
    causal = args.causal
    print(
        f"device: {'GPU (CuPy)' if xp is not np else 'CPU (NumPy)'}, dtype {args.dtype}, "
        f"q {list(q.shape)}, k/v {list(k.shape)}, {'causal' if causal else 'not causal'}"
    )

    # 1. Forward: the output and the log-sum-exp of each row.
    out, lse = cuflash.flash_attention_fwd(q, k, v, h, h_kv, d, causal=causal)
    # 2. Backward: gradients of sum(dout * out) with respect to q, k and v.
    grads = cuflash.flash_attention_bwd(
        dout, q, k, v, out, lse, h, h_kv, d, causal=causal, deterministic=True
    )
    # 3. The vjp pair: forward now, backward whenever (and as often as) needed.
    out_vjp, vjp = cuflash.flash_attention_vjp(q, k, v, h, h_kv, d, causal=causal)
    grads_vjp = vjp(dout, deterministic=True)

    tolerance = TOLERANCE[args.dtype]
    ref_out, ref_lse = attention_reference(*(to_numpy(a) for a in (q, k, v)), causal=causal)
    ref_grads = attention_reference_grad(*(to_numpy(a) for a in (dout, q, k, v)), causal=causal)
    checks = {
        "forward out vs float64 reference": scaled_error(out, ref_out),
        "forward lse vs float64 reference": scaled_error(lse, ref_lse),
    }
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        checks[f"backward {name} vs float64 reference"] = scaled_error(grad, ref)
    fd = finite_difference_check(q, k, v, dout, grads, causal, args.samples, rng)
    for name, error in fd.items():
        checks[f"backward {name} vs finite differences"] = error
    for name, error in checks.items():
        print(f"  {name:<38} {error:.2e}")
    same = all(
        np.array_equal(to_numpy(a), to_numpy(b_))
        for a, b_ in zip((out, *grads), (out_vjp, *grads_vjp))
    )
    print(f"  vjp vs fwd + bwd (deterministic)       {'identical' if same else 'DIFFERENT'}")
    worst = max(checks.values())
    passed = worst <= tolerance and same
    print(f"largest error {worst:.2e} (tolerance {tolerance:.0e} for {args.dtype})")
    print("gradient check passed" if passed else "gradient check FAILED")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
