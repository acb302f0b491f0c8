"""The 16-bit kernels of A100-class GPUs (mma.sync, the registry's sm_80 generation) and of
H100/H200 (wgmma), float32 on its pieces, the CUDA-core kernels and the KV-cache decode
kernels run in the CPU simulator (``tests/simulator``) against the float64 oracle,
without a GPU: the forwards, the backwards with dQ by atomics and by their dQ passes,
the split-D backward, the general kernels, the score modifiers, packed batches and
decoding from contiguous and paged caches. The same checks as the GPU tests
(support.check_results, test_kvcache.run_case), on NaN-poisoned outputs; device-held
offsets, lengths and block ids holding garbage under guard pages."""

import functools
import math
import types

import numpy as np
import pytest
import simulated_attention
import simulated_kvcache
import simulator
from support import (
    DTYPES,
    FLOOR,
    Case,
    alibi_slopes,
    check_close,
    check_lse,
    check_modified_results,
    check_packed_results,
    check_results,
    naive_in_dtype,
    oracle,
    packed_inputs,
    random_inputs,
    rel_error,
    score_magnitude,
)
from test_kvcache import CASES as KV_CASES
from test_kvcache import run_case

import cuflash
from cuflash import modifiers
from cuflash.block_mask import create_block_mask
from cuflash.gpu import kernel_params, registry, schedules
from cuflash.reference import attention_reference, attention_reference_grad

pytestmark = pytest.mark.skipif(
    simulator.compiler() is None, reason="the simulator needs a host C++ compiler (g++ or CXX)"
)

# Every head-dim class and its tile shapes (Q in registers or not, exact head dims),
# each option of the semantics page somewhere: GQA/MQA, causal rows that see no key
# (S_q > S_k), windows, kv_seq_len, [B, S, H, D] strides, one query row.
CASES = [
    Case(
        dtype="bfloat16",
        head_dim=64,
        batch=1,
        heads=4,
        kv_heads=2,
        q_len=150,
        kv_len=100,
        causal=True,
    ),
    Case(
        dtype="float16",
        head_dim=128,
        batch=2,
        heads=2,
        kv_heads=1,
        q_len=70,
        kv_len=140,
        window=(30, 10),
    ),
    Case(
        dtype="bfloat16",
        head_dim=40,
        batch=1,
        heads=3,
        kv_heads=1,
        q_len=90,
        kv_len=90,
        causal=True,
        window=40,
    ),
    Case(
        dtype="float16",
        head_dim=96,
        batch=1,
        heads=2,
        kv_heads=2,
        q_len=80,
        kv_len=120,
        kv_seq_len=77,
        bshd=True,
    ),
    Case(dtype="bfloat16", head_dim=200, batch=1, heads=2, kv_heads=1, q_len=1, kv_len=70),
    Case(
        dtype="float16",
        head_dim=256,
        batch=1,
        heads=2,
        kv_heads=1,
        q_len=40,
        kv_len=50,
        causal=True,
    ),
    Case(
        dtype="bfloat16",
        head_dim=8,
        batch=1,
        heads=2,
        kv_heads=2,
        q_len=70,
        kv_len=70,
        causal=True,
        scale=0.3,
    ),
]


def _run(case, rng, deterministic, excluded=(), softcap=0.0, slopes=None, capability=80, tma=True):
    q, k, v, dout = random_inputs(case, rng)
    kw = dict(
        kv_seq_len=case.kv_seq_len,
        softmax_scale=case.scale,
        softcap=softcap,
        alibi_slopes=slopes,
        excluded=excluded,
        capability=capability,
        head_dim_v=case.head_dim_v,
    )
    out, lse = simulated_attention.forward(q, k, v, *case.args, **kw, tma=tma)
    grads = simulated_attention.backward(
        dout, q, k, v, out, lse, *case.args, **kw, deterministic=deterministic, tma=tma
    )
    return (q, k, v, dout), out, lse, grads


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_tensor_core_kernels_match_oracle(case, deterministic, capability, rng):
    """Before Hopper: forward_mma_sync, backward_mma_sync (D = 64, 128) or
    backward_mma_sync_split_d, with dQ by float32 atomics or by backward_dq_mma_sync.
    H100/H200: forward_wgmma_ws (from D = 72) or forward_wgmma, backward_wgmma with
    dQ by atomics (up to D = 128) or by backward_dq_wgmma (backward_wgmma_ws, the
    default of plain calls from D = 72 to 128, has tests of its own below)."""
    excluded = ("backward_wgmma_ws",) if capability == 90 else ()
    inputs, out, lse, grads = _run(case, rng, deterministic, excluded, capability=capability)
    check_results(case, inputs, out, lse, grads)


# More key tiles than the warp-specialized forward has stages (three of 128 keys up to
# head_dim 128, two of 96 keys to 192 (three of 64 in the modified roles), two of 64
# past it), so that its stage rings wrap and each barrier
# goes through several phases; two query tiles; rows that see no key (S_q > S_k).
RING_CASES = [
    Case(
        dtype="bfloat16",
        head_dim=128,
        batch=1,
        heads=2,
        kv_heads=1,
        q_len=200,
        kv_len=600,
        causal=True,
    ),
    Case(
        dtype="float16",
        head_dim=96,
        batch=1,
        heads=1,
        kv_heads=1,
        q_len=140,
        kv_len=530,
        kv_seq_len=517,
    ),
    Case(
        dtype="bfloat16",
        head_dim=256,
        batch=1,
        heads=1,
        kv_heads=1,
        q_len=150,
        kv_len=140,
        causal=True,
        window=(100, 0),
    ),
    Case(dtype="float16", head_dim=200, batch=1, heads=1, kv_heads=1, q_len=60, kv_len=300),
    # the 64 class's three consumers: two query tiles of 192 rows, their turns in a ring
    Case(
        dtype="bfloat16",
        head_dim=64,
        batch=1,
        heads=2,
        kv_heads=1,
        q_len=250,
        kv_len=520,
        causal=True,
    ),
    # the first query tile of each head seeing no key (S_q > S_k, causal), GQA
    Case(
        dtype="bfloat16",
        head_dim=80,
        batch=1,
        heads=3,
        kv_heads=1,
        q_len=300,
        kv_len=200,
        causal=True,
    ),
    # the 256 class's rows of 192 columns (D = 136-192), two stages of 96 keys; a head
    # dim whose last k16 step is half padding
    Case(
        dtype="bfloat16",
        head_dim=168,
        batch=1,
        heads=2,
        kv_heads=1,
        q_len=140,
        kv_len=330,
        causal=True,
    ),
]


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "cp_async"])
@pytest.mark.parametrize("case", RING_CASES, ids=str)
def test_warp_specialized_forward_wraps_its_stage_rings(case, tma, rng):
    """forward_wgmma_ws over more key tiles than stages: the producer refills each stage
    once every consumer hands it back, and the consumers wait for each phase (a missed
    wait reads the poison or an older tile: the simulator lands a stage's copies only
    when a consumer's wait sees them complete); with the copy engine's boxes (rows past
    kv_seq_len and columns past the head dim as zeros) and with cp.async."""
    assert (
        registry.choose("forward", DTYPES[case.dtype], case.head_dim, 90).name == "forward_wgmma_ws"
    )
    inputs, out, lse, grads = _run(case, rng, False, capability=90, tma=tma)
    check_results(case, inputs, out, lse, grads)


