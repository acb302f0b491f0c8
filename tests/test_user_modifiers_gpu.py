"""User-defined score and mask functions (the semantics page, section 'User-defined
score and mask functions') compiled into the GPU kernels, with and without a block mask,
forward and backward (atomic and deterministic), against the float64 oracle: the docs'
examples (documents packed in one sequence, prefix-LM, chunked local attention), a
random mask with rows that see nothing, a learned relative bias with a document mask;
the block mask's classification against its NumPy twin; the errors. GPU tests are
marked gpu; the block mask's CPU side runs in CI."""

import numpy as np
import pytest
from support import DTYPES, FLOOR, compile_and_check, cupy, rel_error, to_numpy

import cuflash
from cuflash import dispatch, modifiers
from cuflash.block_mask import EMPTY, FULL, PARTIAL, create_block_mask
from cuflash.errors import InvalidArgumentError
from cuflash.reference import attention_reference, attention_reference_grad

BOUND = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}
DOCUMENT_LENGTHS = (300, 40, 200, 100)  # 640 tokens: tiles of 128 empty, full and cut


def _documents(xp, lengths=DOCUMENT_LENGTHS):
    ids = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    return xp.asarray(ids)


def _mask_cases(xp, rng, heads, q_len, kv_len):
    """name -> (score_mod, mask_mod, batch and heads of its block mask)."""
    documents = modifiers.and_masks(
        modifiers.document_mask(_documents(xp)), modifiers.causal_mask()
    )
    table = rng.random((heads, q_len, kv_len)) < 0.3
    table[:, ::7] = False  # rows that see nothing
    table = xp.asarray(table)

    def random_pattern(b, h, q_idx, kv_idx):
        return table[h, q_idx, kv_idx]

    bias = xp.asarray(rng.uniform(-1, 1, (heads, 2 * 255 + 1)).astype(np.float32))
    return {
        "documents": (None, documents, (None, None)),
        "prefix_lm": (None, modifiers.prefix_lm_mask(200), (None, None)),
        "chunked": (None, modifiers.chunked_mask(128), (None, None)),
        "random": (None, modifiers.MaskMod(random_pattern), (None, heads)),
        "bias_documents": (modifiers.relative_bias_score(bias), documents, (None, None)),
    }


def _run(
    rng,
    name,
    dtype="bfloat16",
    head_dim=128,
    batch=2,
    heads=4,
    kv_heads=2,
    q_len=640,
    kv_len=640,
    use_block_mask=True,
    deterministic=False,
):
    """Forward and backward on the GPU with case ``name``, against the oracle."""
    score_mod, mask_mod, (mask_batch, mask_heads) = _mask_cases(cupy, rng, heads, q_len, kv_len)[
        name
    ]
    host = [
        rng.standard_normal((batch, h, n, head_dim)).astype(DTYPES[dtype])
        for h, n in ((heads, q_len), (kv_heads, kv_len), (kv_heads, kv_len), (heads, q_len))
    ]
    q, k, v, dout = (cupy.asarray(x) for x in host)
    given = dict(score_mod=score_mod)
    if use_block_mask:
        given["block_mask"] = create_block_mask(mask_mod, mask_batch, mask_heads, q_len, kv_len)
    else:
        given["mask_mod"] = mask_mod
    args = (heads, kv_heads, head_dim)
    out, lse = cuflash.flash_attention_fwd(q, k, v, *args, **given)
    grads = cuflash.flash_attention_bwd(
        dout, q, k, v, out, lse, *args, **given, deterministic=deterministic
    )
    h64 = [x.astype(np.float64) for x in host]
    ref = dict(score_mod=score_mod, mask_mod=mask_mod)
    ref_out, ref_lse = attention_reference(*h64[:3], False, 0, **ref)
    ref_grads = attention_reference_grad(h64[3], *h64[:3], False, 0, **ref)
    for label, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        got = to_numpy(got).astype(np.float64)
        assert not np.isnan(got).any(), label
        err = rel_error(got, want)
        assert err <= BOUND[dtype] + FLOOR[dtype], (label, err)
    dead = np.isneginf(ref_lse)
    got_lse = to_numpy(lse)
    assert np.array_equal(np.isneginf(got_lse), dead)
    assert np.allclose(got_lse[~dead], ref_lse[~dead], atol=2e-3)
    assert np.all(to_numpy(out)[dead] == 0) and np.all(to_numpy(grads[0])[dead] == 0)
    return dead.any()


