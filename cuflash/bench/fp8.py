"""FP8 forward (``--fp8``): the e4m3 forward (the FP8 page) against the bfloat16 forward
on the same shapes, and against cuDNN's FP8 attention where a peer is available.

Cases: the grid's shapes (``B * S = 16384`` tokens, ``H = 2048 / D``) for D 64 and 128,
S 1024 and 4096, causal and not; q, k and v as uint8 CuPy arrays of e4m3 bits with
per-(batch, KV head) descales, the output in bfloat16. TFLOP/s follow the Performance
page's forward convention. On an H100/H200 these calls run the FP8 kernel
(``cuflash.gpu.fp8_plan``: v's transpose, then e4m3 products); its row includes the
transpose.

The cuDNN peer comes from ``nvidia-cudnn-frontend`` (the ``cudnn`` module), an optional
dependency: :func:`cudnn_fp8_peer` is the hook that builds it, and reports why not when
the module is absent.
"""

import contextlib
import dataclasses
import types

import numpy as np

import cuflash

from .cases import DTYPES, attention_flops, sets_spanning_l2, tflops
from .environment import cupy
from .formatting import format_ratio, format_tflops
from .measure import run_or_reason
from .progress import print_status
from .timing import time_calls

FP8_HEAD_DIMS = (64, 128)
FP8_SEQLENS = (1024, 4096)
CALLS = ("cuflash fp8", "cuflash bfloat16", "cudnn fp8")
_NO_CONTEXT = types.SimpleNamespace(context=contextlib.nullcontext)


@dataclasses.dataclass(frozen=True)
class Fp8Case:
    """q, k, v ``[batch, heads, seqlen, head_dim]`` in e4m3, the output in bfloat16."""

    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool

    def flops(self):
        return attention_flops(
            self.batch, self.heads, self.seqlen, self.head_dim, self.causal, "fwd"
        )


