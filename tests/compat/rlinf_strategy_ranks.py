"""RLinf 0.3.0's own FSDP2 strategy saves and loads a step on 2 gloo ranks (CPU).

    python tests/compat/rlinf_strategy_ranks.py --dir DIR --format dcp|local_shard [--out OUT]

DIR may be a bucket URI: run under ``cloudckpt run`` (activation binds cloudckpt into
the strategy), the strategy's own calls commit the step there, and the checks read
it back through cloudckpt; OUT (default DIR/_reports) is where the ranks report.

Uses the PyPI ``rlinf==0.3.0`` (installed ``--no-deps``), never the partial copy in
``shared/peers/rlinf/src`` (that path is removed from ``sys.path`` before import).
The strategy is built as ``FSDPModelManager.__init__`` / ``setup_model_and_optimizer``
build it (fsdp_model_manager.py:90-99, 289-298): ``create_device_mesh(world_size)``,
``FSDPStrategyBase.create(cfg, world_size, dp_group, logger)``, ``strategy.wrap_model``,
AdamW as ``build_optimizer`` makes it plus ``warmup_optimizer_state``, and
``get_lr_scheduler`` as ``build_lr_scheduler`` calls it. FSDPModelManager itself is
not imported: it needs ``transformers.AutoModelForVision2Seq`` (gone in transformers 5).

Each rank trains 2 steps, calls ``strategy.save_checkpoint(model, optimizer,
lr_scheduler, DIR/global_step_2/actor, checkpoint_format=FORMAT)``, trains 2 more steps,
then builds a fresh model/strategy/optimizer/scheduler (other seed), calls
``strategy.load_checkpoint(..., DIR/global_step_2/actor, checkpoint_format=FORMAT)``
and checks with ``torch.equal``: model local shards and gathered full tensors,
optimizer state (local shards) and param groups, lr scheduler state, RNG state,
``model_state_dict/full_weights.pt``, and that 2 further steps after the load give
the same model/optimizer as the 2 steps after the save. For local_shard the file each
rank wrote (``local_shard_checkpoint/checkpoint_rank_N.pt``) is also compared. On a
bucket, the dcp step copied to ``global_step_5`` must be refused by a third fresh
strategy's load, which must leave its state as it was (reported as ``refused``).

Exit 0 when everything matched, 1 otherwise (each rank's differences are printed).
RLinf 0.3.0's local_shard *load* fails under FSDP2 (``Checkpoint.load_state_dict`` calls
``model.load_state_dict`` with local shards into DTensor params: size mismatch), so
``--format local_shard`` reports that error and exits 1; its save side is checked.

CPU only: RLinf's ``Worker.torch_platform`` is ``None`` when no accelerator is found
(AcceleratorUtil.get_torch_platform(NO_ACCEL)), and ``clear_memory()`` /
``get_rng_state()`` / ``create_device_mesh()`` call it. The script sets the two class
attributes that ``Worker._env_setup_before_init`` sets on a real worker
(``Worker.torch_platform`` / ``Worker.torch_device_type``) to a CPU stand-in whose
``is_available()`` is False (so RLinf's RNG state has only cpu/numpy/random, as on a
machine without an accelerator). No RLinf file is edited.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import socket
import sys
import time
from pathlib import Path

# The PyPI package, not the partial upstream copy that tests/compat/conftest.py puts first.
sys.path[:] = [p for p in sys.path if "peers/rlinf" not in p.replace(os.sep, "/")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD = 2
STEPS_BEFORE, STEPS_AFTER = 2, 2
STEP_DIR = f"global_step_{STEPS_BEFORE}"


class CpuPlatform:
    """What RLinf calls on ``Worker.torch_platform`` (torch.cuda on a GPU node)."""

    synchronize = staticmethod(torch.cpu.synchronize)

    @staticmethod
    def ipc_collect() -> None: ...

    @staticmethod
    def empty_cache() -> None: ...

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def set_device(_device) -> None: ...


def cfg_for(fmt: str):
    from omegaconf import OmegaConf

    # The keys of an RLinf actor config that FSDP2Strategy / the manager read.
    return OmegaConf.create({
        "training_backend": "fsdp",
        "model": {"precision": "fp32"},
        "fsdp_config": {
            "strategy": "fsdp2",
            "mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32",
                                "buffer_dtype": "fp32"},
            "cpu_offload": False,
            "offload_pin_memory": False,
            "reshard_after_forward": True,
            "enable_gradient_accumulation": False,
            "save_full_model_weights": True,
            # apply_fsdp2_to_model needs a layer class to shard (matched by class name).
            "wrap_policy": {"transformer_layer_cls_to_wrap": ["Linear"]},
        },
        "optim": {"lr": 1e-2, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8,
                  "weight_decay": 0.01, "clip_grad": 1.0, "lr_scheduler": "constant",
                  "lr_warmup_steps": 3, "total_training_steps": 10},
        "checkpoint_format": fmt,  # not read by RLinf; passed explicitly below
    })


def build(cfg, seed: int):
    from rlinf.hybrid_engines.fsdp.strategy.base import FSDPStrategyBase
    from rlinf.hybrid_engines.fsdp.strategy.fsdp2 import FSDP2Strategy
    from rlinf.hybrid_engines.fsdp.utils import create_device_mesh, get_lr_scheduler
    from rlinf.utils.logging import get_logger
    from rlinf.utils.utils import warmup_optimizer_state

    # Same seed on every rank: every rank starts from the same weights before sharding,
    # and RLinf's RNG entries are replicated keys in DCP (one copy is kept).
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    module = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(16, 7),  # 7 rows: uneven shards (4 + 3)
        torch.nn.LayerNorm(7),   # left to the root fully_shard
        torch.nn.Linear(7, 3),
    )
    mesh = create_device_mesh(WORLD)
    dp_group = mesh["ddp"].get_group() if "ddp" in mesh.mesh_dim_names else None
    strategy = FSDPStrategyBase.create(cfg, WORLD, dp_group, get_logger())
    assert type(strategy) is FSDP2Strategy, type(strategy)
    model = strategy.wrap_model(model=module, device_mesh=mesh)
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.requires_grad], "lr": o.lr,
          "betas": (o.adam_beta1, o.adam_beta2)}],
        eps=o.adam_eps, weight_decay=o.weight_decay)
    warmup_optimizer_state(optimizer)
    lr_scheduler = get_lr_scheduler(
        lr_scheduler=o.lr_scheduler, optimizer=optimizer, num_warmup_steps=o.lr_warmup_steps,
        num_training_steps=o.total_training_steps)
    return strategy, model, optimizer, lr_scheduler


def train(strategy, model, optimizer, lr_scheduler, first: int, steps: int) -> None:
    """Per-rank data from a generator keyed by (rank, step); dropout uses the global RNG."""
    rank = dist.get_rank()
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
        with strategy.before_micro_batch(model, is_last_micro_batch=True):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
        strategy.clip_grad_norm_(model)
        optimizer.step()
        optimizer.zero_grad()
        lr_scheduler.step()


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def snapshot(model, optimizer, lr_scheduler) -> dict:
    """Everything that must come back, as local shards plus gathered full tensors."""
    msd = model.state_dict()
    return {
        "model_local": {k: _local(v).detach().clone() for k, v in msd.items()},
        "model_full": {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                       for k, v in msd.items()},
        "optim": _clone(optimizer.state_dict()),
        "sched": _clone(lr_scheduler.state_dict()),
        "rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(),
                "random": random.getstate()},
    }


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return _local(obj).detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def diff(a, b, path: str = "") -> list[str]:
    """Paths where a and b differ: tensors by torch.equal (dtype and shape too)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
              and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
        return [] if ok else [path]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(a, b) else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path} keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} len {len(a)} != {len(b)}"]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts]) if "://" in root else os.path.join(root, *parts)


