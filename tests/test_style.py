"""The tree follows its tools' rules (pyproject.toml, .clang-format): ruff's lint and
format, mypy on the package, clang-format on the kernels (the generated
``kernels/common/wgmma_ops.cuh`` aside). ``pre-commit`` runs the same before each commit.
And the package's modules import each other without a circle."""

import ast
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
    paths = {}
    for path in (ROOT / "cuflash").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
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
    assert {"cuflash.problem", "cuflash.gpu", "cuflash.modifiers.block_mask"} <= set(graph)
    assert "cuflash.modifiers.block_mask" in graph["cuflash.problem"]
    assert _circles(graph) == []
