"""A ROLL uploader's checkpoints that it uploaded a part of and has not yet seen
committed: each commits, or is reported as an ERROR naming it and what is missing once no
part came for ``parts_timeout`` (at the next save, at ``wait``/``close``, and at process
end), never waited for forever."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from cloudckpt.errors import CommitConflictError, StorageError
from cloudckpt.integrations.roll import commits
from cloudckpt.integrations.roll.layout import checkpoint_order

log = logging.getLogger(__name__)

#: How often ``wait`` looks at the parts of checkpoints still short of some.
_POLL_SECONDS = 0.5
#: ``wait`` says what it waits for once it has waited this long (other ranks' parts
#: usually land within it).
_NOTICE_SECONDS = 10.0


class OpenCheckpoints:
    """What :class:`~.uploader.RollUploader` keeps of its open checkpoints."""

    output_dir: str
    parts_timeout: float
    _lock: threading.Lock
    _open: dict[str, None]  # uploaded a part, not yet seen committed
    _lost: dict[str, str]  # ckpt_id -> the ERROR that reported it
    _pending: list[Any]

    def _drain(self) -> None:
        raise NotImplementedError

    def _progress(self, ckpt_id: str) -> commits.Progress | None:
        raise NotImplementedError

    def _forget(self, ckpt_id: str) -> None:
        with self._lock:
            self._open.pop(ckpt_id, None)

    def _report_stalled(self, current: str) -> None:
        """At the next save: report each earlier checkpoint that stopped getting parts.
        Never fails the upload it runs in (the next check runs at the next save)."""
        try:
            self._check_open(exclude=current, waited=0.0)
        except (StorageError, CommitConflictError, OSError) as exc:
            log.warning("could not check the earlier checkpoints' parts in %s: %s",
                        self.output_dir, exc)

    def _settle(self) -> None:
        """Until each open checkpoint has committed, or has been reported as lost."""
        start = time.monotonic()
        told = False
        while waiting := self._check_open(exclude=None, waited=time.monotonic() - start):
            if not told and time.monotonic() - start >= _NOTICE_SECONDS:
                told = True
                for ckpt_id, progress in waiting:
                    log.warning("waiting up to %.0f s for the other parts of %s: %s; if no "
                                "other process uploads into it, expected_uploads is wrong",
                                self.parts_timeout, ckpt_id, progress.text())
            time.sleep(_POLL_SECONDS)

    def _check_open(self, exclude: str | None, waited: float) -> list[tuple[str, commits.Progress]]:
        """Look at each open checkpoint (but ``exclude``): drop the committed, report the
        ones idle for ``parts_timeout`` (or after ``waited`` that long), return the rest."""
        with self._lock:
            names = [c for c in self._open if c != exclude]
        waiting = []
        for ckpt_id in names:
            progress = self._progress(ckpt_id)
            if progress is None:
                self._forget(ckpt_id)
            elif max(progress.idle, waited) >= self.parts_timeout:
                self._declare_lost(ckpt_id, progress)
            else:
                waiting.append((ckpt_id, progress))
        return waiting

    def _declare_lost(self, ckpt_id: str, p: commits.Progress) -> None:
        """One ERROR naming the checkpoint, its parts found and expected, and the fix."""
        if p.expected is None:
            fix = ("a process that uploads checkpoints failed or stopped before its part was "
                   "uploaded (see its log); if the job's processes did not all upload, set "
                   "checkpoint_config.expected_uploads to the number that do")
        elif p.problems:
            fix = ("if more processes upload each checkpoint, expected_uploads is too low: "
                   "set it to the pipeline + every uploading rank")
        else:
            fix = ("if every process's upload of it returned, expected_uploads is too high: "
                   "set checkpoint_config.expected_uploads to the number of processes that "
                   f"upload each checkpoint (the pipeline + every uploading rank; "
                   f"{len(p.parts)} if all of them arrived here)")
        msg = (f"{ckpt_id} was NOT committed to {self.output_dir}: {p.text()}, "
               f"and no part came for {self.parts_timeout:.0f} s (parts_timeout), so "
               f"resume_from_checkpoint skips it. Fix: {fix}; otherwise see the ERROR of the "
               "part that failed.")
        with self._lock:
            if ckpt_id not in self._open:
                return  # reported meanwhile by the other thread (wait, or the next save)
            del self._open[ckpt_id]
            self._lost[ckpt_id] = msg
        log.error("%s", msg)

    def _exiting(self) -> None:
        """At process end: let open checkpoints commit (up to ``parts_timeout`` after
        their newest part), then name in one ERROR every checkpoint of this process that
        never committed (reported at the next save, or now)."""
        with self._lock:
            busy = bool(self._open or self._pending)
        try:
            if busy:
                self._drain()
                self._settle()
        except Exception as exc:  # noqa: BLE001 - the process is ending; say, do not raise
            log.error("could not check the open checkpoints of %s at exit: %s",
                      self.output_dir, exc)
        with self._lock:
            lost, self._lost = self._lost, {}
        if lost:
            names = sorted(lost, key=checkpoint_order)
            log.error("at exit: %s never committed to %s (resume_from_checkpoint skips "
                      "them): %s", ", ".join(names), self.output_dir,
                      " | ".join(lost[n] for n in names))
