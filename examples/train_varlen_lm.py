#!/usr/bin/env python
"""Train a byte-level language model on packed documents with varlen attention.

The corpus is the Python standard library on this machine: the ``.py`` files
under ``sysconfig.get_paths()["stdlib"]`` (nothing to download; with Python
3.11, about 1,800 files, from a few bytes to a few hundred kilobytes). Each
file is one document of bytes (tokens 0..255) between two document-boundary
tokens (256); a document longer than ``--max-doc-len`` tokens is cut into
pieces of that length, each piece then being a document of its own. About 5 %
of the files (chosen by a hash of their path) are held out for evaluation.

Packing
-------
Each training step takes whole documents, in a seeded shuffled order, until
the next one would overflow ``--tokens-per-step``, and lays their tokens end
to end: one row of ``total`` tokens, the int32 offsets ``cu_seqlens`` (0
first, ``total`` last) on the device and ``max_seqlen`` as a Python int.
Attention is :func:`cuflash.flash_attention_varlen_vjp` with ``causal=True``,
so every document attends only to its own earlier tokens, and the positional
embedding restarts at 0 in each document: the model sees exactly what it
would see if each document were a batch of its own.

The padded baseline takes the same documents, one per row, padded to the
longest of the step, and uses dense :func:`cuflash.flash_attention_vjp`
(causal; with padding on the right no real token sees a padding token, and
the loss skips the padding). Both layouts give the same loss and gradients
(checked at start-up); they differ in the work done, so the figure compared
is *real* tokens (padding not counted) per second of training.

The model is the one of ``train_tiny_lm.py`` (imported from it, not copied):
a pre-LayerNorm transformer with hand-written backward passes, trained with
Adam. Only the thin parts that differ live here: the packed attention layer,
the positions that restart in each document, the corpus and the packer.

At start-up a cheap check runs on the CPU path (NumPy, float32) on one small
packed batch: the packed attention equals dense attention over each document
alone (output and gradients), and the whole model gives the same loss and
gradients packed as padded. ``--skip-check`` skips it.

Examples
--------
A run of a few seconds on the CPU (a few files, a tiny model)::

    python examples/train_varlen_lm.py --tiny --device cpu

On a GPU: train packed and padded from the same start on the same batches,
report real tokens per second of each and their ratio, write the held-out
loss curves and the figures::

    python examples/train_varlen_lm.py --device gpu --mode both \\
        --plot varlen_loss.png --json varlen.json

``--mode packed`` or ``--mode padded`` trains one layout only.
"""

import argparse
import csv
import dataclasses
import json
import math
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import numpy as np


def import_tiny_lm():
    """The tiny LM example (``train_tiny_lm.py`` next to this script): the model,
    its layers and the optimizer come from it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import train_tiny_lm

    return train_tiny_lm


tiny_lm = import_tiny_lm()
cuflash = tiny_lm.cuflash

DOCUMENT_BOUNDARY = 256  # starts each document and is the target after its last byte
VOCAB_SIZE = 257
MODES = ("packed", "padded")


# ---------------------------------------------------------------------------
# Corpus: the standard library's source files, cut into documents
# ---------------------------------------------------------------------------


def stdlib_root():
    """The folder of this interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(max_files=None):
    """The ``.py`` files of the standard library, sorted by path.

    Third-party packages (``site-packages``, ``dist-packages``) and empty
    files are left out. With ``max_files``, that many files evenly spaced in
    the sorted list (so a small selection still spans the whole library).
    """
    root = stdlib_root()
    files = sorted(
        path
        for path in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(path.relative_to(root).parts)
        and path.is_file()
        and path.stat().st_size > 0
    )
    if max_files is not None and max_files < len(files):
        picks = np.linspace(0, len(files) - 1, max(1, max_files)).round().astype(int)
        files = [files[i] for i in sorted(set(picks))]
    return files


def is_held_out(name, fraction):
    """Whether the file called ``name`` is held out (a stable hash of the name)."""
    return zlib.crc32(name.encode()) % 10_000 < fraction * 10_000


