"""RLinf with one key (issue 48): the guide's recipe, run as written but for the parts
that need GPUs. ``runner.output_dir`` on a bucket is the only key set; the launch is
RLinf's usual Hydra entry (``rlinf_grpo/main_grpo.py``, written as RLinf's
``examples/reasoning/main_grpo.py``: RLinf's ``output_redirector``, ``MetricLogger``,
``ReasoningRunner`` and FSDP2 strategy on two gloo ranks) behind ``cloudckpt run --``,
with no ``--integration`` and no variable beyond the test's S3 endpoint and wandb's
offline mode (no network here).

- the launch without ``cloudckpt run`` (the reference run, which never stops) shows the
  guide's symptom where the doctor said: exit 0, a local ``s3:`` directory, nothing
  committed in the bucket;
- the launch under ``cloudckpt run`` is SIGKILLed while its third step commits, and the
  guide's relaunch line (``runner.resume_dir=auto``, RLinf's own resume key) resumes the
  second step and goes on bit-exact with the reference; RLinf's local files land below
  the bucket's local directory, none under a name starting with a scheme; RLinf's
  installed files hash the same;
- ``cloudckpt doctor`` names the forgotten launcher, ``cloudckpt run --check`` passes, a
  log path spelled as a bucket URI is refused before anything runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from onekey import code_hashes, guide_block, launch_lines, run_guide_script, scheme_named
from safetensors.torch import load as safetensors_load
from test_relaunch import assert_same_steps, kill_mid_save, node_disks, on_node, run_node

from cloudckpt import list_checkpoints
from cloudckpt.errors import ConfigError
from cloudckpt.hf.convert import model_state_from_dcp
from cloudckpt.integrations.rlinf import doctor, localpaths
from cloudckpt.runtime.localdirs import local_dir_for

pytestmark = pytest.mark.timeout(900)

HERE = Path(__file__).resolve().parent
GUIDE = HERE.parents[1] / "docs" / "integrations" / "rlinf.md"
ENTRY = HERE / "rlinf_grpo" / "main_grpo.py"
GUIDE_BUCKET = "s3://my-bucket/rlinf"
EXPERIMENT = "grpo-1.5b"


def recipe() -> tuple[list[str], list[str]]:
    """The guide's launch and relaunch lines: its shell blocks that are a ``cloudckpt run``."""
    lines = launch_lines(GUIDE, after="The shortest recipe")
    assert len(lines) == 2, lines
    launch, relaunch = lines
    assert "--integration" not in launch and relaunch == [*launch, "runner.resume_dir=auto"]
    assert [w for w in launch if "=" in w] == [f"runner.output_dir={GUIDE_BUCKET}"]
    return launch, relaunch


def here(words: list[str], bucket: str = GUIDE_BUCKET, *, launcher: bool = True) -> list[str]:
    """A guide line as run here: this Python, RLinf's entry script with its GPU workers
    stood in (its config directory beside it, as RLinf's), the test's bucket; without
    ``cloudckpt run --`` unless ``launcher``."""
    if not launcher:
        words = words[words.index("--") + 1:]
    mapped = {"cloudckpt": [sys.executable, "-m", "cloudckpt"], "python": [sys.executable],
              "examples/reasoning/main_grpo.py": [str(ENTRY)]}
    return [part for w in words
            for part in mapped.get(w, [w.replace(GUIDE_BUCKET, bucket)])]


def installed_rlinf() -> Path:
    """The rlinf the launches import (PyPI's), not the peers' partial copy on sys.path."""
    return Path(str(distribution("rlinf").locate_file("rlinf")))


def saved(report: dict) -> dict[int, dict]:
    return {s["step"]: {"digests": s["digests"], "next": s["next"]} for s in report["saved"]}


