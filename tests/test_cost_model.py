"""The cost model of context parallelism (``cuflash.distributed.cost_model``): its fit to
the 2-GPU measurement, the properties its predictions must have, its command line, and
the Distributed page's tables, which must be what the command prints."""

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from cuflash.distributed import cost_model as cm
from cuflash.distributed import predictions

ROOT = Path(__file__).resolve().parents[1]
MACHINE = cm.Machine()
PROBLEM = cm.Problem()


def _total(p):
    return p.forward_ms + p.backward_ms


def _checks():
    return {(c.seq_len, c.quantity): c for c in cm.calibrate(MACHINE)}


@pytest.mark.parametrize("seq_len", [65536, 131072])
def test_fits_the_two_gpu_measurement(seq_len):
    checks = _checks()
    for quantity in ("forward ms", "backward ms"):
        for prefix in ("one GPU ", "ring ", "ring kernels "):
            c = checks[seq_len, prefix + quantity]
            assert 0.9 <= c.ratio <= 1.1, c
    assert 0.97 <= checks[seq_len, "one GPU peak GiB"].ratio <= 1.03
    # the target design's memory: below the measured ring's, which copies a step's outputs
    assert 0.8 <= checks[seq_len, "ring peak GiB"].ratio < 1.0
    # one step's transfer timed alone ran slower than the link's bandwidth
    for quantity in ("K,V transfer ms", "dK,dV transfer ms"):
        assert 0.5 <= checks[seq_len, quantity].ratio < 1.0
    assert len(cm.calibrate()) == 10 * len(cm.MEASURED_H200X2)


def test_the_measurement_constant_matches_the_two_gpu_shape():
    m = cm.MEASURED_H200X2[1]
    problem = cm.Problem(seq_len=m.seq_len)
    tflops = problem.flops / (m.one_gpu[0] * 1e-3) / 1e12
    assert 450 < tflops < 470  # the forward's rate on one H200
    assert m.ring[0] / m.one_gpu[0] < 0.54


def _cases():
    for causal in (True, False):
        for heads, kv_heads in ((32, 8), (64, 64), (16, 1)):
            for seq_len in (4096, 65536, 131072, 1048576):
                yield cm.Problem(heads=heads, kv_heads=kv_heads, seq_len=seq_len, causal=causal)


@pytest.mark.parametrize("gpus", [1, 2, 4, 8, 16, 64, 512])
def test_speedup_never_exceeds_the_gpu_count(gpus):
    for problem in _cases():
        for u in cm.ulysses_sizes(problem, gpus, MACHINE) + [gpus]:
            if problem.heads % u or problem.kv_heads % u:
                continue
            p = cm.predict("hybrid", problem, gpus, MACHINE, ulysses_size=u)
            assert 0 < p.speedup <= gpus * (1 + 1e-12), (problem, gpus, u, p)
            assert p.exposed_ms >= -1e-9
            assert p.forward_ms >= p.forward_compute_ms > 0


def test_one_gpu_is_the_whole_call():
    p = cm.predict("ring", PROBLEM, 1, MACHINE)
    assert p.speedup == pytest.approx(1.0) and p.exposed_ms == pytest.approx(0.0)
    seconds = PROBLEM.flops / MACHINE.rate(PROBLEM.seq_len)
    assert p.forward_ms == pytest.approx(1e3 * seconds)


def test_rate_falls_for_short_calls():
    rates = [MACHINE.rate(n) for n in (128, 1024, 4096, 16384, 131072)]
    assert rates == sorted(rates) and rates[-1] < MACHINE.forward_tflops * 1e12
    # about the S = 4096 benchmark's 350 and 280 TFLOP/s
    assert MACHINE.rate(4096) / 1e12 == pytest.approx(350, rel=0.03)
    assert MACHINE.rate(4096, backward=True) / 1e12 == pytest.approx(280, rel=0.03)


def _ring_exposed(seq_len, gpus, machine=MACHINE):
    p = cm.predict("ring", replace(PROBLEM, seq_len=seq_len), gpus, machine)
    lat = machine.latency_us * 1e-3
    return p.forward_ms - p.forward_compute_ms - (gpus - 1) * lat, p


