"""Kernel families that the dispatch keeps off until these pass on a GPU
(``gpu.RUN_PENDING_KERNELS``): float32 on TF32 tensor cores (3 passes, and
the opt-in one-pass ``allow_tf32``), the 16-bit backward that splits
head_dim across warps (the tensor-core backward for D = 256) and the Hopper
wgmma forward."""

import numpy as np
import pytest

import cuflash
from support import Case, cupy, grid_cases, oracle, random_inputs, rel_error, run_and_check

pytestmark = pytest.mark.gpu
FLOAT32_CASES = [c for c in grid_cases() if c.dtype == "float32"]
WIDE_CASES = [c for c in grid_cases() if c.dtype != "float32" and c.head_dim in (64, 128, 256)]
WIDE_CASES += [
    Case(dtype="bfloat16", head_dim=256, heads=8, kv_heads=2, q_len=200, kv_len=300,
         causal=True),
    Case(dtype="float16", head_dim=256, q_len=150, kv_len=150, window=(30, 10)),
    Case(dtype="bfloat16", head_dim=256, heads=4, kv_heads=1, q_len=1, kv_len=500,
         kv_seq_len=333),
    Case(dtype="float16", head_dim=128, q_len=257, kv_len=129, bshd=True),
]


@pytest.fixture
def pending(monkeypatch):
    """Let the dispatch pick the pending kernel families."""
    from cuflash import gpu

    monkeypatch.setattr(gpu, "RUN_PENDING_KERNELS", True)
    return gpu


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=str)
def test_float32_tensor_cores_match_oracle(case, rng, poisoned, pending):
    run_and_check(case, cupy, rng)


@pytest.mark.parametrize("case", FLOAT32_CASES[::3], ids=str)
def test_float32_tensor_cores_deterministic(case, rng, poisoned, pending):
    run_and_check(case, cupy, rng, deterministic=True)


@pytest.mark.parametrize("case", WIDE_CASES, ids=str)
def test_wgmma_forward_matches_oracle(case, rng, poisoned, pending):
    """On an H100/H200 the forward runs on wgmma (the backward as without pending kernels)."""
    if int(cupy.cuda.Device().compute_capability) != 90:
        pytest.skip("wgmma needs compute capability 9.0")
    run_and_check(case, cupy, rng)


@pytest.mark.parametrize("case", WIDE_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_wide_backward_matches_oracle(case, deterministic, rng, poisoned, pending,
                                      monkeypatch):
    monkeypatch.setattr(pending, "PREFER_WIDE_BACKWARD", True)
    run_and_check(case, cupy, rng, deterministic=deterministic)


def test_pending_dispatch(rng, pending, monkeypatch):
    from cuflash import problem

    def prob(case, q, k, v, **kw):
        return problem.forward_problem(q, k, v, *case.args, None, None, **kw)

    for head_dim, bwd in ((40, True), (128, True), (136, False), (256, False)):
        case = Case(head_dim=head_dim)
        q, k, v, _ = random_inputs(case, rng, cupy)
        for allow_tf32, kind in ((False, "tc32"), (True, "tf32")):
            p = prob(case, q, k, v, allow_tf32=allow_tf32)
            assert pending.uses_tensor_cores(p, (q, k, v), f"fwd_{kind}")
            assert pending.uses_tensor_cores(p, (q, k, v), f"dkdv_{kind}_atomic_dq") is bwd
            with cuflash.kernel_path("general"):
                assert not pending.uses_tensor_cores(p, (q, k, v), f"fwd_{kind}")
    case = Case(dtype="bfloat16", head_dim=256)
    q, k, v, _ = random_inputs(case, rng, cupy)
    p = prob(case, q, k, v)
    hopper = int(cupy.cuda.Device().compute_capability) == 90
    assert pending.uses_tensor_cores(p, (q, k, v), "dkdv_tcw_atomic_dq")
    assert pending._fast_role(p, (q, k, v), "fwd")[0] == ("fwd_wg" if hopper else "fwd_tc")
    monkeypatch.setattr(pending, "RUN_PENDING_KERNELS", False)
    assert not pending.uses_tensor_cores(p, (q, k, v), "dkdv_tcw_atomic_dq")
    assert pending._fast_role(p, (q, k, v), "fwd")[0] == "fwd_tc"


def _errors(case, arrays, refs, **kw):
    q, k, v, dout = arrays
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args, **kw)
    grads = cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *case.args, **kw)
    return [rel_error(got, ref) for got, ref in zip((out, *grads), refs)]


ACCURACY_CASES = [
    Case(batch=2, heads=8, kv_heads=2, q_len=500, kv_len=500, head_dim=64, causal=True),
    Case(batch=1, heads=4, kv_heads=4, q_len=300, kv_len=700, head_dim=128, window=(100, 20)),
    Case(batch=2, heads=4, kv_heads=1, q_len=257, kv_len=257, head_dim=96),
]


@pytest.mark.parametrize("case", ACCURACY_CASES, ids=str)
def test_float32_accuracy_against_general_kernel(case, rng, pending):
    """The target: error at most 2x the general float32 kernel's; TF32 is coarser."""
    arrays = random_inputs(case, rng, cupy)
    ref_out, _, ref_grads = oracle(case, *arrays)
    refs = (ref_out, *ref_grads)
    with cuflash.kernel_path("general"):
        general = _errors(case, arrays, refs)
    tensor_cores = _errors(case, arrays, refs)
    tf32 = _errors(case, arrays, refs, allow_tf32=True)
    print(f"\n{case}: general {general}\n  3xTF32 {tensor_cores}\n  TF32 {tf32}")
    for name, e_gen, e_tc, e_tf32 in zip(("out", "dq", "dk", "dv"), general, tensor_cores, tf32):
        assert e_tc <= 2 * e_gen + 1e-7, f"{name}: 3xTF32 {e_tc:.3g} vs general {e_gen:.3g}"
        assert e_tc < e_tf32 < 2e-2, f"{name}: TF32 {e_tf32:.3g}, 3xTF32 {e_tc:.3g}"
        assert np.isfinite(e_tf32)
