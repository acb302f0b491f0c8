#!/usr/bin/env python
"""Train a small causal transformer language model with cuflash attention.

Everything except attention is plain array code -- NumPy on the CPU, CuPy on
a GPU, the same lines for both -- with a hand-written backward pass for every
layer. Attention is :func:`cuflash.flash_attention_vjp`: its forward returns
the output and a ``vjp`` object, and calling ``vjp(dout)`` gives
``dq, dk, dv``, so no autograd framework is needed.

The tasks
---------
Both are generated on the fly (nothing to download), and in both the token to
predict sits at another position of the sequence, so the only way to beat
chance is to fetch it with attention -- a model without attention cannot.

``reverse`` (the default): ``n`` random symbols, a separator, then the same
symbols backwards; scored on the reversed half::

    s7 s1 s42 ... s9 | s9 ... s42 s1 s7

``recall`` (multi-query associative recall): ``n`` key-value pairs, a
separator, then every key again in random order, each followed by its value;
scored on the values after the queries::

    k12 v40 k3 v7 k51 v7 ... | k3 v7 k12 v40 ...

Reverse needs one attention hop per token, at a fixed offset, and is learnt
in a few hundred steps. Recall needs an "induction" circuit over two layers
(find the earlier copy of the query key, read the token after it) and is much
slower: the model first sits for thousands of steps on a plateau where it
only guesses among the values in the context. On an H200,
``--task recall --items 8 --symbols 32 --steps 10000`` left that plateau
(20 %) after about 2,500 steps and reached 100 % in under two minutes; the
default sizes and the target are set for ``reverse``.

The model
---------
Token embedding + learned positional embedding, ``num_layers`` pre-LayerNorm
blocks (multi-head causal attention with optional grouped-query attention, a
GELU MLP), a final LayerNorm and an output projection (tied to the token
embedding by default), softmax cross-entropy on the scored positions. Adam
with optional decoupled weight decay and global-norm gradient clipping.

At start-up the hand-written gradients are checked against central finite
differences in float64 on a tiny model (``--skip-gradcheck`` skips it).

Examples
--------
A quick run on the CPU (well under a minute)::

    python examples/train_tiny_lm.py --tiny --device cpu --plot loss.png

The full run on a GPU (under a minute on an H200; 100 % held-out accuracy
against a target of 95 %)::

    python examples/train_tiny_lm.py --device gpu --require-target --plot loss.png

The harder task::

    python examples/train_tiny_lm.py --device gpu --task recall --items 8 \
        --symbols 32 --steps 10000 --eval-every 500
"""

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np

try:
    import cuflash
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import cuflash
from cuflash.reference import attention_reference, attention_reference_grad

try:
    import cupy
except Exception:  # CuPy is optional: the CPU path needs only NumPy
    cupy = None


# ---------------------------------------------------------------------------
# Arrays and devices
# ---------------------------------------------------------------------------


def array_module(a):
    """Return :mod:`cupy` for a CuPy array, else :mod:`numpy`."""
    return cupy.get_array_module(a) if cupy is not None else np


