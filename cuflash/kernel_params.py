"""The kernels' parameter structs as host records.

Each attention kernel kind takes one struct, defined once in ``kernels/params.cuh``
(``ForwardParams``, ...). This module reads those definitions and lays out the
matching NumPy records by the C rules (each member at a multiple of its alignment,
the size a multiple of the largest), so the host sets members by name and a member
the kernels do not declare is an error when a plan is built, not a wrong result on
a GPU. ``tests/test_kernel_params.py`` holds the layout against the C++
compiler's ``offsetof``.

A launch (``cuflash.gpu.Launch``) passes the record whole; :class:`Params` fixes its
members once a plan and writes only the call's device addresses at each launch.
"""

import functools
import re
import struct
from pathlib import Path

import numpy as np

from . import tensor_maps
from .modifiers.cxx import MODIFIER_ARRAYS_DTYPE

#: log2(e): the kernels take the softmax scale times it (their exponentials are base 2).
LOG2E = 1.4426950408889634

PARAMS_HEADER = Path(__file__).resolve().parent / "kernels" / "params.cuh"

#: ``Strides`` of ``kernels/common.cuh``: element strides of the batch, head and row axes.
STRIDES_DTYPE = np.dtype([("b", "<i8"), ("h", "<i8"), ("s", "<i8")])

#: ``UserModifierArgs`` of ``kernels/common.cuh``: the arrays of the user's score and
#: mask functions and a block mask's view (``BlockMaskView``'s members flattened).
USER_ARGS_DTYPE = np.dtype(
    {
        "names": [
            "score_arrays",
            "mask_arrays",
            "classes",
            "ranges",
            "class_batch_stride",
            "class_head_stride",
            "range_batch_stride",
            "range_head_stride",
            "outer_tiles",
            "inner_tiles",
        ],
        "formats": [
            MODIFIER_ARRAYS_DTYPE,
            MODIFIER_ARRAYS_DTYPE,
            "<u8",
            "<u8",
            "<i8",
            "<i8",
            "<i8",
            "<i8",
            "<i4",
            "<i4",
        ],
        "offsets": [
            0,
            MODIFIER_ARRAYS_DTYPE.itemsize,
            *(2 * MODIFIER_ARRAYS_DTYPE.itemsize + 8 * i for i in range(6)),
            2 * MODIFIER_ARRAYS_DTYPE.itemsize + 48,
            2 * MODIFIER_ARRAYS_DTYPE.itemsize + 52,
        ],
        "itemsize": 2 * MODIFIER_ARRAYS_DTYPE.itemsize + 56,
    }
)

# member type -> (NumPy format, alignment)
_SCALARS = {"int": ("<i4", 4), "float": ("<f4", 4), "long long": ("<i8", 8)}
#: ``TensorMap`` of ``kernels/params.cuh``: a CUtensorMap's 128 bytes, 64-byte aligned.
TENSOR_MAP_DTYPE = np.dtype(("<u8", (16,)))
_RECORDS = {
    "Strides": (STRIDES_DTYPE, 8),
    "UserModifierArgs": (USER_ARGS_DTYPE, 8),
    "TensorMap": (TENSOR_MAP_DTYPE, 64),
}
_POINTER = ("<u8", 8)

_STRUCT = re.compile(r"^struct (\w+) \{\n(.*?)^\};", re.S | re.M)
_MEMBER = re.compile(r"^\s*(?:const\s+)?(long long|\w+)\s*(\*?)\s*(\w+);$")


def members(text=None):
    """``{struct: [(member, C type), ...]}`` of ``kernels/params.cuh`` (or ``text``), a
    pointer's type written ``T*``; ValueError for a line the layout cannot read."""
    text = PARAMS_HEADER.read_text() if text is None else text
    found = {}
    for m in _STRUCT.finditer(text):
        fields = []
        for line in m.group(2).splitlines():
            line = line.split("//", 1)[0].strip()
            if not line:
                continue
            d = _MEMBER.match(line)
            if d is None:
                raise ValueError(f"{m.group(1)}: a member the host cannot lay out: {line!r}")
            ctype = d.group(1) + "*" if d.group(2) else d.group(1)
            if not d.group(2) and ctype not in _SCALARS and ctype not in _RECORDS:
                raise ValueError(f"{m.group(1)}.{d.group(3)}: unknown type {ctype}")
            fields.append((d.group(3), ctype))
        found[m.group(1)] = fields
    return found


