"""The host's records of the kernels' parameter lists (``cuflash.kernel_params``)
against the C++ compiler's layout of ``kernels/params.cuh``: NVRTC compiles one
``static_assert`` an offset of each list's struct, and a kernel declared with each list
to PTX, whose parameters (their sizes and alignments: the parameter buffer's rule) must
fall where the host's record puts them, so a member the two sides place differently
fails here, without a GPU, instead of reading wrong values in a kernel."""

import re

import numpy as np
import pytest

from cuflash import kernel_build, kernel_params


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
        "DqConvertParams",
        "ForwardParams",
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


def _kernel_parameters(name):
    """(offset, bytes) of each parameter of a kernel declared with ``name``'s list, from
    its PTX: each at the next multiple of its alignment (a scalar's: its size; an
    aggregate's: its ``.align``), as a parameter buffer lays them out."""
    text = kernel_params.PARAMS_HEADER.read_text()
    macro, args = re.search(rf"struct {name} \{{\s*(\w+)\(CUFLASH_MEMBER, ([^)]*)\)", text).groups()
    types = ", ".join("half_t" for _ in args.split(","))
    kernel = f'extern "C" __global__ void probe(CUFLASH_PARAMETERS({macro}, {types})) {{}}'
    ptx = _compile(_source([kernel]), ptx=True)
    assert ptx is not None and ".entry probe" in ptx, ptx
    found, end = [], 0
    for align, kind, count in re.findall(
        r"\.param (?:\.align (\d+) )?\.(\w+) probe_param_\d+(?:\[(\d+)\])?", ptx
    ):
        size = int(count) if count else int(kind[1:]) // 8
        align = int(align) if align else size
        end = -(-end // align) * align
        found.append((end, size))
        end += size
    return found, end


@pytest.mark.parametrize("name", STRUCTS)
def test_kernel_parameters_are_where_the_host_writes_them(name):
    """The parameters of a kernel of each list fall at the host record's offsets, and the
    buffer a launch passes ends where they do."""
    parameters, end = _kernel_parameters(name)
    assert _host_parameters(kernel_params.layout(name)) == parameters
    assert kernel_params.parameter_bytes(name) == end


def test_a_host_list_other_than_the_kernels_fails_the_check():
    """A record the host lays out otherwise than the kernel (here: BackwardParams without
    its kv_capacity) does not match the kernel's parameters."""
    fields = [f for f in kernel_params.members()["BackwardParams"] if f[0] != "kv_capacity"]
    wrong = kernel_params.layout.__wrapped__  # the layout of a list given here
    members = kernel_params.members
    try:
        kernel_params.members = lambda: {"BackwardParams": fields}
        dtype = wrong("BackwardParams")
    finally:
        kernel_params.members = members
    parameters, _ = _kernel_parameters("BackwardParams")
    assert _host_parameters(dtype) != parameters


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


def test_params_refuse_what_the_struct_does_not_hold():
    with pytest.raises(KeyError, match="no member 'heads'"):
        kernel_params.Params("ForwardParams", (), heads=1)
    with pytest.raises(KeyError, match="no pointer member 'num_heads'"):
        kernel_params.Params("ForwardParams", ("num_heads",))
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
