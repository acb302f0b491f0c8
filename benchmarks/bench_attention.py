"""asv benchmarks of cuflash's forward and backward passes on a CUDA GPU.

The shapes are those of ``docs/performance.md``: ``B * S = 16384`` tokens and
``H = 2048 / D`` heads, so every case moves the same amount of activations
and only the attention pattern changes with ``S``. FLOPs follow
FlashAttention's convention (the performance page, section 'Methodology').

Without a GPU (CuPy missing, or ``cupy.is_available()`` false) every
``setup`` raises ``NotImplementedError``, which asv reports as skipped.
The module imports only NumPy at the top, so ``asv check`` runs anywhere.
``CUFLASH_ASV_GRID=small`` in the environment shrinks the grid to bfloat16,
D 64/128, S 1024/4096 (causal and not) for a smoke run. The dtype
``"float32-tf32"`` is float32 with ``allow_tf32=True``.

Beside the grid: :class:`HostTime` times one tiny call with nothing
synchronized (the host's cost per call; the performance page, section 'Small
calls and host time'), :class:`Decode` two decoding steps from a KV cache
(the KV-cache page), skipped while cuflash has no
``flash_attention_with_kvcache``, :class:`Varlen` one packed batch of
variable-length sequences (the varlen page), :class:`Modifiers` the score
modifiers ``softcap`` and ``alibi_slopes`` (the semantics page, section 'Score
modifiers: soft-capping and ALiBi'), :class:`MlaDecode` absorbed-MLA decoding and
:class:`Fp8Forward` the dense FP8 forward (the FP8 page; on compute capability 9.0).
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
HOST_TIME_SHAPE = (1, 1, 16, 64)  # B, H, S, D: the GPU work is a few microseconds
# name: (batch, cache length, block size; 0 is a contiguous cache); bfloat16, D=128, H=32/8.
DECODE_CASES = {
    "b16-cache8192-contiguous": (16, 8192, 0),
    "b1-cache32768-paged256": (1, 32768, 256),
}
# name: (batch, query heads, cache length) of absorbed-MLA decoding (bfloat16, one KV head of
# 576, the values its first 512): compute-bound with 128 heads, memory-bound with 16.
MLA_DECODE_CASES = {"b32-h128-cache4096": (32, 128, 4096), "b128-h16-cache16384": (128, 16, 16384)}
# FP8 forward cases (Fp8Forward): e4m3 q, k, v, bfloat16 out, the grid's shapes.
FP8_HEAD_DIMS = [64, 128, 256]
FP8_SEQLENS = [2048, 8192]
MODIFIER_SHAPE = (4, 16, 4096, 128)  # B, H, S, D of Modifiers (bfloat16, causal)
VARLEN_HEAD_DIM = 128  # Varlen: the causal packed batch of uniform lengths, H = 2048 / 128


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


def median_gpu_seconds(cupy, enqueue, repeats=TRACK_REPEATS):
    """Median GPU time of ``enqueue()`` over ``repeats`` CUDA-event timings, after one warm-up."""
    cuda = cupy.cuda
    enqueue()
    seconds = []
    for _ in range(repeats):
        start, end = cuda.Event(), cuda.Event()
        start.record()
        enqueue()
        end.record()
        end.synchronize()
        seconds.append(cuda.get_elapsed_time(start, end) / 1e3)
    return float(np.median(seconds))


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
            for _ in range(4)
        )
        self.out, self.lse = self.forward()
        self.synchronize()

    def synchronize(self):
        """Wait for all work on the current device."""
        self.cupy.cuda.Device().synchronize()

    def forward(self):
        """Enqueue one forward pass; return ``(out, lse)``."""
        return self.cuflash.flash_attention_fwd(
            self.q,
            self.k,
            self.v,
            self.heads,
            self.heads,
            self.head_dim,
            self.causal,
            allow_tf32=self.allow_tf32,
        )

    def backward(self, out, lse):
        """Enqueue one backward pass (without its host synchronization)."""
        return self.cuflash.flash_attention_bwd(
            self.dout,
            self.q,
            self.k,
            self.v,
            out,
            lse,
            self.heads,
            self.heads,
            self.head_dim,
            self.causal,
            synchronize=False,
            allow_tf32=self.allow_tf32,
        )

    def median_seconds(self, enqueue):
        """Median GPU time of ``enqueue()`` over ``TRACK_REPEATS`` CUDA-event timings."""
        return median_gpu_seconds(self.cupy, enqueue)

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


class DeterministicBackward:
    """The backward with ``deterministic=True`` (dQ by a pass of its own, no atomics):
    bfloat16, S = 4096, causal and not, D = 64, 128 and 256; the inputs of Attention."""

    params = (["bfloat16"], [64, 128, 256], [4096], CAUSAL)
    param_names = Attention.param_names
    timeout = 300

    def setup(self, *params):
        self.case = Attention()
        self.case.setup(*params)

    def track_backward_tflops(self, *params):
        case = self.case
        seconds = case.median_seconds(
            lambda: case.cuflash.flash_attention_bwd(
                case.dout,
                case.q,
                case.k,
                case.v,
                case.out,
                case.lse,
                case.heads,
                case.heads,
                case.head_dim,
                case.causal,
                synchronize=False,
                deterministic=True,
            )
        )
        return BACKWARD_FLOP_FACTOR * case.forward_flop_count() / seconds / 1e12

    track_backward_tflops.unit = "TFLOP/s"


class HostTime:
    """Host time of one tiny bfloat16 call, nothing synchronized (targets: 15 us, 30 us).

    The GPU work of a call is a few microseconds, so the wall time asv
    measures is the host's: validation, kernel lookup, allocations, launches.
    ``teardown`` waits for the queued GPU work.
    """

    timeout = 120

    def setup(self):
        self.cupy, self.cuflash = gpu_modules()
        batch, self.heads, seqlen, self.head_dim = HOST_TIME_SHAPE
        rng = self.cupy.random.default_rng(0)
        self.q, self.k, self.v, self.dout = (
            rng.standard_normal(HOST_TIME_SHAPE, dtype=np.float32).astype(numpy_dtype("bfloat16"))
            for _ in range(4)
        )
        self.out, self.lse = self.time_forward_call()
        self.time_backward_call()
        self.teardown()

    def teardown(self):
        self.cupy.cuda.Device().synchronize()

    def time_forward_call(self):
        return self.cuflash.flash_attention_fwd(
            self.q, self.k, self.v, self.heads, self.heads, self.head_dim, True
        )

    def time_backward_call(self):
        return self.cuflash.flash_attention_bwd(
            self.dout,
            self.q,
            self.k,
            self.v,
            self.out,
            self.lse,
            self.heads,
            self.heads,
            self.head_dim,
            True,
            synchronize=False,
        )


class Decode:
    """One decoding step (S_q = 1) from a KV cache with ``flash_attention_with_kvcache``.

    bfloat16, D = 128, 32 query heads on 8 KV heads, every sequence's cache
    full; the inputs are those of ``python -m cuflash.bench --decode``.
    """

    params = (list(DECODE_CASES),)
    param_names = ("case",)
    timeout = 300

    def setup(self, case):
        """Draw the cache (paged: in shuffled blocks) and run one step."""
        self.cupy, cuflash = gpu_modules()
        self.function = getattr(cuflash, "flash_attention_with_kvcache", None)
        if self.function is None:
            raise NotImplementedError("cuflash has no flash_attention_with_kvcache")
        from cuflash.bench import DecodeCase, make_decode_sets, paged_input_set

        batch, cache_len, block_size = DECODE_CASES[case]
        self.case = DecodeCase(batch, cache_len, block_size=block_size)
        self.x = make_decode_sets(self.case, 1)[0]
        if block_size:
            self.x = paged_input_set(self.x, block_size)
        self.decode()
        self.cupy.cuda.Device().synchronize()

    def decode(self):
        """Enqueue one step; return the output."""
        c, x = self.case, self.x
        return self.function(
            x.q,
            x.k_cache,
            x.v_cache,
            c.heads,
            c.kv_heads,
            c.head_dim,
            True,
            cache_seqlens=x.cache_seqlens,
            block_table=x.block_table,
        )

    def time_decode(self, case):
        self.decode()
        self.cupy.cuda.Device().synchronize()

    def track_cache_tb_per_s(self, case):
        """Cache bytes read per second: ``2 * B * H_kv * L * D * 2`` over the median time."""
        return self.case.cache_bytes / median_gpu_seconds(self.cupy, self.decode) / 1e12

    track_cache_tb_per_s.unit = "TB/s"


class MlaDecode:
    """One absorbed-MLA decoding step with ``flash_attention_with_kvcache``: ``v_cache`` the
    view ``k_cache[..., :512]`` of one latent KV head; the inputs are those of ``python -m
    cuflash.bench --mla-decode``.
    """

    params = (list(MLA_DECODE_CASES),)
    param_names = ("case",)
    timeout = 300

    def setup(self, case):
        """Draw the latent cache and the query rows, and run one step."""
        self.cupy, cuflash = gpu_modules()
        try:
            from cuflash.bench import MlaDecodeCase, mla_decode_step
        except ImportError as exc:
            raise NotImplementedError("cuflash has no absorbed-MLA decoding") from exc
        self.case = MlaDecodeCase(*MLA_DECODE_CASES[case])
        self.step = mla_decode_step(self.case)
        self.step()
        self.cupy.cuda.Device().synchronize()

    def time_decode(self, case):
        self.step()
        self.cupy.cuda.Device().synchronize()

    def track_tflops(self, case):
        """The two products' FLOPs, ``2 * B * H * L * (576 + 512)``, over the median time."""
        return self.case.flops / median_gpu_seconds(self.cupy, self.step) / 1e12

    track_tflops.unit = "TFLOP/s"

    def track_cache_tb_per_s(self, case):
        """The latent's bytes (each key row read once) over the median time."""
        return self.case.cache_bytes / median_gpu_seconds(self.cupy, self.step) / 1e12

    track_cache_tb_per_s.unit = "TB/s"


