"""Ring attention (the distributed page), simulated: N virtual ranks as threads of one
process (``cuflash.distributed.ThreadGroup``), each rank's shards gathered and checked
against the float64 oracle on the whole sequence, forward and backward; the pair rule against
the visible-key rule by brute force; the validation errors."""

import collections
import functools
import importlib.util
import itertools
import pathlib
import threading
import types
import weakref

import numpy as np
import pytest
from support import DTYPES, FLOOR, compile_and_check, rel_error, to_numpy

import cuflash
from cuflash import distributed as dist
from cuflash.core.masking import visible_keys
from cuflash.reference import attention_reference, attention_reference_grad

BOUND = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.5e-2}


def _ring(
    rng,
    size,
    layout,
    causal=True,
    window=0,
    heads=4,
    kv_heads=2,
    head_dim=16,
    chunk=6,
    dtype="float32",
    deterministic=False,
    batch=1,
    xp=np,
    vjp_function=None,
    sinks=None,
):
    """Run forward and backward on ``size`` virtual ranks (arrays of ``xp``) with
    ``vjp_function`` (the ring's by default); return the gathered results (and dsinks,
    sixth, with ``sinks``) and the inputs, as NumPy arrays."""
    vjp_function = vjp_function or dist.ring_attention_vjp
    length = dist.chunk_count(layout, size) * chunk
    full = [
        rng.standard_normal((batch, h, length, head_dim)).astype(DTYPES[dtype])
        for h in (heads, kv_heads, kv_heads, heads)
    ]
    per_rank = [
        tuple(dist.shard(xp.asarray(x), layout, r, size) for x in full) for r in range(size)
    ]

    def rank(group, q, k, v, dout):
        extra = {} if sinks is None else {"sinks": xp.asarray(sinks)}
        out, vjp = vjp_function(
            q, k, v, heads, kv_heads, head_dim, causal, window, group=group, layout=layout, **extra
        )
        return (out, vjp.lse, *vjp(dout, deterministic=deterministic))

    results = dist.ThreadGroup(size).run(rank, per_rank)
    gathered = [to_numpy(dist.gather([r[i] for r in results], layout)) for i in range(5)]
    if sinks is not None:  # every rank's dsinks: the whole sequence's, the same bits
        gathered.append([to_numpy(r[5]) for r in results])
    return gathered, full


def _check(rng, size, layout, dtype="float32", **kw):
    (out, lse, dq, dk, dv), (q, k, v, dout) = _ring(rng, size, layout, dtype=dtype, **kw)
    causal, window = kw.get("causal", True), kw.get("window", 0)
    host = [x.astype(np.float64) for x in (q, k, v, dout)]
    ref_out, ref_lse = attention_reference(*host[:3], causal, window)
    ref_grads = attention_reference_grad(host[3], *host[:3], causal, window)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref_out, *ref_grads)):
        err = rel_error(got.astype(np.float64), want)
        assert err <= BOUND[dtype] + FLOOR[dtype], (name, err)
    assert not np.isnan(lse).any()
    live = ~np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), ~live)
    assert np.allclose(lse[live], ref_lse[live], atol=1e-4)


