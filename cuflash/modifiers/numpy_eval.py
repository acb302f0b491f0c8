"""NumPy generation: the source of the evaluator that computes a modifier's graph over
broadcast index grids, floats in a dtype of the caller's (``real``: float32 like the
kernels, float64 for the oracle) and integers in int64."""

import math

from .ir import FLOAT, SYMBOLS, statements

_PY_FUNCTIONS = {
    "tanh": "np.tanh",
    "exp": "np.exp",
    "log": "np.log",
    "sqrt": "np.sqrt",
    "abs": "np.abs",
}


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
    if operation in SYMBOLS:
        return f"({args[0]} {SYMBOLS[operation]} {args[1]})"
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


def py_function(function_name, parameters, roots):
    """NumPy source of a function of ``parameters`` returning the roots' values."""

    def render(expr, text):
        return _py_expression(expr, text, None)

    def declare(name, expr, text):
        return f"{name} = {text}"

    lines, texts = statements(roots, render, "    ", declare)
    header = f"def {function_name}({', '.join(parameters)}, gather, real):"
    return "\n".join([header] + lines + [f"    return ({', '.join(texts)},)"]) + "\n"
