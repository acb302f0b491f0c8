"""User-defined score and mask modifiers (SPEC 8): one Python definition for every path.

A *score modifier* is a function ``(score, b, h, q_idx, kv_idx) -> score`` that
rewrites each scaled score ``s = softmax_scale * q . k`` before the softmax; a
*mask modifier* is a function ``(b, h, q_idx, kv_idx) -> bool`` that says which
keys a query sees. ``b`` is the batch entry, ``h`` the query head, ``q_idx``
the query row and ``kv_idx`` the key, all counted from 0 (no bottom-right
alignment is applied: a modifier that wants it adds ``kv_len - q_len`` itself,
as the ``offset`` of the factories below does).

:class:`ScoreMod` and :class:`MaskMod` read the function's source and
translate it, once, into

* a C++ functor (``cxx_source``, a ``struct`` named after a hash of its
  code) that the GPU kernels compile in through NVRTC, with
  ``grad()``, the derivative of the new score with respect to the old one,
  derived symbolically for the backward pass;
* a NumPy evaluator (:meth:`ScoreMod.numpy_scores`, :meth:`ScoreMod.numpy_grad`,
  :meth:`MaskMod.numpy_mask`) over broadcast index grids, in float32 for the
  CPU path and in float64 for the oracle.

The function itself still runs as plain Python on scalars (call the modifier
object), which is how the tests hold the translations to it.

*The language.* A function body is a sequence of ``name = expr`` (also ``+=`` and friends),
``if``/``else`` blocks and ``return expr``. Expressions use the parameters,
locals, numbers (Python ``int``, ``float``, ``bool``, ``math.inf``,
``float('inf')``), ``+ - * / // % **`` (``**`` with a constant integer
exponent from 0 to 8; ``//`` and ``%`` on integers, with Python's floor
semantics; ``x // 0`` and ``x % 0`` are 0), comparisons (chained too),
``and``/``or``/``not`` on conditions, ``a if c else b`` and the functions
``where``, ``tanh``, ``exp``, ``log``, ``sqrt``, ``abs``, ``minimum`` and
``maximum`` of this module (``math.``,
``numpy.`` and the builtins ``abs``, ``min``, ``max`` of two arguments are
accepted for them). Another modifier object may be called; its code is
inlined. Both branches of a condition are evaluated (there is no
short-circuit), and every array read is checked as if both ran.

Numbers captured from the enclosing scope (closure variables, globals) are
baked into the generated code, so they are part of its cache key; they, and
the arrays, are captured when the modifier is made. Arrays are read with
integer index expressions, one index per axis: up to 4 arrays, each at most
4-D, of dtype int32, int64, float32 or bool, NumPy or CuPy, any strides; a 0-d
array may be used without an index (a run-time scalar that is not part of the
cache key). Arrays are captured by closure or global, or bound by keyword:
``ScoreMod(fn, bias=table)`` makes the name ``bias`` in ``fn`` mean
``table``.

Arithmetic follows the kernels: floats are float32 (the float64 evaluator
computes the same expression in float64), integers are int32, or int64 once
an int64 array value or a constant beyond int32 takes part; ``minimum`` and
``maximum`` of floats ignore a NaN operand (C's ``fminf``, NumPy's ``fmin``).
Array indices never wrap: :meth:`Modifier.check_bounds` rejects, before any
work, a modifier whose indices, computed from ``b``, ``h``, ``q_idx``,
``kv_idx`` and constants, could leave an array for the call's sizes (interval
arithmetic), or whose int32 arithmetic could overflow. An index computed from
an array's *values* (``bias[doc[q_idx]]``) cannot be bounded in advance: the
kernels clamp it into the axis (they clamp every index, so that no read can
leave a buffer), while the NumPy evaluator raises
``InvalidArgumentError`` when one is out of range.

Arrays may be NumPy or CuPy. The NumPy evaluators copy CuPy arrays to the
host; :meth:`Modifier.kernel_arguments` for the GPU takes CuPy arrays on the
current device only and refuses NumPy ones (nothing is copied to a device
behind the caller's back): make a modifier for the GPU with CuPy arrays.

Masked entries are ``-inf`` scores; the derivative is 0 wherever the new
score is ``-inf``. Results of the three evaluators agree to a few float32 units
in the last place (the kernels may fuse a multiply and an add, and their
``tanhf`` is not NumPy's).

*The kernel interface.* :data:`MODIFIER_PRELUDE` (no header needed under NVRTC) defines
``ModifierArrays`` (per slot: element pointer, strides and shape in elements;
a kernel takes it by value, packed by :meth:`Modifier.kernel_arguments` as
:data:`MODIFIER_ARRAYS_DTYPE`), the helpers the functors call, and the
identities ``NoScoreMod`` and ``NoMaskMod``. Each functor (after the prelude
in the translation unit) is an empty struct with ``is_identity = false`` and

* ``float operator()(float score, int b, int h, int q_idx, int kv_idx,
  const ModifierArrays& arrays) const`` and ``float grad(...)`` (score), or
* ``bool operator()(int b, int h, int q_idx, int kv_idx,
  const ModifierArrays& arrays) const`` (mask),

all ``__host__ __device__``: a kernel takes it as a template parameter.
:meth:`Modifier.check_bounds` must pass for the call's sizes before a launch.

Examples
--------
>>> import numpy as np
>>> from cuflash.modifiers import MaskMod, ScoreMod, index_grids, tanh
>>> doc = np.array([0, 0, 1, 1, 1], dtype=np.int32)
>>> def same_document(b, h, q_idx, kv_idx):
...     return doc[q_idx] == doc[kv_idx] and kv_idx <= q_idx
>>> mask = MaskMod(same_document)
>>> b, h, q_idx, kv_idx = index_grids(1, 1, 5, 5)
>>> mask.numpy_mask(b, h, q_idx, kv_idx)[0, 0].astype(int)
array([[1, 0, 0, 0, 0],
       [1, 1, 0, 0, 0],
       [0, 0, 1, 0, 0],
       [0, 0, 1, 1, 0],
       [0, 0, 1, 1, 1]])
>>> mask(0, 0, 4, 2)  # still a Python function
True
>>> cap = 2.0
>>> soft = ScoreMod(lambda score, b, h, q_idx, kv_idx: cap * tanh(score / cap))
>>> scores = np.array([-3.0, 0.5, 8.0], dtype=np.float32)
>>> soft.numpy_scores(scores, 0, 0, 0, 0)
array([-1.8102..., 0.4898..., 1.9986...], dtype=float32)
>>> soft.numpy_grad(scores, 0, 0, 0, 0)
array([0.1807..., 0.9400..., 0.0013...], dtype=float32)
>>> soft.struct_name.startswith("UserScoreMod_"), len(soft.cache_key)
(True, 64)
>>> mask.check_bounds(1, 1, 5, 6)
Traceback (most recent call last):
    ...
cuflash.errors.InvalidArgumentError: mask_mod: same_document reads doc[kv_idx] with axis-0 indices in [0, 5] ...
"""

import ast
import builtins
import hashlib
import inspect
import io
import math
import operator
import os
from pathlib import Path
import re
import textwrap
import threading
import tokenize
import types
import weakref

import numpy as np

from .errors import InvalidArgumentError

__all__ = [
    "Modifier", "ScoreMod", "MaskMod", "index_grids", "MODIFIER_PRELUDE",
    "MODIFIER_ARRAYS_DTYPE", "MAX_ARRAYS", "MAX_ARRAY_NDIM",
    "where", "tanh", "exp", "log", "sqrt", "abs", "minimum", "maximum",
    "causal_mask", "document_mask", "prefix_lm_mask", "chunked_mask", "and_masks", "or_masks",
    "softcap_score", "alibi_score", "relative_bias_score",
]

#: The most arrays one modifier reads.
MAX_ARRAYS = 4
#: The most axes of an array a modifier reads.
MAX_ARRAY_NDIM = 4
#: The largest constant exponent of ``**``.
MAX_POWER = 8

# ------------------------------------------------------------------ user helpers


def where(condition, when_true, when_false):
    """``when_true`` where ``condition`` holds, else ``when_false`` (scalars or arrays)."""
    return np.where(condition, when_true, when_false)[()]


def tanh(value):
    """Hyperbolic tangent (``tanhf`` in the kernels)."""
    return np.tanh(value)


