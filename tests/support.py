"""Shared test machinery: cases, random inputs, the tolerance rule, GPU poisoning."""

import dataclasses
import math

import numpy as np

import cuflash
from cuflash.core.problem import BFLOAT16
from cuflash.reference import _mask, _modified_scores, attention_reference, attention_reference_grad

try:
    import cupy

    HAS_GPU = cupy.is_available()
except ImportError:  # pragma: no cover
    cupy = None
    HAS_GPU = False

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BFLOAT16}
# Below the floor a difference is rounding of the last bits, whatever the dtype.
FLOOR = {"float32": 1e-5, "float16": 2e-4, "bfloat16": 2e-3}
# Scores are accumulated in float32 and the backward recomputes them in another
# summation order than the forward (and against a float32 lse), so a score of
# magnitude |s| is only known to about |s| 2^-24 on every path; the softmax
# passes that on as a relative error. The floor grows by this many such units
# of the largest score (measured on the CPU path: up to 17 for D = 248, |s| = 119).
SCORE_ULPS = 32


# The relative error the FP8 page states for the FP8 kernel (P rounded to e4m3 before
# P V) against the float64 oracle on the dequantized inputs, unit-normal true values.
FP8_KERNEL_TOLERANCE = 0.05
# The FP8 cache's decode kernel (the FP8 page): exact products of the widened e4m3 values,
# P rounded to float16 for P V: about 2^-12 of relative error.
FP8_DECODE_TOLERANCE = 1e-3


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention configuration."""

    dtype: str = "float32"
    batch: int = 2
    heads: int = 4
    kv_heads: int = 4
    q_len: int = 67
    kv_len: int = 67  # capacity S_k
    head_dim: int = 64
    head_dim_v: object = None  # v's head dim (head_dim_v of the API; None: head_dim)
    causal: bool = False
    window: object = 0
    kv_seq_len: object = None
    bshd: bool = False  # pass [B, S, H, D] buffers viewed as [B, H, S, D]
    scale: object = None

    def __str__(self):
        fields = dataclasses.asdict(self)
        default = dataclasses.asdict(Case())
        return "-".join(
            f"{k}={v}" for k, v in fields.items() if v != default[k] or k in ("dtype", "head_dim")
        )

    @property
    def args(self):
        return (self.heads, self.kv_heads, self.head_dim, self.causal, self.window)

    @property
    def value_dim(self):
        """The last dimension of v, the output, dout and dv."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v


def random_inputs(case, rng, xp=np):
    """Fresh q, k, v, dout of the case's dtype (v and dout of its ``value_dim``)."""

    def make(heads, length, width=case.head_dim):
        shape = (
            (case.batch, length, heads, width) if case.bshd else (case.batch, heads, length, width)
        )
        x = rng.standard_normal(shape).astype(DTYPES[case.dtype])
        x = xp.asarray(x)
        return x.transpose(0, 2, 1, 3) if case.bshd else x

    q = make(case.heads, case.q_len)
    k = make(case.kv_heads, case.kv_len)
    v = make(case.kv_heads, case.kv_len, case.value_dim)
    dout = make(case.heads, case.q_len, case.value_dim)
    return q, k, v, dout


def to_numpy(x):
    return cupy.asnumpy(x) if cupy is not None and isinstance(x, cupy.ndarray) else np.asarray(x)


def rel_error(x, ref):
    """``||x - ref|| / ||ref||`` in float64; NaN or inf never passes.

    Where the reference is smaller than an RMS of 0.1 (the inputs are unit
    normal; e.g. gradients that vanish exactly with a one-key window), the
    error is taken relative to that RMS instead.
    """
    x = to_numpy(x).astype(np.float64)
    if not np.all(np.isfinite(x)):
        return math.inf
    scale = max(np.linalg.norm(ref), 0.1 * math.sqrt(max(ref.size, 1)))
    return float(np.linalg.norm(x - ref) / scale)


def _round_in_dtype(x, dtype):
    return x.astype(dtype).astype(np.float32)


