"""Score modifiers' cost: cuflash with ``softcap`` and ``alibi_slopes`` next to its
plain kernels and to compiled ``flex_attention`` with the same score functions.

Usage::

    python -m cuflash.bench_modifiers [--batch 4 --heads 16 --seqlen 4096 --head-dim 128]
                                      [--no-causal] [--json FILE] [--time 0.5]

One table (bfloat16): forward and backward milliseconds and TFLOP/s of each
variant, its TFLOP/s over the plain kernels' (target: at least 0.9) and cuflash's
time over flex_attention's with the same modifier (below 1 is faster), and the
relative L2 distance of flex_attention's forward output from cuflash's with the
same modifier (both compute the same function).
"""

import argparse
import dataclasses
import math
import sys

import numpy as np

from .cases import Case, make_input_sets
from .implementations import CuflashAttention, compiled_flex_attention, torch_stream
from .measure import forward_output, free_memory, measure_implementation
from .peer_commands import add_peer_options, flex_peer_torch, no_gpu_to_measure, print_report

SOFTCAP = 30.0
TARGET = 0.9  # modified TFLOP/s over plain TFLOP/s, at least
MODIFIERS = ("plain", "softcap", "alibi", "softcap+alibi")


def alibi_slopes(heads):
    """ALiBi's geometric slopes ``2^(-8 i / H)``, ``i = 1 .. H`` (float32 ``[H]``)."""
    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)


def cuflash_options(modifier, heads):
    """The keyword arguments of ``modifier`` for cuflash's functions (CuPy arrays)."""
    import cupy

    options = {}
    if "softcap" in modifier:
        options["softcap"] = SOFTCAP
    if "alibi" in modifier:
        options["alibi_slopes"] = cupy.asarray(alibi_slopes(heads))
    return options


class CuflashModified(CuflashAttention):
    """cuflash's forward and backward with one modifier (the same on both)."""

    def __init__(self, case, modifier):
        super().__init__(case, **cuflash_options(modifier, case.heads))
        self.name = f"cuflash {modifier}"


def flex_score_mod(modifier, slopes):
    """flex_attention's ``score_mod`` for ``modifier`` (None when plain): the soft-cap
    first, then the ALiBi bias, as in cuflash (see the Semantics page)."""
    import torch

    if modifier == "plain":
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        if "softcap" in modifier:
            score = SOFTCAP * torch.tanh(score / SOFTCAP)
        if "alibi" in modifier:
            score = score - slopes[h] * (q_idx - kv_idx).abs()
        return score

    return score_mod


class FlexModified:
    """Compiled ``flex_attention`` with the causal block mask (built once, untimed) and the
    modifier's ``score_mod``."""

    has_backward = True

    def __init__(self, case, torch, modifier):
        self.case, self.torch, self.modifier = case, torch, modifier
        self.name = f"flex {modifier}"
        self.slopes = torch.as_tensor(alibi_slopes(case.heads), device="cuda")

    def context(self):
        return torch_stream(self.torch)

    @property
    def block_mask(self):
        from torch.nn.attention.flex_attention import create_block_mask

        if not self.case.causal:
            return None
        return create_block_mask(
            lambda b, h, q, k: q >= k, None, None, self.case.seqlen, self.case.seqlen, device="cuda"
        )

    def _attention(self, q, k, v, block_mask):
        return compiled_flex_attention(self.torch)(
            q, k, v, score_mod=flex_score_mod(self.modifier, self.slopes), block_mask=block_mask
        )

    def forward_call(self, x):
        q, k, v = (self.torch.from_dlpack(a).requires_grad_() for a in (x.q, x.k, x.v))
        mask = self.block_mask
        return lambda: self._attention(q, k, v, mask)

    def backward_call(self, x):
        leaves = [self.torch.from_dlpack(a).requires_grad_() for a in (x.q, x.k, x.v)]
        q, k, v = leaves
        out = self._attention(q, k, v, self.block_mask)
        dout = self.torch.from_dlpack(x.dout)
        return lambda: self.torch.autograd.grad(out, leaves, dout, retain_graph=True)


def measure(case, torch, target_seconds):
    """Forward and backward records of every cuflash variant and flex peer."""
    sets = make_input_sets(case, 2)
    records = []
    for modifier in MODIFIERS:
        cuflash_impl = CuflashModified(case, modifier)
        reference = forward_output(cuflash_impl, sets[0])
        impls = [cuflash_impl] + ([FlexModified(case, torch, modifier)] if torch else [])
        for impl in impls:
            for m in measure_implementation(
                impl, sets, target_seconds, None if impl is cuflash_impl else reference
            ):
                records.append(dict(m.to_dict(), modifier=modifier))
        del reference
        free_memory(torch)
    return records


def table(records):
    """The markdown table: a row per modifier and direction."""
    by_key = {(r["impl"], r["direction"]): r for r in records}
    lines = [
        "| modifier | pass | cuflash ms | TFLOP/s | / plain (>= 0.9) | flex ms | "
        "cuflash / flex time | flex vs cuflash output |",
        "|---|---|---|---|---|---|---|---|",
    ]
    below = []
    for modifier in MODIFIERS:
        for direction in ("fwd", "bwd"):
            mine = by_key[(f"cuflash {modifier}", direction)]
            plain = by_key[("cuflash plain", direction)]
            flex = by_key.get((f"flex {modifier}", direction), {})
            ratio = (
                mine["tflops"] / plain["tflops"]
                if mine.get("tflops") and plain.get("tflops")
                else math.nan
            )
            if modifier != "plain" and not ratio >= TARGET:
                below.append(f"{modifier} {direction}")
            fwd_flex = by_key.get((f"flex {modifier}", "fwd"), {})
            lines.append(
                f"| {modifier} | {direction} | {_ms(mine)} | {_num(mine.get('tflops'))} | "
                f"{ratio:.3f} | {_ms(flex)} | "
                f"{_ratio(mine.get('median_s'), flex.get('median_s'))} | "
                f"{_num(fwd_flex.get('rel_error'), '.1e') if direction == 'fwd' else ''} |"
            )
    lines.append("")
    lines.append("Below target: " + (", ".join(below) if below else "none"))
    return "\n".join(lines)


def _ms(record):
    seconds = record.get("median_s")
    return "—" if seconds is None else f"{seconds * 1e3:.3f}"


def _num(value, spec=".0f"):
    return "—" if value is None else format(value, spec)


def _ratio(a, b):
    return "—" if a is None or b is None else f"{a / b:.2f}"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m cuflash.bench_modifiers", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--no-causal", action="store_true")
    add_peer_options(parser)
    args = parser.parse_args(argv)
    if no_gpu_to_measure():
        return 0
    case = Case("bfloat16", args.head_dim, args.seqlen, not args.no_causal, args.batch, args.heads)
    torch = flex_peer_torch(not args.no_torch)
    records = measure(case, torch, args.time)
    print_report(
        f"Score modifiers, bfloat16, {dataclasses.asdict(case)}, softcap "
        f"{SOFTCAP}, ALiBi slopes 2^(-8i/H); medians",
        table(records),
        records,
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
