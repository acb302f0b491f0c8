"""Packed batches of variable-length sequences (SPEC section 7).

The tokens of every sequence lie end to end, ``q`` as ``[total_q, num_heads,
head_dim]`` and ``k``, ``v`` as ``[total_k, num_kv_heads, head_dim]``, and the
int32 offsets ``cu_seqlens_q`` / ``cu_seqlens_k`` (``[B + 1]``, 0 first, the
totals last) say where each one starts. Sequence ``b`` is its own attention
problem with the semantics of the dense functions.

This version runs each sequence as one dense call on views of the packed
arrays (no copy into a padded layout; NumPy and CuPy alike), so every kernel
and option of the dense functions serves it. The offsets are read on the host
once a call: device-held ones are copied (one small transfer, which
synchronizes the stream) and checked like host-held ones, so a bad offset
never reaches a kernel. A kernel that reads the offsets itself, without the
copy and with one launch for the whole batch, is the next step (the
performance page says where this version stands).
"""

import dataclasses

import numpy as np

from .api import flash_attention_bwd, flash_attention_fwd
from .errors import InvalidArgumentError
from .problem import (_array_module, _check_dtypes, _check_flag, _check_rank, _count,
                      check_dims, check_head_counts, check_int32)


@dataclasses.dataclass(frozen=True)
class VarlenProblem:
    """A validated packed batch: shapes, host copies of the offsets and the options."""

    xp: object
    dtype: np.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    total_q: int
    total_k: int
    offsets_q: tuple  # host ints, B + 1 of them
    offsets_k: tuple

    @property
    def batch(self):
        return len(self.offsets_q) - 1

    def sequences(self):
        """``(b, q0, q1, k0, k1)`` for every sequence with at least one query row."""
        for b in range(self.batch):
            q0, q1 = self.offsets_q[b], self.offsets_q[b + 1]
            if q1 > q0:
                yield b, q0, q1, self.offsets_k[b], self.offsets_k[b + 1]


def _host_offsets(offsets, xp):
    """The offsets as host ints (one device-to-host copy for a CuPy array)."""
    host = offsets if xp is np else xp.asnumpy(offsets)
    return tuple(int(x) for x in np.asarray(host))


def _check_offsets(name, offsets, total, max_name, max_seqlen, tokens):
    """0 first, nondecreasing, ``total`` last, every length within ``max_seqlen``."""
    if offsets[0] != 0:
        raise InvalidArgumentError(name, f"must start at 0, got {offsets[0]}")
    for b in range(len(offsets) - 1):
        length = offsets[b + 1] - offsets[b]
        if length < 0:
            raise InvalidArgumentError(
                name, f"sequence {b}: offsets decrease ({offsets[b]} then {offsets[b + 1]})")
        if length > max_seqlen:
            raise InvalidArgumentError(
                name, f"sequence {b}: length {length} exceeds {max_name} = {max_seqlen}")
    if offsets[-1] != total:
        raise InvalidArgumentError(
            name, f"the last offset {offsets[-1]} differs from {tokens}'s {total} tokens")


def varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   num_heads, num_kv_heads, head_dim, extra_arrays=()):
    """Validate a packed call (offsets read on the host; nothing runs before this
    returns)."""
    named = [("q", q), ("k", k), ("v", v), *extra_arrays]
    xp = _array_module(named + [("cu_seqlens_q", cu_seqlens_q),
                                ("cu_seqlens_k", cu_seqlens_k)])
    for name, a in (("q", q), ("k", k), ("v", v), *extra_arrays):
        _check_rank(name, a, 3, "[tokens, heads, head_dim]")
    dtype = _check_dtypes(named)
    num_heads, num_kv_heads, head_dim = check_head_counts(num_heads, num_kv_heads, head_dim)
    labels = ("tokens", "heads", "head_dim")
    check_dims("q", q, (None, num_heads, head_dim), labels)
    for name, a in (("k", k), ("v", v)):
        check_dims(name, a, (k.shape[0], num_kv_heads, head_dim), labels)
    for name, a in extra_arrays:
        check_dims(name, a, q.shape, labels)
    for name, offsets in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_rank(name, offsets, 1, "[B + 1]")
    check_int32("cu_seqlens_q", cu_seqlens_q, (max(1, cu_seqlens_q.shape[0]),), "[B + 1]")
    check_int32("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape, "[B + 1]")
    max_seqlen_q = _count("max_seqlen_q", max_seqlen_q, 0)
    max_seqlen_k = _count("max_seqlen_k", max_seqlen_k, 0)
    offsets_q = _host_offsets(cu_seqlens_q, xp)
    offsets_k = _host_offsets(cu_seqlens_k, xp)
    _check_offsets("cu_seqlens_q", offsets_q, q.shape[0], "max_seqlen_q", max_seqlen_q, "q")
    _check_offsets("cu_seqlens_k", offsets_k, k.shape[0], "max_seqlen_k", max_seqlen_k, "k")
    return VarlenProblem(xp=xp, dtype=dtype, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, total_q=q.shape[0], total_k=k.shape[0],
                         offsets_q=offsets_q, offsets_k=offsets_k)


def _heads_first(x, start, stop):
    """Tokens ``[start, stop)`` of a packed ``[tokens, heads, D]`` array as a
    ``[1, heads, n, D]`` view (unit last stride: the dense functions take it as it is)."""
    return x[start:stop][None].transpose(0, 2, 1, 3)


def flash_attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, num_heads, num_kv_heads, head_dim, causal=False,
                               window_size=0, *, softmax_scale=None, allow_tf32=False,
                               check=False):
    """Attention over a packed batch of variable-length sequences, forward pass.

    Parameters
    ----------
    q : cupy.ndarray or numpy.ndarray, shape ``[total_q, num_heads, head_dim]``
        The queries of every sequence end to end; float32, float16 or bfloat16.
    k, v : arrays, shape ``[total_k, num_kv_heads, head_dim]``
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
    check : bool, default False
        Accepted for the SPEC's signature: the offsets are always read on the host and
        checked in this version (one transfer when they live on the GPU).

    Returns
    -------
    out : array, shape ``[total_q, num_heads, head_dim]``, dtype of ``q``
    lse : float32 array, shape ``[num_heads, total_q]`` (FlashAttention-2's layout)

    Raises
    ------
    InvalidArgumentError
        Before any kernel runs: shapes, dtypes, devices, offsets of the wrong length or
        dtype, not starting at 0, decreasing, disagreeing with the totals, or a length
        above ``max_seqlen_*`` (naming the sequence).
    """
    _check_flag("check", check)
    problem = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             num_heads, num_kv_heads, head_dim)
    xp = problem.xp
    out = xp.zeros(q.shape, dtype=problem.dtype)
    lse = xp.full((problem.num_heads, problem.total_q), -np.inf, dtype=np.float32)
    for _, q0, q1, k0, k1 in problem.sequences():
        out_b, lse_b = flash_attention_fwd(
            _heads_first(q, q0, q1), _heads_first(k, k0, k1), _heads_first(v, k0, k1),
            problem.num_heads, problem.num_kv_heads, problem.head_dim, causal, window_size,
            softmax_scale=softmax_scale, allow_tf32=allow_tf32)
        out[q0:q1] = out_b[0].transpose(1, 0, 2)
        lse[:, q0:q1] = lse_b[0]
    return out, lse