def _format_of(ctype):
    if ctype.endswith("*"):
        return _POINTER
    return _SCALARS.get(ctype) or _RECORDS[ctype]


@functools.cache
def layout(name):
    """The NumPy dtype of struct ``name`` of ``kernels/params.cuh``, laid out as C does."""
    names, formats, offsets, offset, widest = [], [], [], 0, 1
    for member, ctype in members()[name]:
        fmt, align = _format_of(ctype)
        offset = -(-offset // align) * align
        names.append(member)
        formats.append(fmt)
        offsets.append(offset)
        offset += np.dtype(fmt).itemsize
        widest = max(widest, align)
    itemsize = -(-offset // widest) * widest
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize})


def _aligned_record(dtype, alignment=64):
    """One zeroed record of ``dtype`` at an address that is a multiple of ``alignment``
    (a tensor map's, for the driver that encodes it in place)."""
    raw = np.zeros(dtype.itemsize + alignment, dtype=np.uint8)
    skip = -raw.ctypes.data % alignment
    return raw[skip : skip + dtype.itemsize].view(dtype)


class Params:
    """One launch's record of struct ``name``: the members in ``fields`` fixed now (a
    ``Strides`` member from a 3-tuple, ``user_args`` from a ``UserModifierArgs`` record,
    pointers as ints), the pointers ``per_call`` (in the struct's order) written at each
    launch by ``pack(*addresses)`` (0 for null); every other member zero (null). ``keep``: objects
    whose memory the record points into.

    ``maps``: ``{member: (address member, map, encode)}``, tensor-map members that
    ``pack`` encodes from a per-call address, ``encode(map, destination, address)``
    (e.g. :meth:`cuflash.tensor_maps.TileMap.encode_into`), only when that address
    differs from the last call's."""

    __slots__ = (
        "name",
        "record",
        "address",
        "per_call",
        "keep",
        "pack",
        "_pack_addresses",
        "_maps",
        "_last",
    )

    def __init__(self, name, per_call, keep=(), maps=None, **fields):
        dtype = layout(name)
        self.name, self.per_call, self.keep = name, tuple(per_call), tuple(keep)
        self.record = _aligned_record(dtype)
        for member, value in fields.items():
            if member not in dtype.fields:
                raise KeyError(f"{name} has no member {member!r}")
            self.record[member] = value
        offsets = []
        for member in self.per_call:
            if member not in dtype.fields or dtype.fields[member][0] != np.dtype(_POINTER[0]):
                raise KeyError(f"{name} has no pointer member {member!r}")
            offsets.append(dtype.fields[member][1])
        if offsets != sorted(set(offsets)):
            raise ValueError(f"{name}: per-call members out of the struct's order: {per_call}")
        start = offsets[0] if offsets else 0
        # The span the addresses are packed into (the pad bytes between them zeroed)
        # holds no member fixed here.
        span = range(start, offsets[-1] + 8) if offsets else range(0)
        for member in fields:
            if dtype.fields[member][1] in span:
                raise ValueError(f"{name}.{member} is fixed inside the per-call addresses")
        layout_text, at = "<", start
        for offset in offsets:
            layout_text += f"{offset - at}xQ" if offset > at else "Q"
            at = offset + 8
        self.address = self.record.ctypes.data
        self._pack_addresses = functools.partial(
            struct.Struct(layout_text).pack_into, self.record, start
        )
        self.pack = self._pack_addresses
        self._maps = []
        for member, (source, tile_map, encode) in (maps or {}).items():
            if member not in dtype.fields or dtype.fields[member][0] != TENSOR_MAP_DTYPE:
                raise KeyError(f"{name} has no tensor map member {member!r}")
            if source not in self.per_call:
                raise KeyError(f"{name}.{member}: {source!r} is not a per-call address")
            destination = self.address + dtype.fields[member][1]
            self._maps.append((self.per_call.index(source), tile_map, encode, destination))
        if self._maps:
            self._last = [None] * len(self._maps)
            self.pack = self._pack_with_maps

    def _pack_with_maps(self, *addresses):
        self._pack_addresses(*addresses)
        for i, (source, tile_map, encode, destination) in enumerate(self._maps):
            address = addresses[source]
            if address != self._last[i]:
                self._last[i] = None  # a failed encoding leaves no stale map behind
                encode(tile_map, destination, address)
                self._last[i] = address

    def __getitem__(self, member):
        return self.record[member][0]


