"""A tiny training loop in ROLL's checkpoint flow, with checkpoints in a bucket.

Each rank is an "actor_train" worker (FSDP2 over gloo) and rank 0 is also the
"pipeline". At every save step, as in ROLL, each writes into its own local
staging directory ``{output_dir}/{worker}/checkpoint-N/`` (the pipeline its
``pipeline/worker_state_pipeline.json`` and ``rng_state_pipeline.pth``, rank 0
the HF files, every rank its ``dcp/`` shard and RNG state) and hands it to the
uploader that ``checkpoint_config.type`` picks from a ROLL-style registry. The
bucket merges them into ``checkpoint-N/``, committed once all parts are in.

    python -m torch.distributed.run --nproc_per_node 2 examples/roll/train.py \\
        --config examples/roll/config.yaml [--set key=value ...]
    python examples/roll/train.py --embedded-s3     # demo: local S3, crash, resume

Losses go to stdout as ``step N loss <float.hex()>`` so runs compare exactly.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from cloudckpt.errors import CloudCkptError, exit_code
from cloudckpt.integrations.roll import register
from cloudckpt.runtime.state import get_rng_state, set_rng_state

D_IN, HIDDEN, D_OUT = 16, 64, 4


def load_config(path: str, overrides: list[str]) -> dict:
    """ROLL-shaped YAML with ``${key}`` references to top-level keys; ``a.b=v`` overrides."""
    cfg = yaml.safe_load(Path(path).read_text())
    for item in overrides:
        key, value = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)

    def resolve(v):
        if isinstance(v, str):
            while (new := re.sub(r"\$\{(\w+)\}", lambda m: str(cfg[m.group(1)]), v)) != v:
                v = new  # a reference may hold references (download_dir -> output_dir)
            return v
        if isinstance(v, dict):
            return {k: resolve(x) for k, x in v.items()}
        return v

    return resolve(cfg)


class Loader:
    """A stateful loader over synthetic data (each rank its slice, reshuffled per epoch)."""

    def __init__(self, rank: int, world: int, n: int = 256, batch: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, D_IN, generator=g)
        y = (x @ torch.randn(D_IN, D_OUT, generator=g)).tanh()
        self.x, self.y, self.batch = x[rank::world], y[rank::world], batch
        self.epoch, self.pos = 0, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos >= len(self.x) // self.batch:
            self.epoch, self.pos = self.epoch + 1, 0
        perm = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.epoch))
        idx = perm[self.pos * self.batch:(self.pos + 1) * self.batch]
        self.pos += 1
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.pos = int(s["epoch"]), int(s["pos"])


def build_model(world: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.GELU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(HIDDEN, D_OUT))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


class Manager:
    """What ROLL's CheckpointManager does, with our backends registered: build the
    uploader from ``checkpoint_config``; ``upload`` hands it a worker's directory, then
    deletes that directory unless ``keep_local_file`` (ROLL's manager owns the local
    copy; its uploaders never delete it)."""

    def __init__(self, checkpoint_config: dict) -> None:
        uploader_registry: dict = {}
        register(uploader_registry)
        cfg = copy.deepcopy(checkpoint_config)
        self.uploader = uploader_registry[cfg.pop("type", "file_system")](**cfg)
        self.keep_local_file = bool(checkpoint_config.get("keep_local_file", False))

    def upload(self, ckpt_id: str, local_state_path: str) -> None:
        self.uploader.upload(ckpt_id=ckpt_id, local_state_path=local_state_path)
        if not self.keep_local_file:
            shutil.rmtree(local_state_path, ignore_errors=True)

    def __getattr__(self, name: str):  # get_latest_ckpt, wait: the uploader's
        return getattr(self.uploader, name)


def make_uploader(checkpoint_config: dict) -> Manager:
    return Manager(checkpoint_config)


def resume_dir(resume, uploader, rank: int, world: int) -> Path | None:
    """ROLL's resume rule (base_pipeline.py:64-72): ``true`` takes ``get_latest_ckpt()``
    (here: the latest committed checkpoint, downloaded; rank 0 fetches it for this
    node), a string is a local directory (``download_model`` sends anything else to
    a model hub), anything false starts afresh."""
    if resume is True:
        path = broadcast(uploader.get_latest_ckpt() if rank == 0 else None, world)
    elif isinstance(resume, str) and resume:
        path = resume
        if not Path(path).is_dir():
            raise SystemExit(f"resume_from_checkpoint={path!r} is not a local directory; ROLL "
                             "would send it to a model hub. Use `true`, or a directory from "
                             "`cloudckpt roll fetch`.")
    else:
        return None
    return Path(path) if path else None


def broadcast(obj, world: int):
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def train(args: argparse.Namespace) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rc = run(args, world)
    if world > 1:  # once the run's FSDP2 modules are freed (see examples/train_resume.py)
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return rc


def run(args: argparse.Namespace, world: int) -> int:
    cfg = load_config(args.config, args.set)
    rank = dist.get_rank() if world > 1 else 0
    torch.set_num_threads(1)
    out = Path(cfg["output_dir"])
    ckpt_cfg = dict(cfg["checkpoint_config"])
    resume = cfg.get("resume_from_checkpoint", False)
    if resume is True:  # ROLL's BaseConfig does this too (base_config.py:308-310)
        ckpt_cfg["async_upload"] = False
    ckpt_cfg.setdefault("expected_uploads", world + 1)
    ckpt_cfg.setdefault("max_ckpt_to_keep", cfg.get("max_ckpt_to_keep", 0))
    ckpt_cfg["attempt_id"] = broadcast(os.urandom(8).hex(), world)  # one id per launch
    if args.storage_options:
        ckpt_cfg["storage_options"] = json.loads(args.storage_options)
    uploader = make_uploader(ckpt_cfg)

    model = build_model(world, cfg["seed"])
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=5, gamma=0.7)
    loader = Loader(rank, world)
    log_history: list[dict] = []
    start = 0

    local = resume_dir(resume, uploader, rank, world)
    if local:
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(local / "dcp")))
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        mine = torch.load(local / "rng_state" / f"rng_state_{rank}.pth", weights_only=True)
        sched.load_state_dict(mine["lr_scheduler"])
        pipe = json.loads((local / "pipeline" / "worker_state_pipeline.json").read_text())
        loader.load_state_dict(pipe["kv"]["dataloader"])
        log_history = pipe["log_history"]
        start = pipe["step"] + 1
        set_rng_state(mine["rng"])
        if rank == 0:
            print(f"resumed at step {start} from {local}", flush=True)

    max_steps, save_steps = cfg["max_steps"], cfg["save_steps"]
    for gs in range(start, max_steps):
        x, y = loader.next()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        time.sleep(args.step_delay)
        log_history.append({"step": gs, "loss": loss.item()})
        if rank == 0:
            print(f"step {gs} loss {loss.item().hex()}", flush=True)
        if gs == args.crash_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if gs > 0 and (gs % save_steps == 0 or gs == max_steps - 1):
            save(out, f"checkpoint-{gs}", gs, rank, model, optim, sched, loader, log_history,
                 uploader)
    rc = finish(uploader)
    if world > 1:
        dist.barrier()

    full, _ = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        if args.out:
            torch.save({k: v.detach().clone() for k, v in full.items()}, args.out)
        if rc == 0:
            print("done", flush=True)
    return rc


def finish(uploader) -> int:
    """Before declaring success: a failed async upload, or a checkpoint that never got
    all its parts (e.g. expected_uploads set wrong), ends the run with its error and
    exit code, not a silent 0 (ROLL itself never calls ``wait``)."""
    try:
        uploader.wait()
    except CloudCkptError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exit_code(exc)
    return 0


def save(out: Path, ckpt_id: str, gs: int, rank: int, model, optim, sched, loader,
         log_history, uploader) -> None:
    """ROLL's do_checkpoint: each worker stages locally, then uploads its directory."""
    actor = out / f"actor_train-{rank}" / ckpt_id
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(actor / "dcp"))
    (actor / "rng_state").mkdir(parents=True, exist_ok=True)
    torch.save({"rng": get_rng_state(), "lr_scheduler": sched.state_dict()},
               actor / "rng_state" / f"rng_state_{rank}.pth")
    full, _ = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True,
                                                                      cpu_offload=True))
    if rank == 0:  # actor rank 0: the HF export at the checkpoint's root
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in full.items()}, actor / "model.safetensors")
        (actor / "config.json").write_text(json.dumps(
            {"architectures": ["TinyMLP"], "d_in": D_IN, "hidden": HIDDEN, "d_out": D_OUT}))
    uploader.upload(ckpt_id=ckpt_id, local_state_path=str(actor))
    if rank == 0:  # the pipeline's own state
        pipe = out / "pipeline" / ckpt_id / "pipeline"
        pipe.mkdir(parents=True, exist_ok=True)
        state = {"kv": {"dataloader": loader.state_dict()}, "log_history": log_history,
                 "step": gs}
        (pipe / "worker_state_pipeline.json").write_text(json.dumps(state, indent=2,
                                                                    sort_keys=True))
        torch.save(get_rng_state(), pipe / "rng_state_pipeline.pth")
        uploader.upload(ckpt_id=ckpt_id, local_state_path=str(pipe.parent))
        print(f"saving step {gs}", flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo() -> int:
    """Start a local S3, train on 2 ranks, kill at step 7, resume from the bucket."""
    from cloudckpt_testkit import MotoServer

    from cloudckpt import list_checkpoints

    config = str(Path(__file__).with_name("config.yaml"))
    with MotoServer() as server, tempfile.TemporaryDirectory() as tmp:
        server.create_bucket("cloudckpt-example")
        opts = json.dumps(server.storage_options())
        env = {**os.environ, **server.env(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", __file__,
               "--config", config, "--storage-options", opts,
               "--set", f"output_dir={tmp}/staging", "--step-delay", "0.2"]
        first = subprocess.run([*cmd, "--crash-at-step", "7"], env=env, capture_output=True,
                               text=True)
        print(first.stdout, f"-- killed (exit {first.returncode}); restarting --", sep="")
        second = subprocess.run(cmd, env=env, capture_output=True, text=True)
        print(second.stdout)
        root = "s3://cloudckpt-example/roll/cloudckpt-roll-example"
        for c in list_checkpoints(root, server.storage_options()):
            print(f"{c.uri}  step {c.step}  {c.files} objects")
        return second.returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(Path(__file__).with_name("config.yaml")))
    p.add_argument("--set", action="append", default=[], help="override: key=value")
    p.add_argument("--storage-options", default=None, help="JSON storage options")
    p.add_argument("--crash-at-step", type=int, default=None)
    p.add_argument("--out", default=None, help="write the final parameters here")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="sleep this long per step (stands in for real training work)")
    p.add_argument("--embedded-s3", action="store_true", help="run the demo on a local S3")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return demo() if args.embedded_s3 else train(args)


if __name__ == "__main__":
    sys.exit(main())
