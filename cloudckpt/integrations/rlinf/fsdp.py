"""The actor's FSDP state dict with RLinf's keys (``fsdp_checkpoint.*``), and applying
one loaded back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ... import coordination as coord
from .layout import ROOT_KEY


def fsdp_state_dict(model: Any, optimizer: Any, lr_scheduler: Any = None, *,
                    fsdp_version: int = 2, rank: int | None = None) -> dict[str, Any]:
    """The actor's DCP state dict with RLinf's keys: ``fsdp_checkpoint.{model,
    optimizers, lr_schedulers, fsdp_version, rng}``.

    Model and optimizer come from ``get_state_dict`` (sharded DTensors under
    FSDP2). RNG states are per rank (``rng.rank_{r}``), since DCP keeps one copy
    of a key that every rank saves.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ...state import get_rng_state

    msd, osd = get_state_dict(model, optimizer)
    r = coord.rank() if rank is None else rank
    return {ROOT_KEY: {
        "model": msd, "optimizers": osd,
        "lr_schedulers": lr_scheduler.state_dict() if lr_scheduler is not None else {},
        "fsdp_version": int(fsdp_version),
        "rng": {f"rank_{r}": get_rng_state()},
    }}


def load_fsdp_state_dict(model: Any, optimizer: Any, lr_scheduler: Any,
                         state: Mapping[str, Any], *, rng: bool = True) -> None:
    """Apply a state dict loaded in place (see :meth:`RLinfCheckpointer.load`)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from ...state import set_rng_state

    inner = state[ROOT_KEY]
    set_state_dict(model, optimizer, model_state_dict=inner["model"],
                   optim_state_dict=inner["optimizers"])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(inner["lr_schedulers"])
    if rng:
        for value in inner.get("rng", {}).values():  # only this rank's entry
            set_rng_state(value)
