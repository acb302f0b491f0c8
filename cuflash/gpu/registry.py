"""The kernel registry: every kernel the library launches, as one table of data.

Each :class:`KernelSpec` says what one CUDA kernel template serves (the
direction, the instruction family, the compute capabilities, the precision
and the head dims) and its tile traits for a head_dim: the tile of query rows
(forward) or keys (backward) a block owns, the threads of a block, the shared
memory, and the C++ expression that instantiates it. The dispatch
(:func:`choose`), the kernel build and its cache (``cuflash.gpu.kernel_build``),
``python -m cuflash.precompile``, the compile tests, the sanitizer settings and
the docs' coverage table all read this table. ``cuflash.gpu.standalone`` holds its
other table, ``STANDALONE_KERNELS``: the kernels of the other ``.cu`` files (the KV
cache's, the block-mask classification, the ring merge, ...). Nothing loads a kernel
that these two tables do not hold.

The traits themselves are ``cuflash.gpu.tile_traits``'s.

>>> from cuflash.gpu import registry
>>> [spec.name for spec in registry.KERNELS if spec.direction == "forward"][:2]
['forward_wgmma_ws', 'forward_wgmma']
"""

import dataclasses

import numpy as np

from ..core.dtypes import BFLOAT16
from . import tile_traits
from .tile_traits import Traits