@dataclasses.dataclass(frozen=True)
class Document:
    """One piece of a source file: ``length`` input tokens and their targets.

    ``tokens`` holds ``length + 1`` tokens; the inputs are all but the last,
    the targets all but the first.
    """

    source: str  # path of the file, relative to the standard library
    piece: int  # 0 for the file's first piece
    tokens: np.ndarray

    @property
    def length(self):
        return len(self.tokens) - 1

    @property
    def inputs(self):
        return self.tokens[:-1]

    @property
    def targets(self):
        return self.tokens[1:]


def file_tokens(data):
    """The token sequence of a file's bytes: boundary, bytes, boundary."""
    tokens = np.empty(len(data) + 2, dtype=np.uint16)
    tokens[0] = tokens[-1] = DOCUMENT_BOUNDARY
    tokens[1:-1] = np.frombuffer(data, dtype=np.uint8)
    return tokens


def cut_into_documents(source, tokens, max_doc_len):
    """Cut a file's token sequence into documents of at most ``max_doc_len`` inputs.

    Consecutive pieces share one token: the last target of a piece is the
    first input of the next, so every next-token pair of the file is in
    exactly one piece.
    """
    return [
        Document(source, i, tokens[start : start + max_doc_len + 1])
        for i, start in enumerate(range(0, len(tokens) - 1, max_doc_len))
    ]


@dataclasses.dataclass
class Corpus:
    """The documents for training and for evaluation."""

    train: list
    held_out: list
    train_files: int
    held_out_files: int
    bytes: int


def load_corpus(max_files, max_doc_len, held_out_fraction):
    """Read the standard library's sources and cut them into documents.

    At least one file is held out and at least one trains, whatever the hash says.
    """
    files = stdlib_source_files(max_files)
    if len(files) < 2:
        raise SystemExit("error: need at least two source files")
    root = stdlib_root()
    names = [path.relative_to(root).as_posix() for path in files]
    held = [is_held_out(name, held_out_fraction) for name in names]
    if not any(held):
        held[min(range(len(names)), key=lambda i: zlib.crc32(names[i].encode()))] = True
    if all(held):
        held[0] = False
    corpus = Corpus([], [], 0, 0, 0)
    for path, name, held_out in zip(files, names, held):
        data = path.read_bytes()
        corpus.bytes += len(data)
        documents = cut_into_documents(name, file_tokens(data), max_doc_len)
        if held_out:
            corpus.held_out += documents
            corpus.held_out_files += 1
        else:
            corpus.train += documents
            corpus.train_files += 1
    return corpus


# ---------------------------------------------------------------------------
# Packing documents into steps
# ---------------------------------------------------------------------------


def pack_documents(lengths, token_budget):
    """Group documents, in order, into steps of at most ``token_budget`` tokens.

    Each step takes whole documents until the next one would overflow the
    budget, which then opens the next step (no document is split across
    steps). Returns lists of indices into ``lengths``.
    """
    steps, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if n > token_budget:
            raise ValueError(f"document {i} has {n} tokens, more than the budget {token_budget}")
        if current and used + n > token_budget:
            steps.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        steps.append(current)
    return steps


def step_schedule(documents, token_budget, seed):
    """An endless sequence of steps (lists of documents): every epoch a new
    seeded shuffle of ``documents``, packed by :func:`pack_documents`."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(documents))
        for step in pack_documents([documents[i].length for i in order], token_budget):
            yield [documents[order[i]] for i in step]


def cu_seqlens_of(lengths):
    """int32 offsets ``[0, l0, l0 + l1, ..., total]`` of documents laid end to end."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise ValueError("too many tokens for int32 offsets")
    return offsets.astype(np.int32)


