"""Memory of context-parallel attention on virtual ranks: the single call's peak and each
mode's, a rank's share, over one forward and one backward (inputs included).

Usage: python scripts/context_memory.py [--device cpu|gpu] [--ranks 2] [--seq-len 8192]
           [--heads 32] [--kv-heads 8] [--head-dim 128] [--dtype bfloat16]
           [--modes ring,ulysses,hybrid] [--ulysses-size 2]

The ranks are threads of one process (``ThreadGroup``) on one device, so their peaks
add up: a rank's share is the whole group's peak over the number of ranks (the ranks
run in step, so their peaks come at about the same time). On the CPU the NumPy path's
allocations are counted by ``tracemalloc``; on a GPU by CuPy's memory pool. The CPU
figure holds what the ring keeps between its dense calls (its accumulators, the shards
in flight, any pair's results it still holds), not the GPU kernels' own workspaces.
"""

import argparse
import tracemalloc

import numpy as np

import cuflash
from cuflash import distributed as dist
from cuflash.core.problem import DTYPES_BY_NAME

GIB = 2.0**30


def _inputs(xp, args, seed=0):
    rng = np.random.default_rng(seed)
    dtype = DTYPES_BY_NAME[args.dtype]
    shapes = [(1, h, args.seq_len, args.head_dim) for h in (args.heads, args.kv_heads)]
    return [
        xp.asarray(rng.standard_normal(shapes[i], dtype=np.float32).astype(dtype))
        for i in (0, 1, 1, 0)
    ]


def _peak_bytes(device, call):
    """The peak bytes ``call()`` allocates beyond what exists before it, results
    included until it returns."""
    if device == "cpu":
        tracemalloc.start()
        try:
            result = call()
            del result
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    from cuflash.bench import pool_growth_bytes

    return pool_growth_bytes(call)


def _single(args, xp):
    def call():
        q, k, v, dout = _inputs(xp, args)
        out, lse = cuflash.flash_attention_fwd(
            q, k, v, args.heads, args.kv_heads, args.head_dim, True
        )
        grads = cuflash.flash_attention_bwd(
            dout, q, k, v, out, lse, args.heads, args.kv_heads, args.head_dim, True
        )
        return out, lse, grads

    return call


def _mode(args, xp, mode):
    vjp = {
        "ring": dist.ring_attention_vjp,
        "ulysses": dist.ulysses_attention_vjp,
        "hybrid": dist.hybrid_attention_vjp,
    }[mode]
    options = {"ulysses_size": args.ulysses_size} if mode == "hybrid" else {}

    def rank(group, q, k, v, dout):
        out, residuals = vjp(
            q, k, v, args.heads, args.kv_heads, args.head_dim, True, group=group, **options
        )
        return out, residuals(dout)

    def call():
        shards = [
            tuple(dist.shard(x, "zigzag", r, args.ranks) for x in _inputs(xp, args))
            for r in range(args.ranks)
        ]
        results = dist.ThreadGroup(args.ranks).run(rank, shards)
        return shards, results

    return call


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=8192, help="the whole sequence")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES_BY_NAME))
    parser.add_argument("--modes", default="ring,ulysses,hybrid")
    parser.add_argument("--ulysses-size", type=int, default=None)
    args = parser.parse_args(argv)
    if args.device == "gpu":
        import cupy as xp
    else:
        xp = np
    single = _peak_bytes(args.device, _single(args, xp))
    print(
        f"{args.device}: S = {args.seq_len}, H = {args.heads}, H_kv = {args.kv_heads}, "
        f"D = {args.head_dim}, {args.dtype}, causal, {args.ranks} virtual ranks"
    )
    print("| mode | GiB one call | GiB a rank | a rank / one call |")
    print("|---|---|---|---|")
    for mode in args.modes.split(","):
        share = _peak_bytes(args.device, _mode(args, xp, mode)) / args.ranks
        print(f"| {mode} | {single / GIB:.3f} | {share / GIB:.3f} | {share / single:.3f} |")


if __name__ == "__main__":
    main()
