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

A writer whose save fails marks its claim abandoned instead of removing it: the
claim then still proves that the objects left in the prefix are cloudckpt's, so
``gc`` and ``rm --force`` may remove them (:mod:`cloudckpt.core.ownership`); a delete
writes one before it starts, for the same reason.

A claim whose writer is gone does not block a retry of the same save: an
abandoned claim, a writer in this process whose write failed, or that was
closed or collected, or a process on this host, boot and pid namespace that no
longer runs, is replaced by compare-and-swap. A writer elsewhere (another host,
container or boot) cannot be checked; its claim is taken over only with
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
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from cloudckpt.core.ownership import (
    COMMITTED,
    FOREIGN,
    ROOT,
    Survey,
    classify,
    not_a_checkpoint,
    survey,
)
from cloudckpt.errors import CommitConflictError, NotACheckpointError
from cloudckpt.names import CLAIM_NAME
from cloudckpt.storage import ONE_TRY, ObjectInfo, Store

log = logging.getLogger("cloudckpt")


_live: set[str] = set()  # claims held by writers of this process that are still open
_live_lock = threading.Lock()


def _after_fork() -> None:
    global _live_lock
    _live_lock = threading.Lock()  # the parent's may have been held by another thread
    _live.clear()  # a forked child holds none of its parent's writers


os.register_at_fork(after_in_child=_after_fork)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _pid_namespace() -> str | None:
    """Which pid namespace this process is in: pids mean nothing across them."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None


def _start_ticks(pid: int) -> str | None:
    """The process start time (clock ticks since boot), to tell a reused pid apart."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[-1].split()[19] if stat else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _whoami() -> dict[str, Any]:
    """Where this process runs. Liveness is only judged when all of it matches: a
    hostname alone is shared by containers on one host (host networking) whose pids
    are in other namespaces, and by sandboxes that all call themselves localhost."""
    return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"),
            "pid_ns": _pid_namespace()}


def this_process() -> dict[str, Any]:
    """This process, as records of ownership name it (a claim, a staging marker):
    enough for :func:`process_gone` to judge later that it no longer runs."""
    pid = os.getpid()
    return {**_whoami(), "pid": pid, "started_ticks": _start_ticks(pid)}


def _here(record: Mapping[str, Any]) -> bool:
    return all(record.get(k) == v for k, v in _whoami().items())


def process_gone(record: Mapping[str, Any]) -> bool:
    """Whether the process a :func:`this_process` record names provably no longer runs:
    it ran on this host, boot and pid namespace, and its pid is free or now belongs
    to a process started later. Anything unknown means it may still run."""
    pid = record.get("pid")
    if not _here(record) or isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    if not _pid_alive(pid):
        return True
    started = record.get("started_ticks")
    return started is not None and _start_ticks(pid) not in (None, started)


def _holder_gone(record: dict[str, Any]) -> bool:
    """Whether the writer that made ``record`` provably no longer runs."""
    if record.get("abandoned"):
        return True
    if record.get("pid") == os.getpid() and _here(record):
        with _live_lock:
            if record.get("writer") not in _live:
                return True
        # An abandoned writer may sit in a reference cycle (an exception's traceback
        # holds the frames of every call it passed): collect, then look again. Only on
        # a conflict within one process, so the pause is rare.
        gc.collect()
        with _live_lock:
            return record.get("writer") not in _live
    return process_gone(record)


def _describe(record: dict[str, Any]) -> str:
    when = record.get("since")
    age = f", {time.time() - when:.0f} s ago" if isinstance(when, int | float) else ""
    return f"host {record.get('host')!r}, pid {record.get('pid')}{age}"