def exp(value):
    """Exponential (``expf`` in the kernels)."""
    return np.exp(value)


def log(value):
    """Natural logarithm (``logf`` in the kernels)."""
    return np.log(value)


def sqrt(value):
    """Square root (``sqrtf`` in the kernels)."""
    return np.sqrt(value)


def abs(value):  # noqa: A001 - the modifier language's abs, importable by name
    """Absolute value, of integers or floats."""
    return np.abs(value)


def minimum(first, second):
    """The smaller of two values; a NaN operand is ignored (``fminf``)."""
    return np.fmin(first, second)


def maximum(first, second):
    """The larger of two values; a NaN operand is ignored (``fmaxf``)."""
    return np.fmax(first, second)


# Every callable a modifier may call, by the function it means.
_FUNCTION_ARITY = {"where": 3, "tanh": 1, "exp": 1, "log": 1, "sqrt": 1, "abs": 1,
                   "minimum": 2, "maximum": 2}
_CALLABLES = {}
for _name, _objects in {
    "where": (where, np.where),
    "tanh": (tanh, np.tanh, math.tanh),
    "exp": (exp, np.exp, math.exp),
    "log": (log, np.log, math.log),
    "sqrt": (sqrt, np.sqrt, math.sqrt),
    "abs": (abs, np.abs, builtins.abs, np.fabs),
    "minimum": (minimum, np.minimum, np.fmin, builtins.min),
    "maximum": (maximum, np.maximum, np.fmax, builtins.max),
}.items():
    for _object in _objects:
        _CALLABLES[id(_object)] = (_object, _name)
del _name, _objects, _object

# ------------------------------------------------------------------ value kinds

FLOAT, INT32, INT64, BOOL = "float32", "int32", "int64", "bool"
_NUMERIC_RANK = {INT32: 0, INT64: 1, FLOAT: 2}
_CXX_TYPE = {FLOAT: "float", INT32: "int", INT64: "long long", BOOL: "bool"}
_KIND_OF_DTYPE = {np.dtype(np.int32): INT32, np.dtype(np.int64): INT64,
                  np.dtype(np.float32): FLOAT, np.dtype(np.bool_): BOOL}
_INT_LIMITS = {INT32: (-2**31, 2**31 - 1), INT64: (-2**63, 2**63 - 1)}

#: The layout of ``ModifierArrays`` (:data:`MODIFIER_PRELUDE`): a kernel argument passed
#: by value, as :meth:`Modifier.kernel_arguments` packs it.
MODIFIER_ARRAYS_DTYPE = np.dtype({
    "names": ["data", "stride", "shape"],
    "formats": [("<u8", (MAX_ARRAYS,)), ("<i8", (MAX_ARRAYS, MAX_ARRAY_NDIM)),
                ("<i8", (MAX_ARRAYS, MAX_ARRAY_NDIM))],
    "offsets": [0, 8 * MAX_ARRAYS, 8 * MAX_ARRAYS * (1 + MAX_ARRAY_NDIM)],
    "itemsize": 8 * MAX_ARRAYS * (1 + 2 * MAX_ARRAY_NDIM), "aligned": True})

#: C++ that every functor needs before it: ``ModifierArrays``, the helpers the functors
#: call, ``NoScoreMod`` and ``NoMaskMod``.
MODIFIER_PRELUDE = (Path(__file__).parent / "kernels" / "modifier_prelude.cuh").read_text()

# -------------------------------------------------------------- expression graph


class Expr:
    """One node of a modifier's expression graph.

    Nodes are interned (made only through :func:`_node`): two nodes with the
    same operation, kind, operands and value are one object, so a repeated
    subexpression is computed once by the emitters.

    Attributes
    ----------
    operation : str
        ``const``, ``param``, ``cast``, ``neg``, ``not``, ``add`` ... ``mod``,
        ``lt`` ... ``ne``, ``and``, ``or``, ``where``, ``call`` or ``read``.
    kind : str
        The value's type: ``float32``, ``int32``, ``int64`` or ``bool``.
    args : tuple of Expr
        The operands.
    value : object
        The constant (``const``), the parameter's name (``param``), the
        function's name (``call``) or ``(slot, text)`` of an array read.
    """

    __slots__ = ("operation", "kind", "args", "value", "__weakref__")

    def __repr__(self):
        return f"Expr({self.operation}, {self.kind}, {self.value!r}, {len(self.args)} args)"


_INTERNED = weakref.WeakValueDictionary()
_INTERN_LOCK = threading.Lock()


def _value_key(value):
    # -0.0 and 0.0 are different constants; NaN equals itself here.
    return ("float", value.hex()) if isinstance(value, float) else value


def _node(operation, kind, args=(), value=None):
    """The interned node of this structure."""
    args = tuple(args)
    key = (operation, kind, args, _value_key(value))
    with _INTERN_LOCK:
        found = _INTERNED.get(key)
        if found is None:
            found = Expr()
            found.operation, found.kind, found.args, found.value = operation, kind, args, value
            _INTERNED[key] = found
    return found


class _TypeProblem(Exception):
    """A translation error; the translator adds where in the source it happened."""


def _int_constant(value, at_least=INT32):
    for kind in (INT32, INT64):
        low, high = _INT_LIMITS[kind]
        if low <= value <= high and _NUMERIC_RANK[kind] >= _NUMERIC_RANK[at_least]:
            return _node("const", kind, value=int(value))
    raise _TypeProblem(f"the integer {value} does not fit int64")


def constant(value):
    """A constant node for a Python or NumPy number."""
    if isinstance(value, (bool, np.bool_)):
        return _node("const", BOOL, value=bool(value))
    if isinstance(value, (int, np.integer)):
        return _int_constant(int(value))
    return _node("const", FLOAT, value=float(value))


ZERO = constant(0.0)
ONE = constant(1.0)


def _is_numeric(expr):
    return expr.kind in _NUMERIC_RANK


def _common_kind(*exprs):
    return max((expr.kind for expr in exprs), key=_NUMERIC_RANK.__getitem__)


def convert(expr, kind):
    """``expr`` as a value of ``kind`` (integers widen to int64 or float32)."""
    if expr.kind == kind:
        return expr
    if not _is_numeric(expr) or _NUMERIC_RANK[kind] < _NUMERIC_RANK[expr.kind]:
        raise _TypeProblem(f"cannot use a {expr.kind} value as {kind}")
    if expr.operation == "const":
        return _node("const", kind, value=float(expr.value) if kind == FLOAT else expr.value)
    return _node("cast", kind, (expr,))


def _require_numeric(what, *exprs):
    for expr in exprs:
        if not _is_numeric(expr):
            raise _TypeProblem(f"{what} takes numbers, got a {expr.kind}; "
                               "use where(condition, 1, 0) for a 0/1 number")


_INT_FOLDERS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
                "floordiv": operator.floordiv, "mod": operator.mod}
_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%",
            "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


def arithmetic(operation, left, right):
    """``left operation right`` for ``add``, ``sub``, ``mul``, ``div``, ``floordiv``, ``mod``."""
    _require_numeric(_SYMBOLS[operation], left, right)
    if operation == "div":
        kind = FLOAT
    elif operation in ("floordiv", "mod"):
        if FLOAT in (left.kind, right.kind):
            raise _TypeProblem(f"{_SYMBOLS[operation]} takes integers, got a float32 operand")
        kind = _common_kind(left, right)
    else:
        kind = _common_kind(left, right)
    left, right = convert(left, kind), convert(right, kind)
    if kind != FLOAT:
        if operation in ("floordiv", "mod") and right.operation == "const" and right.value == 0:
            raise _TypeProblem(f"{_SYMBOLS[operation]} by the constant 0")
        if left.operation == right.operation == "const":
            return _int_constant(_INT_FOLDERS[operation](left.value, right.value), at_least=kind)
        identity = _integer_identity(operation, left, right)
        if identity is not None:
            return identity
    return _node(operation, kind, (left, right))


def _integer_identity(operation, left, right):
    """``x + 0``, ``0 + x``, ``x - 0``, ``x * 1``, ``1 * x``, ``x // 1`` as ``x`` (exact on
    integers), else None."""
    def is_constant(expr, value):
        return expr.operation == "const" and expr.value == value

    if operation in ("add", "sub") and is_constant(right, 0):
        return left
    if operation == "add" and is_constant(left, 0):
        return right
    if operation in ("mul", "floordiv") and is_constant(right, 1):
        return left
    if operation == "mul" and is_constant(left, 1):
        return right
    return None


