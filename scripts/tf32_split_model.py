"""NumPy model of float32 products on tensor cores (docs/kernels/tf32.md, float32-pieces.md).

Two sums, as the three-pass float32 kernels compute them:
- "dot": a q.k score, 128 unit normals each side (S = Q K^T, D = 128);
- "long": an output element, sum over 512 keys of p v with p in [0, 1) and
  v unit normal (O += P V; dK and dV are sums of the same kind);
- "softmax": the same with p = exp(s - max s), s = 3 x unit normal, so that
  most p are small (their second float16 piece falls below 2^-14, float16's
  smallest normal).
Ways to compute them: float32 FFMA one product at a time (the general
kernel); one TF32 pass hi*hi (allow_tf32); three TF32 passes lo*hi + hi*lo +
hi*hi. An mma step is 8 exact products summed and added to the float32
accumulator with one rounding. The tensor cores round that addition toward
zero ("rz", what an H200 showed: three-pass errors 3-18x FFMA's); "rn"
rounds to nearest, the model before that measurement. "fresh k" sums every
k steps into a zeroed accumulator (rounding toward zero) and adds that to the
running sum with one round-to-nearest FADD.
Candidates for a faster float32 path, each with "fresh 4" (the same 32
terms a chunk): two float16
pieces (hi = fp16(x), lo = fp16(x - hi): 22 significant bits, products
lo*hi + hi*lo + hi*hi at the 16-bit rate, twice TF32's), and three bfloat16
pieces (24 bits, the six products down to 2^-16 of the leading one); and
two float16 pieces of a x 2^14 (the probabilities' range moved up); 16-bit
products sum 16 terms a step (m64nNk16).
Prints the RMS and largest error relative to sum |a b| over random trials.
Usage: python scripts/tf32_split_model.py
"""

import numpy as np


def tf32(x):
    """Round float32 to TF32 (10 mantissa bits), to nearest, ties away: cvt.rna.tf32.f32."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def to_f32(x, mode):
    """float64 ``x`` to float32, to nearest ("rn") or toward zero ("rz")."""
    y = np.float32(x)
    if mode == "rz" and abs(float(y)) > abs(x):
        y = np.nextafter(y, np.float32(0))
    return y


def bf16(x):
    """Round float32 to bfloat16 (8 significant bits), to nearest even."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)).view(
        np.float32
    )


def fp16(x):
    """Round float32 to float16 (11 significant bits, subnormals below 2^-14), as float32."""
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def mma_sum(passes, n, mode, fresh=None, k=8):
    """The kernels' sum: per k-term step, each pass's k products into the accumulator."""
    total, acc = np.float32(0), np.float32(0)
    for i, k0 in enumerate(range(0, n, k)):
        for a, b in passes:
            step = np.dot(a[k0 : k0 + k].astype(np.float64), b[k0 : k0 + k].astype(np.float64))
            acc = to_f32(np.float64(acc) + step, mode)
        if fresh and (i + 1) % fresh == 0:
            total, acc = np.float32(np.float64(total) + np.float64(acc)), np.float32(0)
    return np.float32(np.float64(total) + np.float64(acc))


def ffma_sum(a, b):
    acc = np.float32(0)
    for x, y in zip(a, b):
        acc = np.float32(np.float64(acc) + np.float64(x) * np.float64(y))
    return acc


def split(x, rounding=tf32, pieces=2):
    """x as the sum of ``pieces`` values rounded by ``rounding`` (each the rest's rounding)."""
    parts, rest = [], np.asarray(x, np.float32)
    for _ in range(pieces):
        parts.append(rounding(rest))
        rest = (rest - parts[-1]).astype(np.float32)
    return parts


def errors_of(kind, trials, rng):
    n = 128 if kind == "dot" else 512
    ways = {
        "float32 FFMA": None,
        "1 x TF32, rz": ("one", "rz", None),
        "3 x TF32, rn": ("three", "rn", None),
        "3 x TF32, rz": ("three", "rz", None),
        "3 x TF32, rz, fresh 1": ("three", "rz", 1),
        "3 x TF32, rz, fresh 4": ("three", "rz", 4),
        "2 x fp16 (3), rz, fresh 4": ("fp16", "rz", 4),
        "2 x fp16, a x 2^14": ("fp16s", "rz", 4),
        "3 x bf16 (6), rz, fresh 4": ("bf16", "rz", 4),
    }
    if kind == "dot":  # the scaling is for probabilities (at most 1)
        del ways["2 x fp16, a x 2^14"]
    errors = {name: [] for name in ways}
    for _ in range(trials):
        if kind == "dot":
            a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
        elif kind == "softmax":
            s_ = 3 * rng.standard_normal(n)
            a = np.exp(s_ - s_.max()).astype(np.float32)
            b = rng.standard_normal(n).astype(np.float32)
        else:
            a = rng.random(n).astype(np.float32)
            b = rng.standard_normal(n).astype(np.float32)
        exact = float(np.dot(a.astype(np.float64), b.astype(np.float64)))
        scale = float(np.dot(np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64))))
        (a_hi, a_lo), (b_hi, b_lo) = split(a), split(b)
        (h_a, l_a), (h_b, l_b) = split(a, fp16), split(b, fp16)
        # probabilities scaled by 2^14 before the split (p <= 1 stays below
        # float16's 65504), the sum scaled back after: small p keep their second
        # piece normal (unit normals are not scaled: that way is not run on them)
        gain = np.float32(1.0 if kind == "dot" else 2.0**14)
        hs_a, ls_a = (x / gain for x in split(a * gain, fp16))
        a3, b3 = split(a, bf16, 3), split(b, bf16, 3)
        pairs_of = {
            "one": [(a_hi, b_hi)],
            "three": [(a_lo, b_hi), (a_hi, b_lo), (a_hi, b_hi)],
            "fp16": [(l_a, h_b), (h_a, l_b), (h_a, h_b)],
            "fp16s": [(ls_a, h_b), (hs_a, l_b), (hs_a, h_b)],
            "bf16": [(a3[i], b3[j]) for i, j in ((2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0))],
        }
        for name, way in ways.items():
            if way is None:
                value = ffma_sum(a, b)
            else:
                passes, mode, fresh = way
                k = 8 if passes in ("one", "three") else 16  # the model sums exactly
                # per step, so dividing the scaled pieces by 2^14 first is the same
                value = mma_sum(pairs_of[passes], n, mode, fresh and fresh * 8 // k, k)
            errors[name].append(abs(float(value) - exact) / scale)
    return errors


def main(trials=300):
    rng = np.random.default_rng(0)
    for kind in ("dot", "long", "softmax"):
        errors = errors_of(kind, trials, rng)
        base = np.sqrt(np.mean(np.square(errors["float32 FFMA"])))
        print(f"{kind}:")
        for name, errs in errors.items():
            rms = np.sqrt(np.mean(np.square(errs)))
            print(f"  {name:>22}: rms {rms:.3g} ({rms / base:.2f}x FFMA), max {max(errs):.3g}")


if __name__ == "__main__":
    main()
