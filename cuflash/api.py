"""The public functions: forward, backward and the vjp helper (the API reference)."""

import dataclasses

import numpy as np

from . import fp8
from .core.config import AttentionConfig
from .core.problem import backward_problem, forward_problem
from .cpu import dense as cpu
from .fp8_forward import dense_forward
from .gpu import plans, value_dims


def _empty_forward(problem):
    xp = problem.xp
    return (
        xp.empty(problem.out_shape, dtype=problem.dtype),
        xp.empty(problem.lse_shape, dtype=np.float32),
    )


def _empty_backward(problem):
    """No query row: dq is empty and no key receives any gradient (nor any sink)."""
    xp = problem.xp
    grads = (
        xp.empty(problem.q_shape, dtype=problem.dtype),
        xp.zeros(problem.kv_shape, dtype=problem.dtype),
        xp.zeros(problem.v_shape, dtype=problem.dtype),
    )
    return (*grads, xp.zeros(problem.num_heads, np.float32)) if problem.sinks else grads


def _arrays_and_slopes(arrays, alibi_slopes, sinks=None):
    """The arrays of a call's plan signature: the slopes and the sinks join them when
    given (the signature's scalars say which are there)."""
    return (*arrays, *(a for a in (alibi_slopes, sinks) if a is not None))


