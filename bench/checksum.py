"""What the crc32c checksum of format-3 chunks costs a fill: ``bench/fill.py``'s comparison
alone (the same as ``python bench/fill.py --checksum-only``). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit
from fill import checksum_figures, meets_checksum_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1 << 26)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    figures = checksum_figures(args.tokens, args.rounds)
    figures["meets_checksum_target"] = meets_checksum_target(figures)
    emit({"bench": "checksum", **figures})


if __name__ == "__main__":
    main()
