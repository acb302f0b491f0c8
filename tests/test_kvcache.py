"""flash_attention_with_kvcache (the KV-cache page): the CPU path and the GPU kernels
against a float64 oracle built from cuflash.reference.attention_reference one sequence at
a time; in-place appends; paged caches; every validation error; untrusted device-held
lengths and block ids."""

import dataclasses
import math

import numpy as np
import pytest
from support import DTYPES, HAS_GPU, check_lse, compile_and_check, rel_error, to_numpy

from cuflash import AttentionConfig, InvalidArgumentError
from cuflash.core.kvcache_problem import kvcache_problem
from cuflash.gpu import decode_kernels, kernel_build, plans, standalone
from cuflash.gpu.decode_kernels import ROW_TILES, num_splits
from cuflash.gpu.decode_tiles import decode_shape, decode_tc_keys, decode_tc_shape
from cuflash.kvcache import flash_attention_with_kvcache
from cuflash.reference import attention_reference

if HAS_GPU:
    import cupy

# Relative error bounds against the float64 oracle (the oracle sees the same rounded
# inputs: what is left is float32 accumulation and the output's rounding).
BOUND = {"float32": 2e-5, "float16": 1.5e-3, "bfloat16": 1e-2}


@dataclasses.dataclass(frozen=True)
class KVCase:
    """One call: shapes, options and the cache's layout."""

    dtype: str = "bfloat16"
    batch: int = 3
    heads: int = 4
    kv_heads: int = 2
    q_len: int = 1
    new_len: int = 0
    head_dim: int = 64
    capacity: int = 80  # contiguous S_cap, or max_blocks * block_size when paged
    block_size: int = 0  # 0: contiguous cache
    causal: bool = True
    window: object = 0
    scale: object = None
    lengths: str = "random"  # "random" (0 and full capacity included), "int", "full"
    vllm_layout: bool = False  # paged [num_blocks, block_size, H_kv, D] passed transposed
    shared_blocks: bool = False  # sequences share their first block
    softcap: float = 0.0  # score modifiers (semantics page)
    alibi: str = ""  # ALiBi slopes: "" none, "heads" [H], "batch" [B, H]
    sinks: bool = False  # attention sinks (float32 [H])

    def __str__(self):
        default = dataclasses.asdict(KVCase())
        return "-".join(
            f"{k}={v}"
            for k, v in dataclasses.asdict(self).items()
            if v != default[k] or k == "dtype"
        )


