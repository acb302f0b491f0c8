"""Score modifiers (the semantics page, section 'Score modifiers'): soft-capping and
ALiBi, forward and backward, on the CPU path (CI) and the GPU kernels (marked gpu), dense
and packed, against the float64 oracle; their validation errors; the oracle's own
derivative against finite differences; the kernel registry's choices with modifiers."""

import math

import numpy as np
import pytest
from support import (
    DTYPES,
    FLOOR,
    Case,
    alibi_slopes,
    check_modified_results,
    cupy,
    random_inputs,
    rel_error,
    to_numpy,
)

import cuflash
from cuflash.gpu import registry
from cuflash.reference import attention_reference, attention_reference_grad

BOUND = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}

# (softcap, ALiBi slopes' shape: None, "heads" or "batch_heads")
MODIFIERS = [(5.0, None), (0.0, "heads"), (2.0, "batch_heads")]


def _check(
    rng,
    xp,
    dtype="float32",
    batch=2,
    heads=4,
    kv_heads=2,
    q_len=45,
    kv_len=70,
    head_dim=64,
    causal=True,
    window=0,
    kv_seq_len=None,
    softcap=5.0,
    alibi=None,
    deterministic=False,
):
    """Forward and backward with modifiers against the oracle (relative errors)."""

    def make(h, n):
        return rng.standard_normal((batch, h, n, head_dim)).astype(DTYPES[dtype])

    host = [make(heads, q_len), make(kv_heads, kv_len), make(kv_heads, kv_len), make(heads, q_len)]
    slopes = alibi_slopes(rng, alibi, batch, heads)
    q, k, v, dout = (xp.asarray(x) for x in host)
    kw = dict(
        kv_seq_len=kv_seq_len,
        softcap=softcap,
        alibi_slopes=None if slopes is None else xp.asarray(slopes),
    )
    args = (heads, kv_heads, head_dim, causal, window)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *args, **kw)
    grads = cuflash.flash_attention_bwd(
        dout, q, k, v, out, lse, *args, **kw, deterministic=deterministic
    )
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
        numeric = (
            np.sum(attention_reference(plus, k, v, True, 0, **kw)[0] * dout)
            - np.sum(attention_reference(minus, k, v, True, 0, **kw)[0] * dout)
        ) / (2 * eps)
        assert abs(numeric - dq[index]) < 1e-6 * max(1.0, abs(numeric)), index


def test_modifiers_change_the_result(rng):
    """A soft-cap and ALiBi are not no-ops (the tests above could not fail otherwise)."""
    q, k, v = (rng.standard_normal((1, 2, 20, 16)).astype(np.float32) * 3 for _ in range(3))
    plain, _ = cuflash.flash_attention_fwd(q, k, v, 2, 2, 16, True)
    capped, _ = cuflash.flash_attention_fwd(q, k, v, 2, 2, 16, True, softcap=1.0)
    biased, _ = cuflash.flash_attention_fwd(
        q, k, v, 2, 2, 16, True, alibi_slopes=np.array([0.5, 1.0], np.float32)
    )
    assert rel_error(capped.astype(np.float64), plain.astype(np.float64)) > 0.05
    assert rel_error(biased.astype(np.float64), plain.astype(np.float64)) > 0.05


def test_cpu_packed_alibi_per_sequence(rng):
    """[B, H] slopes in a packed batch: one row a sequence, positions within it."""
    lengths = [7, 0, 19, 11]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, heads, d = int(offsets[-1]), 2, 16
    q, k, v = (rng.standard_normal((total, heads, d)).astype(np.float32) for _ in range(3))
    slopes = rng.uniform(0.1, 0.9, size=(len(lengths), heads)).astype(np.float32)
    out, _ = cuflash.flash_attention_varlen_fwd(
        q, k, v, offsets, offsets, 19, 19, heads, heads, d, True, softcap=3.0, alibi_slopes=slopes
    )
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
        (
            fwd(alibi_slopes=np.zeros(3, np.float32)),
            r"alibi_slopes: expected shape \(4,\) or \(2, 4\), got \(3,\)",
        ),
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
    with pytest.raises(
        cuflash.InvalidArgumentError,
        match=r"alibi_slopes: expected shape \(2,\) or \(2, 2\), got \(1, 2\)",
    ):
        cuflash.flash_attention_varlen_fwd(
            q, q, q, cu, cu, 6, 6, 2, 2, 8, alibi_slopes=np.ones((1, 2), np.float32)
        )


