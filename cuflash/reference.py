"""The float64 oracle: the plain attention formula with explicit masks.

Slow and memory-hungry (it holds the ``S_q x S_k`` matrix) on purpose: it is
the definition the kernels are tested against, written straight from the
masking rule of the Semantics page, independent of the kernels' tiling and of
:mod:`cuflash.core.masking`.
NumPy arrays in, NumPy float64 arrays out.
"""

import math

import numpy as np

from .modifiers import index_grids


def _mask(q_len, kv_capacity, kv_len, causal, window):
    """``[S_q, S_k]`` booleans from the Semantics page's visible-key rule, written out again."""
    if isinstance(window, (tuple, list)):
        left, right = window
    else:
        left, right = (window - 1, -1) if window > 0 else (-1, -1)
    if causal:
        right = 0
    i = np.arange(q_len)[:, None]
    j = np.arange(kv_capacity)[None, :]
    p = i + kv_len - q_len
    visible = np.broadcast_to(j < kv_len, (q_len, kv_capacity)).copy()
    if left >= 0:
        visible &= j >= p - left
    if right >= 0:
        visible &= j <= p + right
    return visible


def _expand_kv(x, num_heads):
    """Repeat KV heads for the oracle only (the kernels never copy)."""
    return np.repeat(x, num_heads // x.shape[1], axis=1)


def _modified_scores(scores, q_len, kv_len, softcap, alibi_slopes):
    """The built-in score modifiers (see the Semantics page) on scaled scores
    ``[B, H, S_q, S_k]``: ``softcap tanh(s / softcap)``, then ``- slope |p - j|``
    (``p = i + kv_len - q_len``). Returns the scores and their derivative with respect
    to the scaled score (1 without a soft-cap)."""
    derivative = np.ones_like(scores)
    if softcap:
        t = np.tanh(scores / softcap)
        scores, derivative = softcap * t, 1.0 - t * t
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64)
        slopes = slopes[None, :] if slopes.ndim == 1 else slopes  # [B or 1, H]
        i = np.arange(scores.shape[2])[:, None]
        j = np.arange(scores.shape[3])[None, :]
        distance = np.abs(i + kv_len - q_len - j)
        scores = scores - slopes[:, :, None, None] * distance
    return scores, derivative


def _user_modified(raw, derivative, visible, kv_len, score_mod, mask_mod):
    """User-defined modifiers (``cuflash.modifiers``) on the keys in use, in float64:
    the scores, the chained derivative and the visibility."""
    batch, heads, q_len = raw.shape[:3]
    grids = index_grids(batch, heads, q_len, kv_len)
    raw, derivative = raw.copy(), np.broadcast_to(derivative, raw.shape).copy()
    visible = np.broadcast_to(visible, raw.shape).copy()
    if score_mod is not None:
        used = raw[..., :kv_len]
        derivative[..., :kv_len] *= score_mod.numpy_grad(used, *grids, dtype=np.float64)
        raw[..., :kv_len] = score_mod.numpy_scores(used, *grids, dtype=np.float64)
    if mask_mod is not None:
        visible[..., :kv_len] &= mask_mod.numpy_mask(*grids)
    return raw, derivative, visible


def _probabilities(
    q,
    k,
    causal,
    window,
    kv_seq_len,
    softmax_scale,
    given_lse=None,
    softcap=0.0,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    sinks=None,
):
    """Softmax probabilities ``[B, H, S_q, S_k]``, lse ``[B, H, S_q]``, the scale and the
    score modifiers' derivative.

    With ``given_lse``, the probabilities are ``exp(score - given_lse)``, as a
    backward computes them from the log-sum-exp it is handed. With ``sinks`` (``[H]``)
    each row's normalizer has one more term ``exp(sinks[h])`` whose value is zero.
    """
    num_heads, q_len, head_dim = q.shape[1], q.shape[2], q.shape[3]
    kv_capacity = k.shape[2]
    kv_len = kv_capacity if kv_seq_len is None else kv_seq_len
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    visible = _mask(q_len, kv_capacity, kv_len, causal, window)
    raw = scale * q @ np.swapaxes(_expand_kv(k, num_heads), -1, -2)
    raw, derivative = _modified_scores(raw, q_len, kv_len, softcap, alibi_slopes)
    if score_mod is not None or mask_mod is not None:
        raw, derivative, visible = _user_modified(
            raw, derivative, visible, kv_len, score_mod, mask_mod
        )
    scores = np.where(visible, raw, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64)[None, :, None, None]
        row_max = np.maximum(row_max, sink)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.exp(scores - row_max)
    total = weights.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink - row_max)
    seen = total != 0  # rows that see no key sum to 0; a NaN sum stays NaN
    with np.errstate(divide="ignore", invalid="ignore"):
        probs = np.where(seen, weights / total, 0.0)
        lse = np.where(seen[..., 0], np.log(total[..., 0]) + row_max[..., 0], -np.inf)
        if given_lse is not None:
            given = np.asarray(given_lse, dtype=np.float64)[..., None]
            probs = np.where(np.isfinite(given), np.exp(scores - given), 0.0)
    return probs, lse, scale, derivative


