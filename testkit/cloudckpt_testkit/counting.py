"""A store that counts its requests: ``count://bucket/prefix``, objects in memory.

Every primitive a :class:`~cloudckpt.storage.Store` asks of its backend is
recorded as the S3 request it stands for (``PUT``, ``GET``, ``HEAD``, ``LIST``, ``DELETE``,
``COPY``), with the key, the bytes it carried, whether it was conditional,
the simulated rank that made it (:func:`~cloudckpt_testkit.threadranks.current_rank`)
and a timestamp. A listing counts one ``LIST`` per page of 1,000 keys and a
batch delete one ``DELETE`` per 1,000 keys, as S3 bills and throttles them;
a streamed ranged read is one ``GET`` however it is consumed.

Conditional writes are enforced (the memory backend's), so the counts are
those of a store that needs no probing.

The ``count://`` scheme is registered by an entry point of this distribution
(group ``cloudckpt.backends``, see its ``pyproject.toml``): ``open_store`` finds
it without this module being imported first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cloudckpt.storage.backends.memory import MemoryBackend
from cloudckpt.util.crc import Buffer
from cloudckpt_testkit.threadranks import current_rank

#: Keys per LIST page and per DeleteObjects call on S3 (and GCS's list page).
PAGE = 1000


@dataclass(frozen=True)
class Request:
    """One request as the bucket would see it."""

    t: float
    rank: int | None
    kind: str
    key: str
    size: int = 0
    conditional: bool = False


@dataclass
class Recorder:
    """The requests sent to one bucket, in order."""

    requests: list[Request] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, key: str, size: int = 0, conditional: bool = False) -> None:
        req = Request(time.monotonic(), current_rank(), kind, key, size, conditional)
        with self._lock:
            self.requests.append(req)

    def take(self) -> list[Request]:
        """The requests so far; the recorder starts afresh."""
        with self._lock:
            out, self.requests = self.requests, []
        return out


_RECORDERS: dict[str, Recorder] = {}
_quiet = threading.local()


@contextmanager
def _quietly() -> Iterator[None]:
    """Nothing this thread sends meanwhile is recorded (the primitives a recorded
    request is made of)."""
    was = getattr(_quiet, "on", False)
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = was


def recorder(bucket: str) -> Recorder:
    """The recorder of ``count://bucket``, created on first use."""
    return _RECORDERS.setdefault(bucket, Recorder())


class CountingBackend(MemoryBackend):
    """A memory backend that records every request it stands for (see the module)."""

    protocols: ClassVar[tuple[str, ...]] = ("count",)

    @property
    def bucket(self) -> str:
        return self.root.strip("/").split("/", 1)[0]

    def _note(self, kind: str, path: str, size: int = 0, conditional: bool = False,
              times: int = 1) -> None:
        if getattr(_quiet, "on", False):
            return
        key = path.lstrip("/").split("/", 1)[-1]
        rec = recorder(self.bucket)
        for _ in range(max(1, times)):
            rec.add(kind, key, size, conditional)

    def _inner(self, fn: Any, *args: Any) -> Any:
        """Call the memory store's primitive without recording what it calls."""
        with _quietly():
            return fn(*args)

    def put(self, path: str, data: Buffer) -> str:
        self._note("PUT", path, len(memoryview(data).cast("B")))
        return self._inner(super().put, path, data)

    def put_if_absent(self, path: str, data: Buffer) -> str:
        self._note("PUT", path, len(memoryview(data).cast("B")), conditional=True)
        return self._inner(super().put_if_absent, path, data)

    def put_if_match(self, path: str, data: Buffer, version: str) -> str:
        self._note("PUT", path, len(memoryview(data).cast("B")), conditional=True)
        return self._inner(super().put_if_match, path, data, version)

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        data = self._inner(super().get, path, start, end)
        self._note("GET", path, len(data))
        return data

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        data, version = self._inner(super().get_versioned, path)
        self._note("GET", path, len(data))
        return data, version

    def iter_range(self, path: str, start: int, end: int, chunk: int) -> Iterator[bytes]:
        self._note("GET", path, end - start)  # one streamed GET, however many pieces
        with _quietly():
            yield from super().iter_range(path, start, end, chunk)

    def head(self, path: str) -> dict[str, Any] | None:
        self._note("HEAD", path)
        return self._inner(super().head, path)

    def find(self, path: str) -> dict[str, dict[str, Any]]:
        found = self._inner(super().find, path)
        self._note("LIST", path + "/", times=-(-len(found) // PAGE))
        return found

    def ls_dirs(self, path: str) -> list[str]:
        found = self._inner(super().ls_dirs, path)
        self._note("LIST", path + "/", times=-(-len(found) // PAGE))
        return found

    def delete(self, paths: list[str], root: str) -> None:
        for i in range(0, len(paths), PAGE):
            batch = paths[i:i + PAGE]
            self._note("DELETE", batch[0], len(batch))
        self._inner(super().delete, paths, root)

    def bucket_exists(self, root: str) -> bool | None:
        self._note("HEAD", f"/{self.bucket}")
        return True
