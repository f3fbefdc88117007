"""verl 0.9.1's own PPO checkpoint path on a bucket, under ``cloudckpt run``: verl's
``RayPPOTrainer._save_checkpoint``/``_load_checkpoint``, its ``RayWorkerGroup`` on a
real local Ray, and its ``FSDPCheckpointManager`` in the workers (verl_driver.py); the
same trainer methods with one worker in-process (verl_parts.trainer_for) for the
critic, ``default_hdfs_dir`` and local runs. Without activation, verl runs as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from forked import forkserver, run_child

from cloudckpt import list_checkpoints, open_checkpoint
from cloudckpt.core.blobs import referenced
from cloudckpt.core.manifest import DIGEST_RE
from cloudckpt.names import BLOB_AREA
from cloudckpt.storage import open_store

# Whole framework jobs (trainers, Ray clusters, torchrun ranks): minutes each on a
# busy machine, where the suite-wide 300 s cut them off.
pytestmark = pytest.mark.timeout(900)

HERE = Path(__file__).resolve().parent
TRACKER = "latest_checkpointed_iteration.txt"


def trainer_config(**trainer) -> dict:
    base = {"default_local_dir": None, "default_hdfs_dir": None, "resume_mode": "auto",
            "resume_from_path": None, "max_actor_ckpt_to_keep": None,
            "max_critic_ckpt_to_keep": None, "del_local_ckpt_after_load": False}
    return {"trainer": {**base, **trainer},
            "actor_rollout_ref": {"actor": {"checkpoint": {"async_save": False}}}}


def run_driver(tmp_path: Path, plan: dict, env: dict, *, activate: bool = True) -> dict:
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = tmp_path / "out.json"
    env = {**os.environ, **env, "RAY_DEDUP_LOGS": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    launch = [sys.executable, str(HERE / "verl_driver.py"), str(tmp_path / "plan.json"),
              str(out)]
    if activate:
        launch = [sys.executable, "-m", "cloudckpt", "run", "--", *launch]
    r = subprocess.run(launch, env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    seen = json.loads(out.read_text())
    assert "error" not in seen, seen.get("traceback")
    seen["stderr"] = r.stderr
    return seen


def saved_at(phase: dict, step: int) -> dict:
    return next(s for s in phase["saved"] if s["step"] == step)


def assert_resumed(resumed: dict, saved: dict) -> None:
    assert "error" not in resumed, resumed.get("traceback")
    assert resumed["global_steps"] == saved["step"]
    assert resumed["digests"] == saved["digests"]  # model, optimizer, scheduler, RNG, per rank
    assert resumed["next"] == saved["next"]  # the dataloader draws what it would have


@pytest.mark.parametrize("incremental", [False, True])
def test_ppo_steps_commit_to_s3_resume_auto_and_by_path_and_prune(s3, tmp_path, incremental):
    """Also with $CLOUDCKPT_INCREMENTAL=1: every role's file a blob beside the steps,
    verl's retention sweeping the blobs only the pruned steps referenced."""
    config = trainer_config(default_local_dir=s3.root, max_actor_ckpt_to_keep=2)
    plan = {"config": config, "world": 2, "phases": [
        {"save": [1, 2, 3]},
        {"resume": True},
        {"resume": True, "config": {"trainer": {"resume_mode": "resume_path",
                                                "resume_from_path": f"{s3.root}/global_step_2"}}},
        {"resume": True, "world": 1},
    ]}
    seen = run_driver(tmp_path, plan, {**s3.env, "CLOUDCKPT_INCREMENTAL": str(int(incremental))})
    saves, auto, by_path, other_world = seen["phases"]
    # Every worker bound the integration itself and said so in one line.
    for pids in saves["saved"][0]["pids"].values():
        for pid in pids:
            assert seen["stderr"].count(f"bound the verl integration into verl 0.9.1, "
                                        f"pid {pid}: ") == 1, seen["stderr"]

    # verl's retention, after each commit, over whole steps: the newest two stay.
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == \
        ["global_step_2", "global_step_3"]
    step = open_checkpoint(f"{s3.root}/global_step_3", s3.options)
    step.verify(deep=True)
    assert step.manifest.kind == "verl"
    assert {"data.pt", "actor/model_world_size_2_rank_0.pt", "actor/model_world_size_2_rank_1.pt",
            "actor/optim_world_size_2_rank_1.pt", "actor/extra_state_world_size_2_rank_0.pt",
            "actor/fsdp_config.json", "actor/huggingface/config.json"} <= set(step.files)
    assert open_store(s3.root, s3.options).get(TRACKER) == b"3"
    assert (step.manifest.blob_depth == 1) is incremental
    if incremental:  # what the pruned step alone referenced is gone
        area = open_store(s3.root, s3.options).child(BLOB_AREA)
        assert {o.key for o in area.list() if DIGEST_RE.match(o.key)} == referenced(
            open_store(s3.root, s3.options))

    assert_resumed(auto, saved_at(saves, 3))
    assert auto["returned"] is None  # as verl's own _load_checkpoint after a load
    assert_resumed(by_path, saved_at(saves, 2))
    assert "WorldSizeError" in other_world["error"]
    assert "files of 2 ranks; this job has 1 rank" in other_world["error"]
    assert "cannot be resharded" in other_world["error"]


