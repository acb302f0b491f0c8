"""The CPU path (NumPy arrays) against the float64 oracle, over the case grid."""

import numpy as np
import pytest
from support import Case, grid_cases, random_inputs, run_and_check, to_numpy

import cuflash


@pytest.mark.parametrize("case", grid_cases(), ids=str)
def test_cpu_matches_oracle(case, rng):
    run_and_check(case, np, rng)


def test_cpu_long_sequence_is_blocked(rng):
    """S_q x S_k would be 4 GB in float32; the blocked path never builds it."""
    case = Case(
        batch=1, heads=1, kv_heads=1, q_len=32768, kv_len=32768, head_dim=8, causal=True, window=64
    )
    q, k, v, _ = random_inputs(case, rng)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    # Spot-check the last rows against the plain formula on their 64 keys.
    for i in (0, 100, 32767):
        keys = slice(max(0, i - 63), i + 1)
        s = q[0, 0, i] @ k[0, 0, keys].T / np.sqrt(8)
        w = np.exp(s - s.max())
        np.testing.assert_allclose(out[0, 0, i], w @ v[0, 0, keys] / w.sum(), rtol=2e-5, atol=2e-6)


def test_vjp_twice_identical(rng):
    case = Case(heads=4, kv_heads=2, causal=True)
    q, k, v, dout = random_inputs(case, rng)
    out, vjp = cuflash.flash_attention_vjp(q, k, v, *case.args)
    first, second = vjp(dout), vjp(dout)
    for a, b in zip(first, second):
        assert np.array_equal(a, b)
    assert vjp.lse.shape == (case.batch, case.heads, case.q_len)
    assert vjp.config.causal is True and vjp.config.num_kv_heads == 2
    with pytest.raises(AttributeError):
        vjp.q = None  # immutable


def test_outputs_are_fresh_and_inputs_untouched(rng):
    case = Case(dtype="bfloat16", head_dim=40, causal=True)
    q, k, v, dout = random_inputs(case, rng)
    copies = [a.copy() for a in (q, k, v, dout)]
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args)
    cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *case.args)
    for a, b in zip((q, k, v, dout), copies):
        assert np.array_equal(to_numpy(a).view(np.uint16), b.view(np.uint16))


def test_demo_runs_on_the_cpu_path():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "cuflash", "--cpu"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CPU path" in done.stdout and "check passed" in done.stdout
