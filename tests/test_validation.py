"""Every documented error (the troubleshooting page, section 'Error messages'), raised
before any work, naming the argument."""

import numpy as np
import pytest
from support import HAS_GPU, cupy

import cuflash
from cuflash import InvalidArgumentError, distributed

B, H, HK, S, D = 2, 4, 2, 16, 32


def inputs(xp=np, dtype=np.float32):
    rng = np.random.default_rng(0)
    q = xp.asarray(rng.standard_normal((B, H, S, D)).astype(dtype))
    k = xp.asarray(rng.standard_normal((B, HK, S, D)).astype(dtype))
    v = xp.asarray(rng.standard_normal((B, HK, S, D)).astype(dtype))
    return q, k, v


def fwd(q, k, v, *args, **kw):
    args = args or (H, HK, D)
    return cuflash.flash_attention_fwd(q, k, v, *args, **kw)


def expect(arg, fragment, fn, *args, **kw):
    with pytest.raises(InvalidArgumentError) as info:
        fn(*args, **kw)
    assert info.value.arg.startswith(arg) or arg in info.value.arg, str(info.value)
    assert fragment in str(info.value), str(info.value)
    assert str(info.value).startswith(info.value.arg + ": ")


FORWARD_CASES = {
    "q rank": lambda q, k, v: ("q", "expected 4-D", (q[0], k, v)),
    "k rank": lambda q, k, v: ("k", "expected 4-D", (q, k[0], v)),
    "v rank": lambda q, k, v: ("v", "got 5-D", (q, k, v[None])),
    "heads mismatch": lambda q, k, v: ("q", "num_heads is", (q[:, :3], k, v)),
    "kv heads mismatch": lambda q, k, v: ("k", "num_kv_heads is", (q, k[:, :1], v)),
    "batch mismatch": lambda q, k, v: ("k", "batch", (q, k[:1], v)),
    "head_dim mismatch": lambda q, k, v: ("k", "head_dim", (q, k[..., :16], v)),
    "v head_dim mismatch": lambda q, k, v: ("v", "head_dim", (q, k, v[..., :16])),
    "k/v length": lambda q, k, v: ("v", "sequence length", (q, k, v[:, :, :5])),
    "mixed dtypes": lambda q, k, v: ("k", "differs from q's", (q, k.astype(np.float16), v)),
    "unsupported dtype": lambda q, k, v: ("q", "unsupported dtype", (q.astype(np.float64),) * 3),
    "int dtype": lambda q, k, v: ("q", "unsupported dtype", (q.astype(np.int32),) * 3),
}


@pytest.mark.parametrize("name", FORWARD_CASES)
def test_forward_array_errors(name):
    arg, fragment, arrays = FORWARD_CASES[name](*inputs())
    expect(arg, fragment, fwd, *arrays)


@pytest.mark.parametrize(
    "args, kw, arg, fragment",
    [
        ((H, 0, D), {}, "num_kv_heads", "must be >= 1"),
        ((H, 3, D), {}, "num_kv_heads", "must divide"),
        ((H, HK, 33), {}, "head_dim", "multiple of 8"),
        ((H, HK, 264), {}, "head_dim", "unsupported head_dim"),
        ((H, HK, 24), {}, "q", "head_dim is 24"),
        ((H, HK, D), {"kv_seq_len": S + 1}, "kv_seq_len", "must be <="),
        ((H, HK, D), {"kv_seq_len": -1}, "kv_seq_len", "must be >= 0"),
        ((H, HK, D), {"window_size": -2}, "window_size", "must be >= 0"),
        ((H, HK, D), {"window_size": (-2, 0)}, "window_size", ">= -1"),
        ((H, HK, D), {"window_size": (1, 2, 3)}, "window_size", "(left, right)"),
        ((H, HK, D), {"window_size": 2.5}, "window_size", "expected an int"),
        ((H, HK, D), {"causal": "yes"}, "causal", "expected a bool"),
        ((H, HK, D), {"softmax_scale": float("nan")}, "softmax_scale", "finite"),
        ((H, HK, D), {"softmax_scale": "1"}, "softmax_scale", "expected a float"),
        ((H, HK, D), {"allow_tf32": 1}, "allow_tf32", "expected a bool"),
        ((4.0, HK, D), {}, "num_heads", "expected an int"),
    ],
)
def test_forward_scalar_errors(args, kw, arg, fragment):
    expect(arg, fragment, fwd, *inputs(), *args, **kw)


