"""The FP8 forward with two consumers at every head dim and with three up to D = 96
(``cuflash.gpu.tile_traits.FP8_THREE_CONSUMERS_TO``), beside cuDNN's FP8 attention and
the bfloat16 call, on ``python -m cuflash.bench --fp8``'s cases.

Usage: python scripts/fp8_variants.py [HEAD_DIMS [SEQLENS]]
  (default: 32,64,80,96 and 2048,8192,16384; causal and not)
Each count runs in a process of its own: a process keeps each variant's kernel names
(``kernel_build.Variant.kernel_names``, their template arguments the traits') once built.
"""

import subprocess
import sys

from cuflash.bench.environment import cupy
from cuflash.bench.fp8 import format_fp8, fp8_cases, fp8_report
from cuflash.bench.timing import Budget
from cuflash.gpu import tile_traits


def measure(three_to, head_dims, seqlens):
    """The table with three consumers up to D = three_to, in this process."""
    tile_traits.FP8_THREE_CONSUMERS_TO = three_to
    cases = fp8_cases(head_dims, seqlens)
    l2_bytes = cupy.cuda.runtime.getDeviceProperties(0)["l2CacheSize"]
    records = fp8_report(Budget(40, 0.2), l2_bytes, cases)
    print(f"\n#### FP8: three consumers up to D = {three_to}, two above\n")
    print(format_fp8(records), flush=True)


def _ints(text):
    return tuple(int(x) for x in text.split(","))


def main(argv):
    if argv[:1] == ["--three-to"]:
        three_to, head_dims, seqlens = argv[1:4]
        measure(int(three_to), _ints(head_dims), _ints(seqlens))
        return
    head_dims = argv[0] if argv else "32,64,80,96"
    seqlens = argv[1] if len(argv) > 1 else "2048,8192,16384"
    for three_to in (0, 96):
        command = [sys.executable, __file__, "--three-to", str(three_to), head_dims, seqlens]
        subprocess.run(command, check=True)


if __name__ == "__main__":
    main(sys.argv[1:])
