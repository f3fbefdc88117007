"""A job SIGKILLed in the middle of a save and relaunched on another node comes back by
itself, through each framework's own code on two gloo ranks: the relaunch (a new pid
namespace, its own hostname and local disk) resumes the newest committed step, saves
the killed step again (taking the dead save's claim over: at once as the next attempt of
the same run, once its lease ran out as another run), and goes on bit-exact with a run
that never stopped. No command is typed in between.

One section per framework (verl's trainer and its SFT handler, RLinf's runner, ROLL's
workers, AReaL's SFTTrainer); each kills its save while the step's root manifest is in
flight (:class:`relaunch.HeldSave`), compares with a module-scoped reference run that
never stopped, and relaunches as the same run and as another (``RELAUNCHES``). AReaL's
recover dump is the one save that never comes back to the same URI (each is a new
generation of the trial's slot): its relaunch has no claim to take over."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cloudckpt_testkit import FaultProxy
from cloudckpt_testkit.nodes import as_node, node_env
from relaunch import (
    SHORT_LEASE,
    HeldSave,
    Stamped,
    attempt_env,
    kill_held,
    run_stamped,
    taken_over_at,
)
from test_areal_trainer import (
    EPOCHS,
    STEPS,
    TRIAL,
    assert_export_equal,
    assert_recover_equal,
    make_fixtures,
    reference_trial,
    steps_done,
)
from test_areal_trainer import Launch as ArealLaunch
from test_roll_ray import ROLL_SRC
from test_verl import HERE, trainer_config

from cloudckpt import MANIFEST_NAME, list_checkpoints, open_checkpoint
from cloudckpt.training.slot import RecoverSlot

# Whole framework jobs (trainers, Ray clusters, torchrun ranks): minutes each on a
# busy machine, where the suite-wide 300 s cut them off.
pytestmark = pytest.mark.timeout(900)

RELAUNCHES = ["same-run", "other-run"]
#: A node's launch: the command (as on that node) and its environment, given what the
#: test adds to it (the proxy's endpoint, the attempt).
Launch = Callable[[dict[str, str]], tuple[list[str], dict[str, str]]]


@contextmanager
def node_disks() -> Iterator[Path]:
    """Where the nodes' local disks are: a short path (Ray's socket paths must fit 107
    bytes below a node's TMPDIR)."""
    path = Path(tempfile.mkdtemp(prefix="nodes-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def disks():
    with node_disks() as path:
        yield path


def on_node(cmd: list[str], disks: Path, host: str, env: dict[str, str],
            path: tuple[Path, ...] = (), *, run: bool = True
            ) -> tuple[list[str], dict[str, str]]:
    """``cmd`` under ``cloudckpt run`` (unless ``run`` is false: it is there already)
    as on node ``host``, with ``env`` (and ``path`` and this directory on its
    PYTHONPATH)."""
    # RAY_DEDUP_LOGS=0: Ray would fold lines that differ only by pid into one.
    environ = node_env(disks, host, {
        **os.environ, **env, "RAY_DEDUP_LOGS": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [*map(str, path), str(HERE),
                                                    os.environ.get("PYTHONPATH")]))})
    if run:
        cmd = [sys.executable, "-m", "cloudckpt", "run", "--", *cmd]
    return as_node(cmd, host), environ


def relaunch_env(relaunch: str) -> tuple[dict[str, str], dict[str, str]]:
    """The killed attempt's environment, and its relaunch's."""
    again = attempt_env("run-1" if relaunch == "same-run" else "run-2", 1)
    return attempt_env("run-1", 0), again


def kill_mid_save(launch: Launch, cwd: Path, moto_server, target, **hold
                  ) -> tuple[float, str]:
    """Start ``launch`` through a proxy holding its save's ``target`` (see HeldSave),
    SIGKILL the node once that request waits there (its output in ``killed.log``);
    returns when it was killed, and the request held."""
    log = cwd / "killed.log"
    with HeldSave(moto_server.endpoint, target, **hold) as held:
        cmd, environ = launch(held.env)
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, env=environ, cwd=cwd, stdout=out,
                                    stderr=subprocess.STDOUT)
        kill_held(proc, held, log=log)
        assert held.path is not None
        return time.time(), held.path


