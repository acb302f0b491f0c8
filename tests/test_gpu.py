"""The GPU path against the float64 oracle (run with ``pytest -m gpu``)."""

import numpy as np
import pytest
from support import Case, cupy, grid_cases, random_inputs, rel_error, run_and_check, to_numpy

import cuflash
import cuflash.reference
from cuflash.dispatch import PATHS

pytestmark = pytest.mark.gpu


@pytest.fixture(params=PATHS)
def path(request):
    """Run the test once per kernel path ("auto": tensor cores where they apply)."""
    with cuflash.kernel_path(request.param):
        yield request.param


@pytest.mark.parametrize("case", grid_cases(), ids=str)
def test_gpu_matches_oracle(case, rng, poisoned, path):
    run_and_check(case, cupy, rng)


@pytest.mark.parametrize("case", grid_cases()[::3], ids=str)
def test_gpu_deterministic_matches_oracle(case, rng, poisoned, path):
    run_and_check(case, cupy, rng, deterministic=True)


@pytest.mark.parametrize(
    "dtype, head_dim, expected",
    [
        ("bfloat16", 128, True),
        ("float16", 64, True),
        ("bfloat16", 256, True),
        ("float32", 136, "hopper"),
        ("bfloat16", 96, True),
        ("float16", 200, True),
    ],
)
def test_fast_path_dispatch(rng, dtype, head_dim, expected):
    """Tensor cores where the registry has them (float32: the float16 pieces, on Hopper)."""
    from cuflash.core import problem
    from cuflash.gpu import launch as gpu

    if expected == "hopper":
        expected = int(cupy.cuda.Device().compute_capability) == 90
    case = Case(dtype=dtype, head_dim=head_dim)
    q, k, v, _ = random_inputs(case, rng, cupy)
    prob = problem.forward_problem(q, k, v, cuflash.AttentionConfig(*case.args))
    for direction in ("forward", "backward"):
        spec = gpu.choose(prob, direction, gpu.rows_are_16_byte_aligned((q, k, v)))
        assert (spec.instruction != "cuda cores") is expected
        with cuflash.kernel_path("general"):
            assert gpu.choose(prob, direction, True).instruction == "cuda cores"
    # Rows off the 16-byte grid fall back to the general kernel.
    wide = cupy.asarray(rng.standard_normal(q.shape[:3] + (head_dim + 8,)).astype(q.dtype))
    assert not gpu.rows_are_16_byte_aligned((wide[..., 1 : head_dim + 1], k, v))
    assert gpu.choose(prob, "forward", False).instruction == "cuda cores"


def test_unaligned_rows_are_still_correct(rng, poisoned):
    case = Case(dtype="bfloat16", head_dim=64, causal=True)
    q, k, v, dout = random_inputs(case, rng, cupy)
    wide = cupy.zeros(q.shape[:3] + (72,), q.dtype)
    wide[..., 1:65] = q
    out, lse = cuflash.flash_attention_fwd(wide[..., 1:65], k, v, *case.args)
    ref, _ = cuflash.flash_attention_fwd(q, k, v, *case.args)
    assert rel_error(out, to_numpy(ref).astype(np.float64)) < 1e-2


