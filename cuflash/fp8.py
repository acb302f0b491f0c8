"""FP8 (e4m3) inputs (the FP8 page): their dtypes, the descales, and the dequantization.

An FP8 array is either a NumPy array of ``ml_dtypes.float8_e4m3fn`` or, since CuPy
has no float8 dtype, a ``uint8`` array (NumPy or CuPy) holding the e4m3 bits with
``fp8_format="e4m3"`` naming them. Nothing here runs attention: the forward calls
(:mod:`cuflash.fp8_forward`) validate with these checks, then run a native kernel
where one serves the call, else dequantize with :func:`decode` and call the float32
path.

Dequantizing is exact: every e4m3 value is a float32 (and a bfloat16 and a float16)
value, looked up in a 256-entry table that ``ml_dtypes`` itself decodes. The descales
are applied as float32 products (roundings of 2^-24 relative), q's and k's both to
q (so a paged cache, whose blocks several sequences may share, is never rescaled) and
v's to the output.
"""

import numbers

import numpy as np

from .core.dtypes import BFLOAT16, DTYPES_BY_NAME, SUPPORTED_DTYPES
from .errors import InvalidArgumentError

try:
    import ml_dtypes

    E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
except ImportError:  # pragma: no cover
    E4M3 = None

BITS = np.dtype(np.uint8)
FORMATS = ("e4m3",)  # the values fp8_format takes
SIXTEEN_BIT = tuple(d for d in SUPPORTED_DTYPES if d.itemsize == 2)

# The float32 value of every e4m3 bit pattern (0x7F and 0xFF are NaN; there is no inf).
DECODE_TABLE = (
    None if E4M3 is None else np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
)


def is_storage(dtype):
    """Can an array of ``dtype`` hold FP8 values (float8_e4m3fn, or uint8 bits)?"""
    return dtype == BITS or (E4M3 is not None and dtype == E4M3)


def _is_float8(dtype):
    """Any ``ml_dtypes`` 8-bit float (e4m3fn, e5m2, the fnuz kinds ...)."""
    return dtype.itemsize == 1 and dtype.name.startswith("float8")


def requested(arrays, *keywords):
    """Does a call ask for the FP8 path: an 8-bit array among ``arrays``, or one of
    the FP8 keywords (``fp8_format``, the descales, ``out_dtype``) given?"""
    for keyword in keywords:
        if keyword is not None:
            return True
    for a in arrays:
        dtype = getattr(a, "dtype", None)
        # FP8 storage is one byte an element: the itemsize first (a small call's host time)
        if (
            dtype is not None
            and getattr(dtype, "itemsize", 1) == 1
            and (is_storage(dtype) or _is_float8(dtype))
        ):
            return True
    return False


def check_format(fp8_format):
    """``fp8_format``: None or one of :data:`FORMATS`."""
    if fp8_format is not None and (not isinstance(fp8_format, str) or fp8_format not in FORMATS):
        raise InvalidArgumentError(
            "fp8_format", f"expected one of {', '.join(map(repr, FORMATS))}, got {fp8_format!r}"
        )


def _check_one(name, a, fp8_format):
    """Is array ``a`` FP8 storage? Raises for 8-bit arrays that are not e4m3."""
    if a.dtype == BITS:
        if fp8_format is None:
            raise InvalidArgumentError(
                name,
                "uint8 arrays hold FP8 only with fp8_format='e4m3' naming the bits "
                "(CuPy has no float8 dtype)",
            )
        return True
    if E4M3 is not None and a.dtype == E4M3:
        return True
    if _is_float8(a.dtype):
        raise InvalidArgumentError(
            name, f"unsupported FP8 dtype {a.dtype}; expected float8_e4m3fn (e4m3)"
        )
    return False


