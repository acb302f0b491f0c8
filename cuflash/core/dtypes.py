"""The dtypes the library computes in: float32, float16 and bfloat16 (``ml_dtypes``).

Their own module, below ``cuflash.core.problem`` (which validates arrays against them) and
``cuflash.gpu.registry`` (which maps them to the kernels' C++ types), so that the registry
does not import the validation.
"""

import numpy as np

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BFLOAT16 = None

# The dtypes the library computes in, by name (bfloat16 needs ml_dtypes).
DTYPES_BY_NAME = {
    name: d
    for name, d in (
        ("float32", np.dtype(np.float32)),
        ("float16", np.dtype(np.float16)),
        ("bfloat16", BFLOAT16),
    )
    if d is not None
}
SUPPORTED_DTYPES = tuple(DTYPES_BY_NAME.values())
