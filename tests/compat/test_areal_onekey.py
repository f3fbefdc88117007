"""AReaL configured by one key, its own ``cluster.fileroot``, on a bucket: the recipe
of docs/integrations/areal.md, run with AReaL 1.0.4's own ``SFTTrainer`` (areal_sft/).

The guide's YAML block is layered over the example config (hydra ``defaults``, as AReaL
composes it) with its bucket replaced by moto's; the launch is AReaL's usual torchrun
line behind ``cloudckpt run --``, no other key, variable or option. Killed once a recover
dump of the second epoch is in the bucket, relaunched, it ends bit-exact with AReaL's
own uninterrupted run; AReaL's local files land under ``local_dir_for(fileroot)``,
nothing under the working directory is named ``s3:``, and AReaL's files are unchanged.
The doctor says all this of the same command before it runs, and what a launch without
``cloudckpt run`` would do."""

from __future__ import annotations

import getpass
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from onekey import guide_block, run_guide_script, scheme_named, unchanged
from test_areal_trainer import (
    BOUND_AT_CONFIG,
    SFT,
    STEPS,
    TRIAL,
    Launch,
    assert_export_equal,
    assert_recover_equal,
    bound_lines,
    kill_in_second_epoch,
    last_export,
    make_fixtures,
    reference_trial,
    steps_done,
)

from cloudckpt import open_store
from cloudckpt.cli import main as cloudckpt_cli
from cloudckpt.errors import EXIT_USAGE
from cloudckpt.runtime.localdirs import local_dir_for
from cloudckpt.training.slot import RecoverSlot

# Whole framework jobs: minutes each on a busy machine.
pytestmark = pytest.mark.timeout(900)

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "integrations" / "areal.md"
GUIDE_BUCKET = "s3://my-bucket/experiments"
WORLD = 2


def recipe_yaml() -> str:
    """The guide's recipe: its YAML block."""
    block = guide_block(GUIDE, "yaml", after="The recipe")
    assert "cluster:" in block and GUIDE_BUCKET in block
    return block


def user_config(where: Path, fileroot: str) -> Path:
    """The user's config: the example's, with the guide's block (its bucket ``fileroot``)
    over it, composed by AReaL's hydra as one file would be."""
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy(SFT / "config.yaml", where / "example.yaml")
    config = where / "config.yaml"
    config.write_text("defaults:\n  - example\n  - _self_\n\n"
                      + recipe_yaml().replace(GUIDE_BUCKET, fileroot))
    return config


def usual_command(fixtures: dict[str, str], config: Path, workdir: Path) -> list[str]:
    """AReaL's usual SPMD launch (torchrun train.py --config ...), with the fixtures'
    paths and the test's run length: ``cluster.fileroot`` comes from the config alone."""
    cmd = [w for w in Launch(fixtures, workdir, WORLD, bucket=None, env={}).command
           if not w.startswith("cluster.fileroot=")]
    cmd[cmd.index("--config") + 1] = str(config)
    return cmd


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict[str, str]:
    return make_fixtures(tmp_path_factory.mktemp("areal-fixtures"))


def test_the_recipe_killed_and_relaunched_resumes_bit_exact(fixtures, s3, tmp_path,
                                                           tmp_path_factory, hub_server):
    bucket = f"{s3.root}/experiments"
    work = tmp_path / "work"
    config = user_config(tmp_path / "conf", bucket)
    launch = Launch(fixtures, work, WORLD, bucket=None, env=s3.env)
    launch.command = [sys.executable, "-m", "cloudckpt", "run", "--",
                      *usual_command(fixtures, config, work)]
    work.mkdir()
    slot = RecoverSlot(f"{bucket}/{TRIAL}", storage_options=s3.options)

    with unchanged("areal"):
        killed, dumped = kill_in_second_epoch(launch, slot, tmp_path / "killed.log")
        # Every rank bound the config and the trainers, and said where the paths go.
        assert bound_lines(killed) == [BOUND_AT_CONFIG] * WORLD
        assert f"recover.fileroot={bucket}" in killed

        log = launch.run(tmp_path / "resumed.log")
        done = steps_done(log)
        assert done[0] == dumped + 2 and done[-1] == STEPS, (dumped, done)

        ref_trial = reference_trial(fixtures, tmp_path_factory.mktemp("areal-ref"), WORLD)

    # Bit-exact with AReaL's own uninterrupted run: the last dump and the last export.
    assert_recover_equal(slot, s3, ref_trial, tmp_path)
    ref_export = last_export(ref_trial)
    assert_export_equal(f"{bucket}/{TRIAL}/default/{ref_export.name}", s3, ref_export)

    # The guide's Hub push of an export, as written: the export's files on the Hub.
    (line,) = re.findall(r"`(cloudckpt push \S+ \S+)`", GUIDE.read_text())
    user, experiment, trial = TRIAL.split("/")[1:]
    line = re.sub(r"default/epoch\w+", f"default/{ref_export.name}", line.replace(
        GUIDE_BUCKET, bucket).replace("<user>", user).replace("<experiment>", experiment)
        .replace("<trial>", trial))
    run_guide_script(line, tmp_path / "hub", s3.env)
    pushed = hub_server.files("my-org/my-model")
    export = open_store(f"{bucket}/{TRIAL}/default/{ref_export.name}", s3.options)
    weights = [p.name for p in ref_export.glob("*.safetensors")]
    assert weights and {"config.json", *weights} <= pushed.keys()
    assert all(pushed[name] == export.get(name) for name in weights)

    # AReaL's local files under the directory named for the bucket, nothing named s3:.
    local = Path(local_dir_for(bucket, cwd=str(work), environ={}))
    logs = local / "logs" / getpass.getuser() / "gsm8k-sft-cpu" / "trial0"
    saved = (logs / "config.yaml").read_text()
    assert f"fileroot: {bucket}" in saved and f"fileroot: {local}" in saved
    assert (local / "name_resolve").is_dir()
    assert not list(local.rglob("recover_info"))  # the checkpoints are in the bucket
    assert scheme_named(work) == []


