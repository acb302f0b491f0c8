"""The public classes: :class:`ScoreMod` and :class:`MaskMod` (on :class:`Modifier`),
which translate a user's function once through the compiler modules of this package and
hold its C++ functor, its NumPy evaluator and its arrays; and :func:`index_grids`."""

import hashlib
import types
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .bounds import interval_step
from .cxx import MODIFIER_ARRAYS_DTYPE, MODIFIER_PRELUDE, cxx_struct
from .derivative import derivative
from .frontend import Inlinable, Located, Translator, is_cupy_array
from .ir import BOOL, FLOAT, INT32, INT64, INT_LIMITS, convert, graph_nodes
from .numpy_eval import py_function
from .source import NoSource, parameter_names


def index_grids(batch, heads, q_len, kv_len):
    """Broadcastable int64 index grids ``b [B,1,1,1]``, ``h [1,H,1,1]``,
    ``q_idx [1,1,Sq,1]``, ``kv_idx [1,1,1,Sk]`` for the NumPy evaluators."""
    return (
        np.arange(batch).reshape(-1, 1, 1, 1),
        np.arange(heads).reshape(1, -1, 1, 1),
        np.arange(q_len).reshape(1, 1, -1, 1),
        np.arange(kv_len).reshape(1, 1, 1, -1),
    )


def require_int(name, value, minimum_value):
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, (int, np.integer))
        or value < minimum_value
    ):
        raise InvalidArgumentError(name, f"expected an int >= {minimum_value}, got {value!r}")
    return int(value)