def test_break_even_across_nodes():
    """Above the break-even shard the transfers hide (only the latencies remain), below
    it they show; the closed form is ``(H_kv / H) (2 rate / W)`` less the short-call
    term."""
    gpus = 64
    tokens = cm.break_even_tokens(PROBLEM, MACHINE, gpus)
    ratio = PROBLEM.kv_heads / PROBLEM.heads
    expected = ratio * 2 * MACHINE.forward_tflops * 1e12 / (MACHINE.inter_node_gbs * 1e9)
    assert tokens == pytest.approx(expected - 2 * MACHINE.forward_half_tokens)
    assert 1000 < tokens < 4000
    hidden, _ = _ring_exposed(round(gpus * tokens * 1.02), gpus)
    assert hidden == pytest.approx(0.0, abs=1e-9)
    shown, _ = _ring_exposed(round(gpus * tokens * 0.98), gpus)
    assert shown > 1e-4
    small, p = _ring_exposed(round(gpus * tokens / 4), gpus)
    assert small > 0.2 * p.forward_compute_ms
    # the backward: hidden above its own break-even but for the last accumulators' trip
    back = cm.break_even_tokens(PROBLEM, MACHINE, gpus, backward=True)
    assert 0 < back < tokens
    seq_len = round(gpus * back * 1.05)
    _, p = _ring_exposed(seq_len, gpus)
    shard = PROBLEM.values(PROBLEM.kv_heads, seq_len / gpus)
    last_trip = 2 * shard * 4 / (MACHINE.inter_node_gbs * 1e9) * 1e3
    lat = MACHINE.latency_us * 1e-3
    assert p.backward_ms - p.backward_compute_ms == pytest.approx(
        (gpus + 1) * lat + last_trip, rel=1e-3
    )


def test_nvlink_hides_the_ring_transfers():
    assert cm.break_even_tokens(PROBLEM, MACHINE, 8) == 0.0
    for seq_len in (8192, 65536, 1048576):
        exposed, _ = _ring_exposed(seq_len, 8)
        assert exposed == pytest.approx(0.0, abs=1e-9)


def test_ulysses_needs_the_heads_to_split():
    with pytest.raises(ValueError, match="do not split"):
        cm.predict("ulysses", PROBLEM, 64, MACHINE)  # H = 32
    with pytest.raises(ValueError, match="do not split"):
        cm.predict("ulysses", replace(PROBLEM, kv_heads=3, heads=12), 4, MACHINE)
    with pytest.raises(ValueError, match="do not split"):
        cm.predict("hybrid", PROBLEM, 128, MACHINE, ulysses_size=64)
    with pytest.raises(ValueError, match="does not divide"):
        cm.predict("hybrid", PROBLEM, 64, MACHINE, ulysses_size=3)
    with pytest.raises(ValueError, match="unknown mode"):
        cm.predict("tree", PROBLEM, 8, MACHINE)
    assert cm.predict("ulysses", PROBLEM, 8, MACHINE).ulysses_size == 8
    assert cm.ulysses_sizes(PROBLEM, 64, MACHINE) == [1, 2, 4, 8]
    # fewer KV heads than GPUs: each KV head copied to u / H_kv of them
    assert cm.ulysses_sizes(replace(PROBLEM, kv_heads=1), 64, MACHINE) == [1, 2, 4, 8]
    assert cm.ulysses_sizes(replace(PROBLEM, kv_heads=3, heads=12), 12, MACHINE) == [1, 3, 6]
    copied = cm.predict("ulysses", replace(PROBLEM, kv_heads=1), 8, MACHINE)
    split = cm.predict("ulysses", replace(PROBLEM, kv_heads=8), 8, MACHINE)
    assert copied.exposed_ms == split.exposed_ms  # 8 copies of one head: as 8 heads
    wider = cm.predict("ulysses", replace(PROBLEM, kv_heads=16), 8, MACHINE)
    # 2 KV heads a GPU: two parts, one's all-to-all under the other's call
    assert wider.exposed_ms < split.exposed_ms


def test_a_part_of_the_heads_travels_under_the_other_parts_call():
    assert cm._pipelined(10.0, 100.0, 1) == 10.0
    assert cm._pipelined(10.0, 100.0, 2) == 5.0  # the second part hidden
    assert cm._pipelined(10.0, 4.0, 2) == 8.0  # a part's call covers 2 of its 5


def test_hybrid_extremes_are_ring_and_ulysses():
    for gpus in (2, 8):
        ring = cm.predict("ring", PROBLEM, gpus, MACHINE)
        ulysses = cm.predict("ulysses", PROBLEM, gpus, MACHINE)
        as_ring = cm.predict("hybrid", PROBLEM, gpus, MACHINE, ulysses_size=1)
        as_ulysses = cm.predict("hybrid", PROBLEM, gpus, MACHINE, ulysses_size=gpus)
        assert replace(as_ring, mode="ring") == ring
        assert replace(as_ulysses, mode="ulysses") == ulysses


