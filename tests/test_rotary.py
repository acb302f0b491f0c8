"""Rotary embedding at the append of flash_attention_with_kvcache (the KV-cache page): the
CPU path, the append kernel in the CPU simulator and on the GPU against a float64
reference (q and k_new rotated in float64 through complex products, rounded to the dtype,
then test_kvcache's oracle); the caller's q and k_new untouched; every validation error;
untrusted device-held lengths clamped to the tables."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import simulated_kvcache
import simulator
from support import DTYPES, HAS_GPU, check_lse, compile_and_check, rel_error, to_numpy
from test_kvcache import (
    BOUND,
    KVCase,
    _fenced,
    expected_caches,
    host_lengths,
    key_location,
    make_inputs,
    oracle,
)

from cuflash import InvalidArgumentError, flash_attention_with_kvcache, rotary
from cuflash.gpu import plans, standalone

if HAS_GPU:
    import cupy

needs_compiler = pytest.mark.skipif(
    simulator.compiler() is None, reason="the simulator needs a host C++ compiler (g++ or CXX)"
)


@dataclasses.dataclass(frozen=True)
class RotaryCase:
    """A test_kvcache call with rotary tables: ``rotary_dim`` (0: head_dim), the pairs,
    the tables' dtype ("float32" or "same": q's) and their rows past the capacity."""

    kv: KVCase
    rotary_dim: int = 0
    interleaved: bool = False
    tables: str = "float32"
    extra_rows: int = 3

    def __str__(self):
        style = "gptj" if self.interleaved else "neox"
        return f"{self.kv}-rot{self.rotary_dim or self.kv.head_dim}-{style}-{self.tables}"


def rotary_inputs(case, rng, xp=np):
    """test_kvcache's inputs for ``case.kv`` with lengths raised so that every query row
    has a position (``L_b >= S_q``), and random tables ``rotary_cos``, ``rotary_sin``."""
    kv = case.kv
    inputs = make_inputs(kv, rng)
    low = max(kv.q_len - kv.new_len, 0)
    if isinstance(inputs["cache_seqlens"], int):
        inputs["cache_seqlens"] = max(inputs["cache_seqlens"], low)
    else:
        inputs["cache_seqlens"] = np.maximum(inputs["cache_seqlens"], low).astype(np.int32)
    half = (case.rotary_dim or kv.head_dim) // 2
    angles = rng.uniform(-np.pi, np.pi, size=(kv.capacity + case.extra_rows, half))
    dtype = np.float32 if case.tables == "float32" else DTYPES[kv.dtype]
    inputs["rotary_cos"] = np.cos(angles).astype(dtype)
    inputs["rotary_sin"] = np.sin(angles).astype(dtype)
    if xp is not np:
        inputs = {
            name: a if a is None or isinstance(a, int) else _to_device(a)
            for name, a in inputs.items()
        }
    return inputs


def _to_device(a):
    if a.ndim == 4 and not a.flags.c_contiguous:  # keep the transposed view a view
        return cupy.asarray(np.ascontiguousarray(a.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    return cupy.asarray(a)


def rotate64(x, cos, sin, positions, interleaved):
    """``x`` ``[..., n, D]`` with row ``t`` rotated at ``positions[t]`` in float64: the
    pair ``(x1, x2)`` as ``x1 + i x2`` times ``cos + i sin``."""
    x = np.array(x, dtype=np.float64)
    half = cos.shape[1]
    pairs = np.arange(half)
    first, second = (2 * pairs, 2 * pairs + 1) if interleaved else (pairs, pairs + half)
    turn = cos[positions].astype(np.float64) + 1j * sin[positions].astype(np.float64)
    z = (x[..., first] + 1j * x[..., second]) * turn
    x[..., first], x[..., second] = z.real, z.imag
    return x


def rotated_reference_inputs(case, inputs, interleaved=None):
    """NumPy copies of ``inputs`` with q and k_new rotated at their positions in float64,
    rounded to the dtype (what the call attends and appends)."""
    kv = case.kv
    interleaved = case.interleaved if interleaved is None else interleaved
    dtype = DTYPES[kv.dtype]
    cos, sin = to_numpy(inputs["rotary_cos"]), to_numpy(inputs["rotary_sin"])
    q = to_numpy(inputs["q"])
    k_new = None if inputs["k_new"] is None else to_numpy(inputs["k_new"])
    rotated = dict(inputs, q=np.empty_like(q), k_new=None if k_new is None else k_new.copy())
    for b, length in enumerate(host_lengths(kv, inputs)):
        keys = int(length) + kv.new_len
        queries = np.arange(keys - kv.q_len, keys)
        rotated["q"][b] = rotate64(q[b], cos, sin, queries, interleaved).astype(dtype)
        if k_new is not None:
            new = np.arange(int(length), keys)
            rotated["k_new"][b] = rotate64(k_new[b], cos, sin, new, interleaved).astype(dtype)
    return rotated


def call(case, inputs, function=flash_attention_with_kvcache, **extra):
    kv = case.kv
    return function(
        inputs["q"],
        inputs["k_cache"],
        inputs["v_cache"],
        kv.heads,
        kv.kv_heads,
        kv.head_dim,
        kv.causal,
        kv.window,
        cache_seqlens=inputs["cache_seqlens"],
        k_new=inputs["k_new"],
        v_new=inputs["v_new"],
        block_table=inputs["block_table"],
        softmax_scale=kv.scale,
        return_lse=True,
        softcap=kv.softcap,
        alibi_slopes=inputs["alibi_slopes"],
        sinks=inputs["sinks"],
        rotary_cos=inputs["rotary_cos"],
        rotary_sin=inputs["rotary_sin"],
        rotary_interleaved=case.interleaved,
        **extra,
    )


def appended_rows(case, inputs, k_cache):
    """The cache's appended key rows ``[B, H_kv, S_new, D]`` (NumPy)."""
    kv = case.kv
    table = None if inputs["block_table"] is None else to_numpy(inputs["block_table"])
    rows = np.empty((kv.batch, kv.kv_heads, kv.new_len, kv.head_dim), k_cache.dtype)
    for b, length in enumerate(host_lengths(kv, inputs)):
        for t in range(kv.new_len):
            blk, row = key_location(kv, table, b, int(length) + t)
            rows[b, :, t] = k_cache[blk, :, row]
    return rows


