"""The local tier in front of the bucket: local saves, drains, resume from the nearest
complete tier, and what a crash at each moment leaves.

On this one machine a "node" is a directory: each rank's local tier is its own
``<local-dir>/rank-<r>`` (on a cluster, the node's NVMe or ``/dev/shm``), and wiping
one stands for a replaced node.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from dist_run import run_ranks
from test_resume import EXAMPLE, assert_same_params, assert_same_run, env
from training_runs import launcher, losses, run_and_kill, run_crashing, run_through

from cloudckpt import (
    CheckpointManager,
    ConfigError,
    LocalTier,
    ManagerOptions,
    Preemption,
    StepInfo,
)
from cloudckpt.core.listing import list_checkpoints
from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.storage import open_store
from cloudckpt.training import tiers

STEPS = 12
#: Local saves at steps 1, 3, 5, 7, 9, 11; every 2nd drained: 3, 7, 11.
TIER_ARGS = ("--every", "0", "--local-every", "2", "--drain-every", "2")


def command(backend, root: str, local: Path, *extra: str) -> list[str]:
    return [*launcher(2), EXAMPLE, "--root", root, "--storage-options", backend.options_json(),
            "--steps", str(STEPS), "--local-dir", str(local), *TIER_ARGS, *extra]


def run_to_end(backend, root: str, local: Path, out: Path, *extra: str) -> str:
    return run_through(command(backend, root, local, "--out", str(out), *extra), env(backend))


def committed(backend, root: str) -> list[int]:
    store = open_store(root, backend.options)
    return [c.step for c in list_checkpoints(store) if c.committed]


def local_steps(local: Path, rank: int) -> list[int]:
    d = local / f"rank-{rank:05d}"
    return sorted(int(p.name.split("-")[1]) for p in d.iterdir()
                  if (p / "cloudckpt-manifest.json").exists()) if d.exists() else []


class _OnDisk:
    """A bucket on local disk, for runs whose checkpoints nobody looks at."""

    def options_json(self) -> str:
        return "{}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A run that never stopped (with the same tiers, on local disk): its losses and
    its final parameters."""
    tmp = tmp_path_factory.mktemp("tier-ref")
    out = run_to_end(_OnDisk(), str(tmp / "bucket"), tmp / "local", tmp / "ref.pt")
    assert sorted(losses(out)) == list(range(STEPS))
    return losses(out), tmp / "ref.pt"


def test_sigkill_during_a_drain_resumes_the_newer_local_step(s3, tmp_path, reference):
    ref_losses, ref_params = reference
    root, local = s3.uri("drain-kill"), tmp_path / "nodes"
    crash = run_crashing(command(s3, root, local, "--crash-mid-drain", "7"), env(s3),
                         "crashing mid-drain of step 7")
    # The bucket keeps the previous drained step; step 7's drain never committed.
    assert committed(s3, root) == [3]
    common = set(local_steps(local, 0)) & set(local_steps(local, 1))
    assert 7 in common and max(common) > 3

    resumed = run_to_end(s3, root, local, tmp_path / "a.pt")
    assert f"resumed at step {max(common) + 1}" in resumed  # the local tier, not the bucket
    assert_same_run(ref_losses, crash, resumed)
    assert_same_params(ref_params, tmp_path / "a.pt")
    if max(common) < 11:  # a slow drain of step 7 may let the first run save 11 locally
        assert committed(s3, root)[-1] == 11  # and the drains go on


def test_one_rank_without_its_local_tier_sends_the_job_to_the_bucket(s3, tmp_path, reference):
    ref_losses, ref_params = reference
    root, local = s3.uri("node-lost"), tmp_path / "nodes"
    first = run_and_kill(command(s3, root, local), env(s3), kill_at_step=10)
    bucket = committed(s3, root)
    assert bucket and max(bucket) < max(local_steps(local, 1))  # local is newer
    shutil.rmtree(local / "rank-00001")  # rank 1's node was replaced

    resumed = run_to_end(s3, root, local, tmp_path / "b.pt")
    assert f"resumed at step {max(bucket) + 1}" in resumed  # every rank from the bucket
    assert_same_run(ref_losses, first, resumed)
    assert_same_params(ref_params, tmp_path / "b.pt")


