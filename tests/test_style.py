"""The tree follows its tools' rules (pyproject.toml, .clang-format): ruff's lint and
format, mypy on the package, clang-format on the kernels (the generated
``kernels/common/wgmma_ops.cuh`` aside). ``pre-commit`` runs the same before each commit."""

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
