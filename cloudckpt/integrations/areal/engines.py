"""What AReaL's engines contribute to a checkpoint: model, optimizer and LR scheduler,
and their (possibly sharded) state dicts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ... import coordination as coord
from ...errors import ConfigError


@dataclass
class Engine:
    """What AReaL's TrainEngine contributes to a checkpoint: a model, its optimizer
    (optional) and LR scheduler (optional). Any object with ``model``/``optimizer``
    attributes, or a bare ``nn.Module``, is accepted where an Engine is."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None


def _as_engine(obj: Any) -> Engine:
    if isinstance(obj, Engine):
        return obj
    if isinstance(obj, torch.nn.Module):
        return Engine(obj)
    if isinstance(obj, tuple) and 1 <= len(obj) <= 3:
        return Engine(*obj)
    model = getattr(obj, "model", None)
    if isinstance(model, torch.nn.Module):
        return Engine(model, getattr(obj, "optimizer", None), getattr(obj, "lr_scheduler", None))
    raise ConfigError(f"cannot checkpoint a {type(obj).__name__}: pass an nn.Module, an "
                      "Engine(model, optimizer, lr_scheduler) or an object with .model")


def _engines(engine: Any) -> dict[str, Engine]:
    if isinstance(engine, Mapping):
        if not engine:
            raise ConfigError("no engine to checkpoint")
        return {str(k): _as_engine(v) for k, v in engine.items()}
    return {"default": _as_engine(engine)}


def _engine_state(eng: Engine) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if eng.optimizer is None:
        return {"model": get_model_state_dict(eng.model)}
    msd, osd = get_state_dict(eng.model, eng.optimizer)
    return {"model": msd, "optim": osd}


def _set_engine_state(eng: Engine, state: Mapping[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if eng.optimizer is None:
        set_model_state_dict(eng.model, state["model"])
    else:
        set_state_dict(eng.model, eng.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def _is_sharded(model: torch.nn.Module) -> bool:
    return coord.initialized() and any(type(p).__name__ == "DTensor"
                                       for p in model.parameters())


def _full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's tensors on the CPU (FSDP shards gathered; a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
