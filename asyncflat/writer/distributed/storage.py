"""Where pieces and output live: a local path or any fsspec URL, reached the same way."""

from __future__ import annotations

import os
import secrets
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from asyncflat.storage.filesystems import is_remote as is_url  # a URL of a non-local filesystem
from asyncflat.storage.local_files import has_glob
from asyncflat.storage.obstore_client import without_client

__all__ = ["Location", "is_url"]


class Location:
    """A directory-like root (local or fsspec URL) with whole-object reads and writes.

    Picklable: tasks on other machines rebuild the filesystem from the URL and options.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        if not is_url(root):
            root = os.path.abspath(root.removeprefix("file://"))
        self.root = root.rstrip("/")
        self.storage_options = without_client(storage_options)  # fsspec writes, always
        self._fs: fsspec.AbstractFileSystem | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "storage_options": self.storage_options, "_fs": None}

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            self._fs, _ = fsspec.core.url_to_fs(self.root, **self.storage_options)
        return self._fs

    @property
    def local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def put(self, name: str, data: bytes) -> None:
        """Write one object whole: atomically (temp file + rename) on a local disk."""
        path = self.path(name)
        if self.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{secrets.token_hex(4)}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def get(self, name: str) -> bytes | None:
        """The object's bytes, or None if it does not exist."""
        try:
            return self.fs.cat_file(self.path(name))
        except FileNotFoundError:
            return None

    def get_many(self, names: list[str]) -> list[bytes | None]:
        """Each named object's bytes, or None where it cannot be read (on an object store as
        concurrent requests). The names are literal: fsspec's ``cat`` would expand glob
        characters, so a root ``runs/exp[1]`` would never find its own objects."""
        if self.local:
            return [self.get(name) for name in names]
        got = self.fs.cat_ranges([self.path(name) for name in names], 0, None, on_error="return")
        return [None if isinstance(item, BaseException) else item for item in got]

    def get_ranges(self, name: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        return self.get_many_ranges([(name, start, end) for start, end in ranges])

    def get_many_ranges(self, requests: list[tuple[str, int, int | None]]) -> list[bytes]:
        """Bytes ``[start, end)`` (``end`` None: to the end) of each named object, in order;
        on an object store as concurrent requests. A missing object is FileNotFoundError."""
        if not requests:
            return []
        if self.local:
            out = []
            for name, start, end in requests:
                with open(self.path(name), "rb") as f:
                    f.seek(start)
                    out.append(f.read() if end is None else f.read(end - start))
            return out
        got = self.fs.cat_ranges(
            [self.path(r[0]) for r in requests],
            [r[1] for r in requests],
            [r[2] for r in requests],
            on_error="return",
        )
        for item in got:
            if isinstance(item, BaseException):
                raise item
        return list(got)

    def exists(self, name: str = "") -> bool:
        return bool(self.fs.exists(self.path(name) if name else self.root))

    def names(self, folder: str) -> list[str]:
        """The names of the entries in ``folder`` (none when it does not exist). A bucket
        lists a folder's marker object (``folder/``, what a console's "create folder" makes)
        under the folder's own name: not an entry."""
        try:
            listed = self.fs.ls(self.path(folder), detail=False)
        except FileNotFoundError:
            return []
        names = {os.path.basename(p.rstrip("/")) for p in listed}
        if not self.local:
            names.discard(os.path.basename(folder.rstrip("/")))
        return sorted(names)

    def remove(self, *names: str) -> None:
        """Remove these objects (those that exist; in bulk requests on an object store), then
        on a local disk their folders and the root, each if it is left empty: never anything
        else a user keeps there."""
        paths = [self.path(name) for name in names]
        if not self.local:
            # fsspec's bulk rm expands glob characters (a work dir "runs/exp[12]" would remove
            # runs/exp1 and runs/exp2): such paths go one literal request each.
            if not any(has_glob(path) for path in paths):
                try:
                    self.fs.rm(paths)
                    return
                except FileNotFoundError:  # one went meanwhile: the others one by one
                    pass
            for path in paths:
                if self.fs.exists(path):
                    self.fs.rm_file(path)
            return
        for path in paths:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        folders = sorted({os.path.dirname(n) for n in names if "/" in n}, reverse=True)
        for folder in [*folders, ""]:
            try:
                os.rmdir(self.path(folder) if folder else self.root)
            except OSError:
                pass  # not empty: it holds something of the user's