@pytest.mark.parametrize(
    "case",
    [
        Case(dtype="bfloat16", heads=8, kv_heads=2, q_len=300, kv_len=300, causal=True),
        Case(dtype="float32", head_dim=256, q_len=130, kv_len=200, window=(20, 5)),
    ],
    ids=str,
)
def test_deterministic_is_bitwise_reproducible(case, rng):
    q, k, v, dout = random_inputs(case, rng, cupy)
    out, vjp = cuflash.flash_attention_vjp(q, k, v, *case.args)
    runs = [[to_numpy(g).tobytes() for g in vjp(dout, deterministic=True)] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    default = vjp(dout)  # atomics: equal up to rounding
    for name, a, b in zip("qkv", default, vjp(dout, deterministic=True)):
        ref = to_numpy(b).astype(np.float64)
        assert rel_error(a, ref) < {"float32": 1e-5}.get(case.dtype, 1e-2), name


def test_vjp_called_twice(rng):
    case = Case(dtype="float16", heads=4, kv_heads=1, causal=True)
    q, k, v, dout = random_inputs(case, rng, cupy)
    out, vjp = cuflash.flash_attention_vjp(q, k, v, *case.args)
    first, second = vjp(dout), vjp(dout)
    for a, b in zip(first, second):
        assert rel_error(a, to_numpy(b).astype(np.float64)) < 1e-2
    assert vjp.lse.shape == (case.batch, case.heads, case.q_len)


def test_non_default_stream_matches_cpu_path(rng, poisoned):
    case = Case(dtype="float32", heads=4, kv_heads=2, q_len=500, kv_len=700, causal=True)
    q, k, v, dout = random_inputs(case, rng, cupy)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args)
        grads = cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *case.args)
    stream.synchronize()
    host = [to_numpy(a) for a in (q, k, v, dout)]
    cpu_out, cpu_lse = cuflash.flash_attention_fwd(*host[:3], *case.args)
    cpu_grads = cuflash.flash_attention_bwd(host[3], *host[:3], cpu_out, cpu_lse, *case.args)
    assert rel_error(out, cpu_out.astype(np.float64)) < 1e-5
    for a, b in zip(grads, cpu_grads):
        assert rel_error(a, b.astype(np.float64)) < 1e-5


def test_kv_cache_buffer_is_not_copied(rng, poisoned):
    """A full-capacity cache with kv_seq_len: keys past the length never matter."""
    case = Case(dtype="bfloat16", q_len=1, kv_len=4096, kv_seq_len=1000, heads=8, kv_heads=2)
    q, k, v, dout = random_inputs(case, rng, cupy)
    out1, _ = cuflash.flash_attention_fwd(q, k, v, *case.args, kv_seq_len=1000)
    k[:, :, 1000:] = cupy.nan  # garbage past the length must not be read
    v[:, :, 1000:] = cupy.nan
    out2, _ = cuflash.flash_attention_fwd(q, k, v, *case.args, kv_seq_len=1000)
    assert cupy.array_equal(out1, out2) and not cupy.isnan(out2).any()


@pytest.mark.parametrize(
    "shape_q, shape_kv",
    [
        ((0, 4, 16, 32), (0, 2, 16, 32)),
        ((2, 4, 0, 32), (2, 2, 16, 32)),
        ((2, 4, 16, 32), (2, 2, 0, 32)),
    ],
)
def test_empty_dimensions(shape_q, shape_kv, poisoned):
    q = cupy.ones(shape_q, cupy.float32)
    k = v = cupy.ones(shape_kv, cupy.float32)
    out, lse = cuflash.flash_attention_fwd(q, k, v, 4, 2, 32)
    assert out.shape == shape_q
    if out.size:
        assert cupy.all(out == 0) and cupy.all(cupy.isneginf(lse))
    dq, dk, dv = cuflash.flash_attention_bwd(out, q, k, v, out, lse, 4, 2, 32)
    assert dq.shape == shape_q and dk.shape == shape_kv
    for g in (dq, dk, dv):
        assert cupy.all(g == 0)


def test_long_sequence_memory_is_linear(rng):
    """S = 32768 causal in bfloat16: the S x S scores (4 GiB per head) never exist."""
    case = Case(
        dtype="bfloat16",
        batch=1,
        heads=2,
        kv_heads=2,
        q_len=32768,
        kv_len=32768,
        head_dim=64,
        causal=True,
    )
    q, k, v, dout = random_inputs(case, rng, cupy)
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()  # blocks cached by earlier tests are not this call's
    before = pool.total_bytes()
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args)
    grads = cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *case.args)
    extra = pool.total_bytes() - before
    assert extra < 20 * q.nbytes
    # Spot rows against the oracle on the keys they see.
    for i in (0, 5000, 32767):
        sub = [to_numpy(a[:, :, : i + 1]) for a in (k, v)]
        ref, _ = cuflash.reference.attention_reference(
            to_numpy(q[:, :, i : i + 1]), *sub, causal=True
        )
        assert rel_error(out[:, :, i : i + 1], ref) < 1e-2
    assert all(not cupy.isnan(g).any() for g in grads)


def test_poisoning_really_fills_nan(poisoned):
    """The fixture the other tests rely on: fresh allocations read as NaN."""
    for dtype in (cupy.float32, cupy.float16):
        assert bool(cupy.isnan(cupy.empty(1000, dtype)).all())
