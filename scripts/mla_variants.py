"""Absorbed-MLA decoding with each tile of keys of kvcache_decode_mla: the default
(``cuflash.gpu.decode_tiles.decode_mla_keys``) and each forced size, on the cases of
``python -m cuflash.bench --mla-decode``, in one process.

Usage: python scripts/mla_variants.py [KEYS ...]   (default: 64 32 16)
The launch plans are dropped between sizes (a cached plan keeps its tile).
"""

import sys

from cuflash.bench.mla_decode import MLA_DECODE_CASES, format_mla_decode, mla_decode_report
from cuflash.bench.timing import Budget
from cuflash.gpu import decode_kernels, plans

# Memory-bound and compute-bound, short and long: four of the eight.
CASES = tuple(MLA_DECODE_CASES[i] for i in (1, 2, 5, 6))


def main(argv):
    sizes = [int(a) for a in argv] or [64, 32, 16]
    chosen = decode_kernels.decode_mla_keys
    for keys in sizes:
        decode_kernels.decode_mla_keys = lambda *args, keys=keys: keys
        plans.clear()
        records = mla_decode_report(Budget(24, 0.3), CASES)
        print(f"\n#### {keys} keys a tile\n")
        print(format_mla_decode(records))
    decode_kernels.decode_mla_keys = chosen


if __name__ == "__main__":
    main(sys.argv[1:])
