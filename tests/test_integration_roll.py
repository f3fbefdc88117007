"""ROLL integration: uploaders registered into ROLL's registry dict and driven the
way ROLL drives them, concurrent per-rank uploads from real processes, atomic
visibility, pruning, one checkpoint's failure never touching the next, and a
SIGKILL + resume-from-bucket run that must match an uninterrupted one bit for bit.
A checkpoint whose parts never all arrive (expected_uploads set wrong) is reported, and
one missing what ROLL's resume reads is never committed.
(tests/compat/test_roll_compat.py drives the same through ROLL's own classes.)"""

from __future__ import annotations

import copy
import json
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cloudckpt_testkit import FaultPlan, FaultProxy
from helpers import finish
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from training_runs import launcher, losses, run_and_kill

from cloudckpt import (
    MANIFEST_NAME,
    CheckpointWriter,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    RetryPolicy,
    StorageError,
    list_checkpoints,
    open_checkpoint,
    open_store,
)
from cloudckpt.errors import EXIT_INCOMPLETE, ConfigError
from cloudckpt.integrations import roll
from cloudckpt.integrations.roll import (
    CKPT_RE,
    PARTS_DIR,
    GcsUploader,
    S3Uploader,
    download_checkpoint,
    register,
    upload_checkpoint,
    wrap_model_downloaders,
)

REPO = Path(__file__).parent.parent
EXAMPLE = REPO / "examples" / "roll" / "train.py"
CONFIG = REPO / "examples" / "roll" / "config.yaml"
RANK_SCRIPT = Path(__file__).parent / "roll_rank_upload.py"
PIPELINE_KEYS = {"kv", "log_history", "step"}
ROLL_LOG = roll.__name__  # each of its modules logs under its own name below it


def roll_manager_uploader(checkpoint_config: dict):
    """ROLL's CheckpointManager.__init__: deep-copy, pop ``type``, ``cls(**rest)``."""
    registry: dict = {"file_system": object}
    register(registry)
    cfg = copy.deepcopy(checkpoint_config)
    return registry[cfg.pop("type", "file_system")](**cfg)


def old_roll_latest(store_uri: str, options: dict) -> str | None:
    """ROLL's FileSystemUploader.get_latest_ckpt rule: the highest N among names
    matching ^checkpoint-(\\d+)$, no completeness check."""
    store = open_store(store_uri, options)
    pat = re.compile(r"^checkpoint-(\d+)$")
    names = [n for n in store.list_prefixes() if pat.search(n)]
    if not names:
        return None
    return store.child(max(names, key=lambda n: int(pat.search(n).group(1)))).uri


def dcp_metadata(world: int, size: int) -> bytes:
    """DCP's ``.metadata`` as torch's FileSystemWriter pickles it: one ``size``-byte
    item in each rank's ``__{rank}_0.distcp``."""
    index = {MetadataIndex(f"w{r}"): _StorageInfo(f"__{r}_0.distcp", 0, size)
             for r in range(world)}
    return pickle.dumps(Metadata({f"w{r}": BytesStorageMetadata() for r in range(world)},
                                 storage_data=index))


def stage_actor(root: Path, ckpt: str, rank: int, *, hf: bool = False, size: int = 1000,
                world: int = 1) -> Path:
    """An actor rank's local dir: its DCP shard, and (rank 0, as DCP's coordinator) the
    ``.metadata`` naming every rank's shard."""
    d = root / f"actor_train-{rank}" / ckpt
    (d / "dcp").mkdir(parents=True, exist_ok=True)
    (d / "dcp" / f"__{rank}_0.distcp").write_bytes(os.urandom(size))
    if rank == 0:
        (d / "dcp" / ".metadata").write_bytes(dcp_metadata(world, size))
    if hf:
        (d / "config.json").write_text('{"model_type": "tiny"}')
        (d / "model.safetensors").write_bytes(os.urandom(2048))
    return d


def stage_pipeline(root: Path, ckpt: str, step: int) -> Path:
    d = root / "pipeline" / ckpt
    (d / "pipeline").mkdir(parents=True, exist_ok=True)
    state = {"kv": {"dataloader": {"epoch": 0, "pos": step}}, "log_history": [], "step": step}
    (d / "pipeline" / "worker_state_pipeline.json").write_text(
        json.dumps(state, indent=2, sort_keys=True))
    (d / "pipeline" / "rng_state_pipeline.pth").write_bytes(b"rng")
    return d


def config(s3, **extra) -> dict:
    """An uploader config; ``download_dir`` from this module's ``s3`` fixture, when used."""
    where = {"download_dir": str(s3.download_dir)} if hasattr(s3, "download_dir") else {}
    return {"type": "s3", "output_dir": s3.root, "async_upload": False, "keep_local_file": True,
            "storage_options": s3.options, **where, **extra}


@pytest.fixture
def s3(s3, tmp_path):
    """The S3 backend, plus where get_latest_ckpt may download to in this test."""
    s3.download_dir = tmp_path / "latest"
    return s3


