"""The FP8 forward's 64 class (D <= 64) with two and with three consumers
(``cuflash.gpu.tile_traits.FP8_CONSUMERS_64``), beside cuDNN's FP8 attention and the
bfloat16 call, on ``python -m cuflash.bench --fp8``'s cases.

Usage: python scripts/fp8_variants.py [HEAD_DIMS [SEQLENS]]
  (default: 32,64 and 2048,8192,16384; causal and not)
Each count runs in a process of its own: a process keeps each variant's kernel names
(``kernel_build.Variant.kernel_names``, their template arguments the traits') once built.
"""

import subprocess
import sys

from cuflash.bench.environment import cupy
from cuflash.bench.fp8 import format_fp8, fp8_cases, fp8_report
from cuflash.bench.timing import Budget
from cuflash.gpu import tile_traits


def measure(consumers, head_dims, seqlens):
    """The table of one count, in this process."""
    tile_traits.FP8_CONSUMERS_64 = consumers
    cases = fp8_cases(head_dims, seqlens)
    l2_bytes = cupy.cuda.runtime.getDeviceProperties(0)["l2CacheSize"]
    records = fp8_report(Budget(40, 0.2), l2_bytes, cases)
    print(f"\n#### FP8 64 class: {consumers} consumers\n")
    print(format_fp8(records), flush=True)


def _ints(text):
    return tuple(int(x) for x in text.split(","))


def main(argv):
    if argv[:1] == ["--consumers"]:
        consumers, head_dims, seqlens = argv[1:4]
        measure(int(consumers), _ints(head_dims), _ints(seqlens))
        return
    head_dims = argv[0] if argv else "32,64"
    seqlens = argv[1] if len(argv) > 1 else "2048,8192,16384"
    for consumers in (2, 3):
        command = [sys.executable, __file__, "--consumers", str(consumers), head_dims, seqlens]
        subprocess.run(command, check=True)


if __name__ == "__main__":
    main(sys.argv[1:])
