"""A job killed mid-save and relaunched elsewhere: the recovery the frameworks' tests and
the manager's run, each with its own launch.

:class:`HeldSave` puts a fault proxy in front of moto that holds one request of the
save (a step's root manifest: every part is written, nothing is committed) until the
job is dead, then drops it; :func:`kill_held` SIGKILLs the job, every process of its
node at once, while it waits there.
Jobs run as on another node (:mod:`cloudckpt_testkit.nodes`): a new pid namespace, its
own hostname and local disk, so no pid of the crashed attempt means anything to the
relaunch, which must take the crashed save's claim over by itself: at once as the next
attempt of the same run (:func:`attempt_env`), once its lease ran out as another run.
:func:`run_stamped` runs the relaunch and notes when each line of its output came, so a
test can tell when the takeover happened (:func:`taken_over`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloudckpt_testkit import FaultProxy

#: The lease of every claim in these tests: what a relaunch of another run waits out.
SHORT_LEASE = 6


class HeldSave:
    """A proxy to moto that holds a PUT whose target contains ``target`` (a string, or a
    pattern searched for) and, once released, drops it (the client that sent it is dead
    by then). It holds the first such PUT, or the one after ``skip`` others went through
    (a save that comes back: the third recover dump of a run)."""

    def __init__(self, moto_endpoint: str, target: str | re.Pattern[str], *,
                 skip: int = 0) -> None:
        seen: list[str] = []

        def matches(path: str) -> bool:
            return target in path if isinstance(target, str) else bool(target.search(path))

        def on_request(method: str, path: str) -> None:
            if method == "PUT" and matches(path) and self.proxy.hold is None:
                seen.append(path)
                if len(seen) > skip:
                    self.proxy.hold = path  # this request, not the reads of the same key

        self.proxy = FaultProxy(moto_endpoint, on_request=on_request, hold_action="drop")

    def __enter__(self) -> HeldSave:
        self.proxy.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.proxy.release.set()
        self.proxy.stop()

    @property
    def env(self) -> dict[str, str]:
        """What points a job's S3 client at the proxy."""
        return {"AWS_ENDPOINT_URL": self.proxy.endpoint}

    @property
    def path(self) -> str | None:
        """The request held (its target), once one is."""
        return self.proxy.hold


def kill_held(proc: subprocess.Popen, held: HeldSave, timeout: float = 300,
              log: Path | None = None) -> None:
    """SIGKILL the node ``proc`` made (its ``unshare``, and every process in it at once)
    as soon as its save waits in ``held``, then drop the held request; fail if it ends
    or times out first (saying what it printed: its stdout pipe, or ``log`` where it
    writes)."""
    deadline = time.monotonic() + timeout

    def output() -> str:
        if log is not None:
            return log.read_text(errors="replace")[-4000:]
        return proc.stdout.read()[-4000:] if proc.stdout else ""

    while not held.proxy.held.wait(0.1):
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) before its save "
                                 f"reached the held request:\n{output()}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=60)
            raise AssertionError(f"the job's save never reached the held request:\n{output()}")
    kill_node(proc)
    held.proxy.release.set()  # the held request is dropped, never forwarded


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL the node ``proc`` (its ``unshare``) made, every process in it at once, as
    a lost node or container goes: every process stopped first, then killed. Killing
    its unshare alone ends the others a moment later, and in that moment they act on
    their parent's death (torch's spawned ranks get SIGINT, and a save so interrupted
    marks its claim abandoned) or send a dropped request again."""
    node = _namespace(proc.pid)
    for sig in (signal.SIGSTOP, signal.SIGSTOP, signal.SIGKILL):
        for pid in _processes(node):
            _signal(pid, sig)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    _wait_gone(node)


def _namespace(unshare_pid: int) -> str | None:
    """The pid namespace of the node that ``unshare`` made (its children's)."""
    try:
        return os.readlink(f"/proc/{unshare_pid}/ns/pid_for_children")
    except OSError:
        return None


def _processes(namespace: str | None) -> list[int]:
    """The processes of pid namespace ``namespace`` (but zombies), as this one sees them."""
    if namespace is None:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") == namespace:
                found.append(int(entry))
        except OSError:  # gone, or a zombie
            continue
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(namespace: str | None, timeout: float = 60) -> None:
    """Until no process of ``namespace`` runs (a zombie sends nothing)."""
    deadline = time.monotonic() + timeout
    while left := _processes(namespace):
        assert time.monotonic() < deadline, f"the killed node's processes {left} still run"
        time.sleep(0.02)


def attempt_env(run: str, attempt: int, lease: float = SHORT_LEASE) -> dict[str, str]:
    """An attempt of run ``run``, as a launcher names it (see cloudckpt.runtime.attempt)."""
    return {"CLOUDCKPT_RUN_ID": run, "CLOUDCKPT_RUN_ATTEMPT": str(attempt),
            "CLOUDCKPT_CLAIM_LEASE": str(lease)}


@dataclass
class Stamped:
    """What a command printed (stdout and stderr as one stream), each line with the
    ``time.time()`` at which it came."""

    returncode: int
    lines: list[tuple[float, str]]

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def run_stamped(cmd: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path,
                timeout: float = 600) -> Stamped:
    """Run ``cmd`` to its end, its output stamped line by line (and copied to ``log``);
    killed and failed after ``timeout`` seconds."""
    proc = subprocess.Popen(list(cmd), env=dict(env), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        with log.open("w") as copy:
            for line in proc.stdout:
                lines.append((time.time(), line.rstrip("\n")))
                copy.write(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=60)
        reader.join(timeout=10)
        raise AssertionError(f"{cmd[-1]} did not end in {timeout:.0f} s:\n"
                             + "\n".join(line for _, line in lines[-60:])) from None
    reader.join(timeout=60)
    return Stamped(proc.returncode, lines)


def taken_over(log: str | Stamped, uri: str) -> list[str]:
    """The lines in which a save took the claim of ``uri`` over from a dead one."""
    text = log.text if isinstance(log, Stamped) else log
    return [line for line in text.splitlines() if f"taking over {uri} from a save" in line]


def taken_over_at(out: Stamped, uri: str) -> list[tuple[float, str]]:
    """:func:`taken_over`, each line with when it came."""
    return [(t, line) for t, line in out.lines if f"taking over {uri} from a save" in line]
