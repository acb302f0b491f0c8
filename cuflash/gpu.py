"""The GPU path: kernel choice and launches on CuPy's current device and stream."""

import math

import cupy
import numpy as np

from . import dispatch, kernel_build
from .problem import unit_last_stride

LOG2E = 1.4426950408889634
# Tensor-core kernel families (the middle word of a role): "tc" (16-bit
# mma.sync; its backward prefetches the next query tile, 8 warps on 128 keys),
# "wg" (16-bit Hopper wgmma forward, two warpgroups a block), "wgp" (the same
# with the softmax under the wgmma, pipelined; D = 64 and 128), "wgb" (16-bit
# Hopper wgmma backward; D = 64 and 128), "wgd" (the same with head_dim split
# between the warpgroups, S^T and dP^T split by queries and P^T, dS^T
# exchanged through shared memory; D = 256), "tcw" (16-bit
# backward with head_dim split across warps), "tc32" and "tf32" (float32 on
# TF32 tensor cores: three passes, float32 accuracy; one pass, opt-in TF32
# accuracy), "wgs" (float32 forward and backward on two float16 pieces of each
# operand and the 16-bit wgmma, three products each, float32 accuracy; D = 64
# and 128 on Hopper).
# The dispatch passes over the families named in SKIP_FAMILIES: a family in
# development stays there until the GPU suite has run it, and tests and
# benchmarks add one to compare or test the next in line. "tc32" is there
# because its errors are 3-18x the general float32 kernel's (see
# kernels/mma_tf32.cuh): float32 runs on "wgs" where it serves, else on the
# general kernel, unless the call allows TF32.
SKIP_FAMILIES = frozenset({"tc32"})
# Families that run on exactly these compute capabilities (wgmma: sm_90a).
FAMILY_DEVICES = {family: (90,) for family in ("wg", "wgp", "wgb", "wgd", "wgs")}
# 16-bit backward: "tcw" for every head_dim it covers instead of only where
# "tc" does not (for comparing the two; set by tests and benchmarks).
PREFER_WIDE_BACKWARD = False


