"""Decoding from a KV cache (``--decode``, the KV-cache page): ``flash_attention_with_kvcache``
on contiguous and paged caches, next to torch SDPA on a contiguous cache of the same keys and
values, and (one token a step, no append) on the same cache rounded to FP8 (e4m3, the FP8
page) with the bfloat16 query."""

import contextlib
import dataclasses
import functools

import numpy as np

from ..fp8 import DECODE_TABLE
from ..rotary import tables as rotary_tables
from .cases import DTYPES, sets_spanning_l2
from .environment import cupy
from .formatting import format_ratio, format_us
from .implementations import TORCH_BACKENDS, forced_backend, sdpa_backends
from .measure import agreement, forward_output, free_memory, run_or_reason
from .progress import progress_bar
from .timing import time_calls

# Decoding from a KV cache (issue 15, the KV-cache page): bfloat16, D=128, H=32, H_kv=8.
DECODE_BATCH_CACHE = ((1, 8192), (1, 32768), (4, 8192), (16, 8192), (64, 4096), (128, 2048))
DECODE_BLOCK_SIZES = (0, 16, 256)  # 0: contiguous
DECODE_LONG_QUERY_CACHE = (16, 8192)  # B, cache length of the longer query blocks
DECODE_LONG_QUERY_LENS = (4, 512)  # speculative decoding, chunked prefill
DECODE_PEERS = ("FLASH_ATTENTION", "CUDNN_ATTENTION")
DECODE_TARGET_TB_PER_S = 3.4  # 80% of the H200's copy rate, where the cache is >= 256 MB
DECODE_TARGET_MIN_BYTES = 256e6
# An FP8 cache's step (the FP8 page): at most this fraction of the bfloat16 step's time (half
# the bytes) from this batch size on.
DECODE_FP8_TARGET, DECODE_FP8_MIN_BATCH = 0.55, 16
FP8_NAME = "cuflash e4m3"
# Rotary embedding at the append (the KV-cache page): one new token appended a step, with
# and without the tables, on these layouts; the tables may cost at most this fraction.
DECODE_ROTARY_BATCH_CACHE = (64, 4096)
DECODE_ROTARY_BLOCK_SIZES = (0, 16)
DECODE_ROTARY_TARGET = 0.05


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decoding step from a KV cache of ``cache_len`` keys a sequence (the KV-cache page).

    ``block_size`` 0 is a contiguous cache ``[B, H_kv, L, D]``; otherwise the
    cache is paged in blocks of that many keys. With ``new_len`` the step appends
    that many rows (``L - new_len`` cached before it), with ``rotary`` rotated by
    rotary tables of ``L`` positions over the whole head.
    """

    batch: int
    cache_len: int
    q_len: int = 1
    block_size: int = 0
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    new_len: int = 0
    rotary: bool = False

    @property
    def layout(self):
        return "contiguous" if self.block_size == 0 else f"paged {self.block_size}"

    @property
    def group(self):
        """The same step on a contiguous cache: the case torch is timed on."""
        return dataclasses.replace(self, block_size=0)

    @property
    def cache_bytes(self):
        """Bytes of keys and values the step reads: ``2 * B * H_kv * L * D * itemsize``."""
        return (
            2
            * self.batch
            * self.kv_heads
            * self.cache_len
            * self.head_dim
            * DTYPES[self.dtype].itemsize
        )


def decode_cases():
    """The decode table: S_q = 1 on every layout, then longer query blocks (contiguous)."""
    cases = [
        DecodeCase(batch, cache_len, block_size=block_size)
        for batch, cache_len in DECODE_BATCH_CACHE
        for block_size in DECODE_BLOCK_SIZES
    ]
    batch, cache_len = DECODE_LONG_QUERY_CACHE
    cases += [DecodeCase(batch, cache_len, q_len) for q_len in DECODE_LONG_QUERY_LENS]
    batch, cache_len = DECODE_ROTARY_BATCH_CACHE
    return cases + [
        DecodeCase(batch, cache_len, new_len=1, block_size=block_size, rotary=rotary)
        for block_size in DECODE_ROTARY_BLOCK_SIZES
        for rotary in (False, True)
    ]


@dataclasses.dataclass(frozen=True)
class DecodeInputSet:
    """Queries, the cache as cuflash reads it, and the same keys and values contiguous."""

    q: object
    k: object  # [B, H_kv, L, D], contiguous: what torch reads
    v: object
    cache_seqlens: object  # int32 [B] on the device
    k_cache: object  # k itself, or its paged copy
    v_cache: object
    block_table: object = None
    k_new: object = None  # [B, H_kv, new_len, D] appended a step, or None
    v_new: object = None
    rotary_cos: object = None  # [L, D / 2] float32 tables, or None
    rotary_sin: object = None


def make_decode_sets(case, count, seed=0):
    """``count`` standard-normal input sets of ``case`` on a contiguous cache."""
    rng = cupy.random.default_rng(seed)
    dtype = DTYPES[case.dtype]

    def draw(heads, rows):
        shape = (case.batch, heads, rows, case.head_dim)
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    rotary_cos = rotary_sin = None
    if case.rotary:
        rotary_cos, rotary_sin = rotary_tables(case.cache_len, case.head_dim, xp=cupy)
    sets = []
    for _ in range(count):
        k, v = draw(case.kv_heads, case.cache_len), draw(case.kv_heads, case.cache_len)
        k_new, v_new = (
            [draw(case.kv_heads, case.new_len) for _ in "kv"] if case.new_len else [None] * 2
        )
        sets.append(
            DecodeInputSet(
                draw(case.heads, case.q_len),
                k,
                v,
                cupy.full(case.batch, case.cache_len - case.new_len, dtype=np.int32),
                k,
                v,
                None,
                k_new,
                v_new,
                rotary_cos,
                rotary_sin,
            )
        )
    return sets


def e4m3_bits(x):
    """CuPy ``x`` rounded to the nearest e4m3 value (saturated at +-448) as uint8 bits, on
    the GPU: the magnitude's place among the midpoints of the positive e4m3 values."""
    assert DECODE_TABLE is not None  # ml_dtypes is a dependency
    positive = cupy.asarray(DECODE_TABLE[:0x7F].astype(np.float32))  # 0 .. 448, increasing
    midpoints = (positive[1:] + positive[:-1]) / 2
    magnitude = cupy.abs(x.astype(np.float32))
    bits = cupy.searchsorted(midpoints, magnitude).astype(np.uint8)
    return bits | (cupy.signbit(x).astype(np.uint8) << 7)


