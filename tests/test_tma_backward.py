"""The warp-specialized Hopper backward's bulk tensor copies on the GPU
(``backward_wgmma_ws`` with ``use_tma``: q, k, v and dout by the copy engine
through tensor maps) against the float64 oracle and against the same kernel with
cp.async, atomic dQ (the bulk additions) and deterministic."""

import pytest
from support import HAS_GPU, Case, check_results, random_inputs

import cuflash
from cuflash.gpu import launch as gpu
from cuflash.gpu import plans, tensor_maps

pytestmark = pytest.mark.gpu

if HAS_GPU:
    import cupy


CASES = [
    Case(
        dtype="bfloat16", head_dim=128, batch=2, heads=4, kv_heads=2, q_len=300, kv_len=700,
        causal=True,
    ),
    # a key tile cut by kv_seq_len: rows past it read as zeros
    Case(
        dtype="float16", head_dim=96, batch=1, heads=2, kv_heads=2, q_len=200, kv_len=530,
        kv_seq_len=517,
    ),
    # [B, S, H, D] buffers; a head dim whose second 64-column box is partly past D
    Case(
        dtype="bfloat16", head_dim=72, batch=1, heads=4, kv_heads=4, q_len=513, kv_len=1000,
        bshd=True,
    ),
    Case(
        dtype="float16", head_dim=120, batch=2, heads=2, kv_heads=1, q_len=129, kv_len=257,
        window=(64, 0),
    ),
]  # fmt: skip


def _arrays(case, inputs):
    arrays = [cupy.asarray(x) for x in inputs]
    if case.bshd:
        arrays = [cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                  for x in arrays]  # fmt: skip
    return arrays


def _backward_plan():
    (plan,) = [p for p in plans._PLANS.values() if isinstance(p, gpu.BackwardPlan)]
    return plan


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_copy_engine_backward_matches_oracle_and_cp_async(case, deterministic, rng, poisoned):
    if cupy.cuda.Device().compute_capability < "90":
        pytest.skip("the copy engine's kernels need an H100/H200")
    if not tensor_maps.available():
        pytest.fail("a GPU machine whose driver encodes no tensor maps")
    inputs = random_inputs(case, rng)
    q, k, v, dout = _arrays(case, inputs)
    kw = dict(kv_seq_len=case.kv_seq_len)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args, **kw)
    plans._PLANS.clear()

    def backward():
        return cuflash.flash_attention_bwd(
            dout, q, k, v, out, lse, *case.args, **kw, deterministic=deterministic
        )

    grads = backward()
    plan = _backward_plan()
    assert plan.spec.name == "backward_wgmma_ws" and plan.dkdv_tma is not None
    check_results(case, inputs, out, lse, grads)
    # cp.async: dK and dV from the same tiles in the same order, so bitwise (dQ's
    # bulk additions land in any order)
    plan.dkdv_tma, keep = None, plan.dkdv_tma
    try:
        grads_cp = backward()
    finally:
        plan.dkdv_tma = keep
    for got, cp in zip(grads[1:], grads_cp[1:]):
        assert cupy.array_equal(got, cp)
    if deterministic:
        assert cupy.array_equal(grads[0], grads_cp[0])