def test_registry_has_modified_kernels_for_every_call():
    """Every (dtype, head_dim, GPU, option) a plain call serves has kernels compiled with
    the modifiers, forward and backward (and their dQ pass), in the variant
    the GPU path loads; 16-bit calls keep the tensor cores (the backward before Hopper at
    the mma.sync kernel's head dims 64 and 128)."""
    from cuflash.gpu import kernel_build

    for dtype in DTYPES.values():
        for head_dim in kernel_build.HEAD_DIMS:
            for capability in (80, 86, 90):
                names = kernel_build.Variant(
                    dtype, head_dim, registry.generation(capability)
                ).kernel_names()
                for direction in ("forward", "backward"):
                    for allow_tf32 in (False, True):
                        for tensor_cores in (True, False):
                            spec = registry.choose(
                                direction,
                                dtype,
                                head_dim,
                                capability,
                                allow_tf32=allow_tf32,
                                tensor_cores=tensor_cores,
                                modified=True,
                            )
                            assert spec.modifiers, (spec.name, dtype, head_dim, capability)
                            for atomic_dq in (False, spec.atomic_dq(head_dim)):
                                role = spec.role(atomic_dq=atomic_dq, modified=True)
                                assert role in names, role
                            if direction == "backward":  # dQ's pass (deterministic calls)
                                dq = spec.dq_pass()
                                assert dq.role(modified=True) in names, dq.name
                    spec = registry.choose(direction, dtype, head_dim, capability, modified=True)
                    if dtype == DTYPES["float32"] or (
                        direction == "backward" and capability < 90 and head_dim not in (64, 128)
                    ):
                        assert spec.instruction == "cuda cores", spec.name
                    else:
                        assert spec.instruction != "cuda cores", spec.name


# ---- GPU -------------------------------------------------------------------------------
# Each modifier alone ([H] and [B, H] slopes alike) and both together, against the float64
# oracle by the rule of the other GPU tests (support.check_close: at most twice the error
# of the naive computation in the dtype, plus the floor), on NaN-poisoned allocations.

GPU_MODIFIERS = [
    (5.0, None),
    (0.0, "heads"),
    (0.0, "batch_heads"),
    (2.0, "heads"),
    (2.0, "batch_heads"),
]

# Head dims of each tile class (40: the 64 class off the k16 grid; 96: the 128 class;
# 192: the 256 class's backward with a copy of its loop a warpgroup),
# causal and not, GQA, windows, S_q != S_k both ways (ALiBi's position p = i + S_k - S_q),
# several key tiles (the pipelined wgmma loop), keys past kv_seq_len, rows that see no key.
GPU_SHAPES = [
    dict(head_dim=64),
    dict(head_dim=64, q_len=200, kv_len=333, causal=False),
    dict(head_dim=128, heads=8, kv_heads=2, q_len=150, kv_len=300),
    dict(head_dim=256, q_len=33, kv_len=90),
    dict(head_dim=40, causal=False, window=(20, 3)),
    dict(head_dim=96, q_len=130, kv_len=100, kv_seq_len=77),
    dict(head_dim=192, q_len=70, kv_len=130, causal=False),
]


def _gpu_case(dtype, **shape):
    """A support.Case with this file's defaults (GQA 4/2, S_q 45, S_k 70, causal)."""
    return Case(
        **{
            **dict(dtype=dtype, batch=2, heads=4, kv_heads=2, q_len=45, kv_len=70, causal=True),
            **shape,
        }
    )


