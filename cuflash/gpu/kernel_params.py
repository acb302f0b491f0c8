"""The kernels' parameter lists as host records.

Each attention kernel kind takes one parameter list, defined once in
``kernels/common/params.cuh`` as an X-macro (``CUFLASH_FORWARD_PARAMS``, ...) that makes both
the kernels' positional parameters and a C struct of the same members
(``ForwardParams``, ...). This module reads those lists and lays out the matching
NumPy records by the C rules (each member at a multiple of its alignment), which are
also the rules of a kernel's parameter space, so the host sets members by name and
a member the kernels do not declare is an error when a plan is built, not a wrong
result on a GPU. ``tests/test_kernel_params.py`` holds the layout against the C++
compiler's ``offsetof`` and against the parameters of the kernels' PTX.

A launch (``cuflash.gpu.kernel_launch.Launch``) passes the record whole as the kernel's parameter
buffer (``cuLaunchKernel``'s ``extra``); :class:`Params` fixes its members once a plan
and writes only the call's device addresses at each launch.
"""

import functools
import operator
import re
import struct
from pathlib import Path

import numpy as np

from ..modifiers.cxx import MODIFIER_ARRAYS_DTYPE
from . import tensor_maps

#: log2(e): the kernels take the softmax scale times it (their exponentials are base 2).
LOG2E = 1.4426950408889634

PARAMS_HEADER = Path(__file__).resolve().parent.parent / "kernels" / "common" / "params.cuh"

#: ``Strides`` of ``kernels/common/common.cuh``: element strides of the batch, head and row axes.
STRIDES_DTYPE = np.dtype([("b", "<i8"), ("h", "<i8"), ("s", "<i8")])

#: ``UserModifierArgs`` of ``kernels/common/common.cuh``: the arrays of the user's score and
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
#: ``TensorMap`` of ``kernels/common/params.cuh``: a CUtensorMap's 128 bytes, 64-byte aligned.
TENSOR_MAP_DTYPE = np.dtype(("<u8", (16,)))
_RECORDS = {
    "Strides": (STRIDES_DTYPE, 8),
    "UserModifierArgs": (USER_ARGS_DTYPE, 8),
    "TensorMap": (TENSOR_MAP_DTYPE, 64),
}
_POINTER = ("<u8", 8)

_STRUCT = re.compile(r"^struct (\w+) \{\s*(CUFLASH_\w+)\(CUFLASH_MEMBER\b[^)]*\)\s*\};", re.M)
_LIST = re.compile(r"^#define (CUFLASH_\w+)\(X\b[^)]*\)((?:[^\n]*\\\n)*[^\n]*)$", re.M)
_ENTRY = re.compile(r"^X\((PTR|VAL|STRIDES|MAP), ((?:const )?(?:long long|\w+)), (\w+)\)$")


def members(text=None):
    """``{struct: [(member, C type), ...]}`` of the member lists of ``kernels/common/params.cuh``
    (or ``text``): each struct ``S { CUFLASH_..._PARAMS(CUFLASH_MEMBER, ...) };`` with its
    list's entries, a pointer's type written ``T*``, a STRIDES entry ``x`` as member
    ``x_st`` of type ``Strides``; ValueError for an entry the layout cannot read."""
    text = PARAMS_HEADER.read_text() if text is None else text
    lists = {m.group(1): m.group(2) for m in _LIST.finditer(text)}
    found = {}
    for m in _STRUCT.finditer(text):
        name, body = m.group(1), lists.get(m.group(2))
        if body is None:
            raise ValueError(f"{name}: no member list {m.group(2)}")
        fields = []
        for line in body.split("\\\n"):
            line = re.sub(r"/\*.*?\*/", "", line).strip()
            if not line:
                continue
            d = _ENTRY.match(line)
            if d is None:
                raise ValueError(f"{name}: an entry the host cannot lay out: {line!r}")
            kind, ctype, member = d.group(1), d.group(2).removeprefix("const "), d.group(3)
            if kind == "PTR":
                ctype += "*"
            elif kind == "STRIDES":
                member, ctype = member + "_st", "Strides"
            elif kind == "MAP" and ctype != "TensorMap":
                raise ValueError(f"{name}.{member}: a map of {ctype}")
            elif ctype not in _SCALARS and ctype not in _RECORDS:
                raise ValueError(f"{name}.{member}: unknown type {ctype}")
            fields.append((member, ctype))
        found[name] = fields
    return found


