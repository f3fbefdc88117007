"""verl 0.9.1's SFT ``CheckpointHandler`` on a bucket, on 2 gloo ranks (verl_sft_ranks.py):
verl's own handler and ``FSDPEngine`` checkpoint calls save and resume each step under
``cloudckpt run``; without activation, verl resumes its own local copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cloudckpt import list_checkpoints, open_checkpoint
from cloudckpt.storage import open_store

HERE = Path(__file__).resolve().parent
TRACKER = "latest_checkpointed_iteration.txt"


def run_ranks(tmp_path: Path, plan: dict, env: dict, *, activate: bool = True
              ) -> tuple[list[dict], str]:
    name = f"run{len(list(tmp_path.glob('plan*.json')))}"
    plan_file, out = tmp_path / f"plan-{name}.json", tmp_path / name
    plan_file.write_text(json.dumps(plan))
    launch = [sys.executable, str(HERE / "verl_sft_ranks.py"), str(plan_file), str(out)]
    if activate:
        launch = [sys.executable, "-m", "cloudckpt", "run", "--", *launch]
    r = subprocess.run(launch, env={**os.environ, **env}, cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rep in reports:
        assert "error" not in rep, rep.get("traceback")
        assert rep["bound"] is activate
    return reports, r.stderr


def assert_resumed(reports: list[dict], which: int, step: int) -> None:
    """Every rank's resume number ``which`` brought back step ``step`` bit-exact: model
    shard, optimizer, scheduler, RNG, and its own dataloader position."""
    for rep in reports:
        got, saved = rep["resumed"][which], rep["saved"][str(step)]
        assert got["step"] == step
        assert got["digests"] == saved["digests"]
        assert got["next"] == saved["next"]
    assert reports[0]["saved"][str(step)]["next"] != reports[1]["saved"][str(step)]["next"]


def test_sft_steps_commit_to_s3_resume_auto_and_by_path_and_prune(s3, tmp_path):
    plan = {"root": s3.root, "keep": 2, "steps": [1, 2, 3],
            "resumes": [["auto", None], ["resume_path", f"{s3.root}/global_step_2"]]}
    reports, stderr = run_ranks(tmp_path, plan, s3.env)
    assert stderr.count("verl.utils.checkpoint.checkpoint_handler.CheckpointHandler."
                        "save_checkpoint") == 2  # each rank bound it, and said so
    assert_resumed(reports, 0, 3)
    assert_resumed(reports, 1, 2)
    # max_ckpt_to_keep after each commit, over whole committed steps
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == \
        ["global_step_2", "global_step_3"]
    step = open_checkpoint(f"{s3.root}/global_step_3", s3.options)
    step.verify(deep=True)
    assert step.manifest.kind == "verl-sft" and step.metadata["world_size"] == 2
    assert {"model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt",
            "optim_world_size_2_rank_1.pt", "extra_state_world_size_2_rank_0.pt",
            "fsdp_config.json", "huggingface/config.json", "data_0.pt",
            "data_1.pt"} <= set(step.files)
    assert open_store(s3.root, s3.options).get(TRACKER) == b"3"


def cli(*args: str, env: dict) -> None:
    r = subprocess.run([sys.executable, "-m", "cloudckpt", "verl", *args],
                       env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_sft_hdfs_dir_on_gcs_keeps_verls_local_copy_and_both_ways_resume(gcs, tmp_path):
    """``default_hdfs_dir`` on GCS beside a local ``default_local_dir``: each step commits
    in the bucket and verl's local copy stays whole, with verl's own tracker. A step
    downloaded with ``cloudckpt verl download`` resumes under verl's own code; verl's
    local copy, uploaded with ``cloudckpt verl upload``, resumes through cloudckpt."""
    local = tmp_path / "ckpts"
    plan = {"root": str(local), "hdfs": gcs.root, "keep": 1, "steps": [1, 2],
            "resumes": [["auto", None]]}
    reports, _ = run_ranks(tmp_path, plan, gcs.env)
    assert_resumed(reports, 0, 2)
    assert [c.name for c in list_checkpoints(gcs.root, gcs.options)] == ["global_step_2"]
    assert open_store(gcs.root, gcs.options).get(TRACKER) == b"2"
    assert (local / TRACKER).read_text() == "2"
    assert sorted(p.name for p in local.iterdir()) == ["global_step_2", TRACKER]  # verl's own
    assert {"data_0.pt", "data_1.pt", "model_world_size_2_rank_1.pt"} <= \
        {p.name for p in (local / "global_step_2").iterdir()}

    down = tmp_path / "downloaded"
    cli("download", f"{gcs.root}/global_step_2", str(down), env=gcs.env)
    own = {"root": str(down), "steps": [], "resumes": [["auto", None]]}
    by_verl, stderr = run_ranks(tmp_path, own, {}, activate=False)
    assert_resumed([{**rep, "saved": first["saved"]} for rep, first in
                    zip(by_verl, reports, strict=True)], 0, 2)
    assert "cloudckpt" not in stderr

    copy = f"{gcs.root}-uploaded"
    cli("upload", str(local / "global_step_2"), copy, env=gcs.env)
    assert open_checkpoint(f"{copy}/global_step_2", gcs.options).manifest.kind == "verl-sft"
    ours, _ = run_ranks(tmp_path, {"root": copy, "steps": [], "resumes": [["auto", None]]},
                        gcs.env)
    assert_resumed([{**rep, "saved": first["saved"]} for rep, first in
                    zip(ours, reports, strict=True)], 0, 2)
