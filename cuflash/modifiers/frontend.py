"""The front end: a user's Python function (its syntax tree) lowered to the expression
graph of :mod:`cuflash.modifiers.ir`, with the arrays it reads registered in slots.
Calls of the language's functions are resolved by object; another modifier's call is
inlined."""

import ast
import builtins
import math

import numpy as np

from .functions import abs, exp, log, maximum, minimum, sqrt, tanh, where
from .ir import (
    BOOL,
    FLOAT,
    INT32,
    INT64,
    MAX_ARRAY_NDIM,
    MAX_ARRAYS,
    Expr,
    TypeProblem,
    arithmetic,
    call,
    compare,
    constant,
    convert,
    intern,
    logical,
    logical_not,
    negate,
    power,
    require_numeric,
    select,
)
from .source import function_syntax, source_location

# Every callable a modifier may call, by the function it means.
_FUNCTION_ARITY = {
    "where": 3,
    "tanh": 1,
    "exp": 1,
    "log": 1,
    "sqrt": 1,
    "abs": 1,
    "minimum": 2,
    "maximum": 2,
}
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

_KIND_OF_DTYPE = {
    np.dtype(np.int32): INT32,
    np.dtype(np.int64): INT64,
    np.dtype(np.float32): FLOAT,
    np.dtype(np.bool_): BOOL,
}


class _ArrayInput:
    """One array a modifier reads: its slot, its name in the source and the array."""

    def __init__(self, slot, name, array):
        self.slot, self.name, self.array = slot, name, array
        self.kind = _KIND_OF_DTYPE[np.dtype(array.dtype)]

    @property
    def signature(self):
        return f"{np.dtype(self.array.dtype).name}[{self.array.ndim}]"


def is_cupy_array(value):
    return type(value).__module__.startswith("cupy") and hasattr(value, "__cuda_array_interface__")


def is_array(value):
    return isinstance(value, np.ndarray) or is_cupy_array(value)


class Inlinable:
    """A translated function that another one may call, its graph inlined there: the base
    of :class:`cuflash.modifiers.Modifier`. It has ``name``, ``PARAMETERS`` (the
    canonical parameters, ``(name, kind)``), ``_expression`` (its graph, over ``param``
    nodes of those names) and ``_inputs`` (the ``_ArrayInput`` of each slot it reads)."""


_STATEMENT_NAMES = {
    "For": "a for loop",
    "While": "a while loop",
    "With": "a with block",
    "Try": "a try block",
    "Raise": "raise",
    "Assert": "assert",
    "Import": "import",
    "ImportFrom": "import",
    "Global": "global",
    "Nonlocal": "nonlocal",
    "Delete": "del",
    "FunctionDef": "a nested def",
    "ClassDef": "a class",
    "Expr": "an expression statement",
}
_EXPRESSION_NAMES = {
    "ListComp": "a list comprehension",
    "GeneratorExp": "a generator",
    "Lambda": "a lambda",
    "List": "a list",
    "Dict": "a dict",
    "Set": "a set",
    "Tuple": "a tuple",
    "JoinedStr": "an f-string",
    "Slice": "a slice",
    "Starred": "*",
    "NamedExpr": ":=",
    "Await": "await",
    "Yield": "yield",
}
_BINARY_OPS = {
    ast.Add: "add",
    ast.Sub: "sub",
    ast.Mult: "mul",
    ast.Div: "div",
    ast.FloorDiv: "floordiv",
    ast.Mod: "mod",
    ast.Pow: "pow",
}
_COMPARISONS = {
    ast.Lt: "lt",
    ast.LtE: "le",
    ast.Gt: "gt",
    ast.GtE: "ge",
    ast.Eq: "eq",
    ast.NotEq: "ne",
}