def commit_checkpoint(up, tmp: Path, step: int) -> None:
    ckpt = f"checkpoint-{step}"
    up.upload(ckpt, str(stage_actor(tmp / str(step), ckpt, 0, hf=True)))
    up.upload(ckpt, str(stage_pipeline(tmp / str(step), ckpt, step)))
    up.wait()


def test_driven_like_roll_layout_and_invisible_until_complete(s3, tmp_path):
    cfg = config(s3, expected_uploads=2, use_hard_links=False)  # an unknown ROLL key too
    up = roll_manager_uploader(cfg)
    assert isinstance(up, S3Uploader)
    # get_latest_ckpt(checkpoint_config) in ROLL calls cls(**config) with `type` still in
    also = S3Uploader(**cfg)
    assert also.get_latest_ckpt() is None and also.latest_uri() is None
    with pytest.raises(ConfigError, match="gcs"):
        S3Uploader(**{**cfg, "type": "gcs"})
    with pytest.raises(ConfigError, match="gs://"):
        GcsUploader(output_dir=s3.root)

    actor = stage_actor(tmp_path, "checkpoint-4", 0, hf=True)
    up.upload(ckpt_id="checkpoint-4", local_state_path=str(actor))
    assert up.latest_uri() is None and list_checkpoints(s3.root, s3.options) == []
    assert old_roll_latest(s3.root, s3.options) == s3.uri("checkpoint-4")  # old rule: torn!
    pipe = stage_pipeline(tmp_path, "checkpoint-4", 4)
    up.upload(ckpt_id="checkpoint-4", local_state_path=str(pipe))

    assert also.latest_uri() == s3.uri("checkpoint-4")
    # get_latest_ckpt: a local directory (what ROLL's download_model passes through)
    latest = also.get_latest_ckpt()
    assert latest == str(s3.download_dir / "checkpoint-4")
    assert (Path(latest) / "dcp" / "__0_0.distcp").read_bytes() == (
        actor / "dcp" / "__0_0.distcp").read_bytes()
    ckpt = open_checkpoint(s3.uri("checkpoint-4"), s3.options)
    ckpt.verify(deep=True)
    expected = {"config.json", "model.safetensors", "dcp/.metadata", "dcp/__0_0.distcp",
                "pipeline/worker_state_pipeline.json", "pipeline/rng_state_pipeline.pth"}
    assert set(ckpt.files) == expected
    assert ckpt.step == 4 and ckpt.metadata["parts"] == ["actor_train-0", "pipeline"]
    # the prefix holds exactly the manifest's objects (part markers removed)
    store = open_store(s3.uri("checkpoint-4"), s3.options)
    assert {o.key for o in store.list()} == expected | {MANIFEST_NAME}
    state = json.loads(ckpt.read("pipeline/worker_state_pipeline.json"))
    assert set(state) == PIPELINE_KEYS and state["step"] == 4
    assert actor.exists() and pipe.exists()  # keep_local_file: True

    local = download_checkpoint(s3.root, tmp_path / "dl", s3.options)  # the latest
    assert local == str(tmp_path / "dl" / "checkpoint-4")
    assert (Path(local) / "model.safetensors").read_bytes() == (actor / "model.safetensors"
                                                                 ).read_bytes()


def upload_in_processes(cfg: dict, s3, ckpt: str, dirs: list[Path], go: Path,
                        status: int) -> list[str]:
    """One real process per part directory, uploading at once (as ROLL's workers do);
    each must exit with ``status``. Returns their stderr."""
    env = {**os.environ, **s3.env, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), json.dumps(cfg), ckpt, str(d),
                               str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for d in dirs]
    time.sleep(1.0)
    go.touch()
    errs = []
    for p in procs:
        out, err = finish(p, what="a ROLL rank's upload")
        assert p.returncode == status, err[-3000:]
        assert "uploaded" in out
        errs.append(err)
    return errs


