"""Where a writer's objects go, and how a finished dataset is committed there.

Two kinds of output, one interface (:class:`Output`: a zarr ``store`` to write into, then
``commit()`` or ``abort()``):

* :class:`LocalOutput`, a local path: everything is written into a staging directory beside the
  target (``<path>.partial-<random>``) which ``commit()`` renames into place, so a crash leaves
  the previous dataset or nothing, never a half-written store.
* :class:`ObjectOutput`, any other fsspec URL (``gs://``, ``s3://``, ``memory://``): an object
  store has no rename, so chunks are written at their final keys while every metadata object
  (``zarr.json``, ``.zarray``, ``.zgroup``, ``.zattrs``) is held back in memory and written by
  ``commit()`` last, arrays first and the root group's very last. A reader therefore finds no
  dataset (no root metadata) until the commit, then a complete one. Replacing an existing
  dataset removes its root metadata first, then the rest, before any new object is written.

Both wrap their store in :class:`OutputStore`, which turns an ``OSError`` of a write (a full
disk, a permission error) into a :class:`StorageError` naming the object, and which ``stop()``
fences: no new write starts, and the call returns only when the writes in flight have ended, so
removing the staging directory afterwards is final (zarr's sync API returns on the first failed
chunk write while its other writes of the same call are still running and would recreate it).

The distributed converter (:mod:`asyncflat.writer.distributed`) commits through the same two
classes: its tasks write their objects at :attr:`Output.location` (the staging directory, or the
URL), and an :class:`ObjectOutput` opened with ``hold_back="root"`` holds back only the root
group's metadata, so the array metadata the tasks open is in the bucket before they start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import shutil
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any, Literal

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from asyncflat.errors import (
    AsyncflatError,
    ConfigError,
    StorageError,
    install_log_redaction,
    option_secrets,
)
from asyncflat.format.codec import METADATA_FILES
from asyncflat.storage.filesystems import is_remote
from asyncflat.storage.local_files import has_glob
from asyncflat.storage.obstore_client import without_client

__all__ = [
    "LocalOutput",
    "ObjectOutput",
    "Output",
    "OutputExistsError",
    "OutputStore",
    "check_output",
    "display_url",
    "is_remote",
    "open_output",
]

logger = logging.getLogger(__name__)

#: Top-level and split-level names of a flat-tokens store: a directory holding nothing else is
#: one, and ``overwrite`` may replace it. Anything else is refused, so a mistyped ``-o`` never
#: deletes a user's files.
_ROOT_NAMES = METADATA_FILES | {"train", "validation"}
_SPLIT_NAMES = METADATA_FILES | {"encoded_tokens", "seq_starts"}
#: What an :class:`OutputStore` holds back until the commit: nothing, every metadata object, or
#: the root group's only (the distributed converter's tasks must open the array metadata).
HoldBack = Literal["none", "metadata", "root"]
#: How long ``stop()`` waits for writes in flight before giving up on them.
_STOP_WAIT_S = 120.0


class OutputExistsError(ConfigError):
    """The output path already holds something and replacing it was not asked for."""

    def __init__(self, where: str) -> None:
        super().__init__(f"{where} already exists (pass overwrite=True to replace it)")
        self.where = where


def display_url(url: str) -> str:
    """``url`` as shown in messages: a ``user:password@`` part becomes ``user:***@``."""
    return re.sub(r"^([a-zA-Z][\w+.-]*://[^/@:]*):[^/@]*@", r"\1:***@", url)


def _storage_error(exc: Exception, what: str) -> StorageError:
    if isinstance(exc, OSError) and exc.errno is not None:
        reason = f"{exc.strerror or exc} ({type(exc).__name__}, errno {exc.errno})"
    else:
        reason = f"{type(exc).__name__}: {exc}"
    return StorageError(f"{what}: {reason}")


class OutputStore(WrapperStore[Store]):
    """The store an :class:`Output` hands to zarr: its writes name the object on failure, can be
    fenced (:meth:`stop`), and may hold back metadata until the commit.

    ``display`` is the output's name in messages. ``hold_back`` says which metadata objects are
    kept in :attr:`deferred` (and served from there to zarr) instead of being written.
    """

    def __init__(self, store: Store, *, display: str, hold_back: HoldBack = "none") -> None:
        super().__init__(store)
        self.display = display.rstrip("/")
        self.hold_back = hold_back
        self.deferred: dict[str, Buffer] = {}
        self._cond = threading.Condition()
        self._in_flight = 0
        self._stopped = False

    def _with_store(self, store: Store) -> OutputStore:
        return OutputStore(store, display=self.display, hold_back=self.hold_back)

    def _is_deferred(self, key: str) -> bool:
        if self.hold_back == "none" or key.rsplit("/", 1)[-1] not in METADATA_FILES:
            return False
        return self.hold_back == "metadata" or "/" not in key

    async def write_deferred(self) -> None:
        """Write the held-back metadata: deepest first; within a group, ``zarr.json`` /
        ``.zgroup`` after ``.zattrs``, so a reader finds the root only when all is in place."""

        def order(key: str) -> tuple[int, int]:
            name = key.rsplit("/", 1)[-1]
            return (-key.count("/"), name in ("zarr.json", ".zgroup"))

        for key in sorted(self.deferred, key=order):
            await self._store.set(key, self.deferred[key])

    async def set(self, key: str, value: Buffer) -> None:
        if self._is_deferred(key):
            self.deferred[key] = value
            return
        with self._cond:
            if self._stopped:
                raise StorageError(f"{self.display}/{key}: not written, the writer was stopped")
            self._in_flight += 1
        try:
            await self._store.set(key, value)
        except AsyncflatError:
            raise
        except Exception as exc:  # gcsfs's HttpError is no OSError
            raise _storage_error(exc, f"cannot write {self.display}/{key}") from exc
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        if self._is_deferred(key):
            self.deferred.setdefault(key, value)
            return
        if not await self.exists(key):
            await self.set(key, value)

    async def _set_many(self, values: Iterable[tuple[str, Buffer]]) -> None:
        await asyncio.gather(*(self.set(key, value) for key, value in values))

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        if self._is_deferred(key):
            value = self.deferred.get(key)
            if value is None or byte_range is None:
                return value
            return await _slice(value, byte_range)
        return await self._store.get(key, prototype, byte_range)

    async def exists(self, key: str) -> bool:
        if self._is_deferred(key):
            return key in self.deferred
        return await self._store.exists(key)

    async def delete(self, key: str) -> None:
        if self._is_deferred(key):
            self.deferred.pop(key, None)
            return
        await self._store.delete(key)

    def stop(self) -> None:
        """Refuse new writes and wait (bounded) until the writes in flight have ended."""
        deadline = time.monotonic() + _STOP_WAIT_S
        with self._cond:
            self._stopped = True
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning(
                        "%s: %d writes still in flight after %.0f s; removing the output anyway",
                        self.display,
                        self._in_flight,
                        _STOP_WAIT_S,
                    )
                    return
                self._cond.wait(left)


async def _slice(value: Buffer, byte_range: ByteRequest) -> Buffer:
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest

    if isinstance(byte_range, RangeByteRequest):
        return value[byte_range.start : byte_range.end]
    if isinstance(byte_range, OffsetByteRequest):
        return value[byte_range.offset :]
    if isinstance(byte_range, SuffixByteRequest):
        return value[len(value) - byte_range.suffix :]
    raise TypeError(f"unexpected byte range {byte_range!r}")


def _check_replaceable(where: str, top: list[str], below: dict[str, list[str]]) -> None:
    """Refuse to overwrite anything but a flat-tokens store (by its names) or an empty directory."""
    foreign = sorted(set(top) - _ROOT_NAMES)
    for split, names in below.items():
        foreign += sorted(f"{split}/{n}" for n in set(names) - _SPLIT_NAMES)
    if foreign:
        # an object named like the output itself lists as the empty name
        foreign = [name or "an object at that very path" for name in foreign]
        shown = ", ".join(foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        raise ConfigError(
            f"{where} exists and is not a flat-tokens store (it holds {shown}); overwrite only "
            "replaces a flat-tokens store or an empty directory: remove it yourself or choose "
            "another output path"
        )


def _check_local_target(path: str, overwrite: bool) -> None:
    """Refuse a local output that exists, unless ``overwrite`` and it is a flat-tokens store
    or an empty directory."""
    if not os.path.lexists(path):
        return
    if not overwrite:
        raise OutputExistsError(path)
    if os.path.islink(path) or not os.path.isdir(path):
        kind = "a symlink" if os.path.islink(path) else "a file"
        raise ConfigError(
            f"{path} exists and is {kind}, not a flat-tokens store; overwrite only "
            "replaces a flat-tokens store or an empty directory"
        )
    top = os.listdir(path)
    below = {
        name: os.listdir(os.path.join(path, name))
        for name in top
        if name in ("train", "validation") and os.path.isdir(os.path.join(path, name))
    }
    _check_replaceable(path, top, below)


class Output:
    """The target of one writer: a zarr ``store`` to write into, then ``commit`` or ``abort``."""

    display: str
    #: where the objects are written until the commit: the staging directory, or the URL
    location: str
    store: OutputStore

    def commit(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class LocalOutput(Output):
    """A local directory, written into a staging directory beside it and renamed into place.

    ``staging_tag`` names the staging directory ``<path>.partial-<tag>`` (default: random); a
    caller that reruns the same job passes a stable tag, and a previous run's leftover staging
    directory of that name is removed first.
    """

    def __init__(self, path: str, *, overwrite: bool, staging_tag: str | None = None) -> None:
        self.path = os.path.abspath(path)
        self.display = self.path
        self.overwrite = overwrite
        _check_local_target(self.path, self.overwrite)
        parent = os.path.dirname(self.path)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise _storage_error(exc, f"cannot create the parent directory {parent}") from exc
        self.staging = f"{self.path}.partial-{staging_tag or secrets.token_hex(6)}"
        if staging_tag is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
        try:
            os.mkdir(self.staging)
        except OSError as exc:
            raise _storage_error(exc, f"cannot create {self.staging}") from exc
        self.location = self.staging
        self.store = OutputStore(LocalStore(self.staging), display=self.display)
        # If the writer is dropped without commit()/abort(), still remove the staging directory.
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.staging, ignore_errors=True)

    def commit(self) -> None:
        old = None
        committed = False
        try:
            _fsync_tree(self.staging)
            _check_local_target(self.path, self.overwrite)
            if os.path.lexists(self.path):
                old = f"{self.path}.old-{secrets.token_hex(6)}"
                os.rename(self.path, old)
            try:
                os.rename(self.staging, self.path)
            except BaseException:
                if old is not None:
                    os.rename(old, self.path)  # put the previous dataset back
                raise
            # Committed from here on, whatever interrupts the rest (a Ctrl-C in the flush):
            # the staging directory is the dataset now, and the previous one goes...
            committed = True
            self._cleanup.detach()
            try:
                _fsync_dir(os.path.dirname(self.path))
            except OSError as exc:  # ...unless the disk failed: it may be needed back
                kept, old = old, None
                keeping = f"; the previous dataset is kept at {kept}" if kept else ""
                raise _storage_error(
                    exc,
                    f"committed {self.path}, but flushing its directory failed, so the commit "
                    f"may not survive a crash{keeping}",
                ) from exc
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            raise _storage_error(exc, f"cannot commit {self.path}") from exc
        finally:
            if committed and old is not None:
                shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        self.store.stop()
        self._cleanup()


class ObjectOutput(Output):
    """An fsspec URL: chunks at their final keys, metadata held back and written last.

    ``hold_back``: every metadata object (``"metadata"``, the writer's), or only the root
    group's (``"root"``, for writers in other processes that open the arrays themselves).
    """

    def __init__(
        self,
        url: str,
        *,
        overwrite: bool,
        storage_options: dict[str, Any] | None,
        hold_back: HoldBack = "metadata",
    ) -> None:
        self.url = url.rstrip("/")
        self.location = self.url
        self.display = display_url(self.url)
        raw = _object_store(self.url, storage_options, self.display)
        self.store = OutputStore(raw, display=self.display, hold_back=hold_back)
        self._raw = raw
        self._committed = self._aborted = False
        try:
            _sync(self._prepare(overwrite), self.display)
        except BaseException:
            _close_store(self._raw, self.display)
            raise

    async def _prepare(self, overwrite: bool) -> None:
        top = await _check_object_target(self._raw, self.display, overwrite)
        if not top:
            return
        # A reader must never see the old root with new chunks: the root's metadata goes first.
        for name in sorted(METADATA_FILES & set(top)):
            await self._raw.delete(name)
        await self._raw.delete_dir("")
        logger.info("%s: removed the previous dataset", self.display)

    def commit(self) -> None:
        try:
            _sync(self.store.write_deferred(), self.display)
            self._committed = True
        finally:
            _close_store(self._raw, self.display)

    def abort(self) -> None:
        self.store.stop()
        if self._committed or self._aborted:
            return  # a committed dataset is not this writer's to remove any more
        self._aborted = True
        try:
            _sync(self._raw.delete_dir(""), self.display)
        except Exception as exc:  # noqa: BLE001 -- best effort: the abort's cause is what to report
            logger.warning("%s: could not remove the partial output: %s", self.display, exc)
        _close_store(self._raw, self.display)


def open_output(
    path: str | os.PathLike[str],
    *,
    overwrite: bool,
    storage_options: dict[str, Any] | None,
    hold_back: HoldBack = "metadata",
    staging_tag: str | None = None,
) -> Output:
    """The output for a local path, a ``file://`` URL or any other fsspec URL.

    ``hold_back`` applies to a URL (see :class:`ObjectOutput`), ``staging_tag`` to a local path
    (see :class:`LocalOutput`).
    """
    text, remote = _target(path, storage_options)
    if remote:
        return ObjectOutput(
            text, overwrite=overwrite, storage_options=storage_options, hold_back=hold_back
        )
    return LocalOutput(text, overwrite=overwrite, staging_tag=staging_tag)


def _target(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None
) -> tuple[str, bool]:
    """``path`` as text (a local one without ``file://``) and whether it is an fsspec URL;
    storage_options for a local path are refused, and a URL's secrets are redacted from the
    logs from now on (fsspec's and the cloud clients' own log records show the URL)."""
    text = os.fspath(path)
    if is_remote(text):
        install_log_redaction(option_secrets(storage_options))
        return text, True
    if storage_options:
        raise ConfigError(
            f"storage_options are for fsspec URLs; {text} is a local path (got "
            f"{len(storage_options)} options)"
        )
    return text.removeprefix("file://"), False


#: Deletes in flight at once where a path is removed one literal object at a time.
_LITERAL_DELETES = 16


class _LiteralFsspecStore(FsspecStore):
    """An :class:`FsspecStore` whose deletes take its path literally: fsspec's ``rm`` expands
    glob characters, so removing the output ``runs/exp[12]`` (zarr's ``mode="w"``, an overwrite,
    an abort) would remove ``runs/exp1`` and ``runs/exp2``. Such a path's objects are listed
    (a literal prefix) and removed one request each."""

    async def delete(self, key: str) -> None:
        path = f"{self.path}/{key}"
        if not has_glob(path):
            await super().delete(key)
            return
        self._check_writable()
        with contextlib.suppress(FileNotFoundError, *self.allowed_exceptions):
            await self.fs._rm_file(path)

    async def delete_dir(self, prefix: str) -> None:
        path = f"{self.path}/{prefix}".rstrip("/")
        if not has_glob(path):
            await super().delete_dir(prefix)
            return
        self._check_writable()
        found: list[str] = []  # (nothing there: nothing to remove)
        with contextlib.suppress(FileNotFoundError, *self.allowed_exceptions):
            found = await self.fs._find(path, withdirs=False)
        limit = asyncio.Semaphore(_LITERAL_DELETES)

        async def remove(one: str) -> None:
            async with limit:
                with contextlib.suppress(FileNotFoundError, *self.allowed_exceptions):
                    await self.fs._rm_file(one)

        await asyncio.gather(*(remove(one) for one in found))


def _object_store(url: str, storage_options: dict[str, Any] | None, display: str) -> FsspecStore:
    options = {"skip_instance_cache": True, **without_client(storage_options)}
    try:
        return _LiteralFsspecStore.from_url(url, storage_options=options)
    except (ValueError, ImportError, TypeError) as exc:
        raise ConfigError(f"cannot write to {display}: {type(exc).__name__}: {exc}") from None


async def _check_object_target(raw: FsspecStore, display: str, overwrite: bool) -> list[str]:
    """Refuse an output URL that holds objects, unless ``overwrite`` and they are a flat-tokens
    store's; the names at its top (none: nothing there)."""

    async def names(prefix: str) -> list[str]:
        return [name async for name in raw.list_dir(prefix)]

    top = await names("")
    if top:
        if not overwrite:
            raise OutputExistsError(display)
        below: dict[str, list[str]] = {
            s: await names(s) for s in ("train", "validation") if s in top
        }
        _check_replaceable(display, top, below)
    return top


def check_output(
    path: str | os.PathLike[str], *, overwrite: bool, storage_options: dict[str, Any] | None
) -> None:
    """Refuse, reading only, an output that :func:`open_output` would refuse as it stands now:
    one that exists without ``overwrite``, or that is not a flat-tokens store or an empty
    directory. For a caller that starts costly work (a cluster) before it opens the output."""
    text, remote = _target(path, storage_options)
    if not remote:
        _check_local_target(os.path.abspath(text), overwrite)
        return
    display = display_url(text)
    raw = _object_store(text.rstrip("/"), storage_options, display)
    try:
        _sync(_check_object_target(raw, display, overwrite), display)
    finally:
        _close_store(raw, display)


def _sync(coro: Any, display: str) -> Any:
    """Run ``coro`` on zarr's loop; a filesystem's own error becomes a StorageError."""
    try:
        return sync(coro)
    except AsyncflatError:
        raise
    except Exception as exc:  # filesystems raise their own error types
        raise _storage_error(exc, display) from exc


def _close_store(raw: FsspecStore, display: str) -> None:
    try:
        sync(_close_filesystem(raw.fs))
    except Exception as exc:  # noqa: BLE001 -- closing sessions is best effort
        logger.debug("%s: closing the filesystem failed: %s", display, exc)


async def _close_filesystem(fs: Any) -> None:
    """Close the HTTP sessions of ``fs`` on zarr's loop (the one that made them)."""
    from asyncflat.storage.filesystems import close_filesystem

    await close_filesystem(getattr(fs, "sync_fs", fs))  # unwrap fsspec's sync-filesystem wrapper


def _fsync_tree(root: str) -> None:
    """Flush every file and directory under ``root`` so the rename commits durable data."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for filename in filenames:
            fd = os.open(os.path.join(dirpath, filename), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    """Flush a directory's entries (a rename into it is durable only after this)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
