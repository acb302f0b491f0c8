"""The kernels outside the variants, each once: the KV cache's append, split-KV decode
and combine (in ``kernels/decode/``), the block-mask classification, the ring merge, the
sinks' gradient and the FP8 transpose of v (in ``kernels/simt/``). With
``cuflash.gpu.registry``'s ``KERNELS`` this table is every kernel the library launches:
nothing loads a kernel it does not hold.

>>> from cuflash.gpu import standalone
>>> standalone.STANDALONE["ring_merge"].source
'simt/ring_merge.cu'
"""

import dataclasses

import numpy as np

from .registry import CXX_TYPES, cxx_literal


@dataclasses.dataclass(frozen=True)
class StandaloneKernel:
    """A kernel of its own ``.cu`` file (``source``, in ``kernels/``) outside the variants,
    built one instantiation at a time (``cuflash.gpu.kernel_build.load_standalone``).
    ``name``: also its C++ function template's, instantiated with ``parameters`` in order
    (none: not a template) by :meth:`name_expression`; ``modifiers``: compiled with the
    user's modifier functors where a call has them; ``arch``: a target of its own;
    ``threads``: a block's."""

    name: str
    source: str
    parameters: tuple = ()
    modifiers: bool = False
    arch: str | None = None
    threads: int = 128

    def name_expression(self, **args):
        """``cuflash::name<...>`` of the ``parameters`` by keyword: ``dtype`` a NumPy
        dtype (a one-byte one: FP8 storage) or an :class:`E4m3Cache`, the others ints or
        bools."""
        if set(args) != set(self.parameters):
            raise TypeError(f"{self.name} takes {self.parameters}, got {tuple(args)}")
        cxx = [
            _type_cxx(args[p]) if p == "dtype" else cxx_literal(args[p]) for p in self.parameters
        ]
        return f"cuflash::{self.name}" + (f"<{', '.join(cxx)}>" if cxx else "")


#: The kernels' C++ type of FP8 (e4m3) storage: uint8 bits (CuPy's FP8 arrays) or
#: float8_e4m3fn, whichever the call validated.
E4M3_CXX = "cuflash::e4m3_t"


def _storage_cxx(dtype):
    dtype = np.dtype(dtype)
    return E4M3_CXX if dtype.itemsize == 1 else CXX_TYPES[dtype]


@dataclasses.dataclass(frozen=True)
class E4m3Cache:
    """The element types of ``kvcache_decode_tc`` over an FP8 (e4m3) cache, its ``dtype``
    parameter: ``query`` q's dtype (FP8 storage, float16 or bfloat16) and ``out`` the
    output's (float32, float16 or bfloat16)."""

    query: np.dtype
    out: np.dtype

    @property
    def cxx(self):
        return f"cuflash::E4m3Cache<{_storage_cxx(self.query)}, {CXX_TYPES[np.dtype(self.out)]}>"


def _type_cxx(value):
    return value.cxx if isinstance(value, E4m3Cache) else _storage_cxx(value)


# The kernels outside the variants, each once: registry name = C++ template = the
# file's name (in decode/ the KV cache's, in simt/ the others).
_DECODE_TC = ("dtype", "head_dim", "row_warps", "stages", "keys", "paged", "narrow")
STANDALONE_KERNELS = (
    StandaloneKernel("kvcache_append", "decode/kvcache_append.cu", ("dtype",)),
    StandaloneKernel("kvcache_decode_tc", "decode/kvcache_decode_tc.cu", _DECODE_TC, True),
    StandaloneKernel(
        "kvcache_decode_mla",
        "decode/kvcache_decode_mla.cu",
        ("dtype", "head_dim", "head_dim_v", "keys", "stages", "paged", "latent"),
        True,
    ),
    StandaloneKernel(
        "kvcache_decode_mla_wgmma",
        "decode/kvcache_decode_mla_wgmma.cu",
        ("dtype", "head_dim", "head_dim_v", "keys", "paged"),
        True,
        arch="sm_90a",
        threads=256,
    ),
    StandaloneKernel(
        "kvcache_decode", "decode/kvcache_decode.cu", ("dtype", "head_dim", "rows"), True
    ),
    StandaloneKernel("kvcache_combine", "decode/kvcache_combine.cu", ("dtype", "head_dim")),
    StandaloneKernel("classify_mask_cells", "simt/classify_mask_cells.cu", (), True),
    StandaloneKernel("ring_merge", "simt/ring_merge.cu", ("dtype",)),
    StandaloneKernel("sinks_gradient", "simt/sinks_gradient.cu"),
    StandaloneKernel("fp8_transpose_v", "simt/fp8_transpose_v.cu"),
)
STANDALONE = {kernel.name: kernel for kernel in STANDALONE_KERNELS}


def standalone_of(name_expression):
    """The :class:`StandaloneKernel` ``name_expression`` instantiates (LookupError if none)."""
    template = name_expression.removeprefix("cuflash::").split("<", 1)[0]
    for kernel in STANDALONE_KERNELS:
        if name_expression.startswith("cuflash::") and kernel.name == template:
            return kernel
    raise LookupError(f"{name_expression} is not a kernel of the registry")
