"""Local file system backend.

Writes go to a temporary file in the target's directory and are renamed into
place, so no reader ever sees a short object. Create-only uses ``link``
(fails if the target exists); compare-and-swap holds an ``flock`` on the
directory while it checks the version and renames. Files are fsynced before
they become visible unless the storage option ``fsync`` is false.

Symbolic links never lead a store out of its root. The root itself may be a
link (it is resolved on every use, like any path the user gives); below it,
every path is resolved (``os.path.realpath``) and must stay inside the
resolved root:

- reads (``get``, ranges, versioned reads) of a path that resolves outside
  raise :class:`OutsideRootError` (a :class:`~cloudckpt.errors.StorageError`,
  a :class:`~cloudckpt.errors.CorruptCheckpointError` and a
  :class:`PermissionError`); a file inside is opened by its resolved path with
  ``O_NOFOLLOW``;
- ``info``/``exists`` treat such a path as absent, and listings skip it and
  never descend into linked directories (no cycles, nothing counted twice);
- writes and deletes resolve the directory of the target and refuse one that
  lies outside; the last component is replaced or unlinked, never followed,
  so a link is overwritten or removed but its target is never touched.

Links that stay inside the root keep working for reads and writes (files
reached through them are listed when the link itself is a file). A store
opened on a child prefix (:meth:`Store.child`) keeps the root of the store it
came from. What is not covered: a concurrent writer swapping a directory for a
link between the check and the system call (the final component is still
protected by ``O_NOFOLLOW`` on reads and by rename/link semantics on writes).
"""

from __future__ import annotations

import fcntl
import os
import stat
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from io import BufferedReader
from typing import Any, ClassVar

from fsspec.implementations.local import LocalFileSystem

