"""ROLL's usual launch, ``python examples/start_rlvr_pipeline.py --config_path DIR
--config_name NAME``, in the shape of ROLL's own start script and pipeline (whose config
and pipeline modules are not among the peers' importable files): hydra composes the
config as ROLL's start script does, ROLL's ``BaseConfig`` rules that touch paths are
applied as base_config.py applies them, and the pipeline is a class in
``BasePipeline``'s shape (base_pipeline.py): its CheckpointManager built in
``__init__``, its resume there, its ``checkpoint_clusters`` (a class attribute that
``set_checkpoint_clusters`` extends) and ``do_checkpoint`` as ROLL has them. Its
clusters, in the shape of ROLL's ``Cluster`` (``cluster_name``, ``world_size``, one Ray
actor per rank: roll_ray_driver.RollRank), are ROLL's actor (``actor_train``) and, when
the config has a ``critic`` section, a critic. ROLL's own ``CheckpointManager``,
``get_latest_ckpt``, ``download_model`` and logger do the work; nothing here imports
cloudckpt.

Writes ``{output_dir}/run.json``: the step resumed at and each saved step's digests.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from concurrent import futures
from datetime import datetime
from pathlib import Path

import ray
from hydra import compose, initialize
from omegaconf import OmegaConf

# ROLL's start scripts import its pipeline, which imports these, before the config.
from roll.utils.checkpoint_manager import CheckpointManager, download_model, get_latest_ckpt
from roll.utils.logging import get_logger


def roll_config(cfg: dict) -> dict:
    """base_config.py's BaseConfig defaults and __post_init__ rules for paths."""
    cfg.setdefault("exp_name", os.path.basename(sys.argv[0])[: -len(".py")])
    cfg.setdefault("output_dir", "./output")
    cfg.setdefault("logging_dir", "./output/logs")
    cfg.setdefault("track_with", "tensorboard")
    cfg.setdefault("tracker_kwargs", {})
    cfg.setdefault("checkpoint_config", {})
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    if cfg["track_with"] == "tensorboard":
        cfg["tracker_kwargs"]["log_dir"] = os.path.join(
            cfg["tracker_kwargs"].get("log_dir", cfg["output_dir"]), cfg["exp_name"], stamp)
    cfg["logging_dir"] = os.path.join(cfg["logging_dir"], cfg["exp_name"])
    os.environ["ROLL_LOG_DIR"] = cfg["logging_dir"]
    get_logger()
    ckpt = cfg["checkpoint_config"]
    if ckpt.get("type", None) == "file_system":
        ckpt["output_dir"] = os.path.join(ckpt.get("output_dir"), stamp)
    if cfg.get("resume_from_checkpoint") is True:
        ckpt["async_upload"] = False
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config_path", default="config")
    parser.add_argument("--config_name", default="rlvr_config")
    args = parser.parse_args()
    with initialize(config_path=args.config_path, job_name="app", version_base=None):
        cfg = roll_config(OmegaConf.to_container(compose(config_name=args.config_name),
                                                 resolve=True))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        run(cfg)
    finally:
        ray.shutdown()


class Cluster:
    """ROLL's ``Cluster`` as the pipeline uses it: its name, its size and its workers
    (one Ray actor per rank, a gloo group of their own)."""

    def __init__(self, cluster_name: str, cfg: dict, output_dir: str) -> None:
        from roll_ray_driver import RollRank

        mapping = cfg[cluster_name]["device_mapping"]  # WorkerConfig evaluates a string
        self.cluster_name = cluster_name
        self.world_size = len(eval(mapping) if isinstance(mapping, str) else mapping)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.workers = [RollRank.remote(cfg["checkpoint_config"], rank, self.world_size,
                                        port, output_dir, cluster_name)
                        for rank in range(self.world_size)]

    def train(self, global_step: int) -> list:
        return ray.get([w.train.remote(global_step) for w in self.workers])

    def load(self, where: str) -> None:
        ray.get([w.load.remote(where) for w in self.workers])

    def do_checkpoint(self, global_step: int, is_last_step: bool = False,
                      blocking: bool = True) -> list:
        refs = [w.save.remote(f"checkpoint-{global_step}") for w in self.workers]
        return ray.get(refs) if blocking else refs

    def upload_held(self) -> None:
        """The uploads a test held back (roll_ray_driver.RollRank), made now."""
        ray.get([w.upload_held.remote() for w in self.workers])