def power(base, exponent):
    """``base ** exponent`` for a constant integer exponent from 0 to ``MAX_POWER``."""
    _require_numeric("**", base)
    if exponent.operation != "const" or exponent.kind not in (INT32, INT64) \
            or not 0 <= exponent.value <= MAX_POWER:
        raise _TypeProblem(f"** takes a constant integer exponent from 0 to {MAX_POWER}")
    result = convert(constant(1), base.kind) if exponent.value == 0 else None
    square, count = base, exponent.value
    while count:  # binary powering
        if count & 1:
            result = square if result is None else arithmetic("mul", result, square)
        count >>= 1
        if count:
            square = arithmetic("mul", square, square)
    return result


def negate(expr):
    """``-expr``."""
    _require_numeric("unary -", expr)
    if expr.operation == "const":
        return _int_constant(-expr.value, expr.kind) if expr.kind != FLOAT else \
            constant(-expr.value)
    return _node("neg", expr.kind, (expr,))


def compare(operation, left, right):
    """``left operation right`` for ``lt``, ``le``, ``gt``, ``ge``, ``eq``, ``ne``."""
    if left.kind == right.kind == BOOL and operation in ("eq", "ne"):
        return _node(operation, BOOL, (left, right))
    _require_numeric(_SYMBOLS[operation], left, right)
    kind = _common_kind(left, right)
    return _node(operation, BOOL, (convert(left, kind), convert(right, kind)))


def _require_condition(what, *exprs):
    for expr in exprs:
        if expr.kind != BOOL:
            raise _TypeProblem(f"{what} takes conditions (comparisons or bools), "
                               f"got a {expr.kind}")


def logical(operation, left, right):
    """``left and right`` / ``left or right`` of two conditions."""
    _require_condition(operation, left, right)
    absorbing = operation == "or"  # True absorbs an or, False an and
    for known, other in ((left, right), (right, left)):
        if known.operation == "const":
            return known if known.value == absorbing else other
    if left is right:
        return left
    return _node(operation, BOOL, (left, right))


def logical_not(expr):
    """``not expr``."""
    _require_condition("not", expr)
    if expr.operation == "const":
        return constant(not expr.value)
    return _node("not", BOOL, (expr,))


def select(condition, when_true, when_false):
    """``when_true if condition else when_false`` (both are evaluated)."""
    _require_condition("a condition", condition)
    if when_true.kind == BOOL or when_false.kind == BOOL:
        if when_true.kind != when_false.kind:
            raise _TypeProblem(f"the branches have different types ({when_true.kind} and "
                               f"{when_false.kind})")
        kind = BOOL
    else:
        kind = _common_kind(when_true, when_false)
    when_true, when_false = convert(when_true, kind), convert(when_false, kind)
    if when_true is when_false:
        return when_true
    if condition.operation == "const":
        return when_true if condition.value else when_false
    return _node("where", kind, (condition, when_true, when_false))


def call(name, *args):
    """``name(*args)`` for the functions of the language."""
    if name == "where":
        return select(*args)
    _require_numeric(name, *args)
    if name in ("tanh", "exp", "log", "sqrt"):
        return _node("call", FLOAT, (convert(args[0], FLOAT),), name)
    kind = _common_kind(*args)
    return _node("call", kind, tuple(convert(arg, kind) for arg in args), name)


# --------------------------------------------------------------- source access


def _source_location(fn):
    return f"{fn.__qualname__} ({os.path.basename(fn.__code__.co_filename)}, line %d)"


def _parameter_names(code):
    return code.co_varnames[:code.co_argcount]


def _function_syntax(fn):
    """``(ast node, first line)`` of ``fn``'s definition: a ``FunctionDef`` or ``Lambda``
    and the file line its own line 1 stands for."""
    try:
        lines, start = inspect.findsource(fn)
    except (OSError, TypeError) as exc:
        raise _NoSource(f"cannot read the source of {fn.__qualname__} ({exc}); define "
                        "the function with def or lambda in a file (or a notebook cell), "
                        "not at an interactive prompt or through exec") from None
    if fn.__name__ != "<lambda>":
        block = inspect.getblock(lines[start:])
        try:
            tree = ast.parse(textwrap.dedent("".join(block)))
        except SyntaxError:
            tree = None
        definition = tree.body[0] if tree is not None and tree.body else None
        if isinstance(definition, ast.FunctionDef) and definition.name == fn.__name__:
            return definition, start + 1
        raise _NoSource(f"cannot find the definition of {fn.__qualname__} in its source file "
                        "(was the file changed since it was imported?)")
    return _lambda_syntax(fn, lines, start)


class _NoSource(Exception):
    """The function's source cannot be read or found."""


def _lambda_syntax(fn, lines, start):
    """The one lambda of ``lines[start]`` whose parameters are ``fn``'s."""
    text = "".join(lines[start:start + 200])
    wanted = list(_parameter_names(fn.__code__))
    found = []
    for offset in (match.start() for match in re.finditer(r"\blambda\b", lines[start])):
        node = _parse_lambda_at(text, offset)
        if node is not None and [arg.arg for arg in node.args.args] == wanted:
            found.append(node)
    if len(found) != 1:
        why = "several lambdas with its parameters" if found else "no lambda matching it"
        raise _NoSource(f"cannot find {fn.__qualname__} in its source: line {start + 1} has "
                        f"{why}; define it with def")
    return found[0], start + 1


def _parse_lambda_at(text, offset):
    """The lambda expression starting at ``text[offset]``, or None.

    The lambda ends before the first ``,``, closing bracket, ``;`` or end of
    line outside brackets after its colon; every such place is tried in turn.
    """
    source = text[offset:]
    line_starts = [0] + [newline.end() for newline in re.finditer("\n", source)]
    depth, seen_colon = 0, False
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            row = token.start[0] - 1
            end = line_starts[row] + token.start[1] if row < len(line_starts) else len(source)
            if token.type == tokenize.OP and token.string in "([{":
                depth += 1
                continue
            closing = token.type == tokenize.OP and token.string in ")]}"
            if closing:
                depth -= 1
            if depth == 0 and token.type == tokenize.OP and token.string == ":":
                seen_colon = True
            at_end = depth < 0 or (depth == 0 and (
                token.type in (tokenize.NEWLINE, tokenize.ENDMARKER)
                or (token.type == tokenize.OP and token.string in (",", ";") and seen_colon)))
            if not at_end:
                continue
            if seen_colon:
                try:
                    node = ast.parse(source[:end].strip(), mode="eval").body
                except SyntaxError:
                    node = None
                if isinstance(node, ast.Lambda):
                    return node
            if depth < 0 or token.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                return None
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return None
    return None


# ---------------------------------------------------------------- translation


class _ArrayInput:
    """One array a modifier reads: its slot, its name in the source and the array."""

    def __init__(self, slot, name, array):
        self.slot, self.name, self.array = slot, name, array
        self.kind = _KIND_OF_DTYPE[np.dtype(array.dtype)]

    @property
    def signature(self):
        return f"{np.dtype(self.array.dtype).name}[{self.array.ndim}]"


def _is_cupy_array(value):
    return type(value).__module__.startswith("cupy") and hasattr(
        value, "__cuda_array_interface__")


def _is_array(value):
    return isinstance(value, np.ndarray) or _is_cupy_array(value)


_STATEMENT_NAMES = {"For": "a for loop", "While": "a while loop", "With": "a with block",
                    "Try": "a try block", "Raise": "raise", "Assert": "assert",
                    "Import": "import", "ImportFrom": "import", "Global": "global",
                    "Nonlocal": "nonlocal", "Delete": "del", "FunctionDef": "a nested def",
                    "ClassDef": "a class", "Expr": "an expression statement"}
_EXPRESSION_NAMES = {"ListComp": "a list comprehension", "GeneratorExp": "a generator",
                     "Lambda": "a lambda", "List": "a list", "Dict": "a dict",
                     "Set": "a set", "Tuple": "a tuple", "JoinedStr": "an f-string",
                     "Slice": "a slice", "Starred": "*", "NamedExpr": ":=",
                     "Await": "await", "Yield": "yield"}