def test_concurrent_rank_processes_commit_once_complete(s3, tmp_path):
    world = 4
    cfg = {**config(s3, expected_uploads=world + 1), "storage_options": json.loads(
        s3.options_json()), "attempt_id": "launch-1"}

    # round 1: every rank uploads into checkpoint-2 at once; the pipeline has not yet,
    # so each rank's wait() reports it (parts_timeout=0: at once) and exits non-zero
    ranks = [stage_actor(tmp_path, "checkpoint-2", r, size=300_000, world=world)
             for r in range(world)]
    errs = upload_in_processes({**cfg, "parts_timeout": 0}, s3, "checkpoint-2", ranks,
                               tmp_path / "go1", EXIT_INCOMPLETE)
    assert all("checkpoint-2 was NOT committed" in e and "of expected_uploads=5 parts" in e
               for e in errs), errs
    up = S3Uploader(**cfg)
    assert up.latest_uri() is None  # 4 of 5 parts: invisible
    info = list_checkpoints(s3.root, s3.options, include_uncommitted=True)
    assert [(i.name, i.committed) for i in info] == [("checkpoint-2", False)]
    up.upload("checkpoint-2", str(stage_pipeline(tmp_path, "checkpoint-2", 2)))
    assert up.latest_uri() == s3.uri("checkpoint-2")
    ckpt = open_checkpoint(s3.uri("checkpoint-2"), s3.options)
    ckpt.verify(deep=True)
    assert {f"dcp/__{r}_0.distcp" for r in range(world)} <= set(ckpt.files)
    assert len(ckpt.files) == world + 3

    # round 2: all five parts (pipeline included) race; exactly one commit wins
    dirs = [stage_actor(tmp_path / "b", "checkpoint-4", r, size=300_000, world=world)
            for r in range(world)]
    dirs.append(stage_pipeline(tmp_path / "b", "checkpoint-4", 4))
    upload_in_processes(cfg, s3, "checkpoint-4", dirs, tmp_path / "go2", 0)
    ckpt = open_checkpoint(s3.uri("checkpoint-4"), s3.options)
    ckpt.verify(deep=True)
    assert len(ckpt.files) == world + 3 and len(ckpt.metadata["parts"]) == world + 1
    assert not open_store(s3.uri("checkpoint-4"), s3.options).list(PARTS_DIR)


def test_torn_latest_old_rule_differs_and_download_verifies(s3, tmp_path):
    up = roll_manager_uploader(config(s3, expected_uploads=2))
    commit_checkpoint(up, tmp_path, 3)
    # checkpoint-6: the actor part arrived, the pipeline crashed before its upload
    up.upload("checkpoint-6", str(stage_actor(tmp_path / "6", "checkpoint-6", 0, hf=True)))
    assert old_roll_latest(s3.root, s3.options) == s3.uri("checkpoint-6")
    assert up.latest_uri() == s3.uri("checkpoint-3")
    assert up.get_latest_ckpt() == str(s3.download_dir / "checkpoint-3")
    assert download_checkpoint(s3.root, tmp_path / "dl", s3.options).endswith("checkpoint-3")
    with pytest.raises(IncompleteCheckpointError, match="torn"):
        download_checkpoint(s3.uri("checkpoint-6"), tmp_path / "dl2", s3.options)
    # a flipped byte in the bucket is caught on download
    store = open_store(s3.uri("checkpoint-3"), s3.options)
    data = bytearray(store.get("model.safetensors"))
    data[10] ^= 0xFF
    store.put("model.safetensors", bytes(data))
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        download_checkpoint(s3.uri("checkpoint-3"), tmp_path / "dl3", s3.options)


def test_a_checkpoint_under_another_name_or_kind_is_refused_before_it_downloads(s3, tmp_path):
    """checkpoint-3 copied to checkpoint-9 (its manifest still says step 3): ROLL would
    resume at step 3 from files named 9, then save over the names it skipped. The newest
    (what get_latest_ckpt takes) and the name itself are refused before a file comes
    down; a committed checkpoint-10 that is not ROLL's is refused too."""
    from cloudckpt.movement.checkpoint_copy import copy_checkpoint

    up = roll_manager_uploader(config(s3, expected_uploads=2))
    commit_checkpoint(up, tmp_path, 3)
    copy_checkpoint(s3.uri("checkpoint-3"), s3.uri("checkpoint-9"), src_options=s3.options,
                    dst_options=s3.options)
    for where in (s3.root, s3.uri("checkpoint-9")):
        with pytest.raises(CorruptCheckpointError, match="named for step 9 but its manifest"):
            download_checkpoint(where, tmp_path / "dl", s3.options)
    with pytest.raises(CorruptCheckpointError, match="named for step 9"):
        up.get_latest_ckpt()
    CheckpointWriter(s3.uri("checkpoint-10"), step=10, storage_options=s3.options).commit()
    with pytest.raises(CorruptCheckpointError, match="'generic' checkpoint, not a ROLL"):
        download_checkpoint(s3.uri("checkpoint-10"), tmp_path / "dl", s3.options)
    assert not (tmp_path / "dl").exists() and not s3.download_dir.exists()  # nothing came down


