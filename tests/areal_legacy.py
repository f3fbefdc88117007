"""What AReaL does today on a local disk, reduced to its ordering (written for these
tests from COMPAT.md's description, not AReaL's code): the recover checkpoint is a DCP
directory overwritten in place, and ``recover_info/step_info.json`` is written after
the weights. A crash between the two leaves new weights under old recover info."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save_weights(trial: Path, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """Step 1 of a dump: overwrite ``default/recover_checkpoint/`` in place."""
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd},
             storage_writer=dcp.FileSystemWriter(str(trial / "default" / "recover_checkpoint"),
                                                 overwrite=True))


def save_info(trial: Path, step: dict) -> None:
    """Step 2 of a dump: rank 0 writes ``recover_info/``."""
    info = trial / "recover_info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "step_info.json").write_text(json.dumps(step))


def dump(trial: Path, model: torch.nn.Module, optim: torch.optim.Optimizer,
         step: dict) -> None:
    save_weights(trial, model, optim)
    save_info(trial, step)


def load(trial: Path, model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    """Trust ``recover_info`` and load whatever weights the directory holds."""
    step = json.loads((trial / "recover_info" / "step_info.json").read_text())
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=dcp.FileSystemReader(
        str(trial / "default" / "recover_checkpoint")))
    set_state_dict(model, optim, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return step
