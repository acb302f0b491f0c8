"""Score modifiers (SPEC 8): soft-capping and ALiBi, forward and backward, on the CPU path
(CI) and the GPU (marked gpu), dense and packed, against the float64 oracle; their
validation errors; the oracle's own derivative against finite differences."""

import numpy as np
import pytest

import cuflash
from cuflash.reference import attention_reference, attention_reference_grad
from support import DTYPES, FLOOR, cupy, rel_error, to_numpy

BOUND = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}

# (softcap, ALiBi slopes' shape: None, "heads" or "batch_heads")
MODIFIERS = [(5.0, None), (0.0, "heads"), (2.0, "batch_heads")]


def _slopes(rng, kind, batch, heads):
    if kind is None:
        return None
    shape = (heads,) if kind == "heads" else (batch, heads)
    return rng.uniform(0.02, 0.6, size=shape).astype(np.float32)


def _check(rng, xp, dtype="float32", batch=2, heads=4, kv_heads=2, q_len=45, kv_len=70,
           head_dim=64, causal=True, window=0, kv_seq_len=None, softcap=5.0, alibi=None,
           deterministic=False):
    """Forward and backward with modifiers against the oracle (relative errors)."""
    def make(h, n):
        return rng.standard_normal((batch, h, n, head_dim)).astype(DTYPES[dtype])

    host = [make(heads, q_len), make(kv_heads, kv_len), make(kv_heads, kv_len),
            make(heads, q_len)]
    slopes = _slopes(rng, alibi, batch, heads)
    q, k, v, dout = (xp.asarray(x) for x in host)
    kw = dict(kv_seq_len=kv_seq_len, softcap=softcap,
              alibi_slopes=None if slopes is None else xp.asarray(slopes))
    args = (heads, kv_heads, head_dim, causal, window)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *args, **kw)
    grads = cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *args, **kw,
                                        deterministic=deterministic)
    ref = dict(kv_seq_len=kv_seq_len, softcap=softcap, alibi_slopes=slopes)
    h64 = [x.astype(np.float64) for x in host]
    ref_out, ref_lse = attention_reference(*h64[:3], causal, window, **ref)
    ref_grads = attention_reference_grad(h64[3], *h64[:3], causal, window, **ref)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        err = rel_error(to_numpy(got).astype(np.float64), want)
        assert err <= BOUND[dtype] + FLOOR[dtype], (name, err)
    live = ~np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(to_numpy(lse)), ~live)
    assert np.allclose(to_numpy(lse)[live], ref_lse[live], atol=2e-3)


CPU_CASES = [
    dict(),
    dict(causal=False, window=(9, 4)),
    dict(q_len=30, kv_len=80, kv_seq_len=50),
    dict(heads=6, kv_heads=1, causal=False, head_dim=40),
]


@pytest.mark.parametrize("softcap, alibi", MODIFIERS, ids=str)
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_cpu_matches_oracle(case, softcap, alibi, rng):
    _check(rng, np, softcap=softcap, alibi=alibi, **case)


def test_oracle_derivative_matches_finite_differences(rng):
    """The oracle's gradients with a soft-cap and ALiBi are those of its forward."""
    q, k, v, dout = (rng.standard_normal((1, 2, 5, 8)) for _ in range(4))
    slopes = np.array([0.3, 0.7])
    kw = dict(softcap=1.5, alibi_slopes=slopes)
    dq = attention_reference_grad(dout, q, k, v, True, 0, **kw)[0]
    eps = 1e-6
    for index in [(0, 0, 1, 2), (0, 1, 4, 7), (0, 1, 3, 0)]:
        plus, minus = q.copy(), q.copy()
        plus[index] += eps
        minus[index] -= eps
        numeric = (np.sum(attention_reference(plus, k, v, True, 0, **kw)[0] * dout)
                   - np.sum(attention_reference(minus, k, v, True, 0, **kw)[0] * dout)) / (2 * eps)
        assert abs(numeric - dq[index]) < 1e-6 * max(1.0, abs(numeric)), index


def test_modifiers_change_the_result(rng):
    """A soft-cap and ALiBi are not no-ops (the tests above could not fail otherwise)."""
    q, k, v = (rng.standard_normal((1, 2, 20, 16)).astype(np.float32) * 3 for _ in range(3))
    plain, _ = cuflash.flash_attention_fwd(q, k, v, 2, 2, 16, True)
    capped, _ = cuflash.flash_attention_fwd(q, k, v, 2, 2, 16, True, softcap=1.0)
    biased, _ = cuflash.flash_attention_fwd(q, k, v, 2, 2, 16, True,
                                            alibi_slopes=np.array([0.5, 1.0], np.float32))
    assert rel_error(capped.astype(np.float64), plain.astype(np.float64)) > 0.05
    assert rel_error(biased.astype(np.float64), plain.astype(np.float64)) > 0.05


