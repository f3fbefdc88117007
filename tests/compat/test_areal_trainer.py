"""AReaL 1.0.4's own SFTTrainer (FSDPLMEngine, CPU, gloo; areal_sft/), launched as its
users launch it (torchrun train.py --config config.yaml ...), unchanged:

- without activation, AReaL's own Saver and RecoverHandler write its local trial
  directory, as always: the reference run;
- under ``cloudckpt run`` with ``saver.fileroot``/``recover.fileroot`` a bucket URI, the
  same command trains, is SIGKILLed once a recover dump is committed in the bucket, and
  the relaunched command resumes from it: the step counter goes on, and the run ends
  bit-exact with the reference (model, optimizer, the LR schedule, which AReaL's
  engine does not checkpoint, and the second epoch's data order, which AReaL's
  ``cycle_dataloader`` restarts at epoch 0: cloudckpt restores both); its HF export loads
  with ``from_pretrained`` through cloudckpt and equals AReaL's own;
- with one rank and with two. AReaL's installed files are the same before and after.
"""

from __future__ import annotations

import getpass
import hashlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from knobs import FULL  # tests/torture, on sys.path through conftest.py
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from cloudckpt import open_checkpoint
from cloudckpt.cli import main as cloudckpt_cli
from cloudckpt.training.slot import RecoverSlot

# Whole framework jobs (trainers, Ray clusters, torchrun ranks): minutes each on a
# busy machine, where the suite-wide 300 s cut them off.
pytestmark = pytest.mark.timeout(900)

SFT = Path(__file__).resolve().parent / "areal_sft"
TRIAL = f"checkpoints/{getpass.getuser()}/gsm8k-sft-cpu/trial0"
EPOCHS, STEPS = 2, 16  # 8 steps per epoch; the kill lands in the second epoch
STEP_LINE = re.compile(r"Train step (\d+)/(\d+) done")
AREAL = Path(importlib.util.find_spec("areal").submodule_search_locations[0])


