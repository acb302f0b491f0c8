"""A value head dim of its own (``head_dim_v``): v, the output, dout and dv ``head_dim_v``
wide, q and k ``head_dim`` wide, on the CPU path and (marked ``gpu``) the GPU path.

Dense and packed calls, forward and backward, against the float64 oracle on fresh random
inputs, with D > D_v and D < D_v, GQA, causal and windows, sinks, the score modifiers,
user modifiers and block masks, the deterministic backward and the vjp objects; the
zero padding of :mod:`cuflash.gpu.value_dims` (the GPU path's) run on the CPU; and one
bad-input test an argument."""

import dataclasses

import numpy as np
import pytest
from sink_checks import random_sinks
from support import (
    DTYPES,
    FLOOR,
    PACKED_BOUND,
    Case,
    check_packed_results,
    check_results,
    cupy,
    packed_inputs,
    random_inputs,
    rel_error,
    run_and_check,
    to_numpy,
)

import cuflash
from cuflash import modifiers
from cuflash.block_mask import create_block_mask
from cuflash.core.problem import backward_problem, forward_problem
from cuflash.cpu import dense as cpu
from cuflash.gpu import value_dims
from cuflash.reference import attention_reference, attention_reference_grad

ARRAYS = [pytest.param("numpy", id="cpu"), pytest.param("cupy", id="gpu", marks=pytest.mark.gpu)]

DENSE = [
    # D > D_v with GQA, causal rows past the keys (they see none)
    Case(heads=4, kv_heads=2, q_len=70, kv_len=45, head_dim=64, head_dim_v=32, causal=True),
    # D < D_v with a two-sided window
    Case(q_len=50, kv_len=90, head_dim=32, head_dim_v=64, window=(20, 3)),
    # the MLA training shape's head dims, MQA
    Case(dtype="bfloat16", heads=4, kv_heads=1, q_len=77, kv_len=77, head_dim=192, head_dim_v=128),
    Case(
        dtype="float16",
        heads=2,
        kv_heads=2,
        q_len=33,
        kv_len=60,
        head_dim=40,
        head_dim_v=256,
        kv_seq_len=17,
        causal=True,
    ),
    Case(dtype="float16", head_dim=128, head_dim_v=8, window=9, bshd=True),
    Case(dtype="bfloat16", q_len=130, kv_len=45, head_dim=256, head_dim_v=64, causal=True),
    Case(heads=4, kv_heads=2, head_dim=24, head_dim_v=56, scale=0.3, window=16, causal=True),
]


def _xp(name, request):
    if name == "numpy":
        return np
    request.getfixturevalue("poisoned")  # every GPU allocation starts as NaN
    return cupy


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", DENSE, ids=str)
@pytest.mark.parametrize("arrays", ARRAYS)
def test_dense_matches_oracle(arrays, case, deterministic, rng, request):
    """out, lse, dq, dk, dv by the tolerance rule; shapes of head_dim_v where they should
    be; with ``deterministic`` the same bits again."""
    xp = _xp(arrays, request)
    out, lse, grads = run_and_check(case, xp, rng, deterministic=deterministic)
    assert out.shape[-1] == case.head_dim_v and out.flags.c_contiguous
    dq, dk, dv = grads
    assert (dq.shape[-1], dk.shape[-1], dv.shape[-1]) == (
        case.head_dim,
        case.head_dim,
        case.head_dim_v,
    )
    assert all(g.flags.c_contiguous for g in grads)
    if deterministic:
        q, k, v, dout = random_inputs(case, np.random.default_rng(1), xp)
        kw = dict(kv_seq_len=case.kv_seq_len, softmax_scale=case.scale, head_dim_v=case.head_dim_v)
        o, o_lse = cuflash.flash_attention_fwd(q, k, v, *case.args, **kw)
        runs = [
            cuflash.flash_attention_bwd(
                dout, q, k, v, o, o_lse, *case.args, **kw, deterministic=True
            )
            for _ in range(2)
        ]
        for a, b in zip(*runs):
            assert np.array_equal(to_numpy(a), to_numpy(b))