def positions_in_documents(lengths):
    """Each token's position in its own document: ``0 .. l0-1, 0 .. l1-1, ...``."""
    offsets = cu_seqlens_of(lengths)
    total = int(offsets[-1])
    starts = np.repeat(offsets[:-1], lengths)
    return (np.arange(total) - starts).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Batch:
    """The model's input for one step, packed or padded.

    ``inputs``, ``targets`` and ``mask`` are ``[rows, S]`` (packed: one row of
    every token; padded: one row per document); ``positions`` (``[S]``) gives
    the positional-embedding row of each column -- packed, each document
    restarts at 0; padded, ``0 .. S-1`` for every row. ``cu_seqlens`` is None
    for a padded batch.
    """

    layout: str
    inputs: object
    targets: object
    mask: object
    positions: object
    cu_seqlens: object
    max_seqlen: int
    real_tokens: int

    @property
    def slots(self):
        """Tokens the model computes, padding included."""
        return self.inputs.size

    def attention(self, dtype):
        """The attention backend for this batch (``tiny_lm.AttentionBackend``)."""
        if self.layout == "padded":
            return tiny_lm.AttentionBackend(cuflash.flash_attention_vjp, dtype)
        return tiny_lm.AttentionBackend(PackedAttention(self.cu_seqlens, self.max_seqlen), dtype)


def packed_batch(documents, xp):
    """The documents end to end in one row, with their offsets on the device."""
    lengths = [d.length for d in documents]
    inputs = np.concatenate([d.inputs for d in documents]).astype(np.int32)[None]
    targets = np.concatenate([d.targets for d in documents]).astype(np.int32)[None]
    return Batch(
        "packed",
        xp.asarray(inputs),
        xp.asarray(targets),
        xp.ones(inputs.shape, dtype=bool),
        xp.asarray(positions_in_documents(lengths)),
        xp.asarray(cu_seqlens_of(lengths)),
        max(lengths),
        sum(lengths),
    )


def padded_batch(documents, xp):
    """One document a row, padded on the right to the longest; the mask is
    False at the padding."""
    lengths = [d.length for d in documents]
    rows, width = len(documents), max(lengths)
    inputs = np.zeros((rows, width), dtype=np.int32)
    targets = np.zeros((rows, width), dtype=np.int32)
    mask = np.zeros((rows, width), dtype=bool)
    for row, d in enumerate(documents):
        inputs[row, : d.length] = d.inputs
        targets[row, : d.length] = d.targets
        mask[row, : d.length] = True
    return Batch(
        "padded",
        xp.asarray(inputs),
        xp.asarray(targets),
        xp.asarray(mask),
        xp.arange(width, dtype=np.int32),
        None,
        width,
        sum(lengths),
    )


def make_batch(documents, layout, xp):
    """:func:`packed_batch` or :func:`padded_batch`."""
    return packed_batch(documents, xp) if layout == "packed" else padded_batch(documents, xp)


# ---------------------------------------------------------------------------
# The parts of the model that differ from train_tiny_lm
# ---------------------------------------------------------------------------


def tokens_first(x):
    """``[1, H, total, D]`` (the tiny LM's attention layout) -> ``[total, H, D]`` view."""
    return x[0].transpose(1, 0, 2)


def heads_first(x):
    """``[total, H, D]`` -> ``[1, H, total, D]`` view."""
    return x[None].transpose(0, 2, 1, 3)


class PackedAttention:
    """Packed causal attention with the call signature of
    :func:`cuflash.flash_attention_vjp`, for ``train_tiny_lm.attention_forward``.

    That layer hands over the packed row as a batch of one, ``q`` as
    ``[1, H, total, D]`` (a view of its qkv buffer); the ``[total, H, D]``
    views :func:`cuflash.flash_attention_varlen_vjp` wants are transposes of
    it, so nothing is copied either way.
    """

    def __init__(self, cu_seqlens, max_seqlen):
        self.cu_seqlens, self.max_seqlen = cu_seqlens, max_seqlen

    def __call__(self, q, k, v, num_heads, num_kv_heads, head_dim, causal=False):
        out, vjp = cuflash.flash_attention_varlen_vjp(
            tokens_first(q),
            tokens_first(k),
            tokens_first(v),
            self.cu_seqlens,
            self.cu_seqlens,
            self.max_seqlen,
            self.max_seqlen,
            num_heads,
            num_kv_heads,
            head_dim,
            causal=causal,
        )
        return heads_first(out), PackedAttentionVJP(vjp)


class PackedAttentionVJP:
    """Backward of :class:`PackedAttention`, in the ``[1, H, total, D]`` layout."""

    def __init__(self, varlen_vjp):
        self.varlen_vjp = varlen_vjp
        self.q = varlen_vjp.q  # attention_backward reads the dtype from it

    def __call__(self, dout):
        return tuple(heads_first(g) for g in self.varlen_vjp(tokens_first(dout)))


