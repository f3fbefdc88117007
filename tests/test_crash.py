"""SIGKILL a real writer process mid-save; a fresh process must never see a torn
checkpoint, and ``latest_checkpoint`` must return the previous committed one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import finish

HERE = Path(__file__).parent
CHILD = str(HERE / "crash_child.py")
CHECK = str(HERE / "crash_check.py")


def _env(backend) -> dict[str, str]:
    return {**os.environ, **backend.env, "CKPT_OPTIONS": backend.options_json(),
            "PYTHONPATH": str(HERE.parent)}


def run_writer(backend, step: int, kill_at: str | None = None) -> list[str]:
    """Run the writer, stalled at ``kill_at``, and SIGKILL it there."""
    proc = subprocess.Popen([sys.executable, CHILD, backend.uri(f"step-{step}"), str(step),
                             kill_at or "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(backend))
    seen: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line.strip())
        if kill_at is not None and line.strip() == kill_at:
            proc.send_signal(signal.SIGKILL)
            break
    rc = proc.wait(timeout=120)
    if kill_at is None:
        assert rc == 0, proc.stderr.read() if proc.stderr else rc
    else:
        assert rc == -signal.SIGKILL, f"writer was not killed at {kill_at!r}: {seen}"
    return seen


def check(backend) -> dict:
    out = subprocess.run([sys.executable, CHECK, backend.root], capture_output=True, text=True,
                         env=_env(backend), timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


KILL_POINTS = [
    "obj 0",    # after the first data object
    "obj 9",    # between data objects
    "obj 19",   # after the last data object
    "commit",   # everything written, manifest not yet
]


@pytest.mark.parametrize("name", ["local", "s3"])
def test_sigkill_mid_save_never_exposes_a_torn_checkpoint(request, name):
    backend = request.getfixturevalue(name)
    run_writer(backend, 1)  # a good checkpoint to fall back to
    points = list(KILL_POINTS)
    if name == "local":
        points.append("in-manifest")  # manifest bytes on disk, not yet linked
    for i, kill_at in enumerate(points):
        step = 10 + i
        run_writer(backend, step, kill_at)
        report = check(backend)
        assert report["latest"] == 1, (kill_at, report)
        assert [c["step"] for c in report["committed"]] == [1], (kill_at, report)
        assert f"step-{step}" in report["uncommitted"], (kill_at, report)
    # A save that completes becomes the latest, with all 20 objects verified.
    run_writer(backend, 50)
    report = check(backend)
    assert report["latest"] == 50
    assert all(c["files"] == 20 for c in report["committed"])


def test_sigkill_while_the_manifest_put_is_in_flight_on_s3(s3, s3_server):
    """The manifest PUT has left the client but not reached S3 when the writer dies."""
    from dataclasses import replace

    from cloudckpt_testkit import FaultProxy

    run_writer(s3, 1)
    victim: dict[str, subprocess.Popen] = {}
    manifest = "cloudckpt-manifest.json"

    def on_request(method: str, target: str) -> None:
        if method == "PUT" and manifest in target and "step-2" in target:
            proxy.hold = manifest  # drop this request once the writer is dead
            victim["proc"].send_signal(signal.SIGKILL)
            victim["proc"].wait(timeout=30)
            proxy.release.set()

    with FaultProxy(s3_server.endpoint, on_request=on_request, hold_action="drop") as proxy:
        via = replace(s3, options={**s3.options, "endpoint_url": proxy.endpoint},
                      env={**s3.env, "AWS_ENDPOINT_URL": proxy.endpoint})
        proc = subprocess.Popen([sys.executable, CHILD, via.uri("step-2"), "2", "none"],
                                stdout=subprocess.PIPE, text=True, env=_env(via))
        victim["proc"] = proc
        out, _ = finish(proc, what="the save whose commit is held")
        assert proxy.held.wait(30)  # the manifest PUT was held, then dropped
    assert proc.returncode == -signal.SIGKILL
    assert "commit" in out.split() and "done" not in out
    report = check(s3)
    assert report["latest"] == 1
    assert report["uncommitted"] == ["step-2"]