def round_to_tf32(x):
    """float32 values rounded to TF32 (10 stored mantissa bits), to nearest."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def naive_in_dtype(case, q, k, v, dout, tf32=False, softcap=0.0, alibi_slopes=None):
    """Attention and its gradients computed plainly with every product rounded to the dtype.

    With ``tf32`` (float32 cases with ``allow_tf32``), every matrix-product
    operand and result is rounded to TF32 instead. ``softcap`` and
    ``alibi_slopes`` (the semantics page, section 'Score modifiers') modify the
    float32 scores before they are rounded, and their derivative enters dS.

    The backward uses the standard formulation (P recomputed from the
    log-sum-exp, dS = P (dP - rowsum(dO O))), so it carries the same
    cancellation where a gradient vanishes exactly (one visible key). The
    error of this against the float64 oracle is the yardstick of the
    tolerance rule (FlashAttention's: at most twice this error, plus a floor).
    """
    dt = DTYPES[case.dtype]
    q, k, v, dout = (to_numpy(a).astype(np.float32) for a in (q, k, v, dout))
    if tf32:
        q, k, v, dout = (round_to_tf32(a) for a in (q, k, v, dout))

    def _round(x, dt):
        return round_to_tf32(x) if tf32 else _round_in_dtype(x, dt)

    group = case.heads // case.kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = 1 / math.sqrt(case.head_dim) if case.scale is None else case.scale
    kv_len = case.kv_len if case.kv_seq_len is None else case.kv_seq_len
    visible = _mask(case.q_len, case.kv_len, kv_len, case.causal, case.window)
    s = q @ np.swapaxes(k, -1, -2) * np.float32(scale)
    derivative = np.float32(1)
    if softcap or alibi_slopes is not None:
        s, derivative = (
            x.astype(np.float32)
            for x in _modified_scores(s, case.q_len, kv_len, softcap, alibi_slopes)
        )
    s = _round(s, dt)
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    tot = e.sum(axis=-1, keepdims=True)
    p = _round(np.where(tot > 0, e / np.where(tot > 0, tot, 1), 0), dt)
    out = _round(p @ v, dt)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        lse = np.where(tot > 0, m + np.log(tot), np.inf)
        p = _round(np.where(visible, np.exp(s - lse), 0), dt)
    dv = _round(np.swapaxes(p, -1, -2) @ dout, dt)
    dp = _round(dout @ np.swapaxes(v, -1, -2), dt)
    ds = _round(p * (dp - (dout * out).sum(axis=-1, keepdims=True)) * derivative, dt)
    dq = _round(ds @ k * np.float32(scale), dt)
    dk = _round(np.swapaxes(ds, -1, -2) @ q * np.float32(scale), dt)
    fold = (case.batch, case.kv_heads, group, case.kv_len)
    return out, (
        dq,
        _round(dk.reshape(*fold, case.head_dim).sum(axis=2), dt),
        _round(dv.reshape(*fold, case.value_dim).sum(axis=2), dt),
    )


def oracle(case, q, k, v, dout, out=None, lse=None):
    """Float64 out, lse and gradients (Delta taken from ``out``, P from ``lse``, if given)."""
    args = (case.causal, case.window, case.kv_seq_len, case.scale)
    q, k, v, dout = (to_numpy(a).astype(np.float64) for a in (q, k, v, dout))
    ref_out, ref_lse = attention_reference(q, k, v, *args)
    given_out, given_lse = (
        None if a is None else to_numpy(a).astype(np.float64) for a in (out, lse)
    )
    grads = attention_reference_grad(dout, q, k, v, *args, out=given_out, lse=given_lse)
    return ref_out, ref_lse, grads


def score_magnitude(case, q, k, absolute=False):
    """Largest ``|softmax_scale * q . k|`` of the case, in float64.

    With ``absolute``, the largest ``|softmax_scale| * |q| . |k|`` instead: a
    bound on what rounding the operands of the score products can change.
    """
    q, k = (to_numpy(a).astype(np.float64) for a in (q, k))
    k = np.repeat(k, case.heads // case.kv_heads, axis=1)
    scale = 1 / math.sqrt(case.head_dim) if case.scale is None else case.scale
    if q.size == 0 or k.size == 0:
        return 0.0
    if absolute:
        return float(abs(scale) * (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2)).max())
    return float(np.abs(scale * (q @ np.swapaxes(k, -1, -2))).max())


def check_close(name, got, ref, naive, dtype, inherited=None, score_max=0.0):
    """Assert the issue's rule: error <= 2 x naive error + floor.

    ``inherited`` is the exact backward of the output and log-sum-exp the
    implementation was given (the output rounded to the dtype; with TF32,
    the lse of TF32 scores); its error is part of the API, not of the
    kernel. The yardstick is the larger of it and the naive error: on a few
    dozen elements with cancelling gradients the naive computation can land
    much closer than its typical error by chance (the CPU fuzz found a
    one-query, three-key float16 case at 28x below the inherited error).
    ``score_max`` (see :func:`score_magnitude`) raises the floor by
    ``SCORE_ULPS`` float32 units of the largest score.
    """
    err = rel_error(got, ref)
    yardstick = rel_error(naive, ref)
    if inherited is not None:
        yardstick = max(yardstick, rel_error(inherited, ref))
    bound = 2 * yardstick + FLOOR[dtype] + SCORE_ULPS * score_max * 2.0**-24
    assert err <= bound, f"{name}: relative error {err:.3g} > bound {bound:.3g}"
    return err


def check_lse(lse, ref_lse, slack=0.0):
    """lse is float32, -inf exactly where the oracle's is, close elsewhere.

    ``slack`` widens the bound (TF32 products: see :func:`run_and_check`).
    """
    lse = to_numpy(lse)
    assert lse.dtype == np.float32
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), "lse -inf rows differ"
    finite = np.isfinite(ref_lse)
    assert np.all(np.isfinite(lse[finite])), "lse has NaN/inf where the oracle is finite"
    # The oracle sees the same (rounded) inputs, so only float32 accumulation differs.
    if finite.any():
        err = np.max(np.abs(lse[finite] - ref_lse[finite]))
        bound = 1e-4 * (1 + np.abs(ref_lse[finite]).max()) + slack
        assert err <= bound, f"lse error {err:.3g} > bound {bound:.3g}"


def run_and_check(case, xp, rng, deterministic=False, allow_tf32=False):
    """Forward and backward of ``case`` on ``xp`` arrays against the oracle.

    With ``allow_tf32`` the yardstick of float32 cases is the naive
    computation in TF32 (see :func:`naive_in_dtype`).
    """
    q, k, v, dout = random_inputs(case, rng, xp)
    kw = dict(
        kv_seq_len=case.kv_seq_len,
        softmax_scale=case.scale,
        allow_tf32=allow_tf32,
        head_dim_v=case.head_dim_v,
    )
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args, **kw)
    dq, dk, dv = cuflash.flash_attention_bwd(
        dout, q, k, v, out, lse, *case.args, **kw, deterministic=deterministic
    )
    check_results(case, (q, k, v, dout), out, lse, (dq, dk, dv), allow_tf32)
    return out, lse, (dq, dk, dv)


def check_results(case, inputs, out, lse, grads, allow_tf32=False):
    """The forward's ``out`` and ``lse`` and the backward's ``grads`` (dq, dk, dv) of
    ``case`` on ``inputs`` (q, k, v, dout) against the oracle, by the tolerance rule."""
    q, k, v, dout = inputs
    dq, dk, dv = grads
    ref_out, ref_lse, ref_grads = oracle(case, q, k, v, dout)
    inherited_grads = oracle(case, q, k, v, dout, out=out, lse=lse)[2]
    tf32 = allow_tf32 and case.dtype == "float32"
    naive_out, naive_grads = naive_in_dtype(case, q, k, v, dout, tf32=tf32)
    score_max = score_magnitude(case, q, k)
    assert out.dtype == DTYPES[case.dtype] and out.shape == ref_out.shape
    check_close("out", out, ref_out, naive_out, case.dtype, score_max=score_max)
    # TF32 rounds each score-product operand by up to 2^-11: a score moves by
    # at most 2^-10 |scale| |q| . |k|, and the lse by no more than its largest score.
    check_lse(lse, ref_lse, 2.0**-10 * score_magnitude(case, q, k, absolute=True) if tf32 else 0)
    for name, got, ref, naive, inherited in zip(
        ("dq", "dk", "dv"), (dq, dk, dv), ref_grads, naive_grads, inherited_grads
    ):
        assert got.dtype == DTYPES[case.dtype] and got.shape == ref.shape, name
        check_close(name, got, ref, naive, case.dtype, inherited, score_max)
    # Rows that see no key: exact zeros; keys past kv_seq_len: exact zero gradients.
    dead = np.isneginf(ref_lse)
    assert np.all(to_numpy(out)[dead] == 0)
    assert np.all(to_numpy(dq)[dead] == 0)
    if case.kv_seq_len is not None:
        assert np.all(to_numpy(dk)[:, :, case.kv_seq_len :] == 0)
        assert np.all(to_numpy(dv)[:, :, case.kv_seq_len :] == 0)


def alibi_slopes(rng, kind, batch, heads):
    """Random ALiBi slopes: None, ``[heads]`` (kind "heads") or ``[batch, heads]``."""
    if kind is None:
        return None
    shape = (heads,) if kind == "heads" else (batch, heads)
    return rng.uniform(0.02, 0.6, size=shape).astype(np.float32)


def weighty_score_max(case, q, k, softcap, slopes):
    """Largest |score| (before and after the modifiers) among the visible scores whose
    probability is above 1e-6: the magnitude whose float32 rounding the results carry
    (far keys that ALiBi pushes to huge negative scores weigh nothing)."""
    q, k = (to_numpy(a).astype(np.float64) for a in (q, k))
    k = np.repeat(k, case.heads // case.kv_heads, axis=1)
    kv_len = case.kv_len if case.kv_seq_len is None else case.kv_seq_len
    raw = q @ np.swapaxes(k, -1, -2) / math.sqrt(case.head_dim)
    modified, _ = _modified_scores(raw, case.q_len, kv_len, softcap, slopes)
    visible = _mask(case.q_len, case.kv_len, kv_len, case.causal, case.window)
    scores = np.where(visible, modified, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    weighty = visible & (scores - np.where(np.isfinite(top), top, 0) > math.log(1e-6))
    if not weighty.any():
        return 0.0
    return float(max(np.abs(raw[weighty]).max(), np.abs(modified[weighty]).max()))


def check_modified_results(case, inputs, results, softcap, slopes):
    """``results`` (out, lse, dq, dk, dv of one dense problem, [B, H, S, D]) against the
    oracle with the modifiers: support.check_close for each, the lse, and exact zeros in
    rows that see no key and for keys past kv_seq_len."""
    q, k, v, dout = (to_numpy(x) for x in inputs)
    out, lse, *grads = (to_numpy(x) for x in results)
    h64 = [x.astype(np.float64) for x in (q, k, v, dout)]
    args = (case.causal, case.window, case.kv_seq_len)
    mods = dict(softcap=softcap, alibi_slopes=slopes)
    ref_out, ref_lse = attention_reference(*h64[:3], *args, **mods)
    ref_grads = attention_reference_grad(h64[3], *h64[:3], *args, **mods)
    inherited = attention_reference_grad(
        h64[3], *h64[:3], *args, out=out.astype(np.float64), lse=lse.astype(np.float64), **mods
    )
    naive_out, naive_grads = naive_in_dtype(case, q, k, v, dout, **mods)
    score_max = weighty_score_max(case, q, k, softcap, slopes)
    assert out.dtype == DTYPES[case.dtype] and out.shape == ref_out.shape
    check_close("out", out, ref_out, naive_out, case.dtype, score_max=score_max)
    check_lse(lse, ref_lse)
    for name, got, ref, naive, given in zip(
        ("dq", "dk", "dv"), grads, ref_grads, naive_grads, inherited
    ):
        assert got.dtype == DTYPES[case.dtype] and got.shape == ref.shape, name
        check_close(name, got, ref, naive, case.dtype, given, score_max)
    dead = np.isneginf(ref_lse)
    assert np.all(out[dead] == 0) and np.all(grads[0][dead] == 0)
    if case.kv_seq_len is not None:
        assert np.all(grads[1][:, :, case.kv_seq_len :] == 0)
        assert np.all(grads[2][:, :, case.kv_seq_len :] == 0)


# Bounds of a packed call against the float64 oracle (the oracle sees the same rounded
# inputs), on each sequence.
PACKED_BOUND = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.5e-2}


def packed_inputs(
    rng, lengths_q, lengths_k, heads, kv_heads, head_dim, dtype, xp=np, head_dim_v=None
):
    """Fresh packed q, k, v, dout (``[tokens, heads, D]``; v and dout ``head_dim_v``
    wide when given) and int32 offsets of the lengths."""
    width_v = head_dim if head_dim_v is None else head_dim_v

    def make(total, h, width=head_dim):
        return xp.asarray(rng.standard_normal((total, h, width)).astype(DTYPES[dtype]))

    q = make(sum(lengths_q), heads)
    k, v = make(sum(lengths_k), kv_heads), make(sum(lengths_k), kv_heads, width_v)
    dout = make(sum(lengths_q), heads, width_v)
    cu_q = xp.asarray(np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32))
    cu_k = xp.asarray(np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32))
    return q, k, v, dout, cu_q, cu_k


def check_packed_results(
    inputs,
    out,
    lse,
    grads,
    lengths_q,
    lengths_k,
    dtype,
    causal=True,
    window=0,
    softmax_scale=None,
    allow_tf32=False,
    bound=None,
):
    """A packed call's ``out``, ``lse`` ``[H, total_q]`` and ``grads`` (dq, dk, dv) on
    ``inputs`` (q, k, v, dout, ``[tokens, heads, D]``) against the oracle on each
    sequence; zeros where a sequence has no query row or no key."""
    q = inputs[0]
    heads = q.shape[1]
    dq, dk, dv = grads
    bound = PACKED_BOUND[dtype] if bound is None else bound
    assert out.shape == inputs[3].shape and lse.shape == (heads, q.shape[0])
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, inputs[1].shape, inputs[2].shape)
    offsets_q = np.concatenate([[0], np.cumsum(lengths_q)])
    offsets_k = np.concatenate([[0], np.cumsum(lengths_k)])
    host = [to_numpy(x).astype(np.float64) for x in inputs]
    got = [to_numpy(x).astype(np.float64) for x in (out, dq, dk, dv)]
    lse = to_numpy(lse)
    for b in range(len(lengths_q)):
        q0, q1, k0, k1 = offsets_q[b], offsets_q[b + 1], offsets_k[b], offsets_k[b + 1]
        if q1 == q0:
            assert np.all(got[2][k0:k1] == 0) and np.all(got[3][k0:k1] == 0), b
            continue
        if k1 == k0:  # no key: zeros, lse -inf, zero gradients
            assert np.all(got[0][q0:q1] == 0) and np.all(got[1][q0:q1] == 0), b
            assert np.all(np.isneginf(lse[:, q0:q1])), b
            continue

        def dense(x, start, stop):
            return x[start:stop].transpose(1, 0, 2)[None]

        qb, kb, vb, db = (
            dense(host[0], q0, q1),
            dense(host[1], k0, k1),
            dense(host[2], k0, k1),
            dense(host[3], q0, q1),
        )
        ref_out, ref_lse = attention_reference(
            qb, kb, vb, causal, window, softmax_scale=softmax_scale
        )
        ref_grads = attention_reference_grad(
            db, qb, kb, vb, causal, window, softmax_scale=softmax_scale
        )
        for name, x, ref in zip(
            ("out", "dq", "dk", "dv"),
            (got[0][q0:q1], got[1][q0:q1], got[2][k0:k1], got[3][k0:k1]),
            (ref_out, *ref_grads),
        ):
            err = rel_error(x.transpose(1, 0, 2)[None], ref)
            assert err <= bound + FLOOR[dtype], (b, name, err)
        dead = np.isneginf(ref_lse[0])
        assert np.array_equal(np.isneginf(lse[:, q0:q1]), dead), b
        lse_tolerance = 1e-4 if not allow_tf32 else 2e-3  # TF32 rounds q and k
        assert np.allclose(lse[:, q0:q1][~dead], ref_lse[0][~dead], atol=lse_tolerance), b


def grid_cases():
    """The configuration grid of the foundation issue (each option, each dtype)."""
    cases = []
    for dtype in DTYPES:
        for d in (8, 40, 64, 96, 128, 256):
            cases.append(Case(dtype=dtype, head_dim=d, q_len=77, kv_len=77, causal=d % 64 == 0))
    rot = list(DTYPES)
    extra = [
        dict(heads=8, kv_heads=4),
        dict(heads=8, kv_heads=2),
        dict(heads=8, kv_heads=1),
        dict(heads=16, kv_heads=2, q_len=33, kv_len=40),
        dict(causal=True, q_len=45, kv_len=130),
        dict(causal=True, q_len=130, kv_len=45),
        dict(causal=True, q_len=129, kv_len=129),
        dict(window=1, causal=True),
        dict(window=16, causal=True),
        dict(window=500, causal=True),
        dict(window=9),
        dict(window=(7, 3)),
        dict(window=(0, 0)),
        dict(window=(-1, 5), q_len=50, kv_len=90),
        dict(window=(4, -1), causal=True, q_len=90, kv_len=50),
        dict(kv_seq_len=40, kv_len=100),
        dict(kv_seq_len=40, kv_len=100, causal=True),
        dict(kv_seq_len=0, kv_len=30),
        dict(kv_seq_len=99, kv_len=100, window=13, causal=True),
        dict(bshd=True, heads=4, kv_heads=2, causal=True),
        dict(bshd=True, q_len=1, kv_len=300),
        dict(q_len=1, kv_len=1),
        dict(q_len=1, kv_len=200, causal=True),
        dict(q_len=200, kv_len=1, causal=True),
        dict(q_len=333, kv_len=257),
        dict(scale=0.3, causal=True),
        dict(scale=-1.7),
    ]
    for i, kw in enumerate(extra):
        base = dict(dtype=rot[i % 3], head_dim=(64, 128, 40, 256, 96)[i % 5])
        cases.append(Case(**{**base, **kw}))
    return cases


def poison_gpu_allocations():
    """Make every CuPy allocation start as NaN (0xFF bytes) until the returned undo runs."""
    pool = cupy.cuda.MemoryPool()

    def alloc(size):
        mem = pool.malloc(size)
        if size:
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return mem

    cupy.cuda.set_allocator(alloc)

    def undo():
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
        pool.free_all_blocks()

    return undo


def compile_and_check(names, arch, functors=None, source_file=None):
    """Compile ``names`` for ``arch`` through NVRTC (no GPU; with the user's modifier
    functors if given): each kernel without spills or a stack frame, in at most 255
    registers. ``names``: registry kernels outside the variants (their source file from
    ``cuflash.gpu.standalone.STANDALONE_KERNELS``), or of ``kernels/source_file`` where given."""
    from cuflash.gpu import kernel_build, standalone

    if source_file is None:  # each registry kernel's own file
        by_source = {}
        for name in names:
            by_source.setdefault(standalone.standalone_of(name).source, []).append(name)
    else:
        by_source = {source_file: list(names)}
    report = {}
    for source, source_names in by_source.items():
        compiled = kernel_build.compile_source_offline(source, source_names, arch, functors)
        report.update(kernel_build.CompileReport(None, arch, *compiled).kernels())
    for name, info in report.items():
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, (name, arch, info)
        assert info["stack"] == 0, (name, arch, info)
        assert 0 < info["registers"] <= 255, (name, arch, info)
    return report
