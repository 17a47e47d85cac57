"""A first fill's parts on this host, each alone: what a loader's first load cannot go below.

**Fresh memory** (``allocation``): what a shuffle buffer's first writes cost, by how it is
allocated.

A fresh buffer's pages are mapped at their first write, one fault per 4 KiB page; on sandboxed
hosts (gVisor) that is several times the cost of writing the same memory again, and it is part of
a loader's first fill (asyncflat writes step 0's buffers ahead when the loader opens, see
``PageWriter`` in ``asyncflat/engine/fill.py``). This measures, for each way of getting the memory,
the first write of ``--mib`` MiB on 1 and on ``--threads`` threads (pieces of 4 MiB, ``memset``
through ctypes, which releases the GIL) and a second write of the same memory:

* ``numpy``: ``np.empty`` (what the buffers are; glibc's ``mmap`` below it);
* ``mmap``: a private anonymous mapping;
* ``mmap_hugepage``: the same after ``madvise(MADV_HUGEPAGE)``;
* ``mmap_populate``: ``MAP_POPULATE`` (the kernel maps every page in the ``mmap`` call);
* ``populate_write``: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+), on every thread's pieces;
* ``memfd``: a ``memfd_create`` file, ``posix_fallocate``d and mapped shared.

Each case runs in a fresh process, its imports (numpy included) done before the clock starts.
A case the kernel refuses is reported with its error.

**The rest of a fill** (``parts``): the ``--mib`` MiB of chunk objects of asyncflat's layout
(2^27 tokens, 1M-token chunks with the writer's default Blosc and crc32c; written once under
``$ASYNCFLAT_BENCH_DIR``, see ``bench/_common.py``), in the page cache, on 1 and ``--threads``
threads: ``read`` (``pread`` into memory written before, as the loader's reads are),
``crc32c`` and ``decode`` (Blosc, into memory written before), each alone, and
``read_beside_pages``: the reads while other threads first-write a fresh buffer of the same
size (both timed). ``floor_ms``: first writes + reads + checksums + decodes on ``--threads``
threads, one after the other: a first fill that waits for nothing else. Prints one JSON line::

    python bench/first_fill.py                 # 256 MiB, 1 and 6 threads, 2 rounds
    python bench/first_fill.py --mib 64 --threads 8 --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit, ensure_dataset

CASES = ("numpy", "mmap", "mmap_hugepage", "mmap_populate", "populate_write", "memfd")
PIECE = 4 << 20
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _address(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _madvise(address: int, size: int, advice: int) -> None:
    if _libc().madvise(address, size, advice) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"madvise({advice}): {os.strerror(errno)}")


def _write_all(pool: ThreadPoolExecutor, address: int, size: int, value: int) -> None:
    pieces = range(0, size, PIECE)
    list(pool.map(lambda lo: ctypes.memset(address + lo, value, min(PIECE, size - lo)), pieces))


def case(name: str, size: int, threads: int) -> dict[str, float]:
    """One case in this process: seconds of the first write and of a second one."""
    import numpy as np

    pool = ThreadPoolExecutor(threads)
    list(pool.map(lambda _: None, range(4 * threads)))  # the threads started before the clock
    keep: list[object] = []  # the mapping stays alive while it is written
    t0 = time.perf_counter()
    if name == "numpy":
        array = np.empty(size, np.uint8)
        keep.append(array)
        address = array.ctypes.data
    elif name == "memfd":
        fd = os.memfd_create("first-fill")
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        keep.append(mapped)
        address = _address(mapped)
    else:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if name == "mmap_populate":
            flags |= mmap.MAP_POPULATE
        mapped = mmap.mmap(-1, size, flags=flags)
        keep.append(mapped)
        address = _address(mapped)
        if name == "mmap_hugepage":
            _madvise(address, size, _MADV_HUGEPAGE)
        elif name == "populate_write":
            pieces = range(0, size, PIECE)
            list(
                pool.map(
                    lambda lo: _madvise(address + lo, min(PIECE, size - lo), _MADV_POPULATE_WRITE),
                    pieces,
                )
            )
    _write_all(pool, address, size, 1)
    t1 = time.perf_counter()
    _write_all(pool, address, size, 2)
    t2 = time.perf_counter()
    pool.shutdown()
    return {"first_ms": (t1 - t0) * 1e3, "again_ms": (t2 - t1) * 1e3}


def _objects(size: int) -> list[str]:
    """Paths of the chunk objects holding ``size`` bytes of decoded tokens."""
    import numpy as np

    root = os.path.join(ensure_dataset("aligned", 1 << 27), "train", "encoded_tokens", "c")
    count = max(1, size // (4 << 20))  # 1M-token chunks
    paths = [os.path.join(root, str(i)) for i in np.random.default_rng(0).permutation(128)[:count]]
    for path in paths:  # in the page cache, as a trainer's dataset is once read
        with open(path, "rb") as f:
            f.read()
    return paths


def parts(size: int, threads: int) -> dict[str, float]:
    """The fill's reads, checksums and decodes alone (seconds, in this process)."""
    import numpy as np

    from asyncflat.storage.blosc import decode_into
    from asyncflat.storage.chunks import crc32c

    paths = _objects(size)
    fds = [os.open(path, os.O_RDONLY) for path in paths]
    frames = [np.empty(os.fstat(fd).st_size, np.uint8) for fd in fds]
    outs = [np.empty(1 << 20, np.uint32) for _ in paths]
    for array in (*frames, *outs):
        array.fill(1)  # written before: the reads and decodes land in mapped pages

    def read(i: int) -> None:
        os.preadv(fds[i], [memoryview(frames[i])], 0)  # type: ignore[arg-type]

    def check(i: int) -> None:
        crc32c(frames[i][:-4])

    def decode(i: int) -> None:
        decode_into(frames[i][:-4], 0, outs[i])

    out: dict[str, float] = {}
    for count in sorted({1, threads}):
        pool = ThreadPoolExecutor(count)
        list(pool.map(lambda _: None, range(4 * count)))
        for name, job in (("read", read), ("crc32c", check), ("decode", decode)):
            t0 = time.perf_counter()
            list(pool.map(job, range(len(paths))))
            out[f"{name}/{count}"] = (time.perf_counter() - t0) * 1e3
        pool.shutdown()
    readers, writers = ThreadPoolExecutor(threads), ThreadPoolExecutor(threads)
    list(readers.map(lambda _: None, range(4 * threads)))
    list(writers.map(lambda _: None, range(4 * threads)))
    fresh = np.empty(size, np.uint8)
    t0 = time.perf_counter()
    # dispatched from a thread of its own: all ``threads`` writers write pages
    pages = threading.Thread(target=_write_all, args=(writers, fresh.ctypes.data, size, 1))
    pages.start()
    list(readers.map(read, range(len(paths))))
    out[f"read_beside_pages/{threads}"] = (time.perf_counter() - t0) * 1e3
    pages.join()
    out[f"pages_beside_read/{threads}"] = (time.perf_counter() - t0) * 1e3
    readers.shutdown()
    writers.shutdown()
    for fd in fds:
        os.close(fd)
    return out