def _format_of(ctype):
    if ctype.endswith("*"):
        return _POINTER
    return _SCALARS.get(ctype) or _RECORDS[ctype]


def parameter_base(sm):
    """Where the parameters of a kernel compiled for tile generation ``sm`` (80: sm_80 to
    sm_89, 90: sm_90 and newer) begin in its constant bank (the cubin's
    ``EIATTR_PARAM_CBANK``). The compiler aligns each parameter by its address there, not
    by its offset from the first: a 64-byte tensor map after 888 bytes of parameters sits
    at offset 944 on sm_90 (0x210 + 944 = 23 x 64), 928 on sm_80, where a C struct has
    it at 896. A launch's parameter buffer is laid out from this base
    (:meth:`Params.rebased`); ``tests/test_kernel_params.py`` holds it against the
    cubins' offsets."""
    return 0x210 if sm >= 90 else 0x160


@functools.cache
def layout(name, base=0):
    """The NumPy dtype of struct ``name`` of ``kernels/common/params.cuh``, laid out as C does
    (``base`` 0), or as the parameters of its list's kernels whose parameters begin at
    ``base`` in the constant bank (:func:`parameter_base`): each member at a multiple of
    its alignment counted from the bank's start, its offset from ``base``."""
    names, formats, offsets, offset, widest = [], [], [], base, 1
    for member, ctype in members()[name]:
        fmt, align = _format_of(ctype)
        offset = -(-offset // align) * align
        names.append(member)
        formats.append(fmt)
        offsets.append(offset - base)
        offset += np.dtype(fmt).itemsize
        widest = max(widest, align)
    itemsize = -(-(offset - base) // widest) * widest
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize})


def parameter_bytes(name, base=0):
    """The bytes of the parameter buffer of list ``name``'s kernels (their parameters
    from ``base``, as :func:`layout`): where its last parameter ends."""
    dtype = layout(name, base)
    return max(offset + fmt.itemsize for fmt, offset in dtype.fields.values())


_CODES = {"<u8": "Q", "<i4": "i", "<f4": "f", "<i8": "q"}


@functools.cache
def _writers(name, base=0):
    """``{member: (offset, struct.Struct or None)}`` of struct ``name`` laid out from
    ``base``: how a fixed value is written into a record (a scalar, a pointer or
    ``Strides`` by ``struct``; a record's bytes by copy: None), faster than NumPy's
    field assignment, which a record built per call would pay for every member."""
    dtype = layout(name, base)
    found = {}
    for member in dtype.names:
        fmt, offset = dtype.fields[member][:2]
        if fmt == STRIDES_DTYPE:
            found[member] = (offset, struct.Struct("<3q"))
        elif fmt.str in _CODES and fmt.shape == ():
            found[member] = (offset, struct.Struct("<" + _CODES[fmt.str]))
        else:
            found[member] = (offset, None)
    return found


