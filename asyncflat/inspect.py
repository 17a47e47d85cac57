"""Deprecated alias of :mod:`asyncflat.inspection` (this name shadowed the standard library's
``inspect`` for code run from inside the package directory). Import ``asyncflat.inspection``."""

from __future__ import annotations

import warnings

from .inspection import *  # noqa: F403
from .inspection import __all__  # noqa: F401

warnings.warn(
    "asyncflat.inspect is deprecated; import asyncflat.inspection instead",
    DeprecationWarning,
    stacklevel=2,
)
