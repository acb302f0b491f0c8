"""The FP8 (e4m3) KV cache read as it is (the FP8 page): ``kvcache_decode_tc``'s
``E4m3Cache`` instantiations, which keep the cache in e4m3 in shared memory and widen it
exactly in registers, run in the CPU simulator and, marked ``gpu``, through
``cuflash.flash_attention_with_kvcache`` on an sm_89+ GPU, against the float64 oracle on
the dequantized inputs. The cases reach each of the kernel's shapes: the narrow one (up
to 8 packed query rows) and the wide one with one, two and four row tiles; head dims
whose rows end in half a 32-column group (48, 80); contiguous and paged caches (blocks
of 16 keys, which take 64-key tiles, and of 64, which take the FP8 tile), several
splits and their combine, appends, descales as scalars and per-(B, H_kv) arrays, every
q kind and out_dtype, sinks, a window and a soft-cap."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import simulated_kvcache
import simulator
from support import BFLOAT16, FP8_DECODE_TOLERANCE, compile_and_check, cupy, rel_error, to_numpy

import cuflash
from cuflash import fp8
from cuflash.gpu import standalone
from cuflash.gpu.decode_tiles import decode_tc_keys
from cuflash.gpu.kvcache import Fp8Cache
from cuflash.reference import attention_reference

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
Q_KINDS = {"e4m3": E4M3, "bfloat16": BFLOAT16, "float16": np.dtype(np.float16)}
OUT_DTYPES = {"bfloat16": BFLOAT16, "float16": np.dtype(np.float16), "float32": np.float32}


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    head_dim: int
    num_heads: int
    num_kv_heads: int
    q_len: int
    q_kind: str
    out: str
    paged: bool
    descales: str  # "none", "scalar", "per_head", or "mixed" (q's and v's arrays, k's a float)
    window: int = 0
    softcap: float = 0.0
    sinks: bool = False
    block_size: int = 16  # keys a block of a paged cache

    def __str__(self):
        paged = "paged" if self.paged else "contiguous"
        rows = self.q_len * self.num_heads // self.num_kv_heads
        return f"d{self.head_dim}-rows{rows}-{self.q_kind}-{self.out}-{paged}-{self.descales}"


CASES = [
    DecodeCase(128, 8, 2, 1, "bfloat16", "bfloat16", False, "per_head"),  # narrow, 4 rows
    DecodeCase(64, 8, 2, 3, "e4m3", "float32", True, "scalar", sinks=True),  # wide, 12 rows
    DecodeCase(48, 2, 2, 1, "float16", "float16", False, "mixed", window=20),  # narrow, D % 32
    # 48 rows; blocks of 64 keys: the FP8 tile of 128 keys (blocks of 16 take 64-key tiles)
    DecodeCase(80, 16, 1, 3, "bfloat16", "bfloat16", True, "none", softcap=5.0, block_size=64),
    DecodeCase(256, 4, 1, 1, "e4m3", "bfloat16", False, "per_head"),  # narrow, the widest
    DecodeCase(32, 8, 1, 3, "float16", "float32", False, "scalar"),  # 24 rows: two row tiles
]
# 422 keys at most: two splits where few blocks share the simulator's small GPU
LENGTHS, CAPACITY, BLOCKS, NEW = (0, 150, 420), 448, 96, 2


def _inputs(case, rng):
    """``(q, k_cache, v_cache, k_new, v_new, lengths, table, descales)``: NumPy arrays,
    the cache's and the new rows' values e4m3 (unit normal before rounding)."""
    b, d, hk = 3, case.head_dim, case.num_kv_heads
    lengths = np.array(LENGTHS, np.int32)
    if case.paged:
        slots = CAPACITY // case.block_size
        table = rng.permutation(BLOCKS)[: b * slots].reshape(b, slots).astype(np.int32)
        shape = (BLOCKS, hk, case.block_size, d)
    else:
        table, shape = None, (b, hk, CAPACITY, d)
    k_cache, v_cache = (rng.standard_normal(shape).astype(E4M3) for _ in "kv")
    k_new, v_new = (rng.standard_normal((b, hk, NEW, d)).astype(E4M3) for _ in "kv")
    q = rng.standard_normal((b, case.num_heads, case.q_len, d)).astype(Q_KINDS[case.q_kind])
    if case.descales == "none":
        descales = (None, None, None)
    elif case.descales == "scalar":
        descales = (0.75, 1.5, 2.5)
    else:
        descales = tuple(rng.uniform(0.5, 2, (b, hk)).astype(np.float32) for _ in range(3))
        if case.descales == "mixed":
            descales = (descales[0], 1.5, descales[2])
    return q, k_cache, v_cache, k_new, v_new, lengths, table, descales


def _appended(cache, new, lengths, table):
    """The cache after the append of ``new`` at each sequence's length."""
    cache = cache.copy()
    for i in range(new.shape[0]):
        for t in range(new.shape[2]):
            pos = lengths[i] + t
            if table is None:
                cache[i, :, pos] = new[i, :, t]
            else:
                size = cache.shape[2]  # keys a block
                cache[table[i, pos // size], :, pos % size] = new[i, :, t]
    return cache


def _true(x, descale, b, heads):
    """float64 values of sequence b's ``x`` [1, H, S, D] times its descale."""
    values = x.astype(np.float64)
    if descale is None:
        return values
    if isinstance(descale, float):
        return values * descale
    return values * np.repeat(descale[b], heads // descale.shape[1])[None, :, None, None]


def oracle(case, q, k_cache, v_cache, lengths, table, descales, sinks):
    """float64 out, lse of each sequence over its keys after the append."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        positions = np.arange(lengths[b] + NEW)
        if table is None:
            keys, values = k_cache[b][:, positions], v_cache[b][:, positions]
        else:
            size = k_cache.shape[2]  # keys a block
            blocks, rows = table[b, positions // size], positions % size
            keys = k_cache[blocks, :, rows].transpose(1, 0, 2)
            values = v_cache[blocks, :, rows].transpose(1, 0, 2)
        hk = case.num_kv_heads
        out, lse = attention_reference(
            _true(q[b : b + 1], descales[0], b, case.num_heads),
            _true(keys[None], descales[1], b, hk),
            _true(values[None], descales[2], b, hk),
            True,
            case.window,
            softcap=case.softcap,
            sinks=sinks,
        )
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


def check(case, out, lse, ref_out, ref_lse):
    """out of ``case.out``'s dtype within twice its rounding of the oracle plus the
    kernel's float16 P (FP8_DECODE_TOLERANCE); lse within float32's error, -inf where a
    row sees no key; NaN never passes."""
    out = to_numpy(out)
    dtype = np.dtype(OUT_DTYPES[case.out])
    assert out.dtype == dtype, out.dtype
    bound = 2 * rel_error(ref_out.astype(dtype), ref_out) + FP8_DECODE_TOLERANCE
    err = rel_error(out, ref_out)
    assert err <= bound, f"relative error {err:.3g} > {bound:.3g}"
    lse = to_numpy(lse)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))  # rows that see no key
    finite = np.isfinite(ref_lse)
    assert np.all(np.isfinite(lse[finite]))
    bound = 1e-5 * (1 + np.abs(ref_lse[finite]).max())
    assert np.max(np.abs(lse[finite] - ref_lse[finite])) <= bound


def _sinks(case, rng):
    return rng.uniform(-1, 2, case.num_heads).astype(np.float32) if case.sinks else None


def _qk_scale(descales):
    return fp8.query_scale(np, descales[0], descales[1])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_simulated_fp8_cache_matches_oracle(case, rng):
    """The simulated kernels as the library launches them on an H100/H200: the append into
    the e4m3 cache (byte for byte), the decode over it, the combine of its splits."""
    if simulator.compiler() is None:
        pytest.skip("no C++ compiler for the simulator")
    q, k_cache, v_cache, k_new, v_new, lengths, table, descales = _inputs(case, rng)
    sinks = _sinks(case, rng)
    caches = [x.view(np.uint8).copy() for x in (k_cache, v_cache)]
    call = Fp8Cache(
        standalone.E4m3Cache(
            q.dtype if q.dtype != E4M3 else np.dtype(np.uint8), OUT_DTYPES[case.out]
        ),
        _qk_scale(descales),
        descales[2],
    )
    out, lse = simulated_kvcache.forward(
        q.view(np.uint8) if q.dtype == E4M3 else q,
        *caches,
        case.num_heads,
        case.num_kv_heads,
        case.head_dim,
        True,
        case.window,
        cache_seqlens=lengths,
        k_new=k_new.view(np.uint8),
        v_new=v_new.view(np.uint8),
        block_table=table,
        return_lse=True,
        softcap=case.softcap,
        sinks=sinks,
        capability=90,
        guard=True,
        fp8=call,
    )
    want = [_appended(c, n, lengths, table) for c, n in ((k_cache, k_new), (v_cache, v_new))]
    for got, expected in zip(caches, want):
        assert np.array_equal(got, expected.view(np.uint8))
    check(case, out, lse, *oracle(case, q, *want, lengths, table, descales, sinks))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_fp8_cache_matches_oracle(case, rng, poisoned):
    """flash_attention_with_kvcache on uint8 e4m3 caches on the GPU (the native kernel from
    sm_89, else the dequantized path): the append and the output against the oracle."""
    q, k_cache, v_cache, k_new, v_new, lengths, table, descales = _inputs(case, rng)
    sinks = _sinks(case, rng)
    caches = [cupy.asarray(x.view(np.uint8)) for x in (k_cache, v_cache)]
    given = [None if d is None or isinstance(d, float) else cupy.asarray(d) for d in descales]
    given = [d if g is None else g for d, g in zip(descales, given)]
    out, lse = cuflash.flash_attention_with_kvcache(
        cupy.asarray(q.view(np.uint8) if q.dtype == E4M3 else q),
        *caches,
        case.num_heads,
        case.num_kv_heads,
        case.head_dim,
        True,
        case.window,
        cache_seqlens=cupy.asarray(lengths),
        k_new=cupy.asarray(k_new.view(np.uint8)),
        v_new=cupy.asarray(v_new.view(np.uint8)),
        block_table=None if table is None else cupy.asarray(table),
        return_lse=True,
        softcap=case.softcap,
        sinks=None if sinks is None else cupy.asarray(sinks),
        q_descale=given[0],
        k_descale=given[1],
        v_descale=given[2],
        out_dtype=case.out,
        fp8_format="e4m3",
    )
    want = [_appended(c, n, lengths, table) for c, n in ((k_cache, k_new), (v_cache, v_new))]
    for got, expected in zip(caches, want):
        assert np.array_equal(to_numpy(got), expected.view(np.uint8))
    check(case, out, lse, *oracle(case, q, *want, lengths, table, descales, sinks))


def _compiled_names():
    """The FP8 cache's decode instantiations the cases above launch on an H100/H200 (every
    q kind, output dtype and kernel shape): the FP8 tile, and (three stages, paged) the
    16-bit tile's keys that caches in blocks of 16 keys take."""
    kernel = standalone.STANDALONE["kvcache_decode_tc"]
    names = []
    for q_kind, out, d, row_warps, narrow in (
        ("e4m3", "bfloat16", 128, 1, True),
        ("bfloat16", "bfloat16", 128, 1, True),
        ("float16", "float32", 128, 1, False),
        ("bfloat16", "float16", 64, 2, False),
        ("e4m3", "float32", 256, 1, True),
        ("bfloat16", "bfloat16", 80, 4, False),
        ("float16", "bfloat16", 48, 1, True),
    ):
        query = np.dtype(np.uint8) if q_kind == "e4m3" else Q_KINDS[q_kind]
        types = standalone.E4m3Cache(query, OUT_DTYPES[out])
        fp8_keys, small_block_keys = decode_tc_keys(d, fp8=True), decode_tc_keys(d)
        for stages, paged, keys in ((2, False, fp8_keys), (3, True, small_block_keys)):
            names.append(
                kernel.name_expression(
                    dtype=types,
                    head_dim=d,
                    row_warps=row_warps,
                    stages=stages,
                    keys=keys,
                    paged=paged,
                    narrow=narrow,
                )
            )
    names.append(standalone.STANDALONE["kvcache_append"].name_expression(dtype=np.uint8))
    return names


@pytest.mark.parametrize("arch", ["sm_89", "sm_90a"])
def test_fp8_cache_kernels_compile_without_spills(arch):
    """The FP8 cache's kernels compile through NVRTC without spills or a stack frame; the
    decode's SASS widens e4m3 (F2FP) into float16 or bfloat16 products (HMMA) and reads
    no local memory."""
    report = compile_and_check(_compiled_names(), arch)
    assert len(report) == len(_compiled_names())
    if arch != "sm_90a":
        return
    from cuflash.gpu import kernel_build

    if kernel_build.find_cuobjdump() is None:
        pytest.fail("cuobjdump is missing: install the test extra (nvidia-cuda-cuobjdump)")
    names = [n for n in _compiled_names() if "decode" in n]
    compiled = kernel_build.compile_standalone_offline(names, arch)
    try:
        opcodes = kernel_build.CompileReport(None, arch, *compiled).sass_opcodes()
    except RuntimeError as exc:  # an older cuobjdump than this NVRTC
        pytest.skip(str(exc))
    for name, ops in opcodes.items():
        assert ops["F2FP"] > 0 and ops["HMMA"] > 0, (name, ops["F2FP"], ops["HMMA"])
        assert ops["LDL"] == ops["STL"] == 0, name


@pytest.mark.gpu
def test_gpu_fp8_decode_steps_reuse_their_plan(rng, poisoned):
    """Steps of one signature (device-held lengths) take the plan the first made: each
    step's own descale arrays, lengths and appended rows count; a float descale is the
    plan's own (another value, another plan)."""
    case = DecodeCase(128, 8, 2, 1, "bfloat16", "bfloat16", True, "per_head")
    q, k_cache, v_cache, k_new, v_new, lengths, table, _ = _inputs(case, rng)
    caches = [cupy.asarray(x.view(np.uint8)) for x in (k_cache, v_cache)]
    hosts = [k_cache, v_cache]
    floats = {2: (0.5, 1.5, 2.0), 3: (0.25, 1.0, 3.0)}  # each its own plan
    for step in range(4):
        descales = floats.get(step)
        if descales is None:
            descales = tuple(rng.uniform(0.5, 2, (3, 2)).astype(np.float32) for _ in range(3))
        steps = lengths + NEW * step
        k_step, v_step = (rng.standard_normal((3, 2, NEW, 128)).astype(E4M3) for _ in "kv")
        out, lse = cuflash.flash_attention_with_kvcache(
            cupy.asarray(q),
            *caches,
            8,
            2,
            128,
            cache_seqlens=cupy.asarray(steps),
            k_new=cupy.asarray(k_step.view(np.uint8)),
            v_new=cupy.asarray(v_step.view(np.uint8)),
            block_table=cupy.asarray(table),
            return_lse=True,
            q_descale=descales[0] if step in floats else cupy.asarray(descales[0]),
            k_descale=descales[1] if step in floats else cupy.asarray(descales[1]),
            v_descale=descales[2] if step in floats else cupy.asarray(descales[2]),
            fp8_format="e4m3",
        )
        hosts = [_appended(c, n, steps, table) for c, n in zip(hosts, (k_step, v_step))]
        ref = oracle(case, q, *hosts, steps, table, descales, None)
        check(case, out, lse, *ref)


@pytest.mark.parametrize("block_size", [0, 16, 64], ids=["contiguous", "paged16", "paged64"])
def test_simulated_fp8_cache_garbage_lengths_and_block_ids_stay_inside(block_size, rng):
    """Device-held lengths and block ids are never trusted (the KV-cache page): negative,
    past the capacity, block ids out of range, under guard pages; the e4m3 append and the
    decode (both tiles: 64 keys for blocks of 16, 128 otherwise) stay inside every buffer
    and every row is finite."""
    if simulator.compiler() is None:
        pytest.skip("no C++ compiler for the simulator")
    b, h, hk, d, max_blocks, num_blocks = 4, 8, 2, 128, 8, 20
    size = block_size or 16
    shape = (num_blocks, hk, size, d) if block_size else (b, hk, max_blocks * size, d)
    k_cache, v_cache = (rng.standard_normal(shape).astype(E4M3).view(np.uint8) for _ in "kv")
    q = rng.standard_normal((b, h, 1, d)).astype(BFLOAT16)
    k_new, v_new = (rng.standard_normal((b, hk, 1, d)).astype(E4M3).view(np.uint8) for _ in "kv")
    garbage_lengths = np.array([5, -70000, 2**31 - 1, 10**6], np.int32)
    table = garbage_table = None
    if block_size:
        table = np.arange(b * max_blocks, dtype=np.int32).reshape(b, max_blocks) % num_blocks
        garbage_table = np.array(
            [[3, -1, 2**30, -(2**31)] * 2, [19, 20, 7, 0] * 2, [1000, 5, 6, 7] * 2, [-5] * 8],
            np.int32,
        )
    out, lse = simulated_kvcache.forward(
        q,
        k_cache,
        v_cache,
        h,
        hk,
        d,
        cache_seqlens=np.zeros(b, np.int32),
        k_new=k_new,
        v_new=v_new,
        block_table=table,
        return_lse=True,
        capability=90,
        device_lengths=garbage_lengths,
        device_table=garbage_table,
        guard=True,
        fp8=Fp8Cache(standalone.E4m3Cache(BFLOAT16, BFLOAT16), 0.5, 2.0),
    )
    assert np.isfinite(out.astype(np.float32)).all() and np.isfinite(lse).all()


def test_which_fp8_caches_the_kernel_reads():
    """The native decode serves sm_89 and newer, head dims that are multiples of 16 up to
    256 shared by v, and 16-bit outputs; a float32 out_dtype keeps the exact path (as a
    dense FP8 call's), and so does every other cache."""
    from types import SimpleNamespace

    from cuflash.gpu.decode_kernels import reads_fp8

    def problem(head_dim=128, own_value_dims=False):
        return SimpleNamespace(head_dim=head_dim, own_value_dims=own_value_dims)

    assert reads_fp8(problem(), 90, BFLOAT16) and reads_fp8(problem(256), 89, np.float16)
    assert not reads_fp8(problem(), 90, np.float32)
    assert not reads_fp8(problem(), 86, BFLOAT16) and not reads_fp8(problem(), 80, BFLOAT16)
    assert not reads_fp8(problem(72), 90, BFLOAT16) and not reads_fp8(problem(272), 90, BFLOAT16)
    assert not reads_fp8(problem(own_value_dims=True), 90, BFLOAT16)