@pytest.mark.parametrize("persistent", [False, True], ids=["block_a_tile", "persistent"])
@pytest.mark.parametrize("case", RING_CASES[:2], ids=str)
def test_warp_specialized_forward_176_key_tiles(case, persistent, rng, monkeypatch):
    """The plain 128 class on two stages of 176 keys (``CUFLASH_FORWARD_KEYS=176``):
    tiles that are no power of two, rings that wrap, the diagonal inside a tile."""
    monkeypatch.setenv("CUFLASH_FORWARD_KEYS", "176")
    spec = registry.choose("forward", DTYPES[case.dtype], case.head_dim, 90)
    assert spec.traits_of(case.head_dim).template_args[:2] == (176, 2)
    q, k, v, dout = random_inputs(case, rng)
    kw = dict(kv_seq_len=case.kv_seq_len, softmax_scale=case.scale, capability=90, tma=True)
    out, lse = simulated_attention.forward(
        q, k, v, *case.args, **kw, persistent_blocks=2 if persistent else None
    )
    ref_out, ref_lse, _ = oracle(case, q, k, v, dout)
    check_lse(lse, ref_lse)
    naive_out = naive_in_dtype(case, q, k, v, dout)[0]
    check_close("out", out, ref_out, naive_out, case.dtype, score_max=score_magnitude(case, q, k))


# The persistent role (forward_wgmma_ws's plain calls of short rows): one block, or
# three over four work tiles (the second round from the grid's end), so that a block
# walks several tiles and Q's barriers, the stage rings and the consumers' turns run
# on from one tile to the next.
PERSISTENT_CASES = [RING_CASES[0], RING_CASES[2], RING_CASES[4]]


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "cp_async"])
@pytest.mark.parametrize("blocks", [1, 3])
@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=str)
def test_persistent_forward_walks_every_tile(case, blocks, tma, rng):
    """Every tile's rows as the oracle's, and bit for bit those of a block a tile (the
    same products and softmax in the same order)."""
    spec = registry.choose("forward", DTYPES[case.dtype], case.head_dim, 90)
    assert spec.persistent_keys is not None
    q, k, v, dout = random_inputs(case, rng)
    kw = dict(kv_seq_len=case.kv_seq_len, softmax_scale=case.scale, capability=90, tma=tma)
    out, lse = simulated_attention.forward(q, k, v, *case.args, **kw, persistent_blocks=blocks)
    one_a_block = simulated_attention.forward(q, k, v, *case.args, **kw)
    ref_out, ref_lse, _ = oracle(case, q, k, v, dout)
    check_lse(lse, ref_lse)
    naive_out = naive_in_dtype(case, q, k, v, dout)[0]
    check_close("out", out, ref_out, naive_out, case.dtype, score_max=score_magnitude(case, q, k))
    assert np.array_equal(out, one_a_block[0]) and np.array_equal(lse, one_a_block[1])


@pytest.mark.parametrize(
    "garbage", [None, [-7, 500, -3, 130, 2**31 - 1, 40]], ids=["offsets", "garbage"]
)
def test_persistent_packed_forward_walks_every_sequence(garbage, rng):
    """A packed batch on two persistent blocks: tiles past a sequence's rows skipped by
    both warpgroups alike, sequences of no row or no key; with garbage device offsets no
    access outside the arrays (guard pages)."""
    lengths_q, lengths_k = [5, 0, 130, 1, 9], [5, 3, 200, 1, 0]
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lengths_q, lengths_k, 4, 2, 64, "bfloat16")
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k), 4, 2, 64, True)
    kw = dict(capability=90, guard=True)
    if garbage is not None:
        kw["device_offsets"] = (np.array(garbage, np.int32),) * 2
    out, lse = simulated_attention.varlen_forward(q, k, v, *args, **kw, persistent_blocks=2)
    one_a_block = simulated_attention.varlen_forward(q, k, v, *args, **kw)
    assert np.array_equal(out, one_a_block[0]) and np.array_equal(lse, one_a_block[1])
    if garbage is None:
        grads = simulated_attention.varlen_backward(dout, q, k, v, out, lse, *args, capability=90)
        check_packed_results(
            (q, k, v, dout), out, lse, grads, lengths_q, lengths_k, "bfloat16", True, 0
        )


# More query tiles than the warp-specialized backward has stages (two of 64 rows), so
# that its ring wraps: GQA (the steps run over the group's heads), a key tile cut short
# (kv_seq_len), D = 120 (the padded float32 dQ rows), rows that see no key.
BACKWARD_RING_CASES = [
    RING_CASES[0],
    RING_CASES[1],
    Case(
        dtype="bfloat16",
        head_dim=120,
        batch=2,
        heads=2,
        kv_heads=1,
        q_len=150,
        kv_len=140,
        window=(60, 8),
    ),
]


@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("blocks", [1, 2])
@pytest.mark.parametrize("case", BACKWARD_RING_CASES[1:], ids=str)
def test_persistent_backward_walks_every_key_tile(case, blocks, deterministic, tma, rng):
    """backward_wgmma_ws's persistent role on one or two blocks over several key tiles
    (KV heads, batch entries): K and V's empty barrier, the stage ring, dS^T's two
    buffers and the dQ additions run on across tiles; the oracle's gradients, and bit
    for bit a block a tile's dK and dV (dQ's additions land in another order)."""
    q, k, v, dout = random_inputs(case, rng)
    kw = dict(kv_seq_len=case.kv_seq_len, softmax_scale=case.scale, capability=90, tma=tma)
    out, lse = simulated_attention.forward(q, k, v, *case.args, **kw)
    args = (dout, q, k, v, out, lse, *case.args)
    grads = simulated_attention.backward(
        *args, **kw, deterministic=deterministic, persistent_blocks=blocks
    )
    check_results(case, (q, k, v, dout), out, lse, grads)
    one_a_block = simulated_attention.backward(
        *args, **kw, deterministic=deterministic, ordered=False
    )
    assert np.array_equal(grads[1], one_a_block[1]) and np.array_equal(grads[2], one_a_block[2])
    if deterministic:
        assert np.array_equal(grads[0], one_a_block[0])


@pytest.mark.parametrize("blocks", [2, 3])
def test_persistent_backward_schedule(blocks, rng):
    """The persistent backward of a dense call walks the plan's schedule (each block's key
    tiles longest first, dealt to the least loaded block): every key tile once, the
    oracle's gradients, dK and dV bit for bit those of the static walk; and the schedule
    itself deals every tile once, its blocks' work within the longest tile's of each
    other."""
    case = BACKWARD_RING_CASES[2]
    q, k, v, dout = random_inputs(case, rng)
    kw = dict(kv_seq_len=case.kv_seq_len, softmax_scale=case.scale, capability=90)
    out, lse = simulated_attention.forward(q, k, v, *case.args, **kw)
    args = (dout, q, k, v, out, lse, *case.args)
    grads = simulated_attention.backward(*args, **kw, persistent_blocks=blocks)
    check_results(case, (q, k, v, dout), out, lse, grads)
    walked = simulated_attention.backward(*args, **kw, persistent_blocks=blocks, scheduled=False)
    assert np.array_equal(grads[1], walked[1]) and np.array_equal(grads[2], walked[2])

    problem = types.SimpleNamespace(
        window=(-1, 0), kv_capacity=1000, kv_len=1000, q_len=700, group_size=2, packed=None,
        batch=3, num_kv_heads=2,
    )  # fmt: skip
    table = schedules.backward_schedule(problem, 128, 64, 5)
    offsets, tiles = table[:6], table[6:]
    assert offsets[0] == 0 and offsets[-1] == len(tiles) == 8 * 2 * 3
    assert sorted(tiles) == list(range(len(tiles)))
    steps = schedules.backward_tile_steps(problem, 128, 64)
    cost = np.tile(np.where(steps > 0, steps + schedules.TILE_OVERHEAD_STEPS, 0), 6)
    loads = [cost[tiles[a:b]].sum() for a, b in zip(offsets[:-1], offsets[1:])]
    assert max(loads) - min(loads) <= cost.max()
    for a, b in zip(offsets[:-1], offsets[1:]):  # each block's longest first
        assert list(cost[tiles[a:b]]) == sorted(cost[tiles[a:b]], reverse=True)


