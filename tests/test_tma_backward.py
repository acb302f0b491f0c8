"""The warp-specialized Hopper backward's bulk tensor copies on the GPU
(``backward_wgmma_ws`` with ``use_tma``: q, k, v and dout by the copy engine
through tensor maps) against the float64 oracle and against the same kernel with
cp.async, atomic dQ (the bulk additions) and deterministic (dQ added in the blocks'
launch order, and by its own pass)."""

import functools

import pytest
from support import HAS_GPU, Case, check_results, random_inputs

import cuflash
from cuflash import dispatch
from cuflash.gpu import launch as gpu
from cuflash.gpu import plans, registry, tensor_maps

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
    # the 64 class (128 query rows a step): GQA and causal, a head dim short of its box
    # with a key tile cut by kv_seq_len, [B, S, H, D] buffers
    Case(
        dtype="bfloat16", head_dim=64, batch=2, heads=4, kv_heads=2, q_len=300, kv_len=700,
        causal=True,
    ),
    Case(
        dtype="float16", head_dim=40, batch=1, heads=2, kv_heads=2, q_len=200, kv_len=530,
        kv_seq_len=517,
    ),
    Case(
        dtype="bfloat16", head_dim=64, batch=1, heads=4, kv_heads=4, q_len=513, kv_len=1000,
        bshd=True, window=(200, 30),
    ),
    # the 256 class (64 keys a block, each step's dQ added from its stage): GQA and causal,
    # the narrowest split with a key tile cut by kv_seq_len in [B, S, H, D] buffers, a
    # window, and MLA's v of 128 columns under a head dim of 192
    Case(
        dtype="bfloat16", head_dim=256, batch=2, heads=4, kv_heads=2, q_len=300, kv_len=700,
        causal=True,
    ),
    Case(
        dtype="float16", head_dim=136, batch=1, heads=2, kv_heads=2, q_len=200, kv_len=530,
        kv_seq_len=517, bshd=True,
    ),
    Case(
        dtype="float16", head_dim=160, batch=2, heads=2, kv_heads=1, q_len=129, kv_len=257,
        window=(64, 0),
    ),
    Case(
        dtype="bfloat16", head_dim=192, head_dim_v=128, batch=1, heads=4, kv_heads=1,
        q_len=513, kv_len=513, causal=True,
    ),
]  # fmt: skip


def _arrays(case, inputs):
    arrays = [cupy.asarray(x) for x in inputs]
    if case.bshd:
        arrays = [cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                  for x in arrays]  # fmt: skip
    return arrays


def dispatch_skipping(backward):
    """``backward()`` with the dQ pass in place of the ordered dQ."""
    with dispatch.skip_kernels("backward_wgmma_ws" + registry.ORDERED_DQ):
        return backward()


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
    kw = dict(kv_seq_len=case.kv_seq_len, head_dim_v=case.head_dim_v)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args, **kw)
    plans._PLANS.clear()

    def backward():
        return cuflash.flash_attention_bwd(
            dout, q, k, v, out, lse, *case.args, **kw, deterministic=deterministic
        )

    grads = backward()
    plan = _backward_plan()
    assert plan.spec.name == "backward_wgmma_ws" and plan.dkdv_tma is not None
    # dQ added in launch order, not by its own pass (but in the 256 class: the pass)
    assert plan.ordered == (deterministic and plan.spec.orders_dq(case.head_dim))
    check_results(case, inputs, out, lse, grads)
    if deterministic:
        # the same bits again, and dK and dV those of the dQ pass's plan (its dQ within
        # rounding of the additions'), whose own cp.async launch is compared below
        for got, again in zip(grads, backward()):
            assert cupy.array_equal(got, again)
        plans._PLANS.clear()
        with dispatch.skip_kernels("backward_wgmma_ws" + registry.ORDERED_DQ):
            with_pass = backward()
            plan = _backward_plan()
        assert not plan.ordered and plan.dq is not None
        for got, other in zip(grads[1:], with_pass[1:]):
            assert cupy.array_equal(got, other)
        scale = float(cupy.abs(with_pass[0].astype(cupy.float32)).max())
        difference = cupy.abs(grads[0].astype(cupy.float32) - with_pass[0].astype(cupy.float32))
        assert float(difference.max()) <= 0.02 * scale
        grads = with_pass
        backward = functools.partial(dispatch_skipping, backward)
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


@pytest.mark.parametrize(
    "head_dim, causal, heads, kv_heads, seq_len",
    [
        (128, False, 8, 8, 2048),
        (128, True, 8, 2, 4096),
        (64, True, 16, 4, 4096),
    ],
)
def test_ordered_dq_repeats_bit_for_bit_at_scale(head_dim, causal, heads, kv_heads, seq_len, rng):
    """Many blocks at once, each waiting on the key tiles launched before it: the
    deterministic backward's gradients are the same bits call after call, and its dQ
    that of the dQ pass within rounding."""
    if cupy.cuda.Device().compute_capability < "90":
        pytest.skip("the copy engine's kernels need an H100/H200")
    case = Case(
        dtype="bfloat16", head_dim=head_dim, batch=2, heads=heads, kv_heads=kv_heads,
        q_len=seq_len, kv_len=seq_len, causal=causal,
    )  # fmt: skip
    q, k, v, dout = _arrays(case, random_inputs(case, rng))
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args)

    def backward():
        return cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *case.args, deterministic=True)

    first = [g.copy() for g in backward()]
    for _ in range(4):
        for got, again in zip(first, backward()):
            assert cupy.array_equal(got, again)
    with_pass = dispatch_skipping(backward)
    for got, other in zip(first, with_pass):
        got, other = got.astype(cupy.float32), other.astype(cupy.float32)
        error = float(cupy.linalg.norm(got - other) / cupy.linalg.norm(other))
        assert error < 1e-2, error