CASES = ["documents", "prefix_lm", "chunked", "random", "bias_documents"]


@pytest.fixture(scope="module")
def compiled():
    """The kernels of every case, compiled in parallel threads before the tests."""
    from cuflash import precompile

    rng = np.random.default_rng(0)
    for score_mod, mask_mod, _ in _mask_cases(cupy, rng, 4, 640, 640).values():
        precompile.precompile_modifiers(score_mod, mask_mod, ("bfloat16",), (128,))
    documents = _mask_cases(cupy, rng, 4, 640, 640)["documents"][1]
    precompile.precompile_modifiers(None, documents, ("float16", "float32"), (64,))


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("use_block_mask", [True, False])
@pytest.mark.parametrize("name", CASES)
def test_gpu_matches_oracle(name, use_block_mask, deterministic, rng, poisoned, compiled):
    saw_dead_rows = _run(rng, name, use_block_mask=use_block_mask, deterministic=deterministic)
    assert saw_dead_rows == (name == "random")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_other_dtypes(dtype, rng, poisoned, compiled):
    """float16 on the wgmma kernels at D = 64; float32 on the general kernels."""
    for deterministic in (False, True):
        _run(rng, "documents", dtype=dtype, head_dim=64, deterministic=deterministic)


@pytest.mark.gpu
def test_gpu_mma_sync_kernels(rng, poisoned, compiled):
    """The kernels before Hopper read the block mask too."""
    with dispatch.skip_kernels(
        "forward_wgmma_ws", "forward_wgmma", "backward_wgmma_ws", "backward_wgmma"
    ):
        for deterministic in (False, True):
            _run(rng, "documents", head_dim=128, deterministic=deterministic)


@pytest.mark.gpu
def test_gpu_rectangular_and_batched(rng, poisoned, compiled):
    """q_len != kv_len, a mask that reads b (classified per batch entry), GQA."""
    doc_q = cupy.asarray(rng.integers(0, 3, (2, 200)).astype(np.int32))
    doc_k = cupy.asarray(rng.integers(0, 3, (2, 520)).astype(np.int32))
    doc_q.sort(axis=1)
    doc_k.sort(axis=1)
    mask = modifiers.document_mask(doc_q, doc_k)
    block_mask = create_block_mask(mask, 2, None, 200, 520)
    host = [
        rng.standard_normal((2, h, n, 64)).astype(np.float16)
        for h, n in ((4, 200), (1, 520), (1, 520), (4, 200))
    ]
    q, k, v, dout = (cupy.asarray(x) for x in host)
    out, lse = cuflash.flash_attention_fwd(q, k, v, 4, 1, 64, block_mask=block_mask)
    grads = cuflash.flash_attention_bwd(dout, q, k, v, out, lse, 4, 1, 64, block_mask=block_mask)
    h64 = [x.astype(np.float64) for x in host]
    ref_out, _ = attention_reference(*h64[:3], False, 0, mask_mod=mask)
    ref_grads = attention_reference_grad(h64[3], *h64[:3], False, 0, mask_mod=mask)
    for got, want in zip((out, *grads), (ref_out, *ref_grads)):
        assert rel_error(to_numpy(got).astype(np.float64), want) <= BOUND["float16"] + 2e-4