def to_numpy(a):
    """Copy an array (or 0-d array) to a NumPy array on the host."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def gpu_available():
    """True when CuPy is installed and sees a CUDA device."""
    return cupy is not None and cupy.is_available()


def select_array_module(device):
    """Return numpy or cupy for ``--device`` (``auto``, ``gpu`` or ``cpu``).

    Raises
    ------
    SystemExit
        When ``gpu`` is asked for and no GPU is usable.
    """
    if device == "cpu":
        return np
    if gpu_available():
        return cupy
    if device == "gpu":
        raise SystemExit("error: --device gpu, but CuPy sees no CUDA device")
    return np


def attention_dtype(name):
    """The NumPy dtype for ``--dtype`` (bfloat16 comes from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# ---------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReverseTask:
    """Write a random sequence backwards (see the module docstring).

    Token ids: symbols ``0 .. num_symbols - 1``, then one separator.
    """

    length: int = 32
    num_symbols: int = 64

    @property
    def vocab_size(self):
        """The symbols and the separator."""
        return self.num_symbols + 1

    @property
    def seq_len(self):
        """Length of the model's input (the full sequence minus its last token)."""
        return 2 * self.length

    @property
    def chance(self):
        """Accuracy of a model that ignores the context."""
        return 1.0 / self.num_symbols

    def describe(self):
        """One line for the log."""
        return (
            f"reverse {self.length} symbols of {self.num_symbols}, sequence length {self.seq_len}"
        )

    def sample(self, rng, batch_size):
        """Draw a batch of sequences.

        Parameters
        ----------
        rng : numpy.random.Generator
        batch_size : int

        Returns
        -------
        inputs, targets : numpy.ndarray of int32, shape ``[batch_size, seq_len]``
            ``targets`` is ``inputs`` shifted left by one token.
        mask : numpy.ndarray of bool, shape ``[batch_size, seq_len]``
            True where the target is a token of the reversed half (the scored
            positions).
        """
        n = self.length
        symbols = rng.integers(0, self.num_symbols, (batch_size, n))
        seq = np.empty((batch_size, 2 * n + 1), dtype=np.int32)
        seq[:, :n] = symbols
        seq[:, n] = self.num_symbols  # separator
        seq[:, n + 1 :] = symbols[:, ::-1]
        mask = np.zeros((batch_size, self.seq_len), dtype=bool)
        mask[:, n:] = True
        return seq[:, :-1], seq[:, 1:], mask


@dataclasses.dataclass(frozen=True)
class RecallTask:
    """Multi-query associative recall (see the module docstring).

    Token ids: keys ``0 .. num_keys - 1``, values ``num_keys ..
    num_keys + num_values - 1``, then one separator.
    """

    num_pairs: int = 16
    num_queries: int = 16
    num_keys: int = 64
    num_values: int = 64

    def __post_init__(self):
        if not 1 <= self.num_queries <= self.num_pairs <= self.num_keys:
            raise ValueError("need 1 <= num_queries <= num_pairs <= num_keys")

    @property
    def vocab_size(self):
        """Keys, values and the separator."""
        return self.num_keys + self.num_values + 1

    @property
    def seq_len(self):
        """Length of the model's input (the full sequence minus its last token)."""
        return 2 * self.num_pairs + 2 * self.num_queries

    @property
    def chance(self):
        """Accuracy of a model that ignores the context."""
        return 1.0 / self.num_values

    def describe(self):
        """One line for the log."""
        return (
            f"recall: {self.num_pairs} key-value pairs, {self.num_queries} queries, "
            f"{self.num_keys} keys, {self.num_values} values, "
            f"sequence length {self.seq_len}"
        )

    def sample(self, rng, batch_size):
        """Draw a batch of sequences; returns as :meth:`ReverseTask.sample`.

        The mask is true where the input is a query key (the target is its value).
        """
        n, m = self.num_pairs, self.num_queries
        keys = np.argsort(rng.random((batch_size, self.num_keys)), axis=1)[:, :n]
        values = self.num_keys + rng.integers(0, self.num_values, (batch_size, n))
        asked = np.argsort(rng.random((batch_size, n)), axis=1)[:, :m]
        seq = np.empty((batch_size, 2 * n + 2 * m + 1), dtype=np.int32)
        seq[:, 0 : 2 * n : 2] = keys
        seq[:, 1 : 2 * n : 2] = values
        seq[:, 2 * n] = self.num_keys + self.num_values  # separator
        seq[:, 2 * n + 1 :: 2] = np.take_along_axis(keys, asked, axis=1)
        seq[:, 2 * n + 2 :: 2] = np.take_along_axis(values, asked, axis=1)
        mask = np.zeros((batch_size, self.seq_len), dtype=bool)
        mask[:, 2 * n + 1 :: 2] = True
        return seq[:, :-1], seq[:, 1:], mask


def make_task(name, items, symbols):
    """``reverse``: ``items`` symbols of ``symbols``; ``recall``: ``items``
    pairs, all queried, ``symbols`` keys and as many values."""
    if name == "reverse":
        return ReverseTask(items, symbols)
    return RecallTask(items, items, symbols, symbols)


# ---------------------------------------------------------------------------
# Model configuration and parameters
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the transformer."""

    vocab_size: int
    seq_len: int
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    mlp_ratio: int = 4
    tie_embeddings: bool = True
    sinks: bool = False  # a learned attention sink a head (gpt-oss), trained with dsinks

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError("d_model must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_kv_heads must divide num_heads")

    @property
    def head_dim(self):
        """Width of one attention head."""
        return self.d_model // self.num_heads

    def parameter_shapes(self):
        """``{name: shape}`` of every parameter, in a fixed order."""
        d, hidden = self.d_model, self.mlp_ratio * self.d_model
        qkv_width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        shapes = {"tok_emb": (self.vocab_size, d), "pos_emb": (self.seq_len, d)}
        for i in range(self.num_layers):
            shapes.update(
                {
                    f"layers.{i}.ln1.g": (d,),
                    f"layers.{i}.ln1.b": (d,),
                    f"layers.{i}.attn.wqkv": (d, qkv_width),
                    f"layers.{i}.attn.wo": (self.num_heads * self.head_dim, d),
                    f"layers.{i}.ln2.g": (d,),
                    f"layers.{i}.ln2.b": (d,),
                    f"layers.{i}.mlp.w1": (d, hidden),
                    f"layers.{i}.mlp.b1": (hidden,),
                    f"layers.{i}.mlp.w2": (hidden, d),
                    f"layers.{i}.mlp.b2": (d,),
                }
            )
            if self.sinks:
                shapes[f"layers.{i}.attn.sinks"] = (self.num_heads,)
        shapes.update({"ln_f.g": (d,), "ln_f.b": (d,)})
        if not self.tie_embeddings:
            shapes["head"] = (d, self.vocab_size)
        return shapes


class Parameters:
    """All parameters as views into one flat buffer.

    The optimizer and the gradient clipping then work on a single array (a
    handful of kernel launches per step on a GPU, whatever the model size).

    Parameters
    ----------
    shapes : dict
        ``{name: shape}``, as from :meth:`ModelConfig.parameter_shapes`.
    flat : array
        The 1-D buffer holding every parameter, in the order of ``shapes``.
    """

    def __init__(self, shapes, flat):
        self.shapes = dict(shapes)
        self.flat = flat
        self.views = {}
        offset = 0
        for name, shape in self.shapes.items():
            size = math.prod(shape)
            self.views[name] = flat[offset : offset + size].reshape(shape)
            offset += size
        if offset != flat.size:
            raise ValueError("flat buffer size does not match the shapes")

    def __getitem__(self, name):
        return self.views[name]

    def __iter__(self):
        return iter(self.shapes)

    def flatten(self, grads):
        """Concatenate ``{name: gradient}`` into one buffer laid out like ``flat``."""
        xp = array_module(self.flat)
        return xp.concatenate([grads[name].ravel() for name in self.shapes])


def init_parameters(cfg, xp, dtype, seed):
    """GPT-2 style initialisation, drawn on the host so CPU and GPU runs agree.

    Weights are normal with standard deviation 0.02 (the projections into
    the residual stream scaled by ``1 / sqrt(2 * num_layers)``), LayerNorm
    gains one, biases zero.

    Returns
    -------
    Parameters
    """
    rng = np.random.default_rng(seed)
    residual_std = 0.02 / math.sqrt(2 * cfg.num_layers)
    host = {}
    for name, shape in cfg.parameter_shapes().items():
        if name.endswith(".g"):
            host[name] = np.ones(shape)
        elif name.endswith((".b", ".b1", ".b2", ".sinks")):
            host[name] = np.zeros(shape)
        else:
            std = residual_std if name.endswith((".wo", ".w2")) else 0.02
            host[name] = rng.normal(0.0, std, shape)
    flat = np.concatenate([a.ravel() for a in host.values()]).astype(dtype)
    return Parameters(cfg.parameter_shapes(), xp.asarray(flat))


# ---------------------------------------------------------------------------
# Layers: each forward returns (output, cache); each backward takes the cache
# ---------------------------------------------------------------------------


def matmul_grad(x, dy):
    """Gradient of ``x @ w`` with respect to ``w``: ``x^T dy`` over all leading axes."""
    return x.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])


def embedding_forward(ids, tok_emb, pos_emb):
    """Token plus positional embedding of ``ids`` (``[B, S]`` ints) -> ``[B, S, d]``."""
    return tok_emb[ids] + pos_emb[: ids.shape[1]]


def embedding_backward(dx, ids, vocab_size):
    """Return ``(d_tok_emb, d_pos_emb)``; repeated tokens add up."""
    xp = array_module(dx)
    d_tok = xp.zeros((vocab_size, dx.shape[-1]), dtype=dx.dtype)
    xp.add.at(d_tok, ids.ravel(), dx.reshape(-1, dx.shape[-1]))
    return d_tok, dx.sum(axis=0)


def layer_norm_forward(x, g, b, eps=1e-5):
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * g + b``."""
    mean = x.mean(axis=-1, keepdims=True)
    centered = x - mean
    rstd = 1.0 / (((centered * centered).mean(axis=-1, keepdims=True) + eps) ** 0.5)
    xhat = centered * rstd
    return xhat * g + b, (xhat, rstd, g)


def layer_norm_backward(dy, cache):
    """Return ``(dx, dg, db)``."""
    xhat, rstd, g = cache
    dxhat = dy * g
    dx = rstd * (
        dxhat
        - dxhat.mean(axis=-1, keepdims=True)
        - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
    )
    sum_axes = tuple(range(dy.ndim - 1))
    return dx, (dy * xhat).sum(axis=sum_axes), dy.sum(axis=sum_axes)


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_forward(x):
    """GELU, tanh approximation: ``0.5 x (1 + tanh(c (x + 0.044715 x^3)))``."""
    t = array_module(x).tanh(_GELU_C * (x + 0.044715 * x**3))
    return 0.5 * x * (1.0 + t), (x, t)


def gelu_backward(dy, cache):
    """Return ``dx`` for :func:`gelu_forward`."""
    x, t = cache
    du_dx = _GELU_C * (1.0 + 3 * 0.044715 * x * x)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du_dx)