SIXTEEN_BIT_DTYPES = tuple(d for d in (np.dtype(np.float16), BFLOAT16) if d is not None)
CXX_TYPES: dict[np.dtype, str] = {
    np.dtype(np.float32): "float",
    np.dtype(np.float16): "cuflash::half_t",
}
if BFLOAT16 is not None:
    CXX_TYPES[BFLOAT16] = "cuflash::bf16_t"


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel template and what it serves.

    ``direction``: "forward", "backward" (dK and dV, and dQ by float32 atomics
    or, deterministic, not) or "helper" (launched by the others' paths).
    ``precision``: "16-bit" (float16, bfloat16), "float32" (float32 accuracy),
    "tf32" (float32 inputs with ``allow_tf32=True``) or "any" (every dtype).
    ``archs``: the compute-capability generations it runs on (80: sm_80 to sm_89,
    90: sm_90); ``needs_sm90a``: compiled for the arch-specific sm_90a target
    (wgmma). ``head_dims``: (smallest, largest) multiple of 8 served, or a tuple
    of the exact ones when ``exact_head_dims``. ``traits_of(head_dim, modified)`` gives
    :class:`cuflash.gpu.tile_traits.Traits`. ``padded_dq``: the atomic dQ accumulates in rows
    of the head-dim class's width. ``name`` is also the C++ function template's.
    """

    name: str
    direction: str
    instruction: str
    precision: str
    archs: tuple
    head_dims: tuple
    traits: object
    # The Traits function of its roles compiled with score modifiers where they differ
    # (fewer threads where the modifiers need the registers), else None.
    modified_traits: object = None
    needs_sm90a: bool = False
    exact_head_dims: bool = False
    dtype_in_template: bool = True
    padded_dq: bool = False  # the atomic dQ's float32 rows are the head-dim class's width
    # (kernel, largest head_dim, keys): plain calls up to that head_dim whose query rows
    # see fewer keys than that on average (``Problem.keys_a_row_sees``) go to ``kernel``
    # where it is not excluded (too few key tiles a block to fill its pipeline).
    short_rows_kernel: tuple | None = None
    # A kernel with persistent instantiations (its PERSISTENT template argument: a block an
    # SM walks the launch's tiles): plain calls whose rows see fewer keys than this on
    # average run them (``persists``), the others a block a tile; 0: compiled, awaiting
    # the GPU run that sets the line (``CUFLASH_PERSISTENT=1`` runs them).
    persistent_keys: int | None = None
    # A forward kernel that also takes per-entry key counts as its offsets_k with no
    # offsets_q (a chunk of queries over a KV cache with device-held lengths:
    # CUFLASH_FORWARD_SEQUENCE of kernels/common/common.cuh).
    reads_key_counts: bool = False
    # The backward's dQ: by float32 atomics in the kernel for the calls that are not
    # deterministic at the head dims ``atomic_dq_head_dims`` (smallest, largest; None:
    # never, the kernel has no atomic instantiation), else by the helper ``dq_kernel``
    # after it (None: backward_dq_general).
    atomic_dq_head_dims: tuple | None = (8, 256)
    dq_kernel: str | None = None
    # From this head dim on the atomic dQ needs the copy engine's maps (the plan runs the
    # dQ pass for calls it cannot map); None: never.
    atomic_dq_needs_maps_from: int | None = None
    # A backward kernel with an ordered-dQ instantiation (its ORDERED_DQ template argument):
    # the deterministic calls its tensor maps serve add dQ in the blocks' launch order
    # instead of running the dQ pass (:meth:`role`'s ``ordered_dq``).
    ordered_dq: bool = False
    # The head dims (smallest, largest) whose deterministic calls take the ordered dQ where
    # it measured faster than the dQ pass (None: every head dim of its atomic dQ).
    ordered_dq_head_dims: tuple | None = None
    modifiers: bool = False  # also compiled with the score modifiers
    # Also compiled with a user's mask alone (a module built mask-only: the plain code, the
    # mask on the tiles it cuts), where ``modifiers`` is False: its modified roles exist
    # only in such a module (``roles(with_masks=True)``).
    mask_modifiers: bool = False
    # The tiles a block owns and visits, (outer, inner), when its modified roles read a
    # block mask (cuflash.block_mask): query rows and keys forward, keys and query rows
    # backward; None: a user's mask is evaluated on every tile.
    block_tiles: object = None
    # A kernel whose v (and output, dout, dv) may be narrower than q and k: a last
    # template argument DV, v's head dim (cuflash.gpu.value_dims pads the calls of the
    # others); True, or a rule (head_dim, head_dim_v) -> bool for the narrower v it takes.
    value_dims: object = False
    # FP8 roles (e4m3 q, k and v, the variant's dtype the output: cuflash.gpu.fp8_plan) at
    # the head dims ``(smallest, largest)`` that are multiples of 16, with their Traits
    # function; None: none.
    fp8_head_dims: tuple | None = None
    fp8_traits: object = None
    # Taken by the dispatch only inside ``cuflash.dispatch.try_kernels`` (its ``tried``):
    # written and checked without a GPU (compiler, simulator), awaiting a GPU run.
    opt_in: bool = False

    def takes_value_dims(self, head_dim, head_dim_v):
        """Whether it computes a call whose v has ``head_dim_v`` columns natively."""
        if head_dim_v == head_dim:
            return True
        if not self.value_dims or head_dim_v > head_dim:
            return False
        return self.value_dims is True or self.value_dims(head_dim, head_dim_v)

    def serves_head_dim(self, head_dim):
        """Whether it serves ``head_dim``."""
        if self.exact_head_dims:
            return head_dim in self.head_dims
        low, high = self.head_dims
        return low <= head_dim <= high

    def traits_of(self, head_dim, modified=False, fp8=False):
        """The :class:`cuflash.gpu.tile_traits.Traits` of its roles at ``head_dim``, those
        compiled with score modifiers (``modified``), its FP8 role's (``fp8``) or those of
        the plain roles."""
        if fp8:
            return self.fp8_traits(head_dim)
        if modified and self.modified_traits is not None:
            return self.modified_traits(head_dim)
        return self.traits(head_dim)

    def defers_short_rows(self, head_dim, keys_a_row_sees, excluded=frozenset()):
        """Whether a plain call at ``head_dim`` whose rows see ``keys_a_row_sees`` keys on
        average goes to ``short_rows_kernel`` (unless ``excluded`` names it)."""
        if self.short_rows_kernel is None or keys_a_row_sees is None:
            return False
        kernel, largest, keys = self.short_rows_kernel
        return head_dim <= largest and keys_a_row_sees < keys and kernel not in excluded

    def persists(self, modified, keys_a_row_sees):
        """Whether a call (``modified``: with score modifiers) whose rows see
        ``keys_a_row_sees`` keys on average runs the persistent role."""
        if self.persistent_keys is None or modified or keys_a_row_sees is None:
            return False
        return keys_a_row_sees < self.persistent_keys

    def serves_fp8(self, head_dim):
        """Whether it has an FP8 role at ``head_dim``."""
        if self.fp8_head_dims is None:
            return False
        low, high = self.fp8_head_dims
        return low <= head_dim <= high and head_dim % 16 == 0

    def serves_dtype(self, dtype, allow_tf32=False):
        dtype = np.dtype(dtype)
        if self.precision == "16-bit":
            return dtype in SIXTEEN_BIT_DTYPES
        if self.precision == "float32":
            return dtype == np.float32
        if self.precision == "tf32":
            return dtype == np.float32 and allow_tf32
        return dtype in CXX_TYPES

    def compiled_for(self, dtype, head_dim, sm):
        """Whether the variant (dtype, head_dim, tile generation ``sm``) holds this kernel
        (for any ``allow_tf32``)."""
        return (
            sm in self.archs
            and self.serves_head_dim(head_dim)
            and self.serves_dtype(dtype, allow_tf32=True)
        )

    def atomic_dq(self, head_dim):
        """Whether a backward call at ``head_dim`` that is not deterministic adds dQ by
        atomics in this kernel."""
        if self.direction != "backward" or self.atomic_dq_head_dims is None:
            return False
        low, high = self.atomic_dq_head_dims
        return low <= head_dim <= high

    def orders_dq(self, head_dim):
        """Whether its deterministic calls at ``head_dim`` add dQ in the blocks' launch
        order (its ordered role, where the maps serve) rather than by the dQ pass."""
        if not self.ordered_dq or not self.atomic_dq(head_dim):
            return False
        if self.ordered_dq_head_dims is None:
            return True
        low, high = self.ordered_dq_head_dims
        return low <= head_dim <= high

    def atomic_dq_needs_maps(self, head_dim):
        """Whether its atomic (and ordered) dQ at ``head_dim`` runs through the copy engine's
        maps only."""
        start = self.atomic_dq_needs_maps_from
        return start is not None and head_dim >= start

    def serves_modifiers(self, mask_only=False):
        """Whether it serves calls with score modifiers (``mask_only``: a user's mask alone)."""
        return self.modifiers or (mask_only and self.mask_modifiers)

    def roles(self, head_dim=None, with_masks=False):
        """The compiled roles: the name, for the backward its deterministic and
        atomic-dQ instantiations (at ``head_dim`` where given: the atomic one where
        :meth:`atomic_dq` holds), and with ``modifiers`` (or ``mask_modifiers`` and
        ``with_masks``: a module compiled for a user's mask alone) each of those again
        with the score modifiers (``role(...)`` names them)."""
        base = (self.name,)
        adds_dq = (
            self.direction == "backward"
            and self.atomic_dq_head_dims is not None
            and (head_dim is None or self.atomic_dq(head_dim))
        )
        if adds_dq:
            base += (self.name + ATOMIC_DQ,)
        modified = self.modifiers or (with_masks and self.mask_modifiers)
        roles = base + tuple(name + MODIFIED for name in base) if modified else base
        if self.persistent_keys is not None:  # the plain roles, persistent
            roles += tuple(name + PERSISTENT for name in base)
        # the ordered dQ: dense calls, a block a tile
        if adds_dq and (self.orders_dq(head_dim) if head_dim else self.ordered_dq):
            roles += (self.name + ORDERED_DQ,)
        if self.fp8_head_dims is not None and (head_dim is None or self.serves_fp8(head_dim)):
            roles += (self.name + FP8,)
        return roles

    def dq_pass(self):
        """The spec of the helper that computes a backward's dQ when its kernel does not
        add it by atomics (``dq_kernel``, or the CUDA-core pass)."""
        return BY_NAME[self.dq_kernel or "backward_dq_general"]

    def block_mask_tiles(self, head_dim):
        """``(outer, inner)`` tiles of a block mask's view for this kernel, or None."""
        if self.block_tiles is None:
            return None
        return self.block_tiles(self.traits_of(head_dim, modified=True))

    def role(self, atomic_dq=False, modified=False, persistent=False, ordered_dq=False):
        """The role of one instantiation (``persistent``: of a plain call; ``ordered_dq``:
        the deterministic dQ added in launch order, neither atomic nor persistent)."""
        if ordered_dq:
            return self.name + ORDERED_DQ
        return (
            self.name
            + (ATOMIC_DQ if atomic_dq else "")
            + (MODIFIED if modified else "")
            + (PERSISTENT if persistent else "")
        )

    def name_expression(self, role, dtype, head_dim, head_dim_v=None):
        """The C++ expression that instantiates ``role`` for (dtype, head_dim), with v's
        ``head_dim_v`` where given and other than head_dim (``value_dims`` kernels)."""
        fp8 = role.endswith(FP8)
        cxx = CXX_TYPES[np.dtype(dtype)]
        args = [f"cuflash::E4m3<{cxx}>" if fp8 else cxx] if self.dtype_in_template else []
        args.append(str(head_dim))
        traits = self.traits_of(head_dim, modified=role.endswith(MODIFIED), fp8=fp8)
        args += [cxx_literal(a) for a in traits.template_args]
        if self.direction == "backward" and self.atomic_dq_head_dims is not None:
            args.append("true" if adds_dq(role) else "false")
        if self.modifiers or self.mask_modifiers:
            args.append("true" if role.endswith(MODIFIED) else "false")
        if self.persistent_keys is not None:
            args.append("true" if role.endswith(PERSISTENT) else "false")
        if self.ordered_dq:
            args.append("true" if role.endswith(ORDERED_DQ) else "false")
        if head_dim_v is not None and head_dim_v != head_dim:
            if not self.takes_value_dims(head_dim, head_dim_v):
                raise ValueError(f"{self.name} does not take head_dim_v {head_dim_v}")
            args.append(str(head_dim_v))
        return f"cuflash::{self.name}<{', '.join(args)}>"


ATOMIC_DQ = "_atomic_dq"
ORDERED_DQ = "_ordered_dq"
MODIFIED = "_modified"
PERSISTENT = "_persistent"
FP8 = "_fp8"  # e4m3 inputs, the variant's dtype the output


def adds_dq(role):
    """Whether the backward role adds dQ itself (by atomics, or in launch order)."""
    return ATOMIC_DQ in role or role.endswith(ORDERED_DQ)


def cxx_literal(value):
    """A template argument's C++ spelling (``true``/``false`` for a bool)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _fixed(rows, threads=128):
    return lambda d: Traits(rows, threads, 0, ())


def _splits_the_narrower_v(head_dim, head_dim_v):
    """backward_wgmma's narrower v: any in the 64 and 128 classes; in the 256
    class one whose dV and dK columns split between its warpgroups at 32 to 144 columns
    each (``best_split`` of kernels/sm90/backward_wgmma.cuh: the first warpgroup 64 or 128 of
    each)."""
    if tile_traits.head_dim_class(head_dim) < 256:
        return True
    dk, dvk = tile_traits.round_up(head_dim, 16), tile_traits.round_up(head_dim_v, 16)
    return any(
        32 <= dvk - dv <= 144 and 32 <= dk - dkc <= 144 for dv in (64, 128) for dkc in (64, 128)
    )


def _wide_split(head_dim, head_dim_v):
    """backward_wgmma_ws's narrower v: in the 256 class one whose dV, dK and dQ columns split
    between its consumers (``wide_split`` of kernels/sm90/backward_wgmma_ws.cuh: the first
    consumer 64 or 128 of each, the second 16 to 128 of dV and dK, 32 to 128 of dQ)."""
    if tile_traits.head_dim_class(head_dim) < 256:
        return False
    dk, dvk = tile_traits.round_up(head_dim, 16), tile_traits.round_up(head_dim_v, 16)
    dqn = tile_traits.round_up(dk, 32)
    return any(
        16 <= dvk - dv <= 128 and 16 <= dk - dkc <= 128 and 32 <= dqn - dq <= 128
        for dv in (64, 128)
        for dkc in (64, 128)
        for dq in (64, 128)
    )


def _owned_and_visited(traits):
    """Block-mask tiles of kernels whose traits' tile is owned and whose first template
    argument is the tile visited."""
    return traits.tile, traits.template_args[0]


def _rows_and_keys(traits):
    """Block-mask tiles of kernels whose first two template arguments are rows, keys."""
    return traits.template_args[0], traits.template_args[1]


ALL_HEAD_DIMS = (8, 256)
HOPPER, AMPERE_AND_NEWER = (90,), (80, 90)

# In order of preference within each direction: the dispatch takes the first
# kernel that serves the call.
KERNELS = (
    # The warp-specialized forward serves every call; up to D = 64 (its plain roles: three
    # consumers, 192 query rows a block) plain calls whose rows see fewer than 768 keys
    # on average take the two-blocks-an-SM forward_wgmma (D = 64, S = 1024 causal: 208
    # against 237 TFLOP/s; S = 4096: 456 against 350; docs/kernels/forward-sm90-wgmma.md).
    # Its plain calls whose rows see fewer than 2560 keys run persistent, a block an SM
    # (S = 1024: D = 128 causal 383 against 349, D = 64 389 against 363; 2048 keys level
    # to +8 % on two machines; longer calls lost: D = 128, S = 4096 591 against 628,
    # S = 16384 causal 449 against 604).
    KernelSpec(
        "forward_wgmma_ws",
        "forward",
        "wgmma",
        "16-bit",
        HOPPER,
        ALL_HEAD_DIMS,
        tile_traits.forward_ws_traits,
        modified_traits=tile_traits.forward_ws_modified_traits,
        needs_sm90a=True,
        modifiers=True,
        block_tiles=_owned_and_visited,
        reads_key_counts=True,
        short_rows_kernel=("forward_wgmma", 64, 768),
        persistent_keys=2560,
        value_dims=True,
        fp8_head_dims=(16, 256),
        fp8_traits=tile_traits.forward_ws_fp8_traits,
    ),
    # Short plain calls up to D = 64 take forward_wgmma, two blocks an SM
    # (forward_wgmma's launch bounds; 64-key tiles past D = 32): their blocks' short
    # loops hide each other's first loads and last stores.
    KernelSpec(
        "forward_wgmma",
        "forward",
        "wgmma",
        "16-bit",
        HOPPER,
        (8, 64),
        tile_traits.forward_wgmma_traits,
        needs_sm90a=True,
        reads_key_counts=True,
    ),
    KernelSpec(
        "forward_mma_sync",
        "forward",
        "mma.sync",
        "16-bit",
        AMPERE_AND_NEWER,
        ALL_HEAD_DIMS,
        tile_traits.forward_mma_sync_traits,
        modifiers=True,
        block_tiles=_rows_and_keys,
    ),
    KernelSpec(
        "forward_tf32",
        "forward",
        "mma.sync",
        "tf32",
        AMPERE_AND_NEWER,
        ALL_HEAD_DIMS,
        tile_traits.forward_tf32_traits,
        dtype_in_template=False,
    ),
    KernelSpec(
        "forward_float32_pieces",
        "forward",
        "wgmma",
        "float32",
        HOPPER,
        (8, 128),
        tile_traits.forward_pieces_traits,
        needs_sm90a=True,
        dtype_in_template=False,
        reads_key_counts=True,
    ),
    KernelSpec(
        "forward_float32_pieces_wide",
        "forward",
        "wgmma",
        "float32",
        HOPPER,
        (136, 256),
        tile_traits.forward_pieces_wide_traits,
        needs_sm90a=True,
        dtype_in_template=False,
        reads_key_counts=True,
    ),
    KernelSpec(
        "forward_general",
        "forward",
        "cuda cores",
        "any",
        AMPERE_AND_NEWER,
        ALL_HEAD_DIMS,
        tile_traits.forward_general_traits,
        modifiers=True,
    ),
    # The warp-specialized backward of plain calls (a producer warpgroup
    # feeds Q, dO, lse and Delta through a ring of stages, by the copy engine where the
    # driver maps the arrays; 64 query rows a step in the 128 class, 128 in the 64 class;
    # in the 256 class 64 keys a block, the consumers sharing the columns, each step's dQ
    # added from its stage: 1.12x-1.24x backward_wgmma with its dQ pass, H100, 2026-12-07);
    # its register split leaves no room for the score modifiers, only a user's mask alone
    # (which keeps the plain code). Measured above backward_wgmma
    # in the 128 class, atomic and deterministic (D = 128, S = 4096: 450.5 with its dQ
    # writer against 367.3 TFLOP/s; deterministic calls through its maps add dQ in launch
    # order, 413.0 against the dQ pass's 366.7) and in the 64 class (H100, 2026-12-05:
    # D = 64, S = 4096: 384.6 against 297.3; D = 32-64 at 0.86-1.0x cuDNN;
    # docs/kernels/backward-sm90-wgmma.md).
    KernelSpec(
        "backward_wgmma_ws",
        "backward",
        "wgmma",
        "16-bit",
        HOPPER,
        (8, 256),
        tile_traits.backward_ws_traits,
        needs_sm90a=True,
        padded_dq=True,
        atomic_dq_head_dims=(8, 256),
        # The 256 class adds dQ through the copy engine's maps only (its dQ tiles are the
        # stages): without them its calls take the dQ pass.
        atomic_dq_needs_maps_from=136,
        value_dims=_wide_split,
        dq_kernel="backward_dq_wgmma",
        ordered_dq=True,
        # Not the 256 class: its dQ pass beat the ordered dQ by 9-17 % (H100, 2026-12-07).
        ordered_dq_head_dims=(8, 128),
        # A user's mask alone (flex_attention's block masks): its plain code, the query
        # steps of each key tile narrowed to the block mask's, the mask on partial tiles.
        mask_modifiers=True,
        block_tiles=_owned_and_visited,
        # Its persistent roles lost to a block a tile once the dQ writer warp came
        # (2026-12-04: 3-8 % at S = 1024-2048, 29 % at S = 16384 causal, the blocks'
        # static walk): compiled, never chosen; CUFLASH_PERSISTENT=1 runs them, dense
        # calls now by the plan's balanced schedule (cuflash.gpu.schedules), untimed.
        persistent_keys=0,
    ),
    KernelSpec(
        "backward_wgmma",
        "backward",
        "wgmma",
        "16-bit",
        HOPPER,
        ALL_HEAD_DIMS,
        tile_traits.backward_wgmma_traits,
        needs_sm90a=True,
        modifiers=True,
        block_tiles=_owned_and_visited,
        atomic_dq_head_dims=(8, 128),
        dq_kernel="backward_dq_wgmma",
        value_dims=_splits_the_narrower_v,
    ),
    KernelSpec(
        "backward_mma_sync",
        "backward",
        "mma.sync",
        "16-bit",
        AMPERE_AND_NEWER,
        (64, 128),
        tile_traits.backward_mma_sync_traits,
        exact_head_dims=True,
        modifiers=True,
        dq_kernel="backward_dq_mma_sync",
    ),
    KernelSpec(
        "backward_mma_sync_split_d",
        "backward",
        "mma.sync",
        "16-bit",
        AMPERE_AND_NEWER,
        ALL_HEAD_DIMS,
        tile_traits.backward_split_d_traits,
        padded_dq=True,
        dq_kernel="backward_dq_mma_sync",
    ),
    KernelSpec(
        "backward_tf32",
        "backward",
        "mma.sync",
        "tf32",
        AMPERE_AND_NEWER,
        (8, 128),
        tile_traits.backward_tf32_traits,
        dtype_in_template=False,
    ),
    KernelSpec(
        "backward_float32_pieces",
        "backward",
        "wgmma",
        "float32",
        HOPPER,
        (8, 128),
        tile_traits.backward_pieces_traits,
        needs_sm90a=True,
        dtype_in_template=False,
    ),
    KernelSpec(
        "backward_float32_pieces_wide",
        "backward",
        "wgmma",
        "float32",
        HOPPER,
        (136, 256),
        tile_traits.backward_pieces_wide_traits,
        needs_sm90a=True,
        dtype_in_template=False,
        atomic_dq_head_dims=None,
        dq_kernel="backward_dq_float32_pieces_wide",
    ),
    KernelSpec(
        "backward_general",
        "backward",
        "cuda cores",
        "any",
        AMPERE_AND_NEWER,
        ALL_HEAD_DIMS,
        tile_traits.backward_general_traits,
        modifiers=True,
    ),
    # Helpers: Delta = rowsum(dO O) and lse in base 2 (4 rows a block); the
    # deterministic dQ pass on the CUDA cores; the backward_wgmma's dQ pass (its
    # deterministic calls, and every call past head_dim 128); the mma.sync
    # backwards' dQ pass (their deterministic calls); the dQ of the float32
    # pieces past head_dim 128; the atomic dQ's conversion to its dtype and
    # layout (512 elements a block); zeros in the rows of a packed output that no
    # sequence covers; the float16 pieces of float32 operands.
    KernelSpec(
        "backward_delta",
        "helper",
        "cuda cores",
        "any",
        AMPERE_AND_NEWER,
        ALL_HEAD_DIMS,
        _fixed(4),
        value_dims=True,
    ),
    KernelSpec(
        "backward_dq_general",
        "helper",
        "cuda cores",
        "any",
        AMPERE_AND_NEWER,
        ALL_HEAD_DIMS,
        tile_traits.dq_general_traits,
        modifiers=True,
    ),
    KernelSpec(
        "backward_dq_wgmma",
        "helper",
        "wgmma",
        "16-bit",
        HOPPER,
        ALL_HEAD_DIMS,
        tile_traits.dq_wgmma_traits,
        needs_sm90a=True,
        modifiers=True,
        block_tiles=_owned_and_visited,
        value_dims=True,
    ),
    KernelSpec(
        "backward_dq_mma_sync",
        "helper",
        "mma.sync",
        "16-bit",
        AMPERE_AND_NEWER,
        ALL_HEAD_DIMS,
        tile_traits.dq_mma_sync_traits,
        modifiers=True,
        block_tiles=_rows_and_keys,
    ),
    KernelSpec(
        "backward_dq_float32_pieces_wide",
        "helper",
        "wgmma",
        "float32",
        HOPPER,
        (136, 256),
        tile_traits.dq_pieces_wide_traits,
        needs_sm90a=True,
        dtype_in_template=False,
    ),
    KernelSpec(
        "backward_dq_convert",
        "helper",
        "cuda cores",
        "any",
        AMPERE_AND_NEWER,
        ALL_HEAD_DIMS,
        _fixed(512, threads=256),
    ),
    KernelSpec(
        "packed_zero_outside",
        "helper",
        "cuda cores",
        "any",
        AMPERE_AND_NEWER,
        ALL_HEAD_DIMS,
        _fixed(256, threads=256),
    ),
    KernelSpec(
        "float16_pieces_abs_max",
        "helper",
        "cuda cores",
        "float32",
        HOPPER,
        ALL_HEAD_DIMS,
        _fixed(32),
        dtype_in_template=False,
    ),
    KernelSpec(
        "float16_pieces_split",
        "helper",
        "cuda cores",
        "float32",
        HOPPER,
        ALL_HEAD_DIMS,
        _fixed(4),
        dtype_in_template=False,
    ),
)
BY_NAME = {spec.name: spec for spec in KERNELS}
BY_ROLE = {role: spec for spec in KERNELS for role in spec.roles(with_masks=True)}


def variant_roles(dtype, head_dim, sm, head_dim_v=None, with_masks=False):
    """Role -> C++ name expression of every kernel of the variant (dtype, head_dim, tile
    generation ``sm``). With a ``head_dim_v`` other than head_dim: the kernels
    that take it natively (``value_dims``), instantiated for it, and the helpers (a packed
    forward's zeroing), which take the row width as an argument; the FP8 roles where v's
    head dim is a multiple of 16 too. ``with_masks``: also the roles compiled only for a
    user's mask alone (``KernelSpec.mask_modifiers``)."""
    narrow_v = head_dim_v is not None and head_dim_v != head_dim
    return {
        role: spec.name_expression(role, dtype, head_dim, head_dim_v if spec.value_dims else None)
        for spec in KERNELS
        if spec.compiled_for(dtype, head_dim, sm)
        and (
            not narrow_v
            or spec.direction == "helper"
            or spec.takes_value_dims(head_dim, head_dim_v)
        )
        for role in spec.roles(head_dim, with_masks)
        if not (narrow_v and role.endswith(FP8) and head_dim_v % 16)
    }


def generation(compute_capability):
    """The tile generation (80 or 90) of a compute capability such as 86 or 90."""
    return 90 if compute_capability >= 90 else 80


def choose(
    direction,
    dtype,
    head_dim,
    compute_capability,
    allow_tf32=False,
    tensor_cores=True,
    excluded=frozenset(),
    modified=False,
    head_dim_v=None,
    tried=frozenset(),
    keys_a_row_sees=None,
    mask_only=False,
):
    """The first kernel of ``direction`` that serves the call.

    ``tensor_cores`` False (the general kernel path, or rows off the 16-byte
    grid that cp.async needs) leaves the CUDA-core kernels only; ``excluded``
    names kernels to pass over (tests and benchmarks compare the next in line);
    ``modified`` (score modifiers) leaves the kernels compiled with them (``mask_only``:
    a user's mask is the only one, which ``mask_modifiers`` kernels also take).
    Kernels for sm_90a serve compute capability 9.0 only. With a ``head_dim_v`` other
    than head_dim, the first that takes it natively (``takes_value_dims``), else the
    first that serves the call (``cuflash.gpu.value_dims`` then pads it). An ``opt_in``
    kernel serves only when ``tried`` names it. ``keys_a_row_sees`` (the call's
    ``Problem.keys_a_row_sees``; None: many) sends short calls to a kernel's
    ``short_rows_kernel``.
    """
    sm = generation(compute_capability)
    first = None
    for spec in KERNELS:
        if (
            spec.direction != direction
            or spec.name in excluded
            or (spec.opt_in and spec.name not in tried)
            or sm not in spec.archs
            or (spec.needs_sm90a and compute_capability != 90)
            or not spec.serves_head_dim(head_dim)
            or not spec.serves_dtype(dtype, allow_tf32)
            or (modified and not spec.serves_modifiers(mask_only))
            or (not modified and spec.defers_short_rows(head_dim, keys_a_row_sees, excluded))
        ):
            continue
        if spec.instruction != "cuda cores" and not tensor_cores:
            continue
        if head_dim_v is None or spec.takes_value_dims(head_dim, head_dim_v):
            return spec
        first = first or spec
    if first is not None:
        return first
    raise LookupError(f"no {direction} kernel serves {np.dtype(dtype)} head_dim {head_dim}")