_BINARY_OPS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div",
               ast.FloorDiv: "floordiv", ast.Mod: "mod", ast.Pow: "pow"}
_COMPARISONS = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq",
                ast.NotEq: "ne"}


class _Translator:
    """Lowers one function's syntax tree to an :class:`Expr` graph.

    Parameters
    ----------
    fn : function
        The user's function.
    parameters : tuple of (str, str)
        The canonical parameters, ``(name, kind)``, in order.
    bindings : dict
        Names bound by keyword, overriding the function's own scope.
    """

    def __init__(self, fn, parameters, bindings):
        self.fn = fn
        self.parameters = parameters
        self.bindings = bindings
        self.arrays = []  # _ArrayInput, by slot
        self.first_line = fn.__code__.co_firstlineno
        self.location = _source_location(fn)
        closure = fn.__closure__ or ()
        self.closure = {}
        for name, cell in zip(fn.__code__.co_freevars, closure):
            try:
                self.closure[name] = cell.cell_contents
            except ValueError:  # an empty cell: not assigned yet
                pass

    def problem(self, message, node=None):
        line = self.first_line + (getattr(node, "lineno", 1) - 1)
        return _Located(self.location % line, message)

    # ........................................................ statements

    def translate(self):
        """The function's result as an Expr (raises _Located)."""
        syntax, self.first_line = _function_syntax(self.fn)
        names = [arg.arg for arg in syntax.args.args]
        extra = syntax.args
        if (len(names) != len(self.parameters) or extra.vararg or extra.kwarg
                or extra.kwonlyargs or extra.posonlyargs):
            wanted = ", ".join(name for name, _ in self.parameters)
            raise self.problem(f"expected exactly {len(self.parameters)} positional "
                               f"parameters ({wanted}), got {ast.unparse(syntax.args) or 'none'}",
                               syntax)
        scope = {name: _node("param", kind, value=canonical)
                 for name, (canonical, kind) in zip(names, self.parameters)}
        if isinstance(syntax, ast.Lambda):
            return self.expression(syntax.body, scope)
        body = syntax.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # the docstring
        return self.block(body, scope, syntax)

    def block(self, statements, scope, parent):
        """The value that ``statements`` return, with the locals of ``scope``."""
        scope = dict(scope)
        for position, statement in enumerate(statements):
            if isinstance(statement, ast.Pass):
                continue
            if isinstance(statement, ast.Return):
                if statement.value is None:
                    raise self.problem("return needs a value", statement)
                return self.expression(statement.value, scope)
            if isinstance(statement, ast.If):
                rest = statements[position + 1:]
                condition = self.expression(statement.test, scope)
                when_true = self.block(statement.body + rest, scope, statement)
                when_false = self.block(statement.orelse + rest, scope, statement)
                try:
                    return select(condition, when_true, when_false)
                except _TypeProblem as exc:
                    raise self.problem(f"if/else: {exc}", statement) from None
            target, value = self.assignment(statement, scope)
            scope[target] = value
        raise self.problem("the function can end without a return", parent)

    def assignment(self, statement, scope):
        """``(name, value)`` of an assignment statement."""
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        elif isinstance(statement, ast.AugAssign):
            target = statement.target
            value = ast.BinOp(left=ast.Name(id=getattr(target, "id", "?"), ctx=ast.Load()),
                              op=statement.op, right=statement.value)
            ast.copy_location(value, statement)
            ast.fix_missing_locations(value)
        else:
            name = _STATEMENT_NAMES.get(type(statement).__name__, type(statement).__name__)
            raise self.problem(f"unsupported syntax: {name}; a modifier holds assignments, "
                               "if/else and return", statement)
        if not isinstance(target, ast.Name):
            raise self.problem(f"unsupported syntax: assignment to {ast.unparse(target)}; "
                               "assign to a plain name", statement)
        return target.id, self.expression(value, scope)

    # ....................................................... expressions

    def expression(self, node, scope):
        """The Expr of an expression node."""
        method = getattr(self, f"visit_{type(node).__name__}", None)
        if method is None:
            name = _EXPRESSION_NAMES.get(type(node).__name__, type(node).__name__)
            raise self.problem(f"unsupported syntax: {name} ({ast.unparse(node)})", node)
        try:
            return method(node, scope)
        except _TypeProblem as exc:
            raise self.problem(f"{exc} (in {ast.unparse(node)})", node) from None

    def visit_Constant(self, node, scope):
        if isinstance(node.value, (bool, int, float)):
            return constant(node.value)
        raise self.problem(f"unsupported constant {node.value!r}", node)

    def visit_Name(self, node, scope):
        if node.id in scope:
            return scope[node.id]
        return self.value_of(self.resolve(node, scope), node.id, node)

    def visit_Attribute(self, node, scope):
        return self.value_of(self.resolve(node, scope), ast.unparse(node), node)

    def value_of(self, found, label, node):
        """The Expr a captured Python object stands for: a number or a 0-d array."""
        if isinstance(found, (bool, int, float, np.bool_, np.integer, np.floating)):
            return constant(found)
        if _is_array(found):
            if found.ndim == 0:
                return self.read(found, label, [], node)
            raise self.problem(f"array {label} is {found.ndim}-D: index it with "
                               f"{found.ndim} indices", node)
        raise self.problem(f"{label} is a {type(found).__name__}; a modifier uses numbers, "
                           "arrays and its own parameters", node)

    def resolve(self, node, scope):
        """The Python object a name or attribute chain outside the function means."""
        if isinstance(node, ast.Name):
            if node.id in scope:
                raise self.problem(f"{node.id} is a parameter or local here, not a captured "
                                   "array or function", node)
            for space in (self.bindings, self.closure, self.fn.__globals__):
                if node.id in space:
                    return space[node.id]
            if hasattr(builtins, node.id):
                return getattr(builtins, node.id)
            raise self.problem(f"name {node.id!r} is not defined", node)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value, scope)
            if not hasattr(base, node.attr):
                raise self.problem(f"{ast.unparse(node)} does not exist", node)
            return getattr(base, node.attr)
        raise self.problem(f"unsupported syntax: {ast.unparse(node)} as a function or array",
                           node)

    def visit_UnaryOp(self, node, scope):
        literal = node.operand
        if isinstance(node.op, ast.USub) and isinstance(literal, ast.Constant) \
                and type(literal.value) in (int, float):
            return constant(-literal.value)  # -9223372036854775808 is a literal
        operand = self.expression(literal, scope)
        if isinstance(node.op, ast.USub):
            return negate(operand)
        if isinstance(node.op, ast.UAdd):
            _require_numeric("unary +", operand)
            return operand
        if isinstance(node.op, ast.Not):
            return logical_not(operand)
        raise self.problem(f"unsupported operator {ast.unparse(node)}", node)

    def visit_BinOp(self, node, scope):
        operation = _BINARY_OPS.get(type(node.op))
        if operation is None:
            raise self.problem(f"unsupported operator in {ast.unparse(node)}", node)
        left, right = self.expression(node.left, scope), self.expression(node.right, scope)
        return power(left, right) if operation == "pow" else arithmetic(operation, left, right)

    def visit_Compare(self, node, scope):
        values = [self.expression(node.left, scope)]
        values += [self.expression(item, scope) for item in node.comparators]
        result = None
        for position, operation in enumerate(node.ops):
            name = _COMPARISONS.get(type(operation))
            if name is None:
                raise self.problem(f"unsupported comparison in {ast.unparse(node)}", node)
            term = compare(name, values[position], values[position + 1])
            result = term if result is None else logical("and", result, term)
        return result

    def visit_BoolOp(self, node, scope):
        operation = "and" if isinstance(node.op, ast.And) else "or"
        values = [self.expression(item, scope) for item in node.values]
        result = values[0]
        for value in values[1:]:
            result = logical(operation, result, value)
        return result

    def visit_IfExp(self, node, scope):
        return select(self.expression(node.test, scope), self.expression(node.body, scope),
                      self.expression(node.orelse, scope))

    def visit_Call(self, node, scope):
        if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
            raise self.problem(f"calls take positional arguments only: {ast.unparse(node)}",
                               node)
        function = self.resolve(node.func, scope)
        label = ast.unparse(node.func)
        if function is float:
            return self.float_call(node, scope)
        if isinstance(function, Modifier):
            args = [self.expression(arg, scope) for arg in node.args]
            return self.inline(function, args, node)
        entry = _CALLABLES.get(id(function))
        if entry is None or entry[0] is not function:
            raise self.problem(f"unsupported function {label}; a modifier may call where, "
                               "tanh, exp, log, sqrt, abs, minimum, maximum, float and "
                               "other modifiers", node)
        name = entry[1]
        if len(node.args) != _FUNCTION_ARITY[name]:
            raise self.problem(f"{label} takes {_FUNCTION_ARITY[name]} arguments here, got "
                               f"{len(node.args)}", node)
        return call(name, *(self.expression(arg, scope) for arg in node.args))

    def float_call(self, node, scope):
        """``float(x)``: a cast, or a constant from a string such as ``'inf'``."""
        if len(node.args) != 1:
            raise self.problem("float takes one argument", node)
        argument = node.args[0]
        if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
            try:
                return constant(float(argument.value))
            except ValueError:
                raise self.problem(f"float({argument.value!r}) is not a number",
                                   node) from None
        value = self.expression(argument, scope)
        _require_numeric("float", value)
        return convert(value, FLOAT)

    def visit_Subscript(self, node, scope):
        indices = []
        base = node
        while isinstance(base, ast.Subscript):  # a[i][j] is a[i, j]
            index = base.slice
            items = index.elts if isinstance(index, ast.Tuple) else [index]
            indices[:0] = items
            base = base.value
        label = ast.unparse(base)
        array = self.resolve(base, scope)
        if not _is_array(array):
            raise self.problem(f"{label} is a {type(array).__name__}, not an array; pass a "
                               "numpy or cupy array", node)
        if len(indices) != array.ndim:
            raise self.problem(f"array {label} is {array.ndim}-D but {ast.unparse(node)} "
                               f"gives {len(indices)} indices", node)
        values = []
        for index in indices:
            value = self.expression(index, scope)
            if value.kind not in (INT32, INT64):
                raise self.problem(f"array indices must be integers: {ast.unparse(index)} "
                                   f"is a {value.kind}", index)
            values.append(value)
        return self.read(array, label, values, node, ast.unparse(node))

    def read(self, array, label, indices, node, text=None):
        """A read of ``array`` (registered in a slot on first use)."""
        slot = self.slot_of(array, label, node)
        return _node("read", self.arrays[slot].kind, indices, (slot, text or label))

    def slot_of(self, array, label, node):
        """The slot of ``array``, validated and added if new."""
        for entry in self.arrays:
            if entry.array is array:
                return entry.slot
        dtype = np.dtype(array.dtype)
        if dtype not in _KIND_OF_DTYPE:
            raise self.problem(f"array {label}: unsupported dtype {dtype}; expected int32, "
                               "int64, float32 or bool", node)
        if array.ndim > MAX_ARRAY_NDIM:
            raise self.problem(f"array {label} is {array.ndim}-D; at most "
                               f"{MAX_ARRAY_NDIM}-D", node)
        if array.size == 0:
            raise self.problem(f"array {label} is empty", node)
        for axis, stride in enumerate(array.strides):
            if stride % array.itemsize:
                raise self.problem(f"array {label}: the stride of axis {axis} ({stride} "
                                   f"bytes) is not a multiple of its itemsize "
                                   f"({array.itemsize})", node)
        if len(self.arrays) == MAX_ARRAYS:
            names = ", ".join(entry.name for entry in self.arrays)
            raise self.problem(f"reads more than {MAX_ARRAYS} arrays ({names}, {label})", node)
        taken = {entry.name for entry in self.arrays}
        name = label
        while name in taken:
            name += "_"
        self.arrays.append(_ArrayInput(len(self.arrays), name, array))
        return len(self.arrays) - 1

    def inline(self, modifier, args, node):
        """The result of calling another modifier: its graph on these arguments."""
        if len(args) != len(modifier.PARAMETERS):
            raise self.problem(f"{modifier.name} takes {len(modifier.PARAMETERS)} arguments, "
                               f"got {len(args)}", node)
        values = {}
        for (canonical, kind), arg in zip(modifier.PARAMETERS, args):
            if kind == INT32 and arg.kind != INT32:
                raise self.problem(f"{modifier.name}: its index arguments must be int32 "
                                   f"expressions, got a {arg.kind}", node)
            values[canonical] = convert(arg, kind)
        slots = {entry.slot: self.slot_of(entry.array, entry.name, node)
                 for entry in modifier._inputs}
        return _substitute(modifier._expression, values, slots)


