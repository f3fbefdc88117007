"""ROLL configured by one key, as its guide's recipe says (docs/integrations/roll.md: the
YAML block and the launch line are read from there): ``checkpoint_config.output_dir`` on
S3 with ROLL's own ``file_system`` type, launched as ``cloudckpt run -- python
examples/start_rlvr_pipeline.py ...`` (no ``--integration``, no count). ROLL's
workers under a local Ray (roll_examples/start_rlvr_pipeline.py, in the shape of ROLL's
start script and pipeline) save, are SIGKILLed mid-save, come back by themselves and
go on bit-exact with ROLL's own run that never stopped; nothing under the working
directory is named for a scheme and ROLL's files hash the same.

Then: a checkpoint whose rank never uploads never commits and is an ERROR at the next
save and at exit; a critic beside the actor holds the first checkpoints back until its
part is in; and the forgotten launcher, caught by ``cloudckpt doctor``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from onekey import guide_block, launch_lines, run_guide_script, scheme_named, unchanged
from test_relaunch import kill_mid_save, node_disks, on_node, run_node
from test_roll_ray import ROLL_SRC

from cloudckpt import list_checkpoints, open_checkpoint
from cloudckpt.errors import EXIT_USAGE

pytestmark = pytest.mark.timeout(900)

HERE = Path(__file__).resolve().parent
GUIDE = HERE.parents[1] / "docs" / "integrations" / "roll.md"
START = HERE / "roll_examples" / "start_rlvr_pipeline.py"
#: The bucket URI the guide's recipe names, replaced by the test's.
GUIDE_URI = "s3://my-bucket/roll"
#: What the recipe leaves to the user's existing ROLL config: the run's own keys.
RUN_KEYS = """\
exp_name: onekey
max_steps: 5
save_steps: 1
actor_train:
  device_mapping: list(range(0,2))
"""


def guide_recipe() -> tuple[str, list[str]]:
    """The recipe's YAML block and its launch line (after ``cloudckpt run --``)."""
    launch = launch_lines(GUIDE, after="The shortest recipe")
    assert launch and launch[0][3:5] == ["python", "examples/start_rlvr_pipeline.py"], launch
    return guide_block(GUIDE, "yaml", after="The shortest recipe"), launch[0][3:]


def project(tmp: Path, checkpoint_block: str, extra: str = "") -> list[str]:
    """A ROLL checkout's examples/ under ``tmp`` with the recipe's config; returns the
    usual launch (python examples/start_....py --config_path ... --config_name ...)."""
    _, launch = guide_recipe()
    opts = dict(zip(launch[2::2], launch[3::2], strict=False))
    examples = tmp / "examples"
    (examples / opts["--config_path"]).mkdir(parents=True, exist_ok=True)
    shutil.copy(START, examples / Path(launch[1]).name)
    (examples / opts["--config_path"] / f"{opts['--config_name']}.yaml").write_text(
        RUN_KEYS + extra + checkpoint_block)
    return [sys.executable, *launch[1:]]


def cloudckpt_run(command: list[str]) -> list[str]:
    return [sys.executable, "-m", "cloudckpt", "run", "--", *command]


def node(command: list[str], disks: Path, host: str, env: dict[str, str]):
    """The launch on node ``host``, with ROLL's source and the test's helpers importable."""
    return lambda more: on_node(command, disks, host, {**env, **more}, (ROLL_SRC,),
                                run=False)


def saved(cwd: Path) -> dict[int, list[dict]]:
    run = json.loads((cwd / "output" / "run.json").read_text())
    return {s["step"]: s["digests"] for s in run["saved"]}


@pytest.fixture(scope="module")
def roll_reference(tmp_path_factory) -> dict[int, list[dict]]:
    """ROLL's own run that never stopped: its file_system uploader, a local directory."""
    tmp = tmp_path_factory.mktemp("roll-onekey-reference")
    block = f"checkpoint_config:\n  type: file_system\n  output_dir: {tmp / 'uploaded'}\n"
    launch = project(tmp, block)
    with node_disks() as disks:
        run_node(node(launch, disks, "node-r", {}), tmp, {}, "reference")
    (stamped,) = (tmp / "uploaded").iterdir()  # ROLL's timestamp, appended
    assert sorted(p.name for p in stamped.iterdir()) == [f"checkpoint-{s}" for s in (1, 2, 3, 4)]
    return saved(tmp)


