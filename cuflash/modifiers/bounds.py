"""Interval arithmetic on integer nodes: the range of each index a modifier computes from
``b``, ``h``, ``q_idx``, ``kv_idx`` and constants, which
:meth:`cuflash.modifiers.Modifier.check_bounds` holds to the arrays' extents and to
int32."""

from .ir import INT_FOLDERS


def interval_step(expr, range_of):
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
        function = INT_FOLDERS[operation]
        corners = [
            function(first, second) for first in (low, high) for second in (other_low, other_high)
        ]
        return (min(corners), max(corners))
    if operation == "floordiv":
        if other_low <= 0 <= other_high:  # the helper gives 0 for a zero divisor
            largest = max(-low, high, 0)
            return (-largest, largest)
        corners = [first // second for first in (low, high) for second in (other_low, other_high)]
        return (min(corners), max(corners))
    if operation == "mod":
        if other_low > 0:
            return (low, high) if low >= 0 and high < other_low else (0, other_high - 1)
        if other_high < 0:
            return (low, high) if high <= 0 and low > other_low else (other_low + 1, 0)
        return (min(other_low + 1, 0), max(other_high - 1, 0))
    raise AssertionError(f"no interval rule for {operation}")
