"""``head_dim_v`` in ``flash_attention_with_kvcache`` (the KV-cache page): v's own head
dim up to 512 under a head_dim up to 576 on the CPU path, absorbed MLA's ``v_cache`` as
the view ``k_cache[..., :head_dim_v]``, contiguous and paged, against the float64 oracle;
bad input; the GPU path's refusal."""

import numpy as np
import pytest
from support import DTYPES, FLOOR, PACKED_BOUND, cupy, rel_error

import cuflash
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
    """The oracle per sequence on its first ``lengths[b]`` keys (bottom-right causal)."""
    outs, lses = [], []
    for b, length in enumerate(lengths):
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


@pytest.mark.gpu
def test_gpu_refuses_a_value_head_dim_of_its_own():
    """The GPU kernels take one head dim up to 256: a clear error before any kernel."""
    q, k_cache, v_cache = (cupy.asarray(x) for x in _arrays())
    with pytest.raises(cuflash.InvalidArgumentError, match="GPU path takes v of q's head dim"):
        _call(q, k_cache, v_cache, 64, head_dim_v=32)
    big = [cupy.asarray(x) for x in _arrays(d=576, dv=512)]
    with pytest.raises(cuflash.InvalidArgumentError, match="GPU path takes head_dim up to 256"):
        _call(*big, 576, head_dim_v=512)
