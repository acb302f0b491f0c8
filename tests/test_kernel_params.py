"""The host's records of the kernels' parameter lists (``cuflash.gpu.kernel_params``)
against the C++ compiler's layout of ``kernels/common/params.cuh``: NVRTC compiles one
``static_assert`` an offset of each list's struct, and a kernel declared with each list
to PTX, whose parameters (their sizes and alignments: the parameter buffer's rule) must
fall where the host's record puts them, so a member the two sides place differently
fails here, without a GPU, instead of reading wrong values in a kernel."""

import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from cuflash.gpu import decode_params, kernel_build, kernel_params


def _layout_asserts(name):
    dtype = kernel_params.layout(name)
    lines = [f'static_assert(sizeof({name}) == {dtype.itemsize}, "{name}: size");']
    for member, (_, offset) in dtype.fields.items():
        lines.append(
            f'static_assert(__builtin_offsetof({name}, {member}) == {offset}, "{name}.{member}");'
        )
    return lines


def _compile(source, ptx=False):
    """NVRTC's log of ``source`` if it does not compile, else None (or with ``ptx`` its
    PTX)."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source, "params_layout.cu", (), ())
    try:
        nvrtc.compileProgram(prog, kernel_build.COMPILE_OPTIONS + ("-arch=sm_80",))
        if ptx:
            text = nvrtc.getPTX(prog)
            return text.decode() if isinstance(text, bytes) else text
    except nvrtc.NVRTCError:
        return nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return None


def _source(asserts):
    header = kernel_build.inlined_source(kernel_params.PARAMS_HEADER, set())
    body = "\n".join(asserts)
    return f"{header}\nnamespace cuflash {{\n{body}\n}}\n"


STRUCTS = sorted(kernel_params.members())


def test_the_lists_are_the_kernels_kinds():
    assert STRUCTS == [
        "BackwardDeltaParams",
        "BackwardDqParams",
        "BackwardParams",
        "DecodeParams",
        "DqConvertParams",
        "ForwardParams",
        "Fp8TransposeVParams",
        "KvcacheAppendParams",
        "KvcacheCombineParams",
        "PiecesAbsMaxParams",
        "PiecesSplitParams",
        "ZeroOutsideParams",
    ]


@pytest.mark.parametrize("name", STRUCTS)
def test_host_layout_is_the_compilers(name):
    log = _compile(_source(_layout_asserts(name)))
    assert log is None, log


@pytest.mark.parametrize(
    "name, member", [("ForwardParams", "scale_log2"), ("BackwardParams", "dkv_st")]
)
def test_a_misplaced_member_fails_the_check(name, member):
    asserts = _layout_asserts(name)
    wrong = [
        a.replace(") == ", ") == 4 + ", 1) if f'"{name}.{member}"' in a else a for a in asserts
    ]
    log = _compile(_source(wrong))
    assert log is not None and f"{name}.{member}" in log


# The host's record flattened into the kernel's parameters: (offset, bytes) of each.
_PARAMETERS = {"Strides": ((0, 8), (8, 8), (16, 8))}  # three long long


def _host_parameters(dtype):
    found = []
    for member in dtype.names:
        fmt, offset = dtype.fields[member][:2]
        kind = "Strides" if fmt == kernel_params.STRIDES_DTYPE else None
        for at, size in _PARAMETERS.get(kind, ((0, fmt.itemsize),)):
            found.append((offset + at, size))
    return found


def _probe_source(name):
    """A kernel declared with ``name``'s list (every type parameter half_t)."""
    text = kernel_params.PARAMS_HEADER.read_text()
    macro, args = re.search(rf"struct {name} \{{\s*(\w+)\(CUFLASH_MEMBER, ([^)]*)\)", text).groups()
    types = ", ".join("half_t" for _ in args.split(","))
    return _source([f'extern "C" __global__ void probe(CUFLASH_PARAMETERS({macro}, {types})) {{}}'])


