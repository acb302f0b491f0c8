"""The host's dynamic shared-memory figures against the kernels' own layouts, without a GPU.

The host computes each launch's shared memory in Python (``cuflash.gpu.tile_traits`` for
the registry's kernels, ``cuflash.gpu.decode_tiles`` through
``cuflash.gpu.decode_kernels.decode_kernel`` for the KV cache's); each kernel carves that
memory by its layout struct (``kernels/common/common.cuh``: ``<Kernel>Shared``, or the
decode kernels' ``Decode*Shape``) and exposes the bytes it needs as
``<kernel>_shared_bytes``, a constant that takes the kernel's own template arguments. NVRTC
compiles one translation unit an architecture of ``static_assert(<kernel>_shared_bytes<the
launch's arguments> == <the host's figure>)`` for every role of every (dtype, head_dim)
variant, the FP8 roles, v narrower than q and k, and the decode kernels' tile shapes
(CUDA-core, tensor-core: contiguous, paged, narrow, e4m3 cache; MLA), so a host formula
that drifts from the layout fails here instead of overrunning shared memory on a GPU."""

import dataclasses
import os
import re
from unittest import mock

import numpy as np
import pytest

from cuflash.core.kvcache_problem import KVCacheProblem
from cuflash.gpu import decode_kernels, kernel_build, registry, standalone

ARCHS = {"sm_80": 80, "sm_90a": 90}
SIXTEEN_BIT = registry.SIXTEEN_BIT_DTYPES
DTYPES = tuple(registry.CXX_TYPES)  # float32, float16, bfloat16
# (head_dim, head_dim_v) of v narrower than q and k (MLA's 192 / 128 among them): the
# layout at v's head dim fits in the host's figure, which is head_dim's.
NARROW_V = ((64, 32), (96, 40), (128, 64), (192, 128), (256, 128), (256, 192))
DECODE_KERNELS = (
    "kvcache_decode",
    "kvcache_decode_tc",
    "kvcache_decode_mla",
    "kvcache_decode_mla_wgmma",
)


@dataclasses.dataclass(frozen=True)
class Check:
    """One figure: ``expression`` (a kernel's ``<kernel>_shared_bytes<...>``) ``relation``
    ``figure`` (the host's bytes), named by ``label`` in the assertion's message."""

    expression: str
    figure: int
    label: str
    relation: str = "=="

    def line(self, figure=None):
        figure = self.figure if figure is None else figure
        text = f"{self.label}: host {figure} bytes"
        return f'static_assert({self.expression} {self.relation} {figure}, "{text}");'


def shared_bytes_expression(name_expression):
    """``cuflash::kernel<args>`` -> ``cuflash::kernel_shared_bytes<args>``."""
    template, args = name_expression.split("<", 1)
    return f"{template}_shared_bytes<{args}"


def variant_checks(sm, dtypes=DTYPES, head_dims=kernel_build.HEAD_DIMS):
    """A check for every role with dynamic shared memory of every variant of tile
    generation ``sm`` (the FP8 roles and the roles of a user's mask alone included), and
    the value-dims kernels' roles where v is narrower (their layout at most the figure)."""
    checks = []
    for dtype in dtypes:
        shapes = [(d, None) for d in head_dims] + (list(NARROW_V) if sm == 90 else [])
        for head_dim, head_dim_v in shapes:
            roles = registry.variant_roles(dtype, head_dim, sm, head_dim_v, with_masks=True)
            for role, name in roles.items():
                spec = registry.BY_ROLE[role]
                traits = spec.traits_of(
                    head_dim, role.endswith(registry.MODIFIED), role.endswith(registry.FP8)
                )
                if traits.shared_bytes == 0:  # the helpers: no dynamic shared memory
                    continue
                narrow = head_dim_v is not None and bool(spec.value_dims)
                label = f"{role} {np.dtype(dtype)} d={head_dim}" + (
                    f" dv={head_dim_v}" if narrow else ""
                )
                checks.append(
                    Check(
                        shared_bytes_expression(name),
                        traits.shared_bytes,
                        label,
                        "<=" if narrow else "==",
                    )
                )
    return checks