def flash_attention_fwd(
    q,
    k,
    v,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=False,
    window_size=0,
    kv_seq_len=None,
    *,
    softmax_scale=None,
    allow_tf32=False,
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
    """Fused scaled-dot-product attention, forward pass.

    Parameters
    ----------
    q : cupy.ndarray or numpy.ndarray, shape ``[B, num_heads, S_q, head_dim]``
        Queries; float32, float16 or bfloat16 (``ml_dtypes.bfloat16``). Any
        strides with a unit last stride are used without a copy (e.g. a
        ``[B, S, H, D]`` buffer passed as ``x.transpose(0, 2, 1, 3)``).
    k, v : same kind and dtype as ``q``, shapes ``[B, num_kv_heads, S_k, head_dim]`` and
        ``[B, num_kv_heads, S_k, head_dim_v]``
        Keys and values. ``num_kv_heads`` must divide ``num_heads`` (GQA/MQA):
        query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    num_heads, num_kv_heads, head_dim : int
        Must agree with the shapes. ``head_dim`` is a multiple of 8, 8 to 256.
    causal : bool, default False
        Bottom-right aligned: query row ``i`` is at position
        ``p = i + S_k - S_q`` and sees key ``j`` iff ``j <= p``.
    window_size : int or (int, int), default 0
        ``w > 0`` keeps keys with ``j > p - w``; ``0`` means no window. A
        ``(left, right)`` tuple has FlashAttention-2's meaning
        (``p - left <= j <= p + right``, ``-1`` unbounded); ``causal`` sets
        ``right = 0``.
    kv_seq_len : int, optional
        Read only keys ``0 .. kv_seq_len - 1`` (``0 <= kv_seq_len <= S_k``);
        ``S_k`` stays the memory extent, so a KV-cache buffer needs no copy.
        Causal and window positions use this effective length.
    softmax_scale : float, optional, keyword-only
        Multiplies ``q . k``; defaults to ``1 / sqrt(head_dim)``.
    allow_tf32 : bool, default False, keyword-only
        float32 only: let the GPU's tensor cores (compute capability 8.0 and
        newer) take every product in TF32, operands rounded to 10 mantissa
        bits, at relative errors of about 5e-4 instead of 4e-7 (see the
        performance page). Without it, float32 keeps float32 accuracy: on
        H100/H200 on the 16-bit tensor cores at every ``head_dim`` (each operand
        as two float16 pieces, three products each; 2x-4x torch's efficient
        float32 attention), on other GPUs on the general kernels.
        Ignored for float16/bfloat16 and on the CPU path, which is float32
        throughout.
    softcap : float, default 0.0, keyword-only
        Soft-capping (Gemma 2): each score ``s = softmax_scale * q . k``
        becomes ``softcap * tanh(s / softcap)``; 0 is off.
    alibi_slopes : float32 array ``[num_heads]`` or ``[B, num_heads]``, optional
        ALiBi: adds ``-slope * |p - j|`` to the score of query row ``i``
        (position ``p = i + S_k - S_q``, with ``kv_seq_len`` for ``S_k``) and
        key ``j``, after the soft-cap (FlashAttention-2's meaning). The
        backward must be given the same ``softcap`` and ``alibi_slopes``.
    score_mod : cuflash.modifiers.ScoreMod, optional, keyword-only
        A user-defined score function ``(score, b, h, q_idx, kv_idx) -> score``
        applied after the built-in modifiers (``b`` the batch entry, ``h`` the query
        head, ``q_idx``/``kv_idx`` the row and key indices); its derivative enters the
        backward. Compiled into the kernels on first use (cached by its code); its
        arrays must be CuPy arrays on the current device for a GPU call.
    mask_mod : cuflash.modifiers.MaskMod, optional, keyword-only
        A user-defined mask ``(b, h, q_idx, kv_idx) -> bool``: a key is visible when
        the causal/window rule and the mask both allow it. Evaluated on every
        element; for speed give it through ``block_mask``.
    block_mask : cuflash.block_mask.BlockMask, optional, keyword-only
        A mask function with its tile classification
        (:func:`cuflash.block_mask.create_block_mask`, made once for calls of these
        sizes and reused): the kernels skip the tiles it empties and evaluate the
        mask only on the tiles it cuts. Instead of ``mask_mod``.
    sinks : float32 array ``[num_heads]``, optional, keyword-only
        Attention sinks (gpt-oss): a learned logit a query head that joins every row's
        softmax with a zero value vector, ``out_i = sum_j exp(s_ij) v_j /
        (exp(sinks[h]) + sum_j exp(s_ij))``; ``lse`` includes it (a row that sees no
        key gives zeros and ``lse = sinks[h]``). Of ``q``'s array kind and device; the
        backward must be given the same array and then also returns ``dsinks``.
    head_dim_v : int, optional, keyword-only
        v's head dim when it differs from q's and k's (MLA training: ``head_dim`` 192,
        ``head_dim_v`` 128); a multiple of 8, 8 to 256; None means ``head_dim``. The
        output (and in the backward dout and dv) have ``head_dim_v`` columns; the
        default ``softmax_scale`` stays ``1 / sqrt(head_dim)``. The backward must be
        given the same value.
    fp8_format : "e4m3", optional, keyword-only
        FP8 inputs (the FP8 page, forward only): ``q``, ``k`` and ``v`` all NumPy
        arrays of ``ml_dtypes.float8_e4m3fn``, or all ``uint8`` arrays (NumPy or CuPy;
        CuPy has no float8 dtype) holding e4m3 bits, which this keyword names. Every
        other option works as with 16-bit inputs; ``allow_tf32`` is ignored.
    q_descale, k_descale, v_descale : float or float32 array ``[B, num_kv_heads]``, optional
        FP8 only, keyword-only: a stored value times its descale is the true value
        (FlashAttention-3's meaning); 1 when not given. The scores are ``softmax_scale *
        (q . k) * q_descale * k_descale``, the output ``(P V) * v_descale``.
    out_dtype : dtype, optional, keyword-only
        FP8 only: the output's dtype, bfloat16 (the default), float16 or float32.

    Returns
    -------
    out : array, shape ``[B, num_heads, S_q, head_dim_v]``, dtype of ``q``
        Contiguous. Rows that see no key are zeros. FP8 inputs: ``out_dtype``.
    lse : array, float32, shape ``[B, num_heads, S_q]``
        Contiguous natural-log sum of ``exp(softmax_scale * q . k)`` over the
        visible keys (and ``exp(sinks[h])``); ``-inf`` for a row that sees no key.

    Raises
    ------
    InvalidArgumentError
        Before any kernel runs, naming the argument and the reason (every
        message is listed in the Troubleshooting page).

    Notes
    -----
    CuPy arrays run on the current device and stream; NumPy arrays run on the
    CPU path with the same semantics. Accumulation is always float32.
    """
    if fp8.requested((q, k, v), fp8_format, q_descale, k_descale, v_descale, out_dtype):
        config = AttentionConfig(
            num_heads,
            num_kv_heads,
            head_dim,
            causal,
            window_size,
            kv_seq_len,
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
        descales = (q_descale, k_descale, v_descale)
        return dense_forward(flash_attention_fwd, q, k, v, config, fp8_format, descales, out_dtype)
    key = plans.signature(
        _arrays_and_slopes((q, k, v), alibi_slopes, sinks),
        (
            num_heads,
            num_kv_heads,
            head_dim,
            causal,
            window_size,
            kv_seq_len,
            softmax_scale,
            allow_tf32,
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
            kv_seq_len,
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
        problem = forward_problem(q, k, v, config)
        if problem.is_empty:
            return _empty_forward(problem)
        if problem.xp is np:
            return cpu.forward(problem, q, k, v, alibi_slopes, sinks)
        from .gpu import launch as gpu  # imported on first GPU use only

        plan = value_dims.forward_plan(gpu.ForwardPlan, problem, q, k, v)
        plans.remember(key, plan)
    return plan(q, k, v, alibi_slopes=alibi_slopes, sinks=sinks)


def flash_attention_bwd(
    dout,
    q,
    k,
    v,
    output,
    lse,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=False,
    window_size=0,
    *,
    kv_seq_len=None,
    softmax_scale=None,
    deterministic=False,
    synchronize=True,
    allow_tf32=False,
    softcap=0.0,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    sinks=None,
    head_dim_v=None,
):
    """Gradients of :func:`flash_attention_fwd` with respect to q, k and v (and the
    attention sinks, when given).

    Parameters
    ----------
    dout : array, shape ``[B, num_heads, S_q, head_dim_v]``, dtype of ``q``
        Gradient of the loss with respect to ``output``.
    q, k, v : arrays
        The forward inputs (shapes and dtypes as in :func:`flash_attention_fwd`).
    output : array, shape ``[B, num_heads, S_q, head_dim_v]``, dtype of ``q``
        The forward output.
    lse : float32 array, shape ``[B, num_heads, S_q]``
        The forward log-sum-exp.
    num_heads, num_kv_heads, head_dim, causal, window_size
        As passed to the forward.
    kv_seq_len, softmax_scale, allow_tf32, softcap, alibi_slopes : keyword-only
        As passed to the forward.
    score_mod, mask_mod, block_mask, head_dim_v : keyword-only
        As passed to the forward.
    sinks : float32 array ``[num_heads]``, optional, keyword-only
        The forward's attention sinks (the same array): ``dsinks`` is returned too.
    deterministic : bool, default False
        Bitwise-reproducible gradients: dQ is computed by its own pass over
        the keys instead of float32 atomics (on H100/H200 on the tensor cores,
        4-10 % slower; past head_dim 128 every call takes that pass).
    synchronize : bool, default True
        Synchronize the current stream before returning, so the gradients
        are complete for a consumer on any stream. ``False`` leaves the work
        stream-ordered (for CUDA-graph capture).

    Returns
    -------
    dq : array, shape of ``q``, dtype of ``q``
    dk, dv : arrays, shapes of ``k`` and ``v``, dtype of ``q``
        With GQA the gradients of query heads sharing a KV head are summed.
        Gradients of keys at or beyond ``kv_seq_len`` are zero. All three are
        contiguous.
    dsinks : float32 array ``[num_heads]``, only with ``sinks``
        ``-sum_{b, i} exp(sinks[h] - lse) Delta`` over batch entries and rows, with
        ``Delta = rowsum(dout * output)`` (a fixed-order reduction: with
        ``deterministic`` the same bits on every run).

    Raises
    ------
    InvalidArgumentError
        Before any kernel runs, naming the argument and the reason (every
        message is listed in the Troubleshooting page).
    """
    key = plans.signature(
        _arrays_and_slopes((dout, q, k, v, output, lse), alibi_slopes, sinks),
        (
            num_heads,
            num_kv_heads,
            head_dim,
            causal,
            window_size,
            kv_seq_len,
            softmax_scale,
            deterministic,
            synchronize,
            allow_tf32,
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
            kv_seq_len,
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
        problem = backward_problem(dout, q, k, v, output, lse, config, deterministic, synchronize)
        if problem.is_empty:
            return _empty_backward(problem)
        if problem.xp is np:
            return cpu.backward(problem, dout, q, k, v, output, lse, alibi_slopes, sinks)
        from .gpu import launch as gpu  # imported on first GPU use only

        plan = value_dims.backward_plan(
            gpu.BackwardPlan,
            problem,
            dout,
            q,
            k,
            v,
            output,
            lse.flags.c_contiguous,
            bool(deterministic),
        )
        plans.remember(key, plan)
    return plan(
        dout,
        q,
        k,
        v,
        output,
        lse,
        synchronize=bool(synchronize),
        alibi_slopes=alibi_slopes,
        sinks=sinks,
    )


@dataclasses.dataclass(frozen=True)
class AttentionVJP:
    """The residuals of one forward pass; calling it runs the backward pass.

    Immutable and free of global state: it may be called any number of times
    (first-order gradients only).

    Attributes
    ----------
    q, k, v, out, lse : arrays
        The forward inputs, output and log-sum-exp.
    config : AttentionConfig
        The forward's non-array arguments.
    """

    q: object
    k: object
    v: object
    out: object
    lse: object
    config: AttentionConfig

    def __call__(self, dout, *, deterministic=False, synchronize=True):
        """Run the backward pass for the upstream gradient ``dout``.

        Parameters
        ----------
        dout : array, shape ``[B, num_heads, S_q, head_dim_v]``, dtype of ``q``
        deterministic, synchronize : bool
            As in :func:`flash_attention_bwd`.

        Returns
        -------
        dq, dk, dv : arrays
            As returned by :func:`flash_attention_bwd` (with ``config.sinks``, ``dsinks``
            after them).
        """
        c = self.config
        return flash_attention_bwd(
            dout,
            self.q,
            self.k,
            self.v,
            self.out,
            self.lse,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.causal,
            c.window_size,
            kv_seq_len=c.kv_seq_len,
            deterministic=deterministic,
            synchronize=synchronize,
            **c.keywords(),
        )


def flash_attention_vjp(
    q,
    k,
    v,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=False,
    window_size=0,
    kv_seq_len=None,
    *,
    softmax_scale=None,
    allow_tf32=False,
    softcap=0.0,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    sinks=None,
    head_dim_v=None,
):
    """Forward pass plus a callable that runs the matching backward pass.

    The stateless replacement for an autograd tape. Arguments are those of
    :func:`flash_attention_fwd` (``sinks`` included: the vjp then returns ``dsinks``
    fourth; ``head_dim_v`` too).

    Returns
    -------
    out : array, shape ``[B, num_heads, S_q, head_dim_v]``
    vjp : AttentionVJP
        ``dq, dk, dv = vjp(dout)``; ``vjp.lse`` and ``vjp.config`` are readable.

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 16, 32), dtype=np.float32) for _ in range(3))
    >>> out, vjp = cuflash.flash_attention_vjp(q, k, v, 2, 2, 32, causal=True)
    >>> dq, dk, dv = vjp(np.ones_like(out))
    >>> dq.shape, dk.shape, vjp.lse.shape
    ((1, 2, 16, 32), (1, 2, 16, 32), (1, 2, 16))
    """
    fp8.check_not_fp8([("q", q), ("k", k), ("v", v)])  # FP8 is forward only
    config = AttentionConfig(
        num_heads,
        num_kv_heads,
        head_dim,
        causal,
        window_size,
        kv_seq_len,
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
    out, lse = flash_attention_fwd(
        q,
        k,
        v,
        num_heads,
        num_kv_heads,
        head_dim,
        causal,
        window_size,
        kv_seq_len,
        **config.keywords(),
    )
    return out, AttentionVJP(q, k, v, out, lse, config)
