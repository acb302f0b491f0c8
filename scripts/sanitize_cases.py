"""Small calls of every kernel of the registry, for compute-sanitizer to watch.

Forward, backward (atomic and deterministic), each dtype, head dims across
the head-dim classes and the general kernels, causal, window and kv_seq_len
cases, on both kernel paths, and every tensor-core kernel, also those the
default dispatch passes over (``cuflash.dispatch.skip_kernels``): the mma.sync
forward and backward where Hopper takes wgmma, the split-D 16-bit backward, float32
on TF32; score modifiers (soft-cap, ALiBi) on the dense and packed calls; decoding
from a paged cache with modifiers (user functions too) and garbage lengths; absorbed
MLA decoding (kvcache_decode_mla) with garbage lengths and block ids; the dense FP8
forward (e4m3 bits, two and three consumers); ring
attention over two virtual ranks; user score and mask functions with a block mask and
garbage document ids.
Run by scripts/sanitize.sh; exits non-zero on a wrong result. Arguments: the
settings to run (names of SETTINGS; default all); SANITIZE_HEAD_DIMS (comma
separated) narrows the head dims.
"""

import itertools
import os
import sys

import cupy
import numpy as np

import cuflash
from cuflash.core.problem import BFLOAT16
from cuflash.dispatch import skip_kernels

# name -> (kernel path, kernels skipped, allow_tf32). "auto" runs the defaults (on
# Hopper the wgmma kernels for 16 bits and the float16 pieces for float32).
SETTINGS = {
    "auto": ("auto", (), False),
    "general": ("general", (), False),
    "mma-sync": (
        "auto",
        ("forward_wgmma_ws", "forward_wgmma", "backward_wgmma_ws", "backward_wgmma"),
        False,
    ),
    # the 16-bit forwards alone, dense and packed (the warp-specialized kernel
    # from head_dim 72 up and with modifiers): a short run for a kernel change
    "forward-16": ("auto", (), False),
    # the 16-bit defaults, forward and backward, dense and packed; "wgmma-16" the same
    # with backward_wgmma where the default takes the warp-specialized backward
    "auto-16": ("auto", (), False),
    "wgmma-16": ("auto", ("backward_wgmma_ws",), False),
    "split-d": ("auto", ("backward_wgmma_ws", "backward_wgmma", "backward_mma_sync"), False),
    "tf32": ("auto", (), True),
    # the absorbed-MLA decode kernel alone (kvcache_decode_mla), a short run
    "mla": ("auto", (), False),
    # the dense FP8 forward alone (forward_wgmma_ws's FP8 role on Hopper), a short run
    "fp8": ("auto", (), False),
}


def main(settings):
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise SystemExit(f"unknown settings {sorted(unknown)}; expected some of {list(SETTINGS)}")
    rng = np.random.default_rng(0)
    failures = 0
    dtypes = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)
    slopes = cupy.asarray(rng.uniform(0.1, 1.0, 4).astype(np.float32))
    configs = [
        dict(causal=False),
        dict(causal=True, window_size=7),
        dict(kv_seq_len=50),
        dict(causal=True, softcap=5.0, alibi_slopes=slopes),
    ]
    head_dims = [
        int(d) for d in os.environ.get("SANITIZE_HEAD_DIMS", "40,64,96,128,200,256").split(",")
    ]
    for setting, dtype, d, cfg in itertools.product(settings, dtypes, head_dims, configs):
        if setting in ("mla", "fp8"):
            continue  # their own calls below
        float32 = dtype == np.float32
        sixteen_bit_only = setting in ("split-d", "mma-sync", "forward-16", "auto-16", "wgmma-16")
        if (sixteen_bit_only and float32) or (setting == "tf32" and not float32):
            continue  # 16-bit kernels; float32 kernels
        path, skipped, tf32 = SETTINGS[setting]
        cfg = dict(cfg, allow_tf32=tf32)
        q = cupy.asarray(rng.standard_normal((1, 4, 70, d)).astype(dtype))
        k, v = (cupy.asarray(rng.standard_normal((1, 2, 90, d)).astype(dtype)) for _ in "kv")
        with cuflash.kernel_path(path), skip_kernels(*skipped):
            out, lse = cuflash.flash_attention_fwd(q, k, v, 4, 2, d, **cfg)
            for det in () if setting == "forward-16" else (False, True):
                grads = cuflash.flash_attention_bwd(
                    out, q, k, v, out, lse, 4, 2, d, deterministic=det, **cfg
                )
                if any(bool(cupy.isnan(g).any()) for g in grads):
                    failures += 1
        if bool(cupy.isnan(out).any()):
            failures += 1
        if cfg.get("kv_seq_len") is None:
            failures += packed_calls(rng, dtype, d, path, skipped, cfg)
    if "auto" in settings:
        failures += kvcache_and_ring_calls(rng, head_dims)
    if "auto" in settings or "mla" in settings:
        failures += mla_decode_calls(rng)
    if "fp8" in settings:
        failures += fp8_forward_calls(rng)
    for setting in settings:
        if setting in ("auto", "mma-sync", "general"):
            path, skipped, _ = SETTINGS[setting]
            with cuflash.kernel_path(path), skip_kernels(*skipped):
                failures += user_modifier_calls(rng, head_dims)
    print(f"sanitize cases done ({', '.join(settings)}), {failures} with NaN")
    return 1 if failures else 0