def test_persistent_packed_backward_walks_every_sequence(rng):
    """A packed batch's backward on two persistent blocks: key tiles past a sequence's
    keys skipped by every warpgroup alike, sequences of no key or no query."""
    lengths_q, lengths_k = [5, 0, 150, 1, 9], [5, 3, 200, 1, 0]
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lengths_q, lengths_k, 4, 2, 128, "bfloat16")
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k), 4, 2, 128, True)
    out, lse = simulated_attention.varlen_forward(q, k, v, *args, capability=90)
    grads = simulated_attention.varlen_backward(
        dout, q, k, v, out, lse, *args, capability=90, guard=True, persistent_blocks=2
    )
    check_packed_results(
        (q, k, v, dout), out, lse, grads, lengths_q, lengths_k, "bfloat16", True, 0
    )


@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", BACKWARD_RING_CASES, ids=str)
def test_warp_specialized_backward_wraps_its_stage_ring(case, deterministic, tma, rng):
    """backward_wgmma_ws over more query tiles than stages, with dQ by its bulk additions
    or by backward_dq_wgmma, its tiles copied by cp.async or by the copy engine: the
    producer refills a stage once both consumers hand it back, and the consumers meet at
    their named barrier before dQ reads both halves of dS^T."""
    spec = registry.choose("backward", DTYPES[case.dtype], case.head_dim, 90)
    assert spec.name == "backward_wgmma_ws"
    inputs, out, lse, grads = _run(case, rng, deterministic, capability=90, tma=tma)
    check_results(case, inputs, out, lse, grads)


# The 64 class's warp-specialized backward (128 query rows a step, each consumer adding
# its 64 rows of dQ): every head dim of the class (8, 40, 64), GQA, causal rows that
# see no key, windows, several query tiles of 128 rows and more than two ring uses.
BACKWARD_64_CASES = [
    CASES[0],
    CASES[2],
    CASES[6],
    Case(
        dtype="float16",
        head_dim=64,
        batch=2,
        heads=2,
        kv_heads=1,
        q_len=300,
        kv_len=260,
        window=(150, 40),
    ),
]


@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", BACKWARD_64_CASES, ids=str)
def test_warp_specialized_backward_64_class(case, deterministic, tma, rng):
    """backward_wgmma_ws in the 64 class (128 query rows a step), with dQ by its bulk
    additions (through its maps in launch order when deterministic) or by
    backward_dq_wgmma (cp.async, deterministic): the oracle's gradients."""
    spec = registry.choose("backward", DTYPES[case.dtype], case.head_dim, 90)
    assert spec.name == "backward_wgmma_ws"
    inputs, out, lse, grads = _run(case, rng, deterministic, capability=90, tma=tma)
    check_results(case, inputs, out, lse, grads)


# The 256 class's warp-specialized backward (64 keys a block, the consumers sharing the
# columns, each step's dQ added from its own stage): D = 256 with three key tiles and more
# query steps than stages, D = 136 (the narrowest split: 16 columns of dV and dK, 32 of dQ
# on the second consumer) with a window, and MLA's D = 192 with v's 128.
BACKWARD_256_CASES = [
    Case(
        dtype="float16",
        head_dim=256,
        batch=1,
        heads=2,
        kv_heads=1,
        q_len=150,
        kv_len=140,
        causal=True,
    ),
    Case(
        dtype="bfloat16",
        head_dim=136,
        batch=2,
        heads=2,
        kv_heads=2,
        q_len=70,
        kv_len=90,
        window=(30, 10),
    ),
    Case(
        dtype="bfloat16",
        head_dim=192,
        head_dim_v=128,
        batch=1,
        heads=2,
        kv_heads=1,
        q_len=100,
        kv_len=77,
    ),
    # eight steps a key tile: the stages around their ring four times
    Case(
        dtype="float16",
        head_dim=160,
        batch=1,
        heads=2,
        kv_heads=1,
        q_len=200,
        kv_len=70,
    ),
]


@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", BACKWARD_256_CASES, ids=str)
def test_warp_specialized_backward_256_class(case, deterministic, tma, rng):
    """backward_wgmma_ws in the 256 class: dQ added by its writer from the stages through
    the maps (in launch order when deterministic), or without the maps by
    backward_dq_wgmma; the oracle's gradients."""
    spec = registry.choose(
        "backward", DTYPES[case.dtype], case.head_dim, 90, head_dim_v=case.head_dim_v
    )
    assert spec.name == "backward_wgmma_ws"
    inputs, out, lse, grads = _run(case, rng, deterministic, capability=90, tma=tma)
    check_results(case, inputs, out, lse, grads)


@pytest.mark.parametrize("deterministic", [False, True])
def test_persistent_backward_64_class(deterministic, rng):
    """The 64 class's persistent role on two blocks: every key tile, the oracle's
    gradients, dK and dV bit for bit a block a tile's."""
    case = BACKWARD_64_CASES[3]
    q, k, v, dout = random_inputs(case, rng)
    kw = dict(kv_seq_len=case.kv_seq_len, softmax_scale=case.scale, capability=90)
    out, lse = simulated_attention.forward(q, k, v, *case.args, **kw)
    args = (dout, q, k, v, out, lse, *case.args)
    grads = simulated_attention.backward(
        *args, **kw, deterministic=deterministic, persistent_blocks=2
    )
    one_a_block = simulated_attention.backward(*args, **kw, deterministic=deterministic)
    check_results(case, (q, k, v, dout), out, lse, grads)
    assert np.array_equal(grads[1], one_a_block[1]) and np.array_equal(grads[2], one_a_block[2])


# Key tiles that add into a query tile in different counts: causal with more keys than
# queries (every block's first steps on the diagonal), and not causal (every key tile
# adds into every query tile, a chain of waits from the first step).
ORDERED_CASES = [
    BACKWARD_RING_CASES[2],
    Case(
        dtype="float16",
        head_dim=96,
        batch=1,
        heads=2,
        kv_heads=2,
        q_len=150,
        kv_len=400,
        causal=True,
    ),
    Case(dtype="bfloat16", head_dim=128, batch=1, heads=1, kv_heads=1, q_len=70, kv_len=300),
]


@pytest.mark.parametrize("case", ORDERED_CASES, ids=str)
def test_ordered_dq_adds_in_launch_order(case, rng, monkeypatch):
    """The deterministic backward_wgmma_ws through the maps adds dQ itself, in the blocks'
    launch order (key tiles descending): each writer waits until its query tile's counter
    has counted the key tiles launched before it that add there, and the kernel traps on
    a count past that (the simulator fails a wait no earlier block meets). The oracle's
    gradients; dK and dV bit for bit those of the dQ pass's run."""
    launched = []
    launch = simulated_attention.Kernels.launch

    def recording(self, spec_name, grid, args):
        launched.append(self.roles[spec_name][1])
        return launch(self, spec_name, grid, args)

    monkeypatch.setattr(simulated_attention.Kernels, "launch", recording)
    q, k, v, dout = random_inputs(case, rng)
    kw = dict(kv_seq_len=case.kv_seq_len, softmax_scale=case.scale, capability=90)
    out, lse = simulated_attention.forward(q, k, v, *case.args, **kw)
    args = (dout, q, k, v, out, lse, *case.args)
    launched.clear()
    grads = simulated_attention.backward(*args, **kw, deterministic=True)
    assert "backward_wgmma_ws" + registry.ORDERED_DQ in launched, launched
    check_results(case, (q, k, v, dout), out, lse, grads)
    with_pass = simulated_attention.backward(*args, **kw, deterministic=True, ordered=False)
    assert "backward_dq_wgmma" in launched
    assert np.array_equal(grads[1], with_pass[1]) and np.array_equal(grads[2], with_pass[2])