class WriterClaim:
    """The claim of one writer on one prefix; cheap to create, acquired lazily.

    While it is held the writer is live in this process; :meth:`suspend` marks a
    writer whose operation failed as no longer live (its claim object stays), so a
    retry in this process may take over, and the writer itself may re-acquire.
    """

    def __init__(self, store: Store, *, takeover: bool = False, foreign_ok: bool = False,
                 declared: Callable[[], Collection[str]] | None = None) -> None:
        self.store = store
        self.takeover = takeover
        self.foreign_ok = foreign_ok  # the objects are someone else's (adopt)
        # Keys the writer already counts as its own (written by other processes for it,
        # e.g. other ranks): not someone else's data when a fresh claim looks.
        self.declared = declared or (lambda: ())
        self.writer = uuid.uuid4().hex
        self.held = False
        self.used = False  # acquired at least once: this writer has written objects
        self.abandoned = False  # its claim object was marked abandoned
        self.found: Survey | None = None  # the prefix as listed right after claiming
        # Whether its first acquire created the claim on a prefix that had none: only
        # then may no other writer of it still be running (see checkpoint.py).
        self.fresh = False
        self._lock = threading.Lock()

    def acquire(self) -> None:
        """Claim the prefix, or raise :class:`CommitConflictError` naming the holder.

        A fresh claim (no earlier one to take over) is refused with
        :class:`NotACheckpointError` where the prefix holds data that is not an
        unfinished save of cloudckpt's (a root, or objects cloudckpt did not write):
        the claim would otherwise make them look like cloudckpt's to ``gc`` and
        ``rm --force`` (see :mod:`cloudckpt.core.ownership`). ``foreign_ok`` writers
        (``adopt``) claim such a prefix on purpose.
        """
        with self._lock:
            if self.held:
                return
            data = _record(self.writer)
            with _live_lock:
                _live.add(self.writer)
            try:
                try:
                    self.store.put_if_absent(CLAIM_NAME, data)
                    fresh = True
                except CommitConflictError:
                    fresh = self._replace(data)
                self._check_prefix(fresh)
                if not self.used:
                    self.fresh = fresh
            except BaseException:
                with _live_lock:
                    _live.discard(self.writer)
                raise
            self.held = self.used = True
            self.abandoned = False

    def _check_prefix(self, fresh: bool) -> None:
        """One listing after claiming (kept as :attr:`found`): a manifest means a writer
        committed (and released its claim) meanwhile; no claim covers checkpoints below
        that are not its own parts, and a fresh claim no one else's data."""
        found = self.found = survey(self.store)
        if found.kind == COMMITTED:
            self._drop(delete=True, verify=False)
            raise CommitConflictError(
                f"a checkpoint was committed at {self.store.uri} while this save "
                "started; checkpoints are immutable. Choose a new URI.")
        if self.foreign_ok:
            return
        refused = found if found.kind == ROOT else None
        if fresh and refused is None:
            mine = {CLAIM_NAME, *self.declared()}
            rest = classify(self.store.uri, [o for o in found.objects if o.key not in mine])
            refused = rest if rest.kind in (ROOT, FOREIGN) else None
        if refused is not None:
            self._drop(delete=True, verify=True)
            raise NotACheckpointError(
                f"cannot save into {self.store.uri}: {not_a_checkpoint(refused)} Nothing was "
                "written: save to a new URI.")

    def _replace(self, data: bytes) -> bool:
        """Take over an existing claim if its writer is gone; True when there was none
        after all (released meanwhile) and a fresh one was made."""
        try:
            raw, version = self.store.get_with_version(CLAIM_NAME)
        except FileNotFoundError:  # released meanwhile: try once more from scratch
            self.store.put_if_absent(CLAIM_NAME, data)
            return True
        record = _parse(raw)
        if record.get("writer") == self.writer:
            if record.get("abandoned"):  # this writer again, after it failed: live again
                self.store.put_if_match(CLAIM_NAME, data, version)
            return False
        if not (self.takeover or _holder_gone(record)):
            raise CommitConflictError(
                f"another save is writing {self.store.uri} ({_describe(record)}); one writer "
                "per checkpoint. Wait for it, or if that save is dead, remove its leftovers "
                "with `cloudckpt rm --force URI` (or pass takeover=True) and save again.")
        log.warning("taking over %s from a save that is gone (%s)", self.store.uri,
                    _describe(record))
        self.store.put_if_match(CLAIM_NAME, data, version)
        return False

    def check(self) -> None:
        """Raise :class:`CommitConflictError` unless the claim is still ours (a writer
        suspended by a failure claims again first)."""
        if not self.used:
            return
        self.acquire()
        try:
            record = _parse(self.store.get(CLAIM_NAME))
        except FileNotFoundError:
            record = {}
        if record.get("writer") != self.writer:
            self.suspend()
            who = f" by {_describe(record)}" if record else " (its claim was removed)"
            raise CommitConflictError(
                f"this save to {self.store.uri} was taken over{who} while it ran; not "
                "committing. Only one job should write a checkpoint URI.")

    def suspend(self) -> None:
        """The writer's operation failed: it is no longer live (the object stays)."""
        with self._lock:
            self.held = False
            with _live_lock:
                _live.discard(self.writer)

    def release(self, *, committed: bool) -> None:
        """Drop the claim. After a commit (``committed``) its object is removed, with
        full retries, as a claim left in a committed checkpoint stays for good. After
        a failure it is rewritten as abandoned, in one try (not to hold the error back
        for another retry deadline when the endpoint is down): any retry may take it
        over at once, and it still proves that the objects left there are cloudckpt's
        (see :mod:`cloudckpt.core.ownership`), so ``gc`` and ``rm --force`` may remove them."""
        with self._lock:
            if committed or (self.foreign_ok and self.used):
                # after a commit; or an adopt that failed: its claim must not make the
                # objects it covers look like cloudckpt's
                if self.held or self.foreign_ok:
                    self._drop(delete=True, verify=True)
            elif self.used and not self.abandoned:  # suspended by the failure or not
                self._abandon()

    def _abandon(self) -> None:
        self._drop(delete=False, verify=False)
        self.abandoned = True
        store = self.store.with_retry(ONE_TRY)
        try:
            raw, version = store.get_with_version(CLAIM_NAME)
            record = _parse(raw)
            if record.get("writer") == self.writer:
                store.put_if_match(CLAIM_NAME, json.dumps({**record, "abandoned": True,
                                                           "until": time.time()}).encode(),
                                   version)
        except Exception as exc:  # noqa: BLE001 - the claim stays; liveness still judges it
            log.warning("could not mark the writer claim of %s abandoned: %s",
                        self.store.uri, exc)

    def _drop(self, *, delete: bool, verify: bool) -> None:
        self.held = False
        with _live_lock:
            _live.discard(self.writer)
        if not delete:
            return
        store = self.store
        try:
            if verify and _parse(store.get(CLAIM_NAME)).get("writer") != self.writer:
                return
            store.delete([CLAIM_NAME])
        except Exception as exc:  # noqa: BLE001 - a leftover claim only delays a retry
            log.warning("could not remove the writer claim of %s: %s", self.store.uri, exc)

    def __del__(self) -> None:
        try:
            with _live_lock:
                _live.discard(self.writer)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _record(writer: str, **extra: Any) -> bytes:
    return json.dumps({"writer": writer, **this_process(), "since": time.time(),
                       **extra}).encode()


