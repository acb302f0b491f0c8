"""cuflash's kernels run on the CPU, for tests without a GPU.

The kernels' own source (``cuflash/kernels``) is compiled by the host's C++
compiler against ``runtime.h``, a CUDA runtime of fibers (one a CUDA thread,
a block at a time) whose barriers and warp-collective instructions follow PTX's
definitions lane by lane: shuffles, ``ldmatrix``, ``movmatrix``, ``mma.sync``, and
``wgmma`` on its warpgroup through its shared-memory descriptors, and the
``mbarrier`` phases of the warp-specialized kernels. Each ``asm``
statement is rewritten into a call of the simulator's version of its instruction;
the rest of the source compiles as it is. A launch takes the arguments as
``cuLaunchKernel`` does: one parameter buffer (a ``cuflash.gpu.kernel_params.Params``
record), or NumPy arrays and scalars one a parameter.

>>> module = build(["cuflash::backward_delta<float, 64>"])   # doctest: +SKIP
>>> module.launch(name, grid, threads, shared_bytes, args)         # doctest: +SKIP

What it checks: indexing, fragment layouts, masking, the order of copies and
waits (a tile read before its cp.async group completes reads NaN poison),
barriers that never meet and mbarrier phases that never complete (a deadlock is
an error), and with ``guard`` any access
outside an argument's memory (a fault is an error). What it does not: speed, races
between threads (the fibers run in a fixed order), the hardware's rounding inside a
matrix instruction (products are summed in float64 here), a read of a ``wgmma``
accumulator before its wait (``wgmma`` runs when it is issued).
"""

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # NumPy 1
    byte_bounds = np.byte_bounds

from cuflash.gpu import kernel_build, kernel_params

KERNEL_DIR = kernel_build.KERNEL_DIR  # the kernels of the cuflash whose registry runs them
RUNTIME = Path(__file__).resolve().parent / "runtime.h"
CACHE_DIR = Path(os.environ.get("CUFLASH_SIM_CACHE", Path(tempfile.gettempdir()) / "cuflash-sim"))
COMPILER_FLAGS = ("-std=c++17", "-O1", "-shared", "-fPIC", "-w")


def _bytes_at(address, size):
    """The ``size`` bytes at ``address`` as a writable uint8 array (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * max(1, size)).from_address(address))[:size]


TENSOR_MAP_MAGIC = 0x7E450A9  # runtime.h's kTensorMapMagic
_TENSOR_MAP = np.dtype(
    [
        ("base", "<u8"),
        ("dims", "<u8", 4),
        ("strides", "<u8", 4),
        ("box", "<u4", 4),
        ("swizzle128", "<u4"),
        ("magic", "<u4"),
    ]
)


def encode_tensor_map(tile_map, destination, address):
    """The simulator's encoding (runtime.h's ``SimTensorMap``) of a
    :class:`cuflash.gpu.tensor_maps.TileMap` for the array at ``address``, written into
    the 128 bytes at ``destination``: what the driver's encoding is on a GPU (the
    ``encode`` of :func:`cuflash.gpu.kernel_params.forward_maps`)."""
    record = np.zeros(1, _TENSOR_MAP)
    record["base"] = address
    record["dims"] = tile_map.dims
    record["strides"] = tile_map.strides
    record["box"] = tile_map.box
    record["swizzle128"] = 1
    record["magic"] = TENSOR_MAP_MAGIC
    ctypes.memmove(destination, record.ctypes.data, record.itemsize)


class SimulationError(RuntimeError):
    """A simulated launch failed: a deadlock, a shared-memory address outside the block's,
    an instruction the simulator does not model."""


def compiler():
    """The host C++ compiler (``CXX`` or ``g++``), or None."""
    return shutil.which(os.environ.get("CXX", "g++"))


# ------------------------------------------------------------------- the source


def inlined(headers, kernel_dir=KERNEL_DIR):
    """The kernel headers ``headers`` (paths from ``kernel_dir``, by default
    ``cuflash/kernels``) with their local includes inlined once each, as the library's
    modules are (``cuflash.gpu.kernel_build.inlined_source``)."""
    root, seen = Path(kernel_dir), set()
    return "\n".join(kernel_build.inlined_source(root / h, seen, root) for h in headers) + "\n"


def kernels_with(directory, header, old, new):
    """A copy of :data:`KERNEL_DIR` in ``directory`` with the first ``old`` of ``header``
    (a path from it) replaced by ``new`` (for tests of what the simulator catches);
    ``directory``, to put in :data:`KERNEL_DIR`'s place."""
    source = (KERNEL_DIR / header).read_text()
    broken = source.replace(old, new, 1)
    if broken == source:
        raise ValueError(f"{header} does not hold {old!r}")
    shutil.copytree(KERNEL_DIR, directory)
    (Path(directory) / header).write_text(broken)
    return Path(directory)