def mlp_forward(x, w1, b1, w2, b2):
    """``gelu(x @ w1 + b1) @ w2 + b2``."""
    act, gelu_cache = gelu_forward(x @ w1 + b1)
    return act @ w2 + b2, (x, act, gelu_cache)


def mlp_backward(dy, cache, w1, w2):
    """Return ``(dx, dw1, db1, dw2, db2)``."""
    x, act, gelu_cache = cache
    dh = gelu_backward(dy @ w2.T, gelu_cache)
    sum_axes = tuple(range(dy.ndim - 1))
    return (
        dh @ w1.T,
        matmul_grad(x, dh),
        dh.sum(axis=sum_axes),
        matmul_grad(act, dy),
        dy.sum(axis=sum_axes),
    )


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """Which attention the model calls, and in which dtype.

    Attributes
    ----------
    vjp : callable
        Same signature and result as :func:`cuflash.flash_attention_vjp`.
    dtype : numpy.dtype
        q, k and v are cast to it before the call; the output and the
        gradients are cast back to the activations' dtype.
    """

    vjp: object
    dtype: np.dtype


def attention_forward(x, wqkv, wo, cfg, backend, sinks=None):
    """Causal multi-head (or grouped-query) self-attention, with attention ``sinks``
    (a logit a head, float32 to cuflash) when given.

    One matmul makes q, k and v side by side in a ``[B, S, H + 2 H_kv, D]``
    buffer; the ``[B, H, S, D]`` views cuflash wants are transposes of its
    slices, passed without a copy (unit last stride).
    """
    batch, seq, _ = x.shape
    h, h_kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = (x @ wqkv).astype(backend.dtype, copy=False).reshape(batch, seq, h + 2 * h_kv, d)
    q = qkv[:, :, :h].transpose(0, 2, 1, 3)
    k = qkv[:, :, h : h + h_kv].transpose(0, 2, 1, 3)
    v = qkv[:, :, h + h_kv :].transpose(0, 2, 1, 3)
    extra = {}
    if sinks is not None:  # float32 for cuflash; the float64 oracle keeps them as they are
        extra["sinks"] = sinks if backend.dtype == np.float64 else sinks.astype(np.float32)
    out, vjp = backend.vjp(q, k, v, h, h_kv, d, causal=True, **extra)
    merged = out.transpose(0, 2, 1, 3).reshape(batch, seq, h * d).astype(x.dtype, copy=False)
    return merged @ wo, (x, merged, vjp)


