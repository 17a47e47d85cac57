"""``python -m asyncflat.cli``: the same command line as ``asyncflat`` and ``python -m asyncflat``."""

import sys

from asyncflat.cli.entry import main

if __name__ == "__main__":
    sys.exit(main())