def test_sigkill_during_a_local_save_resumes_the_previous_local_step(s3, tmp_path, reference):
    ref_losses, ref_params = reference
    root, local = s3.uri("local-kill"), tmp_path / "nodes"
    crash = run_crashing(command(s3, root, local, "--crash-mid-save", "9"), env(s3),
                         "crashing mid-save of step 9")
    assert 9 not in local_steps(local, 0) and 7 in local_steps(local, 0)
    assert (local / "rank-00000" / "step-9").exists()  # torn: written, never committed

    resumed = run_to_end(s3, root, local, tmp_path / "c.pt")
    assert "resumed at step 8" in resumed
    assert_same_run(ref_losses, crash, resumed)
    assert_same_params(ref_params, tmp_path / "c.pt")


# ------------------------------------------------------------ one process


def _train(mgr: CheckpointManager, model: torch.nn.Linear, steps: range
           ) -> dict[int, torch.Tensor]:
    """A save (when due) after each step's update; the weight after each step."""
    weights = {}
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)
        weights[step] = model.weight.detach().clone()
        mgr.save(StepInfo(epoch_step=step, global_step=step, steps_per_epoch=100),
                 {"model": model.state_dict()})
    return weights


def _weight_after_restore(mgr: CheckpointManager) -> tuple[StepInfo | None, torch.Tensor]:
    model = torch.nn.Linear(4, 4)
    state = {"model": model.state_dict()}
    info = mgr.restore(state)
    return info, state["model"]["weight"]


def test_retention_per_tier_and_the_drained_checkpoint_is_standard(s3, tmp_path):
    tier = LocalTier(str(tmp_path / "local"), every_steps=1, drain_every=3, keep_last=2)
    opts = ManagerOptions(keep_last=1, local=tier)
    model = torch.nn.Linear(4, 4)
    with CheckpointManager(s3.root, opts, storage_options=s3.options) as mgr:
        weights = _train(mgr, model, range(7))
    assert local_steps(tmp_path / "local", 0) == [5, 6]
    assert committed(s3, s3.root) == [6]  # drains at 2 and 5, 6 at close; the bucket keeps one
    record = json.loads(open_store(s3.root, s3.options).get("cloudckpt-tiers.json"))
    assert record["complete"] == [5, 6] and record["ranks"][0]["steps"] == [5, 6]
    assert record["ranks"][0]["host"] == socket.gethostname()
    # The drained checkpoint is a training checkpoint torch's own reader loads.
    import torch.distributed.checkpoint as dcp

    from cloudckpt.movement.checkpoint_copy import download

    download(s3.uri("step-6"), tmp_path / "down", s3.options)
    state = {"model": torch.nn.Linear(4, 4).state_dict()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(tmp_path / "down" / "model")))
    assert torch.equal(state["model"]["weight"], weights[6])


def test_resume_prefers_local_then_falls_back_to_the_bucket(s3, tmp_path, caplog):
    tier = LocalTier(str(tmp_path / "local"), every_steps=1, drain_every=2,
                     drain_at_close=False)
    opts = ManagerOptions(local=tier)
    model = torch.nn.Linear(4, 4)
    with CheckpointManager(s3.root, opts, storage_options=s3.options) as mgr:
        weights = _train(mgr, model, range(3))  # local 1, 2; step 1 drained to the bucket
    assert "step(s) [2] are only on the nodes' local disks" in caplog.text  # said at close
    info, weight = _weight_after_restore(CheckpointManager(s3.root, opts,
                                                           storage_options=s3.options))
    assert info.global_step == 2 and torch.equal(weight, weights[2])

    # A local copy damaged on disk: the job falls back to the bucket, saying so.
    victim = next((tmp_path / "local" / "rank-00000" / "step-2" / "model").glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    info, weight = _weight_after_restore(CheckpointManager(s3.root, opts,
                                                           storage_options=s3.options))
    assert info.global_step == 1 and torch.equal(weight, weights[1])
    assert "cannot be resumed from" in caplog.text


def test_a_local_file_changed_after_its_commit_stops_the_drain(s3, tmp_path):
    tier = LocalTier(str(tmp_path / "local"), every_steps=1)
    mgr = CheckpointManager(s3.root, ManagerOptions(local=tier), storage_options=s3.options)
    _train(mgr, torch.nn.Linear(4, 4), range(1))
    copies = tiers.LocalCopies(tier, mgr.managed)
    local = copies.open("step-0")
    state = local.store.path("state/rank-00000.bin")
    data = bytearray(Path(state).read_bytes())
    data[-1] ^= 0xFF
    Path(state).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="changed after its local commit"):
        tiers.drain(local, mgr.store.child("step-0"))
    assert committed(s3, s3.root) == []


