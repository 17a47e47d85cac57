"""Run-time type checks for public entry points, raising the library's own error.

A wrong argument fails at the call with a message naming the function and the argument
(``argument "params" (dict) is not an instance of asyncflat.config.FlatTokensParams``) instead
of deep inside a background fill. Hot paths are not checked.

Cheap by construction: decorating does nothing but wrap (no source re-parsed and recompiled, as
``typeguard.typechecked`` does for every decorated function at import: ~80 ms for the loader's
module). The first call resolves the signature's annotations once; each call then checks an
argument whose annotation is a class, or a union of classes, with one ``isinstance``. typeguard
is imported (with its ``unittest.mock``, ~25 ms) only for the other annotations (generics,
callables, protocols) and to word a failure, so constructing a loader never imports it.

May import: ``errors``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from asyncflat.errors import ArgumentTypeError

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger(__name__)

_UNION_TYPES = (typing.Union, types.UnionType)


def _plain_classes(hint: Any) -> tuple[type, ...] | None:
    """The classes ``hint`` is a union of (a class alone: one), or None if it is anything else."""
    if hint is Any:
        return None
    if typing.get_origin(hint) in _UNION_TYPES:
        classes: list[type] = []
        for arg in typing.get_args(hint):
            plain = _plain_classes(arg)
            if plain is None:
                return None
            classes.extend(plain)
        return tuple(classes)
    if hint is None or hint is type(None):
        return (type(None),)
    if isinstance(hint, type) and typing.get_origin(hint) is None:
        return (hint,)
    return None


def _qualified_name(value: Any) -> str:
    return _qualified_class(type(value))


def _qualified_class(cls: type) -> str:
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


class _Checker:
    """The argument checks of one function, resolved on its first call."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self._signature: inspect.Signature | None = None
        self._hints: dict[str, Any] = {}
        self._fast: dict[str, tuple[type, ...] | None] = {}

    def _resolve(self) -> inspect.Signature:
        signature = inspect.signature(self._fn)
        try:
            hints = typing.get_type_hints(self._fn)
        except (NameError, AttributeError, TypeError):  # a name only for type checkers
            hints = {}
            namespace = getattr(self._fn, "__globals__", {})
            for name, param in signature.parameters.items():
                try:
                    annotation = param.annotation  # the library's own source text
                    hints[name] = (
                        eval(annotation, namespace) if isinstance(annotation, str) else annotation
                    )
                except (NameError, AttributeError, TypeError, SyntaxError):
                    log.debug("%s: annotation of %r not checked", self._fn.__qualname__, name)
        for name, param in signature.parameters.items():
            hint = hints.get(name, Any)
            if hint is inspect.Parameter.empty:
                continue
            if hint is Any:
                continue
            if param.kind is inspect.Parameter.VAR_POSITIONAL:
                hint = tuple[hint, ...]  # type: ignore[valid-type]
            elif param.kind is inspect.Parameter.VAR_KEYWORD:
                hint = dict[str, hint]  # type: ignore[valid-type]
            self._hints[name] = hint
            self._fast[name] = _plain_classes(hint)
        self._signature = signature
        return signature

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        signature = self._signature or self._resolve()
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return  # the call itself raises the interpreter's own TypeError
        for name, value in bound.arguments.items():
            hint = self._hints.get(name)
            if hint is None:
                continue
            classes = self._fast[name]
            if classes is not None:
                try:
                    if isinstance(value, classes):
                        continue
                except TypeError:
                    pass  # e.g. a protocol that is not runtime-checkable: typeguard decides
                else:
                    if len(classes) > 1 and type(None) not in classes:
                        # typeguard words a union as one line per member; one line reads better
                        wanted = " or ".join(_qualified_class(c) for c in classes)
                        raise ArgumentTypeError(
                            f'{self._fn.__qualname__}(): argument "{name}" '
                            f"({_qualified_name(value)}) is not an instance of {wanted}"
                        )
            self._slow(name, value, hint)

    def _slow(self, name: str, value: Any, hint: Any) -> None:
        from typeguard import TypeCheckError, TypeCheckMemo, check_type_internal

        fn = self._fn
        memo = TypeCheckMemo(getattr(fn, "__globals__", {}), {})
        try:
            check_type_internal(value, hint, memo)
        except TypeCheckError as exc:
            exc.append_path_element(f'argument "{name}" ({_qualified_name(value)})')
            raise ArgumentTypeError(f"{fn.__qualname__}(): {exc}") from None


def checked(fn: F) -> F:
    """Check the annotated arguments of each call to ``fn``; a mismatch raises
    :class:`ArgumentTypeError` naming the function and the argument."""
    checker = _Checker(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        checker.check(args, kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