def test_cpu_packed_alibi_per_sequence(rng):
    """[B, H] slopes in a packed batch: one row a sequence, positions within it."""
    lengths = [7, 0, 19, 11]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, heads, d = int(offsets[-1]), 2, 16
    q, k, v = (rng.standard_normal((total, heads, d)).astype(np.float32) for _ in range(3))
    slopes = rng.uniform(0.1, 0.9, size=(len(lengths), heads)).astype(np.float32)
    out, _ = cuflash.flash_attention_varlen_fwd(q, k, v, offsets, offsets, 19, 19, heads,
                                                heads, d, True, softcap=3.0,
                                                alibi_slopes=slopes)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        s = slice(offsets[b], offsets[b + 1])
        views = [x[s].transpose(1, 0, 2)[None].astype(np.float64) for x in (q, k, v)]
        ref, _ = attention_reference(*views, True, 0, softcap=3.0, alibi_slopes=slopes[b])
        assert rel_error(out[s].transpose(1, 0, 2)[None].astype(np.float64), ref) < 1e-5, b


def _bad_calls():
    q = np.zeros((2, 4, 8, 16), np.float32)
    kv = np.zeros((2, 2, 8, 16), np.float32)

    def fwd(**kw):
        return lambda: cuflash.flash_attention_fwd(q, kv, kv, 4, 2, 16, **kw)

    return [
        (fwd(softcap=-1.0), "softcap: must be finite and >= 0"),
        (fwd(softcap=float("nan")), "softcap: must be finite and >= 0"),
        (fwd(softcap="1"), "softcap: expected a float, got str"),
        (fwd(alibi_slopes=np.zeros(4, np.float64)), "alibi_slopes: expected dtype float32"),
        (fwd(alibi_slopes=np.zeros(3, np.float32)),
         r"alibi_slopes: expected shape \(4,\) or \(2, 4\), got \(3,\)"),
        (fwd(alibi_slopes=[0.1] * 4), "alibi_slopes: expected numpy.ndarray or cupy.ndarray"),
    ]


@pytest.mark.parametrize("index", range(6))
def test_bad_modifiers_are_rejected(index):
    call, message = _bad_calls()[index]
    with pytest.raises(cuflash.InvalidArgumentError, match=message):
        call()


def test_packed_slopes_have_a_row_per_sequence():
    q = np.zeros((10, 2, 8), np.float32)
    cu = np.array([0, 4, 10], np.int32)
    with pytest.raises(cuflash.InvalidArgumentError,
                       match=r"alibi_slopes: expected shape \(2,\) or \(2, 2\), got \(1, 2\)"):
        cuflash.flash_attention_varlen_fwd(q, q, q, cu, cu, 6, 6, 2, 2, 8,
                                           alibi_slopes=np.ones((1, 2), np.float32))


# ---- GPU -------------------------------------------------------------------------------

GPU_SHAPES = [dict(head_dim=64), dict(head_dim=128, heads=8, kv_heads=2),
              dict(head_dim=256, q_len=33, kv_len=90), dict(head_dim=40, causal=False,
                                                           window=(20, 3))]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("softcap, alibi", MODIFIERS, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_matches_oracle(shape, softcap, alibi, dtype, deterministic, rng, poisoned):
    _check(rng, cupy, dtype=dtype, softcap=softcap, alibi=alibi, deterministic=deterministic,
           **shape)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["mma_sync", "general"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_other_kernels(path, dtype, rng, poisoned):
    """The mma.sync kernels (the A100 path) and the general ones take the modifiers too."""
    from cuflash import dispatch

    context = (dispatch.kernel_path("general") if path == "general" else
               dispatch.skip_kernels("forward_wgmma_pipelined", "forward_wgmma",
                                     "backward_wgmma"))
    with context:
        for head_dim in (64, 128):
            _check(rng, cupy, dtype=dtype, head_dim=head_dim, softcap=4.0, alibi="batch_heads")


@pytest.mark.gpu
def test_gpu_packed_with_modifiers(rng, poisoned):
    lengths = [70, 0, 200, 33]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, heads, d = int(offsets[-1]), 4, 64
    host = [rng.standard_normal((total, heads, d)).astype(DTYPES["bfloat16"]) for _ in range(4)]
    slopes = rng.uniform(0.05, 0.5, size=(len(lengths), heads)).astype(np.float32)
    q, k, v, dout = (cupy.asarray(x) for x in host)
    cu = cupy.asarray(offsets)
    kw = dict(softcap=6.0, alibi_slopes=cupy.asarray(slopes))
    out, vjp = cuflash.flash_attention_varlen_vjp(q, k, v, cu, cu, 200, 200, heads, heads, d,
                                                  True, **kw)
    grads = vjp(dout)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        s = slice(offsets[b], offsets[b + 1])
        views = [x[s].transpose(1, 0, 2)[None].astype(np.float64) for x in host]
        ref_out, _ = attention_reference(*views[:3], True, 0, softcap=6.0,
                                         alibi_slopes=slopes[b])
        ref_grads = attention_reference_grad(views[3], *views[:3], True, 0, softcap=6.0,
                                             alibi_slopes=slopes[b])
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads),
                                   (ref_out, *ref_grads)):
            got = to_numpy(got)[s].transpose(1, 0, 2)[None].astype(np.float64)
            err = rel_error(got, want)
            assert err <= BOUND["bfloat16"] + FLOOR["bfloat16"], (b, name, err)