def attention_backward(dy, cache, wqkv, wo, cfg):
    """Return ``(dx, dwqkv, dwo, dsinks)``; ``vjp`` gives the gradients of q, k and v
    (and of the sinks, fourth, when the forward had them; else ``dsinks`` is None)."""
    x, merged, vjp = cache
    batch, seq, _ = x.shape
    h, h_kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    xp = array_module(x)
    dout = (dy @ wo.T).astype(vjp.q.dtype, copy=False).reshape(batch, seq, h, d)
    dq, dk, dv, *dsinks = vjp(dout.transpose(0, 2, 1, 3))
    dqkv = xp.empty((batch, seq, h + 2 * h_kv, d), dtype=x.dtype)
    dqkv[:, :, :h] = dq.transpose(0, 2, 1, 3).astype(x.dtype, copy=False)
    dqkv[:, :, h : h + h_kv] = dk.transpose(0, 2, 1, 3).astype(x.dtype, copy=False)
    dqkv[:, :, h + h_kv :] = dv.transpose(0, 2, 1, 3).astype(x.dtype, copy=False)
    dqkv = dqkv.reshape(batch, seq, -1)
    dsinks = dsinks[0].astype(x.dtype) if dsinks else None
    return dqkv @ wqkv.T, matmul_grad(x, dqkv), matmul_grad(merged, dy), dsinks


def block_parameters(params, prefix):
    """The parameters of one block, by their names without ``prefix``."""
    return {name[len(prefix) :]: params[name] for name in params if name.startswith(prefix)}


def block_forward(x, params, prefix, cfg, backend):
    """Pre-LayerNorm block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(.))``."""
    p = block_parameters(params, prefix)
    a, ln1 = layer_norm_forward(x, p["ln1.g"], p["ln1.b"])
    y, attn = attention_forward(a, p["attn.wqkv"], p["attn.wo"], cfg, backend, p.get("attn.sinks"))
    x = x + y
    m, ln2 = layer_norm_forward(x, p["ln2.g"], p["ln2.b"])
    y, mlp = mlp_forward(m, p["mlp.w1"], p["mlp.b1"], p["mlp.w2"], p["mlp.b2"])
    return x + y, (ln1, attn, ln2, mlp)


def block_backward(dx, cache, params, prefix, cfg, grads):
    """Backward of :func:`block_forward`; stores the block's gradients in ``grads``."""
    p = block_parameters(params, prefix)
    ln1, attn, ln2, mlp = cache
    dm, *mlp_grads = mlp_backward(dx, mlp, p["mlp.w1"], p["mlp.w2"])
    dx_mlp, dg2, db2 = layer_norm_backward(dm, ln2)
    dx = dx + dx_mlp
    da, dwqkv, dwo, dsinks = attention_backward(dx, attn, p["attn.wqkv"], p["attn.wo"], cfg)
    dx_attn, dg1, db1 = layer_norm_backward(da, ln1)
    names = (
        "mlp.w1",
        "mlp.b1",
        "mlp.w2",
        "mlp.b2",
        "ln2.g",
        "ln2.b",
        "attn.wqkv",
        "attn.wo",
        "ln1.g",
        "ln1.b",
    )
    values = (*mlp_grads, dg2, db2, dwqkv, dwo, dg1, db1)
    grads.update({prefix + n: g for n, g in zip(names, values)})
    if dsinks is not None:
        grads[prefix + "attn.sinks"] = dsinks
    return dx + dx_attn


# ---------------------------------------------------------------------------
# The whole model and its loss
# ---------------------------------------------------------------------------


def model_forward(params, cfg, ids, backend):
    """Return the logits ``[B, S, vocab]`` and the cache for the backward pass."""
    x = embedding_forward(ids, params["tok_emb"], params["pos_emb"])
    blocks = []
    for i in range(cfg.num_layers):
        x, cache = block_forward(x, params, f"layers.{i}.", cfg, backend)
        blocks.append(cache)
    x, ln_f = layer_norm_forward(x, params["ln_f.g"], params["ln_f.b"])
    head = params["tok_emb"].T if cfg.tie_embeddings else params["head"]
    return x @ head, (ids, blocks, ln_f, x)