@pytest.mark.gpu
def test_gpu_classification_matches_numpy(rng):
    for name, (_, mask_mod, (batch, heads)) in _mask_cases(cupy, rng, 4, 640, 600).items():
        block_mask = create_block_mask(mask_mod, batch, heads, 640, 600)
        for rows, keys in ((128, 128), (64, 128), (16, 48)):
            got = cupy.asnumpy(block_mask.classes(rows, keys))
            assert np.array_equal(got, block_mask.cpu_classes(rows, keys)), (name, rows, keys)


@pytest.mark.gpu
def test_gpu_errors(rng):
    q = cupy.asarray(rng.standard_normal((1, 2, 64, 64)).astype(np.float16))
    host_ids = _documents(np, (30, 34))
    with pytest.raises(
        InvalidArgumentError,
        match="array query_ids is a numpy array; the GPU kernels need a cupy array",
    ):
        cuflash.flash_attention_fwd(q, q, q, 2, 2, 64, mask_mod=modifiers.document_mask(host_ids))
    block_mask = create_block_mask(modifiers.causal_mask(), None, None, 64, 80)
    with pytest.raises(
        InvalidArgumentError, match="block_mask: made for kv_len=80, the call has kv_len=64"
    ):
        cuflash.flash_attention_fwd(q, q, q, 2, 2, 64, block_mask=block_mask)


# ------------------------------------------------------------------ CPU side (CI)


def test_cpu_classes_follow_the_definition(rng):
    """Each tile's class is what its elements say (empty, full, partial)."""
    for name, (_, mask_mod, (batch, heads)) in _mask_cases(np, rng, 2, 100, 90).items():
        block_mask = create_block_mask(mask_mod, batch, heads, 100, 90)
        visible = mask_mod.numpy_mask(*modifiers.index_grids(1, heads or 1, 100, 90))
        classes = block_mask.cpu_classes(32, 16)
        for i in range(classes.shape[2]):
            for j in range(classes.shape[3]):
                tile = visible[..., 32 * i : 32 * i + 32, 16 * j : 16 * j + 16]
                want = [EMPTY if not t.any() else FULL if t.all() else PARTIAL for t in tile[0]]
                assert list(classes[0, :, i, j]) == want, (name, i, j)


def test_cpu_path_takes_the_block_masks_function(rng):
    mask = modifiers.prefix_lm_mask(20)
    block_mask = create_block_mask(mask, None, None, 50, 50)
    q, k, v = (rng.standard_normal((1, 2, 50, 16)).astype(np.float32) for _ in range(3))
    with_block = cuflash.flash_attention_fwd(q, k, v, 2, 2, 16, block_mask=block_mask)
    with_mask = cuflash.flash_attention_fwd(q, k, v, 2, 2, 16, mask_mod=mask)
    assert np.array_equal(with_block[0], with_mask[0])
    ref, _ = attention_reference(
        *(x.astype(np.float64) for x in (q, k, v)), False, 0, mask_mod=mask
    )
    assert rel_error(with_block[0], ref) < 1e-5


@pytest.mark.parametrize(
    "make, problem",
    [
        (
            lambda: create_block_mask(modifiers.prefix_lm_mask(3), None, None, 0, 5),
            "q_len: expected a positive int or None, got 0",
        ),
        (
            lambda: create_block_mask(modifiers.prefix_lm_mask(3), None, None, None, 5),
            "q_len: q_len and kv_len must be given",
        ),
        (
            lambda: create_block_mask(modifiers.softcap_score(2.0), None, None, 5, 5),
            "mask_mod: expected a cuflash.modifiers.MaskMod, got ScoreMod",
        ),
        (
            lambda: create_block_mask(
                modifiers.document_mask(np.zeros((2, 5), np.int32)), None, None, 5, 5
            ),
            "batch: .* reads b: give the calls' batch",
        ),
        (
            lambda: create_block_mask(
                modifiers.document_mask(np.zeros(5, np.int32)), None, None, 6, 6
            ),
            "indices never wrap",
        ),
    ],
)
def test_block_mask_errors(make, problem):
    with pytest.raises(InvalidArgumentError, match=problem):
        make()