@pytest.mark.parametrize("arrays", ARRAYS)
def test_equals_the_call_with_v_padded(arrays, rng, request):
    """D > D_v is the same attention as v padded with zero columns to D: the output's
    first D_v columns and dq, dk (the reference the benchmark times against)."""
    xp = _xp(arrays, request)
    case = Case(dtype="float32", heads=4, kv_heads=2, head_dim=96, head_dim_v=48, causal=True)
    q, k, v, dout = random_inputs(case, rng, xp)
    wide_v, wide_dout = (xp.zeros((*x.shape[:3], 96), x.dtype) for x in (v, dout))
    wide_v[..., :48], wide_dout[..., :48] = v, dout
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args, head_dim_v=48)
    wide_out, wide_lse = cuflash.flash_attention_fwd(q, k, wide_v, *case.args)
    assert np.all(to_numpy(wide_out)[..., 48:] == 0)
    ref = to_numpy(wide_out)[..., :48].astype(np.float64)
    assert rel_error(out, ref) <= 1e-6
    assert np.max(np.abs(to_numpy(lse) - to_numpy(wide_lse))) <= 1e-5
    grads = cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *case.args, head_dim_v=48)
    wide = cuflash.flash_attention_bwd(wide_dout, q, k, wide_v, wide_out, wide_lse, *case.args)
    for got, want in zip(grads, (wide[0], wide[1], to_numpy(wide[2])[..., :48])):
        assert rel_error(got, to_numpy(want).astype(np.float64)) <= 1e-5


def _shift_bias(score, b, h, q_idx, kv_idx):
    return score + 0.125 * ((q_idx + 2 * kv_idx + h) % 5) - 0.25


def _check_modified(inputs, results, dtype, **options):
    """``results`` (out, lse, dq, dk, dv[, dsinks]) of a dense call on ``inputs`` (q, k, v,
    dout) against the oracle with ``options`` (its keywords), within the packed calls'
    bound; NaN never passes."""
    host = [to_numpy(x).astype(np.float64) for x in inputs]
    ref_out, ref_lse = attention_reference(*host[:3], **options)
    ref_grads = attention_reference_grad(host[3], *host[:3], **options)
    bound = PACKED_BOUND[dtype] + FLOOR[dtype]
    names = ("out", "dq", "dk", "dv", "dsinks")
    for name, got, ref in zip(names, (results[0], *results[2:]), (ref_out, *ref_grads)):
        assert got.shape == ref.shape, name
        err = rel_error(got, ref)
        assert err <= bound, (name, err)
    lse = to_numpy(results[1])
    finite = np.isfinite(ref_lse)
    assert np.array_equal(finite, np.isfinite(lse))
    assert np.max(np.abs(lse[finite] - ref_lse[finite])) <= 1e-4 * (1 + np.abs(ref_lse).max())


@pytest.mark.parametrize("widths", [(64, 32), (32, 80)], ids=["narrow-v", "wide-v"])
@pytest.mark.parametrize("arrays", ARRAYS)
def test_sinks_and_score_modifiers(arrays, widths, rng, request):
    """Sinks (dsinks too), soft-cap, per-batch ALiBi and a user score function."""
    xp = _xp(arrays, request)
    d, dv = widths
    case = Case(heads=4, kv_heads=2, q_len=60, kv_len=75, head_dim=d, head_dim_v=dv, causal=True)
    q, k, v, dout = random_inputs(case, rng, xp)
    sinks = random_sinks(rng, case.heads, xp)
    slopes = rng.uniform(0.02, 0.3, (case.batch, case.heads)).astype(np.float32)
    score_mod = modifiers.ScoreMod(_shift_bias)
    kw = dict(softcap=4.0, alibi_slopes=xp.asarray(slopes), sinks=sinks, score_mod=score_mod)
    out, vjp = cuflash.flash_attention_vjp(q, k, v, *case.args, **kw, head_dim_v=dv)
    assert vjp.config.head_dim_v == dv
    grads = vjp(dout)
    assert len(grads) == 4
    options = dict(softcap=4.0, alibi_slopes=slopes, sinks=to_numpy(sinks), score_mod=score_mod)
    _check_modified((q, k, v, dout), (out, vjp.lse, *grads), case.dtype, causal=True, **options)


@pytest.mark.parametrize("widths", [(64, 16), (16, 64)], ids=["narrow-v", "wide-v"])
@pytest.mark.parametrize("arrays", ARRAYS)
def test_block_mask_and_mask_function(arrays, widths, rng, request):
    """A document mask through a block mask, and the same function as a plain mask_mod."""
    xp = _xp(arrays, request)
    d, dv = widths
    case = Case(dtype="bfloat16", heads=2, kv_heads=1, q_len=200, kv_len=200, head_dim=d)
    q, k, v, dout = random_inputs(dataclasses.replace(case, head_dim_v=dv), rng, xp)
    docs = np.repeat(np.arange(4), 50)[None].repeat(case.batch, 0).astype(np.int32)
    mask = modifiers.document_mask(xp.asarray(docs))
    block = create_block_mask(mask, case.batch, None, case.q_len, case.kv_len)
    host_mask = modifiers.document_mask(docs)
    for kw in (dict(block_mask=block), dict(mask_mod=mask)):
        out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args, **kw, head_dim_v=dv)
        grads = cuflash.flash_attention_bwd(
            dout, q, k, v, out, lse, *case.args, **kw, head_dim_v=dv
        )
        _check_modified((q, k, v, dout), (out, lse, *grads), case.dtype, mask_mod=host_mask)


