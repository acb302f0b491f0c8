"""The functions of the modifier language that a user's function calls (``where``,
``tanh``, ...): NumPy on scalars or arrays, so that a modifier still runs as plain
Python; the front end (:mod:`cuflash.modifiers.frontend`) maps each of them, and its
``math``, ``numpy`` and builtin namesakes, to the operation it means."""

import numpy as np


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