class WithTokenPositions:
    """The parameters as ``train_tiny_lm``'s model reads them, with
    ``pos_emb`` replaced by its rows at ``positions``.

    The tiny LM adds ``pos_emb[:S]`` to a ``[rows, S]`` batch, and its
    backward returns the gradient of those ``S`` rows. Handing it
    ``pos_emb[positions]`` instead makes the positions restart in each
    document of a packed row; :meth:`position_gradient` adds the rows'
    gradients back into the table.
    """

    def __init__(self, params, positions):
        self.params, self.positions = params, positions
        self.pos_emb_rows = params["pos_emb"][positions]

    def __getitem__(self, name):
        return self.pos_emb_rows if name == "pos_emb" else self.params[name]

    def __iter__(self):
        return iter(self.params)

    def position_gradient(self, row_grads):
        """The gradient of the whole ``pos_emb`` table from that of its rows."""
        xp = tiny_lm.array_module(row_grads)
        table = xp.zeros(self.params["pos_emb"].shape, dtype=row_grads.dtype)
        xp.add.at(table, self.positions, row_grads)
        return table


def loss_and_grads(params, cfg, batch, dtype):
    """Mean cross-entropy over the batch's real tokens and ``{name: gradient}``."""
    view = WithTokenPositions(params, batch.positions)
    loss, _, grads = tiny_lm.loss_and_grads(
        view, cfg, (batch.inputs, batch.targets, batch.mask), batch.attention(dtype)
    )
    grads["pos_emb"] = view.position_gradient(grads["pos_emb"])
    return loss, grads


def model_logits(params, cfg, batch, dtype):
    """The logits ``[rows, S, vocab]`` of a batch (no backward)."""
    view = WithTokenPositions(params, batch.positions)
    logits, _ = tiny_lm.model_forward(view, cfg, batch.inputs, batch.attention(dtype))
    return logits


def held_out_loss(params, cfg, batches, dtype):
    """Mean cross-entropy per real token over ``batches`` (nats)."""
    total = 0.0
    for batch in batches:
        logits = model_logits(params, cfg, batch, dtype)
        loss, _, _ = tiny_lm.cross_entropy_forward(logits, batch.targets, batch.mask)
        total += float(loss) * batch.real_tokens
    return total / sum(batch.real_tokens for batch in batches)


# ---------------------------------------------------------------------------
# Start-up check: packed equals per-document dense
# ---------------------------------------------------------------------------