def test_one_key_run_killed_mid_save_resumes_bit_exact(s3, moto_server, tmp_path,
                                                        hub_server):
    launch, relaunch = recipe()
    env = {**s3.env, "WANDB_MODE": "offline"}
    rlinf_files = code_hashes(installed_rlinf())
    with node_disks() as disks:
        # Forgotten launcher: RLinf's own code takes the URI for a local path.
        forgot = tmp_path / "forgotten"
        forgot.mkdir()
        lost = f"{s3.root}-forgotten"
        bare = here(launch, lost, launcher=False)
        plan = doctor.plan(bare, cwd=str(forgot))
        run_node(lambda e: on_node(bare, disks, "node-r", e, run=False), forgot, env,
                 "forgotten")
        reference = json.loads((forgot / "rlinf-run.json").read_text())
        assert reference["resumed_at"] == 0 and sorted(saved(reference)) == [1, 2, 3, 4]
        assert {u.key for u in plan.forgotten} == {"runner.output_dir",
                                                    "runner.logger.log_path"}
        for use in plan.forgotten:  # where the doctor said, and so the guide
            assert Path(use.unlaunched).exists(), use
        local_steps = Path(plan.uses[0].unlaunched)
        assert str(local_steps).startswith(f"{forgot}/s3:/")
        assert (local_steps / "global_step_4/data/data.pt").is_file()
        steps = list_checkpoints(f"{lost}/{EXPERIMENT}/checkpoints", s3.options,
                                 include_uncommitted=True)
        assert steps and not any(c.committed for c in steps)  # torch's fsspec shards alone

        # The one key, under cloudckpt run: killed while step 3's manifest is in flight.
        run = tmp_path / "run"
        run.mkdir()
        ckpts = f"{s3.root}/{EXPERIMENT}/checkpoints"
        kill_mid_save(lambda e: on_node(here(launch, s3.root), disks, "node-a", {**env, **e},
                                        run=False),
                      run, moto_server, "/global_step_3/cloudckpt-manifest.json")
        assert [c.name for c in list_checkpoints(ckpts, s3.options)] == \
            ["global_step_1", "global_step_2"]

        # Relaunched without RLinf's resume key: refused before training, naming it.
        cmd, environ = on_node(here(launch, s3.root), disks, "node-b", env, run=False)
        fresh = subprocess.run(cmd, env=environ, cwd=run, capture_output=True, text=True,
                               timeout=600)
        assert fresh.returncode != 0
        assert "runner.resume_dir is null, so this run would start over" in fresh.stderr
        assert "Relaunch with runner.resume_dir=auto" in fresh.stderr
        assert [c.name for c in list_checkpoints(ckpts, s3.options)] == \
            ["global_step_1", "global_step_2"]

        out = run_node(lambda e: on_node(here(relaunch, s3.root), disks, "node-b", e,
                                         run=False), run, env, "relaunch")
    report = json.loads((run / "rlinf-run.json").read_text())
    assert report["resumed_at"] == 2
    assert_same_steps(saved(report), saved(reference), [3, 4])
    assert [c.name for c in list_checkpoints(ckpts, s3.options)] == \
        [f"global_step_{n}" for n in (1, 2, 3, 4)]
    assert "taking over" in out.text  # the killed save's claim, its lease run out

    local = Path(local_dir_for(f"{s3.root}/{EXPERIMENT}", cwd=str(run), environ={}))
    assert report["log_path"] == str(local)
    # RLinf's own log of the relaunch (output_redirector) names its wandb run's directory.
    assert f"Run data is saved locally in {local}/wandb/" in (local / "log/main.log").read_text()
    assert len(list((local / "wandb").rglob("*.wandb"))) == 2  # the killed run's and this
    assert f"RLinf's runner.logger.log_path ({s3.root}/{EXPERIMENT}) is local: {local}" \
        in out.text
    assert "bound the rlinf integration into rlinf 0.3.0" in out.text
    assert scheme_named(run) == []
    assert code_hashes(installed_rlinf()) == rlinf_files

    # The guide's Hub push: the newest step's model converted to an HF export, pushed.
    config = tmp_path / "model-config.json"
    config.write_text('{"model_type": "qwen2"}')
    script = guide_block(GUIDE, "bash", containing="cloudckpt push").replace(
        GUIDE_BUCKET, s3.root).replace("global_step_150", "global_step_4").replace(
        "/path/to/model/config.json", str(config))
    run_guide_script(script, tmp_path / "hub", s3.env)
    pushed = hub_server.files("my-org/grpo-1.5b")
    weights = {k: v for f, data in pushed.items() if f.endswith(".safetensors")
               for k, v in safetensors_load(data).items()}
    step4 = model_state_from_dcp(f"{ckpts}/global_step_4", storage_options=s3.options)
    assert weights.keys() == step4.keys() and "config.json" in pushed
    assert all(torch.equal(weights[k], step4[k]) for k in step4)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cloudckpt", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_doctor_names_the_forgotten_launcher_and_run_check_passes(tmp_path):
    launch, relaunch = recipe()
    bare = here(launch, launcher=False)
    r = cli("doctor", "--", *bare, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert (f"without `cloudckpt run`: {tmp_path}/s3:/my-bucket/rlinf/{EXPERIMENT}/checkpoints"
            in r.stdout)
    assert "nothing written there reaches the bucket" in r.stderr and "cloudckpt run --" in r.stderr

    r = cli("run", "--check", "--", *here(relaunch, launcher=False), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"s3://my-bucket/rlinf/{EXPERIMENT}/checkpoints" in r.stdout
    assert f"{tmp_path}/cloudckpt-local/my-bucket/rlinf/{EXPERIMENT}" in r.stdout
    assert f"newest committed step under s3://my-bucket/rlinf/{EXPERIMENT}" in r.stdout
    assert "without `cloudckpt run`: " not in r.stdout  # no path goes astray
    assert cli("doctor", "--", *here(launch), cwd=tmp_path).returncode == 0  # the full line

    r = cli("run", "--check", "--", *bare, "runner.logger.log_path=s3://my-bucket/logs",
            cwd=tmp_path)
    assert r.returncode == 2
    assert "REFUSED: runner.logger.log_path is the bucket URI s3://my-bucket/logs" in r.stdout
    config = ENTRY.parent / "config/math/qwen2.5-1.5b-grpo-fsdp.yaml"
    r = cli("doctor", "--", str(config), cwd=tmp_path)  # a config file alone: local paths
    assert r.returncode == 0 and f"{tmp_path.parent}/results/{EXPERIMENT}" in r.stdout
    assert list(tmp_path.iterdir()) == []  # the doctor writes nothing

    other = tmp_path / "ppo.yaml"  # another framework's config: left to its own doctor
    other.write_text("defaults:\n  - its_own_base\ntrainer:\n  default_local_dir: s3://b/x\n")
    assert doctor.plan([str(other)]) is None
    assert doctor.plan(["python3", "-m", "verl.trainer.main_ppo"]) is None


def test_a_log_path_spelled_as_a_bucket_is_refused_at_start_up(s3, tmp_path):
    launch, _ = recipe()
    cmd = [*here(launch, s3.root), f"runner.logger.log_path={s3.root}/logs"]
    r = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, **s3.env},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert f"runner.logger.log_path is the bucket URI {s3.root}/logs" in r.stderr
    assert "set runner.logger.log_path to a local directory" in r.stderr
    assert "ConfigError" in r.stderr and scheme_named(tmp_path) == []
    assert not list_checkpoints(s3.root, s3.options, include_uncommitted=True)


def test_derived_paths_move_and_spelled_ones_stay_or_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.create({
        "runner": {"output_dir": "s3://b/r", "experiment_name": "e", "resume_dir": "auto",
                   "logger": {"log_path": "${runner.output_dir}/${runner.experiment_name}"}},
        "cluster": {"profiling": {"output_dir": "${runner.logger.log_path}/prof"}},
        "actor": {"save_path": "${runner.output_dir}/converted", "model": "/models/m"}})
    moved = localpaths.localise(cfg)
    assert [m.key for m in moved] == ["runner.logger.log_path", "actor.save_path"]
    assert cfg.runner.logger.log_path == f"{tmp_path}/cloudckpt-local/b/r/e"
    assert cfg.cluster.profiling.output_dir == f"{tmp_path}/cloudckpt-local/b/r/e/prof"
    assert cfg.actor.save_path == f"{tmp_path}/cloudckpt-local/b/r/converted"
    assert (cfg.runner.output_dir, cfg.runner.resume_dir) == ("s3://b/r", "auto")

    cfg.runner.logger.log_path = "./logs"  # spelled local: stays
    assert localpaths.localise(cfg) == [] and cfg.runner.logger.log_path == "./logs"
    cfg.runner.logger.log_path = "gs://b/logs"
    with pytest.raises(ConfigError, match="runner.logger.log_path is the bucket URI gs://"):
        localpaths.localise(cfg)
