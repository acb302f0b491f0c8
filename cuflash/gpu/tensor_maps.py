"""TMA tensor maps: what the Hopper kernels' bulk tensor copies read (CUDA's
``CUtensorMap``, 128 opaque bytes a kernel takes in its parameter struct).

A :class:`TileMap` is the fixed part of one array's map: a 16-bit ``[B, H, S, D]``
view (any strides with a unit last one) seen as a 4-dimensional tensor, dimension 0
innermost (head dim, rows, heads, batch), read in boxes of 64 columns (128 bytes, the
width of the 128-byte swizzle that ``wgmma`` reads) by ``box_rows`` rows. Rows past
``rows`` and columns past the head dim read as zeros. A launch plan makes it once; a
call only encodes the array's address into its record (:meth:`TileMap.encode_into`).

The encoding is the driver's ``cuTensorMapEncodeTiled``, called through ``ctypes``
on the ``libcuda`` CuPy already runs on, with no dependency beyond the driver. It
costs about 5 microseconds a map (an H200: three maps added 15 us to a call whose
arrays changed), so a map whose encodings for different addresses differ in one
64-bit word only, as an affine function of the address, is encoded once into a
record and then has that word rewritten (:meth:`TileMap.encode_into`). Whether a
driver's encoding is of that kind is measured, not assumed: four encodings at
different addresses are compared when the map is first used; where they differ
otherwise, every call encodes in full.
"""

import ctypes
import functools
import os

MAP_BYTES = 128
BOX_BYTES = 128  # a box's row: one 128-byte swizzle row (128 FP8, 64 16-bit or 32 float32)

# CUtensorMapDataType UINT8 and UINT16 (the copies move bits), FLOAT32 (the reductions
# add), the 128-byte swizzle, L2 promotion of 256 bytes, and zeros outside the tensor
# (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE).
_UINT8, _UINT16, _FLOAT32 = 0, 1, 7
_NO_INTERLEAVE, _SWIZZLE_128B, _L2_256B, _OOB_ZEROS = 0, 3, 3, 0
_DATA_TYPES = {1: _UINT8, 2: _UINT16, 4: _FLOAT32}  # by element size


class TensorMapError(RuntimeError):
    """The driver refused to encode a tensor map."""


@functools.cache
def _encoder():
    """libcuda's ``cuTensorMapEncodeTiled`` as a ctypes function, or None."""
    try:
        library = ctypes.CDLL("libcuda.so.1")
        encode = library.cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    encode.restype = ctypes.c_int
    encode.argtypes = [
        ctypes.c_void_p,  # CUtensorMap*
        ctypes.c_int,  # data type
        u32,  # rank
        ctypes.c_void_p,  # global address
        ctypes.POINTER(u64),  # global dims
        ctypes.POINTER(u64),  # global strides (bytes, dims 1..rank-1)
        ctypes.POINTER(u32),  # box dims
        ctypes.POINTER(u32),  # element strides
        ctypes.c_int,  # interleave
        ctypes.c_int,  # swizzle
        ctypes.c_int,  # L2 promotion
        ctypes.c_int,  # out-of-bounds fill
    ]
    return encode


def available():
    """Can this process encode tensor maps (a driver with ``cuTensorMapEncodeTiled``), and
    has the environment not turned the copy engine off (``CUFLASH_TMA=0``: every kernel
    copies with cp.async, for comparisons and troubleshooting)?"""
    return os.environ.get("CUFLASH_TMA", "1") != "0" and _encoder() is not None