PACKED = [
    ([9, 0, 30, 4], [12, 5, 25, 0], 4, 2, 64, 32, "float32", True, 0),
    ([17, 40, 3], [17, 64, 8], 4, 4, 32, 96, "bfloat16", False, (8, 2)),
    ([5, 33], [70, 33], 2, 1, 192, 128, "float16", True, 0),
]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("packed", PACKED, ids=lambda p: f"{p[4]}-{p[5]}-{p[6]}")
@pytest.mark.parametrize("arrays", ARRAYS)
def test_packed_matches_oracle(arrays, packed, deterministic, rng, request):
    """Each sequence against the oracle (sequences of no row or no key included); the
    vjp passes head_dim_v on."""
    xp = _xp(arrays, request)
    lengths_q, lengths_k, heads, kv_heads, d, dv, dtype, causal, window = packed
    inputs = packed_inputs(rng, lengths_q, lengths_k, heads, kv_heads, d, dtype, xp, dv)
    q, k, v, dout, cu_q, cu_k = inputs
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k), heads, kv_heads, d, causal, window)
    out, vjp = cuflash.flash_attention_varlen_vjp(q, k, v, *args, head_dim_v=dv)
    assert out.shape == (q.shape[0], heads, dv) and vjp.config.head_dim_v == dv
    grads = vjp(dout, deterministic=deterministic)
    check_packed_results(
        (q, k, v, dout), out, vjp.lse, grads, lengths_q, lengths_k, dtype, causal, window
    )
    direct = cuflash.flash_attention_varlen_bwd(
        dout, q, k, v, out, vjp.lse, *args, head_dim_v=dv, deterministic=deterministic
    )
    for a, b in zip(grads, direct):
        if deterministic or xp is np:
            assert np.array_equal(to_numpy(a), to_numpy(b))


@pytest.mark.parametrize("arrays", ARRAYS)
def test_packed_sinks_and_alibi(arrays, rng, request):
    """A packed call with sinks, soft-cap and per-sequence ALiBi: each sequence against the
    oracle; dsinks sums them."""
    xp = _xp(arrays, request)
    lengths_q, lengths_k, heads, kv_heads, d, dv = [12, 30], [20, 30], 4, 2, 48, 24
    q, k, v, dout, cu_q, cu_k = packed_inputs(
        rng, lengths_q, lengths_k, heads, kv_heads, d, "float32", xp, dv
    )
    sinks = random_sinks(rng, heads, xp)
    slopes = rng.uniform(0.02, 0.3, (2, heads)).astype(np.float32)
    kw = dict(sinks=sinks, softcap=3.0, alibi_slopes=xp.asarray(slopes), head_dim_v=dv)
    args = (cu_q, cu_k, 30, 30, heads, kv_heads, d, True)
    out, lse = cuflash.flash_attention_varlen_fwd(q, k, v, *args, **kw)
    dq, dk, dvv, dsinks = cuflash.flash_attention_varlen_bwd(dout, q, k, v, out, lse, *args, **kw)
    offsets_q, offsets_k = np.cumsum([0] + lengths_q), np.cumsum([0] + lengths_k)
    want_dsinks = np.zeros(heads)
    for b in range(2):
        q0, q1, k0, k1 = offsets_q[b], offsets_q[b + 1], offsets_k[b], offsets_k[b + 1]

        def dense(x, start, stop):
            return to_numpy(x)[start:stop].transpose(1, 0, 2)[None]

        rows = [(q0, q1), (k0, k1), (k0, k1), (q0, q1)]
        views = [dense(x, *r) for x, r in zip((q, k, v, dout), rows)]
        results = (
            dense(out, q0, q1),
            to_numpy(lse)[None, :, q0:q1],
            dense(dq, q0, q1),
            dense(dk, k0, k1),
            dense(dvv, k0, k1),
        )
        options = dict(sinks=to_numpy(sinks), softcap=3.0, alibi_slopes=slopes[b])
        _check_modified(views, results, "float32", causal=True, **options)
        host = [x.astype(np.float64) for x in views]
        want_dsinks += attention_reference_grad(host[3], *host[:3], True, **options)[3]
    assert rel_error(dsinks, want_dsinks) <= PACKED_BOUND["float32"] + FLOOR["float32"]


