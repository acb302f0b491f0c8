"""The tiles of the KV cache's split-KV decode kernels (``kvcache_decode`` and
``kvcache_decode_tc`` of :data:`cuflash.gpu.standalone.STANDALONE_KERNELS`, in
``kernels/decode/``): keys a tile, packed query rows a block and the dynamic shared
memory, mirroring the kernels' ``DecodeShape``, ``DecodeTcShape`` and ``DecodeMlaShape``:
tests/test_shared_layout.py holds each figure, as ``cuflash.gpu.decode_kernels.decode_kernel``
launches it, to the kernel's constexpr ``<kernel>_shared_bytes`` (the shape's ``SMEM``)."""

THREADS = 128  # kDecodeThreads: a decode, append or combine block
TILE_BYTES = 16384  # kDecodeTileBytes


def decode_shape(itemsize, head_dim, rows):
    """The tiles of ``kvcache_decode<T, head_dim, rows>`` (``DecodeShape`` of
    kernels/decode/decode_common.cuh): keys a tile and the dynamic shared memory in bytes
    (checked against ``kvcache_decode_shared_bytes`` by tests/test_shared_layout.py)."""
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


def decode_tc_shape(head_dim, row_warps, stages, keys=None, fp8=False):
    """The tiles of ``kvcache_decode_tc<T, head_dim, row_warps, stages, keys, paged>``
    (``DecodeTcShape`` of kernels/decode/kvcache_decode_tc.cu): keys a tile, packed query rows a
    block and the dynamic shared memory; ``fp8``: over an e4m3 cache (whose rows of one byte
    an element are padded to whole 32 columns). ``keys`` defaults to
    :func:`decode_tc_keys`. The shared memory is checked against
    ``kvcache_decode_tc_shared_bytes`` by tests/test_shared_layout.py."""
    keys = decode_tc_keys(head_dim, fp8) if keys is None else keys
    chunks = head_dim // 8
    key_warps = min(4 // row_warps, keys // 16)
    rows = 16 * row_warps
    pitch = chunks + 1
    kv_pitch = -(-head_dim // 32) * 2 + 1 if fp8 else pitch
    kv_bytes = 2 * stages * keys * kv_pitch * 16
    reduce_bytes = key_warps * rows * head_dim * 4
    shared = max(kv_bytes, reduce_bytes) + rows * pitch * 16 + 2 * key_warps * rows * 4
    return keys, rows, shared


def decode_tc_keys(head_dim, fp8=False):
    """Keys a tile of the tensor-core decode kernel: 16 KB of K up to head_dim 128 (an e4m3
    cache's tiles twice the keys of a 16-bit one's, in the same bytes)."""
    keys = 64 if head_dim <= 128 else 32
    return 2 * keys if fp8 else keys


def decode_mla_shape(head_dim, head_dim_v, keys, stages, latent):
    """The dynamic shared memory in bytes of ``kvcache_decode_mla<T, head_dim, head_dim_v, keys,
    stages, paged, latent>`` (``DecodeMlaShape`` of kernels/decode/kvcache_decode_mla.cu): the K
    (and, not latent, V) tiles, 16 query rows, P and the warps' row statistics (checked
    against ``kvcache_decode_mla_shared_bytes`` by tests/test_shared_layout.py)."""
    rows, warps = 16, THREADS // 32
    k_pitch = head_dim // 8 + 1
    v_chunks = 0 if latent else keys * (head_dim_v // 8 + 1)
    kv_bytes = stages * (keys * k_pitch + v_chunks) * 16
    return kv_bytes + rows * k_pitch * 16 + rows * (keys // 8 + 1) * 16 + 2 * warps * rows * 4


MLA_STAGES = 2
MLA_WGMMA_ROWS = 64  # packed query rows a block of kvcache_decode_mla_wgmma: wgmma's M
MLA_WGMMA_KEYS = 64


def decode_mla_wgmma_shape(head_dim, keys=MLA_WGMMA_KEYS):
    """The dynamic shared memory in bytes of ``kvcache_decode_mla_wgmma<T, head_dim,
    head_dim_v, keys, paged>`` (``DecodeMlaWgmmaShared`` of
    kernels/decode/kvcache_decode_mla_wgmma.cu, checked against
    ``kvcache_decode_mla_wgmma_shared_bytes`` by tests/test_shared_layout.py): the
    1024-byte alignment's slack, 64 query rows and two stages of keys in the input type
    (two bytes), P, three float rows."""
    rows = MLA_WGMMA_ROWS
    return 1024 + rows * head_dim * 2 + 2 * keys * head_dim * 2 + rows * keys * 2 + 3 * rows * 4


def decode_mla_keys(head_dim, head_dim_v, latent, capability):
    """Keys a tile of ``kvcache_decode_mla`` on a GPU of compute ``capability``: the most of
    64, 32, 16 whose two-stage tiles let two blocks share an SM (each block has four warps,
    too few alone to hide the products' latency: 32 keys with two blocks an SM ran
    1.37-1.43x faster than 64 with one on an H200, at 576 / 512), else the most that fit
    one block."""
    fits = [
        keys
        for keys in (64, 32, 16)
        if decode_mla_shape(head_dim, head_dim_v, keys, MLA_STAGES, latent)
        <= block_shared_limit(capability)
    ]
    for keys in fits:
        shared = decode_mla_shape(head_dim, head_dim_v, keys, MLA_STAGES, latent)
        if 2 * (shared + 1024) <= sm_shared_memory(capability):
            return keys
    return fits[0] if fits else 16


def block_shared_limit(capability):
    """Dynamic shared memory a block may opt in to on a GPU of compute ``capability`` (86:
    sm_86): 227 KB on sm_90 and sm_100, 163 KB on sm_80 and sm_87, else 99 KB."""
    if 90 <= capability < 120:
        return 232448
    if capability in (80, 87):
        return 166912
    return 101376


def sm_shared_memory(capability):
    """Shared memory of one SM on a GPU of compute ``capability``, the 1 KB a block
    reserves included: 228 KB on sm_90 and sm_100, 164 KB on sm_80 and sm_87, else 100 KB."""
    if 90 <= capability < 120:
        return 233472
    if capability in (80, 87):
        return 167936
    return 102400