class Fp8Forward:
    """The dense FP8 forward (e4m3 ``q``, ``k``, ``v`` as uint8 bits with
    ``fp8_format="e4m3"``, per-(batch, head) descales, a bfloat16 output) on the grid's
    shapes; the inputs are those of ``python -m cuflash.bench --fp8``. Its products run in
    e4m3 on compute capability 9.0 only (elsewhere an exact float32 path), so other GPUs
    skip it.
    """

    params = (FP8_HEAD_DIMS, FP8_SEQLENS, CAUSAL)
    param_names = ("head_dim", "seqlen", "causal")
    timeout = 300

    def setup(self, head_dim, seqlen, causal):
        """Draw and quantize the inputs, and run one forward."""
        self.cupy, cuflash = gpu_modules()
        if self.cupy.cuda.Device().compute_capability != "90":
            raise NotImplementedError("the FP8 products run on compute capability 9.0")
        try:
            from cuflash.bench import Fp8Case, fp8_forward_step
        except ImportError as exc:
            raise NotImplementedError("cuflash has no FP8 forward") from exc
        self.case = Fp8Case(TOKENS // seqlen, HIDDEN // head_dim, seqlen, head_dim, causal)
        self.step = fp8_forward_step(self.case)
        self.step()
        self.cupy.cuda.Device().synchronize()

    def time_forward(self, head_dim, seqlen, causal):
        self.step()
        self.cupy.cuda.Device().synchronize()

    def track_tflops(self, head_dim, seqlen, causal):
        """The forward's FLOPs (the grid's convention) over the median time."""
        return self.case.flops() / median_gpu_seconds(self.cupy, self.step) / 1e12

    track_tflops.unit = "TFLOP/s"


class Varlen:
    """One packed batch of 16384 tokens with ``flash_attention_varlen_fwd`` / ``_bwd``.

    The lengths of ``python -m cuflash.bench --varlen`` (uniform in 64..4096, fixed
    seed, the last trimmed), bfloat16, D = 128, H = 16, causal. TFLOP/s count only
    the work inside each sequence (causal: half of its square), summed.
    """

    timeout = 300

    def setup(self):
        """Draw the packed inputs and run one forward pass (compiling the kernels)."""
        self.cupy, self.cuflash = gpu_modules()
        from cuflash.bench import varlen_cases

        self.case = next(
            c for c in varlen_cases((VARLEN_HEAD_DIM,)) if c.kind == "uniform" and c.causal
        )
        shape = (self.case.tokens, self.case.heads, self.case.head_dim)
        rng = self.cupy.random.default_rng(0)
        self.q, self.k, self.v, self.dout = (
            rng.standard_normal(shape, dtype=np.float32).astype(numpy_dtype("bfloat16"))
            for _ in range(4)
        )
        self.cu_seqlens = self.cupy.asarray(self.case.cu_seqlens)
        self.out, self.lse = self.forward()
        self.cupy.cuda.Device().synchronize()

    def _args(self):
        c = self.case
        return (
            self.cu_seqlens,
            self.cu_seqlens,
            c.max_seqlen,
            c.max_seqlen,
            c.heads,
            c.heads,
            c.head_dim,
            c.causal,
        )

    def forward(self):
        """Enqueue one forward pass; return ``(out, lse)``."""
        return self.cuflash.flash_attention_varlen_fwd(self.q, self.k, self.v, *self._args())

    def backward(self):
        """Enqueue one backward pass (without its host synchronization)."""
        return self.cuflash.flash_attention_varlen_bwd(
            self.dout, self.q, self.k, self.v, self.out, self.lse, *self._args(), synchronize=False
        )

    def track_forward_tflops(self):
        return self.case.flops("fwd") / median_gpu_seconds(self.cupy, self.forward) / 1e12

    track_forward_tflops.unit = "TFLOP/s"

    def track_backward_tflops(self):
        return self.case.flops("bwd") / median_gpu_seconds(self.cupy, self.backward) / 1e12

    track_backward_tflops.unit = "TFLOP/s"


class Modifiers:
    """Forward and backward TFLOP/s with a score modifier (the semantics page, section
    'Score modifiers'): none, ``softcap=30``, ALiBi slopes ``2^(-8 i / H)``, both;
    bfloat16, causal, ``B, H, S, D = 4, 16, 4096, 128``
    (``python -m cuflash.bench_modifiers`` prints them next to compiled
    ``flex_attention``)."""

    params = (["plain", "softcap", "alibi", "softcap+alibi"],)
    param_names = ["modifier"]
    timeout = 300

    def setup(self, modifier):
        self.cupy, self.cuflash = gpu_modules()
        from cuflash.bench_modifiers import cuflash_options

        batch, heads, seqlen, head_dim = MODIFIER_SHAPE
        rng = self.cupy.random.default_rng(0)
        self.q, self.k, self.v, self.dout = (
            rng.standard_normal(MODIFIER_SHAPE, dtype=np.float32).astype(numpy_dtype("bfloat16"))
            for _ in range(4)
        )
        self.args = (heads, heads, head_dim, True)
        self.options = cuflash_options(modifier, heads)
        self.flops = forward_flops(batch, heads, seqlen, head_dim, True)
        self.out, self.lse = self.forward()
        self.cupy.cuda.Device().synchronize()

    def forward(self):
        return self.cuflash.flash_attention_fwd(self.q, self.k, self.v, *self.args, **self.options)

    def backward(self):
        return self.cuflash.flash_attention_bwd(
            self.dout,
            self.q,
            self.k,
            self.v,
            self.out,
            self.lse,
            *self.args,
            synchronize=False,
            **self.options,
        )

    def track_forward_tflops(self, modifier):
        return self.flops / median_gpu_seconds(self.cupy, self.forward) / 1e12

    track_forward_tflops.unit = "TFLOP/s"

    def track_backward_tflops(self, modifier):
        return (
            BACKWARD_FLOP_FACTOR * self.flops / median_gpu_seconds(self.cupy, self.backward) / 1e12
        )

    track_backward_tflops.unit = "TFLOP/s"


class Masks:
    """Forward and backward milliseconds with a block mask (the semantics page, section
    'Block masks'): documents packed into one sequence (8 x 2048 tokens, causal inside
    each), prefix-LM (prefix 1024 of 4096) and causal chunks of 1024 of 4096; bfloat16,
    H = 16, D = 128 (``python -m cuflash.bench_masks`` prints them next to the varlen
    call and compiled ``flex_attention``)."""

    params = (["documents", "prefix_lm", "chunked"],)
    param_names = ["mask"]
    timeout = 300

    def setup(self, mask):
        self.cupy, self.cuflash = gpu_modules()
        from cuflash.bench_masks import case_of, cuflash_mask
        from cuflash.block_mask import create_block_mask

        case = case_of(mask, 16, 128)
        rng = self.cupy.random.default_rng(0)
        self.q, self.k, self.v, self.dout = (
            rng.standard_normal(case.shape, dtype=np.float32).astype(numpy_dtype("bfloat16"))
            for _ in range(4)
        )
        self.args = (case.heads, case.heads, case.head_dim)
        self.block_mask = create_block_mask(
            cuflash_mask(mask, case), None, None, case.seqlen, case.seqlen
        )
        self.out, self.lse = self.forward()
        self.cupy.cuda.Device().synchronize()

    def forward(self):
        return self.cuflash.flash_attention_fwd(
            self.q, self.k, self.v, *self.args, block_mask=self.block_mask
        )

    def backward(self):
        return self.cuflash.flash_attention_bwd(
            self.dout,
            self.q,
            self.k,
            self.v,
            self.out,
            self.lse,
            *self.args,
            synchronize=False,
            block_mask=self.block_mask,
        )

    def track_forward_ms(self, mask):
        return median_gpu_seconds(self.cupy, self.forward) * 1e3

    track_forward_ms.unit = "ms"

    def track_backward_ms(self, mask):
        return median_gpu_seconds(self.cupy, self.backward) * 1e3

    track_backward_ms.unit = "ms"