class Translator:
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
        self.location = source_location(fn)
        closure = fn.__closure__ or ()
        self.closure = {}
        for name, cell in zip(fn.__code__.co_freevars, closure):
            try:
                self.closure[name] = cell.cell_contents
            except ValueError:  # an empty cell: not assigned yet
                pass

    def problem(self, message, node=None):
        line = self.first_line + (getattr(node, "lineno", 1) - 1)
        return Located(self.location % line, message)

    # ........................................................ statements

    def translate(self):
        """The function's result as an Expr (raises Located)."""
        syntax, self.first_line = function_syntax(self.fn)
        names = [arg.arg for arg in syntax.args.args]
        extra = syntax.args
        if (
            len(names) != len(self.parameters)
            or extra.vararg
            or extra.kwarg
            or extra.kwonlyargs
            or extra.posonlyargs
        ):
            wanted = ", ".join(name for name, _ in self.parameters)
            raise self.problem(
                f"expected exactly {len(self.parameters)} positional "
                f"parameters ({wanted}), got {ast.unparse(syntax.args) or 'none'}",
                syntax,
            )
        scope = {
            name: intern("param", kind, value=canonical)
            for name, (canonical, kind) in zip(names, self.parameters)
        }
        if isinstance(syntax, ast.Lambda):
            return self.expression(syntax.body, scope)
        body = syntax.body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
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
                rest = statements[position + 1 :]
                condition = self.expression(statement.test, scope)
                when_true = self.block(statement.body + rest, scope, statement)
                when_false = self.block(statement.orelse + rest, scope, statement)
                try:
                    return select(condition, when_true, when_false)
                except TypeProblem as exc:
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
            value = ast.BinOp(
                left=ast.Name(id=getattr(target, "id", "?"), ctx=ast.Load()),
                op=statement.op,
                right=statement.value,
            )
            ast.copy_location(value, statement)
            ast.fix_missing_locations(value)
        else:
            name = _STATEMENT_NAMES.get(type(statement).__name__, type(statement).__name__)
            raise self.problem(
                f"unsupported syntax: {name}; a modifier holds assignments, if/else and return",
                statement,
            )
        if not isinstance(target, ast.Name):
            raise self.problem(
                f"unsupported syntax: assignment to {ast.unparse(target)}; assign to a plain name",
                statement,
            )
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
        except TypeProblem as exc:
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
        if is_array(found):
            if found.ndim == 0:
                return self.read(found, label, [], node)
            raise self.problem(
                f"array {label} is {found.ndim}-D: index it with {found.ndim} indices", node
            )
        raise self.problem(
            f"{label} is a {type(found).__name__}; a modifier uses numbers, "
            "arrays and its own parameters",
            node,
        )

    def resolve(self, node, scope):
        """The Python object a name or attribute chain outside the function means."""
        if isinstance(node, ast.Name):
            if node.id in scope:
                raise self.problem(
                    f"{node.id} is a parameter or local here, not a captured array or function",
                    node,
                )
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
        raise self.problem(f"unsupported syntax: {ast.unparse(node)} as a function or array", node)

    def visit_UnaryOp(self, node, scope):
        literal = node.operand
        if (
            isinstance(node.op, ast.USub)
            and isinstance(literal, ast.Constant)
            and (type(literal.value) is int or type(literal.value) is float)
        ):
            return constant(-literal.value)  # -9223372036854775808 is a literal
        operand = self.expression(literal, scope)
        if isinstance(node.op, ast.USub):
            return negate(operand)
        if isinstance(node.op, ast.UAdd):
            require_numeric("unary +", operand)
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
        return select(
            self.expression(node.test, scope),
            self.expression(node.body, scope),
            self.expression(node.orelse, scope),
        )

    def visit_Call(self, node, scope):
        if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
            raise self.problem(f"calls take positional arguments only: {ast.unparse(node)}", node)
        function = self.resolve(node.func, scope)
        label = ast.unparse(node.func)
        if function is float:
            return self.float_call(node, scope)
        if isinstance(function, Inlinable):
            args = [self.expression(arg, scope) for arg in node.args]
            return self.inline(function, args, node)
        entry = _CALLABLES.get(id(function))
        if entry is None or entry[0] is not function:
            raise self.problem(
                f"unsupported function {label}; a modifier may call where, "
                "tanh, exp, log, sqrt, abs, minimum, maximum, float and "
                "other modifiers",
                node,
            )
        name = entry[1]
        if len(node.args) != _FUNCTION_ARITY[name]:
            raise self.problem(
                f"{label} takes {_FUNCTION_ARITY[name]} arguments here, got {len(node.args)}", node
            )
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
                raise self.problem(f"float({argument.value!r}) is not a number", node) from None
        value = self.expression(argument, scope)
        require_numeric("float", value)
        return convert(value, FLOAT)

    def visit_Subscript(self, node, scope):
        indices: list[ast.expr] = []
        base = node
        while isinstance(base, ast.Subscript):  # a[i][j] is a[i, j]
            index = base.slice
            items = index.elts if isinstance(index, ast.Tuple) else [index]
            indices[:0] = items
            base = base.value
        label = ast.unparse(base)
        array = self.resolve(base, scope)
        if not is_array(array):
            raise self.problem(
                f"{label} is a {type(array).__name__}, not an array; pass a numpy or cupy array",
                node,
            )
        if len(indices) != array.ndim:
            raise self.problem(
                f"array {label} is {array.ndim}-D but {ast.unparse(node)} "
                f"gives {len(indices)} indices",
                node,
            )
        values = []
        for index in indices:
            value = self.expression(index, scope)
            if value.kind not in (INT32, INT64):
                raise self.problem(
                    f"array indices must be integers: {ast.unparse(index)} is a {value.kind}", index
                )
            values.append(value)
        return self.read(array, label, values, node, ast.unparse(node))

    def read(self, array, label, indices, node, text=None):
        """A read of ``array`` (registered in a slot on first use)."""
        slot = self.slot_of(array, label, node)
        return intern("read", self.arrays[slot].kind, indices, (slot, text or label))

    def slot_of(self, array, label, node):
        """The slot of ``array``, validated and added if new."""
        for entry in self.arrays:
            if entry.array is array:
                return entry.slot
        dtype = np.dtype(array.dtype)
        if dtype not in _KIND_OF_DTYPE:
            raise self.problem(
                f"array {label}: unsupported dtype {dtype}; expected int32, int64, float32 or bool",
                node,
            )
        if array.ndim > MAX_ARRAY_NDIM:
            raise self.problem(f"array {label} is {array.ndim}-D; at most {MAX_ARRAY_NDIM}-D", node)
        if array.size == 0:
            raise self.problem(f"array {label} is empty", node)
        for axis, stride in enumerate(array.strides):
            if stride % array.itemsize:
                raise self.problem(
                    f"array {label}: the stride of axis {axis} ({stride} "
                    f"bytes) is not a multiple of its itemsize "
                    f"({array.itemsize})",
                    node,
                )
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
            raise self.problem(
                f"{modifier.name} takes {len(modifier.PARAMETERS)} arguments, got {len(args)}", node
            )
        values = {}
        for (canonical, kind), arg in zip(modifier.PARAMETERS, args):
            if kind == INT32 and arg.kind != INT32:
                raise self.problem(
                    f"{modifier.name}: its index arguments must be int32 "
                    f"expressions, got a {arg.kind}",
                    node,
                )
            values[canonical] = convert(arg, kind)
        slots = {
            entry.slot: self.slot_of(entry.array, entry.name, node) for entry in modifier._inputs
        }
        return _substitute(modifier._expression, values, slots)


def _substitute(root, values, slots):
    """``root`` with its parameters replaced by ``values`` and read slots renumbered."""
    done: dict[int, Expr] = {}

    def rebuild(expr):
        found = done.get(id(expr))
        if found is not None:
            return found
        if expr.operation == "param":
            result = values[expr.value]
        elif expr.operation == "read":
            slot, text = expr.value
            result = intern(
                "read", expr.kind, [rebuild(arg) for arg in expr.args], (slots[slot], text)
            )
        else:
            result = intern(
                expr.operation, expr.kind, [rebuild(arg) for arg in expr.args], expr.value
            )
        done[id(expr)] = result
        return result

    return rebuild(root)


class Located(Exception):
    """A translation error with the source location it belongs to."""

    def __init__(self, location, message):
        super().__init__(f"{location}: {message}")
        self.location, self.message = location, message