@functools.cache
def _address_packer(name, per_call, base=0):
    """``(start, struct.Struct, span)``: the per-call members ``per_call`` of struct
    ``name`` (pointers, or an int such as a length) packed from byte ``start`` (the pad
    bytes between them zeroed), the bytes they span; KeyError / ValueError for members
    that are not the struct's pointers or ints in its order."""
    dtype = layout(name, base)
    codes = {np.dtype(_POINTER[0]): "Q", np.dtype("<i4"): "i"}
    offsets, layout_text, at = [], "<", None
    for member in per_call:
        if member not in dtype.fields or dtype.fields[member][0] not in codes:
            raise KeyError(f"{name} has no pointer or int member {member!r}")
        fmt, offset = dtype.fields[member][:2]
        if at is not None and offset < at:
            raise ValueError(f"{name}: per-call members out of the struct's order: {per_call}")
        layout_text += f"{offset - at}x" if at is not None and offset > at else ""
        layout_text += codes[fmt]
        offsets.append(offset)
        at = offset + fmt.itemsize
    start = offsets[0] if offsets else 0
    span = range(start, at) if offsets else range(0)
    return start, struct.Struct(layout_text), span


def _aligned_record(dtype, alignment=64, remainder=0):
    """One zeroed record of ``dtype`` at an address that is ``remainder`` past a multiple
    of ``alignment`` (a record laid out from a parameter base keeps its tensor maps at
    multiples of 64, for the driver that encodes them in place)."""
    raw = np.zeros(dtype.itemsize + alignment, dtype=np.uint8)
    skip = (remainder - raw.ctypes.data) % alignment
    return raw[skip : skip + dtype.itemsize].view(dtype)


class Params:
    """One launch's record of struct ``name`` (its kernels' parameter buffer, of ``size``
    bytes: :func:`parameter_bytes`): the members in ``fields`` fixed now (a
    ``Strides`` member from a 3-tuple, ``user_args`` from a ``UserModifierArgs`` record,
    pointers as ints), the pointers ``per_call`` (in the struct's order; an int member
    too, such as a length) written at each launch by ``pack(*addresses)`` (0 for null);
    every other member zero (null). ``keep``: objects
    whose memory the record points into.

    ``maps``: ``{member: (address member, map, encode)}``, tensor-map members that
    ``pack`` encodes from a per-call address, ``encode(map, destination, address)``
    (e.g. :meth:`cuflash.gpu.tensor_maps.TileMap.encode_into`), only when that address
    differs from the last call's.

    ``base``: the record laid out as :func:`layout`'s (0, the C struct's: the
    simulator's launches); a GPU launch takes :meth:`rebased` to its kernel's
    :func:`parameter_base`."""

    __slots__ = (
        "name",
        "record",
        "address",
        "size",
        "per_call",
        "keep",
        "pack",
        "_pack_addresses",
        "_maps",
        "_last",
        "_last_all",
        "_map_addresses",
        "base",
        "_given",
    )

    def __init__(self, name, per_call, keep=(), maps=None, base=0, **fields):
        dtype = layout(name, base)
        self.name, self.per_call, self.keep = name, tuple(per_call), tuple(keep)
        self.base, self._given = base, (maps, fields)
        self.record = _aligned_record(dtype, 64, base)
        start, packer, span = _address_packer(name, self.per_call, base)
        writers = _writers(name, base)
        raw = self.record.view(np.uint8)
        for member, value in fields.items():
            if member not in writers:
                raise KeyError(f"{name} has no member {member!r}")
            offset, writer = writers[member]
            # The span the addresses are packed into (the pad bytes between them
            # zeroed) holds no member fixed here.
            if offset in span:
                raise ValueError(f"{name}.{member} is fixed inside the per-call addresses")
            if writer is None:
                self.record[member] = value
            elif writer.size == 24:
                writer.pack_into(raw, offset, *value)
            else:
                writer.pack_into(raw, offset, value)
        self.address = self.record.ctypes.data
        self.size = parameter_bytes(name, base)
        self._pack_addresses = functools.partial(packer.pack_into, self.record, start)
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
            # The maps' addresses as one tuple, compared at once (a call's host time)
            self._map_addresses = operator.itemgetter(*(m[0] for m in self._maps), 0)
            self._last_all = None
            self.pack = self._pack_with_maps

    def rebased(self, base):
        """This record laid out from parameter base ``base`` (itself if it is)."""
        if base == self.base:
            return self
        maps, fields = self._given
        return Params(self.name, self.per_call, self.keep, maps, base, **fields)

    def _pack_with_maps(self, *addresses):
        self._pack_addresses(*addresses)
        current = self._map_addresses(addresses)
        if current == self._last_all:
            return
        self._last_all = None
        for i, (source, tile_map, encode, destination) in enumerate(self._maps):
            address = addresses[source]
            if address != self._last[i]:
                self._last[i] = None  # a failed encoding leaves no stale map behind
                encode(tile_map, destination, address)
                self._last[i] = address
        self._last_all = current

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
#: And those of the FP8 roles (``v``: its transpose, ``vt``): the scores' and the output's
#: descales a (batch entry, head) in ``q_scales`` and ``v_scales``; dense calls only.
FORWARD_FP8_ADDRESSES = ("q", "k", "v", "out", "lse", "q_scales", "v_scales", "sinks")
#: And those of the float32 pieces kernels: each input's high and low pieces, out, lse,
#: the pieces' scales, then as :data:`FORWARD_ADDRESSES`.
FORWARD_PIECES_ADDRESSES = (
    "q",
    "q_lo",
    "k",
    "k_lo",
    "v",
    "v_lo",
    "out",
    "lse",
    "q_scales",
    "k_scales",
    "v_scales",
    *FORWARD_ADDRESSES[5:],
)


