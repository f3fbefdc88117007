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

A sampled simulation (:class:`~cloudckpt_testkit.threadranks.SampledWorld`) stands
the objects of the ranks that do not run in as phantoms (:func:`phantom`): listed,
found by ``HEAD`` and deleted like any object, their bytes made only if one is read.

The ``count://`` scheme is registered by an entry point of this distribution
(group ``cloudckpt.backends``, see its ``pyproject.toml``): ``open_store`` finds
it without this module being imported first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cloudckpt.storage import Store
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


class PhantomReadError(RuntimeError):
    """A phantom object with no model of its bytes was read."""


#: Phantom objects by backend path: their size, and how to make their bytes (None: none).
_PHANTOMS: dict[str, tuple[int, Callable[[], bytes] | None]] = {}
_PHANTOM_LOCK = threading.Lock()


def phantom(store: Store, key: str, size: int,
            content: Callable[[], bytes] | None = None) -> None:
    """Stand in ``key`` of ``store`` (a ``count://`` store) as an object of ``size``
    bytes that was never written: what a rank that does not run in a sampled
    simulation would have written. Registering it is no request. Reading it calls
    ``content()`` for its bytes (which must be ``size`` long); without ``content``
    a read raises :class:`PhantomReadError`: nobody should read it."""
    if not isinstance(store.backend, CountingBackend):
        raise TypeError(f"phantom objects live in count:// stores, not {store.uri}")
    with _PHANTOM_LOCK:
        _PHANTOMS[store.path(key)] = (size, content)


def phantoms(store: Store) -> int:
    """How many phantom objects lie under ``store``."""
    below = store.root.rstrip("/") + "/"
    with _PHANTOM_LOCK:
        return sum(p.startswith(below) for p in _PHANTOMS)


def _phantom_bytes(path: str) -> bytes | None:
    """The bytes of the phantom at ``path`` (None: there is none)."""
    with _PHANTOM_LOCK:
        entry = _PHANTOMS.get(path)
    if entry is None:
        return None
    size, content = entry
    if content is None:
        raise PhantomReadError(f"{path} was read, but it stands for an object of a rank that "
                               "did not run, and nothing models its bytes")
    data = content()
    if len(data) != size:
        raise PhantomReadError(f"the bytes modelled for {path} are {len(data)} long, "
                               f"not the {size} it was listed with")
    return data


def _phantoms_below(path: str) -> dict[str, int]:
    below = path.rstrip("/") + "/"
    with _PHANTOM_LOCK:
        return {p: size for p, (size, _) in _PHANTOMS.items() if p.startswith(below)}


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
        _drop_phantom(path)
        return self._inner(super().put, path, data)

    def put_if_absent(self, path: str, data: Buffer) -> str:
        self._note("PUT", path, len(memoryview(data).cast("B")), conditional=True)
        if path in _PHANTOMS:
            raise FileExistsError(path)
        return self._inner(super().put_if_absent, path, data)

    def put_if_match(self, path: str, data: Buffer, version: str) -> str:
        self._note("PUT", path, len(memoryview(data).cast("B")), conditional=True)
        return self._inner(super().put_if_match, path, data, version)

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        whole = _phantom_bytes(path)
        data = (self._inner(super().get, path, start, end) if whole is None
                else whole[start:end])
        self._note("GET", path, len(data))
        return data

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        whole = _phantom_bytes(path)
        if whole is not None:
            self._note("GET", path, len(whole))
            return whole, "phantom"
        data, version = self._inner(super().get_versioned, path)
        self._note("GET", path, len(data))
        return data, version

    def iter_range(self, path: str, start: int, end: int, chunk: int) -> Iterator[bytes]:
        self._note("GET", path, end - start)  # one streamed GET, however many pieces
        whole = _phantom_bytes(path)
        if whole is not None:
            yield from (whole[i:min(i + chunk, end)] for i in range(start, end, chunk)
                        if i < len(whole))
            return
        with _quietly():
            yield from super().iter_range(path, start, end, chunk)

    def head(self, path: str) -> dict[str, Any] | None:
        self._note("HEAD", path)
        size = _phantoms_below_or_at(path)
        if size is not None:
            return {"name": path, "size": size, "type": "file"}
        return self._inner(super().head, path)

    def find(self, path: str) -> dict[str, dict[str, Any]]:
        found = self._inner(super().find, path)
        found.update({p: {"name": p, "size": n, "type": "file"}
                      for p, n in _phantoms_below(path).items()})
        self._note("LIST", path + "/", times=-(-len(found) // PAGE))
        return found

    def ls_dirs(self, path: str) -> list[str]:
        found = self._inner(super().ls_dirs, path)
        below = path.rstrip("/") + "/"
        found = sorted(set(found) | {below + p[len(below):].split("/", 1)[0]
                                     for p in _phantoms_below(path) if "/" in p[len(below):]})
        self._note("LIST", path + "/", times=-(-len(found) // PAGE))
        return found

    def delete(self, paths: list[str], root: str) -> None:
        for i in range(0, len(paths), PAGE):
            batch = paths[i:i + PAGE]
            self._note("DELETE", batch[0], len(batch))
        for p in paths:
            _drop_phantom(p)
        self._inner(super().delete, paths, root)

    def bucket_exists(self, root: str) -> bool | None:
        self._note("HEAD", f"/{self.bucket}")
        return True


def _phantoms_below_or_at(path: str) -> int | None:
    with _PHANTOM_LOCK:
        entry = _PHANTOMS.get(path)
    return None if entry is None else entry[0]


def _drop_phantom(path: str) -> None:
    with _PHANTOM_LOCK:
        _PHANTOMS.pop(path, None)