def storage_dtype(named_arrays, fp8_format, sixteen_bit_first=False):
    """The FP8 storage dtype shared by arrays ``named_arrays`` (float8_e4m3fn or uint8),
    checked: every array FP8 of that one dtype, except that with ``sixteen_bit_first``
    the first (the KV cache's q) may instead be float16 or bfloat16. Raises when none is
    FP8 (an FP8 keyword was given without FP8 arrays)."""
    check_format(fp8_format)
    kinds = [(name, a, _check_one(name, a, fp8_format)) for name, a in named_arrays]
    fp8 = [(name, a) for name, a, is_fp8 in kinds if is_fp8]
    if not fp8:
        names = ", ".join(name for name, _ in named_arrays)
        raise InvalidArgumentError(
            names,
            "none is FP8 (float8_e4m3fn, or uint8 with fp8_format): fp8_format, the "
            "descales and out_dtype are for FP8 inputs only",
        )
    first_name, first = fp8[0]
    for index, (name, a, is_fp8) in enumerate(kinds):
        if is_fp8:
            if a.dtype != first.dtype:
                raise InvalidArgumentError(
                    name, f"dtype {a.dtype} differs from {first_name}'s {first.dtype}"
                )
        elif index == 0 and sixteen_bit_first:
            if a.dtype not in SIXTEEN_BIT:
                raise InvalidArgumentError(
                    name,
                    f"dtype {a.dtype} with an FP8 cache; expected FP8 like the cache, "
                    "float16 or bfloat16",
                )
        else:
            raise InvalidArgumentError(
                name,
                f"dtype {a.dtype} mixed with FP8 {first_name}; FP8 attention takes q, k and "
                "v all in e4m3 (only a KV-cache call takes a 16-bit q)",
            )
    return first.dtype


def check_not_fp8(named_arrays):
    """Raise for an FP8 array among ``named_arrays``: of the calls that take none (the
    backward, the vjp helpers, ring attention)."""
    for name, a in named_arrays:
        dtype = getattr(a, "dtype", None)
        if dtype is not None and (is_storage(dtype) or _is_float8(dtype)):
            raise InvalidArgumentError(
                name,
                f"dtype {dtype}: FP8 inputs are for the forward functions only; the "
                "backward, the vjp and ring attention take float32, float16 or bfloat16",
            )


def check_out_dtype(out_dtype, default):
    """``out_dtype`` as a NumPy dtype: float32, float16 or bfloat16 (a dtype or its name);
    ``default`` for None."""
    if out_dtype is None:
        return default
    if isinstance(out_dtype, str) and out_dtype in DTYPES_BY_NAME:
        return DTYPES_BY_NAME[out_dtype]
    try:
        dtype = np.dtype(out_dtype)
    except TypeError:
        dtype = None
    if dtype not in SUPPORTED_DTYPES:
        name = getattr(out_dtype, "__name__", None) or repr(out_dtype)
        raise InvalidArgumentError(
            "out_dtype", f"expected float32, float16 or bfloat16, got {name}"
        )
    return dtype


def default_out_dtype(q):
    """bfloat16 for an FP8 ``q``; a 16-bit q's own dtype (a KV-cache call)."""
    return q.dtype if q.dtype in SIXTEEN_BIT else BFLOAT16


def _type_name(x):
    """``list``, ``numpy.ndarray``, ``cupy.ndarray``: a type, with its package unless
    built in."""
    package = type(x).__module__.split(".")[0]
    return type(x).__name__ if package == "builtins" else f"{package}.{type(x).__name__}"


def check_descale(name, descale, xp, batch, num_kv_heads):
    """A descale: None (1), a positive finite real, or a float32 ``[batch, num_kv_heads]``
    array of ``xp``'s kind (a NumPy one must be positive and finite; a CuPy one is not
    read on the host). Returns a float or the array."""
    if descale is None:
        return None
    if isinstance(descale, numbers.Real) and not isinstance(descale, (bool, np.bool_)):
        value = float(descale)
        if not (np.isfinite(value) and value > 0):
            raise InvalidArgumentError(name, f"must be positive and finite, got {value}")
        return value
    if not isinstance(descale, xp.ndarray):
        raise InvalidArgumentError(
            name,
            f"expected a float or a float32 [B, num_kv_heads] {xp.__name__} array, "
            f"got {_type_name(descale)}",
        )
    if descale.dtype != np.float32:
        raise InvalidArgumentError(name, f"expected dtype float32, got {descale.dtype}")
    if tuple(descale.shape) != (batch, num_kv_heads):
        raise InvalidArgumentError(
            name,
            f"expected a scalar or shape ({batch}, {num_kv_heads}) [B, num_kv_heads], "
            f"got {tuple(descale.shape)}",
        )
    if xp is np and not np.all(np.isfinite(descale) & (descale > 0)):
        raise InvalidArgumentError(name, "must be positive and finite everywhere")
    return descale


def check_descales(descales, xp, batch, num_kv_heads):
    """``(q_descale, k_descale, v_descale)`` checked by :func:`check_descale`."""
    return tuple(
        check_descale(name, d, xp, batch, num_kv_heads)
        for name, d in zip(("q_descale", "k_descale", "v_descale"), descales)
    )


