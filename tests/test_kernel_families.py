"""Every tensor-core kernel of the registry on the GPU, including the ones the default
dispatch passes over on this device (``cuflash.dispatch.skip_kernels`` lets the next in
line serve): the mma.sync forward and backward where the wgmma ones serve by default
(H100/H200), the wgmma forward without the pipelined softmax, the split-D mma.sync
backward, float32 on TF32 tensor cores (``allow_tf32``) and on float16 pieces."""

import pytest
from support import (
    Case,
    check_close,
    check_lse,
    check_results,
    cupy,
    grid_cases,
    naive_in_dtype,
    oracle,
    random_inputs,
    rel_error,
    run_and_check,
    score_magnitude,
)

import cuflash
from cuflash import dispatch
from cuflash.core import problem
from cuflash.gpu import launch as gpu
from cuflash.gpu import plans, registry

pytestmark = pytest.mark.gpu
FLOAT32_CASES = [c for c in grid_cases() if c.dtype == "float32"]
WIDE_CASES = [c for c in grid_cases() if c.dtype != "float32" and c.head_dim in (64, 128, 256)]
WIDE_CASES += [
    Case(dtype="bfloat16", head_dim=256, heads=8, kv_heads=2, q_len=200, kv_len=300, causal=True),
    Case(dtype="float16", head_dim=256, q_len=150, kv_len=150, window=(30, 10)),
    Case(dtype="bfloat16", head_dim=256, heads=4, kv_heads=1, q_len=1, kv_len=500, kv_seq_len=333),
    Case(dtype="float16", head_dim=128, q_len=257, kv_len=129, bshd=True),
]
WGMMA_16_BIT = ("forward_wgmma_ws", "forward_wgmma", "backward_wgmma_ws", "backward_wgmma")


def _hopper():
    return int(cupy.cuda.Device().compute_capability) == 90


def _problem(case, arrays, **kw):
    q, k, v = arrays[:3]
    config = cuflash.AttentionConfig(*case.args, case.kv_seq_len, **kw)
    return problem.forward_problem(q, k, v, config)


def _chosen(case, arrays, direction, **kw):
    p = _problem(case, arrays, **kw)
    return gpu.choose(p, direction, gpu.rows_are_16_byte_aligned(arrays)).name


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_float32_on_float16_pieces_matches_oracle(case, deterministic, rng, poisoned):
    """float32's default on H100/H200: two float16 pieces and wgmma."""
    if not _hopper():
        pytest.skip("the float16 pieces serve compute capability 9.0")
    arrays = random_inputs(case, rng, cupy)
    assert _chosen(case, arrays, "forward") == _pieces_kernel("forward", case.head_dim)
    assert _chosen(case, arrays, "backward") == _pieces_kernel("backward", case.head_dim)
    run_and_check(case, cupy, rng, deterministic=deterministic)


def _pieces_kernel(direction, head_dim):
    return f"{direction}_float32_pieces" + ("" if head_dim <= 128 else "_wide")


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_tf32_matches_oracle_in_tf32(case, deterministic, rng, poisoned):
    run_and_check(case, cupy, rng, deterministic=deterministic, allow_tf32=True)


