"""In-process memory backend (fsspec ``memory://``), for unit tests and demos.

Conditional writes are serialised by a process-wide lock; the version token
is a hash of the content, so any change of content changes it.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, ClassVar

from fsspec.implementations.memory import MemoryFileSystem

from cloudckpt.storage import versioning
from cloudckpt.storage.fsspec_backend import FsspecBackend
from cloudckpt.storage.options import refuse_options
from cloudckpt.util.crc import Buffer

_LOCK = threading.RLock()


class MemoryBackend(FsspecBackend):
    """Objects in fsspec's process-global memory filesystem."""

    protocols: ClassVar[tuple[str, ...]] = ("memory",)
    native_conditional_writes: ClassVar[bool] = True

    def _root_of(self, root: str) -> str:
        return "/" + root.strip("/")

    @classmethod
    def filesystem_options(cls) -> frozenset[str] | None:
        return frozenset()

    def _read_options(self, scheme: str, options: dict[str, Any]) -> dict[str, Any]:
        refuse_options(scheme, options)
        return options

    def _filesystem(self, options: dict[str, Any]) -> MemoryFileSystem:
        return MemoryFileSystem()

    def uri_of(self, root: str) -> str:
        return f"{self.protocol}://{root.lstrip('/')}"

    def bucket_versioning(self, root: str) -> str:
        return versioning.OFF  # a deleted file is gone

    def put(self, path: str, data: Buffer) -> str:
        data = bytes(data)
        with _LOCK:
            self.fs.pipe_file(path, data)
        return _version(data)

    def put_if_absent(self, path: str, data: Buffer) -> str:
        with _LOCK:
            if self.fs.isfile(path):
                raise FileExistsError(path)
            return self.put(path, data)

    def put_if_match(self, path: str, data: Buffer, version: str) -> str:
        with _LOCK:
            try:
                current = _version(self.fs.cat_file(path))
            except FileNotFoundError:
                current = None
            if current != version:
                raise FileExistsError(path)
            return self.put(path, data)

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        with _LOCK:
            data = self.fs.cat_file(path)
        return data, _version(data)

    def strip_protocol(self, name: str) -> str:
        name = super().strip_protocol(name)
        return name if name.startswith("/") else "/" + name


def _version(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=12).hexdigest()
