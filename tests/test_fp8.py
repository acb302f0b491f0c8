"""FP8 (e4m3) forward (cuflash.fp8, cuflash.fp8_forward) on the CPU path and, marked
``gpu``, on the GPU path: the dense, packed and KV-cache functions against the float64
oracle on the dequantized inputs (times their descales), by relative error; scalar and
per-(B, H_kv) descales, every out_dtype, the masking options, GQA, outliers, both
storages (float8_e4m3fn and uint8 bits); the append into an FP8 cache; one bad call per
argument."""

import math

import ml_dtypes
import numpy as np
import pytest
from support import BFLOAT16, FP8_KERNEL_TOLERANCE, cupy, rel_error, to_numpy

import cuflash
from cuflash import distributed as dist
from cuflash import fp8
from cuflash.reference import attention_reference

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
OUT_DTYPES = {"bfloat16": BFLOAT16, "float16": np.dtype(np.float16), "float32": np.float32}
ARRAYS = [pytest.param("numpy", id="cpu"), pytest.param("cupy", id="gpu", marks=pytest.mark.gpu)]
# Below the floor a difference is float32 accumulation (the FP8 path computes in float32
# on the exactly dequantized inputs; its only other error is the output's rounding).
FLOOR = 1e-5


def _xp(name, request=None):
    """The array module of a parameter; with ``request``, GPU allocations start as NaN
    (the ``poisoned`` fixture), so an output element left unwritten fails the test."""
    if name == "numpy":
        return np
    if request is not None:
        request.getfixturevalue("poisoned")
    return cupy


