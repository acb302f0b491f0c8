"""What the model-shape features cost on the GPU, each against the same call without it.

Usage: python scripts/feature_costs.py [sinks] [rotary]
- sinks: gpt-oss-like attention (bfloat16, H = 64, H_kv = 8, D = 64, S = 4096, causal,
  B * S = 16384), with and without a 128-key window, forward and backward, with and
  without ``sinks`` (target: at most 3 % slower).
- rotary: one decoding step (bfloat16, B = 64, L = 4096, H = 32, H_kv = 8, D = 128, one
  new token appended), with and without the rotary tables, contiguous and paged (64-key
  blocks) (target: at most 5 % slower).
Medians of CUDA-event timings (``cuflash.bench.time_calls``, 0.3 s of calls a row).
"""

import sys

import cupy

import cuflash
from cuflash.bench import time_calls
from cuflash.bench.decode import DecodeCase, make_decode_sets, paged_input_set
from cuflash.core.problem import BFLOAT16


def median_us(fn):
    return time_calls([fn], 0.3).median * 1e6


def sinks():
    b, h, h_kv, s, d = 4, 64, 8, 4096, 64
    rng = cupy.random.default_rng(0)
    q, do = (rng.standard_normal((b, h, s, d), dtype=cupy.float32).astype(BFLOAT16) for _ in "qd")
    k, v = (rng.standard_normal((b, h_kv, s, d), dtype=cupy.float32).astype(BFLOAT16) for _ in "kv")
    logits = rng.standard_normal(h, dtype=cupy.float32)
    print(f"{'window':>7} {'sinks':>6} | {'fwd us':>9} {'bwd us':>9}")
    for window in (0, (128, 0)):
        times = {}
        for with_sinks in (False, True):
            kw = dict(window_size=window, sinks=logits if with_sinks else None)
            fwd = median_us(lambda: cuflash.flash_attention_fwd(q, k, v, h, h_kv, d, True, **kw))
            out, lse = cuflash.flash_attention_fwd(q, k, v, h, h_kv, d, True, **kw)
            bwd = median_us(
                lambda: cuflash.flash_attention_bwd(do, q, k, v, out, lse, h, h_kv, d, True, **kw)
            )
            times[with_sinks] = (fwd, bwd)
            print(f"{str(window):>7} {str(with_sinks):>6} | {fwd:9.1f} {bwd:9.1f}")
        (f0, b0), (f1, b1) = times[False], times[True]
        print(f"  sinks cost: forward {f1 / f0 - 1:+.1%}, backward {b1 / b0 - 1:+.1%}")


def rotary():
    print(f"{'layout':>10} {'rotary':>6} | {'step us':>9}")
    for block_size in (0, 64):
        times = {}
        for with_rotary in (False, True):
            case = DecodeCase(64, 4096, new_len=1, rotary=with_rotary)
            (x,) = make_decode_sets(case, 1)
            if block_size:
                x = paged_input_set(x, block_size)
            extra = {
                name: getattr(x, name)
                for name in ("k_new", "v_new", "rotary_cos", "rotary_sin")
                if getattr(x, name) is not None
            }
            seqlens = x.cache_seqlens

            def step(x=x, extra=extra, seqlens=seqlens):
                # the same position each call: the append overwrites the row it wrote
                return cuflash.flash_attention_with_kvcache(
                    x.q,
                    x.k_cache,
                    x.v_cache,
                    case.heads,
                    case.kv_heads,
                    case.head_dim,
                    True,
                    cache_seqlens=seqlens,
                    block_table=x.block_table,
                    **extra,
                )

            times[with_rotary] = median_us(step)
            layout = "contiguous" if not block_size else f"paged {block_size}"
            print(f"{layout:>10} {str(with_rotary):>6} | {times[with_rotary]:9.1f}")
        print(f"  rotary cost: {times[True] / times[False] - 1:+.1%}")


if __name__ == "__main__":
    parts = sys.argv[1:] or ["sinks", "rotary"]
    for part in parts:
        {"sinks": sinks, "rotary": rotary}[part]()