# Packed batches: valid offsets (lengths 30, 0, 70, 45), then garbage ones (negative,
# decreasing, past the totals), which the kernels must clamp into the arrays.
PACKED_OFFSETS = ([0, 30, 30, 100, 145], [0, -40, 10**6, 20, 145], [145, 3, 2**31 - 1, -9, 0])


def packed_calls(rng, dtype, d, path, skipped, cfg):
    """Forward and backward (atomic, deterministic) of the packed batches; the count of
    NaN results with valid offsets."""
    q, k, v = (cupy.asarray(rng.standard_normal((145, h, d)).astype(dtype)) for h in (4, 2, 2))
    failures = 0
    for i, offsets in enumerate(PACKED_OFFSETS):
        cu = cupy.asarray(np.array(offsets, dtype=np.int32))
        args = (cu, cu, 70, 70, 4, 2, d)
        with cuflash.kernel_path(path), skip_kernels(*skipped):
            out, lse = cuflash.flash_attention_varlen_fwd(q, k, v, *args, **cfg)
            grads = [
                cuflash.flash_attention_varlen_bwd(
                    q, q, k, v, out, lse, *args, deterministic=det, **cfg
                )
                for det in (False, True)
            ]
        if i == 0:
            failures += sum(bool(cupy.isnan(x).any()) for x in (out, *grads[0], *grads[1]))
    return failures


def mla_decode_calls(rng):
    """kvcache_decode_mla (8 query heads) and (80, on sm_90) kvcache_decode_mla_wgmma: absorbed
    MLA (v_cache the latent's first 512 columns), contiguous and paged, with an append,
    split over long caches and with garbage device lengths and block ids; a v cache of
    its own (192 / 128) with modifiers; the count of NaN results with valid lengths."""
    failures = 0
    latent = cupy.asarray(rng.standard_normal((2, 1, 1024, 576)).astype(BFLOAT16))
    blocks = latent.reshape(2, 1, 16, 64, 576).transpose(0, 2, 1, 3, 4).reshape(32, 1, 64, 576)
    table = cupy.asarray(np.arange(32, dtype=np.int32).reshape(2, 16)[:, ::-1].copy())
    new = cupy.asarray(rng.standard_normal((2, 1, 1, 576)).astype(BFLOAT16))
    for heads, (cache, ids) in itertools.product((8, 80), ((latent, None), (blocks, table))):
        q = cupy.asarray(rng.standard_normal((2, heads, 1, 576)).astype(BFLOAT16))
        for lengths in ([1000, 300], [2**30, -5]):
            out = cuflash.flash_attention_with_kvcache(
                q, cache, cache[..., :512], heads, 1, 576,
                cache_seqlens=cupy.asarray(np.array(lengths, np.int32)), k_new=new,
                v_new=new[..., :512], block_table=ids, head_dim_v=512,
            )  # fmt: skip
            failures += lengths[1] > 0 and bool(cupy.isnan(out).any())
        if ids is not None:
            bad = cupy.asarray(np.array([[10**6] * 16, [-4] * 16], np.int32))
            out = cuflash.flash_attention_with_kvcache(
                q, cache, cache[..., :512], heads, 1, 576, cache_seqlens=cupy.asarray(
                    np.array([500, 40], np.int32)), block_table=bad, head_dim_v=512,
            )  # fmt: skip
            failures += bool(cupy.isnan(out).any())
    k_cache = cupy.asarray(rng.standard_normal((2, 2, 300, 192)).astype(np.float16))
    v_cache = cupy.asarray(rng.standard_normal((2, 2, 300, 128)).astype(np.float16))
    q = cupy.asarray(rng.standard_normal((2, 4, 3, 192)).astype(np.float16))
    out = cuflash.flash_attention_with_kvcache(
        q, k_cache, v_cache, 4, 2, 192, window_size=(50, 0),
        cache_seqlens=cupy.asarray(np.array([290, 17], np.int32)), softcap=4.0,
        alibi_slopes=cupy.asarray(rng.uniform(0.1, 1.0, 4).astype(np.float32)),
        sinks=cupy.asarray(rng.standard_normal(4).astype(np.float32)), head_dim_v=128,
    )  # fmt: skip
    return failures + bool(cupy.isnan(out).any())


