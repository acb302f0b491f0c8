"""Peak extra memory of one forward pass, cuflash's and naive attention's, against S."""

from ..api import flash_attention_fwd
from .cases import HIDDEN, Case, make_input_sets
from .environment import cupy
from .implementations import naive_attention
from .measure import failure_reason

MEMORY_SEQLENS = tuple(1024 * 2**i for i in range(8))  # 1k .. 128k
QUICK_MEMORY_SEQLENS = (1024, 4096, 16384)
MEMORY_HEAD_DIM = 128


def pool_growth_bytes(call):
    """Bytes CuPy's memory pool grows by while ``call()`` runs.

    The pool keeps freed blocks until ``free_all_blocks``, so its growth
    from an emptied state is the high-water mark of the call's allocations
    (outputs included, arrays that existed before excluded).
    """
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    result = call()
    cupy.cuda.Device().synchronize()
    del result
    return pool.total_bytes() - before


def memory_record(impl, case, call):
    """Peak extra memory of one forward call, or "OOM"."""
    record = {
        "impl": impl,
        "seqlen": case.seqlen,
        "batch": case.batch,
        "heads": case.heads,
        "head_dim": case.head_dim,
        "dtype": case.dtype,
        "peak_bytes": None,
        "note": "",
    }
    try:
        record["peak_bytes"] = pool_growth_bytes(call)
    except Exception as exc:  # noqa: BLE001 - any failure is reported, not raised
        record["note"] = failure_reason(exc, [])
    cupy.get_default_memory_pool().free_all_blocks()
    return record


def memory_records(case):
    """Peak forward memory of cuflash and naive attention on one draw of ``case``."""
    x = make_input_sets(case, 1)[0]
    heads = (case.heads, case.heads, case.head_dim)
    return [
        memory_record("cuflash", case, lambda: flash_attention_fwd(x.q, x.k, x.v, *heads)),
        memory_record("cupy-naive", case, lambda: naive_attention(x.q, x.k, x.v)),
    ]


def memory_sweep(dtype, seqlens, budget):
    """Peak forward memory of cuflash and naive attention (B=1, H=16, D=128) against S."""
    records = []
    for seqlen in seqlens:
        if budget.remaining() <= 0:
            break
        records += memory_records(
            Case(dtype, MEMORY_HEAD_DIM, seqlen, False, batch=1, heads=HIDDEN // MEMORY_HEAD_DIM)
        )
    return records


def format_memory(records):
    """A Markdown table of peak forward memory (GiB) against S."""
    impls = list(dict.fromkeys(r["impl"] for r in records))
    by_key = {(r["seqlen"], r["impl"]): r for r in records}
    first = records[0]
    lines = [
        f"### Peak extra memory of one forward pass (GiB; {first['dtype']}, "
        f"B={first['batch']}, H={first['heads']}, D={first['head_dim']})",
        "",
        "| S | " + " | ".join(impls) + " |",
        "|---|" + "---|" * len(impls),
    ]
    for seqlen in sorted({r["seqlen"] for r in records}):
        cells = []
        for impl in impls:
            r = by_key.get((seqlen, impl))
            cells.append(
                "–"
                if r is None
                else r["note"]
                if r["peak_bytes"] is None
                else f"{r['peak_bytes'] / 2**30:.3f}"
            )
        lines.append(f"| {seqlen} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