def test_one_key_run_is_killed_and_comes_back_bit_exact(s3, moto_server, tmp_path,
                                                         roll_reference, hub_server):
    block, _ = guide_recipe()
    assert "expected_uploads" not in block
    assert not re.search(r"cloudckpt run [^\n]*--integration", GUIDE.read_text())
    launch = cloudckpt_run(project(tmp_path, block.replace(GUIDE_URI, s3.root)))
    uri = f"{s3.root}/onekey"  # ${exp_name}, resolved; no timestamp
    with unchanged("roll"), node_disks() as disks:
        killed = node(launch, disks, "node-a", s3.env)
        kill_mid_save(killed, tmp_path, moto_server,
                      "/checkpoint-3/_cloudckpt_parts/pipeline.json")
        assert [c.name for c in list_checkpoints(uri, s3.options)] == \
            ["checkpoint-1", "checkpoint-2"]
        log = run_node(node(launch, disks, "node-b", s3.env), tmp_path, {}, "relaunch")
    run = json.loads((tmp_path / "output" / "run.json").read_text())
    assert run["resumed_at"] == 2
    again = saved(tmp_path)
    assert sorted(again) == [3, 4]
    assert all(again[s] == roll_reference[s] for s in (3, 4))  # bit-exact
    assert "bound the roll integration into roll" in log.text
    assert "uploader_registry['file_system'] (bucket URIs)" in log.text
    assert [c.name for c in list_checkpoints(uri, s3.options)] == \
        [f"checkpoint-{s}" for s in (1, 2, 3, 4)]
    step3 = open_checkpoint(f"{uri}/checkpoint-3", s3.options)
    step3.verify(deep=True)
    assert step3.metadata["parts"] == ["actor_train-0", "actor_train-1", "pipeline"]
    assert {"dcp/.metadata", "pipeline/worker_state_pipeline.json"} <= set(step3.files)
    # ROLL's local files stayed where its local keys say; nothing is named for a scheme.
    assert scheme_named(tmp_path) == []
    assert list((tmp_path / "output" / "logs" / "onekey").glob("log_rank_DRIVER_*.log"))
    assert list((tmp_path / "output" / "onekey").iterdir())  # the tensorboard directory
    push_as_the_guide_says(uri, s3.env, tmp_path / "hub", hub_server)


def push_as_the_guide_says(uri: str, env: dict[str, str], cwd: Path, hub) -> None:
    """The guide's Hub push of the newest checkpoint, run as written: the HF files of
    rank 0 reach the Hub, none of ROLL's own state."""
    run_guide_script(guide_block(GUIDE, "bash", containing="hf upload").replace(
        "s3://my-bucket/roll/my_exp", uri), cwd, env)
    pushed = hub.files("my-org/my-model")
    assert set(pushed) - {".gitattributes"} == {"config.json", "model.safetensors"}, \
        sorted(pushed)  # the Hub's own .gitattributes, from the repo's creation
    fetched = cwd / "ckpt" / "checkpoint-4"
    assert pushed["model.safetensors"] == (fetched / "model.safetensors").read_bytes()


def test_a_checkpoint_missing_a_rank_never_commits_and_is_reported(s3, tmp_path):
    """Rank 1 of ROLL's actor never uploads checkpoint-1 (as if it died first): the
    checkpoint stays invisible, the next save and the driver's exit name it and the
    missing rank, and the later checkpoints commit by themselves."""
    block, _ = guide_recipe()
    block = block.replace(GUIDE_URI, s3.root).replace("resume_from_checkpoint: true",
                                                      "resume_from_checkpoint: false")
    launch = cloudckpt_run(project(tmp_path, block))
    config = next((tmp_path / "examples").rglob("*.yaml"))
    config.write_text(config.read_text().replace(
        "checkpoint_config:\n", "checkpoint_config:\n  parts_timeout: 2\n  async_upload: false\n"))
    uri = f"{s3.root}/onekey"
    with node_disks() as disks:
        out = run_node(node(launch, disks, "node-a", s3.env), tmp_path,
                       {"ROLL_TEST_LOST_PART": "checkpoint-1:actor_train-1",
                        "ROLL_TEST_STEP_PAUSE": "3"}, "lost")
    assert [c.name for c in list_checkpoints(uri, s3.options)] == \
        ["checkpoint-2", "checkpoint-3", "checkpoint-4"]
    errors = [line for line in out.text.splitlines() if "ERROR" in line]
    at_save = [e for e in errors if "checkpoint-1 was NOT committed" in e]
    assert at_save and all("1 of 2 ranks of actor_train (actor_train-1)" in e
                           for e in at_save), errors
    at_exit = [e for e in errors if "at exit: checkpoint-1 never committed" in e]
    assert at_exit and all("actor_train-1" in e for e in at_exit)
    # Reported at the next save: before checkpoint-2 was committed.
    lines = out.text.splitlines()
    first_error = next(i for i, line in enumerate(lines) if "checkpoint-1 was NOT" in line)
    assert any(f"committed {uri}/checkpoint-2" in line for line in lines[first_error:])


