"""GPU reliability: sizes past 32-bit indexing, concurrency, running out of memory."""

import os
import subprocess
import sys

import numpy as np
import pytest
from support import Case, check_close, cupy, naive_in_dtype, oracle, score_magnitude, to_numpy

import cuflash
from cuflash.core.problem import BFLOAT16

pytestmark = pytest.mark.gpu
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("path", ["auto", "general"])
def test_more_than_2_31_elements(path):
    """bfloat16 q, k, v of 2.2e9 elements each (4.4 GB): slices past 2**31 match the oracle.

    B=1024, H=64, S=264, D=128: the last (batch, head) starts at element
    2.21e9, so every offset there needs 64 bits. Forward and backward run on
    the whole tensors; sampled (batch, head) slices are checked by the rule
    of the grid tests.
    """
    b, h, s, d = 1024, 64, 264, 128
    assert b * h * s * d > 2**31
    gen = cupy.random.default_rng(7)

    def normal():
        return gen.standard_normal((b, h, s, d), dtype=cupy.float32).astype(BFLOAT16)

    q, k, v, dout = normal(), normal(), normal(), normal()
    with cuflash.kernel_path(path):
        out, lse = cuflash.flash_attention_fwd(q, k, v, h, h, d, causal=True)
        dq, dk, dv = cuflash.flash_attention_bwd(dout, q, k, v, out, lse, h, h, d, causal=True)
    case = Case(
        dtype="bfloat16", batch=1, heads=1, kv_heads=1, q_len=s, kv_len=s, head_dim=d, causal=True
    )
    for bi, hi in [(0, 0), (517, 21), (1023, 62), (1023, 63)]:
        sl = (slice(bi, bi + 1), slice(hi, hi + 1))
        args = [to_numpy(a[sl]) for a in (q, k, v, dout)]
        ref_out, ref_lse, ref_grads = oracle(case, *args)
        naive_out, naive_grads = naive_in_dtype(case, *args)
        inherited = oracle(case, *args, out=to_numpy(out[sl]))[2]
        smax = score_magnitude(case, args[0], args[1])
        check_close("out", out[sl], ref_out, naive_out, "bfloat16", score_max=smax)
        for name, got, ref, naive, inh in zip(
            ("dq", "dk", "dv"), (dq, dk, dv), ref_grads, naive_grads, inherited
        ):
            check_close(f"{name}[{bi},{hi}]", got[sl], ref, naive, "bfloat16", inh, smax)
        assert np.allclose(to_numpy(lse[sl]), ref_lse, atol=1e-3)
    del q, k, v, dout, out, dq, dk, dv
    cupy.get_default_memory_pool().free_all_blocks()


def _inputs(case, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((case.batch, case.heads, case.q_len, case.head_dim))
    kv = (case.batch, case.kv_heads, case.kv_len, case.head_dim)
    k, v = rng.standard_normal(kv), rng.standard_normal(kv)
    dout = rng.standard_normal(q.shape)
    dt = {"bfloat16": BFLOAT16}.get(case.dtype, case.dtype)
    return [cupy.asarray(a.astype(dt)) for a in (q, k, v, dout)]


def _fwd_bwd(case, q, k, v, dout):
    out, lse = cuflash.flash_attention_fwd(q, k, v, *case.args)
    grads = cuflash.flash_attention_bwd(dout, q, k, v, out, lse, *case.args, deterministic=True)
    return out, lse, *grads


def test_many_streams_at_once_match_serial_runs():
    """Eight streams, launched back to back without waiting: bitwise the serial results."""
    cases = [
        Case(dtype=dt, heads=8, kv_heads=2, q_len=400, kv_len=600, head_dim=d, causal=True)
        for dt, d in [("bfloat16", 128), ("float16", 64), ("float32", 64), ("bfloat16", 96)]
    ] * 2
    inputs = [_inputs(c, i) for i, c in enumerate(cases)]
    serial = [[to_numpy(a) for a in _fwd_bwd(c, *x)] for c, x in zip(cases, inputs)]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in cases]
    results = []
    for c, x, st in zip(cases, inputs, streams):
        with st:
            results.append(_fwd_bwd(c, *x))
    for st in streams:
        st.synchronize()
    for i, (got, want) in enumerate(zip(results, serial)):
        for a, b in zip(got, want):
            assert np.array_equal(to_numpy(a), b), f"stream {i} differs"


def _worker(cache_dir):
    path = os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, CUPY_CACHE_DIR=str(cache_dir), PYTHONPATH=path)
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "concurrency_worker.py")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_threads_and_processes_share_first_calls(tmp_path):
    """Two processes on one empty kernel cache, eight threads each, all first calls.

    Every thread compiles (or loads what the other process just wrote) the
    kernels of its own variant while the others launch theirs.
    """
    workers = [_worker(tmp_path), _worker(tmp_path)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    for w, text in zip(workers, outputs):
        assert w.returncode == 0, text
        assert text.count("ok ") == 8, text
    assert any(tmp_path.iterdir()), "the shared cache stayed empty"


@pytest.mark.parametrize("headroom", [0, 1, 2, 3, 4, 6, 8])
def test_out_of_memory_reaches_the_caller_and_leaves_no_damage(headroom):
    """A memory-pool limit that fails the call at each of its allocations in turn."""
    case = Case(dtype="bfloat16", heads=4, kv_heads=2, q_len=300, kv_len=300, head_dim=128)
    x = _inputs(case, 0)
    want = [to_numpy(a) for a in _fwd_bwd(case, *x)]
    # A pool of its own, so that only this call's allocations count against the limit
    # (the default pool may keep free remnants of split blocks that bypass a limit).
    pool = cupy.cuda.MemoryPool()
    unit = x[0].nbytes  # the largest allocations are q-sized (dq in float32 is two)
    pool.set_limit(size=headroom * unit or 1)  # size 0 would mean no limit
    try:
        with cupy.cuda.using_allocator(pool.malloc):
            got = _fwd_bwd(case, *x)
        failed = None
    except cupy.cuda.memory.OutOfMemoryError as exc:
        failed = exc
    if headroom == 0:
        assert failed is not None, "no allocation failed under a zero-headroom limit"
    if failed is None:
        for a, b in zip(got, want):
            assert np.array_equal(to_numpy(a), b)
    again = [to_numpy(a) for a in _fwd_bwd(case, *x)]
    for a, b in zip(again, want):
        assert np.array_equal(a, b), "a call after the failure differs"
