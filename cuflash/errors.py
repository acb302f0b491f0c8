"""The one exception type that cuflash raises for bad input."""


class InvalidArgumentError(ValueError):
    """An argument is invalid; raised before any kernel runs.

    The message starts with the argument's name, then the reason, e.g.
    ``q: expected 4-D [B, H, S, D], got 3-D``.

    Attributes
    ----------
    arg : str
        The argument's name (or names, for a mismatch between arguments).
    reason : str
        What is wrong with it.
    """

    def __init__(self, arg, reason):
        self.arg = arg
        self.reason = reason
        super().__init__(f"{arg}: {reason}")
