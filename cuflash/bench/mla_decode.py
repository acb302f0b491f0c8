"""Absorbed-MLA decoding (``--mla-decode``): one new query row of 16 or 128 query heads over
one KV head of 576 columns whose first 512 are the values (``v_cache`` the view
``k_cache[..., :512]``), bfloat16, a contiguous cache of L keys a sequence.

With 16 query heads a step reads the latent cache once and does little arithmetic: the
figure is the cache's bytes read a second. With 128 the products dominate: TFLOP/s of
the two products at their true widths (q k^T over 576 columns, P v over 512).
"""

import contextlib
import dataclasses
import types

import numpy as np

import cuflash

from .cases import DTYPES
from .environment import cupy
from .formatting import format_tflops
from .measure import run_or_reason
from .progress import print_status
from .timing import time_calls

_NO_CONTEXT = types.SimpleNamespace(context=contextlib.nullcontext)


@dataclasses.dataclass(frozen=True)
class MlaDecodeCase:
    """``batch`` sequences of ``seqlen`` cached keys, ``heads`` query heads, one new row."""

    batch: int
    heads: int
    seqlen: int
    head_dim: int = 576
    head_dim_v: int = 512
    dtype: str = "bfloat16"

    @property
    def cache_bytes(self):
        """Bytes of the latent cache a step reads (each key row once)."""
        return self.batch * self.seqlen * self.head_dim * DTYPES[self.dtype].itemsize

    @property
    def flops(self):
        return 2 * self.batch * self.heads * self.seqlen * (self.head_dim + self.head_dim_v)


#: The issue's shapes: L = 4096 and 16384, B = 32 and 128, 16 and 128 query heads.
MLA_DECODE_CASES = tuple(
    MlaDecodeCase(batch, heads, seqlen)
    for heads in (16, 128)
    for seqlen in (4096, 16384)
    for batch in (32, 128)
)


def mla_decode_step(case, seed=0):
    """A no-argument callable running one decoding step of ``case`` on fresh inputs."""
    rng = cupy.random.default_rng(seed)
    dtype = DTYPES[case.dtype]
    cache = rng.standard_normal(
        (case.batch, 1, case.seqlen, case.head_dim), dtype=np.float32
    ).astype(dtype)
    q = rng.standard_normal((case.batch, case.heads, 1, case.head_dim), dtype=np.float32)
    q = q.astype(dtype)
    lengths = cupy.full(case.batch, case.seqlen, np.int32)
    values = cache[..., : case.head_dim_v]
    return lambda: cuflash.flash_attention_with_kvcache(
        q,
        cache,
        values,
        case.heads,
        1,
        case.head_dim,
        cache_seqlens=lengths,
        head_dim_v=case.head_dim_v,
    )


def mla_decode_report(budget, cases=MLA_DECODE_CASES):
    """Median GPU time of each case's decoding step."""
    records = []
    for index, case in enumerate(cases):
        print_status(f"MLA decode: B={case.batch} H={case.heads} L={case.seqlen}")
        target = budget.target_for(len(cases) - index)
        timing, note = run_or_reason(
            _NO_CONTEXT, lambda: time_calls([mla_decode_step(case)], target)
        )
        records.append(
            {
                **dataclasses.asdict(case),
                "cache_bytes": case.cache_bytes,
                "flops": case.flops,
                "timing": None if timing is None else timing.summary(),
                "note": note,
            }
        )
    return records


def format_mla_decode(records):
    """The table: median time, the cache's TB/s and TFLOP/s of each case."""
    lines = [
        "### Absorbed-MLA decoding: bfloat16, one KV head of 576 (values its first 512), "
        "one new query row",
        "",
        "| B | H | L | median us | cache TB/s | TFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        seconds = None if r["timing"] is None else r["timing"]["median_s"]
        cells = ("–", "–", "–")
        if seconds is not None:
            cells = (
                f"{seconds * 1e6:.1f}",
                f"{r['cache_bytes'] / seconds / 1e12:.2f}",
                format_tflops(r["flops"] / seconds / 1e12),
            )
        lines.append(f"| {r['batch']} | {r['heads']} | {r['seqlen']} | " + " | ".join(cells) + " |")
    failed = [f"- B={r['batch']} H={r['heads']} L={r['seqlen']}: {r['note']}" for r in records
              if r["timing"] is None]  # fmt: skip
    return "\n".join(lines + (["", "Not measured (–):", ""] + failed if failed else []))