def query_scale(xp, q_descale, k_descale):
    """The factor q takes: ``q_descale * k_descale`` in float32, a float or a
    ``[B, H_kv]`` array (None when both are 1)."""
    if q_descale is None and k_descale is None:
        return None
    if q_descale is None or k_descale is None:
        given = k_descale if q_descale is None else q_descale
        return given if isinstance(given, float) else xp.asarray(given, dtype=np.float32)
    if isinstance(q_descale, float) and isinstance(k_descale, float):
        return float(np.float32(q_descale) * np.float32(k_descale))
    return xp.asarray(q_descale, dtype=np.float32) * xp.asarray(k_descale, dtype=np.float32)


def per_head(xp, scale, group_size, rows=None):
    """A ``[B, H_kv]`` factor as an array broadcasting against ``[B, H, S, D]`` (each query
    head taking its KV head's factor), or with ``rows`` (the batch entry of each token,
    an int array) against a packed ``[tokens, H, D]`` array. A float or None passes
    through."""
    if scale is None or isinstance(scale, float):
        return scale
    heads = xp.repeat(scale, group_size, axis=1)
    if rows is None:
        return heads[:, :, None, None]
    return heads[rows][:, :, None]


_DECODE_KERNEL = None
_DEVICE_TABLES: dict = {}  # DECODE_TABLE on each device, copied there once


def _decode_kernel():
    """The CuPy kernel of :func:`decode` (made once): a table lookup and one product."""
    global _DECODE_KERNEL
    if _DECODE_KERNEL is None:
        import cupy

        _DECODE_KERNEL = cupy.ElementwiseKernel(
            "uint8 bits, raw float32 table, float32 scale",
            "float32 value",
            "value = table[bits] * scale",
            "cuflash_fp8_e4m3_decode",
        )
    return _DECODE_KERNEL


def decode(x, scale=None):
    """The float32 values of FP8 array ``x`` (NumPy or CuPy, float8_e4m3fn or uint8
    bits), times ``scale`` (None, a float, or an array broadcasting against ``x``), as a
    new contiguous array. NaN bit patterns give NaN."""
    factor = scale if hasattr(scale, "dtype") else np.float32(1 if scale is None else scale)
    if isinstance(x, np.ndarray):
        assert DECODE_TABLE is not None  # ml_dtypes is a dependency
        values = DECODE_TABLE[x.view(np.uint8)]
        if scale is not None:
            values *= factor
        return values
    import cupy

    device = cupy.cuda.runtime.getDevice()
    table = _DEVICE_TABLES.get(device)
    if table is None:
        table = _DEVICE_TABLES[device] = cupy.asarray(DECODE_TABLE)
    return _decode_kernel()(x.view(cupy.uint8), table, factor)


def scaled_output(out, scale, out_dtype):
    """The float32 output times ``scale`` (v's descale; None, a float or a broadcasting
    array), in ``out_dtype`` (one rounding)."""
    if scale is not None:
        out = out * (scale if hasattr(scale, "dtype") else np.float32(scale))
    return out.astype(out_dtype, copy=False)


def quantize(x, num_kv_heads=None):
    """NumPy ``x`` ``[B, H, S, D]`` (any real dtype) in e4m3 with its descale: ``(values,
    descale)``, ``values`` float8_e4m3fn of ``x / descale`` rounded to nearest and
    ``descale = amax / 448`` (e4m3's largest value) in float32, one for the whole array
    or, with ``num_kv_heads``, a ``[B, num_kv_heads]`` array over each KV head's group
    of heads (FlashAttention-3's per-(batch, KV head) scaling).

    >>> import numpy as np
    >>> from cuflash import fp8
    >>> values, descale = fp8.quantize(np.full((1, 2, 3, 8), 0.5), num_kv_heads=1)
    >>> true_value = values[0, 0, 0, 0].astype(np.float32) * descale[0, 0]
    >>> values.dtype.name, descale.shape, float(true_value)
    ('float8_e4m3fn', (1, 1), 0.5)
    """
    x = np.asarray(x, dtype=np.float64)
    if num_kv_heads is None:
        amax = np.abs(x).max(initial=0.0)
    else:
        amax = np.abs(x.reshape(x.shape[0], num_kv_heads, -1)).max(axis=-1, initial=0.0)
    descale = (np.where(amax > 0, amax, 1.0) / 448.0).astype(np.float32)
    if num_kv_heads is None:
        return (x / np.float64(descale)).astype(E4M3), descale[()]
    rows = np.repeat(descale, x.shape[1] // num_kv_heads, axis=1)[:, :, None, None]
    return (x / rows.astype(np.float64)).astype(E4M3), descale