def test_call_errors_with_block_masks(rng):
    q = rng.standard_normal((2, 2, 8, 16)).astype(np.float32)
    mask = modifiers.prefix_lm_mask(3)
    block_mask = create_block_mask(mask, 3, None, 8, 8)
    with pytest.raises(
        InvalidArgumentError, match="block_mask: made for batch=3, the call has batch=2"
    ):
        cuflash.flash_attention_fwd(q, q, q, 2, 2, 16, block_mask=block_mask)
    block_mask = create_block_mask(mask, None, None, 8, 8)
    with pytest.raises(
        InvalidArgumentError, match="mask_mod: give the mask through block_mask only"
    ):
        cuflash.flash_attention_fwd(
            q, q, q, 2, 2, 16, block_mask=block_mask, mask_mod=modifiers.prefix_lm_mask(3)
        )
    with pytest.raises(
        InvalidArgumentError, match="block_mask: expected a cuflash.block_mask.BlockMask"
    ):
        cuflash.flash_attention_fwd(q, q, q, 2, 2, 16, block_mask=mask)


@pytest.mark.parametrize(
    "dtype, head_dim, arch, with_score",
    [
        ("bfloat16", 128, "sm_90a", True),
        ("float16", 64, "sm_90a", False),
        ("bfloat16", 96, "sm_90a", False),
        ("bfloat16", 128, "sm_80", False),
        ("float32", 64, "sm_90a", True),
        ("bfloat16", 192, "sm_90a", True),
    ],
)
def test_kernels_with_user_functors_compile(dtype, head_dim, arch, with_score, rng):
    """The kernels a call with user modifiers launches, with a document mask and a
    relative bias compiled in (mask-only without the bias: the warp-specialized backward's
    mask roles): NVRTC for the arch, no spills, and the wgmma kernels still issue HGMMA;
    the block mask's classification kernel."""
    from cuflash import precompile
    from cuflash.gpu import kernel_build, registry, standalone

    score_mod, mask_mod, _ = _mask_cases(np, rng, 4, 640, 640)["bias_documents"]
    functors = kernel_build.UserFunctors.of(score_mod if with_score else None, mask_mod)
    capability = 90 if arch == "sm_90a" else 80
    variant = kernel_build.Variant(DTYPES[dtype], head_dim, capability)
    jobs = precompile.modifier_jobs(
        [dtype], [head_dim], capability, capability, mask_only=not with_score
    )
    roles = sorted({role for _, role in jobs})
    names = variant.kernel_names(with_masks=True)
    report = compile_and_check(
        [names[r] for r in roles], arch, functors, source_file=kernel_build.MODULE_FILE
    )
    assert len(report) == len(roles)
    if arch == "sm_90a" and dtype != "float32":
        from cuflash.gpu.kernel_build import compile_offline

        compiled = compile_offline(variant, arch, [r for r in roles if "wgmma" in r], functors)
        try:
            opcodes = compiled.sass_opcodes()
        except RuntimeError as exc:  # no cuobjdump for this NVRTC
            pytest.skip(str(exc))
        assert all(ops["HGMMA"] > 0 for ops in opcodes.values()), opcodes
        assert all(registry.BY_ROLE[r].needs_sm90a for r in opcodes)
    compile_and_check(
        [standalone.STANDALONE["classify_mask_cells"].name_expression()],
        arch,
        kernel_build.UserFunctors.of(mask_mod=mask_mod),
    )


# ------------------------------------------------------------ packed batches (varlen)

VARLEN_Q, VARLEN_K = [37, 0, 90, 12], [50, 8, 90, 30]
# sequences past a kernel's tiles, so that a block mask empties some of each one's
BLOCK_Q, BLOCK_K = [300, 0, 45, 410], [300, 8, 60, 410]


