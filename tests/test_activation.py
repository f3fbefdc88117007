"""Activation: ``cloudckpt run`` and ``CLOUDCKPT_INTEGRATIONS`` bind an integration into
its framework's module in the launched process and every Python process it starts,
only when asked, refusing untested framework code (the test kit's toy framework,
``cloudckpt_testkit.toyframework``, stands for a framework here; the real ones are
driven by tests/compat)."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from cloudckpt_testkit import toyframework

from cloudckpt import activation
from cloudckpt.activation import binding, hooks
from cloudckpt.errors import ConfigError, UntestedVersionError

CLI = [sys.executable, "-m", "cloudckpt"]
BOUND = re.compile(r"INFO cloudckpt: bound the toyfw integration into toyfw \(code "
                   r"sha256:[0-9a-f]{16}\), pid (\d+): cloudckpt_testkit\.toytrainer\.Saver")

#: The framework's trainer saves; this one then starts a Python process that does too.
TRAINER = textwrap.dedent("""
    import subprocess, sys
    from cloudckpt_testkit import toytrainer
    print(toytrainer.Saver.by, toytrainer.train(sys.argv[1]))
    if len(sys.argv) > 2:
        subprocess.run([sys.executable, __file__, sys.argv[2]], check=True)
""")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", activation.ENV_INTEGRATIONS, binding.ENV_ALLOW_UNTESTED)}
    if os.environ.get("PYTHONPATH"):  # a worktree's checkout, ahead of the installed one
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return {**env, **extra}


def run(args: list[str], env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120,
                          env=env or clean_env(), cwd=cwd)


@pytest.fixture(autouse=True)
def no_hooks_left():
    """What a test activates in this process waits for no later test's imports."""
    waiting = {k: list(v) for k, v in hooks._waiting.items()}
    yield
    hooks._waiting.clear()
    hooks._waiting.update(waiting)


@pytest.fixture
def trainer(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    return script


def saved_by_cloudckpt(path: Path) -> bool:
    """The toy framework writes a file; cloudckpt's saver a store with one object."""
    return path.is_dir() and (path / "state").read_bytes() == b"state"


def test_run_binds_in_the_command_and_in_every_python_process_it_starts(tmp_path, trainer):
    a, b = tmp_path / "a", tmp_path / "b"
    r = run([*CLI, "run", "--", sys.executable, str(trainer), str(a), str(b)])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0].startswith("cloudckpt ")
    assert saved_by_cloudckpt(a) and saved_by_cloudckpt(b)  # child and grandchild
    pids = BOUND.findall(r.stderr)
    assert len(pids) == 2 and len(set(pids)) == 2, r.stderr  # one line per process


#: The trainer in children started by multiprocessing (spawn, forkserver): fresh
#: interpreters that inherit only the environment.
SPAWNER = textwrap.dedent("""
    import multiprocessing, sys

    def work(path):
        from cloudckpt_testkit import toytrainer
        print(toytrainer.Saver.by, toytrainer.train(path), flush=True)

    if __name__ == "__main__":
        for method, path in zip(("spawn", "forkserver"), sys.argv[1:]):
            child = multiprocessing.get_context(method).Process(target=work, args=(path,))
            child.start()
            child.join()
            assert child.exitcode == 0, (method, child.exitcode)
""")

#: The trainer as torchrun's workers run it: one save per local rank.
RANKS = textwrap.dedent("""
    import os, sys
    from cloudckpt_testkit import toytrainer
    print(toytrainer.Saver.by, toytrainer.train(f"{sys.argv[1]}-{os.environ['LOCAL_RANK']}"))
""")


def test_run_binds_in_multiprocessing_children_without_extra_variables(tmp_path):
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER)
    a, b = tmp_path / "spawned", tmp_path / "forkserved"
    r = run([*CLI, "run", "--", sys.executable, str(script), str(a), str(b)])
    assert r.returncode == 0, r.stderr
    assert saved_by_cloudckpt(a) and saved_by_cloudckpt(b), r.stdout + r.stderr
    assert len(set(BOUND.findall(r.stderr))) == 2, r.stderr  # each child says so