class Modifier(Inlinable):
    """Base of :class:`ScoreMod` and :class:`MaskMod`: the translation of one function.

    Parameters
    ----------
    fn : function
        A Python function (``def``, or a ``lambda`` in a file) in the language of
        :mod:`cuflash.modifiers`.
    **arrays : array or number
        Values for names that ``fn`` reads but does not define (each overrides
        the closure or global of that name).

    Attributes
    ----------
    kind : str
        ``"score"`` or ``"mask"``.
    fn : function
        The function.
    name : str
        Its qualified name.
    arrays : dict
        The arrays it reads, by name, in slot order.
    struct_name : str
        The C++ functor's name, ``UserScoreMod_<12 hex digits>`` or
        ``UserMaskMod_<...>``, a hash of its code.
    cxx_source : str
        The functor's C++ (compile after :data:`MODIFIER_PRELUDE`).
    cache_key : str
        sha256 (hex) of the prelude, the functor and the arrays' dtypes and
        ranks (not their contents).
    numpy_source : str
        The NumPy evaluator's source.

    Raises
    ------
    InvalidArgumentError
        For a function without source, syntax outside the language, values of
        the wrong type, unsupported arrays or a keyword that ``fn`` does not use.
    """

    kind: str | None = None
    ROLE: str | None = None
    PARAMETERS: tuple[tuple[str, str], ...] = ()

    def __init__(self, fn, /, **arrays):
        if not isinstance(fn, types.FunctionType):
            raise InvalidArgumentError(
                self.ROLE, f"expected a Python function (def or lambda), got {type(fn).__name__}"
            )
        used = set(fn.__code__.co_names) | set(fn.__code__.co_freevars)
        for name in arrays:
            if name not in used or name in parameter_names(fn.__code__):
                raise InvalidArgumentError(
                    self.ROLE, f"{fn.__qualname__} does not read a variable named {name!r}"
                )
        self.fn, self.name = fn, fn.__qualname__
        self._bindings = dict(arrays)
        translator = Translator(fn, self.PARAMETERS, self._bindings)
        try:
            result = translator.translate()
            result = self._checked_result(result, translator)
        except (Located, NoSource) as exc:
            raise InvalidArgumentError(self.ROLE, str(exc)) from None
        self._expression = result
        self._inputs = tuple(translator.arrays)
        self._grad_expression = derivative(result) if self.kind == "score" else None
        self._python = self._python_function()
        self._build_sources()

    # ........................................................ translation

    def _checked_result(self, result, translator):
        """The function's result, checked (and converted) for this kind of modifier."""
        return result

    def _build_sources(self):
        placeholder = "CUFLASH_MODIFIER_STRUCT"
        anonymous = cxx_struct(
            placeholder, self.kind, self._expression, self._grad_expression, self._inputs
        )
        digest = hashlib.sha256(anonymous.encode()).hexdigest()[:12]
        prefix = "UserScoreMod" if self.kind == "score" else "UserMaskMod"
        self.struct_name = f"{prefix}_{digest}"
        self.cxx_source = anonymous.replace(placeholder, self.struct_name)
        signature = ",".join(entry.signature for entry in self._inputs)
        key_text = "\n".join([MODIFIER_PRELUDE, self.cxx_source, signature])
        self.cache_key = hashlib.sha256(key_text.encode()).hexdigest()
        parameters = [name for name, _ in self.PARAMETERS]
        roots = [self._expression]
        if self.kind == "score":
            roots.append(self._grad_expression)
        self.numpy_source = py_function("evaluate", parameters, roots)
        namespace: dict[str, Any] = {"np": np}
        exec(compile(self.numpy_source, f"<cuflash modifier {self.name}>", "exec"), namespace)
        self._numpy_function = namespace["evaluate"]

    def _python_function(self):
        """``fn`` with the keyword bindings in its scope, for calls on scalars."""
        fn = self.fn
        if not self._bindings:
            return fn
        code = fn.__code__
        scope = dict(fn.__globals__)
        scope.update(
            (name, value) for name, value in self._bindings.items() if name in code.co_names
        )
        cells = tuple(
            types.CellType(self._bindings[name]) if name in self._bindings else cell
            for name, cell in zip(code.co_freevars, fn.__closure__ or ())
        )
        return types.FunctionType(code, scope, fn.__name__, fn.__defaults__, cells or None)

    def __call__(self, *args):
        """Run the original Python function (on scalars, say)."""
        return self._python(*args)

    def __repr__(self):
        names = ", ".join(entry.name for entry in self._inputs)
        return f"{type(self).__name__}({self.name}, arrays=[{names}], {self.struct_name})"

    @property
    def arrays(self):
        return {entry.name: entry.array for entry in self._inputs}

    def reads_index(self, name):
        """Does the function's result depend on index ``name`` (``"b"``, ``"h"``,
        ``"q_idx"`` or ``"kv_idx"``)?"""
        roots = [self._expression] + ([self._grad_expression] if self.kind == "score" else [])
        return any(expr.operation == "param" and expr.value == name for expr in graph_nodes(roots))

    # ......................................................... validation

    def check_bounds(self, batch, heads, q_len, kv_len):
        """Reject a modifier whose reads could leave an array for these sizes.

        Every index computed from ``b`` in ``[0, batch)``, ``h`` in
        ``[0, heads)``, ``q_idx`` in ``[0, q_len)``, ``kv_idx`` in
        ``[0, kv_len)`` and constants is bounded by interval arithmetic (both
        branches of a condition count) and must lie in its axis; int32
        arithmetic on them must not overflow. Indices computed from array
        values are not checked here (the kernels clamp them).

        Raises
        ------
        InvalidArgumentError
            Naming the array, the index, its range and the axis's extent.
        """
        extents = {
            "b": require_int("batch", batch, 0),
            "h": require_int("heads", heads, 0),
            "q_idx": require_int("q_len", q_len, 0),
            "kv_idx": require_int("kv_len", kv_len, 0),
        }
        if 0 in extents.values():
            return  # nothing is evaluated
        roots = [self._expression] + ([self._grad_expression] if self.kind == "score" else [])
        ranges: dict[int, tuple[int, int] | None] = {}

        def range_of(expr):
            return ranges.get(id(expr))

        sizes = f"batch={batch}, heads={heads}, q_len={q_len}, kv_len={kv_len}"
        for expr in graph_nodes(roots):
            if expr.kind not in (INT32, INT64):
                ranges[id(expr)] = None
            elif expr.operation == "param":
                ranges[id(expr)] = (0, extents[expr.value] - 1)
            else:
                ranges[id(expr)] = interval_step(expr, range_of)
            known = ranges[id(expr)]
            if (
                expr.kind == INT32
                and known is not None
                and not (INT_LIMITS[INT32][0] <= known[0] and known[1] <= INT_LIMITS[INT32][1])
            ):
                raise InvalidArgumentError(
                    self.ROLE,
                    f"{self.name}: int32 arithmetic may overflow for {sizes}: a "
                    f"value ranges over [{known[0]}, {known[1]}]",
                )
            if expr.operation == "read":
                self._check_read(expr, range_of, sizes)

    def _check_read(self, expr, ranges_of, sizes):
        slot, text = expr.value
        array = self._inputs[slot].array
        for axis, index in enumerate(expr.args):
            known = ranges_of(index)
            if known is not None and (known[0] < 0 or known[1] >= array.shape[axis]):
                raise InvalidArgumentError(
                    self.ROLE,
                    f"{self.name} reads {text} with axis-{axis} indices in "
                    f"[{known[0]}, {known[1]}] for {sizes}, but "
                    f"{text.split('[')[0]} has {array.shape[axis]} entries on axis "
                    f"{axis} (indices never wrap)",
                )

    # ........................................................... GPU side

    def kernel_arguments(self, xp=None):
        """The kernel arguments that carry the arrays: a 1-tuple holding a
        ``ModifierArrays`` record (:data:`MODIFIER_ARRAYS_DTYPE`, passed by value).

        Parameters
        ----------
        xp : module, optional
            ``cupy`` (the default): every array must be a CuPy array on the current
            device; the GPU path never copies an array to the device behind the
            caller's back. ``numpy``: every array must be a NumPy array (host
            pointers, for host builds of the functors).

        The record holds raw pointers: the modifier keeps its arrays alive, so it
        must outlive the kernels that use them.

        Raises
        ------
        InvalidArgumentError
            For an array of the other kind or on another device.
        """
        if xp is None:
            import cupy

            xp = cupy
        on_device = xp is not np
        device = None
        record = np.zeros((), MODIFIER_ARRAYS_DTYPE)
        for entry in self._inputs:
            array = entry.array
            if on_device != is_cupy_array(array):
                have, need = ("numpy", "cupy") if on_device else ("cupy", "numpy")
                raise InvalidArgumentError(
                    self.ROLE,
                    f"{self.name}: array {entry.name} is a {have} array; "
                    f"{'the GPU kernels need' if on_device else 'host code needs'} "
                    f"a {need} array (make the modifier with {need}.asarray)",
                )
            if on_device and device is None:
                device = xp.cuda.Device().id
            if on_device and array.device.id != device:
                raise InvalidArgumentError(
                    self.ROLE,
                    f"{self.name}: array {entry.name} is on device "
                    f"{array.device.id}, the call runs on device {device}",
                )
            record["data"][entry.slot] = (
                array.data.ptr if on_device else array.__array_interface__["data"][0]
            )
            for axis, (stride, extent) in enumerate(zip(array.strides, array.shape)):
                record["stride"][entry.slot, axis] = stride // array.itemsize
                record["shape"][entry.slot, axis] = extent
        return (record[()],)

    # ........................................................... NumPy side

    def _host_arrays(self):
        """The arrays as NumPy arrays (CuPy arrays are copied to the host)."""
        host = []
        for entry in self._inputs:
            array = entry.array
            host.append(array.get() if is_cupy_array(array) else array)
        return host

    def _evaluate(self, inputs, dtype):
        dtype = np.dtype(dtype)
        if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise InvalidArgumentError("dtype", f"expected float32 or float64, got {dtype}")
        indices = []
        for name, value in zip(("b", "h", "q_idx", "kv_idx"), inputs[-4:]):
            value = np.asarray(value)
            if value.dtype.kind not in "iu":
                raise InvalidArgumentError(name, f"expected integer indices, got {value.dtype}")
            indices.append(value.astype(np.int64, copy=False))
        arguments = list(indices)
        if len(inputs) == 5:
            arguments.insert(0, np.asarray(inputs[0], dtype=dtype))
        shape = np.broadcast_shapes(*(np.shape(item) for item in arguments))
        host = self._host_arrays()

        def gather(slot, *positions):
            array, entry = host[slot], self._inputs[slot]
            for axis, position in enumerate(positions):
                low, high = np.min(position), np.max(position)
                if low < 0 or high >= array.shape[axis]:
                    raise InvalidArgumentError(
                        self.ROLE,
                        f"{self.name}: an index on axis {axis} of {entry.name} "
                        f"ranges over [{low}, {high}], outside [0, "
                        f"{array.shape[axis] - 1}] (indices never wrap; the "
                        "kernels would clamp it)",
                    )
            values = array[tuple(positions)]
            if entry.kind == FLOAT:
                return np.asarray(values, dtype=dtype)
            return np.asarray(values, dtype=np.int64) if entry.kind != BOOL else values

        with np.errstate(all="ignore"):
            results = self._numpy_function(*arguments, gather=gather, real=dtype.type)
        return results, shape