def read_file(save_path: str, rel: str, *, weights_only: bool):
    """A file the strategy wrote: from disk, or from the committed part in the bucket."""
    if "://" not in save_path:
        return torch.load(os.path.join(save_path, rel), weights_only=weights_only)
    import io

    from cloudckpt import open_checkpoint

    data = open_checkpoint(save_path).read(rel)  # checked against the manifest's CRC32C
    return torch.load(io.BytesIO(data), weights_only=weights_only)


def rank_main(rank: int, port: int, root: str, formats: list[str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        import rlinf
        from rlinf.scheduler import Worker

        assert "peers/rlinf" not in rlinf.__file__, rlinf.__file__
        # What Worker._env_setup_before_init sets on a real worker; None without accelerator.
        Worker.torch_platform = CpuPlatform()
        Worker.torch_device_type = "cpu"
        for fmt in formats:  # one launch for both: most of a run is importing
            report = {"rank": rank, "rlinf": rlinf.__file__,
                      **check_format(rank, join(root, fmt), fmt)}
            with open(os.path.join(out, f"rank{rank}-{fmt}.json"), "w") as f:
                json.dump(report, f)
            dist.barrier()
    finally:
        gc.collect()  # FSDP2's gloo work freed now, not at shutdown (examples/train_resume.py)
        dist.destroy_process_group()


def check_format(rank: int, root: str, fmt: str) -> dict:
    """Save, train on, load into a fresh strategy, compare; what went wrong, if anything."""
    cfg = cfg_for(fmt)
    save_path = join(root, STEP_DIR, "actor")
    timings = {}

    strategy, model, optimizer, sched = build(cfg, seed=0)
    train(strategy, model, optimizer, sched, 0, STEPS_BEFORE)
    saved = snapshot(model, optimizer, sched)
    t = time.perf_counter()
    strategy.save_checkpoint(model, optimizer, sched, save_path,
                             save_full_model_weights=True, checkpoint_format=fmt)
    timings["save_s"] = time.perf_counter() - t
    train(strategy, model, optimizer, sched, STEPS_BEFORE, STEPS_AFTER)
    expected = snapshot(model, optimizer, sched)
    problems = diff(saved["model_local"], expected["model_local"], "moved")
    assert problems, "training after the save did not change the model"

    problems = []
    if rank == 0:
        full = read_file(save_path, "model_state_dict/full_weights.pt", weights_only=True)
        problems += diff(saved["model_full"], full, "full_weights.pt")
    if fmt == "local_shard":
        # The file this rank wrote (base.py:228-231) holds exactly the saved state.
        own = read_file(save_path, f"local_shard_checkpoint/checkpoint_rank_{rank}.pt",
                        weights_only=False)
        problems += diff({"model_local": saved["model_local"], "optim": saved["optim"],
                          "sched": [saved["sched"]], "rng": saved["rng"]},
                         {"model_local": own["model"], "optim": _clone(own["optimizers"]),
                          "sched": own["lr_schedulers"], "rng": own["rng"]},
                         f"checkpoint_rank_{rank}.pt")

    strategy2, model2, optimizer2, sched2 = build(cfg, seed=123)
    train(strategy2, model2, optimizer2, sched2, 50, 1)  # other state everywhere
    t = time.perf_counter()
    load_error = None
    try:
        strategy2.load_checkpoint(model2, optimizer2, sched2, save_path,
                                  checkpoint_format=fmt)
    except Exception as e:  # reported, and the comparisons that need it are skipped
        lines = str(e).splitlines()
        load_error = (f"{type(e).__name__}: {lines[0] if lines else ''} "
                      f"{lines[1].strip() if len(lines) > 1 else ''} "
                      f"({sum('size mismatch' in x for x in lines)} size mismatches)")
    timings["load_s"] = time.perf_counter() - t
    failed = torch.tensor([load_error is not None], dtype=torch.int32)
    dist.all_reduce(failed)  # every rank skips the collectives below alike
    if load_error is not None:
        problems.append(f"RLinf load_checkpoint raised {load_error}")
    elif failed.item():
        problems.append("load_checkpoint raised on another rank")
    else:
        loaded = snapshot(model2, optimizer2, sched2)
        problems += diff(saved, loaded, "loaded")
        train(strategy2, model2, optimizer2, sched2, STEPS_BEFORE, STEPS_AFTER)
        resumed = snapshot(model2, optimizer2, sched2)
        problems += diff(expected, resumed, "resumed")

    refused = refused_copy(cfg, save_path, fmt) if "://" in root and fmt == "dcp" else None
    if refused is not None:
        problems += refused.pop("problems")
    return {"strategy": type(strategy).__name__, "problems": problems, **timings,
            "tensors_checked": sum(1 for _ in _tensors(saved)), "refused": refused}


def refused_copy(cfg, save_path: str, fmt: str) -> dict:
    """The part copied under a newer step (``cloudckpt cp``: its manifest keeps step 2):
    the strategy's load refuses it on every rank before it loads anything."""
    from cloudckpt.movement.checkpoint_copy import copy_checkpoint

    newer = save_path.replace(STEP_DIR, "global_step_5")
    if dist.get_rank() == 0:
        copy_checkpoint(save_path, newer)
    dist.barrier()
    strategy, model, optimizer, sched = build(cfg, seed=7)
    train(strategy, model, optimizer, sched, 60, 1)
    before = snapshot(model, optimizer, sched)
    try:
        strategy.load_checkpoint(model, optimizer, sched, newer, checkpoint_format=fmt)
        error = None
    except Exception as e:  # noqa: BLE001 - the test reads what was raised
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "problems": diff(before, snapshot(model, optimizer, sched),
                                             "after the refused load")}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="local directory or bucket URI for the step")
    ap.add_argument("--format", required=True,
                    help="dcp, local_shard, or both comma-separated (each below DIR/FORMAT)")
    ap.add_argument("--out", default=None, help="local directory for the ranks' reports")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import importlib.util

    # The ranks import it (and report rlinf.__file__); the same sys.path is theirs.
    print(f"rlinf imported from {importlib.util.find_spec('rlinf').origin}", flush=True)
    root = args.dir if "://" in args.dir else os.path.abspath(args.dir)
    out = args.out or os.path.join(root, "_reports")
    os.makedirs(out, exist_ok=True)
    formats = args.format.split(",")
    assert set(formats) <= {"dcp", "local_shard"}, formats
    mp.spawn(rank_main, args=(_free_port(), root, formats, out), nprocs=WORLD, join=True)
    failed = False
    for fmt in formats:
        step = join(root, fmt, STEP_DIR, "actor")
        if "://" in step:
            from cloudckpt import open_checkpoint

            files = sorted(open_checkpoint(step).files)
        else:
            files = sorted(p.relative_to(step).as_posix() for p in Path(step).rglob("*")
                           if p.is_file())
        print(f"files in {step}: {json.dumps(files)}")
        for r in range(WORLD):
            rep = json.loads(Path(out, f"rank{r}-{fmt}.json").read_text())
            print(f"rank {r} {fmt}: {rep['strategy']} from {rep['rlinf']}; save "
                  f"{rep['save_s']:.3f}s, load {rep['load_s']:.3f}s, {rep['tensors_checked']} "
                  f"tensors; problems: {rep['problems'] or 'none'}")
            failed |= bool(rep["problems"])
    wall = time.perf_counter() - t0
    print(f"{'FAIL' if failed else 'PASS'} format={args.format} wall={wall:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