class _HostArrays:
    """NumPy under the names :mod:`cuflash.gpu.value_dims` calls on CuPy: its padding, run on
    the CPU."""

    empty = staticmethod(np.empty)
    ascontiguousarray = staticmethod(np.ascontiguousarray)


@pytest.mark.parametrize("widths", [(64, 24), (24, 64)], ids=["narrow-v", "wide-v"])
def test_padding_is_exact_on_the_cpu(widths, rng, monkeypatch):
    """value_dims' padded plans around the equal-width CPU path: the kernels see zero
    padding columns at one width, and the results are the unpadded call's."""
    monkeypatch.setattr(value_dims, "cupy", _HostArrays)
    d, dv = widths
    case = Case(heads=4, kv_heads=2, q_len=40, kv_len=52, head_dim=d, head_dim_v=dv)
    q, k, v, dout = random_inputs(case, rng)
    config = cuflash.AttentionConfig(*case.args, head_dim_v=dv)
    problem = forward_problem(q, k, v, config)
    seen = []

    def build_forward(wide, *arrays):
        assert wide.head_dim == wide.head_dim_v == max(d, dv)
        assert wide.softmax_scale == problem.softmax_scale  # 1 / sqrt(d), not of the width

        def plan(*arrays):
            seen.append(arrays)
            return cpu.forward(wide, *arrays)

        return plan

    build_forward.takes_value_dims = lambda *arrays: False  # a kernel of one width
    padded = value_dims.forward_plan(build_forward, problem, q, k, v)
    assert isinstance(padded, value_dims.PaddedForward)
    out, lse = padded(q, k, v)
    for given, wide in zip((q, k, v), seen[-1]):
        assert wide.shape[-1] == max(d, dv)
        assert np.array_equal(wide[..., : given.shape[-1]], given)
        assert np.all(wide[..., given.shape[-1] :] == 0)
    want_out, want_lse = cpu.forward(problem, q, k, v)
    assert out.shape == want_out.shape and out.flags.c_contiguous
    assert rel_error(out, want_out.astype(np.float64)) <= 1e-6
    assert np.max(np.abs(lse - want_lse)) <= 1e-5

    bwd = backward_problem(dout, q, k, v, out, lse, config, False, True)

    def build_backward(wide, *arrays):
        def plan(dout, q, k, v, out, lse, synchronize):
            assert synchronize is False  # the padded plan synchronizes after cutting
            return cpu.backward(wide, dout, q, k, v, out, lse)

        return plan

    build_backward.takes_value_dims = lambda *arrays, deterministic: False  # one width
    padded = value_dims.backward_plan(build_backward, bwd, dout, q, k, v, out, None, False)
    grads = padded(dout, q, k, v, out, lse, synchronize=False)
    for got, want in zip(grads, cpu.backward(bwd, dout, q, k, v, out, lse)):
        assert got.shape == want.shape and got.flags.c_contiguous
        assert rel_error(got, want.astype(np.float64)) <= 1e-5


def test_equal_widths_take_the_plain_plan(rng):
    """No padding, and no wrapper, when v has q's head dim (given or not)."""
    case = Case(head_dim=32)
    q, k, v, _ = random_inputs(case, rng)
    for head_dim_v in (None, 32):
        config = cuflash.AttentionConfig(*case.args, head_dim_v=head_dim_v)
        problem = forward_problem(q, k, v, config)
        assert problem.head_dim_v == 32 and not value_dims.pads_values(problem)
        plan = object()
        assert value_dims.forward_plan(lambda *a: plan, problem, q, k, v) is plan


