"""Attention sinks (cuflash.sinks) on the CPU path and, marked ``gpu``, on the GPU path:
dense forward and backward against the float64 oracle (dsinks included), the vjp, packed
batches, the KV cache and the ring, rows that see no key (zeros, lse = sinks[h]), and the
oracle's dsinks against finite differences of its own output."""

import numpy as np
import pytest
import simulator
from sink_checks import NO_KEY_LSE_RTOL, check_sink_results, finite_difference_dsinks, random_sinks
from support import (
    DTYPES,
    FLOOR,
    PACKED_BOUND,
    Case,
    compile_and_check,
    cupy,
    packed_inputs,
    random_inputs,
    rel_error,
    to_numpy,
)

import cuflash
from cuflash import distributed as dist
from cuflash.reference import attention_reference, attention_reference_grad

ARRAYS = [pytest.param("numpy", id="cpu"), pytest.param("cupy", id="gpu", marks=pytest.mark.gpu)]
DENSE = [
    Case(dtype="float32", heads=4, kv_heads=2, q_len=70, kv_len=45, causal=True),
    Case(dtype="bfloat16", heads=4, kv_heads=1, q_len=50, kv_len=90, head_dim=128, window=(20, 3)),
    Case(
        dtype="float16",
        heads=2,
        kv_heads=2,
        q_len=33,
        kv_len=60,
        head_dim=40,
        kv_seq_len=17,
        causal=True,
    ),
]


def _xp(name):
    return np if name == "numpy" else cupy


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", DENSE, ids=str)
@pytest.mark.parametrize("arrays", ARRAYS)
def test_dense_sinks_match_oracle(arrays, case, deterministic, rng):
    """out, lse, dq, dk, dv and dsinks; causal rows past the keys see none: zeros, lse =
    sinks[h] (exactly on the CPU path)."""
    xp = _xp(arrays)
    q, k, v, dout = random_inputs(case, rng, xp)
    sinks = random_sinks(rng, case.heads, xp)
    kw = dict(kv_seq_len=case.kv_seq_len, sinks=sinks)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args, **kw)
    grads = cuflash.flash_attention_bwd(
        dout, q, k, v, out, lse, *case.args, **kw, deterministic=deterministic
    )
    assert len(grads) == 4 and grads[3].dtype == np.float32 and grads[3].shape == (case.heads,)
    dead = check_sink_results(
        (q, k, v, dout),
        (out, lse, *grads),
        sinks,
        case.dtype,
        case.causal,
        case.window,
        case.kv_seq_len,
        kernels=xp is not np,
    )
    assert dead.any() == (case.causal and case.q_len > (case.kv_seq_len or case.kv_len))
    if deterministic:  # the same bits again
        again = cuflash.flash_attention_bwd(
            dout, q, k, v, out, lse, *case.args, **kw, deterministic=True
        )
        for a, b in zip(grads, again):
            assert np.array_equal(to_numpy(a), to_numpy(b))


@pytest.mark.parametrize("arrays", ARRAYS)
def test_vjp_returns_dsinks(arrays, rng):
    xp = _xp(arrays)
    case = DENSE[0]
    q, k, v, dout = random_inputs(case, rng, xp)
    sinks = random_sinks(rng, case.heads, xp)
    out, vjp = cuflash.flash_attention_vjp(q, k, v, *case.args, sinks=sinks)
    assert vjp.config.sinks is sinks
    direct = cuflash.flash_attention_bwd(dout, q, k, v, out, vjp.lse, *case.args, sinks=sinks)
    for a, b in zip(vjp(dout), direct):
        assert np.array_equal(to_numpy(a), to_numpy(b))


@pytest.mark.parametrize("arrays", ARRAYS)
def test_a_row_that_sees_no_key(arrays, rng):
    """kv_seq_len = 0: every row sees nothing; zeros, lse = sinks[h], and the sinks take
    all the probability: dsinks = -sum Delta = 0 (out is 0), dq = 0."""
    xp = _xp(arrays)
    case = Case(dtype="float32", heads=4, kv_heads=2, q_len=5, kv_len=8)
    q, k, v, dout = random_inputs(case, rng, xp)
    sinks = random_sinks(rng, case.heads, xp)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args, kv_seq_len=0, sinks=sinks)
    assert np.all(to_numpy(out) == 0)
    want = np.broadcast_to(to_numpy(sinks)[None, :, None], lse.shape)
    rtol = NO_KEY_LSE_RTOL["cpu" if xp is np else "kernels"]
    assert np.all(np.abs(to_numpy(lse) - want) <= rtol * np.abs(want))
    dq, dk, dv, dsinks = cuflash.flash_attention_bwd(
        dout, q, k, v, out, lse, *case.args, kv_seq_len=0, sinks=sinks
    )
    assert np.all(to_numpy(dq) == 0) and np.all(to_numpy(dsinks) == 0)