def test_stale_parts_of_a_crashed_attempt_are_not_committed(s3, tmp_path):
    first = roll_manager_uploader(config(s3, expected_uploads=2, attempt_id="a1"))
    first.upload("checkpoint-5", str(stage_pipeline(tmp_path / "a", "checkpoint-5", 5)))
    (tmp_path / "a" / "extra").mkdir()
    (tmp_path / "a" / "extra" / "only-a1.bin").write_bytes(b"x")
    first.upload("checkpoint-5", str(tmp_path / "a" / "extra"), part_id="other")
    # "other" was an a1 part too, but a1 then crashed; attempt a2 redoes step 5
    assert first.latest_uri() == s3.uri("checkpoint-5")  # a1 had 2 parts: committed
    first_ckpt = open_checkpoint(s3.uri("checkpoint-5"), s3.options)
    assert "only-a1.bin" in first_ckpt.files

    second = roll_manager_uploader(config(s3, expected_uploads=2, attempt_id="b2"))
    second.upload("checkpoint-7", str(stage_pipeline(tmp_path / "b", "checkpoint-7", 7)))
    old = roll_manager_uploader(config(s3, expected_uploads=2, attempt_id="a1"))
    old.upload("checkpoint-7", str(stage_actor(tmp_path / "old", "checkpoint-7", 1)))
    assert second.latest_uri() == s3.uri("checkpoint-5")  # a1's part does not count
    second.upload("checkpoint-7", str(stage_actor(tmp_path / "b", "checkpoint-7", 0)))
    ckpt = open_checkpoint(s3.uri("checkpoint-7"), s3.options)
    assert ckpt.metadata["attempt"] == "b2"
    assert "dcp/__1_0.distcp" not in ckpt.files and "dcp/__0_0.distcp" in ckpt.files
    store = open_store(s3.uri("checkpoint-7"), s3.options)
    assert {o.key for o in store.list()} == set(ckpt.files) | {MANIFEST_NAME}

    # without an attempt id, parts older than the uploader are a crashed attempt's
    anon_old = roll_manager_uploader(config(s3, expected_uploads=2))
    anon_old.upload("checkpoint-9", str(stage_actor(tmp_path / "c", "checkpoint-9", 0)))
    anon_new = roll_manager_uploader(config(s3, expected_uploads=2))
    anon_new.upload("checkpoint-9", str(stage_pipeline(tmp_path / "c", "checkpoint-9", 9)))
    assert anon_new.latest_uri() == s3.uri("checkpoint-7")


def test_the_attempt_under_ray_is_its_job_in_its_cluster(monkeypatch):
    """Every fresh Ray cluster numbers its first job 01000000: a relaunch on a new
    cluster is another attempt all the same (its session differs)."""
    from cloudckpt.integrations.roll.worker import attempt_from_env

    class Context:
        def __init__(self, session: str) -> None:
            self.session = session

        def get_job_id(self) -> str:
            return "01000000"

        def get_session_name(self) -> str:
            return self.session

    class Ray:
        session = ""

        def is_initialized(self) -> bool:
            return True

        def get_runtime_context(self) -> Context:
            return Context(self.session)

    ray = Ray()
    monkeypatch.delenv("CLOUDCKPT_ATTEMPT_ID", raising=False)
    monkeypatch.setitem(sys.modules, "ray", ray)
    ray.session = "session_2026-01-01_00-00-00_000001_100"
    crashed = attempt_from_env()
    ray.session = "session_2026-01-01_00-05-00_000001_100"
    assert attempt_from_env() not in ("", crashed)
    assert crashed.endswith("01000000")
    monkeypatch.setenv("CLOUDCKPT_ATTEMPT_ID", "launch-7")
    assert attempt_from_env() == "launch-7"


def test_max_ckpt_to_keep_prunes_the_bucket_but_not_young_torn(s3, tmp_path):
    up = roll_manager_uploader(config(s3, expected_uploads=2, max_ckpt_to_keep=2))
    torn = roll_manager_uploader(config(s3, expected_uploads=2))
    torn.upload("checkpoint-1", str(stage_actor(tmp_path / "t", "checkpoint-1", 0)))
    for step in (2, 4, 6, 8):
        commit_checkpoint(up, tmp_path, step)
    names = [(i.name, i.committed) for i in
             list_checkpoints(s3.root, s3.options, include_uncommitted=True)]
    assert sorted(names) == [("checkpoint-1", False), ("checkpoint-6", True),
                             ("checkpoint-8", True)]
    assert old_roll_latest(s3.root, s3.options) == s3.uri("checkpoint-8")
    eager = roll_manager_uploader(config(s3, expected_uploads=2, max_ckpt_to_keep=2,
                                         torn_grace_seconds=0))
    commit_checkpoint(eager, tmp_path, 10)
    names = sorted(i.name for i in list_checkpoints(s3.root, s3.options,
                                                    include_uncommitted=True))
    assert names == ["checkpoint-10", "checkpoint-8"]


def test_async_upload_survives_roll_deleting_local(s3, tmp_path):
    up = roll_manager_uploader(config(s3, expected_uploads=2, async_upload=True,
                                      keep_local_file=False))
    actor = stage_actor(tmp_path, "checkpoint-2", 0, hf=True, size=400_000)
    pipe = stage_pipeline(tmp_path, "checkpoint-2", 2)
    for d in (actor, pipe):
        up.upload(ckpt_id="checkpoint-2", local_state_path=str(d))
        shutil.rmtree(d)  # ROLL's CheckpointManager deletes it as soon as upload returns
    up.wait()
    open_checkpoint(s3.uri("checkpoint-2"), s3.options).verify(deep=True)
    assert not list(tmp_path.rglob(".cloudckpt-staging-*"))  # staging cleaned up