@pytest.mark.parametrize(
    "old, new",
    [
        # a key tile left out of the count: the writer sees one addition more than it
        # waited for, and traps (on the GPU the order would vary from run to run)
        ("w.tile + 1 + threadIdx.x % 32", "w.tile + 2 + threadIdx.x % 32"),
        # the block's own key tile counted: a wait no block meets (a hang on the GPU)
        ("w.tile + 1 + threadIdx.x % 32", "w.tile + threadIdx.x % 32"),
        # the counter never raised
        ("                increment_counter(counter);\n", ""),
    ],
    ids=["count-short", "count-long", "no-increment"],
)
def test_simulator_finds_a_broken_dq_order(old, new, rng, tmp_path, monkeypatch):
    """The ordered dQ's counts and counters broken: a simulator failure, never a pass."""
    with pytest.raises(simulator.SimulationError):
        _broken_backward(ORDERED_CASES[1], old, new, rng, tmp_path, monkeypatch, deterministic=True)


# The warp-specialized backward's headers: the kernel, and its parts outside the kernel
# (the dQ writer's additions among them).
BACKWARD_WS_HEADERS = ("sm90/backward_wgmma_ws.cuh", "sm90/backward_wgmma_ws_parts.cuh")


def _broken_backward(case, old, new, rng, tmp_path, monkeypatch, tma=True, deterministic=False):
    """The warp-specialized backward of ``case`` (dQ by its atomics, or deterministic in
    launch order; its tiles by the copy engine, or by cp.async) with ``old`` replaced by
    ``new`` in the first of its headers that holds it: the largest relative error of dq,
    dk, dv."""
    header = next(
        (h for h in BACKWARD_WS_HEADERS if old in (simulator.KERNEL_DIR / h).read_text()),
        BACKWARD_WS_HEADERS[0],  # none: kernels_with says what is missing
    )
    kernels = simulator.kernels_with(tmp_path / "kernels", header, old, new)
    monkeypatch.setattr(simulator, "KERNEL_DIR", kernels)
    q, k, v, dout = random_inputs(case, rng)
    out, lse = simulated_attention.forward(q, k, v, *case.args, capability=90)
    grads = simulated_attention.backward(
        dout, q, k, v, out, lse, *case.args, capability=90, tma=tma, deterministic=deterministic
    )
    expected = oracle(case, q, k, v, dout)[2]
    return max(rel_error(g, e) for g, e in zip(grads, expected))


# The simulator runs every thread up to its next barrier in turn, so a consumer's dQ
# issued before the other consumer's half of dS^T is in (no named barrier, or one dS^T
# buffer) still reads that half in time there: compute-sanitizer's racecheck holds
# those (docs/kernels/simulator.md).
@pytest.mark.parametrize(
    "old, new",
    [
        # a stage never handed back: the producer waits for it forever
        ("ring->release(use, true);  // this thread's", "(void)0;  //"),
        # a stage's copies never arrive: the consumers wait forever
        ("ring->filled(use);", "(void)use;"),
    ],
    ids=["no-release", "no-fill"],
)
def test_simulator_finds_a_broken_backward_handshake(old, new, rng, tmp_path, monkeypatch):
    """The warp-specialized backward with one side of its stage handshake left out: a
    deadlock or a fault, never a pass."""
    try:
        error = _broken_backward(BACKWARD_RING_CASES[0], old, new, rng, tmp_path, monkeypatch)
    except RuntimeError as exc:  # the simulator's deadlock or fault report
        assert "deadlock" in str(exc) or "fault" in str(exc), exc
        return
    pytest.fail(f"a broken handshake passed (gradients' error {error})")


@pytest.mark.parametrize(
    "old, new, tma",
    [
        # cp.async: the dQ tile overwritten before the copy engine has read the last rows
        ("if (lane < 16) bulk_wait_read<0>();", "(void)0;", False),
        # cp.async: the block exits with additions in flight
        ("if (ATOMIC_DQ && !tma && lane < 16) bulk_wait<0>();", "(void)0;", False),
        # cp.async: a warp's rows added before all its lanes have written them
        (
            "__syncwarp();\n                    const int row = dq_row0 + warp_row + lane;",
            "const int row = dq_row0 + warp_row + lane;",
            False,
        ),
        # the writer grants the tile back before its additions have read it
        ("            bulk_commit();\n            bulk_wait_read<0>();", "bulk_commit();", True),
        # the writer adds the tile without waiting for the consumers to fill it
        ("mbarrier_wait(full + buffer, (i >> 1) & 1);", "(void)buffer;", True),
        # the consumers fill a tile without waiting for its grant
        ("mbarrier_wait(dq_empty + buffer, ((use >> 1) & 1) ^ 1);", "(void)0;", True),
    ],
    ids=[
        "no-read-wait",
        "no-final-wait",
        "no-warp-sync",
        "writer-no-read-wait",
        "writer-no-full-wait",
        "consumers-no-grant",
    ],
)
def test_simulator_finds_broken_bulk_dq_additions(old, new, tma, rng, tmp_path, monkeypatch):
    """The warp-specialized backward's dQ tile handed to the copy engine without its
    waits, by the consumers' warps (cp.async) or by the dQ writer (the copy engine): a
    simulator failure or gradients far from the oracle's (about 2e-3 from it when
    right), never a pass."""
    try:
        error = _broken_backward(
            BACKWARD_RING_CASES[0], old, new, rng, tmp_path, monkeypatch, tma=tma
        )
    except simulator.SimulationError:
        return
    assert not error < 0.05, error


@pytest.mark.parametrize(
    "old, new",
    [
        # a step's barrier told of half its boxes' bytes: it completes before the rest land
        ("ring->expect(use, STEP_BYTES)", "ring->expect(use, STEP_BYTES / 2)"),
        # dO's boxes one row off
        (
            "&dout_map, c * 64,\n                                            m0,",
            "&dout_map, c * 64, m0 + 1,",
        ),
        # V's boxes read through K's map
        ("&v_map, c * 64, n0, hk, b, kv_full", "&k_map, c * 64, n0, hk, b, kv_full"),
        # dQ's boxes added a row off
        (
            "bulk_tensor_reduce_add_4d(map, 32 * box, m0,",
            "bulk_tensor_reduce_add_4d(map, 32 * box, m0 + 1,",
        ),
        # dQ's boxes written without the swizzle the copy engine reads them by
        (
            "^ (row & 7)) << 2) + 2 * (t & 1)) =\n                                    value;",
            ") << 2) + 2 * (t & 1)) = value;",
        ),
    ],
    ids=["step-bytes", "dout-rows", "v-map", "dq-rows", "dq-swizzle"],
)
def test_simulator_finds_broken_backward_bulk_tensor_copies(old, new, rng, tmp_path, monkeypatch):
    """The warp-specialized backward's bulk tensor copies with a wrong transaction count,
    a box at the wrong rows or through the wrong map, and its dQ boxes added a row off
    or unswizzled: a deadlock, a fault or gradients far from the oracle's, never a
    pass."""
    try:
        error = _broken_backward(BACKWARD_RING_CASES[0], old, new, rng, tmp_path, monkeypatch)
    except simulator.SimulationError:
        return
    assert not error < 0.05, error


