"""The tiles of the KV cache's split-KV decode kernels (``kvcache_decode`` and
``kvcache_decode_tc`` of the registry's ``STANDALONE_KERNELS``, ``kernels/kvcache_decode*.cu``):
keys a tile, packed query rows a block and the dynamic shared memory, mirroring the
kernels' ``DecodeShape`` and ``DecodeTcShape``."""

THREADS = 128  # kDecodeThreads: a decode, append or combine block
TILE_BYTES = 16384  # kDecodeTileBytes


def decode_shape(itemsize, head_dim, rows):
    """The tiles of ``kvcache_decode<T, head_dim, rows>`` (``DecodeShape`` of decode_common.cuh):
    keys a tile and the dynamic shared memory in bytes."""
    elems = 16 // itemsize
    chunks = head_dim // elems
    fit = TILE_BYTES // (head_dim * itemsize)
    keys = 128 if fit >= 128 else 64 if fit >= 64 else 32 if fit >= 32 else 16
    pitch = chunks + 1
    ksub = min(THREADS // chunks, keys)
    kv_bytes = 4 * keys * pitch * 16
    reduce_bytes = ksub * rows * (head_dim + 1) * 4
    shared = max(kv_bytes, reduce_bytes) + rows * head_dim * 4 + keys * rows * 4 + 4 * rows * 4
    return keys, shared


def decode_tc_shape(head_dim, row_warps, stages, keys=None):
    """The tiles of ``kvcache_decode_tc<T, head_dim, row_warps, stages, keys, paged>``
    (``DecodeTcShape`` of kvcache_decode_tc.cu): keys a tile, packed query rows a block and the
    dynamic shared memory. ``keys`` defaults to :func:`decode_tc_keys`."""
    keys = decode_tc_keys(head_dim) if keys is None else keys
    chunks = head_dim // 8
    key_warps = min(4 // row_warps, keys // 16)
    rows = 16 * row_warps
    pitch = chunks + 1
    kv_bytes = 2 * stages * keys * pitch * 16
    reduce_bytes = key_warps * rows * head_dim * 4
    shared = max(kv_bytes, reduce_bytes) + rows * pitch * 16 + 2 * key_warps * rows * 4
    return keys, rows, shared


def decode_tc_keys(head_dim):
    """Keys a tile of the tensor-core decode kernel: 16 KB of K up to head_dim 128."""
    return 64 if head_dim <= 128 else 32