@pytest.mark.parametrize("async_upload", [True, False])
def test_a_failed_checkpoint_never_stops_the_next(s3, s3_server, tmp_path, caplog,
                                                  async_upload):
    """checkpoint-2's requests all get 503 until the retries give up; checkpoint-4,
    uploaded right after by the same uploader, commits."""
    with FaultProxy(s3_server.endpoint) as proxy:
        via = replace(s3, options={**s3.options, "endpoint_url": proxy.endpoint,
                                   "retry": RetryPolicy(initial_backoff=0.02, max_backoff=0.1,
                                                        deadline=1.0)})
        via.download_dir = s3.download_dir
        proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("slowdown",), match="checkpoint-2"))
        up = roll_manager_uploader({**config(via, expected_uploads=1, keep_local_file=False),
                                    "async_upload": async_upload})
        bad = stage_pipeline(tmp_path, "checkpoint-2", 2)
        with caplog.at_level(logging.ERROR, logger=ROLL_LOG):
            if async_upload:
                up.upload("checkpoint-2", str(bad))
                shutil.rmtree(bad)  # as ROLL's manager does once upload returns
            else:
                with pytest.raises(StorageError):
                    up.upload("checkpoint-2", str(bad))
            while not [r for r in caplog.records if r.name.startswith(f"{ROLL_LOG}.")]:
                time.sleep(0.05)  # checkpoint-2 has failed for good before checkpoint-4
            up.upload("checkpoint-4", str(stage_pipeline(tmp_path, "checkpoint-4", 4)))
            if async_upload:
                with pytest.raises(StorageError, match="checkpoint-2") as err:
                    up.wait()
                assert "checkpoint-4" not in str(err.value)
        assert up.latest_uri() == s3.uri("checkpoint-4")
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == ["checkpoint-4"]
    assert proxy.faults["slowdown"] >= 3
    errors = [r.getMessage() for r in caplog.records
              if r.levelno == logging.ERROR and r.name.startswith(f"{ROLL_LOG}.")]
    assert len(errors) == 1 and "checkpoint-2 was NOT saved" in errors[0]
    assert "Fix:" in errors[0] and "later checkpoints upload on their own" in errors[0]
    assert not list(tmp_path.rglob(".cloudckpt-staging-*"))
    # the files of the lost checkpoint are back where ROLL wrote them, as with a sync failure
    assert (bad / "pipeline" / "worker_state_pipeline.json").exists()
    # checkpoint-4 uploaded: a background upload deleted its copy; a synchronous one left
    # it to ROLL's manager, which deletes it when upload returns (ROLL's os.remove would
    # fail, and log "upload failed", on a copy already gone)
    assert (tmp_path / "pipeline" / "checkpoint-4").exists() == (not async_upload)


def roll_logs(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == level and r.name.startswith(f"{ROLL_LOG}.")]


def test_too_high_expected_uploads_is_reported_at_next_save_wait_and_resume(s3, tmp_path,
                                                                          caplog):
    """expected_uploads=3 with 2 parts a checkpoint: nothing can commit. Each checkpoint
    is an ERROR (counts, name, fix) at the next save and at wait(), which raises; the
    resume says what it skipped and that it starts from scratch."""
    cfg = config(s3, expected_uploads=3, parts_timeout=0)
    up = roll_manager_uploader(cfg)
    with caplog.at_level(logging.WARNING, logger=ROLL_LOG):
        for step in (2, 4):
            ckpt = f"checkpoint-{step}"
            up.upload(ckpt, str(stage_actor(tmp_path / str(step), ckpt, 0, hf=True)))
            up.upload(ckpt, str(stage_pipeline(tmp_path / str(step), ckpt, step)))
        errors = roll_logs(caplog, logging.ERROR)
        assert len(errors) == 1, errors  # at checkpoint-4's save: checkpoint-2 is lost
        for text in ("checkpoint-2 was NOT committed", "2 of expected_uploads=3 parts arrived "
                     "(actor_train-0, pipeline)", "expected_uploads is too high",
                     "set checkpoint_config.expected_uploads"):
            assert text in errors[0], errors[0]
        with pytest.raises(IncompleteCheckpointError, match="checkpoint-2, checkpoint-4 never "
                           "committed") as err:
            up.close()
        assert "2 of expected_uploads=3 parts arrived" in str(err.value)
        errors = roll_logs(caplog, logging.ERROR)
        assert len(errors) == 2 and "checkpoint-4 was NOT committed" in errors[1]
        up.wait()  # reported once: nothing new since

        caplog.clear()
        assert list_checkpoints(s3.root, s3.options) == []
        assert roll_manager_uploader(cfg).get_latest_ckpt() is None  # ROLL's resume value
    warnings = roll_logs(caplog, logging.WARNING)
    for step in (2, 4):
        assert any(f"skipping checkpoint-{step}: not committed: 2 of expected_uploads=3 parts "
                   "found (actor_train-0, pipeline)" in w for w in warnings), warnings
    assert any("starts from scratch" in w and "checkpoint-2, checkpoint-4" in w
               for w in warnings), warnings


