"""Moved to :mod:`asyncflat.storage.retry`; this name stays for compatibility."""

from .storage.retry import is_throttle, is_transient, retrying

__all__ = ["is_throttle", "is_transient", "retrying"]
