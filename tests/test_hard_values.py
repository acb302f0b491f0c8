"""Hard values: NaN and Inf inputs, extreme score magnitudes, float16 near its range.

Each test runs on the CPU path (in CI) and on both GPU kernel paths. The
documented behaviour (Semantics page, "Non-finite and extreme values"):

* every output that the formula makes depend on a non-finite input is
  non-finite: a NaN is never turned into a finite value;
* it reaches nothing outside its (batch, head) — for keys and values, the
  query heads of their KV head — so every other output is bitwise what it is
  without the NaN;
* keys at or past ``kv_seq_len`` are never read.
"""

import math

import numpy as np
import pytest
from support import Case, cupy, oracle, random_inputs, run_and_check, to_numpy

import cuflash
from cuflash.reference import _mask

BACKENDS = [
    "cpu",
    pytest.param("auto", marks=pytest.mark.gpu),
    pytest.param("general", marks=pytest.mark.gpu),
]


def _backend_arrays(backend, arrays):
    return arrays if backend == "cpu" else [cupy.asarray(a) for a in arrays]


def _run(backend, case, q, k, v, dout):
    """Forward and deterministic backward on ``backend``; NumPy results."""
    arrays = _backend_arrays(backend, [q, k, v, dout])
    kw = dict(kv_seq_len=case.kv_seq_len, softmax_scale=case.scale)
    path = "auto" if backend == "cpu" else backend
    with cuflash.kernel_path(path):
        out, lse = cuflash.flash_attention_fwd(*arrays[:3], *case.args, **kw)
        grads = cuflash.flash_attention_bwd(
            arrays[3], *arrays[:3], out, lse, *case.args, **kw, deterministic=True
        )
    return {
        name: to_numpy(a) for name, a in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads))
    }


CASES = [
    Case(
        dtype="float32", batch=2, heads=4, kv_heads=2, q_len=70, kv_len=90, head_dim=64, causal=True
    ),
    Case(
        dtype="bfloat16",
        batch=2,
        heads=4,
        kv_heads=2,
        q_len=80,
        kv_len=80,
        head_dim=128,
        window=(9, 4),
    ),
    Case(
        dtype="float16",
        batch=1,
        heads=2,
        kv_heads=1,
        q_len=33,
        kv_len=140,
        head_dim=64,
        kv_seq_len=100,
    ),
]


