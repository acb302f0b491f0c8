"""``head_dim_v`` in ``flash_attention_with_kvcache`` (the KV-cache page): v's own head
dim up to 512 under a head_dim up to 576 on the CPU path, absorbed MLA's ``v_cache`` as
the view ``k_cache[..., :head_dim_v]``, contiguous and paged, against the float64 oracle;
the GPU's kvcache_decode_mla in the CPU simulator and on the GPU (the latent read once,
separate narrower or wider values, splits, the score options, untrusted device-held
lengths and block ids); bad input and the GPU path's refusals."""

import dataclasses

import numpy as np
import pytest
import simulated_kvcache
import simulator
from support import DTYPES, FLOOR, PACKED_BOUND, compile_and_check, cupy, rel_error, to_numpy

import cuflash
from cuflash import AttentionConfig
from cuflash.reference import attention_reference


def _paged(cache, block_size, rng):
    """``cache`` ``[B, H_kv, S_cap, D]`` as shuffled blocks and their block table."""
    b, h_kv, cap, d = cache.shape
    per = cap // block_size
    order = rng.permutation(b * per)
    blocks = np.empty((b * per, h_kv, block_size, d), cache.dtype)
    table = np.empty((b, per), np.int32)
    for i in range(b):
        for j in range(per):
            slot = order[i * per + j]
            blocks[slot] = cache[i, :, j * block_size : (j + 1) * block_size]
            table[i, j] = slot
    return blocks, table


def _reference(q, keys, values, lengths, **options):
    """The oracle per sequence on its first ``lengths[b]`` keys (bottom-right causal); a
    sequence of no keys gives zeros, and an lse of -inf or (with sinks) the sink."""
    outs, lses = [], []
    for b, length in enumerate(lengths):
        if length == 0:
            _, h, q_len, _ = q.shape
            outs.append(np.zeros((1, h, q_len, values.shape[-1])))
            sinks = options.get("sinks")
            lse = np.full((1, h, q_len), -np.inf) if sinks is None else np.empty((1, h, q_len))
            if sinks is not None:
                lse[:] = np.asarray(sinks, np.float64)[None, :, None]
            lses.append(lse)
            continue
        k, v = (x[b : b + 1, :, :length].astype(np.float64) for x in (keys, values))
        out, lse = attention_reference(q[b : b + 1].astype(np.float64), k, v, True, **options)
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_absorbed_mla_reads_the_latent_as_values(paged, rng):
    """MLA decoding absorbed: one KV head of 576 (a 512-wide latent and 64 more), values
    its first 512 columns as a view of the same cache, 16 query heads, an append of two
    rows (v_new the view of k_new): the latent is the keys and the values."""
    b, h, d, dv, cap, q_len = 2, 16, 576, 512, 64, 2
    dtype = DTYPES["bfloat16"]
    latent = rng.standard_normal((b, 1, cap, d)).astype(dtype)
    q = rng.standard_normal((b, h, q_len, d)).astype(dtype)
    k_new = rng.standard_normal((b, 1, q_len, d)).astype(dtype)
    lengths = np.array([17, 40], np.int32)
    expected = latent.copy()
    for i, length in enumerate(lengths):
        expected[i, :, length : length + q_len] = k_new[i]
    block_table = None
    cache = latent
    if paged:
        cache, block_table = _paged(latent, 16, rng)
    out, lse = cuflash.flash_attention_with_kvcache(
        q,
        cache,
        cache[..., :dv],
        h,
        1,
        d,
        cache_seqlens=lengths,
        k_new=k_new,
        v_new=k_new[..., :dv],
        block_table=block_table,
        return_lse=True,
        head_dim_v=dv,
    )
    assert out.shape == (b, h, q_len, dv) and out.dtype == dtype
    ref_out, ref_lse = _reference(q, expected, expected[..., :dv], lengths + q_len)
    assert rel_error(out, ref_out) <= PACKED_BOUND["bfloat16"] + FLOOR["bfloat16"]
    assert np.max(np.abs(lse - ref_lse)) <= 1e-4 * (1 + np.abs(ref_lse).max())
    if not paged:  # the append wrote the new rows, and nothing else
        assert np.array_equal(latent.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_separate_narrower_values_with_options(dtype, rng):
    """MLA without absorption: q/k of 192, a v cache of its own of 128 columns, GQA, a
    window, ALiBi and sinks, against the oracle."""
    b, h, h_kv, d, dv, cap, q_len = 2, 4, 2, 192, 128, 80, 3
    np_dtype = DTYPES[dtype]
    k_cache = rng.standard_normal((b, h_kv, cap, d)).astype(np_dtype)
    v_cache = rng.standard_normal((b, h_kv, cap, dv)).astype(np_dtype)
    q = rng.standard_normal((b, h, q_len, d)).astype(np_dtype)
    slopes = rng.uniform(0.02, 0.3, h).astype(np.float32)
    sinks = rng.standard_normal(h).astype(np.float32)
    lengths = np.array([30, 77], np.int32)
    out, lse = cuflash.flash_attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        h,
        h_kv,
        d,
        True,
        (20, 0),
        cache_seqlens=lengths,
        return_lse=True,
        alibi_slopes=slopes,
        sinks=sinks,
        head_dim_v=dv,
    )
    ref_out, ref_lse = _reference(
        q, k_cache, v_cache, lengths, window=(20, 0), alibi_slopes=slopes, sinks=sinks
    )
    assert out.shape == (b, h, q_len, dv)
    assert rel_error(out, ref_out) <= PACKED_BOUND[dtype] + FLOOR[dtype]
    assert np.max(np.abs(lse - ref_lse)) <= 1e-4 * (1 + np.abs(ref_lse).max())


