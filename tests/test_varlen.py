"""Packed variable-length batches (SPEC 7): each sequence against the float64 oracle, on the
CPU path (CI) and the GPU (marked gpu); the validation errors."""

import math

import numpy as np
import pytest

import cuflash
from cuflash.reference import attention_reference, attention_reference_grad
from support import DTYPES, FLOOR, cupy, rel_error, to_numpy

# Bounds against the float64 oracle (the oracle sees the same rounded inputs).
BOUND = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.5e-2}


def _packed(rng, lengths_q, lengths_k, heads, kv_heads, head_dim, dtype, xp):
    def make(total, h):
        return xp.asarray(rng.standard_normal((total, h, head_dim)).astype(DTYPES[dtype]))

    q = make(sum(lengths_q), heads)
    k, v = make(sum(lengths_k), kv_heads), make(sum(lengths_k), kv_heads)
    dout = make(sum(lengths_q), heads)
    cu_q = xp.asarray(np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32))
    cu_k = xp.asarray(np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32))
    return q, k, v, dout, cu_q, cu_k


def _check_against_oracle(rng, xp, lengths_q, lengths_k, heads=4, kv_heads=2, head_dim=32,
                          dtype="float32", causal=True, window=0, deterministic=False):
    q, k, v, dout, cu_q, cu_k = _packed(rng, lengths_q, lengths_k, heads, kv_heads, head_dim,
                                        dtype, xp)
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k), heads, kv_heads, head_dim, causal,
            window)
    out, vjp = cuflash.flash_attention_varlen_vjp(q, k, v, *args)
    dq, dk, dv = vjp(dout, deterministic=deterministic)
    assert out.shape == q.shape and vjp.lse.shape == (heads, q.shape[0])
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    offsets_q = np.concatenate([[0], np.cumsum(lengths_q)])
    offsets_k = np.concatenate([[0], np.cumsum(lengths_k)])
    host = [to_numpy(x).astype(np.float64) for x in (q, k, v, dout)]
    got = [to_numpy(x).astype(np.float64) for x in (out, dq, dk, dv)]
    lse = to_numpy(vjp.lse)
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

        qb, kb, vb, db = (dense(host[0], q0, q1), dense(host[1], k0, k1),
                          dense(host[2], k0, k1), dense(host[3], q0, q1))
        ref_out, ref_lse = attention_reference(qb, kb, vb, causal, window)
        ref_grads = attention_reference_grad(db, qb, kb, vb, causal, window)
        for name, x, ref in zip(("out", "dq", "dk", "dv"),
                                (got[0][q0:q1], got[1][q0:q1], got[2][k0:k1], got[3][k0:k1]),
                                (ref_out, *ref_grads)):
            err = rel_error(x.transpose(1, 0, 2)[None], ref)
            assert err <= BOUND[dtype] + FLOOR[dtype], (b, name, err)
        dead = np.isneginf(ref_lse[0])
        assert np.array_equal(np.isneginf(lse[:, q0:q1]), dead), b
        assert np.allclose(lse[:, q0:q1][~dead], ref_lse[0][~dead], atol=1e-4), b


CASES = [
    dict(lengths_q=[5, 0, 17, 1, 9], lengths_k=[5, 3, 17, 1, 9]),
    dict(lengths_q=[33], lengths_k=[33], causal=False),
    dict(lengths_q=[4, 12, 7], lengths_k=[10, 12, 2], window=3),
    dict(lengths_q=[6, 6], lengths_k=[6, 0], heads=4, kv_heads=4, head_dim=40),
    dict(lengths_q=[3, 20], lengths_k=[9, 20], heads=6, kv_heads=1, window=(2, 1),
         causal=False),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_matches_oracle_per_sequence(case, dtype, rng):
    _check_against_oracle(rng, np, dtype=dtype, **case)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES + [
    dict(lengths_q=[300, 64, 1, 700], lengths_k=[300, 64, 1, 700], head_dim=128),
    dict(lengths_q=[1000], lengths_k=[1000], head_dim=80, heads=8, kv_heads=2)], ids=str)
def test_gpu_matches_oracle_per_sequence(case, dtype, deterministic, rng, poisoned):
    _check_against_oracle(rng, cupy, dtype=dtype, deterministic=deterministic, **case)


