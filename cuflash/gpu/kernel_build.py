"""Kernel source, compilation and the per-device module cache.

Every kernel of one (dtype, head_dim) variant (the registry's kernels that
serve it, ``cuflash.gpu.registry``) is compiled through NVRTC on first use and
kept for the process (per device and arch); CuPy's on-disk cache keeps the
binary across processes. The local ``#include "..."`` files (paths from ``kernels/``:
``common/``, the shared pieces; ``sm80/``, ``sm90/``, ``simt/`` and ``decode/``, the
kernels, each header named after the kernel it holds) are inlined into the source
string, so CuPy's cache key (a hash of source and options) sees every line.

:func:`compile_offline` compiles the same source for a named arch without a
GPU, which the CPU test suite uses to build every variant for sm_80 and
sm_90a and to read the compiler's resource report.
"""

import collections
import dataclasses
import functools
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from ..modifiers.cxx import MODIFIER_PRELUDE
from . import registry, standalone

KERNEL_DIR = Path(__file__).parent.parent / "kernels"
MODULE_FILE = "attention.cu"
HEAD_DIMS = tuple(range(8, 257, 8))
CXX_TYPES = registry.CXX_TYPES
COMPILE_OPTIONS = ("-std=c++17",)


def inlined_source(path, seen, root=KERNEL_DIR):
    """The text of kernel source ``path`` with its local includes inlined, each file once
    (``seen``: the files inlined so far, updated); an include names a file by its path
    from the kernels' folder ``root``."""
    path = Path(path).resolve()
    if path in seen:
        return ""
    seen.add(path)
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r'\s*#include\s+"([^"]+)"', line)
        if m:
            out.append(inlined_source(root / m.group(1), seen, root))
        elif line.strip() != "#pragma once":
            out.append(line)
    return "\n".join(out)


