"""The FP8 page's accuracy table: relative errors of the FP8 (e4m3) forward against the
float64 oracle, on unit normal inputs and on inputs with outliers (0.1 % of the entries
20x larger), quantized with per-(batch, KV head) descales (``cuflash.fp8.quantize``).

Three errors a row: the FP8 path's own (against the oracle on the dequantized inputs,
the contract's measure), FP8's whole error against the oracle on the inputs before
quantization (what storing them in e4m3 costs), and for comparison the bfloat16 path's
on the same inputs rounded to bfloat16.

``--decode``: the same for a decoding step (one query row a head over an FP8 cache of
DECODE_KEYS keys, ``flash_attention_with_kvcache``), q in bfloat16 or e4m3, the
bfloat16 column a bfloat16 cache of the same values.

Usage: python scripts/fp8_accuracy.py [--gpu] [--decode]   (--gpu: CuPy arrays, the GPU path)
"""

import argparse
import sys

import numpy as np

import cuflash
from cuflash import fp8
from cuflash.core.problem import BFLOAT16
from cuflash.reference import attention_reference

sys.path.insert(0, "tests")
from support import rel_error  # noqa: E402

BATCH, HEADS, KV_HEADS, LENGTH, HEAD_DIM = 2, 8, 2, 256, 128
OUT_DTYPES = (("bfloat16", BFLOAT16), ("float16", np.float16), ("float32", np.float32))
DECODE_KEYS = 4096


