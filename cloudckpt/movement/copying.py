"""How a checkpoint's objects travel from one store to another, each one checked.

:func:`copy_objects` copies a given list of a committed checkpoint's objects
into a :class:`~cloudckpt.core.checkpoint.CheckpointWriter`, checking each against
the source manifest (size and CRC32C) before recording it. How the bytes
travel depends on the destination:
* **within one store** (same backend, endpoint and credentials, e.g. S3 to S3
  or GCS to GCS): on the server (S3 CopyObject or parallel UploadPartCopy,
  GCS rewrite); no byte passes through this process. Each copy is checked by
  the size and CRC32C the server reports for it; where the server reports no
  whole-object CRC32C, or one that disagrees with the manifest, the copy is
  read back and checksummed here, so a server's word alone never fails a good
  copy, and nothing unchecked is ever recorded.
* **into local disk** (a store taking ranged writes): ranges of every object
  are fetched in parallel, each streamed with positional writes into a
  temporary file; their CRC32Cs combine into the object's, which is checked
  before the file is renamed into place.
* **anything else**: streamed through this process, parts fetched and
  uploaded in parallel, checked as they pass.

Memory stays bounded: a ranged read holds one piece (:data:`PIECE`) at a time,
however large the object.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter
from cloudckpt.core.manifest import FileEntry
from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.storage import ONE_TRY, ObjectInfo, Store
from cloudckpt.storage.writers import RangeWriter
from cloudckpt.util.crc import Crc32c

log = logging.getLogger(__name__)

Progress = Callable[[int], Any]
T = TypeVar("T")

#: Bytes one ranged read holds in memory at a time.
PIECE = 4 << 20
#: Large objects streamed between stores at once (each keeps its parts in flight).
STREAMED_OBJECTS = 2



def copy_objects(ckpt: Checkpoint, writer: CheckpointWriter, paths: list[str],
                  progress: Progress | None) -> None:
    """Copy exactly ``paths`` of ``ckpt`` into ``writer``, each checked against
    ``ckpt``'s manifest and then recorded in ``writer`` with the manifest's size and
    CRC32C. The writer's claim is taken before the first object is written.

    Raises :class:`CorruptCheckpointError` naming the first object found missing,
    short or different (a server-side copy of it is deleted again); objects
    already copied stay, unrecorded by any manifest.
    """
    paths = list(dict.fromkeys(paths))
    for p in paths:
        ckpt.entry(p)  # FileNotFoundError for a path the checkpoint does not have
    if not paths:
        return
    report = Report(progress)
    src, dst = ckpt.store, writer.store
    if dst.can_copy_from(src):
        log.debug("copying %d objects of %s to %s on the server", len(paths), src.uri, dst.uri)
        _copy_server_side(ckpt, writer, paths, report)
    elif dst.ranged_writes:
        log.debug("copying %d objects of %s to %s in parallel ranges", len(paths), src.uri,
                  dst.uri)
        _copy_ranged(ckpt, writer, paths, report)
    else:
        log.debug("streaming %d objects of %s to %s", len(paths), src.uri, dst.uri)
        _copy_streamed(ckpt, writer, paths, report)


# ------------------------------------------------------------ server-side copies


def _copy_server_side(ckpt: Checkpoint, writer: CheckpointWriter, paths: list[str],
                      report: Report) -> None:
    src, dst = ckpt.store, writer.store
    trust = _Trust()

    def one(path: str, stop: threading.Event) -> None:
        if stop.is_set():
            raise _Stopped
        entry = ckpt.manifest.files[path]
        try:
            info = dst.copy_from(src, path, path, entry.size)
        except FileNotFoundError:
            if src.info(path) is None:
                raise _corrupt(ckpt, path, "missing") from None
            dst.check_bucket()  # the destination's bucket, then
            raise
        _check_server_copy(ckpt, dst, path, entry, info, trust)
        writer.add_existing(path, entry.size, entry.crc32c)
        report(entry.size)

    with writer._live():  # claimed before the first object is written
        _run_all(one, paths, dst.max_concurrency)


class _Trust:
    """Whether the destination's reported CRC32Cs are believed: until one is
    refuted by reading the copy back."""

    def __init__(self) -> None:
        self.server_crc = True
        self._lock = threading.Lock()

    def refute(self) -> bool:
        """Believe the server no more; True for the first refutation."""
        with self._lock:
            first, self.server_crc = self.server_crc, False
            return first


def _check_server_copy(ckpt: Checkpoint, dst: Store, path: str, entry: FileEntry,
                       info: ObjectInfo, trust: _Trust) -> None:
    """Accept a server-side copy whose size and CRC32C, as the server reports them,
    are the manifest's; read it back where the server reports no CRC32C or another
    one; raise (after deleting the copy) if its bytes are not the manifest's."""
    if info.size != entry.size:
        problem = f"size {info.size} != {entry.size} in manifest"
    elif info.crc32c == entry.crc32c and trust.server_crc:
        return
    else:
        if info.crc32c is None:
            log.debug("%s reports no whole-object CRC32C for %s; reading the copy back to "
                      "check it", dst.uri, path)
        elif trust.server_crc:
            log.debug("%s reports CRC32C %s for the copy of %s, the manifest %s; reading "
                      "the copy back to check it", dst.uri, info.crc32c, path, entry.crc32c)
        else:
            log.debug("reading the copy of %s back: %s reported a wrong CRC32C before",
                      path, dst.uri)
        try:
            size, crc = checksum_object(dst, path, entry.size)
        except (FileNotFoundError, EOFError) as exc:
            problem = f"the copy cannot be read back ({exc})"
        else:
            if size == entry.size and crc == entry.crc32c:
                if info.crc32c is not None and info.crc32c != entry.crc32c and trust.refute():
                    log.warning("%s reported CRC32C %s for the copy of %s, but its bytes "
                                "have CRC32C %s: the server's checksums are wrong; every "
                                "further object of this copy is read back instead", dst.uri,
                                info.crc32c, path, crc)
                return
            problem = f"crc32c {crc} != {entry.crc32c} in manifest"
    try:
        dst.with_retry(ONE_TRY).delete([path])  # a copy known bad is not left behind
    except Exception as exc:  # noqa: BLE001 - unrecorded by any manifest either way
        log.warning("could not delete the bad copy %s: %s", dst.key_uri(path), exc)
    raise _corrupt(ckpt, path, problem)