def test_a_kernel_that_takes_value_dims_is_not_padded(rng):
    """A plan whose kernel takes v's head dim gets the arrays as they are; the registry
    says which kernels do (the Hopper forward and backward, its dQ pass and Delta, for v
    narrower than q and k)."""
    case = Case(head_dim=64, head_dim_v=32)
    q, k, v, _ = random_inputs(case, rng)
    problem = forward_problem(q, k, v, cuflash.AttentionConfig(*case.args, head_dim_v=32))

    def build(problem, *arrays):
        return problem, arrays

    build.takes_value_dims = lambda *arrays: True
    built, arrays = value_dims.forward_plan(build, problem, q, k, v)
    assert built is problem and all(a is b for a, b in zip(arrays, (q, k, v)))
    takes = {spec.name for spec in cuflash.gpu.registry.KERNELS if spec.takes_value_dims(64, 32)}
    assert takes == {"forward_wgmma_ws", "backward_wgmma", "backward_dq_wgmma", "backward_delta"}
    assert not cuflash.gpu.registry.BY_NAME["forward_wgmma_ws"].takes_value_dims(32, 64)
    with pytest.raises(ValueError, match="does not take head_dim_v"):
        cuflash.gpu.registry.BY_NAME["forward_wgmma"].name_expression(
            "forward_wgmma", q.dtype, 64, 32
        )


def _arrays(xp, d=64, dv=32):
    rng = np.random.default_rng(7)

    def make(*shape):
        return xp.asarray(rng.standard_normal(shape).astype(np.float32))

    q, k, v = make(2, 4, 16, d), make(2, 2, 16, d), make(2, 2, 16, dv)
    return q, k, v, make(2, 4, 16, dv), make(2, 4, 16), make(2, 4, 16, d)


BAD_DENSE = [
    (dict(), "v: has head_dim 32, head_dim is 64"),
    (dict(head_dim_v=48), "v: has head_dim 32, head_dim_v is 48"),
    (dict(head_dim_v=12), "head_dim_v: unsupported head_dim_v 12: must be a multiple of 8"),
    (dict(head_dim_v=264), "head_dim_v: unsupported head_dim_v 264"),
    (dict(head_dim_v=0), "head_dim_v: must be >= 1, got 0"),
    (dict(head_dim_v=32.0), "head_dim_v: expected an int, got float"),
    (dict(head_dim_v=True), "head_dim_v: expected an int, got bool"),
]


@pytest.mark.parametrize("arrays", ARRAYS)
@pytest.mark.parametrize("kw, message", BAD_DENSE, ids=[m for _, m in BAD_DENSE])
def test_bad_dense_arguments(arrays, kw, message, request):
    xp = _xp(arrays, request)
    q, k, v, dout, lse, _ = _arrays(xp)
    with pytest.raises(cuflash.InvalidArgumentError, match=message):
        cuflash.flash_attention_fwd(q, k, v, 4, 2, 64, **kw)
    with pytest.raises(cuflash.InvalidArgumentError, match=message):
        cuflash.flash_attention_bwd(dout, q, k, v, dout, lse, 4, 2, 64, **kw)
    with pytest.raises(cuflash.InvalidArgumentError, match=message):
        cuflash.flash_attention_vjp(q, k, v, 4, 2, 64, **kw)


@pytest.mark.parametrize("arrays", ARRAYS)
def test_bad_backward_arrays(arrays, request):
    """dout and the output of the wrong width; a backward not told the forward's
    head_dim_v."""
    xp = _xp(arrays, request)
    q, k, v, dout, lse, wide = _arrays(xp)
    out, fwd_lse = cuflash.flash_attention_fwd(q, k, v, 4, 2, 64, head_dim_v=32)
    for name, args in (
        ("dout", (wide, q, k, v, out, fwd_lse)),
        ("output", (dout, q, k, v, wide, fwd_lse)),
    ):
        with pytest.raises(
            cuflash.InvalidArgumentError,
            match=rf"{name}: expected shape \(2, 4, 16, 32\), got \(2, 4, 16, 64\)",
        ):
            cuflash.flash_attention_bwd(*args, 4, 2, 64, head_dim_v=32)
    with pytest.raises(cuflash.InvalidArgumentError, match="v: has head_dim 32, head_dim is 64"):
        cuflash.flash_attention_bwd(dout, q, k, v, out, fwd_lse, 4, 2, 64)


@pytest.mark.parametrize("arrays", ARRAYS)
def test_bad_packed_arguments(arrays, request):
    xp = _xp(arrays, request)
    rng = np.random.default_rng(3)
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, [6, 10], [8, 8], 4, 2, 64, "float32", xp, 32)
    args = (cu_q, cu_k, 10, 8, 4, 2, 64)
    with pytest.raises(cuflash.InvalidArgumentError, match="v: has head_dim 32, expected 64"):
        cuflash.flash_attention_varlen_fwd(q, k, v, *args)
    with pytest.raises(cuflash.InvalidArgumentError, match="v: has head_dim 32, expected 48"):
        cuflash.flash_attention_varlen_fwd(q, k, v, *args, head_dim_v=48)
    with pytest.raises(cuflash.InvalidArgumentError, match="head_dim_v: unsupported"):
        cuflash.flash_attention_varlen_fwd(q, k, v, *args, head_dim_v=20)
    out, lse = cuflash.flash_attention_varlen_fwd(q, k, v, *args, head_dim_v=32)
    for name, bad in (("dout", (q, out)), ("out", (dout, q))):
        with pytest.raises(
            cuflash.InvalidArgumentError, match=f"{name}: has head_dim 64, expected 32"
        ):
            cuflash.flash_attention_varlen_bwd(bad[0], q, k, v, bad[1], lse, *args, head_dim_v=32)