#: The members of ``ForwardParams`` a forward launch writes at each call, in order.
FORWARD_ADDRESSES = (
    "q",
    "k",
    "v",
    "out",
    "lse",
    "offsets_q",
    "offsets_k",
    "alibi_slopes",
    "sinks",
)
FORWARD_PIECES_ADDRESSES = (
    FORWARD_ADDRESSES[:3]
    + (
        "q_lo",
        "k_lo",
        "v_lo",
        "q_scales",
        "k_scales",
        "v_scales",
    )
    + FORWARD_ADDRESSES[3:]
)


def forward_params(
    problem, q_strides, k_strides, v_strides, out_strides, user, pieces=False, maps=None
):
    """The ``ForwardParams`` of ``problem``'s forward launches (``kernels/params.cuh``):
    the arrays' element strides (``(batch, head, row)`` each), the user's modifier
    arguments (:class:`UserArguments`, or a ``UserModifierArgs`` record), the pieces
    kernels' addresses with ``pieces``; the call's addresses written at each launch
    (:data:`FORWARD_ADDRESSES`, or :data:`FORWARD_PIECES_ADDRESSES`). ``maps``
    (:func:`forward_maps`): q, k and v by the copy engine (``use_tma``)."""
    left, right = problem.window
    record = getattr(user, "record", user)
    return Params(
        "ForwardParams",
        FORWARD_PIECES_ADDRESSES if pieces else FORWARD_ADDRESSES,
        keep=(user,),
        maps=maps,
        use_tma=int(maps is not None),
        q_st=tuple(q_strides),
        k_st=tuple(k_strides),
        v_st=tuple(v_strides),
        out_st=tuple(out_strides),
        num_heads=problem.num_heads,
        group=problem.group_size,
        q_len=problem.q_len,
        kv_len=problem.kv_len,
        win_left=left,
        win_right=right,
        scale_log2=problem.softmax_scale * LOG2E,
        alibi_batch_stride=problem.alibi_batch_stride,
        softcap=problem.softcap,
        user_args=record,
    )


def forward_maps(problem, traits, shapes, strides, encode):
    """The tensor maps of ``forward_wgmma_ws``'s bulk copies (``ForwardParams``'
    ``q_map``, ``k_map`` and ``v_map``, for :func:`forward_params`' ``maps``) of q, k
    and v of ``shapes`` (``[B, H, S, D]``) and element ``strides`` (batch, head, row),
    read in boxes of the kernel's query and key tiles (``traits``: its tile traits),
    each encoded at a call by ``encode(map, destination, address)``; or None where the
    copy engine cannot take them: a packed call (its sequences' rows end where the
    arrays' do not), a dtype other than 16 bits, or strides that are not 16-byte
    multiples. A call whose entries see their own key counts (the KV cache's chunks)
    or whose arrays are not 16-byte aligned must launch without them."""
    if problem.packed is not None or problem.dtype.itemsize != 2:
        return None
    key_rows = traits.template_args[0]
    maps = {}
    for member, shape, stride, box, rows in zip(
        ("q_map", "k_map", "v_map"),
        shapes,
        strides,
        (traits.tile, key_rows, key_rows),
        (problem.q_len, problem.kv_len, problem.kv_len),
    ):
        tile_map = tensor_maps.TileMap(shape, stride, box, rows)
        if not tile_map.supported:
            return None
        maps[member] = (member[0], tile_map, encode)
    return maps