@pytest.mark.parametrize(
    "old, new, deterministic",
    [
        # the 256 class's dQ boxes written without the swizzle the copy engine reads
        (
            "^ (row & 7)) << 2) + 2 * (t & 1)) =\n                                    make_float2",
            ") << 2) + 2 * (t & 1)) = make_float2",
            False,
        ),
        # each in the stage of the step before: another step's rows
        (
            "float* const q_boxes = reinterpret_cast<float*>(Qs + stage * BM * DT);",
            "float* const q_boxes = reinterpret_cast<float*>(Qs + (stage ^ 1) * BM * DT);",
            False,
        ),
        # the dQ pass's calls (no writer): a stage never handed back by its consumers
        ("if constexpr (!ATOMIC_DQ) ring->release(use, true);", "(void)0;", True),
    ],
    ids=["dq-swizzle", "dq-stage", "no-release"],
)
def test_simulator_finds_a_broken_256_class_backward(
    old, new, deterministic, rng, tmp_path, monkeypatch
):
    """The 256 class's dQ boxes unswizzled or in the other stage, and its stages never
    handed back without the writer (cp.async, the dQ pass): a deadlock, a fault or
    gradients far from the oracle's, never a pass."""
    try:
        error = _broken_backward(
            BACKWARD_256_CASES[0],
            old,
            new,
            rng,
            tmp_path,
            monkeypatch,
            tma=not deterministic,
            deterministic=deterministic,
        )
    except simulator.SimulationError:
        return
    assert not error < 0.05, error


FLOAT32_CASES = [
    Case(
        dtype="float32", head_dim=64, batch=1, heads=2, kv_heads=1, q_len=70, kv_len=90, causal=True
    ),
    Case(
        dtype="float32",
        head_dim=40,
        batch=2,
        heads=3,
        kv_heads=3,
        q_len=90,
        kv_len=50,
        window=(20, 10),
        bshd=True,
    ),
    Case(
        dtype="float32",
        head_dim=128,
        batch=1,
        heads=2,
        kv_heads=1,
        q_len=1,
        kv_len=80,
        kv_seq_len=61,
    ),
    Case(
        dtype="float32",
        head_dim=160,
        batch=1,
        heads=2,
        kv_heads=1,
        q_len=50,
        kv_len=70,
        window=(20, 5),
    ),
    Case(
        dtype="float32",
        head_dim=256,
        batch=1,
        heads=2,
        kv_heads=2,
        q_len=40,
        kv_len=40,
        causal=True,
    ),
]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", FLOAT32_CASES, ids=str)
def test_float32_pieces_kernels_match_oracle(case, deterministic, rng):
    """float32 on H100/H200: the float16 pieces (abs_max and split), the pieces forward and
    backward (the wide kernels and their dQ pass past D = 128), float32 accuracy."""
    inputs, out, lse, grads = _run(case, rng, deterministic, capability=90)
    check_results(case, inputs, out, lse, grads)


@pytest.mark.parametrize(
    "case",
    [
        FLOAT32_CASES[0],
        Case(
            dtype="bfloat16",
            head_dim=160,
            batch=1,
            heads=2,
            kv_heads=2,
            q_len=40,
            kv_len=60,
            window=(20, 5),
        ),
    ],
    ids=str,
)
@pytest.mark.parametrize("deterministic", [False, True])
def test_general_kernels_match_oracle(case, deterministic, rng):
    """The CUDA-core kernels: float32's path before Hopper, and every call with rows off
    the 16-byte grid."""
    inputs, out, lse, grads = _run(
        case,
        rng,
        deterministic,
        excluded=("forward_mma_sync", "backward_mma_sync", "backward_mma_sync_split_d"),
    )
    check_results(case, inputs, out, lse, grads)


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", [64, 136])
def test_modified_kernels_match_oracle(head_dim, deterministic, capability, rng):
    """Soft-cap and ALiBi on the tensor-core kernels (the modified dQ passes when
    deterministic, and past D = 128 on Hopper) and, before Hopper past the mma.sync
    backward's head dims, the general backward."""
    case = Case(
        dtype="bfloat16",
        head_dim=head_dim,
        batch=2,
        heads=4,
        kv_heads=2,
        q_len=45,
        kv_len=70,
        causal=True,
    )
    softcap, slopes = 4.0, alibi_slopes(rng, "batch_heads", case.batch, case.heads)
    inputs, out, lse, grads = _run(
        case, rng, deterministic, softcap=softcap, slopes=slopes, capability=capability
    )
    check_modified_results(case, inputs, (out, lse, *grads), softcap, slopes)


def _user_modifier_cases(rng, heads, length):
    """name -> (score_mod, mask_mod) of NumPy arrays: the docs' examples (documents packed
    in one sequence, prefix-LM, chunked local attention), a random mask with rows that
    see nothing, a learned relative bias with the document mask."""
    ids = np.repeat(np.arange(4, dtype=np.int32), (70, 20, 50, length - 140))
    documents = modifiers.and_masks(modifiers.document_mask(ids), modifiers.causal_mask())
    table = rng.random((heads, length, length)) < 0.3
    table[:, ::7] = False

    def random_pattern(b, h, q_idx, kv_idx):
        return table[h, q_idx, kv_idx]

    bias = rng.uniform(-1, 1, (heads, 2 * 255 + 1)).astype(np.float32)
    return {
        "documents": (None, documents, None),
        "prefix_lm": (None, modifiers.prefix_lm_mask(60), None),
        "chunked": (None, modifiers.chunked_mask(64), None),
        "random": (None, modifiers.MaskMod(random_pattern), heads),
        "bias_documents": (modifiers.relative_bias_score(bias), documents, None),
    }


# (case, capability, deterministic, through a block mask)
USER_RUNS = [
    (name, capability, deterministic, block)
    for name in ("documents", "prefix_lm", "chunked", "random", "bias_documents")
    for capability, deterministic, block in ((80, True, False), (90, False, True))
]
USER_RUNS += [("bias_documents", 80, False, True), ("documents", 90, True, True)]


@pytest.mark.parametrize("name, capability, deterministic, block", USER_RUNS, ids=str)
def test_user_modifier_kernels_match_oracle(name, capability, deterministic, block, rng):
    """The kernels compiled with the user's functors (mask-only, and a score function
    with a mask), their arrays read through the modifier record, forward and backward;
    with ``block``, through a block mask (each kernel's view of its classes and ranges:
    empty tiles skipped, the mask evaluated only on the tiles it cuts)."""
    _check_user_modifiers(name, capability, deterministic, block, rng)


# (head_dim, case, deterministic, q/k/v/dout by the copy engine): a user's mask alone
MASKED_WS_RUNS = [
    (96, "documents", False, True),
    (128, "random", True, True),
    (128, "chunked", False, False),
    (40, "prefix_lm", True, False),
    (256, "documents", False, True),
    (192, "chunked", True, False),
]


@pytest.mark.parametrize("head_dim, name, deterministic, tma", MASKED_WS_RUNS, ids=str)
def test_warp_specialized_backward_takes_a_users_mask(head_dim, name, deterministic, tma, rng):
    """A user's mask alone, through a block mask, on the warp-specialized backward of
    every class: each key tile's query steps narrowed to the block mask's range, the mask
    on the tiles it marks partial, dQ by the writer warp or by its pass."""
    spec = registry.choose(
        "backward", DTYPES["bfloat16"], head_dim, 90, modified=True, mask_only=True
    )
    assert spec.name == "backward_wgmma_ws"
    _check_user_modifiers(name, 90, deterministic, True, rng, head_dim=head_dim, tma=tma)