def attention_reference(
    q,
    k,
    v,
    causal=False,
    window=0,
    kv_seq_len=None,
    softmax_scale=None,
    softcap=0.0,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    sinks=None,
):
    """Return ``(out, lse)`` in float64.

    Parameters
    ----------
    q, k, v : array_like, ``[B, H, S_q, D]``, ``[B, H_kv, S_k, D]`` and ``[B, H_kv, S_k, D_v]``
        Any real dtype; heads and head dims are read from the shapes (v's ``D_v`` may
        differ from ``D``; the default scale is ``1 / sqrt(D)``).
    causal : bool
    window : int or (int, int)
        ``window_size`` of :func:`cuflash.flash_attention_fwd`.
    kv_seq_len : int, optional
    softmax_scale : float, optional
    softcap : float, optional
    alibi_slopes : array_like ``[H]`` or ``[B, H]``, optional
        The score modifiers of the Semantics page.
    score_mod, mask_mod : cuflash.modifiers.ScoreMod, MaskMod, optional
        User-defined modifiers, evaluated in float64 after the built-in ones.
    sinks : array_like ``[H]``, optional
        Attention sinks: ``exp(sinks[h])`` joins each row's normalizer, its value zero.

    Returns
    -------
    out : numpy.ndarray, float64 ``[B, H, S_q, D_v]``
        Zeros in rows that see no key.
    lse : numpy.ndarray, float64 ``[B, H, S_q]``
        ``-inf`` in rows that see no key (``sinks[h]`` with sinks).
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    probs, lse, _, _ = _probabilities(
        q,
        k,
        causal,
        window,
        kv_seq_len,
        softmax_scale,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        score_mod=score_mod,
        mask_mod=mask_mod,
        sinks=sinks,
    )
    return probs @ _expand_kv(v, q.shape[1]), lse


def attention_reference_grad(
    dout,
    q,
    k,
    v,
    causal=False,
    window=0,
    kv_seq_len=None,
    softmax_scale=None,
    out=None,
    lse=None,
    softcap=0.0,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    sinks=None,
):
    """Return ``(dq, dk, dv)`` in float64, the exact gradients of the oracle (and
    ``dsinks`` ``[H]`` after them with ``sinks``).

    Parameters
    ----------
    dout : array_like, ``[B, H, S_q, D_v]``
        Gradient of the loss with respect to the output.
    q, k, v, causal, window, kv_seq_len, softmax_scale, softcap, alibi_slopes
    score_mod, mask_mod, sinks
        As in :func:`attention_reference`.
    out : array_like, ``[B, H, S_q, D_v]``, optional
        An output to take ``Delta = rowsum(dout * out)`` from, as the flash
        backward does, instead of the exact one. Given the output rounded to
        the input dtype, the result is exactly what a backward computes from
        that rounded output: its difference from the exact gradients is an
        error that every backward of this API inherits from its ``out``.
    lse : array_like, ``[B, H, S_q]``, optional
        A log-sum-exp to take the probabilities from (``exp(score - lse)``),
        likewise: the backward inherits the error of the ``lse`` it is given.

    Returns
    -------
    dq : numpy.ndarray, float64, shape of ``q``
    dk, dv : numpy.ndarray, float64, shapes of ``k`` and ``v``
        With GQA the gradients of query heads that share a KV head are summed.
    dsinks : numpy.ndarray, float64 ``[H]``, only with ``sinks``
        ``-sum_{b, i} exp(sinks[h] - lse) Delta`` (the sink's probability times Delta).
    """
    dout, q, k, v = (np.asarray(a, dtype=np.float64) for a in (dout, q, k, v))
    num_heads = q.shape[1]
    num_kv_heads, kv_capacity = k.shape[1], k.shape[2]
    probs, row_lse, scale, derivative = _probabilities(
        q,
        k,
        causal,
        window,
        kv_seq_len,
        softmax_scale,
        lse,
        softcap,
        alibi_slopes,
        score_mod,
        mask_mod,
        sinks,
    )
    ke, ve = _expand_kv(k, num_heads), _expand_kv(v, num_heads)
    dv = np.swapaxes(probs, -1, -2) @ dout
    dprobs = dout @ np.swapaxes(ve, -1, -2)
    if out is None:
        delta = (dprobs * probs).sum(axis=-1, keepdims=True)
    else:
        delta = (dout * np.asarray(out, dtype=np.float64)).sum(axis=-1, keepdims=True)
    dscores = probs * (dprobs - delta) * derivative
    dq = scale * dscores @ ke
    dk = scale * np.swapaxes(dscores, -1, -2) @ q
    group = num_heads // num_kv_heads
    fold = (q.shape[0], num_kv_heads, group, kv_capacity)
    dk, dv = (x.reshape(*fold, x.shape[3]).sum(axis=2) for x in (dk, dv))
    grads = dq, dk, dv
    if sinks is None:
        return grads
    if lse is not None:
        row_lse = np.asarray(lse, dtype=np.float64)
    sink = np.asarray(sinks, dtype=np.float64)[None, :, None]
    with np.errstate(invalid="ignore"):
        share = np.where(np.isneginf(row_lse), 0.0, np.exp(sink - row_lse))
    return (*grads, -(share * delta[..., 0]).sum(axis=(0, 2)))
