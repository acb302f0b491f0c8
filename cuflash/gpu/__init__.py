"""The GPU path: the kernel registry, compilation and the module cache, the kernels'
parameter records, launch plans and the launches (``launch``; ``kvcache`` for the KV-cache
call). Importing it needs no GPU; CuPy is imported where a launch needs it."""