def areal_hashes() -> dict[str, str]:
    return {str(p.relative_to(AREAL)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(AREAL.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module", autouse=True)
def areal_untouched():
    before = areal_hashes()
    yield
    assert areal_hashes() == before, "AReaL's installed files changed"


def make_fixtures(root: Path) -> dict[str, str]:
    """The tiny model and dataset (areal_sft/fixtures.py) under ``root``: their paths."""
    out = subprocess.run([sys.executable, str(SFT / "fixtures.py"), str(root)],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    return dict(line.split("=", 1) for line in out.split() if "=" in line)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict[str, str]:
    return make_fixtures(tmp_path_factory.mktemp("areal-fixtures"))


class Launch:
    """One launch of the user's command, and what its log says."""

    def __init__(self, fixtures: dict[str, str], workdir: Path, world: int, *,
                 bucket: str | None, env: dict[str, str]) -> None:
        self.local = workdir / "fileroot"  # AReaL's logs and name records stay local
        self.command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", str(world), "--master-addr", "localhost",
            "--master-port", str(free_port()), str(SFT / "train.py"), "--config",
            str(SFT / "config.yaml"), f"cluster.fileroot={self.local}",
            f"actor.path={fixtures['model']}", f"train_dataset.path={fixtures['dataset']}",
            f"actor.backend=fsdp:d{world}", "actor.optimizer.lr_scheduler_type=cosine",
            f"total_train_epochs={EPOCHS}"]
        if bucket:
            self.command += [f"saver.fileroot={bucket}", f"recover.fileroot={bucket}"]
            self.command = [sys.executable, "-m", "cloudckpt", "run", "--", *self.command]
        # AReaL's SPMD mode, as its launcher sets it; torch.compile off: ~10 s less per launch
        # on 2 cores, the same for the reference and the resumed runs.
        self.env = {**os.environ, **env, "AREAL_SPMD_MODE": "1", "OMP_NUM_THREADS": "1",
                    "TORCHDYNAMO_DISABLE": "1"}
        self.workdir = workdir

    def start(self, log: Path) -> subprocess.Popen:
        return subprocess.Popen(self.command, env=self.env, cwd=self.workdir,
                                stdout=log.open("w"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    def run(self, log: Path) -> str:
        proc = self.start(log)
        assert proc.wait(timeout=600) == 0, log.read_text()[-6000:]
        return log.read_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steps_done(log: str) -> list[int]:
    return [int(m.group(1)) for m in STEP_LINE.finditer(re.sub(r"\x1b\[[0-9;]*m", "", log))]


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (torchrun starts each rank in a session
    of its own, so a signal to the group misses the trainers)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in reversed(tree):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def dcp_tensors(path: Path, out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint on disk (model and optimizer), by key."""
    dcp_to_torch_save(path, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            flat[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", torch.load(out, weights_only=False))
    return flat


def assert_equal_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and len(want) > 10
    for key in want:
        assert torch.equal(got[key], want[key]), key


def reference_trial(fixtures: dict[str, str], work: Path, world: int) -> Path:
    """AReaL's own run (no activation, local fileroot) in ``work``: its trial dir."""
    launch = Launch(fixtures, work, world, bucket=None, env={})
    log = launch.run(work / "ref.log")
    assert steps_done(log)[-1] == STEPS and "bound the areal integration" not in log
    trial = launch.local / TRIAL
    # AReaL's own layout, on local disk: nothing went through cloudckpt.
    assert (trial / "recover_info" / "step_info.json").is_file()
    assert not list(launch.local.rglob("cloudckpt-manifest.json"))
    return trial


@pytest.fixture(scope="module")
def reference(fixtures, tmp_path_factory):
    """AReaL's own run of a world size: its trial dir."""
    trials: dict[int, Path] = {}

    def trial(world: int) -> Path:
        if world not in trials:
            trials[world] = reference_trial(fixtures, tmp_path_factory.mktemp(
                f"areal-ref{world}"), world)
        return trials[world]

    return trial


def assert_recover_equal(slot: RecoverSlot, s3, ref_trial: Path, tmp_path: Path) -> None:
    """The slot's current recover dump holds exactly the model and optimizer of the
    reference trial's ``recover_checkpoint``."""
    ours = tmp_path / "ours"
    assert cloudckpt_cli(["download", slot.current().uri, str(ours),
                          *sum((["-o", f"{k}={v}"] for k, v in s3.options.items()
                                if k != "retry"), [])]) == 0
    assert_equal_tensors(dcp_tensors(ours / "default" / "recover_checkpoint", tmp_path / "a.pt"),
                         dcp_tensors(ref_trial / "default" / "recover_checkpoint",
                                     tmp_path / "b.pt"))


def assert_export_equal(uri: str, s3, ref_export: Path) -> None:
    """The HF export at ``uri`` loads through cloudckpt, and equals AReaL's own."""
    from transformers import AutoModelForCausalLM

    from cloudckpt.hf import from_pretrained

    export = open_checkpoint(uri, s3.options)
    model = from_pretrained(AutoModelForCausalLM, export.uri, storage_options=s3.options)
    want = AutoModelForCausalLM.from_pretrained(ref_export)
    assert_equal_tensors(dict(model.state_dict()), dict(want.state_dict()))


def last_export(trial: Path) -> Path:
    """The HF export of a local AReaL trial's last step."""
    return max((trial / "default").glob("epoch*globalstep*"),
               key=lambda p: int(p.name.rpartition("globalstep")[2]))


#: What each AReaL process's one binding line names: the config's placement, bound at
#: once, and the trainers' module, bound at its import.
BOUND_AT_CONFIG = "areal.api.cli_args.parse_cli_args; binds into areal.trainer at their import"


def bound_lines(log: str) -> list[str]:
    """What each process's binding line of the AReaL integration says it bound."""
    return re.findall(r"bound the areal integration into areal 1\.0\.4, pid \d+: (.*)", log)


def kill_in_second_epoch(launch: Launch, slot: RecoverSlot, log: Path) -> tuple[str, int]:
    """Start ``launch`` (its output in ``log``) and SIGKILL it once a recover dump of the
    second epoch is committed in the bucket: the relaunch must go on with that epoch's
    data order (AReaL's own cycle_dataloader restarts at epoch 0). Returns its output
    and the step of the dump."""
    proc = launch.start(log)
    deadline = time.monotonic() + 300
    while (info := slot.info()) is None or info["step"] < STEPS // EPOCHS:
        assert proc.poll() is None, log.read_text()[-6000:]
        assert time.monotonic() < deadline, "no recover dump of the second epoch was committed"
        time.sleep(0.1)
    kill_tree(proc.pid)
    proc.wait(timeout=60)
    killed = log.read_text()
    assert len(steps_done(killed)) < STEPS, "the run ended before the kill"
    return killed, slot.info()["step"]


# One rank too at full scale (make torture); the regular run keeps the two-rank launch,
# which covers the one-rank path's calls and the collectives besides (75 s each).
@pytest.mark.parametrize("world", [1, 2] if FULL else [2])
def test_sft_trainer_killed_and_relaunched_resumes_from_the_bucket(world, fixtures, reference,
                                                                   s3, tmp_path):
    bucket = f"{s3.root}/areal"
    launch = Launch(fixtures, tmp_path, world, bucket=bucket, env=s3.env)
    slot = RecoverSlot(f"{bucket}/{TRIAL}", storage_options=s3.options)

    killed, dumped = kill_in_second_epoch(launch, slot, tmp_path / "killed.log")
    # Each rank said in one line what it bound, and that the trainers wait for import.
    assert bound_lines(killed) == [BOUND_AT_CONFIG] * world

    log = launch.run(tmp_path / "resumed.log")
    done = steps_done(log)
    assert done[0] == dumped + 2 and done[-1] == STEPS, (dumped, done)  # the counter goes on

    # The relaunch ends where AReaL's own uninterrupted run ends, bit-exact.
    ref_trial = reference(world)
    assert_recover_equal(slot, s3, ref_trial, tmp_path)
    # The HF export of the last step loads through cloudckpt, and equals AReaL's own.
    ref_export = last_export(ref_trial)
    assert_export_equal(f"{bucket}/{TRIAL}/default/{ref_export.name}", s3, ref_export)
