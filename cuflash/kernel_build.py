"""Kernel source, tile choices, compilation and the per-device module cache.

Every general kernel of one (dtype, head_dim) lives in one CuPy
``RawModule``, compiled through NVRTC on first use and kept for the process
(per device and arch); CuPy's on-disk cache keeps the binary across
processes. The local ``#include "..."`` files are inlined into the source
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

from .problem import BFLOAT16

KERNEL_DIR = Path(__file__).parent / "kernels"
MODULE_FILE = "attention.cu"
HEAD_DIMS = tuple(range(8, 257, 8))
CXX_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "cuflash::half_t"}
if BFLOAT16 is not None:
    CXX_TYPES[BFLOAT16] = "cuflash::bf16_t"
COMPILE_OPTIONS = ("-std=c++17",)
TENSOR_CORE_DTYPES = tuple(d for d in (np.dtype(np.float16), BFLOAT16) if d is not None)
TENSOR_CORE_HEAD_DIMS = (64, 128, 256)
# float32 on TF32 tensor cores: kernel role prefix -> mma passes per product
# ("tc32": hi/lo split, float32 accuracy; "tf32": one pass, TF32 accuracy).
FLOAT32_PRECISIONS = {"tc32": 3, "tf32": 1}
# Kernel roles that need an arch-specific target (wgmma exists on sm_90a only).
ARCH_SPECIFIC_ROLES = {role: "sm_90a" for role in (
    "fwd_wg", "fwd_wgp", "fwd_wgs",
    *(f"dkdv_{family}{suffix}" for family in ("wgb", "wgd", "wgs")
      for suffix in ("", "_atomic_dq")))}
THREADS = 128
FLOAT_BYTES = 4


@functools.lru_cache(maxsize=None)
def module_source(name=MODULE_FILE):
    """The ``.cu`` file with its local includes inlined (each once)."""
    seen = set()

    def inline(path):
        if path.name in seen:
            return ""
        seen.add(path.name)
        out = []
        for line in path.read_text().splitlines():
            m = re.match(r'\s*#include\s+"([^"]+)"', line)
            if m:
                out.append(inline(path.parent / m.group(1)))
            elif line.strip() != "#pragma once":
                out.append(line)
        return "\n".join(out)

    return inline(KERNEL_DIR / name) + "\n"


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile sizes for one head_dim and GPU generation (``sm`` 80 or 90), rows x keys."""

    head_dim: int
    sm: int = 90

    @property
    def fwd(self):
        return (64 if self.head_dim <= 128 else 32), 32

    @property
    def fwd_tc(self):
        """Tensor-core forward: (query rows, keys, m16 tiles per warp, Q in registers)."""
        # At D = 128 two m16 tiles per warp spill (sm_80; on sm_90 too since the
        # softmax's exp2 is one MUFU instruction), so one m16 tile and Q in registers.
        return {64: (128, 64, 2, False), 128: (64, 64, 1, True),
                256: (64, 32, 1, False)}.get(self.head_dim)

    @property
    def fwd_wg(self):
        """Hopper wgmma forward: (keys per tile, warpgroups of 64 query rows); sm 90 only."""
        if self.sm < 90:
            return None
        return {64: (128, 2), 128: (128, 2), 256: (64, 2)}.get(self.head_dim)

    @property
    def fwd_wgp(self):
        """The wgmma forward with the softmax pipelined under the matrix units: the
        ``fwd_wg`` shape where it beats ``fwd_wg`` (D = 64, 128; not D = 256)."""
        return self.fwd_wg if self.head_dim <= 128 else None

    @property
    def fwd_wgs(self):
        """float32 forward on float16 pieces with the wgmma (keys per tile); sm 90 only,
        D = 64 and 128."""
        if self.sm < 90:
            return None
        return {64: 64, 128: 64}.get(self.head_dim)

    def fwd_wgs_smem(self):
        """Q's two float16 pieces (128 rows) and two buffers of K's and V's (+ 1 KB
        alignment)."""
        return 2 * self.head_dim * (2 * 128 + 8 * self.fwd_wgs) + 1024

    @property
    def bwd_wgs(self):
        """float32 dK/dV kernel on float16 pieces with the wgmma: (query rows, keys); sm 90
        only, D = 64 and 128."""
        if self.sm < 90 or self.head_dim not in (64, 128):
            return None
        return (64, 64)

    def bwd_wgs_smem(self):
        """K's and V's two float16 pieces, buffers of Q's and dO's (one at D = 64, where
        two blocks share an SM; two at 128), P^T's and dS^T's pieces, as many buffers of
        lse and Delta, 8 floats of warp maxima (+ 1 KB alignment)."""
        bm, bn = self.bwd_wgs
        buffers = 1 if self.head_dim == 64 else 2
        return (2 * (self.head_dim * (4 * bn + 4 * buffers * bm) + 4 * bn * bm)
                + FLOAT_BYTES * (2 * buffers * bm + 8) + 1024)

    def fwd_wg_smem(self, shape=None, itemsize=2):
        """Shared memory of the wgmma forward of ``shape`` (default: ``fwd_wg``): Q, two
        buffers of K and V, a float a thread (ordering stores) and alignment to 1 KB."""
        bn, wg = shape or self.fwd_wg
        return itemsize * self.head_dim * (64 * wg + 4 * bn) + FLOAT_BYTES * 128 * wg + 1024

    def fwd_tc_threads(self):
        rows, _, m_tiles, _ = self.fwd_tc
        return 32 * rows // (16 * m_tiles)

    @property
    def bwd_tc(self):
        """Tensor-core dK/dV kernel: (query rows, keys); 16 keys per warp, the next query
        tile prefetched."""
        return {64: (64, 128), 128: (32, 128)}.get(self.head_dim)

    def bwd_tc_threads(self):
        return 2 * self.bwd_tc[1]

    @property
    def bwd_wgb(self):
        """Hopper wgmma dK/dV kernel: (query rows, keys); two warpgroups of 64 keys; sm 90
        only, D = 64 (128-row query tiles, dQ split by queries) and 128 (dK and dV of
        D = 256 do not fit in the registers)."""
        if self.sm < 90:
            return None
        return {64: (128, 128), 128: (64, 128)}.get(self.head_dim)

    @property
    def bwd_wgd(self):
        """The Hopper wgmma dK/dV kernel with head_dim split between its two warpgroups,
        S^T and dP^T split by query columns and P^T, dS^T exchanged through shared
        memory: (query rows, keys); sm 90 only, D = 256."""
        if self.sm < 90:
            return None
        return {256: (64, 64)}.get(self.head_dim)

    def bwd_wg_smem(self, family, itemsize=2):
        """Shared memory of wgmma dK/dV family ``family`` (wgb or wgd): K, V, two buffers
        of Q, dO, lse and Delta, dS^T (and P^T for wgd's exchange); + alignment to 1 KB."""
        bm, bn = getattr(self, f"bwd_{family}")
        exchanged = 2 if family == "wgd" else 1
        return (itemsize * (2 * (2 * bm + bn) * self.head_dim + exchanged * bn * bm)
                + FLOAT_BYTES * 2 * 2 * bm + 1024)

    @property
    def bwd_tcw(self):
        """Tensor-core dK/dV kernel with D split across 8 warps: (query rows, keys)."""
        return {64: (64, 64), 128: (64, 64), 256: (32, 64)}.get(self.head_dim)

    def bwd_tcw_smem(self, itemsize=2):
        bm, bn = self.bwd_tcw
        return itemsize * (2 * bn * self.head_dim + 4 * bm * self.head_dim + 2 * bn * bm) + \
            FLOAT_BYTES * 4 * bm

    @property
    def fwd_tc32(self):
        """float32 tensor-core forward: (query rows, keys); 16 rows per warp."""
        d = self.head_dim
        return (64, 64 if d <= 64 else 32 if d <= 128 else 16)

    def fwd_tc32_threads(self):
        return 2 * self.fwd_tc32[0]

    def fwd_tc32_smem(self):
        bm, bn = self.fwd_tc32
        return FLOAT_BYTES * (bm + 4 * bn) * self._pitch()

    @property
    def bwd_tc32(self):
        """float32 tensor-core dK/dV kernel: (query rows, keys), head_dim <= 128; 16 keys per warp."""
        d = self.head_dim
        if d > 128:
            return None
        return (64, 64) if d <= 64 else (32, 64)

    def bwd_tc32_threads(self):
        return 2 * self.bwd_tc32[1]

    def bwd_tc32_smem(self):
        bm, bn = self.bwd_tc32
        return FLOAT_BYTES * (2 * (bm + bn) * self._pitch() + bn * (bm + 4) + 2 * bm)

    def bwd_tc_smem(self, itemsize=2):
        """Shared memory of the tensor-core dK/dV kernel: K, V, two buffers of Q, dO, lse
        and Delta, dS^T."""
        bm, bn = self.bwd_tc
        return (itemsize * (2 * (2 * bm + bn) * self.head_dim + bn * bm)
                + FLOAT_BYTES * 2 * 2 * bm)

    def fast_fwd(self, kind):
        """(query rows, threads) of tensor-core forward family ``kind``: tc, wg, wgp, wgs,
        tc32 or tf32."""
        if kind == "tc":
            return self.fwd_tc[0], self.fwd_tc_threads()
        if kind in ("wg", "wgp"):
            warpgroups = (self.fwd_wgp if kind == "wgp" else self.fwd_wg)[1]
            return 64 * warpgroups, 128 * warpgroups
        if kind == "wgs":
            return 128, 256
        return self.fwd_tc32[0], self.fwd_tc32_threads()

    def fast_bwd(self, kind):
        """(keys, threads) of tensor-core dK/dV family ``kind``: wgb, wgd, wgs, tc, tcw,
        tc32 or tf32."""
        if kind in ("wgb", "wgd", "wgs"):
            return getattr(self, f"bwd_{kind}")[1], 256
        if kind == "tc":
            return self.bwd_tc[1], self.bwd_tc_threads()
        if kind == "tcw":
            return self.bwd_tcw[1], 256
        return self.bwd_tc32[1], self.bwd_tc32_threads()

    @property
    def dkdv(self):
        return (64, 32) if self.head_dim <= 128 else (32, 16)

    @property
    def dq(self):
        return self.fwd

    def _pitch(self):
        return self.head_dim + 4

    def fwd_smem(self):
        bm, bn = self.fwd
        return FLOAT_BYTES * (bm * self._pitch() + 2 * bn * self._pitch() + bm * (bn + 4))

    def fwd_tc_smem(self, itemsize=2):
        bm, bn = self.fwd_tc[:2]
        return itemsize * self.head_dim * (bm + 4 * bn)

    def dkdv_smem(self):
        bm, bn = self.dkdv
        return FLOAT_BYTES * (2 * (bm + bn) * self._pitch() + 2 * bm * (bn + 4) + 2 * bm)

    def dq_smem(self):
        bm, bn = self.dq
        return FLOAT_BYTES * (2 * (bm + bn) * self._pitch() + bm * (bn + 4) + 2 * bm)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled module: a storage dtype, a head_dim and a GPU generation."""

    dtype: np.dtype
    head_dim: int
    sm: int = 90  # 80: tiles for sm_80..sm_89; 90: sm_90 and newer

    @property
    def tiles(self):
        return Tiles(self.head_dim, self.sm)

    @property
    def has_tensor_cores(self):
        """Whether this variant has the tensor-core (mma.sync) kernels."""
        return (np.dtype(self.dtype) in TENSOR_CORE_DTYPES
                and self.head_dim in TENSOR_CORE_HEAD_DIMS)

    @functools.lru_cache(maxsize=None)  # noqa: B019 - a few dozen variants per process
    def kernel_names(self):
        """Kernel role -> C++ name expression to instantiate (one shared dict: do not modify)."""
        t, d, tiles = CXX_TYPES[np.dtype(self.dtype)], self.head_dim, self.tiles
        names = {
            "fwd": f"cuflash::attention_fwd_general<{t}, {d}, {tiles.fwd[0]}, {tiles.fwd[1]}>",
            "delta": f"cuflash::attention_bwd_delta<{t}, {d}>",
            "dkdv_atomic_dq": "cuflash::attention_bwd_dkdv<{}, {}, {}, {}, true>".format(
                t, d, *tiles.dkdv),
            "dkdv": "cuflash::attention_bwd_dkdv<{}, {}, {}, {}, false>".format(
                t, d, *tiles.dkdv),
            "dq": f"cuflash::attention_bwd_dq<{t}, {d}, {tiles.dq[0]}, {tiles.dq[1]}>",
        }
        if self.has_tensor_cores:
            bm, bn, m_tiles, q_regs = tiles.fwd_tc
            names["fwd_tc"] = (f"cuflash::attention_fwd_tc<{t}, {d}, {bm}, {bn}, {m_tiles}, "
                               f"{str(q_regs).lower()}>")
        for role, shape, pipeline in (("fwd_wg", tiles.fwd_wg, ""),
                                      ("fwd_wgp", tiles.fwd_wgp, ", true")):
            if self.has_tensor_cores and shape:
                names[role] = "cuflash::attention_fwd_wgmma<{}, {}, {}, {}{}>".format(
                    t, d, *shape, pipeline)
        if self.has_tensor_cores and tiles.bwd_tc:
            for role, atomic in (("dkdv_tc_atomic_dq", "true"), ("dkdv_tc", "false")):
                names[role] = "cuflash::attention_bwd_dkdv_tc<{}, {}, {}, {}, {}>".format(
                    t, d, *tiles.bwd_tc, atomic)
        for family, shape in (("wgb", tiles.bwd_wgb), ("wgd", tiles.bwd_wgd)):
            if self.has_tensor_cores and shape:
                for suffix, atomic in (("_atomic_dq", "true"), ("", "false")):
                    names[f"dkdv_{family}{suffix}"] = (
                        "cuflash::attention_bwd_dkdv_wgmma<{}, {}, {}, {}>".format(
                            t, d, shape[0], atomic))
        if self.has_tensor_cores and tiles.bwd_tcw:
            for role, atomic in (("dkdv_tcw_atomic_dq", "true"), ("dkdv_tcw", "false")):
                names[role] = "cuflash::attention_bwd_dkdv_tc_wide<{}, {}, {}, {}, {}>".format(
                    t, d, *tiles.bwd_tcw, atomic)
        if np.dtype(self.dtype) == np.float32 and tiles.fwd_wgs:  # float16 pieces, wgmma
            names["abs_max"] = f"cuflash::attention_abs_max<{d}>"
            names["split_f16"] = f"cuflash::attention_split_f16<{d}>"
            names["fwd_wgs"] = f"cuflash::attention_fwd_split<{d}, {tiles.fwd_wgs}>"
            for suffix, atomic in (("_atomic_dq", "true"), ("", "false")):
                names[f"dkdv_wgs{suffix}"] = f"cuflash::attention_bwd_split<{d}, {atomic}>"
        if np.dtype(self.dtype) == np.float32:  # TF32 tensor cores: 3 passes or 1
            for precision, passes in FLOAT32_PRECISIONS.items():
                names[f"fwd_{precision}"] = "cuflash::attention_fwd_tc32<{}, {}, {}, {}>".format(
                    d, *tiles.fwd_tc32, passes)
                if tiles.bwd_tc32:
                    for suffix, atomic in (("_atomic_dq", "true"), ("", "false")):
                        names[f"dkdv_{precision}{suffix}"] = (
                            "cuflash::attention_bwd_dkdv_tc32<{}, {}, {}, {}, {}>".format(
                                d, *tiles.bwd_tc32, atomic, passes))
        return names


def all_variants(sm=90):
    """Every (dtype, head_dim) the library can compile, with the tiles of ``sm``."""
    return [Variant(dt, d, sm) for dt in CXX_TYPES for d in HEAD_DIMS]


def generation(compute_capability):
    """The tile generation (80 or 90) for a device's compute capability, e.g. 90."""
    return 90 if compute_capability >= 90 else 80