def _substitute(root, values, slots):
    """``root`` with its parameters replaced by ``values`` and read slots renumbered."""
    done = {}

    def rebuild(expr):
        found = done.get(id(expr))
        if found is not None:
            return found
        if expr.operation == "param":
            result = values[expr.value]
        elif expr.operation == "read":
            slot, text = expr.value
            result = _node("read", expr.kind, [rebuild(arg) for arg in expr.args],
                           (slots[slot], text))
        else:
            result = _node(expr.operation, expr.kind, [rebuild(arg) for arg in expr.args],
                           expr.value)
        done[id(expr)] = result
        return result

    return rebuild(root)


class _Located(Exception):
    """A translation error with the source location it belongs to."""

    def __init__(self, location, message):
        super().__init__(f"{location}: {message}")
        self.location, self.message = location, message


# ---------------------------------------------------------------- derivative


def _plus(left, right):
    if left is ZERO:
        return right
    if right is ZERO:
        return left
    return arithmetic("add", left, right)


def _minus(left, right):
    if right is ZERO:
        return left
    if left is ZERO:
        return negate(right)
    return arithmetic("sub", left, right)


def _times(left, right):
    if left is ZERO or right is ZERO:
        return ZERO
    if left is ONE:
        return right
    if right is ONE:
        return left
    return arithmetic("mul", left, right)


def _over(left, right):
    return ZERO if left is ZERO else arithmetic("div", left, right)


def derivative(root):
    """d(root)/d(score), symbolically (0 for every integer or bool node)."""
    done = {}

    def derivative_of(expr):
        found = done.get(id(expr))
        if found is not None:
            return found
        result = ZERO
        if expr.kind == FLOAT:
            result = _derivative_step(expr, derivative_of)
        done[id(expr)] = result
        return result

    return derivative_of(root)


def _derivative_step(expr, derivative_of):
    """d(expr)/d(score) given ``derivative_of``, the derivative derivative_of the operands."""
    operation, args = expr.operation, expr.args
    if operation == "param":
        return ONE if expr.value == "score" else ZERO
    if operation in ("const", "read", "cast"):
        return ZERO  # casts come from integers, reads are indexed by integers
    if operation == "neg":
        slope = derivative_of(args[0])
        return ZERO if slope is ZERO else negate(slope)
    if operation == "where":
        return select(args[0], derivative_of(args[1]), derivative_of(args[2]))
    if operation in ("add", "sub"):
        return (_plus if operation == "add" else _minus)(derivative_of(args[0]), derivative_of(args[1]))
    if operation == "mul":
        return _plus(_times(derivative_of(args[0]), args[1]), _times(args[0], derivative_of(args[1])))
    if operation == "div":
        top, bottom = args
        if derivative_of(bottom) is ZERO:
            return _over(derivative_of(top), bottom)
        numerator = _minus(_times(derivative_of(top), bottom), _times(top, derivative_of(bottom)))
        return _over(numerator, arithmetic("mul", bottom, bottom))
    if operation == "call":
        name = expr.value
        if name in ("minimum", "maximum"):
            first, second = args
            chosen = compare("le" if name == "minimum" else "ge", first, second)
            return select(chosen, derivative_of(first), derivative_of(second))
        inner = derivative_of(args[0])
        if inner is ZERO:
            return ZERO
        if name == "abs":
            return select(compare("lt", args[0], ZERO), negate(inner), inner)
        outer = {
            "tanh": lambda: arithmetic("sub", ONE, arithmetic("mul", expr, expr)),
            "exp": lambda: expr,
            "log": lambda: arithmetic("div", ONE, args[0]),
            "sqrt": lambda: arithmetic("div", constant(0.5), expr),
        }[name]()
        return _times(outer, inner)
    raise AssertionError(f"no derivative rule for {operation}")


# ------------------------------------------------------------------ intervals


