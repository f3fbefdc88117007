"""Local file system backend.

Writes go to a temporary file in the target's directory and are renamed into
place, so no reader ever sees a short object. Create-only uses ``link``
(fails if the target exists); compare-and-swap holds an ``flock`` on the
directory while it checks the version and renames. Files are fsynced before
they become visible unless ``fsync=False``.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from contextlib import contextmanager
from typing import Any, ClassVar

from fsspec.implementations.local import LocalFileSystem

from ..crc import Buffer
from .base import RawWriter, Store

_TMP_PREFIX = ".cloudckpt-tmp-"


class FileStore(Store):
    """Objects as files below a local directory."""

    protocols: ClassVar[tuple[str, ...]] = ("file", "local")
    native_conditional_writes: ClassVar[bool] = True

    def __init__(self, root: str, *, fsync: bool = True, **kwargs: Any) -> None:
        super().__init__(LocalFileSystem(), os.path.abspath(root), protocol="file", **kwargs)
        self.fsync = fsync

    @property
    def uri(self) -> str:
        return self.root

    # -- writes ------------------------------------------------------------

    def _tmp_for(self, path: str) -> str:
        d, name = os.path.split(path)
        return os.path.join(d, f"{_TMP_PREFIX}{name}.{uuid.uuid4().hex[:12]}")

    def _write_tmp(self, path: str, data: Buffer) -> str:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = self._tmp_for(path)
        with open(tmp, "wb") as f:
            f.write(data)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        return tmp

    def _sync_dir(self, path: str) -> None:
        if self.fsync:
            fd = os.open(os.path.dirname(path), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _put(self, path: str, data: Buffer) -> str:
        tmp = self._write_tmp(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        self._sync_dir(path)
        return _version(os.stat(path))

    def _put_if_absent(self, path: str, data: Buffer) -> str:
        tmp = self._write_tmp(path, data)
        try:
            os.link(tmp, path)  # atomic, and fails if path exists
        finally:
            _unlink(tmp)
        self._sync_dir(path)
        return _version(os.stat(path))

    def _put_if_match(self, path: str, data: Buffer, version: str) -> str:
        with self._dir_lock(path):
            try:
                current = _version(os.stat(path))
            except FileNotFoundError:
                current = None
            if current != version:
                raise FileExistsError(f"{path}: version {current} != expected {version}")
            return self._put(path, data)

    @contextmanager
    def _dir_lock(self, path: str):
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        fd = os.open(d, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _open_writer(self, path: str) -> RawWriter:
        return _FileWriter(self, path)

    # -- reads ---------------------------------------------------------------

    def _get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        with open(path, "rb") as f:
            if start:
                f.seek(start)
            return f.read() if end is None else f.read(end - (start or 0))

    def _get_versioned(self, path: str) -> tuple[bytes, str]:
        with open(path, "rb") as f:
            version = _version(os.fstat(f.fileno()))
            return f.read(), version

    def _head(self, path: str) -> dict[str, Any] | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        if not os.path.isfile(path):
            return None
        return {"name": path, "size": st.st_size, "type": "file", "mtime": st.st_mtime,
                "version": _version(st)}

    def _version_of(self, info: dict[str, Any]) -> str | None:
        return info.get("version")

    def _is_internal(self, path: str) -> bool:
        return os.path.basename(path).startswith(_TMP_PREFIX)

    def _delete(self, paths: list[str]) -> None:
        for p in paths:
            _unlink(p)
        # Leave no empty directories behind (the root included), as an object
        # store has no empty prefixes.
        for d in sorted({os.path.dirname(p) for p in paths}, key=len, reverse=True):
            while d == self.root or d.startswith(self.root + os.sep):
                try:
                    os.rmdir(d)
                except OSError:
                    break
                d = os.path.dirname(d)


class _FileWriter(RawWriter):
    def __init__(self, store: FileStore, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._store = store
        self._path = path
        self._tmp = store._tmp_for(path)
        self._f = open(self._tmp, "wb")  # noqa: SIM115 - closed in commit/abort

    def write(self, data: Buffer) -> None:
        self._f.write(data)

    def commit(self) -> None:
        try:
            if self._store.fsync:
                self._f.flush()
                os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self._tmp, self._path)
        except BaseException:
            self.abort()
            raise
        self._store._sync_dir(self._path)

    def abort(self) -> None:
        self._f.close()
        _unlink(self._tmp)


def _version(st: os.stat_result) -> str:
    # A rename gives a new inode; mtime and size catch in-place rewrites.
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
