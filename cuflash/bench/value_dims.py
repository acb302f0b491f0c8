"""A value head dim of its own (``--head-dim-v``): the MLA training shape (q/k head dim 192,
v head dim 128) with ``head_dim_v``, against the same call with v (and, in the backward,
dout and the output) padded by the caller to 192 columns, forward and backward.

The padded call is the cost of doing without ``head_dim_v``. The forward on an H100/H200
runs natively (``forward_wgmma_ws`` with DV = 128) and should beat it by the products it
saves; the backward pads inside the library (:mod:`cuflash.gpu.value_dims`) and pays that
padding's copies on top.

With torch present, its SDPA backends that take a value head dim of their own run the
same shape (``torch-flash``, ``torch-cudnn``, ``torch-efficient``; one that refuses it
is listed with its reason).
"""

import contextlib
import dataclasses
import math
import types
from collections.abc import Callable
from typing import Any

import numpy as np

import cuflash

from .cases import DIRECTIONS, DTYPES, sets_spanning_l2, tflops
from .environment import cupy
from .formatting import format_ratio, format_tflops
from .implementations import TorchSDPA, sdpa_backends
from .measure import run_or_reason
from .progress import print_status
from .timing import time_calls

CALLS = ("head_dim_v", "v padded")
TORCH_PEERS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
_NO_CONTEXT = types.SimpleNamespace(context=contextlib.nullcontext)


@dataclasses.dataclass(frozen=True)
class ValueDimCase:
    """q and k ``[batch, heads, seqlen, head_dim]``, v ``[batch, heads, seqlen,
    head_dim_v]``."""

    dtype: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    head_dim_v: int
    causal: bool

    def flops(self, direction):
        """FLOPs of the products one pass does at the call's true widths: forward q k^T
        (head_dim) and P v (head_dim_v); the backward recomputes q k^T and takes dO v^T,
        dV (head_dim_v), dQ and dK (head_dim): with equal widths the Performance page's
        4 B H S^2 D and 2.5 times that. Halved when causal."""
        columns = self.head_dim + self.head_dim_v
        if direction == "bwd":
            columns = 3 * self.head_dim + 2 * self.head_dim_v
        flops = 2 * self.batch * self.heads * self.seqlen**2 * columns
        return flops / 2 if self.causal else flops


#: bfloat16, H = 16, D = 192, D_v = 128, S = 4096, causal, B * S = 16384.
MLA_TRAINING = ValueDimCase("bfloat16", 4, 16, 4096, 192, 128, True)


