"""``cloudckpt doctor`` and ``cloudckpt run --check``: the plumbing every framework's
doctor answers through (each framework's own doctor is tested in tests/compat, on the
framework's own config code), and where a bucket output key's local files go."""

from __future__ import annotations

import json
import sys
import types

import pytest

from cloudckpt.cli import main
from cloudckpt.cli.doctor import split_launcher
from cloudckpt.core import plugins
from cloudckpt.core.launchplan import LaunchPlan, PathUse, unlaunched
from cloudckpt.errors import EXIT_USAGE
from cloudckpt.runtime.localdirs import ENV_LOCAL_DIR, local_dir_for


@pytest.fixture
def toy(monkeypatch):
    """A framework whose launches are ``toytrain OUT=...``: OUT holds checkpoints, and
    LOG (if given) logs, which it refuses on a bucket."""

    def doctor(command):
        if "toytrain" not in command[0]:
            return None
        keys = dict(w.split("=", 1) for w in command[1:] if "=" in w)
        out = keys.get("OUT", "out")
        uses = [PathUse("OUT", out, "checkpoints", out,
                        unlaunched=unlaunched(out) if "://" in out else None)]
        if "LOG" in keys:
            uses.append(PathUse("LOG", keys["LOG"], "logs", keys["LOG"],
                                problem="logs go to a local path: set LOG=./logs"
                                if "://" in keys["LOG"] else None))
        return LaunchPlan("toy", "the command line: toytrain", tuple(uses))

    module = types.ModuleType("cloudckpt_toy_doctor")
    module.doctor = doctor
    monkeypatch.setitem(sys.modules, module.__name__, module)
    plugins.frameworks()
    monkeypatch.setitem(plugins._registered, "toy", plugins.Framework(
        name="toy", doctor=f"{module.__name__}:doctor"))


@pytest.mark.parametrize("command, rest, launched", [
    (["toytrain", "OUT=x"], ["toytrain", "OUT=x"], False),
    (["--", "toytrain"], ["toytrain"], False),
    (["cloudckpt", "run", "--", "toytrain"], ["toytrain"], True),
    (["/usr/bin/cloudckpt", "run", "--run-id", "r", "--", "toytrain"], ["toytrain"], True),
    (["python3", "-m", "cloudckpt", "run", "--", "toytrain"], ["toytrain"], True),
])
def test_the_launcher_is_told_apart_from_the_command(command, rest, launched):
    assert split_launcher(command) == (rest, launched)


def test_a_launch_under_cloudckpt_run_is_fine(toy, capsys):
    assert main(["doctor", "--", "cloudckpt", "run", "--", "toytrain", "OUT=s3://b/r"]) == 0
    out = capsys.readouterr().out
    assert "toy, recognised by the command line" in out
    assert "checkpoints: s3://b/r" in out and "without" not in out


def test_the_forgotten_launcher_is_named_with_its_symptom(toy, capsys, tmp_path,
                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["doctor", "--", "toytrain", "OUT=s3://b/r"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert f"without `cloudckpt run`: {tmp_path}/s3:/b/r" in captured.out
    assert "nothing written there reaches the bucket" in captured.err
    assert "cloudckpt run -- toytrain OUT=s3://b/r" in captured.err
    assert not list(tmp_path.iterdir())  # the doctor itself writes nothing


def test_run_check_refuses_what_activation_would_refuse_and_runs_nothing(toy, capsys):
    assert main(["run", "--check", "--", "toytrain", "OUT=s3://b/r", "LOG=s3://b/l"]) \
        == EXIT_USAGE
    captured = capsys.readouterr()
    assert "REFUSED: logs go to a local path: set LOG=./logs" in captured.out
    assert "LOG: logs go to a local path" in captured.err


def test_the_plan_as_json(toy, capsys):
    assert main(["doctor", "--json", "--", "cloudckpt", "run", "--", "toytrain",
                 "OUT=gs://b/r"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["framework"] == "toy" and plan["launched"] is True
    assert plan["uses"][0]["lands"] == "gs://b/r"


def test_a_command_no_framework_recognises(toy, capsys):
    assert main(["doctor", "--", "python3", "other.py"]) == EXIT_USAGE
    assert "no framework recognises 'python3 other.py'" in capsys.readouterr().err
    assert main(["doctor", "--framework", "nope", "--", "toytrain"]) == EXIT_USAGE
    assert "no framework named nope" in capsys.readouterr().err


def test_a_buckets_local_files_go_below_a_directory_named_for_it(tmp_path):
    assert local_dir_for("s3://bkt/runs/a/", cwd=str(tmp_path), environ={}) == \
        str(tmp_path / "cloudckpt-local" / "bkt" / "runs" / "a")
    assert local_dir_for("gs://bkt", cwd=str(tmp_path),
                         environ={ENV_LOCAL_DIR: "/scratch/l"}) == "/scratch/l/bkt"
    assert local_dir_for("rel/dir", cwd=str(tmp_path), environ={}) == str(tmp_path / "rel/dir")
    with pytest.raises(ValueError, match="'..' segment"):
        local_dir_for("s3://bkt/../x", environ={})
