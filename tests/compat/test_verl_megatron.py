"""verl 0.9.1's Megatron checkpoint manager on a bucket, by local staging, on 2 gloo
ranks (verl_megatron_ranks.py names its stand-in and why): verl's save writes its v2
layout in a staging directory, which is committed as the role's part; a load downloads
it once per host and runs verl's load there. A Megatron step verl wrote locally goes
up with ``cloudckpt verl upload``, and comes down with ``download``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_megatron_role_commits_from_staging_and_loads_from_a_download(s3, tmp_path):
    role = f"{s3.root}/global_step_2/actor"
    out, stage = tmp_path / "out", tmp_path / "stage"
    stage.mkdir()
    r = subprocess.run([sys.executable, "-m", "cloudckpt", "run", "--", sys.executable,
                        str(HERE / "verl_megatron_ranks.py"), role, str(out)],
                       env={**os.environ, **s3.env, "CLOUDCKPT_STAGING": str(stage)},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rep in reports:
        assert "error" not in rep, rep.get("traceback")
        assert rep["verl_class_bound"] is True  # activation bound verl's own class
        assert rep["same"] is True  # every rank's model, optimizer and extra state back
        assert rep["both_ways"] == [True, True]  # uploaded, then downloaded: the same
        assert "async_save: false" in rep["async_error"]
    part = reports[0]
    assert part["kind"] == "verl-role"
    assert part["metadata"]["layout"] == "verl-megatron" and part["metadata"]["world_size"] == 2
    for sub in ("model", "optimizer", "extra"):
        assert {f"{sub}/dist_ckpt/.metadata", f"{sub}/dist_ckpt/metadata.json",
                f"{sub}/dist_ckpt/__0_0.distcp", f"{sub}/dist_ckpt/__1_0.distcp"} <= \
            set(part["files"])
    assert {"ckpt_contents.json", "transformer_config.json"} <= set(part["files"])
    assert list(stage.iterdir()) == []  # both staging copies (save, load) removed
    assert "verl.utils.checkpoint.megatron_checkpoint_manager.MegatronCheckpointManager." \
        "save_checkpoint" in r.stderr
