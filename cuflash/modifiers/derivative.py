"""The symbolic derivative of a score modifier's graph with respect to the score, for
the backward pass (``grad()`` of the C++ functor, :meth:`ScoreMod.numpy_grad`)."""

from .ir import FLOAT, ONE, ZERO, Expr, arithmetic, compare, constant, negate, select


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
    done: dict[int, Expr] = {}

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
        return (_plus if operation == "add" else _minus)(
            derivative_of(args[0]), derivative_of(args[1])
        )
    if operation == "mul":
        return _plus(
            _times(derivative_of(args[0]), args[1]), _times(args[0], derivative_of(args[1]))
        )
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