@pytest.mark.parametrize("case", WIDE_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_mma_sync_kernels_match_oracle(case, deterministic, rng, poisoned):
    """The forward and backward of A100-class GPUs, where Hopper takes wgmma."""
    with dispatch.skip_kernels(*WGMMA_16_BIT):
        arrays = random_inputs(case, rng, cupy)
        assert _chosen(case, arrays, "forward") == "forward_mma_sync"
        run_and_check(case, cupy, rng, deterministic=deterministic)


@pytest.mark.parametrize("case", WIDE_CASES, ids=str)
def test_forwards_without_warp_specialization_match_oracle(case, rng, poisoned):
    """On an H100/H200 the warp-specialized forward serves every call but short plain
    ones up to D = 64; this runs the next in line (forward_wgmma up to D = 64, the
    mma.sync forward above)."""
    if not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    with dispatch.skip_kernels("forward_wgmma_ws"):
        run_and_check(case, cupy, rng)


# Plain calls of the 64 class: short ones that the warp-specialized forward's three
# consumers take only when forward_wgmma is skipped, and long ones it takes by default
# (rows that see 768 keys or more on average).
SHORT_AND_LONG_64 = [c for c in WIDE_CASES if c.head_dim == 64] + [
    Case(dtype="bfloat16", head_dim=64, heads=4, kv_heads=2, q_len=400, kv_len=1000),
    Case(dtype="float16", head_dim=40, q_len=1700, kv_len=1700, causal=True),
    Case(dtype="bfloat16", head_dim=32, batch=1, q_len=200, kv_len=900, window=(800, 0)),
]


@pytest.mark.parametrize("case", SHORT_AND_LONG_64, ids=str)
def test_three_consumer_forward_matches_oracle(case, rng, poisoned):
    """forward_wgmma_ws with three consumers of 64 rows (the 64 class), plain calls."""
    if not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    arrays = random_inputs(case, rng, cupy)
    keys = _problem(case, arrays).keys_a_row_sees()
    assert _chosen(case, arrays, "forward") == (
        "forward_wgmma_ws" if keys >= 768 else "forward_wgmma"
    )
    with dispatch.skip_kernels("forward_wgmma"):
        assert _chosen(case, arrays, "forward") == "forward_wgmma_ws"
        run_and_check(case, cupy, rng)


# Short plain calls with more work tiles than an H200 has SMs, so that each persistent
# block walks two or more: causal D = 128 with GQA, and D = 64 (three consumers).
PERSISTENT_CASES = [
    Case(dtype="bfloat16", head_dim=128, batch=4, heads=8, kv_heads=2, q_len=700, kv_len=900,
         causal=True),
    Case(dtype="float16", head_dim=64, batch=4, heads=8, kv_heads=8, q_len=1000, kv_len=1000),
]  # fmt: skip


@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=str)
def test_short_calls_run_the_persistent_forward(case, rng, poisoned, monkeypatch):
    """Plain calls whose rows see fewer than ``persistent_keys`` keys run forward_wgmma_ws's
    persistent role, a block an SM: the oracle's values, and bit for bit those of a
    block a tile (``CUFLASH_PERSISTENT=0``)."""
    if not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    inputs = random_inputs(case, rng)
    q, k, v = (cupy.asarray(x) for x in inputs[:3])
    spec = registry.BY_NAME["forward_wgmma_ws"]
    assert spec.persists(False, _problem(case, (q, k, v)).keys_a_row_sees())
    monkeypatch.delenv("CUFLASH_PERSISTENT", raising=False)
    plans.clear()
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args)
    (plan,) = [p for p in plans._PLANS.values() if isinstance(p, gpu.ForwardPlan)]
    assert plan.spec is spec and plan.persistent
    ref_out, ref_lse, _ = oracle(case, *inputs)
    naive_out, _ = naive_in_dtype(case, *inputs)
    score_max = score_magnitude(case, *inputs[:2])
    check_close("out", out, ref_out, naive_out, case.dtype, score_max=score_max)
    check_lse(lse, ref_lse)
    monkeypatch.setenv("CUFLASH_PERSISTENT", "0")
    plans.clear()
    one_a_block = cuflash.flash_attention_fwd(q, k, v, *case.args)
    (plan,) = [p for p in plans._PLANS.values() if isinstance(p, gpu.ForwardPlan)]
    assert not plan.persistent
    assert cupy.array_equal(out, one_a_block[0]) and cupy.array_equal(lse, one_a_block[1])


