"""The tree follows its tools' rules (pyproject.toml, .clang-format): ruff's lint and
format, mypy on the package, clang-format on the kernels (the generated
``kernels/common/wgmma_ops.cuh`` aside). ``pre-commit`` runs the same before each commit.
And the package's modules import each other without a circle, every import of them
resolves and every call of their functions fits the signature."""

import ast
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON_TREES = ["cuflash", "tests", "scripts", "benchmarks", "examples", "docs"]
GENERATED = {"wgmma_ops.cuh"}


def _run(*command):
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    return done.returncode, (done.stdout + done.stderr)[-6000:]


def _tool(name):
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is missing: install the test extra")
    return found


def test_ruff_lint():
    code, out = _run(_tool("ruff"), "check", *PYTHON_TREES)
    assert code == 0, out


def test_ruff_format():
    code, out = _run(_tool("ruff"), "format", "--check", *PYTHON_TREES)
    assert code == 0, out


def test_mypy():
    code, out = _run(sys.executable, "-m", "mypy")
    assert code == 0, out


def test_clang_format():
    sources = [
        p
        for d in ("cuflash/kernels", "tests/simulator")
        for p in sorted((ROOT / d).rglob("*"))
        if p.suffix in (".cu", ".cuh", ".h") and p.name not in GENERATED
    ]
    assert sources
    code, out = _run(
        _tool("clang-format"), "--style=file", "--dry-run", "-Werror", *map(str, sources)
    )
    assert code == 0, out


def _module_imports():
    """Module -> the package's modules its top-level statements import (a package's
    ``__init__`` that a submodule's import runs first is no edge of the submodule's)."""
    paths = _package_modules()
    graph = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    targets.add(f"{target}.{a.name}" if f"{target}.{a.name}" in paths else target)
        graph[module] = {
            t for t in targets if t in paths and t != module and not module.startswith(t + ".")
        }
    return graph


def _circles(graph):
    """The strongly connected sets of more than one module (Tarjan's algorithm)."""
    index, low, stack, found = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _module_imports()
    assert {"cuflash.core.problem", "cuflash.gpu.launch", "cuflash.modifiers.block_mask"} <= set(
        graph
    )
    assert "cuflash.modifiers.block_mask" in graph["cuflash.core.problem"]
    assert _circles(graph) == []


def _module_name(path):
    """The dotted name of the module at ``path`` (a package's: its folder's)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _package_modules():
    """Module name -> path, for every module of the package."""
    return {_module_name(path): path for path in (ROOT / "cuflash").rglob("*.py")}


@functools.cache
def _names_of(module):
    """The top-level names of the package's ``module``."""
    return _top_level_names(ast.parse(_package_modules()[module].read_text()))


def _top_level_names(tree):
    """The names a module binds at its top level (inside top-level ``if`` and ``try``
    blocks too)."""
    names, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []))
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)
    return names


def _import_problems(path, module):
    """Imports of the package in ``path`` (function-local ones too: a CPU run may never
    reach those) whose module, name or module attribute does not exist."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    modules, names_of = _package_modules(), _names_of
    tree = ast.parse(path.read_text())
    problems, bound = [], {}  # bound: a name -> the package module it holds
    functions = {}  # a name -> the package function it holds
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "cuflash":
                continue
            if target not in modules:
                problems.append(f"{path.name}:{node.lineno}: no module {target}")
                continue
            for a in node.names:
                if f"{target}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{target}.{a.name}"
                elif a.name != "*" and a.name not in names_of(target):
                    problems.append(f"{path.name}:{node.lineno}: {target} has no {a.name}")
                elif a.name in _functions(modules[target]):
                    functions[a.asname or a.name] = _functions(modules[target])[a.name]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "cuflash" and a.name not in modules:
                    problems.append(f"{path.name}:{node.lineno}: no module {a.name}")
                elif a.name.split(".")[0] == "cuflash" and a.asname:
                    bound[a.asname] = a.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
        ):
            held = bound[node.value.id]
            if node.attr.startswith("__") or f"{held}.{node.attr}" in modules:
                continue
            if node.attr not in names_of(held):
                problems.append(f"{path.name}:{node.lineno}: {held} has no {node.attr}")
    # Calls of the package's functions: the arguments fit the signature.
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        definition = None
        if isinstance(f, ast.Name) and f.id in functions:
            definition = functions[f.id]
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            held = bound.get(f.value.id)
            if held is not None:
                definition = _functions(modules[held]).get(f.attr)
        if definition is not None:
            wrong = _call_mismatch(node, definition)
            if wrong:
                problems.append(f"{path.name}:{node.lineno}: {definition.name}: {wrong}")
    return problems


@functools.cache
def _functions(path):
    """The plain functions a module defines at its top level (a name also bound some
    other way there is left out: which one a call meets is not known here)."""
    tree = ast.parse(path.read_text())
    defs, other = {}, set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            if node.name in defs:
                other.add(node.name)
            defs[node.name] = node
    other |= _top_level_names(tree) - {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    return {n: d for n, d in defs.items() if n not in other}


def _call_mismatch(call, definition):
    """Why ``call`` cannot bind to ``definition``'s parameters, or None."""
    a = definition.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    by_name = {p.arg for p in a.args} | {p.arg for p in a.kwonlyargs}
    unpacked = any(isinstance(x, ast.Starred) for x in call.args) or any(
        k.arg is None for k in call.keywords
    )
    named = [k.arg for k in call.keywords if k.arg is not None]
    if a.kwarg is None:
        unknown = sorted(set(named) - by_name)
        if unknown:
            return f"no parameter {unknown}"
    if unpacked:
        return None
    if a.vararg is None and len(call.args) > len(positional):
        return f"{len(call.args)} positional arguments, at most {len(positional)}"
    filled = set(positional[: len(call.args)])
    twice = sorted(filled & set(named))
    if twice:
        return f"{twice} given twice"
    required = positional[: len(positional) - len(a.defaults)]
    required += [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    missing = sorted(set(required) - filled - set(named))
    return f"missing {missing}" if missing else None


def test_every_import_of_the_package_resolves(tmp_path):
    """Every ``import`` and ``from ... import`` of the package's modules in the package,
    the tests, scripts, benchmarks and examples names a module that exists and a name it
    binds, every attribute read off such a module is one it binds, and every call of a
    package function so imported binds to its parameters: function-local imports and
    GPU-only calls (the GPU paths') included, which the CPU suite never runs."""
    problems = []
    for tree in PYTHON_TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            if "_build" not in path.parts:
                problems += _import_problems(path, _module_name(path))
    assert problems == []
    # and the check finds what it looks for
    fake = tmp_path / "_fake_module_for_the_import_check.py"
    fake.write_text(
        "from cuflash.gpu import registry\nfrom cuflash import no_such_module\n"
        "def f():\n    from cuflash.gpu.launch import NoSuchPlan\n"
        "    return registry.NO_SUCH_TABLE\n"
        "from cuflash.core.problem import forward_problem\n"
        "forward_problem(1, 2, 3, 4, no_such_option=1)\n"
        "forward_problem(1, 2, 3)\n"
        "registry.choose('forward', 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)\n"
    )
    found = _import_problems(fake, "tests._fake")
    assert len(found) == 6, found