def fp8_forward_calls(rng):
    """Dense FP8 forwards (e4m3 bits, per-(batch, KV head) descales, GQA) at D = 64 and 96
    (three consumers: 192 query rows a block, the second block partial), 128 and 256 (two),
    plain, causal with a window, and with kv_seq_len; the count of NaN results."""
    from cuflash import fp8

    failures = 0
    for d, cfg in itertools.product(
        (64, 96, 128, 256),
        (dict(causal=False), dict(causal=True, window_size=(40, 0)), dict(kv_seq_len=150)),
    ):
        shapes = ((1, 4, 200, d), (1, 2, 230, d), (1, 2, 230, d))
        quantized = [fp8.quantize(rng.standard_normal(shape), num_kv_heads=2) for shape in shapes]
        (q, qd), (k, kd), (v, vd) = quantized
        out, _ = cuflash.flash_attention_fwd(
            *(cupy.asarray(a.view(np.uint8)) for a in (q, k, v)), 4, 2, d, fp8_format="e4m3",
            q_descale=cupy.asarray(qd), k_descale=cupy.asarray(kd), v_descale=cupy.asarray(vd),
            **cfg,
        )  # fmt: skip
        failures += bool(cupy.isnan(out.astype(cupy.float32)).any())
    return failures


def kvcache_and_ring_calls(rng, head_dims):
    """Decoding from a paged cache with the score modifiers (device lengths, one of them
    garbage), also with user functions whose array values are garbage indices (clamped by
    the kernels), one row a sequence on small blocks and on a window across blocks, a
    chunk of queries on a contiguous cache (the dense forward) with garbage lengths, and
    ring attention over two virtual ranks (the merge kernel); the count of NaN results."""
    from cuflash import distributed as dist
    from cuflash import modifiers

    garbage = cupy.asarray(((rng.random(48) < 0.3) * 10**6).astype(np.int32))
    key_bias = cupy.asarray(rng.uniform(-1, 1, 4).astype(np.float32))

    def biased(score, b, h, q_idx, kv_idx):
        return score + key_bias[garbage[kv_idx]]  # a value-derived index far outside

    def kept(b, h, q_idx, kv_idx):
        return garbage[kv_idx] == 0

    user = dict(score_mod=modifiers.ScoreMod(biased), mask_mod=modifiers.MaskMod(kept))
    failures = 0
    for dtype, d in itertools.product((np.dtype(np.float32), BFLOAT16), head_dims):
        q = cupy.asarray(rng.standard_normal((2, 4, 3, d)).astype(dtype))
        k_cache, v_cache = (
            cupy.asarray(rng.standard_normal((6, 2, 16, d)).astype(dtype)) for _ in "kv"
        )
        table = cupy.asarray(np.array([[0, 1, 2], [3, 4, 5]], np.int32))
        for lengths, given in itertools.product(([20, 45], [7, 10**6]), ({}, user)):
            out = cuflash.flash_attention_with_kvcache(
                q,
                k_cache,
                v_cache,
                4,
                2,
                d,
                cache_seqlens=cupy.asarray(np.array(lengths, np.int32)),
                block_table=table,
                softcap=3.0,
                alibi_slopes=cupy.asarray(rng.uniform(0.1, 1.0, (2, 4)).astype(np.float32)),
                **given,
            )
            failures += lengths[1] < 48 and bool(cupy.isnan(out).any())
        # one row a sequence (the narrow kernel) on blocks of 8 keys (block ids read with
        # the copies) and on a window that starts inside blocks (loads across two)
        q_row = q[:, :, :1]
        small_blocks = [x.reshape(12, 2, 8, d) for x in (k_cache, v_cache)]
        for blocks, ids, window in (
            (small_blocks, np.arange(12).reshape(2, 6), 0),
            ((k_cache, v_cache), table.get(), 21),
        ):
            out = cuflash.flash_attention_with_kvcache(
                q_row,
                *blocks,
                4,
                2,
                d,
                window_size=window,
                cache_seqlens=cupy.asarray(np.array([40, 10**6], np.int32)),
                block_table=cupy.asarray(ids.astype(np.int32)),
            )
            failures += bool(cupy.isnan(out[0]).any())
        # a chunk of 32 rows (x 2 heads a KV head): the dense forward, its key counts
        # written by the append from garbage lengths
        q_chunk = cupy.asarray(rng.standard_normal((2, 4, 32, d)).astype(dtype))
        new_rows = [cupy.asarray(rng.standard_normal((2, 2, 32, d)).astype(dtype)) for _ in "kv"]
        contiguous = [cupy.asarray(rng.standard_normal((2, 2, 80, d)).astype(dtype)) for _ in "kv"]
        out = cuflash.flash_attention_with_kvcache(
            q_chunk,
            *contiguous,
            4,
            2,
            d,
            k_new=new_rows[0],
            v_new=new_rows[1],
            cache_seqlens=cupy.asarray(np.array([-9, 10**6], np.int32)),
            softcap=3.0,
        )
        failures += bool(cupy.isnan(out).any())
        whole = [
            cupy.asarray(rng.standard_normal((1, h, 4 * 37, d)).astype(dtype)) for h in (4, 2, 2, 4)
        ]
        shards = [tuple(dist.shard(x, "zigzag", r, 2) for x in whole) for r in range(2)]

        def rank(group, q, k, v, dout):
            out, vjp = dist.ring_attention_vjp(q, k, v, 4, 2, d, True, group=group)
            return (out, *vjp(dout))

        for result in dist.ThreadGroup(2).run(rank, shards):
            failures += sum(bool(cupy.isnan(x).any()) for x in result)
    return failures


