"""Whether the process that wrote a record of ownership (a writer's claim, a delete's
mark, a staging marker) may still run.

Records name their writer three ways, each judged where it can be:

- **the process**: host, boot id, pid namespace, pid and start time. Only a process on
  this host, boot and pid namespace can be checked (its pid is free, or now another
  process's); pids mean nothing across containers, nodes and reboots.
- **the attempt of the run** (:mod:`cloudckpt.runtime.attempt`): a record of an earlier
  attempt of this process's own run is dead, wherever it ran and whether or not its
  process still runs: that attempt was replaced.
- **the lease**: the writer rewrites its record every quarter of the lease while it
  works (:mod:`cloudckpt.core.leases`), so a record not renewed for a whole lease is dead
  wherever its writer ran. Judged first by the record's ``renewed`` time (clocks of a
  cluster agree within seconds, well below a lease), then, while the lease may still
  run, by watching the record's version on this process's own clock.
"""

from __future__ import annotations

import enum
import math
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.runtime import attempt
from cloudckpt.runtime.attempt import Relation

#: Seconds a claim stays live without being renewed (``CLOUDCKPT_CLAIM_LEASE``).
DEFAULT_LEASE = 60.0
LEASE_ENV = "CLOUDCKPT_CLAIM_LEASE"
# A record's own lease is honoured up to this: a damaged record must not block for days.
_LONGEST_LEASE = 6 * 3600.0


def lease_seconds() -> float:
    """The lease of the records this process writes: ``CLOUDCKPT_CLAIM_LEASE`` seconds
    (read each time, so a launcher or a test may set it), 60 by default."""
    raw = os.environ.get(LEASE_ENV)
    if not raw:
        return DEFAULT_LEASE
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 1.0 <= value <= _LONGEST_LEASE:
        raise ConfigError(f"{LEASE_ENV}={raw!r}: a claim's lease is a number of seconds "
                          f"from 1 to {_LONGEST_LEASE:.0f}")
    return value


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
    """Where this process runs. Pids are only judged when all of it matches: a
    hostname alone is shared by containers on one host (host networking) whose pids
    are in other namespaces, and by sandboxes that all call themselves localhost."""
    return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"),
            "pid_ns": _pid_namespace()}


def this_process() -> dict[str, Any]:
    """This process, as records of ownership name it: enough for :func:`process_gone`
    to judge later, on this host, that it no longer runs."""
    pid = os.getpid()
    return {**_whoami(), "pid": pid, "started_ticks": _start_ticks(pid)}


def here(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` was written on this host, boot and pid namespace."""
    return all(record.get(k) == v for k, v in _whoami().items())


def process_gone(record: Mapping[str, Any]) -> bool:
    """Whether the process a :func:`this_process` record names provably no longer runs:
    it ran on this host, boot and pid namespace, and its pid is free or now belongs
    to a process started later. Anything unknown means it may still run."""
    pid = record.get("pid")
    if not here(record) or isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    if not _pid_alive(pid):
        return True
    started = record.get("started_ticks")
    return started is not None and _start_ticks(pid) not in (None, started)


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def lease_of(record: Mapping[str, Any]) -> float:
    """The lease ``record`` was written with (this process's where it names none)."""
    lease = _seconds(record.get("lease"))
    if lease is None or lease <= 0:
        return lease_seconds()
    return min(lease, _LONGEST_LEASE)


class State(enum.Enum):
    GONE = "gone"  # its writer no longer runs: take it over
    LIVE = "live"  # its writer runs: do not
    LEASED = "leased"  # unknown until its lease runs out


@dataclass(frozen=True)
class Verdict:
    """What a record's writer is: ``why`` says it in words, ``left`` is the longest its
    lease may still run (seconds, for :attr:`State.LEASED`)."""

    state: State
    why: str
    left: float = 0.0


def judge(record: Mapping[str, Any], *, now: float | None = None) -> Verdict:
    """Judge the writer of ``record``, written by another process than this one."""
    if record.get("abandoned"):
        return Verdict(State.GONE, "its save failed and gave it up")
    # An earlier attempt of this run was replaced, even where its processes still run.
    relation = attempt.current().relation(record)
    if relation is Relation.EARLIER:
        return Verdict(State.GONE, f"it belongs to {relation.value} ({record.get('run')})")
    if relation is Relation.LATER:
        return Verdict(State.LIVE, f"it belongs to {relation.value}: this process is of an "
                                   "attempt that was replaced")
    if here(record):
        if process_gone(record):
            return Verdict(State.GONE, "its process no longer runs")
        if _seconds(record.get("pid")) is not None:
            return Verdict(State.LIVE, "its process runs on this host")
    lease = lease_of(record)
    renewed = _seconds(record.get("renewed"))
    if renewed is None:
        renewed = _seconds(record.get("since"))
    if renewed is None:
        return Verdict(State.LEASED, f"its lease of {lease:.0f} s", lease)
    age = (time.time() if now is None else now) - renewed
    if age > lease:
        return Verdict(State.GONE, f"its lease of {lease:.0f} s ran out {age - lease:.0f} s ago")
    return Verdict(State.LEASED, f"its lease of {lease:.0f} s was renewed {max(age, 0):.0f} s "
                                 "ago", min(lease, lease - age))


def stamp(lease: float, since: float | None = None) -> dict[str, Any]:
    """The fields a leased record carries: this process and attempt, the lease, when
    the record was first written and when it was renewed (now)."""
    now = time.time()
    return {**this_process(), **attempt.current().record(), "lease": lease,
            "since": now if since is None else since, "renewed": now}