def model_backward(dlogits, cache, params, cfg):
    """Return ``{name: gradient}`` for every parameter."""
    ids, blocks, ln_f, x_final = cache
    grads = {}
    head = params["tok_emb"].T if cfg.tie_embeddings else params["head"]
    d_head = matmul_grad(x_final, dlogits)
    dx, grads["ln_f.g"], grads["ln_f.b"] = layer_norm_backward(dlogits @ head.T, ln_f)
    for i in reversed(range(cfg.num_layers)):
        dx = block_backward(dx, blocks[i], params, f"layers.{i}.", cfg, grads)
    grads["tok_emb"], grads["pos_emb"] = embedding_backward(dx, ids, cfg.vocab_size)
    if cfg.tie_embeddings:
        grads["tok_emb"] = grads["tok_emb"] + d_head.T
    else:
        grads["head"] = d_head
    return grads


def cross_entropy_forward(logits, targets, mask):
    """Mean softmax cross-entropy over the positions where ``mask`` is set.

    Returns
    -------
    loss : 0-d array
    correct : 0-d array
        How many scored positions have the target as their arg-max.
    cache : tuple
    """
    xp = array_module(logits)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_norm = xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))
    log_probs = shifted - log_norm
    target_log_probs = xp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    weights = mask.astype(logits.dtype) / mask.sum()
    loss = -(target_log_probs * weights).sum()
    correct = ((logits.argmax(axis=-1) == targets) & mask).sum()
    return loss, correct, (log_probs, targets, weights)


def cross_entropy_backward(cache):
    """Return ``dlogits``: ``(softmax - onehot(target)) * weight``."""
    log_probs, targets, weights = cache
    xp = array_module(log_probs)
    vocab = log_probs.shape[-1]
    dlogits = xp.exp(log_probs).reshape(-1, vocab)
    dlogits[xp.arange(dlogits.shape[0]), targets.ravel()] -= 1.0
    return dlogits.reshape(log_probs.shape) * weights[..., None]


def loss_and_grads(params, cfg, batch, backend):
    """Forward and backward on one batch.

    Returns
    -------
    loss, correct : 0-d arrays (see :func:`cross_entropy_forward`)
    grads : dict
    """
    inputs, targets, mask = batch
    logits, cache = model_forward(params, cfg, inputs, backend)
    loss, correct, ce_cache = cross_entropy_forward(logits, targets, mask)
    grads = model_backward(cross_entropy_backward(ce_cache), cache, params, cfg)
    return loss, correct, grads


def evaluate(params, cfg, batches, backend):
    """Return ``(accuracy, loss)`` over ``batches`` of device arrays."""
    total_loss, total_correct, total_scored = 0.0, 0, 0
    for inputs, targets, mask in batches:
        logits, _ = model_forward(params, cfg, inputs, backend)
        loss, correct, _ = cross_entropy_forward(logits, targets, mask)
        scored = int(mask.sum())
        total_loss += float(loss) * scored
        total_correct += int(correct)
        total_scored += scored
    return total_correct / total_scored, total_loss / total_scored


# ---------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------


def clip_by_global_norm(grad, max_norm):
    """Scale ``grad`` in place so its 2-norm is at most ``max_norm``.

    Stays on the device (no host synchronisation). Returns the norm before
    clipping as a 0-d array.
    """
    xp = array_module(grad)
    norm = xp.sqrt((grad * grad).sum())
    grad *= xp.minimum(1.0, max_norm / (norm + 1e-6)).astype(grad.dtype)
    return norm


class Adam:
    """Adam with optional decoupled weight decay (AdamW), on a flat buffer.

    Parameters
    ----------
    params : Parameters
        Updated in place.
    betas : (float, float)
    eps : float
    weight_decay : float
        Applied to matrices only (not to LayerNorm gains or biases).
    """

    def __init__(self, params, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0):
        xp = array_module(params.flat)
        self.params = params
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.m = xp.zeros_like(params.flat)
        self.v = xp.zeros_like(params.flat)
        self.t = 0
        decay = [
            np.full(math.prod(s), weight_decay if len(s) >= 2 else 0.0)
            for s in params.shapes.values()
        ]
        self.decay = xp.asarray(np.concatenate(decay).astype(params.flat.dtype))

    def step(self, grad, lr):
        """One update with learning rate ``lr`` from the flat gradient ``grad``."""
        xp = array_module(grad)
        self.t += 1
        self.m *= self.beta1
        self.m += (1.0 - self.beta1) * grad
        self.v *= self.beta2
        self.v += (1.0 - self.beta2) * grad * grad
        m_hat = self.m / (1.0 - self.beta1**self.t)
        v_hat = self.v / (1.0 - self.beta2**self.t)
        flat = self.params.flat
        flat -= lr * (m_hat / (xp.sqrt(v_hat) + self.eps) + self.decay * flat)


def learning_rate(step, total_steps, peak, warmup):
    """Linear warm-up to ``peak``, then cosine decay to ``peak / 10``."""
    if step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------------
