"""Shared helpers of the commands: number formatting, JSON output, argparse value types."""

from __future__ import annotations

import argparse
import json
from typing import Any, Protocol

from asyncflat.plan.coverage import format_bytes as human_bytes

__all__ = ["Commands", "human_bytes", "ms", "non_negative_float", "positive", "print_json"]


class Commands(Protocol):
    """What a command module's ``add_parser`` gets: the top parser's sub-parsers, to add its own."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def positive(text: str) -> int:
    value = int(text, 0)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
