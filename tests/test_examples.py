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
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=EXAMPLES.parent,
    )


def load_example(name):
    """Import ``examples/<name>`` as a module."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_three_calls_runs_and_passes(dtype):
    proc = run_example(
        "three_calls.py", "--device", "cpu", "--dtype", dtype, "--seq-len", "40", "--samples", "4"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vjp vs fwd + bwd (deterministic)       identical" in proc.stdout
    assert "gradient check passed" in proc.stdout


def test_three_calls_finite_differences_catch_a_wrong_gradient():
    three_calls = load_example("three_calls.py")
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 2, 12, 8)).astype(np.float32) for _ in range(4))
    out, lse = three_calls.cuflash.flash_attention_fwd(q, k, v, 2, 2, 8, causal=True)
    dq, dk, dv = three_calls.cuflash.flash_attention_bwd(
        dout, q, k, v, out, lse, 2, 2, 8, causal=True
    )
    tolerance = three_calls.TOLERANCE["float32"]
    good = three_calls.finite_difference_check(q, k, v, dout, (dq, dk, dv), True, 6, rng)
    assert max(good.values()) < tolerance
    bad = three_calls.finite_difference_check(q, k, v, dout, (dq, dk * 1.01, dv), True, 6, rng)
    assert bad["dk"] > tolerance


def test_train_tiny_lm_reaches_its_target(tmp_path):
    plot = tmp_path / "loss.png"
    proc = run_example(
        "train_tiny_lm.py", "--tiny", "--device", "cpu", "--require-target", "--plot", str(plot)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "gradient check passed" in out
    assert "device: CPU (NumPy)" in out
    assert "2 heads / 1 KV head" in out  # the gradient check covers GQA
    assert "target: accuracy >= 95%: REACHED" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.stat().st_size > 0


def test_train_tiny_lm_require_target_fails_when_missed():
    proc = run_example(
        "train_tiny_lm.py",
        "--tiny",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--skip-gradcheck",
        "--require-target",
        "--untied",
        "--task",
        "recall",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "gradient check" not in proc.stdout
    assert "NOT reached" in proc.stdout


def test_train_tiny_lm_gradient_check_covers_the_sinks(monkeypatch):
    """With --sinks the gradient check holds dsinks to finite differences too, and a
    wrong dsinks fails it."""
    train = load_example("train_tiny_lm.py")
    lines = []
    assert train.gradient_check("recall", True, out=lines.append, sinks=True)
    assert any("attn.sinks" in line for line in lines) and lines[-1] == "gradient check passed"
    correct = train.attention_backward

    def wrong(*args):
        dx, dwqkv, dwo, dsinks = correct(*args)
        return dx, dwqkv, dwo, dsinks * 1.01

    monkeypatch.setattr(train, "attention_backward", wrong)
    lines.clear()
    assert not train.gradient_check("recall", True, out=lines.append, sinks=True)


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


def test_train_varlen_lm_tiny_learns_and_compares_layouts(tmp_path, monkeypatch):
    import json
    import re

    # One BLAS thread: its matrices are small, and OpenBLAS threads that spin on
    # cores other processes use slow the run down several times.
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, "1")
    figures = tmp_path / "varlen.json"
    plot = tmp_path / "varlen_loss.png"
    proc = run_example(
        "train_varlen_lm.py",
        "--tiny",
        "--device",
        "cpu",
        "--json",
        str(figures),
        "--plot",
        str(plot),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "packing check:" in out and ": passed" in out
    assert "device: CPU (NumPy)" in out
    for layout in ("packed", "padded"):
        assert re.search(rf"^{layout}: [\d,]+ real tokens/s; held-out loss ", out, re.MULTILINE), (
            out
        )
    assert re.search(r"^packed / padded real tokens/s: \d+\.\d\dx$", out, re.MULTILINE), out
    result = json.loads(figures.read_text())
    assert set(result["real_tokens_per_s"]) == {"packed", "padded"}
    assert all(rate > 0 for rate in result["real_tokens_per_s"].values())
    assert result["packed_over_padded"] > 0
    for layout, run in result["results"].items():
        curve = [point["loss"] for point in run["held_out_curve"]]
        assert curve[0] > 5.0, layout  # about ln(257) at the start
        assert curve[-1] < curve[0] - 1.0, (layout, curve)
    # Same start, same steps, same math: the two layouts learn the same.
    losses = {layout: run["final_held_out_loss"] for layout, run in result["results"].items()}
    assert losses["packed"] == pytest.approx(losses["padded"], rel=1e-3)
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.stat().st_size > 0
    else:
        assert plot.with_suffix(".csv").stat().st_size > 0


def test_train_varlen_lm_packer_keeps_documents_whole():
    import itertools

    varlen_lm = load_example("train_varlen_lm.py")
    max_doc_len, budget = 64, 256
    corpus = varlen_lm.load_corpus(max_files=12, max_doc_len=max_doc_len, held_out_fraction=0.2)
    assert corpus.train and corpus.held_out

    # Documents: only files longer than max_doc_len are cut, at max_doc_len; the
    # pieces of a file put back together give the whole file.
    by_file = {}
    for d in corpus.train + corpus.held_out:
        by_file.setdefault(d.source, []).append(d)
    for source, pieces in by_file.items():
        assert [d.piece for d in pieces] == list(range(len(pieces)))
        assert all(d.length == max_doc_len for d in pieces[:-1])
        assert 1 <= pieces[-1].length <= max_doc_len
        whole = np.concatenate([d.inputs for d in pieces] + [pieces[-1].targets[-1:]])
        data = (varlen_lm.stdlib_root() / source).read_bytes()
        assert np.array_equal(whole, varlen_lm.file_tokens(data)), source

    # One epoch of steps: every document once, in order, within the budget, and a
    # step ends only where the next document would overflow it.
    lengths = [d.length for d in corpus.train]
    steps = varlen_lm.pack_documents(lengths, budget)
    assert [i for step in steps for i in step] == list(range(len(lengths)))
    for step, following in itertools.pairwise(steps):
        assert sum(lengths[i] for i in step) + lengths[following[0]] > budget
    assert all(sum(lengths[i] for i in step) <= budget for step in steps)

    # Packed batches: offsets 0 first, nondecreasing, total last; each document's
    # tokens between its two offsets; positions restart in each document.
    schedule = varlen_lm.step_schedule(corpus.train, budget, seed=0)
    for _ in range(20):
        documents = next(schedule)
        batch = varlen_lm.packed_batch(documents, np)
        cu = batch.cu_seqlens
        total = batch.inputs.shape[1]
        assert cu.dtype == np.int32 and cu.shape == (len(documents) + 1,)
        assert cu[0] == 0 and cu[-1] == total == batch.real_tokens <= budget
        assert np.all(np.diff(cu) >= 0)
        assert batch.max_seqlen == int(np.diff(cu).max()) and type(batch.max_seqlen) is int
        for b, d in enumerate(documents):
            assert np.array_equal(batch.inputs[0, cu[b] : cu[b + 1]], d.inputs)
            assert np.array_equal(batch.targets[0, cu[b] : cu[b + 1]], d.targets)
            assert np.array_equal(batch.positions[cu[b] : cu[b + 1]], np.arange(d.length))
        padded = varlen_lm.padded_batch(documents, np)
        assert np.array_equal(padded.inputs[padded.mask], batch.inputs[0])
        assert padded.real_tokens == batch.real_tokens


def test_train_varlen_lm_check_catches_packing_bugs(monkeypatch):
    varlen_lm = load_example("train_varlen_lm.py")
    corpus = varlen_lm.load_corpus(max_files=8, max_doc_len=64, held_out_fraction=0.2)
    documents = varlen_lm.check_documents(corpus)
    lines = []
    assert varlen_lm.check_packing(documents, out=lines.append)
    assert lines[-1].endswith("passed")

    # Positions that run on across documents instead of restarting.
    monkeypatch.setattr(
        varlen_lm, "positions_in_documents", lambda lengths: np.arange(sum(lengths), dtype=np.int32)
    )
    assert not varlen_lm.check_packing(documents, out=lines.append)
    assert lines[-1].endswith("FAILED")
    monkeypatch.undo()

    # Offsets that merge the third document into the second (12 + 7 tokens: still
    # within max_seqlen, so only the comparison can tell).
    assert [d.length for d in documents][1:3] == [12, 7]
    correct = varlen_lm.cu_seqlens_of
    monkeypatch.setattr(varlen_lm, "cu_seqlens_of", lambda lengths: np.delete(correct(lengths), 2))
    monkeypatch.setattr(
        varlen_lm,
        "positions_in_documents",
        lambda lengths: np.concatenate([np.arange(n) for n in lengths]),
    )
    assert not varlen_lm.check_packing(documents, out=lines.append)
    assert lines[-1].endswith("FAILED")


def test_train_varlen_lm_writes_a_csv_without_matplotlib(tmp_path, monkeypatch, capsys):
    varlen_lm = load_example("train_varlen_lm.py")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    curve = [
        {"step": 0, "loss": 5.5, "train_seconds": 0.0},
        {"step": 10, "loss": 3.0, "train_seconds": 1.5},
    ]
    varlen_lm.write_curves(
        tmp_path / "loss.png",
        [{"layout": "packed", "real_tokens_per_s": 1.0, "held_out_curve": curve}],
    )
    assert not (tmp_path / "loss.png").exists()
    rows = (tmp_path / "loss.csv").read_text().splitlines()
    assert rows == [
        "layout,step,held_out_loss,train_seconds",
        "packed,0,5.500000,0.000",
        "packed,10,3.000000,1.500",
    ]
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_generate_tiny_lm_with_rotary_runs_and_agrees():
    """--rotary: trained with rotary embeddings, cached decoding (tables passed to the
    call, paged) picks the tokens of recomputing without a cache."""
    proc = run_example(
        "generate_tiny_lm.py", "--device", "cpu", "--rotary", "--paged", "--steps", "30"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rotary embeddings" in proc.stdout
    assert "cache and recompute agree" in proc.stdout


@pytest.mark.parametrize("paged", [False, True])
def test_generate_tiny_lm_rotary_cache_gives_the_recomputed_logits(paged):
    """The cached prefill with the tables gives the logits of the model with rotary
    embeddings; without them it does not (the comparison can fail)."""
    example = load_example("generate_tiny_lm.py")
    lm = example.lm
    dtype = np.dtype(np.float32)
    task = lm.ReverseTask(6, 12)
    cfg = lm.ModelConfig(
        task.vocab_size, task.seq_len, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2
    )
    params = lm.init_parameters(cfg, np, np.float32, seed=3)
    params.flat[:] += np.random.default_rng(5).normal(0.0, 0.3, params.flat.shape)
    tables = example.rotary.tables(task.seq_len, cfg.head_dim)
    attention = example.RotaryAttention(example.cuflash.flash_attention_vjp, *tables)
    backend = lm.AttentionBackend(attention, dtype)
    prompt = task.sample(np.random.default_rng(4), 5)[0][:, :7]

    def cached(with_tables):
        cache = example.KVCache(
            cfg, 5, task.seq_len, dtype, np, block_size=3 if paged else None, seed=5
        )
        return example.forward_with_cache(
            params, cfg, prompt, cache, dtype, tables if with_tables else None
        )

    recomputed, _ = lm.model_forward(params, cfg, prompt, backend)
    assert np.allclose(cached(True), recomputed, rtol=1e-4, atol=1e-4)
    assert not np.allclose(cached(False), recomputed, rtol=1e-2, atol=1e-2)


def test_generate_tiny_lm_rotary_backward_is_the_rotations_transpose():
    """RotaryAttention's gradients of q and k against central differences in float64;
    rotating them forward instead of back would not match."""
    example = load_example("generate_tiny_lm.py")
    lm = example.lm
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape) for shape in ((1, 2, 5, 8), (1, 1, 5, 8), (1, 1, 5, 8)))
    weights = rng.standard_normal(q.shape)
    cos, sin = example.rotary.tables(5, 8, dtype=np.float64)
    attention = example.RotaryAttention(lm.oracle_attention_vjp, cos, sin)
    out, vjp = attention(q, k, v, 2, 1, 8, causal=True)
    grads = dict(zip("qk", vjp(weights)[:2]))
    raw_dq = lm.oracle_attention_vjp(
        example.rotate(q, cos, sin), example.rotate(k, cos, sin), v, 2, 1, 8, causal=True
    )[1](weights)[0]
    forward_rotated = example.rotate(raw_dq, cos, sin)  # the planted error

    def loss(q, k):
        return float((attention(q, k, v, 2, 1, 8, causal=True)[0] * weights).sum())

    eps = 1e-6
    for name, index in (("q", (0, 1, 3, 1)), ("q", (0, 0, 4, 6)), ("k", (0, 0, 2, 5))):
        arrays = {"q": q.copy(), "k": k.copy()}
        arrays[name][index] += eps
        plus = loss(**arrays)
        arrays[name][index] -= 2 * eps
        numeric = (plus - loss(**arrays)) / (2 * eps)
        assert abs(numeric - grads[name][index]) <= 1e-6 * max(1.0, abs(numeric)), name
        if name == "q":
            assert abs(numeric - forward_rotated[index]) > 1e-3
