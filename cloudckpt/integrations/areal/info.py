"""AReaL's ``recover_info/`` directory: six files, written and read as AReaL does.

``step_info.json`` and four ``*_info.json`` (indent 4), and ``dataloader_info.pkl``: a
plain pickle of ``StatefulDataLoader.state_dict()`` (a per-rank list when distributed).
That pickle is read here with an allow-list unpickler: containers, strings, numbers,
``OrderedDict`` and CPU tensors (the sampler's generator state), nothing else, so AReaL's
files load and a pickle that would run code is refused.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloudckpt.core.expected import expect_world_size
from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.integrations.areal.config import areal_class
from cloudckpt.runtime.state import StepInfo
from cloudckpt.serialization.restricted import TENSOR_GLOBALS, restricted_loads

JSON_FILES = ("saver_info", "evaluator_info", "stats_logger_info", "checkpoint_info")
DATALOADER_FILE = "dataloader_info.pkl"


@dataclass
class RecoverInfo:
    """AReaL's ``RecoverInfo`` fields, for users without AReaL installed. Resume at
    ``last_step_info.next()``; ``dataloader_info`` is this rank's state."""

    last_step_info: Any
    saver_info: dict
    evaluator_info: dict
    stats_logger_info: dict
    dataloader_info: Any
    checkpoint_info: dict


def step_info_type() -> type:
    return areal_class("areal.api.io_struct", "StepInfo", StepInfo)


def recover_info_type() -> type:
    return areal_class("areal.utils.recover", "RecoverInfo", RecoverInfo)


def step_info_dict(step_info: Any) -> dict[str, int]:
    return {k: int(v) for k, v in dataclasses.asdict(step_info).items()}


def write(directory: Path, step_info: Any, infos: dict[str, Any], dataloader: Any) -> None:
    """Write AReaL's six files into ``directory`` (``dataloader`` as AReaL pickles it:
    the per-rank list when distributed, the one state otherwise)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "step_info.json").write_text(json.dumps(step_info_dict(step_info), indent=4))
    for name in JSON_FILES:
        (directory / f"{name}.json").write_text(json.dumps(infos[name], indent=4))
    with open(directory / DATALOADER_FILE, "wb") as f:
        pickle.dump(dataloader, f)


#: What a dataloader state pickle may name: ``OrderedDict`` and CPU tensors.
_DATALOADER_GLOBALS = {("collections", "OrderedDict"): collections.OrderedDict,
                       **TENSOR_GLOBALS}


def load_pickle(data: bytes, source: str) -> Any:
    """Decode AReaL's ``dataloader_info.pkl`` without running code it might carry."""
    try:
        return restricted_loads(data, _DATALOADER_GLOBALS, "a dataloader state")
    except Exception as exc:  # noqa: BLE001 - any refusal or damage is the same answer
        raise CorruptCheckpointError(
            f"{source} is not a dataloader state cloudckpt can read safely ({exc}); only "
            "containers, strings, numbers and tensors are accepted. If you wrote this file "
            "yourself, trust it, and load it with pickle, check where it came from first.",
            {DATALOADER_FILE: "refused"}) from None


def read(directory: Path, rank: int, world: int | None) -> Any:
    """AReaL's ``RecoverInfo`` (or ours) from ``directory``; ``dataloader_info`` is
    rank ``rank``'s entry when the file holds a per-rank list and ``world`` is given."""
    try:
        step = json.loads((directory / "step_info.json").read_text())
        infos = {n: json.loads((directory / f"{n}.json").read_text()) for n in JSON_FILES}
        raw = (directory / DATALOADER_FILE).read_bytes()
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{directory} is not AReaL recover info: {exc}",
                                     {"recover_info": "unreadable"}) from None
    loaders = load_pickle(raw, str(directory / DATALOADER_FILE))
    if isinstance(loaders, list) and world is not None:
        expect_world_size(str(directory / DATALOADER_FILE), len(loaders), world,
                          holds="the dataloader states")
        loaders = loaders[rank]
    last = step_info_type()(**{k: int(step[k]) for k in ("epoch", "epoch_step",
                                                          "global_step", "steps_per_epoch")})
    return recover_info_type()(last_step_info=last, dataloader_info=loaders, **infos)