def forward_params(
    problem,
    q_strides,
    k_strides,
    v_strides,
    out_strides,
    user,
    pieces=False,
    maps=None,
    query_tiles=0,
    fp8=False,
):
    """The ``ForwardParams`` of ``problem``'s forward launches (``kernels/common/params.cuh``):
    the arrays' element strides (``(batch, head, row)`` each), the user's modifier
    arguments (:class:`UserArguments`, or a ``UserModifierArgs`` record), the pieces
    kernels' addresses with ``pieces``; the call's addresses written at each launch
    (:data:`FORWARD_ADDRESSES`, or :data:`FORWARD_PIECES_ADDRESSES`). ``maps``
    (:func:`forward_maps`): q, k and v by the copy engine (``use_tma``). ``query_tiles``:
    the kernel's query tiles a (head, batch entry or sequence), which a persistent
    kernel's blocks walk with the others of the launch (``work_tiles``). ``fp8``: the FP8
    roles' addresses (:data:`FORWARD_FP8_ADDRESSES`)."""
    addresses = (
        FORWARD_PIECES_ADDRESSES if pieces else FORWARD_FP8_ADDRESSES if fp8 else FORWARD_ADDRESSES
    )
    return Params(
        "ForwardParams",
        addresses,
        keep=(user,),
        maps=maps,
        use_tma=int(maps is not None),
        query_tiles=query_tiles,
        work_tiles=query_tiles * problem.num_heads * _entries(problem),
        q_st=tuple(q_strides),
        k_st=tuple(k_strides),
        v_st=tuple(v_strides),
        out_st=tuple(out_strides),
        **_attention_fields(problem, user),
    )


def _entries(problem):
    """The batch entries of a dense problem, the sequences of a packed one (the grids' z)."""
    return problem.batch if problem.packed is None else problem.packed.count


def _attention_fields(problem, user):
    """The members ``ForwardParams``, ``BackwardParams`` and ``BackwardDqParams`` share:
    the heads and lengths, the window, the scale in base 2, the modifiers' scalars and
    the user's modifier arguments (a ``UserModifierArgs`` record or :class:`UserArguments`)."""
    left, right = problem.window
    return dict(
        num_heads=problem.num_heads,
        group=problem.group_size,
        q_len=problem.q_len,
        kv_len=problem.kv_len,
        win_left=left,
        win_right=right,
        scale_log2=problem.softmax_scale * LOG2E,
        alibi_batch_stride=problem.alibi_batch_stride,
        softcap=problem.softcap,
        user_args=getattr(user, "record", user),
    )


