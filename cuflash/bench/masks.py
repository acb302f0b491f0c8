"""Mask functions' cost: cuflash with a block mask next to compiled ``flex_attention``
with its block mask of the same function, and (documents) next to cuflash's varlen call
on the same documents.

Usage::

    python -m cuflash.bench_masks [--heads 16 --head-dim 128] [--no-torch] [--json FILE]
                                  [--skip-kernels backward_wgmma_ws,...]

Three masks (bfloat16, the Performance page's targets for score modifiers):

* ``documents``: 8 documents of 2048 tokens packed into one sequence of 16384, causal
  inside each (B = 1); cuflash's time at most 1.15x its varlen call's and at most
  flex_attention's. Written as flex_attention's users write it (the document mask and
  the causal rule in one mask function), and as ``documents+causal``: ``causal=True``
  and the document mask alone.
* ``prefix_lm``: B = 4, S = 4096, every key of a 1024-token prefix, causal after it;
  at most flex_attention's time.
* ``chunked``: B = 4, S = 4096, causal inside chunks of 1024 tokens; at most
  flex_attention's time.

Each mask is written once for cuflash (``cuflash.modifiers``) and once for torch; the
table gives the medians, the ratios, the time to build each block mask (once, outside
the timings; cuflash's once its classification kernel is compiled) and the relative L2
distance of the other outputs from cuflash's.
"""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import sys
import time

import numpy as np

from .. import modifiers
from ..block_mask import create_block_mask
from ..dispatch import skip_kernels
from ..precompile import precompile_modifiers
from ..varlen import flash_attention_varlen_bwd, flash_attention_varlen_fwd
from .cases import Case, make_input_sets
from .implementations import CuflashAttention, compiled_flex_attention, torch_stream
from .measure import forward_output, free_memory, measure_implementation
from .peer_commands import add_peer_options, flex_peer_torch, no_gpu_to_measure, print_report

DOCUMENTS, DOCUMENT_LEN = 8, 2048
PREFIX = 1024
CHUNK = 1024
VARLEN_TARGET = 1.15  # cuflash with the document mask over the varlen call, at most
MASKS = ("documents", "prefix_lm", "chunked")


def case_of(mask, heads, head_dim):
    if mask == "documents":
        return Case("bfloat16", head_dim, DOCUMENTS * DOCUMENT_LEN, False, 1, heads)
    return Case("bfloat16", head_dim, 4096, False, 4, heads)


def cuflash_mask(mask, case):
    """The cuflash.modifiers mask function of ``mask`` (CuPy arrays); "documents+causal":
    the documents only (the call passes causal=True)."""
    import cupy

    if mask.startswith("documents"):
        ids = cupy.repeat(cupy.arange(DOCUMENTS, dtype=np.int32), DOCUMENT_LEN)
        if mask == "documents+causal":
            return modifiers.document_mask(ids)
        return modifiers.and_masks(modifiers.document_mask(ids), modifiers.causal_mask())
    if mask == "prefix_lm":
        return modifiers.prefix_lm_mask(PREFIX)
    return modifiers.chunked_mask(CHUNK)