# Gradient check
# ---------------------------------------------------------------------------


class OracleVJP:
    """Residuals of :func:`oracle_attention_vjp`; ``vjp(dout)`` gives ``(dq, dk, dv)``
    (and ``dsinks`` with sinks)."""

    def __init__(self, q, k, v, causal, sinks=None):
        self.q, self.k, self.v, self.causal, self.sinks = q, k, v, causal, sinks

    def __call__(self, dout):
        return attention_reference_grad(
            dout, self.q, self.k, self.v, causal=self.causal, sinks=self.sinks
        )


def oracle_attention_vjp(q, k, v, num_heads, num_kv_heads, head_dim, causal=False, sinks=None):
    """A float64 stand-in for :func:`cuflash.flash_attention_vjp` (NumPy only).

    Built on :mod:`cuflash.reference`, the plain-formula oracle with the same
    layout and semantics; used for the finite differences, which need more
    precision than float32 attention gives.
    """
    if q.shape[1] != num_heads or k.shape[1] != num_kv_heads or q.shape[3] != head_dim:
        raise ValueError("oracle attention: head arguments disagree with the shapes")
    out, _ = attention_reference(q, k, v, causal=causal, sinks=sinks)
    return out, OracleVJP(q, k, v, causal, sinks)


def relative_error(a, b, floor=1e-12):
    """Element-wise ``|a - b| / max(|a|, |b|)``, taken as 0 where both are below ``floor``."""
    scale = np.maximum(np.abs(a), np.abs(b))
    return np.where(scale > floor, np.abs(a - b) / np.maximum(scale, floor), 0.0)


def gradient_check(
    task_name="reverse",
    tie_embeddings=True,
    samples=6,
    eps=1e-5,
    fd_threshold=1e-5,
    cuflash_threshold=1e-4,
    seed=0,
    out=print,
    sinks=False,
):
    """Check the hand-written gradients of a tiny model, in float64 on the CPU.

    Two comparisons per parameter tensor:

    1. the backward pass against central finite differences
       ``(L(w + eps) - L(w - eps)) / (2 eps)`` at ``samples`` random entries,
       everything in float64 (attention from the float64 oracle in
       :mod:`cuflash.reference`, which has cuflash's exact semantics);
    2. the same gradients with cuflash's float32 attention in the model
       against those of step 1 (``max |g - g_ref| / max |g_ref|``).

    Parameters
    ----------
    task_name : {"reverse", "recall"}
        The task whose batches are used (at a tiny size).
    tie_embeddings : bool
    samples : int
        Entries checked per parameter tensor.
    eps : float
        Finite-difference step.
    fd_threshold, cuflash_threshold : float
        The largest relative errors accepted in comparisons 1 and 2.
    seed : int
    out : callable
        Where the report lines go.
    sinks : bool
        The model with attention sinks (their gradient ``dsinks`` checked too).

    Returns
    -------
    bool
        True when every error is below its threshold.
    """
    task = make_task(task_name, items=3, symbols=5)
    cfg = ModelConfig(
        vocab_size=task.vocab_size,
        seq_len=task.seq_len,
        d_model=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        mlp_ratio=2,
        tie_embeddings=tie_embeddings,
        sinks=sinks,
    )
    rng = np.random.default_rng(seed)
    params = init_parameters(cfg, np, np.float64, seed)
    params.flat[:] += rng.normal(0.0, 0.3, params.flat.shape)  # leave the init's symmetries
    batch = task.sample(rng, 3)
    oracle = AttentionBackend(oracle_attention_vjp, np.dtype(np.float64))
    flash = AttentionBackend(cuflash.flash_attention_vjp, np.dtype(np.float32))

    def loss_at():
        logits, _ = model_forward(params, cfg, batch[0], oracle)
        return float(cross_entropy_forward(logits, batch[1], batch[2])[0])

    _, _, grads = loss_and_grads(params, cfg, batch, oracle)
    _, _, flash_grads = loss_and_grads(params, cfg, batch, flash)
    out(
        f"gradient check: float64, {cfg.num_layers} layers, d_model {cfg.d_model}, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV head, "
        f"{'tied' if tie_embeddings else 'untied'} embeddings"
        f"{', attention sinks' if sinks else ''}, {samples} entries per tensor"
    )
    out(f"  {'parameter':<20} {'finite diff':>12} {'cuflash':>12}")
    worst_fd = worst_flash = 0.0
    for name in params:
        view = params[name].reshape(-1)
        picks = rng.choice(view.size, size=min(samples, view.size), replace=False)
        numeric = np.empty(len(picks))
        for j, i in enumerate(picks):
            saved = view[i]
            view[i] = saved + eps
            plus = loss_at()
            view[i] = saved - eps
            minus = loss_at()
            view[i] = saved
            numeric[j] = (plus - minus) / (2 * eps)
        fd_err = relative_error(grads[name].reshape(-1)[picks], numeric).max()
        ref = grads[name]
        flash_err = np.abs(flash_grads[name] - ref).max() / max(np.abs(ref).max(), 1e-12)
        worst_fd, worst_flash = max(worst_fd, fd_err), max(worst_flash, flash_err)
        out(f"  {name:<20} {fd_err:12.2e} {flash_err:12.2e}")
    passed = worst_fd <= fd_threshold and worst_flash <= cuflash_threshold
    out(
        f"  max: finite diff {worst_fd:.2e} (threshold {fd_threshold:.0e}), "
        f"cuflash {worst_flash:.2e} (threshold {cuflash_threshold:.0e})"
    )
    out("gradient check passed" if passed else "gradient check FAILED")
    return passed


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