def run_rotary_case(case, rng, xp=np, function=flash_attention_with_kvcache):
    """``function`` on ``case``; assert the appended keys are the rotated ones (to the
    dtype's rounding), every other cache element unchanged, q and k_new unchanged, and
    out and lse against the oracle. Returns the inputs and the caches after the call."""
    kv = case.kv
    inputs = rotary_inputs(case, rng, xp)
    given = {n: to_numpy(inputs[n]).copy() for n in ("q", "k_new") if inputs[n] is not None}
    reference = rotated_reference_inputs(case, inputs)
    want_k, want_v = expected_caches(kv, reference)
    out, lse = call(case, inputs, function)
    for name, before in given.items():  # the caller's arrays are not modified
        assert np.array_equal(to_numpy(inputs[name]).view(np.uint8), before.view(np.uint8)), name
    got_k, got_v = to_numpy(inputs["k_cache"]), to_numpy(inputs["v_cache"])
    assert np.array_equal(got_v.view(np.uint8), want_v.view(np.uint8))
    if kv.new_len:  # float32 arithmetic, then the dtype's rounding: within one unit
        got, want = appended_rows(case, inputs, got_k), appended_rows(case, reference, want_k)
        want64 = want.astype(np.float64)
        slack = 1.01 * ml_dtypes.finfo(want.dtype).eps * np.abs(want64) + 1e-6
        assert np.all(np.abs(got.astype(np.float64) - want64) <= slack), case
        want_k = want_k.copy()  # the rest of the cache: bit for bit
        table = None if inputs["block_table"] is None else to_numpy(inputs["block_table"])
        for b, length in enumerate(host_lengths(kv, inputs)):
            for t in range(kv.new_len):
                blk, row = key_location(kv, table, b, int(length) + t)
                want_k[blk, :, row] = got_k[blk, :, row]
    assert np.array_equal(got_k.view(np.uint8), want_k.view(np.uint8))
    ref_out, ref_lse = oracle(kv, reference, got_k, got_v)
    err = rel_error(out, ref_out)
    assert err <= BOUND[kv.dtype], f"{case}: relative error {err:.3g}"
    check_lse(lse, ref_lse)
    return inputs, got_k, out


