"""verl 0.9.1 on 2 gloo ranks under ``cloudckpt run``:

- its SFT ``CheckpointHandler`` on a bucket (verl_sft_ranks.py): verl's own handler and
  ``FSDPEngine`` checkpoint calls save and resume each step; a step downloaded resumes
  under verl's own code, verl's local copy uploaded resumes through cloudckpt;
- its Megatron checkpoint manager by local staging (verl_megatron_ranks.py names its
  stand-in and why): verl's save writes its v2 layout in a staging directory, which is
  committed as the role's part; a load downloads it once per host and runs verl's load
  there; a Megatron step verl wrote locally goes up with ``cloudckpt verl upload`` and
  comes down with ``download``. It shares the first test's launch.
"""

from __future__ import annotations

import json
import os
import re
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


def test_sft_steps_commit_to_s3_resume_auto_and_by_path_and_prune_and_megatron_stages(
        s3, tmp_path):
    stage = tmp_path / "stage"
    stage.mkdir()
    megatron = f"{s3.root}-megatron/global_step_2/actor"
    plan = {"root": s3.root, "keep": 2, "steps": [1, 2, 3], "megatron": megatron,
            "resumes": [["auto", None], ["resume_path", f"{s3.root}/global_step_2"]]}
    reports, stderr = run_ranks(tmp_path, plan, {**s3.env, "CLOUDCKPT_STAGING": str(stage)})
    # Each rank bound verl and said so in one line (what it bound: the resumes below).
    assert len(re.findall(r"bound the verl integration into verl 0\.9\.1, pid \d+: ",
                          stderr)) == 2, stderr
    assert_resumed(reports, 0, 3)
    assert_resumed(reports, 1, 2)
    # max_ckpt_to_keep after each commit, over whole committed steps
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == \
        ["global_step_2", "global_step_3"]
    step = open_checkpoint(f"{s3.root}/global_step_3", s3.options)
    step.verify(deep=True)
    assert step.manifest.kind == "verl-sft" and step.metadata["world_size"] == 2
    assert step.metadata["profile"] == {"name": "full", "lacks": []}  # the engine's manager
    assert {"model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt",
            "optim_world_size_2_rank_1.pt", "extra_state_world_size_2_rank_0.pt",
            "fsdp_config.json", "huggingface/config.json", "data_0.pt",
            "data_1.pt"} <= set(step.files)
    assert open_store(s3.root, s3.options).get(TRACKER) == b"3"
    assert_megatron_staged([rep["megatron"] for rep in reports])
    assert list(stage.iterdir()) == []  # every staging copy (saves, loads) removed


def assert_megatron_staged(reports: list[dict]) -> None:
    for rep in reports:
        assert rep["verl_class_bound"] is True  # activation bound verl's own class
        assert rep["same"] is True  # every rank's model, optimizer and extra state back
        assert rep["both_ways"] == [True, True]  # uploaded, then downloaded: the same
        assert "async_save: false" in rep["async_error"]
    part = reports[0]
    assert part["kind"] == "verl-role"
    assert part["metadata"]["layout"] == "verl-megatron" and part["metadata"]["world_size"] == 2
    assert part["metadata"]["profile"] == {"name": "full", "lacks": []}  # no PEFT
    for sub in ("model", "optimizer", "extra"):
        assert {f"{sub}/dist_ckpt/.metadata", f"{sub}/dist_ckpt/metadata.json",
                f"{sub}/dist_ckpt/__0_0.distcp", f"{sub}/dist_ckpt/__1_0.distcp"} <= \
            set(part["files"])
    assert {"ckpt_contents.json", "transformer_config.json"} <= set(part["files"])


def test_sft_hdfs_dir_on_gcs_keeps_verls_local_copy_and_both_ways_resume(gcs, tmp_path):
    """``default_hdfs_dir`` on GCS beside a local ``default_local_dir``: each step commits
    in the bucket and verl's local copy stays whole, with verl's own tracker. A step
    downloaded with ``cloudckpt verl download`` resumes under verl's own code (a local
    root: the bound handler passes it through); verl's local copy, uploaded with
    ``cloudckpt verl upload``, resumes through cloudckpt."""
    local, down = tmp_path / "ckpts", tmp_path / "downloaded"
    copy = f"{gcs.root}-uploaded"
    plan = {"root": str(local), "hdfs": gcs.root, "keep": 1, "steps": [1, 2], "resumes": [
        ["auto", None],
        {"mode": "auto", "root": str(down), "hdfs": None,
         "before": [["download", f"{gcs.root}/global_step_2", str(down)]]},
        {"mode": "auto", "root": copy, "hdfs": None,
         "before": [["upload", str(local / "global_step_2"), copy]]}]}
    reports, _ = run_ranks(tmp_path, plan, gcs.env)
    for which in range(3):
        assert_resumed(reports, which, 2)
    assert [c.name for c in list_checkpoints(gcs.root, gcs.options)] == ["global_step_2"]
    assert open_store(gcs.root, gcs.options).get(TRACKER) == b"2"
    assert (local / TRACKER).read_text() == "2"
    assert sorted(p.name for p in local.iterdir()) == ["global_step_2", TRACKER]  # verl's own
    assert {"data_0.pt", "data_1.pt", "model_world_size_2_rank_1.pt"} <= \
        {p.name for p in (local / "global_step_2").iterdir()}
    assert not list(local.rglob("cloudckpt-manifest.json"))  # verl's copy holds nothing of ours
    assert (down / TRACKER).read_text() == "2"
    assert open_checkpoint(f"{copy}/global_step_2", gcs.options).manifest.kind == "verl-sft"


def test_sft_a_step_copied_under_a_newer_name_is_refused_before_anything_loads(s3, tmp_path):
    """global_step_1 copied to global_step_5 (``cloudckpt cp`` keeps its manifest, step
    1): ``resume_mode: auto`` takes global_step_5 as the newest and refuses it, and so
    does naming it, before the engine or the dataloader load anything: every rank's
    model, optimizer, scheduler, RNG and dataloader position stay as they were."""
    newer = f"{s3.root}/global_step_5"
    plan = {"root": s3.root, "steps": [1, 2], "resumes": [
        {"mode": "auto", "cp": [f"{s3.root}/global_step_1", newer], "refused": True},
        {"mode": "resume_path", "path": newer, "refused": True},
        ["resume_path", f"{s3.root}/global_step_2"]]}
    reports, _ = run_ranks(tmp_path, plan, s3.env)
    for rank, rep in enumerate(reports):
        for refused in rep["resumed"][:2]:
            assert "named for step 5 but its manifest says step 1" in refused["error"]
            assert refused["after"] == refused["before"]  # nothing applied
            # a fresh loader's first item: not the position step 1 saved (its second)
            assert refused["next"] == [rank * 4096]
    assert_resumed(reports, 2, 2)  # the ranks go on loading committed steps as before