def test_dtype_of_results(rng):
    """The outputs keep the input dtype at both widths (bfloat16 through the CPU path)."""
    case = Case(dtype="bfloat16", q_len=20, kv_len=20, head_dim=16, head_dim_v=40)
    q, k, v, dout = random_inputs(case, rng)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args, head_dim_v=40)
    grads = cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *case.args, head_dim_v=40)
    assert out.dtype == DTYPES["bfloat16"] and all(g.dtype == out.dtype for g in grads)


# ---- the native forward (forward_wgmma_ws, v narrower than q and k) in the simulator

SIMULATED = [
    # the MLA training head dims: 64-key tiles, two stages (the rings wrap), two query
    # tiles, GQA, causal rows past the keys
    (
        Case(dtype="bfloat16", batch=1, heads=2, kv_heads=1, q_len=150, kv_len=140),
        192,
        128,
        dict(causal=True),
    ),
    # 128-key tiles, three stages, a window and kv_seq_len; D_v = 16 j + 8
    (
        Case(dtype="float16", batch=1, heads=1, kv_heads=1, q_len=70, kv_len=420),
        128,
        72,
        dict(window_size=(90, 20), kv_seq_len=401),
    ),
    # the modified role: sinks, soft-cap and ALiBi; D_v in the 64 class below D's 256
    (
        Case(dtype="bfloat16", batch=2, heads=2, kv_heads=2, q_len=40, kv_len=100),
        256,
        40,
        dict(causal=True, softcap=5.0),
    ),
]


def _simulator():
    simulator = pytest.importorskip("simulator")
    if simulator.compiler() is None:
        pytest.skip("the simulator needs a host C++ compiler (g++ or CXX)")
    return pytest.importorskip("simulated_attention")


@pytest.mark.parametrize(
    "case, d, dv, options", SIMULATED, ids=lambda x: str(x) if isinstance(x, int) else None
)
def test_native_forward_in_the_simulator(case, d, dv, options, rng):
    """forward_wgmma_ws instantiated with DV < D (the registry's choice on an H100/H200)
    against the oracle, NaN-poisoned outputs; the modified role with sinks and ALiBi."""
    simulated = _simulator()
    case = dataclasses.replace(case, head_dim=d, head_dim_v=dv)
    spec = cuflash.gpu.registry.choose(
        "forward", DTYPES[case.dtype], d, 90, modified="softcap" in options
    )
    assert spec.name == "forward_wgmma_ws" and spec.takes_value_dims(d, dv)
    q, k, v, _ = random_inputs(case, rng)
    extra = {}
    if "softcap" in options:
        extra = dict(
            sinks=random_sinks(rng, case.heads),
            alibi_slopes=rng.uniform(0.02, 0.3, case.heads).astype(np.float32),
        )
    out, lse = simulated.forward(
        q, k, v, *case.args[:3], **options, **extra, capability=90, head_dim_v=dv
    )
    assert out.shape == (case.batch, case.heads, case.q_len, dv)
    oracle_options = dict(options)
    if "window_size" in oracle_options:
        oracle_options["window"] = oracle_options.pop("window_size")
    host = [x.astype(np.float64) for x in (q, k, v)]
    ref_out, ref_lse = attention_reference(*host, **oracle_options, **extra)
    assert rel_error(out, ref_out) <= PACKED_BOUND[case.dtype] + FLOOR[case.dtype]
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.max(np.abs(lse[finite] - ref_lse[finite])) <= 1e-4 * (1 + np.abs(ref_lse).max())


