"""The GPU path's kernel launch (cuflash.gpu.kernel_launch.Launch) on the host side: the parameter
array it hands cuLaunchKernel, checked without a GPU by catching the driver call."""

import ctypes
import threading

import numpy as np
import pytest

gpu = pytest.importorskip("cuflash.gpu.kernel_launch")  # needs CuPy installed, not a GPU


class FakeFunction:
    ptr = 0x1234


def _read(address, ctype):
    return ctypes.cast(address, ctypes.POINTER(ctype))[0]


def _params(address, count):
    return [_read(address + 8 * i, ctypes.c_uint64) for i in range(count)]


@pytest.fixture
def launches(monkeypatch):
    """Each cuLaunchKernel call's arguments, with the parameters it would copy: the value
    at each parameter pointer as 8 raw bytes (read before the call returns, as the
    driver does)."""
    calls = []

    def fake_launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        count = fake_launch.count
        pointers = _params(params, count)
        calls.append(
            dict(
                dims=(function, gx, gy, gz, bx, by, bz, shared),
                stream=stream,
                extra=extra,
                pointers=pointers,
                values=[_read(p, ctypes.c_uint64) for p in pointers],
            )
        )

    monkeypatch.setattr(gpu, "_launch_kernel", fake_launch)
    return calls, fake_launch


def test_launch_passes_addresses_then_fixed_arguments(launches):
    calls, fake = launches
    record = gpu.UserArguments()
    fixed = (record, np.int64(-5), np.int32(7), np.float32(1.5), np.uint64(2**63 + 3))
    launch = gpu.Launch(FakeFunction(), (3, 2), 128, 4096, fixed)
    fake.count = 3 + len(fixed)
    launch(99, 0x1000, 0, 0x2000)
    launch(98, 0x3000, 0x4000, 0)
    first, second = calls
    assert first["dims"] == (0x1234, 3, 2, 1, 128, 1, 1, 4096)
    assert (first["stream"], second["stream"], first["extra"]) == (99, 98, 0)
    assert first["values"][:3] == [0x1000, 0, 0x2000]
    assert second["values"][:3] == [0x3000, 0x4000, 0]
    # The record is passed by value: its parameter points at the record itself.
    assert first["pointers"][3] == record.address == second["pointers"][3]
    p = first["pointers"]
    assert _read(p[4], ctypes.c_int64) == -5
    assert _read(p[5], ctypes.c_int32) == 7
    assert _read(p[6], ctypes.c_float) == 1.5
    assert _read(p[7], ctypes.c_uint64) == 2**63 + 3
    assert p == second["pointers"]  # packed once, the addresses rewritten in place


def test_launch_grid_is_at_least_one_block_a_dimension(launches):
    calls, fake = launches
    fake.count = 1
    gpu.Launch(FakeFunction(), (0,), 64, 0)(0, 0x10)
    assert calls[0]["dims"][1:4] == (1, 1, 1)


def test_launch_refuses_a_fixed_argument_past_8_bytes():
    launch = gpu.Launch(FakeFunction(), (1,), 32, 0, (np.zeros(3, dtype=np.float32),))
    with pytest.raises(TypeError, match="12 bytes"):
        launch._lay_out(1)


def test_launches_from_threads_keep_their_own_addresses(monkeypatch):
    """Two threads share one launch: each launch sees the addresses its caller wrote (the
    slots are written and handed to the driver under the launch's lock)."""
    seen = []

    def slow_launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        first = _read(_params(params, 1)[0], ctypes.c_uint64)
        threading.Event().wait(0.001)  # let the other thread run meanwhile
        seen.append((stream, first, _read(_params(params, 1)[0], ctypes.c_uint64)))

    monkeypatch.setattr(gpu, "_launch_kernel", slow_launch)
    launch = gpu.Launch(FakeFunction(), (1,), 32, 0)

    def worker(stream):
        for _ in range(50):
            launch(stream, 1000 + stream)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 100
    assert all(before == after == 1000 + stream for stream, before, after in seen)


def test_launch_passes_a_parameter_record_as_the_buffer(monkeypatch):
    """A kernel parameter record goes whole as cuLaunchKernel's parameter buffer
    (``extra``: CU_LAUNCH_PARAM_BUFFER_POINTER, the record, CU_LAUNCH_PARAM_BUFFER_SIZE,
    a size_t of the kernel's parameter bytes, CU_LAUNCH_PARAM_END), with no
    ``kernelParams``; each call writes its addresses into the record."""
    from cuflash.gpu import kernel_params

    calls = []

    def fake_launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        words = [_read(extra + 8 * i, ctypes.c_uint64) for i in range(5)]
        size = _read(words[3], ctypes.c_uint64)
        record = (ctypes.c_uint8 * size).from_address(words[1])
        calls.append((params, words, size, bytes(record)))

    monkeypatch.setattr(gpu, "_launch_kernel", fake_launch)
    record = kernel_params.Params(
        "BackwardDeltaParams", kernel_params.DELTA_ADDRESSES, num_heads=3, accum_width=64
    )
    launch = gpu.Launch(FakeFunction(), (2,), 128, 0, record)
    launch(7, 0x10, 0x20, 0x30, 0x40, 0x50, 0)
    launch(7, 0x11, 0x21, 0x31, 0x41, 0x51, 0x61)
    dtype = kernel_params.layout("BackwardDeltaParams")
    for (params, words, size, raw), last in zip(calls, (0, 0x61)):
        assert params == 0
        assert words[0] == 1 and words[1] == record.address and words[2] == 2 and words[4] == 0
        assert size == kernel_params.parameter_bytes("BackwardDeltaParams") == 112
        seen = np.frombuffer(raw + bytes(dtype.itemsize - size), dtype=dtype)[0]
        assert seen["dq_accum"] == last and seen["num_heads"] == 3 and seen["accum_width"] == 64
    assert np.frombuffer(calls[0][3][:8], np.uint64)[0] == 0x10
    assert np.frombuffer(calls[1][3][:8], np.uint64)[0] == 0x11


def test_kvcache_calls_without_a_plan_reuse_their_launches(monkeypatch):
    """The KV cache's calls with host-held lengths take no plan; their launches are kept by
    kernel, grid and record, so a repeated call packs only its addresses and length."""
    from cuflash.gpu import decode_params
    from cuflash.gpu import kvcache as kvcache_gpu

    monkeypatch.setattr(gpu, "_launch_kernel", lambda *args: None)
    monkeypatch.setattr(kvcache_gpu, "_LAUNCHES", {})
    monkeypatch.setattr(kvcache_gpu, "_on_device", lambda params: params.rebased(0x210))

    class Problem:
        num_heads, num_kv_heads, q_len, new_len, head_dim, head_dim_v = 8, 2, 1, 0, 64, 64
        window, softmax_scale, alibi_batch_stride, softcap = (-1, -1), 0.125, -1, 0.0
        capacity, block_size, max_blocks, num_blocks = 256, 256, 1, 2

    def launch(splits):
        return kvcache_gpu._launch(
            FakeFunction(), (4, 2, 1), 0, decode_params.combine_params, Problem, 8, splits
        )

    first = launch(2)
    assert launch(2) is first and launch(3) is not first
    first(0, 1, 2, 3, 4, 0)
    assert first.fixed["num_splits"] == 2 and first.fixed["num_heads"] == 8
