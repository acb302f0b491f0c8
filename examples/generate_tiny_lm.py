#!/usr/bin/env python
"""Greedy generation with a KV cache: train the tiny language model, then decode.

The model, the task and the training loop are those of ``train_tiny_lm.py``
(imported from beside this file): a small causal transformer learns to write
a random sequence of symbols backwards. After training, generation runs the
way an inference server does:

1. **Prefill.** The prompt (the symbols and the separator) goes through the
   model once. In every layer :func:`flash_attention_with_kvcache` writes the
   prompt's keys and values into that layer's cache (``k_new``, ``v_new``,
   ``cache_seqlens = 0``) and attends the prompt's queries to them (causal).
2. **Decode.** Each step feeds the one token chosen last (greedy: the most
   likely one) at the next position; every layer appends one key and value to
   its cache at ``cache_seqlens`` and attends one query row to all the keys so
   far. Nothing is recomputed.

The cache is either contiguous, ``[B, H_kv, S_cap, D]`` per layer, or paged
(``--paged``): a pool of small blocks ``[num_blocks, H_kv, block_size, D]``
shared by all sequences, and a ``block_table`` that gives each sequence its
blocks in a shuffled order, as a paged-attention server hands them out.

With ``--rotary`` the model also has rotary position embeddings (GPT-NeoX
pairs over the whole head): training and decoding without a cache rotate q
and k by hand (:class:`RotaryAttention`) before the dense call, and decoding
with the cache passes the tables (:func:`cuflash.rotary.tables`) to
:func:`flash_attention_with_kvcache`, which rotates the new keys as it appends
them and the query rows at their positions.

Every generated token is checked against greedy decoding without a cache
(the whole sequence run through the model again at every step, with the
dense :func:`cuflash.flash_attention_fwd`): both must pick the same tokens.

Examples
--------
On the CPU, in well under a minute (most of it training)::

    python examples/generate_tiny_lm.py --device cpu

On a GPU, with a paged bfloat16 cache::

    python examples/generate_tiny_lm.py --device gpu --paged --dtype bfloat16

With rotary position embeddings, rotated at the append::

    python examples/generate_tiny_lm.py --device cpu --rotary
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny_lm as lm  # noqa: E402  (the model, task and training of the sibling example)

cuflash = lm.cuflash
from cuflash import rotary  # noqa: E402
from cuflash.kvcache import flash_attention_with_kvcache  # noqa: E402


def rotate(x, cos, sin, inverse=False):
    """``x`` ``[B, H, S, D]`` with row ``s`` rotated at position ``s`` (GPT-NeoX pairs
    ``(r, r + D / 2)``; float32 arithmetic, float64 for float64), or back with
    ``inverse``."""
    xp = lm.array_module(x)
    half = x.shape[-1] // 2
    c, s = cos[: x.shape[2]], sin[: x.shape[2]]
    if inverse:
        s = -s
    wide = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    x1, x2 = wide[..., :half], wide[..., half:]
    return xp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)


class RotaryAttention:
    """An attention ``vjp`` (``train_tiny_lm.AttentionBackend.vjp``) with rotary position
    embeddings: q and k rotated at their positions before ``vjp``, their gradients
    rotated back (the rotation's transpose) after it."""

    def __init__(self, vjp, cos, sin):
        self.vjp, self.cos, self.sin = vjp, cos, sin

    def __call__(self, q, k, v, *args, **kwargs):
        out, inner = self.vjp(
            rotate(q, self.cos, self.sin), rotate(k, self.cos, self.sin), v, *args, **kwargs
        )
        return out, RotaryGradients(inner, self.cos, self.sin)


class RotaryGradients:
    """The backward of :class:`RotaryAttention`: ``dout -> (dq, dk, dv)``."""

    def __init__(self, inner, cos, sin):
        self.inner, self.cos, self.sin = inner, cos, sin
        self.q = inner.q  # what train_tiny_lm's attention_backward reads the dtype from

    def __call__(self, dout):
        dq, dk, dv = self.inner(dout)
        return (
            rotate(dq, self.cos, self.sin, inverse=True),
            rotate(dk, self.cos, self.sin, inverse=True),
            dv,
        )


class KVCache:
    """One key and one value cache per layer, contiguous or paged.

    Parameters
    ----------
    cfg : train_tiny_lm.ModelConfig
    batch : int
        Sequences generated together.
    capacity : int
        Keys each sequence can hold.
    dtype : numpy.dtype
        The attention dtype.
    xp : module
        numpy or cupy.
    block_size : int, optional
        Paged when given: blocks of this many rows, assigned to the sequences in
        a shuffled order from a pool with a few spare blocks.
    seed : int
    """

    def __init__(self, cfg, batch, capacity, dtype, xp, block_size=None, seed=0):
        h_kv, d = cfg.num_kv_heads, cfg.head_dim
        self.block_table = None
        if block_size:
            blocks_per_sequence = -(-capacity // block_size)
            num_blocks = batch * blocks_per_sequence + 4
            order = np.random.default_rng(seed).permutation(num_blocks)
            table = order[: batch * blocks_per_sequence].reshape(batch, blocks_per_sequence)
            self.block_table = xp.asarray(table.astype(np.int32))
            shape = (num_blocks, h_kv, block_size, d)
        else:
            shape = (batch, h_kv, capacity, d)
        self.keys = [xp.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.values = [xp.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.lengths = xp.zeros(batch, dtype=np.int32)  # keys held, on the arrays' device


def cached_attention(x, wqkv, wo, cfg, cache, layer, dtype, tables=None):
    """Self-attention of the new positions ``x`` ``[B, S_new, d]`` over the cache.

    The new keys and values are appended to layer ``layer``'s cache by the call
    itself (with ``tables``, the rotary ``(cos, sin)``, the keys rotated at their
    positions as they are written, and the queries at theirs); the caller advances
    ``cache.lengths`` once every layer has run.
    """
    batch, new, _ = x.shape
    h, h_kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = (x @ wqkv).astype(dtype, copy=False).reshape(batch, new, h + 2 * h_kv, d)
    q = qkv[:, :, :h].transpose(0, 2, 1, 3)
    k_new = qkv[:, :, h : h + h_kv].transpose(0, 2, 1, 3)
    v_new = qkv[:, :, h + h_kv :].transpose(0, 2, 1, 3)
    out = flash_attention_with_kvcache(
        q,
        cache.keys[layer],
        cache.values[layer],
        h,
        h_kv,
        d,
        causal=True,
        cache_seqlens=cache.lengths,
        k_new=k_new,
        v_new=v_new,
        block_table=cache.block_table,
        rotary_cos=None if tables is None else tables[0],
        rotary_sin=None if tables is None else tables[1],
    )
    merged = out.transpose(0, 2, 1, 3).reshape(batch, new, h * d).astype(x.dtype, copy=False)
    return merged @ wo


def forward_with_cache(params, cfg, tokens, cache, dtype, tables=None):
    """Logits ``[B, S_new, vocab]`` of ``tokens`` ``[B, S_new]`` placed after the cached
    positions; appends their keys and values to every layer's cache (rotary ``tables``:
    ``(cos, sin)`` or None)."""
    xp = lm.array_module(tokens)
    start = int(cache.lengths[0])  # every sequence has the same length here
    positions = xp.arange(start, start + tokens.shape[1])
    x = params["tok_emb"][tokens] + params["pos_emb"][positions]
    for i in range(cfg.num_layers):
        p = lm.block_parameters(params, f"layers.{i}.")
        a, _ = lm.layer_norm_forward(x, p["ln1.g"], p["ln1.b"])
        x = x + cached_attention(a, p["attn.wqkv"], p["attn.wo"], cfg, cache, i, dtype, tables)
        m, _ = lm.layer_norm_forward(x, p["ln2.g"], p["ln2.b"])
        y, _ = lm.mlp_forward(m, p["mlp.w1"], p["mlp.b1"], p["mlp.w2"], p["mlp.b2"])
        x = x + y
    cache.lengths += tokens.shape[1]
    x, _ = lm.layer_norm_forward(x, params["ln_f.g"], params["ln_f.b"])
    head = params["tok_emb"].T if cfg.tie_embeddings else params["head"]
    return x @ head


def generate(params, cfg, prompt, steps, cache, dtype, tables=None):
    """Greedy decoding with the cache: ``steps`` tokens after ``prompt`` ``[B, P]`` (rotary
    ``tables``: ``(cos, sin)`` or None)."""
    xp = lm.array_module(prompt)
    logits = forward_with_cache(params, cfg, prompt, cache, dtype, tables)  # prefill
    token = logits[:, -1].argmax(axis=-1)
    chosen = [token]
    for _ in range(steps - 1):  # decode: one token a step
        logits = forward_with_cache(params, cfg, token[:, None], cache, dtype, tables)
        token = logits[:, -1].argmax(axis=-1)
        chosen.append(token)
    return xp.stack(chosen, axis=1)


def generate_without_cache(params, cfg, prompt, steps, backend):
    """Greedy decoding that runs the whole sequence through the model at every step."""
    xp = lm.array_module(prompt)
    sequence = prompt
    for _ in range(steps):
        logits, _ = lm.model_forward(params, cfg, sequence, backend)
        sequence = xp.concatenate([sequence, logits[:, -1].argmax(axis=-1)[:, None]], axis=1)
    return sequence[:, prompt.shape[1] :]


def train_model(args, task, cfg, xp, backend):
    """Train as ``train_tiny_lm.py`` does; return the parameters."""
    params = lm.init_parameters(cfg, xp, np.float32, args.seed)
    optimizer = lm.Adam(params)
    rng = np.random.default_rng(args.seed + 1)
    warmup = max(1, min(100, args.steps // 10))
    for step in range(1, args.steps + 1):
        batch = lm.to_device(task.sample(rng, args.batch_size), xp)
        _, _, grads = lm.loss_and_grads(params, cfg, batch, backend)
        flat_grad = params.flatten(grads)
        lm.clip_by_global_norm(flat_grad, 1.0)
        optimizer.step(flat_grad, lm.learning_rate(step, args.steps, args.lr, warmup))
    return params


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device",
        choices=("auto", "gpu", "cpu"),
        default="auto",
        help="gpu uses CuPy, cpu uses NumPy; auto picks the GPU when there is one",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="dtype of attention and of the cache (default float32)",
    )
    p.add_argument("--paged", action="store_true", help="a paged cache (see --block-size)")
    p.add_argument(
        "--block-size",
        type=int,
        default=4,
        help="rows a block of the paged cache holds (default 4)",
    )
    p.add_argument(
        "--rotary",
        action="store_true",
        help="rotary position embeddings, rotated at the append by the cached calls",
    )
    p.add_argument("--items", type=int, default=8, help="symbols to reverse (default 8)")
    p.add_argument("--symbols", type=int, default=16, help="alphabet size (default 16)")
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument(
        "--batch-size", type=int, default=32, help="training sequences a step (default 32)"
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument(
        "--sequences", type=int, default=64, help="sequences generated together (default 64)"
    )
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    return p.parse_args(argv)


def main(argv=None):
    """Train, generate with and without the cache, compare; return the exit status."""
    args = parse_args(argv)
    xp = lm.select_array_module(args.device)
    dtype = lm.attention_dtype(args.dtype)
    task = lm.ReverseTask(args.items, args.symbols)
    cfg = lm.ModelConfig(
        task.vocab_size, task.seq_len, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2
    )
    backend = lm.AttentionBackend(cuflash.flash_attention_vjp, dtype)
    tables = None
    if args.rotary:  # the tables cover every position of a sequence
        tables = rotary.tables(task.seq_len, cfg.head_dim, xp=xp)
        backend = lm.AttentionBackend(RotaryAttention(backend.vjp, *tables), dtype)
    print(
        f"device: {'GPU (CuPy)' if xp is not np else 'CPU (NumPy)'}, attention and cache "
        f"dtype {args.dtype}{', rotary embeddings' if args.rotary else ''}; "
        f"task: {task.describe()}"
    )
    start = time.perf_counter()
    params = train_model(args, task, cfg, xp, backend)
    print(f"trained {args.steps} steps in {time.perf_counter() - start:.1f} s")

    inputs, targets, _ = task.sample(np.random.default_rng(args.seed + 7), args.sequences)
    prompt = xp.asarray(inputs[:, : args.items + 1])  # the symbols and the separator
    answer = targets[:, args.items :]  # the symbols backwards
    cache = KVCache(
        cfg,
        args.sequences,
        task.seq_len,
        dtype,
        xp,
        block_size=args.block_size if args.paged else None,
        seed=args.seed,
    )
    layout = (
        f"paged, blocks of {args.block_size} rows, {cache.keys[0].shape[0]} blocks in the pool"
        if args.paged
        else "contiguous"
    )
    start = time.perf_counter()
    with_cache = lm.to_numpy(generate(params, cfg, prompt, args.items, cache, dtype, tables))
    seconds = time.perf_counter() - start
    without_cache = lm.to_numpy(generate_without_cache(params, cfg, prompt, args.items, backend))
    accuracy = float((with_cache == answer).mean())
    agree = float((with_cache == without_cache).mean())
    held = lm.to_numpy(cache.lengths)
    print(
        f"cache: {layout}; {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads of dim "
        f"{cfg.head_dim}; {int(held[0])} keys a sequence after generation"
    )
    print(
        f"generated {args.items} tokens for {args.sequences} sequences in {seconds:.2f} s "
        f"(1 prefill + {args.items - 1} decode steps)"
    )
    for row in range(min(3, args.sequences)):
        print(f"  prompt {inputs[row, : args.items].tolist()} -> {with_cache[row].tolist()}")
    print(f"accuracy against the reversed prompt: {accuracy:.1%}")
    print(f"tokens equal to decoding without a cache: {agree:.1%}")
    ok = agree == 1.0 and bool(np.all(held == task.seq_len))
    print("cache and recompute agree" if ok else "cache and recompute DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
