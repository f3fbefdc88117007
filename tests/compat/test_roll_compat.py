"""ROLL's own checkpoint code drives cloudckpt: ``CheckpointManager`` builds our
uploaders from ``uploader_registry`` and calls them as ROLL's pipeline and FSDP2
workers do; ``get_latest_ckpt`` and ``download_model`` resolve the resume value.

Stand-ins, each the smallest that keeps ROLL's file format (ROLL's strategy needs
CUDA, a Ray cluster and a HF model):

- the FSDP2 worker's ``_save_checkpoint_with_dcp`` / ``_load_checkpoint_with_dcp``
  (reference/fsdp2_strategy.py:371-430) become :func:`roll_dcp_save` /
  :func:`roll_dcp_load`: the same state dict (model tensors, the optimizer and
  scheduler as Stateful objects, ``rng_state``) through the same ``dcp.save`` /
  ``dcp.load``, in one process on CPU (no gloo group, no CUDA RNG);
- the pipeline's ``WorkerState`` JSON and RNG files (base_pipeline.py:119-121) are
  written with COMPAT.md's layout; ``BasePipeline.__init__``'s resume branch
  (base_pipeline.py:64-78) is :func:`roll_resume`, calling ROLL's real
  ``get_latest_ckpt`` and ``download_model``;
- ``download_model`` is called undecorated, from its wrapper's closure: the
  wrapper only caches the result in a Ray actor keyed by node IP, and a local Ray
  (seconds to start, GBs of shared memory on a 2-core box) plus its
  ``get_node_ip`` (a UDP connect towards 8.8.8.8, failing without a route) add
  nothing to what is tested: the path ``download_model`` returns.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from dataclasses import replace
from pathlib import Path

# ROLL's logger writes a file under ./output/logs at import unless told elsewhere.
os.environ.setdefault("ROLL_LOG_DIR", tempfile.mkdtemp(prefix="roll-logs-"))

import pytest  # noqa: E402
import yaml  # noqa: E402
from cloudckpt_testkit import FaultPlan, FaultProxy  # noqa: E402
from roll.utils import checkpoint_manager as roll_cm  # noqa: E402
from roll.utils import upload_utils  # noqa: E402
from roll.utils.checkpoint_manager import CheckpointManager, get_latest_ckpt  # noqa: E402
from roll_parts import Worker, assert_same, roll_dcp_load, stage_actor, stage_pipeline  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from cloudckpt import (
    IncompleteCheckpointError,
    RetryPolicy,
    StorageError,
    list_checkpoints,
    open_checkpoint,
)
from cloudckpt.integrations.roll import GcsUploader, S3Uploader, register  # noqa: E402
from cloudckpt.integrations.roll import resume as resume_module  # noqa: E402
from cloudckpt.integrations.roll import uploader as uploader_module  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ROLL_LOG = "cloudckpt.integrations.roll."  # each module logs under its own name below
#: The function ``@model_path_cache`` wraps (see the module docstring for why).
download_model = roll_cm.download_model.__closure__[0].cell_contents
register(upload_utils.uploader_registry)  # as every ROLL worker process must


# ------------------------------------------------------------- stand-ins

def save_like_roll(manager: CheckpointManager, root: Path, step: int, worker: Worker,
                   keep_local_file: bool = False) -> None:
    """One save step as ROLL makes it: the worker's upload call (fsdp2_strategy.py:606),
    then the pipeline's (base_pipeline.py:126)."""
    ckpt_id = f"checkpoint-{step}"
    manager.upload(ckpt_id=ckpt_id, local_state_path=str(stage_actor(root, ckpt_id, worker)),
                   keep_local_file=keep_local_file)
    manager.upload(ckpt_id=ckpt_id, local_state_path=str(stage_pipeline(root, ckpt_id, step)))


def roll_resume(resume_from_checkpoint, checkpoint_config: dict):
    """BasePipeline.__init__'s resume branch with ROLL's real functions: returns the
    directory ROLL resumes from (or False) and the WorkerState dict it loads."""
    resume = False
    if resume_from_checkpoint is True:
        latest = get_latest_ckpt(checkpoint_config)
        resume = download_model(latest) if latest else False
    elif isinstance(resume_from_checkpoint, str):
        resume = download_model(resume_from_checkpoint)
    if not resume:
        return False, None
    state = json.loads(Path(resume, "pipeline", "worker_state_pipeline.json").read_text())
    return resume, state


class UploaderErrors(logging.Handler):
    """The records (ERRORs by default) a roll module's own logger object emits. Not
    caplog: AReaL's ``getLogger`` (the AReaL tests run in this process) replaces
    logging's root and manager, which detaches loggers made before it from what caplog
    listens to."""

    def __init__(self, level: int = logging.ERROR) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def wait_for_errors(errors: UploaderErrors, n: int, timeout: float = 30.0) -> None:
    """Until the uploader has logged ``n`` ERRORs (a background failure has landed)."""
    deadline = time.monotonic() + timeout
    while sum(r.name.startswith(ROLL_LOG) for r in errors.records) < n:
        assert time.monotonic() < deadline, "the failed upload was never reported"
        time.sleep(0.05)