def _strides(a):
    """Element strides of the batch, head and sequence axes, as int64 scalars."""
    return tuple(np.int64(s // a.itemsize) for s in a.strides[:3])


def _mask_args(problem):
    left, right = problem.window
    return (np.int32(problem.q_len), np.int32(problem.kv_len), np.int32(left), np.int32(right))


def _launch(module, role, grid, args, threads=kernel_build.THREADS):
    module.kernel(role)(grid, (threads,), args, shared_mem=module.smem[role])


def _variant(problem):
    """The kernel variant of ``problem`` for the current device."""
    sm = kernel_build.generation(int(cupy.cuda.Device().compute_capability))
    return kernel_build.Variant(problem.dtype, problem.head_dim, sm)


def _rows_are_16_byte_aligned(arrays):
    """cp.async moves 16-byte chunks: every row must start on a 16-byte boundary."""
    return all(a.data.ptr % 16 == 0 and all(s % 16 == 0 for s in a.strides[:3])
               for a in arrays)


def uses_tensor_cores(problem, arrays, role="fwd_tc"):
    """Whether tensor-core kernel ``role`` serves this call (see :func:`cuflash.kernel_path`)."""
    family = role.split("_")[1]
    if family in SKIP_FAMILIES:
        return False
    capability = int(cupy.cuda.Device().compute_capability)
    if capability not in FAMILY_DEVICES.get(family, (capability,)):
        return False
    return (dispatch.current() == "auto" and role in _variant(problem).kernel_names()
            and capability >= 80 and _rows_are_16_byte_aligned(arrays))


def _fast_families(problem, backward=False):
    """Tensor-core kernel families for the call, in order of preference."""
    if problem.dtype == np.float32:
        return ("tf32",) if problem.allow_tf32 else ("wgs", "tc32")
    if backward:
        wgmma = ("wgb", "wgd")
        return ("tcw",) + wgmma + ("tc",) if PREFER_WIDE_BACKWARD else wgmma + ("tc", "tcw")
    return ("wgp", "wg", "tc")


def _fast_role(problem, arrays, kind, suffix=""):
    """The first tensor-core role ``{kind}_{family}{suffix}`` that serves the call, or None."""
    for family in _fast_families(problem, backward=kind == "dkdv"):
        role = f"{kind}_{family}{suffix}"
        if uses_tensor_cores(problem, arrays, role):
            return role, family
    return None, None


def forward(problem, q, k, v):
    """Return ``(out, lse)`` on the current device and stream."""
    q, k, v = (unit_last_stride(cupy, a) for a in (q, k, v))
    out = cupy.empty(problem.q_shape, dtype=problem.dtype)
    lse = cupy.empty(problem.lse_shape, dtype=np.float32)
    module = kernel_build.load(_variant(problem))
    tiles = module.variant.tiles
    role, family = _fast_role(problem, (q, k, v), "fwd")
    if role:
        rows, threads = tiles.fast_fwd(family)
    else:
        role, rows, threads = "fwd", tiles.fwd[0], kernel_build.THREADS
    grid = (math.ceil(problem.q_len / rows), problem.num_heads, problem.batch)
    if family == "wgs":  # the kernel reads float16 pieces and their scales
        (q, q_lo, q_scales), (k, k_lo, k_scales), (v, v_lo, v_scales) = (
            float16_pieces(module, x, valid_rows)
            for x, valid_rows in ((q, problem.q_len), (k, problem.kv_len), (v, problem.kv_len)))
        arrays, extra = (q, q_lo, k, k_lo, v, v_lo), (q_scales, k_scales, v_scales)
    else:
        arrays, extra = (q, k, v), ()
    _launch(module, role, grid, threads=threads, args=(
        *arrays, out, lse, *_strides(q), *_strides(k), *_strides(v), *extra,
        np.int32(problem.num_heads), np.int32(problem.group_size), *_mask_args(problem),
        np.float32(problem.softmax_scale * LOG2E)))
    return out, lse


def float16_pieces(module, x, valid_rows):
    """``(hi, lo, scales)``: float16 arrays of ``x``'s shape with hi + lo = x * scale on the
    first ``valid_rows`` rows of each head (22 significant bits), and float32 ``scales`` of
    shape ``[batch, heads]``: for each head the power of two that puts its max |x| in
    [2^13, 2^14)."""
    batch, heads, seq_len, _ = x.shape
    abs_max = cupy.zeros((batch, heads), dtype=np.float32)
    _launch(module, "abs_max", (max(1, math.ceil(valid_rows / 32)), heads, batch),
            (x, *_strides(x), abs_max, np.int32(valid_rows)))
    hi = cupy.empty(x.shape, dtype=np.float16)
    lo = cupy.empty(x.shape, dtype=np.float16)
    scales = cupy.empty((batch, heads), dtype=np.float32)
    _launch(module, "split_f16", (max(1, math.ceil(valid_rows / 4)), heads, batch),
            (x, *_strides(x), abs_max, hi, lo, scales, np.int32(heads), np.int32(seq_len),
             np.int32(valid_rows)))
    return hi, lo, scales


def backward_delta(module, problem, dout, output, lse):
    """``(delta, lse_log2)``: Delta = rowsum(dO * O) per query row and lse * log2(e), the
    lse the dK/dV and dQ kernels take (float32, the lse's shape; ``lse`` contiguous)."""
    delta = cupy.empty(problem.lse_shape, dtype=np.float32)
    lse_log2 = cupy.empty(problem.lse_shape, dtype=np.float32)
    _launch(module, "delta", (math.ceil(problem.q_len / 4), problem.num_heads, problem.batch),
            (dout, output, lse, delta, lse_log2, *_strides(dout), *_strides(output),
             np.int32(problem.num_heads), np.int32(problem.q_len)))
    return delta, lse_log2


def _backward_shape_args(problem, q, k, v, dout, scales=()):
    """Strides of q, k, v and dout, then ``scales`` (the float16 pieces' device arrays),
    then the head counts."""
    return (*_strides(q), *_strides(k), *_strides(v), *_strides(dout), *scales,
            np.int32(problem.num_heads), np.int32(problem.group_size))


def _backward_scales(problem):
    return np.float32(problem.softmax_scale), np.float32(problem.softmax_scale * LOG2E)


def dkdv_args(problem, q, k, v, dout, lse_log2, delta, dq, dk, dv, pieces=None):
    """The arguments of every dK/dV kernel role (``dq``: dq_accum, or dQ when unused). For
    the kernel on float16 pieces ("wgs"), ``pieces`` holds ``(lo, scales)`` of each of q,
    k, v and dout (see :func:`float16_pieces`), and q, k, v, dout are their hi pieces."""
    inputs = (q, k, v, dout)
    scales = ()
    if pieces is not None:
        inputs = tuple(x for hi, (lo, _) in zip(inputs, pieces) for x in (hi, lo))
        scales = tuple(s for _, s in pieces)
    return (*inputs, lse_log2, delta, dq, dk, dv,
            *_backward_shape_args(problem, q, k, v, dout, scales),
            np.int32(problem.kv_capacity), *_mask_args(problem), *_backward_scales(problem))


def _split_dkdv_args(module, problem, q, k, v, dout, lse_log2, delta, dq, dk, dv):
    """:func:`dkdv_args` of the dK/dV kernel on float16 pieces ("wgs"): each of q, k, v and
    dout split first."""
    valid_rows = (problem.q_len, problem.kv_len, problem.kv_len, problem.q_len)
    his, pieces = [], []
    for x, rows in zip((q, k, v, dout), valid_rows):
        hi, lo, scales = float16_pieces(module, x, rows)
        his.append(hi)
        pieces.append((lo, scales))
    return dkdv_args(problem, *his, lse_log2, delta, dq, dk, dv, pieces=pieces)


def backward(problem, dout, q, k, v, output, lse, deterministic, synchronize):
    """Return ``(dq, dk, dv)``; see :func:`cuflash.flash_attention_bwd`."""
    dout, q, k, v, output = (unit_last_stride(cupy, a) for a in (dout, q, k, v, output))
    lse = cupy.ascontiguousarray(lse)
    dk = cupy.empty(problem.kv_shape, dtype=problem.dtype)
    dv = cupy.empty(problem.kv_shape, dtype=problem.dtype)
    module = kernel_build.load(_variant(problem))
    tiles = module.variant.tiles
    delta, lse_log2 = backward_delta(module, problem, dout, output, lse)

    # dK and dV (and with atomics dQ) per key tile: tensor cores where they apply.
    suffix = "" if deterministic else "_atomic_dq"
    dkdv_role, family = _fast_role(problem, (q, k, v, dout), "dkdv", suffix)
    if dkdv_role:
        keys, threads = tiles.fast_bwd(family)
    else:
        dkdv_role = "dkdv" + suffix
        keys, threads = tiles.dkdv[1], kernel_build.THREADS
    dq_accum = None if deterministic else cupy.zeros(problem.q_shape, dtype=np.float32)
    dq = cupy.empty(problem.q_shape, dtype=problem.dtype) if deterministic else dq_accum
    if problem.kv_capacity:
        if family == "wgs":  # float16 pieces of q, k, v and dout, and their scales
            args = _split_dkdv_args(module, problem, q, k, v, dout, lse_log2, delta, dq, dk, dv)
        else:
            args = dkdv_args(problem, q, k, v, dout, lse_log2, delta, dq, dk, dv)
        _launch(module, dkdv_role,
                (math.ceil(problem.kv_capacity / keys), problem.num_kv_heads, problem.batch),
                threads=threads, args=args)
    if deterministic:  # dQ by its own pass over the keys, no atomics
        _launch(module, "dq", (math.ceil(problem.q_len / tiles.dq[0]), problem.num_heads,
                               problem.batch), (
            q, k, v, dout, lse_log2, delta, dq, *_backward_shape_args(problem, q, k, v, dout),
            *_mask_args(problem), *_backward_scales(problem)))
    elif problem.dtype != np.float32:
        dq = dq_accum.astype(problem.dtype)
    if synchronize:
        cupy.cuda.get_current_stream().synchronize()
    return dq, dk, dv