class _LoadedVariant:
    """The kernels of one variant on one device, each compiled on first use.

    Each kernel role is its own ``RawModule`` (the role is a ``-D`` option,
    so CuPy's cache key tells them apart): a first forward call compiles the
    forward kernel only, not the backward ones.
    """

    def __init__(self, variant):
        self.variant = variant
        self.names = variant.kernel_names()
        tiles = variant.tiles
        smem = {"fwd": tiles.fwd_smem(), "delta": 0, "dkdv_atomic_dq": tiles.dkdv_smem(),
                "dkdv": tiles.dkdv_smem(), "dq": tiles.dq_smem()}
        if "fwd_tc" in self.names:
            smem["fwd_tc"] = tiles.fwd_tc_smem()
        if "fwd_wg" in self.names:
            smem["fwd_wg"] = tiles.fwd_wg_smem()
        if "fwd_wgp" in self.names:
            smem["fwd_wgp"] = tiles.fwd_wg_smem(tiles.fwd_wgp)
        if "dkdv_tc" in self.names:
            smem["dkdv_tc_atomic_dq"] = smem["dkdv_tc"] = tiles.bwd_tc_smem()
        if "fwd_wgs" in self.names:
            smem.update(fwd_wgs=tiles.fwd_wgs_smem(), abs_max=0, split_f16=0)
            smem["dkdv_wgs"] = smem["dkdv_wgs_atomic_dq"] = tiles.bwd_wgs_smem()
        for family in ("wgb", "wgd"):
            if f"dkdv_{family}" in self.names:
                smem[f"dkdv_{family}_atomic_dq"] = smem[f"dkdv_{family}"] = (
                    tiles.bwd_wg_smem(family))
        if "dkdv_tcw" in self.names:
            smem["dkdv_tcw_atomic_dq"] = smem["dkdv_tcw"] = tiles.bwd_tcw_smem()
        for precision in FLOAT32_PRECISIONS:
            if f"fwd_{precision}" in self.names:
                smem[f"fwd_{precision}"] = tiles.fwd_tc32_smem()
            if f"dkdv_{precision}" in self.names:
                smem[f"dkdv_{precision}"] = smem[f"dkdv_{precision}_atomic_dq"] = \
                    tiles.bwd_tc32_smem()
        self.smem = smem
        self._kernels = {}
        self._lock = threading.Lock()

    def kernel(self, role):
        """The ``cupy.RawKernel`` of ``role``, compiled (or loaded from cache) once."""
        with self._lock:
            found = self._kernels.get(role)
            if found is None:
                import cupy

                name = self.names[role]
                options = COMPILE_OPTIONS + (f"-DCUFLASH_ROLE_{role}",)
                if role in ARCH_SPECIFIC_ROLES:  # CuPy adds -arch=sm_90; NVRTC keeps sm_90a
                    options += (f"-arch={ARCH_SPECIFIC_ROLES[role]}",)
                module = cupy.RawModule(code=module_source(), options=options,
                                        name_expressions=[name])
                found = module.get_function(name)
                if self.smem[role] > 48 * 1024:
                    found.max_dynamic_shared_size_bytes = self.smem[role]
                self._kernels[role] = found
            return found