def test_native_packed_forward_in_the_simulator(rng):
    """A packed batch on the native forward: each sequence against the oracle, a sequence
    of no key zeros, rows outside every sequence zeroed at D_v columns."""
    simulated = _simulator()
    lengths_q, lengths_k, heads, kv_heads, d, dv = [30, 0, 90, 12], [50, 7, 90, 0], 2, 1, 96, 32
    q, k, v, dout, cu_q, cu_k = packed_inputs(
        rng, lengths_q, lengths_k, heads, kv_heads, d, "bfloat16", np, dv
    )
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k), heads, kv_heads, d, True)
    out, lse = simulated.varlen_forward(q, k, v, *args, capability=90, head_dim_v=dv)
    assert out.shape == (q.shape[0], heads, dv)
    # the CPU path's gradients, so that check_packed_results sees a whole call
    _, vjp = cuflash.flash_attention_varlen_vjp(q, k, v, *args, head_dim_v=dv)
    check_packed_results(
        (q, k, v, dout), out, lse, vjp(dout), lengths_q, lengths_k, "bfloat16", True
    )


@pytest.mark.gpu
def test_gpu_native_forward_matches_the_padded_one(rng, poisoned):
    """On an H100/H200 the MLA shape's forward runs natively (no padding); skipping that
    kernel pads instead: both against the oracle, and the same lse."""
    from cuflash import dispatch
    from cuflash.gpu import launch as gpu

    case = Case(
        dtype="bfloat16",
        heads=4,
        kv_heads=2,
        q_len=300,
        kv_len=300,
        head_dim=192,
        head_dim_v=128,
        causal=True,
    )
    q, k, v, _ = random_inputs(case, rng, cupy)
    problem = forward_problem(q, k, v, cuflash.AttentionConfig(*case.args, head_dim_v=128))
    hopper = gpu.device_capability()[1] == 90
    assert gpu.ForwardPlan.takes_value_dims(problem, q, k, v) == hopper
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args, head_dim_v=128)
    with dispatch.skip_kernels("forward_wgmma_ws"):
        assert not gpu.ForwardPlan.takes_value_dims(problem, q, k, v)
        padded_out, padded_lse = cuflash.flash_attention_fwd(q, k, v, *case.args, head_dim_v=128)
    host = [to_numpy(x).astype(np.float64) for x in (q, k, v)]
    ref_out, ref_lse = attention_reference(*host, True)
    bound = PACKED_BOUND["bfloat16"] + FLOOR["bfloat16"]
    for got in (out, padded_out):
        assert got.shape == (2, 4, 300, 128) and rel_error(got, ref_out) <= bound
    assert np.max(np.abs(to_numpy(lse) - to_numpy(padded_lse))) <= 1e-3


@pytest.mark.gpu
def test_gpu_cached_plans_still_check_head_dim_v(poisoned):
    """head_dim_v is part of a plan's signature: a call that drops it after one that gave
    it is still refused, forward and backward."""
    q, k, v, dout, lse, _ = _arrays(cupy)
    out, lse = cuflash.flash_attention_fwd(q, k, v, 4, 2, 64, head_dim_v=32)
    cuflash.flash_attention_bwd(dout, q, k, v, out, lse, 4, 2, 64, head_dim_v=32)
    message = "v: has head_dim 32, head_dim is 64"
    with pytest.raises(cuflash.InvalidArgumentError, match=message):
        cuflash.flash_attention_fwd(q, k, v, 4, 2, 64)
    with pytest.raises(cuflash.InvalidArgumentError, match=message):
        cuflash.flash_attention_bwd(dout, q, k, v, out, lse, 4, 2, 64)


# ---- the native backward (backward_wgmma and its dQ pass, v narrower than q and k) in
# the simulator