def flash_attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads, head_dim,
                               causal=False, window_size=0, *, softmax_scale=None,
                               deterministic=False, synchronize=True, allow_tf32=False,
                               check=False):
    """Gradients of :func:`flash_attention_varlen_fwd` with respect to q, k and v.

    Parameters
    ----------
    dout, out : arrays, shape ``[total_q, num_heads, head_dim]``, dtype of ``q``
        The upstream gradient and the forward output.
    lse : float32 array, shape ``[num_heads, total_q]``
        The forward log-sum-exp.
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        As passed to the forward.
    num_heads, num_kv_heads, head_dim, causal, window_size, softmax_scale, allow_tf32
        As passed to the forward.
    deterministic, synchronize : bool
        As in :func:`cuflash.flash_attention_bwd`.
    check : bool
        As in the forward.

    Returns
    -------
    dq : array, shape of ``q``
    dk, dv : arrays, shape of ``k``
        With GQA the gradients of query heads sharing a KV head are summed. Tokens of
        no sequence (none, when the offsets end at the totals) get zeros.
    """
    for name, flag in (("check", check), ("deterministic", deterministic),
                       ("synchronize", synchronize)):
        _check_flag(name, flag)
    problem = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             num_heads, num_kv_heads, head_dim,
                             extra_arrays=(("dout", dout), ("out", out)))
    xp = problem.xp
    _array_module([("q", q), ("lse", lse)])
    _check_rank("lse", lse, 2, "[num_heads, total_q]")
    check_dims("lse", lse, (problem.num_heads, problem.total_q), ("heads", "tokens"))
    if lse.dtype != np.float32:
        raise InvalidArgumentError("lse", f"expected dtype float32, got {lse.dtype}")
    dq = xp.zeros(q.shape, dtype=problem.dtype)
    dk = xp.zeros(k.shape, dtype=problem.dtype)
    dv = xp.zeros(v.shape, dtype=problem.dtype)
    for _, q0, q1, k0, k1 in problem.sequences():
        grads = flash_attention_bwd(
            _heads_first(dout, q0, q1), _heads_first(q, q0, q1), _heads_first(k, k0, k1),
            _heads_first(v, k0, k1), _heads_first(out, q0, q1),
            xp.ascontiguousarray(lse[:, q0:q1])[None], problem.num_heads,
            problem.num_kv_heads, problem.head_dim, causal, window_size,
            softmax_scale=softmax_scale, deterministic=deterministic, synchronize=False,
            allow_tf32=allow_tf32)
        dq[q0:q1] = grads[0][0].transpose(1, 0, 2)
        dk[k0:k1] = grads[1][0].transpose(1, 0, 2)
        dv[k0:k1] = grads[2][0].transpose(1, 0, 2)
    if synchronize and xp is not np:
        xp.cuda.get_current_stream().synchronize()
    return dq, dk, dv


@dataclasses.dataclass(frozen=True)
class VarlenVJP:
    """The residuals of one packed forward pass; calling it runs the backward pass
    (``dq, dk, dv = vjp(dout)``), any number of times."""

    q: object
    k: object
    v: object
    out: object
    lse: object
    cu_seqlens_q: object
    cu_seqlens_k: object
    max_seqlen_q: int
    max_seqlen_k: int
    config: object  # cuflash.AttentionConfig (kv_seq_len unused)

    def __call__(self, dout, *, deterministic=False, synchronize=True):
        c = self.config
        return flash_attention_varlen_bwd(
            dout, self.q, self.k, self.v, self.out, self.lse, self.cu_seqlens_q,
            self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k, c.num_heads,
            c.num_kv_heads, c.head_dim, c.causal, c.window_size, softmax_scale=c.softmax_scale,
            deterministic=deterministic, synchronize=synchronize, allow_tf32=c.allow_tf32)


def flash_attention_varlen_vjp(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, num_heads, num_kv_heads, head_dim, causal=False,
                               window_size=0, *, softmax_scale=None, allow_tf32=False,
                               check=False):
    """:func:`flash_attention_varlen_fwd` plus a :class:`VarlenVJP` that runs the matching
    backward pass: ``out, vjp = flash_attention_varlen_vjp(...)``; ``dq, dk, dv =
    vjp(dout)``."""
    from .api import AttentionConfig

    out, lse = flash_attention_varlen_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, num_heads,
        num_kv_heads, head_dim, causal, window_size, softmax_scale=softmax_scale,
        allow_tf32=allow_tf32, check=check)
    config = AttentionConfig(num_heads, num_kv_heads, head_dim, causal, window_size, None,
                             softmax_scale, allow_tf32)
    return out, VarlenVJP(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, config)
