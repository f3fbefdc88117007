"""A ROLL-shaped Ray driver, run by test_roll_ray.py as ``[cloudckpt run --] python
roll_ray_driver.py CONFIG_JSON OUT_JSON``: a real local Ray; ROLL's
``CheckpointManager`` built inside Ray actors, as ROLL's workers build theirs (one per
worker process, from ``checkpoint_config``), each uploading its own local directory;
then ROLL's ``get_latest_ckpt`` inside a Ray task. No cloudckpt import anywhere: with
``type: s3`` this works only where activation bound the integration.

Writes to OUT_JSON what each side saw: the upload results, the pids of the actors,
the resume directory and the tensors loaded back from it (as a digest per key).

With ``"save": [steps]`` in CONFIG_JSON it trains instead, as ROLL's pipeline does:
ROLL's actor as ``world`` ranks of a gloo group (one Ray actor each, the model sharded
with FSDP2), each step trained, then each rank's DCP shard and the pipeline's state
uploaded through their own CheckpointManagers as ``checkpoint-{step}``; with
``"resume": true`` it first resumes as ``BasePipeline.__init__`` does
(``get_latest_ckpt``, then every rank's DCP load of that directory). At the end every
uploader waits for its checkpoints to commit (``wait``, which raises what failed).
OUT_JSON then has the step resumed at and, per saved step, every rank's digests.
"""

from __future__ import annotations

import hashlib
import json
import socket
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

    def wait(self) -> None:
        wait_uploads(self.manager)


def digests(tensors: dict) -> dict[str, str]:
    return {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
            for k, v in sorted(tensors.items())}


@ray.remote
class RollRank:
    """One rank of a ROLL cluster (``actor_train-{rank}``, or another cluster's): a gloo
    group member, its sharded model, its own CheckpointManager and local checkpoint dir.

    Test knobs, each ``checkpoint-N:PART`` (``PART``: ``actor_train-1``, ``critic-0``):
    ``ROLL_TEST_LOST_PART``, a rank that dies before its upload; ``ROLL_TEST_LATE_PART``,
    a rank whose upload comes late (ROLL's done-callback of an async DCP save): held
    until :meth:`upload_held`, which the pipeline calls after its own part is in."""

    def __init__(self, checkpoint_config: dict, rank: int, world: int, port: int,
                 local: str | None = None, cluster: str = "actor_train") -> None:
        sys.path.insert(0, str(HERE))
        import torch
        import torch.distributed as dist
        from roll.utils.checkpoint_manager import CheckpointManager

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        from roll_parts import ShardedWorker

        self.rank, self.cluster = rank, cluster
        self.worker = ShardedWorker()
        self.manager = CheckpointManager(checkpoint_config=checkpoint_config)
        # ROLL stages under its output_dir ({output_dir}/actor_train-{rank}/checkpoint-N).
        self.local = Path(local) if local else Path(tempfile.mkdtemp())
        self.held: list[tuple[str, str]] = []

    def train(self, step: int) -> dict[str, str]:
        self.worker.train(step)
        return digests(self.worker.tensors())

    def save(self, ckpt_id: str) -> None:
        import os

        from roll_parts import stage_rank

        local = stage_rank(self.local, ckpt_id, self.worker, self.rank, self.cluster)
        me = f"{ckpt_id}:{self.cluster}-{self.rank}"
        if os.environ.get("ROLL_TEST_LOST_PART") == me:
            return
        if os.environ.get("ROLL_TEST_LATE_PART") == me:
            self.held.append((ckpt_id, str(local)))
            return
        self.manager.upload(ckpt_id=ckpt_id, local_state_path=str(local))

    def upload_held(self) -> None:
        held, self.held = self.held, []
        for ckpt_id, local in held:
            self.manager.upload(ckpt_id=ckpt_id, local_state_path=local)

    def load(self, ckpt_dir: str) -> dict[str, str]:
        from roll_parts import cluster_folder, roll_dcp_load

        roll_dcp_load(self.worker, Path(ckpt_dir) / cluster_folder(self.cluster))
        return digests(self.worker.tensors())

    def wait(self) -> None:
        wait_uploads(self.manager)


def wait_uploads(manager) -> None:
    """cloudckpt's uploader: until every checkpoint it uploaded a part of has committed
    (raises what failed); ROLL's own has nothing to wait for."""
    wait = getattr(manager.uploader, "wait", None)
    if wait is not None:
        wait()


@ray.remote
def latest(checkpoint_config: dict) -> str | None:
    """BasePipeline.__init__'s ``get_latest_ckpt``: the local directory to resume."""
    from roll.utils.checkpoint_manager import get_latest_ckpt

    return get_latest_ckpt(checkpoint_config) or None


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


def train_and_save(config: dict, out: dict) -> None:
    """ROLL's pipeline over ``world`` actor ranks: resume if asked, then train and save
    each step, then wait for every upload to commit."""
    ckpt_config, world = config["checkpoint_config"], config.get("world", 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [RollRank.remote(ckpt_config, rank, world, port) for rank in range(world)]
    pipeline = RollWorker.remote(ckpt_config)
    if config.get("resume"):
        where = ray.get(latest.remote(ckpt_config))
        state = json.loads(Path(where, "pipeline", "worker_state_pipeline.json").read_text())
        out["resumed_at"] = state["step"]
        ray.get([r.load.remote(where) for r in ranks])
    out["saved"] = []
    for step in config["save"]:
        got = ray.get([r.train.remote(step) for r in ranks])
        ckpt_id = f"checkpoint-{step}"
        ray.get([r.save.remote(ckpt_id) for r in ranks])  # the actor's, then the pipeline's
        ray.get(pipeline.upload_pipeline.remote(ckpt_id, step))
        out["saved"].append({"step": step, "digests": got})
    ray.get([w.wait.remote() for w in [*ranks, pipeline]])


def main(config_path: str, out_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": config.get("env_vars", {})})
    out: dict = {}
    try:
        if "save" in config:
            train_and_save(config, out)
            return
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