def _call(q, k_cache, v_cache, d, **kw):
    return cuflash.flash_attention_with_kvcache(q, k_cache, v_cache, 2, 1, d, cache_seqlens=3, **kw)


def _arrays(d=64, dv=32, cap=16):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 1, d)).astype(np.float32)
    k_cache = rng.standard_normal((1, 1, cap, d)).astype(np.float32)
    v_cache = rng.standard_normal((1, 1, cap, dv)).astype(np.float32)
    return q, k_cache, v_cache


def test_bad_value_head_dims():
    q, k_cache, v_cache = _arrays()
    with pytest.raises(cuflash.InvalidArgumentError, match="v_cache.*head_dim_v 64 columns"):
        _call(q, k_cache, v_cache, 64)  # head_dim_v not given: v of 64 columns expected
    with pytest.raises(cuflash.InvalidArgumentError, match="head_dim_v.*multiple of 8"):
        _call(q, k_cache, v_cache, 64, head_dim_v=36)
    with pytest.raises(cuflash.InvalidArgumentError, match="v_new.*head_dim_v"):
        k_new = np.ones((1, 1, 1, 64), np.float32)
        _call(q, k_cache, v_cache, 64, head_dim_v=32, k_new=k_new, v_new=k_new)
    big_q, big_k, big_v = _arrays(d=576, dv=520)
    with pytest.raises(cuflash.InvalidArgumentError, match="head_dim_v.*from 8 to 512"):
        _call(big_q, big_k, big_v, 576, head_dim_v=520)
    with pytest.raises(cuflash.InvalidArgumentError, match="pass head_dim_v"):
        _call(big_q, big_k, big_k, 576)  # v of 576 columns: past 512
    over_q, over_k, over_v = _arrays(d=584, dv=512)
    with pytest.raises(cuflash.InvalidArgumentError, match="head_dim.*from 8 to 576"):
        _call(over_q, over_k, over_v, 584, head_dim_v=512)


def test_a_value_view_must_be_the_first_columns():
    """v_cache sharing k_cache's memory: its first head_dim_v columns only."""
    q, k_cache, _ = _arrays(d=64)
    out = _call(q, k_cache, k_cache[..., :32], 64, head_dim_v=32)
    assert out.shape == (1, 2, 1, 32) and np.all(np.isfinite(out))
    with pytest.raises(cuflash.InvalidArgumentError, match="shares memory with k_cache"):
        _call(q, k_cache, k_cache[..., 32:], 64, head_dim_v=32)
    with pytest.raises(cuflash.InvalidArgumentError, match="shares memory with k_cache"):
        _call(q, k_cache, k_cache[:, :, ::-1, :32], 64, head_dim_v=32)


# ------------------------------------------------------------ kvcache_decode_mla

needs_compiler = pytest.mark.skipif(
    simulator.compiler() is None, reason="the simulator needs a host C++ compiler (g++ or CXX)"
)


