"""Which GPU kernels run: the tensor-core fast path where it applies, or the general one.

>>> import cuflash
>>> with cuflash.kernel_path("general"):  # every call inside uses the general kernels
...     pass

The choice is held in a context variable, so it is per thread and per task.
"""

import contextlib
import contextvars

from .errors import InvalidArgumentError
from .gpu import registry

PATHS = ("auto", "general")
# (kernel path, skipped kernels, tried opt-in kernels): one variable, so that a call's
# plan signature reads all three at once (``state``).
_STATE: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "cuflash_dispatch", default=("auto", frozenset(), frozenset())
)


@contextlib.contextmanager
def _with(index, value):
    """Inside: the state with entry ``index`` replaced by ``value``."""
    state = list(_STATE.get())
    state[index] = value
    token = _STATE.set(tuple(state))
    try:
        yield
    finally:
        _STATE.reset(token)


def state():
    """``(current(), excluded(), tried())`` in one read (a plan signature's part)."""
    return _STATE.get()


@contextlib.contextmanager
def kernel_path(name):
    """Use kernel path ``name`` inside the ``with`` block.

    Parameters
    ----------
    name : {"auto", "general"}
        ``"auto"`` (the default) runs the tensor-core kernels wherever they
        apply and the general kernels elsewhere; ``"general"`` runs the
        general kernels for every call. Tensor-core kernels need compute
        capability 8.0 or newer and 16-byte aligned rows; which kernel serves
        which call is the table of ``cuflash.gpu.registry``.
    """
    if name not in PATHS:
        raise InvalidArgumentError("kernel_path", f"expected one of {PATHS}, got {name!r}")
    with _with(0, name):
        yield


def current():
    """The kernel path in force: ``"auto"`` or ``"general"``."""
    return _STATE.get()[0]


@contextlib.contextmanager
def skip_kernels(*names):
    """Pass over the kernels ``names`` (of ``cuflash.gpu.registry.KERNELS``) inside the
    ``with`` block, so that the next in line serves: for tests and benchmarks that
    compare kernels. An ordered-dQ role (``backward_wgmma_ws_ordered_dq``) may be named
    too: deterministic calls then run the kernel's dQ pass instead.

    >>> import cuflash
    >>> with cuflash.dispatch.skip_kernels("forward_wgmma_ws"):
    ...     pass
    """
    roles = {role for role in registry.BY_ROLE if role.endswith(registry.ORDERED_DQ)}
    unknown = set(names) - set(registry.BY_NAME) - roles
    if unknown:
        raise InvalidArgumentError("names", f"unknown kernels {sorted(unknown)}")
    with _with(1, excluded() | frozenset(names)):
        yield


def excluded():
    """The kernels passed over in this context (see :func:`skip_kernels`)."""
    return _STATE.get()[1]


@contextlib.contextmanager
def try_kernels(*names):
    """Let the dispatch take the opt-in kernels ``names`` (``KernelSpec.opt_in`` of
    ``cuflash.gpu.registry.KERNELS``: written and checked without a GPU, awaiting their GPU
    run) inside the ``with`` block, where they serve the call, for tests and benchmarks.
    No kernel of this release is opt-in.

    >>> import cuflash
    >>> sorted(spec.name for spec in cuflash.gpu.registry.KERNELS if spec.opt_in)
    []
    """
    unknown = set(names) - {spec.name for spec in registry.KERNELS if spec.opt_in}
    if unknown:
        raise InvalidArgumentError("names", f"not opt-in kernels: {sorted(unknown)}")
    with _with(2, tried() | frozenset(names)):
        yield


def tried():
    """The opt-in kernels the dispatch may take in this context (see :func:`try_kernels`)."""
    return _STATE.get()[2]
