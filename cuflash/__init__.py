"""cuflash: FlashAttention forward and backward for CuPy (GPU) and NumPy (CPU).

>>> import cuflash
>>> out, lse = cuflash.flash_attention_fwd(q, k, v, H, H_kv, D, causal=True)  # doctest: +SKIP
"""

from .api import (
    AttentionConfig,
    AttentionVJP,
    flash_attention_bwd,
    flash_attention_fwd,
    flash_attention_vjp,
)
from .dispatch import kernel_path
from .errors import InvalidArgumentError
from .kvcache import flash_attention_with_kvcache
from .varlen import (
    VarlenVJP,
    flash_attention_varlen_bwd,
    flash_attention_varlen_fwd,
    flash_attention_varlen_vjp,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "AttentionVJP",
    "InvalidArgumentError",
    "VarlenVJP",
    "flash_attention_bwd",
    "flash_attention_fwd",
    "flash_attention_varlen_bwd",
    "flash_attention_varlen_fwd",
    "flash_attention_varlen_vjp",
    "flash_attention_vjp",
    "flash_attention_with_kvcache",
    "kernel_path",
]