class TileMap:
    """The map of an FP8 (``itemsize`` 1), 16-bit (2) or float32 (4) ``[B, H, S, D]`` array
    (``shape``, element ``strides`` of the batch, head and row axes) read or reduced
    into in boxes of 128 bytes by ``box_rows`` rows, of which the first ``rows`` (at
    most S) exist.

    ``dims``, ``strides`` (bytes; ``strides[0]`` the element size) and ``box`` are
    the tensor's, innermost first. :attr:`supported` says whether the hardware takes
    it: 16-byte multiples for every stride (the address's alignment is the caller's
    to check), at most 2^32 - 1 elements a dimension and a box of at most 256 rows.
    """

    __slots__ = ("dims", "strides", "box", "supported", "_args", "_address_word", "_encoded")

    def __init__(self, shape, strides, box_rows, rows=None, itemsize=2):
        batch, heads, seq, head_dim = (int(x) for x in shape)
        rows = seq if rows is None else int(rows)
        self.dims = (head_dim, rows, heads, batch)
        itemsize = int(itemsize)
        row, head, entry = (int(s) * itemsize for s in (strides[2], strides[1], strides[0]))
        # A dimension of one element never steps: give it a stride the driver takes.
        head = head if heads > 1 else row * max(1, rows)
        entry = entry if batch > 1 else head * max(1, heads)
        self.strides = (itemsize, row, head, entry)
        self.box = (BOX_BYTES // itemsize, int(box_rows), 1, 1)
        self.supported = (
            all(0 < d < 2**32 for d in self.dims)
            and all(s > 0 and s % 16 == 0 and s < 2**40 for s in self.strides[1:])
            and 0 < box_rows <= 256
        )
        self._args = None
        self._address_word = None  # (word, shift, offset), False, or None: not probed
        self._encoded = set()  # destinations that hold a full encoding of this map

    def encode_into(self, destination, address):
        """Encode the map of the array at device ``address`` into the 128 bytes at host
        address ``destination`` (64-byte aligned): in full the first time, then by
        rewriting the address's word where the driver's encoding allows (see the
        module's notes); TensorMapError where the driver refuses."""
        if self._address_word is None:
            self._address_word = _address_word(self._encode)
        if self._address_word and destination in self._encoded:
            word, shift, offset = self._address_word
            value = ((address >> shift) + offset) & _WORD
            ctypes.c_uint64.from_address(destination + 8 * word).value = value
            return
        self._encoded.discard(destination)
        self._encode(destination, address)
        self._encoded.add(destination)

    def _encode(self, destination, address):
        if self._args is None:
            u32, u64 = ctypes.c_uint32, ctypes.c_uint64
            self._args = (
                (u64 * 4)(*self.dims),
                (u64 * 3)(*self.strides[1:]),
                (u32 * 4)(*self.box),
                (u32 * 4)(1, 1, 1, 1),
            )
        dims, strides, box, steps = self._args
        status = _encoder()(
            destination,
            _DATA_TYPES[self.strides[0]],
            4,
            address,
            dims,
            strides,
            box,
            steps,
            _NO_INTERLEAVE,
            _SWIZZLE_128B,
            _L2_256B,
            _OOB_ZEROS,
        )
        if status != 0:
            raise TensorMapError(
                f"cuTensorMapEncodeTiled refused dims {self.dims}, strides {self.strides}, "
                f"box {self.box} (CUresult {status})"
            )


_WORD = (1 << 64) - 1
# Device addresses for the probe (16-byte aligned, inside a 47-bit address space,
# with different bits set); the driver encodes without reading them.
_PROBES = (1 << 20, (1 << 20) + 0x1234560, (1 << 40) + 0xABCDE0, (1 << 33) + 0x7FFF0)


def _address_word(encode):
    """``(word, shift, offset)`` where the encodings ``encode(destination, address)``
    of the probe addresses differ in that 64-bit word only and it holds ``(address >>
    shift) + offset``; False otherwise (or where the driver refuses a probe)."""
    buffer = (ctypes.c_uint64 * (16 * len(_PROBES) + 8))()
    base = -(-ctypes.addressof(buffer) // 64) * 64
    encodings = []
    try:
        for i, address in enumerate(_PROBES):
            encode(base + MAP_BYTES * i, address)
            at = base + MAP_BYTES * i
            encodings.append([ctypes.c_uint64.from_address(at + 8 * w).value for w in range(16)])
    except TensorMapError:
        return False
    differing = [w for w in range(16) if len({e[w] for e in encodings}) > 1]
    if len(differing) != 1:
        return False
    (word,) = differing
    for shift in (0, 4):
        offsets = {(e[word] - (a >> shift)) & _WORD for e, a in zip(encodings, _PROBES)}
        if len(offsets) == 1:
            return word, shift, offsets.pop()
    return False