_MODULES = {}
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
            env = dict(os.environ, PATH=os.pathsep.join(
                [os.path.dirname(tool), os.environ.get("PATH", "")]))
            done = subprocess.run([tool, "-sass", path], capture_output=True, text=True,
                                  env=env)
        if done.returncode or "Function :" not in done.stdout:
            raise RuntimeError(f"cuobjdump could not read the cubin: {done.stderr.strip()}")
        by_name, current = {}, None
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
        """Per kernel role: registers, stack frame, spill stores and loads."""
        info, current = {}, None
        for line in self.log.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                current = m.group(1)
                info[current] = {}
                continue
            if current is None:
                continue
            m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
            if m:
                info[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                     spill_loads=int(m.group(3)))
            m = re.search(r"Used (\d+) registers", line)
            if m:
                info[current]["registers"] = int(m.group(1))
        return {role: info[name] for role, name in self.lowered_names.items()}


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


def compile_offline(variant, arch):
    """Compile ``variant`` for ``arch`` (e.g. ``"sm_90a"``) without a GPU."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(module_source(), MODULE_FILE, (), ())
    try:
        for name in variant.kernel_names().values():
            nvrtc.addNameExpression(prog, name)
        options = COMPILE_OPTIONS + (f"-arch={arch}", "-Xptxas=-v")
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"{variant} for {arch} failed:\n{nvrtc.getProgramLog(prog)}") from exc
        lowered = {role: nvrtc.getLoweredName(prog, name)
                   for role, name in variant.kernel_names().items()}
        return CompileReport(variant, arch, nvrtc.getProgramLog(prog),
                             _complete_elf(nvrtc.getCUBIN(prog)), lowered)
    finally:
        nvrtc.destroyProgram(prog)


_SINGLE_KERNELS = {}


def load_kernel(source_file, name_expression, shared_bytes=0, arch=None):
    """A kernel of another ``.cu`` file of ``kernels/`` (local includes inlined), compiled
    through NVRTC once per (device, source, name, arch) and cached: the loader for kernels
    outside the per-(dtype, head_dim) variants. ``arch`` (e.g. ``"sm_90a"``) for kernels
    that need an arch-specific target; ``shared_bytes`` above 48 KB raises the kernel's
    dynamic shared-memory limit."""
    import cupy

    device = cupy.cuda.Device()
    key = (device.id, source_file, name_expression, arch, shared_bytes)
    with _MODULES_LOCK:
        found = _SINGLE_KERNELS.get(key)
        if found is None:
            options = COMPILE_OPTIONS + ((f"-arch={arch}",) if arch else ())
            module = cupy.RawModule(code=module_source(source_file), options=options,
                                    name_expressions=[name_expression])
            found = module.get_function(name_expression)
            if shared_bytes > 48 * 1024:
                found.max_dynamic_shared_size_bytes = shared_bytes
            _SINGLE_KERNELS[key] = found
    return found


def compile_source_offline(source_file, name_expressions, arch):
    """Compile ``name_expressions`` of ``kernels/source_file`` for ``arch`` without a GPU:
    ``(log, cubin, lowered names)``, for the compile tests of kernels outside the variants."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(module_source(source_file), source_file, (), ())
    try:
        for name in name_expressions:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, COMPILE_OPTIONS + (f"-arch={arch}", "-Xptxas=-v"))
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"{source_file} for {arch} failed:\n"
                               f"{nvrtc.getProgramLog(prog)}") from exc
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in name_expressions}
        return nvrtc.getProgramLog(prog), _complete_elf(nvrtc.getCUBIN(prog)), lowered
    finally:
        nvrtc.destroyProgram(prog)
