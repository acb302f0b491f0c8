"""``python -m cuflash.bench_modifiers``: the score modifiers' benchmark, now
:mod:`cuflash.bench.modifiers`; this name stays for the docs, scripts and asv's suite that use
it.
"""

import sys

from .bench.modifiers import (
    MODIFIERS,
    SOFTCAP,
    TARGET,
    CuflashModified,
    FlexModified,
    alibi_slopes,
    cuflash_options,
    flex_score_mod,
    main,
    measure,
    table,
)

__all__ = [
    "MODIFIERS",
    "SOFTCAP",
    "TARGET",
    "CuflashModified",
    "FlexModified",
    "alibi_slopes",
    "cuflash_options",
    "flex_score_mod",
    "main",
    "measure",
    "table",
]

if __name__ == "__main__":
    sys.exit(main())