def run_node(launch: Launch, cwd: Path, env: dict[str, str], name: str,
             timeout: float = 600) -> Stamped:
    """Run ``launch`` to its end (it must succeed): its output, stamped."""
    cmd, environ = launch(env)
    out = run_stamped(cmd, environ, cwd, cwd / f"{name}.log", timeout)
    assert out.returncode == 0, out.text[-6000:]
    return out


def check_taken_over(out: Stamped, uri: str, relaunch: str, killed_at: float, *,
                     racers: bool = False) -> None:
    """The relaunch took the killed save's claim of ``uri`` over once: as the next
    attempt of its run, or (another run) once the lease ran out, not before. The claim
    was renewed at most a quarter lease before the kill, so its lease ran out no sooner
    than three quarters of one after it. ``racers``: several processes may try to
    commit (each says so; one's compare-and-swap wins)."""
    lines = taken_over_at(out, uri)
    assert len(lines) == 1 or (racers and lines), out.text[-6000:]
    for when, line in lines:
        if relaunch == "same-run":
            assert "an earlier attempt of this run" in line, line
        else:
            assert f"its lease of {SHORT_LEASE} s" in line, line
            assert when >= killed_at + 0.75 * SHORT_LEASE - 0.5, (when - killed_at, line)


def assert_same_steps(got: dict, want: dict, steps: list[int]) -> None:
    """Per step: every rank's digests (model, optimizer, scheduler, RNG) and the data
    drawn next are the reference's."""
    for step in steps:
        assert got[step] == want[step], f"step {step}"


# --------------------------------------------------------------------------- verl


def verl_launch(tmp_path: Path, disks: Path, name: str, plan: dict, host: str
                ) -> tuple[Launch, Path]:
    """verl_driver.py as on node ``host``."""
    (tmp_path / f"{name}.json").write_text(json.dumps(plan))
    out = tmp_path / f"{name}-out.json"
    cmd = [sys.executable, str(HERE / "verl_driver.py"), str(tmp_path / f"{name}.json"),
           str(out)]
    return (lambda env: on_node(cmd, disks, host, env)), out


def verl_saved(phase: dict) -> dict[int, dict]:
    """Per saved step, every rank's digests and the dataloader's next batch."""
    return {s["step"]: {"digests": s["digests"], "next": s["next"]} for s in phase["saved"]}


@pytest.fixture(scope="module")
def verl_reference(tmp_path_factory) -> dict:
    """verl's own run of four steps that never stopped (on local disk, verl's own save)."""
    tmp = tmp_path_factory.mktemp("verl-reference")
    with node_disks() as disks:
        launch, out = verl_launch(tmp, disks, "reference", {
            "config": trainer_config(default_local_dir=str(tmp / "ckpts")), "world": 2,
            "phases": [{"save": [1, 2, 3, 4]}]}, "node-r")
        run_node(launch, tmp, {}, "reference")
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
    step3 = f"{s3.root}/global_step_3"
    killed, _ = verl_launch(tmp_path, disks, "killed", {
        "config": config, "world": 2, "phases": [{"save": [1, 2, 3]}]}, "node-a")
    killed_at, _ = kill_mid_save(lambda env: killed({**s3.env, **first, **env}), tmp_path,
                              moto_server, "/global_step_3/cloudckpt-manifest.json")
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == \
        ["global_step_1", "global_step_2"]

    relaunched, out = verl_launch(tmp_path, disks, "relaunch", {
        "config": config, "world": 2, "phases": [{"resume": True, "save": [3, 4]}]}, "node-b")
    log = run_node(relaunched, tmp_path, {**s3.env, **again}, "relaunch")
    seen = json.loads(out.read_text())
    assert "error" not in seen, seen.get("traceback")
    (resumed,) = seen["phases"]
    assert "error" not in resumed, resumed.get("traceback")
    assert resumed["resumed_at"] == 2
    assert_same_steps(verl_saved(resumed), verl_saved(verl_reference), [3, 4])
    check_taken_over(log, step3, relaunch, killed_at)
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == \
        ["global_step_1", "global_step_2", "global_step_3", "global_step_4"]
    open_checkpoint(step3, s3.options).verify(deep=True)