def _gpu_run(case, rng, softcap, alibi, deterministic=False, slopes_view=None):
    """Forward and backward of ``case`` on the GPU with the modifiers, checked by
    :func:`support.check_modified_results`. ``slopes_view`` turns the device slopes into
    another view of the same values (a strided one, say)."""
    q, k, v, dout = random_inputs(case, rng, cupy)
    slopes = alibi_slopes(rng, alibi, case.batch, case.heads)
    device_slopes = None if slopes is None else cupy.asarray(slopes)
    if slopes_view is not None and device_slopes is not None:
        device_slopes = slopes_view(device_slopes)
    kw = dict(kv_seq_len=case.kv_seq_len, softcap=softcap, alibi_slopes=device_slopes)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args, **kw)
    grads = cuflash.flash_attention_bwd(
        dout, q, k, v, out, lse, *case.args, **kw, deterministic=deterministic
    )
    check_modified_results(case, (q, k, v, dout), (out, lse, *grads), softcap, slopes)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("softcap, alibi", GPU_MODIFIERS, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_matches_oracle(shape, softcap, alibi, dtype, deterministic, rng, poisoned):
    _gpu_run(_gpu_case(dtype, **shape), rng, softcap, alibi, deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("path", ["mma_sync", "general"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_other_kernels(path, dtype, deterministic, rng, poisoned):
    """The mma.sync kernels (the path before Hopper) and the general ones take the
    modifiers too."""
    from cuflash import dispatch

    context = (
        dispatch.kernel_path("general")
        if path == "general"
        else dispatch.skip_kernels(
            "forward_wgmma_ws", "forward_wgmma", "backward_wgmma_ws", "backward_wgmma"
        )
    )
    with context:
        for head_dim in (40, 64, 128):
            for softcap, alibi in ((4.0, "batch_heads"), (0.0, "heads")):
                case = _gpu_case(dtype, head_dim=head_dim, q_len=100, kv_len=150)
                _gpu_run(case, rng, softcap, alibi, deterministic)


def _gpu_run_inputs(case, inputs, softcap, slopes=None):
    """Forward and backward of ``case`` on the given inputs (CuPy), checked by
    support.check_modified_results."""
    q, k, v, dout = inputs
    kw = dict(softcap=softcap, alibi_slopes=None if slopes is None else cupy.asarray(slopes))
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args, **kw)
    grads = cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *case.args, **kw)
    check_modified_results(case, inputs, (out, lse, *grads), softcap, slopes)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [30.0, 50.0])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_softcap_rows_far_below_the_cap(dtype, softcap, causal, rng, poisoned):
    """A soft-cap alone lets the bfloat16 forward take the cap as every row's max (caps
    up to 41.5): rows whose scores all sit far below it (about -1.5 cap, tanh near -0.9)
    lose nothing; larger caps and float16 track the max."""
    case = _gpu_case(
        dtype, batch=1, heads=2, kv_heads=2, q_len=300, kv_len=300, head_dim=128, causal=causal
    )
    unit = np.ones(case.head_dim) / math.sqrt(case.head_dim)
    size = 1.5 * softcap * math.sqrt(case.head_dim) / 4.0  # |q . k| scale = 1.5 cap
    sign = np.where(np.arange(case.q_len) % 3 == 0, 1.0, -1.0)[:, None]  # a third above
    shape = (case.batch, case.heads, case.q_len, case.head_dim)
    q = sign * size * unit + 0.5 * rng.standard_normal(shape)
    k = 4.0 * unit + 0.5 * rng.standard_normal(shape)
    v, dout = rng.standard_normal(shape), rng.standard_normal(shape)
    inputs = [cupy.asarray(x.astype(DTYPES[dtype])) for x in (q, k, v, dout)]
    _gpu_run_inputs(case, inputs, softcap)


@pytest.mark.gpu
@pytest.mark.parametrize("rise", [3.0, 12.0])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_running_max_climbs(dtype, rise, rng, poisoned):
    """Scores that climb from key tile to key tile (by `rise` in base 2 a tile of 128
    keys: under and over the forward's slack of 8 before it moves a row's max), with a
    soft-cap and ALiBi too: the lazy running max loses nothing."""
    case = _gpu_case(
        dtype, batch=1, heads=2, kv_heads=2, q_len=200, kv_len=1024, head_dim=128, causal=False
    )
    unit = np.ones(case.head_dim) / math.sqrt(case.head_dim)
    scale = 1 / math.sqrt(case.head_dim)
    # score of key j: 2 (0.5 + c j) scale with q = 2 unit, c the climb a key
    climb = rise * math.log(2) / 128 / (2 * scale)
    keys = np.arange(case.kv_len)[:, None]
    q = 2.0 * unit + 0.3 * rng.standard_normal((1, 2, case.q_len, case.head_dim))
    k = (0.5 + climb * keys) * unit + 0.3 * rng.standard_normal((1, 2, case.kv_len, case.head_dim))
    v = rng.standard_normal(k.shape)
    dout = rng.standard_normal(q.shape)
    inputs = [cupy.asarray(x.astype(DTYPES[dtype])) for x in (q, k, v, dout)]
    for softcap, slopes in ((0.0, None), (40.0, None), (0.0, np.array([0.01, 0.002], np.float32))):
        _gpu_run_inputs(case, inputs, softcap, slopes)


@pytest.mark.gpu
def test_gpu_slopes_are_read_at_each_call(rng, poisoned):
    """One plan serves calls with other slopes of the same signature (the values are not
    part of it), and a strided view of the slopes reads the values it shows."""
    case = _gpu_case("bfloat16", head_dim=64, q_len=80, kv_len=120)
    for _ in range(2):
        _gpu_run(case, rng, 0.0, "batch_heads")
    _gpu_run(
        case, rng, 3.0, "batch_heads", slopes_view=lambda s: cupy.ascontiguousarray(s.T).T
    )  # [B, H], column-major
    _gpu_run(case, rng, 0.0, "heads", slopes_view=lambda s: cupy.repeat(s, 2)[::2])  # [H], stride 2


# Per sequence: S_q != S_k both ways (ALiBi's p = i + S_k - S_q within each sequence),
# an empty sequence, one without keys (its rows: zeros, lse -inf), several key tiles.
PACKED_LENGTHS = ([70, 0, 200, 33, 5], [90, 12, 150, 33, 0])
PACKED_SHAPES = [
    dict(head_dim=64, causal=True, window=0),
    dict(head_dim=128, causal=False, window=(30, 10)),
    dict(head_dim=40, causal=True, window=0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("softcap, alibi", GPU_MODIFIERS, ids=str)
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=str)
def test_gpu_packed_with_modifiers(shape, softcap, alibi, dtype, deterministic, rng, poisoned):
    """Packed batches: [B, H] slopes are one row a sequence, positions count within each
    sequence; each sequence against the oracle as a dense problem."""
    lengths_q, lengths_k = PACKED_LENGTHS
    heads, kv_heads, d = 4, 2, shape["head_dim"]
    causal, window = shape["causal"], shape["window"]

    def make(total, h):
        return rng.standard_normal((total, h, d)).astype(DTYPES[dtype])

    host = [
        make(sum(lengths_q), heads),
        make(sum(lengths_k), kv_heads),
        make(sum(lengths_k), kv_heads),
        make(sum(lengths_q), heads),
    ]
    slopes = alibi_slopes(rng, alibi, len(lengths_q), heads)
    offsets_q, offsets_k = (
        np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k)
    )
    q, k, v, dout = (cupy.asarray(x) for x in host)
    args = (
        cupy.asarray(offsets_q),
        cupy.asarray(offsets_k),
        max(lengths_q),
        max(lengths_k),
        heads,
        kv_heads,
        d,
        causal,
        window,
    )
    kw = dict(softcap=softcap, alibi_slopes=None if slopes is None else cupy.asarray(slopes))
    out, lse = cuflash.flash_attention_varlen_fwd(q, k, v, *args, **kw)
    grads = cuflash.flash_attention_varlen_bwd(
        dout, q, k, v, out, lse, *args, **kw, deterministic=deterministic
    )
    out, lse, dq, dk, dv = (to_numpy(x) for x in (out, lse, *grads))

    def dense(x, start, stop):
        return x[start:stop].transpose(1, 0, 2)[None]

    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        q0, q1, k0, k1 = offsets_q[b], offsets_q[b + 1], offsets_k[b], offsets_k[b + 1]
        if lq == 0:  # keys nobody sees: zero gradients
            assert np.all(dk[k0:k1] == 0) and np.all(dv[k0:k1] == 0), b
            continue
        if lk == 0:  # rows that see no key: zeros, lse -inf
            assert np.all(out[q0:q1] == 0) and np.all(dq[q0:q1] == 0), b
            assert np.all(np.isneginf(lse[:, q0:q1])), b
            continue
        case = Case(
            dtype=dtype,
            batch=1,
            heads=heads,
            kv_heads=kv_heads,
            q_len=lq,
            kv_len=lk,
            head_dim=d,
            causal=causal,
            window=window,
        )
        inputs = (
            dense(host[0], q0, q1),
            dense(host[1], k0, k1),
            dense(host[2], k0, k1),
            dense(host[3], q0, q1),
        )
        results = (
            dense(out, q0, q1),
            lse[None, :, q0:q1],
            dense(dq, q0, q1),
            dense(dk, k0, k1),
            dense(dv, k0, k1),
        )
        check_modified_results(
            case,
            inputs,
            results,
            softcap,
            None if slopes is None else slopes[b] if slopes.ndim == 2 else slopes,
        )