#: The members of ``BackwardParams`` (the dK/dV kernels) a launch writes at each call,
#: in order: the inputs, lse log2 e and Delta (``backward_delta``'s), the outputs, the
#: packed call's offsets and the ALiBi slopes.
BACKWARD_ADDRESSES = (
    "q",
    "k",
    "v",
    "dout",
    "lse",
    "delta",
    "dq_accum",
    "dk",
    "dv",
    "offsets_q",
    "offsets_k",
    "alibi_slopes",
)
#: And those of the float32 pieces kernels: each input's high and low pieces, ..., the
#: outputs, the pieces' scales, then as :data:`BACKWARD_ADDRESSES`.
BACKWARD_PIECES_ADDRESSES = (
    "q",
    "q_lo",
    "k",
    "k_lo",
    "v",
    "v_lo",
    "dout",
    "dout_lo",
    "lse",
    "delta",
    "dq_accum",
    "dk",
    "dv",
    "q_scales",
    "k_scales",
    "v_scales",
    "dout_scales",
    *BACKWARD_ADDRESSES[9:],
)
#: The same of ``BackwardDqParams`` (the dQ passes): dq in place of dq_accum, dk, dv.
BACKWARD_DQ_ADDRESSES = (*BACKWARD_ADDRESSES[:6], "dq", *BACKWARD_ADDRESSES[9:])
BACKWARD_DQ_PIECES_ADDRESSES = (
    *BACKWARD_PIECES_ADDRESSES[:10],
    "dq",
    *BACKWARD_PIECES_ADDRESSES[13:],
)


def backward_params(
    problem,
    input_strides,
    output_strides,
    user,
    pieces=False,
    dq_pass=False,
    maps=None,
    key_tiles=0,
    schedule=0,
):
    """The ``BackwardParams`` of ``problem``'s dK/dV launches, or with ``dq_pass`` the
    ``BackwardDqParams`` of its dQ pass (``kernels/common/params.cuh``): ``input_strides`` the
    element strides of q, k, v and dout (``(batch, head, row)`` each), ``output_strides``
    dK's and dV's (``dkv_st``) or dQ's (``dq_st``), the user's modifier arguments (as
    :func:`forward_params`'), the pieces kernels' addresses with ``pieces``; the call's
    addresses written at each launch (:data:`BACKWARD_ADDRESSES`,
    :data:`BACKWARD_PIECES_ADDRESSES`, :data:`BACKWARD_DQ_ADDRESSES` or
    :data:`BACKWARD_DQ_PIECES_ADDRESSES`). ``maps`` (:func:`backward_maps`, dK/dV
    launches only): q, k, v and dout by the copy engine (``use_tma``). ``key_tiles``
    (dK/dV launches): the kernel's key tiles a (KV head, batch entry or sequence), which
    a persistent kernel's blocks walk with the others of the launch (``work_tiles``), and
    ``schedule`` the device address of their tiles' schedule (``cuflash.gpu.schedules``;
    0: the static walk)."""
    q_strides, k_strides, v_strides, dout_strides = input_strides
    fields = {}
    if dq_pass:
        name, fields["dq_st"] = "BackwardDqParams", tuple(output_strides)
        addresses = BACKWARD_DQ_PIECES_ADDRESSES if pieces else BACKWARD_DQ_ADDRESSES
    else:
        name, fields["dkv_st"] = "BackwardParams", tuple(output_strides)
        fields["kv_capacity"] = problem.kv_capacity
        fields["use_tma"] = int(maps is not None)
        fields["key_tiles"] = key_tiles
        fields["work_tiles"] = key_tiles * problem.num_kv_heads * _entries(problem)
        fields["schedule"] = schedule
        addresses = BACKWARD_PIECES_ADDRESSES if pieces else BACKWARD_ADDRESSES
    return Params(
        name,
        addresses,
        keep=(user,),
        maps=maps,
        q_st=tuple(q_strides),
        k_st=tuple(k_strides),
        v_st=tuple(v_strides),
        dout_st=tuple(dout_strides),
        scale=problem.softmax_scale,
        **_attention_fields(problem, user),
        **fields,
    )