def test_not_an_array():
    q, k, v = inputs()
    expect("q", "expected numpy.ndarray or cupy.ndarray", fwd, q.tolist(), k, v)


def backward_args(xp=np):
    q, k, v = inputs(xp)
    out, lse = cuflash.flash_attention_fwd(q, k, v, H, HK, D)
    return [out.copy(), q, k, v, out, lse]


@pytest.mark.parametrize(
    "index, bad, arg, fragment",
    [
        (0, lambda x: x[:, :, :5], "dout", "expected shape"),
        (0, lambda x: x.astype(np.float16), "dout", "differs from q's"),
        (4, lambda x: x[:1], "output", "expected shape"),
        (4, lambda x: x[0], "output", "expected 4-D"),
        (5, lambda x: x[..., :3], "lse", "expected shape"),
        (5, lambda x: x[None], "lse", "expected 3-D"),
        (5, lambda x: x.astype(np.float16), "lse", "float32"),
    ],
)
def test_backward_errors(index, bad, arg, fragment):
    args = backward_args()
    args[index] = bad(args[index])
    expect(arg, fragment, cuflash.flash_attention_bwd, *args, H, HK, D)


@pytest.mark.parametrize(
    "kw, arg",
    [
        ({"deterministic": 1}, "deterministic"),
        ({"synchronize": None}, "synchronize"),
        ({"allow_tf32": "no"}, "allow_tf32"),
        ({"kv_seq_len": 99}, "kv_seq_len"),
        ({"window_size": -1}, "window_size"),
    ],
)
def test_backward_option_errors(kw, arg):
    expect(arg, "", cuflash.flash_attention_bwd, *backward_args(), H, HK, D, **kw)


def test_bfloat16_lse_must_be_float32():
    import ml_dtypes

    args = backward_args()
    args[5] = args[5].astype(ml_dtypes.bfloat16)
    expect("lse", "float32", cuflash.flash_attention_bwd, *args, H, HK, D)


@pytest.mark.parametrize(
    "shape_q, shape_kv",
    [
        ((0, H, S, D), (0, HK, S, D)),
        ((B, 0, S, D), (B, HK, S, D)),
        ((B, H, 0, D), (B, HK, S, D)),
        ((B, H, S, D), (B, HK, 0, D)),
    ],
)
def test_empty_dimensions_cpu(shape_q, shape_kv):
    q = np.ones(shape_q, np.float32)
    k = v = np.ones(shape_kv, np.float32)
    out, lse = cuflash.flash_attention_fwd(q, k, v, shape_q[1], HK, D)
    assert out.shape == shape_q and lse.shape == shape_q[:3]
    if shape_kv[2] == 0 and out.size:
        assert np.all(out == 0) and np.all(np.isneginf(lse))
    dq, dk, dv = cuflash.flash_attention_bwd(out, q, k, v, out, lse, shape_q[1], HK, D)
    assert dq.shape == shape_q and dk.shape == shape_kv and dv.shape == shape_kv
    assert np.all(dq == 0) and np.all(dk == 0) and np.all(dv == 0)


@pytest.mark.gpu
def test_mixed_numpy_cupy():
    q, k, v = inputs()
    expect("q", "mixed", fwd, q, cupy.asarray(k), v)


