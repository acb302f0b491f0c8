"""The GPU path: launch plans on CuPy's current device and stream.

A plan is built once per call signature (shapes, strides, dtype, options,
device, kernel path; see :mod:`cuflash.api`): the kernels the registry
chooses, their grids and blocks, and every scalar argument packed once into a
host buffer that each launch passes by pointer. A call then allocates its
outputs and launches; nothing else runs on the host.
"""

import math
import os

import cupy
import numpy as np

from .. import dispatch
from .. import sinks as attention_sinks
from ..core.problem import unit_last_stride
from . import kernel_build, kernel_params, registry, schedules, tensor_maps, tile_traits
from .kernel_launch import (
    NO_USER_ARGUMENTS,
    Float16Pieces,
    Launch,
    UserArguments,
    address,
    current_stream,
    device_capability,
    element_strides,
    multiprocessors,
    pieces_strides,
    rows_are_16_byte_aligned,
)

FLOAT32 = np.dtype(np.float32)


def persistent_launch(spec, problem):
    """Whether ``problem`` on ``spec`` (its forward or its dK/dV kernel) runs its
    persistent role: the registry's rule (``KernelSpec.persists``), or
    ``CUFLASH_PERSISTENT`` in the environment, ``1`` for every plain call of such a
    kernel and ``0`` for none (comparisons)."""
    if spec.persistent_keys is None or problem.modified:
        return False
    forced = os.environ.get("CUFLASH_PERSISTENT")
    if forced in ("0", "1"):
        return forced == "1"
    return spec.persists(problem.modified, problem.keys_a_row_sees())


def _query_grid(problem):
    """Rows a head and batch entries a grid covers over the queries: the dense problem's
    (q_len, batch), a packed one's (longest sequence, sequence count)."""
    packed = problem.packed
    return (problem.q_len, problem.batch) if packed is None else (packed.max_q_len, packed.count)


def _key_grid(problem):
    """The same over the keys: (kv_capacity, batch), or (longest sequence, count)."""
    packed = problem.packed
    return (
        (problem.kv_capacity, problem.batch)
        if packed is None
        else (packed.max_kv_len, packed.count)
    )


def choose(problem, direction, aligned):
    """The registry's kernel for ``problem`` in ``direction`` on the current device."""
    capability = device_capability()[1]
    return registry.choose(
        direction,
        problem.dtype,
        problem.head_dim,
        capability,
        allow_tf32=problem.allow_tf32,
        tensor_cores=aligned and dispatch.current() == "auto",
        excluded=dispatch.excluded(),
        modified=problem.modified,
        mask_only=problem.mask_only,
        head_dim_v=problem.head_dim_v,
        tried=dispatch.tried(),
        keys_a_row_sees=problem.keys_a_row_sees() if direction == "forward" else None,
    )


def _contiguous_slopes(alibi_slopes):
    """The kernels read the slopes (and the sinks) as a C-contiguous ``[H]`` or ``[B, H]``
    array (a strided view, e.g. a column of a bigger table, is copied; None stays
    None)."""
    if alibi_slopes is None or alibi_slopes.flags.c_contiguous:
        return alibi_slopes
    return cupy.ascontiguousarray(alibi_slopes)


def _user_arguments(problem, spec, direction):
    """The :class:`UserArguments` of ``spec``'s launches for ``problem``; its block mask's
    view when the kernel reads one."""
    if problem.score_mod is None and problem.mask_mod is None:
        return NO_USER_ARGUMENTS
    view = None
    tiles = spec.block_mask_tiles(problem.head_dim)
    if problem.block_mask is not None and tiles is not None:
        view = problem.block_mask.view(direction, *tiles, problem.num_heads, problem.num_kv_heads)
    return UserArguments(problem, view)


def _functors(problem):
    return kernel_build.UserFunctors.of(
        problem.score_mod,
        problem.mask_mod,
        built_ins=problem.softcap > 0 or problem.alibi_slopes_shape is not None,
    )


def _variant(problem):
    sm = registry.generation(device_capability()[1])
    head_dim_v = None if problem.head_dim_v == problem.head_dim else problem.head_dim_v
    return kernel_build.load(kernel_build.Variant(problem.dtype, problem.head_dim, sm, head_dim_v))