CASES = [
    # plain decoding with GQA, every dtype, full rotary_dim, both styles
    RotaryCase(KVCase(dtype="bfloat16", heads=8, kv_heads=2, new_len=1)),
    RotaryCase(KVCase(dtype="float32", new_len=1, head_dim=40), interleaved=True),
    RotaryCase(KVCase(dtype="float16", heads=8, kv_heads=2, new_len=1, head_dim=128)),
    # partial rotary_dim; tables in q's dtype; speculative rows; the smallest rotary_dim
    RotaryCase(
        KVCase(dtype="float16", new_len=4, q_len=4, head_dim=128, heads=8, kv_heads=2),
        rotary_dim=64,
        interleaved=True,
    ),
    RotaryCase(
        KVCase(dtype="bfloat16", new_len=7, q_len=7, head_dim=24, heads=6, kv_heads=1),
        rotary_dim=16,
        tables="same",
    ),
    RotaryCase(KVCase(dtype="float32", new_len=3, q_len=3, head_dim=8, heads=2), rotary_dim=2),
    # no k_new: the query rows alone rotate, at positions from cache_seqlens
    RotaryCase(KVCase(dtype="bfloat16", q_len=2, head_dim=128, heads=8), rotary_dim=32),
    RotaryCase(KVCase(dtype="float32", q_len=1, lengths="int"), interleaved=True),
    # paged: appends across blocks, shared blocks, vLLM's layout
    RotaryCase(
        KVCase(dtype="float16", block_size=16, capacity=96, new_len=5, q_len=5, head_dim=72),
        interleaved=True,
    ),
    RotaryCase(
        KVCase(
            dtype="bfloat16",
            block_size=16,
            capacity=64,
            new_len=17,
            q_len=3,
            heads=8,
            kv_heads=8,
        ),
        rotary_dim=32,
        tables="same",
    ),
    RotaryCase(
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
        rotary_dim=128,
        interleaved=True,
    ),
    RotaryCase(
        KVCase(dtype="float32", block_size=8, capacity=48, new_len=2, q_len=2, shared_blocks=True),
    ),
    # the options: windows, no causal, soft-cap, ALiBi, sinks, splits of long caches
    RotaryCase(
        KVCase(
            dtype="float16",
            alibi="batch",
            softcap=3.0,
            new_len=4,
            q_len=4,
            head_dim=128,
            heads=8,
            kv_heads=2,
            window=9,
            sinks=True,
        ),
        rotary_dim=96,
    ),
    RotaryCase(
        KVCase(dtype="bfloat16", causal=False, window=(3, 2), q_len=6, new_len=2, lengths="int"),
        interleaved=True,
    ),
    RotaryCase(KVCase(dtype="float32", capacity=600, new_len=1, head_dim=40, sinks=True)),
    # a long chunk of queries (the dense forward's kernels on a contiguous cache)
    RotaryCase(
        KVCase(
            dtype="bfloat16", q_len=40, new_len=9, heads=4, kv_heads=1, head_dim=96, capacity=140
        ),
        rotary_dim=64,
        interleaved=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_matches_reference(case, rng):
    run_rotary_case(case, rng)


def test_the_reference_tells_the_styles_and_positions_apart(rng):
    """The checks can fail: the other pairing, or positions one off, are far from the
    call's output."""
    case = RotaryCase(KVCase(dtype="float32", new_len=3, q_len=3, heads=4, kv_heads=2))
    inputs = rotary_inputs(case, rng)
    fresh = {n: a.copy() if isinstance(a, np.ndarray) else a for n, a in inputs.items()}
    out, _ = call(case, inputs)
    wrong = rotated_reference_inputs(case, fresh, interleaved=True)
    want_k, want_v = expected_caches(case.kv, wrong)
    assert rel_error(out, oracle(case.kv, wrong, want_k, want_v)[0]) > 100 * BOUND["float32"]
    shifted = dict(fresh, rotary_cos=fresh["rotary_cos"][1:], rotary_sin=fresh["rotary_sin"][1:])
    off = rotated_reference_inputs(case, shifted)
    want_k, want_v = expected_caches(case.kv, off)
    assert rel_error(out, oracle(case.kv, off, want_k, want_v)[0]) > 100 * BOUND["float32"]


def test_dimensions_past_rotary_dim_are_copied(rng):
    """Only the first rotary_dim dimensions change; the rest are k_new's bits."""
    case = RotaryCase(KVCase(dtype="bfloat16", new_len=2, q_len=2, head_dim=64), rotary_dim=24)
    inputs, k_cache, _ = run_rotary_case(case, rng)
    rows = appended_rows(case, inputs, k_cache)
    assert np.array_equal(rows[..., 24:].view(np.uint16), inputs["k_new"][..., 24:].view(np.uint16))
    assert not np.array_equal(rows[..., :24], inputs["k_new"][..., :24])


def test_decode_loop_equals_one_prefill(rng):
    """Appending one rotated token a step gives the rows of one call over the whole
    prompt: each row's position is the same either way."""
    b, h, hk, d, cap, steps = 2, 4, 2, 32, 24, 10
    q = rng.standard_normal((b, h, steps, d)).astype(np.float32)
    k = rng.standard_normal((b, hk, steps, d)).astype(np.float32)
    v = rng.standard_normal((b, hk, steps, d)).astype(np.float32)
    k_cache = rng.standard_normal((b, hk, cap, d)).astype(np.float32)
    v_cache = rng.standard_normal((b, hk, cap, d)).astype(np.float32)
    cos, sin = rotary.tables(cap, d)
    tables = dict(rotary_cos=cos, rotary_sin=sin)
    whole_cache = k_cache.copy()
    whole = flash_attention_with_kvcache(
        q, whole_cache, v_cache.copy(), h, hk, d, cache_seqlens=0, k_new=k, v_new=v, **tables
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
            **tables,
        )
        np.testing.assert_allclose(step[:, :, 0], whole[:, :, t], rtol=2e-6, atol=2e-6)
    assert np.array_equal(k_cache[:, :, :steps], whole_cache[:, :, :steps])


def test_tables_rotate_as_the_usual_frequencies():
    """cuflash.rotary.tables: angle p * base ** (-2 r / rotary_dim)."""
    cos, sin = rotary.tables(5, 8, base=100.0)
    angle = 3 * 100.0 ** (-2 * 2 / 8)
    assert np.isclose(cos[3, 2], np.cos(angle)) and np.isclose(sin[3, 2], np.sin(angle))
    assert np.all(cos[0] == 1) and np.all(sin[0] == 0)


# ---------------------------------------------------------------------------------------
# Validation


def _valid(rng, xp=np):
    case = RotaryCase(KVCase(dtype="bfloat16", new_len=2, q_len=2, capacity=64))
    inputs = rotary_inputs(case, rng, xp)
    inputs["cache_seqlens"] = (
        np.array([0, 5, 40], np.int32) if xp is np else cupy.asarray(np.array([0, 5, 40], np.int32))
    )
    return case, inputs


BAD_CALLS = [
    ("rotary_sin", "given together", lambda i: dict(i, rotary_sin=None)),
    ("rotary_cos", "given together", lambda i: dict(i, rotary_cos=None)),
    (
        "rotary_cos",
        "expected numpy.ndarray or cupy.ndarray, got list",
        lambda i: dict(i, rotary_cos=i["rotary_cos"].tolist()),
    ),
    (
        "rotary_sin",
        "expected 2-D [S_rot, rotary_dim / 2], got 1-D",
        lambda i: dict(i, rotary_sin=i["rotary_sin"][0]),
    ),
    (
        "rotary_cos",
        "expected dtype float32 or q's bfloat16, got float64",
        lambda i: dict(i, rotary_cos=i["rotary_cos"].astype(np.float64)),
    ),
    (
        "rotary_cos",
        "expected dtype float32 or q's bfloat16, got float16",
        lambda i: dict(i, rotary_cos=i["rotary_cos"].astype(np.float16)),
    ),
    (
        "rotary_sin",
        "differs from rotary_cos's",
        lambda i: dict(i, rotary_sin=i["rotary_sin"][:, :8]),
    ),
    (
        "rotary_sin",
        "bfloat16 (67, 32) differs from rotary_cos's float32 (67, 32)",
        lambda i: dict(i, rotary_sin=i["rotary_sin"].astype(DTYPES["bfloat16"])),
    ),
    (
        "rotary_cos",
        "1 <= rotary_dim / 2 <= head_dim / 2 = 32, got (67, 33)",
        lambda i: dict(
            i,
            rotary_cos=np.ones((67, 33), np.float32),
            rotary_sin=np.ones((67, 33), np.float32),
        ),
    ),
    (
        "rotary_cos",
        "got (67, 0)",
        lambda i: dict(i, rotary_cos=i["rotary_cos"][:, :0], rotary_sin=i["rotary_sin"][:, :0]),
    ),
    (
        "rotary_cos",
        "got (0, 32)",
        lambda i: dict(i, rotary_cos=i["rotary_cos"][:0], rotary_sin=i["rotary_sin"][:0]),
    ),
    (
        "rotary_cos",
        "sequence 2: position 41 is past the tables' last row (S_rot = 41)",
        lambda i: dict(i, rotary_cos=i["rotary_cos"][:41], rotary_sin=i["rotary_sin"][:41]),
    ),
    (
        "rotary_cos",
        "position 63 is past the tables' last row (S_rot = 50)",
        lambda i: dict(
            i, cache_seqlens=62, rotary_cos=i["rotary_cos"][:50], rotary_sin=i["rotary_sin"][:50]
        ),
    ),
    (
        "rotary_cos",
        "sequence 0: query row 0 sits at position -1 < 0 (S_q = 3 query rows, L_b = 2 keys)",
        lambda i: dict(i, q=np.concatenate([i["q"], i["q"][:, :, :1]], axis=2)),
    ),
]


@pytest.mark.parametrize(
    "name, reason, change", BAD_CALLS, ids=[f"{n}-{r[:30]}" for n, r, _ in BAD_CALLS]
)
def test_cpu_rejects(name, reason, change, rng):
    case, inputs = _valid(rng)
    before = (inputs["k_cache"].copy(), inputs["v_cache"].copy())
    with pytest.raises(InvalidArgumentError) as info:
        call(case, change(inputs))
    assert info.value.arg == name, str(info.value)
    assert reason in info.value.reason, str(info.value)
    assert np.array_equal(before[0].view(np.uint16), inputs["k_cache"].view(np.uint16))
    assert np.array_equal(before[1].view(np.uint16), inputs["v_cache"].view(np.uint16))


def test_cpu_rejects_a_non_bool_style(rng):
    case, inputs = _valid(rng)
    with pytest.raises(InvalidArgumentError) as info:
        call(dataclasses.replace(case, interleaved=1), inputs)
    assert info.value.arg == "rotary_interleaved" and "expected a bool" in info.value.reason


def test_cpu_valid_base_runs(rng):
    """The base of the rejection tests is itself valid (each failure is the change's)."""
    case, inputs = _valid(rng)
    out, _ = call(case, inputs)
    assert np.all(np.isfinite(out.astype(np.float32)))


# ---------------------------------------------------------------------------------------
# The append kernel in the CPU simulator; its compilation


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_append_kernel_compiles_without_spills(arch):
    """kvcache_append of every dtype, the rotation included, through NVRTC."""
    kernel = standalone.STANDALONE["kvcache_append"]
    names = [kernel.name_expression(dtype=DTYPES[n]) for n in ("float32", "float16", "bfloat16")]
    compile_and_check(names, arch)


SIMULATED = [CASES[i] for i in (0, 2, 3, 4, 6, 9, 10, 12, 14, 15)]


@needs_compiler
@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("case", SIMULATED, ids=str)
def test_simulated_kernels_match_reference_and_cpu(case, capability, rng):
    """The append rotates k_new into the cache and q into its copy; the attention reads the
    copy: the reference's checks, and the cache bit for bit the CPU path's (one float32
    arithmetic, no FMA)."""
    kv = case.kv
    if capability == 90 and (kv.block_size or kv.q_len * kv.heads // kv.kv_heads < 64):
        pytest.skip("sm_90 differs from sm_80 only for long chunks (the dense kernels)")
    seed = int(rng.integers(2**31))
    sim = run_rotary_case(
        case,
        np.random.default_rng(seed),
        function=lambda *a, **k: simulated_kvcache.forward(*a, capability=capability, **k),
    )
    cpu = run_rotary_case(case, np.random.default_rng(seed))
    assert np.array_equal(sim[1].view(np.uint8), cpu[1].view(np.uint8))


GARBAGE_LENGTHS = np.array([5, -70000, 2**31 - 1, 10**6], np.int32)
TABLE_ROWS = 50  # fewer than the capacity: the clamp to the tables' rows matters


@needs_compiler
@pytest.mark.parametrize(
    "paged, q_len",
    [(False, 2), (True, 2), (False, 32)],
    ids=["contiguous", "paged", "contiguous-lengthy"],
)
def test_simulated_garbage_lengths_clamp_the_positions(paged, q_len, rng):
    """Device-held lengths are never trusted: under guard pages, garbage lengths (and block
    ids) keep every access inside the arrays, every row finite. On a contiguous cache the
    call is the CPU path's with each length clamped to [0, capacity - S_new] and each
    position to the tables' rows [0, S_rot) (tables whose last row repeats past S_rot)."""
    b, h, hk, d, bs, max_blocks, num_blocks = 4, 8, 2, 128, 16, 8, 20
    dtype = DTYPES["bfloat16"]
    shape = (num_blocks, hk, bs, d) if paged else (b, hk, max_blocks * bs, d)
    k_cache, v_cache = (rng.standard_normal(shape).astype(dtype) for _ in "kv")
    q = rng.standard_normal((b, h, q_len, d)).astype(dtype)
    k_new, v_new = (rng.standard_normal((b, hk, q_len, d)).astype(dtype) for _ in "kv")
    cos, sin = rotary.tables(TABLE_ROWS, 96)
    table = garbage_table = None
    if paged:
        table = np.arange(b * max_blocks, dtype=np.int32).reshape(b, max_blocks) % num_blocks
        garbage_table = np.array(
            [[3, -1, 2**30, -(2**31)] * 2, [19, 20, 7, 0] * 2, [1000, 5, 6, 7] * 2, [-5] * 8],
            np.int32,
        )
    before = (k_cache.copy(), v_cache.copy())
    arrays = dict(k_new=k_new, v_new=v_new, return_lse=True, rotary_interleaved=True)
    out, lse = simulated_kvcache.forward(
        q,
        k_cache,
        v_cache,
        h,
        hk,
        d,
        cache_seqlens=np.zeros(b, np.int32),
        block_table=table,
        rotary_cos=cos,
        rotary_sin=sin,
        device_lengths=GARBAGE_LENGTHS,
        device_table=garbage_table,
        guard=True,
        **arrays,
    )
    assert np.isfinite(out.astype(np.float32)).all() and np.isfinite(lse).all()
    if paged:
        return
    clamped = np.clip(GARBAGE_LENGTHS, 0, shape[2] - q_len).astype(np.int32)
    last = shape[2] - TABLE_ROWS  # rows past S_rot: the last row again

    def repeated(t):
        return np.concatenate([t, np.repeat(t[-1:], last, axis=0)])

    want_out, want_lse = flash_attention_with_kvcache(
        q,
        *before,
        h,
        hk,
        d,
        cache_seqlens=clamped,
        rotary_cos=repeated(cos),
        rotary_sin=repeated(sin),
        **arrays,
    )
    assert np.array_equal(k_cache.view(np.uint16), before[0].view(np.uint16))
    assert np.array_equal(v_cache.view(np.uint16), before[1].view(np.uint16))
    assert rel_error(out, want_out.astype(np.float64)) <= BOUND["bfloat16"]
    check_lse(lse, want_lse.astype(np.float64))


# ---------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_matches_reference_and_cpu(case, rng, poisoned):
    seed = int(rng.integers(2**31))
    gpu = run_rotary_case(case, np.random.default_rng(seed), xp=cupy)
    cpu = run_rotary_case(case, np.random.default_rng(seed))
    assert np.array_equal(gpu[1].view(np.uint8), cpu[1].view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[0], CASES[6], CASES[9], CASES[15]], ids=str)
def test_gpu_plans_take_each_calls_tables(case, rng, poisoned):
    """Device-held lengths with check=False: the second call of a signature takes the launch
    plan, with that call's tables and its own rotated copy of q."""
    plans.clear()
    for _ in range(2):
        run_rotary_case(case, rng, xp=cupy)


@pytest.mark.gpu
def test_gpu_strided_q_and_tables(rng, poisoned):
    """q and k_new as [B, S, H, D] views, the tables a column slice of wider ones: the
    cache bit for bit the CPU path's."""
    b, h, hk, d, cap = 2, 8, 2, 64, 100
    dtype = DTYPES["float16"]
    q = rng.standard_normal((b, 3, h, d)).astype(dtype).transpose(0, 2, 1, 3)
    k_new = rng.standard_normal((b, 3, hk, d)).astype(dtype).transpose(0, 2, 1, 3)
    v_new = rng.standard_normal((b, hk, 3, d)).astype(dtype)
    k_cache, v_cache = (rng.standard_normal((b, hk, cap, d)).astype(dtype) for _ in "kv")
    wide_cos, wide_sin = rotary.tables(cap, 2 * d)
    lengths = np.array([10, 60], np.int32)

    def run(move):
        caches = [move(k_cache.copy()), move(v_cache.copy())]
        cos, sin = (move(t)[:, : d // 2] for t in (wide_cos, wide_sin))  # strided rows
        out = flash_attention_with_kvcache(
            move(q),
            *caches,
            h,
            hk,
            d,
            cache_seqlens=move(lengths),
            k_new=move(k_new),
            v_new=move(v_new),
            rotary_cos=cos,
            rotary_sin=sin,
        )
        return to_numpy(out), to_numpy(caches[0])

    cpu_out, cpu_k = run(lambda a: a)
    gpu_out, gpu_k = run(_to_device)
    assert np.array_equal(gpu_k.view(np.uint16), cpu_k.view(np.uint16))
    assert rel_error(gpu_out, cpu_out.astype(np.float64)) <= BOUND["float16"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "paged, q_len",
    [(False, 2), (True, 2), (False, 32)],
    ids=["contiguous", "paged", "contiguous-dense"],
)
def test_gpu_garbage_lengths_clamp_the_positions(rng, paged, q_len):
    """Garbage device-held lengths with tables shorter than the cache: no access outside
    the fenced caches, every row finite."""
    b, h, hk, d, bs, max_blocks, num_blocks = 4, 8, 2, 128, 16, 8, 20
    dtype = DTYPES["bfloat16"]
    shape = (num_blocks, hk, bs, d) if paged else (b, hk, max_blocks * bs, d)
    buf_k, k_cache = _fenced(rng, shape, dtype)
    buf_v, v_cache = _fenced(rng, shape, dtype)
    fence_k, fence_v = buf_k.copy(), buf_v.copy()
    q = cupy.asarray(rng.standard_normal((b, h, q_len, d)).astype(dtype))
    k_new = cupy.asarray(rng.standard_normal((b, hk, q_len, d)).astype(dtype))
    v_new = cupy.asarray(rng.standard_normal((b, hk, q_len, d)).astype(dtype))
    cos, sin = rotary.tables(50, 96, xp=cupy)
    table = None
    if paged:
        table = cupy.asarray(np.arange(b * max_blocks, dtype=np.int32).reshape(b, max_blocks) % 20)
    out, lse = flash_attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        h,
        hk,
        d,
        cache_seqlens=cupy.asarray(GARBAGE_LENGTHS),
        k_new=k_new,
        v_new=v_new,
        block_table=table,
        return_lse=True,
        rotary_cos=cos,
        rotary_sin=sin,
    )
    cupy.cuda.get_current_stream().synchronize()  # an illegal address would surface here
    assert bool(cupy.isfinite(out.astype(np.float32)).all()) and bool(cupy.isfinite(lse).all())
    size = int(np.prod(shape))
    for buf, before in ((buf_k, fence_k), (buf_v, fence_v)):
        outside = cupy.concatenate([buf[:4096], buf[4096 + size :]]).view(cupy.uint16)
        assert cupy.array_equal(
            outside, cupy.concatenate([before[:4096], before[4096 + size :]]).view(cupy.uint16)
        )


@pytest.mark.gpu
def test_gpu_rejects_tables_of_another_kind(rng):
    case, inputs = _valid(rng, xp=cupy)
    with pytest.raises(InvalidArgumentError, match="mixed"):
        call(case, dict(inputs, rotary_cos=to_numpy(inputs["rotary_cos"])))


@pytest.mark.gpu
def test_gpu_check_verifies_the_positions(rng):
    """check=True copies device-held lengths to the host and rejects positions past the
    tables before anything is written."""
    case, inputs = _valid(rng, xp=cupy)
    short = dict(inputs, rotary_cos=inputs["rotary_cos"][:41], rotary_sin=inputs["rotary_sin"][:41])
    snapshot = inputs["k_cache"].copy()
    with pytest.raises(InvalidArgumentError, match="sequence 2: position 41 is past"):
        call(case, short, check=True)
    assert cupy.array_equal(snapshot.view(cupy.uint16), inputs["k_cache"].view(cupy.uint16))
    out, _ = call(case, short)  # without check: clamped to the last row, no error
    assert bool(cupy.isfinite(out.astype(np.float32)).all())
