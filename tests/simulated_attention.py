"""The GPU path run in the CPU simulator (``tests/simulator``) on NumPy arrays: the
registry's kernels for an A100-class GPU (compute capability 8.0: mma.sync and the CUDA
cores) or for an H100/H200 (9.0: wgmma) in 16 bits.

:func:`forward` and :func:`backward` launch the kernels the registry chooses for
``capability`` with the arguments ``cuflash.gpu``'s plans pass, in the same order,
so that a test can hold the results against the float64 oracle without a GPU. Dense problems; score modifiers the built-in ones (softcap,
ALiBi). Outputs are poisoned with NaN before the kernels run.
"""

import math

import numpy as np

import simulator
from cuflash import registry
from cuflash.modifiers import MODIFIER_ARRAYS_DTYPE
from cuflash.problem import backward_problem, forward_problem

LOG2E = 1.4426950408889634
#: ``UserModifierArgs`` of kernels/common.cuh without user modifiers: zeros in the size of
#: cuflash.gpu's record (two ModifierArrays and a BlockMaskView of 56 bytes).
NO_USER_ARGUMENTS = np.zeros(1, dtype=np.dtype(
    [("bytes", np.uint8, 2 * MODIFIER_ARRAYS_DTYPE.itemsize + 56)]))


def _strides(a):
    """Element strides of the batch, head and sequence axes (int64 scalars)."""
    return tuple(np.int64(s // a.itemsize) for s in a.strides[:3])


def _contiguous_strides(shape):
    _, heads, rows, d = shape
    return (np.int64(heads * rows * d), np.int64(rows * d), np.int64(d))


def _mask_args(problem):
    left, right = problem.window
    return (np.int32(problem.q_len), np.int32(problem.kv_len), np.int32(left), np.int32(right))


def _modifier_args(problem, alibi_slopes):
    batch_stride = alibi_slopes.shape[1] if alibi_slopes is not None and alibi_slopes.ndim == 2 \
        else 0
    return (np.int32(batch_stride), np.float32(problem.softcap))


def _poisoned(shape, dtype):
    return np.full(shape, np.nan, dtype=dtype)


class Kernels:
    """The kernels one call launches, compiled into one simulated module."""

    def __init__(self, problem, specs, capability):
        self.problem = problem
        self.roles = {}
        for spec, atomic in specs:
            role = spec.role(atomic_dq=atomic,
                             modified=problem.modified and spec.modifiers)
            self.roles[spec.name] = (spec, role, spec.name_expression(
                role, problem.dtype, problem.head_dim))
        self.module = simulator.build(sorted({name for _, _, name in self.roles.values()}),
                                      arch=capability)

    def launch(self, spec_name, grid, args):
        spec, _, name = self.roles[spec_name]
        traits = spec.traits(self.problem.head_dim)
        self.module.launch(name, grid, traits.threads, traits.shared_bytes, args)

    def tile(self, spec_name):
        spec = self.roles[spec_name][0]
        return spec.traits(self.problem.head_dim).tile


def forward(q, k, v, num_heads, num_kv_heads, head_dim, causal=False, window_size=0,
            kv_seq_len=None, softmax_scale=None, softcap=0.0, alibi_slopes=None,
            excluded=(), capability=80):
    """``(out, lse)`` of the forward kernel the registry chooses for ``capability``
    (``excluded``: kernels to pass over)."""
    problem = forward_problem(q, k, v, num_heads, num_kv_heads, head_dim, causal, window_size,
                              kv_seq_len, softmax_scale, softcap=softcap,
                              alibi_slopes=alibi_slopes)
    spec = registry.choose("forward", problem.dtype, head_dim, capability,
                           excluded=frozenset(excluded), modified=problem.modified)
    kernels = Kernels(problem, [(spec, False)], capability)
    out = _poisoned(problem.q_shape, problem.dtype)
    lse = _poisoned(problem.lse_shape, np.float32)
    grid = (math.ceil(problem.q_len / kernels.tile(spec.name)), num_heads, problem.batch)
    kernels.launch(spec.name, grid, [
        q, k, v, out, lse, None, None, alibi_slopes, NO_USER_ARGUMENTS,
        *_strides(q), *_strides(k), *_strides(v), *_contiguous_strides(out.shape),
        np.int32(num_heads), np.int32(problem.group_size), *_mask_args(problem),
        np.float32(problem.softmax_scale * LOG2E), *_modifier_args(problem, alibi_slopes)])
    return out, lse


def backward(dout, q, k, v, out, lse, num_heads, num_kv_heads, head_dim, causal=False,
             window_size=0, kv_seq_len=None, softmax_scale=None, deterministic=False,
             softcap=0.0, alibi_slopes=None, excluded=(), capability=80):
    """``(dq, dk, dv)`` of the backward the registry chooses for ``capability``: the Delta
    kernel, the dK/dV kernel and either its float32 atomics for dQ and their conversion,
    or its dQ pass (deterministic calls, and the kernels without atomics)."""
    problem = backward_problem(dout, q, k, v, out, lse, num_heads, num_kv_heads, head_dim,
                               causal, window_size, kv_seq_len, softmax_scale, deterministic,
                               True, softcap=softcap, alibi_slopes=alibi_slopes)
    spec = registry.choose("backward", problem.dtype, head_dim, capability,
                           excluded=frozenset(excluded), modified=problem.modified)
    atomic = not deterministic and spec.atomic_dq(head_dim)
    dq_spec = None if atomic else spec.dq_pass()
    helpers = [registry.BY_NAME["backward_delta"]]
    helpers.append(registry.BY_NAME["backward_dq_convert"] if atomic else dq_spec)
    kernels = Kernels(problem, [(spec, atomic)] + [(h, False) for h in helpers], capability)

    accum_width = registry.head_dim_class(head_dim) if atomic and spec.padded_dq else head_dim
    rows = problem.batch * num_heads * problem.q_len
    delta = _poisoned(rows, np.float32)
    lse_log2 = _poisoned(rows, np.float32)
    dq_accum = _poisoned(rows * accum_width, np.float32) if atomic else None
    kernels.launch("backward_delta", (math.ceil(problem.q_len / 4), num_heads, problem.batch), [
        dout, out, lse, delta, lse_log2, dq_accum, *_strides(dout), *_strides(out),
        np.int32(num_heads), np.int32(problem.q_len),
        np.int32(accum_width if atomic else 0)])

    dq = _poisoned(problem.q_shape, problem.dtype)
    dk = _poisoned(problem.kv_shape, problem.dtype)
    dv = _poisoned(problem.kv_shape, problem.dtype)
    heads = (np.int32(num_heads), np.int32(problem.group_size))
    options = (*_mask_args(problem), np.float32(problem.softmax_scale),
               np.float32(problem.softmax_scale * LOG2E))
    input_strides = tuple(s for x in (q, k, v, dout) for s in _strides(x))
    modifiers = _modifier_args(problem, alibi_slopes)
    grid = (math.ceil(problem.kv_capacity / kernels.tile(spec.name)), num_kv_heads,
            problem.batch)
    kernels.launch(spec.name, grid, [
        q, k, v, dout, lse_log2, delta, dq_accum, dk, dv, None, None, alibi_slopes,
        NO_USER_ARGUMENTS, *input_strides, *_contiguous_strides(dk.shape), *heads,
        np.int32(problem.kv_capacity), *options, *modifiers])
    if atomic:
        count = math.prod(problem.q_shape)
        kernels.launch("backward_dq_convert", (math.ceil(count / 512),), [
            dq_accum, dq, *_contiguous_strides(dq.shape), np.int64(count),
            np.int32(accum_width), np.int32(num_heads), np.int32(problem.q_len)])
    else:
        grid = (math.ceil(problem.q_len / kernels.tile(dq_spec.name)), num_heads,
                problem.batch)
        kernels.launch(dq_spec.name, grid, [
            q, k, v, dout, lse_log2, delta, dq, None, None, alibi_slopes, NO_USER_ARGUMENTS,
            *input_strides, *_contiguous_strides(dq.shape), *heads, *options, *modifiers])
    return dq, dk, dv