class OutputLayout:
    """Where a plan's output of ``heads`` heads and ``rows`` rows a head lives: a dense
    problem's outputs are contiguous ``[B, heads, rows, D]``, a packed one's contiguous
    ``[rows, heads, D]`` (tokens first, as its inputs), D the problem's head_dim or
    ``width``; ``strides`` are the element strides of the batch, head and row axes as the
    kernels take them."""

    def __init__(self, problem, heads, rows, width=None):
        d = problem.head_dim if width is None else width
        if problem.packed is None:
            self.shape = (problem.batch, heads, rows, d)
            self.strides = (np.int64(heads * rows * d), np.int64(rows * d), np.int64(d))
        else:
            self.shape = (rows, heads, d)
            self.strides = (np.int64(rows * heads * d), np.int64(d), np.int64(heads * d))
        self.dtype = problem.dtype

    def empty(self):
        return cupy.ndarray(self.shape, self.dtype)


def _zero_outside(loaded, problem, layout, rows):
    """The launch that zeroes a packed output's rows outside every sequence, or None
    (dense): ``launch(stream, output, offsets)`` (addresses)."""
    if problem.packed is None:
        return None
    d = layout.shape[-1]
    return Launch.of_role(
        loaded,
        "packed_zero_outside",
        (64,),
        kernel_params.zero_outside_params(
            problem.packed.count, rows, layout.shape[1], layout.shape[1] * d
        ),
    )


class ForwardPlan:
    """The launches of one forward signature (v narrower than q and k where the kernel
    takes it: :meth:`takes_value_dims`)."""

    def __init__(self, problem, q, k, v):
        self.problem = problem
        contiguous_rows = [unit_last_stride(cupy, a) for a in (q, k, v)]
        self.copies = any(a is not b for a, b in zip(contiguous_rows, (q, k, v)))
        q, k, v = contiguous_rows
        self.spec = choose(problem, "forward", rows_are_16_byte_aligned((q, k, v)))
        if not self.spec.takes_value_dims(problem.head_dim, problem.head_dim_v):
            raise ValueError(f"{self.spec.name} does not take head_dim_v (pad v instead)")
        loaded = _variant(problem)
        rows, batch = _query_grid(problem)
        traits = self.spec.traits_of(problem.head_dim, problem.modified)
        query_tiles = math.ceil(rows / traits.tile)
        grid = (query_tiles, problem.num_heads, batch)
        self.persistent = persistent = persistent_launch(self.spec, problem)
        if persistent:  # a block an SM, walking every tile
            grid = (min(math.prod(grid), multiprocessors(device_capability()[0])),)
        self.out = OutputLayout(problem, problem.num_heads, problem.q_len, problem.head_dim_v)
        self.pieces = None
        if self.spec.precision == "float32":  # float16 pieces of q, k and v
            self.pieces = [
                Float16Pieces(loaded, x.shape, element_strides(x), rows)
                for x, rows in ((q, problem.q_len), (k, problem.kv_len), (v, problem.kv_len))
            ]
            strides = [pieces_strides(p) for p in self.pieces]
        else:
            strides = [element_strides(x) for x in (q, k, v)]
        self.user = _user_arguments(problem, self.spec, "forward")
        params = kernel_params.forward_params(
            problem,
            *strides,
            self.out.strides,
            self.user,
            pieces=self.pieces is not None,
            query_tiles=query_tiles,
        )
        role = self.spec.role(modified=problem.modified, persistent=persistent)
        self.main = Launch.of_role(loaded, role, grid, params, _functors(problem))
        # The same kernel with q, k and v by the copy engine, where it can address them.
        self.main_tma = None
        if self.spec.name == "forward_wgmma_ws" and tensor_maps.available():
            maps = kernel_params.forward_maps(
                problem,
                traits,
                [x.shape for x in (q, k, v)],
                strides,
                tensor_maps.TileMap.encode_into,
            )
            if maps is not None:
                with_maps = kernel_params.forward_params(
                    problem,
                    *strides,
                    self.out.strides,
                    self.user,
                    maps=maps,
                    query_tiles=query_tiles,
                )
                self.main_tma = Launch.of_role(loaded, role, grid, with_maps, _functors(problem))
        self.zero_outside = _zero_outside(loaded, problem, self.out, problem.q_len)

    @staticmethod
    def takes_value_dims(problem, q, k, v):
        """Does the kernel a plan of ``problem`` runs take its v's head dim as it is
        (``cuflash.gpu.value_dims`` pads the calls of those that do not)?"""
        arrays = [unit_last_stride(cupy, a) for a in (q, k, v)]
        spec = choose(problem, "forward", rows_are_16_byte_aligned(arrays))
        return spec.takes_value_dims(problem.head_dim, problem.head_dim_v)

    def __call__(self, q, k, v, offsets=(None, None), alibi_slopes=None, sinks=None):
        """``(out, lse)``; ``offsets``: a packed problem's ``cu_seqlens_q``, ``cu_seqlens_k``
        (out then ``[total_q, H, D]``, zeros in rows outside every sequence);
        ``alibi_slopes`` as the problem says; ``sinks``: float32 ``[H]`` attention sinks
        (every forward kernel's row finish adds them), or None."""
        problem = self.problem
        if self.copies:  # a last stride other than 1 (the signature fixes which)
            q, k, v = (unit_last_stride(cupy, a) for a in (q, k, v))
        alibi_slopes, sinks = _contiguous_slopes(alibi_slopes), _contiguous_slopes(sinks)
        out = self.out.empty()
        lse = cupy.ndarray(problem.lse_shape, FLOAT32)
        stream = current_stream()
        tail = (
            out.data.ptr,
            lse.data.ptr,
            address(offsets[0]),
            address(offsets[1]),
            address(alibi_slopes),
            address(sinks),
        )
        if self.pieces is None:
            addresses = (q.data.ptr, k.data.ptr, v.data.ptr)
            # The maps read every key row of the arrays' kv_len: not for entries that see
            # their own key counts (offsets[1] without offsets[0]: the KV cache's chunks).
            launch = self.main
            if (
                self.main_tma is not None
                and offsets[1] is None
                and not (addresses[0] | addresses[1] | addresses[2]) & 15
            ):
                launch = self.main_tma
            try:
                launch(stream, *addresses, *tail)
            except tensor_maps.TensorMapError:
                self.main_tma = None  # the driver refuses these arrays: cp.async
                self.main(stream, *addresses, *tail)
        else:
            (qh, ql, qs), (kh, kl, ks), (vh, vl, vs) = (
                pieces(stream, x) for pieces, x in zip(self.pieces, (q, k, v))
            )
            self.main(
                stream,
                *(x.data.ptr for x in (qh, ql, kh, kl, vh, vl)),
                *tail[:2],
                *(x.data.ptr for x in (qs, ks, vs)),
                *tail[2:],
            )
        if self.zero_outside is not None:
            self.zero_outside(stream, out.data.ptr, tail[2], lse.data.ptr)
        return out, lse


