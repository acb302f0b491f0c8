"""Packed variable-length batches (``--varlen``, the Packed batches page): cuflash's varlen calls
against its dense kernels on equal lengths, torch SDPA on nested jagged tensors and compiled
``flex_attention`` with a document mask."""

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..varlen import flash_attention_varlen_bwd, flash_attention_varlen_fwd
from .cases import (
    DIRECTIONS,
    DTYPES,
    HIDDEN,
    TOKENS,
    Case,
    InputSet,
    attention_flops,
    make_input_sets,
    rotation_count,
    sets_spanning_l2,
)
from .environment import cupy
from .formatting import format_ratio, format_tflops
from .implementations import (
    TORCH_BACKENDS,
    CuflashAttention,
    compiled_flex_attention,
    forced_backend,
    sdpa_backends,
    torch_stream,
)
from .measure import forward_output, free_memory, measure_implementation, skipped
from .progress import progress_bar

# Packed variable-length batches (issue 16, the Packed batches page): bfloat16, H = 2048 / D.
VARLEN_LENGTH_RANGE = (64, 4096)  # uniform, inclusive; the last length is trimmed
VARLEN_SEED = 0
VARLEN_EQUAL = (8, 2048)  # B, S of the equal-lengths case
VARLEN_HEAD_DIMS = (64, 128)
VARLEN_DTYPE = "bfloat16"
VARLEN_DENSE_MULTIPLE = 8  # the dense-equal S is the mean length rounded to this
VARLEN_TARGET = ("cuflash-dense-equal", 0.95)  # cuflash varlen / dense-equal at least this
VARLEN_IMPLS = ("cuflash-varlen", "cuflash-dense-equal", "torch-nested-flash", "torch-flex")


def draw_varlen_lengths(
    total=TOKENS, low=VARLEN_LENGTH_RANGE[0], high=VARLEN_LENGTH_RANGE[1], seed=VARLEN_SEED
):
    """Sequence lengths drawn uniformly from ``low .. high`` (inclusive) until they sum to
    ``total``; the last is trimmed so that the sum is exactly ``total`` (it may fall below
    ``low``)."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(int(rng.integers(low, high, endpoint=True)), total - sum(lengths)))
    return tuple(lengths)


def varlen_flops(lengths, heads, head_dim, causal, direction="fwd"):
    """FLOPs of a packed batch: :func:`attention_flops` of each sequence alone, summed
    (only the work inside the sequences counts; causal halves each one's square)."""
    return sum(attention_flops(1, heads, n, head_dim, causal, direction) for n in lengths)


@dataclasses.dataclass(frozen=True)
class VarlenCase:
    """One packed batch: ``q``, ``k``, ``v`` ``[sum(lengths), heads, head_dim]`` of ``dtype``.

    ``kind`` is "uniform" (lengths drawn by :func:`draw_varlen_lengths`) or
    "equal" (``VARLEN_EQUAL``).
    """

    kind: str
    lengths: tuple
    head_dim: int
    heads: int
    causal: bool
    dtype: str = VARLEN_DTYPE

    @property
    def tokens(self):
        return sum(self.lengths)

    @property
    def batch(self):
        return len(self.lengths)

    @property
    def max_seqlen(self):
        return max(self.lengths)

    @property
    def mean_seqlen(self):
        return self.tokens / self.batch

    @property
    def cu_seqlens(self):
        """int32 offsets ``[B + 1]`` on the host: 0, then the running sums of the lengths."""
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int32)

    @property
    def numpy_dtype(self):
        return DTYPES[self.dtype]

    @property
    def label(self):
        if self.kind == "equal":
            return f"equal {self.batch} x {self.lengths[0]}"
        low, high = VARLEN_LENGTH_RANGE
        return f"uniform {low}..{high} ({self.batch} seqs)"

    @property
    def dense_case(self):
        """The dense problem on equal lengths of the batch's mean: ``B = round(tokens /
        mean)`` sequences of the mean rounded to a multiple of ``VARLEN_DENSE_MULTIPLE``."""
        mean = self.mean_seqlen
        seqlen = VARLEN_DENSE_MULTIPLE * max(1, round(mean / VARLEN_DENSE_MULTIPLE))
        return Case(
            self.dtype,
            self.head_dim,
            seqlen,
            self.causal,
            batch=round(self.tokens / mean),
            heads=self.heads,
        )

    def flops(self, direction):
        """FLOPs of one pass in ``direction`` ("fwd" or "bwd"), summed over the sequences."""
        return varlen_flops(self.lengths, self.heads, self.head_dim, self.causal, direction)


