"""ROLL with ``checkpoint_config.type: s3`` and no user code: ROLL's CheckpointManager in
Ray worker processes of a real local Ray (roll_ray_driver.py), bound by ``cloudckpt
run``, uploads, commits, and resumes through ROLL's own ``get_latest_ckpt``. Without
activation, ROLL behaves as before: ``s3`` is not a type it knows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cloudckpt import list_checkpoints, open_checkpoint

HERE = Path(__file__).resolve().parent
ROLL_SRC = HERE.parents[2] / "shared" / "peers" / "roll" / "src"


def run_driver(s3, tmp_path: Path, *, activate: bool) -> tuple[dict, str]:
    config = {"checkpoint_config": {"type": "s3", "output_dir": s3.root,
                                    "download_dir": str(tmp_path / "latest"),
                                    "expected_uploads": 2}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out.json"
    # RAY_DEDUP_LOGS=0: Ray folds lines differing only by pid, and each pid's line is checked.
    env = {**os.environ, **s3.env, "ROLL_LOG_DIR": str(tmp_path / "roll-logs"),
           "RAY_DEDUP_LOGS": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROLL_SRC), str(HERE),
                                                       os.environ.get("PYTHONPATH")]))}
    launch = [sys.executable, str(HERE / "roll_ray_driver.py"), str(tmp_path / "config.json"),
              str(out)]
    if activate:
        launch = [sys.executable, "-m", "cloudckpt", "run", "--", *launch]
    r = subprocess.run(launch, env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text()), r.stderr


def test_roll_workers_in_ray_upload_commit_and_resume_under_activation(s3, tmp_path):
    seen, stderr = run_driver(s3, tmp_path, activate=True)
    assert "error" not in seen, seen.get("error")
    # Each Ray worker process (and the task's) bound the integration itself: one line each.
    for pid in seen["pids"]:
        assert "bound the roll integration into roll (code sha256:" in stderr
        assert f"pid {pid}: roll.utils.checkpoint_manager.uploader_registry['s3']" in stderr
    (ckpt,) = list_checkpoints(s3.root, s3.options)
    assert ckpt.name == "checkpoint-3"
    committed = open_checkpoint(ckpt.uri, s3.options)
    committed.verify(deep=True)
    assert {"dcp/.metadata", "pipeline/worker_state_pipeline.json"} <= set(committed.files)
    resumed = seen["resumed"]
    assert resumed["step"] == 3 and Path(resumed["latest"]).name == "checkpoint-3"
    assert resumed["tensors"] == seen["saved"]  # bit-exact, loaded by a fresh worker


def test_without_activation_roll_knows_no_s3(s3, tmp_path):
    seen, stderr = run_driver(s3, tmp_path, activate=False)
    assert "Unknown tracker name: s3" in seen["error"]
    assert "bound the roll integration" not in stderr
    assert list_checkpoints(s3.root, s3.options) == []