def e4m3_input_set(x):
    """``x`` with its cache (contiguous or paged) rounded to e4m3 bits."""
    return dataclasses.replace(x, k_cache=e4m3_bits(x.k_cache), v_cache=e4m3_bits(x.v_cache))


def paged_input_set(x, block_size, seed=0):
    """``x`` with its cache copied into shuffled blocks of ``block_size`` keys.

    Blocks ``[num_blocks, H_kv, block_size, D]``; ``block_table[b, j]`` holds
    keys ``j * block_size ..`` of sequence ``b``. The cache length must be a
    multiple of ``block_size``.
    """
    xp = cupy.get_array_module(x.k)  # NumPy arrays work too
    batch, kv_heads, cache_len, head_dim = x.k.shape
    if cache_len % block_size:
        raise ValueError(f"cache length {cache_len} is not a multiple of {block_size}")
    per_sequence = cache_len // block_size
    order = xp.asarray(np.random.default_rng(seed).permutation(batch * per_sequence))
    block_table = order.astype(np.int32).reshape(batch, per_sequence)

    def paged(cache):
        blocks = cache.reshape(batch, kv_heads, per_sequence, block_size, head_dim)
        blocks = blocks.transpose(0, 2, 1, 3, 4).reshape(-1, kv_heads, block_size, head_dim)
        out = xp.empty_like(blocks)
        out[order] = blocks
        return out

    return dataclasses.replace(x, k_cache=paged(x.k), v_cache=paged(x.v), block_table=block_table)