class BackwardPlan:
    """The launches of one backward signature (atomic or deterministic; v narrower than q
    and k where its kernels take it: :meth:`takes_value_dims`)."""

    def __init__(
        self, problem, dout, q, k, v, output, lse_is_contiguous, deterministic, order_dq=True
    ):
        if not self.takes_value_dims(problem, dout, q, k, v, output, deterministic=deterministic):
            raise ValueError("this backward takes one head dim (pad v instead)")
        self.problem = problem
        self.deterministic = deterministic
        given = (dout, q, k, v, output)
        dout, q, k, v, output = (unit_last_stride(cupy, a) for a in given)
        self.copies = (
            any(a is not b for a, b in zip((dout, q, k, v, output), given)) or not lse_is_contiguous
        )
        self.spec = choose(problem, "backward", rows_are_16_byte_aligned((q, k, v, dout)))
        loaded = _variant(problem)
        # dQ by float32 atomics in the dK/dV kernel, or by a pass of its own; a
        # deterministic call whose arrays the copy engine maps adds it in the blocks'
        # launch order where the kernel can (ordered_dq: the same additions, in one order).
        self.atomic = not deterministic and self.spec.atomic_dq(problem.head_dim)
        # CUFLASH_PERSISTENT=1 (comparisons) sends deterministic calls to the persistent
        # role and its dQ pass: the ordered dQ runs a block a tile.
        self.persistent = persistent = persistent_launch(self.spec, problem)
        dq_width = tile_traits.head_dim_class(problem.head_dim)
        maps, self.ordered = None, False
        if self.spec.name == "backward_wgmma_ws" and tensor_maps.available():
            self.ordered = (
                order_dq
                and deterministic
                and not persistent
                and not problem.modified  # a user's mask alone: a block a tile, dQ's pass
                and self.spec.orders_dq(problem.head_dim)
                and self.spec.name + registry.ORDERED_DQ not in dispatch.excluded()
                and not (q.data.ptr | k.data.ptr | v.data.ptr | dout.data.ptr) & 15
            )
            maps = kernel_params.backward_maps(
                problem,
                self.spec.traits(problem.head_dim),
                [x.shape for x in (q, k, v, dout)],
                [element_strides(x) for x in (q, k, v, dout)],
                tensor_maps.TileMap.encode_into,
                dq_width if self.atomic or self.ordered else 0,
            )
            self.ordered = self.ordered and maps is not None
        # The kernels whose dQ additions need the maps take the dQ pass without them, and
        # so do the calls whose arrays turn out not to map (``needs_maps``, __call__).
        self.needs_maps = self.spec.atomic_dq_needs_maps(problem.head_dim) and (
            self.atomic or self.ordered
        )
        if self.needs_maps and maps is None:
            self.atomic = self.ordered = self.needs_maps = False
        self._dq_pass_plan = None  # the dQ pass's, where the ordered dQ cannot run
        self.adds_dq = adds_dq = self.atomic or self.ordered
        self.dq_layout = OutputLayout(problem, problem.num_heads, problem.q_len)
        self.dkv_layout = OutputLayout(problem, problem.num_kv_heads, problem.kv_capacity)
        keys = self.spec.traits(problem.head_dim).tile
        key_rows, batch = _key_grid(problem)
        key_tiles = math.ceil(key_rows / keys)
        grid = (key_tiles, problem.num_kv_heads, batch)
        # Persistent: a block an SM, walking every tile, by the plan's schedule where it
        # knows the tiles' work (dense calls), kept on the device with the plan.
        self.schedule, schedule = None, 0
        if persistent:
            grid = (min(math.prod(grid), multiprocessors(device_capability()[0])),)
            traits = self.spec.traits(problem.head_dim)
            table = schedules.backward_schedule(
                problem, traits.tile, traits.template_args[0], grid[0]
            )
            if table is not None:
                self.schedule = cupy.asarray(table)
                schedule = self.schedule.data.ptr
        role = self.spec.role(
            atomic_dq=self.atomic,
            modified=problem.modified,
            persistent=persistent,
            ordered_dq=self.ordered,
        )
        self.pieces = None
        if self.spec.precision == "float32":
            self.pieces = [
                Float16Pieces(loaded, x.shape, element_strides(x), rows)
                for x, rows in (
                    (q, problem.q_len),
                    (k, problem.kv_len),
                    (v, problem.kv_len),
                    (dout, problem.q_len),
                )
            ]
            strides = [pieces_strides(p) for p in self.pieces]
        else:
            strides = [element_strides(x) for x in (q, k, v, dout)]
        self.user = _user_arguments(problem, self.spec, "backward")
        # The ordered dQ's kernel runs with the maps only (no cp.async launch), as does
        # the atomic one that needs them.
        self.dkdv = None
        if not (self.ordered or self.needs_maps):
            self.dkdv = Launch.of_role(
                loaded,
                role,
                grid,
                kernel_params.backward_params(
                    problem,
                    strides,
                    self.dkv_layout.strides,
                    self.user,
                    pieces=self.pieces is not None,
                    key_tiles=key_tiles,
                    schedule=schedule,
                ),
                _functors(problem),
            )
        # The same kernel with q, k, v and dout by the copy engine, where it can
        # address them.
        self.dkdv_tma = None
        if maps is not None:
            with_maps = kernel_params.backward_params(
                problem,
                strides,
                self.dkv_layout.strides,
                self.user,
                maps=maps,
                key_tiles=key_tiles,
                schedule=schedule,
            )
            self.dkdv_tma = Launch.of_role(loaded, role, grid, with_maps, _functors(problem))
        self.dq = self.convert = None
        self.dq_reads_pieces = False
        accum_width = problem.head_dim
        rows, batch = _query_grid(problem)
        if not adds_dq:  # dQ by a pass of its own over the keys
            dq_spec = self.spec.dq_pass()
            # The float32 pieces' own dQ kernel reads the pieces; the others the inputs.
            self.dq_reads_pieces = dq_spec.precision == "float32"
            dq_strides = (
                strides if self.dq_reads_pieces else [element_strides(x) for x in (q, k, v, dout)]
            )
            tile = dq_spec.traits(problem.head_dim).tile
            self.dq = Launch.of_role(
                loaded,
                dq_spec.role(modified=problem.modified),
                (math.ceil(rows / tile), problem.num_heads, batch),
                kernel_params.backward_params(
                    problem,
                    dq_strides,
                    self.dq_layout.strides,
                    _user_arguments(problem, dq_spec, "forward"),
                    pieces=self.dq_reads_pieces,
                    dq_pass=True,
                ),
                _functors(problem),
            )
        elif problem.dtype != np.float32 or problem.packed is not None:
            # The float32 atomics' buffer into dQ's dtype and layout (a dense float32
            # dQ is that buffer itself).
            count = math.prod(problem.q_shape)
            if self.spec.padded_dq:
                accum_width = dq_width
            self.convert = Launch.of_role(
                loaded,
                "backward_dq_convert",
                (math.ceil(count / 512),),
                kernel_params.dq_convert_params(
                    problem, self.dq_layout.strides, count, accum_width
                ),
            )
        self.row_bytes = -(-4 * math.prod(problem.lse_shape) // 256) * 256
        self.dq_bytes = 0
        if self.convert is not None:
            self.dq_bytes = 4 * math.prod(problem.q_shape) // problem.head_dim * accum_width
        if self.ordered:  # an int counter a 64-row query tile (ordered_dq_counter, common.cuh)
            self.dq_bytes += 4 * problem.batch * problem.num_heads * -(-problem.q_len // 64)
        self.workspace_bytes = 2 * self.row_bytes + self.dq_bytes
        # Delta, lse log2 e, and zeros in the float32 dQ the atomics add into (its own
        # array for a dense float32 problem, else the workspace's), a row a warp.
        self.delta = Launch.of_role(
            loaded,
            "backward_delta",
            (math.ceil(problem.q_len / 4), problem.num_heads, problem.batch),
            kernel_params.delta_params(
                problem,
                element_strides(dout),
                element_strides(output),
                accum_width if adds_dq else 0,
                counters=self.ordered,
            ),
        )
        self.zero_outside_q = _zero_outside(loaded, problem, self.dq_layout, problem.q_len)
        self.zero_outside_k = _zero_outside(loaded, problem, self.dkv_layout, problem.kv_capacity)

    def _dq_pass(self, dout, q, k, v, output):
        """The plan of this signature with dQ by its own pass (built on first need: the
        ordered dQ's maps refused, or arrays off the 16-byte grid)."""
        if self._dq_pass_plan is None:
            self._dq_pass_plan = BackwardPlan(
                self.problem, dout, q, k, v, output, True, True, order_dq=False
            )
        return self._dq_pass_plan

    @staticmethod
    def takes_value_dims(problem, dout, q, k, v, output, *rest, deterministic=False):
        """Do the kernels a plan of ``problem`` runs (dK/dV, and the dQ pass where dQ is
        not added by atomics) take its v's head dim as it is (``cuflash.gpu.value_dims`` pads
        the calls of those that do not)?"""
        if problem.head_dim_v == problem.head_dim:
            return True
        arrays = [unit_last_stride(cupy, a) for a in (q, k, v, dout)]
        spec = choose(problem, "backward", rows_are_16_byte_aligned(arrays))
        if not spec.takes_value_dims(problem.head_dim, problem.head_dim_v):
            return False
        atomic = not deterministic and spec.atomic_dq(problem.head_dim)
        return atomic or spec.dq_pass().takes_value_dims(problem.head_dim, problem.head_dim_v)

    def __call__(
        self,
        dout,
        q,
        k,
        v,
        output,
        lse,
        synchronize,
        offsets=(None, None),
        alibi_slopes=None,
        sinks=None,
    ):
        """``(dq, dk, dv)``; ``offsets`` and ``alibi_slopes`` as in
        :meth:`ForwardPlan.__call__` (a packed problem's gradients tokens first, zeros in
        rows outside every sequence); with ``sinks``, ``dsinks`` fourth (a CuPy reduction
        of the lse and the Delta rows: the kernels need no sinks, the lse holds them)."""
        problem = self.problem
        if self.copies:  # a last stride other than 1, or lse not contiguous
            dout, q, k, v, output = (unit_last_stride(cupy, a) for a in (dout, q, k, v, output))
            lse = cupy.ascontiguousarray(lse)
        if (self.ordered or self.needs_maps) and (
            self.dkdv_tma is None or (q.data.ptr | k.data.ptr | v.data.ptr | dout.data.ptr) & 15
        ):
            return self._dq_pass(dout, q, k, v, output)(
                dout, q, k, v, output, lse, synchronize, offsets, alibi_slopes, sinks
            )
        alibi_slopes = _contiguous_slopes(alibi_slopes)
        stream = current_stream()
        # One workspace: Delta and lse * log2(e) (float32 rows), and the float32 dQ of
        # the atomic backward when it needs converting, at 256-byte boundaries.
        workspace = cupy.cuda.alloc(self.workspace_bytes)
        delta, lse_log2 = workspace.ptr, workspace.ptr + self.row_bytes
        if not self.adds_dq:
            dq = self.dq_layout.empty()
            dq_target = dq.data.ptr
        elif self.convert is None:  # dense float32: the atomics' buffer is dQ
            dq = cupy.ndarray(problem.q_shape, FLOAT32)
            dq_target = dq.data.ptr
        else:
            dq_target = workspace.ptr + 2 * self.row_bytes
        self.delta(
            stream,
            dout.data.ptr,
            output.data.ptr,
            lse.data.ptr,
            delta,
            lse_log2,
            dq_target if self.adds_dq else 0,
        )
        # dK and dV take one set of strides in the kernels: a narrower dV is written into
        # rows of head_dim columns and its first head_dim_v are copied out at the end.
        dk, dv = self.dkv_layout.empty(), self.dkv_layout.empty()
        tail = (address(offsets[0]), address(offsets[1]), address(alibi_slopes))
        inputs, scales = (q.data.ptr, k.data.ptr, v.data.ptr, dout.data.ptr), ()
        if self.pieces is None:
            kernel_inputs, kernel_scales = inputs, scales
        else:  # the pieces kernels' inputs (a dQ kernel of the registry takes plain ones)
            pieces = [p(stream, x) for p, x in zip(self.pieces, (q, k, v, dout))]
            kernel_inputs = tuple(x.data.ptr for hi, lo, _ in pieces for x in (hi, lo))
            kernel_scales = tuple(scale.data.ptr for _, _, scale in pieces)
            if self.dq_reads_pieces:
                inputs, scales = kernel_inputs, kernel_scales
        if problem.kv_capacity:
            call = (
                *kernel_inputs,
                lse_log2,
                delta,
                dq_target,
                dk.data.ptr,
                dv.data.ptr,
                *kernel_scales,
                *tail,
            )
            if (
                self.dkdv_tma is not None
                and not (inputs[0] | inputs[1] | inputs[2] | inputs[3]) & 15
            ):
                try:
                    self.dkdv_tma(stream, *call)
                except tensor_maps.TensorMapError:
                    self.dkdv_tma = None  # the driver refuses these arrays: cp.async
                    if self.ordered or self.needs_maps:  # or the dQ pass
                        return self._dq_pass(dout, q, k, v, output)(
                            dout, q, k, v, output, lse, synchronize, offsets, alibi_slopes, sinks
                        )
                    self.dkdv(stream, *call)
            else:
                self.dkdv(stream, *call)
        if self.dq is not None:
            self.dq(stream, *inputs, lse_log2, delta, dq.data.ptr, *scales, *tail)
        elif self.convert is not None:
            dq = self.dq_layout.empty()
            self.convert(stream, dq_target, dq.data.ptr)
        if self.zero_outside_q is not None:
            self.zero_outside_q(stream, dq.data.ptr, tail[0], 0)
            self.zero_outside_k(stream, dk.data.ptr, tail[1], 0)
            self.zero_outside_k(stream, dv.data.ptr, tail[1], 0)
        dsinks = None
        if sinks is not None:  # queued last: the host builds its CuPy steps under the kernels
            rows = cupy.ndarray(problem.lse_shape, FLOAT32, memptr=workspace)  # Delta
            dsinks = attention_sinks.gradient(cupy, sinks, lse, rows, 1)
        if problem.head_dim_v != problem.head_dim:
            dv = cupy.ascontiguousarray(dv[..., : problem.head_dim_v])
        if synchronize:
            cupy.cuda.get_current_stream().synchronize()
        return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)