def test_the_doctor_names_the_forgotten_launcher_and_passes_cloudckpt_run(
        fixtures, tmp_path, monkeypatch, capsys):
    config = user_config(tmp_path / "conf", GUIDE_BUCKET)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    command = usual_command(fixtures, config, work)

    assert cloudckpt_cli(["doctor", "--", *command]) == EXIT_USAGE
    out, err = capsys.readouterr()
    trial = f"checkpoints/{getpass.getuser()}/gsm8k-sft-cpu/trial0"
    assert f"without `cloudckpt run`: {work}/s3:/my-bucket/experiments/{trial}" in out
    assert "nothing written there reaches the bucket" in err
    assert "launch it as `cloudckpt run --" in err

    assert cloudckpt_cli(["run", "--check", "--", *command]) == 0
    out = capsys.readouterr().out
    assert f"recover dumps (RecoverHandler): {GUIDE_BUCKET}/{trial}" in out
    assert f"HF exports (Saver): {GUIDE_BUCKET}/{trial}" in out
    local = local_dir_for(GUIDE_BUCKET)
    assert f"{local}/logs/{getpass.getuser()}/gsm8k-sft-cpu/trial0" in out
    assert f"name-resolve records: {local}/name_resolve" in out
    assert "without" not in out
    assert list(work.iterdir()) == []  # the doctor writes nothing


