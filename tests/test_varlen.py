"""Packed variable-length batches (the varlen page): each sequence against the float64
oracle, on the CPU path (CI) and the GPU (marked gpu); the validation errors."""

import math

import numpy as np
import pytest
from support import check_packed_results, cupy, packed_inputs

import cuflash


def _check_against_oracle(
    rng,
    xp,
    lengths_q,
    lengths_k,
    heads=4,
    kv_heads=2,
    head_dim=32,
    dtype="float32",
    causal=True,
    window=0,
    deterministic=False,
    softmax_scale=None,
    allow_tf32=False,
    bound=None,
):
    q, k, v, dout, cu_q, cu_k = packed_inputs(
        rng, lengths_q, lengths_k, heads, kv_heads, head_dim, dtype, xp
    )
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k), heads, kv_heads, head_dim, causal, window)
    out, vjp = cuflash.flash_attention_varlen_vjp(
        q, k, v, *args, softmax_scale=softmax_scale, allow_tf32=allow_tf32
    )
    grads = vjp(dout, deterministic=deterministic)
    check_packed_results(
        (q, k, v, dout),
        out,
        vjp.lse,
        grads,
        lengths_q,
        lengths_k,
        dtype,
        causal,
        window,
        softmax_scale,
        allow_tf32,
        bound,
    )