@pytest.fixture(scope="module")
def forks():
    """A forkserver that imported the frameworks once, with cloudckpt activated."""
    return forkserver()


def test_critic_and_hdfs_dir_on_gcs_keep_a_local_copy_verl_itself_resumes(forks, gcs,
                                                                          tmp_path):
    """``default_hdfs_dir`` on GCS beside a local ``default_local_dir``, with a critic:
    each step commits both roles in the bucket, verl's local copy stays whole, and a
    step stays while either role's count keeps it."""
    local = tmp_path / "ckpts"
    keys = {"default_hdfs_dir": gcs.root, "max_actor_ckpt_to_keep": 1,
            "max_critic_ckpt_to_keep": 2}
    out = tmp_path / "report.json"
    assert run_child(forks, "verl_run", str(out), gcs.env, str(local), [1, 2, 3], keys,
                     True) == 0
    assert json.loads(out.read_text()) == {"step": 3, "same": True, "next": [3], "bound": True}
    names = [c.name for c in list_checkpoints(gcs.root, gcs.options)]
    assert names == ["global_step_2", "global_step_3"]  # the critic's count keeps 2
    step = open_checkpoint(f"{gcs.root}/global_step_3", gcs.options)
    step.verify(deep=True)
    assert {"actor/model_world_size_1_rank_0.pt", "critic/model_world_size_1_rank_0.pt",
            "critic/optim_world_size_1_rank_0.pt", "data.pt"} <= set(step.files)
    assert open_store(gcs.root, gcs.options).get(TRACKER) == b"3"
    # verl's own local copy is whole too: its files, data.pt, its tracker.
    assert (local / TRACKER).read_text() == "3"
    assert (local / "global_step_3" / "critic" / "optim_world_size_1_rank_0.pt").is_file()
    assert (local / "global_step_3" / "data.pt").is_file()


def test_a_step_the_trainer_refuses_loads_nothing(forks, s3, tmp_path):
    """A critic's part missing from the step, or optimizer states the step was saved
    without: verl's bound ``_load_checkpoint`` refuses before any role (the actor
    included) or the dataloader loads anything."""
    out = tmp_path / "report.json"
    assert run_child(forks, "verl_refused", s3.root, s3.env, str(out)) == 0
    report = json.loads(out.read_text())
    assert "critic" in report["no-critic"]["error"]
    # the part records its save profile: refused by it, naming verl's key and the switch
    assert report["no-optim"]["error"].startswith("PartialCheckpointError: ")
    assert "'weights' save: it holds no optimizer" in report["no-optim"]["error"]
    for case in report.values():
        assert case["same"] and case["step"] == 0 and case["next"] == [0], case