SIMULATED_BACKWARD = [
    # the MLA training head dims: the 256 class's warpgroups split dV's 128 columns and
    # dK's 192 (64 + 128 and 64 + 64, a copy of the loop each), the dQ pass's dP over
    # 128 columns; GQA, causal rows past the keys
    (Case(dtype="bfloat16", batch=1, heads=2, kv_heads=1, q_len=150, kv_len=140), 192, 128, {}),
    # the 128 class (the warp-specialized backward does not take D_v: the next kernel
    # does), a window and kv_seq_len, D_v = 16 j + 8
    (
        Case(dtype="float16", batch=1, heads=2, kv_heads=2, q_len=70, kv_len=150),
        128,
        40,
        dict(window=(60, 8), kv_seq_len=141),
    ),
    # the 64 class; an uneven split of the 256 class (dV's 144 columns as 64 + 80, dK's
    # 256 as 128 + 128)
    (Case(dtype="bfloat16", batch=2, heads=1, kv_heads=1, q_len=60, kv_len=60), 64, 32, {}),
    (Case(dtype="float16", batch=1, heads=1, kv_heads=1, q_len=50, kv_len=90), 256, 136, {}),
]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(
    "case, d, dv, options",
    SIMULATED_BACKWARD,
    ids=lambda x: str(x) if isinstance(x, int) else None,
)
def test_native_backward_in_the_simulator(case, d, dv, options, deterministic, rng):
    """backward_wgmma and backward_dq_wgmma instantiated with DV < D (on an H100/H200 the
    registry's choice where the warp-specialized backward does not take DV, and the
    kernel of score modifiers), their Delta at DV columns, against the oracle by
    the GPU tests' rule, atomic and deterministic dQ (the forward's out and lse from the
    CPU path). The warp-specialized backward's 256 class with DV: the simulator's tests."""
    simulated = _simulator()
    case = dataclasses.replace(case, head_dim=d, head_dim_v=dv, **options)
    skipped = ("backward_wgmma_ws",)
    spec = cuflash.gpu.registry.choose(
        "backward", DTYPES[case.dtype], d, 90, head_dim_v=dv, excluded=frozenset(skipped)
    )
    assert spec.name == "backward_wgmma" and spec.takes_value_dims(d, dv)
    q, k, v, dout = random_inputs(case, rng)
    kw = dict(kv_seq_len=case.kv_seq_len, softmax_scale=case.scale, head_dim_v=dv)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args, **kw)  # the CPU path's
    grads = simulated.backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        *case.args,
        **kw,
        deterministic=deterministic,
        capability=90,
        excluded=skipped,
    )
    assert grads[2].shape == v.shape
    check_results(case, (q, k, v, dout), out, lse, grads)


def test_backward_takes_the_narrower_v_where_its_kernels_do():
    """On an H100/H200 the 16-bit backward of a narrower v runs natively: in the 256 class
    on the warp-specialized backward where its consumers can split dV's, dK's and dQ's
    columns, else on backward_wgmma (and its dQ pass) where its warpgroups can split dV's
    and dK's (64 of v's or fewer cannot); a wider v is padded."""
    bf16 = DTYPES["bfloat16"]
    ws = cuflash.gpu.registry.choose("backward", bf16, 192, 90, head_dim_v=128)
    assert ws.name == "backward_wgmma_ws" and ws.dq_pass().takes_value_dims(192, 128)
    assert ws.takes_value_dims(256, 136) and not ws.takes_value_dims(256, 64)
    assert not ws.takes_value_dims(128, 64)
    spec = cuflash.gpu.registry.choose(
        "backward", bf16, 192, 90, head_dim_v=128, excluded=frozenset({"backward_wgmma_ws"})
    )
    assert spec.name == "backward_wgmma" and spec.dq_pass().takes_value_dims(192, 128)
    assert cuflash.gpu.registry.choose("backward", bf16, 128, 90).name == "backward_wgmma_ws"
    assert cuflash.gpu.registry.choose("backward", bf16, 128, 90, head_dim_v=64).name == (
        "backward_wgmma"
    )
    assert not spec.takes_value_dims(192, 64) and not spec.takes_value_dims(128, 192)
    assert spec.takes_value_dims(128, 64)


@pytest.mark.parametrize("d, dv", [(192, 128), (128, 64)])
def test_native_modified_backward_in_the_simulator(d, dv, rng):
    """The modified roles of the native backward (soft-cap and ALiBi, their derivative in
    dS) with v narrower than q and k, atomic and deterministic, against the oracle."""
    simulated = _simulator()
    case = Case(dtype="bfloat16", heads=2, kv_heads=1, q_len=90, kv_len=100, causal=True)
    case = dataclasses.replace(case, head_dim=d, head_dim_v=dv)
    q, k, v, dout = random_inputs(case, rng)
    slopes = rng.uniform(0.02, 0.3, 2).astype(np.float32)
    kw = dict(softcap=5.0, alibi_slopes=slopes, head_dim_v=dv)
    out, lse = cuflash.flash_attention_fwd(q, k, v, 2, 1, d, True, **kw)  # the CPU path's
    host = [x.astype(np.float64) for x in (dout, q, k, v)]
    ref = attention_reference_grad(*host, causal=True, softcap=5.0, alibi_slopes=slopes)
    for deterministic in (False, True):
        grads = simulated.backward(
            dout, q, k, v, out, lse, 2, 1, d, True, deterministic=deterministic, capability=90, **kw
        )
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
            assert got.shape == want.shape, name
            assert rel_error(got, want) <= PACKED_BOUND["bfloat16"] + FLOOR["bfloat16"], name
