"""Attention over a KV cache for inference (the KV-cache page).

:func:`flash_attention_with_kvcache` appends new keys and values to a cache
in place and attends the query rows of each sequence to its cached keys, with
per-sequence lengths, a contiguous or a paged cache, and the masking rules of
the dense functions. NumPy arrays run the CPU path (:mod:`cuflash.cpu.kvcache`); CuPy
arrays run the split-KV kernels of the registry's standalone table
(``cuflash.gpu.standalone``, ``kernels/decode/``), chosen by
:mod:`cuflash.gpu.decode_kernels` and launched by :mod:`cuflash.gpu.kvcache`.
"""

import numbers

import numpy as np

from . import fp8
from .core.config import AttentionConfig
from .core.kvcache_problem import kvcache_problem
from .cpu.kvcache import cpu_forward
from .fp8_forward import fp8_decode_key, kvcache_forward
from .gpu import plans


def flash_attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=True,
    window_size=0,
    *,
    cache_seqlens,
    k_new=None,
    v_new=None,
    block_table=None,
    softmax_scale=None,
    return_lse=False,
    check=False,
    softcap=0.0,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    sinks=None,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved=False,
    fp8_format=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    out_dtype=None,
    head_dim_v=None,
    allow_tf32=False,
    block_mask=None,
):
    """Attention of new query rows over a KV cache, appending new keys first (inference).

    Parameters
    ----------
    q : cupy.ndarray or numpy.ndarray, shape ``[B, num_heads, S_q, head_dim]``
        The new query rows of each sequence, ``S_q >= 1`` (1 for plain
        decoding, a few for speculative decoding, hundreds for a chunk of a
        prompt); float32, float16 or bfloat16. Any unit-last-stride view.
    k_cache, v_cache : same kind and dtype as ``q``
        Contiguous cache ``[B, num_kv_heads, S_cap, head_dim]``, or, with
        ``block_table``, a paged cache ``[num_blocks, num_kv_heads,
        block_size, head_dim]``. Any strides with a unit last stride (vLLM's
        ``[num_blocks, block_size, H_kv, D]`` buffer passed as
        ``x.transpose(0, 2, 1, 3)``); never copied, written in place.
    num_heads, num_kv_heads, head_dim : int
        Must agree with the shapes; ``num_kv_heads`` divides ``num_heads``
        (GQA/MQA); ``head_dim`` a multiple of 8 from 8 to 256, or to 576 with
        ``head_dim_v`` (on the GPU: float16/bfloat16 and a multiple of 16 above 256).
    causal : bool, default True
        Bottom-right aligned per sequence: query row ``i`` of sequence ``b``
        sits at position ``p = i + L_b - S_q`` and sees keys ``j <= p``.
    window_size : int or (int, int), default 0
        As in :func:`cuflash.flash_attention_fwd`, with ``S_k = L_b``.
    cache_seqlens : int or int32 array ``[B]``, keyword-only, required
        Keys already in each sequence's cache (an int: the same for every
        sequence). An array lives on the arrays' device (NumPy on the CPU path).
    k_new, v_new : arrays ``[B, num_kv_heads, S_new, head_dim]``, optional
        Written into the cache at positions ``cache_seqlens[b] ..
        cache_seqlens[b] + S_new - 1`` before attending; sequence ``b`` then
        has ``L_b = cache_seqlens[b] + S_new`` keys. No other cache element
        changes.
    block_table : int32 array ``[B, max_blocks]``, optional
        Paged cache: key ``j`` of sequence ``b`` is row ``j % block_size`` of
        block ``block_table[b, j // block_size]``. Blocks may be shared
        between sequences and appear in any order; entries past a sequence's
        last block are never read.
    softmax_scale : float, optional
        Multiplies ``q . k``; defaults to ``1 / sqrt(head_dim)``.
    return_lse : bool, default False
        Also return the float32 log-sum-exp ``[B, num_heads, S_q]``.
    softcap : float, default 0.0, keyword-only
        Soft-capping of the scaled scores, ``softcap * tanh(s / softcap)``; 0 is off
        (the Semantics page's score modifiers, as in :func:`cuflash.flash_attention_fwd`).
    alibi_slopes : float32 array ``[num_heads]`` or ``[B, num_heads]``, optional
        ALiBi: adds ``-slope * |p - j|`` to the score of query row ``i`` (at ``p = i +
        L_b - S_q``) and key ``j``, after the soft-cap; on the arrays' device.
    score_mod, mask_mod : cuflash.modifiers.ScoreMod, MaskMod, optional, keyword-only
        The user's score and mask functions (see the Semantics page), as in
        :func:`cuflash.flash_attention_fwd` on the sequence's keys: ``b`` is the
        batch entry, ``h`` the query head, ``q_idx`` the query row ``i`` (``0 ..
        S_q - 1``; its position in the sequence is ``i + L_b - S_q``) and ``kv_idx``
        the key ``j`` (``0 .. L_b - 1``). Their arrays' reads are bounded for
        ``q_idx < S_q`` and ``kv_idx <`` the capacity. Calls with them skip the
        cached launch plans of device-held lengths.
    block_mask : cuflash.block_mask.BlockMask, optional, keyword-only
        A mask function with its tile classification, instead of ``mask_mod``, as in
        :func:`cuflash.flash_attention_fwd`, made for ``q_len = S_q`` and ``kv_len =``
        the capacity (:func:`cuflash.block_mask.create_block_mask`). Long query
        chunks on a contiguous cache (the dense forward's kernels) skip the tiles it
        empties; the split-KV kernels evaluate its mask function.
    sinks : float32 array ``[num_heads]``, optional, keyword-only
        Attention sinks, as in :func:`cuflash.flash_attention_fwd`: ``exp(sinks[h])``
        joins each row's softmax with a zero value (once a row, also when the keys are
        split across blocks); on the arrays' device.
    rotary_cos, rotary_sin : arrays ``[S_rot, rotary_dim / 2]``, optional, keyword-only
        Rotary embedding at the append (the KV-cache page's "Rotary embedding"), both or
        neither, float32 or ``q``'s dtype, on the arrays' device. Row ``t`` of ``k_new``
        is rotated at position ``cache_seqlens[b] + t`` before it is written, and query
        row ``i`` at ``p = i + L_b - S_q``; the caller's ``q`` and ``k_new`` are not
        modified. The first ``rotary_dim`` (``<= head_dim``) dimensions rotate in pairs,
        ``x1' = x1 cos - x2 sin``, ``x2' = x1 sin + x2 cos`` with the tables' row of the
        position, in float32, rounded to the dtype. Host-held positions must be rows
        ``0 .. S_rot - 1``; device-held ones are clamped to them.
    rotary_interleaved : bool, default False, keyword-only
        The pairs: ``(x[r], x[r + rotary_dim / 2])`` (GPT-NeoX) by default, ``(x[2r],
        x[2r + 1])`` (GPT-J) when True; without the tables it changes nothing.
    fp8_format, q_descale, k_descale, v_descale, out_dtype : keyword-only
        An FP8 cache (the FP8 page): ``k_cache`` and ``v_cache`` (and ``k_new``,
        ``v_new``) in e4m3 as in :func:`cuflash.flash_attention_fwd`, ``q`` in e4m3 too
        or in float16/bfloat16 (whose dtype is then ``out_dtype``'s default); the
        descales ``[B, num_kv_heads]`` one row a sequence. No rotary tables.
    head_dim_v : int, optional, keyword-only
        The head dim of ``v_cache``, ``v_new`` and the output when it is not
        ``head_dim`` (a multiple of 8 up to 512): MLA's values, e.g. absorbed MLA's
        ``head_dim`` 576 with ``head_dim_v`` 512, where ``v_cache`` may be the view
        ``k_cache[..., :head_dim_v]`` of the latent cache (read as the values; with
        ``v_new`` its rows are written after ``k_new``'s). Any other ``v_cache``
        sharing memory with ``k_cache`` is an error. On the GPU a ``head_dim_v`` of
        its own (or a ``head_dim`` above 256) takes float16/bfloat16, ``head_dim`` a
        multiple of 16 and ``head_dim_v`` a multiple of 64; the latent view is read
        once (the KV-cache page).
    allow_tf32 : bool, default False, keyword-only
        float32 only, as in :func:`cuflash.flash_attention_fwd`: the products may run
        in TF32. Long query chunks on a contiguous cache (the dense forward's kernels)
        then take the TF32 tensor cores; the split-KV kernels keep float32 products.
        Ignored for float16/bfloat16 and on the CPU path.
    check : bool, default False
        GPU path: copy device-held ``cache_seqlens`` and ``block_table`` to
        the host once and verify them (lengths plus ``S_new`` within the
        capacity, used block ids naming blocks, rotated positions within the
        rotary tables) before any kernel runs.
        Without it they are never trusted either: the kernels clamp lengths
        to ``[0, capacity - S_new]`` and block ids to ``[0, num_blocks)``, so
        no access leaves the buffers, but a bad value gives a wrong result.
        Host-held values (an int; NumPy arrays on the CPU path) are always
        verified.

    Returns
    -------
    out : array, shape ``[B, num_heads, S_q, head_dim_v]``, dtype of ``q``
        Rows that see no key are zeros.
    lse : array, float32, shape ``[B, num_heads, S_q]``
        Only with ``return_lse``; ``-inf`` for rows that see no key (``sinks[h]`` with
        sinks).

    Raises
    ------
    InvalidArgumentError
        Before any kernel runs and before the cache is written: shapes,
        dtypes, devices, ``block_table``'s shape or dtype, host-held lengths
        above the capacity, rotary tables that do not fit (or that host-held
        positions run past), and with ``check=True`` bad device-held lengths
        or block ids (naming the sequence).

    Notes
    -----
    CuPy arrays run on the current device and stream: the append (which with
    rotary tables also writes the rotated copy of ``q`` that the attention
    reads, so it runs even without ``k_new``), the
    split-KV attention kernel and the combine of the splits, in that order
    (long query chunks on a contiguous cache take the dense forward's kernels
    after the append instead: see the KV-cache page). Accumulation is always
    float32.
    """
    if fp8.requested(
        (q, k_cache, v_cache, k_new, v_new), fp8_format, q_descale, k_descale, v_descale, out_dtype
    ):
        cache = (cache_seqlens, k_new, v_new, block_table, return_lse, check)
        rotary = (rotary_cos, rotary_sin)
        descales = (q_descale, k_descale, v_descale)
        key = None
        if check is False and score_mod is None and mask_mod is None and block_mask is None:
            # Device-held lengths: the plan of this signature serves every step.
            given: tuple[object, ...] = (q, k_cache, v_cache, cache_seqlens, k_new, v_new)
            given += (block_table, alibi_slopes, sinks, rotary_cos, rotary_sin)
            key = fp8_decode_key(
                given,
                descales,
                (num_heads, num_kv_heads, head_dim, causal, window_size, softmax_scale),
                (return_lse, softcap, head_dim_v, allow_tf32, fp8_format, out_dtype),
            )
            plan = plans.get(key)
            if plan is not None:
                return plan(given[:9], descales)
        config = AttentionConfig(
            num_heads,
            num_kv_heads,
            head_dim,
            causal,
            window_size,
            None,
            softmax_scale,
            allow_tf32,
            softcap,
            alibi_slopes,
            score_mod,
            mask_mod,
            block_mask,
            sinks,
            head_dim_v,
        )
        return kvcache_forward(
            flash_attention_with_kvcache,
            q,
            k_cache,
            v_cache,
            config,
            *cache,
            rotary,
            fp8_format,
            descales,
            out_dtype,
            plan_key=key,
        )
    key = None
    if (
        check is False
        and not isinstance(cache_seqlens, numbers.Integral)
        and score_mod is None
        and mask_mod is None
        and block_mask is None
    ):
        # Device-held lengths: the plan of this signature serves every step.
        given = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, alibi_slopes, sinks)
        given += (rotary_cos, rotary_sin)
        key = plans.signature(
            tuple(a for a in given if a is not None),
            (
                "kvcache",
                tuple(a is None for a in given),
                num_heads,
                num_kv_heads,
                head_dim,
                causal,
                window_size,
                softmax_scale,
                return_lse,
                softcap,
                rotary_interleaved,
                head_dim_v,
                allow_tf32,
            ),
        )
        plan = plans.get(key)
        if plan is not None:
            return plan(*given)
    config = AttentionConfig(
        num_heads,
        num_kv_heads,
        head_dim,
        causal,
        window_size,
        None,
        softmax_scale,
        allow_tf32,
        softcap,
        alibi_slopes,
        score_mod,
        mask_mod,
        block_mask,
        sinks,
        head_dim_v,
    )
    problem = kvcache_problem(
        q,
        k_cache,
        v_cache,
        config,
        cache_seqlens,
        k_new,
        v_new,
        block_table,
        return_lse,
        check,
        rotary_cos,
        rotary_sin,
        rotary_interleaved,
    )
    tables = (rotary_cos, rotary_sin)
    if problem.xp is np:
        out, lse = cpu_forward(
            problem,
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            k_new,
            v_new,
            block_table,
            alibi_slopes,
            sinks,
            *tables,
        )
        return (out, lse) if problem.return_lse else out
    from .gpu.kvcache import DecodePlan, gpu_forward  # imported on first GPU use only

    if key is not None and problem.batch * problem.num_heads:
        plan = DecodePlan(
            problem, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, alibi_slopes
        )
        plans.remember(key, plan)
        return plan(*given)
    out, lse = gpu_forward(
        problem,
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        k_new,
        v_new,
        block_table,
        check,
        alibi_slopes,
        sinks,
        *tables,
    )
    return (out, lse) if problem.return_lse else out
