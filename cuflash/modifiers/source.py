"""Finding a user's function in its source file: the ``def`` or ``lambda`` syntax tree the
front end translates, and where it stands for error messages."""

import ast
import inspect
import io
import os
import re
import textwrap
import tokenize


def source_location(fn):
    return f"{fn.__qualname__} ({os.path.basename(fn.__code__.co_filename)}, line %d)"


def parameter_names(code):
    return code.co_varnames[: code.co_argcount]


def function_syntax(fn):
    """``(ast node, first line)`` of ``fn``'s definition: a ``FunctionDef`` or ``Lambda``
    and the file line its own line 1 stands for."""
    try:
        lines, start = inspect.findsource(fn)
    except (OSError, TypeError) as exc:
        raise NoSource(
            f"cannot read the source of {fn.__qualname__} ({exc}); define "
            "the function with def or lambda in a file (or a notebook cell), "
            "not at an interactive prompt or through exec"
        ) from None
    if fn.__name__ != "<lambda>":
        block = inspect.getblock(lines[start:])
        try:
            tree = ast.parse(textwrap.dedent("".join(block)))
        except SyntaxError:
            tree = None
        definition = tree.body[0] if tree is not None and tree.body else None
        if isinstance(definition, ast.FunctionDef) and definition.name == fn.__name__:
            return definition, start + 1
        raise NoSource(
            f"cannot find the definition of {fn.__qualname__} in its source file "
            "(was the file changed since it was imported?)"
        )
    return _lambda_syntax(fn, lines, start)


class NoSource(Exception):
    """The function's source cannot be read or found."""


def _lambda_syntax(fn, lines, start):
    """The one lambda of ``lines[start]`` whose parameters are ``fn``'s."""
    text = "".join(lines[start : start + 200])
    wanted = list(parameter_names(fn.__code__))
    found = []
    for offset in (match.start() for match in re.finditer(r"\blambda\b", lines[start])):
        node = _parse_lambda_at(text, offset)
        if node is not None and [arg.arg for arg in node.args.args] == wanted:
            found.append(node)
    if len(found) != 1:
        why = "several lambdas with its parameters" if found else "no lambda matching it"
        raise NoSource(
            f"cannot find {fn.__qualname__} in its source: line {start + 1} has "
            f"{why}; define it with def"
        )
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
            at_end = depth < 0 or (
                depth == 0
                and (
                    token.type in (tokenize.NEWLINE, tokenize.ENDMARKER)
                    or (token.type == tokenize.OP and token.string in (",", ";") and seen_colon)
                )
            )
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
