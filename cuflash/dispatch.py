"""Which GPU kernels run: the tensor-core fast path where it applies, or the general one.

>>> import cuflash
>>> with cuflash.kernel_path("general"):  # every call inside uses the general kernels
...     pass

The choice is held in a context variable, so it is per thread and per task.
"""

import contextlib
import contextvars

from .errors import InvalidArgumentError

PATHS = ("auto", "general")
_CURRENT = contextvars.ContextVar("cuflash_kernel_path", default="auto")



@contextlib.contextmanager
def kernel_path(name):
    """Use kernel path ``name`` inside the ``with`` block.

    Parameters
    ----------
    name : {"auto", "general"}
        ``"auto"`` (the default) runs the tensor-core kernels wherever they
        apply and the general kernels elsewhere; ``"general"`` runs the
        general kernels for every call. Tensor-core kernels need compute
        capability 8.0 or newer and 16-byte aligned rows; they serve
        float16/bfloat16 with head_dim 64, 128 or 256 (forward and backward
        on ``wgmma`` on compute capability 9.0, ``mma.sync`` elsewhere), and float32
        calls with ``allow_tf32=True`` (forward for every head_dim, backward
        for head_dim <= 128).
    """
    if name not in PATHS:
        raise InvalidArgumentError("kernel_path", f"expected one of {PATHS}, got {name!r}")
    token = _CURRENT.set(name)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current():
    """The kernel path in force: ``"auto"`` or ``"general"``."""
    return _CURRENT.get()