def test_save_profiles_follow_verls_save_contents_and_lora_only(forks, s3, tmp_path):
    """A step verl saved without its optimizer records ``weights`` (lacking it); a
    LoRA-only one ``adapters``. A trainer loading verl's default contents from the first
    is refused before anything loads, naming ``load_contents`` and the switch; with
    $CLOUDCKPT_ALLOW_PARTIAL_RESUME=1 it loads the model, scheduler and RNG and warns
    that the optimizer starts fresh; with ``load_contents`` leaving the optimizer out
    (verl's own option) it loads the same without a word. The LoRA step resumes onto
    the base model, as verl's own load does."""
    out = tmp_path / "report.json"
    assert run_child(forks, "verl_profiles", s3.root, s3.env, str(out)) == 0
    report = json.loads(out.read_text())
    assert report["records"] == {
        "weights": {"name": "weights", "lacks": ["optimizer"]},
        "lora": {"name": "adapters", "lacks": ["frozen weights"]}}
    assert "optim_world_size_1_rank_0.pt" in report["lora_files"]

    refused = report["refused"]
    assert refused["error"].startswith("PartialCheckpointError: "), refused
    assert "global_step_2/actor is a 'weights' save: it holds no optimizer" in refused["error"]
    assert ("leave 'optimizer' out of actor_rollout_ref.actor.checkpoint.load_contents, or "
            "set CLOUDCKPT_ALLOW_PARTIAL_RESUME=1") in refused["error"]
    assert refused["step"] == 0
    assert {"model", "optimizer", "scheduler"} <= set(refused["unchanged"])  # nothing loaded

    allowed = report["allowed"]
    assert allowed["error"] is None and allowed["step"] == 2
    assert {"model", "scheduler", "rng"} <= set(allowed["as_saved"])
    assert "optimizer" in allowed["unchanged"] and "optimizer" not in allowed["as_saved"]
    assert any("partial resume from" in w and "optimizer start(s) fresh" in w
               for w in allowed["warnings"]), allowed["warnings"]

    own = report["load_contents"]
    assert own["error"] is None and own["step"] == 2 and own["warnings"] == []
    assert {"model", "scheduler", "rng"} <= set(own["as_saved"])
    assert "optimizer" in own["unchanged"]

    lora = report["lora"]
    assert lora["error"] is None and lora["step"] == 2 and lora["warnings"] == []
    assert {"model", "optimizer", "scheduler", "rng"} <= set(lora["as_saved"])


LOCAL_RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
from verl_parts import resumed, trainer_for
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
root = sys.argv[2]
for step in (1, 2):
    trainer_for(root, step)._save_checkpoint()
report = resumed(trainer_for(root, 0), lambda: trainer_for(root, 2))
report["bound"] = hasattr(RayPPOTrainer._save_checkpoint, "__wrapped__")
print(json.dumps(report))
"""


def assert_verls_own_layout(local: Path) -> None:
    assert (local / TRACKER).read_text() == "2"  # verl's own tracker and layout
    assert sorted(p.name for p in (local / "global_step_2" / "actor").iterdir()) == [
        "extra_state_world_size_1_rank_0.pt", "fsdp_config.json", "huggingface",
        "model_world_size_1_rank_0.pt", "optim_world_size_1_rank_0.pt"]
    assert (local / "global_step_2" / "data.pt").is_file()
    assert not list(local.rglob("cloudckpt-manifest.json"))  # nothing of ours


def test_a_local_run_without_activation_is_verls_own(tmp_path):
    local = tmp_path / "ckpts"
    r = subprocess.run([sys.executable, "-c", LOCAL_RUN, str(HERE), str(local)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.splitlines()[-1])
    assert report == {"step": 2, "same": True, "next": [2], "bound": False}
    assert_verls_own_layout(local)
    assert "cloudckpt" not in r.stderr


def test_a_local_run_under_activation_is_verls_own(forks, tmp_path):
    local, out = tmp_path / "ckpts", tmp_path / "report.json"
    assert run_child(forks, "verl_run", str(out), {}, str(local), [1, 2], {}) == 0
    assert json.loads(out.read_text()) == {"step": 2, "same": True, "next": [2], "bound": True}
    assert_verls_own_layout(local)


def test_the_example_crashes_relaunches_and_resumes_bit_exact():
    """examples/verl/train.py --demo as written: its config's bucket default_local_dir,
    verl's own trainer calls, a SIGKILL at step 6 and a relaunch from step 4's commit."""
    r = subprocess.run([sys.executable, str(HERE.parents[1] / "examples/verl/train.py"),
                        "--demo"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    first, _, second = r.stdout.partition("(killed: exit -9)")
    assert "starting at step 5" in second and "done" in second
    losses = [dict(line.split(" loss ") for line in part.splitlines()
                   if line.startswith("step ")) for part in (first, second)]
    assert {"step 5", "step 6"} <= losses[0].keys() & losses[1].keys()
    for step in ("step 5", "step 6"):  # the resumed run draws and trains as the first did
        assert losses[0][step] == losses[1][step]
    assert "global_step_12" in second and "global_step_4 " not in second  # kept: 8, 12