def test_wait_waits_for_the_other_processes_parts(s3, tmp_path, caplog):
    """A rank done before the pipeline: wait() returns once the pipeline's part commits
    the checkpoint (no error), and reports a checkpoint only after parts_timeout."""
    rank = roll_manager_uploader(config(s3, expected_uploads=2, parts_timeout=30,
                                        attempt_id="run-1"))
    rank.upload("checkpoint-3", str(stage_actor(tmp_path, "checkpoint-3", 0)))
    pipeline = roll_manager_uploader(config(s3, expected_uploads=2, attempt_id="run-1"))
    late = threading.Timer(1.5, pipeline.upload,
                           ("checkpoint-3", str(stage_pipeline(tmp_path, "checkpoint-3", 3))))
    late.start()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=ROLL_LOG):
        rank.wait()
    late.join()
    assert 1.0 < time.monotonic() - t0 < 20
    assert rank.latest_uri() == s3.uri("checkpoint-3") and not roll_logs(caplog, logging.ERROR)

    alone = roll_manager_uploader(config(s3, expected_uploads=2, parts_timeout=1.5))
    alone.upload("checkpoint-6", str(stage_actor(tmp_path, "checkpoint-6", 0)))
    t0 = time.monotonic()
    with pytest.raises(IncompleteCheckpointError, match="checkpoint-6"):
        alone.wait()
    assert time.monotonic() - t0 >= 1.0


def test_too_low_expected_uploads_never_commits_missing_shards(s3, tmp_path):
    """expected_uploads=1, three real processes (two actor ranks of one DCP checkpoint and
    the pipeline), one after another: rank 0's part alone (its .metadata names rank 1's
    shard) and then with the pipeline's stays invisible; rank 1's part commits it, whole."""
    cfg = {**config(s3, expected_uploads=1, parts_timeout=0),
           "storage_options": json.loads(s3.options_json()), "attempt_id": "low-1"}
    rank0 = stage_actor(tmp_path, "checkpoint-5", 0, hf=True, world=2)
    errs = upload_in_processes(cfg, s3, "checkpoint-5", [rank0], tmp_path / "go",
                               EXIT_INCOMPLETE)
    for text in ("not committed yet", "dcp/.metadata names dcp/__1_0.distcp, which no part "
                 "uploaded", "pipeline/worker_state_pipeline.json is missing",
                 "checkpoint-5 was NOT committed", "expected_uploads is too low"):
        assert text in errs[0], errs[0]
    assert list_checkpoints(s3.root, s3.options) == []
    pipe = stage_pipeline(tmp_path, "checkpoint-5", 5)
    errs = upload_in_processes(cfg, s3, "checkpoint-5", [pipe], tmp_path / "go",
                               EXIT_INCOMPLETE)
    assert "__1_0.distcp, which no part uploaded" in errs[0]
    assert "worker_state_pipeline.json is missing" not in errs[0]
    assert list_checkpoints(s3.root, s3.options) == []
    rank1 = stage_actor(tmp_path, "checkpoint-5", 1, world=2)
    errs = upload_in_processes(cfg, s3, "checkpoint-5", [rank1], tmp_path / "go", 0)
    assert "more than expected_uploads=1" in errs[0] and "set expected_uploads to 3" in errs[0]

    ckpt = open_checkpoint(s3.uri("checkpoint-5"), s3.options)
    ckpt.verify(deep=True)
    assert ckpt.metadata["parts"] == ["actor_train-0", "actor_train-1", "pipeline"]
    local = Path(S3Uploader(**cfg).get_latest_ckpt())
    md = dcp.FileSystemReader(str(local / "dcp")).read_metadata()
    assert {i.relative_path for i in md.storage_data.values()} == {"__0_0.distcp",
                                                                    "__1_0.distcp"}
    assert all((local / "dcp" / i.relative_path).stat().st_size == 1000
               for i in md.storage_data.values())