def fp8_cases(head_dims=FP8_HEAD_DIMS, seqlens=FP8_SEQLENS):
    """The table's cases on the grid's shapes."""
    return [
        Fp8Case(16384 // s, 2048 // d, s, d, causal)
        for d in head_dims
        for s in seqlens
        for causal in (False, True)
    ]


def _input_sets(case, count, seed=0):
    """``count`` draws of q, k, v: unit normal values quantized on the GPU (amax scaling a
    batch entry and head) as uint8 e4m3 bits, their descales, and the bfloat16 values."""
    rng = cupy.random.default_rng(seed)
    shape = (case.batch, case.heads, case.seqlen, case.head_dim)
    sets = []
    for _ in range(count):
        drawn = {}
        for name in "qkv":
            x = rng.standard_normal(shape, dtype=np.float32)
            host, descale = cuflash.fp8.quantize(cupy.asnumpy(x), case.heads)
            drawn[name] = cupy.asarray(host.view(np.uint8))
            drawn[f"{name}_descale"] = cupy.asarray(descale)
            drawn[f"{name}_bf16"] = x.astype(DTYPES["bfloat16"])
        sets.append(drawn)
    return sets


def _fp8_call(case, x):
    return lambda: cuflash.flash_attention_fwd(
        x["q"],
        x["k"],
        x["v"],
        case.heads,
        case.heads,
        case.head_dim,
        case.causal,
        fp8_format="e4m3",
        q_descale=x["q_descale"],
        k_descale=x["k_descale"],
        v_descale=x["v_descale"],
    )


def fp8_forward_step(case, seed=0):
    """One FP8 forward of ``case`` (an :class:`Fp8Case`) on one draw of quantized inputs, as
    a function to call (asv's ``Fp8Forward`` times it)."""
    return _fp8_call(case, _input_sets(case, 1, seed)[0])


def _bf16_call(case, x):
    return lambda: cuflash.flash_attention_fwd(
        x["q_bf16"], x["k_bf16"], x["v_bf16"], case.heads, case.heads, case.head_dim, case.causal
    )


def cudnn_fp8_peer():
    """``(make_call, note)``: ``make_call(case, x)`` returns a no-argument callable running
    cuDNN's FP8 forward (``nvidia-cudnn-frontend``'s ``sdpa_fp8`` graph, one a case) on
    input set ``x``; or None with the reason it cannot. cuDNN takes one descale a tensor
    (ones here: the timing does not depend on them) and, on Hopper, writes its output in
    e4m3 (half the bytes of cuflash's bfloat16 output)."""
    try:
        import cudnn
    except ImportError:
        return None, "nvidia-cudnn-frontend is not installed (pip install nvidia-cudnn-frontend)"
    except (OSError, AssertionError) as exc:  # the module found no cuDNN library
        return None, f"nvidia-cudnn-frontend could not load cuDNN: {exc}"
    graphs = {}

    def make_call(case, x):
        if case not in graphs:
            graphs[case] = _CudnnFp8Graph(cudnn, case)
        return graphs[case].call(x)

    return make_call, f"cudnn frontend {getattr(cudnn, '__version__', 'unknown')}"


class _CudnnFp8Graph:
    """cuDNN's FP8 SDPA forward of one case, built once: q, k, v and the output e4m3
    ``[B, H, S, D]`` (contiguous), six float32 scalars (the descales of q, k, v and S, the
    scales of S and O), the maxima of S and O."""

    def __init__(self, cudnn, case):
        e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=cupy.cuda.get_current_stream().ptr)
        graph = cudnn.pygraph(
            io_data_type=e4m3,
            intermediate_data_type=fp32,
            compute_data_type=fp32,
            handle=self.handle,
        )
        b, h, s, d = case.batch, case.heads, case.seqlen, case.head_dim
        shape, stride = (b, h, s, d), (h * s * d, s * d, d, 1)
        self.q, self.k, self.v = (
            graph.tensor(name=n, dim=shape, stride=stride, data_type=e4m3) for n in "qkv"
        )
        scalar = dict(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=fp32)
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        self.scalars = [graph.tensor(name=n, **scalar) for n in names]
        self.o, _, amax_s, amax_o = graph.sdpa_fp8(
            self.q,
            self.k,
            self.v,
            *self.scalars,
            generate_stats=False,
            attn_scale=1.0 / np.sqrt(d),
            use_causal_mask=case.causal,
            name="sdpa_fp8",
        )
        self.o.set_output(True).set_dim(shape).set_stride(stride).set_data_type(e4m3)
        self.maxima = (amax_s, amax_o)
        for amax in self.maxima:
            amax.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1))
            amax.set_data_type(fp32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace = cupy.empty(max(1, graph.get_workspace_size()), np.uint8)
        self.out = cupy.empty(shape, np.uint8)
        self.ones = cupy.ones(len(names), np.float32)
        self.amax = cupy.zeros(2, np.float32)

    def call(self, x):
        pack = {self.q: x["q"].data.ptr, self.k: x["k"].data.ptr, self.v: x["v"].data.ptr}
        pack[self.o] = self.out.data.ptr
        for i, t in enumerate(self.scalars):
            pack[t] = self.ones.data.ptr + 4 * i
        for i, t in enumerate(self.maxima):
            pack[t] = self.amax.data.ptr + 4 * i
        workspace = self.workspace.data.ptr
        return lambda: self.graph.execute(pack, workspace, handle=self.handle)


def fp8_report(budget, l2_bytes, cases=None):
    """Median GPU time of each call of each case (records; a call that cannot run has a
    note instead of a timing)."""
    cases = fp8_cases() if cases is None else cases
    peer, peer_note = cudnn_fp8_peer()
    makers = {"cuflash fp8": _fp8_call, "cuflash bfloat16": _bf16_call, "cudnn fp8": peer}
    records = []
    left = len(cases) * len(CALLS)
    for case in cases:
        # q, k, v: one byte an element in e4m3, two in bfloat16
        set_bytes = 3 * 3 * case.batch * case.heads * case.seqlen * case.head_dim
        sets, note = run_or_reason(
            _NO_CONTEXT, lambda case=case: _input_sets(case, sets_spanning_l2(set_bytes, l2_bytes))
        )
        for name in CALLS:
            print_status(f"fp8: {name} {case}")
            timing = None
            make = makers[name]
            call_note = note if make is not None else peer_note
            if sets is not None and make is not None:
                target = budget.target_for(left)
                timing, call_note = run_or_reason(
                    _NO_CONTEXT,
                    lambda make=make, case=case: time_calls([make(case, x) for x in sets], target),
                )
            left -= 1
            records.append(
                {
                    "call": name,
                    **dataclasses.asdict(case),
                    "timing": None if timing is None else timing.summary(),
                    "flops": case.flops(),
                    "note": call_note,
                }
            )
    return records


def format_fp8(records):
    """The table: median time and TFLOP/s of each call, and bfloat16 / FP8 time."""
    lines = [
        "### FP8 (e4m3) forward: bfloat16 out, per-(batch, KV head) descales",
        "",
        "| D | S | causal | call | median ms | TFLOP/s | bfloat16 / fp8 |",
        "|---|---|---|---|---|---|---|",
    ]

    def median(record):
        return None if record is None or record["timing"] is None else record["timing"]["median_s"]

    by_key = {}
    for r in records:
        by_key[(r["head_dim"], r["seqlen"], r["causal"], r["call"])] = r
    shapes = dict.fromkeys((r["head_dim"], r["seqlen"], r["causal"]) for r in records)
    for shape in shapes:
        fp8_seconds = median(by_key.get((*shape, "cuflash fp8")))
        bf16_seconds = median(by_key.get((*shape, "cuflash bfloat16")))
        for call in CALLS:
            record = by_key.get((*shape, call))
            if record is None:
                continue
            seconds = median(record)
            ratio = (
                None if fp8_seconds is None or bf16_seconds is None else bf16_seconds / fp8_seconds
            )
            lines.append(
                f"| {shape[0]} | {shape[1]} | {shape[2]} | {call} | "
                + ("–" if seconds is None else f"{seconds * 1e3:.3f}")
                + " | "
                + ("–" if seconds is None else format_tflops(tflops(record["flops"], seconds)))
                + " | "
                + (format_ratio(ratio) if call == CALLS[0] else "")
                + " |"
            )
    notes = dict.fromkeys(
        f"- {r['call']}: {r['note']}" for r in records if r["timing"] is None and r["note"]
    )
    return "\n".join(lines + (["", "Not measured (–):", "", *notes] if notes else []))
