"""``python -m cuflash.distributed.predictions``: the cost model's tables (the Distributed
page's "Design for many GPUs"): predicted times and memory of ring, Ulysses and hybrid
attention for a range of sequence lengths and GPU counts, or, with ``--check``, the
model next to the 2-GPU measurement. The model itself is
:mod:`cuflash.distributed.cost_model`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace

from .cost_model import GIB, Machine, Problem, calibrate, predict, splits


def _ms(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def prediction_table(
    problem: Problem, seq_lens: Sequence[int], gpu_counts: Sequence[int], machine: Machine
) -> str:
    """The Markdown table :func:`main` prints: one GPU, then each mode that applies."""
    lines = [
        "| S | GPUs | mode | U x R | forward ms | backward ms | exposed ms | speedup | GiB a GPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seq_len in seq_lens:
        p = replace(problem, seq_len=seq_len)
        rows = [("one GPU", predict("ring", p, 1, machine))]
        for gpus in gpu_counts:
            rows.append(("ring", predict("ring", p, gpus, machine)))
            if splits(p, gpus):
                rows.append(("ulysses", predict("ulysses", p, gpus, machine)))
            rows.append(("hybrid", predict("hybrid", p, gpus, machine)))
        for name, r in rows:
            lines.append(
                f"| {seq_len} | {r.gpus} | {name} | {r.ulysses_size} x {r.ring_size} | "
                f"{_ms(r.forward_ms)} | {_ms(r.backward_ms)} | {_ms(r.exposed_ms)} | "
                f"{r.speedup:.1f}x | {r.memory_bytes / GIB:.2f} |"
            )
    return "\n".join(lines)


def calibration_table(machine: Machine) -> str:
    """The Markdown table of :func:`calibrate` (``--check``)."""
    lines = ["| S | quantity | predicted | measured | ratio |", "|---|---|---|---|---|"]
    for c in calibrate(machine):
        lines.append(
            f"| {c.seq_len} | {c.quantity} | {c.predicted:.2f} | {c.measured:.2f} | {c.ratio:.2f} |"
        )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> None:
    """Print the prediction table (or, with ``--check``, the model against the 2-GPU
    measurement); the shape's and the machine's fields are options."""
    parser = argparse.ArgumentParser(
        prog="python -m cuflash.distributed.predictions",
        description="Predicted times and memory of ring, Ulysses and hybrid attention.",
    )
    problem, machine = Problem(), Machine()
    shape = ("heads", "kv_heads", "head_dim", "batch")
    links = ("gpus_per_node", "inter_node_gbs", "nvlink_gbs", "latency_us")
    for name in shape + links:
        default = getattr(problem if name in shape else machine, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    parser.add_argument("--seq-lens", type=_ints, default=[65536, 131072, 262144, 1048576])
    parser.add_argument("--gpus", type=_ints, default=[2, 8, 64, 512])
    parser.add_argument("--check", action="store_true", help="compare with the 2-GPU run")
    options = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
    machine = replace(machine, **{name: options[name] for name in links})
    if options["check"]:
        print(calibration_table(machine))
        return
    problem = replace(problem, **{name: options[name] for name in shape})
    print(prediction_table(problem, options["seq_lens"], options["gpus"], machine))


if __name__ == "__main__":
    main()
