"""The head-dim sweep (``--head-dim-sweep``): every head dim, S 1024 and 4096, causal and
not, on the grid's shapes, against torch flash and cuDNN (float32: efficient)."""

from .cases import DIRECTIONS, build_grid
from .formatting import format_agreement, format_notes, format_ratio, format_tflops
from .implementations import CuflashAttention, implementation_factories
from .measure import Measurement, run_grid

# Head-dim sweep (issue 14): B * S = 16384 and H = max(1, 2048 // D) as in the grid.
SWEEP_DTYPES = ("bfloat16", "float16", "float32")
SWEEP_HEAD_DIMS = (32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
FLOAT32_SWEEP_HEAD_DIMS = (32, 64, 96, 128, 160, 256)
SWEEP_SEQLENS = (1024, 4096)
SWEEP_PEERS = ("FLASH_ATTENTION", "CUDNN_ATTENTION")
FLOAT32_SWEEP_PEERS = ("EFFICIENT_ATTENTION",)
SWEEP_TARGET = ("torch-flash", 1.0)  # cuflash / peer TFLOP/s at least this
FLOAT32_SWEEP_TARGET = ("torch-efficient", 2.0)


def sweep_peer_backends(dtype):
    """The torch backends a head-dim sweep case of ``dtype`` is compared with."""
    return FLOAT32_SWEEP_PEERS if dtype == "float32" else SWEEP_PEERS


def sweep_target(dtype):
    """``(peer, ratio)``: the sweep's target is cuflash / peer >= ratio."""
    return FLOAT32_SWEEP_TARGET if dtype == "float32" else SWEEP_TARGET


def head_dim_sweep_cases(dtypes, head_dims=None, seqlens=None):
    """The head-dim sweep: every dtype, head dim, causal flag and S with B*S and H*D fixed.

    Without ``head_dims``, 16-bit dtypes take ``SWEEP_HEAD_DIMS`` and float32
    ``FLOAT32_SWEEP_HEAD_DIMS``; without ``seqlens``, ``SWEEP_SEQLENS``.
    """
    cases = []
    for dtype in dtypes:
        dims = head_dims or (FLOAT32_SWEEP_HEAD_DIMS if dtype == "float32" else SWEEP_HEAD_DIMS)
        cases += build_grid([dtype], dims, seqlens or SWEEP_SEQLENS)
    return cases


def head_dim_sweep(cases, torch, allow_tf32, budget, l2_bytes):
    """cuflash and torch's peers of each dtype (``sweep_peer_backends``) on ``cases``."""
    factories = {
        dtype: implementation_factories(torch, allow_tf32, sweep_peer_backends(dtype), naive=False)
        for dtype in dict.fromkeys(c.dtype for c in cases)
    }
    return run_grid(cases, lambda case: factories[case.dtype], budget, l2_bytes, torch)


def _ratio(measurement, peer):
    """cuflash's throughput over ``peer``'s (peer time / cuflash time), or None."""
    if measurement is None or peer is None or measurement.seconds is None or peer.seconds is None:
        return None
    return peer.seconds / measurement.seconds


def _case_label(case):
    return f"D={case.head_dim} S={case.seqlen}{' causal' if case.causal else ''}"


def format_head_dim_sweep_table(measurements, dtype, direction):
    """Head-dim sweep, one dtype and direction: TFLOP/s, cuflash / peer, cases below target."""
    rows = [m for m in measurements if m.case.dtype == dtype and m.direction == direction]
    impls = list(dict.fromkeys(m.impl for m in rows))
    peers = [impl for impl in impls if impl != CuflashAttention.name]
    by_key = {(m.case, m.impl): m for m in rows}
    cases = sorted({m.case for m in rows}, key=lambda c: (c.head_dim, c.causal, c.seqlen))
    target_peer, target_ratio = sweep_target(dtype)
    title = {"fwd": "forward", "bwd": "backward"}[direction]
    lines = [
        f"### Head-dim sweep, {title}, {dtype}: TFLOP/s and cuflash / peer "
        f"(target: cuflash / {target_peer} >= {target_ratio:g})",
        "",
        "| D | S | causal | B | H | "
        + " | ".join(impls)
        + " | "
        + " | ".join(f"cuflash / {peer}" for peer in peers)
        + " |",
        "|---|---|---|---|---|" + "---|" * (len(impls) + len(peers)),
    ]
    below, target_measured = [], False
    for case in cases:
        baseline = by_key.get((case, CuflashAttention.name))
        throughput = [by_key.get((case, impl)) for impl in impls]
        ratios = {peer: _ratio(baseline, by_key.get((case, peer))) for peer in peers}
        lines.append(
            f"| {case.head_dim} | {case.seqlen} | {case.causal} | {case.batch} | "
            f"{case.heads} | "
            + " | ".join(
                "–" if m is None or m.tflops is None else format_tflops(m.tflops)
                for m in throughput
            )
            + " | "
            + " | ".join(format_ratio(r) for r in ratios.values())
            + " |"
        )
        ratio = ratios.get(target_peer)
        target_measured = target_measured or ratio is not None
        if ratio is not None and ratio < target_ratio:
            below.append(f"{_case_label(case)} ({ratio:.2f}x)")
    if target_measured:
        lines += [
            "",
            f"Below target (cuflash / {target_peer} < {target_ratio:g}): "
            + (", ".join(below) if below else "none")
            + ".",
        ]
    return "\n".join(lines + format_agreement(rows) + format_notes(rows))


def format_head_dim_sweep(records):
    """Every table of a head-dim sweep's JSON records."""
    measurements = [Measurement.from_dict(r) for r in records]
    return "\n\n".join(
        format_head_dim_sweep_table(measurements, dtype, direction)
        for dtype in dict.fromkeys(m.case.dtype for m in measurements)
        for direction in DIRECTIONS
    )