@dataclasses.dataclass(frozen=True)
class MlaCase:
    """A decoding call that kvcache_decode_mla serves: ``latent`` v_cache the view of
    k_cache's first ``head_dim_v`` columns, else a v cache of its own."""

    head_dim: int = 576
    head_dim_v: int = 512
    latent: bool = True
    dtype: str = "bfloat16"
    batch: int = 2
    heads: int = 16
    kv_heads: int = 1
    q_len: int = 1
    new_len: int = 1
    capacity: int = 96
    lengths: tuple = (17, 70)
    block_size: int = 0  # 0: contiguous
    window: tuple = (-1, 0)
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    offset: int = 0  # the caches' columns start this far into wider rows (off the 16-byte grid)

    def __str__(self):
        fields = dataclasses.fields(self)
        return "-".join(
            f"{f.name}={getattr(self, f.name)}"
            for f in fields
            if getattr(self, f.name) != f.default or f.name in ("head_dim", "head_dim_v")
        )


MLA_CASES = [
    MlaCase(),  # absorbed MLA, 16 heads: one row tile, a partial last key tile
    MlaCase(heads=20, q_len=2, new_len=2, block_size=16, capacity=320, lengths=(300, 5)),
    MlaCase(lengths=(0, 33), new_len=0, sinks=True),  # a sequence of no keys: the sink alone
    MlaCase(
        head_dim=192,
        head_dim_v=128,
        latent=False,
        dtype="float16",
        heads=4,
        kv_heads=2,
        q_len=3,
        new_len=3,
        window=(20, 0),
        alibi=True,
        sinks=True,
        softcap=6.0,
    ),  # fmt: skip
    MlaCase(
        head_dim=64,
        head_dim_v=128,
        latent=False,
        heads=8,
        kv_heads=2,
        block_size=32,
        capacity=96,
        window=(-1, -1),
        new_len=0,
    ),  # fmt: skip
    MlaCase(head_dim=320, head_dim_v=256, heads=6, lengths=(95, 40), new_len=1),
]


# Absorbed MLA with many query heads: kvcache_decode_mla_wgmma on sm_90 (64 packed rows
# a block; MLA_CASES' latent 16-head ones take it there too), kvcache_decode_mla elsewhere.
MLA_WGMMA_CASES = [
    MlaCase(heads=64),  # one row tile, a partial last key tile
    # two row tiles (the second partial), paged, five key tiles, sinks
    MlaCase(
        dtype="float16",
        heads=40,
        q_len=2,
        new_len=2,
        block_size=16,
        capacity=320,
        lengths=(300, 5),
        sinks=True,
    ),
    MlaCase(
        head_dim=256,
        head_dim_v=128,
        heads=128,
        kv_heads=2,
        window=(20, 0),
        alibi=True,
        softcap=6.0,
        lengths=(95, 40),
    ),
    MlaCase(heads=32, offset=1),  # rows off the 16-byte grid: copies element by element
]


def mla_inputs(case, rng):
    """NumPy inputs of ``case``: q, the caches (paged: shuffled blocks and a table), k_new /
    v_new (the view of k_new for a latent cache), slopes, sinks, the lengths."""
    dtype = DTYPES[case.dtype]
    b, h, hk, d, dv = case.batch, case.heads, case.kv_heads, case.head_dim, case.head_dim_v
    width = d if case.latent else max(d, dv)
    keys = rng.standard_normal((b, hk, case.capacity, width + case.offset)).astype(dtype)
    keys = keys[..., case.offset :]
    k_cache = keys[..., :d]
    v_cache = keys[..., :dv] if case.latent else rng.standard_normal(
        (b, hk, case.capacity, dv)).astype(dtype)  # fmt: skip
    dense_k, dense_v, table = k_cache, v_cache, None
    if case.block_size:  # the same shuffle of blocks for both caches
        k_blocks, table = _paged(np.ascontiguousarray(keys), case.block_size, rng)
        k_cache = k_blocks[..., :d]
        if case.latent:
            v_cache = k_blocks[..., :dv]
        else:
            v_cache = np.empty((k_blocks.shape[0], hk, case.block_size, dv), dtype)
            for i, j in np.ndindex(*table.shape):
                v_cache[table[i, j]] = dense_v[
                    i, :, j * case.block_size : (j + 1) * case.block_size
                ]
    q = rng.standard_normal((b, h, case.q_len, d)).astype(dtype)
    k_new = v_new = None
    if case.new_len:
        k_new = rng.standard_normal((b, hk, case.new_len, d)).astype(dtype)
        v_new = k_new[..., :dv] if case.latent else rng.standard_normal(
            (b, hk, case.new_len, dv)).astype(dtype)  # fmt: skip
    slopes = rng.uniform(0.02, 0.3, h).astype(np.float32) if case.alibi else None
    sinks = rng.standard_normal(h).astype(np.float32) if case.sinks else None
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new, block_table=table,
        alibi_slopes=slopes, sinks=sinks, cache_seqlens=np.array(case.lengths, np.int32),
        dense_k=dense_k, dense_v=dense_v,
    )  # fmt: skip


