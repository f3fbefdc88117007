"""Writer claims: one writer per checkpoint prefix, or two writers' objects mix.

Manifests are create-only, so two writers racing on one URI can never both
commit. But their data objects share names: without a claim, the loser keeps
overwriting objects after the winner listed their CRC32C in its manifest, and
the committed checkpoint is torn. So before a writer puts its first object it
creates ``.cloudckpt-writer.json`` in the prefix, create-only; a second writer
finds it and stops before writing anything. The claim is re-read just before
the manifest is committed (a writer whose claim was taken over must not
commit) and removed after; a writer that gets the claim checks that no
manifest appeared meanwhile (the claim of a writer that committed is gone).

A claim whose writer is gone does not block a retry of the same save: a
writer in this process that was closed or collected, or a process on this
host that no longer runs, is replaced by compare-and-swap. A writer on
another host cannot be checked; its claim is taken over only with
``takeover=True`` or after ``cloudckpt rm --force`` / ``cloudckpt gc``.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from .errors import CommitConflictError
from .manifest import MANIFEST_NAME
from .storage import RetryPolicy, Store

log = logging.getLogger("cloudckpt")

CLAIM_NAME = ".cloudckpt-writer.json"
_ONE_TRY = RetryPolicy(max_attempts=1, deadline=10.0)

_live: set[str] = set()  # claims held by writers of this process that are still open
_live_lock = threading.Lock()


def _start_ticks(pid: int) -> str | None:
    """The process start time (clock ticks since boot), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder_gone(record: dict[str, Any]) -> bool:
    """Whether the writer that made ``record`` provably no longer runs."""
    if record.get("host") != socket.gethostname():
        return False
    pid = record.get("pid")
    if not isinstance(pid, int):
        return False
    if pid == os.getpid():
        with _live_lock:
            if record.get("writer") not in _live:
                return True
        # An abandoned writer may sit in a reference cycle (an exception's traceback
        # holds the frames of every call it passed): collect, then look again.
        gc.collect()
        with _live_lock:
            return record.get("writer") not in _live
    if not _pid_alive(pid):
        return True
    started = record.get("started_ticks")
    return started is not None and _start_ticks(pid) not in (None, started)


def _describe(record: dict[str, Any]) -> str:
    when = record.get("since")
    age = f", {time.time() - when:.0f} s ago" if isinstance(when, int | float) else ""
    return f"host {record.get('host')!r}, pid {record.get('pid')}{age}"


class WriterClaim:
    """The claim of one writer on one prefix; cheap to create, acquired lazily."""

    def __init__(self, store: Store, *, takeover: bool = False) -> None:
        self.store = store
        self.takeover = takeover
        self.writer = uuid.uuid4().hex
        self.held = False
        pid = os.getpid()
        self._record = {"writer": self.writer, "host": socket.gethostname(), "pid": pid,
                        "started_ticks": _start_ticks(pid), "since": time.time()}

    def acquire(self) -> None:
        """Claim the prefix, or raise :class:`CommitConflictError` naming the holder."""
        if self.held:
            return
        data = json.dumps(self._record).encode()
        with _live_lock:
            _live.add(self.writer)
        try:
            try:
                self.store.put_if_absent(CLAIM_NAME, data)
            except CommitConflictError:
                self._replace(data)
            self.held = True
            # A writer that committed released its claim: a late one must not write.
            if self.store.exists(MANIFEST_NAME):
                self.release()
                raise CommitConflictError(
                    f"a checkpoint was committed at {self.store.uri} while this save "
                    "started; checkpoints are immutable. Choose a new URI.")
        except BaseException:
            with _live_lock:
                _live.discard(self.writer)
            raise

    def _replace(self, data: bytes) -> None:
        try:
            raw, version = self.store.get_with_version(CLAIM_NAME)
        except FileNotFoundError:  # released meanwhile: try once more from scratch
            self.store.put_if_absent(CLAIM_NAME, data)
            return
        record = _parse(raw)
        if record.get("writer") == self.writer:
            return
        if not (self.takeover or _holder_gone(record)):
            raise CommitConflictError(
                f"another save is writing {self.store.uri} ({_describe(record)}); one writer "
                "per checkpoint. Wait for it, or if that save is dead, remove its leftovers "
                "with `cloudckpt rm --force URI` (or pass takeover=True) and save again.")
        log.warning("taking over %s from a save that is gone (%s)", self.store.uri,
                    _describe(record))
        self.store.put_if_match(CLAIM_NAME, data, version)

    def check(self) -> None:
        """Raise :class:`CommitConflictError` unless the claim is still ours."""
        if not self.held:
            return
        try:
            record = _parse(self.store.get(CLAIM_NAME))
        except FileNotFoundError:
            record = {}
        if record.get("writer") != self.writer:
            self.release(delete=False)
            who = f" by {_describe(record)}" if record else " (its claim was removed)"
            raise CommitConflictError(
                f"this save to {self.store.uri} was taken over{who} while it ran; not "
                "committing. Only one job should write a checkpoint URI.")

    def release(self, *, delete: bool = True, verify: bool = False) -> None:
        """Drop the claim; with ``delete`` also remove the claim object (best effort),
        with ``verify`` only if it is still ours."""
        if not self.held:
            return
        self.held = False
        with _live_lock:
            _live.discard(self.writer)
        if not delete:
            return
        # One attempt: this runs while a failure is being reported, and must not
        # hold that error back for another retry deadline when the endpoint is down.
        store = self.store.with_retry(_ONE_TRY)
        try:
            if verify and _parse(store.get(CLAIM_NAME)).get("writer") != self.writer:
                return
            store.delete([CLAIM_NAME])
        except Exception as exc:  # a leftover claim only delays a retry, never a reader
            log.debug("could not remove the writer claim of %s: %s", self.store.uri, exc)

    def __del__(self) -> None:
        try:
            with _live_lock:
                _live.discard(self.writer)
        except Exception:  # interpreter shutdown
            pass


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        record = json.loads(raw)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}