def _varlen_case(rng, xp, dtype=np.float32, head_dim=16, lengths=(VARLEN_Q, VARLEN_K)):
    """Packed sequences with user modifiers that read the sequence index ``b``: a prefix
    length and a bias per (sequence, head); and the per-sequence oracle."""
    lengths_q, lengths_k = lengths
    heads, kv_heads = 4, 2
    prefixes = np.array([5, 3, 20, 0], np.int32)
    bias = rng.uniform(-1, 1, (len(lengths_q), heads)).astype(np.float32)
    device_bias = xp.asarray(bias)

    def per_sequence_bias(score, b, h, q_idx, kv_idx):
        return score + device_bias[b, h]

    mods = dict(
        score_mod=modifiers.ScoreMod(per_sequence_bias),
        mask_mod=modifiers.prefix_lm_mask(xp.asarray(prefixes)),
    )
    tokens = [
        rng.standard_normal((sum(n), h, head_dim)).astype(dtype)
        for n, h in (
            (lengths_q, heads),
            (lengths_k, kv_heads),
            (lengths_k, kv_heads),
            (lengths_q, heads),
        )
    ]
    cu = [
        xp.asarray(np.concatenate([[0], np.cumsum(n)]).astype(np.int32))
        for n in (lengths_q, lengths_k)
    ]
    args = (*cu, max(lengths_q), max(lengths_k), heads, kv_heads, head_dim)

    def oracle():
        outs, grads = [], [[], [], []]
        q_at, k_at = np.cumsum([0] + lengths_q), np.cumsum([0] + lengths_k)
        for b in range(len(lengths_q)):

            def bias_b(score, b_, h, q_idx, kv_idx):
                return score + row[h]

            ref = dict(
                score_mod=modifiers.ScoreMod(bias_b, row=bias[b]),
                mask_mod=modifiers.prefix_lm_mask(int(prefixes[b])),
            )
            q, k, v, dout = (
                x[lo:hi].transpose(1, 0, 2)[None].astype(np.float64)
                for x, lo, hi in zip(
                    tokens,
                    (q_at[b], k_at[b], k_at[b], q_at[b]),
                    (q_at[b + 1], k_at[b + 1], k_at[b + 1], q_at[b + 1]),
                )
            )
            outs.append(attention_reference(q, k, v, False, 0, **ref)[0][0].transpose(1, 0, 2))
            for i, g in enumerate(attention_reference_grad(dout, q, k, v, False, 0, **ref)):
                grads[i].append(g[0].transpose(1, 0, 2))
        return np.concatenate(outs), [np.concatenate(g) for g in grads]

    return [xp.asarray(x) for x in tokens], args, mods, oracle


def _check_varlen(rng, xp, dtype=np.float32, deterministic=False, block=False):
    """The packed case against its oracle; ``block``: longer sequences, the mask given
    as a block mask made for the sequences' count and longest lengths."""
    lengths = (BLOCK_Q, BLOCK_K) if block else (VARLEN_Q, VARLEN_K)
    (q, k, v, dout), args, mods, oracle = _varlen_case(rng, xp, dtype, lengths=lengths)
    if block:
        rows, keys = max(lengths[0]), max(lengths[1])
        mask_mod = mods.pop("mask_mod")
        mods["block_mask"] = create_block_mask(mask_mod, len(lengths[0]), None, rows, keys)
    out, lse = cuflash.flash_attention_varlen_fwd(q, k, v, *args, **mods)
    grads = cuflash.flash_attention_varlen_bwd(
        dout, q, k, v, out, lse, *args, **mods, deterministic=deterministic
    )
    ref_out, ref_grads = oracle()
    name = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}.get(
        np.dtype(dtype), "bfloat16"
    )
    for label, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        got = to_numpy(got).astype(np.float64)
        assert not np.isnan(got).any(), label
        assert rel_error(got, want) <= BOUND[name] + FLOOR[name], (label, rel_error(got, want))