@functools.cache
def module_source(name=MODULE_FILE):
    """The ``.cu`` file with its local includes inlined (each once)."""
    return inlined_source(KERNEL_DIR / name, set()) + "\n"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One (storage dtype, head_dim, tile generation) and the kernels it holds: every
    kernel of ``cuflash.gpu.registry.KERNELS`` that serves it on that generation. With a
    ``head_dim_v`` (v's head dim, other than head_dim): the kernels that take it natively,
    instantiated for it (``registry.variant_roles``)."""

    dtype: np.dtype
    head_dim: int
    sm: int = 90  # 80: tiles for sm_80..sm_89; 90: sm_90 and newer
    head_dim_v: int | None = None

    @functools.cache  # noqa: B019 - a few dozen variants per process
    def kernel_names(self, with_masks=False):
        """Kernel role -> C++ name expression to instantiate (one shared dict: do not
        modify); ``with_masks``: also the roles compiled only for a user's mask alone."""
        return registry.variant_roles(
            self.dtype, self.head_dim, self.sm, self.head_dim_v, with_masks
        )

    def traits(self, role):
        """The ``cuflash.gpu.tile_traits.Traits`` of kernel ``role`` at this head_dim."""
        return registry.BY_ROLE[role].traits_of(
            self.head_dim, role.endswith(registry.MODIFIED), role.endswith(registry.FP8)
        )


def all_variants(sm=90):
    """Every (dtype, head_dim) the library can compile, with the tiles of ``sm``."""
    return [Variant(dt, d, sm) for dt in CXX_TYPES for d in HEAD_DIMS]


generation = registry.generation


@dataclasses.dataclass(frozen=True)
class UserFunctors:
    """The user's modifier functors (``cuflash.modifiers``) a kernel is compiled with:
    their C++ goes before the module source and ``-D`` options name them in
    ``kernels/common/common.cuh`` (``CUFLASH_USER_SCORE_MOD``, ``CUFLASH_USER_MASK_MOD``).
    Equal when their code is equal (the modifiers' cache keys), whatever arrays they
    read: kernels are shared by every modifier of the same source."""

    key: tuple  # (score cache key or None, mask cache key or None, mask only)
    prefix: str = dataclasses.field(compare=False)
    options: tuple = dataclasses.field(compare=False)

    @classmethod
    def of(cls, score_mod=None, mask_mod=None, built_ins=False):
        """The functors of ``score_mod`` and ``mask_mod`` (either may be None), or None
        when both are. ``built_ins``: the calls also take softcap or ALiBi; without them
        and a score function, the kernels are compiled mask-only (their plain code, the
        mask on the tiles it cuts: ``CUFLASH_USER_MASK_ONLY``)."""
        if score_mod is None and mask_mod is None:
            return None
        mods = [m for m in (score_mod, mask_mod) if m is not None]
        options = tuple(
            f"-DCUFLASH_USER_{kind}_MOD={m.struct_name}"
            for kind, m in (("SCORE", score_mod), ("MASK", mask_mod))
            if m is not None
        )
        mask_only = score_mod is None and not built_ins
        if mask_only:
            options += ("-DCUFLASH_USER_MASK_ONLY",)
        prefix = MODIFIER_PRELUDE + "".join(m.cxx_source for m in mods)
        return cls(
            tuple(None if m is None else m.cache_key for m in (score_mod, mask_mod)) + (mask_only,),
            prefix,
            options,
        )


class _LoadedVariant:
    """The kernels of one variant on one device, each compiled on first use.

    Each kernel role is its own ``RawModule`` (the role is a ``-D`` option,
    so CuPy's cache key tells them apart): a first forward call compiles the
    forward kernel only, not the backward ones.
    """

    def __init__(self, variant):
        self.variant = variant
        self.names = variant.kernel_names(with_masks=True)  # each compiled on first use
        self._kernels = {}
        self._locks = {}
        self._lock = threading.Lock()

    def kernel(self, role, functors=None):
        """The ``cupy.RawKernel`` of ``role``, compiled (or loaded from cache) once; with
        :class:`UserFunctors` (a modified role), compiled with them."""
        key = role if functors is None else (role, functors)
        found = self._kernels.get(key)
        if found is not None:
            return found
        with self._lock:  # one lock a kernel: threads compile different kernels at once
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            found = self._kernels.get(key)
            if found is None:
                spec = registry.BY_ROLE[role]
                options: tuple[str, ...] = (f"-DCUFLASH_ROLE_{role}",)
                if spec.needs_sm90a:  # CuPy adds -arch=sm_90; NVRTC keeps the last, sm_90a
                    options += ("-arch=sm_90a",)
                prefix = ""
                if functors is not None:
                    options += functors.options
                    prefix = functors.prefix
                found = self._kernels[key] = _raw_kernel(
                    MODULE_FILE,
                    self.names[role],
                    options,
                    self.variant.traits(role).shared_bytes,
                    prefix,
                )
            return found


_MODULES: dict = {}
_MODULES_LOCK = threading.Lock()


def load(variant):
    """The kernels of ``variant`` for CuPy's current device."""
    import cupy

    device = cupy.cuda.Device()
    key = (device.id, device.compute_capability, variant)
    with _MODULES_LOCK:
        loaded = _MODULES.get(key)
        if loaded is None:
            loaded = _MODULES[key] = _LoadedVariant(variant)
    return loaded


@dataclasses.dataclass
class CompileReport:
    """What NVRTC and ptxas said about one variant for one arch."""

    variant: Variant
    arch: str
    log: str
    cubin: bytes
    lowered_names: dict  # role -> mangled name

    def sass_opcodes(self, cuobjdump=None):
        """Per kernel role: a Counter of SASS opcodes (``HMMA``, ``HGMMA``, ``LDL``...).

        Disassembles the cubin with ``cuobjdump -sass`` (``cuobjdump`` from
        :func:`find_cuobjdump` unless given). Raises RuntimeError when there
        is none or it cannot read the cubin (an older cuobjdump than NVRTC).
        """
        tool = cuobjdump or find_cuobjdump()
        if tool is None:
            raise RuntimeError("no cuobjdump found")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "variant.cubin")
            with open(path, "wb") as f:
                f.write(self.cubin)
            # cuobjdump runs nvdisasm, which the wheels install next to it.
            env = dict(
                os.environ,
                PATH=os.pathsep.join([os.path.dirname(tool), os.environ.get("PATH", "")]),
            )
            done = subprocess.run([tool, "-sass", path], capture_output=True, text=True, env=env)
        if done.returncode or "Function :" not in done.stdout:
            raise RuntimeError(f"cuobjdump could not read the cubin: {done.stderr.strip()}")
        by_name: dict = {}
        current = None
        for line in done.stdout.splitlines():
            m = re.search(r"Function : (\w+)", line)
            if m:
                current = by_name[m.group(1)] = collections.Counter()
                continue
            m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
            if m and current is not None:
                current[m.group(1)] += 1
        return {role: by_name[name] for role, name in self.lowered_names.items()}

    def kernels(self):
        """Per kernel role: registers, stack frame, spill stores and loads, and whether
        ptxas serialized its wgmma instructions: its advisories "wgmma.mma_async
        instructions are serialized due to ..." (C7519, e.g. for a wgmma in a branch that
        depends on the warpgroup; C7512, insufficient register resources: every wgmma
        then waits for the one before, which the register counts do not show)."""
        info: dict = {}
        current = properties_of = None
        serialized = set(
            re.findall(
                r"wgmma\.mma_async instructions are serialized.*? function '(\w+)'", self.log
            )
        )
        for line in self.log.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                current = properties_of = m.group(1)
                info[current] = {}
                continue
            # A called function's properties follow its caller's: they are not the kernel's.
            m = re.search(r"Function properties for (\w+)", line)
            if m:
                properties_of = m.group(1)
                continue
            if current is None or properties_of != current:
                continue
            m = re.search(
                r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
            )
            if m:
                info[current].update(
                    stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3))
                )
            m = re.search(r"Used (\d+) registers", line)
            if m:
                info[current]["registers"] = int(m.group(1))
        return {
            role: dict(info[name], wgmma_serialized=name in serialized)
            for role, name in self.lowered_names.items()
        }


