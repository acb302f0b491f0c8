"""The documentation builds without warnings, and the code in it runs.

* ``test_docs_build`` runs ``sphinx-build -W --keep-going -b html docs <tmp>``
  (skipped only when Sphinx is not installed; the rest of the ``docs`` extra
  must then be there too).
* ``test_snippets`` runs every fenced ``python`` and ``pycon`` block of
  ``docs/*.md`` on the CPU path, page by page, top to bottom, in one namespace
  per page (so a block may use what an earlier block of its page defined).
  ``python`` blocks are executed; ``pycon`` blocks are doctests, so their
  printed output is checked too. A block whose first line is ``# gpu-only``
  is only compiled here; ``test_snippets_gpu`` runs every block, GPU ones
  included, on a machine with a GPU. A ``# needs: torch, jax`` line (right
  after the marker) skips a block whose modules are not installed.
* ``test_docstring_examples`` runs the doctests of every ``cuflash`` module.
* The ``test_error_table_*`` tests hold the Troubleshooting page's table of
  error messages to the ``InvalidArgumentError`` calls in ``cuflash/**/*.py``
  and to the messages that real calls produce.
"""

import ast
import dataclasses
import doctest
import importlib
import importlib.util
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
from test_fp8 import fp8_bad_calls  # the FP8 messages' sample calls

import cuflash

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
DOCTEST_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


# --------------------------------------------------------------------------- build


