"""Block masks: the implementation of :mod:`cuflash.block_mask` (its docstring tells how
to use them). A :class:`BlockMask` classifies a mask function's tiles once, on the GPU
(``kernels/simt/classify_mask_cells.cu``) or from the NumPy evaluator, and folds the 16 x 16 cells
into each kernel's tile shape (``_View``, ``BlockMaskView`` in ``kernels/common/common.cuh``)."""

import math

import numpy as np

from ..errors import InvalidArgumentError
from ..gpu import kernel_build, standalone
from .api import MaskMod, index_grids

EMPTY, PARTIAL, FULL = 0, 1, 2
CELL = 16  # rows and keys of a classification cell (kernels/simt/classify_mask_cells.cu)
_CELLS_PER_BLOCK = 8


def _optional_count(name, value):
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgumentError(name, f"expected a positive int or None, got {value!r}")
    return int(value)


def create_block_mask(mask_mod, batch, heads, q_len, kv_len):
    """The :class:`BlockMask` of ``mask_mod`` for calls of these sizes.

    Parameters
    ----------
    mask_mod : cuflash.modifiers.MaskMod
        The mask function ``(b, h, q_idx, kv_idx) -> bool``.
    batch, heads : int or None
        The calls' batch size and query heads; None when the mask does not read ``b``
        (``h``): it is then classified once for all of them (with ``b = 0``, ``h = 0``).
    q_len, kv_len : int
        The calls' query rows and keys (``kv_seq_len``).

    Raises
    ------
    InvalidArgumentError
        For a ``mask_mod`` that is not a ``MaskMod``, sizes that are not positive, None
        for an index the mask reads, or reads outside its arrays for these sizes.
    """
    return BlockMask(mask_mod, batch, heads, q_len, kv_len)