def test_best_ulysses_size():
    for gpus in (2, 8, 64, 512):
        for seq_len in (65536, 131072, 1048576):
            problem = replace(PROBLEM, seq_len=seq_len)
            best = cm.best_ulysses_size(problem, gpus, MACHINE)
            totals = {
                u: _total(cm.predict("hybrid", problem, gpus, MACHINE, ulysses_size=u))
                for u in cm.ulysses_sizes(problem, gpus, MACHINE)
            }
            assert totals[best] == min(totals.values())
            assert cm.predict("hybrid", problem, gpus, MACHINE).ulysses_size == best
    # across nodes the hybrid beats the ring: 64 GPUs, S = 131072, twice the speedup
    ring = cm.predict("ring", PROBLEM, 64, MACHINE)
    hybrid = cm.predict("hybrid", PROBLEM, 64, MACHINE)
    assert hybrid.ulysses_size == 8 and hybrid.ring_size == 8
    assert hybrid.speedup > 2 * ring.speedup
    # on one node over NVLink Ulysses wins: the ring's short chunks lose kernel rate;
    # over a slow link the ring wins: it hides its transfers, Ulysses does not
    assert cm.best_ulysses_size(PROBLEM, 8, MACHINE) == 8
    assert cm.best_ulysses_size(PROBLEM, 8, replace(MACHINE, nvlink_gbs=20)) == 1
    # MQA across nodes: the KV head copied inside each node, the ring across them
    assert cm.best_ulysses_size(replace(PROBLEM, kv_heads=1), 64, MACHINE) == 8


def test_memory_falls_as_one_over_n():
    one = cm.predict("ring", PROBLEM, 1, MACHINE).memory_bytes
    ring = {n: cm.predict("ring", PROBLEM, n, MACHINE).memory_bytes for n in (2, 4, 64, 512)}
    s = PROBLEM.seq_len
    in_flight = 2 * 2 * 2 + 3 * 2 * 4  # K and V held and coming (bf16), dK/dV x3 (float32)
    for n, memory in ring.items():
        assert memory == pytest.approx(2 * ring[2] / n)
        assert memory - one / n == pytest.approx(
            PROBLEM.values(PROBLEM.kv_heads, s / n) * in_flight
        )
        assert one / n < memory < 1.6 * one / n  # in flight: 0.57 of the rest
    ulysses = cm.predict("ulysses", PROBLEM, 8, MACHINE).memory_bytes
    assert ring[4] / 2 < ulysses < 2 * one / 8  # the head-split copies, no ring buffers
    assert math.isclose(one / cm.GIB, 7.02, abs_tol=0.01)


def _row_modes(text):
    rows = [line.split(" | ") for line in text.splitlines()[2:]]
    return [(int(r[0].lstrip("| ")), int(r[1]), r[2]) for r in rows]


def test_main_prints_the_table(capsys):
    predictions.main(["--seq-lens", "131072,1048576", "--gpus", "8,64"])
    out = capsys.readouterr().out
    assert out.startswith("| S | GPUs | mode | U x R |")
    expected = []
    for s in (131072, 1048576):
        expected += [(s, 1, "one GPU"), (s, 8, "ring"), (s, 8, "ulysses"), (s, 8, "hybrid")]
        expected += [(s, 64, "ring"), (s, 64, "hybrid")]
    assert _row_modes(out) == expected
    assert "| 131072 | 64 | hybrid | 8 x 8 |" in out
    predictions.main(["--kv-heads", "64", "--heads", "64", "--seq-lens", "65536", "--gpus", "64"])
    assert [m for _, _, m in _row_modes(capsys.readouterr().out)] == [
        "one GPU",
        "ring",
        "ulysses",
        "hybrid",
    ]
    predictions.main(["--check"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| S | quantity | predicted | measured | ratio |"
    assert len(lines) == 2 + 10 * len(cm.MEASURED_H200X2)


def test_module_runs():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cuflash.distributed.predictions",
            "--gpus",
            "2",
            "--seq-lens",
            "4096",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "| 4096 | 2 | ring | 1 x 2 |" in done.stdout


def test_the_distributed_page_shows_what_the_model_prints(capsys):
    page = (ROOT / "docs" / "distributed.md").read_text(encoding="utf-8")
    section = page.split("\n## Design for many GPUs\n", 1)[1]
    for argv in (["--check"], ["--seq-lens", "131072,262144,1048576", "--gpus", "8,64,512"]):
        predictions.main(argv)
        table = capsys.readouterr().out.strip()
        assert table in section, f"rerun python -m cuflash.distributed.predictions {' '.join(argv)}"
        assert f"python -m cuflash.distributed.predictions {' '.join(argv)}" in section
