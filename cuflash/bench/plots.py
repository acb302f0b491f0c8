"""PNG plots of a report: TFLOP/s against S (a file per dtype and direction), peak memory."""

import sys
from pathlib import Path

from .cases import DIRECTIONS, HIDDEN, TOKENS


def _pyplot():
    """matplotlib's pyplot on the Agg backend, or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("cuflash.bench: matplotlib is not installed; no plots written", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(measurements, directory):
    """One PNG per (dtype, direction): TFLOP/s against S, a panel per (D, causal)."""
    plt = _pyplot()
    if plt is None:
        return []
    paths = []
    for dtype in dict.fromkeys(m.case.dtype for m in measurements):
        for direction in DIRECTIONS:
            rows = [
                m
                for m in measurements
                if m.case.dtype == dtype and m.direction == direction and m.tflops is not None
            ]
            if rows:
                paths.append(
                    _plot_panels(plt, rows, Path(directory) / f"throughput-{dtype}-{direction}.png")
                )
    return paths


def _plot_panels(plt, rows, path):
    head_dims = sorted({m.case.head_dim for m in rows})
    fig, axes = plt.subplots(
        len(head_dims), 2, figsize=(11, 3.4 * len(head_dims)), squeeze=False, sharex=True
    )
    for (row, head_dim), (col, causal) in (
        (r, c) for r in enumerate(head_dims) for c in enumerate((False, True))
    ):
        ax = axes[row][col]
        panel = [m for m in rows if m.case.head_dim == head_dim and m.case.causal == causal]
        for impl in dict.fromkeys(m.impl for m in rows):
            points = sorted((m.case.seqlen, m.tflops) for m in panel if m.impl == impl)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={head_dim}, causal={causal}")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("sequence length S")
    axes[0][0].legend(fontsize="small")
    first = rows[0]
    fig.suptitle(
        f"{first.case.dtype} {'forward' if first.direction == 'fwd' else 'backward'}"
        f" (B*S={TOKENS}, H={HIDDEN}/D)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_memory(records, directory):
    """``memory.png``: peak extra forward memory against S; OOM noted in the legend."""
    plt = _pyplot()
    if plt is None or not records:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl in dict.fromkeys(r["impl"] for r in records):
        mine = [r for r in records if r["impl"] == impl]
        points = [
            (r["seqlen"], r["peak_bytes"] / 2**30) for r in mine if r["peak_bytes"] is not None
        ]
        failed = [r for r in mine if r["peak_bytes"] is None]
        label = impl + (f" ({failed[0]['note']} from S={failed[0]['seqlen']})" if failed else "")
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("peak extra memory (GiB)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = Path(directory) / "memory.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
