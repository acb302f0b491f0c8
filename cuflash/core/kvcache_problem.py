"""The validated call of :func:`cuflash.flash_attention_with_kvcache` (the KV-cache
page): the problem object, the head-dim limits and the checks of lengths, block ids
and a latent value view, shared by the front end, its FP8 forward and the GPU path."""

import dataclasses
import math
import numbers

import numpy as np

from .. import rotary as rotary_embedding
from ..errors import InvalidArgumentError
from .masking import normalize_window
from .problem import (
    MAX_GRID_YZ,
    array_module,
    check_alibi_slopes,
    check_block_mask,
    check_dims,
    check_dtypes,
    check_flag,
    check_head_counts,
    check_head_dim_v,
    check_int32,
    check_rank,
    check_sinks,
    check_softcap,
    check_user_modifiers,
)

# Head dims the KV-cache call takes (absorbed MLA decodes a 576-wide latent whose first
# 512 columns are the values). On the GPU, one head dim up to GPU_MAX_HEAD_DIM takes the
# split-KV kernels of every dtype; wider keys or a value head dim of its own take
# kvcache_decode_mla (16-bit, head_dim a multiple of 16, head_dim_v of MLA_V_MULTIPLE).
MAX_HEAD_DIM, MAX_HEAD_DIM_V, GPU_MAX_HEAD_DIM = 576, 512, 256
MLA_V_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class KVCacheProblem:
    """A validated call of :func:`flash_attention_with_kvcache`."""

    xp: object
    dtype: np.dtype
    batch: int
    num_heads: int
    num_kv_heads: int
    q_len: int
    new_len: int  # S_new (0 without k_new / v_new)
    head_dim: int
    paged: bool
    capacity: int  # keys a sequence can hold: S_cap, or max_blocks * block_size
    block_size: int  # rows a block holds (S_cap for a contiguous cache)
    num_blocks: int  # blocks of a paged cache (B for a contiguous one)
    max_blocks: int  # block-table columns (1 for a contiguous cache)
    host_lengths: object  # int64 [B] cached lengths when held on the host, else None
    softmax_scale: float
    window: tuple  # (left, right), -1 = unbounded, causal folded in
    return_lse: bool
    softcap: float = 0.0  # the Semantics page's score modifiers; 0 is off
    alibi_batch_stride: int = -1  # ALiBi slopes: H for [B, H], 0 for [H], -1 for none
    score_mod: object = None  # a cuflash.modifiers.ScoreMod, or None
    mask_mod: object = None  # a cuflash.modifiers.MaskMod, or None
    block_mask: object = None  # a cuflash.block_mask.BlockMask holding mask_mod, or None
    sinks: bool = False  # attention sinks (float32 [H]) given
    rotary: object = None  # a cuflash.rotary.Rotary (the tables given), or None
    head_dim_v: int = 0  # of v_cache, v_new and the output (head_dim unless given)
    latent: bool = False  # v_cache is k_cache[..., :head_dim_v] (absorbed MLA)
    allow_tf32: bool = False  # float32 products may run in TF32 (the dense forward's)

    @property
    def own_value_dims(self):
        """Keys wider than GPU_MAX_HEAD_DIM or a value head dim of its own: the GPU's
        kvcache_decode_mla serves the call."""
        return self.head_dim_v != self.head_dim or self.head_dim > GPU_MAX_HEAD_DIM

    @property
    def alibi(self):
        return self.alibi_batch_stride >= 0

    @property
    def group_size(self):
        return self.num_heads // self.num_kv_heads

    @property
    def q_shape(self):
        return (self.batch, self.num_heads, self.q_len, self.head_dim)

    @property
    def out_shape(self):
        return (self.batch, self.num_heads, self.q_len, self.head_dim_v)

    @property
    def lse_shape(self):
        return (self.batch, self.num_heads, self.q_len)


def _scale(softmax_scale, head_dim):
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise InvalidArgumentError(
            "softmax_scale", f"expected a float, got {type(softmax_scale).__name__}"
        )
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise InvalidArgumentError("softmax_scale", f"must be finite, got {scale}")
    return scale