class CuflashDecode:
    """``cuflash.flash_attention_with_kvcache``: bottom-right causal, appending the case's
    new rows (none in most cases), with its rotary tables if any."""

    name = "cuflash"

    def __init__(self, case, function):
        self.case, self.function = case, function

    def context(self):
        return contextlib.nullcontext()

    def forward_call(self, x):
        c = self.case
        return functools.partial(
            self.function,
            x.q,
            x.k_cache,
            x.v_cache,
            c.heads,
            c.kv_heads,
            c.head_dim,
            True,
            cache_seqlens=x.cache_seqlens,
            block_table=x.block_table,
            **{
                name: getattr(x, name)
                for name in ("k_new", "v_new", "rotary_cos", "rotary_sin")
                if getattr(x, name) is not None
            },
        )


class CuflashFp8Decode(CuflashDecode):
    """The same step on the cache rounded to e4m3 (uint8 bits), the query bfloat16."""

    name = FP8_NAME

    def forward_call(self, x):
        return functools.partial(super().forward_call(x), fp8_format="e4m3")


class TorchDecode:
    """SDPA with one forced backend on the contiguous cache, bottom-right causal.

    ``S_q = 1`` sees every key (no mask); longer query blocks take
    ``causal_lower_right``. GQA by ``enable_gqa=True``, or, when the backend
    refuses it, by k and v repeated to the query heads (copied once, untimed);
    ``gqa`` says which.
    """

    def __init__(self, case, torch, backend):
        self.case, self.torch, self.backend = case, torch, backend
        self.name = TORCH_BACKENDS[backend.name]
        self.gqa = None

    def context(self):
        return forced_backend(self.torch, self.backend)

    def forward_call(self, x):
        torch, c = self.torch, self.case
        sdpa = torch.nn.functional.scaled_dot_product_attention
        q, k, v = (torch.from_dlpack(a) for a in (x.q, x.k, x.v))
        mask = None
        if c.q_len > 1:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(c.q_len, c.cache_len)
        try:
            sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
            self.gqa = "enable_gqa=True"
            return lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        except Exception:  # noqa: BLE001 - the backend's refusal; repeat k/v instead
            group = c.heads // c.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            self.gqa = "k/v repeated"
            return lambda: sdpa(q, k, v, attn_mask=mask)


def decode_record(case, impl, timing, note, rel_error=None):
    """A JSON-ready record of one decode measurement."""
    record = {
        "impl": impl.name,
        **dataclasses.asdict(case),
        "layout": case.layout,
        "cache_bytes": case.cache_bytes,
        "note": note,
        "rel_error": rel_error,
        "gqa": getattr(impl, "gqa", None),
        "median_s": None,
    }
    if timing is not None:
        record.update(timing.summary())
    return record


def decode_table(function, torch, budget, l2_bytes):
    """Decode records: cuflash on every case, torch's peers once a contiguous group."""
    cases = decode_cases()
    groups = list(dict.fromkeys(c.group for c in cases))
    peers = sdpa_backends(torch, DECODE_PEERS)
    left = len(cases) + len(groups) * len(peers)
    records = []
    bar = progress_bar(len(cases), "decode cases")
    for group in groups:
        if budget.remaining() <= 0:
            records += [
                decode_record(c, CuflashDecode(c, function), None, "time budget exhausted")
                for c in cases
                if c.group == group
            ]
            bar.update(sum(c.group == group for c in cases))
            continue
        set_bytes = 2 * group.cache_bytes  # q is small; out too
        contiguous_sets = make_decode_sets(group, sets_spanning_l2(set_bytes, l2_bytes))
        reference = None
        for case in (c for c in cases if c.group == group):
            bar.set_postfix_str(f"B={case.batch} L={case.cache_len} S_q={case.q_len} {case.layout}")
            impls: list[CuflashDecode | TorchDecode] = [CuflashDecode(case, function)]
            if case.block_size == 0 and not case.new_len:  # torch: the steps without appends
                impls += [TorchDecode(case, torch, backend) for backend in peers]
            inputs = (
                contiguous_sets
                if case.block_size == 0
                else [paged_input_set(x, case.block_size) for x in contiguous_sets]
            )
            fp8_step = case.q_len == 1 and not case.new_len
            if fp8_step:
                impls.append(CuflashFp8Decode(case, function))
            for impl in impls:
                if impl.name == FP8_NAME:
                    del inputs
                    free_memory(torch)
                    base = (
                        contiguous_sets
                        if case.block_size == 0
                        else [paged_input_set(x, case.block_size) for x in contiguous_sets]
                    )
                    inputs = [e4m3_input_set(x) for x in base]
                    del base
                timing, note = None, "time budget exhausted"
                if budget.remaining() > 0:
                    timing, note = run_or_reason(
                        impl,
                        lambda impl=impl: time_calls(
                            [impl.forward_call(x) for x in inputs], budget.target_for(left)
                        ),
                    )
                left -= 1
                rel_error = None
                if timing is not None and reference is not None:
                    rel_error = agreement(impl, inputs[0], reference)
                elif timing is not None:  # the first output of the group is the reference
                    reference, _ = run_or_reason(
                        impl, lambda impl=impl: forward_output(impl, inputs[0])
                    )
                records.append(decode_record(case, impl, timing, note, rel_error))
            del inputs
            free_memory(torch)
            bar.update(1)
        del contiguous_sets, reference
        free_memory(torch)
    bar.close()
    return records


