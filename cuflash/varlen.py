"""Packed batches of variable-length sequences (the Packed batches page).

The tokens of every sequence lie end to end, ``q`` as ``[total_q, num_heads,
head_dim]`` and ``k``, ``v`` as ``[total_k, num_kv_heads, head_dim]``, and the
int32 offsets ``cu_seqlens_q`` / ``cu_seqlens_k`` (``[B + 1]``, 0 first, the
totals last) say where each one starts. Sequence ``b`` is its own attention
problem with the semantics of the dense functions.

On the GPU one launch of the dense kernels serves the whole batch: the packed
arrays are one batch entry (``[1, H, total, D]`` views, no copy) and each
block reads its sequence's offsets on the device (``Sequence`` in
``kernels/common/common.cuh``), so a call copies nothing to the host and can be
captured in a CUDA graph. The offsets are not trusted there: the kernels
clamp them into the arrays, and ``check=True`` copies them to the host once
and verifies them. On the CPU the offsets are host values, always verified,
and each sequence runs as one dense call on views.
"""

import dataclasses

import numpy as np

from . import fp8
from . import sinks as attention_sinks
from .core.config import AttentionConfig
from .core.problem import (
    array_module,
    backward_problem,
    check_dims,
    check_flag,
    check_rank,
    forward_problem,
)
from .core.varlen_problem import heads_first, varlen_problem, verified_offsets
from .cpu import dense as cpu
from .errors import InvalidArgumentError
from .fp8_forward import varlen_forward
from .gpu import plans, value_dims
from .gpu.packed_plans import PackedBackward, PackedForward