def test_merge_keeps_one_copy_of_each_replicated_chunk():
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def rank_md(r: int) -> Metadata:
        props = TensorProperties(dtype=torch.float32)
        whole = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
        half = ChunkStorageMetadata(offsets=torch.Size([2 * r]), sizes=torch.Size([2]))
        return Metadata(
            state_dict_metadata={
                "replicated": TensorStorageMetadata(props, torch.Size([4]), [whole]),
                "sharded": TensorStorageMetadata(props, torch.Size([4]), [half])},
            storage_data={
                MetadataIndex("replicated", torch.Size([0])): _StorageInfo(f"__{r}_0.distcp",
                                                                          0, 16),
                MetadataIndex("sharded", torch.Size([2 * r])): _StorageInfo(f"__{r}_1.distcp",
                                                                           0, 8)})

    merged, used = tiers.merge_metadata([rank_md(0), rank_md(1)])
    assert len(merged.state_dict_metadata["replicated"].chunks) == 1
    assert len(merged.state_dict_metadata["sharded"].chunks) == 2
    assert used == {"__0_0.distcp", "__0_1.distcp", "__1_1.distcp"}  # rank 1's copy stays


# ------------------------------------------------------------ close, on two gloo ranks


def _close(s3, tmp_path: Path, mode: str) -> list[dict]:
    ranks = run_ranks("tier_workers.close_drain", 2, s3.root, s3.options,
                      str(tmp_path / "nodes"), mode, timeout=240)
    return [ranks[0], ranks[1]]


def test_close_drains_the_newest_local_step_and_it_restores_bit_exact(s3, tmp_path):
    """Local saves only (no drain_every): close() commits the newest local step in the
    bucket, says so, and a fresh manager on both ranks restores it bit-exact."""
    ranks = _close(s3, tmp_path, "drain")
    assert committed(s3, s3.root) == [3]
    assert f"INFO local tier: drained step 3 to {s3.uri('step-3')} at close" in \
        ranks[0]["logged"]
    for r, out in enumerate(ranks):
        assert "error" not in out, out["error"]
        assert not any("only on the nodes' local disks" in line for line in out["logged"])
        assert out["restored"]["step"] == 3 and out["restored"]["same"]
        assert out["restored"]["position"] == out["position"] == 100 * r + 3


def test_close_without_drain_at_close_warns_and_leaves_the_bucket_alone(s3, tmp_path):
    ranks = _close(s3, tmp_path, "keep")
    assert committed(s3, s3.root) == []
    assert "WARNING local tier: step(s) [0, 1, 2, 3] are only on the nodes' local disks, " \
        "not in the bucket: a lost node loses them" in ranks[0]["logged"]
    assert all(out["restored"] is None and "error" not in out for out in ranks)
    assert local_steps(tmp_path / "nodes", 1) == [2, 3]  # still there, on the nodes


def test_close_does_not_drain_again_what_the_bucket_holds(s3, tmp_path):
    """The newest local step was drained on schedule: close() sends nothing more."""
    ranks = _close(s3, tmp_path, "held")
    assert ranks[0]["drains"] == [1, 3]  # the scheduled drains only, no third one
    assert committed(s3, s3.root) == [1, 3]
    assert not any("at close" in line for out in ranks for line in out["logged"])
    assert all(out["restored"]["same"] and "error" not in out for out in ranks)