def decode_problem(dtype, head_dim, rows, head_dim_v=None, paged=False, capacity=512, **kw):
    """A KV-cache call of ``rows`` packed query rows (a group of that many query heads on
    one KV head, one query row each) as the decode kernels' choice reads it."""
    fields = dict(
        xp=np,
        dtype=np.dtype(dtype),
        batch=1,
        num_heads=rows,
        num_kv_heads=1,
        q_len=1,
        new_len=0,
        head_dim=head_dim,
        paged=paged,
        capacity=capacity,
        block_size=16 if paged else capacity,
        num_blocks=capacity // 16 if paged else 1,
        max_blocks=capacity // 16 if paged else 1,
        host_lengths=None,
        softmax_scale=1.0,
        window=(-1, -1),
        return_lse=False,
        head_dim_v=head_dim if head_dim_v is None else head_dim_v,
    )
    fields.update(kw)
    return KVCacheProblem(**fields)


def _decode_check(problem, capability=80, fp8=None):
    name, _, _, shared = decode_kernels.decode_kernel(problem, capability, fp8)
    label = f"{name.removeprefix('cuflash::')} cc={capability}"
    return Check(shared_bytes_expression(name), shared, label)


def decode_checks():
    """The decode kernels' tiles as ``decode_kernel`` chooses them: the CUDA-core kernel
    (every dtype off the tensor cores' head dims, each row tile), the tensor-core one
    (both 16-bit dtypes, every head dim a multiple of 16, 1 to 64 packed rows: narrow and
    one to four row tiles; contiguous and paged; short and long caches: two and three
    stages), over an e4m3 cache (q in e4m3 or 16 bits; 16-bit tiles in blocks of fewer
    than 32 keys), and the MLA one (absorbed 576 / 512, 192 / 128 with its own v, 64 / 128,
    on sm_80, sm_86 and sm_90: the keys a tile each picks; absorbed 576 / 512 and 256 / 128
    with 64 query heads on sm_90: the wgmma one)."""
    checks = []
    for dtype in DTYPES:
        for head_dim in range(8, 257, 8):
            if np.dtype(dtype).itemsize == 2 and head_dim % 16 == 0:
                continue  # the tensor-core kernel's
            for rows in (1, 2, 3, 8, 16):
                checks.append(_decode_check(decode_problem(dtype, head_dim, rows)))
    for dtype in SIXTEEN_BIT:
        for head_dim in range(16, 257, 16):
            for rows in (1, 8, 16, 32, 64):
                for paged in (False, True):
                    for capacity in (512, 4096):
                        problem = decode_problem(dtype, head_dim, rows, paged=paged)
                        problem = dataclasses.replace(problem, capacity=capacity)
                        checks.append(_decode_check(problem))
    for out in SIXTEEN_BIT:
        for query in (np.dtype(np.uint8), out):
            fp8 = standalone.E4m3Cache(query, out)
            for head_dim in (16, 64, 80, 128, 192, 256):
                for rows, paged, block_size in ((1, False, 0), (16, True, 16), (64, True, 64)):
                    problem = decode_problem(out, head_dim, rows, paged=paged)
                    if paged:
                        problem = dataclasses.replace(problem, block_size=block_size)
                    checks.append(_decode_check(problem, 90, fp8))
    for dtype in SIXTEEN_BIT:
        for head_dim, head_dim_v, latent in ((576, 512, True), (192, 128, False), (64, 128, False)):
            for capability in (80, 86, 90):
                for paged in (False, True):
                    problem = decode_problem(
                        dtype, head_dim, 16, head_dim_v, paged=paged, latent=latent
                    )
                    checks.append(_decode_check(problem, capability))
        for head_dim, head_dim_v in ((576, 512), (256, 128)):
            for paged in (False, True):
                problem = decode_problem(dtype, head_dim, 64, head_dim_v, paged=paged, latent=True)
                checks.append(_decode_check(problem, 90))
                assert "kvcache_decode_mla_wgmma" in checks[-1].expression
    return checks


