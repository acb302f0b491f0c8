"""The native FP8 forward on Hopper (the FP8 page): ``forward_wgmma_ws``'s FP8 role
reads e4m3 q and k and v's transpose, which ``fp8_transpose_v`` writes first (an e4m3
``wgmma`` reads both of its operands K-major, so P V needs v's keys along shared
memory's rows). The descales join the kernel as a (batch entry, head) factor of the
softmax scale (q's times k's) and of the output (v's), which it writes in the call's
16-bit ``out_dtype``.

:func:`serves` says which calls it takes: dense calls on compute capability 9.0 whose
head dims are multiples of 16 up to 256 (v's no wider than q's), with no score
modifiers (softcap, ALiBi, a user's score or mask function), whose arrays the copy
engine can address (rows on the 16-byte grid), in the default kernel path. The others
run the dequantized float32 forward (:mod:`cuflash.fp8_forward`).
"""

import math

import cupy
import numpy as np

from .. import dispatch
from ..core.problem import unit_last_stride
from . import kernel_build, kernel_params, plans, registry, standalone, tensor_maps
from .kernel_launch import (
    NO_USER_ARGUMENTS,
    Launch,
    address,
    current_stream,
    device_capability,
    element_strides,
    rows_are_16_byte_aligned,
)
from .tile_traits import round_up

WS_FORWARD = registry.BY_NAME["forward_wgmma_ws"]
ROLE = WS_FORWARD.name + registry.FP8
TRANSPOSE = standalone.STANDALONE["fp8_transpose_v"]
TRANSPOSE_TILE, TRANSPOSE_THREADS = 64, 256  # keys and rows a block, its threads
SIXTEEN_BIT = tuple(registry.CXX_TYPES.keys() - {np.dtype(np.float32)})


def serves(problem, arrays, out_dtype):
    """Whether the native FP8 forward takes ``problem`` (a validated dense FP8 forward on
    CuPy ``arrays`` q, k, v) with output ``out_dtype``."""
    return (
        problem.packed is None
        and not problem.modified
        and np.dtype(out_dtype) in SIXTEEN_BIT
        and WS_FORWARD.serves_fp8(problem.head_dim)
        and problem.head_dim_v % 16 == 0
        and problem.head_dim_v <= problem.head_dim
        and dispatch.current() == "auto"
        and WS_FORWARD.name not in dispatch.excluded()
        and device_capability()[1] == 90
        and tensor_maps.available()
        and rows_are_16_byte_aligned([unit_last_stride(cupy, a) for a in arrays])
    )


def _contiguous_strides(shape):
    _, heads, rows, width = shape
    return (np.int64(heads * rows * width), np.int64(rows * width), np.int64(width))


class Fp8ForwardPlan:
    """The two launches of one FP8 forward signature: v's transpose into a buffer of the
    call, then the attention; ``plan(q, k, v, query_scale, value_scale, sinks)`` with the
    descales as float32 ``[B, H]`` arrays (each query head's)."""

    def __init__(self, problem, q, k, v, out_dtype):
        self.problem = problem
        q, k, v = (unit_last_stride(cupy, a) for a in (q, k, v))
        head_dim_v = None if problem.head_dim_v == problem.head_dim else problem.head_dim_v
        variant = kernel_build.Variant(np.dtype(out_dtype), problem.head_dim, 90, head_dim_v)
        loaded = kernel_build.load(variant)
        traits = variant.traits(ROLE)
        rows, keys = round_up(problem.head_dim_v, 16), round_up(problem.kv_len, 16)
        self.vt_shape = (problem.batch, problem.num_kv_heads, rows, keys)
        self.transpose = Launch(
            kernel_build.load_standalone(TRANSPOSE.name_expression()).kernel,
            (
                math.ceil(keys / TRANSPOSE_TILE),
                math.ceil(rows / TRANSPOSE_TILE),
                problem.batch * problem.num_kv_heads,
            ),
            TRANSPOSE_THREADS,
            0,
            kernel_params.fp8_transpose_params(problem, element_strides(v), rows, keys).rebased(
                kernel_params.parameter_base(90)
            ),
        )
        self.out_shape = (problem.batch, problem.num_heads, problem.q_len, problem.head_dim_v)
        self.out_dtype = np.dtype(out_dtype)
        strides = [element_strides(q), element_strides(k), _contiguous_strides(self.vt_shape)]
        maps = kernel_params.fp8_forward_maps(
            problem,
            traits,
            [q.shape, k.shape, self.vt_shape],
            strides,
            tensor_maps.TileMap.encode_into,
        )
        if maps is None:
            raise ValueError("the copy engine cannot address these arrays (see serves)")
        query_tiles = math.ceil(problem.q_len / traits.tile)
        params = kernel_params.forward_params(
            problem,
            *strides,
            _contiguous_strides(self.out_shape),
            NO_USER_ARGUMENTS,
            maps=maps,
            query_tiles=query_tiles,
            fp8=True,
        )
        grid = (query_tiles, problem.num_heads, problem.batch)
        self.attention = Launch.of_role(loaded, ROLE, grid, params)

    def __call__(self, q, k, v, query_scale, value_scale, sinks=None):
        """``(out, lse)``: out ``[B, H, S_q, head_dim_v]`` in the plan's ``out_dtype``."""
        q, k, v = (unit_last_stride(cupy, a) for a in (q, k, v))
        stream = current_stream()
        vt = cupy.ndarray(self.vt_shape, np.uint8)
        self.transpose(stream, v.data.ptr, vt.data.ptr)
        out = cupy.ndarray(self.out_shape, self.out_dtype)
        lse = cupy.ndarray(self.problem.lse_shape, np.float32)
        self.attention(
            stream,
            q.data.ptr,
            k.data.ptr,
            vt.data.ptr,
            out.data.ptr,
            lse.data.ptr,
            query_scale.data.ptr,
            value_scale.data.ptr,
            address(sinks),
        )
        return out, lse


def forward(problem, q, k, v, config, out_dtype, query_scale, value_scale):
    """The native FP8 forward of a call :func:`serves` (its plan made once a signature):
    ``query_scale`` (q's descale times k's) and ``value_scale`` (v's) are float32
    ``[B, H_kv]`` arrays, floats or None (1)."""
    c = config
    scalars = (
        "fp8",
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.causal,
        problem.window,
        problem.kv_len,
        problem.softmax_scale,
        problem.head_dim_v,
        c.sinks is None,
        np.dtype(out_dtype).str,
    )
    key = plans.signature((q, k, v), scalars)
    plan = plans.get(key)
    if plan is None:
        plan = Fp8ForwardPlan(problem, q, k, v, out_dtype)
        plans.remember(key, plan)
    scales = [_per_query_head(problem, s) for s in (query_scale, value_scale)]
    sinks = c.sinks
    if sinks is not None:
        sinks = cupy.ascontiguousarray(sinks, dtype=np.float32)
    return plan(q, k, v, *scales, sinks)


def _per_query_head(problem, scale):
    """A ``[B, H_kv]`` factor (or a float, or None: 1) as the float32 ``[B, H]`` array the
    kernel reads, each query head its KV head's."""
    if scale is None or isinstance(scale, float):
        shape = (problem.batch, problem.num_heads)
        return cupy.full(shape, 1.0 if scale is None else scale, np.float32)
    per_kv_head = cupy.asarray(scale, dtype=np.float32)
    return cupy.ascontiguousarray(cupy.repeat(per_kv_head, problem.group_size, axis=1))
