"""Moved to :mod:`asyncflat.storage.blosc`; this name stays for compatibility."""

from .storage.blosc import AVAILABLE, BloscError, FrameLayout, decode_into, frame_problem

__all__ = ["AVAILABLE", "BloscError", "FrameLayout", "decode_into", "frame_problem"]