def mla_expected(case, inputs):
    """The float64 oracle of ``case`` on its inputs (the append done on copies of the
    caches before paging)."""
    k, v = inputs["dense_k"].copy(), inputs["dense_v"].copy()
    lengths = np.array(case.lengths)
    for i, length in enumerate(lengths):
        if case.new_len:
            k[i, :, length : length + case.new_len] = inputs["k_new"][i]
            v[i, :, length : length + case.new_len] = inputs["v_new"][i]
    options = dict(window=case.window, softcap=case.softcap)
    if case.alibi:
        options["alibi_slopes"] = inputs["alibi_slopes"]
    if case.sinks:
        options["sinks"] = inputs["sinks"]
    return _reference(inputs["q"], k, v, lengths + case.new_len, **options)


def run_mla(case, inputs, call):
    """``call`` (the library or the simulator) on ``case``'s inputs: ``(out, lse)``."""
    return call(
        inputs["q"], inputs["k_cache"], inputs["v_cache"], case.heads, case.kv_heads,
        case.head_dim, True, case.window, cache_seqlens=inputs["cache_seqlens"],
        k_new=inputs["k_new"], v_new=inputs["v_new"], block_table=inputs["block_table"],
        return_lse=True, softcap=case.softcap, alibi_slopes=inputs["alibi_slopes"],
        sinks=inputs["sinks"], head_dim_v=case.head_dim_v,
    )  # fmt: skip


def check_mla(case, out, lse, want_out, want_lse):
    out, lse = to_numpy(out), to_numpy(lse)
    assert out.shape == (case.batch, case.heads, case.q_len, case.head_dim_v)
    assert np.all(np.isfinite(out)) and not np.any(np.isnan(lse))
    err = rel_error(out, want_out)
    assert err <= PACKED_BOUND[case.dtype] + FLOOR[case.dtype], f"{case}: {err:.3g}"
    finite = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.max(np.abs(lse - want_lse)[finite], initial=0) <= 1e-3 * (
        1 + np.abs(want_lse[finite]).max(initial=0)
    )


def mla_problem(case, rng):
    """The validated call (``kvcache_problem``) of ``case`` on fresh inputs."""
    from cuflash.core import kvcache_problem as kvcache

    inputs = mla_inputs(case, rng)
    config = AttentionConfig(
        case.heads, case.kv_heads, case.head_dim, True, case.window, head_dim_v=case.head_dim_v
    )
    return kvcache.kvcache_problem(
        inputs["q"], inputs["k_cache"], inputs["v_cache"], config, inputs["cache_seqlens"],
        inputs["k_new"], inputs["v_new"], inputs["block_table"], return_lse=True,
    )  # fmt: skip


def mla_kernel_of(case, capability):
    """The kernel a case should take: kvcache_decode_mla_wgmma on sm_90 for the latent view
    with 16 packed query rows or more, head_dim a multiple of 64 and head_dim_v of 128."""
    wgmma = (
        capability == 90
        and case.latent
        and case.heads // case.kv_heads * case.q_len >= 16
        and case.head_dim % 64 == 0
        and case.head_dim_v % 128 == 0
    )
    return "kvcache_decode_mla_wgmma" if wgmma else "kvcache_decode_mla"


def test_mla_cases_route_to_their_kernel():
    """Every case takes kvcache_decode_mla (with the latent flag of its v_cache, its tile
    of keys fitting the block's shared memory of sm_80, sm_86 and sm_90) or, on sm_90,
    kvcache_decode_mla_wgmma (mla_kernel_of)."""
    from cuflash.gpu import decode_kernels, standalone
    from cuflash.gpu.decode_tiles import block_shared_limit

    rng = np.random.default_rng(0)
    for case in MLA_CASES:
        problem = mla_problem(case, rng)
        assert problem.latent == case.latent and problem.own_value_dims
        for capability in (80, 86, 90):
            name, keys, rows, shared = decode_kernels.decode_kernel(problem, capability)
            assert standalone.standalone_of(name).name == mla_kernel_of(case, capability)
            if mla_kernel_of(case, capability) != "kvcache_decode_mla":
                continue
            assert name.endswith(f", {str(case.latent).lower()}>") and rows == 16
            assert shared <= block_shared_limit(capability) and keys in (16, 32, 64)
        assert (
            decode_kernels.decode_kernel(problem, 90)[1]
            >= decode_kernels.decode_kernel(problem, 86)[1]
        )


