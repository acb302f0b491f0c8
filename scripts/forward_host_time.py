"""Host time of a small forward call on the warp-specialized kernel (D = 128), with the
same arrays every call (the tensor maps encoded once) and with two sets of arrays in
turn (the maps encoded at every call): wall microseconds a call over ``--calls``.

Usage: python scripts/forward_host_time.py [--calls 2000]   (CUFLASH_TMA=0: cp.async)
"""

import argparse
import time

import cupy
import ml_dtypes
import numpy as np

import cuflash


def per_call_us(calls, sets):
    for q, k, v in sets:  # plans made, kernels loaded
        cuflash.flash_attention_fwd(q, k, v, 1, 1, 128)
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for i in range(calls):
        q, k, v = sets[i % len(sets)]
        cuflash.flash_attention_fwd(q, k, v, 1, 1, 128)
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    calls = parser.parse_args().calls
    rng = np.random.default_rng(0)

    def inputs():
        shape = (1, 1, 16, 128)
        return [cupy.asarray(rng.standard_normal(shape).astype(ml_dtypes.bfloat16)) for _ in "qkv"]

    one, two = [inputs()], [inputs(), inputs()]
    print(f"same arrays: {per_call_us(calls, one):.1f} us a call")
    print(f"two sets in turn: {per_call_us(calls, two):.1f} us a call")


if __name__ == "__main__":
    main()