def max_relative_difference(a, b):
    """``max |a - b| / max |b|`` in float64 on the host."""
    a = np.asarray(tiny_lm.to_numpy(a), dtype=np.float64)
    b = np.asarray(tiny_lm.to_numpy(b), dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def check_packing(documents, threshold=1e-4, seed=0, out=print):
    """Check one small packed batch on the CPU path (NumPy, float32).

    1. The batch's rows hold each document's tokens at its offsets.
    2. :class:`PackedAttention` (causal, 2 query heads sharing 1 KV head) and
       its backward equal dense :func:`cuflash.flash_attention_vjp` over each
       document alone, sliced out with offsets computed here from the
       documents' own lengths.
    3. A small model gives the same loss, logits and gradients on the packed
       batch as on the padded batch of the same documents (which also checks
       that positions restart in each document).

    Returns True when every relative difference is at most ``threshold``.
    """
    f32 = np.dtype(np.float32)
    packed, padded = packed_batch(documents, np), padded_batch(documents, np)
    starts = np.cumsum([0] + [d.length for d in documents])
    layout_ok = all(
        np.array_equal(packed.inputs[0, s : s + d.length], d.inputs)
        and np.array_equal(packed.targets[0, s : s + d.length], d.targets)
        for s, d in zip(starts, documents)
    )
    layout_ok = layout_ok and int(tiny_lm.to_numpy(packed.cu_seqlens)[-1]) == starts[-1]

    rng = np.random.default_rng(seed)
    heads, kv_heads, dim, total = 2, 1, 8, int(starts[-1])
    q = rng.standard_normal((1, heads, total, dim)).astype(f32)
    k, v = (rng.standard_normal((1, kv_heads, total, dim)).astype(f32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(f32)
    attention = PackedAttention(packed.cu_seqlens, packed.max_seqlen)
    out_packed, vjp = attention(q, k, v, heads, kv_heads, dim, causal=True)
    grads_packed = vjp(dout)
    attention_error = 0.0
    for s, d in zip(starts, documents):
        doc = slice(s, s + d.length)
        out_doc, vjp_doc = cuflash.flash_attention_vjp(
            q[:, :, doc], k[:, :, doc], v[:, :, doc], heads, kv_heads, dim, causal=True
        )
        grads_doc = vjp_doc(np.ascontiguousarray(dout[:, :, doc]))
        pairs = [(out_packed, out_doc)] + list(zip(grads_packed, grads_doc))
        attention_error = max(
            [attention_error]
            + [max_relative_difference(whole[:, :, doc], part) for whole, part in pairs]
        )

    # pos_emb as long as the whole row, so positions that failed to restart in
    # each document would still index it (and change the logits).
    cfg = tiny_lm.ModelConfig(
        VOCAB_SIZE, total, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, mlp_ratio=2
    )
    params = tiny_lm.init_parameters(cfg, np, np.float32, seed)
    params.flat[:] += rng.normal(0.0, 0.1, params.flat.shape).astype(np.float32)
    loss_packed, grads_packed = loss_and_grads(params, cfg, packed, f32)
    loss_padded, grads_padded = loss_and_grads(params, cfg, padded, f32)
    logits_packed = model_logits(params, cfg, packed, f32)[0]
    logits_padded = model_logits(params, cfg, padded, f32)[padded.mask]
    model_error = max(
        [
            max_relative_difference(loss_packed, loss_padded),
            max_relative_difference(logits_packed, logits_padded),
        ]
        + [max_relative_difference(grads_packed[n], grads_padded[n]) for n in params]
    )

    passed = layout_ok and attention_error <= threshold and model_error <= threshold
    out(
        f"packing check: {len(documents)} documents of {[d.length for d in documents]} tokens; "
        f"layout {'ok' if layout_ok else 'WRONG'}; packed vs per-document dense attention "
        f"{attention_error:.1e}; packed vs padded model {model_error:.1e} "
        f"(threshold {threshold:.0e}): {'passed' if passed else 'FAILED'}"
    )
    return passed


def check_documents(corpus, lengths=(7, 16, 1, 20), cut=12):
    """A few short documents of different lengths for :func:`check_packing`: the
    first training file cut into two pieces of ``cut`` tokens, then the starts
    of the next files, ``lengths`` tokens long."""
    firsts = [d for d in corpus.train if d.piece == 0]
    documents = cut_into_documents(firsts[0].source, firsts[0].tokens[: 2 * cut + 1], cut)
    for d, n in zip(firsts[1:], lengths):
        documents.append(Document(d.source, 0, d.tokens[: n + 1]))
    return documents


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def synchronize(xp):
    """Wait for the GPU (no-op on the CPU path)."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def train(args, cfg, xp, corpus, eval_batches, layout, dtype):
    """Train in ``layout`` ("packed" or "padded"); return the measurements.

    Every layout starts from the same parameters and sees the same steps (the
    same documents in the same order). Tokens per second count real tokens
    only, over the training steps after the first ``--untimed-steps`` (which
    include compiling kernels), held-out evaluations not included.
    """
    params = tiny_lm.init_parameters(cfg, xp, np.float32, args.seed)
    optimizer = tiny_lm.Adam(params, weight_decay=args.weight_decay)
    schedule = step_schedule(corpus.train, args.tokens_per_step, args.seed + 1)
    warmup = max(1, min(100, args.steps // 10))
    losses = xp.zeros(args.steps, dtype=np.float32)
    curve = [(0, held_out_loss(params, cfg, eval_batches, dtype), 0.0)]
    print(f"[{layout}] step 0: held-out loss {curve[0][1]:.4f}", flush=True)
    timed_seconds, timed_tokens, timed_slots, seconds = 0.0, 0, 0, 0.0
    real_tokens, slots = 0, 0
    synchronize(xp)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        if step == args.untimed_steps + 1:
            synchronize(xp)
            timed_start = time.perf_counter()
        batch = make_batch(next(schedule), layout, xp)
        loss, grads = loss_and_grads(params, cfg, batch, dtype)
        flat_grad = params.flatten(grads)
        tiny_lm.clip_by_global_norm(flat_grad, args.clip)
        optimizer.step(flat_grad, tiny_lm.learning_rate(step, args.steps, args.lr, warmup))
        losses[step - 1] = loss
        real_tokens += batch.real_tokens
        slots += batch.slots
        if step > args.untimed_steps:
            timed_tokens += batch.real_tokens
            timed_slots += batch.slots
        if step % args.eval_every == 0 or step == args.steps:
            synchronize(xp)
            now = time.perf_counter()
            seconds += now - start
            if step > args.untimed_steps:
                timed_seconds += now - timed_start
            loss_value = held_out_loss(params, cfg, eval_batches, dtype)
            curve.append((step, loss_value, seconds))
            print(
                f"[{layout}] step {step}: held-out loss {loss_value:.4f} "
                f"(training loss {float(loss):.4f}), {seconds:.1f} s",
                flush=True,
            )
            start = timed_start = time.perf_counter()
    timed_steps = args.steps - args.untimed_steps
    if timed_steps <= 0:  # too few steps to leave out the first ones: time them all
        timed_steps, timed_seconds, timed_tokens, timed_slots = (
            args.steps,
            seconds,
            real_tokens,
            slots,
        )
    result = {
        "layout": layout,
        "steps": args.steps,
        "real_tokens": real_tokens,
        "timed_steps": timed_steps,
        "timed_seconds": timed_seconds,
        "timed_real_tokens": timed_tokens,
        "timed_slots": timed_slots,
        "real_tokens_per_s": timed_tokens / timed_seconds,
        "train_seconds": seconds,
        "initial_held_out_loss": curve[0][1],
        "final_held_out_loss": curve[-1][1],
        "held_out_curve": [{"step": s, "loss": v, "train_seconds": t} for s, v, t in curve],
        "train_loss": [float(x) for x in tiny_lm.to_numpy(losses)],
    }
    print(
        f"[{layout}] {args.steps} steps, {real_tokens:,} real tokens; timed "
        f"{result['timed_steps']} steps: {timed_seconds:.2f} s, "
        f"{result['real_tokens_per_s']:,.0f} real tokens/s",
        flush=True,
    )
    return result


def padding_statistics(corpus, token_budget, seed):
    """Over one epoch of steps: mean budget fill, and the slots a padded layout
    computes per real token."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(corpus.train))
    lengths = np.array([corpus.train[i].length for i in order])
    steps = pack_documents(lengths, token_budget)
    real = sum(int(lengths[s].sum()) for s in steps)
    padded = sum(len(s) * int(lengths[s].max()) for s in steps)
    return {
        "steps_per_epoch": len(steps),
        "budget_fill": real / (len(steps) * token_budget),
        "documents_per_step": len(lengths) / len(steps),
        "padded_slots_per_token": padded / real,
    }


def write_curves(path, results):
    """Plot the held-out loss curves to a PNG at ``path``; without matplotlib,
    write them as a CSV next to it (``path`` with a ``.csv`` suffix)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        csv_path = path.with_suffix(".csv")
        with open(csv_path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["layout", "step", "held_out_loss", "train_seconds"])
            for result in results:
                for point in result["held_out_curve"]:
                    writer.writerow(
                        [
                            result["layout"],
                            point["step"],
                            f"{point['loss']:.6f}",
                            f"{point['train_seconds']:.3f}",
                        ]
                    )
        print(
            f"matplotlib is not installed: no plot written; the held-out loss curves "
            f"are in {csv_path}"
        )
        return
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4))
    for result in results:
        curve = result["held_out_curve"]
        label = f"{result['layout']} ({result['real_tokens_per_s']:,.0f} real tokens/s)"
        by_step.plot(
            [p["step"] for p in curve],
            [p["loss"] for p in curve],
            marker=".",
            label=result["layout"],
        )
        by_time.plot(
            [p["train_seconds"] for p in curve], [p["loss"] for p in curve], marker=".", label=label
        )
    by_step.set(xlabel="step", ylabel="held-out loss (nats per token)", title="by step")
    by_time.set(xlabel="training seconds (evaluations excluded)", title="by time")
    for ax in (by_step, by_time):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

# The settings each size starts from; any flag given on the command line wins.
DEFAULTS = {
    "full": dict(
        max_files=None,
        max_doc_len=2048,
        tokens_per_step=16384,
        d_model=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        steps=400,
        lr=2e-3,
        eval_every=50,
        eval_tokens=65536,
    ),
    "tiny": dict(
        max_files=60,
        max_doc_len=128,
        tokens_per_step=1024,
        d_model=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        steps=40,
        lr=5e-3,
        eval_every=10,
        eval_tokens=2048,
    ),
}


def _sized(key, text):
    """Help text that names the default of ``key`` at both sizes."""
    full, tiny = DEFAULTS["full"][key], DEFAULTS["tiny"][key]
    return f"{text} (default {'all' if full is None else full}; with --tiny {tiny})"


def parse_args(argv=None):
    """Parse the command line; unset sizes come from ``DEFAULTS``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--mode",
        choices=("packed", "padded", "both"),
        default="both",
        help="train packed, padded, or both from the same start on the same "
        "steps and compare them (default both)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "gpu", "cpu"),
        default="auto",
        help="gpu uses CuPy, cpu uses NumPy; auto (the default) picks the GPU when CuPy sees one",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="dtype of attention's q, k and v; everything else stays float32 "
        "(default bfloat16 on a GPU, float32 on the CPU)",
    )
    p.add_argument(
        "--tiny", action="store_true", help="a few files and a tiny model: seconds on the CPU"
    )
    p.add_argument(
        "--max-files",
        type=int,
        help=_sized("max_files", "source files read (evenly spaced in the sorted list)"),
    )
    p.add_argument(
        "--max-doc-len",
        type=int,
        help=_sized("max_doc_len", "longer documents are cut into pieces of this many tokens"),
    )
    p.add_argument(
        "--tokens-per-step",
        type=int,
        help=_sized("tokens_per_step", "token budget of a step (whole documents up to it)"),
    )
    p.add_argument(
        "--held-out-fraction",
        type=float,
        default=0.05,
        help="share of the files held out (default 0.05)",
    )
    p.add_argument(
        "--eval-tokens", type=int, help=_sized("eval_tokens", "held-out tokens evaluated")
    )
    p.add_argument(
        "--eval-every", type=int, help=_sized("eval_every", "steps between held-out evaluations")
    )
    p.add_argument("--d-model", type=int, help=_sized("d_model", "model width"))
    p.add_argument("--num-layers", type=int, help=_sized("num_layers", "blocks"))
    p.add_argument("--num-heads", type=int, help=_sized("num_heads", "query heads"))
    p.add_argument("--num-kv-heads", type=int, help=_sized("num_kv_heads", "key-value heads"))
    p.add_argument("--steps", type=int, help=_sized("steps", "training steps per layout"))
    p.add_argument("--lr", type=float, help=_sized("lr", "peak learning rate"))
    p.add_argument(
        "--weight-decay", type=float, default=0.0, help="AdamW decay of the matrices (default 0)"
    )
    p.add_argument(
        "--clip", type=float, default=1.0, help="limit on the global gradient norm (default 1)"
    )
    p.add_argument(
        "--untimed-steps",
        type=int,
        default=3,
        help="first steps of each layout left out of tokens/s: they compile kernels (default 3)",
    )
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    p.add_argument(
        "--skip-check",
        action="store_true",
        help="skip the start-up check of packed against dense attention",
    )
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="write the held-out loss curves to this PNG (a CSV next to it "
        "when matplotlib is not installed)",
    )
    p.add_argument("--json", metavar="PATH", help="write the measured figures to this file")
    args = p.parse_args(argv)
    for key, value in DEFAULTS["tiny" if args.tiny else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.max_doc_len > args.tokens_per_step:
        p.error("--max-doc-len must not exceed --tokens-per-step")
    return args


def main(argv=None):
    """Check, train, report; return the exit status."""
    args = parse_args(argv)
    xp = tiny_lm.select_array_module(args.device)
    if args.dtype is None:
        args.dtype = "float32" if xp is np else "bfloat16"
    dtype = tiny_lm.attention_dtype(args.dtype)

    corpus = load_corpus(args.max_files, args.max_doc_len, args.held_out_fraction)
    if not args.skip_check and not check_packing(check_documents(corpus)):
        return 1
    eval_rng = np.random.default_rng(args.seed + 2)
    eval_documents, eval_total = [], 0
    for i in eval_rng.permutation(len(corpus.held_out)):
        if eval_total >= args.eval_tokens:
            break
        eval_documents.append(corpus.held_out[i])
        eval_total += corpus.held_out[i].length
    eval_batches = [
        packed_batch([eval_documents[i] for i in step], xp)
        for step in pack_documents([d.length for d in eval_documents], args.tokens_per_step)
    ]
    stats = padding_statistics(corpus, args.tokens_per_step, args.seed + 1)
    lengths = np.array([d.length for d in corpus.train])

    cfg = tiny_lm.ModelConfig(
        VOCAB_SIZE,
        args.max_doc_len,
        args.d_model,
        args.num_layers,
        args.num_heads,
        args.num_kv_heads,
    )
    size = sum(math.prod(s) for s in cfg.parameter_shapes().values())
    device = "CPU (NumPy)"
    if xp is not np:
        props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
        device = f"GPU (CuPy): {props['name'].decode()}"
    print(f"device: {device}, attention dtype {args.dtype}, seed {args.seed}")
    print(
        f"corpus: {corpus.train_files + corpus.held_out_files} files, "
        f"{corpus.bytes / 1e6:.1f} MB under {stdlib_root()}; training on "
        f"{corpus.train_files} files ({len(corpus.train)} documents, "
        f"{int(lengths.sum()):,} tokens), held out {corpus.held_out_files} files "
        f"(evaluating {eval_total:,} tokens)"
    )
    print(
        f"documents: at most {args.max_doc_len} tokens ("
        f"{(lengths == args.max_doc_len).mean():.0%} of them at that length), "
        f"median {int(np.median(lengths))}"
    )
    print(
        f"steps: up to {args.tokens_per_step} tokens, {stats['documents_per_step']:.1f} "
        f"documents and {stats['budget_fill']:.0%} of the budget on average; padded, "
        f"{stats['padded_slots_per_token']:.3f} slots per real token"
    )
    print(
        f"model: {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads / "
        f"{cfg.num_kv_heads} KV heads of dim {cfg.head_dim}, vocabulary {VOCAB_SIZE}, "
        f"{size:,} parameters; {args.steps} steps, lr {args.lr:g}"
    )

    layouts = MODES if args.mode == "both" else (args.mode,)
    results = [train(args, cfg, xp, corpus, eval_batches, layout, dtype) for layout in layouts]
    by_layout = {r["layout"]: r for r in results}
    for r in results:
        print(
            f"{r['layout']}: {r['real_tokens_per_s']:,.0f} real tokens/s; held-out loss "
            f"{r['initial_held_out_loss']:.4f} -> {r['final_held_out_loss']:.4f}"
        )
    ratio = None
    if len(results) == 2:
        ratio = by_layout["packed"]["real_tokens_per_s"] / by_layout["padded"]["real_tokens_per_s"]
        print(f"packed / padded real tokens/s: {ratio:.2f}x")
    if args.plot:
        write_curves(args.plot, results)
    if args.json:
        figures = {
            "device": device,
            "dtype": args.dtype,
            "config": {k: v for k, v in vars(args).items() if k not in ("plot", "json")},
            "corpus": {
                "files": corpus.train_files + corpus.held_out_files,
                "train_files": corpus.train_files,
                "held_out_files": corpus.held_out_files,
                "train_documents": len(corpus.train),
                "train_tokens": int(lengths.sum()),
                "eval_tokens": eval_total,
            },
            "packing": stats,
            "parameters": size,
            "real_tokens_per_s": {r["layout"]: r["real_tokens_per_s"] for r in results},
            "packed_over_padded": ratio,
            "final_held_out_loss": {r["layout"]: r["final_held_out_loss"] for r in results},
            "results": by_layout,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1))
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