def test_docs_build(tmp_path):
    pytest.importorskip("sphinx", reason="Sphinx is not installed (pip install -e .[docs])")
    out = tmp_path / "html"
    cmd = [
        sys.executable,
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-q",
        "-b",
        "html",
        str(DOCS),
        str(out),
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, (
        f"sphinx-build failed (exit {proc.returncode}); needs the docs extra "
        f"(pip install -e .[docs]).\n{proc.stdout}\n{proc.stderr}"
    )
    for name in ("causal", "windows", "kv_seq_len", "gqa", "mqa"):
        assert (out / "_images" / f"{name}.png").is_file(), f"mask figure {name}.png missing"
    api = (out / "api.html").read_text(encoding="utf-8")
    undocumented = [name for name in cuflash.__all__ if f'id="cuflash.{name}"' not in api]
    assert not undocumented, f"public names missing from docs/api.rst: {undocumented}"
    for name in ("attention_reference", "attention_reference_grad"):
        assert f'id="cuflash.reference.{name}"' in api, name
    print(f"docs built in {seconds:.1f} s")


# ------------------------------------------------------------------------ snippets


@dataclasses.dataclass(frozen=True)
class Snippet:
    """One fenced code block of a page."""

    page: Path
    line: int  # line of the block's first code line, 1-based
    lang: str  # "python" or "pycon"
    code: str
    gpu_only: bool
    needs: tuple

    def __str__(self):
        return f"{self.page.relative_to(ROOT)}:{self.line}"


FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
LANGS = {"python": "python", "py": "python", "python3": "python", "pycon": "pycon"}


def _language(info):
    """``python`` / ``pycon`` / None for a fence's info string (MyST forms too)."""
    words = info.split()
    if not words:
        return None
    if words[0] in ("{code-block}", "{code}", "{sourcecode}") and len(words) > 1:
        return LANGS.get(words[1])
    return LANGS.get(words[0])


def _markers(code, lang):
    """``(gpu_only, needs)`` from the block's leading comment lines."""
    gpu_only, needs = False, ()
    for line in code.splitlines():
        text = line.strip()
        if lang == "pycon":
            text = text[4:].strip() if text.startswith(">>>") else text
        if not text.startswith("#"):
            break
        if re.fullmatch(r"#\s*gpu-only\b.*", text):
            gpu_only = True
        m = re.fullmatch(r"#\s*needs:\s*(.+)", text)
        if m:
            needs += tuple(n.strip() for n in m.group(1).split(",") if n.strip())
    return gpu_only, needs


def extract_snippets(page):
    """Every python/pycon fenced block of a Markdown page, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    snippets, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        info, fence, indent = m.group("info").strip(), m.group("fence"), m.group("indent")
        if info.startswith("{") and _language(info) is None:
            i += 1  # a directive ({note}, {toctree}, ...): its body is Markdown, keep scanning
            continue
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        lang = _language(info)
        if lang is not None:
            body = lines[i + 1 : j]
            first = 0
            while first < len(body) and re.match(r"^\s*:\w[\w-]*:", body[first]):
                first += 1  # options of a {code-block} directive
            body = [b[len(indent) :] if b.startswith(indent) else b.lstrip() for b in body[first:]]
            code = "\n".join(body) + "\n"
            snippets.append(Snippet(page, i + 2 + first, lang, code, *_markers(code, lang)))
        i = j + 1
    return snippets


def _compile_python(snippet):
    # Leading newlines make tracebacks point at the right line of the page.
    return compile("\n" * (snippet.line - 1) + snippet.code, str(snippet.page), "exec")


def _run_pycon(snippet, namespace, compile_only=False):
    parser = doctest.DocTestParser()
    test = parser.get_doctest(
        snippet.code, namespace, str(snippet), str(snippet.page), snippet.line - 1
    )
    if compile_only:
        for example in test.examples:
            compile(example.source, str(snippet), "single")
        return
    report = []
    runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
    runner.run(test, out=report.append, clear_globs=False)
    namespace.update(test.globs)  # DocTest works on a copy; later blocks see its names
    if runner.failures:
        raise AssertionError(f"doctest failed at {snippet}:\n" + "".join(report))


def run_page(page, gpu):
    """Run a page's blocks in order; return (ran, compiled_only, skipped) lists."""
    namespace = {"__name__": f"docs_{page.stem}"}
    ran, compiled, skipped = [], [], []
    for snippet in extract_snippets(page):
        missing = [m for m in snippet.needs if importlib.util.find_spec(m) is None]
        if snippet.gpu_only and not gpu:
            if snippet.lang == "python":
                _compile_python(snippet)
            else:
                _run_pycon(snippet, namespace, compile_only=True)
            compiled.append(snippet)
            continue
        if missing:
            skipped.append((snippet, missing))
            continue
        try:
            if snippet.lang == "python":
                exec(_compile_python(snippet), namespace)  # noqa: S102 - the docs' own code
            else:
                _run_pycon(snippet, namespace)
        except AssertionError as exc:
            if str(exc).startswith("doctest failed"):
                raise
            raise AssertionError(f"snippet {snippet} failed:\n{traceback.format_exc()}") from exc
        except Exception as exc:
            raise AssertionError(f"snippet {snippet} raised:\n{traceback.format_exc()}") from exc
        ran.append(snippet)
    return ran, compiled, skipped


def _page_id(page):
    return page.name


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_snippets(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ran, compiled, _ = run_page(page, gpu=False)
    print(f"{page.name}: ran {len(ran)}, compiled only (gpu-only) {len(compiled)}")
    for snippet in ran:
        print(f"  ran {snippet} ({snippet.lang})")


@pytest.mark.gpu
@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_snippets_gpu(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ran, _, skipped = run_page(page, gpu=True)
    print(f"{page.name}: ran {len(ran)}, skipped {len(skipped)}")
    for snippet, missing in skipped:
        print(f"  skipped {snippet}: {', '.join(missing)} not installed")


def test_snippets_found():
    """The extractor sees the pages' code: a broken parser must not pass silently."""
    by_page = {page.name: extract_snippets(page) for page in PAGES}
    for name in (
        "index.md",
        "getting_started.md",
        "semantics.md",
        "gradients.md",
        "troubleshooting.md",
    ):
        cpu = [s for s in by_page.get(name, []) if not s.gpu_only]
        assert cpu, f"{name}: no CPU snippet found"
    assert any(s.lang == "pycon" for snippets in by_page.values() for s in snippets)
    assert any(s.gpu_only for snippets in by_page.values() for s in snippets)
    total = sum(len(s) for s in by_page.values())
    assert total >= 20, total


def test_extractor_markers():
    page = DOCS / "getting_started.md"
    blocks = {s.line: s for s in extract_snippets(page)}
    torch_blocks = [s for s in blocks.values() if "torch" in s.needs]
    assert torch_blocks and all(s.gpu_only for s in torch_blocks)


# ---------------------------------------------------------------- docstring doctests

MODULES = ["cuflash"] + sorted(
    name for _, name, _ in pkgutil.walk_packages(cuflash.__path__, "cuflash.")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:  # cuflash.gpu.launch without CuPy
        pytest.skip(f"{name} cannot be imported here: {exc}")
    report = []
    runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


def test_docstring_examples_exist():
    """At least one docstring example really runs (not all skipped or missing)."""
    runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
            runner.run(test, out=lambda _: None)
    results = runner.summarize(verbose=False)
    assert results.attempted - getattr(results, "skipped", 0) > 0


# ------------------------------------------------------------- the error-message table

GPU_ONLY_ERRORS = (
    "numpy and cupy arrays are mixed",
    "arrays are on different devices",
    "the call needs about",
    "the GPU kernels need a cupy array",
    "host code needs a numpy array",
    "the call runs on device",
    "the modifier does not compile",
    "the GPU path takes",
)


def _pattern(node):
    """A regex for the text an argument of ``InvalidArgumentError(...)`` produces."""
    if isinstance(node, ast.Constant):
        return re.escape(str(node.value))
    if isinstance(node, ast.JoinedStr):
        return "".join(
            re.escape(v.value) if isinstance(v, ast.Constant) else "(.+)" for v in node.values
        )
    return "(.+)"


def error_call_sites():
    """``{"file:line": regex}`` for every ``InvalidArgumentError(arg, reason)`` call."""
    sites = {}
    for path in sorted((ROOT / "cuflash").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "InvalidArgumentError"
            ):
                arg, reason = node.args
                sites[f"{path.relative_to(ROOT)}:{node.lineno}"] = re.compile(
                    f"^{_pattern(arg)}: {_pattern(reason)}$", re.S
                )
    return sites


def documented_messages():
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    section = text.split("\n## Error messages", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, re.M)


def varlen_bad_calls():
    """One invalid CPU call per documented message of the packed (varlen) functions."""
    q, kv = np.zeros((10, 4, 8), np.float32), np.zeros((12, 2, 8), np.float32)
    cu_q, cu_k = np.array([0, 4, 10], np.int32), np.array([0, 5, 12], np.int32)

    def fwd(cu_q=cu_q, cu_k=cu_k, max_q=8):
        return lambda: cuflash.flash_attention_varlen_fwd(q, kv, kv, cu_q, cu_k, max_q, 8, 4, 2, 8)

    many = np.zeros(65538, np.int32)
    many[-1] = 10
    return [
        fwd(cu_q=np.array([1, 4, 10], np.int32)),
        fwd(cu_q=np.array([0, 6, 4], np.int32)),
        fwd(max_q=5),
        fwd(cu_k=np.array([0, 5, 11], np.int32)),
        fwd(cu_q=many, cu_k=many),
    ]


def distributed_bad_calls():
    """One invalid CPU call per documented message of cuflash.distributed."""
    from cuflash import distributed as dist

    q = np.zeros((1, 2, 8, 16), np.float32)

    class One:
        rank, size = 0, 1

        def exchange(self, obj):
            return obj

    class Two(One):
        rank, size = 0, 2

    class Four(One):
        rank, size = 0, 4

    def fwd(q=q, k=q, v=q, group=One(), layout="zigzag"):
        return lambda: dist.ring_attention_fwd(q, k, v, 2, 2, 16, True, group=group, layout=layout)

    return [
        fwd(layout="ring"),
        fwd(group=object()),
        fwd(k=q[:, :, :6], v=q[:, :, :6]),
        fwd(q=q[:, :, :7], k=q[:, :, :7], v=q[:, :, :7]),
        lambda: dist.shard(np.zeros((1, 1, 10, 4)), "zigzag", 0, 2),
        lambda: dist.ThreadGroup(0),
        lambda: dist.NcclGroup(2, 2),
        lambda: dist.ulysses_attention_fwd(
            np.zeros((1, 3, 8, 16), np.float32),
            *[np.zeros((1, 1, 8, 16), np.float32)] * 2,
            3,
            1,
            16,
            group=Two(),
        ),
        lambda: dist.ulysses_attention_fwd(
            np.zeros((1, 8, 8, 16), np.float32),
            *[np.zeros((1, 3, 8, 16), np.float32)] * 2,
            8,
            3,
            16,
            group=Four(),
        ),
        lambda: dist.hybrid_groups(Four(), 3),
        lambda: dist.hybrid_groups(Four(), 2),
    ]


BAD_MODULE = """\
import numpy as np


def looping(score, b, h, q_idx, kv_idx):
    for step in range(3):
        score = score + step
    return score


def relative(score, b, h, q_idx, kv_idx):
    return score + TABLE[h, q_idx - kv_idx + 3]


def by_slot(score, b, h, q_idx, kv_idx):
    return score + TABLE[h, SLOT[q_idx]]


def reads(score, b, h, q_idx, kv_idx):
    return score + bias[h]  # bound by keyword


def product(b, h, q_idx, kv_idx):
    return q_idx * kv_idx * 1000 > 7


TABLE = np.linspace(0.5, 2.0, 14, dtype=np.float32).reshape(2, 7)
SLOT = np.array([0, 9], np.int32)
"""


def _bad_module():
    folder = Path(tempfile.mkdtemp())
    path = folder / "my_modifiers.py"
    path.write_text(BAD_MODULE)
    spec = importlib.util.spec_from_file_location("my_modifiers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def modifier_bad_calls():
    """One invalid CPU call per documented message of cuflash.modifiers."""
    from cuflash import modifiers

    bad = _bad_module()
    grids = modifiers.index_grids(1, 2, 2, 2)
    scores = np.ones((1, 2, 2, 2), np.float32)

    return [
        lambda: modifiers.ScoreMod(np.tanh),
        lambda: modifiers.ScoreMod(bad.reads, table=np.ones(2, np.float32)),
        lambda: modifiers.ScoreMod(bad.looping),
        lambda: modifiers.ScoreMod(bad.reads, bias=np.ones(2)),
        lambda: modifiers.ScoreMod(bad.relative).check_bounds(1, 2, 8, 4),
        lambda: modifiers.MaskMod(bad.product).check_bounds(1, 1, 100_000, 100_000),
        lambda: modifiers.ScoreMod(bad.by_slot).numpy_scores(scores, *grids),
        lambda: modifiers.softcap_score(2.0).numpy_scores(scores, *grids, dtype=np.float16),
        lambda: modifiers.softcap_score(2.0).numpy_scores(scores, 0, 0, 0.5, 0),
        lambda: modifiers.softcap_score(0.0),
        lambda: modifiers.alibi_score(np.ones(4)),
        lambda: modifiers.alibi_score(np.ones((1, 2, 3), np.float32)),
        lambda: modifiers.document_mask([0, 0, 1]),
        lambda: modifiers.relative_bias_score(np.ones((2, 4), np.float32)),
        lambda: modifiers.and_masks(),
        lambda: cuflash.flash_attention_fwd(
            np.ones((1, 2, 4, 16), np.float32),
            np.ones((1, 2, 4, 16), np.float32),
            np.ones((1, 2, 4, 16), np.float32),
            2,
            2,
            16,
            score_mod=modifiers.causal_mask(),
        ),
        *block_mask_bad_calls(),
    ]


def block_mask_bad_calls():
    """One invalid CPU call per documented message of cuflash.block_mask."""
    from cuflash import modifiers
    from cuflash.block_mask import create_block_mask

    q = np.ones((1, 2, 64, 16), np.float32)
    causal = modifiers.causal_mask()
    return [
        lambda: create_block_mask(causal, None, None, 0, 5),
        lambda: create_block_mask(causal, None, None, None, 5),
        lambda: create_block_mask(modifiers.softcap_score(2.0), None, None, 5, 5),
        lambda: create_block_mask(
            modifiers.document_mask(np.zeros((2, 5), np.int32)), None, None, 5, 5
        ),
        lambda: cuflash.flash_attention_fwd(
            q, q, q, 2, 2, 16, block_mask=create_block_mask(causal, None, None, 64, 80)
        ),
        lambda: cuflash.flash_attention_fwd(q, q, q, 2, 2, 16, block_mask=causal),
        lambda: cuflash.flash_attention_fwd(
            q,
            q,
            q,
            2,
            2,
            16,
            mask_mod=modifiers.causal_mask(),
            block_mask=create_block_mask(causal, None, None, 64, 64),
        ),
    ]


def kvcache_bad_calls():
    """One invalid CPU call per documented message of flash_attention_with_kvcache."""

    def a(*shape, dtype=np.float32):
        return np.zeros(shape, dtype)

    q1, cache, new = a(2, 8, 1, 64), a(2, 2, 16, 64), a(2, 2, 1, 64)
    pool, table = a(4, 2, 8, 64), np.zeros((2, 2), np.int32)
    lens = np.zeros(2, np.int32)

    def kv(q=q1, k_cache=cache, v_cache=cache, num_heads=8, num_kv_heads=2, head_dim=64, **kw):
        kw.setdefault("cache_seqlens", 0)
        v_cache = k_cache if v_cache is None else v_cache
        return lambda: cuflash.flash_attention_with_kvcache(
            q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, **kw
        )

    return [
        kv(q=a(2, 8, 0, 64)),
        kv(k_cache=a(2, 1, 16, 64)),
        kv(v_cache=a(2, 2, 12, 64)),
        kv(v_cache=cache[..., 32:], head_dim_v=32),
        kv(q=a(2, 8, 1, 576), k_cache=a(2, 2, 16, 576), v_cache=None, head_dim=576),
        kv(k_cache=a(2, 2, 16, 128)[..., ::2], v_cache=a(2, 2, 16, 128)[..., ::2]),
        kv(k_new=new),
        kv(k_new=a(2, 2, 17, 64), v_new=a(2, 2, 17, 64)),
        kv(
            k_new=new,
            v_new=new,
            k_cache=np.broadcast_to(cache[:1], cache.shape),
            v_cache=np.broadcast_to(cache[:1], cache.shape),
        ),
        kv(cache_seqlens=None),
        kv(cache_seqlens=True),
        kv(cache_seqlens=lens.astype(np.int64)),
        kv(cache_seqlens=16, k_new=new, v_new=new),
        kv(cache_seqlens=np.array([0, -4], np.int32)),
        kv(cache_seqlens=np.array([0, 16], np.int32), k_new=new, v_new=new),
        kv(k_cache=pool, v_cache=pool, block_table=table.astype(np.int64)),
        kv(k_cache=pool, v_cache=pool, block_table=table[:1]),
        kv(k_cache=a(4, 2, 0, 64), v_cache=a(4, 2, 0, 64), block_table=table),
        kv(k_cache=pool[:0], v_cache=pool[:0], block_table=table),
        kv(
            k_cache=pool,
            v_cache=pool,
            block_table=np.array([[0, 1], [2, 9]], np.int32),
            cache_seqlens=9,
        ),
        kv(rotary_cos=a(16, 32)),
        kv(
            q=a(2, 8, 1, 64, dtype=np.float16),
            k_cache=a(2, 2, 16, 64, dtype=np.float16),
            v_cache=a(2, 2, 16, 64, dtype=np.float16),
            rotary_cos=a(16, 32, dtype=np.float64),
            rotary_sin=a(16, 32, dtype=np.float64),
        ),
        kv(rotary_cos=a(16, 32), rotary_sin=a(16, 8)),
        kv(rotary_cos=a(16, 40), rotary_sin=a(16, 40)),
        kv(rotary_cos=a(16, 32), rotary_sin=a(16, 32)),
        kv(rotary_cos=a(8, 32), rotary_sin=a(8, 32), cache_seqlens=np.array([3, 9], np.int32)),
        kv(q=a(70000, 8, 1, 64), k_cache=a(70000, 2, 1, 64), v_cache=a(70000, 2, 1, 64)),
        kv(
            q=a(0, 1, 2**31, 8),
            k_cache=a(0, 1, 1, 8),
            v_cache=a(0, 1, 1, 8),
            num_heads=1,
            num_kv_heads=1,
            head_dim=8,
        ),
    ]


def bad_calls():
    """One invalid CPU call per documented message (the GPU-only ones aside)."""
    from cuflash import precompile

    def a(*shape, dtype=np.float32):
        return np.zeros(shape, dtype)

    q, kv, out, lse = a(2, 8, 16, 64), a(2, 2, 16, 64), a(2, 8, 16, 64), a(2, 8, 16)
    f64, f16 = np.float64, np.float16

    def fwd(q=q, k=kv, v=kv, num_heads=8, num_kv_heads=2, head_dim=64, **kw):
        return lambda: cuflash.flash_attention_fwd(q, k, v, num_heads, num_kv_heads, head_dim, **kw)

    def bwd(dout=out, output=out, lse=lse, **kw):
        return lambda: cuflash.flash_attention_bwd(dout, q, kv, kv, output, lse, 8, 2, 64, **kw)

    huge = a(70000, 1, 0, 8)
    return [
        fwd(q=q.tolist()),
        fwd(q=a(8, 16, 64)),
        fwd(
            q=a(2, 8, 16, 64, dtype=f64), k=a(2, 2, 16, 64, dtype=f64), v=a(2, 2, 16, 64, dtype=f64)
        ),
        fwd(k=a(2, 2, 16, 64, dtype=f16)),
        fwd(num_heads=8.0),
        fwd(num_heads=-1),
        fwd(num_kv_heads=0),
        fwd(head_dim=0),
        fwd(num_kv_heads=3),
        fwd(q=a(2, 8, 16, 12), k=a(2, 2, 16, 12), v=a(2, 2, 16, 12), head_dim=12),
        fwd(num_heads=4),
        fwd(k=a(2, 2, 16, 128), v=a(2, 2, 16, 128), head_dim=128),
        fwd(k=a(1, 2, 16, 64)),
        fwd(k=a(2, 4, 16, 64)),
        fwd(v=a(2, 2, 16, 32)),
        fwd(v=a(2, 2, 16, 32), head_dim_v=48),
        fwd(v=a(2, 2, 16, 12), head_dim_v=12),
        fwd(v=a(2, 2, 12, 64)),
        fwd(kv_seq_len=8.0),
        fwd(kv_seq_len=-1),
        fwd(kv_seq_len=17),
        fwd(window_size=2.5),
        fwd(window_size=-1),
        fwd(window_size=(4, 0, 1)),
        fwd(window_size=(-2, 0)),
        fwd(causal=1),
        fwd(softmax_scale="0.125"),
        fwd(softmax_scale=float("nan")),
        fwd(allow_tf32=1),
        fwd(softcap="1"),
        fwd(softcap=-1.0),
        fwd(alibi_slopes=a(8, dtype=f64)),
        fwd(alibi_slopes=a(3)),
        fwd(sinks=a(8, dtype=f64)),
        fwd(sinks=a(3)),
        fwd(q=huge, k=huge, v=huge, num_heads=1, num_kv_heads=1, head_dim=8),
        fwd(
            q=a(0, 1, 2**31, 8),
            k=a(0, 1, 8, 8),
            v=a(0, 1, 8, 8),
            num_heads=1,
            num_kv_heads=1,
            head_dim=8,
        ),
        bwd(output=a(2, 8, 16, 64, dtype=f16)),
        bwd(dout=a(8, 16, 64)),
        bwd(dout=a(2, 8, 64, 16)),
        bwd(lse=a(2, 8, 16, 1)),
        bwd(lse=a(2, 8, 8)),
        bwd(lse=a(2, 8, 16, dtype=f16)),
        bwd(deterministic=1),
        bwd(synchronize=None),
        lambda: cuflash.kernel_path("fast").__enter__(),
        lambda: cuflash.dispatch.skip_kernels("forward_fastest").__enter__(),
        lambda: cuflash.dispatch.try_kernels("forward_wgmma").__enter__(),
        *kvcache_bad_calls(),
        *varlen_bad_calls(),
        *distributed_bad_calls(),
        *modifier_bad_calls(),
        *fp8_bad_calls(),
        lambda: precompile.jobs_for(["float64"], [64], sm=80),
        lambda: precompile.jobs_for(["float16"], [12], sm=80),
    ]


def produced_messages():
    messages = []
    for call in bad_calls():
        with pytest.raises(cuflash.InvalidArgumentError) as info:
            call()
        messages.append(str(info.value))
    return messages


def test_error_table_covers_every_call_site():
    documented = documented_messages()
    assert len(documented) >= 30, documented
    missing = [
        site
        for site, pattern in error_call_sites().items()
        if not any(pattern.match(m) for m in documented)
    ]
    assert not missing, (
        f"InvalidArgumentError raised here has no row in docs/troubleshooting.md: {missing}"
    )


def test_error_table_messages_are_real():
    produced = set(produced_messages())
    sites = error_call_sites()
    for message in documented_messages():
        if any(s in message for s in GPU_ONLY_ERRORS):
            assert any(p.match(message) for p in sites.values()), message
        else:
            assert message in produced, f"documented but not produced: {message!r}"


def test_every_sample_call_is_documented():
    documented = set(documented_messages())
    undocumented = [m for m in produced_messages() if m not in documented]
    assert not undocumented, undocumented
