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

A claim is a lease (:mod:`cloudckpt.core.leases`): its writer renews it while it holds
it, and a claim whose writer is gone does not block a save for longer than the lease
(:mod:`cloudckpt.core.liveness`). It is taken over, by compare-and-swap, at once when it
is abandoned, when its writer is a writer of this process that failed or was dropped, or
a process of this host, boot and pid namespace that no longer runs, or when it belongs
to an earlier attempt of this process's run (a relaunch: :mod:`cloudckpt.runtime.attempt`);
a claim of another run, container or node is taken over once it has not been renewed
for a whole lease, which a contender waits out, and a renewal seen meanwhile means a live
writer. ``takeover=True`` takes any claim over at once. A writer taken over while it
still runs cannot change what the new writer commits (invariant 12 of
docs/architecture.md): it fails at its commit.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from cloudckpt.core.leases import Lease
from cloudckpt.core.liveness import (
    State,
    Verdict,
    here,
    judge,
    lease_of,
    lease_seconds,
    stamp,
)
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

log = logging.getLogger(__name__)


_live: set[str] = set()  # claims held by writers of this process that are still open
_live_lock = threading.Lock()
# A record that changes while a contender waits is judged again, a bounded number of times.
_LOOKS = 8


def _after_fork() -> None:
    global _live_lock
    _live_lock = threading.Lock()  # the parent's may have been held by another thread
    _live.clear()  # a forked child holds none of its parent's writers


os.register_at_fork(after_in_child=_after_fork)


@dataclass(frozen=True)
class ClaimRecord:
    """A claim as stored in ``.cloudckpt-writer.json``: its writer's id; whether its
    save gave it up (``abandoned``) or it is a delete's (``deleting``); and ``stamp``,
    every other field as read (the process, attempt and lease of
    :func:`~cloudckpt.core.liveness.stamp`, which :mod:`~cloudckpt.core.liveness`
    judges). A record that cannot be read is one with no writer: never this writer's,
    judged by its lease."""

    writer: str | None
    abandoned: bool = False
    deleting: bool = False
    stamp: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: bytes) -> ClaimRecord:
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            return cls(None)
        writer = doc.pop("writer", None)
        return cls(writer if isinstance(writer, str) else None,
                   abandoned=bool(doc.pop("abandoned", False)),
                   deleting=bool(doc.pop("deleting", False)), stamp=doc)

    def to_bytes(self) -> bytes:
        flags = {k: True for k in ("abandoned", "deleting") if getattr(self, k)}
        return json.dumps({"writer": self.writer, **self.stamp, **flags}).encode()

    def given_up(self) -> ClaimRecord:
        """This record marked abandoned now: its objects stay provably cloudckpt's, and
        any contender may take the prefix over at once."""
        return replace(self, abandoned=True, stamp={**self.stamp, "until": time.time()})

    def describe(self) -> str:
        """Who wrote it, for messages."""
        when = self.stamp.get("since")
        age = f", {time.time() - when:.0f} s ago" if isinstance(when, int | float) else ""
        run = f", run {self.stamp['run']!r}" if self.stamp.get("run") else ""
        return f"host {self.stamp.get('host')!r}, pid {self.stamp.get('pid')}{run}{age}"



def _own_writer_gone(record: ClaimRecord) -> bool | None:
    """For a record of this very process: whether its writer is gone (None: the record
    is another process's)."""
    if record.stamp.get("pid") != os.getpid() or not here(record.stamp):
        return None
    with _live_lock:
        if record.writer not in _live:
            return True
    # An abandoned writer may sit in a reference cycle (an exception's traceback
    # holds the frames of every call it passed): collect, then look again. Only on
    # a conflict within one process, so the pause is rare.
    gc.collect()
    with _live_lock:
        return record.writer not in _live


def _verdict(record: ClaimRecord) -> Verdict:
    """Whether the writer that made ``record`` runs, is gone, or holds a lease."""
    if record.abandoned:
        return Verdict(State.GONE, "its save failed and gave it up")
    own = _own_writer_gone(record)
    if own is None:
        return judge(record.stamp)
    if own:
        return Verdict(State.GONE, "its writer in this process failed or was dropped")
    return Verdict(State.LIVE, "a writer of this process holds it")


def _version(store: Store, info: ObjectInfo) -> str:
    """The version a write left (read back where the backend does not return one)."""
    return info.version or store.get_with_version(info.key)[1]


