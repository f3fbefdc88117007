"""The ``cloudckpt`` command against moto S3 and local disk."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import torn_save

from cloudckpt import CheckpointWriter, open_checkpoint, open_store
from cloudckpt.cli import main


def s3_args(backend) -> list[str]:
    return ["-o", f"endpoint_url={backend.options['endpoint_url']}",
            "-o", f"key={backend.options['key']}", "-o", f"secret={backend.options['secret']}"]


def make(backend, name: str, step: int, n: int = 4) -> dict[str, bytes]:
    objs = {f"part-{i}.bin": os.urandom(3000 + i) for i in range(n)}
    with CheckpointWriter(backend.uri(name), step=step, storage_options=backend.options) as w:
        w.put_many(objs)
    return objs


def run_cli(backend, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **backend.env}
    return subprocess.run([sys.executable, "-m", "cloudckpt", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_verify_deep_names_the_flipped_object(s3):
    objs = make(s3, "step-1", 1)
    ok = run_cli(s3, "verify", "--deep", s3.uri("step-1"))
    assert ok.returncode == 0, ok.stderr
    assert "OK" in ok.stdout and "4 objects" in ok.stdout
    flipped = bytearray(objs["part-2.bin"])
    flipped[7] ^= 0x80
    open_store(s3.uri("step-1"), s3.options).put("part-2.bin", bytes(flipped))
    shallow = run_cli(s3, "verify", s3.uri("step-1"))
    assert shallow.returncode == 0  # sizes still match: only --deep can tell
    bad = run_cli(s3, "verify", "--deep", s3.uri("step-1"))
    assert bad.returncode == 1
    assert "BAD  part-2.bin: crc32c" in bad.stdout
    assert "part-1.bin" not in bad.stdout


def test_ls_info_latest(s3, capsys):
    make(s3, "step-5", 5)
    make(s3, "step-12", 12, n=2)
    torn_save(s3.uri("step-20"), s3.options, {"part-0.bin": b"torn"})
    assert main([*s3_args(s3), "ls", s3.root]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in out[1:]}
    assert rows["step-5"].split()[1] == "5" and rows["step-5"].endswith("committed")
    assert rows["step-20"].endswith("uncommitted (no manifest)")
    assert [line.split()[0] for line in out[1:]] == ["step-5", "step-12", "step-20"]
    assert main([*s3_args(s3), "latest", s3.root]) == 0
    assert capsys.readouterr().out.strip() == s3.uri("step-12")
    assert main([*s3_args(s3), "info", "--json", s3.uri("step-12")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == 12 and sorted(doc["files"]) == ["part-0.bin", "part-1.bin"]
    assert main([*s3_args(s3), "ls", "--json", s3.root]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {d["name"]: d["committed"] for d in listed} == {
        "step-20": False, "step-5": True, "step-12": True}


def test_error_exit_codes(s3, capsys):
    torn_save(s3.uri("torn"), s3.options, {"x": b"x"})
    assert main([*s3_args(s3), "info", s3.uri("missing")]) == 3
    assert "no checkpoint at" in capsys.readouterr().err
    assert main([*s3_args(s3), "info", s3.uri("torn")]) == 4
    assert "no manifest" in capsys.readouterr().err
    assert main([*s3_args(s3), "latest", s3.uri("empty")]) == 3
    assert main(["-o", "nonsense", "ls", s3.root]) == 2
    make(s3, "a", 1)
    make(s3, "b", 2)
    assert main([*s3_args(s3), "cp", s3.uri("a"), s3.uri("b")]) == 5
    assert "different checkpoint" in capsys.readouterr().err


def test_cp_download_rm(s3, tmp_path, capsys):
    objs = make(s3, "step-3", 3)
    assert main([*s3_args(s3), "cp", s3.uri("step-3"), s3.uri("copy", "step-3")]) == 0
    assert open_checkpoint(s3.uri("copy", "step-3"), s3.options).read("part-0.bin") == objs[
        "part-0.bin"]
    dest = tmp_path / "dl"
    assert main([*s3_args(s3), "download", s3.uri("step-3"), str(dest)]) == 0
    for name, data in objs.items():
        assert (dest / name).read_bytes() == data
    assert main(["verify", "--deep", str(dest)]) == 0
    # Downloading again finds the same commit and copies nothing.
    assert main([*s3_args(s3), "download", s3.uri("step-3"), str(dest)]) == 0
    assert main([*s3_args(s3), "rm", s3.uri("step-3")]) == 0
    assert open_store(s3.uri("step-3"), s3.options).list() == []
    torn_save(s3.uri("torn"), s3.options, {"x": b"x"})
    assert main([*s3_args(s3), "rm", s3.uri("torn")]) == 4
    assert main([*s3_args(s3), "rm", "--force", s3.uri("torn")]) == 0


@pytest.mark.parametrize("argv", [["--help"], ["verify", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert "cloudckpt" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["download", "ls", "info", "latest"])
def test_a_misspelt_bucket_is_named_as_missing_by_every_command(s3, tmp_path, capsys, command):
    uri = "s3://cloudckpt-tset/runs/run"  # the test bucket, misspelt
    args = [uri, str(tmp_path / "dl")] if command == "download" else [uri]
    assert main([*s3_args(s3), command, *args]) == 3
    err = capsys.readouterr().err
    assert "the bucket s3://cloudckpt-tset does not exist" in err, err
    assert "nothing is stored there" not in err


@pytest.mark.parametrize("command", ["--version", "ls", "latest", "info", "verify", "gc", "rm"])
def test_commands_that_touch_no_tensors_start_without_torch(s3, command):
    """``cloudckpt ls`` and friends start in well under a second: torch (seconds to
    import) is never loaded by them (benchmarks/cli_bench.py has the timings)."""
    make(s3, "step-1", 1)
    make(s3, "step-2", 2)
    args = {"--version": [], "ls": [s3.root], "latest": [s3.root],
            "info": [s3.uri("step-1")], "verify": [s3.uri("step-1")], "gc": [s3.root],
            "rm": [s3.uri("step-1")]}[command]
    code = ("import sys\nfrom cloudckpt.cli import main\n"
            f"try:\n    rc = main({[command, *args]!r})\nexcept SystemExit as e:\n"
            "    rc = e.code\nprint('RC', rc, 'TORCH', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **s3.env}, timeout=120)
    assert "RC 0 TORCH False" in out.stdout, out.stdout + out.stderr


def test_ls_orders_by_step_with_torn_saves_in_place(s3, capsys):
    for step in (9, 12, 100):
        make(s3, f"step-{step}", step)
    torn_save(s3.uri("step-11"), s3.options, {"x.bin": b"x"})
    torn_save(s3.uri("step-10"), s3.options, {"x.bin": b"x"})
    assert main([*s3_args(s3), "ls", s3.root]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert names == ["step-9", "step-10", "step-11", "step-12", "step-100"]


def test_verbose_commands_show_cloudckpts_progress_not_the_clients_chatter(s3):
    make(s3, "step-1", 1)
    out = run_cli(s3, "-v", "ls", s3.root)
    assert out.returncode == 0, out.stderr
    assert "botocore" not in out.stderr and "Found credentials" not in out.stderr, out.stderr
    out = run_cli(s3, "-v", "cp", s3.uri("step-1"), s3.uri("copy"))
    assert out.returncode == 0 and "INFO cloudckpt" in out.stderr, out.stderr
    assert "botocore" not in out.stderr, out.stderr


def test_a_checkpoint_or_a_bare_name_where_a_root_belongs_says_what_to_pass(s3, tmp_path,
                                                                           monkeypatch, capsys):
    make(s3, "step-1", 1)
    for command in ("ls", "latest"):
        assert main([*s3_args(s3), command, s3.uri("step-1")]) == 2
        err = capsys.readouterr().err
        assert "is a checkpoint, not a run directory" in err and s3.root in err, err
    monkeypatch.chdir(tmp_path)
    assert main(["ls", "my-bucket/run"]) == 3
    err = capsys.readouterr().err
    assert "taken as a local path" in err and "s3://my-bucket/run" in err, err


# ------------------------------------------------------------------ framework commands

FRAMEWORK_COMMANDS = {"areal": ["import", "adopt"], "roll": ["upload", "fetch"],
                      "rlinf": ["convert", "latest", "adopt", "upload"]}


def console_script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed ``cloudckpt`` script, beside this interpreter."""
    script = os.path.join(os.path.dirname(sys.executable), "cloudckpt")
    return subprocess.run([script, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


@pytest.mark.parametrize("framework", sorted(FRAMEWORK_COMMANDS))
def test_a_frameworks_help_lists_its_commands(framework):
    out = console_script(framework, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: cloudckpt {framework} "), out.stdout
    for command in FRAMEWORK_COMMANDS[framework]:
        assert f"\n    {command} " in out.stdout, out.stdout
        sub = console_script(framework, command, "--help")
        assert sub.returncode == 0 and "-o KEY=VALUE" in sub.stdout, sub.stdout + sub.stderr


def test_the_top_help_lists_the_frameworks():
    from cloudckpt.core.plugins import frameworks

    out = console_script("--help")
    assert out.returncode == 0, out.stderr
    for fw in frameworks():
        if fw.commands:  # the test kit's toy framework (for activation) has none
            assert f"\n    {fw.name} " in out.stdout and fw.summary.split()[0] in out.stdout
    assert set(FRAMEWORK_COMMANDS) <= {fw.name for fw in frameworks()}


def test_a_framework_command_without_its_subcommand_is_a_usage_error():
    out = console_script("roll")
    assert out.returncode == 2 and "cloudckpt roll: error:" in out.stderr, out.stderr


def test_a_framework_commands_error_gets_the_shared_exit_code(s3, tmp_path):
    out = console_script("roll", "fetch", s3.uri("no-such-run"), str(tmp_path / "dl"),
                         env=s3.env)
    assert out.returncode == 3, out.stderr
    assert out.stderr.startswith("cloudckpt: error: ") and "Traceback" not in out.stderr
    out = console_script("rlinf", "latest", "--output_dir", s3.uri("logs"),
                         "--experiment_name", "none", env=s3.env)
    assert out.returncode == 3 and "no committed checkpoint" in out.stderr, out.stderr
    out = console_script("rlinf", "adopt", s3.uri("x", "global_step_1"), "-o", "nonsense",
                         env=s3.env)
    assert out.returncode == 2 and "KEY=VALUE" in out.stderr, out.stderr


def test_options_reach_a_framework_command_from_every_level(s3, tmp_path, capsys):
    key, secret, endpoint = s3_args(s3)[3], s3_args(s3)[5], s3_args(s3)[1]
    argv = ["-o", endpoint, "roll", "--option", key, "fetch", s3.uri("none"),
            str(tmp_path / "dl"), "--storage-option", secret]
    assert main(argv) == 3
    assert "no committed" in capsys.readouterr().err.lower()


@pytest.fixture
def demo_framework(monkeypatch):
    """A framework of the test's own, registered as a plug-in would be: ``demo run``
    records what it was given and fails as told."""
    import types

    from cloudckpt.core import plugins
    from cloudckpt.errors import CorruptCheckpointError

    seen: list = []

    def run(args):
        seen.append(args)
        if args.fail == "corrupt":
            raise CorruptCheckpointError("demo: a bad object")
        return int(args.fail or 0)

    def add_commands(parser):
        from cloudckpt.util.cliargs import add_command

        sub = parser.add_subparsers(dest="subcommand", required=True)
        add_command(sub, "run", run, "run the demo").add_argument("--fail", default=None,
                                                                   help="how to end")

    module = types.ModuleType("cloudckpt_demo_commands")
    module.add_commands = add_commands
    monkeypatch.setitem(sys.modules, module.__name__, module)
    plugins.frameworks()  # the entry points first: ours is added to them
    monkeypatch.setitem(plugins._registered, "demo", plugins.Framework(
        name="demo", summary="a demo framework", commands=f"{module.__name__}:add_commands"))
    monkeypatch.setitem(plugins._registered, "broken", plugins.Framework(
        name="broken", summary="fails to load", commands="cloudckpt_no_such_module:add"))
    return seen


def test_a_registered_frameworks_commands_follow_the_cli_contract(demo_framework, capsys):
    seen = demo_framework
    ours = logging.getLogger("cloudckpt")
    level = ours.level
    try:
        assert main(["-v", "-o", "a=1", "demo", "-o", "b=2", "run", "-o", "a=3", "-v"]) == 0
    finally:
        ours.setLevel(level)  # -vv set it to DEBUG for the rest of the session
    assert seen[-1].options == {"a": 3, "b": 2} and seen[-1].verbose == 2
    assert main(["demo", "run", "--fail", "5"]) == 5
    assert main(["demo", "run", "--fail", "corrupt"]) == 1  # exit_code(CorruptCheckpointError)
    assert capsys.readouterr().err == "cloudckpt: error: demo: a bad object\n"
    with pytest.raises(SystemExit) as exc:
        main(["broken", "anything"])
    assert exc.value.code == 2
    assert "the commands of broken" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "a demo framework" in capsys.readouterr().out


def test_other_commands_import_no_frameworks_commands(s3):
    code = ("import sys\nfrom cloudckpt.cli import main\nfrom cloudckpt.core import plugins\n"
            "for argv in (['--help'], ['ls', sys.argv[1]]):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "mods = {f.commands.partition(':')[0] for f in plugins.frameworks() if f.commands}\n"
            "print('LOADED', sorted(mods & set(sys.modules)), 'TORCH', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, s3.root], capture_output=True, text=True,
                         env={**os.environ, **s3.env}, timeout=120)
    assert "LOADED [] TORCH False" in out.stdout, out.stdout + out.stderr


def test_import_and_help_load_no_pyyaml():
    """PyYAML is the ``areal`` extra's: ``import cloudckpt`` and the command line's help
    run in an install without it."""
    code = ("import sys\nimport cloudckpt\nfrom cloudckpt.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('YAML', 'yaml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert "YAML False" in out.stdout, out.stdout + out.stderr



def test_the_version_is_written_once_in_pyproject(capsys):
    """``--version`` prints pyproject's version, which no module repeats."""
    import tomllib

    import cloudckpt

    root = Path(cloudckpt.__file__).resolve().parent
    want = tomllib.loads((root.parent / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"cloudckpt {want}"
    assert not [p for p in root.rglob("*.py") if f'"{want}"' in p.read_text()]
