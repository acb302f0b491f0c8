"""Launch plans cached by call signature, so that a repeated GPU call skips validation
and kernel choice.

The signature holds everything validation and the kernel choice read: each
array's type, dtype, shape, strides, device and 16-byte alignment, the
scalar arguments with their types, the current device, and the kernel path
and skipped kernels in force. Two calls with the same signature validate the
same way and run the same kernels on different data, so the second reuses the
first's :class:`cuflash.gpu.ForwardPlan` or :class:`cuflash.gpu.BackwardPlan`.
Calls with NumPy arrays, or with an unhashable argument, are not cached.
"""

from . import dispatch

try:
    import cupy
except ImportError:  # pragma: no cover - the CPU path needs no CuPy
    cupy = None

MAX_PLANS = 1024
_PLANS = {}


def signature(arrays, scalars):
    """The cache key of a call on CuPy arrays, or None (NumPy arrays, or unhashable)."""
    if cupy is None:
        return None
    parts = []
    for a in arrays:
        if type(a) is not cupy.ndarray:
            return None
        memory = a.data
        parts.append((a.dtype, a.shape, a.strides, memory.device_id, memory.ptr % 16))
    parts += (cupy.cuda.runtime.getDevice(), dispatch.current(), dispatch.excluded())
    parts.extend((type(x), x) for x in scalars)
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:  # a list as window_size, say: validate every call
        return None
    return key


def get(key):
    return None if key is None else _PLANS.get(key)


def remember(key, plan):
    if key is None:
        return
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan


def clear():
    """Forget every plan (tests; a plan never goes stale by itself)."""
    _PLANS.clear()
