"""The native FP8 forward (``forward_wgmma_ws``'s FP8 role after ``fp8_transpose_v``,
cuflash/gpu/fp8_plan.py) in the CPU simulator against the float64 oracle on the
dequantized inputs, as the GPU plan launches it (the same parameter records and tensor
maps); V^T's layout byte for byte; and, marked ``gpu``, the same through the public
function on an H100/H200, where the plan serves the call.

The kernel rounds P to e4m3 (3 mantissa bits) before P V, so its error is FP8's, not
the output's rounding: ``support.FP8_KERNEL_TOLERANCE`` is the bound the FP8 page states."""

import math

import ml_dtypes
import numpy as np
import pytest
import simulator
from support import BFLOAT16, FP8_KERNEL_TOLERANCE, cupy, rel_error, to_numpy

import cuflash
from cuflash import fp8
from cuflash.core.config import AttentionConfig
from cuflash.core.problem import forward_problem
from cuflash.gpu import fp8_plan, kernel_params, plans, registry
from cuflash.gpu.tile_traits import round_up
from cuflash.reference import attention_reference

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
WS_FORWARD = registry.BY_NAME["forward_wgmma_ws"]
NO_USER_ARGUMENTS = np.zeros(1, dtype=kernel_params.USER_ARGS_DTYPE)


