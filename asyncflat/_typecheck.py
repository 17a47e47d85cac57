"""Run-time type checks for public entry points, raising the library's own error.

typeguard checks the annotations; a wrong argument then fails at the call with a message naming
the function and argument, instead of deep inside a background fill. Hot paths are not checked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from typeguard import TypeCheckError, typechecked

from .errors import ArgumentTypeError

F = TypeVar("F", bound=Callable[..., Any])


def checked(fn: F) -> F:
    """``typeguard.typechecked`` whose failures are :class:`ArgumentTypeError`."""
    instrumented = typechecked(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return instrumented(*args, **kwargs)
        except TypeCheckError as exc:
            raise ArgumentTypeError(f"{fn.__qualname__}(): {exc}") from None

    return wrapper  # type: ignore[return-value]
