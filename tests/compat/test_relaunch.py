"""A job SIGKILLed in the middle of a save and relaunched on another node comes back by
itself, through each framework's own code on two gloo ranks: the relaunch (a new pid
namespace, its own hostname and local disk) resumes the newest committed step, saves
the killed step again (taking the dead save's claim over: at once as the next attempt of
the same run, once its lease ran out as another run), and goes on bit-exact with a run
that never stopped. No command is typed in between."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from cloudckpt_testkit.nodes import as_node, node_env
from relaunch import SHORT_LEASE, HeldSave, attempt_env, kill_held, taken_over
from test_verl import HERE, saved_at, trainer_config

from cloudckpt import list_checkpoints, open_checkpoint

RELAUNCHES = ["same-run", "other-run"]


@pytest.fixture
def disks():
    """Where the nodes' local disks are: a short path (Ray's socket paths must fit 107
    bytes below a node's TMPDIR)."""
    path = Path(tempfile.mkdtemp(prefix="nodes-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def relaunch_env(relaunch: str) -> tuple[dict[str, str], dict[str, str]]:
    """The killed attempt's environment, and its relaunch's."""
    again = attempt_env("run-1" if relaunch == "same-run" else "run-2", 1)
    return attempt_env("run-1", 0), again


def check_taken_over(log: str, uri: str, relaunch: str, killed_at: float) -> None:
    lines = taken_over(log, uri)
    assert len(lines) == 1, log[-4000:]
    if relaunch == "same-run":
        assert "an earlier attempt of this run" in lines[0]
    else:
        assert f"its lease of {SHORT_LEASE} s" in lines[0]
        assert time.time() > killed_at + SHORT_LEASE - 1  # not before the lease ran out


# --------------------------------------------------------------------------- verl


def verl_launch(tmp_path: Path, disks: Path, name: str, plan: dict, env: dict, host: str
                ) -> tuple[list[str], dict, Path]:
    """verl_driver.py under ``cloudckpt run`` as on node ``host``."""
    (tmp_path / f"{name}.json").write_text(json.dumps(plan))
    out = tmp_path / f"{name}-out.json"
    cmd = [sys.executable, "-m", "cloudckpt", "run", "--", sys.executable,
           str(HERE / "verl_driver.py"), str(tmp_path / f"{name}.json"), str(out)]
    environ = node_env(disks, host, {
        **os.environ, **env, "RAY_DEDUP_LOGS": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))})
    return as_node(cmd, host), environ, out


@pytest.fixture(scope="module")
def verl_reference(tmp_path_factory) -> dict:
    """verl's own run of four steps that never stopped (on local disk, verl's own save)."""
    tmp = tmp_path_factory.mktemp("verl-reference")
    disks = Path(tempfile.mkdtemp(prefix="nodes-"))
    try:
        cmd, environ, out = verl_launch(tmp, disks, "reference", {
            "config": trainer_config(default_local_dir=str(tmp / "ckpts")), "world": 2,
            "phases": [{"save": [1, 2, 3, 4]}]}, {}, "node-r")
        r = subprocess.run(cmd, env=environ, cwd=tmp, capture_output=True, text=True,
                           timeout=600)
    finally:
        shutil.rmtree(disks, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-4000:]
    (reference,) = json.loads(out.read_text())["phases"]
    return reference


@pytest.mark.parametrize("relaunch", RELAUNCHES)
def test_verl_trainer_killed_mid_save_comes_back_on_another_node(relaunch, s3, moto_server,
                                                                 tmp_path, disks,
                                                                 verl_reference):
    """verl's RayPPOTrainer with its RayWorkerGroup of two FSDP2 ranks, killed while the
    root manifest of global_step_3 is in flight (the actor's part committed)."""
    config = trainer_config(default_local_dir=s3.root)
    first, again = relaunch_env(relaunch)
    reference = verl_reference
    step3 = f"{s3.root}/global_step_3"
    with HeldSave(moto_server.endpoint, "/global_step_3/cloudckpt-manifest.json") as held:
        cmd, environ, _ = verl_launch(tmp_path, disks, "killed", {
            "config": config, "world": 2, "phases": [{"save": [1, 2, 3]}]},
            {**s3.env, **held.env, **first}, "node-a")
        proc = subprocess.Popen(cmd, env=environ, cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        kill_held(proc, held)
    killed_at = time.time()
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == \
        ["global_step_1", "global_step_2"]

    cmd, environ, out = verl_launch(tmp_path, disks, "relaunch", {
        "config": config, "world": 2, "phases": [{"resume": True, "save": [3, 4]}]},
        {**s3.env, **again}, "node-b")
    r = subprocess.run(cmd, env=environ, cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    seen = json.loads(out.read_text())
    assert "error" not in seen, seen.get("traceback")
    (resumed,) = seen["phases"]
    assert "error" not in resumed, resumed.get("traceback")
    assert resumed["resumed_at"] == 2
    for step in (3, 4):  # model, optimizer, scheduler, RNG per rank; the data order
        want, got = saved_at(reference, step), saved_at(resumed, step)
        assert got["digests"] == want["digests"] and got["next"] == want["next"], step
    check_taken_over(r.stderr, step3, relaunch, killed_at)
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == \
        ["global_step_1", "global_step_2", "global_step_3", "global_step_4"]
    open_checkpoint(step3, s3.options).verify(deep=True)
