"""Checks of attention sinks (cuflash.sinks) against the float64 oracle, shared by the
CPU, simulator and GPU tests: fresh random sinks, and the results of a dense or packed
call held against the oracle with the same sinks."""

import numpy as np
from support import FLOOR, PACKED_BOUND, rel_error, to_numpy

from cuflash.reference import _mask, attention_reference, attention_reference_grad

# lse of a row that sees no key: sinks[h] exactly on the CPU path; the kernels keep it in
# base 2 (sink log2 e, then times ln 2): a few float32 roundings.
NO_KEY_LSE_RTOL = {"cpu": 0.0, "kernels": 4e-7}


def random_sinks(rng, heads, xp=np):
    """float32 ``[heads]`` logits around the scores' scale, one head's large enough to
    dominate its rows (and one negative)."""
    sinks = rng.uniform(-1.0, 3.0, heads).astype(np.float32)
    sinks[0] = 6.0
    return xp.asarray(sinks)


def check_sink_results(
    inputs,
    results,
    sinks,
    dtype,
    causal=False,
    window=0,
    kv_seq_len=None,
    softmax_scale=None,
    kernels=False,
):
    """A dense call's ``results`` (out, lse and, when given, dq, dk, dv and dsinks) on
    ``inputs`` (q, k, v, dout, ``[B, H, S, D]``) with ``sinks`` against the oracle: each
    within the packed calls' bound of it; rows that see no key zeros with ``lse =
    sinks[h]`` (up to the kernels' rounding with ``kernels``); NaN never passes."""
    host = [to_numpy(x).astype(np.float64) for x in inputs]
    sinks = to_numpy(sinks)
    args = (causal, window, kv_seq_len, softmax_scale)
    ref_out, ref_lse = attention_reference(*host[:3], *args, sinks=sinks)
    out, lse = to_numpy(results[0]), to_numpy(results[1])
    bound = PACKED_BOUND[dtype] + FLOOR[dtype]
    assert rel_error(out, ref_out) <= bound, ("out", rel_error(out, ref_out))
    assert lse.dtype == np.float32 and np.all(np.isfinite(lse))
    assert np.max(np.abs(lse - ref_lse)) <= 1e-4 * (1 + np.abs(ref_lse).max())
    q_len, kv_capacity = host[0].shape[2], host[1].shape[2]
    kv_len = kv_capacity if kv_seq_len is None else kv_seq_len
    dead = ~_mask(q_len, kv_capacity, kv_len, causal, window).any(axis=-1)  # [S_q]
    if dead.any():
        assert np.all(out[:, :, dead] == 0)
        want = np.broadcast_to(sinks[None, :, None], lse.shape)[:, :, dead]
        rtol = NO_KEY_LSE_RTOL["kernels" if kernels else "cpu"]
        assert np.all(np.abs(lse[:, :, dead] - want) <= rtol * np.abs(want)), "no-key lse"
    if len(results) == 2:
        return dead
    ref_grads = attention_reference_grad(host[3], *host[:3], *args, sinks=sinks)
    for name, got, ref in zip(("dq", "dk", "dv", "dsinks"), results[2:], ref_grads):
        err = rel_error(got, ref)
        assert err <= bound, (name, err)
    return dead


def finite_difference_dsinks(inputs, sinks, causal=False, window=0, step=1e-4):
    """d(sum(dout * out))/d(sinks) of the float64 oracle by central differences."""
    host = [to_numpy(x).astype(np.float64) for x in inputs]
    base = to_numpy(sinks).astype(np.float64)
    grads = []
    for h in range(base.size):
        e = np.zeros_like(base)
        e[h] = step
        up, _ = attention_reference(*host[:3], causal, window, sinks=base + e)
        down, _ = attention_reference(*host[:3], causal, window, sinks=base - e)
        grads.append(((up - down) * host[3]).sum() / (2 * step))
    return np.array(grads)