def checksum_object(store: Store, key: str, size: int) -> tuple[int, str]:
    """Size and CRC32C of the first ``size`` bytes of ``key``, read in parallel ranges
    (one piece each in memory at a time)."""
    span = max(store.part_size, -(-size // max(store.max_concurrency, 1)))
    ranges = [(s, min(s + span, size)) for s in range(0, size, span)] or [(0, 0)]

    def one(r: tuple[int, int]) -> tuple[int, int]:
        crc = Crc32c()
        store.read_range_to(key, r[0], r[1], lambda _, data: crc.update(data), chunk=PIECE)
        return crc.value, crc.size

    whole = Crc32c()
    for crc, n in store.map(one, ranges):
        whole.append(crc, n)
    if size == 0 and store.info(key) is None:
        raise FileNotFoundError(store.key_uri(key))
    return whole.size, whole.hexdigest()


# ------------------------------------------------------------ ranged writes (local)


class _RangedObject:
    """One object written as parallel ranges: its writer (opened by its first range),
    and each range's CRC32C, combined in order once the last one is in."""

    def __init__(self, path: str, entry: FileEntry, span: int) -> None:
        self.path = path
        self.entry = entry
        size = entry.size
        count = max(1, -(-size // span))
        step = max(1, -(-size // count))
        self.ranges = [(s, min(s + step, size)) for s in range(0, size, step)] or [(0, 0)]
        self.crcs: list[tuple[int, int]] = [(0, 0)] * len(self.ranges)
        self._left = len(self.ranges)
        self._lock = threading.Lock()
        self._out: RangeWriter | None = None
        self._closed = False

    def writer(self, store: Store) -> RangeWriter:
        with self._lock:
            if self._closed:
                raise _Stopped
            if self._out is None:
                self._out = store.open_write_at(self.path, self.entry.size)
            return self._out

    def range_done(self, index: int, crc: int, size: int) -> bool:
        """Record a range; True for the last one."""
        with self._lock:
            self.crcs[index] = (crc, size)
            self._left -= 1
            return self._left == 0

    def commit(self) -> None:
        with self._lock:
            assert self._out is not None
            self._out.commit()
            self._closed = True

    def abort(self) -> None:
        with self._lock:
            if not self._closed and self._out is not None:
                self._out.abort()
            self._closed = True


def _copy_ranged(ckpt: Checkpoint, writer: CheckpointWriter, paths: list[str],
                 report: Report) -> None:
    """Several objects and several ranges of one object in flight: about as many
    ranges as the source takes requests at once, each one request streamed piece by
    piece into place."""
    src, dst = ckpt.store, writer.store
    streams = max(src.max_concurrency, 1)
    total = sum(ckpt.manifest.files[p].size for p in paths)
    span = max(src.part_size, -(-total // streams))
    jobs = [_RangedObject(p, ckpt.manifest.files[p], span) for p in paths]
    tasks = [(job, i) for job in jobs for i in range(len(job.ranges))]

    def fetch(task: tuple[_RangedObject, int], stop: threading.Event) -> None:
        job, index = task
        start, end = job.ranges[index]
        out = job.writer(dst)
        crc = Crc32c()

        def sink(offset: int, data: bytes) -> None:
            if stop.is_set():
                raise _Stopped
            crc.update(data)
            out.write_at(offset, data)
            report(len(data))

        try:
            if end > start:
                src.read_range_to(job.path, start, end, sink, chunk=PIECE)
            elif src.info(job.path) is None:  # an empty object: it must still exist
                raise FileNotFoundError(src.key_uri(job.path))
        except (FileNotFoundError, EOFError) as exc:
            raise _corrupt(ckpt, job.path, f"missing or short ({exc})") from None
        if job.range_done(index, crc.value, crc.size):
            _finish_ranged(ckpt, writer, job)

    with writer._live():  # claimed before the first object is written
        try:
            _run_all(fetch, tasks, streams)
        finally:
            for job in jobs:
                job.abort()  # temporary files of objects not committed


def _finish_ranged(ckpt: Checkpoint, writer: CheckpointWriter, job: _RangedObject) -> None:
    whole = Crc32c()
    for crc, size in job.crcs:
        whole.append(crc, size)
    entry = job.entry
    if whole.size != entry.size or whole.hexdigest() != entry.crc32c:
        job.abort()
        raise _corrupt(ckpt, job.path, f"crc32c {whole.hexdigest()} != {entry.crc32c} in "
                                       "manifest")
    job.commit()
    writer.add_existing(job.path, entry.size, entry.crc32c)


# ------------------------------------------------------------ streamed copies


def _copy_streamed(ckpt: Checkpoint, writer: CheckpointWriter, paths: list[str],
                   report: Report) -> None:
    """Small objects in parallel batches (each read whole and checked), large ones a
    few at a time, each streamed in order with its ranges fetched in parallel."""
    chunk = max(ckpt.store.part_size, 1 << 20)
    small = [p for p in paths if ckpt.manifest.files[p].size <= chunk]
    large = [p for p in paths if ckpt.manifest.files[p].size > chunk]
    batch = max(ckpt.store.max_concurrency, 1)
    for i in range(0, len(small), batch):
        items = ckpt.read_many(small[i : i + batch])  # each checked against the manifest
        writer.put_many(items)
        report(sum(len(v) for v in items.values()))
    window = max(ckpt.store.max_concurrency // (2 * STREAMED_OBJECTS), 1) * chunk
    _run_all(lambda path, stop: _stream_one(ckpt, writer, path, chunk, window, report, stop),
             large, STREAMED_OBJECTS)


def _stream_one(ckpt: Checkpoint, writer: CheckpointWriter, path: str, chunk: int,
                window: int, report: Report, stop: threading.Event) -> None:
    entry = ckpt.manifest.files[path]
    crc = Crc32c()
    ranges = [(path, s, min(s + chunk, entry.size)) for s in range(0, entry.size, chunk)]
    with writer.open(path) as out:
        try:
            for data in ckpt.store.iter_ranges(ranges, max_bytes=window):
                if stop.is_set():
                    raise _Stopped
                crc.update(data)
                out.write(data)
                report(len(data))
        except (FileNotFoundError, EOFError) as exc:
            raise _corrupt(ckpt, path, f"missing or short ({exc})") from None
        if crc.size != entry.size or crc.hexdigest() != entry.crc32c:
            raise _corrupt(ckpt, path, f"crc32c {crc.hexdigest()} != {entry.crc32c} in "
                                       "manifest")


# ------------------------------------------------------------ helpers


class _Stopped(Exception):
    """A task gave up because another one failed."""


class Report:
    """``progress``, called from any thread, one call at a time."""

    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        if self._progress is not None and n:
            with self._lock:
                self._progress(n)


def _run_all(fn: Callable[[T, threading.Event], None], items: Sequence[T],
             workers: int) -> None:
    """Run ``fn(item, stop)`` over ``items``, ``workers`` at a time. The first failure
    sets ``stop`` (tasks check it between pieces), starts nothing more, and is raised
    once the tasks still running have returned: nothing runs behind the caller's back."""
    stop = threading.Event()
    if workers <= 1 or len(items) <= 1:
        for item in items:
            fn(item, stop)
        return
    pool = ThreadPoolExecutor(min(workers, len(items)), thread_name_prefix="cloudckpt-copy")

    def guarded(item: T) -> None:
        if stop.is_set():
            raise _Stopped
        try:
            fn(item, stop)
        except BaseException:
            stop.set()
            raise

    futures: list[Future[None]] = []
    try:
        futures.extend(pool.submit(guarded, item) for item in items)
        wait(futures, return_when=FIRST_EXCEPTION)
    except BaseException:  # interrupted: let the running tasks stop at their next piece
        stop.set()
        raise
    finally:
        if stop.is_set():
            for f in futures:
                f.cancel()
        pool.shutdown(wait=True)
    errors = [f.exception() for f in futures if not f.cancelled()]
    failures = [e for e in errors if e is not None and not isinstance(e, _Stopped)]
    if failures:
        raise failures[0]
    if any(e is not None for e in errors):  # only _Stopped: cannot happen, but never pass
        raise RuntimeError("a copy task stopped without an error to report")


def _corrupt(ckpt: Checkpoint, path: str, problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"object {path!r} of {ckpt.uri} does not match its manifest while copying "
        f"({problem}); nothing was committed", {path: problem})
