"""The grid: ``B * S = 16384`` tokens and ``H = 2048 / D`` heads for every dtype, head dim,
causal flag and S; its defaults and its TFLOP/s table (cuflash next to each peer)."""

from .formatting import format_agreement, format_notes, format_tflops
from .implementations import CuflashAttention

DEFAULT_DTYPES = ("bfloat16", "float16")
DEFAULT_HEAD_DIMS = (64, 128, 256)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_DTYPES = ("bfloat16",)
QUICK_HEAD_DIMS = (64, 128)
QUICK_SEQLENS = (512, 2048)


def _cell(measurement, baseline):
    """Table cell: TFLOP/s, and for a peer the ratio cuflash / peer."""
    if measurement is None or measurement.tflops is None:
        return "–"
    text = format_tflops(measurement.tflops)
    if (
        measurement.impl != CuflashAttention.name
        and baseline is not None
        and baseline.tflops is not None
    ):
        text += f" ({baseline.tflops / measurement.tflops:.2f}x)"
    return text


def format_throughput_table(measurements, dtype, direction):
    """A Markdown table of TFLOP/s for one dtype and direction, with its notes."""
    rows = [m for m in measurements if m.case.dtype == dtype and m.direction == direction]
    impls = list(dict.fromkeys(m.impl for m in rows))
    by_key = {(m.case, m.impl): m for m in rows}
    cases = sorted({m.case for m in rows}, key=lambda c: (c.head_dim, c.causal, c.seqlen))
    title = {"fwd": "Forward", "bwd": "Backward"}[direction]
    lines = [
        f"### {title}, {dtype}: TFLOP/s (peer cells: cuflash / peer)",
        "",
        "| D | S | causal | B | H | " + " | ".join(impls) + " |",
        "|---|---|---|---|---|" + "---|" * len(impls),
    ]
    for case in cases:
        baseline = by_key.get((case, CuflashAttention.name))
        cells = [_cell(by_key.get((case, impl)), baseline) for impl in impls]
        lines.append(
            f"| {case.head_dim} | {case.seqlen} | {case.causal} | {case.batch} | "
            f"{case.heads} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines + format_agreement(rows) + format_notes(rows))
