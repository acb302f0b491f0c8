"""The tile traits of the GPU kernels: per kernel and head_dim, the tile a block
owns, its threads, its dynamic shared memory and the template arguments after the
dtype and head_dim (:class:`Traits`). ``cuflash.gpu.registry`` pairs each kernel with its
function here; the shared-memory sums spell out each kernel's buffers, as its
header lays them out, and tests/test_shared_layout.py holds each sum to the kernel's own
constexpr ``<kernel>_shared_bytes`` (the ``bytes`` of its layout struct ``<Kernel>Shared``,
the end of the offsets its carve takes) for every role of every variant.

Tile traits per head-dim class follow FlashAttention-2's kernel traits: every
multiple of 8 from 8 to 256 runs on the tiles of its class (64, 128 or 256
columns), with the exact head_dim compiled in (products over the head_dim take
``round_up(D, 16) / 16`` k16 steps; see ``kernels/common/common.cuh``)."""

import dataclasses
import os

from .decode_tiles import block_shared_limit

FLOAT_BYTES = 4


def head_dim_class(head_dim):
    """The tile width that serves ``head_dim``: 64, 128 or 256 columns (the kernels'
    ``head_dim_class``)."""
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def round_up(x, multiple):
    return -(-x // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Traits:
    """The tile traits of one kernel at one head_dim.

    ``tile``: query rows a block owns (forward), keys (backward dK/dV), or the
    rows a block of a helper kernel covers; ``threads`` a block; ``shared_bytes``
    of dynamic shared memory (checked against the kernel's ``<kernel>_shared_bytes`` by
    tests/test_shared_layout.py); ``template_args``: the C++ template arguments after
    the dtype and head_dim (the backward's atomic flag is added per role).
    """

    tile: int
    threads: int
    shared_bytes: int
    template_args: tuple = ()


def pitch(head_dim):
    """float32 rows of the CUDA-core and TF32 kernels: head_dim + 4 words (no bank
    conflicts)."""
    return head_dim + 4


# ---- traits of each kernel, per head_dim -------------------------------------


def forward_wgmma_traits(d):
    keys = 128 if d <= 32 else 64  # two blocks an SM: S, P and O of a tile in 128 registers
    warpgroups = 2
    width = head_dim_class(d)  # shared-memory tiles of the class's width
    smem = 2 * width * (64 * warpgroups + 4 * keys) + 1024
    return Traits(64 * warpgroups, 128 * warpgroups, smem, (keys, warpgroups))


def forward_ws_traits(d, consumers=None, modified=False):
    """kernels/sm90/forward_wgmma_ws.cuh: a producer warpgroup and 2 consumers of 64 query
    rows each (3 in the 64 class, whose short products hide a softmax only with more rows
    in turn), Q resident, STAGES stages of K and of V, the stage rings' barriers (16 bytes
    a stage each), Q's two barriers (full, and empty: the persistent roles') and the
    consumers' order slots. The tiles' rows are the head dim rounded up to 64 columns
    (the copy engine's boxes: D = 136-192 in 192). Key tiles: 128 up to D = 128; in the
    256 class 96 for the plain roles of D = 136-192 (1.07x-1.26x over 64 on an H100,
    docs/kernels/forward-sm90-wgmma.md), else 64 (the wide O leaves no registers for
    more; the modified roles' user functions need them); as many stages as fit, at most
    three. The plain roles take ``CUFLASH_FORWARD_KEYS`` keys a tile where the
    environment sets it and two stages of them fit (comparisons: a tile's fixed softmax
    work, the rows' maxima across the quad, the rescales, the barriers, spread over more
    keys; the keys must be one of gen_wgmma_ops.py's N_SS)."""
    width = head_dim_class(d)
    row = round_up(d, 64)
    if consumers is None:
        consumers = 3 if width == 64 else 2
    rows = 64 * consumers

    def shared(keys, stages):
        return (
            2 * row * (rows + 2 * stages * keys)
            + 2 * 16 * stages
            + 2 * 8
            + FLOAT_BYTES * 128 * consumers
            + 1024
        )

    def stages_of(keys):
        limit = block_shared_limit(90)  # an sm_90a kernel
        return max((s for s in (1, 2, 3) if shared(keys, s) <= limit), default=0)

    keys = 128 if width < 256 else 96 if row == 192 and not modified else 64
    chosen = os.environ.get("CUFLASH_FORWARD_KEYS")
    if not modified and chosen and stages_of(int(chosen)) >= 2:
        keys = int(chosen)
    stages = stages_of(keys)
    return Traits(rows, 128 * (consumers + 1), shared(keys, stages), (keys, stages, consumers))


def forward_ws_modified_traits(d):
    """forward_wgmma_ws compiled with score modifiers: two consumers at every head_dim (at
    three, 160 registers each, a user's score and mask functions spill), 128-key tiles."""
    return forward_ws_traits(d, consumers=2, modified=True)


# forward_wgmma_ws's FP8 roles run three consumers up to this head dim, two above (three
# spill at D = 112 and 128).
FP8_THREE_CONSUMERS_TO = 96


def forward_ws_fp8_traits(d):
    """forward_wgmma_ws's FP8 roles (e4m3: one byte an element, 128 a swizzled row):
    consumers of 64 query rows (three up to FP8_THREE_CONSUMERS_TO: short products hide a
    softmax only with more rows in turn, as in the 16-bit roles' 64 class; two above), three
    stages of 128 keys; Q and the K stages in rows of the head-dim class rounded up to 128
    (the copy engine fills the columns past the head dim with zeros), the V^T stages in
    rows of 128 keys, one for each of the head dim rounded up to 16 (an upper bound of
    v's); then the barriers and order slots as the 16-bit roles'."""
    consumers = 3 if d <= FP8_THREE_CONSUMERS_TO else 2
    keys, stages = 128, 3 if d <= 128 else 2
    rows, width = 64 * consumers, round_up(head_dim_class(d), 128)
    smem = (
        width * (rows + stages * keys)
        + stages * round_up(d, 16) * keys
        + 2 * 16 * stages
        + 2 * 8
        + FLOAT_BYTES * 128 * consumers
        + 1024
    )
    return Traits(rows, 128 * (consumers + 1), smem, (keys, stages, consumers))


def forward_mma_sync_traits(d):
    width = head_dim_class(d)
    if width == 256:  # Q in registers up to D = 192 (ptxas spills at 192 with Q in smem)
        rows, keys, m_tiles, q_in_registers = 64, 32, 1, d <= 192
    elif width == 128:
        rows, keys, m_tiles, q_in_registers = 64, 64, 1, True
    else:
        rows, keys, m_tiles, q_in_registers = 128, 64, 2, False
    return Traits(
        rows,
        32 * rows // (16 * m_tiles),
        2 * width * (rows + 4 * keys),
        (rows, keys, m_tiles, q_in_registers),
    )


def forward_pieces_traits(d):
    keys, width = 64, head_dim_class(d)
    return Traits(128, 256, 2 * width * (2 * 128 + 8 * keys) + 1024, (keys,))


def forward_pieces_wide_traits(d):
    """kernels/sm90/forward_float32_pieces_wide.cuh: 64 rows, one 64-key tile of K and of V, each as
    two float16 pieces 256 columns wide, and each warpgroup's half of S in float32."""
    rows, keys, width = 64, 64, 256
    return Traits(
        rows, 256, 2 * 2 * width * (rows + 2 * keys) + FLOAT_BYTES * 2 * rows * keys + 1024
    )


def forward_tf32_traits(d):
    rows, keys = 64, (64 if d <= 64 else 32 if d <= 128 else 16)
    return Traits(rows, 2 * rows, FLOAT_BYTES * (rows + 4 * keys) * pitch(d), (rows, keys))


def general_rows(d):
    return (64 if d <= 128 else 32), 32


def forward_general_traits(d):
    rows, keys = general_rows(d)
    p = pitch(d)
    return Traits(
        rows, 128, FLOAT_BYTES * (rows * p + 2 * keys * p + rows * (keys + 4)), (rows, keys)
    )


def backward_wgmma_traits(d):
    width = head_dim_class(d)
    rows, keys = {64: (128, 128), 128: (64, 128), 256: (64, 64)}[width]
    exchanged = 2 if width == 256 else 1  # P^T as well as dS^T in shared memory
    smem = (
        2 * (2 * (2 * rows + keys) * width + exchanged * keys * rows)
        + FLOAT_BYTES * 2 * 2 * rows
        + 1024
    )
    return Traits(keys, 256, smem, (rows,))


def backward_ws_traits(d):
    """kernels/sm90/backward_wgmma_ws.cuh: up to D = 128 128 keys (a producer and two consumer
    warpgroups of 64 keys), K and V resident, STAGES stages of the query rows a step (64 in
    the 128 class, 128 in the 64 class) of Q and dO and their lse and Delta, two buffers of
    dS^T, the float32 dQ tiles (one of rows 8 floats wider, or two for the dQ writer,
    whichever is larger), the ring's barriers (16 bytes a stage), K/V's two (full, and
    empty: the persistent roles'), each dQ tile's two (full, empty) and its coordinates for
    the writer warp (16 bytes a tile); in the 128 class 1024 bytes more to align the tiles,
    while the 64 class's, 112 bytes short of that under the 227 KB a block may hold,
    declares its array 1024-byte aligned (the kernel traps where it is not). The 256 class
    (D = 136-256): 64 keys, P^T and dS^T where the two dS^T buffers are, and no dQ tiles
    (each step's goes into its stage)."""
    width = head_dim_class(d)
    rows, keys, stages = (128 if width == 64 else 64), (64 if width == 256 else 128), 2
    dq_floats = 0 if width == 256 else max(rows * (width + 8), 2 * rows * width)
    smem = (
        2 * (2 * keys * width + 2 * stages * rows * width + 2 * keys * rows)
        + FLOAT_BYTES * (dq_floats + 2 * stages * rows)
        + 16 * stages
        + 2 * 8
        + 2 * (2 * 8 + 16)
        + (0 if width == 64 else 1024)
    )
    return Traits(keys, 384, smem, (rows, stages))


def backward_mma_sync_traits(d):
    rows, keys = {64: (64, 128), 128: (32, 128)}[head_dim_class(d)]
    smem = (
        2 * (2 * (2 * rows + keys) * head_dim_class(d) + keys * rows) + FLOAT_BYTES * 2 * 2 * rows
    )
    return Traits(keys, 2 * keys, smem, (rows, keys))


def backward_split_d_traits(d):
    width = head_dim_class(d)
    rows, keys = (32, 64) if width == 256 else (64, 64)
    smem = 2 * (2 * keys * width + 4 * rows * width + 2 * keys * rows) + FLOAT_BYTES * 4 * rows
    return Traits(keys, 256, smem, (rows, keys))


def backward_pieces_traits(d):
    rows, keys, width = 64, 64, head_dim_class(d)
    buffers = 1 if d == 64 else 2  # kernels/sm90/backward_float32_pieces.cuh: split_bwd_blocks
    smem = (
        2 * (width * (4 * keys + 4 * buffers * rows) + 4 * keys * rows)
        + FLOAT_BYTES * (2 * buffers * rows + 8)
        + 1024
    )
    return Traits(keys, 256, smem, ())


def backward_pieces_wide_traits(d):
    """kernels/sm90/backward_float32_pieces_wide.cuh, dK and dV: 64 keys of K and V and a 32-row
    query tile of Q and dO, each as two float16 pieces 256 columns wide, P^T handed between the
    warpgroups in float32, lse and Delta of the tile, four maxima."""
    rows, keys, width = 32, 64, 256
    return Traits(
        keys,
        256,
        2 * 2 * width * (2 * keys + 2 * rows) + FLOAT_BYTES * (keys * rows + 2 * rows + 4) + 1024,
    )


def dq_pieces_wide_traits(d):
    """kernels/sm90/backward_dq_float32_pieces_wide.cuh: 64 rows of Q and dO and a 32-key tile of K
    and V as pieces 256 columns wide, P and dS handed over in float32, lse and Delta of the rows,
    four maxima and dS's exponent."""
    rows, keys, width = 64, 32, 256
    return Traits(
        rows,
        256,
        2 * 2 * width * (2 * rows + 2 * keys)
        + FLOAT_BYTES * (2 * rows * keys + 2 * rows + 5)
        + 1024,
    )


def backward_tf32_traits(d):
    rows, keys = (64, 64) if d <= 64 else (32, 64)
    p = pitch(d)
    smem = FLOAT_BYTES * (2 * (rows + keys) * p + keys * (rows + 4) + 2 * rows)
    return Traits(keys, 2 * keys, smem, (rows, keys))


def backward_general_traits(d):
    rows, keys = (64, 32) if d <= 128 else (32, 16)
    p = pitch(d)
    smem = FLOAT_BYTES * (2 * (rows + keys) * p + 2 * rows * (keys + 4) + 2 * rows)
    return Traits(keys, 128, smem, (rows, keys))


def dq_general_traits(d):
    rows, keys = general_rows(d)
    p = pitch(d)
    return Traits(
        rows,
        128,
        FLOAT_BYTES * (2 * (rows + keys) * p + rows * (keys + 4) + 2 * rows),
        (rows, keys),
    )


def dq_wgmma_traits(d):
    """kernels/sm90/backward_dq_wgmma.cuh: 128 query rows (64 a warpgroup), Q and dO resident, two
    buffers of K and V of 64-key tiles (32 in the 256 class, where 64 would not fit)."""
    rows, width = 128, head_dim_class(d)
    keys = 32 if width == 256 else 64
    return Traits(rows, 256, 2 * width * (2 * rows + 4 * keys) + 1024, (keys,))


def dq_mma_sync_traits(d):
    """kernels/sm80/backward_dq_mma_sync.cuh: 64 query rows (16 a warp), Q and dO resident, two
    buffers of K and V: 64-key tiles, 32 in the 128 class and 16 in the 256 class (96 KB of shared
    memory there, within the 99 KB of an sm_86 or sm_89 block)."""
    rows, width = 64, head_dim_class(d)
    keys = {64: 64, 128: 32, 256: 16}[width]
    return Traits(rows, 2 * rows, 2 * width * (2 * rows + 4 * keys), (rows, keys))
