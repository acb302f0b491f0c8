"""asv benchmarks of cuflash's forward and backward passes on a CUDA GPU.

The shapes are those of ``docs/performance.md``: ``B * S = 16384`` tokens and
``H = 2048 / D`` heads, so every case moves the same amount of activations
and only the attention pattern changes with ``S``. FLOPs follow
FlashAttention's convention (SPEC section 5).

Without a GPU (CuPy missing, or ``cupy.is_available()`` false) every
``setup`` raises ``NotImplementedError``, which asv reports as skipped.
The module imports only NumPy at the top, so ``asv check`` runs anywhere.
``CUFLASH_ASV_GRID=small`` in the environment shrinks the grid to bfloat16,
D 64/128, S 1024/4096 (causal and not) for a smoke run. The dtype
``"float32-tf32"`` is float32 with ``allow_tf32=True``.
"""

import os

import numpy as np

TOKENS = 16384
HIDDEN = 2048
TF32_SUFFIX = "-tf32"  # float32 with allow_tf32=True
DTYPES = ["float32", "float32" + TF32_SUFFIX, "float16", "bfloat16"]
HEAD_DIMS = [64, 128, 256]
SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
CAUSAL = [False, True]
if os.environ.get("CUFLASH_ASV_GRID") == "small":  # a smoke run: 8 cases per benchmark
    DTYPES, HEAD_DIMS, SEQLENS = ["bfloat16"], [64, 128], [1024, 4096]
BACKWARD_FLOP_FACTOR = 2.5
TRACK_REPEATS = 10


def gpu_modules():
    """Return ``(cupy, cuflash)``, or raise ``NotImplementedError`` without a GPU."""
    try:
        import cupy
    except ImportError as exc:
        raise NotImplementedError("CuPy is not installed") from exc
    if not cupy.is_available():
        raise NotImplementedError("no CUDA GPU is available")
    import cuflash

    return cupy, cuflash


def numpy_dtype(name):
    """The NumPy dtype of the parameter ``name``; ``"bfloat16"`` is ml_dtypes'."""
    name = name.removesuffix(TF32_SUFFIX)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def forward_flops(batch, heads, seqlen, head_dim, causal):
    """FLOPs of one forward pass: ``4 * B * H * S * S * D``, halved when causal."""
    flops = 4 * batch * heads * seqlen * seqlen * head_dim
    return flops / 2 if causal else flops


class Attention:
    """Forward, backward and both, over dtype x head_dim x seqlen x causal."""

    params = (DTYPES, HEAD_DIMS, SEQLENS, CAUSAL)
    param_names = ("dtype", "head_dim", "seqlen", "causal")
    timeout = 300

    def setup(self, dtype, head_dim, seqlen, causal):
        """Draw the inputs and run one forward pass (compiling the kernels)."""
        self.cupy, self.cuflash = gpu_modules()
        self.batch, self.heads = TOKENS // seqlen, HIDDEN // head_dim
        self.head_dim, self.causal = head_dim, causal
        self.allow_tf32 = dtype.endswith(TF32_SUFFIX)
        shape = (self.batch, self.heads, seqlen, head_dim)
        rng = self.cupy.random.default_rng(0)
        self.q, self.k, self.v, self.dout = (
            rng.standard_normal(shape, dtype=np.float32).astype(numpy_dtype(dtype))
            for _ in range(4))
        self.out, self.lse = self.forward()
        self.synchronize()

    def synchronize(self):
        """Wait for all work on the current device."""
        self.cupy.cuda.Device().synchronize()

    def forward(self):
        """Enqueue one forward pass; return ``(out, lse)``."""
        return self.cuflash.flash_attention_fwd(
            self.q, self.k, self.v, self.heads, self.heads, self.head_dim, self.causal,
            allow_tf32=self.allow_tf32)

    def backward(self, out, lse):
        """Enqueue one backward pass (without its host synchronization)."""
        return self.cuflash.flash_attention_bwd(
            self.dout, self.q, self.k, self.v, out, lse, self.heads, self.heads,
            self.head_dim, self.causal, synchronize=False, allow_tf32=self.allow_tf32)

    def median_seconds(self, enqueue):
        """Median GPU time of ``enqueue()`` over ``TRACK_REPEATS`` CUDA-event timings."""
        cuda = self.cupy.cuda
        enqueue()
        seconds = []
        for _ in range(TRACK_REPEATS):
            start, end = cuda.Event(), cuda.Event()
            start.record()
            enqueue()
            end.record()
            end.synchronize()
            seconds.append(cuda.get_elapsed_time(start, end) / 1e3)
        return float(np.median(seconds))

    def forward_flop_count(self):
        """FLOPs of this case's forward pass."""
        return forward_flops(self.batch, self.heads, self.q.shape[2], self.head_dim, self.causal)

    def time_forward(self, dtype, head_dim, seqlen, causal):
        self.forward()
        self.synchronize()

    def time_backward(self, dtype, head_dim, seqlen, causal):
        self.backward(self.out, self.lse)
        self.synchronize()

    def time_forward_backward(self, dtype, head_dim, seqlen, causal):
        self.backward(*self.forward())
        self.synchronize()

    def track_forward_tflops(self, dtype, head_dim, seqlen, causal):
        return self.forward_flop_count() / self.median_seconds(self.forward) / 1e12

    track_forward_tflops.unit = "TFLOP/s"

    def track_backward_tflops(self, dtype, head_dim, seqlen, causal):
        seconds = self.median_seconds(lambda: self.backward(self.out, self.lse))
        return BACKWARD_FLOP_FACTOR * self.forward_flop_count() / seconds / 1e12

    track_backward_tflops.unit = "TFLOP/s"

    def track_peak_memory(self, dtype, head_dim, seqlen, causal):
        """Bytes CuPy's memory pool grows by during one forward + backward.

        The pool keeps freed blocks until ``free_all_blocks``, so its growth
        from an emptied state is the high-water mark of the call's own
        allocations (outputs included, the inputs and residuals of ``setup``
        excluded).
        """
        pool = self.cupy.get_default_memory_pool()
        pool.free_all_blocks()
        before = pool.total_bytes()
        grads = self.backward(*self.forward())
        self.synchronize()
        del grads
        return pool.total_bytes() - before

    track_peak_memory.unit = "bytes"