# ----------------------------------------------------------- verl's SFT handler


def verl_sft_launch(tmp_path: Path, disks: Path, name: str, plan: dict, host: str
                    ) -> tuple[Launch, Path]:
    """verl_sft_ranks.py (verl's SFT CheckpointHandler on every rank) as on ``host``."""
    (tmp_path / f"{name}.json").write_text(json.dumps(plan))
    out = tmp_path / name
    cmd = [sys.executable, str(HERE / "verl_sft_ranks.py"), str(tmp_path / f"{name}.json"),
           str(out)]
    return (lambda env: on_node(cmd, disks, host, env)), out


def sft_reports(out: Path) -> list[dict]:
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rep in reports:
        assert "error" not in rep, rep.get("traceback")
    return reports


def sft_saved(reports: list[dict]) -> dict[int, list[dict]]:
    """Per saved step, each rank's digests and next dataloader item."""
    return {int(step): [rep["saved"][step] for rep in reports] for step in reports[0]["saved"]}


@pytest.mark.parametrize("relaunch", RELAUNCHES)
def test_verl_sft_handler_killed_mid_save_comes_back_on_another_node(
        relaunch, s3, moto_server, tmp_path, disks, verl_sft_reference):
    """verl's SFT CheckpointHandler on two torchrun-style ranks, killed while the root
    manifest of global_step_3 is in flight (every rank's files written); the relaunch
    runs verl's ``load_checkpoint()`` (resume_mode auto), then trains and saves on."""
    first, again = relaunch_env(relaunch)
    step3 = f"{s3.root}/global_step_3"
    killed, _ = verl_sft_launch(tmp_path, disks, "killed",
                                {"root": s3.root, "steps": [1, 2, 3]}, "node-a")
    killed_at, _ = kill_mid_save(lambda env: killed({**s3.env, **first, **env}), tmp_path,
                              moto_server, "/global_step_3/cloudckpt-manifest.json")
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == \
        ["global_step_1", "global_step_2"]

    relaunched, out = verl_sft_launch(tmp_path, disks, "relaunch",
                                      {"root": s3.root, "resume_save": [3, 4]}, "node-b")
    log = run_node(relaunched, tmp_path, {**s3.env, **again}, "relaunch")
    reports = sft_reports(out)
    assert [rep["resumed_at"] for rep in reports] == [2, 2]
    assert_same_steps(sft_saved(reports), verl_sft_reference, [3, 4])
    check_taken_over(log, step3, relaunch, killed_at)
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == \
        ["global_step_1", "global_step_2", "global_step_3", "global_step_4"]
    open_checkpoint(step3, s3.options).verify(deep=True)


# ------------------------------------------------------------ RLinf's runner


def rlinf_launch(tmp_path: Path, disks: Path, name: str, output_dir: str, steps: list[int],
                 host: str) -> tuple[Launch, Path]:
    """rlinf_runner_driver.py as on ``host``: RLinf's ReasoningRunner over an actor group
    of two ranks running RLinf's FSDP2 strategy; ``init_workers`` with resume_dir auto,
    then it trains and saves ``steps``."""
    out = tmp_path / name
    out.mkdir()
    cmd = [sys.executable, str(HERE / "rlinf_runner_driver.py"), "--output-dir", output_dir,
           "--out", str(out), "--save", ",".join(map(str, steps)), "--world", "2"]
    return (lambda env: on_node(cmd, disks, host, env)), out / "run.json"