CASES = [
    dict(lengths_q=[5, 0, 17, 1, 9], lengths_k=[5, 3, 17, 1, 9]),
    dict(lengths_q=[33], lengths_k=[33], causal=False),
    dict(lengths_q=[4, 12, 7], lengths_k=[10, 12, 2], window=3),
    dict(lengths_q=[6, 6], lengths_k=[6, 0], heads=4, kv_heads=4, head_dim=40),
    dict(lengths_q=[3, 20], lengths_k=[9, 20], heads=6, kv_heads=1, window=(2, 1), causal=False),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_matches_oracle_per_sequence(case, dtype, rng):
    _check_against_oracle(rng, np, dtype=dtype, **case)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(
    "case",
    CASES
    + [
        dict(lengths_q=[300, 64, 1, 700], lengths_k=[300, 64, 1, 700], head_dim=128),
        dict(lengths_q=[1000], lengths_k=[1000], head_dim=80, heads=8, kv_heads=2),
    ],
    ids=str,
)
def test_gpu_matches_oracle_per_sequence(case, dtype, deterministic, rng, poisoned):
    _check_against_oracle(rng, cupy, dtype=dtype, deterministic=deterministic, **case)


def _random_lengths(rng, count, longest):
    """A mix of lengths up to ``longest`` with a zero and a full-length one in it."""
    lengths = list(rng.integers(0, longest + 1, size=count))
    lengths[rng.integers(count)] = 0
    lengths[rng.integers(count)] = longest
    return [int(x) for x in lengths]


# Every head-dim class, its edges and insides, with options rotating over them.
HEAD_DIMS = (8, 24, 32, 64, 80, 96, 128, 160, 192, 256)
OPTIONS = [
    dict(causal=True),
    dict(causal=False, heads=6, kv_heads=3),
    dict(causal=True, window=(40, 5)),
    dict(causal=False, softmax_scale=0.3),
    dict(causal=True, heads=4, kv_heads=1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gpu_every_head_dim_random_mix(head_dim, dtype, rng, poisoned):
    """Random mixes (zeros and a full-length sequence among them), q and k lengths apart,
    atomic and deterministic, every head-dim class."""
    options = OPTIONS[HEAD_DIMS.index(head_dim) % len(OPTIONS)]
    lengths_q = _random_lengths(rng, 6, 300)
    lengths_k = [x if i % 2 else int(rng.integers(0, 400)) for i, x in enumerate(lengths_q)]
    for deterministic in (False, True):
        _check_against_oracle(
            rng,
            cupy,
            lengths_q,
            lengths_k,
            head_dim=head_dim,
            dtype=dtype,
            deterministic=deterministic,
            **options,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["general", "mma_sync"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_other_kernels_read_the_offsets(path, dtype, rng, poisoned):
    """The general kernels and, on a Hopper GPU, the mma.sync ones (the A100 path)."""
    from cuflash import dispatch

    lengths = _random_lengths(rng, 5, 200)
    if path == "general":
        context = dispatch.kernel_path("general")
    else:
        context = dispatch.skip_kernels(
            "forward_wgmma_ws",
            "forward_wgmma",
            "backward_wgmma_ws",
            "backward_wgmma",
            "forward_float32_pieces",
            "backward_float32_pieces",
        )
    with context:
        for head_dim in (64, 96, 128):
            _check_against_oracle(rng, cupy, lengths, lengths, head_dim=head_dim, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [152, 256])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_float32_wide_pieces_read_the_offsets(head_dim, deterministic, rng, poisoned):
    """float32 past head_dim 128 on a Hopper GPU: the wide float16-pieces kernels."""
    if int(cupy.cuda.Device().compute_capability) != 90:
        pytest.skip("wgmma needs compute capability 9.0")
    lengths_q, lengths_k = _random_lengths(rng, 5, 150), _random_lengths(rng, 5, 150)
    _check_against_oracle(
        rng,
        cupy,
        lengths_q,
        lengths_k,
        head_dim=head_dim,
        deterministic=deterministic,
        causal=False,
        window=(40, 10),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_tf32(head_dim, rng, poisoned):
    lengths = _random_lengths(rng, 4, 250)
    _check_against_oracle(
        rng, cupy, lengths, lengths, head_dim=head_dim, allow_tf32=True, bound=3e-3
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_one_long_sequence_and_many_short(dtype, rng, poisoned):
    _check_against_oracle(rng, cupy, [2000], [2000], head_dim=64, dtype=dtype)
    short = [int(x) for x in rng.integers(0, 9, size=300)]
    _check_against_oracle(rng, cupy, short, short, head_dim=64, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_deterministic_repeats_bitwise(dtype, rng):
    lengths = _random_lengths(rng, 5, 400)
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lengths, lengths, 4, 2, 128, dtype, cupy)
    args = (cu_q, cu_k, max(lengths), max(lengths), 4, 2, 128, True)
    out, lse = cuflash.flash_attention_varlen_fwd(q, k, v, *args)
    first = cuflash.flash_attention_varlen_bwd(dout, q, k, v, out, lse, *args, deterministic=True)
    again = cuflash.flash_attention_varlen_bwd(dout, q, k, v, out, lse, *args, deterministic=True)
    for x, y in zip(first, again):
        assert cupy.array_equal(x, y)


@pytest.mark.gpu
def test_gpu_tokens_outside_every_sequence_get_zero_gradients(rng, poisoned):
    """Device offsets that end short of the totals (unchecked): the tokens past the last
    offset belong to no sequence; their gradients are zeros and the rest is right."""
    lengths = [50, 0, 70]
    q, k, v, dout, cu_q, cu_k = packed_inputs(
        rng, lengths + [30], lengths + [40], 4, 2, 64, "bfloat16", cupy
    )
    cu_q, cu_k = cu_q[:-1], cu_k[:-1]  # the last "sequence" is outside every sequence
    args = (cu_q, cu_k, 70, 70, 4, 2, 64, True)
    out, lse = cuflash.flash_attention_varlen_fwd(q, k, v, *args)
    dq, dk, dv = cuflash.flash_attention_varlen_bwd(dout, q, k, v, out, lse, *args)
    assert not cupy.any(dq[120:]) and not cupy.any(dk[120:]) and not cupy.any(dv[120:])
    assert bool(cupy.all(cupy.isfinite(dq[:120])))
    ref, _ = cuflash.flash_attention_varlen_fwd(q[:120], k[:120], v[:120], *args)
    assert cupy.array_equal(out[:120], ref)
    with pytest.raises(cuflash.InvalidArgumentError, match="the last offset 120 differs"):
        cuflash.flash_attention_varlen_fwd(q, k, v, *args, check=True)


@pytest.mark.gpu
def test_gpu_untrusted_offsets_stay_inside_the_arrays(rng):
    """Garbage device offsets (negative, decreasing, past the totals, longer than
    max_seqlen): no fault, no write outside the outputs (guard bytes around a copy of the
    inputs stay intact), and check=True names the sequence."""
    lengths = [40, 60, 30]
    q, k, v, dout, _, _ = packed_inputs(rng, lengths, lengths, 2, 2, 64, "float16", cupy)
    for offsets in ([0, -50, 10**6, 20], [100, 10, 130, 2**31 - 1], [-7, 500, -3, 130]):
        cu = cupy.asarray(np.array(offsets, np.int32))
        args = (cu, cu, 60, 60, 2, 2, 64, True)
        out, lse = cuflash.flash_attention_varlen_fwd(q, k, v, *args)
        grads = cuflash.flash_attention_varlen_bwd(dout, q, k, v, out, lse, *args)
        cupy.cuda.get_current_stream().synchronize()  # a fault would surface here
        assert out.shape == q.shape and all(g.shape == x.shape for g, x in zip(grads, (q, k, v)))
        with pytest.raises(cuflash.InvalidArgumentError, match="cu_seqlens_q"):
            cuflash.flash_attention_varlen_fwd(q, k, v, *args, check=True)


@pytest.mark.gpu
def test_gpu_device_offsets_checked_on_request(rng):
    lengths = [10, 30]
    q, k, v, _, cu_q, cu_k = packed_inputs(rng, lengths, lengths, 2, 2, 32, "bfloat16", cupy)
    cuflash.flash_attention_varlen_fwd(q, k, v, cu_q, cu_k, 30, 30, 2, 2, 32, check=True)
    with pytest.raises(
        cuflash.InvalidArgumentError,
        match="cu_seqlens_q: sequence 1: length 30 exceeds max_seqlen_q = 20",
    ):
        cuflash.flash_attention_varlen_fwd(q, k, v, cu_q, cu_k, 20, 30, 2, 2, 32, check=True)


@pytest.mark.gpu
def test_gpu_graph_capture_replays_the_packed_call(rng):
    """No device-to-host copy without check: forward and backward (deterministic,
    synchronize=False) capture into a CUDA graph and replay, on new values in the same
    buffers, to the direct calls' results."""
    lengths = [100, 7, 260]
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lengths, lengths, 4, 2, 64, "bfloat16", cupy)
    args = (cu_q, cu_k, 260, 260, 4, 2, 64, True)

    def step():
        out, lse = cuflash.flash_attention_varlen_fwd(q, k, v, *args)
        return (
            out,
            lse,
            *cuflash.flash_attention_varlen_bwd(
                dout, q, k, v, out, lse, *args, deterministic=True, synchronize=False
            ),
        )

    step()  # compiles and builds the plans
    cupy.cuda.Device().synchronize()
    graph_pool = cupy.cuda.MemoryPool()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream, cupy.cuda.using_allocator(graph_pool.malloc):
        stream.begin_capture()
        captured = step()
        graph = stream.end_capture()
    for x in (q, k, v, dout):
        x[...] = cupy.asarray(rng.standard_normal(x.shape).astype(x.dtype))
    for x in captured:
        x.fill(np.nan)
    graph.launch(stream)
    stream.synchronize()
    direct = step()
    cupy.cuda.Device().synchronize()
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), captured, direct):
        assert bool(cupy.all(cupy.isfinite(got))), name
        assert cupy.array_equal(got, want), name


def test_packed_equal_lengths_match_the_dense_call(rng):
    """Equal lengths packed: the dense call's result, bitwise (the same per-sequence math)."""
    B, S, H, D = 3, 20, 2, 16
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, [S] * B, [S] * B, H, H, D, "float32", np)
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
        return lambda: cuflash.flash_attention_varlen_fwd(
            q, k, v, cu_q, cu_k, mq, mk, 4, 2, 8, **kw
        )

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
    with pytest.raises(
        cuflash.InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        call()


def test_backward_checks_its_extra_arrays(rng):
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, [3, 5], [4, 5], 2, 2, 8, "float32", np)
    out, lse = cuflash.flash_attention_varlen_fwd(q, k, v, cu_q, cu_k, 5, 5, 2, 2, 8)
    args = (cu_q, cu_k, 5, 5, 2, 2, 8)
    with pytest.raises(cuflash.InvalidArgumentError, match="lse: has heads 3"):
        cuflash.flash_attention_varlen_bwd(dout, q, k, v, out, np.zeros((3, 8), np.float32), *args)
    with pytest.raises(cuflash.InvalidArgumentError, match="dout: has tokens 7"):
        cuflash.flash_attention_varlen_bwd(dout[:7], q, k, v, out, lse, *args)
    with pytest.raises(cuflash.InvalidArgumentError, match="lse: expected dtype float32"):
        cuflash.flash_attention_varlen_bwd(dout, q, k, v, out, lse.astype(np.float64), *args)
    grads = cuflash.flash_attention_varlen_bwd(dout, q, k, v, out, lse, *args)
    assert all(np.all(np.isfinite(g)) for g in grads)
    assert math.isfinite(float(np.abs(grads[0]).sum()))
