"""Small calls (``--small-calls``): GPU time per call of three small causal bfloat16 shapes
of a training loop, and the host time per call of a tiny problem."""

import dataclasses
import time

from .cases import DIRECTIONS, Case, make_input_sets
from .environment import cupy
from .formatting import format_notes, format_ratio, format_us
from .implementations import CuflashAttention, implementation_factories
from .measure import Measurement, run_grid, run_or_reason
from .progress import print_status

# Small calls (issue 14): GPU time per call of small training shapes, and host time per call.
SMALL_CALL_SHAPES = ((1, 8, 128, 64), (4, 12, 256, 64), (8, 16, 512, 128))  # B, H, S, D
SMALL_CALL_PEERS = ("FLASH_ATTENTION", "CUDNN_ATTENTION")
SMALL_CALL_TARGET_PEER = "torch-flash"  # cuflash fwd + bwd at most its time
HOST_TIME_SHAPE = (1, 1, 16, 64)
HOST_TIME_CALLS = 1000
HOST_TIME_TARGET_US = {"fwd": 15.0, "bwd": 30.0}

SMALL_CALL_CASES = tuple(
    Case("bfloat16", d, s, True, batch=b, heads=h) for b, h, s, d in SMALL_CALL_SHAPES
)
HOST_TIME_CASE = Case(
    "bfloat16",
    HOST_TIME_SHAPE[3],
    HOST_TIME_SHAPE[2],
    True,
    batch=HOST_TIME_SHAPE[0],
    heads=HOST_TIME_SHAPE[1],
)


def host_seconds_per_call(call, count):
    """Wall seconds per call of ``count`` back-to-back calls, nothing synchronized between.

    One untimed call warms up and the device is idle when the clock starts;
    the clock stops when the last call returns (its GPU work may still run).
    """
    call()
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(count):
        call()
    seconds = time.perf_counter() - start
    cupy.cuda.Device().synchronize()
    return seconds / count


def host_time_records(factories, case=HOST_TIME_CASE, count=HOST_TIME_CALLS):
    """Host microseconds per call of each implementation, forward and backward, on ``case``."""
    x = make_input_sets(case, 1)[0]
    records = []
    for make in factories:
        impl = make(case)
        for direction in DIRECTIONS:
            make_call = impl.forward_call if direction == "fwd" else impl.backward_call
            seconds, note = run_or_reason(
                impl, lambda make_call=make_call: host_seconds_per_call(make_call(x), count)
            )
            records.append(
                {
                    "impl": impl.name,
                    "direction": direction,
                    "calls": count,
                    **dataclasses.asdict(case),
                    "us_per_call": None if seconds is None else 1e6 * seconds,
                    "note": note,
                }
            )
    return records


def small_call_sweep(torch, budget, l2_bytes):
    """GPU time per call of the small cases, and host time per call of a tiny one."""
    factories = implementation_factories(torch, torch_backends=SMALL_CALL_PEERS, naive=False)
    measurements = run_grid(list(SMALL_CALL_CASES), lambda case: factories, budget, l2_bytes, torch)
    print_status(f"host time per call ({HOST_TIME_CALLS} calls)")
    return {
        "measurements": [m.to_dict() for m in measurements],
        "host_time": host_time_records(factories),
    }


def format_small_calls(record):
    """GPU time per call of the small cases (fwd, bwd, sum, ratio) and the host time table."""
    measurements = [Measurement.from_dict(r) for r in record["measurements"]]
    by_key = {(m.case, m.impl, m.direction): m for m in measurements}
    cases = list(dict.fromkeys(m.case for m in measurements))
    impls = list(dict.fromkeys(m.impl for m in measurements))

    def total(case, impl):
        seconds = [getattr(by_key.get((case, impl, d)), "seconds", None) for d in DIRECTIONS]
        return None if None in seconds else sum(seconds)

    lines = [
        "### Small calls, causal: time per call in us (median of CUDA events around "
        "back-to-back calls: the GPU's time, or the host's where that is longer)",
        "",
        "| dtype | B | H | S | D | impl | fwd | bwd | fwd+bwd | peer / cuflash (fwd+bwd) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    below = []
    for case in cases:
        mine = total(case, CuflashAttention.name)
        for impl in impls:
            fwd, bwd = (getattr(by_key.get((case, impl, d)), "seconds", None) for d in DIRECTIONS)
            theirs = total(case, impl)
            ratio = (
                None
                if impl == CuflashAttention.name or mine is None or theirs is None
                else theirs / mine
            )
            lines.append(
                f"| {case.dtype} | {case.batch} | {case.heads} | {case.seqlen} | "
                f"{case.head_dim} | {impl} | {format_us(fwd)} | {format_us(bwd)} | "
                f"{format_us(theirs)} | {format_ratio(ratio)} |"
            )
            if impl == SMALL_CALL_TARGET_PEER and ratio is not None and ratio < 1:
                below.append(
                    f"B={case.batch} H={case.heads} S={case.seqlen} D={case.head_dim} "
                    f"({ratio:.2f}x)"
                )
    lines += [
        "",
        f"Target: cuflash fwd+bwd <= {SMALL_CALL_TARGET_PEER}'s (ratio >= 1). "
        f"Below target: {', '.join(below) if below else 'none'}.",
    ]
    lines += format_notes(measurements)
    if record.get("host_time"):
        lines += ["", format_host_time(record["host_time"])]
    return "\n".join(lines)


def format_host_time(records):
    """Host microseconds per call, forward and backward, with cuflash's targets."""
    first = records[0]
    by_key = {(r["impl"], r["direction"]): r for r in records}
    impls = list(dict.fromkeys(r["impl"] for r in records))
    lines = [
        f"### Host time per call in us: wall time of {first['calls']} back-to-back calls "
        f"(B={first['batch']} H={first['heads']} S={first['seqlen']} D={first['head_dim']} "
        f"{first['dtype']}{' causal' if first['causal'] else ''}; cuflash's backward with "
        "synchronize=False)",
        "",
        "| impl | fwd | bwd |",
        "|---|---|---|",
    ]
    verdicts = []
    for impl in impls:
        cells = []
        for direction in DIRECTIONS:
            r = by_key.get((impl, direction))
            cells.append(
                "–" if r is None or r["us_per_call"] is None else f"{r['us_per_call']:.1f}"
            )
            if impl == CuflashAttention.name and r is not None and r["us_per_call"] is not None:
                target = HOST_TIME_TARGET_US[direction]
                verdicts.append(
                    f"{direction} <= {target:g} us "
                    f"({'met' if r['us_per_call'] <= target else 'missed'})"
                )
        lines.append(f"| {impl} | " + " | ".join(cells) + " |")
    if verdicts:
        lines += ["", "cuflash's targets: " + ", ".join(verdicts) + "."]
    failed = [
        f"- {r['impl']} {r['direction']}: {r['note']}" for r in records if r["us_per_call"] is None
    ]
    return "\n".join(lines + (["", "Not measured (–):", ""] + failed if failed else []))