def _sequence_blocks(length, block_size):
    return -(-length // block_size)


def check_block_ids(table, lengths, new_len, block_size, num_blocks):
    """Every block id a sequence uses (its first ``length + S_new`` keys) names a block."""
    for b, length in enumerate(lengths):
        used = table[b, : _sequence_blocks(int(length) + new_len, block_size)]
        bad = np.flatnonzero((used < 0) | (used >= num_blocks))
        if bad.size:
            slot = int(bad[0])
            raise InvalidArgumentError(
                "block_table",
                f"sequence {b}: block_table[{b}, {slot}] = {int(used[slot])} "
                f"is not a block of the cache (0 .. {num_blocks - 1})",
            )


def check_lengths(lengths, new_len, capacity):
    """Host-held lengths: ``0 <= length`` and ``length + S_new <= capacity``."""
    for b, length in enumerate(lengths):
        length = int(length)
        if length < 0:
            raise InvalidArgumentError(
                "cache_seqlens", f"sequence {b}: length {length} is negative"
            )
        if length + new_len > capacity:
            raise InvalidArgumentError(
                "cache_seqlens",
                f"sequence {b}: {length} cached keys plus S_new = {new_len} "
                f"exceed the capacity {capacity}",
            )


def _extent(xp, a):
    """``(first, last)`` byte addresses an array's elements span."""
    start = a.data.ptr if xp is not np else a.__array_interface__["data"][0]
    low = start + sum(s * (n - 1) for s, n in zip(a.strides, a.shape) if s < 0 and n)
    high = start + sum(s * (n - 1) for s, n in zip(a.strides, a.shape) if s > 0 and n)
    return low, high + a.itemsize - 1, start


def _check_value_view(xp, k_cache, v_cache):
    """A ``v_cache`` that shares memory with ``k_cache`` must be its first ``head_dim_v``
    columns (``k_cache[..., :head_dim_v]``, absorbed MLA's latent read as the values):
    the same start and strides. Any other overlap is an error. Returns whether it is
    that view."""
    if not (k_cache.size and v_cache.size):
        return False
    k_low, k_high, k_start = _extent(xp, k_cache)
    v_low, v_high, v_start = _extent(xp, v_cache)
    if v_high < k_low or k_high < v_low:
        return False
    if v_start != k_start or tuple(v_cache.strides) != tuple(k_cache.strides):
        raise InvalidArgumentError(
            "v_cache",
            "shares memory with k_cache but is not its first head_dim_v columns "
            "(k_cache[..., :head_dim_v])",
        )
    return True


def kvcache_problem(
    q,
    k_cache,
    v_cache,
    config,
    cache_seqlens,
    k_new=None,
    v_new=None,
    block_table=None,
    return_lse=False,
    check=False,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved=False,
    storage_dtype=None,
):
    """Validate a call of the options ``config`` (an ``AttentionConfig``; its
    ``kv_seq_len`` unused: ``cache_seqlens`` and ``k_new`` give the keys) and the cache's
    own arguments (every check runs on the host, before any kernel); ``storage_dtype``:
    the FP8 dtype of the cache, which :func:`cuflash.fp8.storage_dtype` has checked (with
    ``q``'s, which may be 16-bit), or None (the usual dtypes)."""
    c = config
    if (k_new is None) != (v_new is None):
        missing = "v_new" if v_new is None else "k_new"
        raise InvalidArgumentError(missing, "k_new and v_new must be given together")
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    if k_new is not None:
        named += [("k_new", k_new), ("v_new", v_new)]
    extra = [("block_table", block_table)] if block_table is not None else []
    if cache_seqlens is not None and not isinstance(cache_seqlens, numbers.Integral):
        extra.append(("cache_seqlens", cache_seqlens))
    xp = array_module(named + extra)
    check_rank("q", q, 4, "[B, H, S_q, D]")
    paged = block_table is not None
    cache_layout = "[num_blocks, H_kv, block_size, D]" if paged else "[B, H_kv, S_cap, D]"
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_rank(name, a, 4, cache_layout)
    if k_new is not None:
        for name, a in (("k_new", k_new), ("v_new", v_new)):
            check_rank(name, a, 4, "[B, H_kv, S_new, D]")
    dtype = check_dtypes(named) if storage_dtype is None else storage_dtype
    num_heads, num_kv_heads, head_dim = check_head_counts(
        c.num_heads, c.num_kv_heads, c.head_dim, MAX_HEAD_DIM
    )
    head_dim_v = check_head_dim_v(c.head_dim_v, head_dim, MAX_HEAD_DIM_V)
    if head_dim_v > MAX_HEAD_DIM_V:  # head_dim_v not given: v's head dim is head_dim's
        raise InvalidArgumentError(
            "head_dim_v",
            f"v's head dim is at most {MAX_HEAD_DIM_V}: pass head_dim_v for a head_dim of "
            f"{head_dim}",
        )
    batch, _, q_len, _ = q.shape
    check_dims("q", q, (None, num_heads, None, head_dim), ("batch", "heads", "", "head_dim"))
    if q_len < 1:
        raise InvalidArgumentError("q", "S_q must be >= 1 (one or more new query rows)")
    labels = ("blocks" if paged else "batch", "heads", "rows", "head_dim")
    check_dims("k_cache", k_cache, (None if paged else batch, num_kv_heads, None, head_dim), labels)
    v_shape = (*k_cache.shape[:3], head_dim_v)
    if tuple(v_cache.shape) != v_shape:
        raise InvalidArgumentError(
            "v_cache",
            f"expected shape {v_shape} (k_cache's rows, head_dim_v {head_dim_v} columns), "
            f"got {tuple(v_cache.shape)}",
        )
    latent = _check_value_view(xp, k_cache, v_cache)
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        if a.size and a.strides[-1] != a.itemsize:
            raise InvalidArgumentError(
                name,
                "the last stride must be 1 element: the cache is read and written "
                "in place, never copied",
            )
    new_len = 0
    if k_new is not None:
        new_len = k_new.shape[2]
        for name, a, width in (("k_new", k_new, head_dim), ("v_new", v_new, head_dim_v)):
            check_dims(
                name,
                a,
                (batch, num_kv_heads, new_len, width),
                ("batch", "heads", "rows", "head_dim" if name == "k_new" else "head_dim_v"),
            )
        if xp is np and not (k_cache.flags.writeable and v_cache.flags.writeable):
            raise InvalidArgumentError("k_cache", "is read-only; k_new needs a writable cache")
    if paged:
        if block_table.ndim != 2 or block_table.shape[0] != batch:
            raise InvalidArgumentError(
                "block_table",
                f"expected shape ({batch}, max_blocks) [B, max_blocks], "
                f"got {tuple(block_table.shape)}",
            )
        check_int32("block_table", block_table, (batch, block_table.shape[1]), "[B, max_blocks]")
        num_blocks, block_size, max_blocks = (
            k_cache.shape[0],
            k_cache.shape[2],
            block_table.shape[1],
        )
        if block_size < 1:
            raise InvalidArgumentError("k_cache", "block_size (axis 2) must be >= 1")
        if batch and num_blocks < 1:
            raise InvalidArgumentError("k_cache", "a paged cache needs at least one block")
        capacity = max_blocks * block_size
    else:
        capacity = block_size = k_cache.shape[2]
        num_blocks, max_blocks = batch, 1
    if new_len > capacity:
        raise InvalidArgumentError(
            "k_new", f"S_new = {new_len} rows exceed the cache capacity {capacity}"
        )
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(
        cache_seqlens, (bool, np.bool_)
    ):
        length = int(cache_seqlens)
        if length < 0 or length + new_len > capacity:
            raise InvalidArgumentError(
                "cache_seqlens",
                f"{length} cached keys plus S_new = {new_len} must be within "
                f"0 .. the capacity {capacity}",
            )
        host_lengths = np.full(batch, length, dtype=np.int64)
    elif cache_seqlens is None:
        raise InvalidArgumentError("cache_seqlens", "is required: an int or an int32 [B] array")
    elif isinstance(cache_seqlens, (bool, np.bool_)) or not hasattr(cache_seqlens, "dtype"):
        raise InvalidArgumentError(
            "cache_seqlens",
            f"expected an int or an int32 [B] array, got {type(cache_seqlens).__name__}",
        )
    else:
        check_int32("cache_seqlens", cache_seqlens, (batch,), "[B]")
        host_lengths = None
        if xp is np:
            host_lengths = cache_seqlens.astype(np.int64)
            check_lengths(host_lengths, new_len, capacity)
    window = normalize_window(c.window_size, c.causal, capacity, q_len)
    scale = _scale(c.softmax_scale, head_dim)
    softcap = check_softcap(c.softcap)
    slopes_shape = check_alibi_slopes(c.alibi_slopes, q, num_heads, batch)
    has_sinks = check_sinks(c.sinks, q, num_heads)
    rotary = rotary_embedding.check_rotary(
        rotary_cos, rotary_sin, rotary_interleaved, q, head_dim, dtype
    )
    if rotary is not None and host_lengths is not None:
        rotary_embedding.check_positions(rotary, host_lengths, new_len, q_len)
    # the user's functions see b < B, h < H, q_idx < S_q and kv_idx < the capacity
    mask_mod = check_block_mask(c.block_mask, c.mask_mod, batch, num_heads, q_len, capacity)
    check_user_modifiers(c.score_mod, mask_mod, xp, num_heads, batch, q_len, capacity)
    check_flag("return_lse", return_lse)
    check_flag("check", check)
    check_flag("allow_tf32", c.allow_tf32)
    if batch > MAX_GRID_YZ or num_kv_heads > MAX_GRID_YZ:
        raise InvalidArgumentError(
            "q",
            f"too large for the device: batch and num_kv_heads must each be <= "
            f"{MAX_GRID_YZ}, got {batch} and {num_kv_heads}",
        )
    if q_len * max(num_heads, 1) >= 2**31 or capacity >= 2**31:
        raise InvalidArgumentError("q", "too large for the device: lengths must be < 2**31")
    problem = KVCacheProblem(
        xp=xp,
        dtype=dtype,
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        q_len=q_len,
        new_len=new_len,
        head_dim=head_dim,
        paged=paged,
        capacity=capacity,
        block_size=block_size,
        num_blocks=num_blocks,
        max_blocks=max_blocks,
        host_lengths=host_lengths,
        softmax_scale=scale,
        window=window,
        return_lse=bool(return_lse),
        softcap=softcap,
        alibi_batch_stride=-1
        if slopes_shape is None
        else (num_heads if len(slopes_shape) == 2 else 0),
        score_mod=c.score_mod,
        mask_mod=mask_mod,
        block_mask=c.block_mask,
        sinks=has_sinks,
        rotary=rotary,
        head_dim_v=head_dim_v,
        latent=latent,
        allow_tf32=bool(c.allow_tf32),
    )
    if xp is not np and problem.own_value_dims:
        _check_mla_on_gpu(problem)
    if paged and xp is np:  # host-held block ids are validated like host-held lengths
        check_block_ids(block_table, host_lengths, new_len, block_size, num_blocks)
    return problem


def _check_mla_on_gpu(problem):
    """The GPU's kvcache_decode_mla takes float16/bfloat16, head_dim a multiple of 16
    and head_dim_v a multiple of MLA_V_MULTIPLE (the NumPy path takes every case)."""
    wide = f"head_dim {problem.head_dim} with head_dim_v {problem.head_dim_v}"
    if np.dtype(problem.dtype).itemsize != 2:
        raise InvalidArgumentError(
            "q",
            f"{wide}: the GPU path takes float16 or bfloat16, got {np.dtype(problem.dtype).name} "
            "(NumPy arrays take float32 on the CPU path)",
        )
    if problem.head_dim % 16 or problem.head_dim_v % MLA_V_MULTIPLE:
        raise InvalidArgumentError(
            "head_dim_v" if problem.head_dim % 16 == 0 else "head_dim",
            f"{wide}: the GPU path takes a head_dim of 16s and a head_dim_v of "
            f"{MLA_V_MULTIPLE}s where they differ or head_dim is above {GPU_MAX_HEAD_DIM} "
            "(NumPy arrays take any on the CPU path)",
        )
