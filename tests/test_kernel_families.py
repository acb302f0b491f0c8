"""Every tensor-core kernel family on the GPU, including the ones the default dispatch
passes over on this device (``gpu.SKIP_FAMILIES``, ``gpu.FAMILY_DEVICES``,
``gpu.PREFER_WIDE_BACKWARD``): float32 on TF32 tensor cores (three passes, and the
opt-in one-pass ``allow_tf32``), the mma.sync forward and backward where the wgmma ones
serve by default (H100/H200), the Hopper wgmma forward not pipelined where the pipelined one serves
by default (D = 64 and 128), and the 16-bit backward that splits head_dim across warps."""

import pytest

import cuflash
from cuflash import gpu, problem
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


def _hopper():
    return int(cupy.cuda.Device().compute_capability) == 90


@pytest.fixture
def skip_families(monkeypatch):
    """Set which families the dispatch passes over, for one test."""
    def set_(*families):
        monkeypatch.setattr(gpu, "SKIP_FAMILIES", frozenset(families))
    return set_


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=str)
def test_float32_three_pass_matches_oracle(case, rng, poisoned, skip_families):
    skip_families("wgs")  # the three TF32 passes, not the float16 pieces
    run_and_check(case, cupy, rng)


@pytest.mark.parametrize("case", FLOAT32_CASES[::3], ids=str)
def test_float32_three_pass_deterministic(case, rng, poisoned, skip_families):
    skip_families("wgs")  # the three TF32 passes, not the float16 pieces
    run_and_check(case, cupy, rng, deterministic=True)


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_float32_on_float16_pieces_matches_oracle(case, deterministic, rng, poisoned,
                                                  skip_families):
    """The float32 forward and backward on two float16 pieces and wgmma ("wgs", D = 64
    and 128 on H100/H200)."""
    if not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    skip_families(*gpu.SKIP_FAMILIES - {"wgs"})
    run_and_check(case, cupy, rng, deterministic=deterministic)


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_tf32_matches_oracle_in_tf32(case, deterministic, rng, poisoned):
    run_and_check(case, cupy, rng, deterministic=deterministic, allow_tf32=True)


