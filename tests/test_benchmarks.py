"""The benchmark tooling without a GPU: asv's suite, FLOP counting, reports, the CLI."""

import dataclasses
import json
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
from support import HAS_GPU

from cuflash import bench

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
    done = subprocess.run(
        [sys.executable, "-m", "asv", "check", "--python=same"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "No problems found" in done.stdout


@pytest.mark.skipif(HAS_GPU, reason="with a GPU the command really runs")
def test_command_without_gpu_says_so_and_exits_0():
    done = subprocess.run(
        [sys.executable, "-m", "cuflash.bench", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
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
    cases = bench.build_grid(bench.DEFAULT_DTYPES, bench.DEFAULT_HEAD_DIMS, bench.DEFAULT_SEQLENS)
    assert len(cases) == 2 * 3 * 6 * 2
    assert all(c.batch * c.seqlen == 16384 and c.heads * c.head_dim == 2048 for c in cases)
    assert cases[0].shape == (32, 32, 512, 64)


def test_tflops_and_ratios_in_the_table(case):
    flops = case.flops("fwd")  # 4 * 16 * 32 * 1024 * 1024 * 64 = 1.374e11
    rows = [
        fake(case, "cuflash", "fwd", 1e-3),
        fake(case, "torch-flash", "fwd", 2e-3, rel_error=3e-3),
        fake(case, "torch-math", "fwd", note="OOM"),
    ]
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
        ["1024", "False"],
        ["4096", "False"],
        ["1024", "True"],
    ]
    assert table.startswith("### Backward, bfloat16")


def test_report_is_markdown_and_json(case, tmp_path):
    rows = [fake(case, "cuflash", "fwd", 1e-3), fake(case, "cuflash", "bwd", 3e-3)]
    memory = [
        {
            "impl": "cuflash",
            "seqlen": 131072,
            "batch": 1,
            "heads": 16,
            "head_dim": 128,
            "dtype": "bfloat16",
            "peak_bytes": 2**30,
            "note": "",
        },
        {
            "impl": "cupy-naive",
            "seqlen": 131072,
            "batch": 1,
            "heads": 16,
            "head_dim": 128,
            "dtype": "bfloat16",
            "peak_bytes": None,
            "note": "OOM",
        },
    ]
    first_call = {
        "dtype": "bfloat16",
        "head_dim": 128,
        "cold": {"fwd_first_s": 3.5, "bwd_first_s": 0.01, "fwd_second_s": 0.0002},
        "warm_cache": {"error": "Traceback\nRuntimeError: boom"},
    }
    report = {
        "environment": {"gpu": "NVIDIA H200", "cuflash": "0.1.0"},
        "first_call": first_call,
        "memory": memory,
    }
    text = bench.format_report(report, rows)
    assert "GPU: NVIDIA H200" in text
    assert "| 131072 | 1.000 | OOM |" in text
    assert "| empty (compile) | 3.50 | 0.010 | 0.0002 |" in text
    assert "| warm | error: RuntimeError: boom | | |" in text
    json.dumps([m.to_dict() for m in rows])
    assert rows[1].to_dict()["tflops"] == pytest.approx(2.5 * case.flops("fwd") / 3e-3 / 1e12)


def test_saved_report_gives_the_same_tables(case, tmp_path, capsys):
    """``--from-json`` rebuilds the measurements of a saved report: same Markdown."""
    rows = [
        fake(case, "cuflash", "fwd", 1e-3),
        fake(case, "torch-flash", "fwd", 2e-3),
        bench.Measurement(case, "torch-math", "fwd", note="out of memory"),
    ]
    report = {
        "environment": {"gpu": "NVIDIA H200", "cuflash": "0.1.0"},
        "settings": {"allow_tf32": False},
        "measurements": [m.to_dict() for m in rows],
    }
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
    rows = [
        fake(bench.Case.in_grid("float16", d, s, c), impl, "fwd", t)
        for d in (64, 128)
        for s in (512, 1024)
        for c in (False, True)
        for impl, t in (("cuflash", 1e-3), ("torch-flash", 2e-3))
    ]
    paths = bench.plot_throughput(rows, tmp_path)
    assert [p.name for p in paths] == ["throughput-float16-fwd.png"]
    memory = [
        {"impl": "cupy-naive", "seqlen": s, "peak_bytes": b, "note": n}
        for s, b, n in ((1024, 2**26, ""), (2048, None, "OOM"))
    ]
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


# ------------------------------------------ head-dim sweep, small calls, decoding


def test_new_tables_replace_the_grid_and_size_the_budget():
    default = bench.parse_args([])
    assert default.modes == () and default.sweep_cases == []
    assert default.time_budget == bench.DEFAULT_TIME_BUDGET
    args = bench.parse_args(["--small-calls", "--decode"])
    assert args.modes == ("small_calls", "decode") and not args.head_dim_sweep
    assert (
        args.time_budget
        == bench.MODE_TIME_BUDGETS["small_calls"] + bench.MODE_TIME_BUDGETS["decode"]
    )
    assert bench.parse_args(["--decode", "--time-budget", "30"]).time_budget == 30


def test_head_dim_sweep_cases():
    cases = bench.parse_args(["--head-dim-sweep"]).sweep_cases
    assert len(cases) == 2 * 11 * 2 * 2 + 6 * 2 * 2
    assert {c.dtype for c in cases} == {"bfloat16", "float16", "float32"}
    assert {c.head_dim for c in cases if c.dtype == "float32"} == {32, 64, 96, 128, 160, 256}
    assert {c.seqlen for c in cases} == {1024, 4096}
    assert all(c.batch * c.seqlen == 16384 and c.heads == max(1, 2048 // c.head_dim) for c in cases)
    assert bench.Case.in_grid("bfloat16", 80, 4096, True).shape == (4, 25, 4096, 80)
    narrow = bench.parse_args(
        [
            "--head-dim-sweep",
            "--dtype",
            "bfloat16,float32",
            "--head-dims",
            "48,80",
            "--seqlens",
            "1024",
        ]
    ).sweep_cases
    assert [(c.dtype, c.head_dim, c.causal) for c in narrow] == [
        (d, h, c) for d in ("bfloat16", "float32") for h in (48, 80) for c in (False, True)
    ]
    assert bench.sweep_peer_backends("float32") == ("EFFICIENT_ATTENTION",)
    assert bench.sweep_target("float16") == ("torch-flash", 1.0)


def test_decode_cases_and_cache_bytes():
    cases = bench.decode_cases()
    assert len(cases) == 6 * 3 + 2 + 4
    assert {(c.batch, c.cache_len) for c in cases if c.q_len == 1 and not c.new_len} == {
        (1, 8192),
        (1, 32768),
        (4, 8192),
        (16, 8192),
        (64, 4096),
        (128, 2048),
    }
    assert [(c.batch, c.cache_len, c.q_len) for c in cases if c.q_len > 1] == [
        (16, 8192, 4),
        (16, 8192, 512),
    ]
    assert [(c.batch, c.cache_len, c.block_size, c.rotary) for c in cases if c.new_len] == [
        (64, 4096, 0, False),
        (64, 4096, 0, True),
        (64, 4096, 16, False),
        (64, 4096, 16, True),
    ]
    assert bench.DecodeCase(64, 4096, new_len=1, rotary=True).group.rotary  # its own reference
    assert {c.layout for c in cases} == {"contiguous", "paged 16", "paged 256"}
    case = bench.DecodeCase(16, 8192, block_size=256)
    assert case.cache_bytes == 2 * 16 * 8 * 8192 * 128 * 2  # 512 MiB of bfloat16
    assert case.group == bench.DecodeCase(16, 8192)


def test_paged_cache_holds_the_same_keys():
    if bench.cupy is None:
        pytest.skip("CuPy is not installed")
    keys = np.arange(2 * 3 * 8 * 4, dtype=np.float32).reshape(2, 3, 8, 4)
    x = bench.DecodeInputSet(None, keys, -keys, None, keys, -keys)
    paged = bench.paged_input_set(x, 4)
    assert paged.k_cache.shape == (4, 3, 4, 4) and paged.block_table.dtype == np.int32
    assert sorted(paged.block_table.ravel()) == [0, 1, 2, 3]
    for b in range(2):
        for j in range(8):
            block = paged.block_table[b, j // 4]
            assert (paged.k_cache[block, :, j % 4] == keys[b, :, j]).all()
            assert (paged.v_cache[block, :, j % 4] == -keys[b, :, j]).all()


def synthetic_report():
    """A saved report of the three new tables, with one refusal and targets missed."""
    sweep = []
    for case in bench.head_dim_sweep_cases(("bfloat16", "float32"), (80, 128), (1024,)):
        peers = (
            (("torch-efficient", 4e-3),)
            if case.dtype == "float32"
            else (("torch-flash", 1.5e-3), ("torch-cudnn", 0.8e-3))
        )
        for direction in bench.DIRECTIONS:
            sweep.append(fake(case, "cuflash", direction, 2e-3 if case.head_dim == 80 else 1e-3))
            sweep += [fake(case, impl, direction, seconds) for impl, seconds in peers]
    small = []
    for case in bench.SMALL_CALL_CASES:
        for direction, factor in (("fwd", 1), ("bwd", 3)):
            small += [
                fake(case, "cuflash", direction, 20e-6 * factor),
                fake(case, "torch-flash", direction, 25e-6 * factor),
                fake(case, "torch-cudnn", direction, note="RuntimeError: No kernel."),
            ]
    host = [
        {
            "impl": impl,
            "direction": direction,
            "calls": 1000,
            **dataclasses.asdict(bench.HOST_TIME_CASE),
            "us_per_call": us,
            "note": "",
        }
        for impl, direction, us in (
            ("cuflash", "fwd", 12.0),
            ("cuflash", "bwd", 41.5),
            ("torch-flash", "fwd", 30.0),
        )
    ]
    host.append({**host[-1], "direction": "bwd", "us_per_call": None, "note": "OOM"})
    decode = []
    # B=1, cache 32768: contiguous, paged 16, paged 256; B=16, cache 8192: contiguous.
    steps = [c for c in bench.decode_cases() if (c.batch, c.cache_len, c.q_len) == (1, 32768, 1)]
    for case in steps + [bench.DecodeCase(16, 8192)]:
        seconds = case.cache_bytes / (3.5e12 if case.batch == 1 else 3.0e12)
        decode.append(
            bench.decode_record(
                case, bench.CuflashDecode(case, None), bench.Timing((seconds,)), "", 1e-3
            )
        )
        if case.batch == 16:  # the e4m3 cache: 0.6 of the bfloat16 step's time
            fp8_impl = types.SimpleNamespace(name="cuflash e4m3")
            decode.append(bench.decode_record(case, fp8_impl, bench.Timing((0.6 * seconds,)), ""))
        if case.block_size == 0:
            for impl, factor in (("torch-flash", 1.2), ("torch-cudnn", 0.9)):
                torch_impl = types.SimpleNamespace(name=impl, gqa="enable_gqa=True")
                decode.append(
                    bench.decode_record(
                        case, torch_impl, bench.Timing((factor * seconds,)), "", 4e-3
                    )
                )
    for case in (c for c in bench.decode_cases() if c.new_len):  # rotary: +8 %, then +2 %
        seconds = (
            case.cache_bytes / 3.9e12 * (1 + (0.02 if case.block_size else 0.08) * case.rotary)
        )
        decode.append(
            bench.decode_record(case, bench.CuflashDecode(case, None), bench.Timing((seconds,)), "")
        )
    return {
        "environment": {"gpu": "NVIDIA H200", "cuflash": "0.1.0"},
        "settings": {"allow_tf32": False},
        "measurements": [],
        "head_dim_sweep": [m.to_dict() for m in sweep],
        "small_calls": {"measurements": [m.to_dict() for m in small], "host_time": host},
        "decode": {"note": "", "records": decode},
    }


def test_new_tables_from_saved_report(tmp_path, capsys):
    report = synthetic_report()
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(report))
    assert bench.main(["--from-json", str(saved)]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == bench.format_report(report, []).strip()
    # Head-dim sweep: TFLOP/s of each implementation, then cuflash / each peer.
    assert (
        "| D | S | causal | B | H | cuflash | torch-flash | torch-cudnn | "
        "cuflash / torch-flash | cuflash / torch-cudnn |"
    ) in printed
    assert "| 80 | 1024 | False | 16 | 25 | 67.1 | 89.5 | 168 | 0.75x | 0.40x |" in printed
    assert (
        "Below target (cuflash / torch-flash < 1): D=80 S=1024 (0.75x), D=80 S=1024 causal (0.75x)."
    ) in printed
    assert "### Head-dim sweep, backward, float32" in printed
    assert "| 128 | 1024 | True | 16 | 16 | 68.7 | 17.2 | 4.00x |" in printed
    assert "Below target (cuflash / torch-efficient < 2): none." in printed
    # Small calls: per-call microseconds, their sum, the peer's sum over cuflash's.
    assert "| bfloat16 | 1 | 8 | 128 | 64 | cuflash | 20.0 | 60.0 | 80.0 | – |" in printed
    assert "| bfloat16 | 1 | 8 | 128 | 64 | torch-flash | 25.0 | 75.0 | 100.0 | 1.25x |" in printed
    assert "Below target: none." in printed
    assert "- torch-cudnn: RuntimeError: No kernel. (6 cases)" in printed
    assert "| cuflash | 12.0 | 41.5 |" in printed and "| torch-flash | 30.0 | – |" in printed
    assert "fwd <= 15 us (met), bwd <= 30 us (missed)" in printed
    assert "- torch-flash bwd: OOM" in printed
    # Decoding: time, TB/s, torch's times (shared by the paged rows), faster torch / cuflash.
    assert "| 1 | 32768 | 1 | contiguous | 38.3 | 3.50 | 46.0 | 34.5 | 0.90x |" in printed
    assert (
        "| 1 | 32768 | 1 | paged 256 | 38.3 | 3.50 | 46.0 | 34.5 | 0.90x | – | – | – |" in printed
    )
    assert (
        "| 16 | 8192 | 1 | contiguous | 179.0 | 3.00 | 214.7 | 161.1 | 0.90x | "
        "107.4 | 2.50 | 0.60 |"
    ) in printed
    assert (
        "Below target: B=1 cache 32768 S_q=1 contiguous (0.90x), "
        "B=1 cache 32768 S_q=1 paged 16 (0.90x)"
    ) in printed
    # a 512 MiB cache, its e4m3 step 0.6 of the bfloat16 one's time
    assert "B=16 cache 8192 S_q=1 contiguous (0.90x, e4m3 0.60 of bfloat16, 3.00 TB/s)." in printed
    assert "torch-flash enable_gqa=True (2 cases)" in printed
    assert "| 64 | 4096 | 1 | paged 16, append 1, rotary | 280.8 | 3.82 | – | – | – |" in printed
    assert (
        "Rotary embedding at the append (one new token a step): B=64 cache 4096 contiguous: "
        "275.3 us without, 297.3 us with (+8.0%); B=64 cache 4096 paged 16: 275.3 us without, "
        "280.8 us with (+2.0%). Target: at most +5%; missed: B=64 cache 4096 contiguous."
    ) in printed


def test_asv_suite_has_the_host_time_decode_mla_fp8_and_varlen_benchmarks():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import bench_attention as suite
    finally:
        sys.path.remove(str(ROOT))
    assert {"time_forward_call", "time_backward_call"} <= set(vars(suite.HostTime))
    assert {"time_decode", "track_cache_tb_per_s"} <= set(vars(suite.Decode))
    assert suite.Decode.params == (["b16-cache8192-contiguous", "b1-cache32768-paged256"],)
    assert {"time_decode", "track_tflops", "track_cache_tb_per_s"} <= set(vars(suite.MlaDecode))
    assert suite.MlaDecode.params == (["b32-h128-cache4096", "b128-h16-cache16384"],)
    assert {"time_forward", "track_tflops"} <= set(vars(suite.Fp8Forward))
    assert suite.Fp8Forward.params == ([64, 128, 256], [2048, 8192], [False, True])
    assert {"track_forward_tflops", "track_backward_tflops"} <= set(vars(suite.Varlen))
    assert {"track_forward_tflops", "track_backward_tflops"} <= set(vars(suite.Modifiers))
    if not HAS_GPU:
        with pytest.raises(NotImplementedError):
            suite.Modifiers().setup("softcap")
        with pytest.raises(NotImplementedError):
            suite.HostTime().setup()
        with pytest.raises(NotImplementedError):
            suite.Decode().setup("b16-cache8192-contiguous")
        with pytest.raises(NotImplementedError):
            suite.MlaDecode().setup("b32-h128-cache4096")
        with pytest.raises(NotImplementedError):
            suite.Fp8Forward().setup(128, 2048, False)
        with pytest.raises(NotImplementedError):
            suite.Varlen().setup()


# ------------------------------------------------------- score modifiers


def _modifier_records(slow=()):
    """Fake records of every variant: the modifiers in ``slow`` at 0.8x plain TFLOP/s."""
    from cuflash import bench_modifiers

    records = []
    for modifier in bench_modifiers.MODIFIERS:
        for impl in (f"cuflash {modifier}", f"flex {modifier}"):
            for direction, ms in (("fwd", 1.0), ("bwd", 2.5)):
                factor = 0.8 if modifier in slow and impl.startswith("cuflash") else 1.0
                records.append(
                    dict(
                        impl=impl,
                        direction=direction,
                        modifier=modifier,
                        median_s=ms / factor * 1e-3,
                        tflops=100 / ms * factor,
                        rel_error=2e-3,
                    )
                )
    return records


def test_modifier_table_names_the_variants_below_target():
    from cuflash import bench_modifiers

    text = bench_modifiers.table(_modifier_records(slow=("alibi",)))
    assert "Below target: alibi fwd, alibi bwd" in text
    assert "| softcap | fwd | 1.000 | 100 | 1.000 | 1.000 | 1.00 | 2.0e-03 |" in text
    assert "Below target: none" in bench_modifiers.table(_modifier_records())


def test_modifier_command_without_gpu_says_so(capsys):
    from cuflash import bench_modifiers

    if HAS_GPU:
        pytest.skip("a GPU is present")
    assert bench_modifiers.main(["--no-torch"]) == 0
    assert "nothing to measure" in capsys.readouterr().out


def test_alibi_slopes_are_geometric():
    from cuflash.bench_modifiers import alibi_slopes

    slopes = alibi_slopes(8)
    assert slopes.dtype == np.float32 and slopes.shape == (8,)
    assert np.allclose(slopes[1:] / slopes[:-1], 2.0**-1) and np.isclose(slopes[-1], 2.0**-8)


# ------------------------------------------------------- packed variable-length


def test_varlen_lengths_sum_to_the_tokens():
    lengths = bench.draw_varlen_lengths()
    assert sum(lengths) == 16384 and lengths == bench.draw_varlen_lengths()
    assert all(64 <= n <= 4096 for n in lengths[:-1]) and 1 <= lengths[-1] <= 4096
    assert bench.draw_varlen_lengths(seed=1) != lengths
    for seed in range(20):
        other = bench.draw_varlen_lengths(seed=seed)
        assert sum(other) == 16384 and all(64 <= n <= 4096 for n in other[:-1])
        assert 1 <= other[-1] <= 4096
    assert bench.draw_varlen_lengths(10, 4, 4) == (4, 4, 2)  # the last one trimmed


def test_varlen_flops_sum_the_dense_flops_of_each_sequence():
    lengths = (100, 3000, 7)
    for causal in (False, True):
        for direction in bench.DIRECTIONS:
            assert bench.varlen_flops(lengths, 16, 128, causal, direction) == sum(
                bench.attention_flops(1, 16, n, 128, causal, direction) for n in lengths
            )
    assert bench.varlen_flops((2048,) * 8, 32, 64, True) == bench.attention_flops(
        8, 32, 2048, 64, True
    )
    assert bench.varlen_flops(lengths, 1, 64, False) == 4 * 64 * (100**2 + 3000**2 + 7**2)


def test_varlen_cases_and_their_dense_equal_problems():
    cases = bench.varlen_cases()
    assert len(cases) == 2 * 2 * 2
    assert {(c.kind, c.head_dim, c.causal) for c in cases} == {
        (k, d, c) for k in ("uniform", "equal") for d in (64, 128) for c in (False, True)
    }
    assert all(
        c.tokens == 16384 and c.heads * c.head_dim == 2048 and c.dtype == "bfloat16" for c in cases
    )
    uniform = next(c for c in cases if c.kind == "uniform" and c.head_dim == 128 and c.causal)
    assert uniform.lengths == bench.draw_varlen_lengths() and uniform.heads == 16
    offsets = uniform.cu_seqlens
    assert offsets.dtype == np.int32 and offsets[0] == 0 and offsets[-1] == 16384
    assert (np.diff(offsets) == uniform.lengths).all()
    assert uniform.flops("bwd") == 2.5 * uniform.flops("fwd")
    dense = uniform.dense_case
    assert dense.batch == round(16384 / uniform.mean_seqlen) == uniform.batch
    assert dense.seqlen % 8 == 0 and abs(dense.seqlen - uniform.mean_seqlen) <= 4
    assert (dense.heads, dense.head_dim, dense.causal) == (16, 128, True)
    equal = next(c for c in cases if c.kind == "equal")
    assert equal.lengths == (2048,) * 8 and equal.label == "equal 8 x 2048"
    assert (equal.dense_case.batch, equal.dense_case.seqlen) == (8, 2048)
    assert equal.flops("fwd") == equal.dense_case.flops("fwd")


def test_varlen_option_replaces_the_grid():
    args = bench.parse_args(["--varlen"])
    assert args.varlen and args.modes == ("varlen",)
    assert args.time_budget == bench.MODE_TIME_BUDGETS["varlen"]
    assert bench.parse_args(["--varlen", "--time-budget", "60"]).time_budget == 60
    assert not bench.parse_args([]).varlen


def synthetic_varlen_report():
    """A saved varlen section: torch nested refuses the causal cases, flex is slower."""
    cases = bench.varlen_cases((128,))
    records = []
    for case in cases:
        for direction in bench.DIRECTIONS:
            seconds = case.flops(direction) / 400e12  # 400 TFLOP/s for cuflash varlen
            dense = case.dense_case
            rows = [
                (case, "cuflash-varlen", seconds, "", None),
                (dense, "cuflash-dense-equal", dense.flops(direction) / 500e12, "", None),
                (
                    case,
                    "torch-nested-flash",
                    None if case.causal else seconds / 0.8,
                    "RuntimeError: No available kernel." if case.causal else "",
                    2e-3,
                ),
                (case, "torch-flex", 2 * seconds, "", 3e-3),
            ]
            for measured, impl, median, note, error in rows:
                timing = None if median is None else bench.Timing((median,) * 5)
                m = bench.Measurement(
                    measured,
                    impl,
                    direction,
                    timing,
                    note,
                    error if direction == "fwd" and timing else None,
                )
                records.append(bench.varlen_record(case, m))
    return {
        "lengths": {c.kind: list(c.lengths) for c in cases},
        "seed": 0,
        "records": records,
        "ratios": bench.varlen_ratios(records),
    }


def test_varlen_table_from_saved_report(tmp_path, capsys):
    varlen = synthetic_varlen_report()
    report = {
        "environment": {"gpu": "NVIDIA H200"},
        "settings": {},
        "measurements": [],
        "varlen": varlen,
    }
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(report))
    assert bench.main(["--from-json", str(saved)]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == bench.format_report(report, []).strip()
    assert "### Packed variable-length batch" in printed
    lengths = ", ".join(map(str, bench.draw_varlen_lengths()))
    assert (
        f"(seed 0, the last trimmed): {lengths}; mean 1489.5; dense-equal B=11 S=1488." in printed
    )
    assert "Equal: 8 x 2048; dense-equal B=8 S=2048." in printed
    assert (
        "| lengths | D | H | causal | dense B x S | cuflash-varlen | cuflash-dense-equal | "
        "torch-nested-flash | torch-flex | varlen / cuflash-dense-equal | "
        "varlen / torch-nested-flash | varlen / torch-flex |"
    ) in printed
    assert (
        "| uniform 64..4096 (11 seqs) | 128 | 16 | False | 11 x 1488 | 400 | 500 | 320 | "
        "200 | 0.80x | 1.25x | 2.00x |"
    ) in printed
    assert (
        "| equal 8 x 2048 | 128 | 16 | True | 8 x 2048 | 400 | 500 | – | 200 | 0.80x | – |"
        in printed
    )
    assert (
        "Below target (cuflash-varlen / cuflash-dense-equal < 0.95): uniform 64..4096 "
        "(11 seqs) D=128 (0.80x)" in printed
    )
    assert "- torch-nested-flash: RuntimeError: No available kernel. (2 cases)" in printed
    assert "torch-nested-flash 2.0e-03, torch-flex 3.0e-03" in printed
    assert printed.count("#### ") == 2
    ratio = varlen["ratios"][0]
    assert (ratio["kind"], ratio["head_dim"], ratio["causal"], ratio["direction"]) == (
        "uniform",
        128,
        False,
        "fwd",
    )
    assert ratio["cuflash-dense-equal"] == pytest.approx(0.8)
    assert ratio["torch-flex"] == pytest.approx(2.0)
    causal = next(r for r in varlen["ratios"] if r["causal"])
    assert causal["torch-nested-flash"] is None
    json.dumps(varlen)
    empty = bench.format_varlen({"records": [], "note": "torch missing"})
    assert empty.endswith("Not measured: torch missing.")


def test_varlen_mask_is_the_document_mask():
    document = np.repeat(np.arange(3), (2, 3, 1))
    q_idx, kv_idx = np.meshgrid(np.arange(6), np.arange(6), indexing="ij")
    plain = bench.document_mask_mod(document, False)(0, 0, q_idx, kv_idx)
    causal = bench.document_mask_mod(document, True)(0, 0, q_idx, kv_idx)
    assert plain.sum() == 2 * 2 + 3 * 3 + 1 and causal.sum() == 3 + 6 + 1
    assert (causal == (plain & (q_idx >= kv_idx))).all()


def test_head_dim_v_shape_and_flops():
    """The MLA training shape, and FLOPs at the true widths that reduce to the Performance
    page's convention when the widths are equal."""
    mla = bench.MLA_TRAINING
    assert (mla.dtype, mla.heads, mla.head_dim, mla.head_dim_v, mla.seqlen) == (
        "bfloat16",
        16,
        192,
        128,
        4096,
    )
    assert mla.causal and mla.batch * mla.seqlen == bench.TOKENS
    equal = dataclasses.replace(mla, head_dim_v=mla.head_dim)
    for direction in bench.DIRECTIONS:
        want = bench.attention_flops(4, 16, 4096, 192, True, direction)
        assert equal.flops(direction) == want
        assert mla.flops(direction) < want
    assert mla.flops("fwd") == 4 * 16 * 4096**2 * (192 + 128)


def test_head_dim_v_option_and_table(capsys, tmp_path):
    args = bench.parse_args(["--head-dim-v"])
    assert args.modes == ("head_dim_v",) and args.time_budget == 60.0
    mla = dataclasses.asdict(bench.MLA_TRAINING)

    def record(call, direction, seconds):
        timing = None if seconds is None else bench.Timing((seconds,) * 5).summary()
        flops = bench.MLA_TRAINING.flops(direction)
        note = "" if seconds else "OOM"
        return dict(call=call, direction=direction, **mla, timing=timing, flops=flops, note=note)

    records = [
        record("head_dim_v", "fwd", 0.004),
        record("v padded", "fwd", 0.005),
        record("head_dim_v", "bwd", None),
        record("v padded", "bwd", 0.012),
    ]
    table = bench.format_value_dims(records)
    assert "D=192 D_v=128 causal" in table
    assert "| fwd | head_dim_v | 4.000 |" in table and "| 1.25x |" in table
    assert "- head_dim_v bwd: OOM" in table
    report = {"environment": {}, "settings": {}, "head_dim_v": records, "measurements": []}
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(report))
    assert bench.main(["--from-json", str(saved)]) == 0
    assert table in capsys.readouterr().out


def test_fp8_option_and_table(capsys, tmp_path):
    """``--fp8``: its cases on the grid's shapes, the cuDNN hook's note when the frontend
    is absent, and the table (bfloat16 / fp8 time) from a saved report."""
    args = bench.parse_args(["--fp8"])
    assert args.modes == ("fp8",) and args.time_budget == bench.MODE_TIME_BUDGETS["fp8"]
    cases = bench.fp8_cases()
    assert len(cases) == 8 and all(c.batch * c.seqlen == bench.TOKENS for c in cases)
    assert all(c.heads * c.head_dim == bench.HIDDEN for c in cases)
    peer, note = bench.cudnn_fp8_peer()
    assert peer is None and note  # no GPU graph here: a reason instead
    case = cases[0]

    def record(call, seconds):
        timing = None if seconds is None else bench.Timing((seconds,) * 5).summary()
        note = "" if seconds else "nvidia-cudnn-frontend is not installed"
        fields = dataclasses.asdict(case)
        return dict(call=call, **fields, timing=timing, flops=case.flops(), note=note)

    records = [record("cuflash fp8", 0.002), record("cuflash bfloat16", 0.003)]
    records.append(record("cudnn fp8", None))
    table = bench.format_fp8(records)
    assert "| 64 | 1024 | False | cuflash fp8 | 2.000 |" in table and "| 1.50x |" in table
    assert "- cudnn fp8: nvidia-cudnn-frontend is not installed" in table
    report = {"environment": {}, "settings": {}, "fp8": records, "measurements": []}
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(report))
    assert bench.main(["--from-json", str(saved)]) == 0
    assert table in capsys.readouterr().out
