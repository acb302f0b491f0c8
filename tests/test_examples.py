"""The runnable examples in ``examples/``, run small on the CPU path.

Each script runs in a subprocess, as a user would start it; the checks that
must be able to fail are also run in-process with a planted error.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name, *args, timeout=240):
    """Run ``examples/<name>`` with the current interpreter; return the process."""
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args],
                          capture_output=True, text=True, timeout=timeout,
                          cwd=EXAMPLES.parent)


def load_example(name):
    """Import ``examples/<name>`` as a module."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_three_calls_runs_and_passes(dtype):
    proc = run_example("three_calls.py", "--device", "cpu", "--dtype", dtype,
                       "--seq-len", "40", "--samples", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vjp vs fwd + bwd (deterministic)       identical" in proc.stdout
    assert "gradient check passed" in proc.stdout


def test_three_calls_finite_differences_catch_a_wrong_gradient():
    three_calls = load_example("three_calls.py")
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 2, 12, 8)).astype(np.float32)
                     for _ in range(4))
    out, lse = three_calls.cuflash.flash_attention_fwd(q, k, v, 2, 2, 8, causal=True)
    dq, dk, dv = three_calls.cuflash.flash_attention_bwd(dout, q, k, v, out, lse, 2, 2, 8,
                                                         causal=True)
    tolerance = three_calls.TOLERANCE["float32"]
    good = three_calls.finite_difference_check(q, k, v, dout, (dq, dk, dv), True, 6, rng)
    assert max(good.values()) < tolerance
    bad = three_calls.finite_difference_check(q, k, v, dout, (dq, dk * 1.01, dv), True, 6, rng)
    assert bad["dk"] > tolerance


def test_train_tiny_lm_reaches_its_target(tmp_path):
    plot = tmp_path / "loss.png"
    proc = run_example("train_tiny_lm.py", "--tiny", "--device", "cpu", "--require-target",
                       "--plot", str(plot))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "gradient check passed" in out
    assert "device: CPU (NumPy)" in out
    assert "2 heads / 1 KV head" in out  # the gradient check covers GQA
    assert "target: accuracy >= 95%: REACHED" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.stat().st_size > 0


def test_train_tiny_lm_require_target_fails_when_missed():
    proc = run_example("train_tiny_lm.py", "--tiny", "--device", "cpu", "--steps", "2",
                       "--skip-gradcheck", "--require-target", "--untied", "--task", "recall")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "gradient check" not in proc.stdout
    assert "NOT reached" in proc.stdout


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_train_tiny_lm_gradient_check_catches_a_wrong_backward(monkeypatch, tie_embeddings):
    train = load_example("train_tiny_lm.py")
    lines = []
    assert train.gradient_check("recall", tie_embeddings, out=lines.append)
    assert lines[-1] == "gradient check passed"
    correct = train.gelu_backward
    monkeypatch.setattr(train, "gelu_backward", lambda dy, cache: correct(dy, cache) * 1.001)
    lines.clear()
    assert not train.gradient_check("recall", tie_embeddings, out=lines.append)
    assert lines[-1] == "gradient check FAILED"