def _reach(case, tensor, b, head, pos):
    """Masks of the outputs a non-finite ``tensor[b, head, pos, d]`` must reach.

    Returns (must, contained): ``must[name]`` marks elements (row-wise, the
    last axis dropped) the formula makes non-finite; ``contained[name]`` marks
    the rows of the heads the value may spread to. Everything outside
    ``contained`` must be bitwise unchanged.
    """
    group = case.heads // case.kv_heads
    kv_len = case.kv_len if case.kv_seq_len is None else case.kv_seq_len
    vis = _mask(case.q_len, case.kv_len, kv_len, case.causal, case.window)  # [S_q, S_k]
    q_shape, kv_shape = (
        (case.batch, case.heads, case.q_len),
        (case.batch, case.kv_heads, case.kv_len),
    )
    must = {
        n: np.zeros(q_shape if n in ("out", "lse", "dq") else kv_shape, bool)
        for n in ("out", "lse", "dq", "dk", "dv")
    }
    contained = {n: np.zeros_like(m) for n, m in must.items()}
    if tensor in ("q", "dout"):
        kv_head = head // group
        for n in ("out", "lse", "dq"):
            contained[n][b, head] = True
        for n in ("dk", "dv"):
            contained[n][b, kv_head] = True
        seen = vis[pos]
        if seen.any():
            if tensor == "q":
                must["out"][b, head, pos] = must["lse"][b, head, pos] = True
            must["dq"][b, head, pos] = True
            must["dk"][b, kv_head, seen] = must["dv"][b, kv_head, seen] = True
    else:  # k or v of KV head `head`
        heads = slice(head * group, (head + 1) * group)
        for n in ("out", "lse", "dq"):
            contained[n][b, heads] = True
        for n in ("dk", "dv"):
            contained[n][b, head] = True
        rows = vis[:, pos]
        must["out"][b, heads, rows] = must["dq"][b, heads, rows] = True
        if tensor == "k":
            must["lse"][b, heads, rows] = True
        if rows.any():
            must["dk"][b, head, pos] = True
            if tensor == "k":
                must["dv"][b, head, pos] = True
    return must, contained


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("tensor", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_input_reaches_what_it_should(backend, case, tensor, bad, rng):
    q, k, v, dout = (np.ascontiguousarray(a) for a in random_inputs(case, rng))
    clean = _run(backend, case, q, k, v, dout)
    for name, value in clean.items():
        finite = np.isfinite(value) | (name == "lse") & np.isneginf(value)
        assert finite.all(), f"clean run: {name} not finite"
    arrays = dict(q=q, k=k, v=v, dout=dout)
    target = arrays[tensor]
    kv_len = case.kv_len if case.kv_seq_len is None else case.kv_seq_len
    heads = case.heads if tensor in ("q", "dout") else case.kv_heads
    length = case.q_len if tensor in ("q", "dout") else kv_len
    b, head, pos, d = (int(rng.integers(n)) for n in (case.batch, heads, length, case.head_dim))
    if bad == math.inf and tensor in ("q", "k"):
        # An infinite q or k element makes scores of both signs, and a -inf
        # score is a hidden key (the row stays finite). Make the partner column
        # positive so every score it touches is +inf: those rows must be NaN.
        group = case.heads // case.kv_heads
        partner, heads = (
            (k, head // group) if tensor == "q" else (q, slice(head * group, (head + 1) * group))
        )
        column = np.abs(partner[b, heads, :, d].astype(np.float32)) + 1
        partner[b, heads, :, d] = column.astype(partner.dtype)
        if case.scale is not None and case.scale < 0:
            bad = -bad
        clean = _run(backend, case, q, k, v, dout)
    target[b, head, pos, d] = bad
    got = _run(backend, case, q, k, v, dout)
    must, contained = _reach(case, tensor, b, head, pos)
    for name, value in got.items():
        rows = value if name == "lse" else np.isfinite(value).all(axis=-1)
        finite = np.isfinite(rows) if name == "lse" else rows
        if name == "lse":
            finite = finite | (np.isneginf(value) & np.isneginf(clean[name]))
        hidden = must[name] & finite
        assert not hidden.any(), f"{name}: {int(hidden.sum())} rows should be non-finite"
        same = np.equal(value, clean[name]) | np.isnan(value) & np.isnan(clean[name])
        same = same if name == "lse" else same.all(axis=-1)
        leaked = ~contained[name] & ~same
        assert not leaked.any(), f"{name}: {int(leaked.sum())} rows changed outside the head"


@pytest.mark.parametrize("backend", BACKENDS)
def test_keys_past_kv_seq_len_are_never_read(backend, rng):
    case = Case(
        dtype="bfloat16", heads=4, kv_heads=2, q_len=20, kv_len=300, kv_seq_len=130, causal=True
    )
    q, k, v, dout = (np.ascontiguousarray(a) for a in random_inputs(case, rng))
    clean = _run(backend, case, q, k, v, dout)
    k[:, :, case.kv_seq_len :] = np.nan
    v[:, :, case.kv_seq_len :] = np.inf
    got = _run(backend, case, q, k, v, dout)
    for name in clean:
        assert np.array_equal(got[name], clean[name]), name
    assert np.all(got["dk"][:, :, case.kv_seq_len :] == 0)


def _backend_check(backend, case, rng, scale_inputs):
    """``run_and_check`` with inputs transformed by ``scale_inputs``."""
    xp = np if backend == "cpu" else cupy

    class Scaled:  # a generator whose normals are transformed
        def standard_normal(self, shape):
            return scale_inputs(rng.standard_normal(shape), shape)

    with cuflash.kernel_path("auto" if backend == "cpu" else backend):
        return run_and_check(case, xp, Scaled())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1e4, -300.0, 1e-6, 1e-30])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_extreme_score_magnitudes(backend, scale, dtype, rng):
    """Softmax scales from nearly one-hot (1e4) to nearly uniform (1e-30)."""
    case = Case(dtype=dtype, heads=2, kv_heads=2, q_len=50, kv_len=75, causal=True, scale=scale)
    out, lse, grads = _backend_check(backend, case, rng, lambda x, shape: x)
    assert np.all(np.isfinite(to_numpy(lse)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_near_its_range(backend, rng):
    """V up to 60000 (float16 tops out at 65504) and scores near 1e4 stay finite."""
    case = Case(
        dtype="float16", heads=2, kv_heads=1, q_len=40, kv_len=60, head_dim=64, window=(20, 20)
    )
    calls = []

    def scale_inputs(x, shape):
        calls.append(shape)
        which = len(calls)  # q, k, v, dout in random_inputs' order
        if which in (1, 2):  # scores scale * q.k reach about 1e4
            return x * 40.0
        if which == 3:
            return np.clip(x * 20000.0, -60000.0, 60000.0)
        return x * 1e-3  # keeps dv and the products dO.V inside float16

    out, lse, grads = _backend_check(backend, case, rng, scale_inputs)
    assert np.abs(to_numpy(out)).max() > 10000
    for g in (out, *grads):
        assert np.all(np.isfinite(to_numpy(g)))


def test_oracle_marks_what_the_rule_expects(rng):
    """The reach rule itself, on the float64 oracle: the required rows are NaN there too."""
    case = CASES[0]
    q, k, v, dout = (a.astype(np.float64) for a in random_inputs(case, rng))
    q[1, 3, 50, 7] = np.nan
    out, lse, (dq, dk, dv) = oracle(case, q, k, v, dout)
    must, _ = _reach(case, "q", 1, 3, 50)
    assert np.isnan(out[must["out"]]).all() and np.isnan(dk[must["dk"]]).all()