def _interval_step(expr, range_of):
    """The range ``(low, high)`` range_of an integer node given its operands' ranges (None: not
    known, e.g. an array's values)."""
    operation = expr.operation
    if operation == "const":
        return (expr.value, expr.value)
    if operation == "read":
        return None
    if operation == "where":
        first, second = range_of(expr.args[1]), range_of(expr.args[2])
        if first is None or second is None:
            return None
        return (min(first[0], second[0]), max(first[1], second[1]))
    ranges = [range_of(arg) for arg in expr.args]
    if any(item is None for item in ranges):
        return None
    if operation == "cast":
        return ranges[0]
    if operation == "neg":
        return (-ranges[0][1], -ranges[0][0])
    (low, high) = ranges[0]
    if operation == "call" and expr.value == "abs":
        if low >= 0:
            return (low, high)
        return (-high, -low) if high <= 0 else (0, max(-low, high))
    (other_low, other_high) = ranges[1]
    if operation == "call":
        pick = min if expr.value == "minimum" else max
        return (pick(low, other_low), pick(high, other_high))
    if operation in ("add", "sub", "mul"):
        function = _INT_FOLDERS[operation]
        corners = [function(first, second) for first in (low, high)
                   for second in (other_low, other_high)]
        return (min(corners), max(corners))
    if operation == "floordiv":
        if other_low <= 0 <= other_high:  # the helper gives 0 for a zero divisor
            largest = max(-low, high, 0)
            return (-largest, largest)
        corners = [first // second for first in (low, high)
                   for second in (other_low, other_high)]
        return (min(corners), max(corners))
    if operation == "mod":
        if other_low > 0:
            return (low, high) if low >= 0 and high < other_low else (0, other_high - 1)
        if other_high < 0:
            return (low, high) if high <= 0 and low > other_low else (other_low + 1, 0)
        return (min(other_low + 1, 0), max(other_high - 1, 0))
    raise AssertionError(f"no interval rule for {operation}")


def _graph_nodes(roots):
    """Every node under ``roots``, operands before the nodes that use them."""
    order, seen = [], set()
    for root in roots:
        stack = [(root, False)]
        while stack:
            expr, expanded = stack.pop()
            if id(expr) in seen:
                continue
            if expanded:
                seen.add(id(expr))
                order.append(expr)
            else:
                stack.append((expr, True))
                stack.extend((arg, False) for arg in reversed(expr.args)
                             if id(arg) not in seen)
    return order


# ------------------------------------------------------------------- emitters


def _float_literal(value):
    if math.isnan(value):
        return "CUFLASH_MOD_NAN"
    with np.errstate(over="ignore"):
        single = np.float32(value)
    if np.isinf(single):
        return "CUFLASH_MOD_INF" if single > 0 else "(-CUFLASH_MOD_INF)"
    text = str(single)
    if "e" not in text and "." not in text:
        text += ".0"
    return f"({text}f)" if text.startswith("-") else f"{text}f"


def _cxx_constant(expr):
    value = expr.value
    if expr.kind == BOOL:
        return "true" if value else "false"
    if expr.kind == FLOAT:
        return _float_literal(value)
    suffix = "LL" if expr.kind == INT64 else ""
    low = _INT_LIMITS[expr.kind][0]
    if value == low:
        return f"({low + 1}{suffix} - 1)"
    return f"({value}{suffix})" if value < 0 else f"{value}{suffix}"


_CXX_PARAMETERS = {"score": "score", "b": "b", "h": "h", "q_idx": "q_idx",
                   "kv_idx": "kv_idx"}
_CXX_FUNCTIONS = {"tanh": "tanhf", "exp": "expf", "log": "logf", "sqrt": "sqrtf",
                  "abs": "cuflash_mod_abs", "minimum": "cuflash_mod_min",
                  "maximum": "cuflash_mod_max"}
_PY_FUNCTIONS = {"tanh": "np.tanh", "exp": "np.exp", "log": "np.log", "sqrt": "np.sqrt",
                 "abs": "np.abs"}


def _cxx_expression(expr, text, accessors):
    """C++ of one node, ``text`` giving its operands'."""
    operation, args = expr.operation, [text(arg) for arg in expr.args]
    if operation == "const":
        return _cxx_constant(expr)
    if operation == "param":
        return _CXX_PARAMETERS[expr.value]
    if operation == "cast":
        return f"static_cast<{_CXX_TYPE[expr.kind]}>({args[0]})"
    if operation == "neg":
        return f"(-{args[0]})"
    if operation == "not":
        return f"(!{args[0]})"
    if operation in ("and", "or"):
        return f"({args[0]} {'&&' if operation == 'and' else '||'} {args[1]})"
    if operation == "where":
        return f"({args[0]} ? {args[1]} : {args[2]})"
    if operation in ("floordiv", "mod"):
        return f"cuflash_mod_{operation}({args[0]}, {args[1]})"
    if operation in _SYMBOLS:
        return f"({args[0]} {_SYMBOLS[operation]} {args[1]})"
    if operation == "call":
        return f"{_CXX_FUNCTIONS[expr.value]}({', '.join(args)})"
    if operation == "read":
        return f"{accessors[expr.value[0]]}({', '.join(['arrays'] + args)})"
    raise AssertionError(operation)


def _py_constant(expr):
    if expr.kind == FLOAT:
        value = expr.value
        return f"real({value!r})" if math.isfinite(value) else f"real({str(value)!r})"
    return repr(expr.value)


def _py_expression(expr, text, accessors):
    """NumPy source of one node (floats in dtype ``real``, integers in int64)."""
    operation, args = expr.operation, [text(arg) for arg in expr.args]
    if operation == "const":
        return _py_constant(expr)
    if operation == "param":
        return expr.value
    if operation == "cast":
        return f"np.asarray({args[0]}, dtype=real)" if expr.kind == FLOAT else args[0]
    if operation == "neg":
        return f"np.negative({args[0]})"
    if operation == "not":
        return f"np.logical_not({args[0]})"
    if operation in ("and", "or"):
        return f"np.logical_{operation}({args[0]}, {args[1]})"
    if operation == "where":
        return f"np.where({args[0]}, {args[1]}, {args[2]})"
    if operation == "floordiv":
        return f"np.floor_divide({args[0]}, {args[1]})"
    if operation == "mod":
        return f"np.remainder({args[0]}, {args[1]})"
    if operation in _SYMBOLS:
        return f"({args[0]} {_SYMBOLS[operation]} {args[1]})"
    if operation == "call":
        if expr.value in ("minimum", "maximum"):
            prefix = "f" if expr.kind == FLOAT else ""
            name = {"minimum": "min", "maximum": "max"}[expr.value]
            name = f"np.{prefix}{name}" if prefix else f"np.{expr.value}"
            return f"{name}({args[0]}, {args[1]})"
        return f"{_PY_FUNCTIONS[expr.value]}({args[0]})"
    if operation == "read":
        return f"gather({', '.join([str(expr.value[0])] + args)})"
    raise AssertionError(operation)


def _statements(roots, render, indent, declare):
    """Temporaries for the nodes that several others use, then the roots' texts.

    Returns ``(lines, texts)``: ``lines`` declare the temporaries (through
    ``declare(name, expr, text)``), ``texts`` are the roots' expressions.
    """
    order = _graph_nodes(roots)
    uses = {}
    for expr in order:
        for arg in expr.args:
            uses[id(arg)] = uses.get(id(arg), 0) + 1
    for root in roots:
        uses[id(root)] = uses.get(id(root), 0) + 1
    names, lines = {}, []

    def text(expr):
        return names.get(id(expr)) or render(expr, text)

    for expr in order:
        if uses.get(id(expr), 0) > 1 and expr.operation not in ("const", "param"):
            name = f"tmp{len(names)}"
            lines.append(indent + declare(name, expr, render(expr, text)))
            names[id(expr)] = name
    return lines, [text(root) for root in roots]


def _cxx_accessor(entry, name):
    """A static member ``name`` that loads one element of ``entry``'s array (indices
    clamped into its shape)."""
    ctype = "unsigned char" if entry.kind == BOOL else _CXX_TYPE[entry.kind]
    ndim = entry.array.ndim
    slot = entry.slot
    parameters = "".join(f", long long i{axis}" for axis in range(ndim))
    offset = " + ".join(f"cuflash_mod_clamp(i{axis}, arrays.shape[{slot}][{axis}]) * "
                        f"arrays.stride[{slot}][{axis}]" for axis in range(ndim)) or "0"
    load = f"cuflash_mod_load<{ctype}>(arrays.data[{slot}], {offset})"
    if entry.kind == BOOL:
        load = f"({load} != 0)"
    return (f"    static CUFLASH_MOD_FN {_CXX_TYPE[entry.kind]} {name}("
            f"const ModifierArrays& arrays{parameters}) {{\n"
            f"        return {load};\n    }}\n")