class RLVRPipeline:
    """``BasePipeline``'s shape, as far as checkpoints go."""

    checkpoint_clusters: list = []

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.output_dir = os.path.abspath(cfg["output_dir"])
        self.checkpoint_manager = CheckpointManager(checkpoint_config=cfg["checkpoint_config"])
        # The tracker (create_tracker: tensorboard's SummaryWriter makes its log_dir).
        os.makedirs(cfg["tracker_kwargs"]["log_dir"], exist_ok=True)
        self.executor = futures.ThreadPoolExecutor(max_workers=5)
        self.resume_from_checkpoint: str | bool = False
        self.start = 0
        if cfg.get("resume_from_checkpoint") is True:
            latest = get_latest_ckpt(cfg["checkpoint_config"])
            if latest:
                self.resume_from_checkpoint = download_model(latest)
                state = json.loads(Path(self.resume_from_checkpoint, "pipeline",
                                        "worker_state_pipeline.json").read_text())
                self.start = state["step"]
        # RLVRPipeline.__init__: its clusters, then the ones that checkpoint.
        self.actor_train = Cluster("actor_train", cfg, self.output_dir)
        clusters = [self.actor_train]
        if "critic" in cfg:
            self.critic = Cluster("critic", cfg, self.output_dir)
            clusters.append(self.critic)
        self.set_checkpoint_clusters(*clusters)

    def set_checkpoint_clusters(self, *clusters) -> None:
        self.checkpoint_clusters.extend(clusters)

    def do_checkpoint(self, global_step: int, is_last_step: bool | None = None) -> None:
        """base_pipeline.py's: every checkpoint cluster's ranks, then the pipeline's part."""
        from roll_parts import stage_pipeline

        max_steps, save_steps = self.cfg["max_steps"], self.cfg["save_steps"]
        if is_last_step is None:
            is_last_step = global_step == max_steps - 1
        if global_step > 0 and (global_step % save_steps == 0
                                or global_step == max_steps - 1):
            refss = [c.do_checkpoint(global_step=global_step, is_last_step=is_last_step,
                                     blocking=False) for c in self.checkpoint_clusters]
            for refs in refss:
                ray.get(refs)
            ckpt_id = f"checkpoint-{global_step}"
            local = stage_pipeline(Path(self.output_dir), ckpt_id, global_step)
            if self.cfg["checkpoint_config"].get("async_upload", True) and not is_last_step:
                self.executor.submit(self.checkpoint_manager.upload, ckpt_id=ckpt_id,
                                     local_state_path=str(local))
            else:
                self.checkpoint_manager.upload(ckpt_id=ckpt_id, local_state_path=str(local))

    def run(self) -> None:
        out: dict = {"resumed_at": None, "saved": []}
        start = self.start
        if self.resume_from_checkpoint:
            out["resumed_at"] = start
            self.actor_train.load(self.resume_from_checkpoint)
            if hasattr(self, "critic"):
                self.critic.load(self.resume_from_checkpoint)
            start += 1
        max_steps, save_steps = self.cfg["max_steps"], self.cfg["save_steps"]
        for global_step in range(start, max_steps):
            got = self.actor_train.train(global_step)
            if hasattr(self, "critic"):
                self.critic.train(global_step)
            self.do_checkpoint(global_step)
            # Uploads a test held back come after the pipeline's part (ROLL's workers
            # upload from their async DCP save's done-callback).
            for cluster in self.checkpoint_clusters:
                cluster.upload_held()
            if global_step > 0 and (global_step % save_steps == 0
                                    or global_step == max_steps - 1):
                out["saved"].append({"step": global_step, "digests": got})
            Path(self.output_dir, "run.json").write_text(json.dumps(out))
            time.sleep(float(os.environ.get("ROLL_TEST_STEP_PAUSE", "0")))


def run(cfg: dict) -> None:
    RLVRPipeline(cfg).run()


if __name__ == "__main__":
    main()