def _check_user_modifiers(name, capability, deterministic, block, rng, head_dim=64, tma=False):
    batch, heads, kv_heads, length = 1, 4, 2, 160
    score_mod, mask_mod, mask_heads = _user_modifier_cases(rng, heads, length)[name]
    host = [
        rng.standard_normal((batch, h, length, head_dim)).astype(DTYPES["bfloat16"])
        for h in (heads, kv_heads, kv_heads, heads)
    ]
    q, k, v, dout = host
    kw = dict(score_mod=score_mod, capability=capability, tma=tma)
    if block:
        kw["block_mask"] = create_block_mask(mask_mod, None, mask_heads, length, length)
    else:
        kw["mask_mod"] = mask_mod
    out, lse = simulated_attention.forward(q, k, v, heads, kv_heads, head_dim, **kw)
    grads = simulated_attention.backward(
        dout, q, k, v, out, lse, heads, kv_heads, head_dim, deterministic=deterministic, **kw
    )
    h64 = [x.astype(np.float64) for x in host]
    ref = dict(score_mod=score_mod, mask_mod=mask_mod)
    ref_out, ref_lse = attention_reference(*h64[:3], False, 0, **ref)
    ref_grads = attention_reference_grad(h64[3], *h64[:3], False, 0, **ref)
    for label, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert rel_error(got, want) <= 2e-2 + FLOOR["bfloat16"], label
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    assert np.all(out[np.isneginf(ref_lse)] == 0)


def test_packed_block_mask_kernels_match_oracle(rng):
    """A packed call's block mask (made for the sequences' count and longest lengths),
    whose mask reads the sequence index: each block reads its sequence's classes and
    ranges (blockIdx.z), tiles counted from the sequence's first row and key; the forward
    skips the tiles it empties (a causal prefix-LM past the first 128 rows)."""
    lengths_q, lengths_k = [300, 0, 45, 410], [300, 8, 60, 410]
    heads, kv_heads, head_dim = 4, 2, 16
    q, k, v, dout, cu_q, cu_k = packed_inputs(
        rng, lengths_q, lengths_k, heads, kv_heads, head_dim, "bfloat16"
    )
    # the first sequence's tile of rows 0-127 and keys 256-383 empty, the last one's
    # not: a block reading another sequence's classes skips visible keys
    prefixes = np.array([5, 3, 20, 300], np.int32)
    mask_mod = modifiers.prefix_lm_mask(prefixes)
    rows, keys = max(lengths_q), max(lengths_k)
    block_mask = create_block_mask(mask_mod, len(lengths_q), None, rows, keys)
    args = (cu_q, cu_k, rows, keys, heads, kv_heads, head_dim)
    kw = dict(capability=90, modifiers=dict(block_mask=block_mask))
    out, lse = simulated_attention.varlen_forward(q, k, v, *args, **kw)
    grads = simulated_attention.varlen_backward(dout, q, k, v, out, lse, *args, **kw)
    q_at, k_at = np.cumsum([0] + lengths_q), np.cumsum([0] + lengths_k)
    for b in range(len(lengths_q)):
        if lengths_q[b] == 0:
            continue
        rows_b, keys_b = slice(q_at[b], q_at[b + 1]), slice(k_at[b], k_at[b + 1])
        q64, k64, v64, dout64 = (
            x[s].transpose(1, 0, 2)[None].astype(np.float64)
            for x, s in ((q, rows_b), (k, keys_b), (v, keys_b), (dout, rows_b))
        )
        ref = dict(mask_mod=modifiers.prefix_lm_mask(int(prefixes[b])))
        want_out, _ = attention_reference(q64, k64, v64, False, 0, **ref)
        want_grads = attention_reference_grad(dout64, q64, k64, v64, False, 0, **ref)
        got = (out[rows_b], grads[0][rows_b], grads[1][keys_b], grads[2][keys_b])
        for label, g, w in zip(("out", "dq", "dk", "dv"), got, (want_out, *want_grads)):
            g = g.astype(np.float64).transpose(1, 0, 2)[None]
            assert rel_error(g, w) <= 2e-2 + FLOOR["bfloat16"], (b, label)


# Packed batches: sequences of no query row, of no key, GQA, windows (test_varlen's mix).
PACKED_CASES = [
    dict(lengths_q=[5, 0, 17, 1, 9], lengths_k=[5, 3, 17, 1, 9], head_dim=64),
    dict(lengths_q=[6, 66], lengths_k=[6, 0], heads=4, kv_heads=4, head_dim=40, causal=False),
    dict(
        lengths_q=[3, 70, 20],
        lengths_k=[9, 80, 20],
        heads=6,
        kv_heads=1,
        head_dim=128,
        window=(12, 1),
        causal=False,
    ),
    dict(lengths_q=[40, 30], lengths_k=[50, 30], head_dim=200),
]


@pytest.mark.parametrize("capability, dtype", [(80, "bfloat16"), (90, "float16"), (90, "float32")])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", PACKED_CASES, ids=str)
def test_packed_kernels_match_oracle(case, deterministic, capability, dtype, rng):
    """The kernels read each sequence's rows from the offsets; rows outside every sequence
    are zeros (packed_zero_outside)."""
    case = dict(dict(heads=4, kv_heads=2, causal=True, window=0), **case)
    lengths_q, lengths_k = case["lengths_q"], case["lengths_k"]
    q, k, v, dout, cu_q, cu_k = packed_inputs(
        rng, lengths_q, lengths_k, case["heads"], case["kv_heads"], case["head_dim"], dtype
    )
    args = (
        cu_q,
        cu_k,
        max(lengths_q),
        max(lengths_k),
        case["heads"],
        case["kv_heads"],
        case["head_dim"],
        case["causal"],
        case["window"],
    )
    out, lse = simulated_attention.varlen_forward(q, k, v, *args, capability=capability)
    grads = simulated_attention.varlen_backward(
        dout, q, k, v, out, lse, *args, deterministic=deterministic, capability=capability
    )
    check_packed_results(
        (q, k, v, dout),
        out,
        lse,
        grads,
        lengths_q,
        lengths_k,
        dtype,
        case["causal"],
        case["window"],
    )


GARBAGE_OFFSETS = ([0, -50, 10**6, 20], [100, 10, 130, 2**31 - 1], [-7, 500, -3, 130])


def _garbage_offsets_run(rng, capability, dtype, offsets, deterministic=False):
    """A packed forward and backward whose kernels read garbage device ``offsets``, every
    array between guard pages (a fault raises simulator.SimulationError)."""
    lengths = [40, 60, 30]
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lengths, lengths, 2, 2, 64, dtype)
    garbage = np.array(offsets, np.int32)
    args = (cu_q, cu_k, max(lengths), max(lengths), 2, 2, 64, True)
    kw = dict(device_offsets=(garbage, garbage), capability=capability, guard=True)
    out, lse = simulated_attention.varlen_forward(q, k, v, *args, **kw)
    return simulated_attention.varlen_backward(
        dout, q, k, v, out, lse, *args, deterministic=deterministic, **kw
    )


def test_rows_outside_every_sequence_read_as_seeing_no_key(rng):
    """Device offsets whose first is past row 0 (garbage: the host's say otherwise) leave
    rows that no sequence covers: zeros in the output, -inf in the log-sum-exp, which the
    backward reads whatever the offsets say."""
    lengths = [40, 60, 30]
    q, k, v, _, cu_q, cu_k = packed_inputs(rng, lengths, lengths, 2, 2, 64, "bfloat16")
    garbage = np.array([100, 10, 130, 2**31 - 1], np.int32)
    out, lse = simulated_attention.varlen_forward(
        q,
        k,
        v,
        cu_q,
        cu_k,
        60,
        60,
        2,
        2,
        64,
        True,
        device_offsets=(garbage, garbage),
        capability=90,
    )
    assert lse.shape == (2, 130)
    assert np.all(np.asarray(out[:100], np.float32) == 0)
    assert np.all(lse[:, :100] == -np.inf)