def test_varlen_cpu_path_sees_the_sequence_index(rng):
    _check_varlen(rng, np)


def test_varlen_cpu_path_takes_a_block_mask(rng):
    _check_varlen(rng, np, block=True)


def test_varlen_block_mask_is_made_for_the_sequences(rng):
    """A packed call's block mask is made for (sequences, heads, longest lengths), and
    holds the call's mask function."""
    (q, k, v, _), args, mods, _ = _varlen_case(rng, np)
    count, rows, keys = len(VARLEN_Q), max(VARLEN_Q), max(VARLEN_K)
    mask_mod = mods.pop("mask_mod")
    for sizes, name in (
        ((count - 1, None, rows, keys), "batch"),
        ((count, None, rows + 1, keys), "q_len"),
        ((count, None, rows, sum(VARLEN_K)), "kv_len"),
    ):
        wrong = create_block_mask(mask_mod, *sizes)
        with pytest.raises(InvalidArgumentError, match=f"block_mask.*{name}"):
            cuflash.flash_attention_varlen_fwd(q, k, v, *args, block_mask=wrong, **mods)
    block_mask = create_block_mask(mask_mod, count, None, rows, keys)
    with pytest.raises(InvalidArgumentError, match="mask_mod"):
        cuflash.flash_attention_varlen_fwd(
            q, k, v, *args, block_mask=block_mask, mask_mod=modifiers.causal_mask(), **mods
        )