class WriterClaim:
    """The claim of one writer on one prefix; cheap to create, acquired lazily.

    While it is held the writer is live in this process and its lease is renewed;
    :meth:`suspend` marks a writer whose operation failed as no longer live (its claim
    object stays), so a retry in this process may take over, and the writer itself may
    re-acquire.
    """

    def __init__(self, store: Store, *, takeover: bool = False, foreign_ok: bool = False,
                 declared: Callable[[], Collection[str]] | None = None) -> None:
        self.store = store
        self.takeover = takeover
        self.foreign_ok = foreign_ok  # the objects are someone else's (adopt)
        # A save replacing the checkpoint committed there (core.replacing): a manifest
        # under the claim is the one it replaces, not one committed meanwhile.
        self.replacing = False
        # Keys the writer already counts as its own (written by other processes for it,
        # e.g. other ranks): not someone else's data when a fresh claim looks.
        self.declared = declared or (lambda: ())
        self.writer = uuid.uuid4().hex
        self.lease = lease_seconds()
        self.held = False
        self.used = False  # acquired at least once: this writer has written objects
        self.abandoned = False  # its claim object was marked abandoned
        self.found: Survey | None = None  # the prefix as listed right after claiming
        # Whether its first acquire created the claim on a prefix that had none: only
        # then may no other writer of it still be running (see checkpoint.py).
        self.fresh = False
        # What the claim holds, renewed by a lease that must not keep this object alive
        # (a writer dropped without a release is let go when it is collected).
        self._data = _recorder(self.writer, self.lease)
        self._renewing: Lease | None = None
        self._lock = threading.Lock()

    def acquire(self) -> None:
        """Claim the prefix, or raise :class:`CommitConflictError` naming the holder.

        A fresh claim (no earlier one to take over) is refused with
        :class:`NotACheckpointError` where the prefix holds data that is not an
        unfinished save of cloudckpt's (a root, or objects cloudckpt did not write):
        the claim would otherwise make them look like cloudckpt's to ``gc`` and
        ``rm --force`` (see :mod:`cloudckpt.core.ownership`). ``foreign_ok`` writers
        (``adopt``) claim such a prefix on purpose. A claim another process took over
        while this writer held it raises here, at the writer's next write.
        """
        with self._lock:
            if self.held and self._renewing is not None and self._renewing.lost:
                self._drop(delete=False, verify=False)
                raise self._taken_over(None)
            if self.held:
                return
            with _live_lock:
                _live.add(self.writer)
            try:
                try:
                    info = self.store.put_if_absent(CLAIM_NAME, self._data())
                    fresh, version = True, _version(self.store, info)
                except CommitConflictError:
                    fresh, version = self._replace()
                self._renewing = Lease(self.store, CLAIM_NAME, self._data, version,
                                       self.lease).start()
                self._check_prefix(fresh)
                if not self.used:
                    self.fresh = fresh
            except BaseException:
                self._drop(delete=False, verify=False)
                raise
            self.held = self.used = True
            self.abandoned = False

    def _check_prefix(self, fresh: bool) -> None:
        """One listing after claiming (kept as :attr:`found`): a manifest means a writer
        committed (and released its claim) meanwhile; no claim covers checkpoints below
        that are not its own parts, and a fresh claim no one else's data."""
        found = self.found = survey(self.store)
        if found.kind == COMMITTED and not self.replacing:
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

    def _replace(self) -> tuple[bool, str]:
        """Take over an existing claim once its writer is gone, waiting out its lease
        where only that can tell. Returns whether the claim was made fresh after all
        (released meanwhile), and the version written."""
        try:
            raw, version = self.store.get_with_version(CLAIM_NAME)
        except FileNotFoundError:  # released meanwhile: try once more from scratch
            return True, self._create()
        record = ClaimRecord.parse(raw)
        for _ in range(_LOOKS):
            if record.writer == self.writer:
                if record.abandoned:  # this writer again, after it failed: live again
                    version = _version(self.store, self.store.put_if_match(
                        CLAIM_NAME, self._data(), version))
                return False, version
            verdict = Verdict(State.GONE, "takeover=True") if self.takeover \
                else _verdict(record)
            if verdict.state is State.LEASED:
                seen = self._watch(record, version, verdict)
                if seen is None:
                    return True, self._create()
                if seen[1] != version:  # changed while watched: judge the new record
                    record, version = seen
                    continue
                verdict = Verdict(State.GONE, f"{verdict.why}, and not in the "
                                              f"{verdict.left:.0f} s left of it")
            if verdict.state is State.LIVE:
                raise CommitConflictError(
                    f"another save is writing {self.store.uri} ({record.describe()}: "
                    f"{verdict.why}); one writer per checkpoint. Wait for it; if that save "
                    "is dead, its claim expires with its lease (or remove its leftovers "
                    "with `cloudckpt rm --force URI`, or pass takeover=True).")
            log.warning("taking over %s from a save that is gone (%s: %s)", self.store.uri,
                        record.describe(), verdict.why)
            return False, _version(self.store, self.store.put_if_match(
                CLAIM_NAME, self._data(), version))
        raise CommitConflictError(f"the claim of {self.store.uri} kept changing hands while "
                                  "this save waited for it; one writer per checkpoint")

    def _create(self) -> str:
        return _version(self.store, self.store.put_if_absent(CLAIM_NAME, self._data()))

    def _watch(self, record: ClaimRecord, version: str, verdict: Verdict
               ) -> tuple[ClaimRecord, str] | None:
        """Watch a claim whose lease may still run, on this process's clock: returns it
        as it is once changed (a renewal by a live writer, or another's takeover), or
        unchanged once ``verdict.left`` passed without a renewal; None once removed."""
        log.info("%s is claimed by a save elsewhere (%s; %s): waiting up to %.0f s for "
                 "a renewal", self.store.uri, record.describe(), verdict.why, verdict.left)
        deadline = time.monotonic() + verdict.left
        poll = min(max(lease_of(record.stamp), 1.0) / 8, 5.0)  # a few looks per renewal
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(poll, left))
            try:
                raw, seen = self.store.get_with_version(CLAIM_NAME)
            except FileNotFoundError:
                return None
            if seen != version:
                new = ClaimRecord.parse(raw)
                if new.writer == record.writer and not new.abandoned:
                    raise CommitConflictError(
                        f"another save is writing {self.store.uri} ({new.describe()}): it "
                        "renewed its claim while this save waited; one writer per "
                        "checkpoint. Wait for it to end, or stop it.")
                return new, seen
        return record, version

    def _taken_over(self, record: ClaimRecord | None) -> CommitConflictError:
        known = record is not None and (record.writer is not None or record.stamp)
        who = f" by {record.describe()}" if known and record is not None else ""
        return CommitConflictError(
            f"this save to {self.store.uri} was taken over{who} while it ran; not "
            "committing. Only one job should write a checkpoint URI.")

    def check(self) -> None:
        """Raise :class:`CommitConflictError` unless the claim is still ours (a writer
        suspended by a failure claims again first)."""
        if not self.used:
            return
        self.acquire()
        try:
            record: ClaimRecord | None = ClaimRecord.parse(self.store.get(CLAIM_NAME))
        except FileNotFoundError:
            record = None
        if record is None or record.writer != self.writer:
            self.suspend()
            raise self._taken_over(record)

    def suspend(self) -> None:
        """The writer's operation failed: it is no longer live (the object stays)."""
        with self._lock:
            self._drop(delete=False, verify=False)

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
            record = ClaimRecord.parse(raw)
            if record.writer == self.writer:
                store.put_if_match(CLAIM_NAME, record.given_up().to_bytes(), version)
        except Exception as exc:  # noqa: BLE001 - the claim stays; its lease runs out
            log.warning("could not mark the writer claim of %s abandoned: %s",
                        self.store.uri, exc)

    def _drop(self, *, delete: bool, verify: bool) -> None:
        self.held = False
        with _live_lock:
            _live.discard(self.writer)
        if self._renewing is not None:
            self._renewing.stop()  # before the claim is rewritten or removed
        if not delete:
            return
        store = self.store
        try:
            if verify and ClaimRecord.parse(store.get(CLAIM_NAME)).writer != self.writer:
                return
            store.delete([CLAIM_NAME])
        except Exception as exc:  # noqa: BLE001 - a leftover claim only delays a retry
            log.warning("could not remove the writer claim of %s: %s", self.store.uri, exc)

    def __del__(self) -> None:
        try:
            with _live_lock:
                _live.discard(self.writer)
            if self._renewing is not None:
                self._renewing.stop()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _recorder(writer: str, lease: float, *, deleting: bool = False) -> Callable[[], bytes]:
    """The bytes of ``writer``'s claim, each time it is written (renewed) from now on."""
    since = time.time()
    return lambda: ClaimRecord(writer, deleting=deleting, stamp=stamp(lease, since)).to_bytes()