def test_mla_wgmma_cases_route_to_their_kernel():
    """Many query heads over the latent view take kvcache_decode_mla_wgmma on sm_90 (64
    rows a block, its 256 threads, shared memory within the block's limit) and
    kvcache_decode_mla elsewhere and below 16 packed rows."""
    from cuflash.gpu import decode_kernels, standalone
    from cuflash.gpu.decode_tiles import block_shared_limit

    rng = np.random.default_rng(0)
    for case in MLA_WGMMA_CASES:
        problem = mla_problem(case, rng)
        name, keys, rows, shared = decode_kernels.decode_kernel(problem, 90)
        assert standalone.standalone_of(name).name == "kvcache_decode_mla_wgmma"
        assert (keys, rows, decode_kernels.block_threads(name)) == (64, 64, 256)
        assert shared <= block_shared_limit(90)
        for capability in (80, 86):
            name = decode_kernels.decode_kernel(problem, capability)[0]
            assert standalone.standalone_of(name).name == "kvcache_decode_mla"
    few = MlaCase(heads=8)  # 8 packed rows: kvcache_decode_mla
    name = decode_kernels.decode_kernel(mla_problem(few, rng), 90)[0]
    assert standalone.standalone_of(name).name == "kvcache_decode_mla"


def test_mla_wgmma_kernels_compile_without_spills():
    """The kvcache_decode_mla_wgmma instantiations of the cases (and DeepSeek's paged
    576 / 512) compile for sm_90a with no spill or stack frame and no serialized wgmma."""
    from cuflash.gpu import decode_kernels

    rng = np.random.default_rng(0)
    names = set()
    for case in [*MLA_WGMMA_CASES, MlaCase(heads=128, block_size=64, capacity=128)]:
        names.add(decode_kernels.decode_kernel(mla_problem(case, rng), 90)[0])
    assert len(names) == 4
    report = compile_and_check(sorted(names), "sm_90a")
    assert not any(info["wgmma_serialized"] for info in report.values()), report


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_mla_kernels_compile_without_spills(arch):
    """The kvcache_decode_mla instantiations the cases launch on that architecture, and the
    combine at their value head dims, compile through NVRTC with no spill or stack frame."""
    from cuflash.gpu import decode_kernels

    rng = np.random.default_rng(0)
    capability = int(arch[3:5])
    names = set()
    for case in MLA_CASES:
        problem = mla_problem(case, rng)
        if case.dtype == "bfloat16":
            names |= {
                decode_kernels.decode_kernel(problem, capability)[0],
                decode_kernels.combine_name(problem),
            }
    assert len(names) >= 5
    compile_and_check(sorted(names), arch)


@needs_compiler
@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("case", MLA_CASES, ids=str)
def test_simulated_mla_kernel_matches_oracle(case, capability, rng):
    """kvcache_decode_mla (and the append, the combine of its splits) in the CPU
    simulator with out-of-buffer accesses trapped, against the float64 oracle."""
    inputs = mla_inputs(case, rng)
    want = mla_expected(case, inputs)
    out, lse = run_mla(case, inputs, lambda *a, **k: simulated_kvcache.forward(
        *a, capability=capability, guard=True, **k))  # fmt: skip
    check_mla(case, out, lse, *want)


@needs_compiler
@pytest.mark.parametrize("case", MLA_WGMMA_CASES, ids=str)
def test_simulated_mla_wgmma_kernel_matches_oracle(case, rng):
    """kvcache_decode_mla_wgmma (sm_90's choice for many query heads) in the CPU simulator
    with out-of-buffer accesses trapped, against the float64 oracle."""
    inputs = mla_inputs(case, rng)
    want = mla_expected(case, inputs)
    out, lse = run_mla(case, inputs, lambda *a, **k: simulated_kvcache.forward(
        *a, capability=90, guard=True, **k))  # fmt: skip
    check_mla(case, out, lse, *want)


