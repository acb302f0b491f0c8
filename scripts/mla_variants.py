"""Absorbed-MLA decoding with each kernel choice, on the cases of ``python -m cuflash.bench
--mla-decode``, in one process.

Usage:
  python scripts/mla_variants.py [KEYS ...]   kvcache_decode_mla with each tile of keys:
      the default (``cuflash.gpu.decode_tiles.decode_mla_keys``) and each forced size
      (default: 64 32 16), on four of the eight cases, kvcache_decode_mla_wgmma off
  python scripts/mla_variants.py --wgmma      all eight cases with kvcache_decode_mla_wgmma
      off, at the default rule (``MLA_WGMMA_MIN_ROWS`` packed query rows or more) and from
      64 rows (the 16-head cases on kvcache_decode_mla)
  python scripts/mla_variants.py --once B H L  one step of that case (after a warm-up one),
      for a profiler (Nsight Compute's first launch of the decode kernel)
The launch plans are dropped between variants (a cached plan keeps its kernel).
"""

import sys

from cuflash.bench.mla_decode import (
    MLA_DECODE_CASES,
    MlaDecodeCase,
    format_mla_decode,
    mla_decode_report,
    mla_decode_step,
)
from cuflash.bench.timing import Budget
from cuflash.gpu import decode_kernels, plans

# Memory-bound and compute-bound, short and long: four of the eight.
CASES = tuple(MLA_DECODE_CASES[i] for i in (1, 2, 5, 6))
NEVER = 1 << 30


def _report(title, cases):
    plans.clear()
    records = mla_decode_report(Budget(24, 0.3), cases)
    print(f"\n#### {title}\n")
    print(format_mla_decode(records))


def main(argv):
    chosen_keys, chosen_rows = decode_kernels.decode_mla_keys, decode_kernels.MLA_WGMMA_MIN_ROWS
    try:
        if argv[:1] == ["--once"]:
            step = mla_decode_step(MlaDecodeCase(*map(int, argv[1:4])))
            step()
            step()
            return
        if argv == ["--wgmma"]:
            for rows, title in (
                (NEVER, "kvcache_decode_mla (wgmma off)"),
                (chosen_rows, f"default: kvcache_decode_mla_wgmma from {chosen_rows} rows"),
                (64, "kvcache_decode_mla_wgmma from 64 rows"),
            ):
                decode_kernels.MLA_WGMMA_MIN_ROWS = rows
                _report(title, MLA_DECODE_CASES)
            return
        decode_kernels.MLA_WGMMA_MIN_ROWS = NEVER
        for keys in [int(a) for a in argv] or [64, 32, 16]:
            decode_kernels.decode_mla_keys = lambda *args, keys=keys: keys
            _report(f"kvcache_decode_mla, {keys} keys a tile", CASES)
    finally:
        decode_kernels.decode_mla_keys = chosen_keys
        decode_kernels.MLA_WGMMA_MIN_ROWS = chosen_rows


if __name__ == "__main__":
    main(sys.argv[1:])
