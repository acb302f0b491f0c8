"""One kernel launch and what it passes: :class:`Launch` (grid, block, shared memory
and the parameter record, handed to ``cuLaunchKernel``), the user's modifier
arguments, the device queries a launch needs, and the float16 pieces of a float32
operand (two small launches).
"""

import contextlib
import functools
import math
import struct
import threading

import cupy
import numpy as np
from cupy.cuda import function as _function
from cupy_backends.cuda.api.driver import launchKernel as _launch_kernel

from ..errors import InvalidArgumentError
from . import kernel_params

_DEVICES: dict = {}


def device_capability():
    """``(device id, compute capability)`` of CuPy's current device (asked once a device)."""
    device_id = cupy.cuda.runtime.getDevice()
    found = _DEVICES.get(device_id)
    if found is None:
        found = _DEVICES[device_id] = (
            device_id,
            int(cupy.cuda.Device(device_id).compute_capability),
        )
    return found


@functools.cache
def multiprocessors(device_id):
    """The SM count of device ``device_id`` (a persistent kernel's blocks: one an SM)."""
    return cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]


def rows_are_16_byte_aligned(arrays):
    """cp.async moves 16-byte chunks: every row must start on a 16-byte boundary."""
    return all(a.data.ptr % 16 == 0 and all(s % 16 == 0 for s in a.strides[:3]) for a in arrays)