def _unquoted(text, start=0):
    """``(index, character, depth)`` of each character of ``text`` from ``start`` that lies
    outside string literals, with the brackets open around it (from ``start``)."""
    depth, i, quoted = 0, start, False
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        else:
            depth -= c in ")]}"
            yield i, c, depth
            depth += c in "([{"
        i += 1


def _split_top_level(text, separator):
    """``text`` split at ``separator`` outside string literals and brackets."""
    parts, start = [], 0
    for i, c, depth in _unquoted(text):
        if c == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _operands(text):
    """``"constraint"(expression)`` operands: a list of (constraint, expression)."""
    found = []
    for part in _split_top_level(text, ","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r'"([^"]*)"\s*\((.*)\)', part, re.S)
        if m is None:
            raise ValueError(f"an asm operand the simulator cannot read: {part!r}")
        found.append((m.group(1), m.group(2).strip()))
    return found


# instruction text -> simulator function; the arguments are the outputs, then the inputs
_INSTRUCTIONS = (
    ("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "ldmatrix_x4_trans"),
    ("ldmatrix.sync.aligned.m8n8.x4.shared.b16", "ldmatrix_x4"),
    ("movmatrix.sync.aligned.m8n8.trans.b16", "movmatrix_trans"),
    ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "mma_bf16"),
    ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "mma_f16"),
    ("cvt.rn.bf16x2.f32", "cvt_rn_bf16x2_f32"),
    ("cvt.rn.satfinite.e4m3x2.f32", "cvt_rn_satfinite_e4m3x2_f32"),
    ("cvt.rn.f16x2.f32", "cvt_rn_f16x2_f32"),
    ("cvt.rn.f16.f32", "cvt_rn_f16_f32"),
    ("cvt.f32.f16", "cvt_f32_f16"),
    ("ex2.approx.ftz.f32", "ex2_approx_ftz_f32"),
    ("tanh.approx.f32", "tanh_approx_f32"),
    ("ld.shared.v2.f32", "ld_shared_v2_f32"),
    ("prmt.b32", "prmt_b32"),
    ("ld.acquire.gpu.global.b32", "ld_acquire_gpu_b32"),
    ("red.release.gpu.global.add.s32", "red_release_add_one"),
    ("st.shared.f32", "st_shared_f32"),
    ("cp.async.commit_group", "cp_async_commit_group"),
    ("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32", "bulk_reduce_add_f32"),
    ("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile", "bulk_tensor_reduce_add_4d"),
    ("cp.async.bulk.commit_group", "bulk_commit_group"),
    ("cp.async.bulk.wait_group", "bulk_wait_group"),  # .read too: both read the source
    ("cp.async.wait_group", "cp_async_wait_group"),
    ("cp.async.mbarrier.arrive.noinc.shared", "cp_async_mbarrier_arrive"),
    ("mbarrier.arrive.expect_tx.shared", "mbarrier_arrive_expect_tx"),
    ("cp.async.bulk.tensor.4d.shared::cluster.global", "tma_load_4d"),
    ("mbarrier.init.shared", "mbarrier_init"),
    ("mbarrier.try_wait.parity.shared", "mbarrier_wait"),
    ("mbarrier.arrive.shared", "mbarrier_arrive"),
)


