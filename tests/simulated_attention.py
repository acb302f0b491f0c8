"""The GPU path run in the CPU simulator (``tests/simulator``) on NumPy arrays: the
registry's kernels for an A100-class GPU (compute capability 8.0: mma.sync and the CUDA
cores) or for an H100/H200 (9.0: wgmma, float32 on its float16 pieces).

:func:`forward` and :func:`backward` (dense) and :func:`varlen_forward` and
:func:`varlen_backward` (packed batches) launch the kernels the registry chooses for
``capability`` with the arguments ``cuflash.gpu.launch``'s plans pass, in the same order, so
that a test can hold the results against the float64 oracle without a GPU. Score
modifiers: the built-in ones (softcap, ALiBi) and the user's score and mask functions,
compiled in as the library does, with their block mask's view in host memory (its
classes from the mask's NumPy twin). Outputs are poisoned with NaN before the kernels
run.
"""

import math

import numpy as np
import simulator

from cuflash import dispatch
from cuflash.core.config import AttentionConfig
from cuflash.core.problem import backward_problem, forward_problem
from cuflash.core.varlen_problem import heads_first, varlen_problem
from cuflash.gpu import kernel_params, registry, schedules, tile_traits
from cuflash.gpu.kernel_launch import USER_ARGS_DTYPE
from cuflash.gpu.launch import _functors

#: ``UserModifierArgs`` of kernels/common/common.cuh without user modifiers: zeros.
NO_USER_ARGUMENTS = np.zeros(1, dtype=USER_ARGS_DTYPE)
PIECES_HELPERS = ("float16_pieces_abs_max", "float16_pieces_split")


def user_arguments(problem, spec, direction):
    """The ``UserModifierArgs`` record of ``spec``'s launches for ``problem``: its score
    and mask functions' NumPy arrays and, for a kernel that reads one, its block mask's
    view in host memory (``direction`` as ``cuflash.gpu.launch`` asks for it), as
    ``cuflash.gpu.launch.UserArguments`` makes them on the device; and the view, which the
    record points into."""
    if problem.score_mod is None and problem.mask_mod is None:
        return NO_USER_ARGUMENTS, None
    record = np.zeros(1, dtype=USER_ARGS_DTYPE)
    for field, mod in (("score_arrays", problem.score_mod), ("mask_arrays", problem.mask_mod)):
        if mod is not None:
            record[field] = mod.kernel_arguments(np)[0]
    view = None
    tiles = spec.block_mask_tiles(problem.head_dim)
    if problem.block_mask is not None and tiles is not None:
        view = problem.block_mask.view(
            direction, *tiles, problem.num_heads, problem.num_kv_heads, host=True
        )
        for name, value in zip(USER_ARGS_DTYPE.names[2:], view.fields()):
            record[name] = value
    return record, view