from cloudckpt.errors import OutsideRootError, StorageError
from cloudckpt.names import TMP_PREFIX
from cloudckpt.storage import versioning
from cloudckpt.storage.backend import Host
from cloudckpt.storage.fsspec_backend import FsspecBackend
from cloudckpt.storage.options import flag, refuse_options
from cloudckpt.storage.retry import storage_error
from cloudckpt.storage.writers import RangeWriter, RawWriter
from cloudckpt.util.crc import Buffer

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class FileBackend(FsspecBackend):
    """Objects as files below a local directory."""

    protocols: ClassVar[tuple[str, ...]] = ("file", "local")
    native_conditional_writes: ClassVar[bool] = True
    ranged_writes: ClassVar[bool] = True

    def __init__(self, root: str, **kw: Any) -> None:
        super().__init__(root, **kw)
        # The store's children share the backend: they stay inside the store they came from.
        self._jail = self.root

    def rooted(self, root: str) -> FileBackend:
        new = super().rooted(root)
        new._jail = root  # opened there on purpose: contained there
        return new

    def _root_of(self, root: str) -> str:
        return os.path.abspath(root)

    @classmethod
    def filesystem_options(cls) -> frozenset[str] | None:
        return frozenset()  # the local filesystem takes none; fsync is the backend's own

    def _read_options(self, scheme: str, options: dict[str, Any]) -> dict[str, Any]:
        self.fsync = flag("fsync", options.pop("fsync")) if "fsync" in options else True
        refuse_options(scheme, options, allowed=["fsync"])
        return options

    def _filesystem(self, options: dict[str, Any]) -> LocalFileSystem:
        return LocalFileSystem()

    def uri_of(self, root: str) -> str:
        return root

    def bucket_versioning(self, root: str) -> str:
        return versioning.OFF  # a deleted file is gone

    # -- containment -------------------------------------------------------

    def _resolve(self, path: str) -> str:
        """``path`` with every link resolved; OutsideRootError if that leaves the root."""
        jail = os.path.realpath(self._jail)
        real = os.path.realpath(path)
        if not _within(real, jail):
            raise OutsideRootError(
                f"{path} leads outside the store root {self._jail} through a symbolic link "
                f"(to {real}); cloudckpt does not follow links out of a local store. Remove "
                "the link, or open the store at the real location."
            )
        return real

    def _resolve_dir(self, path: str) -> str:
        """``path`` with its directory resolved and checked, its last component kept
        as is: writes and deletes replace or unlink a link, never follow it."""
        d, name = os.path.split(path)
        return os.path.join(self._resolve(d), name)

    def _stat(self, path: str) -> os.stat_result | None:
        """The stat of the regular file ``path`` resolves to inside the root, else None."""
        try:
            real = self._resolve(path)
        except OutsideRootError:
            return None
        try:
            st = os.stat(real)
        except FileNotFoundError:
            return None
        return st if stat.S_ISREG(st.st_mode) else None

    def _open_read(self, path: str) -> BufferedReader:
        fd = os.open(self._resolve(path), os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
        return os.fdopen(fd, "rb")

    # -- writes ------------------------------------------------------------

    def _tmp_for(self, path: str) -> str:
        d, name = os.path.split(path)
        return os.path.join(d, f"{TMP_PREFIX}{name}.{uuid.uuid4().hex[:12]}")

    def _write_tmp(self, path: str, data: Buffer) -> str:
        tmp = self._tmp_for(path)
        try:
            with os.fdopen(_create(tmp), "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            _unlink(tmp)  # a full disk leaves no partial file behind
            raise
        return tmp

    def _sync_dir(self, path: str) -> None:
        if self.fsync:
            fd = os.open(os.path.dirname(path), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def put(self, path: str, data: Buffer) -> str:
        path = self._resolve_dir(path)
        tmp = self._write_tmp(path, data)
        try:
            st = os.stat(tmp)  # the object's inode: its version, even if deleted at once
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        self._sync_dir(path)
        return _version(st)

    def put_if_absent(self, path: str, data: Buffer) -> str:
        path = self._resolve_dir(path)
        tmp = self._write_tmp(path, data)
        try:
            st = os.stat(tmp)
            os.link(tmp, path)  # atomic, and fails if path exists
        finally:
            _unlink(tmp)
        self._sync_dir(path)
        return _version(st)

    def put_if_match(self, path: str, data: Buffer, version: str) -> str:
        path = self._resolve_dir(path)
        with self._dir_lock(path):
            st = self._stat(path)
            current = _version(st) if st is not None else None
            if current != version:
                raise FileExistsError(f"{path}: version {current} != expected {version}")
            return self.put(path, data)

    @contextmanager
    def _dir_lock(self, path: str):
        d = os.path.dirname(self._resolve_dir(path))
        os.makedirs(d, exist_ok=True)
        fd = os.open(d, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def open_writer(self, path: str, host: Host) -> RawWriter:
        return _FileWriter(self, path)

    def open_range_writer(self, path: str, size: int) -> RangeWriter:
        return _RangeFileWriter(self, path, size)

    # -- reads ---------------------------------------------------------------

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        with self._open_read(path) as f:
            if start:
                f.seek(start)
            return f.read() if end is None else f.read(end - (start or 0))

    def iter_range(self, path: str, start: int, end: int, chunk: int) -> Iterator[bytes]:
        with self._open_read(path) as f:
            f.seek(start)
            pos = start
            while pos < end:
                data = f.read(min(chunk, end - pos))
                if not data:
                    return
                pos += len(data)
                yield data

    def readinto_range(self, path: str, start: int, views: list[memoryview]) -> None:
        """Fill ``views`` in turn from byte ``start`` on (an optional primitive the
        Store's ``read_range_into`` uses where a backend has it)."""
        # Straight from the page cache into the caller's buffers: no copy of our own.
        with self._open_read(path) as f:
            f.seek(start)
            for view in views:
                got = 0
                while got < view.nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        raise EOFError(f"{path} ends before byte {start + view.nbytes}")
                    got += n

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        with self._open_read(path) as f:
            version = _version(os.fstat(f.fileno()))
            return f.read(), version

    def head(self, path: str) -> dict[str, Any] | None:
        st = self._stat(path)
        return None if st is None else _entry(path, st)

    def find(self, path: str) -> dict[str, dict[str, Any]]:
        # Our own walk, not fsspec's: linked directories are never descended, and a
        # linked file is listed only when it resolves to a file inside the root.
        jail = os.path.realpath(self._jail)
        top = self._resolve(path)
        if not os.path.isdir(top):
            st = self._stat(path)
            return {} if st is None else {path: _entry(path, st)}
        out: dict[str, dict[str, Any]] = {}
        for dirpath, _dirs, names in os.walk(top):
            rel = os.path.relpath(dirpath, top)
            base = path if rel == "." else f"{path}/{rel.replace(os.sep, '/')}"
            for name in names:
                full = os.path.join(dirpath, name)
                try:
                    st = os.lstat(full)
                    if stat.S_ISLNK(st.st_mode):
                        real = os.path.realpath(full)
                        st = os.stat(real) if _within(real, jail) else None
                except OSError:  # vanished meanwhile, or a dangling link
                    continue
                if st is not None and stat.S_ISREG(st.st_mode):
                    out[f"{base}/{name}"] = _entry(f"{base}/{name}", st)
        return out

    def ls_dirs(self, path: str) -> list[str]:
        jail = os.path.realpath(self._jail)
        try:
            with os.scandir(self._resolve(path)) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [f"{path}/{e.name}" for e in entries
                if e.is_dir(follow_symlinks=False)
                or (e.is_symlink() and e.is_dir() and _within(os.path.realpath(e.path), jail))]

    def version_of(self, info: Mapping[str, Any]) -> str | None:
        return info.get("version")

    def delete(self, paths: list[str], root: str) -> None:
        # Every directory is checked before anything is deleted; the last component
        # is unlinked, so a link is removed and its target left alone.
        for real in [self._resolve_dir(p) for p in paths]:
            _unlink(real)
        # Leave no empty directories behind (the deleting store's root included), as
        # an object store has no empty prefixes.
        for d in sorted({os.path.dirname(p) for p in paths}, key=len, reverse=True):
            while d == root or d.startswith(root + os.sep):
                try:
                    os.rmdir(d)
                except OSError:
                    break
                d = os.path.dirname(d)


def _create(path: str, attempts: int = 5) -> int:
    """Create the new file ``path`` (its directories too) and open it for writing. A
    delete of the last object beside it removes the directory it empties, as an object
    store has no empty prefixes; when that happens between the two steps, make the
    directory again."""
    for attempt in range(attempts):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW
                           | _O_CLOEXEC, 0o666)
        except (FileNotFoundError, FileExistsError):  # a directory made or pruned meanwhile
            if attempt == attempts - 1 or os.path.lexists(path):
                raise
    raise AssertionError("unreachable")


class _FileWriter(RawWriter):
    def __init__(self, backend: FileBackend, path: str) -> None:
        path = backend._resolve_dir(path)
        self._backend = backend
        self._path = path
        self._tmp = backend._tmp_for(path)
        self._f = os.fdopen(_create(self._tmp), "wb")  # closed in commit/abort

    def write(self, data: Buffer) -> None:
        try:
            self._f.write(data)
        except OSError as exc:  # a full disk or the file size limit: say which
            raise storage_error(exc, f"write {self._path}", errors=self._backend) from exc

    def commit(self, size: int, crc32c: str) -> None:
        try:
            if self._backend.fsync:
                self._f.flush()
                os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self._tmp, self._path)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, OSError):
                raise storage_error(exc, f"write {self._path}", errors=self._backend) from exc
            raise
        self._backend._sync_dir(self._path)

    def abort(self) -> None:
        try:
            self._f.close()  # may fail flushing onto a full disk: the file goes anyway
        except OSError:
            pass
        finally:
            _unlink(self._tmp)


class _RangeFileWriter(RangeWriter):
    """A temporary file of the final size, written with ``pwrite`` at any offset from
    any thread, then fsynced and renamed into place like every other write."""

    def __init__(self, backend: FileBackend, path: str, size: int) -> None:
        self._backend = backend
        self._path = backend._resolve_dir(path)  # the directory may not lead outside
        self._size = size
        self._tmp = backend._tmp_for(self._path)
        self._fd: int | None = None
        try:
            self._fd = _create(self._tmp)
            os.ftruncate(self._fd, size)
        except OSError as exc:
            self.abort()
            raise storage_error(exc, f"write {self._path}", errors=self._backend) from exc

    def write_at(self, offset: int, data: Buffer) -> None:
        if self._fd is None:
            raise ValueError(f"write to a closed writer of {self._path}")
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > self._size:
            raise ValueError(f"range [{offset}, {offset + len(view)}) outside {self._path} "
                             f"of {self._size} bytes")
        try:
            while view:
                n = os.pwrite(self._fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError as exc:  # a full disk or the file size limit: say which
            raise storage_error(exc, f"write {self._path}", errors=self._backend) from exc

    def commit(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            raise ValueError(f"commit of a closed writer of {self._path}")
        try:
            try:
                if os.fstat(fd).st_size != self._size:
                    raise StorageError(f"{self._tmp} changed size while being written")
                if self._backend.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self._tmp, self._path)
        except BaseException as exc:
            _unlink(self._tmp)
            if isinstance(exc, OSError) and not isinstance(exc, StorageError):
                raise storage_error(exc, f"write {self._path}", errors=self._backend) from exc
            raise
        self._backend._sync_dir(self._path)

    def abort(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        _unlink(self._tmp)


def _within(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _entry(name: str, st: os.stat_result) -> dict[str, Any]:
    return {"name": name, "size": st.st_size, "type": "file", "mtime": st.st_mtime,
            "version": _version(st)}


def _version(st: os.stat_result) -> str:
    # A rename gives a new inode; mtime and size catch in-place rewrites.
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