def test_a_bucket_it_cannot_place_is_refused_by_the_doctor_and_at_start_up(
        fixtures, s3, tmp_path, monkeypatch, capsys):
    """Name-resolve records written as a bucket URI of their own: refused before any
    training, with the key to set, by the doctor and by the activated launch."""
    config = user_config(tmp_path / "conf", f"{s3.root}/experiments")
    work = tmp_path / "work"
    work.mkdir()
    nfs = f"cluster.name_resolve.nfs_record_root={s3.root}/names"
    command = [*usual_command(fixtures, config, work), nfs]

    monkeypatch.chdir(work)
    assert cloudckpt_cli(["run", "--check", "--", *command]) == EXIT_USAGE
    assert "set cluster.name_resolve.nfs_record_root to a local" in capsys.readouterr().err

    launch = Launch(fixtures, work, 1, bucket=None, env=s3.env)
    script = command.index(str(SFT / "train.py"))
    out = subprocess.run([sys.executable, "-m", "cloudckpt", "run", "--", sys.executable,
                          *command[script:]], env=launch.env, cwd=work, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode != 0
    assert "ConfigError" in out.stderr and \
        "set cluster.name_resolve.nfs_record_root to a local" in out.stderr, out.stderr[-4000:]
    assert scheme_named(work) == []


def composed(tmp_path: Path, text: str, overrides: list[str] = ()):
    """A config composed by hydra as AReaL's ``parse_cli_args`` composes it."""
    from cloudckpt.integrations.areal.doctor import compose

    (tmp_path / "c.yaml").write_text(text)
    return compose(str(tmp_path / "c.yaml"), list(overrides))


SECTIONS = """
cluster:
  fileroot: {root}
saver:
  fileroot: ${{cluster.fileroot}}
recover:
  mode: {mode}
  fileroot: ${{cluster.fileroot}}
stats_logger:
  fileroot: ${{cluster.fileroot}}
"""


@pytest.mark.parametrize("mode, want", [("on", "on"), ("off", "off"), ("auto", "auto"),
                                        ("disabled", "disabled")])
def test_recover_mode_is_never_changed_but_a_bare_on_is_read_as_meant(tmp_path, mode, want):
    from omegaconf import OmegaConf

    from cloudckpt.integrations.areal.placement import place

    cfg = composed(tmp_path, SECTIONS.format(root="s3://b/x", mode=mode))
    place(cfg, cwd=str(tmp_path), environ={})
    assert OmegaConf.select(cfg, "recover.mode") == want
    assert OmegaConf.select(cfg, "recover.fileroot") == "s3://b/x"
    assert OmegaConf.select(cfg, "stats_logger.fileroot") == \
        OmegaConf.select(cfg, "cluster.fileroot") == str(tmp_path / "cloudckpt-local/b/x")


def test_a_local_config_is_left_as_it_is(tmp_path):
    from omegaconf import OmegaConf

    from cloudckpt.integrations.areal.placement import place

    cfg = composed(tmp_path, SECTIONS.format(root=str(tmp_path / "root"), mode="on"))
    before = OmegaConf.to_container(cfg, resolve=False)
    place(cfg, cwd=str(tmp_path), environ={})
    assert OmegaConf.to_container(cfg, resolve=False) == before
    assert before["recover"]["mode"] is True  # AReaL's own refusal stays AReaL's
    assert list(tmp_path.iterdir()) == [tmp_path / "c.yaml"]


def test_a_bucket_written_for_the_logs_alone_gets_a_local_directory(tmp_path):
    from omegaconf import OmegaConf

    from cloudckpt.integrations.areal.placement import place

    cfg = composed(tmp_path, SECTIONS.format(root=str(tmp_path / "root"), mode="auto"),
                   ["saver.fileroot=gs://g/s", "stats_logger.fileroot=gs://g/logs"])
    place(cfg, cwd=str(tmp_path), environ={})
    assert OmegaConf.select(cfg, "saver.fileroot") == "gs://g/s"
    assert OmegaConf.select(cfg, "stats_logger.fileroot") == \
        str(tmp_path / "cloudckpt-local/g/logs")
    assert OmegaConf.select(cfg, "recover.fileroot") == str(tmp_path / "root")


def test_the_doctor_knows_areal_launches_from_others(tmp_path):
    from cloudckpt.integrations.areal.doctor import plan

    config = user_config(tmp_path / "conf", GUIDE_BUCKET)
    for launch in (["python", "-m", "areal.infra.launcher.local", "train.py", "--config",
                    str(config)],
                   ["torchrun", "--nproc-per-node", "8", "train.py", f"--config={config}"],
                   [str(config)]):
        found = plan(launch)
        assert found is not None and found.framework == "areal", launch
        assert {u.key for u in found.forgotten} >= {"cluster.fileroot", "saver.fileroot",
                                                    "recover.fileroot"}
    (tmp_path / "verl.yaml").write_text("trainer:\n  default_local_dir: s3://b/r\n")
    for other in (["python3", "-m", "verl.trainer.main_ppo", "trainer.total_epochs=1"],
                  ["python", "train.py", "--config", str(tmp_path / "verl.yaml")],
                  [str(tmp_path / "verl.yaml")]):
        assert plan(other) is None, other


@pytest.mark.parametrize("resolver, refused", [("nfs", True), ("etcd3", False)])
def test_name_resolve_files_on_a_bucket_derived_path_are_refused_on_several_nodes(
        tmp_path, resolver, refused):
    """Derived from a bucket ``cluster.fileroot``, the name-resolve root is a local
    directory: one node's processes share it, several nodes' cannot."""
    from cloudckpt.integrations.areal.placement import NFS_ROOT, plan

    cfg = composed(tmp_path, SECTIONS.format(root="s3://b/x", mode="on"),
                   [f"+cluster.name_resolve.type={resolver}",  # as AReaL's examples write
                    "+cluster.name_resolve.nfs_record_root=${cluster.fileroot}/name_resolve"])
    one_node = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}
    two_nodes = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    (alone,) = [p for p in plan(cfg, environ=one_node, cwd=str(tmp_path)) if p.key == NFS_ROOT]
    assert alone.problem is None, alone
    assert alone.lands == f"{tmp_path}/cloudckpt-local/b/x/name_resolve"
    (shared,) = [p for p in plan(cfg, environ=two_nodes, cwd=str(tmp_path))
                 if p.key == NFS_ROOT]
    if refused:
        assert "this job runs on 2 nodes" in shared.problem
        assert "set it to a shared (NFS) directory" in shared.problem
    else:
        assert shared.problem is None
