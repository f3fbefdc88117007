"""verl 0.9.1's SFT ``CheckpointHandler`` on 2 gloo ranks (CPU), as verl's
``SFTTrainer`` drives it (``verl/trainer/sft_trainer.py``: one handler per run, its
``save_checkpoint(step)`` on every rank, ``load_checkpoint()`` at start).

    python tests/compat/verl_sft_ranks.py PLAN.json OUT_DIR

PLAN: ``root`` (``trainer.default_local_dir``), ``hdfs`` (``default_hdfs_dir``),
``keep`` (``max_ckpt_to_keep``), ``steps`` to save, then ``resumes``: each a
``[resume_mode, resume_from_path]`` that a fresh handler loads, or a dict of ``mode``,
``path``, its own ``root`` and ``hdfs``, ``before``: ``cloudckpt verl`` command lines
rank 0 runs first, in a process of its own (the other rank waits), ``cp``: ``[SRC,
DST]`` for ``cloudckpt cp`` likewise, and ``refused``: the load is expected to raise
(its error and the fresh state's digests before and after it are reported). With
``resume_save`` (steps), the run starts as a relaunched job does instead: fresh state,
the handler's ``load_checkpoint()`` (``resume_mode: auto``), then it trains and saves
those steps. With ``hang``, each rank then touches ``OUT_DIR/hanging{R}`` and waits
(a run still going, for a test to kill). Each rank writes ``OUT_DIR/rank{R}.json``: the
digests and the next dataloader item at every saved step, the step it resumed at, and
what each resume brought back; with ``megatron`` (a role URI), also the report of
verl_megatron_ranks' checks, run on the same ranks.

The engine is verl's own ``FSDPEngine`` (``verl/workers/engine/fsdp/transformer_impl.py``),
made with ``__new__`` over verl_parts' FSDP2 model and verl's ``FSDPCheckpointManager``:
its ``__init__`` builds the model from a model config on an accelerator. Its checkpoint
calls, ``is_mp_src_rank_with_outputs`` and ``get_data_parallel_rank`` run as written;
``_uses_fsdp2_cpu_offload_policy`` is set so that its ``save_checkpoint`` does not move
the CPU model to a GPU first (what that policy means: the parameters live on the CPU).
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verl_parts import Trainable  # noqa: E402

WORLD = 2
ITEMS = 4096


def engine_for(trainable: Trainable) -> Any:
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    engine = FSDPEngine.__new__(FSDPEngine)
    engine.module, engine.optimizer = trainable.model, trainable.optimizer
    engine.checkpoint_manager = trainable.manager
    engine.ulysses_device_mesh = None
    engine._is_offload_param = engine._is_offload_optimizer = False
    engine._uses_fsdp2_cpu_offload_policy = True
    return engine


def loader(rank: int, step: int) -> Any:
    """Each data-parallel rank's own items, ``step`` of them drawn."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    dl = StatefulDataLoader(list(range(rank * ITEMS, (rank + 1) * ITEMS)), batch_size=1)
    it = iter(dl)
    for _ in range(step):
        next(it)
    return dl


def peek(dl: Any) -> list[int]:
    """The item ``dl`` draws next, without drawing it (a new iterator draws a seed from
    torch's RNG, which the save that follows keeps: it is put back)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    with torch.random.fork_rng(devices=[]):
        copy = StatefulDataLoader(dl.dataset, batch_size=1)
        copy.load_state_dict(dl.state_dict())
        return next(iter(copy)).tolist()


def handler_for(plan: dict, engine: Any, dl: Any, mode: str = "auto",
                path: str | None = None) -> Any:
    from verl.utils.checkpoint import CheckpointHandler

    return CheckpointHandler(engine, dl, default_local_dir=plan["root"],
                             max_ckpt_to_keep=plan.get("keep"),
                             default_hdfs_dir=plan.get("hdfs"), resume_mode=mode,
                             resume_from_path=path)


def cli(args: list[str], *, command: list[str] | None = None) -> None:
    """``cloudckpt verl ARGS`` (or ``command`` for ``verl``) on rank 0, in a process of
    its own (outside the ranks' process group), the other rank waiting."""
    if dist.get_rank() == 0:
        r = subprocess.run([sys.executable, "-m", "cloudckpt",
                            *(["verl"] if command is None else command), *args],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    dist.barrier()


def rank_main(rank: int, port: int, plan: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    report: dict[str, Any] = {"rank": rank, "saved": {}, "resumed": []}
    try:
        from verl.utils.checkpoint import CheckpointHandler

        report["bound"] = hasattr(CheckpointHandler.save_checkpoint, "__wrapped__")
        trainable = Trainable({})
        engine = engine_for(trainable)
        dl = loader(rank, 0)
        handler = handler_for(plan, engine, dl)
        steps = plan.get("steps", [])
        if "resume_save" in plan:  # a relaunched job: resume, then train and save on
            trainable.train(1, 99)  # other state everywhere, as after a fresh start
            report["resumed_at"] = handler.load_checkpoint()
            steps = plan["resume_save"]
        it = iter(dl)
        for step in steps:
            trainable.train(1, step)
            next(it)
            report["saved"][step] = {"digests": trainable.digests(), "next": peek(dl)}
            handler.save_checkpoint(step)
        if plan.get("hang"):  # a run still going when its node is lost
            Path(out, f"hanging{rank}").touch()
            time.sleep(3600)
        for resume in plan.get("resumes", []):
            if isinstance(resume, list):
                resume = {"mode": resume[0], "path": resume[1]}
            for args in resume.get("before", []):
                cli(args)
            if "cp" in resume:
                cli(resume["cp"], command=["cp"])
            fresh = Trainable({})
            fresh.train(1, 99)  # other state everywhere
            fresh_dl = loader(rank, 7)
            where = {**plan, **{k: resume[k] for k in ("root", "hdfs") if k in resume}}
            handler = handler_for(where, engine_for(fresh), fresh_dl, resume["mode"],
                                  resume.get("path"))
            if resume.get("refused"):
                before = fresh.digests()
                try:
                    handler.load_checkpoint()
                    error = None
                except Exception as exc:  # noqa: BLE001 - the test reads what was raised
                    error = f"{type(exc).__name__}: {exc}"
                report["resumed"].append({"error": error, "before": before,
                                          "after": fresh.digests(),
                                          "next": next(iter(fresh_dl)).tolist()})
                continue
            step = handler.load_checkpoint()
            report["resumed"].append({"step": step, "digests": fresh.digests(),
                                      "next": next(iter(fresh_dl)).tolist()})
        if plan.get("megatron"):  # verl_megatron_ranks' checks, in the same launch
            from verl_megatron_ranks import check

            report["megatron"] = check(plan["megatron"], out)
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
        gc.collect()  # FSDP2's gloo work freed now, not at shutdown (examples/train_resume.py)
        dist.destroy_process_group()


def main() -> int:
    plan = json.loads(Path(sys.argv[1]).read_text())
    out = sys.argv[2]
    os.makedirs(out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, plan, out), nprocs=WORLD, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