def find_cuobjdump():
    """Path of ``cuobjdump``: on PATH, or from the ``nvidia-cuda-cuobjdump`` wheel."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for candidate in sorted(Path(root).glob("cu*/bin/cuobjdump")):
            return str(candidate)
    return None


def _complete_elf(image):
    """``image`` padded to the end of its ELF headers.

    CuPy's ``nvrtc.getCUBIN`` returns the cubin one byte short (it treats the
    size as a C string's); the driver loads it anyway, cuobjdump refuses it.
    """
    if image[:4] != b"\x7fELF" or len(image) < 64:
        return image
    ph_off, sh_off = struct.unpack_from("<QQ", image, 0x20)
    ph_size, ph_count, sh_size, sh_count = struct.unpack_from("<HHHH", image, 0x36)
    end = max(ph_off + ph_size * ph_count, sh_off + sh_size * sh_count)
    return image + b"\0" * max(0, end - len(image))


def compile_offline(variant, arch, roles=None, functors=None):
    """Compile ``variant`` for ``arch`` (e.g. ``"sm_90a"``) without a GPU: every kernel,
    or the named ``roles``, with :class:`UserFunctors` if given (and with a user's mask
    alone, the roles compiled only for it)."""
    names = variant.kernel_names(with_masks=functors is not None and functors.key[-1])
    if roles is not None:
        names = {role: names[role] for role in roles}
    try:
        log, cubin, lowered = compile_source_offline(
            MODULE_FILE, list(names.values()), arch, functors
        )
    except RuntimeError as exc:
        raise RuntimeError(f"{variant}: {exc}") from exc
    return CompileReport(
        variant, arch, log, cubin, {role: lowered[name] for role, name in names.items()}
    )


def _raw_kernel(source_file, name_expression, options, shared_bytes, prefix=""):
    """``name_expression`` of ``kernels/source_file`` (after ``prefix``) compiled through
    NVRTC (or loaded from CuPy's cache), its dynamic shared-memory limit raised to
    ``shared_bytes`` past 48 KB."""
    import cupy

    module = cupy.RawModule(
        code=prefix + module_source(source_file),
        options=COMPILE_OPTIONS + options,
        name_expressions=[name_expression],
    )
    kernel = module.get_function(name_expression)
    if shared_bytes > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = shared_bytes
    return kernel


_SINGLE_KERNELS: dict = {}


def load_standalone(name_expression, shared_bytes=0, functors=None):
    """A kernel of ``cuflash.gpu.standalone.STANDALONE_KERNELS`` (outside the per-(dtype,
    head_dim) variants): ``name_expression`` (from its ``name_expression``) of its source
    file (local includes inlined), compiled through NVRTC once per (device, source, name,
    arch, functors) and cached; LookupError for a kernel the registry does not hold.
    ``shared_bytes`` above 48 KB raises the kernel's dynamic shared-memory limit;
    :class:`UserFunctors` (kernels with ``modifiers``) go before the source."""
    import cupy

    spec = standalone.standalone_of(name_expression)
    if functors is not None and not spec.modifiers:
        raise ValueError(f"{spec.name} is not compiled with modifier functors")
    arch = spec.arch
    key = (cupy.cuda.Device().id, spec.source, name_expression, arch, shared_bytes, functors)
    with _MODULES_LOCK:
        found = _SINGLE_KERNELS.get(key)
        if found is None:
            options = (f"-arch={arch}",) if arch else ()
            prefix = ""
            if functors is not None:
                options += functors.options
                prefix = functors.prefix
            found = _SINGLE_KERNELS[key] = _raw_kernel(
                spec.source, name_expression, options, shared_bytes, prefix
            )
    return found


def compile_standalone_offline(name_expressions, arch, functors=None):
    """:func:`compile_source_offline` of registry kernels outside the variants, all of one
    source file (``cuflash.gpu.standalone.STANDALONE_KERNELS``)."""
    sources = {standalone.standalone_of(name).source for name in name_expressions}
    if len(sources) != 1:
        raise ValueError(f"expected the kernels of one source file, got {sorted(sources)}")
    return compile_source_offline(sources.pop(), name_expressions, arch, functors)


def compile_source_offline(source_file, name_expressions, arch, functors=None):
    """Compile ``name_expressions`` of ``kernels/source_file`` for ``arch`` without a GPU
    (with :class:`UserFunctors` if given): ``(log, cubin, lowered names)``, for the
    compile tests."""
    from cupy.cuda import nvrtc

    prefix = functors.prefix if functors is not None else ""
    options = functors.options if functors is not None else ()
    prog = nvrtc.createProgram(prefix + module_source(source_file), source_file, (), ())
    try:
        for name in name_expressions:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, COMPILE_OPTIONS + options + (f"-arch={arch}", "-Xptxas=-v"))
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(
                f"{source_file} for {arch} failed:\n{nvrtc.getProgramLog(prog)}"
            ) from exc
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in name_expressions}
        return nvrtc.getProgramLog(prog), _complete_elf(nvrtc.getCUBIN(prog)), lowered
    finally:
        nvrtc.destroyProgram(prog)


def forget_loaded():
    """Forget every loaded variant and standalone kernel, so that the next call loads
    them again (from CuPy's kernel cache, or compiled): the benchmarks' first-call probe."""
    with _MODULES_LOCK:
        _MODULES.clear()
        _SINGLE_KERNELS.clear()
