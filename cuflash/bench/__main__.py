"""``python -m cuflash.bench``: the side-by-side benchmark (see :mod:`cuflash.bench.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