def torch_mask(mask, torch):
    """The same function for ``flex_attention``'s ``create_block_mask``."""
    if mask == "documents":
        ids = torch.arange(DOCUMENTS, device="cuda").repeat_interleave(DOCUMENT_LEN)
        return lambda b, h, q, k: (ids[q] == ids[k]) & (q >= k)
    if mask == "prefix_lm":
        return lambda b, h, q, k: (k < PREFIX) | (q >= k)
    return lambda b, h, q, k: (q // CHUNK == k // CHUNK) & (q >= k)


def _timed(build, synchronize):
    start = time.perf_counter()
    result = build()
    synchronize()
    return result, time.perf_counter() - start


class CuflashMasked(CuflashAttention):
    """cuflash's forward and backward with a block mask (built once, untimed)."""

    def __init__(self, case, mask):
        import cupy

        function = cuflash_mask(mask, case)
        create_block_mask(function, None, None, case.seqlen, case.seqlen).classify()  # compiles
        block_mask, self.build_seconds = _timed(
            lambda: create_block_mask(function, None, None, case.seqlen, case.seqlen).classify(),
            cupy.cuda.get_current_stream().synchronize,
        )
        super().__init__(case, block_mask=block_mask)
        self.name = f"cuflash {mask}"


class CuflashVarlenDocuments:
    """cuflash's varlen call on the documents as separate sequences (causal); its output
    is shown in the dense layout for the agreement check."""

    has_backward = True

    def __init__(self, case):
        import cupy

        self.case = case
        self.name = "cuflash varlen documents"
        self.offsets = cupy.arange(0, DOCUMENTS + 1, dtype=np.int32) * DOCUMENT_LEN
        self.build_seconds = None

    def context(self):
        return contextlib.nullcontext()

    def _packed(self, x):
        return (a[0].transpose(1, 0, 2) for a in (x.q, x.k, x.v))

    def _args(self):
        c = self.case
        return (
            self.offsets,
            self.offsets,
            DOCUMENT_LEN,
            DOCUMENT_LEN,
            c.heads,
            c.heads,
            c.head_dim,
            True,
        )

    def forward_call(self, x):
        q, k, v = self._packed(x)
        return lambda: flash_attention_varlen_fwd(q, k, v, *self._args())[0].transpose(1, 0, 2)[
            None
        ]

    def backward_call(self, x):
        q, k, v = self._packed(x)
        dout = x.dout[0].transpose(1, 0, 2)
        out, lse = flash_attention_varlen_fwd(q, k, v, *self._args())
        return lambda: flash_attention_varlen_bwd(
            dout, q, k, v, out, lse, *self._args(), synchronize=False
        )


class FlexMasked:
    """Compiled ``flex_attention`` with the block mask of the same function (built once,
    untimed)."""

    has_backward = True

    def __init__(self, case, torch, mask):
        from torch.nn.attention.flex_attention import create_block_mask as flex_block_mask

        self.case, self.torch = case, torch
        self.name = f"flex {mask}"
        self.block_mask, self.build_seconds = _timed(
            lambda: flex_block_mask(
                torch_mask(mask, torch), None, None, case.seqlen, case.seqlen, device="cuda"
            ),
            torch.cuda.synchronize,
        )

    def context(self):
        return torch_stream(self.torch)

    def _attention(self, q, k, v):
        return compiled_flex_attention(self.torch)(q, k, v, block_mask=self.block_mask)

    def forward_call(self, x):
        q, k, v = (self.torch.from_dlpack(a).requires_grad_() for a in (x.q, x.k, x.v))
        return lambda: self._attention(q, k, v)

    def backward_call(self, x):
        leaves = [self.torch.from_dlpack(a).requires_grad_() for a in (x.q, x.k, x.v)]
        out = self._attention(*leaves)
        dout = self.torch.from_dlpack(x.dout)
        return lambda: self.torch.autograd.grad(out, leaves, dout, retain_graph=True)


def precompile(heads, head_dim):
    """Every mask's kernels, compiled in parallel threads before the timings."""
    masks = [
        cuflash_mask(mask, case_of(mask, heads, head_dim)) for mask in MASKS + ("documents+causal",)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(masks)) as pool:
        list(pool.map(lambda m: precompile_modifiers(None, m, ("bfloat16",), (head_dim,)), masks))


def measure(heads, head_dim, torch, target_seconds):
    """Records of every mask's implementations (forward and backward)."""
    precompile(heads, head_dim)
    records = []
    for mask in MASKS:
        case = case_of(mask, heads, head_dim)
        sets = make_input_sets(case, 2)
        mine = CuflashMasked(case, mask)
        reference = forward_output(mine, sets[0])
        impls: list[CuflashMasked | CuflashVarlenDocuments | FlexMasked] = [mine]
        if mask == "documents":
            impls.append(CuflashMasked(dataclasses.replace(case, causal=True), "documents+causal"))
            impls.append(CuflashVarlenDocuments(case))
        if torch is not None:
            impls.append(FlexMasked(case, torch, mask))
        for impl in impls:
            for m in measure_implementation(
                impl, sets, target_seconds, None if impl is mine else reference
            ):
                records.append(dict(m.to_dict(), mask=mask, build_s=impl.build_seconds))
        del reference, sets
        free_memory(torch)
    return records


def table(records):
    """The markdown table: a row per mask and direction."""
    by_key = {(r["impl"], r["direction"]): r for r in records}
    lines = [
        "| mask | pass | cuflash ms | varlen ms | cuflash / varlen (<= 1.15) | flex ms | "
        "cuflash / flex (<= 1) | block mask build ms, cuflash / flex | "
        "output vs cuflash's, varlen / flex |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    missed = []
    for mask in MASKS[:1] + ("documents+causal",) + MASKS[1:]:
        for direction in ("fwd", "bwd"):
            mine = by_key.get((f"cuflash {mask}", direction), {})
            varlen = (
                by_key.get(("cuflash varlen documents", direction), {})
                if mask.startswith("documents")
                else {}
            )
            flex = by_key.get((f"flex {mask.split('+')[0]}", direction), {})
            over_varlen = _ratio(mine.get("median_s"), varlen.get("median_s"))
            over_flex = _ratio(mine.get("median_s"), flex.get("median_s"))
            if over_varlen is not None and over_varlen > VARLEN_TARGET:
                missed.append(f"{mask} {direction} vs varlen")
            if over_flex is not None and over_flex > 1:
                missed.append(f"{mask} {direction} vs flex")
            builds = (
                f"{_ms(mine, 'build_s')} / {_ms(flex, 'build_s')}" if direction == "fwd" else ""
            )
            errors = (
                f"{_num(varlen.get('rel_error'))} / {_num(flex.get('rel_error'))}"
                if direction == "fwd"
                else ""
            )
            lines.append(
                f"| {mask} | {direction} | {_ms(mine)} | {_ms(varlen)} | "
                f"{_fmt(over_varlen)} | {_ms(flex)} | {_fmt(over_flex)} | {builds} | "
                f"{errors} |"
            )
    lines.append("")
    lines.append("Targets missed: " + (", ".join(missed) if missed else "none"))
    return "\n".join(lines)


def _ms(record, key="median_s"):
    seconds = record.get(key)
    return "—" if seconds is None else f"{seconds * 1e3:.3f}"


def _num(value):
    return "—" if value is None else f"{value:.1e}"


def _ratio(a, b):
    return None if a is None or b is None else a / b


def _fmt(ratio):
    return "—" if ratio is None else f"{ratio:.2f}"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m cuflash.bench_masks", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--skip-kernels",
        default="",
        help="comma-separated registry kernels cuflash passes over (cuflash.dispatch."
        "skip_kernels), to time the next in line",
    )
    add_peer_options(parser)
    args = parser.parse_args(argv)
    if no_gpu_to_measure():
        return 0
    skipped = [name for name in args.skip_kernels.split(",") if name]
    torch = flex_peer_torch(not args.no_torch)
    with skip_kernels(*skipped):
        records = measure(args.heads, args.head_dim, torch, args.time)
    passed_over = f"; kernels passed over: {', '.join(skipped)}" if skipped else ""
    print_report(
        f"Mask functions, bfloat16, H = {args.heads}, D = {args.head_dim}; medians{passed_over}",
        table(records),
        records,
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