# setmaxnreg moves registers between warpgroups: nothing to model.
_NO_OPS = (
    "wgmma.fence",
    "wgmma.commit_group",
    "wgmma.wait_group",
    "fence.proxy.async",
    "setmaxnreg",
)


def _wgmma(template, outputs, inputs):
    """The simulator call of one ``wgmma.mma_async`` (see ``sim::wgmma``, and
    ``sim::wgmma_e4m3`` for FP8)."""
    a_registers = len(inputs) == 6  # four A registers, B's descriptor, the flag
    accumulators = ", ".join(f"&({e})" for _, e in outputs)
    if a_registers:
        a_regs, a_desc = "{" + ", ".join(e for _, e in inputs[:4]) + "}", "0ull"
    else:
        a_regs, a_desc = "{0u, 0u, 0u, 0u}", inputs[0][1]
    b_desc, accumulate = inputs[-2][1], inputs[-1][1]
    fp8 = re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3", template)
    if fp8:
        return (
            f"{{ float* const sim_d[] = {{{accumulators}}}; const unsigned sim_a[4] = {a_regs}; "
            f"::sim::wgmma_e4m3<{fp8.group(1)}, {str(a_registers).lower()}>"
            f"(sim_d, sim_a, {a_desc}, {b_desc}, ({accumulate}) != 0); }}"
        )
    m = re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.(bf16|f16)", template)
    n, bf16 = int(m.group(1)), m.group(2) == "bf16"
    flags = re.search(r"p,\s*1,\s*1((?:,\s*\d)*);", template).group(1)
    transposes = [int(x) for x in re.findall(r"\d", flags)]
    trans_a, trans_b = (0, transposes[0]) if a_registers else transposes
    return (
        f"{{ float* const sim_d[] = {{{accumulators}}}; const unsigned sim_a[4] = {a_regs}; "
        f"::sim::wgmma<{n}, {str(bf16).lower()}, {str(a_registers).lower()}, "
        f"{str(bool(trans_a)).lower()}, {str(bool(trans_b)).lower()}>"
        f"(sim_d, sim_a, {a_desc}, {b_desc}, ({accumulate}) != 0); }}"
    )


def _translate(body):
    """The simulator call for the body of one ``asm(...)`` statement."""
    sections = _split_top_level(body, ":")
    template = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', sections[0]))
    outputs = _operands(sections[1]) if len(sections) > 1 else []
    inputs = _operands(sections[2]) if len(sections) > 2 else []
    args = [e for _, e in outputs] + [e for _, e in inputs]
    if not template.strip() or any(op in template for op in _NO_OPS):
        return "(void)0"  # a register pin, or what runs in order here anyway
    if "wgmma.mma_async" in template:
        return _wgmma(template, outputs, inputs)
    if "cvt.rn.f16x2.e4m3x2" in template:  # mov.b32 {l, h}, x; two cvt (e4m3x4_to_f16x2)
        return f"::sim::e4m3x4_to_f16x2({', '.join(args)})"
    if re.search(r"mov\.b32\s*\{\s*\w+,\s*\w+\s*\}", template) and "cvt.f32.f16" in template:
        return f"::sim::unpack_f16x2_f32({', '.join(args)})"
    if "%%dynamic_smem_size" in template:
        return f"::sim::mov_dynamic_smem_size({args[0]})"
    if "red.global.add.v2.f32" in template:  # setp.ne p, %3, 0; @p red [%0], {%1, %2}
        return f"::sim::red_global_add_v2_f32({args[0]}, {args[1]}, {args[2]}, ({args[3]}) != 0)"
    m = re.search(r"(?:bar|barrier)\.(sync|arrive)\s+%0,\s*(\d+|%1)", template)
    if m:
        count = args[1] if m.group(2) == "%1" else m.group(2)
        return f"::sim::bar_{m.group(1)}({args[0]}, {count})"
    if "cp.async.ca.shared.global" in template and "ignore" in template:
        # setp.eq.u32 ignore, %2, 0; cp.async.ca [%0], [%1], BYTES, ignore
        size = re.search(r"\],\s*(\d+),\s*ignore", template).group(1)
        return f"::sim::cp_async_ignore_src({args[0]}, {args[1]}, {size}, ({args[2]}) == 0)"
    if "cp.async.cg.shared.global" in template:
        size = re.search(r"\],\s*(\d+),", template).group(1)
        return f"::sim::cp_async({args[0]}, {args[1]}, {size}, {args[2]})"
    for instruction, function in _INSTRUCTIONS:
        if instruction in template:
            return f"::sim::{function}({', '.join(args)})"
    # Not modelled: an error if a launch reaches it (it may sit in a branch for
    # another architecture).
    text = template.strip().splitlines()[0] if template.strip() else "asm"
    return f'::sim::unsupported("{text.replace(chr(92), "").replace(chr(34), "")}")'