def step_label(record):
    """The layout column of a decode record: the layout, then the append and the rotary
    tables where the step has them."""
    label = record["layout"]
    if record.get("new_len"):
        label += f", append {record['new_len']}"
    if record.get("rotary"):
        label += ", rotary"
    return label


def rotary_cost(records):
    """Lines on what the rotary tables cost a decoding step: cuflash's time of each rotary
    step against the same step without the tables (target: at most
    DECODE_ROTARY_TARGET more)."""
    plain = {}
    for r in records:
        if r["impl"] == "cuflash" and r.get("new_len") and not r.get("rotary"):
            plain[(r["batch"], r["cache_len"], r["layout"], r["new_len"])] = r["median_s"]
    parts, missed = [], []
    for r in records:
        if r["impl"] != "cuflash" or not r.get("rotary"):
            continue
        without = plain.get((r["batch"], r["cache_len"], r["layout"], r["new_len"]))
        with_tables = r["median_s"]
        where = f"B={r['batch']} cache {r['cache_len']} {r['layout']}"
        if without is None or with_tables is None:
            parts.append(f"{where}: not measured")
            continue
        extra = with_tables / without - 1
        parts.append(
            f"{where}: {format_us(without)} us without, {format_us(with_tables)} us with "
            f"({extra:+.1%})"
        )
        if extra > DECODE_ROTARY_TARGET:
            missed.append(where)
    if not parts:
        return []
    return [
        "",
        f"Rotary embedding at the append (one new token a step): {'; '.join(parts)}. "
        f"Target: at most {DECODE_ROTARY_TARGET:+.0%}; missed: "
        + (", ".join(missed) if missed else "none")
        + ".",
    ]


