"""What the crc32c checksum of format-3 chunks costs a fill: ``bench/fill.py``'s comparison
alone (the same as ``python bench/fill.py --checksum-only``). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit
from fill import CHECKSUM_TARGET, checksum_figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1 << 26)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    figures = checksum_figures(args.tokens, args.rounds)
    figures["meets_checksum_target"] = 1 - figures["crc32c_over_plain"] <= CHECKSUM_TARGET
    emit({"bench": "checksum", **figures})


if __name__ == "__main__":
    main()
