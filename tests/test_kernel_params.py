"""The host's records of the kernels' parameter structs (``cuflash.kernel_params``)
against the C++ compiler's layout of ``kernels/params.cuh``: NVRTC compiles one
``static_assert`` an offset, so a member the two sides place differently fails here,
without a GPU, instead of reading wrong values in a kernel."""

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


def _compile(source):
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source, "params_layout.cu", (), ())
    try:
        nvrtc.compileProgram(prog, kernel_build.COMPILE_OPTIONS + ("-arch=sm_80",))
    except nvrtc.NVRTCError:
        return nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return None


def _source(asserts):
    header = kernel_build.inlined_source(kernel_params.PARAMS_HEADER, set())
    body = "\n".join(asserts)
    return f"{header}\nnamespace cuflash {{\n{body}\n}}\n"


@pytest.mark.parametrize("name", sorted(kernel_params.members()))
def test_host_layout_is_the_compilers(name):
    log = _compile(_source(_layout_asserts(name)))
    assert log is None, log


def test_a_misplaced_member_fails_the_check():
    asserts = _layout_asserts("ForwardParams")
    wrong = [a.replace(") == ", ") == 4 + ", 1) if ".scale_log2" in a else a for a in asserts]
    log = _compile(_source(wrong))
    assert log is not None and "ForwardParams.scale_log2" in log


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


def test_members_refuse_a_line_the_host_cannot_lay_out():
    with pytest.raises(ValueError, match="cannot lay out"):
        kernel_params.members("struct P {\n    int a, b;\n};")
    with pytest.raises(ValueError, match="unknown type"):
        kernel_params.members("struct P {\n    double a;\n};")