def run_case(name: str, size: int, threads: int) -> dict[str, float | str]:
    argv = [sys.executable, os.path.abspath(__file__), "--child", name, str(size), str(threads)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--threads", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (medians)")
    parser.add_argument("--cases", default=",".join(CASES), help="allocations to measure")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, size, threads = args.child
        if name == "parts":
            print(json.dumps(parts(int(size), int(threads))))
        else:
            print(json.dumps(case(name, int(size), int(threads))))
        return
    if not 4 <= args.mib <= 512:
        parser.error("--mib: 4 to 512 (the parts read the 2^27-token dataset's 4 MiB chunks)")
    size = args.mib << 20
    cases = args.cases.split(",")
    runs: dict[str, list[dict[str, float | str]]] = {}
    for _ in range(args.rounds):
        for name in cases:
            for threads in sorted({1, args.threads}):
                runs.setdefault(f"{name}/{threads}", []).append(run_case(name, size, threads))
    measured = [run_case("parts", size, args.threads) for _ in range(args.rounds)]
    errors = [r["error"] for r in measured if "error" in r]
    fill: dict[str, float | str] = (
        {"error": str(errors[0])}
        if errors
        else {
            key: round(statistics.median(float(r[key]) for r in measured), 1) for key in measured[0]
        }
    )
    results: dict[str, dict[str, float | str]] = {}
    for key, rounds in runs.items():
        errors = [r["error"] for r in rounds if "error" in r]
        if errors:
            results[key] = {"error": str(errors[0])}
            continue
        results[key] = {
            field: round(statistics.median(float(r[field]) for r in rounds), 1)
            for field in ("first_ms", "again_ms")
        }
    emit(
        {
            "bench": "first_fill",
            "mib": args.mib,
            "threads": args.threads,
            "rounds": args.rounds,
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "allocation": results,
            "parts": fill,
            "floor_ms": _floor(results, fill, args.threads),
        }
    )


def _floor(
    allocation: dict[str, dict[str, float | str]], fill: dict[str, float | str], threads: int
) -> float | None:
    """First writes, reads, checksums and decodes on ``threads`` threads, one after the other."""
    keys = ("read", "crc32c", "decode")
    first = allocation.get(f"numpy/{threads}", {}).get("first_ms")
    if first is None or "error" in fill:
        return None
    return round(float(first) + sum(float(fill[f"{key}/{threads}"]) for key in keys), 1)


if __name__ == "__main__":
    main()
