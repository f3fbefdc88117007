"""Activation reaches the workers of a Ray cluster started on its own (``ray start
--head``), which never saw ``cloudckpt run``'s environment: the driver under ``cloudckpt
run`` connects to it with a runtime_env of its own, and a task and an actor that import
verl's checkpoint manager module find it bound, with the driver's attempt and the
user's own variable and setup hook kept (ray_separate_driver.py). Without ``cloudckpt
run``, the same driver binds nothing there: the cluster itself carries no activation."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)

HERE = Path(__file__).resolve().parent
VERL_BINDING = "cloudckpt.integrations.verl.binding:bind_fsdp_manager"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain_env(home: Path) -> dict[str, str]:
    """This test's environment without activation: no CLOUDCKPT_* variable, no hook
    directory; cloudckpt and this directory importable, as on a cluster's nodes. A
    ``HOME`` of its own: Ray turns token authentication on for a head that finds a
    token in ``~/.ray``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOUDCKPT_")}
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not p.endswith(os.path.join("activation", "site"))]
    return {**env, "PYTHONPATH": os.pathsep.join([*path, str(HERE)]), "RAY_DEDUP_LOGS": "0",
            "HOME": str(home)}


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[str, Path]]:
    """``ray start --head --block``, in a session of its own (ended by its group id)."""
    temp = Path(tempfile.mkdtemp(prefix="rayh-"))
    port = _free_port()
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
         "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false",
         "--disable-usage-stats",
         f"--temp-dir={temp}", "--block"],
        env=_plain_env(temp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    seen = []
    try:
        assert head.stdout is not None
        for line in head.stdout:
            seen.append(line)
            if "Ray runtime started" in line:
                break
        else:
            raise AssertionError("ray start --head failed:\n" + "".join(seen[-40:]))
        yield f"127.0.0.1:{port}", temp
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def run_driver(cluster: tuple[str, Path], tmp_path: Path, *, under_run: bool
               ) -> tuple[dict, str]:
    address, home = cluster
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(HERE / "ray_separate_driver.py"), address, str(out)]
    if under_run:
        cmd = [sys.executable, "-m", "cloudckpt", "run", "--run-id", "job-7", "--", *cmd]
    r = subprocess.run(cmd, env=_plain_env(home), cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    return json.loads(out.read_text()), r.stdout + r.stderr


def test_workers_of_a_separately_started_cluster_bind_under_cloudckpt_run(cluster, tmp_path):
    report, log = run_driver(cluster, tmp_path, under_run=True)
    started = report["driver_env"]["CLOUDCKPT_ATTEMPT_STARTED"]
    assert started and report["driver_env"]["CLOUDCKPT_RUN_ID"] == "job-7"
    for where in ("task", "actor"):
        seen = report[where]
        assert seen["bound"] == [VERL_BINDING] and seen["bound_method"], seen
        assert not seen["hook_dir_on_path"], seen  # bound by Ray's setup hook alone
        assert seen["env"] == {"CLOUDCKPT_INTEGRATIONS": "auto",
                               "CLOUDCKPT_ATTEMPT_STARTED": started,
                               "CLOUDCKPT_RUN_ID": "job-7", "USERS_VAR": "kept",
                               "USERS_HOOK_SAW": "auto"}, seen
        assert (f"pid {seen['pid']}: verl.utils.checkpoint.fsdp_checkpoint_manager."
                "FSDPCheckpointManager") in log
    # The driver said once what it carried.
    carried = [line for line in log.splitlines() if "ray.init carries activation" in line]
    assert len(carried) == 1, log[-4000:]
    assert "CLOUDCKPT_INTEGRATIONS=auto" in carried[0]
    assert f"CLOUDCKPT_ATTEMPT_STARTED={started}" in carried[0]
    assert "cloudckpt.activation.ray.setup_worker, then" in carried[0]


def test_without_cloudckpt_run_the_cluster_binds_nothing(cluster, tmp_path):
    report, log = run_driver(cluster, tmp_path, under_run=False)
    for where in ("task", "actor"):
        seen = report[where]
        assert seen["bound"] == [] and not seen["bound_method"], seen
        assert seen["env"]["CLOUDCKPT_INTEGRATIONS"] is None
        assert seen["env"]["USERS_VAR"] == "kept" and seen["env"]["USERS_HOOK_SAW"] == "unset"
    assert "cloudckpt" not in log