def rlinf_saved(report: dict) -> dict[int, dict]:
    return {s["step"]: {"digests": s["digests"], "next": s["next"]} for s in report["saved"]}


@pytest.fixture(scope="module")
def rlinf_reference(tmp_path_factory) -> dict[int, dict]:
    """RLinf's own runner and strategy saving four steps on local disk, never stopped."""
    tmp = tmp_path_factory.mktemp("rlinf-reference")
    with node_disks() as disks:
        launch, out = rlinf_launch(tmp, disks, "reference", str(tmp / "results"),
                                   [1, 2, 3, 4], "node-r")
        run_node(launch, tmp, {}, "reference")
    report = json.loads(out.read_text())
    assert report["resumed_at"] == 0
    return rlinf_saved(report)


@pytest.mark.parametrize("relaunch", RELAUNCHES)
def test_rlinf_runner_killed_mid_save_comes_back_on_another_node(
        relaunch, s3, moto_server, tmp_path, disks, rlinf_reference):
    """RLinf's ReasoningRunner._save_checkpoint over two FSDP2 ranks, killed while the
    step's root manifest is in flight (the actor's part committed below it)."""
    first, again = relaunch_env(relaunch)
    steps = f"{s3.root}/exp/checkpoints"
    killed, _ = rlinf_launch(tmp_path, disks, "killed", s3.root, [1, 2, 3], "node-a")
    killed_at, _ = kill_mid_save(lambda env: killed({**s3.env, **first, **env}), tmp_path,
                              moto_server, "/global_step_3/cloudckpt-manifest.json")
    assert [c.name for c in list_checkpoints(steps, s3.options)] == \
        ["global_step_1", "global_step_2"]

    relaunched, out = rlinf_launch(tmp_path, disks, "relaunch", s3.root, [3, 4], "node-b")
    log = run_node(relaunched, tmp_path, {**s3.env, **again}, "relaunch")
    report = json.loads(out.read_text())
    assert report["resumed_at"] == 2
    assert_same_steps(rlinf_saved(report), rlinf_reference, [3, 4])
    check_taken_over(log, f"{steps}/global_step_3", relaunch, killed_at)
    assert [c.name for c in list_checkpoints(steps, s3.options)] == \
        ["global_step_1", "global_step_2", "global_step_3", "global_step_4"]
    step3 = open_checkpoint(f"{steps}/global_step_3", s3.options)
    step3.verify(deep=True)
    assert {"data/data.pt", "actor/cloudckpt-manifest.json"} <= set(step3.files)


# ------------------------------------------------------------------ ROLL's workers


def roll_launch(tmp_path: Path, disks: Path, name: str, checkpoint_config: dict,
                steps: list[int], host: str, *, resume: bool = False) -> tuple[Launch, Path]:
    """roll_ray_driver.py as on ``host``: ROLL's actor as two Ray actors of a gloo group
    and the pipeline, each with its own CheckpointManager uploading its part of each
    ``checkpoint-N``; ``resume``: first get_latest_ckpt and every rank's DCP load."""
    config = {"checkpoint_config": checkpoint_config, "save": steps, "resume": resume,
              "world": 2}
    (tmp_path / f"{name}.json").write_text(json.dumps(config))
    out = tmp_path / f"{name}-out.json"
    cmd = [sys.executable, str(HERE / "roll_ray_driver.py"), str(tmp_path / f"{name}.json"),
           str(out)]
    env = {"ROLL_LOG_DIR": str(tmp_path / f"{name}-roll-logs")}
    return (lambda more: on_node(cmd, disks, host, {**env, **more}, (ROLL_SRC,))), out


def roll_result(out: Path) -> dict:
    seen = json.loads(out.read_text())
    assert "error" not in seen, seen["error"]
    return seen