def mark_deleting(store: Store) -> None:
    """Write a claim saying a delete of ``store``'s committed prefix is under way,
    before its manifest goes: a delete cut short then leaves objects that still prove
    to be cloudckpt's (see :mod:`cloudckpt.core.ownership`). The claim is this process's,
    live while it runs, so no writer takes the prefix over mid-delete."""
    store.put(CLAIM_NAME, _record(uuid.uuid4().hex, deleting=True))


def seize(store: Store, objects: Sequence[ObjectInfo]) -> bool:
    """Before deleting an unfinished save surveyed as ``objects``: replace its claim,
    by compare-and-swap on the version surveyed, with this process's "deleting"
    claim (create it where there was none). A writer that took the prefix over
    since then keeps it (False: delete nothing); one that comes later finds it held;
    one that held it all along fails its check before committing."""
    data = _record(uuid.uuid4().hex, deleting=True)
    claim = next((o for o in objects if o.key == CLAIM_NAME), None)
    try:
        if claim is None:
            store.put_if_absent(CLAIM_NAME, data)
            return True
        version = claim.version
        if version is None:  # a listing without versions: read it (a narrower race)
            _, version = store.get_with_version(CLAIM_NAME)
        store.put_if_match(CLAIM_NAME, data, version)
    except (CommitConflictError, FileNotFoundError):
        return False
    return True


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        record = json.loads(raw)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}