@pytest.mark.gpu
def test_gpu_errors_before_any_work():
    q, k, v = inputs(cupy)
    expect("q", "expected 4-D", fwd, q[0], k, v)
    expect("kv_seq_len", "must be <=", fwd, q, k, v, kv_seq_len=S + 1)
    args = backward_args(cupy)
    args[5] = args[5][..., :3]
    expect("lse", "expected shape", cuflash.flash_attention_bwd, *args, H, HK, D)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU or cupy.cuda.runtime.getDeviceCount() < 2, reason="needs two GPUs")
def test_arrays_on_different_devices():
    q, k, v = inputs(cupy)
    with cupy.cuda.Device(1):
        k1 = cupy.asarray(k)
    expect("q", "different devices", fwd, q, k1, v)


def test_too_large_for_the_device_grid():
    # A zero-length sequence keeps the arrays empty while the head count is huge.
    q = np.empty((1, 70000, 0, 8), np.float32)
    k = np.empty((1, 1, 0, 8), np.float32)
    expect("q", "too large for the device", fwd, q, k, k, 70000, 1, 8)


def test_error_is_a_value_error():
    assert issubclass(InvalidArgumentError, ValueError)


SINKS_CASES = {
    "wrong shape": (lambda xp: xp.zeros(H + 1, np.float32), "sinks", "expected shape (4,)"),
    "per batch entry": (lambda xp: xp.zeros((B, H), np.float32), "sinks", "expected shape"),
    "float64": (lambda xp: xp.zeros(H), "sinks", "expected dtype float32, got float64"),
    "float16": (lambda xp: xp.zeros(H, np.float16), "sinks", "expected dtype float32"),
    "a list": (lambda xp: [0.0] * H, "sinks", "expected numpy.ndarray or cupy.ndarray"),
}


@pytest.mark.parametrize("name", SINKS_CASES)
def test_sinks_errors(name):
    """Bad sinks fail every entry point before any work, naming sinks."""
    make, arg, fragment = SINKS_CASES[name]
    sinks = make(np)
    expect(arg, fragment, fwd, *inputs(), sinks=sinks)
    expect(arg, fragment, cuflash.flash_attention_bwd, *backward_args(), H, HK, D, sinks=sinks)
    expect(arg, fragment, cuflash.flash_attention_vjp, *inputs(), H, HK, D, sinks=sinks)
    q, k, v = (x[0].transpose(1, 0, 2) for x in inputs())
    cu = np.array([0, S], np.int32)
    expect(
        arg,
        fragment,
        cuflash.flash_attention_varlen_fwd,
        q,
        k,
        v,
        cu,
        cu,
        S,
        S,
        H,
        HK,
        D,
        sinks=sinks,
    )
    expect(
        arg,
        fragment,
        cuflash.flash_attention_varlen_bwd,
        q,
        q,
        k,
        v,
        q,
        np.zeros((H, S), np.float32),
        cu,
        cu,
        S,
        S,
        H,
        HK,
        D,
        sinks=sinks,
    )
    q4, k4, v4 = inputs()
    expect(
        arg,
        fragment,
        cuflash.flash_attention_with_kvcache,
        q4,
        k4,
        v4,
        H,
        HK,
        D,
        cache_seqlens=S,
        sinks=sinks,
    )
    group = distributed.ThreadGroup(1)
    expect(
        arg,
        fragment,
        lambda: group.run(
            lambda g: distributed.ring_attention_fwd(
                q4, k4, v4, H, HK, D, group=g, layout="contiguous", sinks=sinks
            ),
            [()],
        ),
    )


@pytest.mark.gpu
def test_sinks_of_the_other_array_kind_or_device():
    q, k, v = inputs(cupy)
    expect("sinks", "mixed", fwd, q, k, v, sinks=np.zeros(H, np.float32))
    expect("sinks", "mixed", fwd, *inputs(), sinks=cupy.zeros(H, np.float32))
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device(1):
            elsewhere = cupy.zeros(H, np.float32)
        expect("sinks", "different devices", fwd, q, k, v, sinks=elsewhere)
