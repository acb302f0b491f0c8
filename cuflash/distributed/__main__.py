"""``python -m cuflash.distributed``: context-parallel attention (``--mode ring``,
``ulysses`` or ``hybrid``) on every visible GPU (one process each, over NCCL), checked
against the single-GPU call on the whole sequence, timed next to it, with each GPU's
peak memory.

Started plainly it launches one process a GPU itself; started by torchrun or mpirun
(one process a GPU) each rank joins the group their environment names and prints its
own line.
"""

import argparse
import json
import os
import sys

from .demo import RingCase, launch, run_rank
from .groups import NcclGroup


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m cuflash.distributed", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--seq-lens",
        default="65536,131072",
        help="whole-sequence lengths, comma-separated (default %(default)s)",
    )
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument(
        "--mode",
        default="ring",
        choices=("ring", "ulysses", "hybrid"),
        help="how the sequence is split over the GPUs (default %(default)s)",
    )
    parser.add_argument(
        "--ulysses-size",
        type=int,
        default=None,
        help="the hybrid's all-to-all group (GPUs; default: the cost model's rule)",
    )
    parser.add_argument(
        "--gpus", type=int, default=None, help="processes to launch (default: every visible GPU)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed calls a median")
    parser.add_argument("--json", default=None, help="write every rank's records here")
    return parser.parse_args(argv)


def _table(per_rank, size, mode):
    gib = 2.0**30
    lines = [
        f"{mode} attention on {size} GPU(s) against one GPU (milliseconds, the slowest rank)",
        f"| S | one GPU fwd / bwd | {mode} fwd / bwd | ratio fwd / bwd | {mode} kernels only "
        f"fwd / bwd | transfers a step K,V / dK,dV | GiB a GPU: one / {mode} | max error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for index, first in enumerate(per_rank[0]):
        timings = [rank[index]["timings"] for rank in per_rank]

        def worst(key, timings=timings):
            return max(t[key] for t in timings)

        single = (worst("single_fwd_ms"), worst("single_bwd_ms"))
        ring = (worst("cp_fwd_ms"), worst("cp_bwd_ms"))
        error = max(
            max(v for k, v in rank[index]["errors"].items() if k != "repeat") for rank in per_rank
        )
        passed = all(rank[index]["passed"] for rank in per_rank)
        lines.append(
            f"| {first['case']['seq_len']} | {single[0]:.1f} / {single[1]:.1f} | "
            f"{ring[0]:.1f} / {ring[1]:.1f} | {ring[0] / single[0]:.3f} / "
            f"{ring[1] / single[1]:.3f} | {worst('kernels_only_fwd_ms'):.1f} / "
            f"{worst('kernels_only_bwd_ms'):.1f} | {worst('transfer_kv_ms'):.2f} / "
            f"{worst('transfer_dkdv_ms'):.2f} | {worst('single_peak_bytes') / gib:.2f} / "
            f"{worst('cp_peak_bytes') / gib:.2f} | {error:.1e}"
            f"{'' if passed else ' FAILED'} |"
        )
    return "\n".join(lines)


def _rank_table(per_rank, mode):
    """Each rank's times, peak memory and errors (the slowest-rank table's inputs)."""
    gib = 2.0**30
    lines = [
        "",
        "rank by rank (milliseconds; GiB; relative errors, the lse's absolute)",
        f"| rank | S | one GPU fwd / bwd | {mode} fwd / bwd | GiB one / {mode} | "
        "errors out / lse / dq / dk / dv |",
        "|---|---|---|---|---|---|",
    ]
    for rank, records in enumerate(per_rank):
        for record in records:
            t, e = record["timings"], record["errors"]
            errors = " / ".join(f"{e[name]:.1e}" for name in ("out", "lse", "dq", "dk", "dv"))
            lines.append(
                f"| {rank} | {record['case']['seq_len']} | {t['single_fwd_ms']:.1f} / "
                f"{t['single_bwd_ms']:.1f} | {t['cp_fwd_ms']:.1f} / {t['cp_bwd_ms']:.1f} | "
                f"{t['single_peak_bytes'] / gib:.2f} / {t['cp_peak_bytes'] / gib:.2f} | "
                f"{errors} |"
            )
    return "\n".join(lines)


def main(argv=None):
    options = _parse(sys.argv[1:] if argv is None else argv)
    cases = [
        RingCase(
            seq_len=int(s),
            heads=options.heads,
            kv_heads=options.kv_heads,
            head_dim=options.head_dim,
            causal=not options.no_causal,
            layout=options.layout,
            dtype=options.dtype,
            mode=options.mode,
            ulysses_size=options.ulysses_size,
        )
        for s in options.seq_lens.split(",")
    ]
    env = os.environ
    if "RANK" in env or "OMPI_COMM_WORLD_RANK" in env:
        group = NcclGroup.from_environment()
        records = run_rank(group, cases, options.repeats)
        print(json.dumps({"rank": group.rank, "records": records}), flush=True)
        return 0 if all(r["passed"] for r in records) else 1
    import cupy

    size = options.gpus or cupy.cuda.runtime.getDeviceCount()
    per_rank = launch(run_rank, size, cases, options.repeats)
    print(_table(per_rank, size, options.mode))
    print(_rank_table(per_rank, options.mode))
    if options.json:
        with open(options.json, "w") as f:
            json.dump(per_rank, f, indent=1)
    return 0 if all(r["passed"] for rank in per_rank for r in rank) else 1


if __name__ == "__main__":
    sys.exit(main())