def test_packed_equal_lengths_match_the_dense_call(rng):
    """Equal lengths packed: the dense call's result, bitwise (the same per-sequence math)."""
    B, S, H, D = 3, 20, 2, 16
    q, k, v, dout, cu_q, cu_k = _packed(rng, [S] * B, [S] * B, H, H, D, "float32", np)
    out, lse = cuflash.flash_attention_varlen_fwd(q, k, v, cu_q, cu_k, S, S, H, H, D, True)
    dense = [x.reshape(B, S, H, D).transpose(0, 2, 1, 3) for x in (q, k, v)]
    ref, ref_lse = cuflash.flash_attention_fwd(*dense, H, H, D, True)
    assert np.array_equal(out, ref.transpose(0, 2, 1, 3).reshape(B * S, H, D))
    assert np.array_equal(lse, ref_lse.transpose(1, 0, 2).reshape(H, B * S))


def _bad_calls():
    a = lambda *shape, dtype=np.float32: np.zeros(shape, dtype)  # noqa: E731
    q, kv = a(10, 4, 8), a(12, 2, 8)
    cu_q, cu_k = np.array([0, 4, 10], np.int32), np.array([0, 5, 12], np.int32)

    def fwd(q=q, k=kv, v=kv, cu_q=cu_q, cu_k=cu_k, mq=8, mk=8, **kw):
        return lambda: cuflash.flash_attention_varlen_fwd(q, k, v, cu_q, cu_k, mq, mk, 4, 2, 8,
                                                          **kw)

    return [
        (fwd(q=a(1, 10, 4, 8)), "q: expected 3-D"),
        (fwd(k=a(12, 4, 8)), "k: has heads 4, expected 2"),
        (fwd(v=a(11, 2, 8)), "v: has tokens 11, expected 12"),
        (fwd(cu_q=cu_q.astype(np.int64)), "cu_seqlens_q: expected dtype int32"),
        (fwd(cu_k=np.array([0, 12], np.int32)), "cu_seqlens_k: expected shape (3,)"),
        (fwd(cu_q=np.array([[0, 4, 10]], np.int32)), "cu_seqlens_q: expected 1-D"),
        (fwd(cu_q=np.array([1, 4, 10], np.int32)), "cu_seqlens_q: must start at 0"),
        (fwd(cu_q=np.array([0, 6, 4], np.int32)), "sequence 1: offsets decrease"),
        (fwd(cu_k=np.array([0, 5, 11], np.int32)), "the last offset 11 differs"),
        (fwd(mq=5), "cu_seqlens_q: sequence 1: length 6 exceeds max_seqlen_q = 5"),
        (fwd(mk=-1), "max_seqlen_k: must be >= 0"),
        (fwd(cu_q=[0, 4, 10]), "cu_seqlens_q: expected numpy.ndarray or cupy.ndarray"),
    ]


@pytest.mark.parametrize("index", range(12))
def test_bad_input_is_rejected(index):
    call, message = _bad_calls()[index]
    with pytest.raises(cuflash.InvalidArgumentError, match=message.replace("(", r"\(")
                       .replace(")", r"\)")):
        call()


def test_backward_checks_its_extra_arrays(rng):
    q, k, v, dout, cu_q, cu_k = _packed(rng, [3, 5], [4, 5], 2, 2, 8, "float32", np)
    out, lse = cuflash.flash_attention_varlen_fwd(q, k, v, cu_q, cu_k, 5, 5, 2, 2, 8)
    args = (cu_q, cu_k, 5, 5, 2, 2, 8)
    with pytest.raises(cuflash.InvalidArgumentError, match="lse: has heads 3"):
        cuflash.flash_attention_varlen_bwd(dout, q, k, v, out, np.zeros((3, 8), np.float32),
                                           *args)
    with pytest.raises(cuflash.InvalidArgumentError, match="dout: has tokens 7"):
        cuflash.flash_attention_varlen_bwd(dout[:7], q, k, v, out, lse, *args)
    with pytest.raises(cuflash.InvalidArgumentError, match="lse: expected dtype float32"):
        cuflash.flash_attention_varlen_bwd(dout, q, k, v, out, lse.astype(np.float64), *args)
    grads = cuflash.flash_attention_varlen_bwd(dout, q, k, v, out, lse, *args)
    assert all(np.all(np.isfinite(g)) for g in grads)
    assert math.isfinite(float(np.abs(grads[0]).sum()))