def _kernel_parameters(name, arch):
    """(offset, bytes) of each parameter of a kernel declared with ``name``'s list,
    compiled for ``arch``, and where its parameters begin in the constant bank and how
    many bytes they take: the cubin's own record (``cuobjdump -elf``:
    ``EIATTR_KPARAM_INFO``, ``EIATTR_PARAM_CBANK``), which the driver follows when it
    copies a parameter buffer."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(_probe_source(name), "params_probe.cu", (), ())
    try:
        nvrtc.compileProgram(prog, kernel_build.COMPILE_OPTIONS + (f"-arch={arch}",))
        cubin = kernel_build._complete_elf(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.cubin"
        path.write_bytes(cubin)
        elf = subprocess.run(
            [kernel_build.find_cuobjdump(), "-elf", str(path)], capture_output=True, text=True
        ).stdout
    found = sorted(
        (int(ordinal, 16), int(offset, 16), int(size, 16))
        for ordinal, offset, size in re.findall(
            r"Ordinal : (0x[0-9a-f]+)\s+Offset\s+: (0x[0-9a-f]+)\s+Size\s+: (0x[0-9a-f]+)", elf
        )
    )
    bank = re.search(r"EIATTR_PARAM_CBANK\s+Format:\s+\S+\s+Value:\s+\S+\s+(0x[0-9a-f]+)", elf)
    assert found and bank, elf[:2000]
    word = int(bank.group(1), 16)
    return [(offset, size) for _, offset, size in found], word & 0xFFFF, word >> 16


needs_cuobjdump = pytest.mark.skipif(
    kernel_build.find_cuobjdump() is None, reason="no cuobjdump to read the cubin"
)


@needs_cuobjdump
@pytest.mark.parametrize("sm, arch", [(80, "sm_80"), (90, "sm_90a")])
@pytest.mark.parametrize("name", STRUCTS)
def test_kernel_parameters_are_where_the_host_writes_them(name, sm, arch):
    """The parameters of a kernel of each list fall at the offsets of the host's record
    laid out from the kernel's parameter base (64-byte tensor maps included, which the
    compiler aligns by their constant-bank address), and the buffer a launch passes is
    as long as the kernel's parameters."""
    parameters, base, size = _kernel_parameters(name, arch)
    assert base == kernel_params.parameter_base(sm)
    assert _host_parameters(kernel_params.layout(name, base)) == parameters
    assert kernel_params.parameter_bytes(name, base) == size


@needs_cuobjdump
def test_a_host_list_other_than_the_kernels_fails_the_check():
    """A record the host lays out otherwise than the kernel (here: BackwardParams without
    its kv_capacity; and ForwardParams from 0, the C struct's offsets, where its tensor
    maps are not) does not match the kernel's parameters."""
    fields = [f for f in kernel_params.members()["BackwardParams"] if f[0] != "kv_capacity"]
    wrong = kernel_params.layout.__wrapped__  # the layout of a list given here
    members = kernel_params.members
    try:
        kernel_params.members = lambda: {"BackwardParams": fields}
        dtype = wrong("BackwardParams", 0x210)
    finally:
        kernel_params.members = members
    parameters, _, _ = _kernel_parameters("BackwardParams", "sm_90a")
    assert _host_parameters(dtype) != parameters
    parameters, _, _ = _kernel_parameters("ForwardParams", "sm_90a")
    assert _host_parameters(kernel_params.layout("ForwardParams")) != parameters


def test_a_rebased_record_keeps_its_values_and_maps_aligned():
    """A record laid out from a parameter base holds the same members, its tensor maps at
    64-byte host addresses (the driver encodes them in place)."""
    p = kernel_params.Params(
        "ForwardParams", kernel_params.FORWARD_ADDRESSES, num_heads=6, q_len=77, softcap=2.5
    )
    r = p.rebased(0x210)
    assert r is not p and r.rebased(0x210) is r and p.rebased(0) is p
    assert (r["num_heads"], r["q_len"], r["softcap"]) == (6, 77, 2.5)
    offset = kernel_params.layout("ForwardParams", 0x210).fields["q_map"][1]
    assert offset % 64 == 48 and (r.address + offset) % 64 == 0
    assert r.size == kernel_params.parameter_bytes("ForwardParams", 0x210) > p.size