def test_a_critic_that_uploads_late_or_never_holds_its_checkpoint_back(s3, tmp_path):
    """A job with two checkpoint clusters (the actor of 2 ranks and a critic of 1), a new
    output directory: nothing was committed there before. The critic's part of
    checkpoint-1 never comes (as if it died first): checkpoint-1 is never committed and
    is an ERROR naming the critic at the next save and at exit. The critic's part of
    checkpoint-2 comes only after the pipeline's and the actor's are all in (ROLL's
    async DCP save, its upload from the done-callback): checkpoint-2 is committed once
    the critic's part is in, never without it. ROLL's pipeline names its checkpoint
    clusters; nobody gives a count."""
    block, _ = guide_recipe()
    block = block.replace(GUIDE_URI, s3.root).replace("resume_from_checkpoint: true",
                                                      "resume_from_checkpoint: false")
    launch = cloudckpt_run(project(tmp_path, block,
                                   "critic:\n  device_mapping: list(range(0,1))\n"))
    config = next((tmp_path / "examples").rglob("*.yaml"))
    # The pipeline's part uploads synchronously: a late critic is surely later than it.
    config.write_text(config.read_text().replace("max_steps: 5", "max_steps: 4").replace(
        "checkpoint_config:\n", "checkpoint_config:\n  parts_timeout: 2\n  async_upload: false\n"))
    uri = f"{s3.root}/onekey"
    with node_disks() as disks:
        out = run_node(node(launch, disks, "node-a", s3.env), tmp_path,
                       {"ROLL_TEST_LOST_PART": "checkpoint-1:critic-0",
                        "ROLL_TEST_LATE_PART": "checkpoint-2:critic-0",
                        "ROLL_TEST_STEP_PAUSE": "3"}, "critic")
    assert [c.name for c in list_checkpoints(uri, s3.options)] == \
        ["checkpoint-2", "checkpoint-3"]
    step2 = open_checkpoint(f"{uri}/checkpoint-2", s3.options)
    step2.verify(deep=True)
    assert step2.metadata["parts"] == ["actor_train-0", "actor_train-1", "critic-0", "pipeline"]
    assert step2.metadata["clusters"] == {"actor_train": 2, "critic": 1}
    assert {"dcp/.metadata", "critic/dcp/.metadata", "critic/dcp/__0_0.distcp",
            "pipeline/worker_state_pipeline.json"} <= set(step2.files)
    errors = [line for line in out.text.splitlines() if "ERROR:cloudckpt" in line]
    assert errors and all("checkpoint-1" in e for e in errors), errors  # none of step 2
    at_save = [e for e in errors if "checkpoint-1 was NOT committed" in e]
    assert at_save and all("every part of critic (1 rank" in e for e in at_save), errors
    at_exit = [e for e in errors if "at exit: checkpoint-1 never committed" in e]
    assert at_exit and all("critic" in e for e in at_exit), errors


def test_the_forgotten_launcher_is_caught_by_the_doctor(s3, tmp_path):
    block, _ = guide_recipe()
    launch = project(tmp_path, block.replace(GUIDE_URI, s3.root))
    command = ["python", *launch[1:]]
    doctor = subprocess.run([sys.executable, "-m", "cloudckpt", "doctor", "--", *command],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert doctor.returncode == EXIT_USAGE, doctor.stderr
    assert f"without `cloudckpt run`: {tmp_path}/s3:/" in doctor.stdout
    assert "cloudckpt run -- python examples/start_rlvr_pipeline.py" in doctor.stderr
    check = subprocess.run([sys.executable, "-m", "cloudckpt", "run", "--check", "--",
                            *command], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0, check.stderr
    assert f"checkpoints: {s3.root}/onekey/checkpoint-N" in check.stdout
    assert f"logs: {tmp_path}/output/logs/onekey" in check.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["examples"]  # wrote nothing


def test_a_bucket_where_roll_writes_locally_is_refused_at_start_up(s3, tmp_path):
    """ROLL's own output_dir on a bucket (its local staging, its tensorboard directory):
    the launch stops before Ray starts, naming the key to set; and the doctor reads a
    ROLL config file alone the same way."""
    block, _ = guide_recipe()
    launch = cloudckpt_run(project(tmp_path, block.replace(GUIDE_URI, s3.root),
                                   f"output_dir: {s3.root}/local-things\n"))
    env = {**os.environ, **s3.env, "PYTHONPATH": os.pathsep.join(
        [str(ROLL_SRC), str(HERE), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(launch, cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0
    assert "ConfigError: ROLL cannot run this launch on a bucket: output_dir:" in r.stderr
    assert f"put the bucket in checkpoint_config.output_dir: {s3.root}/local-things" in r.stderr
    assert "RollRank" not in r.stdout + r.stderr  # stopped before any worker started
    assert scheme_named(tmp_path) == []
    config = next((tmp_path / "examples").rglob("*.yaml"))
    doctor = subprocess.run([sys.executable, "-m", "cloudckpt", "doctor", "--", str(config)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert doctor.returncode == EXIT_USAGE
    assert "roll, recognised by the config file rlvr_config.yaml" in doctor.stdout
    assert "REFUSED: ROLL writes its output_dir with local file calls" in doctor.stdout