_ASM = re.compile(r"\basm\s*(?:volatile\s*)?\(")


def rewrite(source):
    """``source`` with each asm statement a simulator call and each ``extern __shared__``
    array the block's dynamic shared memory (a static ``__shared__`` one is a function's
    static: the fibers of one block share it, and blocks run one at a time)."""
    out, pos = [], 0
    for m in _ASM.finditer(source):
        if m.start() < pos:
            continue
        # the statement's closing parenthesis: the first ")" that closes more than it opened
        end = next(i for i, c, depth in _unquoted(source, m.end()) if depth < 0)
        out += [source[pos : m.start()], _translate(source[m.end() : end])]
        pos = end + 1
    out.append(source[pos:])
    text = "".join(out)
    return re.sub(
        r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?(\w+(?:\s+\w+)*?)\s+(\w+)\s*"
        r"\[\s*\]\s*;",
        r"\1* \2 = static_cast<\1*>(::sim::dynamic_shared());",
        text,
    )


# ---------------------------------------------------------------------- modules


class Module:
    """The compiled kernels of :func:`build`: ``launch(name, grid, threads, shared_bytes,
    args)`` runs the kernel ``name`` (one of its name expressions)."""

    def __init__(self, library_path, names):
        self._library = ctypes.CDLL(str(library_path))
        self._library.sim_failure.restype = ctypes.c_char_p
        self._library.sim_fault_address.restype = ctypes.c_ulonglong
        self._library.sim_guarded_alloc.restype = ctypes.c_void_p
        self._library.sim_guarded_alloc.argtypes = [ctypes.c_ulonglong]
        self._library.sim_guarded_free.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
        self._entries, self._buffer_entries = {}, {}
        for i, name in enumerate(names):
            entry = getattr(self._library, f"sim_kernel_{i}")
            entry.restype = ctypes.c_int
            entry.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_ulonglong, ctypes.c_void_p]
            self._entries[name] = entry
            entry = getattr(self._library, f"sim_kernel_buffer_{i}")
            entry.restype = ctypes.c_int
            entry.argtypes = (
                [ctypes.c_uint] * 4
                + [ctypes.c_ulonglong]
                + [
                    ctypes.c_void_p,
                    ctypes.c_ulonglong,
                ]
            )
            self._buffer_entries[name] = entry

    def launch(self, name, grid, threads, shared_bytes, args, guard=False):
        """Run kernel ``name`` on ``grid`` (up to 3 dims) of blocks of ``threads``.

        ``args``: a kernel parameter record with its call's arrays, ``(params, arrays)``
        (a ``cuflash.gpu.kernel_params.Params`` and its ``per_call`` members' arrays, or None,
        or an int for an int member, in order), passed as the kernel's parameter
        buffer as ``cuflash.gpu.kernel_launch.Launch`` passes it (a buffer laid out for other
        parameters than the kernel's is an error); or the arguments in the kernel's
        order: NumPy arrays (their address; the caller keeps them alive), None (a null
        pointer), NumPy scalars (their bytes, so their type must be the parameter's),
        one-element structured arrays (a record passed by value). With ``guard``, each
        array is copied into memory between inaccessible pages for the launch (and the
        bytes the launch changed back after it, so that arguments that share memory,
        such as absorbed MLA's ``v_cache`` view of ``k_cache``, keep each other's
        writes): a read or write past its end, or far before its start, raises
        SimulationError naming the argument.
        """
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        if min(grid) <= 0:
            return
        storage, pointers, guarded = [], (ctypes.c_void_p * max(1, len(args)))(), []

        def address_of(a, name):
            """``a``'s address for the kernel (its guarded copy's with ``guard``)."""
            if a is None:
                return 0
            address = a.ctypes.data
            if guard:
                low, high = byte_bounds(a)  # the memory a view spans
                copy = self._library.sim_guarded_alloc(max(1, high - low))
                ctypes.memmove(copy, low, high - low)
                guarded.append((name, low, high, copy, _bytes_at(low, high - low).copy()))
                address = copy + (address - low)
            return address

        if len(args) == 2 and isinstance(args[0], kernel_params.Params):  # the call's buffer
            params, arrays = args
            if len(arrays) != len(params.per_call):
                raise TypeError(f"{params.name}: {len(arrays)} arrays for {params.per_call}")
            params.pack(  # an int (a length) as it is
                *(
                    x if isinstance(x, int) else address_of(x, f"{params.name}.{m}")
                    for x, m in zip(arrays, params.per_call)
                )
            )
            buffer = params.record.copy()
            storage.append(buffer)
            entry, tail = self._buffer_entries[name], (buffer.ctypes.data, params.size)
            args = ()
        else:
            entry, tail = self._entries[name], (pointers,)
        for i, a in enumerate(args):
            if a is None or (isinstance(a, np.ndarray) and a.dtype.names is None):
                cell = np.array([address_of(a, f"argument {i}")], dtype=np.uint64)
            elif isinstance(a, np.ndarray):  # a record by value
                cell = a
            elif isinstance(a, np.generic):
                cell = np.array([a])
            else:
                raise TypeError(f"argument {i}: a NumPy array, scalar or record, got {type(a)}")
            storage.append(cell)
            pointers[i] = cell.ctypes.data
        try:
            status = entry(*grid, int(threads), int(shared_bytes), *tail)
            for _, low, high, copy, snapshot in guarded:  # the bytes it changed come back
                after = _bytes_at(copy, high - low)
                changed = np.flatnonzero(after != snapshot)
                _bytes_at(low, high - low)[changed] = after[changed]
        finally:
            for _, low, high, copy, _ in guarded:
                self._library.sim_guarded_free(copy, max(1, high - low))
        if status == 2:
            fault = self._library.sim_fault_address()
            near = [
                i
                for i, low, high, copy, _ in guarded
                if copy - 4096 <= fault < copy + (high - low) + 4096
            ]
            where = f"{near[0]}'s guard page" if near else "memory of no argument"
            raise SimulationError(f"{name}: an access at {fault:#x} faulted ({where})")
        if status:
            raise SimulationError(f"{name}: {self._library.sim_failure().decode()}")