def inputs(rng, outliers):
    """Unit normal q, k, v ``[B, H, S, D]`` (k, v with KV_HEADS), float64."""
    arrays = []
    for heads in (HEADS, KV_HEADS, KV_HEADS):
        x = rng.standard_normal((BATCH, heads, LENGTH, HEAD_DIM))
        if outliers:
            picked = rng.choice(x.size, max(1, x.size // 1000), replace=False)
            x.flat[picked] *= 20
        arrays.append(x)
    return arrays


def dequantized(values, descale, heads):
    """float64 ``values * descale`` of a ``[B, H_kv]`` descale spread over ``heads``."""
    rows = np.repeat(descale.astype(np.float64), heads // descale.shape[1], axis=1)
    return values.astype(np.float64) * rows[:, :, None, None]


def measure(xp, outliers, causal, rng):
    """One table row a output dtype: (inputs, causal, out_dtype, path, fp8 total, bf16)."""
    exact = inputs(rng, outliers)
    quantized = [fp8.quantize(x, KV_HEADS) for x in exact]
    true_values = [dequantized(v, d, v.shape[1]) for v, d in quantized]
    ref_fp8, _ = attention_reference(*true_values, causal)
    ref_exact, _ = attention_reference(*exact, causal)
    bf16 = [xp.asarray(x.astype(BFLOAT16)) for x in exact]
    out_bf16, _ = cuflash.flash_attention_fwd(*bf16, HEADS, KV_HEADS, HEAD_DIM, causal)
    bf16_error = rel_error(out_bf16, ref_exact)
    rows = []
    for name, dtype in OUT_DTYPES:
        out, _ = cuflash.flash_attention_fwd(
            *(xp.asarray(v.view(np.uint8)) for v, _ in quantized),
            HEADS,
            KV_HEADS,
            HEAD_DIM,
            causal,
            fp8_format="e4m3",
            q_descale=xp.asarray(quantized[0][1]),
            k_descale=xp.asarray(quantized[1][1]),
            v_descale=xp.asarray(quantized[2][1]),
            out_dtype=dtype,
        )
        rows.append((name, rel_error(out, ref_fp8), rel_error(out, ref_exact), bf16_error))
    return rows


def _outliers(x, rng):
    picked = rng.choice(x.size, max(1, x.size // 1000), replace=False)
    x.flat[picked] *= 20
    return x


def measure_decode(xp, outliers, q_kind, rng):
    """One table row a output dtype of a decoding step: (q kind, out_dtype, path, fp8
    total, bf16)."""
    shapes = ((BATCH, HEADS, 1, HEAD_DIM),) + ((BATCH, KV_HEADS, DECODE_KEYS, HEAD_DIM),) * 2
    exact = [rng.standard_normal(shape) for shape in shapes]
    if outliers:
        exact = [_outliers(x, rng) for x in exact]
    caches = [fp8.quantize(x, KV_HEADS) for x in exact[1:]]
    if q_kind == "e4m3":
        q_values, q_descale = fp8.quantize(exact[0], KV_HEADS)
        q_true = dequantized(q_values, q_descale, HEADS)
        q_given, q_descale = xp.asarray(q_values.view(np.uint8)), xp.asarray(q_descale)
    else:
        q_true = exact[0].astype(BFLOAT16).astype(np.float64)
        q_given, q_descale = xp.asarray(exact[0].astype(BFLOAT16)), None
    true_caches = [dequantized(v, d, KV_HEADS) for v, d in caches]
    ref_fp8, _ = attention_reference(q_true, *true_caches, True)
    ref_exact, _ = attention_reference(*exact, True)
    bf16 = [xp.asarray(x.astype(BFLOAT16)) for x in exact]
    out_bf16 = cuflash.flash_attention_with_kvcache(
        *bf16, HEADS, KV_HEADS, HEAD_DIM, cache_seqlens=DECODE_KEYS
    )
    bf16_error = rel_error(out_bf16, ref_exact)
    rows = []
    for name, dtype in OUT_DTYPES:
        out = cuflash.flash_attention_with_kvcache(
            q_given,
            *(xp.asarray(v.view(np.uint8)) for v, _ in caches),
            HEADS,
            KV_HEADS,
            HEAD_DIM,
            cache_seqlens=DECODE_KEYS,
            fp8_format="e4m3",
            q_descale=q_descale,
            k_descale=xp.asarray(caches[0][1]),
            v_descale=xp.asarray(caches[1][1]),
            out_dtype=dtype,
        )
        rows.append((name, rel_error(out, ref_fp8), rel_error(out, ref_exact), bf16_error))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="CuPy arrays (the GPU path)")
    parser.add_argument("--decode", action="store_true", help="a decoding step over a cache")
    args = parser.parse_args()
    if args.gpu:
        import cupy as xp
    else:
        xp = np
    rng = np.random.default_rng(34)
    if args.decode:
        print(
            f"B={BATCH} H={HEADS} H_kv={KV_HEADS} one query row over {DECODE_KEYS} keys "
            f"D={HEAD_DIM}, {'GPU' if args.gpu else 'CPU'} path"
        )
        print("| inputs | q | out_dtype | FP8 path | FP8 vs unquantized | bfloat16 cache |")
        print("|---|---|---|---|---|---|")
        for outliers in (False, True):
            for q_kind in ("bfloat16", "e4m3"):
                for name, own, total, bf16 in measure_decode(xp, outliers, q_kind, rng):
                    kind = "outliers" if outliers else "normal"
                    print(f"| {kind} | {q_kind} | {name} | {own:.1e} | {total:.1e} | {bf16:.1e} |")
        return
    print(
        f"B={BATCH} H={HEADS} H_kv={KV_HEADS} S={LENGTH} D={HEAD_DIM}, "
        f"{'GPU' if args.gpu else 'CPU'} path"
    )
    print("| inputs | causal | out_dtype | FP8 path | FP8 vs unquantized | bfloat16 inputs |")
    print("|---|---|---|---|---|---|")
    for outliers in (False, True):
        for causal in (False, True):
            for name, own, total, bf16 in measure(xp, outliers, causal, rng):
                kind = "outliers" if outliers else "normal"
                print(f"| {kind} | {causal} | {name} | {own:.1e} | {total:.1e} | {bf16:.1e} |")


if __name__ == "__main__":
    main()