def flash_attention_varlen_fwd(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=False,
    window_size=0,
    *,
    softmax_scale=None,
    allow_tf32=False,
    check=False,
    softcap=0.0,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    sinks=None,
    head_dim_v=None,
    fp8_format=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    out_dtype=None,
):
    """Attention over a packed batch of variable-length sequences, forward pass.

    Parameters
    ----------
    q : cupy.ndarray or numpy.ndarray, shape ``[total_q, num_heads, head_dim]``
        The queries of every sequence end to end; float32, float16 or bfloat16.
    k, v : arrays, shape ``[total_k, num_kv_heads, head_dim]`` (v: ``head_dim_v`` last)
        The keys and values of every sequence end to end.
    cu_seqlens_q, cu_seqlens_k : int32 arrays ``[B + 1]`` on the arrays' device
        Offsets: sequence ``b`` is queries ``cu_seqlens_q[b] ..< cu_seqlens_q[b + 1]``
        against keys ``cu_seqlens_k[b] ..< cu_seqlens_k[b + 1]``; 0 first,
        nondecreasing, the totals last. Lengths of 0 are valid.
    max_seqlen_q, max_seqlen_k : int
        Bounds on every sequence's length (checked).
    num_heads, num_kv_heads, head_dim, causal, window_size, softmax_scale, allow_tf32
        As in :func:`cuflash.flash_attention_fwd`, per sequence (causal is
        bottom-right aligned in each sequence).
    softcap, alibi_slopes : keyword-only
        As in :func:`cuflash.flash_attention_fwd`; ``[B, num_heads]`` slopes are one row
        a sequence, and ALiBi's positions count within each sequence.
    score_mod, mask_mod : cuflash.modifiers objects, keyword-only
        As in :func:`cuflash.flash_attention_fwd`, with ``b`` the sequence and
        ``q_idx``, ``kv_idx`` positions within it (their reads are bounded for
        ``max_seqlen_q``, ``max_seqlen_k``).
    block_mask : cuflash.block_mask.BlockMask, optional, keyword-only
        As in :func:`cuflash.flash_attention_fwd` (instead of ``mask_mod``), made for
        the sequences' sizes: ``B`` the sequence count (or None), ``Q_LEN`` and
        ``KV_LEN`` ``max_seqlen_q`` and ``max_seqlen_k``; its tiles are each
        sequence's own, from its first row and key.
    sinks : float32 array ``[num_heads]``, optional, keyword-only
        Attention sinks, as in :func:`cuflash.flash_attention_fwd` (the same logits for
        every sequence; a row of a sequence with no key gives zeros and
        ``lse = sinks[h]``).
    head_dim_v : int, optional, keyword-only
        v's head dim, as in :func:`cuflash.flash_attention_fwd` (None: ``head_dim``).
    fp8_format, q_descale, k_descale, v_descale, out_dtype : keyword-only
        FP8 inputs, as in :func:`cuflash.flash_attention_fwd` (the FP8 page), with
        ``[B, num_kv_heads]`` descales one row a sequence.
    check : bool, default False
        Verify device-held offsets before any kernel runs: one device-to-host copy
        (which synchronizes the stream), then the errors below, naming the sequence.
        Without it nothing is copied (the call can be captured in a CUDA graph) and
        the kernels trust no offset: they clamp each into the arrays, so offsets that
        break the rules above leave some rows unspecified but never read or write
        outside the arrays. Host-held offsets (the CPU path) are always verified.

    Returns
    -------
    out : array, shape ``[total_q, num_heads, head_dim_v]``, dtype of ``q``
    lse : float32 array, shape ``[num_heads, total_q]`` (FlashAttention-2's layout)

    Raises
    ------
    InvalidArgumentError
        Before any kernel runs: shapes, dtypes, devices, offsets of the wrong length or
        dtype, more than 65535 sequences; with host offsets or ``check``, offsets not
        starting at 0, decreasing, disagreeing with the totals, or a length above
        ``max_seqlen_*`` (naming the sequence).
    """
    if fp8.requested((q, k, v), fp8_format, q_descale, k_descale, v_descale, out_dtype):
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
        offsets = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        descales = (q_descale, k_descale, v_descale)
        return varlen_forward(
            flash_attention_varlen_fwd,
            q,
            k,
            v,
            *offsets,
            config,
            check,
            fp8_format,
            descales,
            out_dtype,
        )
    arrays = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    key = plans.signature(
        (*arrays, *(a for a in (alibi_slopes, sinks) if a is not None)),
        (
            "packed",
            max_seqlen_q,
            max_seqlen_k,
            num_heads,
            num_kv_heads,
            head_dim,
            causal,
            window_size,
            softmax_scale,
            allow_tf32,
            check,
            softcap,
            score_mod,
            mask_mod,
            block_mask,
            alibi_slopes is None,
            sinks is None,
            head_dim_v,
        ),
    )
    plan = plans.get(key)
    if plan is None:
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
        problem = varlen_problem(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, config, check
        )
        if problem.xp is np:
            return _forward_per_sequence(problem, config, q, k, v)
        plan = value_dims.forward_plan(PackedForward, problem, q, k, v)
        plans.remember(key, plan)
    if check:  # every call: the offsets' values are not part of the signature
        verified_offsets(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return plan(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks)


def _sequence_slopes(alibi_slopes, b):
    """Sequence ``b``'s ALiBi slopes (``[H]``), or None."""
    if alibi_slopes is None or alibi_slopes.ndim == 1:
        return alibi_slopes
    return np.ascontiguousarray(alibi_slopes[b])


def _sequence_problem(problem, b):
    """A sequence's dense problem, its user modifiers seeing ``b`` as the batch entry."""
    return dataclasses.replace(problem, first_batch=b)


def _sequence_config(config, attention, b):
    """Sequence ``b``'s dense options: its ALiBi slopes, and the packed call's mask (a
    block mask's classification covers the packed call's sizes, not a sequence's)."""
    return dataclasses.replace(
        config,
        alibi_slopes=_sequence_slopes(config.alibi_slopes, b),
        mask_mod=attention.mask_mod,
        block_mask=None,
    )


def _forward_per_sequence(problem, config, q, k, v):
    """The CPU path: one dense call a sequence, on views."""
    attention = problem.attention
    out = np.zeros((*q.shape[:2], attention.head_dim_v), dtype=attention.dtype)
    lse = np.full((attention.num_heads, problem.total_q), -np.inf, dtype=np.float32)
    for b, q0, q1, k0, k1 in problem.sequences():
        views = (heads_first(q, q0, q1), heads_first(k, k0, k1), heads_first(v, k0, k1))
        sequence_config = _sequence_config(config, attention, b)
        sequence = _sequence_problem(forward_problem(*views, sequence_config), b)
        out_b, lse_b = cpu.forward(sequence, *views, sequence_config.alibi_slopes, config.sinks)
        out[q0:q1] = out_b[0].transpose(1, 0, 2)
        lse[:, q0:q1] = lse_b[0]
    return out, lse


def flash_attention_varlen_bwd(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=False,
    window_size=0,
    *,
    softmax_scale=None,
    deterministic=False,
    synchronize=True,
    allow_tf32=False,
    check=False,
    softcap=0.0,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    sinks=None,
    head_dim_v=None,
):
    """Gradients of :func:`flash_attention_varlen_fwd` with respect to q, k and v (and the
    attention sinks, when given).

    Parameters
    ----------
    dout, out : arrays, shape ``[total_q, num_heads, head_dim_v]``, dtype of ``q``
        The upstream gradient and the forward output.
    lse : float32 array, shape ``[num_heads, total_q]``
        The forward log-sum-exp.
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        As passed to the forward.
    num_heads, num_kv_heads, head_dim, causal, window_size, softmax_scale, allow_tf32,
    softcap, alibi_slopes, score_mod, mask_mod, block_mask, sinks, head_dim_v
        As passed to the forward.
    deterministic, synchronize : bool
        As in :func:`cuflash.flash_attention_bwd`.
    check : bool
        As in the forward.

    Returns
    -------
    dq : array, shape of ``q``
    dk, dv : arrays, shapes of ``k`` and ``v``
        With GQA the gradients of query heads sharing a KV head are summed. Tokens of
        no sequence (none, when the offsets end at the totals) get zeros.
    dsinks : float32 array ``[num_heads]``, only with ``sinks``
        As in :func:`cuflash.flash_attention_bwd`, summed over every sequence's rows.
    """
    arrays = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    key = plans.signature(
        (*arrays, *(a for a in (alibi_slopes, sinks) if a is not None)),
        (
            "packed",
            max_seqlen_q,
            max_seqlen_k,
            num_heads,
            num_kv_heads,
            head_dim,
            causal,
            window_size,
            softmax_scale,
            deterministic,
            synchronize,
            allow_tf32,
            check,
            softcap,
            score_mod,
            mask_mod,
            block_mask,
            alibi_slopes is None,
            sinks is None,
            head_dim_v,
        ),
    )
    plan = plans.get(key)
    if plan is None:
        for name, flag in (("deterministic", deterministic), ("synchronize", synchronize)):
            check_flag(name, flag)
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
        problem = varlen_problem(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            config,
            check,
            extra_arrays=(("dout", dout), ("out", out)),
        )
        array_module([("q", q), ("lse", lse)])
        check_rank("lse", lse, 2, "[num_heads, total_q]")
        check_dims("lse", lse, (problem.attention.num_heads, problem.total_q), ("heads", "tokens"))
        if lse.dtype != np.float32:
            raise InvalidArgumentError("lse", f"expected dtype float32, got {lse.dtype}")
        if problem.xp is np:
            return _backward_per_sequence(problem, config, dout, q, k, v, out, lse)
        plan = value_dims.backward_plan(
            PackedBackward, problem, dout, q, k, v, out, lse, bool(deterministic)
        )
        plans.remember(key, plan)
    if check:
        verified_offsets(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return plan(
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        synchronize=bool(synchronize),
        alibi_slopes=alibi_slopes,
        sinks=sinks,
    )


def _backward_per_sequence(problem, config, dout, q, k, v, out, lse):
    """The CPU path: one dense backward a sequence, on views (and the sinks' gradient over
    every sequence's rows)."""
    attention = problem.attention
    dq = np.zeros(q.shape, dtype=attention.dtype)
    dk = np.zeros(k.shape, dtype=attention.dtype)
    dv = np.zeros(v.shape, dtype=attention.dtype)
    for b, q0, q1, k0, k1 in problem.sequences():
        views = (
            heads_first(dout, q0, q1),
            heads_first(q, q0, q1),
            heads_first(k, k0, k1),
            heads_first(v, k0, k1),
            heads_first(out, q0, q1),
            np.ascontiguousarray(lse[:, q0:q1])[None],
        )
        # the sinks' gradient over every sequence's rows comes after the loop
        sequence_config = dataclasses.replace(_sequence_config(config, attention, b), sinks=None)
        sequence = _sequence_problem(backward_problem(*views, sequence_config, False, True), b)
        grads = cpu.backward(sequence, *views, sequence_config.alibi_slopes)
        dq[q0:q1] = grads[0][0].transpose(1, 0, 2)
        dk[k0:k1] = grads[1][0].transpose(1, 0, 2)
        dv[k0:k1] = grads[2][0].transpose(1, 0, 2)
    sinks = config.sinks
    if sinks is None:
        return dq, dk, dv
    rows = np.zeros(problem.total_q, dtype=bool)  # the tokens of some sequence
    for _, q0, q1, _, _ in problem.sequences():
        rows[q0:q1] = True
    delta = np.where(rows, attention_sinks.row_deltas(dout, out).T, np.float32(0))
    return dq, dk, dv, attention_sinks.gradient(np, sinks, lse, delta, 0)


@dataclasses.dataclass(frozen=True)
class VarlenVJP:
    """The residuals of one packed forward pass; calling it runs the backward pass
    (``dq, dk, dv = vjp(dout)``, and ``dsinks`` fourth with sinks), any number of times."""

    q: object
    k: object
    v: object
    out: object
    lse: object
    cu_seqlens_q: object
    cu_seqlens_k: object
    max_seqlen_q: int
    max_seqlen_k: int
    config: AttentionConfig  # kv_seq_len unused

    def __call__(self, dout, *, deterministic=False, synchronize=True):
        c = self.config
        return flash_attention_varlen_bwd(
            dout,
            self.q,
            self.k,
            self.v,
            self.out,
            self.lse,
            self.cu_seqlens_q,
            self.cu_seqlens_k,
            self.max_seqlen_q,
            self.max_seqlen_k,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.causal,
            c.window_size,
            deterministic=deterministic,
            synchronize=synchronize,
            **c.keywords(),
        )


def flash_attention_varlen_vjp(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=False,
    window_size=0,
    *,
    softmax_scale=None,
    allow_tf32=False,
    check=False,
    softcap=0.0,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    sinks=None,
    head_dim_v=None,
):
    """:func:`flash_attention_varlen_fwd` plus a :class:`VarlenVJP` that runs the matching
    backward pass: ``out, vjp = flash_attention_varlen_vjp(...)``; ``dq, dk, dv =
    vjp(dout)`` (with ``sinks``, ``dq, dk, dv, dsinks``)."""
    fp8.check_not_fp8([("q", q), ("k", k), ("v", v)])  # FP8 is forward only
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
    offsets = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out, lse = flash_attention_varlen_fwd(
        q,
        k,
        v,
        *offsets,
        num_heads,
        num_kv_heads,
        head_dim,
        causal,
        window_size,
        check=check,
        **config.keywords(),
    )
    return out, VarlenVJP(
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, config
    )