@pytest.mark.parametrize("case", WIDE_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_mma_sync_kernels_match_oracle(case, deterministic, rng, poisoned, skip_families):
    """The forward and backward of A100-class GPUs, on D = 64/128/256 where Hopper takes
    wgmma (the backward at D = 64 and 128)."""
    skip_families("wg", "wgp", "wgb", "wgd")
    run_and_check(case, cupy, rng, deterministic=deterministic)


@pytest.mark.parametrize("case", [c for c in WIDE_CASES if c.head_dim != 256], ids=str)
def test_unpipelined_wgmma_forward_matches_oracle(case, rng, poisoned, skip_families):
    """On an H100/H200 the default forward is the pipelined wgmma one ("wgp") at D = 64
    and 128, the one without the pipeline ("wg") at D = 256; this runs "wg" at 64 and 128."""
    if not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    skip_families(*gpu.SKIP_FAMILIES, "wgp")
    run_and_check(case, cupy, rng)


@pytest.mark.parametrize("case", WIDE_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_wide_backward_matches_oracle(case, deterministic, rng, poisoned, monkeypatch):
    monkeypatch.setattr(gpu, "PREFER_WIDE_BACKWARD", True)
    run_and_check(case, cupy, rng, deterministic=deterministic)


def test_dispatch_picks_families(rng, skip_families, monkeypatch):
    def prob(case, q, k, v, **kw):
        return problem.forward_problem(q, k, v, *case.args, None, None, **kw)

    skip_families()
    for head_dim, bwd in ((40, True), (128, True), (136, False), (256, False)):
        case = Case(head_dim=head_dim)
        q, k, v, _ = random_inputs(case, rng, cupy)
        for allow_tf32, kind in ((False, "tc32"), (True, "tf32")):
            p = prob(case, q, k, v, allow_tf32=allow_tf32)
            assert gpu.uses_tensor_cores(p, (q, k, v), f"fwd_{kind}")
            assert gpu.uses_tensor_cores(p, (q, k, v), f"dkdv_{kind}_atomic_dq") is bwd
            with cuflash.kernel_path("general"):
                assert not gpu.uses_tensor_cores(p, (q, k, v), f"fwd_{kind}")
    skip_families("tc32", "wgs")  # float32 without allow_tf32 runs the general kernel
    case = Case(head_dim=64)
    q, k, v, _ = random_inputs(case, rng, cupy)
    assert gpu._fast_role(prob(case, q, k, v), (q, k, v), "fwd") == (None, None)
    skip_families("tc32")  # or, on Hopper at D = 64 and 128, the float16 pieces
    assert gpu._fast_role(prob(case, q, k, v), (q, k, v), "fwd")[0] == (
        "fwd_wgs" if _hopper() else None)
    assert gpu._fast_role(prob(case, q, k, v), (q, k, v, q), "dkdv", "_atomic_dq")[0] == (
        "dkdv_wgs_atomic_dq" if _hopper() else None)
    skip_families("tc32", "wgs")
    assert gpu._fast_role(prob(case, q, k, v, allow_tf32=True), (q, k, v), "fwd")[0] == "fwd_tf32"
    case = Case(dtype="bfloat16", head_dim=256)
    q, k, v, _ = random_inputs(case, rng, cupy)
    p = prob(case, q, k, v)
    assert gpu._fast_role(p, (q, k, v, q), "dkdv", "_atomic_dq")[0] == (
        "dkdv_wgd_atomic_dq" if _hopper() else "dkdv_tcw_atomic_dq")
    skip_families("tc32", "wgd")
    assert gpu._fast_role(p, (q, k, v, q), "dkdv", "_atomic_dq")[0] == "dkdv_tcw_atomic_dq"
    assert gpu._fast_role(p, (q, k, v), "fwd")[0] == ("fwd_wg" if _hopper() else "fwd_tc")
    case = Case(dtype="bfloat16", head_dim=128)
    q128, k128, v128, _ = random_inputs(case, rng, cupy)
    p128 = prob(case, q128, k128, v128)
    assert gpu._fast_role(p128, (q128, k128, v128), "fwd")[0] == (
        "fwd_wgp" if _hopper() else "fwd_tc")
    assert gpu._fast_role(p128, (q128, k128, v128, q128), "dkdv")[0] == (
        "dkdv_wgb" if _hopper() else "dkdv_tc")
    skip_families("tc32", "wgb")
    assert gpu._fast_role(p128, (q128, k128, v128, q128), "dkdv")[0] == "dkdv_tc"
    monkeypatch.setattr(gpu, "PREFER_WIDE_BACKWARD", True)
    assert gpu._fast_role(p128, (q128, k128, v128, q128), "dkdv")[0] == "dkdv_tcw"
    monkeypatch.setattr(gpu, "PREFER_WIDE_BACKWARD", False)
    skip_families("tc32", "wgp")
    assert gpu._fast_role(p128, (q128, k128, v128), "fwd")[0] == (
        "fwd_wg" if _hopper() else "fwd_tc")
    skip_families("tcw", "wg", "wgp")
    assert not gpu.uses_tensor_cores(p, (q, k, v), "dkdv_tcw_atomic_dq")
    assert gpu._fast_role(p, (q, k, v), "fwd")[0] == "fwd_tc"


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


@pytest.mark.parametrize("case", ACCURACY_CASES[:2], ids=str)  # D = 64, 128: where it serves
def test_float32_pieces_accuracy_target(case, rng, skip_families):
    """The float16-pieces kernels' errors (out, dq, dk, dv): at most 2x the general
    kernel's (printed for the docs)."""
    if not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    arrays = random_inputs(case, rng, cupy)
    ref_out, _, ref_grads = oracle(case, *arrays)
    q, k, v, dout = arrays
    errors = {}
    for name, skipped in (("general", gpu.SKIP_FAMILIES | {"wgs"}),
                          ("pieces", gpu.SKIP_FAMILIES - {"wgs"})):
        skip_families(*skipped)
        p = problem.forward_problem(q, k, v, *case.args, None, None)
        assert (gpu._fast_role(p, (q, k, v), "fwd")[0] == "fwd_wgs") is (name == "pieces")
        assert (gpu._fast_role(p, (q, k, v, dout), "dkdv", "_atomic_dq")[0]
                == "dkdv_wgs_atomic_dq") is (name == "pieces")
        errors[name] = _errors(case, arrays, (ref_out, *ref_grads))
    print(f"\n{case}: general {errors['general']}\n  pieces {errors['pieces']}")
    for what, general, pieces in zip(("out", "dq", "dk", "dv"), errors["general"],
                                     errors["pieces"]):
        assert pieces <= 2 * general, f"{what}: pieces {pieces:.3g}, general {general:.3g}"


def _three_errors(case, rng):
    """Relative errors (out, dq, dk, dv) of the general, 3xTF32 and TF32 kernels."""
    arrays = random_inputs(case, rng, cupy)
    ref_out, _, ref_grads = oracle(case, *arrays)
    refs = (ref_out, *ref_grads)
    with cuflash.kernel_path("general"):
        general = _errors(case, arrays, refs)
    three_pass = _errors(case, arrays, refs)
    tf32 = _errors(case, arrays, refs, allow_tf32=True)
    print(f"\n{case}: general {general}\n  3xTF32 {three_pass}\n  TF32 {tf32}")
    return general, three_pass, tf32


@pytest.mark.parametrize("case", ACCURACY_CASES, ids=str)
def test_float32_tensor_core_errors(case, rng, skip_families):
    """3xTF32 beats one pass; TF32 stays within a sanity bound (errors printed for the docs)."""
    skip_families("wgs")  # the three TF32 passes, not the float16 pieces
    _, three_pass, tf32 = _three_errors(case, rng)
    for name, e_3, e_1 in zip(("out", "dq", "dk", "dv"), three_pass, tf32):
        assert e_3 < e_1 < 2e-2, f"{name}: TF32 {e_1:.3g}, 3xTF32 {e_3:.3g}"


@pytest.mark.xfail(strict=True, reason="3xTF32 drifts (truncating accumulation): 3-18x the "
                   "general kernel's error, so gpu.SKIP_FAMILIES holds tc32 back")
@pytest.mark.parametrize("case", ACCURACY_CASES, ids=str)
def test_float32_three_pass_accuracy_target(case, rng, skip_families):
    """The target: error at most 2x the general float32 kernel's."""
    skip_families("wgs")  # the three TF32 passes, not the float16 pieces
    general, three_pass, _ = _three_errors(case, rng)
    for name, e_gen, e_3 in zip(("out", "dq", "dk", "dv"), general, three_pass):
        assert e_3 <= 2 * e_gen + 1e-7, f"{name}: 3xTF32 {e_3:.3g} vs general {e_gen:.3g}"