def ckpt_config(backend, tmp_path: Path, **extra) -> dict:
    return {"type": backend.name, "output_dir": backend.root, "storage_options": backend.options,
            "download_dir": str(tmp_path / "latest"), "expected_uploads": 2, **extra}


@pytest.fixture(params=["s3", "gcs"])
def bucket(request):
    return request.getfixturevalue(request.param)


# ----------------------------------------------------------------- tests

@pytest.mark.parametrize("incremental", [False, True])
def test_cloudckpt_to_bucket_to_roll_resume(bucket, tmp_path, monkeypatch, incremental):
    """ROLL's manager uploads through cloudckpt; ROLL's get_latest_ckpt + download_model
    resume bit-exactly, skipping (and naming) a newer torn checkpoint, which wait()
    reports; no model hub is reached. With ``incremental: true`` in checkpoint_config
    every file is a blob of the output directory's area, and the same holds."""
    hub_calls: list = []
    monkeypatch.setenv("MODEL_DOWNLOAD_TYPE", "HUGGINGFACE_HUB")
    monkeypatch.setitem(roll_cm.model_download_registry, "HUGGINGFACE_HUB",
                        lambda name, local_dir=None: hub_calls.append(name))
    cfg = ckpt_config(bucket, tmp_path, async_upload=True, parts_timeout=0,
                      incremental=incremental)
    assert roll_resume(True, cfg) == (False, None)  # an empty bucket starts afresh

    manager = CheckpointManager(checkpoint_config=cfg)
    assert isinstance(manager.uploader, (S3Uploader, GcsUploader))
    worker = Worker(seed=1)
    worker.train(3)
    save_like_roll(manager, tmp_path / "out", 3, worker)
    expected = {k: v.clone() for k, v in worker.tensors().items()}
    expected_sched = worker.scheduler.state_dict()
    worker.train(2)
    staged = stage_actor(tmp_path / "out", "checkpoint-5", worker)  # torn: no pipeline part
    manager.upload(ckpt_id="checkpoint-5", local_state_path=str(staged))
    with pytest.raises(IncompleteCheckpointError, match="checkpoint-5 never committed.*"
                       r"1 of expected_uploads=2 parts arrived \(actor_train-0\)"):
        manager.uploader.wait()
    assert not (tmp_path / "out" / "pipeline" / "checkpoint-3").exists()  # ROLL deleted it

    warnings = UploaderErrors(logging.WARNING)
    resume_module.log.addHandler(warnings)
    try:
        path, state = roll_resume(True, cfg)
    finally:
        resume_module.log.removeHandler(warnings)
    assert any("skipping checkpoint-5: not committed: 1 of expected_uploads=2 parts found "
               "(actor_train-0)" in r.getMessage() for r in warnings.records), warnings.records
    assert path == str(tmp_path / "latest" / "checkpoint-3") and state["step"] == 3
    committed = open_checkpoint(f"{bucket.root}/checkpoint-3", bucket.options)
    assert (committed.manifest.blob_depth == 1) is incremental
    committed.verify(deep=True)
    resumed = Worker(seed=99)
    roll_dcp_load(resumed, Path(path))
    assert_same(resumed.tensors(), expected)
    assert_same(load_file(str(Path(path) / "model.safetensors")),
                {k[len("model."):]: v for k, v in expected.items() if k.startswith("model.")})
    assert resumed.scheduler.state_dict() == expected_sched and expected_sched["last_epoch"] == 3
    # a string resume value: the directory `cloudckpt roll fetch` prints, which
    # download_model passes through unchanged
    assert roll_resume(path, cfg)[0] == path
    assert hub_calls == []
    # a bucket URI or "latest" as the value is what ROLL sends to the hub (why the docs
    # say `true` or a local directory)
    roll_resume("latest", cfg)
    assert hub_calls == ["latest"]


def test_roll_file_system_to_bucket_to_cloudckpt_resume(bucket, tmp_path):
    """ROLL's own FileSystemUploader writes a local checkpoint; the documented command
    commits it into the bucket; cloudckpt's uploader finds and resumes it bit-exactly."""
    local_root = tmp_path / "roll-fs"
    manager = CheckpointManager(checkpoint_config={"type": "file_system",
                                                   "output_dir": str(local_root)})
    worker = Worker(seed=2)
    worker.train(4)
    save_like_roll(manager, tmp_path / "out", 4, worker)
    ckpt_dir = manager.uploader.get_latest_ckpt()  # ROLL's rule, on local disk
    assert ckpt_dir == str(local_root / "checkpoint-4")

    opts = [f"-o{k}={v if isinstance(v, str) else json.dumps(v)}"
            for k, v in json.loads(bucket.options_json()).items()]
    proc = subprocess.run([str(Path(sys.executable).with_name("cloudckpt")), "roll", *opts,
                           "upload", ckpt_dir, bucket.root], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, **bucket.env}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == bucket.uri("checkpoint-4")
    ckpt = open_checkpoint(bucket.uri("checkpoint-4"), bucket.options)
    ckpt.verify(deep=True)
    local_files = {p.relative_to(ckpt_dir).as_posix() for p in Path(ckpt_dir).rglob("*")
                   if p.is_file()}
    assert set(ckpt.files) == local_files and "dcp/.metadata" in local_files

    up = CheckpointManager(checkpoint_config=ckpt_config(bucket, tmp_path)).uploader
    path = up.get_latest_ckpt()
    resumed = Worker(seed=77)
    roll_dcp_load(resumed, Path(path))
    assert_same(resumed.tensors(), worker.tensors())
    for rel in local_files:
        assert (Path(path) / rel).read_bytes() == (Path(ckpt_dir) / rel).read_bytes(), rel