@needs_compiler
@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_simulated_mla_kernel_stays_inside_on_garbage(paged, capability, rng):
    """Device-held lengths and block ids of any value: kvcache_decode_mla reads and writes
    inside its buffers (the simulator's guard traps any other access) and leaves no NaN."""
    case = MlaCase(block_size=16 if paged else 0, capacity=64, lengths=(5, 9))
    inputs = mla_inputs(case, rng)
    lengths = np.array([2**30, -7], np.int32)
    table = None
    if paged:
        table = inputs["block_table"].copy()
        table[0, 0], table[1, -1] = 10**6, -3

    def call(*a, **k):
        return simulated_kvcache.forward(
            *a,
            capability=capability,
            guard=True,
            device_lengths=lengths,
            device_table=table,
            **k,
        )

    out, lse = run_mla(case, inputs, call)
    assert np.all(np.isfinite(out)) and not np.any(np.isnan(lse))


@pytest.mark.gpu
@pytest.mark.parametrize("case", MLA_CASES + MLA_WGMMA_CASES, ids=str)
def test_gpu_mla_kernel_matches_oracle(case, rng, poisoned):
    """kvcache_decode_mla (and, for many heads on sm_90, kvcache_decode_mla_wgmma) on the
    GPU (outputs poisoned first) against the float64 oracle;
    the caches afterwards as the CPU path leaves them."""
    inputs = mla_inputs(case, rng)
    want = mla_expected(case, inputs)
    on_gpu = {n: None if a is None else cupy.asarray(a) for n, a in inputs.items()}
    if case.latent:  # the view of the same device cache
        on_gpu["v_cache"] = on_gpu["k_cache"][..., : case.head_dim_v]
        if case.new_len:
            on_gpu["v_new"] = on_gpu["k_new"][..., : case.head_dim_v]
    out, lse = run_mla(case, on_gpu, cuflash.flash_attention_with_kvcache)
    check_mla(case, out, lse, *want)
    cpu_inputs = {n: None if a is None else a.copy() for n, a in inputs.items()}
    if case.latent:
        cpu_inputs["v_cache"] = cpu_inputs["k_cache"][..., : case.head_dim_v]
        if case.new_len:
            cpu_inputs["v_new"] = cpu_inputs["k_new"][..., : case.head_dim_v]
    run_mla(case, cpu_inputs, cuflash.flash_attention_with_kvcache)
    for name in ("k_cache", "v_cache"):
        assert np.array_equal(
            to_numpy(on_gpu[name]).view(np.uint16), cpu_inputs[name].view(np.uint16)
        ), name


@pytest.mark.gpu
def test_gpu_refuses_what_its_kernels_do_not_take():
    """A value head dim of its own or keys past 256 on the GPU: float16/bfloat16, head_dim
    a multiple of 16 and head_dim_v of 64 (a clear error before any kernel)."""
    q, k_cache, v_cache = (cupy.asarray(x) for x in _arrays())
    with pytest.raises(cuflash.InvalidArgumentError, match="GPU path takes float16 or bfloat16"):
        _call(q, k_cache, v_cache, 64, head_dim_v=32)
    half = [cupy.asarray(x.astype(np.float16)) for x in _arrays(d=64, dv=32)]
    with pytest.raises(cuflash.InvalidArgumentError, match="head_dim_v of 64s"):
        _call(*half, 64, head_dim_v=32)
    odd = [cupy.asarray(x.astype(np.float16)) for x in _arrays(d=264, dv=264)]
    with pytest.raises(cuflash.InvalidArgumentError, match="head_dim_v of 64s"):
        _call(*odd, 264, head_dim_v=264)


def test_gpu_requirements_hold_on_the_host():
    """The GPU's refusals come from the problem's checks, which need no GPU: assert them
    through kvcache_problem on NumPy arrays standing for device ones."""
    from cuflash.core import kvcache_problem as kvcache

    q, k_cache, v_cache = _arrays()
    config = AttentionConfig(2, 1, 64, True, head_dim_v=32)
    problem = kvcache.kvcache_problem(q, k_cache, v_cache, config, 3)
    with pytest.raises(cuflash.InvalidArgumentError, match="GPU path takes float16 or bfloat16"):
        kvcache._check_mla_on_gpu(problem)
    half = kvcache.kvcache_problem(
        *(x.astype(np.float16) for x in (q, k_cache, v_cache)), config, 3
    )
    with pytest.raises(cuflash.InvalidArgumentError, match="head_dim_v of 64s"):
        kvcache._check_mla_on_gpu(half)