def element_strides(a):
    """Element strides of the batch, head and sequence axes, as int64 scalars."""
    return tuple(np.int64(s // a.itemsize) for s in a.strides[:3])


# cuLaunchKernel's `extra` markers (cuda.h): the next value is the parameter buffer,
# the next the address of its size (a size_t), the end of the array.
CU_LAUNCH_PARAM_END, CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2


class Launch:
    """One kernel launch with its grid, block, shared memory and fixed arguments:
    ``launch(stream, *addresses)`` passes the call's device addresses (ints, 0 for none)
    and the fixed arguments straight to ``cuLaunchKernel``.

    The fixed arguments are the record of a kernel's parameter list (a
    :class:`cuflash.gpu.kernel_params.Params`: the call's addresses are written into its
    per-call members), passed whole as the kernel's parameter buffer (``extra``:
    CU_LAUNCH_PARAM_BUFFER_POINTER, "a buffer containing all kernel parameters", laid
    out by the parameters' alignment as the record is); or NumPy scalars of at most 8
    bytes and records passed by value (an object with an ``address`` of its host bytes,
    such as :class:`UserArguments`) after the addresses, passed by an array of
    parameter pointers (``kernelParams``). Either is packed once,
    so that a launch only writes the addresses into their slots. A lock keeps two
    threads from sharing the slots: the driver copies them before ``cuLaunchKernel``
    returns.
    """

    __slots__ = (
        "function",
        "grid",
        "block",
        "shared_bytes",
        "fixed",
        "_dimensions",
        "_storage",
        "_params",
        "_size",
        "_arguments",
        "_pack",
        "_lock",
    )

    def __init__(self, function, grid, threads, shared_bytes, fixed=()):
        self.function = function  # keeps its module loaded
        self.grid = tuple(max(1, int(g)) for g in grid)
        self.grid += (1,) * (3 - len(self.grid))
        self.block = (int(threads), 1, 1)
        self.shared_bytes = int(shared_bytes)
        self.fixed = fixed if isinstance(fixed, kernel_params.Params) else tuple(fixed)
        self._dimensions = (function.ptr, *self.grid, *self.block, self.shared_bytes)
        self._arguments = None
        self._lock = threading.Lock()

    @classmethod
    def of_role(cls, loaded, role, grid, fixed=(), functors=None):
        """The launch of kernel ``role`` of a loaded variant (its registry traits), with
        the user's modifier functors (``kernel_build.UserFunctors``) if given."""
        traits = loaded.variant.traits(role)
        if isinstance(fixed, kernel_params.Params):  # the kernel's parameter offsets
            fixed = fixed.rebased(kernel_params.parameter_base(loaded.variant.sm))
        return cls(
            compiled(loaded, role, functors).kernel,
            grid,
            traits.threads,
            traits.shared_bytes,
            fixed,
        )

    def _lay_out(self, count):
        """``cuLaunchKernel``'s ``(kernelParams, extra)``: for a parameter record, the
        ``extra`` array that hands it over as the parameter buffer; else the slots of
        ``count`` addresses, then one a fixed scalar, and the array of parameter pointers
        (a record's points at the record)."""
        if isinstance(self.fixed, kernel_params.Params):
            if count != len(self.fixed.per_call):
                raise TypeError(f"{self.fixed.name}: {count} addresses for {self.fixed.per_call}")
            self._storage = self.fixed
            self._size = np.array([self.fixed.size], dtype=np.uint64)  # a size_t
            self._params = np.array(
                [
                    CU_LAUNCH_PARAM_BUFFER_POINTER,
                    self.fixed.address,
                    CU_LAUNCH_PARAM_BUFFER_SIZE,
                    self._size.ctypes.data,
                    CU_LAUNCH_PARAM_END,
                ],
                dtype=np.uint64,
            )
            self._pack = self.fixed.pack
            self._arguments = (0, self._params.ctypes.data)
            return self._arguments
        storage = np.zeros(count + len(self.fixed), dtype=np.int64)
        raw = storage.view(np.uint8)
        base = storage.ctypes.data
        params = np.array([base + 8 * i for i in range(len(storage))], dtype=np.uint64)
        for i, value in enumerate(self.fixed, start=count):
            if hasattr(value, "address"):
                params[i] = value.address
            else:
                data = np.asarray(value).tobytes()
                if len(data) > 8:
                    raise TypeError(f"a fixed kernel argument of {len(data)} bytes")
                raw[8 * i : 8 * i + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._storage, self._params = storage, params  # alive while the launch is
        self._pack = functools.partial(struct.Struct(f"<{count}Q").pack_into, storage, 0)
        self._arguments = (params.ctypes.data, 0)
        return self._arguments

    def __call__(self, stream, *addresses):
        with self._lock:
            arguments = self._arguments
            if arguments is None:
                arguments = self._lay_out(len(addresses))
            self._pack(*addresses)
            _launch_kernel(*self._dimensions, stream, *arguments)


def address(a):
    """The device address of a CuPy array or memory pointer, 0 for None."""
    if a is None:
        return 0
    return a.data.ptr if isinstance(a, cupy.ndarray) else a.ptr


def current_stream():
    """The current CUDA stream's handle, as :class:`Launch` takes it."""
    return cupy.cuda.get_current_stream().ptr


@contextlib.contextmanager
def modifier_compile_errors(functors):
    """Inside: a compilation with the user's modifier ``functors`` (or None) that NVRTC
    refuses raises an ``InvalidArgumentError`` carrying the compiler's message."""
    try:
        yield
    except cupy.cuda.compiler.CompileException as exc:
        if functors is None:
            raise
        raise InvalidArgumentError(
            "score_mod" if functors.key[0] is not None else "mask_mod",
            f"the modifier does not compile: {exc}",
        ) from None


def compiled(loaded, role, functors):
    """``loaded.kernel(role, functors)`` (see :func:`modifier_compile_errors`)."""
    if functors is None:
        return loaded.kernel(role)
    with modifier_compile_errors(functors):
        return loaded.kernel(role, functors)


USER_ARGS_DTYPE = kernel_params.USER_ARGS_DTYPE


class UserArguments:
    """The ``UserModifierArgs`` argument of one kernel launch: a host record passed by
    value (its host ``address`` for :class:`Launch`, ``pointer`` for a CuPy kernel
    call), zeros for a call without user modifiers."""

    def __init__(self, problem=None, view=None):
        self.record = np.zeros(1, dtype=USER_ARGS_DTYPE)
        if problem is not None:
            for field, mod in (
                ("score_arrays", problem.score_mod),
                ("mask_arrays", problem.mask_mod),
            ):
                if mod is not None:  # CuPy arrays on the current device, else an error
                    self.record[field] = mod.kernel_arguments(cupy)[0]
        if view is not None:
            for name, value in zip(USER_ARGS_DTYPE.names[2:], view.fields()):
                self.record[name] = value
            self.view = view  # keeps its arrays alive
        self.address = self.record.ctypes.data
        self.pointer = _function.CPointer(self.address)


NO_USER_ARGUMENTS = UserArguments()


class Float16Pieces:
    """The float16 pieces of one float32 operand (see :func:`Float16Pieces.__call__`)."""

    def __init__(self, loaded, shape, strides, valid_rows):
        batch, heads, seq_len, head_dim = shape
        self.shape = shape
        self.pieces_shape = (batch, heads, seq_len, head_dim)
        abs_max, split = kernel_params.pieces_params(strides, valid_rows, heads, seq_len)
        self.abs_max = Launch.of_role(
            loaded, "float16_pieces_abs_max", (math.ceil(valid_rows / 32), heads, batch), abs_max
        )
        self.split = Launch.of_role(
            loaded, "float16_pieces_split", (math.ceil(valid_rows / 4), heads, batch), split
        )

    def __call__(self, stream, x):
        """``(hi, lo, scales)``: contiguous float16 arrays of ``x``'s shape (the kernels
        fill their tiles' padding columns with zeros), with hi + lo = x * scale on the
        valid rows of each head (22 significant bits), and float32 ``scales`` of shape
        ``[batch, heads]``: for each head the power of two that puts its max |x| in
        [2^13, 2^14)."""
        abs_max = cupy.zeros(self.shape[:2], dtype=np.float32)
        self.abs_max(stream, x.data.ptr, abs_max.data.ptr)
        hi = cupy.empty(self.pieces_shape, dtype=np.float16)
        lo = cupy.empty(self.pieces_shape, dtype=np.float16)
        scales = cupy.empty(self.shape[:2], dtype=np.float32)
        self.split(stream, x.data.ptr, abs_max.data.ptr, hi.data.ptr, lo.data.ptr, scales.data.ptr)
        return hi, lo, scales


def pieces_strides(pieces):
    """Strides of the contiguous pieces arrays, as the kernels take them."""
    batch, heads, seq_len, width = pieces.pieces_shape
    return (np.int64(heads * seq_len * width), np.int64(seq_len * width), np.int64(width))