def test_params_fix_members_and_pack_the_calls_addresses():
    strides = ((1000, 100, 10), (2000, 200, 20), (3000, 300, 30), (4000, 400, 40))
    user = np.zeros(1, kernel_params.USER_ARGS_DTYPE)
    user["outer_tiles"] = 7
    p = kernel_params.Params(
        "ForwardParams",
        kernel_params.FORWARD_ADDRESSES,
        q_st=strides[0],
        out_st=strides[3],
        num_heads=16,
        scale_log2=0.5,
        user_args=user,
    )
    addresses = [0x1000 * (i + 1) for i in range(len(kernel_params.FORWARD_ADDRESSES))]
    p.pack(*addresses)
    for member, address in zip(kernel_params.FORWARD_ADDRESSES, addresses):
        assert p[member] == address
    assert p["q_lo"] == 0 and p["k_scales"] == 0  # not per call, not fixed: null
    assert tuple(p["q_st"]) == strides[0] and tuple(p["out_st"]) == strides[3]
    assert p["num_heads"] == 16 and p["scale_log2"] == np.float32(0.5)
    assert p["user_args"]["outer_tiles"] == 7


def test_tensor_maps_are_encoded_when_their_address_changes():
    """A call encodes a map only where its array's address differs from the last call's;
    an encoding the driver refused is tried again at the next call."""
    encoded, refuse = [], set()

    def encode(tile_map, destination, address):
        if address in refuse:
            raise RuntimeError("refused")
        encoded.append((tile_map, address))

    maps = {"q_map": ("q", "Q", encode), "k_map": ("k", "K", encode), "v_map": ("v", "V", encode)}
    p = kernel_params.Params("ForwardParams", kernel_params.FORWARD_ADDRESSES, maps=maps)
    addresses = [0x1000 * (i + 1) for i in range(len(kernel_params.FORWARD_ADDRESSES))]
    p.pack(*addresses)
    assert sorted(encoded) == [("K", 0x2000), ("Q", 0x1000), ("V", 0x3000)]
    p.pack(*addresses)  # the same arrays: nothing to encode
    addresses[3] = 0x9000  # out: no map reads it
    p.pack(*addresses)
    assert len(encoded) == 3
    addresses[1] = 0x7000  # k alone moved
    p.pack(*addresses)
    assert encoded[3:] == [("K", 0x7000)]
    refuse.add(0x8000)
    addresses[2] = 0x8000
    with pytest.raises(RuntimeError):
        p.pack(*addresses)
    refuse.clear()
    p.pack(*addresses)  # the refused map is encoded at the next call
    assert encoded[4:] == [("V", 0x8000)] and p["v"] == 0x8000


def test_a_length_goes_with_the_call_addresses():
    """The KV cache's host-held length is an int the call writes with its addresses."""
    p = kernel_params.Params("DecodeParams", decode_params.DECODE_ADDRESSES, num_heads=8)
    p.pack(*range(1, len(decode_params.DECODE_ADDRESSES)), 4096)
    assert p["v_scales"] == len(decode_params.DECODE_ADDRESSES) - 1  # the last address
    assert p["seqlen_value"] == 4096 and p["num_heads"] == 8
    p.pack(*range(1, len(decode_params.DECODE_ADDRESSES)), 0)
    assert p["seqlen_value"] == 0


def test_params_refuse_what_the_struct_does_not_hold():
    with pytest.raises(KeyError, match="no member 'heads'"):
        kernel_params.Params("ForwardParams", (), heads=1)
    with pytest.raises(KeyError, match="no pointer or int member 'scale_log2'"):
        kernel_params.Params("ForwardParams", ("scale_log2",))
    with pytest.raises(ValueError, match="out of the struct's order"):
        kernel_params.Params("ForwardParams", ("k", "q"))
    with pytest.raises(ValueError, match="inside the per-call addresses"):
        kernel_params.Params("ForwardParams", ("q", "v"), k=5)


def _list(*entries):
    body = " \\\n".join(f"    {e}" for e in entries)
    struct = "struct P {\n    CUFLASH_P_PARAMS(CUFLASH_MEMBER, void)\n};\n"
    return f"#define CUFLASH_P_PARAMS(X, T) \\\n{body}\n{struct}"


def test_members_read_a_list():
    text = _list("X(PTR, const T, a) /* a comment */", "X(STRIDES, Strides, a)", "X(VAL, int, n)")
    assert kernel_params.members(text) == {"P": [("a", "T*"), ("a_st", "Strides"), ("n", "int")]}


def test_members_refuse_a_line_the_host_cannot_lay_out():
    with pytest.raises(ValueError, match="cannot lay out"):
        kernel_params.members(_list("X(VAL, int, a, b)"))
    with pytest.raises(ValueError, match="unknown type"):
        kernel_params.members(_list("X(VAL, double, a)"))
    with pytest.raises(ValueError, match="a map of int"):
        kernel_params.members(_list("X(MAP, int, a)"))