def _accessor_names(inputs):
    """``{slot: C++ name}`` of the array accessors: ``load_<array name>``, unique."""
    names = {}
    for entry in inputs:
        cleaned = re.sub(r"\W", "_", entry.name, flags=re.ASCII)
        name = f"load_{cleaned}" if cleaned.replace("_", "") else f"load_{entry.slot}"
        if name in names.values():
            name += f"_{entry.slot}"
        names[entry.slot] = name
    return names


def _cxx_struct(name_placeholder, kind, value, grad, inputs):
    """The functor's C++ (its name a placeholder until the code is hashed)."""
    accessors = _accessor_names(inputs)
    out = [f"struct {name_placeholder} {{\n", "    static constexpr bool is_identity = false;\n"]
    out += [_cxx_accessor(entry, accessors[entry.slot]) for entry in inputs]

    def render(expr, text):
        return _cxx_expression(expr, text, accessors)

    def declare(name, expr, text):
        return f"const {_CXX_TYPE[expr.kind]} {name} = {text};"

    indent = " " * 8
    if kind == "score":
        signature = ("float score, int b, int h, int q_idx, int kv_idx, "
                     "const ModifierArrays& arrays")
        lines, (result,) = _statements([value], render, indent, declare)
        out.append(f"    CUFLASH_MOD_FN float operator()({signature}) const {{\n")
        out += [line + "\n" for line in lines]
        out.append(f"{indent}return {result};\n    }}\n")
        lines, (result, slope) = _statements([value, grad], render, indent, declare)
        out.append(f"    // d(operator())/d(score); 0 where the score is masked (-inf).\n"
                   f"    CUFLASH_MOD_FN float grad({signature}) const {{\n")
        out += [line + "\n" for line in lines]
        out.append(f"{indent}return {result} == -CUFLASH_MOD_INF ? 0.0f : {slope};\n    }}\n")
    else:
        signature = "int b, int h, int q_idx, int kv_idx, const ModifierArrays& arrays"
        lines, (result,) = _statements([value], render, indent, declare)
        out.append(f"    CUFLASH_MOD_FN bool operator()({signature}) const {{\n")
        out += [line + "\n" for line in lines]
        out.append(f"{indent}return {result};\n    }}\n")
    out.append("};\n")
    return "".join(out)


def _py_function(function_name, parameters, roots):
    """NumPy source of a function of ``parameters`` returning the roots' values."""
    def render(expr, text):
        return _py_expression(expr, text, None)

    def declare(name, expr, text):
        return f"{name} = {text}"

    lines, texts = _statements(roots, render, "    ", declare)
    header = f"def {function_name}({', '.join(parameters)}, gather, real):"
    return "\n".join([header] + lines + [f"    return ({', '.join(texts)},)"]) + "\n"


# ------------------------------------------------------------------ modifiers


def index_grids(batch, heads, q_len, kv_len):
    """Broadcastable int64 index grids ``b [B,1,1,1]``, ``h [1,H,1,1]``,
    ``q_idx [1,1,Sq,1]``, ``kv_idx [1,1,1,Sk]`` for the NumPy evaluators."""
    return (np.arange(batch).reshape(-1, 1, 1, 1), np.arange(heads).reshape(1, -1, 1, 1),
            np.arange(q_len).reshape(1, 1, -1, 1), np.arange(kv_len).reshape(1, 1, 1, -1))


def _require_int(name, value, minimum_value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or value < minimum_value:
        raise InvalidArgumentError(name, f"expected an int >= {minimum_value}, got {value!r}")
    return int(value)


class Modifier:
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

    kind = None
    ROLE = None
    PARAMETERS = ()

    def __init__(self, fn, /, **arrays):
        if not isinstance(fn, types.FunctionType):
            raise InvalidArgumentError(self.ROLE, f"expected a Python function (def or "
                                                  f"lambda), got {type(fn).__name__}")
        used = set(fn.__code__.co_names) | set(fn.__code__.co_freevars)
        for name in arrays:
            if name not in used or name in _parameter_names(fn.__code__):
                raise InvalidArgumentError(self.ROLE, f"{fn.__qualname__} does not read a "
                                                      f"variable named {name!r}")
        self.fn, self.name = fn, fn.__qualname__
        self._bindings = dict(arrays)
        translator = _Translator(fn, self.PARAMETERS, self._bindings)
        try:
            result = translator.translate()
            result = self._checked_result(result, translator)
        except (_Located, _NoSource) as exc:
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
        anonymous = _cxx_struct(placeholder, self.kind, self._expression,
                                self._grad_expression, self._inputs)
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
        self.numpy_source = _py_function("evaluate", parameters, roots)
        namespace = {"np": np}
        exec(compile(self.numpy_source, f"<cuflash modifier {self.name}>", "exec"), namespace)
        self._numpy_function = namespace["evaluate"]

    def _python_function(self):
        """``fn`` with the keyword bindings in its scope, for calls on scalars."""
        fn = self.fn
        if not self._bindings:
            return fn
        code = fn.__code__
        scope = dict(fn.__globals__)
        scope.update((name, value) for name, value in self._bindings.items()
                     if name in code.co_names)
        cells = tuple(types.CellType(self._bindings[name]) if name in self._bindings else cell
                      for name, cell in zip(code.co_freevars, fn.__closure__ or ()))
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
        return any(expr.operation == "param" and expr.value == name
                   for expr in _graph_nodes(roots))

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
        extents = {"b": _require_int("batch", batch, 0), "h": _require_int("heads", heads, 0),
                   "q_idx": _require_int("q_len", q_len, 0),
                   "kv_idx": _require_int("kv_len", kv_len, 0)}
        if 0 in extents.values():
            return  # nothing is evaluated
        roots = [self._expression] + ([self._grad_expression] if self.kind == "score" else [])
        ranges = {}

        def range_of(expr):
            return ranges.get(id(expr))

        sizes = f"batch={batch}, heads={heads}, q_len={q_len}, kv_len={kv_len}"
        for expr in _graph_nodes(roots):
            if expr.kind not in (INT32, INT64):
                ranges[id(expr)] = None
            elif expr.operation == "param":
                ranges[id(expr)] = (0, extents[expr.value] - 1)
            else:
                ranges[id(expr)] = _interval_step(expr, range_of)
            known = ranges[id(expr)]
            if expr.kind == INT32 and known is not None and not (
                    _INT_LIMITS[INT32][0] <= known[0] and known[1] <= _INT_LIMITS[INT32][1]):
                raise InvalidArgumentError(
                    self.ROLE, f"{self.name}: int32 arithmetic may overflow for {sizes}: a "
                               f"value ranges over [{known[0]}, {known[1]}]")
            if expr.operation == "read":
                self._check_read(expr, range_of, sizes)

    def _check_read(self, expr, ranges_of, sizes):
        slot, text = expr.value
        array = self._inputs[slot].array
        for axis, index in enumerate(expr.args):
            known = ranges_of(index)
            if known is not None and (known[0] < 0 or known[1] >= array.shape[axis]):
                raise InvalidArgumentError(
                    self.ROLE, f"{self.name} reads {text} with axis-{axis} indices in "
                               f"[{known[0]}, {known[1]}] for {sizes}, but "
                               f"{text.split('[')[0]} has {array.shape[axis]} entries on axis "
                               f"{axis} (indices never wrap)")

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
            import cupy as xp
        on_device = xp is not np
        device = None
        record = np.zeros((), MODIFIER_ARRAYS_DTYPE)
        for entry in self._inputs:
            array = entry.array
            if on_device != _is_cupy_array(array):
                have, need = ("numpy", "cupy") if on_device else ("cupy", "numpy")
                raise InvalidArgumentError(
                    self.ROLE, f"{self.name}: array {entry.name} is a {have} array; "
                               f"{'the GPU kernels need' if on_device else 'host code needs'} "
                               f"a {need} array (make the modifier with {need}.asarray)")
            if on_device and device is None:
                device = xp.cuda.Device().id
            if on_device and array.device.id != device:
                raise InvalidArgumentError(
                    self.ROLE, f"{self.name}: array {entry.name} is on device "
                               f"{array.device.id}, the call runs on device {device}")
            record["data"][entry.slot] = array.data.ptr if on_device else \
                array.__array_interface__["data"][0]
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
            host.append(array.get() if _is_cupy_array(array) else array)
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
                        self.ROLE, f"{self.name}: an index on axis {axis} of {entry.name} "
                                   f"ranges over [{low}, {high}], outside [0, "
                                   f"{array.shape[axis] - 1}] (indices never wrap; the "
                                   "kernels would clamp it)")
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
    PARAMETERS = (("score", FLOAT), ("b", INT32), ("h", INT32), ("q_idx", INT32),
                  ("kv_idx", INT32))

    def _checked_result(self, result, translator):
        if result.kind == BOOL:
            raise translator.problem("a score modifier must return a number (the new score), "
                                     "got a bool; use MaskMod for masks")
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
            raise translator.problem(f"a mask modifier must return a bool (a condition), got "
                                     f"a {result.kind}")
        return result

    def numpy_mask(self, b, h, q_idx, kv_idx):
        """The mask (True: visible) over broadcast grids (see :func:`index_grids`)."""
        (value,), shape = self._evaluate((b, h, q_idx, kv_idx), np.float32)
        return np.broadcast_to(np.asarray(value, dtype=bool), shape).copy()


