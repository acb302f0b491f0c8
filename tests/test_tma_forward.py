"""The Hopper forward's bulk tensor copies on the GPU (``forward_wgmma_ws`` with
``use_tma``: q, k and v by the copy engine through tensor maps) against the float64
oracle and against the same kernel with cp.async, on the layouts, lengths and head
dims the maps must get right; and the calls that must not take them (arrays off 16
bytes, the KV cache's chunks, packed batches) still right."""

import numpy as np
import pytest
from support import (
    HAS_GPU,
    Case,
    check_close,
    check_lse,
    naive_in_dtype,
    oracle,
    random_inputs,
    score_magnitude,
)

import cuflash
from cuflash.gpu import launch as gpu
from cuflash.gpu import plans, tensor_maps

pytestmark = pytest.mark.gpu

if HAS_GPU:
    import cupy


def _hopper():
    if cupy.cuda.Device().compute_capability < "90":
        pytest.skip("the copy engine's kernels need an H100/H200")


def _forward_plans():
    return [p for p in plans._PLANS.values() if isinstance(p, gpu.ForwardPlan)]


CASES = [
    Case(
        dtype="bfloat16", head_dim=128, batch=2, heads=4, kv_heads=2, q_len=300, kv_len=700,
        causal=True,
    ),
    # a key tile cut by kv_seq_len: rows past it must read as zeros, not the buffer's
    Case(
        dtype="float16", head_dim=96, batch=1, heads=2, kv_heads=2, q_len=200, kv_len=530,
        kv_seq_len=517,
    ),
    Case(dtype="bfloat16", head_dim=256, batch=2, heads=2, kv_heads=1, q_len=150, kv_len=340),
    Case(
        dtype="float16", head_dim=200, batch=2, heads=2, kv_heads=2, q_len=129, kv_len=257,
        window=(64, 0),
    ),
    # [B, S, H, D] buffers: rows H * D apart, heads D apart
    Case(
        dtype="bfloat16", head_dim=72, batch=1, heads=4, kv_heads=4, q_len=513, kv_len=1000,
        bshd=True,
    ),
    Case(
        dtype="bfloat16", head_dim=192, head_dim_v=128, batch=1, heads=2, kv_heads=1, q_len=260,
        kv_len=390, causal=True,
    ),
]  # fmt: skip


def _forward(case, q, k, v):
    return cuflash.flash_attention_fwd(
        q, k, v, *case.args, kv_seq_len=case.kv_seq_len, head_dim_v=case.head_dim_v
    )


def _check(case, inputs, out, lse):
    q, k, v, dout = inputs
    ref_out, ref_lse, _ = oracle(case, q, k, v, dout)
    naive_out, _ = naive_in_dtype(case, q, k, v, dout)
    check_close("out", out, ref_out, naive_out, case.dtype, score_max=score_magnitude(case, q, k))
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_copy_engine_forward_matches_oracle_and_cp_async(case, rng, poisoned):
    _hopper()
    if not tensor_maps.available():
        pytest.fail("a GPU machine whose driver encodes no tensor maps")
    inputs = random_inputs(case, rng)
    q, k, v = (cupy.asarray(x) for x in inputs[:3])
    if case.bshd:
        q, k, v = (cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                   for x in (q, k, v))  # fmt: skip
    if case.kv_seq_len is not None:  # NaN past the keys a call reads: never read as data
        k[:, :, case.kv_seq_len :] = np.nan
        v[:, :, case.kv_seq_len :] = np.nan
    plans._PLANS.clear()
    out, lse = _forward(case, q, k, v)
    (plan,) = _forward_plans()
    assert plan.spec.name == "forward_wgmma_ws" and plan.main_tma is not None
    _check(case, inputs, out, lse)
    # the same kernel with cp.async: the same values up to the order of nothing (the
    # products see the same tiles), so bitwise
    plan.main_tma, keep = None, plan.main_tma
    try:
        out_cp, lse_cp = _forward(case, q, k, v)
    finally:
        plan.main_tma = keep
    assert cupy.array_equal(out, out_cp) and cupy.array_equal(lse, lse_cp)
    # a second call on other arrays re-encodes the maps
    others = random_inputs(case, rng)
    q2, k2, v2 = (cupy.asarray(x) for x in others[:3])
    if case.bshd:
        q2, k2, v2 = (cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                      for x in (q2, k2, v2))  # fmt: skip
    out2, lse2 = _forward(case, q2, k2, v2)
    _check(case, others, out2, lse2)


def test_arrays_off_16_bytes_take_cp_async(rng, poisoned):
    """q starting 8 bytes into its buffer: the copy engine cannot address it."""
    _hopper()
    case = CASES[0]
    inputs = random_inputs(case, rng)
    q, k, v = (cupy.asarray(x) for x in inputs[:3])
    flat = cupy.empty(q.size + 4, q.dtype)
    shifted = flat[4:].reshape(q.shape)
    shifted[...] = q
    assert shifted.data.ptr % 16 == 8
    out, lse = _forward(case, shifted, k, v)
    _check(case, inputs, out, lse)


def test_kv_cache_chunks_read_only_their_keys(rng, poisoned):
    """A chunk of queries over a KV cache (the forward kernel with per-entry key
    counts): keys past an entry's count are NaN in the cache and must not be read."""
    _hopper()
    b, h, d, capacity, chunk = 2, 4, 128, 600, 160
    lengths = [300, 517]
    x = rng.standard_normal
    q_host = x((b, h, chunk, d)).astype(np.float16)
    k_host = x((b, h, capacity, d)).astype(np.float16)
    v_host = x((b, h, capacity, d)).astype(np.float16)
    k_cache, v_cache = cupy.asarray(k_host), cupy.asarray(v_host)
    for i, n in enumerate(lengths):
        k_cache[i, :, n:] = np.nan
        v_cache[i, :, n:] = np.nan
    seqlens = cupy.asarray(lengths, dtype=cupy.int32)
    out = cuflash.flash_attention_with_kvcache(
        cupy.asarray(q_host), k_cache, v_cache, h, h, d, causal=True, cache_seqlens=seqlens
    )
    got = out.get().astype(np.float64)
    assert np.all(np.isfinite(got))
    for i, n in enumerate(lengths):
        ref, _ = cuflash.flash_attention_fwd(
            q_host[i : i + 1], k_host[i : i + 1, :, :n], v_host[i : i + 1, :, :n], h, h, d, True
        )
        ref = ref.astype(np.float64)
        err = np.linalg.norm(got[i : i + 1] - ref) / np.linalg.norm(ref)
        assert err < 5e-3, (i, err)