@pytest.mark.parametrize("layout", dist.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_ring_matches_oracle(size, causal, layout, rng):
    _check(rng, size, layout, causal=causal, chunk=4 if size == 8 else 6)


@pytest.mark.parametrize(
    "window, causal", [(5, True), ((3, 7), False), ((0, 0), False), ((9, 2), True)]
)
@pytest.mark.parametrize("layout", dist.LAYOUTS)
def test_ring_windows(window, causal, layout, rng):
    """Windows across chunk boundaries: pairs whose band misses the block are skipped,
    others cut to the band (rows of a chunk that see nothing in a step merge as -inf)."""
    _check(rng, 3, layout, causal=causal, window=window)


def test_ring_gqa_batch_and_bfloat16(rng):
    _check(rng, 4, "zigzag", heads=6, kv_heads=1, batch=2, dtype="bfloat16")


def test_deterministic_ring_repeats_bitwise(rng):
    seed = int(rng.integers(2**31))
    first = _ring(np.random.default_rng(seed), 3, "zigzag", deterministic=True)[0]
    again = _ring(np.random.default_rng(seed), 3, "zigzag", deterministic=True)[0]
    for x, y in zip(first, again):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("layout", dist.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_ulysses_matches_oracle(size, causal, layout, rng):
    """The all-to-all over heads: the ring's arguments and results (4 query heads on 4
    KV heads split over up to 4 ranks)."""
    _check(
        rng,
        size,
        layout,
        causal=causal,
        heads=4,
        kv_heads=4,
        vjp_function=dist.ulysses_attention_vjp,
    )


def test_ulysses_gqa_windows_batch_and_bfloat16(rng):
    _check(
        rng,
        2,
        "zigzag",
        window=(5, 3),
        causal=False,
        heads=8,
        kv_heads=2,
        batch=2,
        dtype="bfloat16",
        vjp_function=dist.ulysses_attention_vjp,
    )


@pytest.mark.parametrize("kv_heads", [2, 4])  # one part a rank; two parts (2 KV heads)
def test_ulysses_sinks_and_deterministic_bits(kv_heads, rng):
    """Sinks split with their heads; dsinks gathered back, the whole sequence's on every
    rank, equal to the ring's; a deterministic backward repeats bitwise."""
    sinks = rng.standard_normal(4).astype(np.float32)
    seed = int(rng.integers(2**31))
    runs = [
        _ring(
            np.random.default_rng(seed),
            2,
            "zigzag",
            heads=4,
            kv_heads=kv_heads,
            deterministic=True,
            sinks=sinks,
            vjp_function=function,
        )[0]
        for function in (dist.ulysses_attention_vjp, dist.ulysses_attention_vjp)
    ]
    ring, _ = _ring(
        np.random.default_rng(seed), 2, "zigzag", heads=4, kv_heads=kv_heads, sinks=sinks
    )
    for x, y in zip(runs[0][:5], runs[1][:5]):
        assert np.array_equal(x, y)
    for got, want in zip(runs[0][:5], ring[:5]):
        assert rel_error(got.astype(np.float64), want.astype(np.float64)) <= 1e-5
    per_rank = runs[0][5]
    assert all(np.array_equal(per_rank[0], d) for d in per_rank)
    assert rel_error(per_rank[0].astype(np.float64), ring[5][0].astype(np.float64)) <= 1e-5


def test_ulysses_needs_heads_that_split_over_the_ranks():
    q = np.zeros((1, 3, 8, 16), np.float32)
    k = np.zeros((1, 1, 8, 16), np.float32)

    def rank(group, q, k):
        return dist.ulysses_attention_fwd(q, k, k, 3, 1, 16, group=group)

    with pytest.raises(cuflash.InvalidArgumentError, match="3 heads do not split over the 2"):
        dist.ThreadGroup(2).run(rank, [(q, k), (q, k)])


def _hybrid(ulysses_size):
    return functools.partial(dist.hybrid_attention_vjp, ulysses_size=ulysses_size)


@pytest.mark.parametrize("layout", dist.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "size, ulysses_size, heads, kv_heads",
    [
        (4, 2, 4, 2),
        (6, 3, 6, 3),
        (6, 2, 4, 2),
        (8, 4, 4, 4),
        (8, 2, 2, 2),
        (4, 4, 4, 4),
        (3, 1, 2, 1),
    ],
)
def test_hybrid_matches_oracle(size, ulysses_size, heads, kv_heads, causal, layout, rng):
    """Ulysses inside sub-groups, the ring across them: the ring's results for every
    split of the ranks (``ulysses_size`` 1 is the ring, the group's size Ulysses)."""
    _check(
        rng,
        size,
        layout,
        causal=causal,
        heads=heads,
        kv_heads=kv_heads,
        chunk=4,
        vjp_function=_hybrid(ulysses_size),
    )


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(
    "mode",
    [dist.ring_attention_vjp, dist.ulysses_attention_vjp, _hybrid(2)],
    ids=["ring", "ulysses", "hybrid"],
)
def test_every_mode_in_every_dtype(mode, dtype, rng):
    """The ring, Ulysses and the hybrid on 4 ranks against the oracle in each dtype
    (the partial results rounded to it, as the GPU's are)."""
    _check(rng, 4, "zigzag", dtype=dtype, heads=4, kv_heads=2, chunk=5, vjp_function=mode)


def test_hybrid_gqa_windows_batch_and_bfloat16(rng):
    _check(
        rng,
        4,
        "zigzag",
        window=(5, 3),
        causal=True,
        heads=8,
        kv_heads=2,
        batch=2,
        chunk=5,
        dtype="bfloat16",
        vjp_function=_hybrid(2),
    )


@pytest.mark.parametrize(
    "size, ulysses_size, heads, kv_heads",
    [(4, 4, 4, 1), (4, 4, 8, 2), (8, 4, 4, 2), (4, 2, 2, 1)],
)
@pytest.mark.parametrize("causal", [True, False])
def test_fewer_kv_heads_than_ranks_are_copied(size, ulysses_size, heads, kv_heads, causal, rng):
    """MQA and GQA over more ranks than KV heads: each rank a copy of its query heads' KV
    head, the copies' dK and dV summed on the way back."""
    _check(
        rng,
        size,
        "zigzag",
        causal=causal,
        heads=heads,
        kv_heads=kv_heads,
        chunk=4,
        vjp_function=_hybrid(ulysses_size),
    )


def test_copied_kv_heads_give_the_same_bits_every_run(rng):
    seed = int(rng.integers(2**31))
    runs = [
        _ring(
            np.random.default_rng(seed),
            4,
            "zigzag",
            heads=4,
            kv_heads=1,
            chunk=4,
            dtype="bfloat16",
            deterministic=True,
            vjp_function=dist.ulysses_attention_vjp,
        )[0]
        for _ in range(2)
    ]
    for x, y in zip(*runs):
        assert np.array_equal(x, y)


def test_ulysses_computes_one_part_while_the_next_travels(monkeypatch, rng):
    """Two dense calls of half the heads each; both parts' all-to-alls start before the
    first call, and the first part's results leave before the second call."""
    from cuflash.distributed import ulysses

    events = collections.defaultdict(list)

    class Recording:
        def __init__(self, group):
            self.rank, self.size, self._group = group.rank, group.size, group

        def exchange(self, arrays):
            return self._group.exchange(arrays)

        def start_all_to_all(self, chunks):
            events[threading.get_ident()].append("all-to-all")
            return self._group.start_all_to_all(chunks)

    fwd = ulysses.flash_attention_fwd

    def recorded(function, name):
        def call(q, *args, **kwargs):
            events[threading.get_ident()].append((name, q.shape[1], args[2], args[3]))
            return function(q, *args, **kwargs)

        return call

    monkeypatch.setattr(ulysses, "flash_attention_fwd", recorded(fwd, "forward"))
    size, heads, kv_heads, length = 2, 4, 4, 16
    full = [
        rng.standard_normal((1, h, length, 8), dtype=np.float32)
        for h in (heads, kv_heads, kv_heads)
    ]

    def rank(group, q, k, v):
        result = dist.ulysses_attention_fwd(
            q, k, v, heads, kv_heads, 8, True, group=Recording(group)
        )
        events[group.rank] = events.pop(threading.get_ident())
        return result

    shards = [tuple(dist.shard(x, "zigzag", r, size) for x in full) for r in range(size)]
    outs = dist.ThreadGroup(size).run(rank, shards)
    whole, _ = cuflash.flash_attention_fwd(*full, heads, kv_heads, 8, True)
    assert np.allclose(dist.gather([o[0] for o in outs], "zigzag"), whole, atol=1e-6)
    for r in range(size):
        # Both parts leave first; part 0's results leave before part 1's call.
        part = ("forward", 1, 1, 1)  # a dense call on half the heads
        assert events[r] == ["all-to-all"] * 2 + [part, "all-to-all"] * 2, events[r]


def test_hybrid_sinks_and_deterministic_bits(rng):
    """Sinks split with their heads over the sub-group and summed around the ring:
    dsinks the whole sequence's, the same bits on every rank and on a second run, equal
    to the ring's."""
    sinks = rng.standard_normal(4).astype(np.float32)
    seed = int(rng.integers(2**31))
    runs = [
        _ring(
            np.random.default_rng(seed),
            4,
            "zigzag",
            heads=4,
            kv_heads=2,
            chunk=4,
            deterministic=True,
            sinks=sinks,
            vjp_function=_hybrid(2),
        )[0]
        for _ in range(2)
    ]
    ring = _ring(
        np.random.default_rng(seed), 4, "zigzag", heads=4, kv_heads=2, chunk=4, sinks=sinks
    )
    for x, y in zip(runs[0][:5], runs[1][:5]):
        assert np.array_equal(x, y)
    for got, want in zip(runs[0][:5], ring[0][:5]):
        assert rel_error(got.astype(np.float64), want.astype(np.float64)) <= 1e-5
    per_rank = runs[0][5]
    assert all(np.array_equal(per_rank[0], d) for d in per_rank)
    assert rel_error(per_rank[0].astype(np.float64), ring[0][5][0].astype(np.float64)) <= 1e-5


def test_hybrid_groups_are_nodes_and_their_places():
    def rank(group):
        within, across = dist.hybrid_groups(group, 2)
        return (within.rank, within.size, within.members), (
            across.rank,
            across.size,
            across.members,
        )

    found = dist.ThreadGroup(6).run(rank, [()] * 6)
    assert found[3] == ((1, 2, (2, 3)), (1, 3, (1, 3, 5)))
    assert found[4] == ((0, 2, (4, 5)), (2, 3, (0, 2, 4)))


def test_default_ulysses_size_is_the_cost_models_choice():
    """Without ``ulysses_size`` the hybrid takes the cost model's fastest split that fits
    the group: within a node, dividing both head counts, rings over some of the ranks
    only where the group can send between any two."""

    class Group:
        rank = 0

        def __init__(self, size, local_size, send_recv=True):
            self.size, self.local_size = size, local_size
            if send_recv:
                self.start_send_recv = self.exchange = lambda *a: a

    def shard(size, heads=32, seq_len=131072):
        return types.SimpleNamespace(
            shape=(1, heads, seq_len // size, 128), dtype=np.dtype(np.float16), ndim=4
        )

    model = dist.cost_model
    for size, local in ((8, 8), (64, 8), (512, 8), (16, 4)):
        problem = model.Problem(seq_len=131072)
        want = model.best_ulysses_size(problem, size, model.Machine(gpus_per_node=local))
        assert dist.default_ulysses_size(Group(size, local), shard(size), 32, 8, 128, True) == want
        assert want <= local and 32 % want == 8 % want == 0
    # Across nodes the model keeps the all-to-all inside them (its docs' 8 x 8).
    assert dist.default_ulysses_size(Group(64, 8), shard(64), 32, 8, 128, True) == 8
    # Fewer KV heads than a node's GPUs: copies of them inside it.
    assert dist.default_ulysses_size(Group(64, 8), shard(64), 32, 1, 128, True) == 8
    # A ring exchange alone: the ring or Ulysses over all ranks, nothing between.
    assert dist.default_ulysses_size(Group(64, 8, False), shard(64), 32, 8, 128, True) == 1


def test_the_command_prints_the_slowest_rank_and_every_rank():
    """``python -m cuflash.distributed``'s tables from each rank's records: the slowest
    rank's times and memory, the largest error, FAILED where a rank failed."""
    from cuflash.distributed import __main__ as command

    def record(seq_len, scale, passed=True):
        timings = {
            key: scale * value
            for key, value in dict(
                single_fwd_ms=10.0,
                single_bwd_ms=30.0,
                cp_fwd_ms=5.5,
                cp_bwd_ms=16.0,
                kernels_only_fwd_ms=5.0,
                kernels_only_bwd_ms=15.0,
                transfer_kv_ms=0.5,
                transfer_dkdv_ms=1.0,
                single_peak_bytes=2.0**31,
                cp_peak_bytes=2.0**30,
            ).items()
        }
        errors = dict(out=1e-4 * scale, lse=1e-6, dq=2e-4, dk=3e-4, dv=4e-4, repeat=True)
        return dict(case=dict(seq_len=seq_len), timings=timings, errors=errors, passed=passed)

    per_rank = [[record(4096, 1.0)], [record(4096, 2.0, passed=False)]]
    slowest = command._table(per_rank, 2, "hybrid")
    assert slowest.startswith("hybrid attention on 2 GPU(s)")
    row = slowest.splitlines()[-1]
    assert row.startswith("| 4096 | 20.0 / 60.0 | 11.0 / 32.0 | 0.550 / 0.533 |"), row
    assert "| 4.00 / 2.00 | 4.0e-04 FAILED |" in row, row
    ranks = command._rank_table(per_rank, "hybrid").splitlines()
    assert ranks[-2].startswith("| 0 | 4096 | 10.0 / 30.0 | 5.5 / 16.0 | 2.00 / 1.00 |")
    assert ranks[-1].endswith("| 2.0e-04 / 1.0e-06 / 2.0e-04 / 3.0e-04 / 4.0e-04 |")


def test_the_ring_keeps_no_finished_pair_results(monkeypatch, rng):
    """Memory: when a dense call starts, no earlier call's output (forward) or dQ
    (backward) is still held, nor an earlier step's dK and dV (a step's own wait in its
    list for the shard's accumulators, which travel meanwhile)."""
    from cuflash.distributed import ring

    held = collections.defaultdict(list)  # thread -> (step, kind, weak reference)
    step_of = {}
    pairs = ring._Schedule.pairs

    def counted_pairs(self, step):
        step_of[threading.get_ident()] = step
        return pairs(self, step)

    def check_and_track(function, kinds):
        def call(*args, **kwargs):
            me, step = threading.get_ident(), step_of[threading.get_ident()]
            for made, kind, ref in held[me]:
                alive = ref() is not None
                assert not (alive and (kind in ("out", "dq") or made < step)), (kind, made, step)
            results = function(*args, **kwargs)
            held[me] += [(step, kind, weakref.ref(x)) for kind, x in zip(kinds, results)]
            return results

        return call

    monkeypatch.setattr(ring._Schedule, "pairs", counted_pairs)
    monkeypatch.setattr(
        ring, "flash_attention_fwd", check_and_track(ring.flash_attention_fwd, ("out",))
    )
    monkeypatch.setattr(
        ring, "flash_attention_bwd", check_and_track(ring.flash_attention_bwd, ("dq", "dk", "dv"))
    )
    for layout in dist.LAYOUTS:
        _check(rng, 3, layout, causal=False, window=(9, 5), heads=2, kv_heads=1, chunk=5)
    assert sum(len(h) for h in held.values()) > 3 * 3 * 4  # every rank, every step


def test_the_memory_script_counts_a_ranks_share(capsys):
    """``scripts/context_memory.py`` on the CPU: every mode's share of a rank is below
    the single call's peak, and the ring's falls with more ranks."""
    spec = importlib.util.spec_from_file_location(
        "context_memory", pathlib.Path(__file__).parents[1] / "scripts" / "context_memory.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    shares = {}
    for ranks in (2, 4):
        script.main(
            ["--seq-len", "512", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
            + ["--dtype", "float32", "--ranks", str(ranks), "--ulysses-size", "2"]
        )
        rows = [line.split("|") for line in capsys.readouterr().out.splitlines()[3:]]
        shares[ranks] = {row[1].strip(): float(row[4]) for row in rows}
        assert set(shares[ranks]) == {"ring", "ulysses", "hybrid"}
        assert all(0 < share < 1 for share in shares[ranks].values()), shares
    assert shares[4]["ring"] < shares[2]["ring"]


@pytest.mark.parametrize("native", [True, False])
def test_all_to_all_delivers_each_chunk_once(native, rng):
    """The groups' own all-to-all and the ring-exchange fallback: chunk ``j`` of rank
    ``r`` arrives at rank ``j`` as ``received[r]``."""
    size = 4
    sent = rng.standard_normal((size, size, 3))

    def rank(group):
        chunks = [(sent[group.rank, j],) for j in range(size)]
        via = group if native else _RingOnly(group)
        return dist.all_to_all(via, chunks)

    class _RingOnly:
        def __init__(self, group):
            self.rank, self.size, self.exchange = group.rank, group.size, group.exchange

    for r, received in enumerate(dist.ThreadGroup(size).run(rank, [()] * size)):
        for j in range(size):
            assert np.array_equal(received[j][0], sent[j, r])


def test_a_rank_that_returns_early_does_not_hang_the_others():
    def rank(group):
        if group.rank == 0:
            return None  # exchanges nothing
        return group.exchange((np.ones(2),))

    with pytest.raises(RuntimeError, match="rank 1 waits for arrays from rank 0, which has"):
        dist.ThreadGroup(2).run(rank, [()] * 2)


def test_a_failing_rank_does_not_hang_the_others():
    def rank(group):
        if group.rank == 1:
            raise ValueError("rank 1 fails")
        return group.exchange((np.ones(2),))

    with pytest.raises(ValueError, match="rank 1 fails"):
        dist.ThreadGroup(3).run(rank, [()] * 3)


def test_shard_and_gather_are_inverse(rng):
    x = rng.standard_normal((2, 3, 24, 4))
    for layout, size in itertools.product(dist.LAYOUTS, (1, 2, 3, 4)):
        shards = [dist.shard(x, layout, r, size) for r in range(size)]
        assert np.array_equal(dist.gather(shards, layout), x)
    # zigzag: rank 0 of 2 holds chunks 0 and 3 of 4
    assert np.array_equal(
        dist.shard(x, "zigzag", 0, 2), np.concatenate([x[:, :, 0:6], x[:, :, 18:24]], axis=2)
    )


@pytest.mark.parametrize(
    "left, right", [(-1, -1), (-1, 0), (4, 0), (0, 0), (3, 7), (-1, 5), (12, -1), (2, 1)]
)
def test_pair_call_is_the_visible_key_rule(left, right):
    """Every (query chunk, key chunk) pair of a 5-chunk sequence: the keys the dense call
    sees (its rows and keys, its window, bottom-right) are the whole sequence's."""
    chunk, count = 5, 5
    total = chunk * count
    rule = np.broadcast_to(
        visible_keys(np.arange(total), np.arange(total), total, total, left, right), (total, total)
    )
    for a, c in itertools.product(range(count), repeat=2):
        q_seg = dist.Segment(a * chunk, chunk, 0)
        k_seg = dist.Segment(c * chunk, chunk, 0)
        want = rule[a * chunk : (a + 1) * chunk, c * chunk : (c + 1) * chunk]
        call = dist.pair_call(q_seg, k_seg, left, right)
        got = np.zeros((chunk, chunk), dtype=bool)
        if call is not None:
            got[: call.rows, : call.keys] = visible_keys(
                np.arange(call.rows), np.arange(call.keys), call.rows, call.keys, *call.window
            )
        assert np.array_equal(got, want), (a, c, call)
        assert call is None or want.any(), (a, c, call)  # empty pairs are skipped


@pytest.mark.parametrize(
    "window", [(-1, -1), (-1, 0), (7, 0), (0, 0), (5, 9), (-1, 6), (15, -1), (3, 2), (30, 0)]
)
@pytest.mark.parametrize("layout", dist.LAYOUTS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_step_calls_cover_each_visible_key_once(size, layout, window):
    """The calls of every rank and step, placed at their rows and keys and mapped back
    to positions of the whole sequence, see each visible (query, key) exactly once and
    nothing else; a causal zigzag step is at most two calls."""
    chunk = 5
    shard_length = chunk * (dist.chunk_count(layout, size) // size)
    total = shard_length * size
    rule = np.broadcast_to(
        visible_keys(np.arange(total), np.arange(total), total, total, *window), (total, total)
    )
    seen = np.zeros((total, total), dtype=int)

    def positions(segs):
        return np.concatenate([np.arange(s.start, s.start + s.length) for s in segs])

    for rank in range(size):
        q_segs = dist.segments(layout, rank, size, shard_length)
        for step in range(size):
            owner = (rank - step) % size
            k_segs = dist.segments(layout, owner, size, shard_length)
            calls = dist.step_calls(q_segs, k_segs, *window)
            if layout == "zigzag" and window == (-1, 0):
                assert len(calls) <= 2, calls
            for row0, key0, call in calls:
                mask = np.broadcast_to(
                    visible_keys(
                        np.arange(call.rows),
                        np.arange(call.keys),
                        call.rows,
                        call.keys,
                        *call.window,
                    ),
                    (call.rows, call.keys),
                )
                rows = positions(q_segs)[row0 : row0 + call.rows]
                keys = positions(k_segs)[key0 : key0 + call.keys]
                seen[np.ix_(rows, keys)] += mask
    assert np.array_equal(seen, rule.astype(int))


def _bad_calls():
    q = np.zeros((1, 2, 8, 16), np.float32)
    q8 = np.zeros((1, 8, 8, 16), np.float32)

    class One:
        rank, size = 0, 1

        def exchange(self, obj):
            return obj

    class Ring:  # a ring exchange only, no point-to-point
        rank = 0

        def __init__(self, size):
            self.size = size

        def exchange(self, obj):
            return obj

    def fwd(q=q, k=q, v=q, group=One(), layout="zigzag"):
        return lambda: dist.ring_attention_fwd(q, k, v, 2, 2, 16, True, group=group, layout=layout)

    return [
        (fwd(layout="ring"), "layout: expected one of ('contiguous', 'zigzag'), got 'ring'"),
        (
            fwd(group=object()),
            "group: expected a process group with rank, size and exchange(), got object",
        ),
        (
            fwd(k=q[:, :, :6], v=q[:, :, :6]),
            "k: shard length 6 differs from q's 8: ring "
            "attention is self-attention over one sequence",
        ),
        (
            fwd(q=q[:, :, :7], k=q[:, :, :7], v=q[:, :, :7]),
            "q: shard length 7 is not a multiple of the 2 chunks a rank holds in the zigzag layout",
        ),
        (
            lambda: dist.shard(np.zeros((1, 1, 10, 4)), "zigzag", 0, 2),
            "x: sequence length 10 is not a multiple of the 4 chunks of the zigzag layout over 2 "
            "ranks",
        ),
        (lambda: dist.ThreadGroup(0), "size: expected an int >= 1, got 0"),
        (
            lambda: dist.hybrid_groups(Ring(4), 3),
            "ulysses_size: expected a divisor of the group's size 4, got 3",
        ),
        (
            lambda: dist.hybrid_groups(Ring(4), 2),
            "group: Ring has no start_send_recv(arrays, to, source): it cannot run a ring "
            "over some of its ranks",
        ),
        (
            lambda: dist.hybrid_attention_fwd(
                q8, q8[:, :3], q8[:, :3], 8, 3, 16, group=Ring(4), ulysses_size=4
            ),
            "num_kv_heads: 3 KV heads neither split over the 4 ranks of an all-to-all nor "
            "divide them (a multiple of the Ulysses group's size, each rank a group of KV "
            "heads, or a divisor, each KV head copied to size / num_kv_heads ranks)",
        ),
    ]


@pytest.mark.parametrize("index", range(9))
def test_bad_input_is_rejected(index):
    call, message = _bad_calls()[index]
    with pytest.raises(cuflash.InvalidArgumentError) as info:
        call()
    assert str(info.value) == message


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", dist.LAYOUTS)
@pytest.mark.parametrize("size", [1, 3])
def test_ring_on_one_gpu_matches_oracle(size, layout, dtype, rng, poisoned):
    """Virtual ranks on one GPU: the flash kernels and the merge kernel on the ring."""
    import cupy

    _check(rng, size, layout, dtype=dtype, chunk=70, head_dim=64, xp=cupy)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("size, ulysses_size", [(2, 2), (4, 2)])
def test_ulysses_and_hybrid_on_one_gpu_match_oracle(size, ulysses_size, dtype, rng, poisoned):
    """Virtual ranks on one GPU: the all-to-all over CuPy arrays, the ring across."""
    import cupy

    _check(
        rng,
        size,
        "zigzag",
        dtype=dtype,
        chunk=70,
        head_dim=64,
        heads=4,
        kv_heads=2,
        xp=cupy,
        vjp_function=_hybrid(ulysses_size),
    )


@pytest.mark.gpu
def test_thread_group_ranks_launch_on_the_callers_device(rng):
    """Each virtual rank's thread launches on the caller's device without an allocation of
    its own first (its outputs come from the pool's cache): the copy engine's tensor maps
    and the launch need the device's context current in that thread."""
    import cupy

    q, k, v = (
        cupy.asarray(rng.standard_normal((1, 4, 2048, 128)).astype(DTYPES["bfloat16"]))
        for _ in range(3)
    )
    want = cuflash.flash_attention_fwd(q, k, v, 4, 4, 128, True)  # (out, lse)
    spare = [cupy.empty_like(x) for x in want for _ in range(4)]
    del spare  # back to the pool: the ranks' outputs need no new allocation
    cupy.cuda.Device().synchronize()

    def rank(group):
        return cuflash.flash_attention_fwd(q, k, v, 4, 4, 128, True)

    for got in dist.ThreadGroup(2).run(rank, [(), ()]):
        assert all(bool(cupy.array_equal(x, y)) for x, y in zip(got, want, strict=True))


# ------------------------------------------------------------------ two GPUs over NCCL


def _gpu_count():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy, no driver
        return 0


def _nccl_cases():
    from cuflash.distributed.demo import RingCase

    small = dict(seq_len=600, heads=4, kv_heads=2, head_dim=64)  # chunks of 150 rows
    cases = [
        RingCase(**small, causal=causal, layout=layout, dtype=dtype)
        for dtype in ("bfloat16", "float16", "float32")
        for layout in dist.LAYOUTS
        for causal in (True, False)
    ]
    cases += [
        RingCase(**small, causal=False, window=(100, 40), dtype="bfloat16"),
        RingCase(**small, causal=True, window=(170, 0), layout="contiguous", dtype="float16"),
        RingCase(**small, causal=True, window=(5, 0), dtype="float32"),
        RingCase(seq_len=1040, heads=8, kv_heads=1, head_dim=128, dtype="bfloat16"),  # MQA
        RingCase(
            seq_len=520,
            heads=6,
            kv_heads=3,
            head_dim=40,
            dtype="float16",
            batch=2,
            softmax_scale=0.3,
        ),
        RingCase(seq_len=520, heads=2, kv_heads=2, head_dim=256, dtype="float32"),
        RingCase(
            seq_len=2048, heads=8, kv_heads=2, head_dim=128, dtype="bfloat16", deterministic=True
        ),
        RingCase(**small, causal=False, dtype="float32", deterministic=True),
    ]
    cases += [  # the all-to-all over NCCL: Ulysses, and the hybrid at either end
        RingCase(**small, causal=causal, dtype=dtype, mode=mode, ulysses_size=size)
        for mode, size in (("ulysses", None), ("hybrid", 2), ("hybrid", 1))
        for dtype, causal in (("bfloat16", True), ("float32", False))
    ]
    cases += [
        RingCase(**small, window=(100, 40), layout="contiguous", dtype="float16", mode="ulysses"),
        RingCase(**small, dtype="bfloat16", deterministic=True, mode="ulysses"),
        RingCase(seq_len=1040, heads=8, kv_heads=1, head_dim=128, mode="ulysses"),  # MQA
    ]
    return cases


NCCL_CASES = _nccl_cases() if _gpu_count() >= 2 else []


@pytest.fixture(scope="module")
def nccl_errors():
    from cuflash.distributed import demo

    if _gpu_count() < 2:
        pytest.skip("ring attention over NCCL needs two GPUs")
    return demo.launch(demo.check_cases, 2, NCCL_CASES)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(NCCL_CASES)) if NCCL_CASES else [0])
def test_ring_over_nccl_matches_one_gpu(nccl_errors, index):
    """Each rank's shard of the ring's out, lse, dQ, dK, dV against the single-GPU call
    on the whole sequence; deterministic cases give the same bits twice."""
    from cuflash.distributed.demo import case_passes

    case = NCCL_CASES[index]
    for rank, errors in enumerate(nccl_errors):
        assert case_passes(case, errors[index]), (str(case), rank, errors[index])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_demo_runs_on_every_gpu(mode):
    """``python -m cuflash.distributed`` checks and times a small case on every GPU."""
    import subprocess
    import sys

    if _gpu_count() < 2:
        pytest.skip("the demo's ring needs two GPUs")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cuflash.distributed",
            "--seq-lens",
            "4096",
            "--heads",
            "8",
            "--kv-heads",
            "2",
            "--repeats",
            "2",
            "--mode",
            mode,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| 4096 |" in done.stdout and "FAILED" not in done.stdout, done.stdout
    assert done.stdout.startswith(f"{mode} attention on"), done.stdout


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_merge_kernel_compiles_without_spills(arch):
    from cuflash.gpu import registry, standalone

    merge = standalone.STANDALONE["ring_merge"]
    compile_and_check([merge.name_expression(dtype=dtype) for dtype in registry.CXX_TYPES], arch)