def _fp8_values(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(E4M3)


def expected_vt(v, rows, keys):
    """V^T as fp8_transpose_v writes it: ``[B, H_kv, rows, keys]`` bytes, each 16 keys
    permuted (position 4 t + i holds key 2 t + i, or 8 + 2 t + i - 2 for i >= 2)."""
    b, hk, kv_len, dv = v.shape
    vt = np.zeros((b, hk, rows, keys), np.uint8)
    bits = v.view(np.uint8)
    for p in range(min(keys, round_up(kv_len, 16))):
        r, t, i = p % 16, (p % 16) // 4, p % 4
        key = p - r + (2 * t + i if i < 2 else 8 + 2 * t + i - 2)
        if key < kv_len:
            vt[:, :, :dv, p] = bits[:, :, key, :]
    return vt


def simulated(
    q,
    k,
    v,
    num_heads,
    kv_heads,
    causal=False,
    window=0,
    scales=(None, None),
    sinks=None,
    out_dtype=BFLOAT16,
    kv_seq_len=None,
    guard=False,
):
    """``(out, lse)`` of the FP8 role in the simulator, launched as the GPU plan launches
    it: the transpose, then the attention through its tensor maps; outputs poisoned."""
    d, dv = q.shape[3], v.shape[3]
    config = AttentionConfig(
        num_heads,
        kv_heads,
        d,
        causal,
        window,
        kv_seq_len,
        head_dim_v=None if dv == d else dv,
        sinks=sinks,
    )
    bits = [x.view(np.uint8) for x in (q, k, v)]
    problem = forward_problem(*bits, config, storage_dtype=np.dtype(np.uint8))
    role = WS_FORWARD.name + registry.FP8
    traits = WS_FORWARD.traits_of(d, fp8=True)
    forward_name = WS_FORWARD.name_expression(role, out_dtype, d, None if dv == d else dv)
    transpose_name = fp8_plan.TRANSPOSE.name_expression()
    transpose = simulator.build([transpose_name], headers=(fp8_plan.TRANSPOSE.source,), arch=90)
    attention = simulator.build([forward_name], arch=90)

    rows, keys = round_up(dv, 16), round_up(problem.kv_len, 16)
    vt = np.full((problem.batch, kv_heads, rows, keys), 0x7F, np.uint8)  # NaN bytes
    strides = [tuple(np.int64(s) for s in x.strides[:3]) for x in bits]
    params = kernel_params.fp8_transpose_params(problem, strides[2], rows, keys)
    grid = (math.ceil(keys / 64), math.ceil(rows / 64), problem.batch * kv_heads)
    transpose.launch(transpose_name, grid, 256, 0, (params, (bits[2], vt)), guard)

    vt_strides = tuple(np.int64(s) for s in vt.strides[:3])
    maps = kernel_params.fp8_forward_maps(
        problem,
        traits,
        [bits[0].shape, bits[1].shape, vt.shape],
        [strides[0], strides[1], vt_strides],
        simulator.encode_tensor_map,
    )
    assert maps is not None
    out = np.full((problem.batch, num_heads, problem.q_len, dv), np.nan, out_dtype)
    lse = np.full(problem.lse_shape, np.nan, np.float32)
    query_tiles = math.ceil(problem.q_len / traits.tile)
    out_strides = tuple(np.int64(s // out.itemsize) for s in out.strides[:3])
    params = kernel_params.forward_params(
        problem,
        strides[0],
        strides[1],
        vt_strides,
        out_strides,
        NO_USER_ARGUMENTS,
        maps=maps,
        query_tiles=query_tiles,
        fp8=True,
    )
    per_head = [
        np.repeat(
            np.broadcast_to(np.float32(1.0 if s is None else s), (problem.batch, kv_heads)),
            num_heads // kv_heads,
            axis=1,
        ).astype(np.float32)
        for s in scales
    ]
    arrays = (bits[0], bits[1], vt, out, lse, *per_head, sinks)
    attention.launch(
        forward_name,
        (query_tiles, num_heads, problem.batch),
        traits.threads,
        traits.shared_bytes,
        (params, arrays),
        guard,
    )
    return out, lse, vt


def oracle(q, k, v, num_heads, causal, window, scales, sinks=None, kv_seq_len=None):
    query, value = (1.0 if s is None else np.asarray(s, np.float64) for s in scales)
    group = num_heads // k.shape[1]

    def heads(x):
        return x if np.ndim(x) == 0 else np.repeat(x, group, axis=1)[..., None, None]

    qf = q.astype(np.float64) * heads(query)
    out, lse = attention_reference(
        qf, k.astype(np.float64), v.astype(np.float64), causal, window, kv_seq_len, sinks=sinks
    )
    return out * heads(value), lse


CASES = [
    dict(b=1, h=2, hk=1, sq=136, sk=200, d=128, causal=False),
    dict(b=2, h=2, hk=2, sq=70, sk=150, d=64, causal=True),
    dict(b=1, h=3, hk=1, sq=40, sk=300, d=96, causal=False, window=(64, 8)),
    dict(b=1, h=1, hk=1, sq=64, sk=140, d=256, causal=True),
    dict(b=2, h=2, hk=1, sq=50, sk=180, d=32, causal=True, kv_seq_len=133),
    # three consumers each with rows (up to D = 96), the second block's partial
    dict(b=1, h=2, hk=1, sq=230, sk=260, d=64, causal=False),
    dict(b=1, h=1, hk=1, sq=150, sk=170, d=96, causal=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c['d']}-causal{int(c['causal'])}")
def test_simulated_fp8_forward_matches_oracle(case, rng):
    """Fresh e4m3 inputs with per-(B, H_kv) descales: out within FP8's error of the oracle,
    lse within the scores' float32 rounding; V^T exactly as expected."""
    b, h, hk, d = case["b"], case["h"], case["hk"], case["d"]
    q = _fp8_values(rng, (b, h, case["sq"], d))
    k = _fp8_values(rng, (b, hk, case["sk"], d))
    v = _fp8_values(rng, (b, hk, case["sk"], d))
    # scores of about unit size (q's descale times k's near 1 on unit-normal values), so
    # that P spreads over e4m3's range as on real inputs
    scales = tuple(rng.uniform(0.5, 1.5, (b, hk)).astype(np.float32) for _ in range(2))
    window, kv_seq_len = case.get("window", 0), case.get("kv_seq_len")
    # every array between guard pages: a read past v's rows or vt's end faults
    out, lse, vt = simulated(
        q, k, v, h, hk, case["causal"], window, scales, kv_seq_len=kv_seq_len, guard=True
    )
    assert np.array_equal(vt, expected_vt(v[:, :, : kv_seq_len or v.shape[2]], *vt.shape[2:]))
    ref_out, ref_lse = oracle(q, k, v, h, case["causal"], window, scales, kv_seq_len=kv_seq_len)
    assert not np.isnan(out.astype(np.float32)).any()
    err = rel_error(out.astype(np.float64), ref_out)
    assert err <= FP8_KERNEL_TOLERANCE, err
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    assert np.max(np.abs(lse[finite] - ref_lse[finite])) <= 1e-3 * (1 + np.abs(ref_lse).max())


def test_simulated_fp8_forward_sinks_and_float16(rng):
    """Attention sinks join each row's sum; float16 output."""
    q = _fp8_values(rng, (1, 2, 64, 64))
    k, v = (_fp8_values(rng, (1, 2, 130, 64)) for _ in range(2))
    sinks = rng.standard_normal(2).astype(np.float32)
    out, lse, _ = simulated(
        q, k, v, 2, 2, True, sinks=sinks, scales=(0.1, 0.5), out_dtype=np.dtype(np.float16)
    )
    assert out.dtype == np.float16
    ref_out, ref_lse = oracle(q, k, v, 2, True, 0, (0.1, 0.5), sinks=sinks)
    assert rel_error(out.astype(np.float64), ref_out) <= FP8_KERNEL_TOLERANCE


def test_simulated_fp8_forward_wrong_permutation_fails(rng):
    """A V^T without the key permutation (the plain transpose) pairs P with the wrong
    values: the oracle check above could fail."""
    q = _fp8_values(rng, (1, 1, 64, 64))
    k, v = (_fp8_values(rng, (1, 1, 64, 64)) for _ in range(2))
    out, _, vt = simulated(q, k, v, 1, 1)
    good = rel_error(out.astype(np.float64), oracle(q, k, v, 1, False, 0, (None, None))[0])
    # the same softmax weights against a plain transpose's value order
    keys = np.arange(64)
    r, t, i = keys % 16, (keys % 16) // 4, keys % 4
    perm = keys - r + np.where(i < 2, 2 * t + i, 8 + 2 * t + i - 2)
    shuffled = v.copy()
    shuffled[:, :, perm] = v  # value of key perm[p] moved to row p: what the kernel sees
    bad = rel_error(out.astype(np.float64), oracle(q, k, shuffled, 1, False, 0, (None, None))[0])
    assert good <= FP8_KERNEL_TOLERANCE < bad


@pytest.mark.gpu
@pytest.mark.parametrize(
    "d, causal", [(64, False), (128, True), (128, False), (96, True), (256, False), (192, True)]
)
def test_gpu_fp8_kernel_matches_oracle(d, causal, rng, poisoned):
    """Through the public function on an H100/H200 (the plan serves these calls): fresh
    quantized inputs, out within FP8's error, lse close."""
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the FP8 kernel runs on compute capability 9.0")
    b, h, hk, s = 2, 4, 2, 600
    x = [rng.standard_normal(shape) for shape in ((b, h, s, d), (b, hk, s, d), (b, hk, s, d))]
    (q, qd), (k, kd), (v, vd) = (fp8.quantize(a, num_kv_heads=hk) for a in x)
    plans.clear()
    out, lse = cuflash.flash_attention_fwd(
        *(cupy.asarray(a.view(np.uint8)) for a in (q, k, v)),
        h,
        hk,
        d,
        causal,
        fp8_format="e4m3",
        q_descale=cupy.asarray(qd),
        k_descale=cupy.asarray(kd),
        v_descale=cupy.asarray(vd),
    )
    assert any(isinstance(p, fp8_plan.Fp8ForwardPlan) for p in plans._PLANS.values())
    ref_out, ref_lse = oracle(q, k, v, h, causal, 0, (qd * kd, vd))
    host = to_numpy(out)
    assert host.dtype == BFLOAT16 and not np.isnan(host.astype(np.float32)).any()
    assert rel_error(host.astype(np.float64), ref_out) <= FP8_KERNEL_TOLERANCE
    got = to_numpy(lse)
    assert np.max(np.abs(got - ref_lse)) <= 1e-3 * (1 + np.abs(ref_lse).max())
