"""A ROLL-shaped Ray driver, run by test_roll_ray.py as ``[cloudckpt run --] python
roll_ray_driver.py CONFIG_JSON OUT_JSON``: a real local Ray; ROLL's
``CheckpointManager`` built inside Ray actors, as ROLL's workers build theirs (one per
worker process, from ``checkpoint_config``), each uploading its own local directory;
then ROLL's ``get_latest_ckpt`` inside a Ray task. No cloudckpt import anywhere: with
``type: s3`` this works only where activation bound the integration.

Writes to OUT_JSON what each side saw: the upload results, the pids of the actors,
the resume directory and the tensors loaded back from it (as a digest per key).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import ray

HERE = Path(__file__).resolve().parent


@ray.remote
class RollWorker:
    """One ROLL worker process: its CheckpointManager and its local checkpoint dir."""

    def __init__(self, checkpoint_config: dict) -> None:
        sys.path.insert(0, str(HERE))
        from roll.utils.checkpoint_manager import CheckpointManager

        self.manager = CheckpointManager(checkpoint_config=checkpoint_config)

    def pid(self) -> int:
        import os

        return os.getpid()

    def upload_actor(self, ckpt_id: str, seed: int) -> dict:
        from roll_parts import Worker, stage_actor

        worker = Worker(seed)
        worker.train(2)
        local = stage_actor(Path(tempfile.mkdtemp()), ckpt_id, worker)
        self.manager.upload(ckpt_id=ckpt_id, local_state_path=str(local))
        return digests(worker.tensors())

    def upload_pipeline(self, ckpt_id: str, step: int) -> None:
        from roll_parts import stage_pipeline

        local = stage_pipeline(Path(tempfile.mkdtemp()), ckpt_id, step)
        self.manager.upload(ckpt_id=ckpt_id, local_state_path=str(local))


def digests(tensors: dict) -> dict[str, str]:
    return {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
            for k, v in sorted(tensors.items())}


@ray.remote
def resume(checkpoint_config: dict) -> dict:
    """BasePipeline.__init__'s resume branch (``resume_from_checkpoint: true``), then
    the actor's DCP load of what it returned."""
    sys.path.insert(0, str(HERE))
    from roll.utils.checkpoint_manager import get_latest_ckpt
    from roll_parts import Worker, roll_dcp_load

    latest = get_latest_ckpt(checkpoint_config)
    if not latest:
        return {"latest": None}
    actor_dir = Path(latest)
    state = json.loads((actor_dir / "pipeline" / "worker_state_pipeline.json").read_text())
    fresh = Worker(seed=99)
    roll_dcp_load(fresh, actor_dir)
    return {"latest": latest, "step": state["step"], "tensors": digests(fresh.tensors())}


def main(config_path: str, out_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": config.get("env_vars", {})})
    out: dict = {}
    try:
        actor, pipeline = RollWorker.remote(config["checkpoint_config"]), \
            RollWorker.remote(config["checkpoint_config"])
        out["pids"] = ray.get([actor.pid.remote(), pipeline.pid.remote()])
        saved = actor.upload_actor.remote("checkpoint-3", seed=1)
        ray.get(pipeline.upload_pipeline.remote("checkpoint-3", 3))
        out["saved"] = ray.get(saved)
        # The uploads run in the workers' background (ROLL's default): the checkpoint
        # is committed by whichever part lands last, some time after upload returned.
        deadline = time.monotonic() + 90
        while True:
            out["resumed"] = ray.get(resume.remote(config["checkpoint_config"]))
            if out["resumed"]["latest"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    except Exception as exc:  # what a worker raised, for the test to read
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        Path(out_path).write_text(json.dumps(out))
        ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