@pytest.mark.parametrize("capability, dtype", [(80, "float16"), (90, "bfloat16"), (90, "float32")])
@pytest.mark.parametrize("offsets", GARBAGE_OFFSETS, ids=str)
def test_garbage_device_offsets_stay_inside_the_arrays(offsets, capability, dtype, rng):
    """Device offsets are never trusted (the varlen page, section 'Offsets on the
    device'): negative, decreasing, past the totals or longer than max_seqlen, no kernel
    reads or writes outside its arrays."""
    for deterministic in (False, True):
        grads = _garbage_offsets_run(rng, capability, dtype, offsets, deterministic)
        assert all(g.shape[1:] == (2, 64) for g in grads)


def test_a_parameter_record_of_other_parameters_fails_the_launch():
    """A kernel's parameter buffer must be laid out for its own parameter list: Delta's
    kernel runs with its record, and fails with the dQ conversion's (laid out for other
    parameters, as a host whose lists went out of step with the kernels' would)."""
    problem = types.SimpleNamespace(num_heads=2, q_len=8)  # what the records read
    name = "cuflash::backward_delta<float, 64>"
    module = simulator.build([name], headers=("simt/backward_delta.cuh",))
    dout, out = np.ones((1, 2, 8, 64), np.float32), np.full((1, 2, 8, 64), 2.0, np.float32)
    lse = np.zeros((1, 2, 8), np.float32)
    delta, lse_log2 = np.zeros(16, np.float32), np.zeros(16, np.float32)
    strides = (np.int64(1024), np.int64(512), np.int64(64))
    arrays = (dout, out, lse, delta, lse_log2, None)
    delta_params = kernel_params.delta_params(problem, strides, strides, 0)
    module.launch(name, (2, 2, 1), 128, 0, (delta_params, arrays))
    assert (delta == 128.0).all()
    convert = kernel_params.dq_convert_params(problem, strides, 1024, 64)
    with pytest.raises(simulator.SimulationError, match="parameter buffer of 60 bytes"):
        module.launch(name, (2, 2, 1), 128, 0, (convert, (dout, out)))


def test_guard_pages_catch_an_offset_left_unclamped(rng, tmp_path, monkeypatch):
    """The guard pages of the test above see an access outside an array: with the
    sequence's first query row taken from the offsets unclamped, the kernels fault."""
    kernels = simulator.kernels_with(
        tmp_path / "kernels",
        "common/common.cuh",
        "const int q0 = clamped(offsets_q[b], 0, q_len)",
        "const int q0 = offsets_q[b]",
    )
    monkeypatch.setattr(simulator, "KERNEL_DIR", kernels)
    with pytest.raises(simulator.SimulationError, match="faulted"):
        _garbage_offsets_run(rng, 80, "float16", [0, -50, 10**6, 20])


# The decode kernels are one code for every GPU; long query chunks on a contiguous cache
# take the dense forward, whose Hopper kernels read device-held key counts.
KV_RUNS = [(case, 80) for case in KV_CASES] + [
    (case, 90)
    for case in KV_CASES
    if not case.block_size and case.q_len * (case.heads // case.kv_heads) >= 64
]


@pytest.mark.parametrize("case, capability", KV_RUNS, ids=str)
def test_kvcache_kernels_match_oracle(case, capability, rng):
    """Every case of test_kvcache (appends across blocks, paged and shared blocks, vLLM's
    layout, windows, modifiers, long chunks on the dense kernels): the append, the split-KV
    kernel and the combine of its splits, the cache bitwise unchanged but for the new
    rows."""
    run_case(case, rng, call=functools.partial(simulated_kvcache.forward, capability=capability))


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize(
    "paged, q_len",
    [(False, 2), (True, 2), (False, 32)],
    ids=["contiguous", "paged", "contiguous-dense"],
)
def test_garbage_lengths_and_block_ids_stay_inside(paged, q_len, capability, rng):
    """Device-held lengths and block ids are never trusted (the KV-cache page, section
    'Lengths and block ids on the GPU'): test_kvcache's garbage (negative, past the
    capacity, block ids out of range) under guard pages, appends and the attention alike,
    every row finite."""
    b, h, hk, d, bs, max_blocks, num_blocks = 4, 8, 2, 128, 16, 8, 20
    dtype = DTYPES["bfloat16"]
    shape = (num_blocks, hk, bs, d) if paged else (b, hk, max_blocks * bs, d)
    k_cache, v_cache = (rng.standard_normal(shape).astype(dtype) for _ in "kv")
    q = rng.standard_normal((b, h, q_len, d)).astype(dtype)
    k_new, v_new = (rng.standard_normal((b, hk, q_len, d)).astype(dtype) for _ in "kv")
    garbage_lengths = np.array([5, -70000, 2**31 - 1, 10**6], np.int32)
    table = garbage_table = None
    if paged:
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
        capability=capability,
        device_lengths=garbage_lengths,
        device_table=garbage_table,
        guard=True,
    )
    assert np.isfinite(out.astype(np.float32)).all() and np.isfinite(lse).all()


def _broken_dq(case, header, old, new, capability, rng, tmp_path, monkeypatch):
    """The relative error of dQ of the deterministic backward of ``case`` (its dQ pass)
    with ``old`` replaced by ``new`` in kernel header ``header``."""
    kernels = simulator.kernels_with(tmp_path / "kernels", header, old, new)
    monkeypatch.setattr(simulator, "KERNEL_DIR", kernels)
    q, k, v, dout = random_inputs(case, rng)
    out, lse = simulated_attention.forward(q, k, v, *case.args, capability=capability)
    dq, _, _ = simulated_attention.backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        *case.args,
        deterministic=True,
        capability=capability,
        ordered=False,
    )
    return rel_error(dq, oracle(case, q, k, v, dout)[2][0])


def test_simulator_finds_a_tile_read_before_its_copy_lands(rng, tmp_path, monkeypatch):
    """A kernel that reads a tile without waiting for its cp.async group reads the NaN
    the simulator poisons shared memory with, so such a bug fails these tests."""
    assert (
        _broken_dq(
            CASES[0],
            "sm80/backward_dq_mma_sync.cuh",
            "cp_async_wait<1>();",
            "",
            80,
            rng,
            tmp_path,
            monkeypatch,
        )
        == math.inf
    )


def test_simulator_finds_a_wrong_wgmma_descriptor(rng, tmp_path, monkeypatch):
    """A wgmma operand read with the wrong stride between its 64-column blocks (K in the
    Hopper dQ pass's dQ += dS K, at D = 128) gives results far from the oracle's (about
    1e-3 from it when right)."""
    assert (
        _broken_dq(
            CASES[1],
            "sm90/backward_dq_wgmma.cuh",
            "BN * 64 * sizeof(T), ATOM)",
            "BN * 32 * sizeof(T), ATOM)",
            90,
            rng,
            tmp_path,
            monkeypatch,
        )
        > 0.1
    )


def _broken_forward(case, header, old, new, rng, tmp_path, monkeypatch, **kw):
    """Run the Hopper forward of ``case`` with ``old`` replaced by ``new`` in kernel header
    ``header`` (``kw``: the simulated call's options); the relative error of its output."""
    kernels = simulator.kernels_with(tmp_path / "kernels", header, old, new)
    monkeypatch.setattr(simulator, "KERNEL_DIR", kernels)
    q, k, v, dout = random_inputs(case, rng)
    out, _ = simulated_attention.forward(
        q, k, v, *case.args, kv_seq_len=case.kv_seq_len, capability=90, **kw
    )
    return rel_error(out, oracle(case, q, k, v, dout)[0])


