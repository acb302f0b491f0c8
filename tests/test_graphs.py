"""CUDA-graph capture of a training step's attention, and the launch-plan cache."""

import numpy as np
import pytest
from support import Case, cupy, random_inputs, rel_error, to_numpy

import cuflash
from cuflash.gpu import plans

pytestmark = pytest.mark.gpu


def _step(case, q, k, v, dout, deterministic):
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args)
    grads = cuflash.flash_attention_bwd(
        dout, q, k, v, out, lse, *case.args, deterministic=deterministic, synchronize=False
    )
    return (out, lse, *grads)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(
    "case",
    [
        Case(
            dtype="bfloat16", heads=8, kv_heads=2, q_len=200, kv_len=200, head_dim=64, causal=True
        ),
        Case(dtype="float16", heads=4, kv_heads=4, q_len=100, kv_len=160, head_dim=80, window=32),
        Case(dtype="float32", heads=4, kv_heads=1, q_len=90, kv_len=90, head_dim=96, causal=True),
    ],
    ids=str,
)
def test_captured_step_replays_like_direct_calls(case, deterministic, rng):
    """Forward and backward(synchronize=False) captured into a CuPy graph, replayed on new
    values written into the same input buffers, give the direct calls' results."""
    q, k, v, dout = random_inputs(case, rng, cupy)
    _step(case, q, k, v, dout, deterministic)  # compiles and builds the plans
    cupy.cuda.Device().synchronize()
    # The graph's memory (outputs and temporaries) from a pool of its own, kept as long
    # as the graph: no allocation outside the graph can take a block it writes.
    graph_pool = cupy.cuda.MemoryPool()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream, cupy.cuda.using_allocator(graph_pool.malloc):
        stream.begin_capture()
        captured = _step(case, q, k, v, dout, deterministic)
        graph = stream.end_capture()
    for x in (q, k, v, dout):  # fresh values in the captured buffers
        x[...] = cupy.asarray(rng.standard_normal(x.shape).astype(x.dtype))
    for x in captured:  # poisoned: the replay must write them
        x.fill(np.nan)
    graph.launch(stream)
    stream.synchronize()
    direct = _step(case, q, k, v, dout, deterministic)
    cupy.cuda.Device().synchronize()
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), captured, direct):
        got, want = to_numpy(got), to_numpy(want)
        assert np.all(np.isfinite(got)), name
        if deterministic or name in ("out", "lse"):
            assert np.array_equal(got, want), name  # the same kernels on the same data
        else:  # atomics may add dQ in another order
            assert rel_error(got, want.astype(np.float64)) < 1e-2, name


def test_plans_are_reused_and_keyed_by_layout(rng):
    """A repeated call reuses its plan; another layout, option or kernel path gets its own."""
    plans.clear()
    case = Case(dtype="bfloat16", head_dim=64, q_len=64, kv_len=64)
    q, k, v, dout = random_inputs(case, rng, cupy)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args)
    assert len(plans._PLANS) == 1
    cuflash.flash_attention_fwd(q.copy(), k, v, *case.args)
    assert len(plans._PLANS) == 1
    cuflash.flash_attention_fwd(q, k, v, *case.args[:3], True)  # causal
    cuflash.flash_attention_fwd(q[:, :, :32], k, v, *case.args)  # shorter, other strides
    with cuflash.kernel_path("general"):
        general, _ = cuflash.flash_attention_fwd(q, k, v, *case.args)
    assert len(plans._PLANS) == 4
    assert rel_error(general, to_numpy(out).astype(np.float64)) < 1e-2
    # A cached plan still validates nothing new: the same signature, the same answer.
    again, _ = cuflash.flash_attention_fwd(q, k, v, *case.args)
    assert np.array_equal(to_numpy(again), to_numpy(out))
    with pytest.raises(cuflash.InvalidArgumentError):
        cuflash.flash_attention_fwd(q, k, v, 3, *case.args[1:])