def roll_saved(seen: dict) -> dict[int, list[dict]]:
    return {s["step"]: s["digests"] for s in seen["saved"]}


@pytest.fixture(scope="module")
def roll_reference(tmp_path_factory) -> dict[int, list[dict]]:
    """ROLL's own run of four steps that never stopped (its file_system uploader)."""
    tmp = tmp_path_factory.mktemp("roll-reference")
    with node_disks() as disks:
        launch, out = roll_launch(tmp, disks, "reference", {
            "type": "file_system", "output_dir": str(tmp / "uploaded")}, [1, 2, 3, 4],
            "node-r")
        run_node(launch, tmp, {}, "reference")
    assert sorted(os.listdir(tmp / "uploaded")) == [f"checkpoint-{s}" for s in (1, 2, 3, 4)]
    return roll_saved(roll_result(out))


@pytest.mark.parametrize("relaunch", RELAUNCHES)
def test_roll_workers_killed_mid_commit_come_back_on_another_node(
        relaunch, s3, moto_server, tmp_path, disks, roll_reference):
    """ROLL's workers uploading checkpoint-3 as three parts (two actor ranks and the
    pipeline), killed while its manifest is in flight: every part is uploaded and its
    marker written, and the last part's uploader holds the claim of its commit. The
    relaunch (a fresh Ray cluster) resumes checkpoint-2 through ROLL's
    get_latest_ckpt, uploads checkpoint-3 again and commits it by itself."""
    first, again = relaunch_env(relaunch)
    config = {"type": "s3", "output_dir": s3.root, "expected_uploads": 3}
    ckpt3 = f"{s3.root}/checkpoint-3"
    killed, _ = roll_launch(tmp_path, disks, "killed",
                            {**config, "download_dir": str(tmp_path / "latest-a")},
                            [1, 2, 3], "node-a")
    killed_at, _ = kill_mid_save(lambda env: killed({**s3.env, **first, **env}), tmp_path,
                              moto_server, "/checkpoint-3/cloudckpt-manifest.json")
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == \
        ["checkpoint-1", "checkpoint-2"]

    relaunched, out = roll_launch(tmp_path, disks, "relaunch",
                                  {**config, "download_dir": str(tmp_path / "latest-b")},
                                  [3, 4], "node-b", resume=True)
    log = run_node(relaunched, tmp_path, {**s3.env, **again}, "relaunch")
    seen = roll_result(out)
    assert seen["resumed_at"] == 2
    assert_same_steps(roll_saved(seen), roll_reference, [3, 4])
    # Each uploader that finds all parts in commits: more than one may take over.
    check_taken_over(log, ckpt3, relaunch, killed_at, racers=True)
    assert len([line for line in log.text.splitlines()
                if f"committed {ckpt3} (step 3" in line]) == 1
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == \
        ["checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-4"]
    step3 = open_checkpoint(ckpt3, s3.options)
    step3.verify(deep=True)
    assert step3.metadata["parts"] == ["actor_train-0", "actor_train-1", "pipeline"]
    # Every object of the prefix is the manifest's: the killed attempt's markers went
    # (hidden bookkeeping aside: a process killed mid-probe leaves its probe object).
    assert sorted(o.key for o in step3.store.list()) == \
        sorted([*step3.files, "cloudckpt-manifest.json"])


# ------------------------------------------------------------ AReaL's SFTTrainer

#: A recover dump's own manifest: its slot's generation, committed at every dump.
DUMP_MANIFEST = re.compile(r"/gen-\d{20}-[0-9a-f]{8}/cloudckpt-manifest\.json$")
#: Dumps at global steps 1, 3, 5, ... (recover.freq_steps: 2): the sixth, at step 11,
#: is in the second epoch, after the HF export of that step (saver.freq_steps: 3).
KILLED_DUMP, DUMPS_BEFORE = 11, 5


