"""Preemption notices: a signal (SIGTERM by default) or a call asks for one last save.

Clusters announce the end of a job before they kill it: SLURM sends SIGTERM (or the
``--signal`` of the job) and SIGKILL ``KillWait`` seconds later (30 by default);
Kubernetes sends SIGTERM and kills after ``terminationGracePeriodSeconds`` (30 by
default); torchrun passes SIGTERM on to its workers and kills them 30 s later; spot
instances get two minutes. A :class:`Notice` turns that announcement into one save:

- the handler only takes note (the main thread may be inside a collective or an
  upload; a handler must not start another), and puts the previous handler back, so
  a second signal goes straight on;
- the manager saves at its next safe point, the end of the current step, when the
  ranks agree that any of them has a notice (every rank saves the same step);
- the save must commit within ``budget`` seconds of the notice: its commit is
  refused after the deadline (the save stays invisible, never torn), and a watchdog
  sends the signal on at the deadline if the safe point has not come by then;
- after the save, the signal goes on to the previous handler (by default the
  process ends as that signal); a notice given by :meth:`Notice.request`, from a
  framework's own signal handling, returns to the caller instead.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from cloudckpt.errors import ConfigError

log = logging.getLogger(__name__)

#: Seconds from the notice to the commit: below the 30 s that torchrun, SLURM's
#: default ``KillWait`` and Kubernetes' default grace period give before SIGKILL.
DEFAULT_BUDGET = 25.0


@dataclass(frozen=True)
class Preemption:
    """Opt-in preemption saves: on any of ``signals`` (names, e.g. ``"SIGUSR1"`` for
    SLURM's ``--signal=USR1@120``), one save at the next safe point, committed within
    ``budget`` seconds of the signal or not at all."""

    budget: float = DEFAULT_BUDGET
    signals: tuple[str, ...] = ("SIGTERM",)

    def __post_init__(self) -> None:
        if not self.budget > 0:
            raise ConfigError(f"Preemption.budget must be a positive number of seconds, "
                              f"got {self.budget!r}")
        for name in self.signals:
            if not isinstance(getattr(signal, str(name), None), signal.Signals):
                raise ConfigError(f"Preemption.signals: {name!r} is not a signal name "
                                  "(e.g. 'SIGTERM', 'SIGUSR1')")


class Notice:
    """Whether this process was told it is about to end, when, and by which signal."""

    def __init__(self, policy: Preemption) -> None:
        self.policy = policy
        self.signum: int | None = None
        self.noticed_at: float | None = None
        self._previous: dict[int, Any] = {}
        self._done = threading.Event()
        self._lock = threading.Lock()

    def install(self) -> None:
        """Handle the policy's signals (from the main thread, where Python runs handlers)."""
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("preemption signals can be handled only from the main thread: "
                              "create the CheckpointManager there, or call "
                              "request_preemption_save() from your own signal handling")
        for name in self.policy.signals:
            sig = getattr(signal, name)
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        log.info("preemption saves armed: on %s, one save within %.0f s",
                 "/".join(self.policy.signals), self.policy.budget)

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: Any) -> None:
        previous = self._previous.get(signum)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._note(signum)

    def request(self) -> None:
        """A notice without a signal: the next safe point saves, and returns."""
        self._note(None)

    def _note(self, signum: int | None) -> None:
        with self._lock:
            if self.noticed_at is not None:
                return
            self.noticed_at, self.signum = time.monotonic(), signum
        what = signal.Signals(signum).name if signum else "a preemption request"
        log.warning("%s: saving at the end of this step, within %.0f s", what,
                    self.policy.budget)
        if signum:
            threading.Thread(target=self._watchdog, name="cloudckpt-preemption",
                             daemon=True).start()

    @property
    def code(self) -> float:
        """What the ranks compare (their largest wins): 0 no notice, 0.5 a request, else
        the signal's number."""
        if self.noticed_at is None:
            return 0.0
        return float(self.signum) if self.signum else 0.5

    @property
    def deadline(self) -> float:
        """The monotonic time by which the save must commit."""
        assert self.noticed_at is not None
        return self.noticed_at + self.policy.budget

    def _watchdog(self) -> None:
        if self._done.wait(max(0.0, self.deadline - time.monotonic())):
            return
        log.error("preemption: no save committed within %.0f s of the signal; the process "
                  "ends now, and a save still in flight is NOT committed (it stays "
                  "invisible; the previous checkpoint is the one to resume from)",
                  self.policy.budget)
        self._proceed()

    def proceed(self, signum: int | None = None) -> None:
        """The save is over (committed or not): let the signal go on, to the previous
        handler; with none here (another rank's), ``signum``, the one the ranks agreed on."""
        self._done.set()
        if not (self.signum or signum):  # a request: answered, the next one is new
            with self._lock:
                self.noticed_at, self._done = None, threading.Event()
            return
        self._proceed(signum)

    def _proceed(self, signum: int | None = None) -> None:
        sig = self.signum or signum
        if not sig:
            return
        if self.signum is None:  # another rank's signal: this one's handler is still ours
            self.uninstall()
        os.kill(os.getpid(), sig)