def fresh(rng, shape, outliers=False):
    """Unit normal values, or with ``outliers`` 0.1 % of them (at least one) 20x larger."""
    x = rng.standard_normal(shape)
    if outliers:
        count = max(1, x.size // 1000)
        x.flat[rng.choice(x.size, count, replace=False)] *= 20
    return x


def fp8_inputs(rng, shapes, kind, kv_heads, outliers=False):
    """Fresh e4m3 arrays of ``shapes`` and their descales, by ``kind``: ``none``, unit
    normal values rounded to e4m3; ``scalar`` and ``per_head``, quantized by
    :func:`cuflash.fp8.quantize` (one descale, or one a batch entry and KV head), so the
    true values are about unit normal either way."""
    arrays, descales = [], []
    for shape in shapes:
        x = fresh(rng, shape, outliers)
        if kind == "none":
            arrays.append(x.astype(E4M3))
            descales.append(None)
        else:
            values, descale = fp8.quantize(x, kv_heads if kind == "per_head" else None)
            arrays.append(values)
            descales.append(float(descale) if kind == "scalar" else descale)
    return arrays, tuple(descales)


def stored(x, xp, storage):
    """An e4m3 NumPy array as the call takes it: float8_e4m3fn, or uint8 bits (CuPy)."""
    bits = x.view(np.uint8) if storage == "bits" or xp is not np else x
    return xp.asarray(bits)


def storage_keyword(xp, storage):
    return {"fp8_format": "e4m3"} if storage == "bits" or xp is not np else {}


def true_values(x, descale, num_heads=None):
    """float64 ``x * descale`` (``[B, H_kv]`` descales spread over ``num_heads`` heads)."""
    values = x.astype(np.float64)
    if descale is None:
        return values
    d = np.asarray(descale, dtype=np.float64)
    if d.ndim == 0:
        return values * d
    return values * np.repeat(d, (num_heads or d.shape[1]) // d.shape[1], axis=1)[..., None, None]


def fp8_kernel_runs(xp, out_dtype, head_dim, head_dim_v=None, modified=False):
    """Whether a dense call runs the FP8 kernel (the FP8 page; cuflash.gpu.fp8_plan.serves):
    on an H100/H200, a 16-bit output, head dims that are multiples of 16 up to 256 (v's
    no wider than q's), no score modifiers, the arrays' rows on the 16-byte grid."""
    dv = head_dim_v or head_dim
    return (
        xp is not np
        and cupy.cuda.Device().compute_capability == "90"
        and np.dtype(out_dtype).itemsize == 2
        and head_dim % 16 == 0
        and head_dim <= 256
        and dv % 16 == 0
        and dv <= head_dim
        and not modified
    )


def check_output(out, ref, out_dtype, fp8_kernel=False):
    """The output is of ``out_dtype`` and within twice the error of rounding the oracle to
    it, plus the floor (the float32 computation on the dequantized inputs), or within
    the FP8 kernel's stated error where it ran (``fp8_kernel``); NaN never passes."""
    host = to_numpy(out)
    assert host.dtype == np.dtype(out_dtype), host.dtype
    rounding = rel_error(ref.astype(out_dtype), ref)
    bound = FP8_KERNEL_TOLERANCE if fp8_kernel else 2 * rounding + FLOOR
    err = rel_error(host, ref)
    assert err <= bound, f"relative error {err:.3g} > {bound:.3g}"
    return err


def check_lse(lse, ref_lse, fp8_kernel=False):
    """lse within float32's error of the scores, or (``fp8_kernel``) within that of the
    FP8 tensor cores' accumulation of e4m3 products (the FP8 page)."""
    lse = to_numpy(lse)
    assert lse.dtype == np.float32
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert np.all(np.isfinite(lse[finite]))
    if finite.any():
        bound = (1e-3 if fp8_kernel else 1e-5) * (1 + np.abs(ref_lse[finite]).max())
        assert np.max(np.abs(lse[finite] - ref_lse[finite])) <= bound


def random_descales(rng, batch, kv_heads):
    """Per-(B, H_kv) descales about 1 (for unit normal e4m3 values)."""
    return tuple(rng.uniform(0.5, 2, (batch, kv_heads)).astype(np.float32) for _ in range(3))


def on(xp, descales):
    return tuple(xp.asarray(d) if isinstance(d, np.ndarray) else d for d in descales)


# --------------------------------------------------------------------------- the helpers


def test_decode_table_is_ml_dtypes_decoding():
    """All 256 bit patterns: the values ml_dtypes gives, NaN at 0x7F and 0xFF, -0 at 0x80;
    448 is the largest."""
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(E4M3).astype(np.float32)
    got = fp8.decode(codes)
    assert got.dtype == np.float32
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[[0x7F, 0xFF]]).all()
    assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    assert np.signbit(got[0x80]) and got[0x80] == 0 and np.nanmax(got) == 448
    # float8 arrays and strided views decode the same
    x = codes.view(E4M3).reshape(4, 64)[:, ::3]
    assert np.array_equal(fp8.decode(x), want.reshape(4, 64)[:, ::3], equal_nan=True)


def test_e4m3_values_are_exact_in_16_bit():
    """Every finite e4m3 value, subnormals included, is a bfloat16 and a float16 value (so
    a 16-bit dequantization would be exact too)."""
    values = fp8.DECODE_TABLE[np.isfinite(fp8.DECODE_TABLE)]
    for dtype in (BFLOAT16, np.float16):
        assert np.array_equal(values.astype(dtype).astype(np.float32), values)


def test_quantize_round_trips_within_e4m3_precision(rng):
    x = fresh(rng, (2, 4, 30, 16), outliers=True)
    values, descale = fp8.quantize(x, num_kv_heads=2)
    assert values.dtype == E4M3 and descale.shape == (2, 2) and descale.dtype == np.float32
    back = true_values(values, descale, 4)
    assert np.nanmax(np.abs(values.astype(np.float32))) == 448  # amax scaling
    normal = np.abs(back) >= 2.0**-6 * descale.min()
    assert np.all(np.abs(back - x)[normal] <= 2.0**-4 * np.abs(x)[normal])


# --------------------------------------------------------------------------- dense


DENSE = [
    dict(heads=4, kv_heads=2, q_len=70, kv_len=45, causal=True),
    dict(heads=4, kv_heads=1, q_len=50, kv_len=90, head_dim=128, window=(20, 3)),
    dict(heads=2, kv_heads=2, q_len=33, kv_len=60, head_dim=40, kv_seq_len=17, causal=True),
    dict(heads=6, kv_heads=3, q_len=20, kv_len=130, head_dim=64, head_dim_v=32, window=16),
]


def dense_call(rng, xp, case, descale_kind, storage="float8", outliers=False, **kw):
    """Run the dense forward on fresh quantized inputs; returns out, lse and the float64
    oracle's out, lse on the true (dequantized) values."""
    b, h, hk = 2, case["heads"], case["kv_heads"]
    d, dv = case.get("head_dim", 64), case.get("head_dim_v") or case.get("head_dim", 64)
    shapes = ((b, h, case["q_len"], d), (b, hk, case["kv_len"], d), (b, hk, case["kv_len"], dv))
    (q, k, v), descales = fp8_inputs(rng, shapes, descale_kind, hk, outliers)
    names = ("q_descale", "k_descale", "v_descale")
    given = {n: x for n, x in zip(names, on(xp, descales)) if x is not None}
    causal, window = case.get("causal", False), case.get("window", 0)
    out, lse = cuflash.flash_attention_fwd(
        *(stored(x, xp, storage) for x in (q, k, v)),
        h,
        hk,
        d,
        causal,
        window,
        case.get("kv_seq_len"),
        head_dim_v=case.get("head_dim_v"),
        **given,
        **storage_keyword(xp, storage),
        **kw,
    )
    ref_out, ref_lse = attention_reference(
        true_values(q, descales[0], h),
        true_values(k, descales[1]),
        true_values(v, descales[2]),
        causal,
        window,
        case.get("kv_seq_len"),
        softcap=kw.get("softcap", 0.0),
        alibi_slopes=None if kw.get("alibi_slopes") is None else to_numpy(kw["alibi_slopes"]),
        sinks=None if kw.get("sinks") is None else to_numpy(kw["sinks"]),
    )
    return out, lse, ref_out, ref_lse


@pytest.mark.parametrize("descale_kind", ["none", "scalar", "per_head"])
@pytest.mark.parametrize("case", DENSE, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("arrays", ARRAYS)
def test_dense_matches_oracle(arrays, case, descale_kind, rng, request):
    """bfloat16 out (the default) and float32 lse against the oracle."""
    xp = _xp(arrays, request)
    out, lse, ref_out, ref_lse = dense_call(rng, xp, case, descale_kind)
    d = case.get("head_dim", 64)
    kernel = fp8_kernel_runs(xp, BFLOAT16, d, case.get("head_dim_v"))
    check_output(out, ref_out, BFLOAT16, kernel)
    check_lse(lse, ref_lse, kernel)


@pytest.mark.parametrize("storage", ["float8", "bits"])
@pytest.mark.parametrize("out_dtype", list(OUT_DTYPES))
@pytest.mark.parametrize("arrays", ARRAYS)
def test_out_dtypes_and_storages(arrays, out_dtype, storage, rng):
    """out_dtype by name or dtype; uint8 bits with fp8_format give what float8 gives."""
    xp = _xp(arrays)
    dtype = OUT_DTYPES[out_dtype]
    name_or_dtype = out_dtype if storage == "bits" else dtype
    out, lse, ref_out, ref_lse = dense_call(
        rng, xp, DENSE[0], "per_head", storage, out_dtype=name_or_dtype
    )
    kernel = fp8_kernel_runs(xp, dtype, 64)
    err = check_output(out, ref_out, dtype, kernel)
    if out_dtype == "float32":
        assert err <= 2 * FLOOR  # float32 throughout: the dequantization is exact
    check_lse(lse, ref_lse, kernel)


@pytest.mark.parametrize("arrays", ARRAYS)
def test_outliers(arrays, rng):
    """0.1 % of the entries 20x larger (so the scaled scores reach the hundreds) and
    per-(B, H_kv) descales: still within the output's rounding of the oracle."""
    out, lse, ref_out, ref_lse = dense_call(
        rng, _xp(arrays), DENSE[1], "per_head", outliers=True, out_dtype=np.float32
    )
    check_output(out, ref_out, np.float32)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("arrays", ARRAYS)
def test_descales_change_the_result(arrays, rng):
    """The descales are applied: q's and k's scale the scores (a different softmax), v's
    the output; dropping one misses the oracle."""
    xp = _xp(arrays)
    b, h, hk, s, d = 1, 2, 1, 24, 32
    q, k, v = (fresh(rng, (b, n, s, d)).astype(E4M3) for n in (h, hk, hk))
    bits = [stored(x, xp, "float8") for x in (q, k, v)]
    kw = storage_keyword(xp, "float8")
    plain, _ = cuflash.flash_attention_fwd(*bits, h, hk, d, out_dtype="float32", **kw)
    sharper, _ = cuflash.flash_attention_fwd(
        *bits, h, hk, d, q_descale=2.0, k_descale=np.float32(1.5), out_dtype="float32", **kw
    )
    ref, _ = attention_reference(
        *(x.astype(np.float64) for x in (q, k, v)), softmax_scale=3.0 / math.sqrt(d)
    )
    check_output(sharper, ref, np.float32)
    assert rel_error(plain, ref) > 1e-2
    halved, _ = cuflash.flash_attention_fwd(
        *bits, h, hk, d, v_descale=0.5, out_dtype="float32", **kw
    )
    assert np.allclose(to_numpy(halved), 0.5 * to_numpy(plain), rtol=1e-6, atol=0)


@pytest.mark.parametrize("arrays", ARRAYS)
def test_modifiers_and_sinks(arrays, rng):
    """Soft-cap, ALiBi and attention sinks work on FP8 inputs as on 16-bit ones."""
    xp = _xp(arrays)
    slopes = xp.asarray(rng.uniform(0.01, 0.3, 4).astype(np.float32))
    sinks = xp.asarray(rng.uniform(-1, 2, 4).astype(np.float32))
    out, lse, ref_out, ref_lse = dense_call(
        rng, xp, DENSE[0], "per_head", softcap=8.0, alibi_slopes=slopes, sinks=sinks
    )
    check_output(out, ref_out, BFLOAT16)
    check_lse(lse, ref_lse)


def _user_modifiers(xp, table, documents, q_len, kv_len):
    """A relative-bias score_mod and a document mask as a block mask, on ``xp`` arrays."""
    from cuflash import modifiers
    from cuflash.block_mask import create_block_mask

    score_mod = modifiers.relative_bias_score(xp.asarray(table))
    mask_mod = modifiers.document_mask(xp.asarray(documents))
    return score_mod, mask_mod, create_block_mask(mask_mod, None, None, q_len, kv_len)


@pytest.mark.parametrize("arrays", ARRAYS)
def test_user_modifiers_and_block_masks(arrays, rng):
    """The user's score_mod and a block mask apply to FP8 inputs as to 16-bit ones."""
    xp = _xp(arrays)
    b, h, hk, s, d = 2, 4, 2, 96, 64
    shapes = ((b, h, s, d), (b, hk, s, d), (b, hk, s, d))
    (q, k, v), descales = fp8_inputs(rng, shapes, "per_head", hk)
    table = rng.uniform(-1, 1, (h, 9)).astype(np.float32)
    documents = np.repeat(np.arange(3), (40, 16, 40)).astype(np.int32)
    score_mod, _, block_mask = _user_modifiers(xp, table, documents, s, s)
    out, lse = cuflash.flash_attention_fwd(
        *(stored(x, xp, "float8") for x in (q, k, v)),
        h,
        hk,
        d,
        True,
        score_mod=score_mod,
        block_mask=block_mask,
        q_descale=xp.asarray(descales[0]),
        k_descale=xp.asarray(descales[1]),
        v_descale=xp.asarray(descales[2]),
        **storage_keyword(xp, "float8"),
    )
    host_score, host_mask, _ = _user_modifiers(np, table, documents, s, s)
    ref_out, ref_lse = attention_reference(
        true_values(q, descales[0], h),
        true_values(k, descales[1]),
        true_values(v, descales[2]),
        True,
        score_mod=host_score,
        mask_mod=host_mask,
    )
    check_output(out, ref_out, BFLOAT16)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("arrays", ARRAYS)
def test_bshd_views_and_empty_calls(arrays, rng):
    """[B, S, H, D] buffers viewed as [B, H, S, D] need no copy; an empty call returns
    empty arrays of out_dtype."""
    xp = _xp(arrays)
    b, s, h, d = 2, 19, 4, 32
    q, k, v = (fresh(rng, (b, s, h, d)).astype(E4M3) for _ in range(3))
    views = [stored(x, xp, "float8").transpose(0, 2, 1, 3) for x in (q, k, v)]
    kw = storage_keyword(xp, "float8")
    out, _ = cuflash.flash_attention_fwd(*views, h, h, d, True, out_dtype="float16", **kw)
    ref, _ = attention_reference(
        *(x.transpose(0, 2, 1, 3).astype(np.float64) for x in (q, k, v)), True
    )
    check_output(out, ref, np.float16, fp8_kernel_runs(xp, np.float16, d))
    empty = xp.asarray(np.zeros((0, h, s, d), np.uint8))
    out, lse = cuflash.flash_attention_fwd(empty, empty, empty, h, h, d, fp8_format="e4m3")
    assert out.shape == (0, h, s, d) and out.dtype == BFLOAT16 and lse.shape == (0, h, s)


# --------------------------------------------------------------------------- packed


@pytest.mark.parametrize(
    ("descale_kind", "storage"),
    [("scalar", "float8"), ("per_head", "float8"), ("per_head", "bits")],
)
@pytest.mark.parametrize("arrays", ARRAYS)
def test_packed_matches_oracle(arrays, descale_kind, storage, rng, request):
    """Each sequence against the oracle with its own row of descales (a sequence of no
    query row and one of no key included)."""
    xp = _xp(arrays, request)
    lengths_q, lengths_k, h, hk, d = [9, 0, 30, 4], [12, 5, 25, 0], 4, 2, 64
    q = fresh(rng, (sum(lengths_q), h, d)).astype(E4M3)
    k, v = (fresh(rng, (sum(lengths_k), hk, d)).astype(E4M3) for _ in "kv")
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    descales = random_descales(rng, len(lengths_q), hk)
    if descale_kind == "scalar":
        descales = tuple(float(d[0, 0]) for d in descales)
    out, lse = cuflash.flash_attention_varlen_fwd(
        *(stored(x, xp, storage) for x in (q, k, v)),
        xp.asarray(cu_q),
        xp.asarray(cu_k),
        max(lengths_q),
        max(lengths_k),
        h,
        hk,
        d,
        True,
        q_descale=on(xp, descales)[0],
        k_descale=on(xp, descales)[1],
        v_descale=on(xp, descales)[2],
        out_dtype="float32",
        check=xp is not np,
        **storage_keyword(xp, storage),
    )
    out, lse = to_numpy(out), to_numpy(lse)
    for s in range(len(lengths_q)):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        if q1 == q0:
            continue
        if k1 == k0:  # no key: zeros, lse -inf
            assert np.all(out[q0:q1] == 0) and np.all(np.isneginf(lse[:, q0:q1]))
            continue

        def seq(x, lo, hi, descale, heads, s=s):
            part = x[lo:hi].transpose(1, 0, 2)[None]
            one = descale if not isinstance(descale, np.ndarray) else descale[s : s + 1]
            return true_values(part, one, heads)

        ref_out, ref_lse = attention_reference(
            seq(q, q0, q1, descales[0], h),
            seq(k, k0, k1, descales[1], hk),
            seq(v, k0, k1, descales[2], hk),
            True,
        )
        check_output(out[q0:q1].transpose(1, 0, 2)[None], ref_out, np.float32)
        check_lse(lse[:, q0:q1][None], ref_lse)


# --------------------------------------------------------------------------- KV cache


def cache_oracle(q, k_cache, v_cache, lengths, block_table, block_size, descales, causal=True):
    """float64 out, lse of each sequence's first ``lengths[b]`` keys (after the append)."""
    b_count, h = q.shape[:2]
    outs, lses = [], []
    for b in range(b_count):
        positions = np.arange(lengths[b])
        if block_table is None:
            keys, values = k_cache[b][:, positions], v_cache[b][:, positions]
        else:
            blocks, rows = block_table[b, positions // block_size], positions % block_size
            keys = k_cache[blocks, :, rows].transpose(1, 0, 2)
            values = v_cache[blocks, :, rows].transpose(1, 0, 2)

        def row(d, b=b):
            return d if not isinstance(d, np.ndarray) else d[b : b + 1]

        out, lse = attention_reference(
            true_values(q[b : b + 1], row(descales[0]), h),
            true_values(keys[None], row(descales[1])),
            true_values(values[None], row(descales[2])),
            causal,
        )
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


@pytest.mark.parametrize("q_kind", ["e4m3", "bfloat16"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("arrays", ARRAYS)
def test_kvcache_appends_and_matches_oracle(arrays, paged, q_kind, rng, request):
    """The new keys land in the FP8 cache at each sequence's length (nothing else
    changes) and the rows attend to the dequantized cache with per-(B, H_kv) descales."""
    xp = _xp(arrays, request)
    b, h, hk, d, s_q, s_new, block_size = 3, 8, 2, 64, 2, 3, 16
    lengths = np.array([0, 21, 40], np.int32)
    if paged:
        blocks = 10
        table = rng.permutation(blocks)[: b * 3].reshape(b, 3).astype(np.int32)
        shape = (blocks, hk, block_size, d)
    else:
        table, shape = None, (b, hk, 48, d)
    k_cache, v_cache = (fresh(rng, shape).astype(E4M3) for _ in "kv")
    k_new, v_new = (fresh(rng, (b, hk, s_new, d)).astype(E4M3) for _ in "kv")
    if q_kind == "e4m3":
        q = fresh(rng, (b, h, s_q, d)).astype(E4M3)
        q_given = stored(q, xp, "float8")
    else:
        q = fresh(rng, (b, h, s_q, d)).astype(BFLOAT16)
        q_given = xp.asarray(q)
    descales = random_descales(rng, b, hk)
    caches = [stored(x, xp, "float8") for x in (k_cache, v_cache)]
    out, lse = cuflash.flash_attention_with_kvcache(
        q_given,
        *caches,
        h,
        hk,
        d,
        cache_seqlens=xp.asarray(lengths),
        k_new=stored(k_new, xp, "float8"),
        v_new=stored(v_new, xp, "float8"),
        block_table=None if table is None else xp.asarray(table),
        return_lse=True,
        q_descale=on(xp, descales)[0],
        k_descale=on(xp, descales)[1],
        v_descale=on(xp, descales)[2],
        check=xp is not np,
        **storage_keyword(xp, "float8"),
    )
    # the append: the expected caches, byte for byte
    want = [k_cache.copy(), v_cache.copy()]
    for cache, new in zip(want, (k_new, v_new)):
        for i in range(b):
            for t in range(s_new):
                pos = lengths[i] + t
                if table is None:
                    cache[i, :, pos] = new[i, :, t]
                else:
                    cache[table[i, pos // block_size], :, pos % block_size] = new[i, :, t]
    for got, expected in zip(caches, want):
        assert np.array_equal(to_numpy(got).view(np.uint8), expected.view(np.uint8))
    ref_out, ref_lse = cache_oracle(q, *want, lengths + s_new, table, block_size, descales)
    check_output(out, ref_out, BFLOAT16)  # a bfloat16 q's dtype, or the default
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("arrays", ARRAYS)
def test_kvcache_int_length_and_scalar_descales(arrays, rng):
    """An int cache_seqlens without new keys, scalar descales, float16 out, a window."""
    xp = _xp(arrays)
    b, h, hk, d, s_q, length = 2, 4, 4, 32, 3, 30
    k_cache, v_cache = (fresh(rng, (b, hk, 40, d)).astype(E4M3) for _ in "kv")
    q = fresh(rng, (b, h, s_q, d)).astype(E4M3)
    descales = (0.5, 2.0, 3.0)
    out = cuflash.flash_attention_with_kvcache(
        *(stored(x, xp, "bits") for x in (q, k_cache, v_cache)),
        h,
        hk,
        d,
        True,
        window_size=8,
        cache_seqlens=length,
        q_descale=descales[0],
        k_descale=descales[1],
        v_descale=descales[2],
        out_dtype=np.float16,
        fp8_format="e4m3",
    )
    want = []
    for i in range(b):
        o, _ = attention_reference(
            true_values(q[i : i + 1], 0.5),
            true_values(k_cache[i : i + 1, :, :length], 2.0),
            true_values(v_cache[i : i + 1, :, :length], 3.0),
            True,
            8,
        )
        want.append(o)
    check_output(out, np.concatenate(want), np.float16)


def test_kvcache_value_head_dim():
    """An FP8 cache whose v is narrower than k (head_dim_v, MLA's shape) takes the option
    as a 16-bit cache does: the output has v's head dim, the scale stays q's."""
    rng = np.random.default_rng(7)
    b, h, hk, d, dv, s_q, length = 2, 4, 1, 64, 32, 2, 37
    k_cache = fresh(rng, (b, hk, 48, d)).astype(E4M3)
    v_cache = fresh(rng, (b, hk, 48, dv)).astype(E4M3)
    q = fresh(rng, (b, h, s_q, d)).astype(E4M3)
    out = cuflash.flash_attention_with_kvcache(
        q, k_cache, v_cache, h, hk, d, cache_seqlens=length, head_dim_v=dv, q_descale=0.5
    )
    want, _ = attention_reference(
        true_values(q, 0.5),
        true_values(k_cache[:, :, :length], None),
        true_values(v_cache[:, :, :length], None),
        True,
    )
    assert out.shape == (b, h, s_q, dv)
    check_output(out, want, BFLOAT16)


# --------------------------------------------------------------------------- bad input


def _e4m3(*shape):
    return np.zeros(shape, E4M3)


class _OneRank:
    """A process group of one rank (ring attention's sample call)."""

    rank, size = 0, 1

    def exchange(self, obj):
        return obj


def fp8_bad_calls():
    """One invalid CPU call per FP8 message (the docs' error table shares them)."""
    q, kv = _e4m3(2, 4, 8, 16), _e4m3(2, 2, 8, 16)
    bits = np.zeros((2, 2, 8, 16), np.uint8)

    def fwd(q=q, k=kv, v=kv, **kw):
        return lambda: cuflash.flash_attention_fwd(q, k, v, 4, 2, 16, **kw)

    def kv_call(q=_e4m3(2, 4, 1, 16), cache=_e4m3(2, 2, 8, 16), **kw):
        return lambda: cuflash.flash_attention_with_kvcache(
            q, cache, cache, 4, 2, 16, cache_seqlens=2, **kw
        )

    f32 = np.zeros((2, 2, 8, 16), np.float32)
    return [
        fwd(k=bits, v=bits),
        fwd(k=np.zeros((2, 2, 8, 16), ml_dtypes.float8_e5m2)),
        fwd(k=f32.astype(np.float16)),
        fwd(q=bits.repeat(2, 1), k=bits, v=bits, fp8_format="e5m2"),
        fwd(q=f32.repeat(2, 1), k=f32, v=f32, q_descale=2.0),
        fwd(k=kv.view(np.uint8), v=kv.view(np.uint8), fp8_format="e4m3"),
        fwd(q_descale=np.ones((2, 4), np.float32)),
        fwd(k_descale=np.ones((2, 2))),
        fwd(v_descale=[1.0, 2.0]),
        fwd(q_descale=0.0),
        fwd(k_descale=np.array([[1, -1], [1, 1]], np.float32)),
        fwd(out_dtype=np.float64),
        kv_call(q=np.zeros((2, 4, 1, 16), np.float32)),
        kv_call(rotary_cos=np.zeros((8, 8), np.float32), rotary_sin=np.zeros((8, 8), np.float32)),
        lambda: cuflash.flash_attention_bwd(
            q, q, kv, kv, q, np.zeros((2, 4, 8), np.float32), 4, 2, 16
        ),
        lambda: cuflash.flash_attention_vjp(q, kv, kv, 4, 2, 16),
        lambda: dist.ring_attention_fwd(q, q, q, 4, 4, 16, True, group=_OneRank()),
    ]


EXPECTED = [
    "k: uint8 arrays hold FP8 only with fp8_format='e4m3' naming the bits (CuPy has no "
    "float8 dtype)",
    "k: unsupported FP8 dtype float8_e5m2; expected float8_e4m3fn (e4m3)",
    "k: dtype float16 mixed with FP8 q; FP8 attention takes q, k and v all in e4m3 "
    "(only a KV-cache call takes a 16-bit q)",
    "fp8_format: expected one of 'e4m3', got 'e5m2'",
    "q, k, v: none is FP8 (float8_e4m3fn, or uint8 with fp8_format): fp8_format, the descales "
    "and out_dtype are for FP8 inputs only",
    "k: dtype uint8 differs from q's float8_e4m3fn",
    "q_descale: expected a scalar or shape (2, 2) [B, num_kv_heads], got (2, 4)",
    "k_descale: expected dtype float32, got float64",
    "v_descale: expected a float or a float32 [B, num_kv_heads] numpy array, got list",
    "q_descale: must be positive and finite, got 0.0",
    "k_descale: must be positive and finite everywhere",
    "out_dtype: expected float32, float16 or bfloat16, got float64",
    "q: dtype float32 with an FP8 cache; expected FP8 like the cache, float16 or bfloat16",
    "rotary_cos: not with an FP8 cache: the rotated keys would be rounded to e4m3; rotate k "
    "before quantizing it",
    "q: dtype float8_e4m3fn: FP8 inputs are for the forward functions only; the backward, "
    "the vjp and ring attention take float32, float16 or bfloat16",
    "q: dtype float8_e4m3fn: FP8 inputs are for the forward functions only; the backward, "
    "the vjp and ring attention take float32, float16 or bfloat16",
    "q: dtype float8_e4m3fn: FP8 inputs are for the forward functions only; the backward, "
    "the vjp and ring attention take float32, float16 or bfloat16",
]


@pytest.mark.parametrize("index", range(len(EXPECTED)))
def test_bad_input_raises_before_anything_runs(index):
    """Each bad call raises InvalidArgumentError with its message."""
    call = fp8_bad_calls()[index]
    with pytest.raises(cuflash.InvalidArgumentError) as info:
        call()
    assert str(info.value) == EXPECTED[index]


def test_bad_input_leaves_the_cache_alone(rng):
    """A bad descale on a call with new keys raises before the append writes the cache."""
    cache = fresh(rng, (1, 1, 8, 16)).astype(E4M3)
    new = fresh(rng, (1, 1, 2, 16)).astype(E4M3)
    before = cache.copy()
    with pytest.raises(cuflash.InvalidArgumentError):
        cuflash.flash_attention_with_kvcache(
            fresh(rng, (1, 2, 1, 16)).astype(E4M3),
            cache,
            cache,
            2,
            1,
            16,
            cache_seqlens=3,
            k_new=new,
            v_new=new,
            v_descale=np.ones((1, 2), np.float32),
        )
    assert np.array_equal(cache.view(np.uint8), before.view(np.uint8))


def test_packed_bad_descale_names_the_sequences():
    q, kv = _e4m3(10, 4, 16), _e4m3(12, 2, 16)
    cu_q, cu_k = np.array([0, 4, 10], np.int32), np.array([0, 5, 12], np.int32)
    with pytest.raises(cuflash.InvalidArgumentError, match=r"shape \(2, 2\)"):
        cuflash.flash_attention_varlen_fwd(
            q, kv, kv, cu_q, cu_k, 8, 8, 4, 2, 16, q_descale=np.ones((3, 2), np.float32)
        )
    with pytest.raises(cuflash.InvalidArgumentError, match="forward functions only"):
        cuflash.flash_attention_varlen_vjp(q, kv, kv, cu_q, cu_k, 8, 8, 4, 2, 16)


def test_nan_input_is_never_hidden(rng):
    """A NaN bit pattern (0x7F) in v reaches the output of every row that sees it (and,
    by IEEE rules, possibly others: 0 x NaN is NaN)."""
    q, k, v = (fresh(rng, (1, 1, 6, 16)).astype(E4M3) for _ in range(3))
    v.view(np.uint8)[0, 0, 2, 5] = 0x7F
    out, _ = cuflash.flash_attention_fwd(q, k, v, 1, 1, 16, True, out_dtype="float32")
    assert np.isnan(out[0, 0, 2:, 5]).all()


@pytest.mark.gpu
def test_gpu_matches_cpu_path_on_poisoned_memory(poisoned, rng):
    """Every GPU allocation starts as NaN: the GPU path writes every output element and
    agrees with the CPU path (the same float32 computation) to float32 accumulation."""
    case = DENSE[2]
    b, h, hk, d = 2, case["heads"], case["kv_heads"], case["head_dim"]
    shapes = ((b, h, case["q_len"], d), (b, hk, case["kv_len"], d), (b, hk, case["kv_len"], d))
    (q, k, v), descales = fp8_inputs(rng, shapes, "per_head", hk)
    kw = dict(kv_seq_len=case["kv_seq_len"], out_dtype="float32")
    names = dict(zip(("q_descale", "k_descale", "v_descale"), descales))
    cpu_out, cpu_lse = cuflash.flash_attention_fwd(q, k, v, h, hk, d, True, **kw, **names)
    gpu_out, gpu_lse = cuflash.flash_attention_fwd(
        *(cupy.asarray(x.view(np.uint8)) for x in (q, k, v)),
        h,
        hk,
        d,
        True,
        fp8_format="e4m3",
        **kw,
        **{n: cupy.asarray(x) for n, x in names.items()},
    )
    assert rel_error(gpu_out, cpu_out.astype(np.float64)) <= 10 * FLOOR
    assert np.all(np.isfinite(to_numpy(gpu_lse)) == np.isfinite(cpu_lse))
    seen = np.isfinite(cpu_lse)
    assert math.isfinite(float(np.abs(to_numpy(gpu_lse)[seen] - cpu_lse[seen]).max()))