@pytest.mark.parametrize("mode, says", [
    ("lost", "CheckpointNotFoundError"),
    ("late", "IncompleteCheckpointError: .*was written .* after its deadline")])
def test_a_drain_at_close_that_fails_or_runs_late_raises_on_every_rank(s3, tmp_path, mode,
                                                                        says):
    """Rank 1's newest local copy gone, or a drain_timeout no drain meets: close()
    raises on both ranks (no hang), nothing is committed, and it says the step is
    only on the nodes' disks."""
    ranks = _close(s3, tmp_path, mode)
    for out in ranks:
        assert re.match(says, out["error"]), out["error"]
        assert out["restored"] is None
    assert committed(s3, s3.root) == []
    if mode == "late":
        assert any(line.startswith("ERROR local tier: the drain at close of step 3") and
                   "only on the nodes' local disks" in line for line in ranks[0]["logged"])


def test_a_local_step_one_rank_refuses_is_loaded_by_no_rank(s3, tmp_path):
    """Rank 1's local copy of the only step fails its check: rank 0 must not have
    loaded its own copy meanwhile, since nothing else resumes over it."""
    ranks = run_ranks("tier_workers.refused_local_step", 2, s3.root, s3.options,
                      str(tmp_path / "nodes"), timeout=240)
    for out in ranks.values():
        assert out["info"] is None and out["untouched"], out
    assert any("cannot be resumed from" in line for line in ranks[0]["logged"])


def test_close_skips_a_step_another_drain_committed(s3, tmp_path, caplog):
    """The bucket holds the newest local step already (drained by another process):
    close() finds it there and sends nothing."""
    tier = LocalTier(str(tmp_path / "local"), every_steps=1)
    drains = []
    mgr = CheckpointManager(s3.root, ManagerOptions(local=tier, on_report=lambda r: drains.append(
        r) if r.op == "drain" else None), storage_options=s3.options)
    _train(mgr, torch.nn.Linear(4, 4), range(2))
    there = tiers.drain(tiers.LocalCopies(tier, mgr.managed).open("step-1"),
                        mgr.store.child("step-1"))
    with caplog.at_level(logging.INFO, logger="cloudckpt"):
        mgr.close()
    assert drains == [] and "at close" not in caplog.text
    assert open_store(s3.uri("step-1"), s3.options).get("cloudckpt-manifest.json") == \
        there.store.get("cloudckpt-manifest.json")  # the same commit, not a new one


def test_close_does_not_mistake_another_run_of_steps_for_its_own(s3, tmp_path):
    """The bucket's step-1 is of an abandoned run of steps (other weights): close()
    must not take it for its own step 1 and drain nothing; the drain it tries is
    refused, loudly, as the name is taken."""
    from cloudckpt.errors import CommitConflictError

    old = CheckpointManager(s3.root, ManagerOptions(every_steps=1), storage_options=s3.options)
    _train(old, torch.nn.Linear(4, 4), range(2))
    old.close()
    tier = LocalTier(str(tmp_path / "local"), every_steps=1)
    mgr = CheckpointManager(s3.root, ManagerOptions(local=tier), storage_options=s3.options)
    torch.manual_seed(1)
    _train(mgr, torch.nn.Linear(4, 4), range(2))
    with pytest.raises(CommitConflictError):
        mgr.close()


@pytest.mark.parametrize("bad", [{"path": "s3://b/x"}, {"every_steps": 0},
                                 {"drain_every": -1}, {"keep_last": 0}, {"drain_timeout": 0}])
def test_a_bad_local_tier_is_refused(bad):
    with pytest.raises(ConfigError, match="LocalTier"):
        LocalTier(**{"path": "/tmp/x", "every_steps": 1, **bad})


# ------------------------------------------------------------ preemption