def user_modifier_calls(rng, head_dims):
    """User functions compiled into the kernels: a document mask read through a block mask
    (tiles empty, full and partial, rows of the last document that see no key) with
    garbage document ids past the end (value-derived indices, clamped by the kernels), and
    a relative bias; forward and backward, atomic and deterministic; the count of NaN
    results."""
    from cuflash import modifiers
    from cuflash.block_mask import create_block_mask

    ids = np.repeat(np.arange(4, dtype=np.int32), [70, 60, 50, 20])
    ids[-5:] = 10**6  # a value-derived index far outside any array
    ids = cupy.asarray(ids)
    documents = modifiers.and_masks(modifiers.document_mask(ids), modifiers.causal_mask(offset=-3))
    doc_bias = cupy.asarray(rng.uniform(-1, 1, 4).astype(np.float32))

    def by_document(score, b, h, q_idx, kv_idx):
        return score + doc_bias[ids[kv_idx]]  # ids past 3: clamped by the kernels

    bias = modifiers.ScoreMod(by_document)
    block_mask = create_block_mask(documents, None, None, 200, 200)
    failures = 0
    for dtype, d in itertools.product((np.dtype(np.float32), BFLOAT16), head_dims):
        q = cupy.asarray(rng.standard_normal((1, 4, 200, d)).astype(dtype))
        k, v = (cupy.asarray(rng.standard_normal((1, 2, 200, d)).astype(dtype)) for _ in "kv")
        for given in (
            dict(block_mask=block_mask),
            dict(block_mask=block_mask, score_mod=bias),
            dict(mask_mod=documents),
        ):
            out, lse = cuflash.flash_attention_fwd(q, k, v, 4, 2, d, **given)
            failures += bool(cupy.isnan(out).any())
            for det in (False, True):
                grads = cuflash.flash_attention_bwd(
                    out, q, k, v, out, lse, 4, 2, d, deterministic=det, **given
                )
                failures += sum(bool(cupy.isnan(g).any()) for g in grads)
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(SETTINGS)))