def _input_sets(case, count, seed=0):
    """``count`` draws of q, k, v, dout, and v, dout padded with zero columns to head_dim
    (on the GPU)."""
    rng = cupy.random.default_rng(seed)
    dtype = DTYPES[case.dtype]
    wide = (case.batch, case.heads, case.seqlen, case.head_dim)
    narrow = wide[:3] + (case.head_dim_v,)

    def draw(shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    def padded(x):
        out = cupy.zeros(wide, dtype)
        out[..., : case.head_dim_v] = x
        return out

    sets = []
    for _ in range(count):
        q, k, v, dout = draw(wide), draw(wide), draw(narrow), draw(narrow)
        sets.append(dict(q=q, k=k, v=v, dout=dout, v_padded=padded(v), dout_padded=padded(dout)))
    return sets


def _forward(case, x, padded):
    """The call's forward on input set ``x``: ``(out, lse)``."""
    args = (case.heads, case.heads, case.head_dim, case.causal)
    if padded:
        return cuflash.flash_attention_fwd(x["q"], x["k"], x["v_padded"], *args)
    return cuflash.flash_attention_fwd(x["q"], x["k"], x["v"], *args, head_dim_v=case.head_dim_v)


def _call(case, x, padded, direction):
    """A no-argument callable running one pass of the call on ``x``."""
    if direction == "fwd":
        return lambda: _forward(case, x, padded)
    out, lse = _forward(case, x, padded)
    args = (case.heads, case.heads, case.head_dim, case.causal)
    if padded:
        dout, v = x["dout_padded"], x["v_padded"]
        return lambda: cuflash.flash_attention_bwd(
            dout, x["q"], x["k"], v, out, lse, *args, synchronize=False
        )
    return lambda: cuflash.flash_attention_bwd(
        x["dout"],
        x["q"],
        x["k"],
        x["v"],
        out,
        lse,
        *args,
        synchronize=False,
        head_dim_v=case.head_dim_v,
    )


def _peer_call(peer, x, direction):
    """A no-argument callable of torch's SDPA (``peer``, a :class:`TorchSDPA`) on input
    set ``x``, its q, k and v at their own widths."""
    x = types.SimpleNamespace(**x)
    return peer.forward_call(x) if direction == "fwd" else peer.backward_call(x)


def value_dim_report(budget, l2_bytes, case=MLA_TRAINING, torch=None):
    """Median GPU time of the ``head_dim_v`` call, the padded call and, with ``torch``,
    its SDPA backends, each direction."""
    # q, k and the padded v, dout: head_dim columns; v, dout: head_dim_v columns
    set_bytes = (4 * case.head_dim + 2 * case.head_dim_v) * math.prod(
        (case.batch, case.heads, case.seqlen)
    )
    sets, note = run_or_reason(
        _NO_CONTEXT,
        lambda: _input_sets(
            case, sets_spanning_l2(set_bytes * DTYPES[case.dtype].itemsize, l2_bytes)
        ),
    )
    calls: list[tuple[str, types.SimpleNamespace | TorchSDPA, Callable[..., Any]]] = [
        (name, _NO_CONTEXT, lambda x, d, padded=name == "v padded": _call(case, x, padded, d))
        for name in CALLS
    ]
    for backend in [] if torch is None else sdpa_backends(torch, TORCH_PEERS):
        peer = TorchSDPA(case, torch, backend)
        calls.append((peer.name, peer, lambda x, d, peer=peer: _peer_call(peer, x, d)))
    records = []
    left = len(calls) * len(DIRECTIONS)
    for name, context, make in calls:
        for direction in DIRECTIONS:
            print_status(f"head_dim_v: {name} {direction}")
            timing = None
            if sets is not None:
                target = budget.target_for(left)
                timing, note = run_or_reason(
                    context, lambda: time_calls([make(x, direction) for x in sets], target)
                )
            left -= 1
            records.append(
                {
                    "call": name,
                    "direction": direction,
                    **dataclasses.asdict(case),
                    "timing": None if timing is None else timing.summary(),
                    "flops": case.flops(direction),
                    "note": note,
                }
            )
    return records


def format_value_dims(records):
    """The table: median time, TFLOP/s (at the true widths) and padded / head_dim_v."""
    first = records[0]
    lines = [
        f"### A value head dim of its own: {first['dtype']}, B={first['batch']} "
        f"H={first['heads']} S={first['seqlen']} D={first['head_dim']} "
        f"D_v={first['head_dim_v']}{' causal' if first['causal'] else ''}",
        "",
        "| direction | call | median ms | TFLOP/s | time / head_dim_v's |",
        "|---|---|---|---|---|",
    ]
    by_key = {(r["call"], r["direction"]): r for r in records}

    def median(record):
        return None if record is None or record["timing"] is None else record["timing"]["median_s"]

    names = list(dict.fromkeys(r["call"] for r in records))
    for direction in DIRECTIONS:
        mine = median(by_key.get((CALLS[0], direction)))
        for call in names:
            record = by_key.get((call, direction))
            seconds = median(record)
            ratio = None if mine is None or seconds is None else seconds / mine
            lines.append(
                f"| {direction} | {call} | "
                + ("–" if seconds is None else f"{seconds * 1e3:.3f}")
                + " | "
                + (
                    "–"
                    if record is None or seconds is None
                    else format_tflops(tflops(record["flops"], seconds))
                )
                + " | "
                + ("" if call == CALLS[0] else format_ratio(ratio))
                + " |"
            )
    failed = [
        f"- {r['call']} {r['direction']}: {r['note']}" for r in records if r["timing"] is None
    ]
    lines += [
        "",
        "TFLOP/s count the products at the true widths (the padded call does more work "
        "than it is credited with).",
    ]
    return "\n".join(lines + (["", "Not measured (–):", ""] + failed if failed else []))