def _workers(launcher_pid: int) -> list[int]:
    """The training processes torchrun started (its children running the script)."""
    kids = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    return [int(k) for k in kids if "train_resume" in Path(f"/proc/{k}/cmdline").read_text()]


def run_and_preempt(cmd: list[str], environ: dict, at_step: int) -> tuple[int, str, str]:
    """Start a two-rank run and SIGTERM both ranks (as SLURM and Kubernetes do) once it
    has printed ``at_step``; return torchrun's status, its stdout and its stderr."""
    import signal

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environ, start_new_session=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(f"step {at_step} "):
            for pid in _workers(proc.pid):
                os.kill(pid, signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(seen) + out, err


PREEMPT_ARGS = ("--every", "4", "--step-seconds", "0.2")


@pytest.fixture(scope="module")
def preempt_reference(tmp_path_factory):
    """16 steps that never stopped: their losses and final parameters."""
    tmp = tmp_path_factory.mktemp("preempt-ref")
    ref = run_through([*launcher(2), EXAMPLE, "--root", str(tmp / "bucket"), "--steps", "16",
                       "--out", str(tmp / "ref.pt")], env(None))
    return losses(ref), tmp / "ref.pt"


@pytest.mark.parametrize("budget", [20.0, 0.01])
def test_sigterm_saves_once_within_the_budget_and_ends_the_ranks(s3, tmp_path, budget,
                                                                  preempt_reference):
    """SIGTERM to both ranks mid-training: with time enough, one save of the step they
    agree on commits, both ranks end by SIGTERM, and the relaunch resumes from it,
    bit-exact; with too little, that save stays invisible and the previous one resumes."""
    root = s3.uri(f"preempt-{budget}")
    base = [*launcher(2), EXAMPLE, "--root", root, "--storage-options", s3.options_json(),
            "--steps", "16", *PREEMPT_ARGS]
    ref_losses, ref_params = preempt_reference
    status, out, err = run_and_preempt([*base, "--preemption-budget", str(budget)], env(s3),
                                       at_step=9)
    assert status != 0
    ended = re.findall(r"rank\s*: (\d) \(local_rank: \d\)\n\s*exitcode\s*: (-?\d+)", err)
    assert sorted(ended) == [("0", "-15"), ("1", "-15")], err[-3000:]  # both by SIGTERM
    steps = committed(s3, root)
    if budget > 1:
        assert "preemption save committed" in err
        saved = max(steps)
        assert saved >= 9 and saved not in (3, 7, 11, 15)  # not a scheduled save
    else:
        assert "NOT committed" in err
        saved = max(steps)
        assert saved in (3, 7)  # only the scheduled saves
    resumed = run_through([*base, "--out", str(tmp_path / "p.pt")], env(s3))
    assert f"resumed at step {saved + 1}" in resumed
    assert_same_run(ref_losses, out, resumed)
    assert_same_params(ref_params, tmp_path / "p.pt")


def test_a_preemption_request_saves_the_next_step_and_returns(s3):
    """A framework with its own signal handling asks instead: the next save() call
    saves to the bucket (off schedule) and returns; ``preempted`` says stop."""
    opts = ManagerOptions(every_steps=100, preemption=Preemption(budget=30.0))
    mgr = CheckpointManager(s3.root, opts, storage_options=s3.options)
    try:
        assert not mgr.save(StepInfo(global_step=0), {"w": torch.zeros(3)})
        mgr.request_preemption_save()
        assert mgr.save(StepInfo(global_step=1), {"w": torch.ones(3)})
        assert mgr.preempted and committed(s3, s3.root) == [1]
        assert not mgr.save(StepInfo(global_step=2), {"w": torch.ones(3)})  # answered
    finally:
        mgr.close()
    with pytest.raises(ConfigError, match="needs ManagerOptions"):
        CheckpointManager(s3.root, storage_options=s3.options).request_preemption_save()


@pytest.mark.parametrize("bad", [{"budget": 0}, {"signals": ("SIGNOPE",)}])
def test_a_bad_preemption_policy_is_refused(bad):
    with pytest.raises(ConfigError, match="Preemption"):
        Preemption(**bad)