def translation_unit(names, headers, kernel_dir=KERNEL_DIR, prefix=""):
    """The C++ of a module holding kernels ``names`` from kernel ``headers`` (of
    ``kernel_dir``), after ``prefix`` (the user's modifier functors)."""
    lines = [f'#include "{RUNTIME}"', rewrite(prefix + inlined(headers, kernel_dir))]
    for i, name in enumerate(names):
        lines.append(
            f'extern "C" int sim_kernel_{i}(unsigned gx, unsigned gy, unsigned gz, '
            f"unsigned threads, unsigned long long shared_bytes, void** params) {{\n"
            f"    return ::sim::launch(&{name}, dim3{{gx, gy, gz}}, "
            f"dim3{{threads, 1, 1}}, shared_bytes, params);\n}}\n"
            f'extern "C" int sim_kernel_buffer_{i}(unsigned gx, unsigned gy, unsigned gz, '
            f"unsigned threads, unsigned long long shared_bytes, const void* buffer, "
            f"unsigned long long size) {{\n"
            f"    return ::sim::launch_buffer(&{name}, dim3{{gx, gy, gz}}, "
            f"dim3{{threads, 1, 1}}, shared_bytes, buffer, size);\n}}"
        )
    lines += [
        'extern "C" const char* sim_failure() { return ::sim::failure; }',
        'extern "C" unsigned long long sim_fault_address() { return ::sim::fault_address; }',
        'extern "C" void* sim_guarded_alloc(unsigned long long bytes) '
        "{ return ::sim::guarded_alloc(bytes); }",
        'extern "C" void sim_guarded_free(void* p, unsigned long long bytes) '
        "{ ::sim::guarded_free(p, bytes); }",
    ]
    return "\n".join(lines) + "\n"