#: The members of ``BackwardDeltaParams`` a launch writes at each call, in order.
DELTA_ADDRESSES = ("dout", "out", "lse", "delta", "lse_log2", "dq_accum")


def delta_params(problem, dout_strides, out_strides, accum_width, counters=False):
    """The ``BackwardDeltaParams`` of ``problem``'s ``backward_delta`` launches: dout's
    and out's element strides, the atomic dQ's row width (0: no atomic dQ), and with
    ``counters`` the ordered dQ's counters after its rows to zero."""
    return Params(
        "BackwardDeltaParams",
        DELTA_ADDRESSES,
        dout_st=tuple(dout_strides),
        out_st=tuple(out_strides),
        num_heads=problem.num_heads,
        q_len=problem.q_len,
        accum_width=accum_width,
        dq_counters=int(counters),
    )


def dq_convert_params(problem, dq_strides, count, accum_width):
    """The ``DqConvertParams`` of the atomic dQ's conversion (``backward_dq_convert``):
    dQ's element strides, its ``count`` elements, the accumulator's row width; the call
    writes ``dq_accum`` and ``dq``."""
    return Params(
        "DqConvertParams",
        ("dq_accum", "dq"),
        dq_st=tuple(dq_strides),
        count=count,
        accum_width=accum_width,
        num_heads=problem.num_heads,
        q_len=problem.q_len,
    )


def zero_outside_params(count, rows, heads, row_elements):
    """The ``ZeroOutsideParams`` of a packed output's zeroing (``packed_zero_outside``):
    ``count`` sequences, ``rows`` rows of ``heads`` heads, ``row_elements`` elements a
    row; the call writes the output ``x``, its ``offsets`` and the forward's ``lse`` (0
    for the gradients)."""
    return Params(
        "ZeroOutsideParams",
        ("x", "offsets", "lse"),
        count=count,
        total=rows,
        heads=heads,
        row_elements=row_elements,
    )


def pieces_params(strides, valid_rows, heads, seq_len):
    """The ``PiecesAbsMaxParams`` and ``PiecesSplitParams`` of the float16 pieces of a
    float32 operand of element ``strides`` (``float16_pieces_abs_max``, then
    ``float16_pieces_split``): its first ``valid_rows`` rows of each head, into pieces of
    ``heads`` heads of ``seq_len`` rows."""
    abs_max = Params("PiecesAbsMaxParams", ("x", "abs_max_bits"), x_st=strides, rows=valid_rows)
    split = Params(
        "PiecesSplitParams",
        ("x", "abs_max", "hi", "lo", "scale_out"),
        x_st=strides,
        num_heads=heads,
        seq_len=seq_len,
        rows=valid_rows,
    )
    return abs_max, split


def forward_maps(problem, traits, shapes, strides, encode):
    """The tensor maps of ``forward_wgmma_ws``'s bulk copies (``ForwardParams``'
    ``q_map``, ``k_map`` and ``v_map``, for :func:`forward_params`' ``maps``) of q, k
    and v of ``shapes`` (``[B, H, S, D]``) and element ``strides`` (batch, head, row),
    read in boxes of the kernel's query and key tiles (``traits``: its tile traits),
    each encoded at a call by ``encode(map, destination, address)``; or None where the
    copy engine cannot take them (:func:`_tile_maps`). A call whose entries see their
    own key counts (the KV cache's chunks) or whose arrays are not 16-byte aligned must
    launch without them."""
    key_rows = traits.template_args[0]
    return _tile_maps(
        problem,
        ("q_map", "k_map", "v_map"),
        shapes,
        strides,
        (traits.tile, key_rows, key_rows),
        (problem.q_len, problem.kv_len, problem.kv_len),
        encode,
    )


