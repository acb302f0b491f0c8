"""The CPU path: NumPy, blocked like the kernels (``dense``; ``kvcache`` for the KV-cache
call)."""
