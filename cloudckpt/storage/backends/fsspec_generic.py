"""Any other fsspec filesystem (``hdfs://``, ``abfs://``, ``sftp://`` ...).

Plain reads and writes go through fsspec. These filesystems offer no
conditional write that fsspec exposes, so create-only and compare-and-swap
are emulated by check-then-write: safe for one writer, NOT against
concurrent writers to the same key. A warning says so once per protocol.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any, ClassVar

import fsspec

from cloudckpt.storage.fsspec_backend import FsspecBackend
from cloudckpt.util.crc import Buffer

log = logging.getLogger(__name__)
_warned: set[str] = set()
_LOCK = threading.Lock()


class FsspecGenericBackend(FsspecBackend):
    """Fallback over any fsspec filesystem, with emulated conditional writes."""

    #: Any scheme: the ``protocol`` keyword names it (required), as open_store passes
    #: the URI's scheme to every backend. Options are not checked
    #: (``filesystem_options()`` is None): whatever the filesystem takes is passed on.
    protocols: ClassVar[tuple[str, ...]] = ()
    native_conditional_writes: ClassVar[bool] = False

    def _filesystem(self, options: dict[str, Any]) -> fsspec.AbstractFileSystem:
        return fsspec.filesystem(self.protocol, **options)

    def _warn(self) -> None:
        if self.protocol not in _warned:
            _warned.add(self.protocol)
            log.warning(
                "%s:// has no conditional writes; cloudckpt emulates them, which is not safe "
                "against two writers committing the same checkpoint at once", self.protocol)

    def put(self, path: str, data: Buffer) -> str:
        self.fs.pipe_file(path, bytes(data))
        return _version(bytes(data))

    def put_if_absent(self, path: str, data: Buffer) -> str:
        self._warn()
        with _LOCK:
            if self.fs.exists(path):
                raise FileExistsError(path)
            return self.put(path, data)

    def put_if_match(self, path: str, data: Buffer, version: str) -> str:
        self._warn()
        with _LOCK:
            if _version(self.fs.cat_file(path)) != version:
                raise FileExistsError(path)
            return self.put(path, data)

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        data = self.fs.cat_file(path)
        return data, _version(data)


def _version(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=12).hexdigest()
