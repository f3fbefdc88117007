"""verl configured by its one output key, as the guide's recipe says
(docs/integrations/verl.md, its two launch lines read here): ``trainer.default_local_dir``
on a bucket and ``cloudckpt run --`` in front, nothing else (no --integration, no
variable but the storage endpoint's).

- The doctor reads each line with verl's own hydra config: without ``cloudckpt
  run`` it exits 2 naming the ``./s3:`` directory and the fix; ``run --check`` exits 0.
- The PPO trainer (verl 0.9.1's default v1 ``PPOTrainerSync``, with verl's own
  RayWorkerGroup of two FSDP2 workers: verl_driver.py), on S3 with the config verl's
  hydra composes from the line, is SIGKILLed while step 3's manifest is in flight and
  relaunched: it resumes step 2 and goes on bit-exact with verl's own local run.
- The SFT trainer's CheckpointHandler on two torchrun-style ranks (verl_sft_ranks.py),
  on GCS (fake-gcs-server), is SIGKILLed between steps and relaunched likewise.

Each leaves nothing under its working directory named for a scheme, and verl's
installed files hash as before."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from onekey import launch_lines, scheme_named, unchanged
from relaunch import kill_node
from test_relaunch import (
    assert_same_steps,
    kill_mid_save,
    node_disks,
    relaunch_env,
    run_node,
    sft_reports,
    sft_saved,
    verl_launch,
    verl_saved,
    verl_sft_launch,
)

from cloudckpt import list_checkpoints, open_checkpoint
from cloudckpt.integrations.verl.doctor import compose, read_command

pytestmark = pytest.mark.timeout(900)

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "integrations" / "verl.md"
KEY = "trainer.default_local_dir"


def guide_line(entry: str, root: str) -> list[str]:
    """The guide's recipe's launch line running ``entry``, its bucket replaced by ``root``:
    the words after ``cloudckpt run --``."""
    lines = [w for w in launch_lines(GUIDE, after="The shortest recipe") if entry in w]
    assert len(lines) == 1, lines
    words = lines[0][3:]
    keys = [w for w in words if "=" in w]
    assert [w.split("=", 1)[0] for w in keys] == [KEY], keys  # the one key, nothing else
    return [f"{KEY}={root}" if w.startswith(f"{KEY}=") else w for w in words]


def composed(words: list[str]) -> dict:
    """The config verl's hydra composes from the line (hydra's own node aside)."""
    from omegaconf import OmegaConf

    args = read_command(words)
    assert args is not None
    cfg = compose(args)
    with_hydra = OmegaConf.to_container(cfg, resolve=False)
    with_hydra.pop("hydra")
    return OmegaConf.to_container(OmegaConf.create(with_hydra), resolve=True)


def check_doctor(words: list[str], root: str, cwd: Path, env: dict[str, str]) -> None:
    """The forgotten launcher is named; under ``cloudckpt run`` the launch is fine."""
    scheme = root.split("://")[0]
    doctor = subprocess.run([sys.executable, "-m", "cloudckpt", "doctor", "--", *words],
                            cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert doctor.returncode == 2, doctor.stdout + doctor.stderr
    bucket_path = root.split("://", 1)[1]
    assert f"without `cloudckpt run`: {cwd}/{scheme}:/{bucket_path}" in doctor.stdout
    assert f"launch it as `cloudckpt run -- {shlex.join(words)}`" in doctor.stderr
    check = subprocess.run([sys.executable, "-m", "cloudckpt", "run", "--check", "--", *words],
                           cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"{root}/global_step_N, each step committed" in check.stdout
    assert "without" not in check.stdout
    assert not list(cwd.iterdir())  # the doctor wrote nothing


@pytest.fixture
def disks():
    with node_disks() as path:
        yield path


# ------------------------------------------------------------------ PPO, on S3


def ppo_plan(config: dict, phase: dict) -> dict:
    return {"config": config, "world": 2, "trainer": "v1", "phases": [phase]}


@pytest.fixture(scope="module")
def ppo_reference(tmp_path_factory) -> dict:
    """verl's own v1 trainer saving four steps on local disk, never stopped, with the
    guide's line composed (its key a local directory)."""
    tmp = tmp_path_factory.mktemp("verl-onekey-reference")
    config = composed(guide_line("verl.trainer.main_ppo", str(tmp / "ckpts")))
    with node_disks() as nodes:
        launch, out = verl_launch(tmp, nodes, "reference",
                                  ppo_plan(config, {"save": [1, 2, 3, 4]}), "node-r")
        run_node(launch, tmp, {}, "reference")
    (reference,) = json.loads(out.read_text())["phases"]
    assert "error" not in reference, reference.get("traceback")
    return reference