@pytest.fixture(scope="module")
def areal(tmp_path_factory) -> tuple[dict[str, str], Path]:
    """The tiny model and dataset, and AReaL's own run of two ranks that never stopped
    (its trial directory on local disk)."""
    fixtures = make_fixtures(tmp_path_factory.mktemp("areal-fixtures"))
    return fixtures, reference_trial(fixtures, tmp_path_factory.mktemp("areal-ref"), 2)


def areal_launch(fixtures: dict[str, str], tmp_path: Path, disks: Path, bucket: str,
                 host: str) -> Launch:
    """AReaL's SFT command (torchrun, two gloo ranks, under cloudckpt run) as on ``host``,
    its local fileroot on that node's disk."""
    work = tmp_path / host
    work.mkdir()

    def launch(env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        areal = ArealLaunch(fixtures, work, 2, bucket=bucket, env=env)
        return on_node(areal.command, disks, host, areal.env, run=False)

    return launch


@pytest.mark.parametrize("relaunch", RELAUNCHES)
def test_areal_sft_trainer_killed_mid_dump_comes_back_on_another_node(
        relaunch, s3, moto_server, tmp_path, disks, areal):
    """AReaL's SFTTrainer, killed while the manifest of its recover dump at global step
    11 is in flight (every rank's DCP shard and AReaL's recover info written, the slot's
    pointer still on the dump of step 9). The relaunch recovers step 9, dumps step 11
    again and trains to the end, bit-exact with AReaL's own run. A dump goes to a
    generation of its own, so the dead one's claim is in nobody's way: nothing is
    taken over, and the torn generation stays invisible."""
    fixtures, ref_trial = areal
    first, again = relaunch_env(relaunch)
    bucket = f"{s3.root}/areal"
    slot = RecoverSlot(f"{bucket}/{TRIAL}", storage_options=s3.options)
    killed = areal_launch(fixtures, tmp_path, disks, bucket, "node-a")
    _, held = kill_mid_save(lambda env: killed({**s3.env, **first, **env}), tmp_path,
                            moto_server, DUMP_MANIFEST, skip=DUMPS_BEFORE)
    torn = held.rsplit("/", 2)[-2]  # the killed dump's generation
    resumed = slot.info()["step"]
    assert resumed == KILLED_DUMP - 2 and STEPS // EPOCHS <= resumed  # the second epoch
    assert len(steps_done((tmp_path / "killed.log").read_text())) < STEPS

    dumps: set[str] = set()  # the relaunch's, through a proxy that counts them
    counting = FaultProxy(moto_server.endpoint, on_request=lambda method, path: dumps.add(
        path) if method == "PUT" and DUMP_MANIFEST.search(path) else None)
    counting.start()
    try:
        out = run_node(areal_launch(fixtures, tmp_path, disks, bucket, "node-b"), tmp_path,
                       {**s3.env, **again, "AWS_ENDPOINT_URL": counting.endpoint},
                       "relaunch")
    finally:
        counting.stop()
    done = steps_done(out.text)  # "Train step N" is global step N - 1
    assert done[0] == resumed + 2 and done[-1] == STEPS, done  # the counter goes on
    # It dumped step 11 again, then 13 and 15, each committed and made current.
    assert len(dumps) == 3 and slot.info()["step"] == STEPS - 1
    assert not taken_over_at(out, bucket)
    # The killed dump never became current, and its torn generation holds no manifest.
    assert torn in slot.generations() and slot.info()["generation"] != torn
    assert not slot.store.child(torn).exists(MANIFEST_NAME)
    # Where AReaL's own run ends, bit-exact: the last dump, and its HF exports, the one
    # the killed run made (kept by the relaunch) and the relaunch's last.
    assert_recover_equal(slot, s3, ref_trial, tmp_path)
    for step in (KILLED_DUMP, STEPS - 2):
        (ref_export,) = (ref_trial / "default").glob(f"epoch*globalstep{step}")
        assert_export_equal(f"{bucket}/{TRIAL}/default/{ref_export.name}", s3, ref_export)