class BlockMask:
    """A mask function and its tile classification; see :mod:`cuflash.block_mask`."""

    def __init__(self, mask_mod, batch, heads, q_len, kv_len):
        if not isinstance(mask_mod, MaskMod):
            raise InvalidArgumentError(
                "mask_mod", f"expected a cuflash.modifiers.MaskMod, got {type(mask_mod).__name__}"
            )
        self.mask_mod = mask_mod
        self.batch = _optional_count("batch", batch)
        self.heads = _optional_count("heads", heads)
        self.q_len = _optional_count("q_len", q_len)
        self.kv_len = _optional_count("kv_len", kv_len)
        if self.q_len is None or self.kv_len is None:
            raise InvalidArgumentError("q_len", "q_len and kv_len must be given")
        for name, size, index in (("batch", self.batch, "b"), ("heads", self.heads, "h")):
            if size is None and mask_mod.reads_index(index):
                raise InvalidArgumentError(
                    name,
                    f"{mask_mod.name} reads {index}: give the calls' {name} (None "
                    f"classifies one {index} for all)",
                )
        mask_mod.check_bounds(self.batch or 1, self.heads or 1, self.q_len, self.kv_len)
        self._cells = None  # (any_visible, all_visible) on the device, once classified
        self._views = {}

    def __repr__(self):
        return (
            f"BlockMask({self.mask_mod.name}, batch={self.batch}, heads={self.heads}, "
            f"q_len={self.q_len}, kv_len={self.kv_len})"
        )

    @property
    def entries(self):
        """(batch entries, heads) of the classification: 1 where broadcast."""
        return self.batch or 1, self.heads or 1

    def check_call(self, batch, num_heads, q_len, kv_len):
        """Raise ``InvalidArgumentError`` unless this block mask serves a call of these
        sizes."""
        for name, mine, call in (
            ("batch", self.batch, batch),
            ("num_heads", self.heads, num_heads),
            ("q_len", self.q_len, q_len),
            ("kv_len", self.kv_len, kv_len),
        ):
            if mine is not None and mine != call:
                raise InvalidArgumentError(
                    "block_mask",
                    f"made for {name}={mine}, the call has {name}={call} "
                    "(make a block mask for the call's sizes)",
                )

    # ............................................................ classification

    def classify(self):
        """Evaluate the mask on the GPU (CuPy's current device), once; returns self."""
        if self._cells is None:
            import cupy

            functors = kernel_build.UserFunctors.of(mask_mod=self.mask_mod)
            name = standalone.STANDALONE["classify_mask_cells"].name_expression()
            kernel = kernel_build.load_standalone(name, functors=functors)
            entries, heads = self.entries
            q_cells, kv_cells = math.ceil(self.q_len / CELL), math.ceil(self.kv_len / CELL)
            shape = (entries, heads, q_cells, kv_cells)
            any_visible = cupy.empty(shape, dtype=np.uint8)
            all_visible = cupy.empty(shape, dtype=np.uint8)
            arguments = self.mask_mod.kernel_arguments(cupy)[0]
            grid = (math.ceil(kv_cells / _CELLS_PER_BLOCK), q_cells, entries * heads)
            kernel(
                grid,
                (CELL * CELL,),
                (
                    arguments,
                    any_visible,
                    all_visible,
                    np.int32(heads),
                    np.int32(self.q_len),
                    np.int32(self.kv_len),
                    np.int32(q_cells),
                    np.int32(kv_cells),
                ),
            )
            self._cells = (any_visible, all_visible)
        return self

    def cpu_classes(self, rows, keys):
        """The classes of tiles of ``rows`` x ``keys`` ([entries, heads, query tiles, key
        tiles], uint8: 0 empty, 1 partial, 2 full), from the mask's NumPy evaluator (for
        tests and the docs; the kernels use :meth:`classify`'s)."""
        entries, heads = self.entries
        visible = self.mask_mod.numpy_mask(*index_grids(entries, heads, self.q_len, self.kv_len))
        visible = np.broadcast_to(visible, (entries, heads, self.q_len, self.kv_len))
        return _fold(np, visible, visible, rows, keys)  # an element is a cell

    def classes(self, rows, keys):
        """The classes of tiles of ``rows`` x ``keys`` on the device (as
        :meth:`cpu_classes`); rows and keys multiples of 16."""
        import cupy

        if rows % CELL or keys % CELL:
            raise ValueError(f"tiles of {rows} x {keys} are not whole {CELL} x {CELL} cells")
        any_visible, all_visible = self.classify()._cells
        return _fold(cupy, any_visible, all_visible, rows // CELL, keys // CELL)

    def view(self, direction, outer, inner, num_heads, num_kv_heads, host=False):
        """The arrays and strides a kernel reads (``kernels/common/common.cuh``,
        ``BlockMaskView``), for a kernel whose blocks own ``outer`` rows ("forward") or
        keys ("backward") and visit tiles of ``inner`` keys (rows); cached. ``host``: in
        host memory from :meth:`cpu_classes`, for host builds of the kernels (the
        test suite's simulator)."""
        key = (direction, outer, inner, num_heads, num_kv_heads, host)
        found = self._views.get(key)
        if found is None:
            found = self._views[key] = _View(
                self, direction, outer, inner, num_heads, num_kv_heads, host
            )
        return found


def _fold(xp, any_visible, all_visible, fold_q, fold_kv):
    """Classes of tiles of ``fold_q`` x ``fold_kv`` cells from each cell's any- and
    all-visible flags (``[entries, heads, q cells, kv cells]``; the padding past the last
    cell counts as neither)."""
    entries, heads, q_cells, kv_cells = any_visible.shape
    q_tiles, kv_tiles = -(-q_cells // fold_q), -(-kv_cells // fold_kv)
    pad = ((0, 0), (0, 0), (0, q_tiles * fold_q - q_cells), (0, kv_tiles * fold_kv - kv_cells))
    shape = (entries, heads, q_tiles, fold_q, kv_tiles, fold_kv)
    any_tile = xp.pad(any_visible, pad, constant_values=0).reshape(shape).max(axis=(3, 5))
    all_tile = xp.pad(all_visible, pad, constant_values=1).reshape(shape).min(axis=(3, 5))
    return xp.where(any_tile != 0, xp.where(all_tile != 0, FULL, PARTIAL), EMPTY).astype(np.uint8)


def _ranges(xp, nonempty):
    """[..., outer, 2] int32: per outer tile the inner tiles [lo, hi) outside which every
    tile is empty ([0, 0) when all are)."""
    inner = nonempty.shape[-1]
    has = nonempty.any(axis=-1)
    lo = xp.where(has, nonempty.argmax(axis=-1), 0)
    hi = xp.where(has, inner - nonempty[..., ::-1].argmax(axis=-1), 0)
    return xp.ascontiguousarray(xp.stack([lo, hi], axis=-1).astype(np.int32))


class _View:
    """One kernel tile shape's classes and ranges (``BlockMaskView`` in
    ``kernels/common/common.cuh``), on the device or (``host``) in host memory: ``fields()``
    gives its record's values."""

    def __init__(self, block_mask, direction, outer, inner, num_heads, num_kv_heads, host=False):
        if host:
            xp, classes_of = np, block_mask.cpu_classes
        else:
            import cupy

            xp, classes_of = cupy, block_mask.classes
        if direction == "forward":
            classes = classes_of(outer, inner)
        else:  # blocks own key tiles: [entries, heads, key tiles, query tiles]
            classes = xp.ascontiguousarray(classes_of(inner, outer).transpose(0, 1, 3, 2))
        entries, heads, outer_tiles, inner_tiles = classes.shape
        nonempty = classes != EMPTY
        range_heads = heads
        if direction == "backward" and heads > 1:  # a block serves a KV head's group
            group = num_heads // num_kv_heads
            nonempty = nonempty.reshape(entries, num_kv_heads, group, outer_tiles, inner_tiles).any(
                axis=2
            )
            range_heads = num_kv_heads
        self.classes = xp.ascontiguousarray(classes)
        self.ranges = _ranges(xp, nonempty)
        tile_count = outer_tiles * inner_tiles
        self.class_strides = (
            heads * tile_count if entries > 1 else 0,
            tile_count if heads > 1 else 0,
        )
        self.range_strides = (
            range_heads * outer_tiles * 2 if entries > 1 else 0,
            outer_tiles * 2 if range_heads > 1 else 0,
        )
        self.tiles = (outer_tiles, inner_tiles)

    def fields(self):
        """The ``BlockMaskView`` record's values, in order."""
        addresses = [
            a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr
            for a in (self.classes, self.ranges)
        ]
        return (*addresses, *self.class_strides, *self.range_strides, *self.tiles)