def _source(arch):
    """The kernels' sources, each header once: the variants' module and, in the sm_80
    unit, the decode kernels'."""
    seen = set()
    parts = [kernel_build.inlined_source(kernel_build.KERNEL_DIR / kernel_build.MODULE_FILE, seen)]
    if arch == "sm_80":
        for kernel in DECODE_KERNELS:
            path = kernel_build.KERNEL_DIR / standalone.STANDALONE[kernel].source
            parts.append(kernel_build.inlined_source(path, seen))
    return "\n".join(parts)


def compile_checks(arch, lines):
    """NVRTC's log of the kernels' sources and ``lines`` (static_asserts) compiled for
    ``arch``, or None where they compile."""
    from cupy.cuda import nvrtc

    body = "\n".join(lines)
    source = f"{_source(arch)}\nnamespace cuflash {{\n{body}\n}}\n"
    prog = nvrtc.createProgram(source, "shared_layout.cu", (), ())
    try:
        nvrtc.compileProgram(prog, kernel_build.COMPILE_OPTIONS + (f"-arch={arch}",))
    except nvrtc.NVRTCError:
        return nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return None


def checks_of(arch):
    checks = variant_checks(ARCHS[arch])
    if arch == "sm_90a":  # forward_wgmma_ws's plain roles on 176-key tiles
        with mock.patch.dict(os.environ, {"CUFLASH_FORWARD_KEYS": "176"}):
            checks += variant_checks(90, SIXTEEN_BIT, (72, 96, 128))
    if arch == "sm_80":
        checks += decode_checks()
    return checks


def _failures(log):
    return re.findall(r'static assertion failed with "([^"]*)"', log or "")


@pytest.mark.parametrize("arch", ARCHS)
def test_host_figures_are_the_kernels_layouts(arch):
    checks = checks_of(arch)
    assert len(checks) > 500
    log = compile_checks(arch, [c.line() for c in checks])
    assert log is None, "\n".join(_failures(log)) or log[-4000:]


def test_every_family_is_checked():
    """The checks reach every kernel whose launch takes dynamic shared memory (the
    registry's, the FP8 and mask-only roles, 176-key tiles and the three decode kernels)."""
    found = {
        c.expression.split("<", 1)[0].removeprefix("cuflash::") for a in ARCHS for c in checks_of(a)
    }
    kernels = [s.name for s in registry.KERNELS if s.traits(max(s.head_dims)).shared_bytes]
    assert found == {f"{name}_shared_bytes" for name in kernels + list(DECODE_KERNELS)}
    text = " ".join(c.line() for a in ARCHS for c in checks_of(a))
    for piece in ("_fp8 ", "ws_modified ", "E4m3Cache", "true, true>", " dv=", ", 176, 2, 2,"):
        assert piece in text, piece


def _one_a_role(checks):
    """The first check of each role (and of each decode kernel and cache type)."""
    first = {}
    for c in checks:
        key = c.label.split("<")[0].split()[0] + ("e4m3" if "E4m3Cache" in c.label else "")
        first.setdefault(key, c)
    return list(first.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_a_wrong_host_figure_fails_the_check(arch):
    """A host figure 16 bytes short (a region the formula forgot) or over (one it
    invented) fails its check, and only its: one check of each role, every other one
    wrong."""
    checks = _one_a_role(checks_of(arch))
    assert len(checks) >= 20
    wrong = checks[::2]
    lines = [c.line(c.figure + (16 if i % 2 else -16)) for i, c in enumerate(wrong)]
    lines += [c.line() for c in checks[1::2]]
    failed = _failures(compile_checks(arch, lines))
    assert sorted(failed) == sorted(
        f"{c.label}: host {c.figure + (16 if i % 2 else -16)} bytes" for i, c in enumerate(wrong)
    )