def test_run_binds_in_torchruns_workers_without_extra_variables(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    out = tmp_path / "rank"
    r = run([*CLI, "run", "--", sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "2", str(script), str(out)])
    assert r.returncode == 0, r.stderr
    assert all(saved_by_cloudckpt(tmp_path / f"rank-{i}") for i in range(2)), r.stderr
    assert len(set(BOUND.findall(r.stderr))) == 2, r.stderr


def test_without_activation_nothing_is_bound(tmp_path, trainer):
    """Importing cloudckpt, its activation and every integration binds nothing."""
    a = tmp_path / "a"
    imports = ("import cloudckpt, cloudckpt.activation, cloudckpt.cli; "
               "import cloudckpt.integrations.areal, cloudckpt.integrations.roll, "
               "cloudckpt.integrations.rlinf; ")
    r = run([sys.executable, "-c", imports + f"exec(open({str(trainer)!r}).read())", str(a)])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("framework ")
    assert a.is_file() and a.read_bytes() == b"state"
    assert "bound" not in r.stderr


def test_the_printed_environment_activates_workers_started_elsewhere(tmp_path, trainer):
    r = run([*CLI, "run", "--integration", "toyfw", "--print-env"])
    assert r.returncode == 0, r.stderr
    env = dict(line.removeprefix("export ").split("=", 1) for line in r.stdout.split("\n")
               if line)
    theirs = os.environ.get("PYTHONPATH")  # kept after the hook (a worktree's checkout)
    assert env == {"PYTHONPATH": os.pathsep.join(filter(None, [activation.hook_directory(),
                                                               theirs])),
                   activation.ENV_INTEGRATIONS: "toyfw"}
    a = tmp_path / "a"
    r = run([sys.executable, str(trainer), str(a)], env=clean_env(**env))
    assert r.returncode == 0 and saved_by_cloudckpt(a), r.stderr
    assert len(BOUND.findall(r.stderr)) == 1


def test_a_sitecustomize_already_on_the_path_still_runs(tmp_path, trainer):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text(
        "import os, pathlib\npathlib.Path(os.environ['MARK']).write_text('ran')\n")
    mark, a = tmp_path / "mark", tmp_path / "a"
    env = clean_env(PYTHONPATH=os.pathsep.join(filter(None, [
        activation.hook_directory(), str(theirs), os.environ.get("PYTHONPATH")])),
        CLOUDCKPT_INTEGRATIONS="toyfw", MARK=str(mark))
    r = run([sys.executable, str(trainer), str(a)], env=env)
    assert r.returncode == 0, r.stderr
    assert mark.read_text() == "ran" and saved_by_cloudckpt(a)


def test_an_unknown_integration_stops_the_launch(tmp_path):
    r = run([*CLI, "run", "--integration", "nope", "--", sys.executable, "-c", "print(1)"])
    assert r.returncode == 2 and "no integration named nope" in r.stderr, r.stderr
    assert "areal" in r.stderr and r.stdout == ""  # names the known ones; ran nothing
    # Set by a cluster, the hook stops the process before it runs any user code.
    env = clean_env(PYTHONPATH=activation.hook_directory(), CLOUDCKPT_INTEGRATIONS="nope")
    r = run([sys.executable, "-c", "print('ran')"], env=env)
    assert r.returncode == 2 and "ran" not in r.stdout
    assert "activation failed" in r.stderr and "no integration named nope" in r.stderr


@pytest.mark.parametrize("launch, message", [
    ([], "no command to run"),
    (["--", "no-such-command-cloudckpt"], "command not found: no-such-command-cloudckpt"),
])
def test_a_launch_that_cannot_start_is_a_usage_error(launch, message):
    r = run([*CLI, "run", *launch])
    assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.fixture
def toy_module() -> types.ModuleType:
    """A fresh copy of the toy trainer module, imported under its own name."""
    sys.modules.pop(toyframework.MODULE, None)
    import cloudckpt_testkit.toytrainer as module

    yield module
    sys.modules.pop(toyframework.MODULE, None)


def test_untested_code_is_refused_unless_allowed(toy_module, caplog, monkeypatch):
    monkeypatch.delenv(binding.ENV_ALLOW_UNTESTED, raising=False)
    fw = dataclasses.replace(toyframework.FRAMEWORK, tested=("sha256:ffffffffffffffff",))
    (b,) = fw.bindings
    with pytest.raises(UntestedVersionError) as err:
        binding.bind(fw, b, toy_module)
    assert "tested: sha256:ffffffffffffffff" in str(err.value)
    assert binding.ENV_ALLOW_UNTESTED in str(err.value)
    assert toy_module.Saver.by == "framework"  # nothing bound
    monkeypatch.setenv(binding.ENV_ALLOW_UNTESTED, "1")
    with caplog.at_level(logging.INFO, logger="cloudckpt.activation"):
        assert binding.bind(fw, b, toy_module) == ("Saver",)
    assert toy_module.Saver.by == "cloudckpt"
    assert any(r.levelno == logging.WARNING and "not tested with" in r.message
               for r in caplog.records)
    assert binding.bind(fw, b, toy_module) == ()  # once only


def test_a_changed_framework_source_changes_its_fingerprint(toy_module, tmp_path):
    names = toyframework.FRAMEWORK.bindings[0].fingerprint
    assert binding.fingerprint(toy_module, names) in toyframework.FRAMEWORK.tested
    changed = tmp_path / "toytrainer_changed.py"
    changed.write_text(Path(toy_module.__file__).read_text().replace('b"state"', 'b"other"'))
    spec = importlib.util.spec_from_file_location("toytrainer_changed", changed)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert binding.fingerprint(module, names) not in toyframework.FRAMEWORK.tested


def test_activate_binds_a_module_already_imported_and_one_imported_later(toy_module):
    assert toy_module.Saver.by == "framework"
    assert activation.activate("toyfw") == ["toyfw"]
    assert toy_module.Saver.by == "cloudckpt"
    sys.modules.pop(toyframework.MODULE)
    hooks.when_imported(toyframework.MODULE, lambda m: setattr(m, "seen", True))
    import cloudckpt_testkit.toytrainer as again

    assert again is not toy_module and again.seen is True
    assert again.__loader__ is again.__spec__.loader and "hooks" not in type(
        again.__loader__).__module__  # the module keeps its own loader


def test_activate_names_what_it_knows():
    with pytest.raises(ConfigError, match="known: .*toyfw"):
        activation.activate(["toyfw", "nope"])
    assert {"areal", "roll", "toyfw"} <= set(activation.activate(None))


def test_a_process_says_once_what_it_bound_and_what_waits(toy_module, tmp_path, caplog,
                                                          monkeypatch):
    """Two of a framework's modules bound in one process: one INFO line, at the first,
    naming the other module as waiting; the second binding is said at DEBUG only."""
    second = tmp_path / "toytrainer_second.py"
    second.write_text(Path(toy_module.__file__).read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    (b,) = toyframework.FRAMEWORK.bindings
    fw = dataclasses.replace(toyframework.FRAMEWORK, name="toyfw-twice", bindings=(
        b, dataclasses.replace(b, module="toytrainer_second")))
    with caplog.at_level(logging.DEBUG, logger="cloudckpt.activation"):
        binding.bind(fw, fw.bindings[0], toy_module)
        import toytrainer_second

        binding.bind(fw, fw.bindings[1], toytrainer_second)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "toyfw-twice" in
            r.getMessage()]
    assert [level for level, _ in said] == [logging.INFO, logging.DEBUG], said
    assert said[0][1].endswith(f"pid {os.getpid()}: {toyframework.MODULE}.Saver; binds "
                               "into toytrainer_second at their import"), said
    assert said[1][1].endswith(": toytrainer_second.Saver")
    assert toytrainer_second.Saver.by == "cloudckpt"
    sys.modules.pop("toytrainer_second")
