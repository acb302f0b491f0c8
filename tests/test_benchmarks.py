"""The benchmark tooling without a GPU: asv's suite, FLOP counting, reports, the CLI."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from cuflash import bench
from support import HAS_GPU

ROOT = Path(__file__).resolve().parent.parent


def fake(case, impl, direction, seconds=None, note="", rel_error=None):
    """A Measurement with five identical timed calls of ``seconds``."""
    timing = None if seconds is None else bench.Timing((seconds,) * 5)
    return bench.Measurement(case, impl, direction, timing, note, rel_error)


@pytest.fixture
def case():
    return bench.Case.in_grid("bfloat16", 64, 1024, False)


def test_asv_check_passes():
    pytest.importorskip("asv")
    done = subprocess.run([sys.executable, "-m", "asv", "check", "--python=same"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "No problems found" in done.stdout


@pytest.mark.skipif(HAS_GPU, reason="with a GPU the command really runs")
def test_command_without_gpu_says_so_and_exits_0():
    done = subprocess.run([sys.executable, "-m", "cuflash.bench", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU" in done.stderr and "nothing was timed" in done.stderr
    assert done.stdout == ""


def test_flops_follow_spec_section_5():
    forward = 4 * 2 * 3 * 1024 * 1024 * 64
    assert bench.attention_flops(2, 3, 1024, 64, False) == forward
    assert bench.attention_flops(2, 3, 1024, 64, True) == forward / 2
    assert bench.attention_flops(2, 3, 1024, 64, False, "bwd") == 2.5 * forward
    assert bench.attention_flops(2, 3, 1024, 64, True, "bwd") == 1.25 * forward


def test_grid_keeps_tokens_and_hidden_size_fixed():
    cases = bench.build_grid(bench.DEFAULT_DTYPES, bench.DEFAULT_HEAD_DIMS,
                             bench.DEFAULT_SEQLENS)
    assert len(cases) == 2 * 3 * 6 * 2
    assert all(c.batch * c.seqlen == 16384 and c.heads * c.head_dim == 2048 for c in cases)
    assert cases[0].shape == (32, 32, 512, 64)


def test_tflops_and_ratios_in_the_table(case):
    flops = case.flops("fwd")  # 4 * 16 * 32 * 1024 * 1024 * 64 = 1.374e11
    rows = [fake(case, "cuflash", "fwd", 1e-3),
            fake(case, "torch-flash", "fwd", 2e-3, rel_error=3e-3),
            fake(case, "torch-math", "fwd", note="OOM")]
    assert rows[0].tflops == pytest.approx(flops / 1e-3 / 1e12)
    table = bench.format_throughput_table(rows, "bfloat16", "fwd")
    assert "| D | S | causal | B | H | cuflash | torch-flash | torch-math |" in table
    assert "| 64 | 1024 | False | 16 | 32 | 137 | 68.7 (2.00x) | – |" in table
    assert "torch-flash 3.0e-03" in table
    assert "- torch-math: OOM (1 case)" in table


def test_rows_sorted_and_directions_kept_apart(case):
    longer = bench.Case.in_grid("bfloat16", 64, 4096, False)
    causal = bench.Case.in_grid("bfloat16", 64, 1024, True)
    rows = [fake(c, "cuflash", d, 1e-3) for c in (longer, causal, case) for d in ("fwd", "bwd")]
    table = bench.format_throughput_table(rows, "bfloat16", "bwd")
    body = [line for line in table.splitlines() if line.startswith("| 64 ")]
    assert [line.split(" | ")[1:3] for line in body] == [
        ["1024", "False"], ["4096", "False"], ["1024", "True"]]
    assert table.startswith("### Backward, bfloat16")


def test_report_is_markdown_and_json(case, tmp_path):
    rows = [fake(case, "cuflash", "fwd", 1e-3), fake(case, "cuflash", "bwd", 3e-3)]
    memory = [{"impl": "cuflash", "seqlen": 131072, "batch": 1, "heads": 16, "head_dim": 128,
               "dtype": "bfloat16", "peak_bytes": 2**30, "note": ""},
              {"impl": "cupy-naive", "seqlen": 131072, "batch": 1, "heads": 16,
               "head_dim": 128, "dtype": "bfloat16", "peak_bytes": None, "note": "OOM"}]
    first_call = {"dtype": "bfloat16", "head_dim": 128,
                  "cold": {"fwd_first_s": 3.5, "bwd_first_s": 0.01, "fwd_second_s": 0.0002},
                  "warm_cache": {"error": "Traceback\nRuntimeError: boom"}}
    report = {"environment": {"gpu": "NVIDIA H200", "cuflash": "0.1.0"},
              "first_call": first_call, "memory": memory}
    text = bench.format_report(report, rows)
    assert "GPU: NVIDIA H200" in text
    assert "| 131072 | 1.000 | OOM |" in text
    assert "| empty (compile) | 3.50 | 0.010 | 0.0002 |" in text
    assert "| warm | error: RuntimeError: boom | | |" in text
    json.dumps([m.to_dict() for m in rows])
    assert rows[1].to_dict()["tflops"] == pytest.approx(2.5 * case.flops("fwd") / 3e-3 / 1e12)


def test_saved_report_gives_the_same_tables(case, tmp_path, capsys):
    """``--from-json`` rebuilds the measurements of a saved report: same Markdown."""
    rows = [fake(case, "cuflash", "fwd", 1e-3), fake(case, "torch-flash", "fwd", 2e-3),
            bench.Measurement(case, "torch-math", "fwd", note="out of memory")]
    report = {"environment": {"gpu": "NVIDIA H200", "cuflash": "0.1.0"},
              "settings": {"allow_tf32": False},
              "measurements": [m.to_dict() for m in rows]}
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(report))
    assert bench.main(["--from-json", str(saved)]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == bench.format_report(report, rows).strip()
    assert "(2.00x)" in printed and "out of memory" in printed


def test_allow_tf32_reaches_cuflash_and_the_report(case):
    args = bench.parse_args(["--allow-tf32", "--dtype", "float32"])
    assert args.allow_tf32 and args.dtypes == ("float32",)
    assert not bench.parse_args([]).allow_tf32
    impl = bench.implementation_factories(None, allow_tf32=True)[0](case)
    assert impl.name == "cuflash" and impl.allow_tf32
    assert not bench.implementation_factories(None)[0](case).allow_tf32
    rows = [fake(case, "cuflash", "fwd", 1e-3)]
    report = {"environment": {"gpu": "NVIDIA H200"}, "settings": {"allow_tf32": True}}
    assert "`allow_tf32=True`" in bench.format_report(report, rows)
    report["settings"]["allow_tf32"] = False
    assert "allow_tf32" not in bench.format_report(report, rows)


def test_plots_are_written(case, tmp_path):
    pytest.importorskip("matplotlib")
    rows = [fake(bench.Case.in_grid("float16", d, s, c), impl, "fwd", t)
            for d in (64, 128) for s in (512, 1024) for c in (False, True)
            for impl, t in (("cuflash", 1e-3), ("torch-flash", 2e-3))]
    paths = bench.plot_throughput(rows, tmp_path)
    assert [p.name for p in paths] == ["throughput-float16-fwd.png"]
    memory = [{"impl": "cupy-naive", "seqlen": s, "peak_bytes": b, "note": n}
              for s, b, n in ((1024, 2**26, ""), (2048, None, "OOM"))]
    assert bench.plot_memory(memory, tmp_path).stat().st_size > 0


def test_failure_reasons():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("Flash attention needs fp16\nmore detail", stacklevel=1)
    reason = bench.failure_reason(RuntimeError("No available kernel.\ntrace"), caught)
    assert reason == "Flash attention needs fp16; RuntimeError: No available kernel."
    assert bench.failure_reason(MemoryError("CUDA out of memory"), []) == "OOM"


def test_rotation_spans_the_l2_cache(case):
    l2 = 60 * 2**20
    assert bench.rotation_count(case, l2) == 2  # one set is 256 MiB already
    small = bench.Case("float16", 64, 128, False, batch=1, heads=4)
    assert bench.rotation_count(small, l2) == bench.MAX_INPUT_SETS


def test_budget_shrinks_the_target():
    budget = bench.Budget(100.0, 0.2)
    assert budget.target_for(10) == 0.2
    assert budget.target_for(10**6) == bench.MIN_TARGET_SECONDS


def test_quick_and_explicit_options():
    args = bench.parse_args(["--quick", "--head-dims", "128"])
    assert args.dtypes == ("bfloat16",) and args.head_dims == (128,)
    assert args.seqlens == bench.QUICK_SEQLENS
    assert bench.parse_args(["--dtype", "float32"]).dtypes == ("float32",)
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtype", "float64"])
