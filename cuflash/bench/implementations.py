"""What is timed: cuflash's forward and backward, PyTorch SDPA with one backend forced,
naive CuPy attention, compiled ``flex_attention``; each makes calls on an input set."""

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..api import flash_attention_bwd, flash_attention_fwd
from .environment import cupy

TORCH_BACKENDS = {
    "FLASH_ATTENTION": "torch-flash",
    "CUDNN_ATTENTION": "torch-cudnn",
    "EFFICIENT_ATTENTION": "torch-efficient",
    "MATH": "torch-math",
}
VARLEN_RECOMPILE_LIMIT = 64  # torch.compile'd flex_attention: one graph per D, mask, grad mode


class CuflashAttention:
    """cuflash's forward and backward (residuals from an untimed forward);
    ``allow_tf32`` and the keyword ``options`` (e.g. score modifiers) are passed to both."""

    name = "cuflash"
    has_backward = True

    def __init__(self, case, allow_tf32=False, **options):
        self.case = case
        self.allow_tf32 = allow_tf32
        self.options = options

    def context(self):
        return contextlib.nullcontext()

    def _fwd(self, x):
        c = self.case
        return flash_attention_fwd(
            x.q,
            x.k,
            x.v,
            c.heads,
            c.heads,
            c.head_dim,
            c.causal,
            allow_tf32=self.allow_tf32,
            **self.options,
        )

    def forward_call(self, x):
        """A call that enqueues one forward pass on ``x`` and returns the output."""
        return lambda: self._fwd(x)[0]

    def backward_call(self, x):
        """A call that enqueues one backward pass on ``x``."""
        c = self.case
        out, lse = self._fwd(x)
        return functools.partial(
            flash_attention_bwd,
            x.dout,
            x.q,
            x.k,
            x.v,
            out,
            lse,
            c.heads,
            c.heads,
            c.head_dim,
            c.causal,
            synchronize=False,
            allow_tf32=self.allow_tf32,
            **self.options,
        )


@dataclasses.dataclass(frozen=True)
class StreamPointer:
    """A raw ``cudaStream_t`` offered through the CUDA stream protocol."""

    ptr: int

    def __cuda_stream__(self):
        return (0, self.ptr)


def torch_stream(torch):
    """A context putting CuPy (and so its events) on torch's current stream."""
    return cupy.cuda.Stream.from_external(StreamPointer(torch.cuda.current_stream().cuda_stream))


def forced_backend(torch, backend):
    """A context forcing SDPA's ``backend``, with CuPy's events on torch's current stream."""
    from torch.nn.attention import sdpa_kernel

    stack = contextlib.ExitStack()
    stack.enter_context(sdpa_kernel([backend]))
    stack.enter_context(torch_stream(torch))
    return stack


class TorchSDPA:
    """``torch.nn.functional.scaled_dot_product_attention`` with one forced backend."""

    has_backward = True

    def __init__(self, case, torch, backend):
        self.case, self.torch, self.backend = case, torch, backend
        self.name = TORCH_BACKENDS[backend.name]

    def context(self):
        return forced_backend(self.torch, self.backend)

    def _leaves(self, x):
        return [self.torch.from_dlpack(a).requires_grad_() for a in (x.q, x.k, x.v)]

    def _sdpa(self, q, k, v):
        return self.torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=self.case.causal
        )

    def forward_call(self, x):
        """A training-mode forward (inputs require grad), returning the output."""
        q, k, v = self._leaves(x)
        return lambda: self._sdpa(q, k, v)

    def backward_call(self, x):
        """A call of ``torch.autograd.grad`` through the graph of an untimed forward."""
        q, k, v = self._leaves(x)
        out = self._sdpa(q, k, v)
        dout = self.torch.from_dlpack(x.dout)
        return lambda: self.torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def naive_attention(q, k, v, causal_bias=None):
    """Attention the way a CuPy user writes it without this library.

    Inputs are cast to float32, ``scores = q k^T / sqrt(D)`` is materialized
    (``[B, H, S, S]``, plus ``causal_bias`` if given), softmax runs in float32
    and ``softmax @ v`` is cast back to the input dtype.
    """
    scale = np.float32(1 / math.sqrt(q.shape[-1]))
    scores = cupy.matmul(q.astype(np.float32) * scale, k.astype(np.float32).swapaxes(-1, -2))
    if causal_bias is not None:
        scores += causal_bias
    scores -= scores.max(axis=-1, keepdims=True)
    cupy.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return cupy.matmul(scores, v.astype(np.float32, copy=False)).astype(q.dtype)


def causal_bias(seqlen):
    """``[S, S]`` float32: 0 where a key is visible, ``-inf`` above the diagonal."""
    return cupy.triu(cupy.full((seqlen, seqlen), -np.inf, dtype=np.float32), k=1)


class NaiveCupyAttention:
    """:func:`naive_attention`, forward only."""

    name = "cupy-naive"
    has_backward = False

    def __init__(self, case):
        self.case = case

    def context(self):
        return contextlib.nullcontext()

    @functools.cached_property
    def bias(self):
        """The causal bias of the case (built once, untimed), or None."""
        return causal_bias(self.case.seqlen) if self.case.causal else None

    def forward_call(self, x):
        bias = self.bias
        return lambda: naive_attention(x.q, x.k, x.v, bias)


def sdpa_backends(torch, names):
    """The ``SDPBackend`` members of ``names`` (keys of ``TORCH_BACKENDS``) torch has."""
    if torch is None:
        return []
    from torch.nn.attention import SDPBackend

    return [getattr(SDPBackend, name) for name in names if hasattr(SDPBackend, name)]


def implementation_factories(
    torch, allow_tf32=False, torch_backends=tuple(TORCH_BACKENDS), naive=True
):
    """Constructors ``case -> implementation``: cuflash, torch's ``torch_backends``, naive CuPy."""
    factories: list[Callable[..., Any]] = [
        functools.partial(CuflashAttention, allow_tf32=allow_tf32)
    ]
    factories += [
        functools.partial(TorchSDPA, torch=torch, backend=backend)
        for backend in sdpa_backends(torch, torch_backends)
    ]
    return factories + ([NaiveCupyAttention] if naive else [])


@functools.cache
def compiled_flex_attention(torch):
    """``torch.compile(flex_attention, dynamic=False)``, once a process, with room for a
    graph per head dim, mask and grad mode."""
    import torch._dynamo.config as config
    from torch.nn.attention.flex_attention import flex_attention

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), VARLEN_RECOMPILE_LIMIT))
            break
    return torch.compile(flex_attention, dynamic=False)
