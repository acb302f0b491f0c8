"""C++ generation: the functor struct of a modifier's graph, compiled into the kernels
through NVRTC after :data:`MODIFIER_PRELUDE`, and the layout of the ``ModifierArrays``
record the kernels take (:data:`MODIFIER_ARRAYS_DTYPE`)."""

import math
import re
from pathlib import Path

import numpy as np

from .ir import (
    BOOL,
    FLOAT,
    INT32,
    INT64,
    INT_LIMITS,
    MAX_ARRAY_NDIM,
    MAX_ARRAYS,
    SYMBOLS,
    statements,
)

_CXX_TYPE = {FLOAT: "float", INT32: "int", INT64: "long long", BOOL: "bool"}

#: The layout of ``ModifierArrays`` (:data:`MODIFIER_PRELUDE`): a kernel argument passed
#: by value, as :meth:`Modifier.kernel_arguments` packs it.
MODIFIER_ARRAYS_DTYPE = np.dtype(
    {
        "names": ["data", "stride", "shape"],
        "formats": [
            ("<u8", (MAX_ARRAYS,)),
            ("<i8", (MAX_ARRAYS, MAX_ARRAY_NDIM)),
            ("<i8", (MAX_ARRAYS, MAX_ARRAY_NDIM)),
        ],
        "offsets": [0, 8 * MAX_ARRAYS, 8 * MAX_ARRAYS * (1 + MAX_ARRAY_NDIM)],
        "itemsize": 8 * MAX_ARRAYS * (1 + 2 * MAX_ARRAY_NDIM),
        "aligned": True,
    }
)

#: C++ that every functor needs before it: ``ModifierArrays``, the helpers the functors
#: call, ``NoScoreMod`` and ``NoMaskMod``.
MODIFIER_PRELUDE = (
    Path(__file__).parent.parent / "kernels" / "common" / "modifier_prelude.cuh"
).read_text()


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
    low = INT_LIMITS[expr.kind][0]
    if value == low:
        return f"({low + 1}{suffix} - 1)"
    return f"({value}{suffix})" if value < 0 else f"{value}{suffix}"


_CXX_PARAMETERS = {"score": "score", "b": "b", "h": "h", "q_idx": "q_idx", "kv_idx": "kv_idx"}
_CXX_FUNCTIONS = {
    "tanh": "tanhf",
    "exp": "expf",
    "log": "logf",
    "sqrt": "sqrtf",
    "abs": "cuflash_mod_abs",
    "minimum": "cuflash_mod_min",
    "maximum": "cuflash_mod_max",
}


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
    if operation in SYMBOLS:
        return f"({args[0]} {SYMBOLS[operation]} {args[1]})"
    if operation == "call":
        return f"{_CXX_FUNCTIONS[expr.value]}({', '.join(args)})"
    if operation == "read":
        return f"{accessors[expr.value[0]]}({', '.join(['arrays'] + args)})"
    raise AssertionError(operation)


def _cxx_accessor(entry, name):
    """A static member ``name`` that loads one element of ``entry``'s array (indices
    clamped into its shape)."""
    ctype = "unsigned char" if entry.kind == BOOL else _CXX_TYPE[entry.kind]
    ndim = entry.array.ndim
    slot = entry.slot
    parameters = "".join(f", long long i{axis}" for axis in range(ndim))
    offset = (
        " + ".join(
            f"cuflash_mod_clamp(i{axis}, arrays.shape[{slot}][{axis}]) * "
            f"arrays.stride[{slot}][{axis}]"
            for axis in range(ndim)
        )
        or "0"
    )
    load = f"cuflash_mod_load<{ctype}>(arrays.data[{slot}], {offset})"
    if entry.kind == BOOL:
        load = f"({load} != 0)"
    return (
        f"    static CUFLASH_MOD_FN {_CXX_TYPE[entry.kind]} {name}("
        f"const ModifierArrays& arrays{parameters}) {{\n"
        f"        return {load};\n    }}\n"
    )


def _accessor_names(inputs):
    """``{slot: C++ name}`` of the array accessors: ``load_<array name>``, unique."""
    names: dict[int, str] = {}
    for entry in inputs:
        cleaned = re.sub(r"\W", "_", entry.name, flags=re.ASCII)
        name = f"load_{cleaned}" if cleaned.replace("_", "") else f"load_{entry.slot}"
        if name in names.values():
            name += f"_{entry.slot}"
        names[entry.slot] = name
    return names


def cxx_struct(name_placeholder, kind, value, grad, inputs):
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
        signature = "float score, int b, int h, int q_idx, int kv_idx, const ModifierArrays& arrays"
        lines, (result,) = statements([value], render, indent, declare)
        out.append(f"    CUFLASH_MOD_FN float operator()({signature}) const {{\n")
        out += [line + "\n" for line in lines]
        out.append(f"{indent}return {result};\n    }}\n")
        lines, (result, slope) = statements([value, grad], render, indent, declare)
        out.append(
            f"    // d(operator())/d(score); 0 where the score is masked (-inf).\n"
            f"    CUFLASH_MOD_FN float grad({signature}) const {{\n"
        )
        out += [line + "\n" for line in lines]
        out.append(f"{indent}return {result} == -CUFLASH_MOD_INF ? 0.0f : {slope};\n    }}\n")
    else:
        signature = "int b, int h, int q_idx, int kv_idx, const ModifierArrays& arrays"
        lines, (result,) = statements([value], render, indent, declare)
        out.append(f"    CUFLASH_MOD_FN bool operator()({signature}) const {{\n")
        out += [line + "\n" for line in lines]
        out.append(f"{indent}return {result};\n    }}\n")
    out.append("};\n")
    return "".join(out)