@pytest.mark.parametrize("async_upload", [True, False])
def test_one_failed_upload_does_not_stop_the_next(s3, moto_server, tmp_path, async_upload):
    """503s on checkpoint-2 until the retries give up, via ROLL's manager and ROLL's
    pipeline executor (async) or inline (the sync path that resume=true forces);
    checkpoint-4 from the same processes commits; no staging directory remains."""
    with FaultProxy(moto_server.endpoint) as proxy:
        via = replace(s3, options={**s3.options, "endpoint_url": proxy.endpoint,
                                   "retry": RetryPolicy(initial_backoff=0.02, max_backoff=0.1,
                                                        deadline=1.0)})
        proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("slowdown",), match="checkpoint-2"))
        cfg = ckpt_config(via, tmp_path, async_upload=async_upload)
        manager = CheckpointManager(checkpoint_config=cfg)
        executor = futures.ThreadPoolExecutor(max_workers=5)  # BasePipeline.executor
        worker = Worker(seed=3)
        errors = UploaderErrors()
        uploader_module.log.addHandler(errors)
        try:
            for step in (2, 4):
                worker.train(1)
                if async_upload:  # base_pipeline.py:123-124
                    executor.submit(save_like_roll, manager, tmp_path / "out", step,
                                    worker).result()
                else:
                    save_like_roll(manager, tmp_path / "out", step, worker)
                wait_for_errors(errors, 2)  # checkpoint-2 has failed before checkpoint-4
            executor.shutdown()
            if async_upload:
                with pytest.raises(StorageError, match="checkpoint-2") as err:
                    manager.uploader.wait()
                assert "checkpoint-4" not in str(err.value)
        finally:
            uploader_module.log.removeHandler(errors)
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == ["checkpoint-4"]
    open_checkpoint(s3.uri("checkpoint-4"), s3.options).verify(deep=True)
    assert proxy.faults["slowdown"] >= 3
    ours = [r.getMessage() for r in errors.records if r.name.startswith(ROLL_LOG)]
    assert len(ours) == 2, ours  # both parts of checkpoint-2, nothing about checkpoint-4
    assert all("checkpoint-2 was NOT saved" in m and "Fix:" in m for m in ours)
    assert not list(tmp_path.rglob(".cloudckpt-staging-*"))
    # the lost checkpoint's files are where ROLL wrote them; the committed one's are gone
    assert (tmp_path / "out" / "pipeline" / "checkpoint-2" / "pipeline").is_dir()
    assert not (tmp_path / "out" / "pipeline" / "checkpoint-4").exists()
    path, state = roll_resume(True, ckpt_config(s3, tmp_path))
    assert state["step"] == 4 and Path(path).name == "checkpoint-4"


def test_documented_config_goes_through_roll(s3, tmp_path):
    """examples/roll/config.yaml (and the docs' YAML) as written: ROLL's manager builds
    the uploader from its checkpoint_config, and its resume value takes ROLL's
    get_latest_ckpt branch, the only one that reaches the bucket."""
    docs = (REPO / "docs" / "integrations" / "roll.md").read_text()
    blocks = [yaml.safe_load(b.split("```", 1)[0]) for b in docs.split("```yaml\n")[1:]]
    example = yaml.safe_load((REPO / "examples" / "roll" / "config.yaml").read_text())
    configs = [example, *[b for b in blocks if isinstance(b, dict) and "checkpoint_config" in b]]
    assert len(configs) >= 2
    for cfg in configs:
        assert cfg["resume_from_checkpoint"] is True, cfg
        ckpt_cfg = {**cfg["checkpoint_config"], "output_dir": s3.root,
                    "storage_options": s3.options, "download_dir": str(tmp_path / "dl")}
        manager = CheckpointManager(checkpoint_config=ckpt_cfg)
        assert isinstance(manager.uploader, S3Uploader)
        assert roll_resume(cfg["resume_from_checkpoint"], ckpt_cfg) == (False, None)
    manager = CheckpointManager(checkpoint_config={**ckpt_cfg, "async_upload": False,
                                                   "expected_uploads": 2})
    save_like_roll(manager, tmp_path / "out", 6, Worker(seed=4))
    path, state = roll_resume(True, ckpt_cfg)
    assert state["step"] == 6 and Path(path).is_dir()