def _defines(options):
    """``-DNAME=VALUE`` / ``-DNAME`` compiler options as #define lines."""
    lines = []
    for option in options:
        name, _, value = option[2:].partition("=")
        lines.append(f"#define {name} {value}".rstrip())
    return "\n".join(lines)


@functools.cache
def _built(names, headers, kernel_dir, arch, functors):
    defines = f"#define __CUDA_ARCH__ {arch}0\n"
    prefix = ""
    if functors is not None:  # the user's modifier functors, as kernel_build compiles them
        defines += _defines(functors.options) + "\n"
        prefix = functors.prefix
    source = defines + translation_unit(list(names), headers, kernel_dir, prefix)
    digest = hashlib.sha256((source + RUNTIME.read_text() + " ".join(COMPILER_FLAGS)).encode())
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    library = CACHE_DIR / f"kernels-{digest.hexdigest()[:20]}.so"
    if not library.exists():
        with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
            cpp = Path(tmp) / "kernels.cpp"
            cpp.write_text(source)
            built = Path(tmp) / "kernels.so"
            done = subprocess.run(
                [compiler(), *COMPILER_FLAGS, "-o", str(built), str(cpp)],
                capture_output=True,
                text=True,
            )
            if done.returncode:
                raise RuntimeError(f"the simulated kernels do not compile:\n{done.stderr[-6000:]}")
            os.replace(built, library)  # atomic: parallel test workers may build it too
    return Module(library, list(names))


HEADERS = (
    "simt/forward_general.cuh",
    "simt/backward_delta.cuh",
    "simt/backward_dq_convert.cuh",
    "simt/packed_zero_outside.cuh",
    "simt/backward_general.cuh",
    "simt/backward_dq_general.cuh",
    "sm80/forward_mma_sync.cuh",
    "sm80/backward_mma_sync.cuh",
    "sm80/backward_mma_sync_split_d.cuh",
    "sm80/backward_dq_mma_sync.cuh",
    "sm90/forward_wgmma.cuh",
    "sm90/forward_wgmma_ws.cuh",
    "sm90/backward_wgmma.cuh",
    "sm90/backward_wgmma_ws.cuh",
    "sm90/backward_dq_wgmma.cuh",
    "simt/float16_pieces_abs_max.cuh",
    "simt/float16_pieces_split.cuh",
    "sm90/forward_float32_pieces.cuh",
    "sm90/forward_float32_pieces_wide.cuh",
    "sm90/backward_float32_pieces.cuh",
    "sm90/backward_float32_pieces_wide.cuh",
    "sm90/backward_dq_float32_pieces_wide.cuh",
)


def build(names, headers=HEADERS, arch=80, functors=None):
    """The simulated kernels ``names`` (C++ name expressions, as the registry writes
    them) of ``headers`` in :data:`KERNEL_DIR`, with ``__CUDA_ARCH__`` of compute
    capability ``arch`` (80 or 90) and the user's modifier ``functors``
    (``cuflash.gpu.kernel_build.UserFunctors``, or None), compiled once per process and cached
    on disk by their source."""
    return _built(tuple(names), tuple(headers), KERNEL_DIR, int(arch), functors)