class SimpleProgress:
    """A minimal stand-in for ``tqdm`` (prints a line every ~10 %)."""

    def __init__(self, total, desc=""):
        self.total, self.desc, self.n, self.postfix = total, desc, 0, ""
        self.every = max(1, total // 10)
        self.start = time.perf_counter()

    def update(self, n=1):
        self.n += n
        if self.n % self.every == 0 or self.n == self.total:
            elapsed = time.perf_counter() - self.start
            print(f"{self.desc} {self.n}/{self.total} [{elapsed:.0f}s] {self.postfix}", flush=True)

    def set_postfix_str(self, text):
        self.postfix = text

    def close(self):
        pass


def progress_bar(total, desc):
    """``tqdm`` if it is installed, else :class:`SimpleProgress`."""
    try:
        from tqdm import tqdm
    except ImportError:
        return SimpleProgress(total, desc)
    return tqdm(total=total, desc=desc, unit="step", mininterval=0.5)


def to_device(batch, xp):
    """Copy a host batch to ``xp`` arrays."""
    return tuple(xp.asarray(a) for a in batch)


def train(args, task, cfg, xp):
    """Run the training loop.

    Returns
    -------
    dict
        ``losses`` (per step), ``eval_steps``, ``eval_accuracy``, ``accuracy``
        and ``loss`` (held out, after the last step), ``eval_count`` (held-out
        sequences) and ``seconds`` (the loop, evaluations included).
    """
    backend = AttentionBackend(cuflash.flash_attention_vjp, attention_dtype(args.dtype))
    params = init_parameters(cfg, xp, np.float32, args.seed)
    optimizer = Adam(params, weight_decay=args.weight_decay)
    data_rng = np.random.default_rng(args.seed + 1)
    eval_rng = np.random.default_rng(args.seed + 2)
    eval_batches = [
        to_device(task.sample(eval_rng, args.batch_size), xp)
        for _ in range(max(1, args.eval_sequences // args.batch_size))
    ]
    warmup = max(1, min(100, args.steps // 10))
    losses = xp.zeros(args.steps, dtype=np.float32)
    eval_steps, eval_accuracy = [], []
    bar = progress_bar(args.steps, "training")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = to_device(task.sample(data_rng, args.batch_size), xp)
        loss, _, grads = loss_and_grads(params, cfg, batch, backend)
        flat_grad = params.flatten(grads)
        clip_by_global_norm(flat_grad, args.clip)
        optimizer.step(flat_grad, learning_rate(step, args.steps, args.lr, warmup))
        losses[step - 1] = loss
        if step % args.eval_every == 0 or step == args.steps:
            accuracy, eval_loss = evaluate(params, cfg, eval_batches, backend)
            eval_steps.append(step)
            eval_accuracy.append(accuracy)
            bar.set_postfix_str(f"loss {float(loss):.3f}, held-out acc {accuracy:.1%}")
        bar.update()
    seconds = time.perf_counter() - start
    bar.close()
    return {
        "losses": to_numpy(losses),
        "eval_steps": eval_steps,
        "eval_accuracy": eval_accuracy,
        "accuracy": accuracy,
        "loss": eval_loss,
        "seconds": seconds,
        "eval_count": len(eval_batches) * args.batch_size,
    }


def plot_curves(path, result, task, target):
    """Write the training loss and held-out accuracy to a PNG at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    losses = result["losses"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(np.arange(1, len(losses) + 1), losses, lw=0.6, alpha=0.5, label="per step")
    window = max(1, len(losses) // 50)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax_loss.plot(np.arange(window, len(losses) + 1), smooth, label=f"mean of {window}")
    ax_loss.set(
        xlabel="step", ylabel="cross-entropy (scored tokens)", yscale="log", title="training loss"
    )
    ax_loss.legend()
    ax_acc.plot(result["eval_steps"], result["eval_accuracy"], marker=".")
    ax_acc.axhline(target, color="green", ls="--", label=f"target {target:.0%}")
    ax_acc.axhline(task.chance, color="gray", ls=":", label=f"chance {task.chance:.1%}")
    ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02), title="held-out accuracy")
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curve written to {path}")


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

# The settings each size starts from; any flag given on the command line wins.
DEFAULTS = {
    "full": dict(
        items=32,
        symbols=64,
        d_model=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        batch_size=128,
        steps=1000,
        lr=1e-3,
        eval_every=100,
        eval_sequences=2048,
        target=0.95,
    ),
    "tiny": dict(
        items=8,
        symbols=16,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        batch_size=32,
        steps=300,
        lr=3e-3,
        eval_every=50,
        eval_sequences=256,
        target=0.95,
    ),
}


def _sized(key, text):
    """Help text that names the default of ``key`` at both sizes."""
    full, tiny = DEFAULTS["full"][key], DEFAULTS["tiny"][key]
    return f"{text} (default {full}; with --tiny {tiny})"


def parse_args(argv=None):
    """Parse the command line; unset sizes come from ``DEFAULTS``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device",
        choices=("auto", "gpu", "cpu"),
        default="auto",
        help="gpu uses CuPy, cpu uses NumPy; auto (the default) picks the GPU when CuPy sees one",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="dtype of attention's q, k and v; weights and every other "
        "activation stay float32 (default float32)",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a small task and model that train in seconds on the CPU",
    )
    p.add_argument(
        "--task",
        choices=("reverse", "recall"),
        default="reverse",
        help="see the module docstring (default reverse)",
    )
    p.add_argument(
        "--items",
        type=int,
        help=_sized("items", "symbols to reverse, or key-value pairs to recall"),
    )
    p.add_argument(
        "--symbols",
        type=int,
        help=_sized("symbols", "alphabet size (recall: keys, and as many values)"),
    )
    p.add_argument("--d-model", type=int, help=_sized("d_model", "model width"))
    p.add_argument("--num-layers", type=int, help=_sized("num_layers", "blocks"))
    p.add_argument("--num-heads", type=int, help=_sized("num_heads", "query heads"))
    p.add_argument(
        "--num-kv-heads",
        type=int,
        help=_sized(
            "num_kv_heads", "key-value heads; fewer than --num-heads is grouped-query attention"
        ),
    )
    p.add_argument(
        "--untied",
        action="store_true",
        help="an output projection of its own instead of the token embedding",
    )
    p.add_argument(
        "--sinks",
        action="store_true",
        help="attention sinks (gpt-oss): a learned logit a head in every layer, "
        "trained through the vjp's fourth gradient, dsinks",
    )
    p.add_argument("--steps", type=int, help=_sized("steps", "training steps"))
    p.add_argument("--batch-size", type=int, help=_sized("batch_size", "sequences per step"))
    p.add_argument("--lr", type=float, help=_sized("lr", "peak learning rate"))
    p.add_argument(
        "--weight-decay", type=float, default=0.0, help="AdamW decay of the matrices (default 0)"
    )
    p.add_argument(
        "--clip", type=float, default=1.0, help="limit on the global gradient norm (default 1)"
    )
    p.add_argument(
        "--eval-every", type=int, help=_sized("eval_every", "steps between held-out evaluations")
    )
    p.add_argument(
        "--eval-sequences", type=int, help=_sized("eval_sequences", "size of the held-out set")
    )
    p.add_argument("--target", type=float, help=_sized("target", "held-out accuracy to reach"))
    p.add_argument(
        "--require-target",
        action="store_true",
        help="exit with status 1 when the target is not reached",
    )
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    p.add_argument(
        "--skip-gradcheck",
        action="store_true",
        help="skip the finite-difference check of the gradients",
    )
    p.add_argument("--plot", metavar="PATH", help="write the loss curve to this PNG")
    args = p.parse_args(argv)
    for key, value in DEFAULTS["tiny" if args.tiny else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None):
    """Run the gradient check, train, report; return the exit status."""
    args = parse_args(argv)
    xp = select_array_module(args.device)
    task = make_task(args.task, args.items, args.symbols)
    cfg = ModelConfig(
        task.vocab_size,
        task.seq_len,
        args.d_model,
        args.num_layers,
        args.num_heads,
        args.num_kv_heads,
        tie_embeddings=not args.untied,
        sinks=args.sinks,
    )
    if not args.skip_gradcheck and not gradient_check(
        args.task, cfg.tie_embeddings, sinks=cfg.sinks
    ):
        return 1
    size = sum(math.prod(s) for s in cfg.parameter_shapes().values())
    print(
        f"device: {'GPU (CuPy)' if xp is not np else 'CPU (NumPy)'}, "
        f"attention dtype {args.dtype}, seed {args.seed}"
    )
    print(f"task: {task.describe()}; chance accuracy {task.chance:.1%}")
    print(
        f"model: {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads "
        f"/ {cfg.num_kv_heads} KV heads of dim {cfg.head_dim}, "
        f"{'tied' if cfg.tie_embeddings else 'untied'} embeddings"
        f"{', attention sinks' if cfg.sinks else ''}, {size:,} parameters"
    )
    print(
        f"training: {args.steps} steps of {args.batch_size} sequences, lr {args.lr:g}, "
        f"weight decay {args.weight_decay:g}, clip {args.clip:g}"
    )
    result = train(args, task, cfg, xp)
    print(
        f"trained {args.steps} steps in {result['seconds']:.1f} s "
        f"({args.steps / result['seconds']:.1f} steps/s)"
    )
    print(
        f"held-out accuracy: {result['accuracy']:.2%} "
        f"(loss {result['loss']:.4f}, {result['eval_count']} sequences)"
    )
    reached = result["accuracy"] >= args.target
    print(f"target: accuracy >= {args.target:.0%}: {'REACHED' if reached else 'NOT reached'}")
    if args.plot:
        plot_curves(args.plot, result, task, args.target)
    return 1 if args.require_target and not reached else 0


if __name__ == "__main__":
    sys.exit(main())
