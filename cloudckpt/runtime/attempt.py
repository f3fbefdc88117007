"""Which run this process belongs to, and which attempt of it.

A job that crashes comes back as a new attempt of the same run: torchrun restarts its
workers, SLURM requeues the job, Kubernetes restarts the pod's container, a person or a
script launches it again on another node. The new attempt's processes have new pids, in
another pid namespace, often on another host, so nothing about the crashed processes can
be checked there. What the launchers keep across attempts is an id of the run and,
mostly, a restart count; this module reads them, so that a save of a later attempt may
take over what an earlier attempt of its own run left claimed (:mod:`cloudckpt.core.claim`)
without waiting for its lease to run out.

The run's id, first found of:

- ``CLOUDCKPT_RUN_ID`` (with ``CLOUDCKPT_RUN_ATTEMPT``, a number, if the launcher has
  one): set it where no launcher below names the run, e.g. from a Kubernetes Job's
  name through the downward API;
- SLURM: ``SLURM_JOB_ID``, the attempt ``SLURM_RESTART_COUNT`` (a requeue keeps the id);
- torchrun: ``TORCHELASTIC_RUN_ID`` (its ``--rdzv-id``; not the default ``none``), the
  attempt ``TORCHELASTIC_RESTART_COUNT``;
- Kubernetes: the pod's name (``HOSTNAME`` where ``KUBERNETES_SERVICE_HOST`` is set),
  which a restarted container keeps.

Attempts of one run are ordered by their numbers where both have one, else by when they
started, where a launcher says so: ``CLOUDCKPT_ATTEMPT_STARTED``, which ``cloudckpt run``
sets for every process it launches, so that the processes of one attempt share it.
Without either, two processes of one run cannot be told apart from two attempts of it,
and nothing is taken over by the run alone.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

#: The environment variable ``cloudckpt run`` sets: when this attempt of the run began.
STARTED_ENV = "CLOUDCKPT_ATTEMPT_STARTED"
#: The run's id where no launcher names it (``cloudckpt run --run-id``).
RUN_ENV = "CLOUDCKPT_RUN_ID"
#: The attempt's number within the run named by ``CLOUDCKPT_RUN_ID``, if known.
NUMBER_ENV = "CLOUDCKPT_RUN_ATTEMPT"
#: What a launcher carries to processes it does not start itself (a Ray cluster's
#: workers): cloudckpt's own variables naming the run and the attempt.
CARRIED = (RUN_ENV, NUMBER_ENV, STARTED_ENV)

# Two attempts starting within this many seconds of each other are not ordered by time:
# wall clocks of different machines differ by about that much.
_CLOCK_SLACK = 2.0


class Relation(enum.Enum):
    """How another attempt (the one that wrote a record) relates to this one."""

    EARLIER = "an earlier attempt of this run"
    LATER = "a later attempt of this run"
    SAME = "this attempt"
    UNRELATED = "another run, or one this process cannot tell"


@dataclass(frozen=True)
class Attempt:
    """This process's run (None: no launcher names it) and attempt of it: the
    launcher's restart count, and when the attempt started (None where unknown)."""

    run: str | None
    number: int | None
    started: float | None

    def record(self) -> dict[str, Any]:
        """The fields a record of ownership carries to name this attempt."""
        return {"run": self.run, "attempt": self.number, "attempt_started": self.started}

    def relation(self, record: Mapping[str, Any]) -> Relation:
        """How the attempt named by ``record`` (see :meth:`record`) relates to this one."""
        run = record.get("run")
        if self.run is None or run != self.run:
            return Relation.UNRELATED
        theirs = record.get("attempt")
        if _count(theirs) and self.number is not None:
            if theirs == self.number:
                return Relation.SAME
            return Relation.EARLIER if theirs < self.number else Relation.LATER
        started = record.get("attempt_started")
        if (not isinstance(started, int | float) or isinstance(started, bool)
                or self.started is None):
            return Relation.UNRELATED
        if abs(started - self.started) <= _CLOCK_SLACK:
            return Relation.SAME if started == self.started else Relation.UNRELATED
        return Relation.EARLIER if started < self.started else Relation.LATER


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(env: Mapping[str, str], name: str) -> int | None:
    try:
        value = int(env.get(name, ""))
    except ValueError:
        return None
    return value if value >= 0 else None


def _run(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    if env.get(RUN_ENV):
        return env[RUN_ENV], _number(env, NUMBER_ENV)
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}", _number(env, "SLURM_RESTART_COUNT") or 0
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return (f"torchelastic:{env['TORCHELASTIC_RUN_ID']}",
                _number(env, "TORCHELASTIC_RESTART_COUNT"))
    if env.get("KUBERNETES_SERVICE_HOST") and env.get("HOSTNAME"):
        return f"k8s-pod:{env['HOSTNAME']}", None
    return None, None


def current(env: Mapping[str, str] | None = None) -> Attempt:
    """This process's attempt, from the environment (read each time: cheap, and a
    test or a launcher may change it)."""
    env = os.environ if env is None else env
    run, number = _run(env)
    try:
        started: float | None = float(env.get(STARTED_ENV, ""))
    except ValueError:
        started = None
    return Attempt(run, number, started)


def launch_environment() -> dict[str, str]:
    """What a launcher of one attempt (``cloudckpt run``) puts in the environment of
    every process it starts: when the attempt began, kept if a launcher above set it."""
    return {STARTED_ENV: os.environ.get(STARTED_ENV) or repr(time.time())}