@pytest.mark.parametrize("deterministic", [False, True])
def test_persistent_backward_matches_oracle(deterministic, rng, poisoned, monkeypatch):
    """backward_wgmma_ws's persistent role (``CUFLASH_PERSISTENT=1``; no call takes it by
    default yet): the oracle's gradients, and bit for bit a block a tile's dK and dV
    (deterministic: both with the dQ pass, which the persistent role runs, and so dQ too)."""
    if not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    # 8 key tiles x 8 KV heads x 4 entries: two or more tiles a block on an H200
    case = Case(dtype="bfloat16", head_dim=128, batch=4, heads=16, kv_heads=8, q_len=700,
                kv_len=900, causal=True)  # fmt: skip
    inputs = random_inputs(case, rng)
    q, k, v, dout = (cupy.asarray(x) for x in inputs)
    runs = []
    for forced in ("1", "0"):
        monkeypatch.setenv("CUFLASH_PERSISTENT", forced)
        plans.clear()
        out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args)
        with dispatch.skip_kernels("backward_wgmma_ws" + registry.ORDERED_DQ):
            grads = cuflash.flash_attention_bwd(
                dout, q, k, v, out, lse, *case.args, deterministic=deterministic
            )
        (plan,) = [p for p in plans._PLANS.values() if isinstance(p, gpu.BackwardPlan)]
        assert plan.spec.name == "backward_wgmma_ws" and plan.persistent == (forced == "1")
        runs.append((out, lse, grads))
    (out, lse, grads), (_, _, one_a_block) = runs
    check_results(case, inputs, out, lse, grads)
    assert cupy.array_equal(grads[1], one_a_block[1])
    assert cupy.array_equal(grads[2], one_a_block[2])
    if deterministic:
        assert cupy.array_equal(grads[0], one_a_block[0])


@pytest.mark.parametrize("case", WIDE_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_split_d_backward_matches_oracle(case, deterministic, rng, poisoned):
    with dispatch.skip_kernels("backward_wgmma_ws", "backward_wgmma", "backward_mma_sync"):
        arrays = random_inputs(case, rng, cupy)
        assert _chosen(case, arrays, "backward") == "backward_mma_sync_split_d"
        run_and_check(case, cupy, rng, deterministic=deterministic)


def test_dispatch_follows_the_registry(rng):
    """The GPU path asks the registry: the device's first kernel, the general one on the
    general path or with rows off the 16-byte grid, the next in line when skipped."""
    capability = int(cupy.cuda.Device().compute_capability)
    for dtype, head_dim in (
        ("bfloat16", 40),
        ("float16", 128),
        ("bfloat16", 200),
        ("float32", 64),
        ("float32", 136),
    ):
        case = Case(dtype=dtype, head_dim=head_dim)
        arrays = random_inputs(case, rng, cupy)
        keys = _problem(case, arrays).keys_a_row_sees()
        for direction in ("forward", "backward"):
            expected = registry.choose(
                direction,
                arrays[0].dtype,
                head_dim,
                capability,
                keys_a_row_sees=keys if direction == "forward" else None,
            )
            assert _chosen(case, arrays, direction) == expected.name
            with cuflash.kernel_path("general"):
                assert _chosen(case, arrays, direction) == f"{direction}_general"
            if expected.instruction != "cuda cores":
                with dispatch.skip_kernels(expected.name):
                    assert _chosen(case, arrays, direction) != expected.name
        if dtype == "float32":
            assert _chosen(case, arrays, "forward", allow_tf32=True) == "forward_tf32"
    case = Case(dtype="bfloat16", head_dim=64)
    q, k, v, _ = random_inputs(case, rng, cupy)
    wide = cupy.asarray(rng.standard_normal(q.shape[:3] + (72,)).astype(q.dtype))
    assert _chosen(case, (wide[..., 1:65], k, v), "forward") == "forward_general"
    with pytest.raises(cuflash.InvalidArgumentError, match="unknown kernels"):
        with dispatch.skip_kernels("forward_fastest"):
            pass


def test_plans_are_kept_per_kernel_choice(rng):
    """A launch plan cached outside a ``skip_kernels`` (or ``try_kernels``) block is not
    taken inside it: the same call there runs the kernel the context chooses."""
    if not _hopper():
        pytest.skip("the 128 class's two wgmma backwards need compute capability 9.0")
    case = Case(dtype="bfloat16", head_dim=128)
    q, k, v, dout = random_inputs(case, rng, cupy)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args)

    def backward_kernels():
        plans.clear()
        cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *case.args)
        before = {p.spec.name for p in plans._PLANS.values() if isinstance(p, gpu.BackwardPlan)}
        with dispatch.skip_kernels("backward_wgmma_ws"):
            cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *case.args)
        return before, {
            p.spec.name for p in plans._PLANS.values() if isinstance(p, gpu.BackwardPlan)
        }

    before, after = backward_kernels()
    assert before == {"backward_wgmma_ws"} and after == {"backward_wgmma_ws", "backward_wgmma"}
    key = plans.signature((q,), ())
    with dispatch._with(2, frozenset({"an opt-in kernel"})):
        assert plans.signature((q,), ()) != key


