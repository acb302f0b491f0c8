"""The float64 oracle itself: finite differences, and the plain definition."""

import math

import numpy as np
import pytest

from cuflash.reference import attention_reference, attention_reference_grad


def loss(q, k, v, dout, opts):
    return float(np.sum(attention_reference(q, k, v, **opts)[0] * dout))


@pytest.mark.parametrize(
    "opts, kv_heads",
    [
        ({}, 2),
        ({"causal": True}, 1),
        ({"window": 3, "causal": True}, 2),
        ({"window": (2, 1)}, 4),
        ({"kv_seq_len": 5}, 2),
        ({"softmax_scale": 0.7}, 4),
    ],
)
def test_gradients_match_finite_differences(rng, opts, kv_heads):
    q = rng.standard_normal((1, 4, 6, 8))
    k = rng.standard_normal((1, kv_heads, 7, 8))
    v = rng.standard_normal((1, kv_heads, 7, 8))
    dout = rng.standard_normal((1, 4, 6, 8))
    grads = attention_reference_grad(dout, q, k, v, **opts)
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            up = loss(q, k, v, dout, opts)
            x[idx] = old - eps
            down = loss(q, k, v, dout, opts)
            x[idx] = old
            numeric[idx] = (up - down) / (2 * eps)
        err = np.linalg.norm(g - numeric) / np.linalg.norm(numeric)
        assert err < 1e-7, err


def test_matches_the_plain_formula_per_row(rng):
    """One row by hand: softmax over the visible keys, then the weighted sum."""
    q, k, v = (
        rng.standard_normal((1, 1, 5, 8)),
        rng.standard_normal((1, 1, 9, 8)),
        rng.standard_normal((1, 1, 9, 8)),
    )
    out, lse = attention_reference(q, k, v, causal=True, window=3)
    for i in range(5):
        p = i + 9 - 5
        keys = [j for j in range(9) if p - 3 < j <= p]
        s = np.array([q[0, 0, i] @ k[0, 0, j] / math.sqrt(8) for j in keys])
        w = np.exp(s - s.max())
        np.testing.assert_allclose(out[0, 0, i], (w / w.sum()) @ v[0, 0, keys], rtol=1e-12)
        np.testing.assert_allclose(lse[0, 0, i], np.log(np.exp(s).sum()), rtol=1e-12)


def test_rows_that_see_no_key(rng):
    q, k = rng.standard_normal((1, 1, 6, 8)), rng.standard_normal((1, 1, 3, 8))
    out, lse = attention_reference(q, k, k, causal=True)  # rows 0..2 sit before key 0
    assert np.all(out[0, 0, :3] == 0) and np.all(np.isneginf(lse[0, 0, :3]))
    assert np.all(np.isfinite(lse[0, 0, 3:]))
    grads = attention_reference_grad(np.ones_like(q), q, k, k, causal=True)
    assert np.all(grads[0][0, 0, :3] == 0) and all(np.all(np.isfinite(g)) for g in grads)


def test_given_out_and_lse_are_what_the_gradients_use(rng):
    """The exact out and lse change nothing; a shifted lse scales P, as a backward does."""
    q, k, v, dout = (rng.standard_normal((1, 2, 5, 8)) for _ in range(4))
    opts = {"causal": True, "window": 3}
    out, lse = attention_reference(q, k, v, **opts)
    exact = attention_reference_grad(dout, q, k, v, **opts)
    given = attention_reference_grad(dout, q, k, v, **opts, out=out, lse=lse)
    for a, b in zip(exact, given):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)
    shifted = attention_reference_grad(dout, q, k, v, **opts, out=out, lse=lse - math.log(2))
    np.testing.assert_allclose(shifted[2], 2 * exact[2], rtol=1e-12)  # dv = P^T dout


def test_sinks_are_a_key_of_zero_value(rng):
    """A sink is one more key of the row whose score is sinks[h] and whose value is zero:
    the oracle with sinks equals the plain formula with that key appended, and -inf sinks
    change nothing."""
    q, k, v = (rng.standard_normal((2, 3, 7, 8)) for _ in range(3))
    sinks = rng.uniform(-1, 2, 3)
    out, lse = attention_reference(q, k, v, causal=True, sinks=sinks)
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(8)
    scores = np.where(np.tril(np.ones((7, 7), bool)), scores, -np.inf)
    scores = np.concatenate(
        [scores, np.broadcast_to(sinks[None, :, None, None], (2, 3, 7, 1))], axis=-1
    )
    weights = np.exp(scores)
    v_sink = np.concatenate([v, np.zeros((2, 3, 1, 8))], axis=2)
    np.testing.assert_allclose(lse, np.log(weights.sum(-1)), rtol=1e-12)
    np.testing.assert_allclose(out, weights @ v_sink / weights.sum(-1, keepdims=True), rtol=1e-10)
    plain = attention_reference(q, k, v, causal=True)
    none = attention_reference(q, k, v, causal=True, sinks=np.full(3, -np.inf))
    for a, b in zip(plain, none):
        np.testing.assert_array_equal(a, b)