def make_inputs(case, rng, xp=np):
    """Fresh q, cache, new rows, lengths and block table for ``case`` (``xp`` arrays)."""
    dt = DTYPES[case.dtype]
    b, h, hk, d = case.batch, case.heads, case.kv_heads, case.head_dim

    def normal(shape):
        return rng.standard_normal(shape).astype(dt)

    room = case.capacity - case.new_len
    if case.lengths == "int":
        lengths = int(rng.integers(0, room + 1))
    elif case.lengths == "full":
        lengths = np.full(b, room, dtype=np.int32)
    else:  # random, with an empty cache and a full one whenever there are 3+ sequences
        lengths = rng.integers(0, room + 1, size=b).astype(np.int32)
        if b >= 3:
            lengths[0], lengths[1] = 0, room
    table = None
    if case.block_size:
        max_blocks = case.capacity // case.block_size
        num_blocks = b * max_blocks + 3  # spare blocks that no sequence uses
        table = rng.permutation(num_blocks)[: b * max_blocks].reshape(b, max_blocks)
        if case.shared_blocks:  # every sequence reads sequence 0's first block
            table[:, 0] = table[0, 0]
        table = table.astype(np.int32)
        if case.vllm_layout:
            k_cache = normal((num_blocks, case.block_size, hk, d)).transpose(0, 2, 1, 3)
            v_cache = normal((num_blocks, case.block_size, hk, d)).transpose(0, 2, 1, 3)
        else:
            k_cache = normal((num_blocks, hk, case.block_size, d))
            v_cache = normal((num_blocks, hk, case.block_size, d))
    else:
        k_cache = normal((b, hk, case.capacity, d))
        v_cache = normal((b, hk, case.capacity, d))
    q = normal((b, h, case.q_len, d))
    k_new = v_new = None
    if case.new_len:
        k_new, v_new = normal((b, hk, case.new_len, d)), normal((b, hk, case.new_len, d))

    def move(a):
        if a is None or xp is np:
            return a
        if a.ndim == 4 and not a.flags.c_contiguous:  # keep the transposed view a view
            return xp.asarray(np.ascontiguousarray(a.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
        return xp.asarray(a)

    if not isinstance(lengths, int):
        lengths = move(lengths)
    slopes = None
    if case.alibi:
        shape = (h,) if case.alibi == "heads" else (b, h)
        slopes = rng.uniform(0.05, 1.0, size=shape).astype(np.float32)
    sinks = rng.uniform(-1.0, 4.0, h).astype(np.float32) if case.sinks else None
    return dict(
        q=move(q),
        k_cache=move(k_cache),
        v_cache=move(v_cache),
        k_new=move(k_new),
        v_new=move(v_new),
        cache_seqlens=lengths,
        block_table=move(table),
        alibi_slopes=move(slopes),
        sinks=move(sinks),
    )


def host_lengths(case, inputs):
    lengths = inputs["cache_seqlens"]
    if isinstance(lengths, int):
        return np.full(case.batch, lengths, dtype=np.int64)
    return to_numpy(lengths).astype(np.int64)


def key_location(case, table, b, j):
    """(block or sequence, row) of key ``j`` of sequence ``b``."""
    if table is None:
        return b, j
    return int(table[b, j // case.block_size]), j % case.block_size


def expected_caches(case, inputs):
    """The caches after the call as NumPy arrays: the inputs with the new rows written."""
    k_cache, v_cache = (to_numpy(inputs[n]).copy() for n in ("k_cache", "v_cache"))
    table = None if inputs["block_table"] is None else to_numpy(inputs["block_table"])
    if case.new_len:
        k_new, v_new = to_numpy(inputs["k_new"]), to_numpy(inputs["v_new"])
        for b, length in enumerate(host_lengths(case, inputs)):
            for t in range(case.new_len):
                blk, row = key_location(case, table, b, int(length) + t)
                k_cache[blk, :, row] = k_new[b, :, t]
                v_cache[blk, :, row] = v_new[b, :, t]
    return k_cache, v_cache


def oracle(case, inputs, k_cache, v_cache):
    """Float64 (out, lse): each sequence's keys gathered, then attention_reference."""
    q = to_numpy(inputs["q"]).astype(np.float64)
    table = None if inputs["block_table"] is None else to_numpy(inputs["block_table"])
    out = np.zeros(q.shape)
    lse = np.zeros(q.shape[:3])
    sinks = None if inputs.get("sinks") is None else to_numpy(inputs["sinks"])
    for b, length in enumerate(host_lengths(case, inputs)):
        kv_len = int(length) + case.new_len
        if kv_len == 0:  # no key at all: zeros and -inf or the sinks (the oracle needs a key)
            out[b], lse[b] = 0.0, -np.inf if sinks is None else sinks[:, None]
            continue
        where = [key_location(case, table, b, j) for j in range(kv_len)]
        keys = np.stack([k_cache[blk, :, row] for blk, row in where], axis=1)
        values = np.stack([v_cache[blk, :, row] for blk, row in where], axis=1)
        slopes = inputs.get("alibi_slopes")
        if slopes is not None:
            slopes = to_numpy(slopes)
            slopes = slopes[b] if slopes.ndim == 2 else slopes
        ref_out, ref_lse = attention_reference(
            q[b : b + 1],
            keys[None].astype(np.float64),
            values[None].astype(np.float64),
            case.causal,
            case.window,
            None,
            case.scale,
            softcap=case.softcap,
            alibi_slopes=slopes,
            sinks=sinks,
        )
        out[b], lse[b] = ref_out[0], ref_lse[0]
    return out, lse


def run_case(case, rng, xp=np, check=False, call=flash_attention_with_kvcache):
    """``call`` (the library's function, or a stand-in of the same signature) on ``case``,
    and assert: out and lse against the oracle, the cache written exactly at the appended
    rows and nowhere else."""
    inputs = make_inputs(case, rng, xp)
    want_k, want_v = expected_caches(case, inputs)
    out, lse = call(
        inputs["q"],
        inputs["k_cache"],
        inputs["v_cache"],
        case.heads,
        case.kv_heads,
        case.head_dim,
        case.causal,
        case.window,
        cache_seqlens=inputs["cache_seqlens"],
        k_new=inputs["k_new"],
        v_new=inputs["v_new"],
        block_table=inputs["block_table"],
        softmax_scale=case.scale,
        return_lse=True,
        check=check,
        softcap=case.softcap,
        alibi_slopes=inputs["alibi_slopes"],
        **({} if inputs["sinks"] is None else {"sinks": inputs["sinks"]}),
    )
    assert type(out) is type(inputs["q"])
    assert out.dtype == DTYPES[case.dtype] and out.shape == inputs["q"].shape
    assert lse.dtype == np.float32 and lse.shape == inputs["q"].shape[:3]
    got_k, got_v = to_numpy(inputs["k_cache"]), to_numpy(inputs["v_cache"])
    # Bitwise: the appended rows hold k_new / v_new, every other element is unchanged.
    assert np.array_equal(got_k.view(np.uint8), want_k.view(np.uint8))
    assert np.array_equal(got_v.view(np.uint8), want_v.view(np.uint8))
    ref_out, ref_lse = oracle(case, inputs, want_k, want_v)
    err = rel_error(out, ref_out)
    assert err <= BOUND[case.dtype], f"{case}: relative error {err:.3g}"
    check_lse(lse, ref_lse)
    dead = np.isneginf(ref_lse)
    assert np.all(to_numpy(out)[dead] == 0)
    return inputs, out, lse


CASES = [
    # plain decoding, GQA, random lengths (0 and full included), every dtype
    KVCase(dtype="float32"),
    KVCase(dtype="float16"),
    KVCase(dtype="bfloat16"),
    # appends (one row, several), speculative and longer chunks of queries
    KVCase(dtype="float32", new_len=1, head_dim=40),
    KVCase(dtype="float16", new_len=4, q_len=4, head_dim=128, heads=8, kv_heads=2),
    KVCase(dtype="bfloat16", new_len=7, q_len=7, head_dim=24, heads=6, kv_heads=1),
    KVCase(dtype="float32", new_len=3, q_len=20, head_dim=8, heads=2, kv_heads=2),
    KVCase(dtype="bfloat16", q_len=40, new_len=9, heads=4, kv_heads=1, head_dim=96, capacity=140),
    # paged: shuffled blocks, appends across block boundaries, shared blocks, vLLM's layout
    KVCase(dtype="float16", block_size=16, capacity=96, new_len=5, q_len=5, head_dim=72),
    KVCase(
        dtype="bfloat16",
        block_size=16,
        capacity=64,
        new_len=17,
        q_len=3,
        head_dim=64,
        heads=8,
        kv_heads=8,
    ),
    KVCase(
        dtype="float32",
        block_size=8,
        capacity=48,
        new_len=2,
        q_len=2,
        shared_blocks=True,
        head_dim=136,
    ),
    KVCase(
        dtype="bfloat16",
        block_size=32,
        capacity=96,
        new_len=1,
        vllm_layout=True,
        heads=8,
        kv_heads=4,
        head_dim=256,
    ),
    KVCase(dtype="float16", block_size=5, capacity=35, new_len=6, q_len=6, lengths="full"),
    # one query row a sequence on blocks below 16 keys and on 24-key blocks under a window
    # (the tensor-core kernel's loads inside one block, across two, block ids per copy)
    KVCase(
        dtype="bfloat16", block_size=8, capacity=96, new_len=1, heads=8, kv_heads=2, head_dim=128
    ),
    KVCase(
        dtype="float16", block_size=24, capacity=120, heads=8, kv_heads=1, head_dim=64, window=37
    ),
    # masking: windows, no causal, a tuple window, a custom scale, an int length
    KVCase(dtype="float32", window=5, q_len=3, new_len=3),
    KVCase(dtype="bfloat16", causal=False, q_len=4, lengths="int", head_dim=120),
    KVCase(
        dtype="float16", causal=False, window=(3, 2), q_len=6, new_len=2, block_size=16, capacity=64
    ),
    KVCase(dtype="float32", window=1, q_len=9, new_len=4, scale=-0.7, heads=3, kv_heads=3),
    KVCase(dtype="bfloat16", scale=0.05, q_len=2, lengths="int", new_len=2, heads=16, kv_heads=1),
    # score modifiers (semantics page): soft-cap, ALiBi [H] and [B, H], both; decoding, chunks,
    # paged, the CUDA-core and tensor-core kernels and the dense kernels' long chunks
    KVCase(dtype="bfloat16", softcap=2.0),
    KVCase(dtype="float32", alibi="heads", q_len=3, new_len=3, window=5),
    KVCase(
        dtype="float16",
        alibi="batch",
        softcap=3.0,
        new_len=4,
        q_len=4,
        head_dim=128,
        heads=8,
        kv_heads=2,
    ),
    KVCase(
        dtype="float32",
        softcap=1.5,
        alibi="batch",
        block_size=16,
        capacity=96,
        new_len=5,
        q_len=5,
        head_dim=72,
    ),
    KVCase(
        dtype="bfloat16",
        softcap=4.0,
        alibi="heads",
        q_len=40,
        new_len=9,
        heads=4,
        kv_heads=1,
        head_dim=96,
        capacity=140,
    ),
    KVCase(
        dtype="bfloat16",
        alibi="batch",
        softcap=2.5,
        q_len=80,
        new_len=80,
        heads=8,
        kv_heads=2,
        head_dim=128,
        capacity=200,
        lengths="int",
        causal=False,
    ),
    # attention sinks: both decode kernels (an empty cache), splits, a long chunk (dense)
    KVCase(dtype="bfloat16", sinks=True, q_len=2, new_len=0),
    KVCase(dtype="float32", sinks=True, capacity=600, new_len=1, head_dim=40),
    KVCase(
        dtype="float32",
        sinks=True,
        batch=1,
        heads=2,
        kv_heads=1,
        capacity=600,
        new_len=1,
        head_dim=40,
        lengths="full",
    ),
    KVCase(
        dtype="float16",
        sinks=True,
        batch=2,
        kv_heads=1,
        capacity=600,
        q_len=3,
        new_len=3,
        block_size=40,
        softcap=3.0,
        lengths="full",
    ),
    KVCase(dtype="bfloat16", sinks=True, q_len=40, new_len=9, heads=4, kv_heads=1),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_matches_oracle(case, rng):
    run_case(case, rng)


def test_cpu_out_only_without_return_lse(rng):
    case = KVCase(dtype="float32", new_len=2, q_len=2)
    inputs = make_inputs(case, rng)
    out = flash_attention_with_kvcache(
        inputs["q"],
        inputs["k_cache"],
        inputs["v_cache"],
        4,
        2,
        64,
        cache_seqlens=inputs["cache_seqlens"],
        k_new=inputs["k_new"],
        v_new=inputs["v_new"],
    )
    assert isinstance(out, np.ndarray) and out.shape == (3, 4, 2, 64)


def test_cpu_decode_loop_equals_one_prefill(rng):
    """Appending one token a step gives the rows of one causal call over the whole sequence."""
    b, h, hk, d, cap, steps = 2, 4, 2, 32, 24, 10
    q = rng.standard_normal((b, h, steps, d)).astype(np.float32)
    k = rng.standard_normal((b, hk, steps, d)).astype(np.float32)
    v = rng.standard_normal((b, hk, steps, d)).astype(np.float32)
    k_cache = rng.standard_normal((b, hk, cap, d)).astype(np.float32)
    v_cache = rng.standard_normal((b, hk, cap, d)).astype(np.float32)
    whole = flash_attention_with_kvcache(
        q, k_cache.copy(), v_cache.copy(), h, hk, d, cache_seqlens=0, k_new=k, v_new=v
    )
    for t in range(steps):
        step = flash_attention_with_kvcache(
            q[:, :, t : t + 1],
            k_cache,
            v_cache,
            h,
            hk,
            d,
            cache_seqlens=t,
            k_new=k[:, :, t : t + 1],
            v_new=v[:, :, t : t + 1],
        )
        np.testing.assert_allclose(step[:, :, 0], whole[:, :, t], rtol=2e-6, atol=2e-6)
    assert np.array_equal(k_cache[:, :, :steps], k)


# ---------------------------------------------------------------------------------------
# Validation


def _valid_args(rng, paged=False, xp=np):
    case = KVCase(
        dtype="float32",
        new_len=2,
        block_size=16 if paged else 0,
        capacity=64,
        lengths="full" if paged else "random",
    )
    inputs = make_inputs(case, rng, xp)
    return dict(
        q=inputs["q"],
        k_cache=inputs["k_cache"],
        v_cache=inputs["v_cache"],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        cache_seqlens=inputs["cache_seqlens"],
        k_new=inputs["k_new"],
        v_new=inputs["v_new"],
        block_table=inputs["block_table"],
    )


def _call(args):
    args = dict(args)
    positional = [
        args.pop(n) for n in ("q", "k_cache", "v_cache", "num_heads", "num_kv_heads", "head_dim")
    ]
    return flash_attention_with_kvcache(*positional, **args)


def _with(args, **changes):
    return {**args, **changes}


BAD_CALLS = [
    ("q", "expected 4-D", lambda a: _with(a, q=a["q"][0])),
    ("q", "heads", lambda a: _with(a, num_heads=8)),
    ("q", "S_q must be >= 1", lambda a: _with(a, q=a["q"][:, :, :0])),
    ("head_dim", "unsupported head_dim", lambda a: _with(a, head_dim=12)),
    ("softcap", "must be finite and >= 0", lambda a: _with(a, softcap=-1.0)),
    ("alibi_slopes", "expected shape", lambda a: _with(a, alibi_slopes=np.ones(3, np.float32))),
    (
        "alibi_slopes",
        "expected dtype float32",
        lambda a: _with(a, alibi_slopes=np.ones(4, np.float64)),
    ),
    ("num_kv_heads", "must divide", lambda a: _with(a, num_kv_heads=3)),
    ("num_kv_heads", ">= 1", lambda a: _with(a, num_kv_heads=0)),
    ("k_cache", "expected 4-D", lambda a: _with(a, k_cache=a["k_cache"][0])),
    ("k_cache", "batch", lambda a: _with(a, k_cache=a["k_cache"][:2], v_cache=a["v_cache"][:2])),
    (
        "k_cache",
        "heads",
        lambda a: _with(a, k_cache=a["k_cache"][:, :1], v_cache=a["v_cache"][:, :1]),
    ),
    (
        "k_cache",
        "last stride",
        lambda a: _with(
            a,
            k_cache=a["k_cache"][..., ::2],
            v_cache=a["v_cache"][..., ::2],
            head_dim=32,
            q=a["q"][..., :32],
            k_new=None,
            v_new=None,
        ),
    ),
    ("v_cache", "k_cache's rows, head_dim_v", lambda a: _with(a, v_cache=a["v_cache"][:, :, :40])),
    ("v_cache", "dtype", lambda a: _with(a, v_cache=a["v_cache"].astype(np.float16))),
    ("q", "unsupported dtype", lambda a: _with(a, q=a["q"].astype(np.float64))),
    ("k_new", "dtype", lambda a: _with(a, k_new=a["k_new"].astype(np.float16))),
    ("v_new", "given together", lambda a: _with(a, v_new=None)),
    ("k_new", "given together", lambda a: _with(a, k_new=None)),
    ("k_new", "heads", lambda a: _with(a, k_new=a["k_new"][:, :1], v_new=a["v_new"][:, :1])),
    ("v_new", "rows", lambda a: _with(a, v_new=a["v_new"][:, :, :1])),
    (
        "k_new",
        "exceed the cache capacity",
        lambda a: _with(
            a,
            k_new=np.zeros((3, 2, 65, 64), np.float32) + 1,
            v_new=np.ones((3, 2, 65, 64), np.float32),
        ),
    ),
    ("cache_seqlens", "is required", lambda a: _with(a, cache_seqlens=None)),
    (
        "cache_seqlens",
        "dtype int32",
        lambda a: _with(a, cache_seqlens=a["cache_seqlens"].astype(np.int64)),
    ),
    ("cache_seqlens", "shape", lambda a: _with(a, cache_seqlens=a["cache_seqlens"][:2])),
    ("cache_seqlens", "expected an int", lambda a: _with(a, cache_seqlens=True)),
    ("cache_seqlens", "expected numpy", lambda a: _with(a, cache_seqlens=[1, 2, 3])),
    (
        "cache_seqlens",
        "sequence 2: 63 cached keys plus S_new = 2 exceed the capacity 64",
        lambda a: _with(a, cache_seqlens=np.array([0, 5, 63], np.int32)),
    ),
    (
        "cache_seqlens",
        "sequence 1: length -4 is negative",
        lambda a: _with(a, cache_seqlens=np.array([0, -4, 6], np.int32)),
    ),
    ("cache_seqlens", "63 cached keys plus S_new = 2", lambda a: _with(a, cache_seqlens=63)),
    ("cache_seqlens", "-1 cached keys", lambda a: _with(a, cache_seqlens=-1)),
    ("window_size", "must be >= 0", lambda a: _with(a, window_size=-2)),
    ("softmax_scale", "finite", lambda a: _with(a, softmax_scale=math.inf)),
    ("return_lse", "bool", lambda a: _with(a, return_lse=1)),
    ("check", "bool", lambda a: _with(a, check="yes")),
    ("allow_tf32", "bool", lambda a: _with(a, allow_tf32=1)),
    ("causal", "bool", lambda a: _with(a, causal=None)),
    (
        "k_cache",
        "read-only",
        lambda a: _with(a, k_cache=np.broadcast_to(a["k_cache"][:1], a["k_cache"].shape)),
    ),
]

BAD_PAGED_CALLS = [
    (
        "block_table",
        "dtype int32",
        lambda a: _with(a, block_table=a["block_table"].astype(np.int64)),
    ),
    ("block_table", "[B, max_blocks]", lambda a: _with(a, block_table=a["block_table"][:2])),
    ("block_table", "[B, max_blocks]", lambda a: _with(a, block_table=a["block_table"][0])),
    ("block_table", "expected numpy", lambda a: _with(a, block_table=7)),
    (
        "k_cache",
        "expected 4-D [num_blocks, H_kv, block_size, D]",
        lambda a: _with(a, k_cache=a["k_cache"][0]),
    ),
    (
        "k_cache",
        "at least one block",
        lambda a: _with(a, k_cache=a["k_cache"][:0], v_cache=a["v_cache"][:0]),
    ),
    (
        "cache_seqlens",
        "sequence 0: 63 cached keys plus S_new = 2 exceed the capacity 64",
        lambda a: _with(a, cache_seqlens=np.array([63, 0, 0], np.int32)),
    ),
    (
        "block_table",
        "sequence 1: block_table[1, 2] = -1 is not a block",
        lambda a: _with(a, block_table=_poke(a["block_table"], (1, 2), -1)),
    ),
    (
        "block_table",
        "sequence 2: block_table[2, 0] = 15 is not a block of the cache (0 .. 14)",
        lambda a: _with(a, block_table=_poke(a["block_table"], (2, 0), 15)),
    ),
]


def _poke(table, index, value):
    table = table.copy()
    table[index] = value
    return table


@pytest.mark.parametrize(
    "name, reason, change",
    BAD_CALLS + BAD_PAGED_CALLS,
    ids=[f"{n}-{r[:24]}" for n, r, _ in BAD_CALLS + BAD_PAGED_CALLS],
)
def test_cpu_rejects(name, reason, change, rng):
    paged = any(change is c for _, _, c in BAD_PAGED_CALLS)
    args = _valid_args(rng, paged=paged)
    before = [a.copy() for a in (args["k_cache"], args["v_cache"])]
    with pytest.raises(InvalidArgumentError) as info:
        _call(change(args))
    assert info.value.arg == name, str(info.value)
    assert reason in info.value.reason, str(info.value)
    # Nothing was written before the error.
    assert np.array_equal(before[0], args["k_cache"]) and np.array_equal(before[1], args["v_cache"])


def test_cpu_valid_args_run(rng):
    """The base of the rejection tests is itself valid (so each failure is the change's)."""
    for paged in (False, True):
        out = _call(_valid_args(rng, paged=paged))
        assert np.all(np.isfinite(out))


def test_cpu_unused_block_table_entries_are_never_read(rng):
    """Entries past a sequence's last block may hold anything (e.g. -1 padding)."""
    case = KVCase(dtype="float32", block_size=16, capacity=64, lengths="int")
    inputs = make_inputs(case, rng)
    length = inputs["cache_seqlens"]
    used = -(-length // 16)
    inputs["block_table"][:, used:] = -1
    run_inputs = dict(inputs)
    out = flash_attention_with_kvcache(
        run_inputs["q"],
        run_inputs["k_cache"],
        run_inputs["v_cache"],
        4,
        2,
        64,
        cache_seqlens=length,
        block_table=run_inputs["block_table"],
    )
    ref_out, _ = oracle(case, inputs, inputs["k_cache"], inputs["v_cache"])
    assert rel_error(out, ref_out) <= BOUND["float32"]


# ---------------------------------------------------------------------------------------
# Kernels: compile without spills; the shared-memory mirror


def _kernel_names(dtype_names, head_dims):
    kernels = standalone.STANDALONE
    names = []
    for dtype in (DTYPES[n] for n in dtype_names):
        names.append(kernels["kvcache_append"].name_expression(dtype=dtype))
        for d in head_dims:
            names.append(kernels["kvcache_combine"].name_expression(dtype=dtype, head_dim=d))
            names += [
                kernels["kvcache_decode"].name_expression(dtype=dtype, head_dim=d, rows=rm)
                for rm in ROW_TILES
            ]
            if dtype.itemsize == 2 and d % 16 == 0:
                names += [
                    kernels["kvcache_decode_tc"].name_expression(
                        dtype=dtype,
                        head_dim=d,
                        row_warps=rw,
                        stages=stages,
                        keys=decode_tc_keys(d),
                        paged=paged,
                        narrow=narrow,
                    )
                    for rw, narrow in ((1, True), (1, False), (2, False), (4, False))
                    for stages in (2, 3)
                    for paged in (False, True)
                ]
    return names


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_decode_kernels_compile_without_spills(arch):
    """The kernels of bfloat16 decoding at head_dim 128 and float32's general kernel (the
    slow test below compiles every dtype, head_dim and tile)."""
    names = [
        "cuflash::kvcache_append<cuflash::bf16_t>",
        "cuflash::kvcache_combine<cuflash::bf16_t, 128>",
        "cuflash::kvcache_decode_tc<cuflash::bf16_t, 128, 1, 2, 64, false, true>",
        "cuflash::kvcache_decode_tc<cuflash::bf16_t, 128, 1, 3, 64, true, true>",
        "cuflash::kvcache_decode_tc<cuflash::bf16_t, 128, 1, 2, 64, false, false>",
        "cuflash::kvcache_decode_tc<cuflash::bf16_t, 128, 4, 2, 64, true, false>",
        "cuflash::kvcache_decode<float, 128, 4>",
    ]
    compile_and_check(names, arch)


# Each class's edges and insides (float16 is bfloat16's code on another type).
COMPILED_HEAD_DIMS = (8, 24, 40, 64, 72, 96, 120, 128, 136, 160, 200, 248, 256)


def _compile_job(job):
    dtype, arch = job
    compile_and_check(_kernel_names([dtype], COMPILED_HEAD_DIMS), arch)
    return True


@pytest.mark.slow
def test_decode_kernels_of_every_head_dim_class_compile_without_spills():
    """bfloat16 and float32, every row tile, head dims across the classes, for sm_80 and
    sm_90a."""
    import os
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(dtype, arch) for dtype in ("bfloat16", "float32") for arch in ("sm_80", "sm_90a")]
    with ProcessPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        assert all(pool.map(_compile_job, jobs))


def test_decode_shape_fits_every_gpu():
    """Shared memory of every decode kernel within sm_80's 163 KB (three blocks an SM on
    the H200's 227 KB at head_dim 128)."""
    for itemsize in (2, 4):
        for d in kernel_build.HEAD_DIMS:
            for rm in ROW_TILES:
                keys, shared = decode_shape(itemsize, d, rm)
                assert keys in (16, 32, 64, 128) and keys * d * itemsize <= 16384
                assert shared <= 163 * 1024, (itemsize, d, rm, shared)
    assert 3 * (decode_shape(2, 128, 4)[1] + 1024) <= 228 * 1024
    for d in range(16, 257, 16):
        for row_warps in (1, 2, 4):
            for stages in (2, 3):
                keys, rows, shared = decode_tc_shape(d, row_warps, stages)
                assert rows == 16 * row_warps and keys * d * 2 <= 16384
                assert shared <= 163 * 1024, (d, row_warps, stages, shared)
    assert 3 * (decode_tc_shape(128, 1, 2)[2] + 1024) <= 228 * 1024
    assert 2 * (decode_tc_shape(128, 1, 3)[2] + 1024) <= 228 * 1024


def test_pipeline_depth_follows_the_longest_sequence():
    """Three K/V tiles in the tensor-core decode kernel's pipeline (two blocks an SM) for
    sequences of LONG_CACHE_KEYS keys or more up to head_dim 128, two otherwise."""
    dtype = DTYPES["bfloat16"]

    def stages(lengths, head_dim=128, capacity=4096, new_len=0):
        q = np.zeros((2, 8, 1, head_dim), dtype)
        cache = np.zeros((2, 2, capacity, head_dim), dtype)
        new = np.zeros((2, 2, new_len, head_dim), dtype) if new_len else None
        config = AttentionConfig(8, 2, head_dim, True)
        problem = kvcache_problem(q, cache, cache, config, lengths, new, new)
        name = decode_kernels.decode_kernel(problem)[0]
        return int(name.split(",")[3])

    long_enough = decode_kernels.LONG_CACHE_KEYS
    assert stages(np.array([10, long_enough], np.int32)) == 3
    assert stages(np.array([10, long_enough - 1], np.int32)) == 2
    assert stages(np.array([10, long_enough - 1], np.int32), new_len=1) == 3  # after the append
    assert stages(100) == 2
    assert stages(np.array([0, 4000], np.int32), head_dim=256) == 2


def test_an_fp8_cache_keeps_two_tiles_in_flight_at_any_length():
    """An FP8 cache's tiles (twice a 16-bit tile's keys) take FP8_STAGES at every length,
    where a 16-bit cache of the same lengths takes three; paged in blocks of fewer than
    FP8_RUN_BLOCK_KEYS keys it takes the 16-bit tile and its pipeline depth."""
    dtype = DTYPES["bfloat16"]
    fp8 = standalone.E4m3Cache(np.dtype(dtype), np.dtype(dtype))

    def tiles(block_size=None):
        q = np.zeros((2, 8, 1, 128), dtype)
        table = None
        if block_size:
            cache = np.zeros((2 * 4096 // block_size, 2, block_size, 128), dtype)
            table = np.arange(2 * 4096 // block_size, dtype=np.int32).reshape(2, -1)
        else:
            cache = np.zeros((2, 2, 4096, 128), dtype)
        config = AttentionConfig(8, 2, 128, True)
        problem = kvcache_problem(q, cache, cache, config, 4000, block_table=table)
        name, keys, _, _ = decode_kernels.decode_kernel(problem, 90, fp8=fp8)
        return keys, int(name.split(",")[-4])  # keys a tile, stages

    two, three = decode_kernels.FP8_STAGES, decode_kernels.LONG_CACHE_STAGES
    assert (two, three) == (2, 3)
    assert tiles() == (decode_tc_keys(128, fp8=True), two)
    assert tiles(256) == (decode_tc_keys(128, fp8=True), two)
    assert tiles(16) == (decode_tc_keys(128), three)


def test_decode_kernel_instantiation_follows_the_call():
    """The tensor-core decode kernel: its paged instantiation for a block table, the narrow
    one (rows as the MMA's N side) where a block's packed query rows fit NARROW_ROWS."""
    dtype = DTYPES["bfloat16"]

    def name(q_len, heads, kv_heads, paged):
        q = np.zeros((2, heads, q_len, 128), dtype)
        shape = (4, kv_heads, 16, 128) if paged else (2, kv_heads, 64, 128)
        cache = np.zeros(shape, dtype)
        table = np.arange(4, dtype=np.int32).reshape(2, 2) if paged else None
        config = AttentionConfig(heads, kv_heads, 128, True)
        problem = kvcache_problem(q, cache, cache, config, 10, block_table=table)
        return decode_kernels.decode_kernel(problem)[0]

    assert name(1, 32, 8, False).endswith(", false, true>")
    assert name(1, 32, 8, True).endswith(", true, true>")
    assert name(2, 32, 8, False).endswith(", false, true>")  # 8 packed rows
    assert name(1, 36, 4, False).endswith(", false, false>")  # 9 packed rows
    assert name(4, 32, 8, True).endswith(", true, false>")


def test_key_count_kernels_are_the_registrys():
    """The forward kernels that read per-entry key counts (CUFLASH_FORWARD_SEQUENCE) are the
    registry's ``reads_key_counts`` ones: the dense path of device-held lengths trusts it."""
    import re

    from cuflash.gpu import registry

    source = kernel_build.module_source()
    for spec in registry.KERNELS:
        if spec.direction != "forward":
            continue
        start = re.search(rf"__global__[^;{{]*\b{spec.name}\(", source)
        assert start is not None, spec.name
        body = source[start.end() :]
        # the macros, or sequence_of<KEY_COUNTS> itself (a persistent kernel's per-tile
        # sequence: common/work_tiles.cuh)
        uses = re.search(
            r"CUFLASH_FORWARD_SEQUENCE|CUFLASH_SEQUENCE_OF|sequence_of<(true|false)>", body
        ).group(0)
        reads = uses in ("CUFLASH_FORWARD_SEQUENCE", "sequence_of<true>")
        assert reads == spec.reads_key_counts, spec.name


def test_split_cap_is_the_combines():
    """The combine takes a thread a split: MAX_SPLITS is its kMaxSplits (kDecodeThreads)."""
    import re

    source = kernel_build.module_source(standalone.STANDALONE["kvcache_combine"].source)
    assert re.search(r"constexpr int kMaxSplits = kDecodeThreads;", source)
    assert re.search(rf"constexpr int kDecodeThreads = {decode_kernels.THREADS};", source)
    assert decode_kernels.MAX_SPLITS == decode_kernels.THREADS


def test_split_choice():
    """One wave where a wave holds the work; long sequences split; short ones do not."""
    assert num_splits(blocks=8, slots=396, tiles=512, cap=128) == 49  # B = 1, 32k keys
    assert num_splits(blocks=128, slots=396, tiles=128, cap=32) == 3  # B = 16, 8k keys
    assert num_splits(blocks=2048, slots=396, tiles=8, cap=2) == 1  # B = 256, 512 keys
    assert num_splits(blocks=10, slots=396, tiles=1, cap=1) == 1
    for blocks in (1, 7, 100, 1000):
        for tiles in (1, 10, 300):
            splits = num_splits(blocks, 264, tiles, cap=min(tiles, 128))
            assert 1 <= splits <= min(tiles, 128)


# ---------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_matches_oracle(case, rng, poisoned):
    run_case(case, rng, xp=cupy)


GPU_CASES = [
    # one row tile of each size (packed rows 1, 2, 4, 8) and several tiles
    KVCase(heads=4, kv_heads=4, capacity=700),
    KVCase(heads=4, kv_heads=2, capacity=700),
    KVCase(heads=8, kv_heads=2, capacity=1100, new_len=1),
    KVCase(heads=8, kv_heads=1, capacity=900, dtype="float16"),
    KVCase(heads=8, kv_heads=2, q_len=5, new_len=5, capacity=600, dtype="float32"),
    KVCase(heads=8, kv_heads=1, q_len=3, new_len=2, capacity=600, head_dim=16),
    KVCase(
        heads=2,
        kv_heads=1,
        q_len=3,
        new_len=3,
        capacity=304,
        head_dim=48,
        dtype="float16",
        block_size=16,
        window=20,
    ),
    # long caches: many splits and the combine; paged with small and large blocks
    KVCase(batch=2, heads=8, kv_heads=2, capacity=5000, new_len=1, head_dim=128),
    KVCase(
        batch=2,
        heads=8,
        kv_heads=2,
        capacity=4096,
        block_size=16,
        new_len=1,
        head_dim=128,
        window=700,
    ),
    KVCase(
        batch=3,
        heads=4,
        kv_heads=1,
        capacity=4096,
        block_size=256,
        new_len=3,
        q_len=3,
        head_dim=256,
        dtype="float16",
    ),
    KVCase(
        batch=2,
        heads=4,
        kv_heads=2,
        capacity=3000,
        head_dim=40,
        dtype="float32",
        causal=False,
        window=(100, 50),
        q_len=4,
    ),
    # long query chunks: the dense kernels on a contiguous cache (an int length, lengths on
    # the device) and the split kernel on a paged one
    KVCase(
        batch=2,
        heads=8,
        kv_heads=2,
        capacity=700,
        lengths="int",
        q_len=40,
        new_len=40,
        head_dim=128,
    ),
    KVCase(batch=2, heads=8, kv_heads=2, capacity=700, q_len=40, new_len=40, head_dim=128),
    KVCase(
        batch=4,
        heads=8,
        kv_heads=2,
        capacity=900,
        q_len=64,
        new_len=64,
        head_dim=80,
        dtype="float16",
        window=300,
        softcap=4.0,
        alibi="batch",
    ),
    KVCase(
        batch=3,
        heads=4,
        kv_heads=4,
        capacity=520,
        q_len=70,
        head_dim=128,
        dtype="float32",
        alibi="heads",
    ),
    KVCase(
        batch=3,
        heads=6,
        kv_heads=2,
        capacity=333,
        q_len=50,
        new_len=20,
        head_dim=64,
        causal=False,
        window=(40, 9),
    ),
    KVCase(
        batch=2,
        heads=8,
        kv_heads=2,
        capacity=704,
        block_size=64,
        q_len=33,
        new_len=33,
        head_dim=64,
        dtype="float16",
        lengths="int",
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_long_caches(case, rng, poisoned):
    run_case(case, rng, xp=cupy, check=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES[11:16], ids=str)
def test_gpu_query_chunks_through_plans(case, rng, poisoned):
    """Long query chunks with check=False: the launch plans of device-held lengths (the
    dense forward's on a contiguous cache) and an int length's call."""
    plans.clear()
    for _ in range(2):  # the second call of the signature takes the plan
        run_case(case, rng, xp=cupy)


def _allow_tf32_errors(case, seed, xp):
    """The output's relative error against the oracle without and with allow_tf32, on
    the same inputs (drawn afresh from ``seed`` each time: the append writes the cache)."""
    errors = []
    for allow_tf32 in (False, True):
        inputs = make_inputs(case, np.random.default_rng(seed), xp)
        want_k, want_v = expected_caches(case, inputs)
        args = (inputs["q"], inputs["k_cache"], inputs["v_cache"], case.heads, case.kv_heads)
        out = flash_attention_with_kvcache(
            *args,
            case.head_dim,
            cache_seqlens=inputs["cache_seqlens"],
            k_new=inputs["k_new"],
            v_new=inputs["v_new"],
            allow_tf32=allow_tf32,
        )
        errors.append(rel_error(out, oracle(case, inputs, want_k, want_v)[0]))
    return errors


TF32_CHUNK = KVCase(
    dtype="float32", batch=2, heads=8, kv_heads=2, capacity=700, lengths="int", q_len=40,
    new_len=40, head_dim=128,
)  # fmt: skip


def test_cpu_ignores_allow_tf32(rng):
    """The CPU path is float32 throughout: allow_tf32 changes nothing there."""
    plain, tf32 = _allow_tf32_errors(TF32_CHUNK, int(rng.integers(1 << 30)), np)
    assert plain == tf32 and plain <= BOUND["float32"]


@pytest.mark.gpu
def test_gpu_allow_tf32_runs_long_chunks_in_tf32(rng, poisoned):
    """A float32 query chunk on a contiguous cache takes the dense forward's TF32 kernel
    with allow_tf32 (TF32's rounding, within its bound of the oracle) and keeps float32
    accuracy without it."""
    plain, tf32 = _allow_tf32_errors(TF32_CHUNK, int(rng.integers(1 << 30)), cupy)
    assert plain <= BOUND["float32"], plain
    assert 5 * plain < tf32 < 1e-2, (plain, tf32)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize(
    "case", [GPU_CASES[5], GPU_CASES[6], GPU_CASES[9], GPU_CASES[10], GPU_CASES[-1]], ids=str
)
def test_gpu_pipeline_depths(case, stages, rng, poisoned, monkeypatch):
    """The tensor-core kernel with two and three K/V tiles in its pipeline."""
    monkeypatch.setattr(decode_kernels, "decode_tc_stages", lambda head_dim, longest: stages)
    run_case(case, rng, xp=cupy)


@pytest.mark.gpu
def test_gpu_is_deterministic(rng):
    case = KVCase(batch=1, heads=32, kv_heads=8, capacity=20000, head_dim=128, lengths="full")
    inputs = make_inputs(case, rng, cupy)
    args = (inputs["q"], inputs["k_cache"], inputs["v_cache"], 32, 8, 128)
    first = flash_attention_with_kvcache(
        *args, cache_seqlens=inputs["cache_seqlens"], return_lse=True
    )
    for _ in range(3):
        again = flash_attention_with_kvcache(
            *args, cache_seqlens=inputs["cache_seqlens"], return_lse=True
        )
        for a, b in zip(first, again):
            assert cupy.array_equal(
                a.view(cupy.uint8) if a.dtype != np.float32 else a,
                b.view(cupy.uint8) if b.dtype != np.float32 else b,
            )


@pytest.mark.gpu
def test_gpu_plan_takes_each_calls_slopes(rng, poisoned):
    """Device-held lengths reuse one plan per signature; the ALiBi slopes are the call's."""
    case = KVCase(dtype="bfloat16", alibi="batch", softcap=3.0, q_len=2, new_len=0)
    for _ in range(2):  # a new draw, the same signature: the second call takes the plan
        run_case(case, rng, xp=cupy)


@pytest.mark.gpu
def test_gpu_unaligned_cache_rows(rng, poisoned):
    """Rows that do not start on 16-byte boundaries (a view one element in) still work."""
    b, h, hk, d, cap = 2, 4, 2, 64, 300
    buf_k = cupy.asarray(rng.standard_normal((b, hk, cap, d + 8)).astype(DTYPES["float16"]))
    buf_v = cupy.asarray(rng.standard_normal((b, hk, cap, d + 8)).astype(DTYPES["float16"]))
    k_cache, v_cache = buf_k[..., 1 : d + 1], buf_v[..., 1 : d + 1]
    q = cupy.asarray(rng.standard_normal((b, h, 2, d)).astype(DTYPES["float16"]))
    lengths = cupy.asarray(np.array([250, 7], np.int32))
    out = flash_attention_with_kvcache(q, k_cache, v_cache, h, hk, d, cache_seqlens=lengths)
    case = KVCase(dtype="float16", batch=b, heads=h, kv_heads=hk, head_dim=d, q_len=2, capacity=cap)
    ref, _ = oracle(
        case,
        dict(q=q, cache_seqlens=lengths, block_table=None),
        to_numpy(k_cache),
        to_numpy(v_cache),
    )
    assert rel_error(out, ref) <= BOUND["float16"]


def _fenced(rng, shape, dtype, fence=4096):
    """A cache inside a larger buffer whose outside is NaN: a read outside the cache would
    bring NaN into the output, a write would change the fence."""
    size = int(np.prod(shape))
    buf = cupy.full(size + 2 * fence, cupy.nan, dtype=np.float32).astype(dtype)
    buf[fence : fence + size] = cupy.asarray(rng.standard_normal(size).astype(dtype))
    return buf, buf[fence : fence + size].reshape(shape)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "paged, q_len",
    [(False, 2), (True, 2), (False, 32)],
    ids=["contiguous", "paged", "contiguous-dense"],
)
def test_gpu_garbage_lengths_and_block_ids_stay_inside(rng, paged, q_len):
    """Split-KV kernels (2 query rows) and the dense forward (32 rows x 4 heads a KV head),
    as many rows appended: every row sees a key whatever the lengths hold."""
    b, h, hk, d, bs, max_blocks, num_blocks = 4, 8, 2, 128, 16, 8, 20
    dtype = DTYPES["bfloat16"]
    if paged:
        shape = (num_blocks, hk, bs, d)
    else:
        shape = (b, hk, max_blocks * bs, d)
    buf_k, k_cache = _fenced(rng, shape, dtype)
    buf_v, v_cache = _fenced(rng, shape, dtype)
    fence_k, fence_v = buf_k.copy(), buf_v.copy()
    q = cupy.asarray(rng.standard_normal((b, h, q_len, d)).astype(dtype))
    k_new = cupy.asarray(rng.standard_normal((b, hk, q_len, d)).astype(dtype))
    v_new = cupy.asarray(rng.standard_normal((b, hk, q_len, d)).astype(dtype))
    lengths = cupy.asarray(np.array([5, -70000, 2**31 - 1, 10**6], np.int32))
    table = None
    if paged:
        table = cupy.asarray(
            np.array(
                [[3, -1, 2**30, -(2**31)] * 2, [19, 20, 7, 0] * 2, [1000, 5, 6, 7] * 2, [-5] * 8],
                np.int32,
            )
        )
    kwargs = dict(
        cache_seqlens=lengths, k_new=k_new, v_new=v_new, block_table=table, return_lse=True
    )
    out, lse = flash_attention_with_kvcache(q, k_cache, v_cache, h, hk, d, **kwargs)
    cupy.cuda.get_current_stream().synchronize()  # an illegal address would surface here
    assert bool(cupy.isfinite(out.astype(np.float32)).all()) and bool(cupy.isfinite(lse).all())
    size = int(np.prod(shape))
    for buf, before in ((buf_k, fence_k), (buf_v, fence_v)):
        outside = cupy.concatenate([buf[:4096], buf[4096 + size :]]).view(cupy.uint16)
        assert cupy.array_equal(
            outside, cupy.concatenate([before[:4096], before[4096 + size :]]).view(cupy.uint16)
        )
    snapshot = (k_cache.copy(), v_cache.copy())
    with pytest.raises(InvalidArgumentError) as info:
        flash_attention_with_kvcache(q, k_cache, v_cache, h, hk, d, check=True, **kwargs)
    assert info.value.arg in ("cache_seqlens", "block_table")
    assert "sequence 1" in info.value.reason
    assert cupy.array_equal(snapshot[0].view(cupy.uint16), k_cache.view(cupy.uint16))
    assert cupy.array_equal(snapshot[1].view(cupy.uint16), v_cache.view(cupy.uint16))
    if paged:  # good lengths, one bad block id in use
        good = cupy.asarray(np.array([0, 3, 9, 1], np.int32))
        bad_table = cupy.asarray(np.array([[i] * 8 for i in range(4)], np.int32))
        bad_table[2, 0] = 21
        with pytest.raises(InvalidArgumentError, match="sequence 2: block_table"):
            flash_attention_with_kvcache(
                q, k_cache, v_cache, h, hk, d, cache_seqlens=good, block_table=bad_table, check=True
            )


@pytest.mark.gpu
def test_gpu_rejects_mixed_and_cross_device(rng):
    args = _valid_args(rng, xp=cupy)
    with pytest.raises(InvalidArgumentError, match="mixed"):
        _call(_with(args, cache_seqlens=to_numpy(args["cache_seqlens"])))
    with pytest.raises(InvalidArgumentError, match="mixed"):
        _call(_with(args, k_new=to_numpy(args["k_new"])))
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device(1):
            other = cupy.asarray(to_numpy(args["cache_seqlens"]))
        with pytest.raises(InvalidArgumentError, match="different devices"):
            _call(_with(args, cache_seqlens=other))
    with pytest.raises(InvalidArgumentError, match="the capacity 64"):
        _call(_with(args, cache_seqlens=63))


# ---------------------------------------------------------------------------------------
# The generation example


@pytest.mark.parametrize("paged", [False, True])
def test_example_generation_matches_decoding_without_cache(paged):
    """examples/generate_tiny_lm.py's cached greedy decoding picks the tokens that running
    the whole sequence through the model at every step picks (an untrained model: the
    check is the cache's bookkeeping, not the model's skill)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "generate_tiny_lm.py"
    spec = importlib.util.spec_from_file_location("generate_tiny_lm", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    lm = example.lm
    task = lm.ReverseTask(6, 12)
    cfg = lm.ModelConfig(
        task.vocab_size, task.seq_len, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2
    )
    params = lm.init_parameters(cfg, np, np.float32, seed=3)
    inputs, _, _ = task.sample(np.random.default_rng(4), 5)
    prompt = inputs[:, :7]
    cache = example.KVCache(
        cfg, 5, task.seq_len, np.dtype(np.float32), np, block_size=3 if paged else None, seed=5
    )
    backend = lm.AttentionBackend(example.cuflash.flash_attention_vjp, np.dtype(np.float32))
    with_cache = example.generate(params, cfg, prompt, 6, cache, np.dtype(np.float32))
    without = example.generate_without_cache(params, cfg, prompt, 6, backend)
    assert with_cache.shape == (5, 6) and np.array_equal(with_cache, without)
    assert np.all(cache.lengths == task.seq_len)
    if paged:  # the blocks no sequence was given stay zeros
        unused = np.setdiff1d(np.arange(cache.keys[0].shape[0]), cache.block_table)
        assert unused.size == 4 and not np.any(cache.keys[0][unused])
