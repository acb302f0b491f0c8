"""Launch plans cached by call signature, so that a repeated GPU call skips validation
and kernel choice.

The signature holds everything validation and the kernel choice read: each
array's type, dtype, shape, strides, device and 16-byte alignment, the
scalar arguments with their types (the values of the call's
:class:`~cuflash.core.config.AttentionConfig`, as a flat tuple: a front end builds
that object, a few microseconds of host time, only when its plan is missed), the
current device, and the kernel path, skipped kernels and tried opt-in kernels in
force. Two calls with the same
signature validate the same way and run the same kernels on different data, so
the second reuses the first's :class:`cuflash.gpu.launch.ForwardPlan` or
:class:`cuflash.gpu.launch.BackwardPlan`.
Calls with NumPy arrays, or with an unhashable argument, are not cached.
"""

from .. import dispatch

try:
    import cupy
except ImportError:  # pragma: no cover - the CPU path needs no CuPy
    cupy = None

MAX_PLANS = 1024
_PLANS: dict = {}


def signature(arrays, scalars):
    """The cache key of a call on CuPy arrays, or None (NumPy arrays, or unhashable)."""
    if cupy is None:
        return None
    ndarray = cupy.ndarray
    parts: list = []
    for a in arrays:
        if type(a) is not ndarray:
            return None
        memory = a.data
        parts += (a.dtype, a.shape, a.strides, memory.device_id, memory.ptr & 15)
    return (
        *parts,
        cupy.cuda.runtime.getDevice(),
        dispatch.state(),
        *map(type, scalars),
        *scalars,
    )


def get(key):
    """The plan of signature ``key``, or None (not seen, or an unhashable argument such as
    a list as window_size: such calls validate every time)."""
    if key is None:
        return None
    try:
        return _PLANS.get(key)
    except TypeError:
        return None


def remember(key, plan):
    if key is None:
        return
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    try:
        _PLANS[key] = plan
    except TypeError:
        pass


def clear():
    """Forget every plan (tests; a plan never goes stale by itself)."""
    _PLANS.clear()
