"""``python -m asyncflat``: the same command line as the ``asyncflat`` script."""

import sys

from asyncflat.cli import main

if __name__ == "__main__":
    sys.exit(main())