def varlen_cases(head_dims=VARLEN_HEAD_DIMS, seed=VARLEN_SEED):
    """The varlen table's cases: uniform lengths, then equal ones; by head dim, causal."""
    batch, seqlen = VARLEN_EQUAL
    lengths = {"uniform": draw_varlen_lengths(seed=seed), "equal": (seqlen,) * batch}
    return [
        VarlenCase(kind, lengths[kind], head_dim, max(1, HIDDEN // head_dim), causal)
        for kind in lengths
        for head_dim in head_dims
        for causal in (False, True)
    ]


def make_packed_sets(case, count, seed=0):
    """``count`` standard-normal packed input sets ``[tokens, heads, head_dim]`` of ``case``."""
    rng = cupy.random.default_rng(seed)
    shape = (case.tokens, case.heads, case.head_dim)

    def draw():
        return rng.standard_normal(shape, dtype=np.float32).astype(case.numpy_dtype)

    return [InputSet(draw(), draw(), draw(), draw()) for _ in range(count)]


class CuflashVarlen:
    """``flash_attention_varlen_fwd`` / ``_bwd`` (backward with ``synchronize=False``),
    device-held int32 offsets, ``max_seqlen`` the longest sequence."""

    name = "cuflash-varlen"
    has_backward = True

    def __init__(self, case):
        self.case = case
        self.cu_seqlens = cupy.asarray(case.cu_seqlens)

    def context(self):
        return contextlib.nullcontext()

    def _args(self):
        c = self.case
        return (
            self.cu_seqlens,
            self.cu_seqlens,
            c.max_seqlen,
            c.max_seqlen,
            c.heads,
            c.heads,
            c.head_dim,
            c.causal,
        )

    def forward_call(self, x):
        return lambda: flash_attention_varlen_fwd(x.q, x.k, x.v, *self._args())[0]

    def backward_call(self, x):
        out, lse = flash_attention_varlen_fwd(x.q, x.k, x.v, *self._args())
        return functools.partial(
            flash_attention_varlen_bwd,
            x.dout,
            x.q,
            x.k,
            x.v,
            out,
            lse,
            *self._args(),
            synchronize=False,
        )


class CuflashDenseEqual(CuflashAttention):
    """cuflash's dense kernels on the equal-lengths problem of a packed case."""

    name = "cuflash-dense-equal"


class TorchNestedSDPA:
    """SDPA with one forced backend on nested jagged tensors ``[B, H, {S}, D]`` viewing the
    packed arrays (``nested_tensor_from_jagged`` with the offsets and the min/max lengths
    cached, so no call reads them back); the output is returned as ``[tokens, H, D]``."""

    has_backward = True

    def __init__(self, case, torch, backend):
        self.case, self.torch, self.backend = case, torch, backend
        self.name = f"torch-nested-{TORCH_BACKENDS[backend.name].removeprefix('torch-')}"
        self.offsets = torch.as_tensor(case.cu_seqlens.astype(np.int64), device="cuda")

    def context(self):
        return forced_backend(self.torch, self.backend)

    def _inputs(self, x):
        """Leaves ``[tokens, H, D]`` (through DLPack) and their nested ``[B, H, {S}, D]`` views."""
        c, nested = self.case, self.torch.nested
        leaves = [self.torch.from_dlpack(a).requires_grad_() for a in (x.q, x.k, x.v)]
        views = [
            nested.nested_tensor_from_jagged(
                a, self.offsets, min_seqlen=min(c.lengths), max_seqlen=c.max_seqlen
            ).transpose(1, 2)
            for a in leaves
        ]
        return leaves, views

    def _attention(self, q, k, v):
        out = self.torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=self.case.causal
        )
        return out.transpose(1, 2).values()

    def forward_call(self, x):
        _, (q, k, v) = self._inputs(x)
        return lambda: self._attention(q, k, v)

    def backward_call(self, x):
        leaves, views = self._inputs(x)
        out = self._attention(*views)
        dout = self.torch.from_dlpack(x.dout)
        return lambda: self.torch.autograd.grad(out, leaves, dout, retain_graph=True)


def document_mask_mod(document, causal):
    """flex_attention's mask: the same document and, when causal, ``q_idx >= kv_idx``
    (bottom-right and top-left alignment coincide, q and k lengths being equal)."""

    def same_document(b, h, q_idx, kv_idx):
        return document[q_idx] == document[kv_idx]

    def causal_same_document(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    return causal_same_document if causal else same_document


class TorchFlex:
    """Compiled ``flex_attention`` on ``[1, H, tokens, D]`` (contiguous copies, untimed) with
    a block mask of the document ids of the tokens (built once, untimed)."""

    name = "torch-flex"
    has_backward = True

    def __init__(self, case, torch):
        self.case, self.torch = case, torch

    def context(self):
        return torch_stream(self.torch)

    @functools.cached_property
    def block_mask(self):
        from torch.nn.attention.flex_attention import create_block_mask

        torch, c = self.torch, self.case
        lengths = torch.as_tensor(c.lengths, device="cuda")
        document = torch.repeat_interleave(
            torch.arange(c.batch, device="cuda", dtype=torch.int32), lengths
        )
        return create_block_mask(
            document_mask_mod(document, c.causal), None, None, c.tokens, c.tokens, device="cuda"
        )

    def _heads_first(self, a):
        return self.torch.from_dlpack(a).unsqueeze(0).transpose(1, 2).contiguous()

    def _attention(self, q, k, v):
        return compiled_flex_attention(self.torch)(q, k, v, block_mask=self.block_mask)

    def forward_call(self, x):
        """A training-mode forward, its output viewed as ``[tokens, H, D]``."""
        q, k, v = (self._heads_first(a).requires_grad_() for a in (x.q, x.k, x.v))
        return lambda: self._attention(q, k, v)[0].transpose(0, 1)

    def backward_call(self, x):
        leaves = [self._heads_first(a).requires_grad_() for a in (x.q, x.k, x.v)]
        out = self._attention(*leaves)
        dout = self._heads_first(x.dout)
        return lambda: self.torch.autograd.grad(out, leaves, dout, retain_graph=True)


def varlen_record(case, measurement):
    """A JSON-ready record of one varlen table measurement (``measurement.case`` is the
    packed case, or the dense-equal :class:`Case`)."""
    measured = measurement.case
    dense = isinstance(measured, Case)
    record = {
        "kind": case.kind,
        "label": case.label,
        "dtype": case.dtype,
        "head_dim": case.head_dim,
        "heads": case.heads,
        "causal": case.causal,
        "tokens": case.tokens,
        "batch": measured.batch,
        "seqlen": measured.seqlen if dense else None,
        "max_seqlen": measured.seqlen if dense else case.max_seqlen,
        "impl": measurement.impl,
        "direction": measurement.direction,
        "flops": measured.flops(measurement.direction),
        "tflops": measurement.tflops,
        "note": measurement.note,
        "rel_error": measurement.rel_error,
        "median_s": None,
    }
    if measurement.timing is not None:
        record.update(measurement.timing.summary())
    return record


def varlen_ratios(records):
    """cuflash varlen's TFLOP/s over each peer's, a record per case and direction."""
    by_key = {
        (r["kind"], r["head_dim"], r["causal"], r["direction"], r["impl"]): r for r in records
    }
    ratios = []
    for key in dict.fromkeys(k[:4] for k in by_key):
        mine = by_key.get((*key, VARLEN_IMPLS[0]), {}).get("tflops")
        ratio = {"kind": key[0], "head_dim": key[1], "causal": key[2], "direction": key[3]}
        for impl in VARLEN_IMPLS[1:]:
            theirs = by_key.get((*key, impl), {}).get("tflops")
            ratio[impl] = mine / theirs if mine is not None and theirs else None
        ratios.append(ratio)
    return ratios


def varlen_table(torch, budget, l2_bytes, cases=None):
    """The varlen table: cuflash varlen, torch nested (flash) and compiled flex_attention on
    the packed inputs of each case (their forward outputs checked against cuflash varlen's),
    and cuflash's dense kernels on the case's equal lengths."""
    cases = varlen_cases() if cases is None else cases
    peers: list[Callable[..., Any]] = (
        []
        if torch is None
        else [
            functools.partial(TorchNestedSDPA, torch=torch, backend=backend)
            for backend in sdpa_backends(torch, ("FLASH_ATTENTION",))
        ]
    )
    peers += [] if torch is None else [functools.partial(TorchFlex, torch=torch)]
    left = len(cases) * 2 * (2 + len(peers))
    records = []
    bar = progress_bar(len(cases), "varlen cases")
    for case in cases:
        bar.set_postfix_str(f"{case.label} D={case.head_dim} causal={case.causal}")
        impls = [CuflashVarlen(case)] + [make(case) for make in peers]
        if budget.remaining() <= 0:
            records += [
                varlen_record(case, m)
                for impl in impls + [CuflashDenseEqual(case.dense_case)]
                for m in skipped(impl, "time budget exhausted")
            ]
            bar.update(1)
            continue
        packed = make_packed_sets(
            case,
            sets_spanning_l2(
                4 * case.tokens * case.heads * case.head_dim * case.numpy_dtype.itemsize, l2_bytes
            ),
        )
        reference = None
        for impl in impls:
            if budget.remaining() <= 0:
                measurements = skipped(impl, "time budget exhausted")
            else:
                measurements = measure_implementation(
                    impl, packed, budget.target_for(left), reference
                )
                if impl.name == CuflashVarlen.name and measurements[0].timing is not None:
                    reference = forward_output(impl, packed[0])
            left -= 2
            records += [varlen_record(case, m) for m in measurements]
            free_memory(torch)
        del packed, reference
        free_memory(torch)
        dense = CuflashDenseEqual(case.dense_case)
        if budget.remaining() <= 0:
            measurements = skipped(dense, "time budget exhausted")
        else:
            sets = make_input_sets(dense.case, rotation_count(dense.case, l2_bytes))
            measurements = measure_implementation(dense, sets, budget.target_for(left), None)
            del sets
        left -= 2
        records += [varlen_record(case, m) for m in measurements]
        free_memory(torch)
        bar.update(1)
    bar.close()
    return records


def varlen_report(torch, budget, l2_bytes):
    """The JSON-ready varlen section: the lengths, every record and the ratios."""
    cases = varlen_cases()
    records = varlen_table(torch, budget, l2_bytes, cases)
    return {
        "lengths": {case.kind: list(case.lengths) for case in cases},
        "seed": VARLEN_SEED,
        "records": records,
        "ratios": varlen_ratios(records),
    }


def _count_cases(count):
    return f"{count} case{'s' if count > 1 else ''}"


def format_varlen_intro(record):
    """The lines above the varlen tables: the problem, the lengths, the peers."""
    records = record["records"]
    first = records[0]
    heads = ", ".join(
        f"{h} at D = {d}" for d, h in sorted({(r["head_dim"], r["heads"]) for r in records})
    )
    lines = [
        f"{first['dtype']}, {first['tokens']} tokens packed, H = {HIDDEN} / D ({heads}), "
        "causal and not."
    ]
    dense = {
        r["kind"]: (r["batch"], r["seqlen"]) for r in records if r["impl"] == CuflashDenseEqual.name
    }
    for kind, lengths in record.get("lengths", {}).items():
        shape = dense.get(kind)
        dense_text = "" if shape is None else f"; dense-equal B={shape[0]} S={shape[1]}"
        if kind == "uniform":
            low, high = VARLEN_LENGTH_RANGE
            lines.append(
                f"Uniform: {len(lengths)} sequences, lengths drawn uniformly from "
                f"{low}..{high} (seed {record.get('seed')}, the last trimmed): "
                f"{', '.join(map(str, lengths))}; mean "
                f"{sum(lengths) / len(lengths):.1f}{dense_text}."
            )
        else:
            lines.append(f"Equal: {len(lengths)} x {lengths[0]}{dense_text}.")
    lines.append(
        "TFLOP/s count only the work inside each sequence (causal: half of its "
        "square), summed over the sequences. cuflash-dense-equal: the dense kernels "
        "on equal lengths of the batch's mean (rounded to a multiple of "
        f"{VARLEN_DENSE_MULTIPLE}), its own FLOPs. torch-nested-flash: SDPA with the "
        "flash backend forced on nested jagged tensors; torch-flex: torch.compile'd "
        "flex_attention with a document mask (block mask built once, untimed)."
    )
    return lines


def format_varlen_table(records, direction):
    """One direction of the varlen table: TFLOP/s, cuflash varlen / each peer, the target."""
    rows = [r for r in records if r["direction"] == direction]
    impls = [impl for impl in VARLEN_IMPLS if any(r["impl"] == impl for r in rows)]
    peers = impls[1:]
    by_key = {(r["kind"], r["head_dim"], r["causal"], r["impl"]): r for r in rows}
    ratios = {(r["kind"], r["head_dim"], r["causal"]): r for r in varlen_ratios(rows)}
    target_peer, target_ratio = VARLEN_TARGET
    title = {"fwd": "forward", "bwd": "backward"}[direction]
    lines = [
        f"#### {title.capitalize()}: TFLOP/s and cuflash-varlen / peer (target: "
        f"cuflash-varlen / {target_peer} >= {target_ratio:g})",
        "",
        "| lengths | D | H | causal | dense B x S | "
        + " | ".join(impls)
        + " | "
        + " | ".join(f"varlen / {peer}" for peer in peers)
        + " |",
        "|---|---|---|---|---|" + "---|" * (len(impls) + len(peers)),
    ]
    below, target_measured = [], False
    for key, ratio in ratios.items():
        cells = [by_key.get((*key, impl), {}).get("tflops") for impl in impls]
        dense = by_key.get((*key, CuflashDenseEqual.name))
        first = next(r for r in rows if (r["kind"], r["head_dim"], r["causal"]) == key)
        lines.append(
            f"| {first['label']} | {key[1]} | {first['heads']} | {key[2]} | "
            + ("–" if dense is None else f"{dense['batch']} x {dense['seqlen']}")
            + " | "
            + " | ".join("–" if t is None else format_tflops(t) for t in cells)
            + " | "
            + " | ".join(format_ratio(ratio.get(peer)) for peer in peers)
            + " |"
        )
        value = ratio.get(target_peer)
        target_measured = target_measured or value is not None
        if value is not None and value < target_ratio:
            below.append(f"{first['label']} D={key[1]}{' causal' if key[2] else ''} ({value:.2f}x)")
    if target_measured:
        lines += [
            "",
            f"Below target (cuflash-varlen / {target_peer} < {target_ratio:g}): "
            + (", ".join(below) if below else "none")
            + ".",
        ]
    errors: dict[str, float] = {}
    for r in rows:
        if r["rel_error"] is not None:
            errors[r["impl"]] = max(errors.get(r["impl"], 0.0), r["rel_error"])
    if errors:
        lines += [
            "",
            "Largest relative L2 distance of a forward output from cuflash-varlen's: "
            + ", ".join(f"{impl} {error:.1e}" for impl, error in errors.items()),
        ]
    notes: dict[tuple[str, str], int] = {}
    for r in rows:
        if r["median_s"] is None:
            notes[(r["impl"], r["note"])] = notes.get((r["impl"], r["note"]), 0) + 1
    if notes:
        lines += ["", "Not measured (–):", ""] + [
            f"- {impl}: {note} ({_count_cases(count)})" for (impl, note), count in notes.items()
        ]
    return "\n".join(lines)


def format_varlen(record):
    """The packed variable-length tables (forward, backward) of a report's varlen section."""
    title = "### Packed variable-length batch"
    if not record.get("records"):
        return f"{title}\n\nNot measured: {record.get('note') or 'no cases'}."
    return "\n\n".join(
        [title, "\n".join(format_varlen_intro(record))]
        + [format_varlen_table(record["records"], d) for d in DIRECTIONS]
    )