@contextmanager
def deleting(store: Store) -> Iterator[None]:
    """Write a claim saying a delete of ``store``'s committed prefix is under way,
    before its manifest goes, and hold it while the block runs: a delete cut short
    then leaves objects that still prove to be cloudckpt's (see
    :mod:`cloudckpt.core.ownership`), and no writer takes the prefix over mid-delete."""
    lease = lease_seconds()
    record = _recorder(uuid.uuid4().hex, lease, deleting=True)
    info = store.put(CLAIM_NAME, record())
    held = Lease(store, CLAIM_NAME, record, _version(store, info), lease).start()
    try:
        yield
    finally:
        held.stop()


@contextmanager
def seized(store: Store, objects: Sequence[ObjectInfo]) -> Iterator[bool]:
    """Before deleting an unfinished save surveyed as ``objects``: replace its claim,
    by compare-and-swap on the version surveyed, with this process's "deleting"
    claim (create it where there was none), held while the block runs. A writer that
    took the prefix over since then keeps it (False: delete nothing); one that comes
    later finds it held; one that held it all along fails its check before committing."""
    lease = lease_seconds()
    record = _recorder(uuid.uuid4().hex, lease, deleting=True)
    claim = next((o for o in objects if o.key == CLAIM_NAME), None)
    try:
        if claim is None:
            info = store.put_if_absent(CLAIM_NAME, record())
        else:
            version = claim.version
            if version is None:  # a listing without versions: read it (a narrower race)
                _, version = store.get_with_version(CLAIM_NAME)
            info = store.put_if_match(CLAIM_NAME, record(), version)
    except (CommitConflictError, FileNotFoundError):
        yield False
        return
    held = Lease(store, CLAIM_NAME, record, _version(store, info), lease).start()
    try:
        yield True
    finally:
        held.stop()