def test_an_incomplete_local_checkpoint_is_never_committed(s3, tmp_path):
    """`upload` of a local checkpoint-N that ROLL could not resume from (a DCP shard or a
    rank's torch file missing, no pipeline state) refuses, naming what is missing."""
    rank0 = stage_actor(tmp_path / "a", "checkpoint-8", 0, world=2)
    with pytest.raises(IncompleteCheckpointError, match="pipeline/worker_state_pipeline.json "
                       "is missing.*__1_0.distcp, which no part uploaded"):
        upload_checkpoint(rank0, s3.root, s3.options)
    legacy = stage_pipeline(tmp_path / "b", "checkpoint-9", 9)
    for name in ("model_world_size_2_rank_0.pt", "optim_world_size_2_rank_0.pt",
                 "optim_world_size_2_rank_1.pt"):
        (legacy / name).write_bytes(b"torch")
    with pytest.raises(IncompleteCheckpointError, match="model_world_size_2_rank_1.pt is "
                       "missing") as err:
        upload_checkpoint(legacy, s3.root, s3.options)
    assert "optim_world_size_2_rank" not in str(err.value)
    assert list_checkpoints(s3.root, s3.options) == []
    (legacy / "model_world_size_2_rank_1.pt").write_bytes(b"torch")
    assert upload_checkpoint(legacy, s3.root, s3.options) == s3.uri("checkpoint-9")


def test_gcs_uploader_commits_and_finds_latest(gcs, tmp_path):
    up = roll_manager_uploader({"type": "gcs", "output_dir": gcs.root, "async_upload": True,
                                "keep_local_file": True, "expected_uploads": 2,
                                "storage_options": gcs.options,
                                "download_dir": str(tmp_path / "latest")})
    assert isinstance(up, GcsUploader)
    up.upload("checkpoint-2", str(stage_actor(tmp_path, "checkpoint-2", 0, hf=True)))
    markers = open_store(gcs.uri("checkpoint-2", PARTS_DIR), gcs.options)
    while not markers.list():  # not wait(): that would wait for the pipeline's part too
        time.sleep(0.05)
    assert up.get_latest_ckpt() is None
    up.upload("checkpoint-2", str(stage_pipeline(tmp_path, "checkpoint-2", 2)))
    up.wait()
    assert up.latest_uri() == gcs.uri("checkpoint-2")
    assert up.get_latest_ckpt() == str(tmp_path / "latest" / "checkpoint-2")
    open_checkpoint(gcs.uri("checkpoint-2"), gcs.options).verify(deep=True)