class ScoreMod(Modifier):
    """A score modifier ``fn(score, b, h, q_idx, kv_idx) -> new score``.

    See :class:`Modifier` for the parameters. The new score may be ``-inf``
    (masked); the function must return a number.

    The C++ functor has
    ``float operator()(float score, int b, int h, int q_idx, int kv_idx, const ModifierArrays&)``
    and ``float grad(...)`` with the same parameters, the derivative with
    respect to ``score`` (0 where the new score is ``-inf``).

    Examples
    --------
    >>> import numpy as np
    >>> from cuflash.modifiers import ScoreMod
    >>> slopes = np.array([0.5, 0.25], dtype=np.float32)
    >>> def alibi(score, b, h, q_idx, kv_idx):
    ...     return score - slopes[h] * abs(q_idx - kv_idx)
    >>> mod = ScoreMod(alibi)
    >>> mod.numpy_scores(np.float32(1.0), 0, np.array([0, 1]), 0, 3)
    array([-0.5 ,  0.25], dtype=float32)
    >>> float(mod(1.0, 0, 1, 0, 3))
    0.25
    """

    kind = "score"
    ROLE = "score_mod"
    PARAMETERS = (("score", FLOAT), ("b", INT32), ("h", INT32), ("q_idx", INT32), ("kv_idx", INT32))

    def _checked_result(self, result, translator):
        if result.kind == BOOL:
            raise translator.problem(
                "a score modifier must return a number (the new score), "
                "got a bool; use MaskMod for masks"
            )
        return convert(result, FLOAT)

    def numpy_scores(self, score, b, h, q_idx, kv_idx, dtype=np.float32):
        """The new scores over broadcast grids (see :func:`index_grids`), in ``dtype``
        (float32 like the kernels, or float64 for the oracle)."""
        (value, _), shape = self._evaluate((score, b, h, q_idx, kv_idx), dtype)
        return np.broadcast_to(np.asarray(value, dtype=dtype), shape).copy()

    def numpy_grad(self, score, b, h, q_idx, kv_idx, dtype=np.float32):
        """d(new score)/d(score) over broadcast grids; 0 where the new score is ``-inf``."""
        (value, slope), shape = self._evaluate((score, b, h, q_idx, kv_idx), dtype)
        value = np.broadcast_to(np.asarray(value, dtype=dtype), shape)
        slope = np.broadcast_to(np.asarray(slope, dtype=dtype), shape)
        return np.where(value == -np.inf, np.zeros((), dtype), slope)


class MaskMod(Modifier):
    """A mask modifier ``fn(b, h, q_idx, kv_idx) -> bool``: True where the key is visible.

    See :class:`Modifier` for the parameters. The C++ functor has
    ``bool operator()(int b, int h, int q_idx, int kv_idx, const ModifierArrays&)``.
    """

    kind = "mask"
    ROLE = "mask_mod"
    PARAMETERS = (("b", INT32), ("h", INT32), ("q_idx", INT32), ("kv_idx", INT32))

    def _checked_result(self, result, translator):
        if result.kind != BOOL:
            raise translator.problem(
                f"a mask modifier must return a bool (a condition), got a {result.kind}"
            )
        return result

    def numpy_mask(self, b, h, q_idx, kv_idx):
        """The mask (True: visible) over broadcast grids (see :func:`index_grids`)."""
        (value,), shape = self._evaluate((b, h, q_idx, kv_idx), np.float32)
        return np.broadcast_to(np.asarray(value, dtype=bool), shape).copy()
