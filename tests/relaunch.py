"""A job killed mid-save and relaunched elsewhere: the recovery the frameworks' tests and
the manager's run, each with its own launch.

:class:`HeldSave` puts a fault proxy in front of moto that holds one request of the
save (a step's root manifest: every part is written, nothing is committed) until the
job is dead, then drops it; :func:`kill_held` SIGKILLs the job while it waits there.
Jobs run as on another node (:mod:`cloudckpt_testkit.nodes`): a new pid namespace, its
own hostname and local disk, so no pid of the crashed attempt means anything to the
relaunch, which must take the crashed save's claim over by itself: at once as the next
attempt of the same run (:func:`attempt_env`), once its lease ran out as another run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

from cloudckpt_testkit import FaultProxy

#: The lease of every claim in these tests: what a relaunch of another run waits out.
SHORT_LEASE = 6


class HeldSave:
    """A proxy to moto that holds the first PUT whose target contains ``target`` and,
    once released, drops it (the client that sent it is dead by then)."""

    def __init__(self, moto_endpoint: str, target: str) -> None:
        def on_request(method: str, path: str) -> None:
            if method == "PUT" and target in path and self.proxy.hold is None:
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


def kill_held(proc: subprocess.Popen, held: HeldSave, timeout: float = 300) -> None:
    """SIGKILL ``proc`` (the node's ``unshare``: everything in the node dies with it) as
    soon as its save waits in ``held``; fail if it ends or times out first."""
    deadline = time.monotonic() + timeout
    while not held.proxy.held.wait(0.1):
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the job ended (exit {proc.returncode}) before its save "
                                 f"reached the held request:\n{out[-4000:]}")
        assert time.monotonic() < deadline, "the job's save never reached the held request"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    held.proxy.release.set()  # the held request is dropped, never forwarded


def attempt_env(run: str, attempt: int, lease: float = SHORT_LEASE) -> dict[str, str]:
    """An attempt of run ``run``, as a launcher names it (see cloudckpt.runtime.attempt)."""
    return {"CLOUDCKPT_RUN_ID": run, "CLOUDCKPT_RUN_ATTEMPT": str(attempt),
            "CLOUDCKPT_CLAIM_LEASE": str(lease)}


def taken_over(log: str, uri: str) -> list[str]:
    """The lines in which a save took the claim of ``uri`` over from a dead one."""
    return [line for line in log.splitlines() if f"taking over {uri} from a save" in line]