def test_model_download_registry_resumes_from_bucket_uri(s3, tmp_path):
    up = roll_manager_uploader(config(s3, expected_uploads=2))
    commit_checkpoint(up, tmp_path, 3)
    calls = []
    registry = {"MODELSCOPE": lambda name, local_dir=None: calls.append(name) or name}
    uploaders: dict = {}
    register(uploaders, registry)
    wrap_model_downloaders(registry, s3.options)  # again: with options, not double-wrapped
    assert registry["MODELSCOPE"]("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    path = registry["MODELSCOPE"](up.latest_uri(), str(tmp_path / "resume"))
    assert calls == ["Qwen/Qwen2.5-0.5B"] and path.endswith("checkpoint-3")
    assert json.loads((Path(path) / "pipeline" / "worker_state_pipeline.json").read_text()
                      )["step"] == 3
    assert set(uploaders) == {"s3", "gcs"} and roll.CKPT_RE is CKPT_RE


# --------------------------------------------------------------- end to end

def run(s3, root: str, staging: Path, *extra: str, kill_at: int | None = None,
        until: Callable[[], bool] | None = None) -> str:
    cmd = [*launcher(2), str(EXAMPLE),
           "--config", str(CONFIG), "--storage-options", s3.options_json(),
           "--set", f"checkpoint_config.output_dir={root}", "--set", f"output_dir={staging}",
           "--step-delay", "0.15", *extra]
    env = {**os.environ, **s3.env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": str(REPO)}
    if kill_at is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "done" in proc.stdout
        return proc.stdout
    return run_and_kill(cmd, env, kill_at, until)


def test_sigkill_then_resume_from_bucket_is_bit_exact(s3, tmp_path):
    ref_out = run(s3, s3.uri("ref"), tmp_path / "ref", "--out", str(tmp_path / "ref.pt"))
    reference = losses(ref_out)
    assert sorted(reference) == list(range(12))
    ref_params = torch.load(tmp_path / "ref.pt", weights_only=True)

    # layout of the last checkpoint (pruned to max_ckpt_to_keep=2 in the bucket too)
    assert [c.name for c in list_checkpoints(s3.uri("ref"), s3.options)] == [
        "checkpoint-9", "checkpoint-11"]
    last = open_checkpoint(s3.uri("ref", "checkpoint-11"), s3.options)
    assert set(last.files) == {
        "config.json", "model.safetensors", "dcp/.metadata", "dcp/__0_0.distcp",
        "dcp/__1_0.distcp", "rng_state/rng_state_0.pth", "rng_state/rng_state_1.pth",
        "pipeline/worker_state_pipeline.json", "pipeline/rng_state_pipeline.pth"}
    raw = last.read("pipeline/worker_state_pipeline.json").decode()
    state = json.loads(raw)
    assert set(state) == PIPELINE_KEYS and state["step"] == 11
    assert raw == json.dumps(state, indent=2, sort_keys=True)
    assert not list((tmp_path / "ref").rglob("*.distcp"))  # keep_local_file: false

    # killed right after the async save of step 6 started (resume off: uploads stay
    # async; on a busy machine, once step 3's has committed), then resumed with
    # `resume_from_checkpoint: true` (uploads sync, as in ROLL)
    first = run(s3, s3.uri("a"), tmp_path / "a", "--set", "resume_from_checkpoint=false",
                kill_at=7, until=lambda: bool(list_checkpoints(s3.uri("a"), s3.options)))
    second = run(s3, s3.uri("a"), tmp_path / "a", "--out", str(tmp_path / "a.pt"))
    m = re.search(r"resumed at step (\d+) from (\S+)", second)
    assert m and int(m.group(1)) in (4, 7, 10), second
    assert m.group(2).startswith(str(tmp_path / "a" / "resume" / "checkpoint-"))
    merged = {**losses(first), **losses(second)}
    assert merged == reference
    for part in (first, second):
        assert all(reference[s] == v for s, v in losses(part).items())
    params = torch.load(tmp_path / "a.pt", weights_only=True)
    assert params.keys() == ref_params.keys()
    assert all(torch.equal(params[k], ref_params[k]) for k in params)

    # killed later; the documented `fetch` command downloads the latest committed
    # checkpoint and its path is the resume value (a string keeps uploads async)
    run(s3, s3.uri("b"), tmp_path / "b", kill_at=10)
    opts = [f"-o{k}={json.dumps(v) if not isinstance(v, str) else v}"
            for k, v in json.loads(s3.options_json()).items()]
    fetched = subprocess.run([str(Path(sys.executable).with_name("cloudckpt")), "roll", *opts,
                              "fetch", s3.uri("b"), str(tmp_path / "fetched")],
                             capture_output=True, text=True, env={**os.environ, **s3.env},
                             cwd=REPO, timeout=60)
    assert fetched.returncode == 0, fetched.stderr
    latest = fetched.stdout.strip()
    assert Path(latest).is_dir() and CKPT_RE.match(Path(latest).name)
    third = run(s3, s3.uri("b"), tmp_path / "b", "--set", f"resume_from_checkpoint={latest}",
                "--out", str(tmp_path / "b.pt"))
    assert f"from {latest}" in third
    assert all(reference[s] == v for s, v in losses(third).items())
    params = torch.load(tmp_path / "b.pt", weights_only=True)
    assert all(torch.equal(params[k], ref_params[k]) for k in params)


def run_example(s3, root: str, staging: Path, *extra: str) -> subprocess.CompletedProcess:
    """examples/roll/train.py on one process with config.yaml as written (whose
    expected_uploads: 3 counts 2 actor ranks and the pipeline)."""
    cmd = [*launcher(1), str(EXAMPLE), "--config", str(CONFIG), "--storage-options",
           s3.options_json(), "--set", f"checkpoint_config.output_dir={root}",
           "--set", f"output_dir={staging}", *extra]
    env = {**os.environ, **s3.env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)


def test_example_on_one_process_with_too_high_expected_uploads_fails_loudly(s3, tmp_path):
    """The documented config on one process: 2 parts a checkpoint, 3 expected. The run
    names every checkpoint as an ERROR with its counts (at the next save, parts_timeout=0
    here, and at wait()) and exits with EXIT_INCOMPLETE; a `resume_from_checkpoint: true`
    run then says it skips them and starts from scratch."""
    first = run_example(s3, s3.root, tmp_path / "a", "--set", "checkpoint_config.parts_timeout=0")
    assert first.returncode == EXIT_INCOMPLETE, first.stderr[-3000:]
    assert "saving step 11" in first.stdout and "done" not in first.stdout
    lost = re.findall(r"^ERROR cloudckpt\.integrations\.roll\.\w+: (checkpoint-\d+) was NOT "
                      r"committed to " + re.escape(s3.root) + r": 2 of expected_uploads=3 "
                      r"parts arrived \(actor_train-0, pipeline\).*"
                      r"set checkpoint_config\.expected_uploads", first.stderr, re.M)
    assert lost == ["checkpoint-3", "checkpoint-6", "checkpoint-9", "checkpoint-11"], (
        first.stderr[-3000:])
    assert ("error: checkpoint-3, checkpoint-6, checkpoint-9, checkpoint-11 never committed"
            in first.stderr)
    assert list_checkpoints(s3.root, s3.options) == []

    second = run_example(s3, s3.root, tmp_path / "b", "--set", "max_steps=1")
    assert second.returncode == 0 and "done" in second.stdout, second.stderr[-3000:]
    assert "resumed at step" not in second.stdout
    skipped = re.findall(r"^WARNING cloudckpt\.integrations\.roll\.\w+: resume from \S+: "
                         r"skipping (checkpoint-\d+): not committed: 2 of expected_uploads=3 "
                         r"parts found \(actor_train-0, pipeline\)", second.stderr, re.M)
    assert skipped == lost, second.stderr[-3000:]
    assert "the run starts from scratch" in second.stderr