def fp8_forward_maps(problem, traits, shapes, strides, encode):
    """The tensor maps of ``forward_wgmma_ws``'s FP8 role: q and k as :func:`forward_maps`'
    (one byte an element, boxes of 128 columns), and v's transpose ``vt`` (the ``v`` of
    the call, ``[B, H_kv, rows, keys]`` from :func:`fp8_transpose_params`) in boxes of 128
    keys by all its rows; ``shapes`` and ``strides`` of q, k and vt. None where the copy
    engine cannot take them (the FP8 role has no other copy)."""
    rows = shapes[2][2]
    return _tile_maps(
        problem,
        ("q_map", "k_map", "v_map"),
        shapes,
        strides,
        (traits.tile, traits.template_args[0], rows),
        (problem.q_len, problem.kv_len, rows),
        encode,
    )


def fp8_transpose_params(problem, v_strides, rows, keys):
    """The ``Fp8TransposeVParams`` of ``fp8_transpose_v``: v's element strides, v^T's
    ``rows`` (v's head dim rounded up to 16) and ``keys`` (kv_len rounded up to 16) a head;
    the call's v and vt written at each launch."""
    return Params(
        "Fp8TransposeVParams",
        ("v", "vt"),
        v_st=tuple(v_strides),
        kv_heads=problem.num_kv_heads,
        kv_len=problem.kv_len,
        head_dim_v=problem.head_dim_v,
        rows=rows,
        keys=keys,
    )


def backward_maps(problem, traits, shapes, strides, encode, dq_width=0):
    """The tensor maps of ``backward_wgmma_ws``'s bulk copies (``BackwardParams``'
    ``q_map``, ``k_map``, ``v_map`` and ``dout_map``, for :func:`backward_params`'
    ``maps``) of q, k, v and dout (``shapes`` and ``strides`` in that order, as
    :func:`forward_maps`'), in boxes of the kernel's query rows a step and its key
    tile; with ``dq_width`` (the atomic dQ's row width) also ``dq_accum_map``, the
    float32 dQ rows its bulk reductions add into, in boxes of a step's rows. None
    where the copy engine cannot take them. Arrays that are not 16-byte aligned must
    launch without them."""
    rows, keys = traits.template_args[0], traits.tile
    maps = _tile_maps(
        problem,
        ("q_map", "k_map", "v_map", "dout_map"),
        shapes,
        strides,
        (rows, keys, keys, rows),
        (problem.q_len, problem.kv_len, problem.kv_len, problem.q_len),
        encode,
    )
    if maps is None or not dq_width:
        return maps
    shape = (problem.batch, problem.num_heads, problem.q_len, dq_width)
    row_elements = problem.q_len * dq_width
    accum = tensor_maps.TileMap(
        shape, (problem.num_heads * row_elements, row_elements, dq_width), rows, itemsize=4
    )
    if not accum.supported:
        return None
    maps["dq_accum_map"] = ("dq_accum", accum, encode)
    return maps


def _tile_maps(problem, members, shapes, strides, boxes, rows, encode):
    """``{member: (address member, TileMap, encode)}`` of each ``member`` (``x_map``
    maps the call's address ``x``), or None for a packed call (its sequences' rows end
    where the arrays' do not), a dtype other than 16 bits or FP8, or strides that are not
    16-byte multiples."""
    itemsize = problem.dtype.itemsize
    if problem.packed is not None or itemsize not in (1, 2):
        return None
    maps = {}
    for member, shape, stride, box, valid_rows in zip(members, shapes, strides, boxes, rows):
        tile_map = tensor_maps.TileMap(shape, stride, box, valid_rows, itemsize=itemsize)
        if not tile_map.supported:
            return None
        maps[member] = (member.removesuffix("_map"), tile_map, encode)
    return maps
