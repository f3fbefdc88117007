"""verl's doctor (cloudckpt.integrations.verl.doctor) on verl 0.9.1's own hydra config:
the launch forms a verl user types, every path it lists, what activation refuses (and
that activation refuses the same at the trainer's start), all without importing torch
or verl and without writing a file. The one-key recipe's doctor runs are in
test_verl_onekey.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from onekey import package_dir

from cloudckpt.cli import main
from cloudckpt.errors import EXIT_USAGE
from cloudckpt.integrations.verl.doctor import plan

HERE = Path(__file__).resolve().parent
PPO = ["python3", "-m", "verl.trainer.main_ppo"]


def uses(command: list[str]) -> dict:
    found = plan(command)
    assert found is not None
    return {u.key: u for u in found.uses}


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_other_commands_are_not_verls():
    assert plan(["python3", "-m", "areal.launcher.local", "train.py"]) is None
    assert plan(["torchrun", "train.py", "trainer.default_local_dir=s3://b/r"]) is None


def test_every_path_of_a_ppo_launch_with_and_without_cloudckpt_run(cwd, capsys):
    got = uses([*PPO, "trainer.default_local_dir=s3://b/run", "trainer.validation_data_dir=val",
                "trainer.logger=[console,tensorboard]", "hydra.run.dir=hydra-out"])
    ckpt = got["trainer.default_local_dir"]
    assert ckpt.lands.startswith("s3://b/run/global_step_N")
    assert ckpt.unlaunched == f"{cwd}/s3:/b/run" and ckpt.problem is None
    assert got["trainer.default_hdfs_dir"].value is None
    assert got["trainer.rollout_data_dir"].lands == "(unset: not written)"
    assert got["trainer.validation_data_dir"].lands == f"{cwd}/val"
    assert got["trainer.logger: tensorboard ($TENSORBOARD_DIR)"].lands == \
        f"{cwd}/tensorboard_log/verl_examples/gsm8k"
    assert got["hydra.run.dir"].lands == f"{cwd}/hydra-out"
    assert "global_profiler.save_path" not in got  # no profiler tool: nothing written
    assert main(["doctor", "--", *PPO, "trainer.default_local_dir=s3://b/run"]) == EXIT_USAGE
    assert main(["run", "--check", "--", *PPO, "trainer.default_local_dir=s3://b/run"]) == 0
    assert not list(cwd.iterdir())


def test_a_local_run_is_verls_own_and_fine(cwd):
    got = uses([*PPO])
    assert got["trainer.default_local_dir"].lands.startswith(
        f"{cwd}/checkpoints/verl_examples/gsm8k (verl's own")
    assert main(["doctor", "--", *PPO]) == 0


def test_a_config_of_the_users_by_config_path_and_name_and_as_a_file(cwd, capsys):
    """verl's examples' form: their own YAML whose defaults are verl's ppo_trainer, with
    verl's config directory on hydra's search path; and the YAML alone."""
    packaged = package_dir("verl") / "trainer" / "config"
    (cwd / "conf").mkdir()
    (cwd / "conf" / "my_ppo.yaml").write_text(
        f"hydra:\n  searchpath:\n    - file://{packaged}\n"
        "defaults:\n  - ppo_trainer\n  - _self_\n"
        "trainer:\n  default_local_dir: gs://b/run\n  rollout_data_dir: s3://b/run/rollouts\n")
    for command in ([*PPO, f"--config-path={cwd}/conf", "--config-name", "my_ppo"],
                    [str(cwd / "conf" / "my_ppo.yaml")]):
        got = uses(command)
        assert got["trainer.default_local_dir"].value == "gs://b/run"
        rollouts = got["trainer.rollout_data_dir"]
        assert rollouts.unlaunched == f"{cwd}/s3:/b/run/rollouts"
        assert "set trainer.rollout_data_dir to a local path, e.g. trainer.rollout_data_dir=" \
               "cloudckpt-local/b/run/rollouts" in rollouts.problem
    assert main(["run", "--check", "--", str(cwd / "conf" / "my_ppo.yaml")]) == EXIT_USAGE
    assert "REFUSED: verl writes its rollout dumps" in capsys.readouterr().out
    assert sorted(p.name for p in cwd.iterdir()) == ["conf"]


@pytest.mark.parametrize("command, refused", [
    (["torchrun", "--nproc_per_node", "2", "-m", "verl.trainer.sft_trainer_ray",
      "trainer.default_local_dir=s3://b/sft"], "launch the torchrun one"),
    ([*PPO, "trainer.default_local_dir=s3://b/r", "trainer.v1.trainer_mode=colocate_async"],
     "set trainer.v1.trainer_mode=sync"),
    ([*PPO, "trainer.default_local_dir=s3://b/r", "trainer.default_hdfs_dir=s3://b/h"],
     "set one of them"),
    ([*PPO, "+global_profiler.tool=torch", "global_profiler.save_path=s3://b/prof"],
     "set global_profiler.save_path to a local path"),
])
def test_what_activation_refuses_the_doctor_refuses(cwd, capsys, command, refused):
    assert main(["run", "--check", "--", *command]) == EXIT_USAGE
    assert refused in capsys.readouterr().err


def test_the_sft_trainer_script_path_and_its_keys(cwd):
    script = str(package_dir("verl") / "trainer" / "sft_trainer.py")
    found = plan(["torchrun", "--nproc-per-node=2", script, "trainer.default_hdfs_dir=s3://b/h"])
    assert found is not None and "the SFT trainer" in found.found_by
    got = {u.key: u for u in found.uses}
    assert got["trainer.default_local_dir"].value == "checkpoints/gsm8k-sft/test"
    assert got["trainer.default_hdfs_dir"].lands.startswith("s3://b/h/global_step_N")
    assert "trainer.rollout_data_dir" not in got


def test_the_doctor_imports_neither_torch_nor_verl(tmp_path):
    r = subprocess.run([sys.executable, "-c", (
        "import sys, json; from cloudckpt.integrations.verl.doctor import plan; "
        "plan(['python3', '-m', 'verl.trainer.main_ppo', 'trainer.default_local_dir=s3://b/r']); "
        "print(json.dumps([m for m in ('torch', 'verl', 'ray') if m in sys.modules]))")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout) == []


START = """
import sys
sys.path.insert(0, sys.argv[1])
from verl_parts import trainer_for
trainer_for(sys.argv[2], 0, rollout_data_dir="s3://b/run/rollouts")._load_checkpoint()
"""


def test_activation_refuses_it_at_the_trainers_start(tmp_path):
    """The bound ``_load_checkpoint`` (run first by verl's ``fit``) refuses a bucket
    ``rollout_data_dir`` before anything is loaded or written."""
    r = subprocess.run([sys.executable, "-m", "cloudckpt", "run", "--", sys.executable, "-c",
                        START, str(HERE), "ckpts"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={**os.environ})
    assert r.returncode != 0
    assert "ConfigError: verl writes its rollout dumps (JSONL, each logged step) at " \
           "trainer.rollout_data_dir with local file calls" in r.stderr
    assert not list(tmp_path.iterdir())
