"""The modifiers' intermediate representation: value kinds, the interned expression
graph (:class:`Expr`) and its constructors, which check types and fold constants, and
the walks over a graph that the analyses and the code generators share."""

import operator
import threading
import weakref

import numpy as np

#: The most arrays one modifier reads.
MAX_ARRAYS = 4
#: The most axes of an array a modifier reads.
MAX_ARRAY_NDIM = 4
#: The largest constant exponent of ``**``.
MAX_POWER = 8

# ------------------------------------------------------------------ value kinds

FLOAT, INT32, INT64, BOOL = "float32", "int32", "int64", "bool"
_NUMERIC_RANK = {INT32: 0, INT64: 1, FLOAT: 2}
INT_LIMITS = {INT32: (-(2**31), 2**31 - 1), INT64: (-(2**63), 2**63 - 1)}

# -------------------------------------------------------------- expression graph


class Expr:
    """One node of a modifier's expression graph.

    Nodes are interned (made only through :func:`intern`): two nodes with the
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
    operation: str
    kind: str
    args: tuple["Expr", ...]
    value: object

    def __repr__(self):
        return f"Expr({self.operation}, {self.kind}, {self.value!r}, {len(self.args)} args)"


_INTERNED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_INTERN_LOCK = threading.Lock()


def _value_key(value):
    # -0.0 and 0.0 are different constants; NaN equals itself here.
    return ("float", value.hex()) if isinstance(value, float) else value


def intern(operation, kind, args=(), value=None):
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


class TypeProblem(Exception):
    """A translation error; the translator adds where in the source it happened."""


def _int_constant(value, at_least=INT32):
    for kind in (INT32, INT64):
        low, high = INT_LIMITS[kind]
        if low <= value <= high and _NUMERIC_RANK[kind] >= _NUMERIC_RANK[at_least]:
            return intern("const", kind, value=int(value))
    raise TypeProblem(f"the integer {value} does not fit int64")


def constant(value):
    """A constant node for a Python or NumPy number."""
    if isinstance(value, (bool, np.bool_)):
        return intern("const", BOOL, value=bool(value))
    if isinstance(value, (int, np.integer)):
        return _int_constant(int(value))
    return intern("const", FLOAT, value=float(value))


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
        raise TypeProblem(f"cannot use a {expr.kind} value as {kind}")
    if expr.operation == "const":
        return intern("const", kind, value=float(expr.value) if kind == FLOAT else expr.value)
    return intern("cast", kind, (expr,))


def require_numeric(what, *exprs):
    for expr in exprs:
        if not _is_numeric(expr):
            raise TypeProblem(
                f"{what} takes numbers, got a {expr.kind}; "
                "use where(condition, 1, 0) for a 0/1 number"
            )


INT_FOLDERS = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
}
SYMBOLS = {
    "add": "+",
    "sub": "-",
    "mul": "*",
    "div": "/",
    "floordiv": "//",
    "mod": "%",
    "lt": "<",
    "le": "<=",
    "gt": ">",
    "ge": ">=",
    "eq": "==",
    "ne": "!=",
}


def arithmetic(operation, left, right):
    """``left operation right`` for ``add``, ``sub``, ``mul``, ``div``, ``floordiv``, ``mod``."""
    require_numeric(SYMBOLS[operation], left, right)
    if operation == "div":
        kind = FLOAT
    elif operation in ("floordiv", "mod"):
        if FLOAT in (left.kind, right.kind):
            raise TypeProblem(f"{SYMBOLS[operation]} takes integers, got a float32 operand")
        kind = _common_kind(left, right)
    else:
        kind = _common_kind(left, right)
    left, right = convert(left, kind), convert(right, kind)
    if kind != FLOAT:
        if operation in ("floordiv", "mod") and right.operation == "const" and right.value == 0:
            raise TypeProblem(f"{SYMBOLS[operation]} by the constant 0")
        if left.operation == right.operation == "const":
            return _int_constant(INT_FOLDERS[operation](left.value, right.value), at_least=kind)
        identity = _integer_identity(operation, left, right)
        if identity is not None:
            return identity
    return intern(operation, kind, (left, right))


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
    require_numeric("**", base)
    if (
        exponent.operation != "const"
        or exponent.kind not in (INT32, INT64)
        or not 0 <= exponent.value <= MAX_POWER
    ):
        raise TypeProblem(f"** takes a constant integer exponent from 0 to {MAX_POWER}")
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
    require_numeric("unary -", expr)
    if expr.operation == "const":
        return (
            _int_constant(-expr.value, expr.kind) if expr.kind != FLOAT else constant(-expr.value)
        )
    return intern("neg", expr.kind, (expr,))


def compare(operation, left, right):
    """``left operation right`` for ``lt``, ``le``, ``gt``, ``ge``, ``eq``, ``ne``."""
    if left.kind == right.kind == BOOL and operation in ("eq", "ne"):
        return intern(operation, BOOL, (left, right))
    require_numeric(SYMBOLS[operation], left, right)
    kind = _common_kind(left, right)
    return intern(operation, BOOL, (convert(left, kind), convert(right, kind)))


def _require_condition(what, *exprs):
    for expr in exprs:
        if expr.kind != BOOL:
            raise TypeProblem(f"{what} takes conditions (comparisons or bools), got a {expr.kind}")


def logical(operation, left, right):
    """``left and right`` / ``left or right`` of two conditions."""
    _require_condition(operation, left, right)
    absorbing = operation == "or"  # True absorbs an or, False an and
    for known, other in ((left, right), (right, left)):
        if known.operation == "const":
            return known if known.value == absorbing else other
    if left is right:
        return left
    return intern(operation, BOOL, (left, right))


def logical_not(expr):
    """``not expr``."""
    _require_condition("not", expr)
    if expr.operation == "const":
        return constant(not expr.value)
    return intern("not", BOOL, (expr,))


def select(condition, when_true, when_false):
    """``when_true if condition else when_false`` (both are evaluated)."""
    _require_condition("a condition", condition)
    if when_true.kind == BOOL or when_false.kind == BOOL:
        if when_true.kind != when_false.kind:
            raise TypeProblem(
                f"the branches have different types ({when_true.kind} and {when_false.kind})"
            )
        kind = BOOL
    else:
        kind = _common_kind(when_true, when_false)
    when_true, when_false = convert(when_true, kind), convert(when_false, kind)
    if when_true is when_false:
        return when_true
    if condition.operation == "const":
        return when_true if condition.value else when_false
    return intern("where", kind, (condition, when_true, when_false))


def call(name, *args):
    """``name(*args)`` for the functions of the language."""
    if name == "where":
        return select(*args)
    require_numeric(name, *args)
    if name in ("tanh", "exp", "log", "sqrt"):
        return intern("call", FLOAT, (convert(args[0], FLOAT),), name)
    kind = _common_kind(*args)
    return intern("call", kind, tuple(convert(arg, kind) for arg in args), name)


# ---------------------------------------------------------------- graph walks


def graph_nodes(roots):
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
                stack.extend((arg, False) for arg in reversed(expr.args) if id(arg) not in seen)
    return order


def statements(roots, render, indent, declare):
    """Temporaries for the nodes that several others use, then the roots' texts.

    Returns ``(lines, texts)``: ``lines`` declare the temporaries (through
    ``declare(name, expr, text)``), ``texts`` are the roots' expressions.
    """
    order = graph_nodes(roots)
    uses: dict[int, int] = {}
    for expr in order:
        for arg in expr.args:
            uses[id(arg)] = uses.get(id(arg), 0) + 1
    for root in roots:
        uses[id(root)] = uses.get(id(root), 0) + 1
    names: dict[int, str] = {}
    lines: list[str] = []

    def text(expr):
        return names.get(id(expr)) or render(expr, text)

    for expr in order:
        if uses.get(id(expr), 0) > 1 and expr.operation not in ("const", "param"):
            name = f"tmp{len(names)}"
            lines.append(indent + declare(name, expr, render(expr, text)))
            names[id(expr)] = name
    return lines, [text(root) for root in roots]