def test_ppo_trainer_by_its_one_key_on_s3_killed_mid_save_resumes_bit_exact(
        s3, moto_server, tmp_path, disks, ppo_reference):
    work = tmp_path / "work"
    work.mkdir()
    words = guide_line("verl.trainer.main_ppo", s3.root)
    env = {**os.environ, **s3.env}
    with unchanged("verl"):
        check_doctor(words, s3.root, work, env)
        config = composed(words)
        assert config["trainer"]["default_local_dir"] == s3.root
        assert config["trainer"]["use_v1"] is True  # main_ppo's default: the v1 trainer
        first, again = relaunch_env("same-run")
        killed, _ = verl_launch(tmp_path, disks, "killed",
                                ppo_plan(config, {"save": [1, 2, 3]}), "node-a")
        kill_mid_save(lambda more: killed({**s3.env, **first, **more}), work, moto_server,
                      "/global_step_3/cloudckpt-manifest.json")
        assert [c.name for c in list_checkpoints(s3.root, s3.options)] == \
            ["global_step_1", "global_step_2"]
        relaunched, out = verl_launch(tmp_path, disks, "relaunch",
                                      ppo_plan(config, {"resume": True, "save": [3, 4]}), "node-b")
        log = run_node(relaunched, work, {**s3.env, **again}, "relaunch")
    seen = json.loads(out.read_text())
    assert "error" not in seen, seen.get("traceback")
    (resumed,) = seen["phases"]
    assert "error" not in resumed, resumed.get("traceback")
    assert resumed["resumed_at"] == 2
    assert_same_steps(verl_saved(resumed), verl_saved(ppo_reference), [3, 4])
    # Each process that bound verl said so once (the trainer's binding is what told
    # verl's checkpoint_callback the committed URIs below).
    pids = re.findall(r"bound the verl integration into verl 0\.9\.1, pid (\d+): ", log.text)
    assert pids and len(pids) == len(set(pids)), pids
    # verl's checkpoint_callback is told each committed step's URI.
    assert resumed["saved"][-1]["callbacks"] == [[3, f"{s3.root}/global_step_3"],
                                                 [4, f"{s3.root}/global_step_4"]]
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == \
        ["global_step_1", "global_step_2", "global_step_3", "global_step_4"]
    open_checkpoint(f"{s3.root}/global_step_3", s3.options).verify(deep=True)
    assert scheme_named(work) == [] and scheme_named(tmp_path) == []


# ------------------------------------------------------------------ SFT, on GCS


def kill_node_when(proc: subprocess.Popen, ready: Callable[[], bool], log: Path,
                   timeout: float = 600) -> None:
    """SIGKILL the node ``proc`` made, every process in it at once, once ``ready()``."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) before it was "
                                 f"killed:\n{log.read_text(errors='replace')[-4000:]}")
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
        time.sleep(0.2)
    kill_node(proc)


def test_sft_trainer_by_its_one_key_on_gcs_killed_mid_run_resumes_bit_exact(
        gcs, tmp_path, disks, verl_sft_reference):
    work = tmp_path / "work"
    work.mkdir()
    words = guide_line("verl.trainer.sft_trainer", gcs.root)
    assert words[:1] == ["torchrun"]
    env = {**os.environ, **gcs.env}
    with unchanged("verl"):
        check_doctor(words, gcs.root, work, env)
        trainer = composed(words)["trainer"]
        plan = {"root": trainer["default_local_dir"], "keep": trainer["max_ckpt_to_keep"],
                "hdfs": trainer["default_hdfs_dir"]}
        assert plan == {"root": gcs.root, "keep": None, "hdfs": None}
        first, again = relaunch_env("same-run")
        killed, out = verl_sft_launch(tmp_path, disks, "killed",
                                      {**plan, "steps": [1, 2], "hang": True}, "node-a")
        cmd, environ = killed({**gcs.env, **first})
        log = work / "killed.log"
        with log.open("w") as sink:
            proc = subprocess.Popen(cmd, env=environ, cwd=work, stdout=sink,
                                    stderr=subprocess.STDOUT)
        kill_node_when(proc, lambda: all((out / f"hanging{r}").exists() for r in (0, 1)), log)
        assert [c.name for c in list_checkpoints(gcs.root, gcs.options)] == \
            ["global_step_1", "global_step_2"]
        relaunched, out = verl_sft_launch(tmp_path, disks, "relaunch",
                                          {**plan, "resume_save": [3, 4]}, "node-b")
        run_node(relaunched, work, {**gcs.env, **again}, "relaunch")
    reports = sft_reports(out)
    assert [rep["resumed_at"] for rep in reports] == [2, 2]
    assert all(rep["bound"] for rep in reports)
    assert_same_steps(sft_saved(reports), verl_sft_reference, [3, 4])
    assert [c.name for c in list_checkpoints(gcs.root, gcs.options)] == \
        ["global_step_1", "global_step_2", "global_step_3", "global_step_4"]
    open_checkpoint(f"{gcs.root}/global_step_4", gcs.options).verify(deep=True)
    assert scheme_named(work) == [] and scheme_named(tmp_path) == []
    # Each rank said in one line what it bound (the handler's binding is in rep["bound"]).
    pids = re.findall(r"bound the verl integration into verl 0\.9\.1, pid (\d+): ",
                      (work / "relaunch.log").read_text())
    assert len(pids) == len(set(pids)) == 2, pids
