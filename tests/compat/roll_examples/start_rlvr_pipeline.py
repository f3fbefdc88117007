"""ROLL's usual launch, ``python examples/start_rlvr_pipeline.py --config_path DIR
--config_name NAME``, in the shape of ROLL's own start script and pipeline (whose config
and pipeline modules are not among the peers' importable files): hydra composes the
config as ROLL's start script does, ROLL's ``BaseConfig`` rules that touch paths are
applied as base_config.py applies them, and ``BasePipeline``'s resume and
``do_checkpoint`` run as base_pipeline.py runs them, over ROLL's actor as two gloo ranks
in Ray actors (roll_ray_driver.RollRank) and the pipeline's CheckpointManager in this
driver. ROLL's own ``CheckpointManager``, ``get_latest_ckpt``, ``download_model`` and
logger do the work; nothing here imports cloudckpt.

Writes ``{output_dir}/run.json``: the step resumed at and each saved step's digests.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
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


def run(cfg: dict) -> None:
    from roll_parts import stage_pipeline
    from roll_ray_driver import RollRank

    ckpt_config, output_dir = cfg["checkpoint_config"], os.path.abspath(cfg["output_dir"])
    # The tracker (create_tracker: tensorboard's SummaryWriter makes its log_dir).
    os.makedirs(cfg["tracker_kwargs"]["log_dir"], exist_ok=True)
    manager = CheckpointManager(checkpoint_config=ckpt_config)
    mapping = cfg["actor_train"]["device_mapping"]  # WorkerConfig evaluates a string
    world = len(eval(mapping) if isinstance(mapping, str) else mapping)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [RollRank.remote(ckpt_config, rank, world, port, output_dir)
             for rank in range(world)]
    out: dict = {"resumed_at": None, "saved": []}
    start = 0
    if cfg.get("resume_from_checkpoint") is True:  # BasePipeline.__init__
        latest = get_latest_ckpt(ckpt_config)
        if latest:
            where = download_model(latest)
            state = json.loads(Path(where, "pipeline", "worker_state_pipeline.json").read_text())
            out["resumed_at"] = start = state["step"]
            ray.get([r.load.remote(where) for r in ranks])
            start += 1
    max_steps, save_steps = cfg["max_steps"], cfg["save_steps"]
    for global_step in range(start, max_steps):
        got = ray.get([r.train.remote(global_step) for r in ranks])
        # BasePipeline.do_checkpoint: every checkpoint cluster's ranks, then the pipeline.
        if global_step > 0 and (global_step % save_steps == 0
                                or global_step == max_steps - 1):
            ckpt_id = f"checkpoint-{global_step}"
            ray.get([r.save.remote(ckpt_id) for r in ranks])
            local = stage_pipeline(Path(output_dir), ckpt_id, global_step)
            manager.upload(ckpt_id=ckpt_id, local_state_path=str(local))
            out["saved"].append({"step": global_step, "digests": got})
        Path(output_dir, "run.json").write_text(json.dumps(out))
        time.sleep(float(os.environ.get("ROLL_TEST_STEP_PAUSE", "0")))


if __name__ == "__main__":
    main()
