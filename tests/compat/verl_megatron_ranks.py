"""The local-staging path of verl 0.9.1's Megatron checkpoint manager on a bucket, on 2
gloo ranks (CPU), under ``cloudckpt run``.

:func:`check` runs on the ranks of verl_sft_ranks.py (plan key ``megatron``), whose
launch it shares.

verl's ``MegatronCheckpointManager`` needs CUDA (its model, its RNG tracker, Megatron-
Core's writer), and Megatron-Core 0.16.1's ``dist_checkpointing`` does not run on CPU
either: its torch_dist writer calls ``torch.cuda.synchronize()`` before writing and
all-reduces a CUDA tensor after. So the stand-in is :class:`MegatronLayout`: verl's
class with its ``save_checkpoint``/``load_checkpoint`` replaced by CPU ones writing
verl's v2 layout through verl's own path helpers (``model/``, ``optimizer/``,
``extra/dist_ckpt/``, ``transformer_config.json``) and verl's own
``_write_checkpoint_manifest`` (``ckpt_contents.json``, last); each ``dist_ckpt`` holds
what Megatron's torch_dist format holds: torch DCP's ``.metadata`` and
``__R_0.distcp`` shards, and Megatron-Core's own ``metadata.json`` (its
``save_config``). The bound wrappers are cloudckpt's ``bind_megatron_manager`` applied to
a module holding the stand-in, as activation applies it to verl's module (whose class
the report shows bound too).

Each rank reports: whether the loaded tensors equal the saved
ones, the role part's files (rank 0), the same after ``cloudckpt verl upload`` and
``download`` of a step, and the error an ``async_save`` gets.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

WORLD = 2
PARTS = ("model", "optimizer", "extra")


def layout_class() -> Any:
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.utils.megatron_utils import (
        get_extra_dist_checkpoint_path,
        get_model_dist_checkpoint_path,
        get_optimizer_dist_checkpoint_path,
        get_transformer_config_checkpoint_path,
    )

    paths = {"model": get_model_dist_checkpoint_path,
             "optimizer": get_optimizer_dist_checkpoint_path,
             "extra": get_extra_dist_checkpoint_path}

    class MegatronLayout(MegatronCheckpointManager):
        """verl's Megatron manager over plain tensors (``__init__`` builds a Megatron
        model on CUDA: the attributes verl's own manifest writer reads are set here)."""

        def __init__(self, state: dict[str, torch.Tensor], async_save: bool = False) -> None:
            self.state = state
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.checkpoint_config = OmegaConf.create({"async_save": async_save})
            self.checkpoint_save_contents = self.checkpoint_load_contents = list(PARTS)
            self.use_dist_checkpointing, self.bridge, self.peft_cls = True, None, None
            self.lr_scheduler = self.processing_class = None
            self.role, self.arch = "actor", "Qwen2ForCausalLM"

        def save_checkpoint(self, local_path, hdfs_path=None, global_step=0,
                            max_ckpt_to_keep=None):
            for part, path_of in paths.items():
                path = path_of(local_path)
                dcp.save({f"{part}.rank{self.rank}": self.state[part]}, checkpoint_id=path)
                if self.rank == 0:
                    save_config(CheckpointingConfig("torch_dist"), path)
            if self.rank == 0:
                Path(get_transformer_config_checkpoint_path(local_path)).write_text(
                    json.dumps({"num_layers": 2, "hidden_size": 32}))
            dist.barrier()
            self._write_checkpoint_manifest(local_path, global_step, True)  # verl's, last

        def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
            from megatron.core.dist_checkpointing.core import check_is_distributed_checkpoint

            self._raise_for_old_layout(local_path)  # verl's own check of the layout
            assert Path(local_path, "ckpt_contents.json").is_file()
            for part, path_of in paths.items():
                path = path_of(local_path)
                assert check_is_distributed_checkpoint(path), path
                into = {f"{part}.rank{self.rank}": torch.zeros_like(self.state[part])}
                dcp.load(into, checkpoint_id=path)
                self.state[part] = into[f"{part}.rank{self.rank}"]

    return MegatronLayout


def both_ways(cls: Any, saved: dict, role_uri: str, out: str) -> list[bool]:
    """A step verl wrote on local disk, committed with ``cloudckpt verl upload``, loads
    from the bucket; the committed step, after ``cloudckpt verl download``, loads under
    verl's own (unbound: local) path."""
    from verl_sft_ranks import cli

    root = role_uri.rsplit("/", 2)[0]
    local = Path(out, "verl-local", "global_step_3")
    cls(dict(saved)).save_checkpoint(str(local / "actor"), None, 3, None)  # verl's own
    cli(["upload", str(local), root])
    results = []
    fresh = cls({p: torch.zeros(64) for p in PARTS})
    fresh.load_checkpoint(f"{root}/global_step_3/actor")
    results.append(all(torch.equal(fresh.state[p], saved[p]) for p in PARTS))
    cli(["download", f"{root}/global_step_3", str(Path(out, "downloaded"))])
    fresh = cls({p: torch.zeros(64) for p in PARTS})
    fresh.load_checkpoint(str(Path(out, "downloaded", "global_step_3", "actor")))
    results.append(all(torch.equal(fresh.state[p], saved[p]) for p in PARTS))
    return results


def check(role_uri: str, out: str) -> dict[str, Any]:
    """This rank's part of the checks (call on both ranks of a gloo group)."""
    from verl.utils.checkpoint import megatron_checkpoint_manager as verls

    from cloudckpt.integrations.verl.binding import bind_megatron_manager

    rank = dist.get_rank()
    report: dict[str, Any] = {
        "verl_class_bound": hasattr(verls.MegatronCheckpointManager.save_checkpoint,
                                    "__wrapped__")}
    cls = layout_class()
    bind_megatron_manager(SimpleNamespace(MegatronCheckpointManager=cls))
    g = torch.Generator().manual_seed(rank)
    saved = {p: torch.randn(64, generator=g) for p in PARTS}
    cls(dict(saved)).save_checkpoint(role_uri, None, 2, None)
    if rank == 0:
        from cloudckpt import open_checkpoint

        part = open_checkpoint(role_uri)
        part.verify(deep=True)
        report.update(kind=part.manifest.kind, metadata=part.metadata,
                      files=sorted(part.files))
    fresh = cls({p: torch.zeros(64) for p in PARTS})
    fresh.load_checkpoint(role_uri)
    report["same"] = all(torch.equal(fresh.state[p], saved[p]) for p in PARTS)
    report["both_ways"] = both_ways(cls, saved, role_uri, out)
    try:
        cls(dict(saved), async_save=True).save_checkpoint(role_uri + "-async", None, 3)
    except Exception as exc:  # noqa: BLE001 - reported
        report["async_error"] = f"{type(exc).__name__}: {exc}"
    return report