def _strides(a):
    """Element strides of the batch, head and sequence axes (int64 scalars)."""
    return tuple(np.int64(s // a.itemsize) for s in a.strides[:3])


def _contiguous_strides(shape):
    _, heads, rows, d = shape
    return (np.int64(heads * rows * d), np.int64(rows * d), np.int64(d))


def _poisoned(shape, dtype):
    return np.full(shape, np.nan, dtype=dtype)


class _Output:
    """An output of ``heads`` heads and ``rows`` rows a head, NaN-poisoned, as
    ``cuflash.gpu.launch.OutputLayout`` lays it out: ``array`` (dense ``[B, heads, rows, D]``,
    packed ``[rows, heads, D]``, D the head_dim or ``width``), ``view`` (``[B, heads,
    rows, D]`` either way) and the kernels' ``strides``."""

    def __init__(self, problem, heads, rows, width=None):
        d = problem.head_dim if width is None else width
        if problem.packed is None:
            self.array = _poisoned((problem.batch, heads, rows, d), problem.dtype)
            self.view = self.array
        else:
            self.array = _poisoned((rows, heads, d), problem.dtype)
            self.view = heads_first(self.array)
        self.strides = _strides(self.view)


class Kernels:
    """The kernels one call launches, compiled into one simulated module; ``guard``: each
    launch's arrays between guard pages (``simulator.Module.launch``)."""

    def __init__(self, problem, specs, capability, guard=False, persistent=False, ordered=False):
        self.problem, self.guard = problem, guard
        functors = _functors(problem)  # the user's, as the GPU path compiles them (or None)
        self._users = {}
        self.roles = {}
        for spec, atomic in specs:
            role = spec.role(
                atomic_dq=atomic,
                modified=problem.modified and spec.serves_modifiers(problem.mask_only),
                persistent=persistent and spec.persistent_keys is not None,
                ordered_dq=ordered and atomic and spec.orders_dq(problem.head_dim),
            )
            # v's head dim where the kernel takes one of its own (the forward's)
            head_dim_v = problem.head_dim_v if spec.value_dims else None
            self.roles[spec.name] = (
                spec,
                role,
                spec.name_expression(role, problem.dtype, problem.head_dim, head_dim_v),
            )
        self.module = simulator.build(
            sorted({name for _, _, name in self.roles.values()}), arch=capability, functors=functors
        )

    def launch(self, spec_name, grid, args):
        traits = self.traits(spec_name)
        name = self.roles[spec_name][2]
        self.module.launch(name, grid, traits.threads, traits.shared_bytes, args, self.guard)

    def traits(self, spec_name):
        spec, role, _ = self.roles[spec_name]
        return spec.traits_of(self.problem.head_dim, role.endswith(registry.MODIFIED))

    def tile(self, spec_name):
        return self.traits(spec_name).tile

    def user(self, spec_name, direction):
        """The ``UserModifierArgs`` record of kernel ``spec_name`` (see
        :func:`user_arguments`), kept with its view while the kernels are."""
        key = (spec_name, direction)
        if key not in self._users:
            self._users[key] = user_arguments(self.problem, self.roles[spec_name][0], direction)
        return self._users[key][0]


def _query_grid(problem, tile):
    rows, batch = (
        (problem.q_len, problem.batch)
        if problem.packed is None
        else (problem.packed.max_q_len, problem.packed.count)
    )
    return math.ceil(rows / tile), problem.num_heads, batch


def _key_grid(problem, tile):
    rows, batch = (
        (problem.kv_capacity, problem.batch)
        if problem.packed is None
        else (problem.packed.max_kv_len, problem.packed.count)
    )
    return math.ceil(rows / tile), problem.num_kv_heads, batch


def _helpers(*names):
    return [(registry.BY_NAME[name], False) for name in names]


def _zero_outside(kernels, problem, output, offsets, lse=None):
    """Zeros in a packed output's rows outside every sequence, -inf in the forward's
    ``lse`` there (``packed_zero_outside``)."""
    rows, heads, d = output.array.shape
    kernels.launch(
        "packed_zero_outside",
        (64,),
        (
            kernel_params.zero_outside_params(problem.packed.count, rows, heads, heads * d),
            (output.array, offsets, lse),
        ),
    )


def _pieces(kernels, x, valid_rows):
    """``(hi, lo, scales)``: the float16 pieces of float32 ``x`` (``cuflash.gpu.launch``'s
    Float16Pieces), rows past ``valid_rows`` of each head left poisoned."""
    batch, heads, seq_len, _ = x.shape
    abs_max = np.zeros((batch, heads), np.float32)
    abs_max_params, split_params = kernel_params.pieces_params(
        _strides(x), valid_rows, heads, seq_len
    )
    kernels.launch(
        "float16_pieces_abs_max",
        (math.ceil(valid_rows / 32), heads, batch),
        (abs_max_params, (x, abs_max)),
    )
    hi, lo = _poisoned(x.shape, np.float16), _poisoned(x.shape, np.float16)
    scales = _poisoned((batch, heads), np.float32)
    kernels.launch(
        "float16_pieces_split",
        (math.ceil(valid_rows / 4), heads, batch),
        (split_params, (x, abs_max, hi, lo, scales)),
    )
    return hi, lo, scales


def run_forward(
    problem,
    q,
    k,
    v,
    offsets=(None, None),
    alibi_slopes=None,
    excluded=(),
    capability=80,
    guard=False,
    sinks=None,
    tma=False,
    persistent_blocks=None,
):
    """``(out, lse)`` of ``problem`` (validated; q, k, v as ``[B, H, S, D]`` views, a packed
    problem's as ``[1, H, total, D]`` with its ``offsets``) on the kernels the registry
    chooses for ``capability`` (``guard``: see :class:`Kernels`; ``sinks``: float32
    ``[H]`` attention sinks, or None; ``tma``: q, k and v by bulk tensor copies, where
    the kernel and the call take them, as on a GPU; ``persistent_blocks``: the persistent
    role of a kernel that has one, on that many blocks)."""
    spec = registry.choose(
        "forward",
        problem.dtype,
        problem.head_dim,
        capability,
        excluded=frozenset(excluded),
        tried=dispatch.tried(),
        modified=problem.modified,
    )
    assert spec.takes_value_dims(problem.head_dim, problem.head_dim_v), spec.name
    pieces = spec.precision == "float32"
    packed = problem.packed is not None
    helpers = _helpers(
        *(PIECES_HELPERS if pieces else ()), *(("packed_zero_outside",) if packed else ())
    )
    persistent = persistent_blocks is not None
    if persistent:
        assert spec.persistent_keys is not None and not problem.modified, spec.name
    kernels = Kernels(problem, [(spec, False)] + helpers, capability, guard, persistent)
    out = _Output(problem, problem.num_heads, problem.q_len, problem.head_dim_v)
    lse = _poisoned(problem.lse_shape, np.float32)
    if pieces:
        (qh, ql, qs), (kh, kl, ks), (vh, vl, vs) = (
            _pieces(kernels, x, rows)
            for x, rows in ((q, problem.q_len), (k, problem.kv_len), (v, problem.kv_len))
        )
        inputs, scales = (qh, ql, kh, kl, vh, vl), (qs, ks, vs)
        strides = [_contiguous_strides(x.shape) for x in (qh, kh, vh)]
    else:
        inputs, scales = (q, k, v), ()
        strides = [_strides(x) for x in (q, k, v)]
    maps = None
    if tma and spec.name == "forward_wgmma_ws" and offsets[1] is None:
        shapes = [x.shape for x in (q, k, v)]
        traits = kernels.traits(spec.name)
        maps = kernel_params.forward_maps(
            problem, traits, shapes, strides, simulator.encode_tensor_map
        )
        assert maps is not None, "the copy engine takes every dense test case"
    grid = _query_grid(problem, kernels.tile(spec.name))
    params = kernel_params.forward_params(
        problem,
        *strides,
        out.strides,
        kernels.user(spec.name, "forward"),
        pieces,
        maps,
        query_tiles=grid[0],
    )
    kernels.launch(
        spec.name,
        (persistent_blocks,) if persistent else grid,
        (params, (*inputs, out.array, lse, *scales, *offsets, alibi_slopes, sinks)),
    )
    if packed:
        _zero_outside(kernels, problem, out, offsets[0], lse)
    return out.array, lse


def run_backward(
    problem,
    dout,
    q,
    k,
    v,
    out,
    lse,
    deterministic,
    offsets=(None, None),
    alibi_slopes=None,
    excluded=(),
    capability=80,
    guard=False,
    tma=False,
    persistent_blocks=None,
    ordered=None,
    scheduled=None,
):
    """``(dq, dk, dv)`` of ``problem`` (as :func:`run_forward`; ``lse`` ``[B, H, S]``): the
    Delta kernel, the dK/dV kernel and either its float32 atomics for dQ and their
    conversion, or its dQ pass (deterministic calls, and the kernels without atomics);
    ``tma``: q, k, v and dout by bulk tensor copies, where the kernel takes them;
    ``persistent_blocks``: the dK/dV kernel's persistent role on that many blocks;
    ``ordered``: a deterministic call's dQ added in launch order where the kernel can
    (None: where the GPU's plan does, False: never); ``scheduled`` False: the persistent
    blocks' static walk where the GPU's plan gives a dense call its schedule."""
    head_dim, num_heads = problem.head_dim, problem.num_heads
    spec = registry.choose(
        "backward",
        problem.dtype,
        head_dim,
        capability,
        excluded=frozenset(excluded),
        tried=dispatch.tried(),
        modified=problem.modified,
        mask_only=problem.mask_only,
        head_dim_v=problem.head_dim_v,
    )
    ordered = (
        ordered is not False
        and deterministic
        and not problem.modified
        and tma
        and persistent_blocks is None
        and problem.packed is None
        and problem.kv_capacity > 0
        and spec.orders_dq(head_dim)
    )
    # the ordered dQ adds as the atomic one does, into a buffer with counters after it
    atomic = ordered or (not deterministic and spec.atomic_dq(head_dim))
    if spec.atomic_dq_needs_maps(head_dim) and not (tma and problem.packed is None):
        atomic = ordered = False  # the dQ pass, as the GPU's plan without the maps
    dq_spec = None if atomic else spec.dq_pass()
    # v narrower than q and k: the kernels that take it natively (as gpu.BackwardPlan)
    assert spec.takes_value_dims(head_dim, problem.head_dim_v), spec.name
    assert atomic or dq_spec.takes_value_dims(head_dim, problem.head_dim_v), dq_spec.name
    pieces = spec.precision == "float32"
    packed = problem.packed is not None
    # a dense float32 dQ is the atomics' buffer itself, else converted
    convert = atomic and (problem.dtype != np.float32 or packed)
    helpers = _helpers(
        "backward_delta",
        *(("backward_dq_convert",) if convert else ()),
        *(PIECES_HELPERS if pieces else ()),
        *(("packed_zero_outside",) if packed else ()),
    )
    if not atomic:
        helpers.append((dq_spec, False))
    persistent = persistent_blocks is not None
    if persistent:
        assert spec.persistent_keys is not None and not problem.modified, spec.name
    kernels = Kernels(problem, [(spec, atomic)] + helpers, capability, guard, persistent, ordered)

    accum_width = tile_traits.head_dim_class(head_dim) if atomic and spec.padded_dq else head_dim
    rows = math.prod(problem.lse_shape)
    delta = _poisoned(rows, np.float32)
    lse_log2 = _poisoned(rows, np.float32)
    dq = _Output(problem, num_heads, problem.q_len)
    dq_accum = None
    if atomic:
        # the ordered dQ's counters (int32, one a 64-row query tile) after its rows
        counters = problem.batch * num_heads * -(-problem.q_len // 64) if ordered else 0
        dq_accum = _poisoned(rows * accum_width + counters, np.float32) if convert else dq.array
    kernels.launch(
        "backward_delta",
        (math.ceil(problem.q_len / 4), num_heads, problem.batch),
        (
            kernel_params.delta_params(
                problem, _strides(dout), _strides(out), accum_width if atomic else 0, ordered
            ),
            (dout, out, lse, delta, lse_log2, dq_accum),
        ),
    )

    dk = _Output(problem, problem.num_kv_heads, problem.kv_capacity)
    dv = _Output(problem, problem.num_kv_heads, problem.kv_capacity)
    input_strides = [_strides(x) for x in (q, k, v, dout)]
    inputs, scales, strides = (q, k, v, dout), (), input_strides
    if pieces:
        made = [
            _pieces(kernels, x, rows)
            for x, rows in (
                (q, problem.q_len),
                (k, problem.kv_len),
                (v, problem.kv_len),
                (dout, problem.q_len),
            )
        ]
        inputs = tuple(x for hi, lo, _ in made for x in (hi, lo))
        scales = tuple(scale for _, _, scale in made)
        strides = [_contiguous_strides(hi.shape) for hi, _, _ in made]
    if problem.kv_capacity:
        maps = None
        if tma and spec.name == "backward_wgmma_ws":
            maps = kernel_params.backward_maps(
                problem,
                kernels.traits(spec.name),
                [x.shape for x in (q, k, v, dout)],
                strides,
                simulator.encode_tensor_map,
                accum_width if atomic else 0,
            )
        grid = _key_grid(problem, kernels.tile(spec.name))
        # the persistent blocks' schedule, as the GPU's plan builds it (kept alive here)
        table = None
        if persistent and scheduled is not False:
            traits = kernels.traits(spec.name)
            table = schedules.backward_schedule(
                problem, traits.tile, traits.template_args[0], persistent_blocks
            )
        params = kernel_params.backward_params(
            problem,
            strides,
            dk.strides,
            kernels.user(spec.name, "backward"),
            pieces,
            maps=maps,
            key_tiles=grid[0],
            schedule=0 if table is None else table.ctypes.data,
        )
        kernels.launch(
            spec.name,
            (persistent_blocks,) if persistent else grid,
            (
                params,
                (
                    *inputs,
                    lse_log2,
                    delta,
                    dq_accum,
                    dk.array,
                    dv.array,
                    *scales,
                    *offsets,
                    alibi_slopes,
                ),
            ),
        )
    if convert:
        count = math.prod(problem.q_shape)
        kernels.launch(
            "backward_dq_convert",
            (math.ceil(count / 512),),
            (
                kernel_params.dq_convert_params(problem, dq.strides, count, accum_width),
                (dq_accum, dq.array),
            ),
        )
    elif not atomic:  # the float32 pieces' own dQ pass reads the pieces, the others the inputs
        reads_pieces = dq_spec.precision == "float32"
        params = kernel_params.backward_params(
            problem,
            strides if reads_pieces else input_strides,
            dq.strides,
            kernels.user(dq_spec.name, "forward"),
            reads_pieces,
            dq_pass=True,
        )
        kernels.launch(
            dq_spec.name,
            _query_grid(problem, kernels.tile(dq_spec.name)),
            (
                params,
                (
                    *(inputs if reads_pieces else (q, k, v, dout)),
                    lse_log2,
                    delta,
                    dq.array,
                    *(scales if reads_pieces else ()),
                    *offsets,
                    alibi_slopes,
                ),
            ),
        )
    if packed:
        _zero_outside(kernels, problem, dq, offsets[0])
        _zero_outside(kernels, problem, dk, offsets[1])
        _zero_outside(kernels, problem, dv, offsets[1])
    # dV is written into rows of head_dim columns (the kernels' one dK/dV stride set)
    return dq.array, dk.array, np.ascontiguousarray(dv.array[..., : problem.head_dim_v])


def forward(
    q,
    k,
    v,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=False,
    window_size=0,
    kv_seq_len=None,
    softmax_scale=None,
    softcap=0.0,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    excluded=(),
    capability=80,
    sinks=None,
    head_dim_v=None,
    tma=True,
    persistent_blocks=None,
):
    """``(out, lse)`` of the forward kernel the registry chooses for ``capability``
    (``excluded``: kernels to pass over; ``head_dim_v``: v's head dim, for a kernel that
    takes one of its own; ``tma``: bulk tensor copies where a GPU's plan takes them, or
    cp.async everywhere; ``persistent_blocks``: see :func:`run_forward`)."""
    config = AttentionConfig(
        num_heads,
        num_kv_heads,
        head_dim,
        causal,
        window_size,
        kv_seq_len,
        softmax_scale,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        score_mod=score_mod,
        mask_mod=mask_mod,
        block_mask=block_mask,
        sinks=sinks,
        head_dim_v=head_dim_v,
    )
    problem = forward_problem(q, k, v, config)
    return run_forward(
        problem,
        q,
        k,
        v,
        alibi_slopes=alibi_slopes,
        excluded=excluded,
        capability=capability,
        sinks=sinks,
        tma=tma,
        persistent_blocks=persistent_blocks,
    )


def backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=False,
    window_size=0,
    kv_seq_len=None,
    softmax_scale=None,
    deterministic=False,
    softcap=0.0,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    excluded=(),
    capability=80,
    head_dim_v=None,
    tma=True,
    persistent_blocks=None,
    ordered=None,
    scheduled=None,
):
    """``(dq, dk, dv)`` of the backward the registry chooses for ``capability``
    (``head_dim_v``: v's head dim, for the kernels that take it natively; ``tma``: bulk
    tensor copies where a GPU's plan takes them, or cp.async; ``persistent_blocks``,
    ``ordered`` and ``scheduled``: see :func:`run_backward`)."""
    config = AttentionConfig(
        num_heads,
        num_kv_heads,
        head_dim,
        causal,
        window_size,
        kv_seq_len,
        softmax_scale,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        score_mod=score_mod,
        mask_mod=mask_mod,
        block_mask=block_mask,
        head_dim_v=head_dim_v,
    )
    problem = backward_problem(dout, q, k, v, out, lse, config, deterministic, True)
    return run_backward(
        problem,
        dout,
        q,
        k,
        v,
        out,
        lse,
        deterministic,
        alibi_slopes=alibi_slopes,
        excluded=excluded,
        capability=capability,
        tma=tma,
        persistent_blocks=persistent_blocks,
        ordered=ordered,
        scheduled=scheduled,
    )


def _packed(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    num_heads,
    num_kv_heads,
    head_dim,
    causal,
    window_size,
    extra_arrays=(),
    head_dim_v=None,
    modifiers=None,
):
    """The packed problem (``modifiers``: ``score_mod``, ``mask_mod``, ``block_mask``
    keywords of the call)."""
    config = AttentionConfig(
        num_heads,
        num_kv_heads,
        head_dim,
        causal,
        window_size,
        head_dim_v=head_dim_v,
        **(modifiers or {}),
    )
    return varlen_problem(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        config,
        False,
        extra_arrays=extra_arrays,
    ).attention


def varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=False,
    window_size=0,
    device_offsets=None,
    capability=80,
    guard=False,
    sinks=None,
    head_dim_v=None,
    modifiers=None,
    persistent_blocks=None,
):
    """``(out [total_q, H, D_v], lse [H, total_q])`` of a packed batch (validated with the
    host offsets; the kernels read ``device_offsets`` if given, as a GPU's garbage ones
    would be, else the same; ``modifiers``: the call's ``score_mod``, ``mask_mod``,
    ``block_mask`` keywords; ``persistent_blocks``: see :func:`run_forward`)."""
    problem = _packed(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        num_heads,
        num_kv_heads,
        head_dim,
        causal,
        window_size,
        head_dim_v=head_dim_v,
        modifiers=modifiers,
    )
    out, lse = run_forward(
        problem,
        *map(heads_first, (q, k, v)),
        offsets=device_offsets or (cu_seqlens_q, cu_seqlens_k),
        capability=capability,
        guard=guard,
        sinks=sinks,
        persistent_blocks=persistent_blocks,
    )
    return out, lse[0]


def varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    num_heads,
    num_kv_heads,
    head_dim,
    causal=False,
    window_size=0,
    deterministic=False,
    device_offsets=None,
    capability=80,
    guard=False,
    modifiers=None,
    persistent_blocks=None,
):
    """``(dq, dk, dv)`` of a packed batch (see :func:`varlen_forward`)."""
    problem = _packed(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        num_heads,
        num_kv_heads,
        head_dim,
        causal,
        window_size,
        extra_arrays=[("dout", dout), ("output", out)],
        modifiers=modifiers,
    )
    return run_backward(
        problem,
        *map(heads_first, (dout, q, k, v, out)),
        np.ascontiguousarray(lse[None]),
        deterministic,
        offsets=device_offsets or (cu_seqlens_q, cu_seqlens_k),
        capability=capability,
        guard=guard,
        persistent_blocks=persistent_blocks,
    )