# ------------------------------------------------------------------ factories
# Each is an ordinary modifier: a function of the language, its numbers baked in.


def _require_array(name, value, ndims, dtypes):
    if not _is_array(value):
        raise InvalidArgumentError(name, f"expected a numpy or cupy array, got "
                                         f"{type(value).__name__}")
    if value.ndim not in ndims:
        shapes = " or ".join(f"{ndim}-D" for ndim in ndims)
        raise InvalidArgumentError(name, f"expected {shapes}, got {value.ndim}-D")
    if np.dtype(value.dtype) not in dtypes:
        names = " or ".join(np.dtype(dtype).name for dtype in dtypes)
        raise InvalidArgumentError(name, f"expected dtype {names}, got {value.dtype}")
    return value


_INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_FLOAT_DTYPES = (np.dtype(np.float32),)


def causal_mask(offset=0):
    """Keys at or before the query's position ``q_idx + offset`` (``offset = kv_len -
    q_len`` aligns the last query with the last key, as ``causal=True`` does)."""
    offset = _require_int("offset", offset, -2**31)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return MaskMod(causal)


def document_mask(doc_ids, kv_doc_ids=None):
    """Keys of the query's own document (packed sequences of several documents).

    Parameters
    ----------
    doc_ids : int32 or int64 array, ``[S_q]`` or ``[B, S_q]``
        The document of each query (and key, without ``kv_doc_ids``).
    kv_doc_ids : array like ``doc_ids``, optional
        The document of each key, ``[S_k]`` or ``[B, S_k]``.

    Combine with :func:`causal_mask` through :func:`and_masks` for causal
    attention inside each document.
    """
    query_ids = _require_array("doc_ids", doc_ids, (1, 2), _INDEX_DTYPES)
    key_ids = query_ids if kv_doc_ids is None else _require_array(
        "kv_doc_ids", kv_doc_ids, (query_ids.ndim,), _INDEX_DTYPES)
    if query_ids.ndim == 1:
        def same_document(b, h, q_idx, kv_idx):
            return query_ids[q_idx] == key_ids[kv_idx]
    else:
        def same_document(b, h, q_idx, kv_idx):
            return query_ids[b, q_idx] == key_ids[b, kv_idx]
    return MaskMod(same_document)


def prefix_lm_mask(prefix_len, offset=0):
    """Prefix-LM attention: every key of the prefix, causal after it.

    Parameters
    ----------
    prefix_len : int or int32/int64 array ``[B]``
        The prefix's length (per batch entry for an array).
    offset : int
        The query's position is ``q_idx + offset``.
    """
    offset = _require_int("offset", offset, -2**31)
    if _is_array(prefix_len):
        lengths = _require_array("prefix_len", prefix_len, (1,), _INDEX_DTYPES)

        def prefix_or_causal(b, h, q_idx, kv_idx):
            return kv_idx < lengths[b] or kv_idx <= q_idx + offset
    else:
        length = _require_int("prefix_len", prefix_len, 0)

        def prefix_or_causal(b, h, q_idx, kv_idx):
            return kv_idx < length or kv_idx <= q_idx + offset
    return MaskMod(prefix_or_causal)


def chunked_mask(chunk, causal=True, offset=0):
    """Chunked local attention: query and key in the same chunk of ``chunk`` positions
    (and the key not after the query with ``causal``). The query's position is
    ``q_idx + offset``."""
    chunk = _require_int("chunk", chunk, 1)
    offset = _require_int("offset", offset, -2**31)
    if not isinstance(causal, (bool, np.bool_)):
        raise InvalidArgumentError("causal", f"expected a bool, got {type(causal).__name__}")
    causal = bool(causal)

    def same_chunk(b, h, q_idx, kv_idx):
        position = q_idx + offset
        return position // chunk == kv_idx // chunk and (kv_idx <= position or not causal)

    return MaskMod(same_chunk)


def _joined(masks, operation):
    if not masks or not all(isinstance(mask, MaskMod) for mask in masks):
        raise InvalidArgumentError("masks", "expected one or more MaskMod objects")
    result = masks[0]
    for other in masks[1:]:
        first, second = result, other
        if operation == "and":
            def both(b, h, q_idx, kv_idx):
                return first(b, h, q_idx, kv_idx) and second(b, h, q_idx, kv_idx)
            result = MaskMod(both)
        else:
            def either(b, h, q_idx, kv_idx):
                return first(b, h, q_idx, kv_idx) or second(b, h, q_idx, kv_idx)
            result = MaskMod(either)
    return result


def and_masks(*masks):
    """A key is visible where every one of ``masks`` shows it."""
    return _joined(masks, "and")


def or_masks(*masks):
    """A key is visible where any one of ``masks`` shows it."""
    return _joined(masks, "or")


def softcap_score(cap):
    """Soft-capping, ``cap * tanh(score / cap)`` (SPEC 8's ``softcap``)."""
    if isinstance(cap, (bool, np.bool_)) or not isinstance(cap, (int, float, np.number)) \
            or not math.isfinite(cap) or cap <= 0:
        raise InvalidArgumentError("cap", f"expected a finite number > 0, got {cap!r}")
    cap = float(cap)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * tanh(score / cap)

    return ScoreMod(softcap)


def alibi_score(slopes, offset=0):
    """ALiBi, ``score - slope * |q_idx + offset - kv_idx|`` (SPEC 8's ``alibi_slopes``
    with ``offset = kv_len - q_len``).

    Parameters
    ----------
    slopes : float32 array ``[H]`` or ``[B, H]``
    offset : int
    """
    slopes = _require_array("slopes", slopes, (1, 2), _FLOAT_DTYPES)
    offset = _require_int("offset", offset, -2**31)
    if slopes.ndim == 1:
        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * abs(q_idx + offset - kv_idx)
    else:
        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[b, h] * abs(q_idx + offset - kv_idx)
    return ScoreMod(alibi)


def relative_bias_score(table, offset=0):
    """A learned bias per head and relative distance, ``score + table[h, d + R]``.

    Parameters
    ----------
    table : float32 array ``[H, 2 R + 1]``
        The bias of distance ``d = kv_idx - (q_idx + offset)`` from ``-R`` to
        ``R``; farther keys get the bias of ``-R`` or ``R`` (distances are
        clipped, so every size passes :meth:`Modifier.check_bounds`).
    offset : int
    """
    table = _require_array("table", table, (2,), _FLOAT_DTYPES)
    if table.shape[1] % 2 == 0:
        raise InvalidArgumentError("table", f"expected an odd number of distances "
                                            f"(2 R + 1), got {table.shape[1]}")
    reach = (table.shape[1] - 1) // 2
    offset = _require_int("offset", offset, -2**31)

    def relative_bias(score, b, h, q_idx, kv_idx):
        distance = minimum(maximum(kv_idx - q_idx - offset, -reach), reach)
        return score + table[h, distance + reach]

    return ScoreMod(relative_bias)