def _errors(case, arrays, refs, **kw):
    q, k, v, dout = arrays
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args, **kw)
    grads = cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *case.args, **kw)
    return [rel_error(got, ref) for got, ref in zip((out, *grads), refs)]


ACCURACY_CASES = [
    Case(batch=2, heads=8, kv_heads=2, q_len=500, kv_len=500, head_dim=64, causal=True),
    Case(batch=1, heads=4, kv_heads=4, q_len=300, kv_len=700, head_dim=128, window=(100, 20)),
    Case(batch=2, heads=4, kv_heads=1, q_len=257, kv_len=257, head_dim=96),
    Case(batch=1, heads=4, kv_heads=2, q_len=200, kv_len=333, head_dim=40, causal=True),
    Case(batch=2, heads=4, kv_heads=2, q_len=300, kv_len=300, head_dim=256, causal=True),
    Case(batch=1, heads=4, kv_heads=4, q_len=257, kv_len=400, head_dim=160, window=(90, 30)),
]


@pytest.mark.parametrize("case", ACCURACY_CASES, ids=str)
def test_float32_pieces_accuracy_target(case, rng):
    """The float16-pieces kernels' errors (out, dq, dk, dv): at most 2x the general
    kernel's; TF32's within a sanity bound and above the pieces' (printed for the docs;
    past head_dim 128 TF32's gradients are the general backward's)."""
    if not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    arrays = random_inputs(case, rng, cupy)
    ref_out, _, ref_grads = oracle(case, *arrays)
    refs = (ref_out, *ref_grads)
    assert _chosen(case, arrays, "forward") == _pieces_kernel("forward", case.head_dim)
    with cuflash.kernel_path("general"):
        general = _errors(case, arrays, refs)
    pieces = _errors(case, arrays, refs)
    tf32 = _errors(case, arrays, refs, allow_tf32=True)
    print(f"\n{case}: general {general}\n  pieces {pieces}\n  TF32 {tf32}")
    for what, e_general, e_pieces, e_tf32 in zip(("out", "dq", "dk", "dv"), general, pieces, tf32):
        assert e_pieces <= 2 * e_general, f"{what}: pieces {e_pieces:.3g}, general {e_general:.3g}"
        if what == "out" or case.head_dim <= 128:
            assert e_pieces < e_tf32 < 2e-2, f"{what}: TF32 {e_tf32:.3g}, pieces {e_pieces:.3g}"


WS_BACKWARD_CASES = [c for c in WIDE_CASES if 72 <= c.head_dim <= 128] + [
    Case(dtype="bfloat16", head_dim=128, heads=8, kv_heads=2, q_len=400, kv_len=300, causal=True),
    Case(dtype="float16", head_dim=96, heads=2, kv_heads=1, q_len=333, kv_len=517, kv_seq_len=501),
    Case(dtype="bfloat16", head_dim=120, q_len=200, kv_len=260, window=(70, 9)),
    Case(dtype="float16", head_dim=72, heads=4, kv_heads=4, q_len=1, kv_len=300),
]


@pytest.mark.parametrize("case", WS_BACKWARD_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kernel", ["backward_wgmma_ws", "backward_wgmma"])
def test_plain_128_class_backwards_match_oracle(case, deterministic, kernel, rng, poisoned):
    """The 128 class's plain backward: backward_wgmma_ws by default (more query tiles
    than its ring's stages, GQA, cut key tiles, windows, D = 120 (its padded dQ rows), a
    single query row) and backward_wgmma, the next in line, with it skipped; atomic and
    deterministic dQ."""
    if not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    skipped = () if kernel == "backward_wgmma_ws" else ("backward_wgmma_ws",)
    with dispatch.skip_kernels(*skipped):
        arrays = random_inputs(case, rng, cupy)
        assert _chosen(case, arrays, "backward") == kernel
        run_and_check(case, cupy, rng, deterministic=deterministic)