def format_decode(record):
    """The decode table: time, cache bytes per second, torch's times and the ratio."""
    title = (
        "### Decoding from a KV cache (forward time in us; TB/s = cache bytes read / cuflash time)"
    )
    if not record.get("records"):
        return f"{title}\n\nNot measured: {record.get('note') or 'no cases'}."
    records = record["records"]
    ours = ("cuflash", FP8_NAME)
    peers = list(dict.fromkeys(r["impl"] for r in records if r["impl"] not in ours))
    torch_by_group = {}
    fp8_by_step = {}
    for r in records:
        if r["impl"] == FP8_NAME:
            fp8_by_step[(r["batch"], r["cache_len"], r["layout"])] = r
        elif r["impl"] != "cuflash":
            torch_by_group[(r["batch"], r["cache_len"], r["q_len"], r["impl"])] = r
    first = records[0]
    lines = [
        title,
        "",
        f"{first['dtype']}, D={first['head_dim']}, H={first['heads']}, "
        f"H_kv={first['kv_heads']}, causal (bottom-right); torch SDPA on a contiguous "
        "cache of the same keys and values, without a mask at S_q = 1 (every key "
        "visible), with `causal_lower_right(S_q, L)` above.",
        "",
        "| B | cache | S_q | layout | cuflash | TB/s | "
        + " | ".join(peers)
        + " | faster torch / cuflash | e4m3 cache | TB/s | e4m3 / bfloat16 |",
        "|---|---|---|---|---|---|" + "---|" * len(peers) + "---|---|---|---|",
    ]
    below = []
    for r in (r for r in records if r["impl"] == "cuflash"):
        mine = r["median_s"]
        theirs = [
            torch_by_group.get((r["batch"], r["cache_len"], r["q_len"], peer), {}).get("median_s")
            for peer in peers
        ]
        measured = [t for t in theirs if t is not None]
        ratio = min(measured) / mine if measured and mine is not None else None
        rate = None if mine is None else r["cache_bytes"] / mine / 1e12
        fp8 = None
        if r["q_len"] == 1 and not r.get("new_len"):
            fp8 = fp8_by_step.get((r["batch"], r["cache_len"], r["layout"]), {}).get("median_s")
        fp8_rate = None if fp8 is None else r["cache_bytes"] / 2 / fp8 / 1e12
        fp8_ratio = None if fp8 is None or mine is None else fp8 / mine
        lines.append(
            f"| {r['batch']} | {r['cache_len']} | {r['q_len']} | {step_label(r)} | "
            f"{format_us(mine)} | {'–' if rate is None else f'{rate:.2f}'} | "
            + " | ".join(format_us(t) for t in theirs)
            + f" | {format_ratio(ratio)} | {format_us(fp8)} | "
            + f"{'–' if fp8_rate is None else f'{fp8_rate:.2f}'} | "
            + f"{'–' if fp8_ratio is None else f'{fp8_ratio:.2f}'} |"
        )
        misses = [f"{ratio:.2f}x"] if ratio is not None and ratio < 1 else []
        if (
            fp8_ratio is not None
            and r["batch"] >= DECODE_FP8_MIN_BATCH
            and fp8_ratio > DECODE_FP8_TARGET
        ):
            misses.append(f"e4m3 {fp8_ratio:.2f} of bfloat16")
        if (
            rate is not None
            and r["q_len"] == 1
            and r["cache_bytes"] >= DECODE_TARGET_MIN_BYTES
            and rate < DECODE_TARGET_TB_PER_S
        ):
            misses.append(f"{rate:.2f} TB/s")
        if misses:
            below.append(
                f"B={r['batch']} cache {r['cache_len']} S_q={r['q_len']} {step_label(r)} "
                f"({', '.join(misses)})"
            )
    lines += [
        "",
        "Targets: cuflash time <= the faster torch backend's (ratio >= 1); "
        f">= {DECODE_TARGET_TB_PER_S:g} TB/s where the cache is >= "
        f"{DECODE_TARGET_MIN_BYTES / 1e6:.0f} MB; from an e4m3 cache (the same values rounded, "
        f"TB/s of its bytes) at most {DECODE_FP8_TARGET:g}x the bfloat16 step's time from "
        f"B = {DECODE_FP8_MIN_BATCH}. Below target: "
        + (", ".join(below) if below else "none")
        + ".",
    ]
    lines += rotary_cost(records)
    modes: dict[str, dict[str, int]] = {}
    for r in records:
        if r.get("gqa"):
            modes.setdefault(r["impl"], {}).setdefault(r["gqa"], 0)
            modes[r["impl"]][r["gqa"]] += 1
    if modes:
        lines += [
            "",
            "torch's grouped-query attention: "
            + "; ".join(
                f"{impl} "
                + ", ".join(
                    f"{mode} ({count} case{'s' if count > 1 else ''})"
                    for mode, count in by_mode.items()
                )
                for impl, by_mode in modes.items()
            )
            + ".",
        ]
    errors: dict[str, float] = {}
    for r in records:
        if r["rel_error"] is not None:
            key = f"{r['impl']} {r['layout']}" if r["impl"] == "cuflash" else r["impl"]
            errors[key] = max(errors.get(key, 0.0), r["rel_error"])
    if errors:
        lines += [
            "",
            "Largest relative L2 distance of an output from the first of its keys "
            "and values (cuflash contiguous where it ran): "
            + ", ".join(f"{key} {error:.1e}" for key, error in errors.items()),
        ]
    notes: dict[tuple[str, str], int] = {}
    for r in records:
        if r["median_s"] is None:
            notes[(r["impl"], r["note"])] = notes.get((r["impl"], r["note"]), 0) + 1
    if notes:
        lines += ["", "Not measured (–):", ""] + [
            f"- {impl}: {note} ({count} case{'s' if count > 1 else ''})"
            for (impl, note), count in notes.items()
        ]
    return "\n".join(lines)
