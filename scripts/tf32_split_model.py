"""NumPy model of the float32 tensor-core products (docs/perf-notes.md, version 3).

A q.k dot product of 128 unit normals, four ways: float32 FFMA one product at
a time (the general kernel); three TF32 passes lo*hi + hi*lo + hi*hi; one
pass hi*hi (allow_tf32). An mma step is modelled as 8 exact products summed
and rounded once into the float32 accumulator. Prints the RMS and largest
error relative to |q| |k| over 300 random pairs.
Usage: python scripts/tf32_split_model.py
"""

import numpy as np


def tf32(x):
    """Round float32 to TF32 (10 mantissa bits), to nearest, ties away: cvt.rna.tf32.f32."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def mma_dot(passes, n):
    acc = np.float32(0)
    for k0 in range(0, n, 8):
        for a, b in passes:
            step = np.dot(a[k0:k0 + 8].astype(np.float64), b[k0:k0 + 8].astype(np.float64))
            acc = np.float32(np.float64(acc) + step)
    return acc


def ffma_dot(a, b):
    acc = np.float32(0)
    for x, y in zip(a, b):
        acc = np.float32(np.float64(acc) + np.float64(x) * np.float64(y))
    return acc


def main(trials=300, n=128):
    rng = np.random.default_rng(0)
    errors = {"float32 FFMA": [], "3 x TF32": [], "1 x TF32": []}
    for _ in range(trials):
        a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
        exact = float(np.dot(a.astype(np.float64), b.astype(np.float64)))
        a_hi, b_hi = tf32(a), tf32(b)
        a_lo, b_lo = tf32(a - a_hi), tf32(b - b_hi)
        results = {"float32 FFMA": ffma_dot(a, b),
                   "3 x TF32": mma_dot([(a_lo, b_hi), (a_hi, b_lo), (a_hi, b_hi)], n),
                   "1 x TF32": mma_dot([(a_hi, b_hi)], n)}
        scale = np.linalg.norm(a) * np.linalg.norm(b)
        for name, value in results.items():
            errors[name].append(abs(float(value) - exact) / scale)
    for name, errs in errors.items():
        print(f"{name:>13}: rms {np.sqrt(np.mean(np.square(errs))):.3g}, max {max(errs):.3g}")


if __name__ == "__main__":
    main()
