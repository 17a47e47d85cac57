"""What a test counts to show that the library let go of what it opened."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable


def open_fds() -> int:
    """File descriptors this process holds now (Linux: ``/proc/self/fd``)."""
    return len(os.listdir("/proc/self/fd"))


def rss_kib() -> int:
    """This process's resident memory, in KiB (``VmRSS``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def library_threads() -> list[str]:
    """The names of asyncflat's threads alive now."""
    return [t.name for t in threading.enumerate() if t.name.startswith("asyncflat")]


def wait_until(predicate: Callable[[], object], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` every 20 ms until it holds or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())
