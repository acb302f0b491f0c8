"""Validation of every argument (the errors of the Troubleshooting page), shared by every path.

``forward_problem`` and ``backward_problem`` check the arguments and return
an :class:`AttentionProblem` that holds everything the kernels need. Nothing
runs on a device before they return.
"""

import dataclasses
import functools
import math
import numbers

import numpy as np

from ..errors import InvalidArgumentError
from ..fp8 import check_not_fp8
from ..modifiers.api import MaskMod, ScoreMod
from ..modifiers.block_mask import BlockMask

# BFLOAT16 and DTYPES_BY_NAME are imported from here by the scripts, tests and benchmarks.
from .dtypes import BFLOAT16, DTYPES_BY_NAME, SUPPORTED_DTYPES  # noqa: F401
from .masking import mean_visible_keys, normalize_window

try:  # CuPy is optional: the CPU path needs only NumPy.
    import cupy
except ImportError:  # pragma: no cover - exercised only without CuPy
    cupy = None

MAX_HEAD_DIM = 256
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z (heads, batch)
MAX_INT32 = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class PackedSequences:
    """How the rows of a packed call's arrays split into sequences (the Packed batches page): the
    problem's arrays are one batch entry of every sequence end to end, and the
    kernels read where each sequence starts from the offsets on the device."""

    count: int  # B, the grid's batch extent
    max_q_len: int  # bounds on every sequence's lengths: the grid's row extents
    max_kv_len: int


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """A validated attention call: shapes, options and the array module."""

    xp: object  # numpy or cupy
    dtype: np.dtype
    batch: int
    num_heads: int
    num_kv_heads: int
    q_len: int
    kv_capacity: int  # S_k of the k/v tensors (memory extent)
    kv_len: int  # keys actually read (kv_seq_len)
    head_dim: int  # of q and k
    head_dim_v: int  # of v, the output and their gradients (head_dim unless given)
    softmax_scale: float
    causal: bool
    window: tuple  # (left, right), -1 = unbounded; causal already folded in
    allow_tf32: bool = False  # float32 products may run in TF32 (see flash_attention_fwd)
    packed: PackedSequences | None = None  # a packed batch of sequences, or None (dense)
    softcap: float = 0.0  # scores become softcap tanh(score / softcap); 0: off
    alibi_slopes_shape: tuple | None = None  # (H,) or (B, H) of the ALiBi slopes; None: off
    score_mod: object = None  # a cuflash.modifiers.ScoreMod, or None
    mask_mod: object = None  # a cuflash.modifiers.MaskMod, or None
    block_mask: object = None  # a cuflash.block_mask.BlockMask holding mask_mod, or None
    first_batch: int = 0  # the user modifiers' b of batch entry 0 (a packed call's sequence)
    sinks: bool = False  # attention sinks: a float32 [H] logit a query head joins every row

    @property
    def modified(self):
        """Do score modifiers (see the Semantics page) apply, built-in or the user's?"""
        return (
            self.softcap > 0
            or self.alibi_slopes_shape is not None
            or self.score_mod is not None
            or self.mask_mod is not None
        )

    @property
    def mask_only(self):
        """Is a user's mask the only score modifier (no soft-cap, ALiBi or score function)?"""
        return (
            self.mask_mod is not None
            and self.score_mod is None
            and self.softcap == 0
            and self.alibi_slopes_shape is None
        )

    @property
    def alibi_batch_stride(self):
        """Slopes between batch entries (sequences): 0 for ``[H]`` slopes, H for ``[B, H]``."""
        shape = self.alibi_slopes_shape
        return 0 if shape is None or len(shape) == 1 else shape[1]

    @property
    def group_size(self):
        """Query heads per KV head (1 = MHA, num_heads = MQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def is_empty(self):
        return self.batch * self.num_heads * self.q_len == 0

    @property
    def q_shape(self):
        return (self.batch, self.num_heads, self.q_len, self.head_dim)

    @property
    def kv_shape(self):
        return (self.batch, self.num_kv_heads, self.kv_capacity, self.head_dim)

    @property
    def v_shape(self):
        return (self.batch, self.num_kv_heads, self.kv_capacity, self.head_dim_v)

    @property
    def out_shape(self):
        return (self.batch, self.num_heads, self.q_len, self.head_dim_v)

    @property
    def lse_shape(self):
        return (self.batch, self.num_heads, self.q_len)

    def keys_a_row_sees(self):
        """The keys a query row sees on average under the window (rows aligned to the
        last key), over a packed call's longest sequences: a row's work, for the
        dispatch."""
        q_len, kv_len = (
            (self.q_len, self.kv_len)
            if self.packed is None
            else (self.packed.max_q_len, self.packed.max_kv_len)
        )
        return mean_visible_keys(q_len, kv_len, *self.window)


def array_module(named_arrays):
    """NumPy or CuPy: the module of ``named_arrays`` (``(name, array)`` pairs), all of
    one kind and (CuPy) on one device, else ``InvalidArgumentError``."""
    kinds = set()
    for name, a in named_arrays:
        if isinstance(a, np.ndarray):
            kinds.add("numpy")
        elif cupy is not None and isinstance(a, cupy.ndarray):
            kinds.add("cupy")
        else:
            raise InvalidArgumentError(
                name, f"expected numpy.ndarray or cupy.ndarray, got {type(a).__name__}"
            )
    if len(kinds) > 1:
        names = ", ".join(n for n, _ in named_arrays)
        raise InvalidArgumentError(names, "numpy and cupy arrays are mixed; pass all of one kind")
    if kinds == {"cupy"}:
        devices = {a.device.id for _, a in named_arrays}
        if len(devices) > 1:
            raise InvalidArgumentError(
                ", ".join(n for n, _ in named_arrays),
                f"arrays are on different devices {sorted(devices)}",
            )
        return cupy
    return np


def check_dtypes(named_arrays):
    """The one supported dtype of ``named_arrays`` (``(name, array)`` pairs)."""
    check_not_fp8(named_arrays)  # FP8 forwards are validated by cuflash.fp8_forward
    first_name, first = named_arrays[0]
    if first.dtype not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(
            first_name, f"unsupported dtype {first.dtype}; expected float32, float16 or bfloat16"
        )
    for name, a in named_arrays[1:]:
        if a.dtype != first.dtype:
            raise InvalidArgumentError(
                name, f"dtype {a.dtype} differs from {first_name}'s {first.dtype}"
            )
    return first.dtype


def check_count(name, value, minimum):
    """``value`` as an int of at least ``minimum`` (a bool is not a count)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(name, f"expected an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidArgumentError(name, f"must be >= {minimum}, got {value}")
    return int(value)


def check_flag(name, flag):
    """``flag`` is a bool (Python's or NumPy's)."""
    if not isinstance(flag, (bool, np.bool_)):
        raise InvalidArgumentError(name, f"expected a bool, got {type(flag).__name__}")


def check_rank(name, a, ndim, layout):
    """``a`` has ``ndim`` dimensions (``layout`` names them in the message)."""
    if a.ndim != ndim:
        raise InvalidArgumentError(name, f"expected {ndim}-D {layout}, got {a.ndim}-D")


def _check_shape(name, a, expected):
    if tuple(a.shape) != tuple(expected):
        raise InvalidArgumentError(name, f"expected shape {tuple(expected)}, got {tuple(a.shape)}")


def check_dims(name, a, expected, labels):
    """``a.shape[axis] == expected[axis]`` for each axis with an expectation."""
    for axis, (want, label) in enumerate(zip(expected, labels)):
        if want is not None and a.shape[axis] != want:
            raise InvalidArgumentError(name, f"has {label} {a.shape[axis]}, expected {want}")


def check_int32(name, a, shape, layout):
    """An int32 array of ``shape`` (``layout`` names its axes in the message)."""
    if a.dtype != np.int32:
        raise InvalidArgumentError(name, f"expected dtype int32, got {a.dtype}")
    if tuple(a.shape) != tuple(shape):
        raise InvalidArgumentError(
            name, f"expected shape {tuple(shape)} {layout}, got {tuple(a.shape)}"
        )


@functools.cache
def _device_memory(device_id):
    """Total memory of a GPU in bytes (asked once per device: it never changes)."""
    return cupy.cuda.Device(device_id).mem_info[1]


def _check_device_limits(problem, named_arrays, element_bytes=None):
    """Grid and length limits, and (GPU) memory: about twice the arrays' bytes (the outputs
    mirror the inputs), at ``element_bytes`` an element when the call computes on copies
    of another width (FP8 inputs dequantized to float32), else at the arrays' own."""
    if problem.num_heads > MAX_GRID_YZ or problem.batch > MAX_GRID_YZ:
        raise InvalidArgumentError(
            "q",
            f"too large for the device: batch and num_heads must each be <= "
            f"{MAX_GRID_YZ}, got {problem.batch} and {problem.num_heads}",
        )
    if problem.q_len > MAX_INT32 or problem.kv_capacity > MAX_INT32:
        raise InvalidArgumentError(
            "q", "too large for the device: sequence lengths must be < 2**31"
        )
    if problem.xp is np:
        return
    needed = 2 * sum(a.size * (element_bytes or a.itemsize) for _, a in named_arrays)
    total = _device_memory(named_arrays[0][1].device.id)
    if needed > total:
        raise InvalidArgumentError(
            named_arrays[0][0],
            f"too large for the device: the call needs about {needed / 2**30:.1f} GiB, "
            f"the device has {total / 2**30:.1f} GiB",
        )


def check_head_counts(num_heads, num_kv_heads, head_dim, max_head_dim=MAX_HEAD_DIM):
    """``(num_heads, num_kv_heads, head_dim)`` as ints, validated: counts, GQA divisibility
    and a supported head_dim (a multiple of 8 up to ``max_head_dim``)."""
    num_heads = check_count("num_heads", num_heads, 0)
    num_kv_heads = check_count("num_kv_heads", num_kv_heads, 1)
    head_dim = check_count("head_dim", head_dim, 1)
    if num_heads % num_kv_heads:
        raise InvalidArgumentError(
            "num_kv_heads", f"must divide num_heads ({num_heads}), got {num_kv_heads}"
        )
    if head_dim % 8 or head_dim > max_head_dim:
        raise InvalidArgumentError(
            "head_dim",
            f"unsupported head_dim {head_dim}: must be a multiple of 8 from 8 to {max_head_dim}",
        )
    return num_heads, num_kv_heads, head_dim


def check_head_dim_v(head_dim_v, head_dim, max_head_dim_v=MAX_HEAD_DIM):
    """v's head dim as an int (``head_dim`` for None): a multiple of 8 from 8 to
    ``max_head_dim_v``."""
    if head_dim_v is None:
        return head_dim
    head_dim_v = check_count("head_dim_v", head_dim_v, 1)
    if head_dim_v % 8 or head_dim_v > max_head_dim_v:
        raise InvalidArgumentError(
            "head_dim_v",
            f"unsupported head_dim_v {head_dim_v}: must be a multiple of 8 from 8 to "
            f"{max_head_dim_v}",
        )
    return head_dim_v


def value_dim_label(head_dim_v):
    """How a message names v's expected head dim: the argument that set it."""
    return "head_dim" if head_dim_v is None else "head_dim_v"


def check_softcap(softcap):
    """``softcap`` as a float: finite and >= 0 (0 is off)."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise InvalidArgumentError("softcap", f"expected a float, got {type(softcap).__name__}")
    value = float(softcap)
    if not math.isfinite(value) or value < 0:
        raise InvalidArgumentError("softcap", f"must be finite and >= 0 (0 is off), got {value}")
    return value


def check_alibi_slopes(alibi_slopes, q, num_heads, batch):
    """The shape of float32 ``alibi_slopes`` (``[num_heads]`` or ``[batch, num_heads]``, of
    ``q``'s array kind and device), or None when there are none."""
    if alibi_slopes is None:
        return None
    array_module([("q", q), ("alibi_slopes", alibi_slopes)])
    if alibi_slopes.dtype != np.float32:
        raise InvalidArgumentError(
            "alibi_slopes", f"expected dtype float32, got {alibi_slopes.dtype}"
        )
    shape = tuple(alibi_slopes.shape)
    if shape not in ((num_heads,), (batch, num_heads)):
        raise InvalidArgumentError(
            "alibi_slopes", f"expected shape ({num_heads},) or ({batch}, {num_heads}), got {shape}"
        )
    return shape


def check_sinks(sinks, q, num_heads):
    """Are there attention sinks? float32 ``sinks`` ``[num_heads]`` (one logit a query
    head), of ``q``'s array kind and device, or None."""
    if sinks is None:
        return False
    array_module([("q", q), ("sinks", sinks)])
    if sinks.dtype != np.float32:
        raise InvalidArgumentError("sinks", f"expected dtype float32, got {sinks.dtype}")
    if tuple(sinks.shape) != (num_heads,):
        raise InvalidArgumentError(
            "sinks", f"expected shape ({num_heads},) [num_heads], got {tuple(sinks.shape)}"
        )
    return True


def check_block_mask(block_mask, mask_mod, batch, num_heads, q_len, kv_len):
    """A ``cuflash.block_mask.BlockMask`` for a call of these sizes: the mask function
    the call uses (its own, or ``mask_mod`` without a block mask)."""
    if block_mask is None:
        return mask_mod
    if not isinstance(block_mask, BlockMask):
        raise InvalidArgumentError(
            "block_mask",
            f"expected a cuflash.block_mask.BlockMask, got {type(block_mask).__name__}",
        )
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        raise InvalidArgumentError(
            "mask_mod", "give the mask through block_mask only (it holds its own mask function)"
        )
    block_mask.check_call(batch, num_heads, q_len, kv_len)
    return block_mask.mask_mod


def check_user_modifiers(score_mod, mask_mod, xp, num_heads, batch, q_len, kv_len):
    """User-defined modifiers (``cuflash.modifiers``): of their kinds, their reads inside
    their arrays for these sizes (the GPU path checks the arrays' kind and device when it
    packs them)."""
    for name, value, kind in (("score_mod", score_mod, ScoreMod), ("mask_mod", mask_mod, MaskMod)):
        if value is None:
            continue
        if not isinstance(value, kind):
            raise InvalidArgumentError(
                name, f"expected a cuflash.modifiers.{kind.__name__}, got {type(value).__name__}"
            )
        value.check_bounds(batch, num_heads, q_len, kv_len)


def forward_problem(
    q,
    k,
    v,
    config,
    extra_arrays=(),
    alibi_batch=None,
    modifier_sizes=None,
    storage_dtype=None,
):
    """Validate a forward call (also the shared part of a backward call) of the options
    ``config`` (an :class:`~cuflash.core.config.AttentionConfig`). ``alibi_batch``: the
    batch entries per-entry slopes cover (the sequences of a packed call; default the
    batch); ``modifier_sizes``: the ``(batch, q_len, kv_len)`` the user modifiers see (a
    packed call's sequences and longest lengths; default the arrays'); ``storage_dtype``:
    the FP8 dtype of the arrays, which :func:`cuflash.fp8.storage_dtype` has checked
    (None: the usual dtypes)."""
    c = config
    named = [("q", q), ("k", k), ("v", v), *extra_arrays]
    xp = array_module(named)
    for name, a in (("q", q), ("k", k), ("v", v)):
        check_rank(name, a, 4, "[B, H, S, D]")
    dtype = check_dtypes(named) if storage_dtype is None else storage_dtype
    num_heads, num_kv_heads, head_dim = check_head_counts(c.num_heads, c.num_kv_heads, c.head_dim)
    value_label = value_dim_label(c.head_dim_v)
    head_dim_v = check_head_dim_v(c.head_dim_v, head_dim)
    batch, _, q_len, _ = q.shape
    if q.shape[1] != num_heads:
        raise InvalidArgumentError("q", f"has {q.shape[1]} heads, num_heads is {num_heads}")
    if q.shape[3] != head_dim:
        raise InvalidArgumentError("q", f"has head_dim {q.shape[3]}, head_dim is {head_dim}")
    for name, a, width, label in (
        ("k", k, head_dim, "head_dim"),
        ("v", v, head_dim_v, value_label),
    ):
        if a.shape[0] != batch:
            raise InvalidArgumentError(name, f"batch {a.shape[0]} differs from q's {batch}")
        if a.shape[1] != num_kv_heads:
            raise InvalidArgumentError(
                name, f"has {a.shape[1]} heads, num_kv_heads is {num_kv_heads}"
            )
        if a.shape[3] != width:
            raise InvalidArgumentError(name, f"has head_dim {a.shape[3]}, {label} is {width}")
    if k.shape[2] != v.shape[2]:
        raise InvalidArgumentError(
            "v", f"sequence length {v.shape[2]} differs from k's {k.shape[2]}"
        )
    kv_capacity = k.shape[2]
    if c.kv_seq_len is None:
        kv_len = kv_capacity
    else:
        kv_len = check_count("kv_seq_len", c.kv_seq_len, 0)
        if kv_len > kv_capacity:
            raise InvalidArgumentError(
                "kv_seq_len", f"must be <= S_k ({kv_capacity}), got {kv_len}"
            )
    window = normalize_window(c.window_size, c.causal, kv_capacity, q_len)
    softmax_scale = c.softmax_scale
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(
            softmax_scale, numbers.Real
        ):
            raise InvalidArgumentError(
                "softmax_scale", f"expected a float, got {type(softmax_scale).__name__}"
            )
        scale = float(softmax_scale)
        if not math.isfinite(scale):
            raise InvalidArgumentError("softmax_scale", f"must be finite, got {scale}")
    check_flag("allow_tf32", c.allow_tf32)
    softcap = check_softcap(c.softcap)
    slopes_shape = check_alibi_slopes(
        c.alibi_slopes, q, num_heads, batch if alibi_batch is None else alibi_batch
    )
    has_sinks = check_sinks(c.sinks, q, num_heads)
    entries, rows, keys = modifier_sizes or (batch, q_len, kv_len)
    mask_mod = check_block_mask(c.block_mask, c.mask_mod, entries, num_heads, rows, keys)
    check_user_modifiers(c.score_mod, mask_mod, xp, num_heads, entries, rows, keys)
    problem = AttentionProblem(
        xp=xp,
        dtype=dtype,
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        q_len=q_len,
        kv_capacity=kv_capacity,
        kv_len=kv_len,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        softmax_scale=scale,
        causal=bool(c.causal),
        window=window,
        allow_tf32=bool(c.allow_tf32),
        softcap=softcap,
        alibi_slopes_shape=slopes_shape,
        score_mod=c.score_mod,
        mask_mod=mask_mod,
        block_mask=c.block_mask,
        sinks=has_sinks,
    )
    _check_device_limits(problem, named, element_bytes=None if storage_dtype is None else 4)
    return problem


def backward_problem(dout, q, k, v, output, lse, config, deterministic, synchronize):
    """Validate a backward call of the options ``config``: the forward's checks plus dout,
    output and lse (both ``[B, H, S_q, head_dim_v]``)."""
    extra = [("dout", dout), ("output", output)]
    problem = forward_problem(q, k, v, config, extra_arrays=extra)
    # lse is float32, so it joins the array-kind check but not the dtype one.
    array_module([("q", q), ("lse", lse)])
    for name, a in extra:
        check_rank(name, a, 4, "[B, H, S, D]")
        _check_shape(name, a, problem.out_shape)
    check_rank("lse", lse, 3, "[B, H, S_q]")
    _check_shape("lse", lse, problem.lse_shape)
    if lse.dtype != np.float32:
        raise InvalidArgumentError("lse", f"expected dtype float32, got {lse.dtype}")
    check_flag("deterministic", deterministic)
    check_flag("synchronize", synchronize)
    return problem


def unit_last_stride(xp, a):
    """``a`` itself when its last stride is 1 (or it is empty), else one copy."""
    if a.size == 0 or a.strides[-1] == a.itemsize:
        return a
    return xp.ascontiguousarray(a)