@pytest.fixture(scope="module")
def compiled_varlen():
    """The packed cases' kernels, compiled in parallel threads before the tests."""
    from cuflash import precompile

    _, _, mods, _ = _varlen_case(np.random.default_rng(0), cupy)
    precompile.precompile_modifiers(
        mods["score_mod"], mods["mask_mod"], ("bfloat16", "float32"), (16,)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_varlen_sees_the_sequence_index(dtype, deterministic, rng, poisoned, compiled_varlen):
    _check_varlen(rng, cupy, DTYPES[dtype], deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_varlen_takes_a_block_mask(dtype, deterministic, rng, poisoned, compiled_varlen):
    """The kernels read the block mask's tiles of each sequence (blockIdx.z) from the
    sequence's first row and key."""
    _check_varlen(rng, cupy, DTYPES[dtype], deterministic, block=True)


# ------------------------------------------------------------ KV cache


def _kvcache_cases():
    from test_kvcache import KVCase

    return [
        # decoding: the CUDA-core kernel (float32), the tensor-core one (bfloat16)
        KVCase(dtype="float32", batch=3, capacity=80),
        KVCase(dtype="bfloat16", new_len=1, head_dim=64),
        # speculative rows with appends, paged, GQA
        KVCase(
            dtype="float16",
            new_len=4,
            q_len=4,
            head_dim=128,
            heads=8,
            kv_heads=2,
            block_size=16,
            capacity=96,
        ),
        # with the built-ins too (the modified kernels with the user's functions)
        KVCase(dtype="bfloat16", new_len=3, q_len=3, softcap=3.0, alibi="batch"),
        # a long chunk on a contiguous cache with an int length: the dense kernels
        KVCase(
            dtype="bfloat16",
            q_len=40,
            new_len=40,
            heads=4,
            kv_heads=1,
            head_dim=64,
            capacity=160,
            lengths="int",
        ),
    ]


def _kvcache_modifiers(rng, case, xp):
    """A bias per (batch entry, head) and a mask that drops a random quarter of each
    sequence's keys (the query's first row keeps them all), reading ``b``; and the same
    per sequence for the oracle (its batch index is 0)."""
    bias = rng.uniform(-1, 1, (case.batch, case.heads)).astype(np.float32)
    dropped = (rng.random((case.batch, case.capacity)) < 0.25).astype(np.int32)
    device_bias, device_dropped = xp.asarray(bias), xp.asarray(dropped)

    def biased(score, b, h, q_idx, kv_idx):
        return score + device_bias[b, h]

    def kept(b, h, q_idx, kv_idx):
        return device_dropped[b, kv_idx] == 0 or q_idx == 0

    def of_sequence(b):
        def biased_b(score, b_, h, q_idx, kv_idx):
            return score + row[h]

        def kept_b(b_, h, q_idx, kv_idx):
            return drops[kv_idx] == 0 or q_idx == 0

        return dict(
            score_mod=modifiers.ScoreMod(biased_b, row=bias[b]),
            mask_mod=modifiers.MaskMod(kept_b, drops=dropped[b]),
        )

    return dict(score_mod=modifiers.ScoreMod(biased), mask_mod=modifiers.MaskMod(kept)), of_sequence


def _check_kvcache(case, rng, xp, block_mask=False):
    """flash_attention_with_kvcache with user modifiers against the per-sequence oracle,
    and the cache written at the appended rows only; ``block_mask``: the mask given as a
    block mask made for the capacity."""
    from test_kvcache import expected_caches, host_lengths, key_location, make_inputs

    inputs = make_inputs(case, rng, xp)
    mods, of_sequence = _kvcache_modifiers(rng, case, xp)
    if block_mask:
        mods["block_mask"] = create_block_mask(
            mods.pop("mask_mod"), case.batch, case.heads, case.q_len, case.capacity
        )
    want_k, want_v = expected_caches(case, inputs)
    out, lse = cuflash.flash_attention_with_kvcache(
        inputs["q"],
        inputs["k_cache"],
        inputs["v_cache"],
        case.heads,
        case.kv_heads,
        case.head_dim,
        case.causal,
        case.window,
        cache_seqlens=inputs["cache_seqlens"],
        k_new=inputs["k_new"],
        v_new=inputs["v_new"],
        block_table=inputs["block_table"],
        return_lse=True,
        softcap=case.softcap,
        alibi_slopes=inputs["alibi_slopes"],
        **mods,
    )
    assert np.array_equal(to_numpy(inputs["k_cache"]).view(np.uint8), want_k.view(np.uint8))
    q = to_numpy(inputs["q"]).astype(np.float64)
    table = None if inputs["block_table"] is None else to_numpy(inputs["block_table"])
    slopes = None if inputs["alibi_slopes"] is None else to_numpy(inputs["alibi_slopes"])
    ref_out, ref_lse = np.zeros(q.shape), np.full(q.shape[:3], -np.inf)
    for b, length in enumerate(host_lengths(case, inputs)):
        kv_len = int(length) + case.new_len
        if kv_len == 0:
            continue
        where = [key_location(case, table, b, j) for j in range(kv_len)]
        keys, values = (
            np.stack([cache[blk, :, row] for blk, row in where], axis=1)[None].astype(np.float64)
            for cache in (want_k, want_v)
        )
        ref_out[b], ref_lse[b] = (
            x[0]
            for x in attention_reference(
                q[b : b + 1],
                keys,
                values,
                case.causal,
                case.window,
                softcap=case.softcap,
                alibi_slopes=None
                if slopes is None
                else (slopes[b] if slopes.ndim == 2 else slopes),
                **of_sequence(b),
            )
        )
    got = to_numpy(out).astype(np.float64)
    assert not np.isnan(got).any()
    assert rel_error(got, ref_out) <= BOUND[case.dtype] + FLOOR[case.dtype], rel_error(got, ref_out)
    lse = to_numpy(lse)
    dead = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), dead) and np.all(got[dead] == 0)
    assert np.allclose(lse[~dead], ref_lse[~dead], atol=2e-3)


@pytest.mark.parametrize("block_mask", [False, True], ids=["mask_mod", "block_mask"])
@pytest.mark.parametrize("index", range(5))
def test_kvcache_cpu_path_takes_user_modifiers(index, block_mask, rng):
    _check_kvcache(_kvcache_cases()[index], rng, np, block_mask)