@pytest.mark.parametrize(
    "old, new",
    [
        # the producer refills a stage without waiting for the consumers to hand it back
        ("mbarrier_wait(&empty[stage(use)], parity(use) ^ 1);", "(void)use;"),
        # a consumer reads a stage without waiting for its copies
        ("mbarrier_wait(&full[stage(use)], parity(use));", "(void)use;"),
    ],
    ids=["refill-early", "read-early"],
)
def test_simulator_finds_a_broken_stage_ring(old, new, rng, tmp_path, monkeypatch):
    """The warp-specialized forward with one side of its stage handshake left out: a
    deadlock, a fault or results far from the oracle's, never a pass."""
    try:
        error = _broken_forward(
            RING_CASES[0], "common/mbarrier.cuh", old, new, rng, tmp_path, monkeypatch
        )
    except simulator.SimulationError:
        return
    assert not error < 0.05, error


@pytest.mark.parametrize(
    "old, new",
    [
        # Q's barrier told of half its boxes' bytes: it completes before the second lands
        (
            "mbarrier_arrive_expect_tx(q_full, Q_BYTES);",
            "mbarrier_arrive_expect_tx(q_full, Q_BYTES / 2);",
        ),
        # K's boxes one row off
        ("&k_map, c * CHUNK, n0, hk, b,", "&k_map, c * CHUNK, n0 + 1, hk, b,"),
        # V's stage barrier told of no bytes: it completes before its copies land
        ("v_ring->expect(use, V_BYTES)", "v_ring->expect(use, 0)"),
    ],
    ids=["q-bytes", "k-rows", "v-bytes"],
)
def test_simulator_finds_broken_bulk_tensor_copies(old, new, rng, tmp_path, monkeypatch):
    """The warp-specialized forward's bulk tensor copies with a wrong transaction count or
    a box at the wrong rows: a deadlock, a fault or results far from the oracle's."""
    try:
        error = _broken_forward(
            RING_CASES[0], "sm90/forward_wgmma_ws.cuh", old, new, rng, tmp_path, monkeypatch
        )
    except simulator.SimulationError:
        return
    assert not error < 0.05, error


@pytest.mark.parametrize(
    "old, new",
    [
        # the second and third column blocks' chunks from the wrong columns
        ("valid ? from + block * 64 : src", "valid ? from + block * 32 : src"),
        # every column block written over the first
        ("dst + block * (ROWS * 64) + to(r, c)", "dst + to(r, c)"),
    ],
    ids=["columns", "block"],
)
def test_simulator_finds_a_broken_192_column_copy(old, new, rng, tmp_path, monkeypatch):
    """The 256 class's rows of 192 columns by cp.async (24 chunks a row, a chunk of each
    64-column block a thread): a copy of the wrong columns or into the wrong column block
    is far from the oracle's."""
    case = RING_CASES[-1]
    assert case.head_dim == 168
    error = _broken_forward(
        case, "common/wgmma.cuh", old, new, rng, tmp_path, monkeypatch, tma=False
    )
    assert not error < 0.05, error


def test_the_256_class_forward_tiles():
    """Plain calls of D = 136-192 on rows of 192 columns take two stages of 96 keys
    (H100, 2026-12-07: 1.07x-1.26x over 64-key tiles in rows of 256); past D = 192 and
    in the modified roles (a user's functions, a block mask) tiles of 64 keys."""
    spec = registry.choose("forward", DTYPES["bfloat16"], 160, 90)
    for d, plain, modified in (
        (136, (96, 2, 2), (64, 3, 2)),
        (192, (96, 2, 2), (64, 3, 2)),
        (200, (64, 2, 2), (64, 2, 2)),
        (256, (64, 2, 2), (64, 2, 2)),
    ):
        assert spec.traits_of(d).template_args == plain, d
        assert spec.traits_of(d, modified=True).template_args == modified, d


# Attention sinks: each forward kernel family's row finish (mma.sync, wgmma warp-specialized
# and not, the float32 pieces and their wide kernel, the CUDA cores), causal rows that see no
# key; two runs through the (unchanged) backward kernels on the sinks' lse.
SINK_CASE = Case(
    dtype="bfloat16", head_dim=64, batch=1, heads=4, kv_heads=2, q_len=50, kv_len=30, causal=True
)
SINK_RUNS = [
    (SINK_CASE, 80, (), True),
    (SINK_CASE, 90, (), True),
    (
        Case(
            dtype="float16",
            head_dim=136,
            batch=1,
            heads=2,
            kv_heads=1,
            q_len=40,
            kv_len=50,
            window=(20, 5),
        ),
        90,
        (),
        False,
    ),
    (
        Case(
            dtype="float32",
            head_dim=64,
            batch=1,
            heads=2,
            kv_heads=1,
            q_len=40,
            kv_len=30,
            causal=True,
        ),
        90,
        (),
        False,
    ),
    (
        Case(
            dtype="float32",
            head_dim=160,
            batch=1,
            heads=2,
            kv_heads=2,
            q_len=40,
            kv_len=30,
            causal=True,
        ),
        90,
        (),
        False,
    ),
    (
        Case(
            dtype="float32",
            head_dim=40,
            batch=2,
            heads=2,
            kv_heads=1,
            q_len=40,
            kv_len=30,
            causal=True,
        ),
        80,
        (),
        False,
    ),
]


@pytest.mark.parametrize("case, capability, excluded, backward", SINK_RUNS, ids=str)
def test_sink_kernels_match_oracle(case, capability, excluded, backward, rng):
    """Every forward kernel adds exp(sinks[h]) to its rows' sums (add_sink): out and lse
    against the oracle, rows that see no key zeros with lse = sinks[h]; the backward's
    kernels on that lse give the oracle's gradients, and dsinks from the lse and Delta."""
    from sink_checks import check_sink_results, random_sinks

    from cuflash import sinks as attention_sinks

    q, k, v, dout = random_inputs(case, rng)
    sinks = random_sinks(rng, case.heads)
    kw = dict(softmax_scale=case.scale, excluded=excluded, capability=capability)
    out, lse = simulated_attention.forward(q, k, v, *case.args, sinks=sinks, **kw)
    results = [out, lse]
    if backward:
        results += simulated_attention.backward(dout, q, k, v, out, lse, *case.args, **kw)
        delta = attention_sinks.row_deltas(dout, out)
        results.append(attention_sinks.gradient(np, sinks, lse, delta, 1))
    dead = check_sink_results(
        (q, k, v, dout),
        results,
        sinks,
        case.dtype,
        case.causal,
        case.window,
        softmax_scale=case.scale,
        kernels=True,
    )
    assert dead.any() == case.causal


def test_packed_sink_kernels_match_oracle(rng):
    """Packed batches: each sequence's rows take the sinks, a sequence of no key gives
    zeros and lse = sinks[h]."""
    from sink_checks import NO_KEY_LSE_RTOL, random_sinks

    lengths_q, lengths_k, heads = [20, 7, 33], [25, 0, 30], 4
    q, k, v, _, cu_q, cu_k = packed_inputs(rng, lengths_q, lengths_k, heads, 2, 64, "bfloat16")
    sinks = random_sinks(rng, heads)
    out, lse = simulated_attention.varlen_forward(
        q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), heads, 2, 64, True, sinks=sinks
    )
    want_out, want_lse = cuflash.flash_attention_varlen_fwd(
        q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), heads, 2, 64, True, sinks=sinks
    )
    assert rel_error(out, want_out.astype(np.float64)) <= 1e-2
    assert np.max(np.abs(lse - want_lse)) <= 1e-4 * (1 + np.abs(want_lse).max())
    assert np.all(out[20:27].astype(np.float32) == 0)
    no_key = np.broadcast_to(sinks[:, None], (heads, 7))
    assert np.all(np.abs(lse[:, 20:27] - no_key) <= NO_KEY_LSE_RTOL["kernels"] * np.abs(no_key))