def test_oracle_dsinks_match_finite_differences(rng):
    """The oracle's dsinks (-sum exp(sink - lse) Delta) is the derivative of
    sum(dout * out) with respect to the sinks, by central differences in float64."""
    case = Case(heads=3, kv_heads=1, q_len=20, kv_len=14, head_dim=16, causal=True)
    q, k, v, dout = (x.astype(np.float64) for x in random_inputs(case, rng))
    sinks = rng.uniform(-1, 2, case.heads)
    _, _, _, dsinks = attention_reference_grad(dout, q, k, v, True, 0, sinks=sinks)
    numeric = finite_difference_dsinks((q, k, v, dout), sinks, causal=True)
    np.testing.assert_allclose(dsinks, numeric, rtol=1e-6, atol=1e-9)
    # and the CPU path's dsinks against both
    f32 = [x.astype(np.float32) for x in (q, k, v, dout)]
    s32 = sinks.astype(np.float32)
    out, lse = cuflash.flash_attention_fwd(*f32[:3], *case.args, sinks=s32)
    got = cuflash.flash_attention_bwd(f32[3], *f32[:3], out, lse, *case.args, sinks=s32)[3]
    assert rel_error(got, numeric) <= 1e-5


@pytest.mark.parametrize("arrays", ARRAYS)
def test_packed_sinks_match_oracle(arrays, rng):
    """Each sequence's rows take the sinks (one of no key: zeros, lse = sinks[h]); dsinks
    sums every sequence's rows."""
    xp = _xp(arrays)
    lengths_q, lengths_k, heads, kv_heads, d, dtype = (
        [9, 0, 30, 4],
        [12, 5, 25, 0],
        4,
        2,
        64,
        "bfloat16",
    )
    q, k, v, dout, cu_q, cu_k = packed_inputs(
        rng, lengths_q, lengths_k, heads, kv_heads, d, dtype, xp
    )
    sinks = random_sinks(rng, heads, xp)
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k), heads, kv_heads, d, True)
    out, vjp = cuflash.flash_attention_varlen_vjp(q, k, v, *args, sinks=sinks)
    dq, dk, dv, dsinks = vjp(dout)
    offsets_q, offsets_k = np.cumsum([0] + lengths_q), np.cumsum([0] + lengths_k)
    host = [to_numpy(x).astype(np.float64) for x in (q, k, v, dout)]
    got = [to_numpy(x).astype(np.float64) for x in (out, dq, dk, dv)]
    lse = to_numpy(vjp.lse)
    want_dsinks = np.zeros(heads)
    for b in range(len(lengths_q)):
        q0, q1, k0, k1 = offsets_q[b], offsets_q[b + 1], offsets_k[b], offsets_k[b + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            assert np.all(got[0][q0:q1] == 0)
            want = np.broadcast_to(to_numpy(sinks)[:, None], (heads, q1 - q0))
            rtol = NO_KEY_LSE_RTOL["cpu" if xp is np else "kernels"]
            assert np.all(np.abs(lse[:, q0:q1] - want) <= rtol * np.abs(want))
            continue

        def dense(x, start, stop):
            return x[start:stop].transpose(1, 0, 2)[None]

        views = (
            dense(host[3], q0, q1),
            dense(host[0], q0, q1),
            dense(host[1], k0, k1),
            dense(host[2], k0, k1),
        )
        ref_out, ref_lse = attention_reference(*views[1:], True, sinks=to_numpy(sinks))
        *ref_grads, ref_dsinks = attention_reference_grad(*views, True, sinks=to_numpy(sinks))
        want_dsinks += ref_dsinks
        for name, x, ref in zip(
            ("out", "dq", "dk", "dv"),
            (got[0][q0:q1], got[1][q0:q1], got[2][k0:k1], got[3][k0:k1]),
            (ref_out, *ref_grads),
        ):
            err = rel_error(dense(x, 0, None), ref)
            assert err <= PACKED_BOUND[dtype] + FLOOR[dtype], (b, name, err)
        assert np.allclose(lse[:, q0:q1], ref_lse[0], atol=1e-4), b
    assert rel_error(dsinks, want_dsinks) <= PACKED_BOUND[dtype] + FLOOR[dtype]


@pytest.mark.parametrize("arrays", ARRAYS)
@pytest.mark.parametrize("split", [False, True], ids=["short", "long"])
def test_kvcache_sinks_match_dense(arrays, split, rng):
    """Decoding with sinks equals the dense call on each sequence's keys, an empty cache
    included (its row sees no key: zeros, lse = sinks[h]); a long cache splits its keys
    on the GPU and the combine adds the sinks once."""
    xp = _xp(arrays)
    b, h, hk, d, capacity = 3, 4, 2, 64, 2048 if split else 64
    dt = DTYPES["bfloat16"]
    k_cache, v_cache = (rng.standard_normal((b, hk, capacity, d)).astype(dt) for _ in "kv")
    q = rng.standard_normal((b, h, 1, d)).astype(dt)
    lengths = np.array([0, capacity, capacity // 3], np.int32)
    sinks = random_sinks(rng, h)
    out, lse = cuflash.flash_attention_with_kvcache(
        *(xp.asarray(x) for x in (q, k_cache, v_cache)),
        h,
        hk,
        d,
        cache_seqlens=xp.asarray(lengths),
        return_lse=True,
        sinks=xp.asarray(sinks),
    )
    out, lse = to_numpy(out).astype(np.float64), to_numpy(lse)
    assert np.all(out[0] == 0)
    rtol = NO_KEY_LSE_RTOL["cpu" if xp is np else "kernels"]
    assert np.all(np.abs(lse[0, :, 0] - sinks) <= rtol * np.abs(sinks))
    for i in (1, 2):
        n = int(lengths[i])
        ref_out, ref_lse = attention_reference(
            q[i : i + 1].astype(np.float64),
            k_cache[i : i + 1, :, :n].astype(np.float64),
            v_cache[i : i + 1, :, :n].astype(np.float64),
            True,
            sinks=sinks,
        )
        assert rel_error(out[i : i + 1], ref_out) <= 1e-2
        assert np.allclose(lse[i], ref_lse[0], atol=1e-4)


@pytest.mark.parametrize("layout", dist.LAYOUTS)
@pytest.mark.parametrize("size", [1, 3])
def test_ring_sinks_match_oracle(size, layout, rng):
    """The ring adds the sinks once after its merge, and sums dsinks over the ranks in
    rank order: every rank holds the whole sequence's dsinks, the same bits."""
    heads, kv_heads, d, causal, window = 4, 2, 16, True, (9, 2)
    length = dist.chunk_count(layout, size) * 6
    full = [
        rng.standard_normal((1, n, length, d)).astype(np.float32)
        for n in (heads, kv_heads, kv_heads, heads)
    ]
    sinks = random_sinks(rng, heads)
    per_rank = [tuple(dist.shard(x, layout, r, size) for x in full) for r in range(size)]

    def rank(group, q, k, v, dout):
        out, vjp = dist.ring_attention_vjp(
            q, k, v, heads, kv_heads, d, causal, window, group=group, layout=layout, sinks=sinks
        )
        return (out, vjp.lse, *vjp(dout))

    results = dist.ThreadGroup(size).run(rank, per_rank)
    gathered = [dist.gather([r[i] for r in results], layout) for i in range(5)]
    check_sink_results(full, (*gathered, results[0][5]), sinks, "float32", causal, window)
    for r in results[1:]:
        assert np.array_equal(r[5], results[0][5])


@pytest.mark.skipif(simulator.compiler() is None, reason="the simulator needs a C++ compiler")
@pytest.mark.parametrize("shape, head_axis", [((3, 5, 700), 1), ((6, 1300), 0)], ids=str)
def test_gpu_gradient_kernel_in_the_simulator(shape, head_axis, rng):
    """The registry's ``sinks_gradient`` (the GPU backward's dsinks) in the CPU simulator
    against the NumPy reduction, with rows whose lse is -inf (they add nothing), one NaN
    row in the last head (its dsinks NaN, the others not), rows that span several of the
    kernel's strides, and dsinks poisoned before the launch."""
    heads = shape[head_axis]
    sinks = random_sinks(rng, heads)
    lse = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
    delta = rng.standard_normal(shape).astype(np.float32)
    lse.flat[rng.choice(lse.size, lse.size // 10, replace=False)] = -np.inf
    expected = cuflash.sinks.gradient(np, sinks, lse, delta, head_axis)
    nan_lse = lse.copy()
    np.moveaxis(nan_lse, head_axis, 0)[-1].flat[3] = np.nan
    name = cuflash.gpu.standalone.STANDALONE["sinks_gradient"].name_expression()
    module = simulator.build([name], headers=("simt/sinks_gradient.cu",))
    outer, inner = int(np.prod(shape[:head_axis])), int(np.prod(shape[head_axis + 1 :]))
    for lse_in, check_nan in ((lse, False), (nan_lse, True)):
        dsinks = np.full(heads, np.nan, np.float32)
        args = (sinks, lse_in, delta, dsinks, np.int32(outer), np.int32(heads), np.int32(inner))
        module.launch(name, (heads,), 512, 0, args, guard=True)
        if check_nan:
            assert np.isnan(dsinks[-1]) and not np.isnan(dsinks[:-1]).any()
            assert rel_error(dsinks[:-1], expected[:-1]) < 1e-5
        else:
            assert rel_error(dsinks, expected) < 1e-5, (dsinks, expected)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_gradient_kernel_compiles_without_spills(arch):
    compile_and_check([cuflash.gpu.standalone.STANDALONE["sinks_gradient"].name_expression()], arch)