@pytest.mark.gpu
@pytest.mark.parametrize("block_mask", [False, True], ids=["mask_mod", "block_mask"])
@pytest.mark.parametrize("index", range(5))
def test_gpu_kvcache_takes_user_modifiers(index, block_mask, rng, poisoned):
    """Decoding, appends, paged caches and a long chunk (the dense kernels, which skip
    the tiles a block mask empties), with the mask as a function and as a block mask."""
    _check_kvcache(_kvcache_cases()[index], rng, cupy, block_mask)


def test_kvcache_block_mask_is_checked(rng):
    """A KV-cache call's block mask is made for the capacity, holds the call's mask
    function, and is a BlockMask."""
    from test_kvcache import KVCase, make_inputs

    case = KVCase(dtype="float32", capacity=80)
    inputs = make_inputs(case, rng)
    mask = modifiers.MaskMod(lambda b, h, q_idx, kv_idx: kv_idx != 3)
    args = (inputs["q"], inputs["k_cache"], inputs["v_cache"], case.heads, case.kv_heads)

    def call(**kw):
        return cuflash.flash_attention_with_kvcache(
            *args, case.head_dim, cache_seqlens=inputs["cache_seqlens"], **kw
        )

    for block_mask, mask_mod, reason in (
        (create_block_mask(mask, None, None, 1, 64), None, "made for kv_len=64"),
        (create_block_mask(mask, None, None, 1, 80), modifiers.MaskMod(
            lambda b, h, q_idx, kv_idx: kv_idx != 4), "through block_mask only"),
        (mask, None, "expected a cuflash.block_mask.BlockMask"),
    ):  # fmt: skip
        with pytest.raises(InvalidArgumentError, match=reason):
            call(block_mask=block_mask, mask_mod=mask_mod)
    expected = call(mask_mod=mask)
    assert np.array_equal(call(block_mask=create_block_mask(mask, None, None, 1, 80)), expected)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_decode_kernels_with_user_functors_compile(arch, rng):
    """The decode kernels (tensor-core and CUDA-core) with a relative bias and a document
    mask compiled in, and mask-only: NVRTC for the arch, no spills."""
    from cuflash.gpu import kernel_build

    score_mod, mask_mod, _ = _mask_cases(np, rng, 4, 640, 640)["bias_documents"]
    names = [
        "cuflash::kvcache_decode_tc<cuflash::bf16_t, 128, 1, 2, 64, false, true>",
        "cuflash::kvcache_decode_tc<cuflash::bf16_t, 128, 1, 2, 64, true, false>",
        "cuflash::kvcache_decode_tc<cuflash::bf16_t, 128, 4, 2, 64, false, false>",
        "cuflash::kvcache_decode<float, 128, 4>",
        "cuflash::kvcache_decode<cuflash::half_t, 64, 8>",
    ]
    for functors in (
        kernel_build.UserFunctors.of(score_mod, mask_mod),
        kernel_build.UserFunctors.of(None, mask_mod),
    ):
        assert len(compile_and_check(names, arch, functors)) == len(names)


def test_kvcache_modifier_reads_are_bounded_by_the_capacity(rng):
    """A modifier's array must cover every key position up to the capacity."""
    from test_kvcache import KVCase, make_inputs

    case = KVCase(dtype="float32", capacity=80)
    inputs = make_inputs(case, rng, np)
    short = np.zeros((case.batch, case.capacity - 1), np.int32)

    def kept(b, h, q_idx, kv_idx):
        return short[b, kv_idx] == 0

    with pytest.raises(InvalidArgumentError, match="mask_mod"):
        cuflash.flash_attention_with_kvcache(
            inputs["q"],
            inputs["k_cache"],
            inputs["v_cache"],
            case.heads,
            case.kv_heads,
            case.head_dim,
            cache_seqlens=inputs["cache_seqlens"],
            mask_mod=modifiers.MaskMod(kept),
        )
