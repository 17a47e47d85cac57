"""Every object a loader reads from a bucket, pinned to the version its first read saw.

A dataset in a bucket can be replaced while a job reads it (a re-upload, a sync, a
``gsutil cp`` over the same names). Replaced by objects of the same size, nothing else would
notice: an object read again would serve its new bytes beside the old ones already read.
So the first read of each object records its version from that same response (S3's ETag and
version id, GCS's generation, obstore's ``e_tag``), and every later read of the object, whole
or ranged, is *conditional* on it (``If-Match: <etag>``, ``ifGenerationMatch=<generation>``):
no second request, and a replaced object is refused by the store itself (412 Precondition
Failed) instead of served.

A refused object raises :class:`~asyncflat.errors.ObjectReplacedError` (a :class:`~asyncflat.errors.StorageError`:
the store no longer holds what the loader opened; each version's bytes may be fine, so it is not
a :class:`~asyncflat.errors.CorruptChunkError`, and it is never retried). The refusal is kept:
every later read of that object raises it again, without a request, until the loader is
reopened (a new loader pins afresh and reads the new version).

The pin is per object, from its first read: an object not read before a replacement is read
at its new version (docs/cloud.md says what pinning the whole dataset would take).

The table is per loader (per raw store): :class:`VersionPins`. The conditional reads of each
client live beside the client: :mod:`.filesystems` (s3fs, gcsfs), :mod:`.obstore_client`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NoReturn

from asyncflat.errors import ObjectReplacedError

__all__ = ["Version", "VersionMismatch", "VersionPins"]

log = logging.getLogger(__name__)


class VersionMismatch(Exception):
    """Raised by a client's conditional read when the store refused its precondition (412)."""


@dataclasses.dataclass(frozen=True)
class Version:
    """One version of one object, as the store names it."""

    kind: str  # "ETag", "generation"
    value: str
    #: Said alongside (an S3 version id of a versioned bucket); not compared.
    note: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.value}" + (f" ({self.note})" if self.note else "")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Version) and (self.kind, self.value) == (other.kind, other.value)

    def __hash__(self) -> int:
        return hash((self.kind, self.value))


class VersionPins:
    """Keys -> the version of the object first read, and the objects refused since."""

    def __init__(self) -> None:
        self._pinned: dict[str, Version] = {}
        self._refused: dict[str, str] = {}
        self._unversioned_warned = False

    def __len__(self) -> int:
        return len(self._pinned)

    def pinned(self, key: str) -> Version | None:
        """The version a read of ``key`` must be conditional on (None: its first read).
        Raises :class:`ObjectReplacedError` for an object refused before."""
        refusal = self._refused.get(key)
        if refusal is not None:
            raise ObjectReplacedError(refusal)
        return self._pinned.get(key)

    def record(self, key: str, found: Version | None) -> None:
        """Pin ``key`` to ``found`` (the version a read returned); raise if another read of it
        returned another version (two first reads in flight across a replacement)."""
        if found is None:
            if not self._unversioned_warned:
                self._unversioned_warned = True
                log.warning(
                    "the store sent no version (ETag or generation) with %s: its objects "
                    "cannot be pinned, a replaced object would go unnoticed",
                    key,
                )
            return
        pinned = self._pinned.setdefault(key, found)
        if pinned != found:
            self._refuse(key, f"pinned {pinned}, found {found}")

    def mismatch(self, key: str, pinned: Version) -> NoReturn:
        """The store refused a read conditional on ``pinned`` (412): the object changed."""
        self._refuse(
            key,
            f"pinned {pinned}, found another (412 Precondition Failed to a read conditional "
            "on the pinned version: changed since; a 412 does not name the new version)",
        )

    def _refuse(self, key: str, versions: str) -> NoReturn:
        message = (
            f"object replaced in the store since this loader first read it: {versions}; "
            "refused (never mixed with the version read before) until the loader is reopened"
        )
        self._refused[key] = message
        raise ObjectReplacedError(message)
