"""``python -m cuflash.bench_masks``: the mask functions' benchmark, now
:mod:`cuflash.bench.masks`; this name stays for the docs, scripts and asv's suite that use it.
"""

import sys

from .bench.masks import (
    CHUNK,
    DOCUMENT_LEN,
    DOCUMENTS,
    MASKS,
    PREFIX,
    VARLEN_TARGET,
    CuflashMasked,
    CuflashVarlenDocuments,
    FlexMasked,
    case_of,
    cuflash_mask,
    main,
    measure,
    precompile,
    table,
    torch_mask,
)

__all__ = [
    "CHUNK",
    "DOCUMENTS",
    "DOCUMENT_LEN",
    "MASKS",
    "PREFIX",
    "VARLEN_TARGET",
    "CuflashMasked",
    "CuflashVarlenDocuments",
    "FlexMasked",
    "case_of",
    "cuflash_mask",
    "main",
    "measure",
    "precompile",
    "table",
    "torch_mask",
]

if __name__ == "__main__":
    sys.exit(main())
