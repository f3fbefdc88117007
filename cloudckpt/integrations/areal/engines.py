"""What AReaL's engines are to a checkpoint: objects with AReaL's ``save(meta)`` and
``load(meta)``, which write and read a local path in their own format.

AReaL's own engines (FSDP, Megatron, Archon) are used as they are, so the bytes are
exactly AReaL's. A plain ``nn.Module``, or an :class:`Engine` (model, optimizer, LR
scheduler), is wrapped in :class:`ModuleEngine`, which writes what AReaL's FSDP engine
writes: DCP with keys ``dcp.model.*`` and ``dcp.optim.*`` for a recover checkpoint, a
Hugging Face folder for an export. An export needs a Hugging Face config: a
``transformers`` model's own ``.config``, else ``Engine(..., hf_config=...)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cloudckpt import hf
from cloudckpt.errors import ConfigError
from cloudckpt.integrations.areal.config import areal_class
from cloudckpt.runtime import coordination as coord


@dataclass
class SaveLoadMeta:
    """AReaL's ``SaveLoadMeta`` fields, for users without AReaL installed."""

    path: str
    weight_format: str
    with_optim: bool
    tokenizer: Any = None
    processor: Any = None
    base_model_path: str | None = None
    naive_distributed: bool = False


def save_load_meta(**fields: Any) -> Any:
    """AReaL's own ``SaveLoadMeta`` when AReaL is in use, this module's otherwise."""
    return areal_class("areal.api.io_struct", "SaveLoadMeta", SaveLoadMeta)(**fields)


@dataclass
class Engine:
    """A model, its optimizer and LR scheduler (both optional), and the Hugging Face
    config its exports carry (taken from ``model.config`` when not given)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None
    hf_config: Any = None


class _DCPState:
    """AReaL's FSDP ``DCPState``: the model and optimizer as DCP's stateful ``dcp``."""

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is None:
            set_model_state_dict(self.model, state["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])


class ModuleEngine:
    """AReaL's engine interface over a plain model: ``save``/``load`` of a
    :class:`SaveLoadMeta` in the FSDP engine's formats. The LR scheduler, which
    AReaL's engines do not checkpoint, is saved beside (``lr_scheduler.*`` keys) and
    restored when present."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def save(self, meta: Any) -> None:
        import torch.distributed.checkpoint as dcp

        eng = self.engine
        if meta.weight_format == "hf":
            self._export(meta)
        elif meta.weight_format == "dcp":
            state: dict[str, Any] = {"dcp": _DCPState(eng.model, eng.optimizer
                                                      if meta.with_optim else None)}
            if eng.lr_scheduler is not None:
                state["lr_scheduler"] = eng.lr_scheduler.state_dict()
            dcp.save(state, checkpoint_id=meta.path)
        else:
            raise ConfigError(f"unknown weight format {meta.weight_format!r}: AReaL's are "
                              "'hf' and 'dcp'")

    def load(self, meta: Any) -> None:
        import torch.distributed.checkpoint as dcp

        eng = self.engine
        if meta.weight_format != "dcp":
            raise ConfigError(f"ModuleEngine loads only 'dcp' recover checkpoints, not "
                              f"{meta.weight_format!r}")
        state: dict[str, Any] = {"dcp": _DCPState(eng.model, eng.optimizer
                                                  if meta.with_optim else None)}
        saved = dcp.FileSystemReader(meta.path).read_metadata().state_dict_metadata
        sched = eng.lr_scheduler
        if sched is not None and any(k.startswith("lr_scheduler.") for k in saved):
            state["lr_scheduler"] = sched.state_dict()
        dcp.load(state, checkpoint_id=meta.path)
        if "lr_scheduler" in state:
            sched.load_state_dict(state["lr_scheduler"])

    def _export(self, meta: Any) -> None:
        """A Hugging Face folder at ``meta.path``: the whole model, written by rank 0."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        model = self.engine.model
        sharded = coord.initialized() and any(type(p).__name__ == "DTensor"
                                              for p in model.parameters())
        # A sharded (FSDP2) model is gathered on every rank; a plain one is exported as
        # itself, so transformers' tied weights and generation config are honoured.
        source: Any = get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True)) if sharded else model
        config = self.engine.hf_config or getattr(model, "config", None)
        if config is None:  # said before any rank writes, not as hf.export's complaint
            raise ConfigError(
                f"cannot export a {type(model).__name__} as a Hugging Face folder: it has no "
                ".config. Pass Engine(model, optimizer, lr_scheduler, hf_config=...) (a dict "
                "or a transformers PretrainedConfig); a bare nn.Module only works for a "
                "transformers model, which carries its config")
        if coord.rank() == 0:
            hf.export(source, str(Path(meta.path).resolve()), config=config,
                      tokenizer=meta.tokenizer)


def as_engine(obj: Any) -> Any:
    """``obj`` if it has AReaL's engine interface, else a :class:`ModuleEngine` for a
    model, an :class:`Engine`, a (model, optimizer, scheduler) tuple or an object with
    ``.model``."""
    if callable(getattr(obj, "save", None)) and callable(getattr(obj, "load", None)) \
            and not isinstance(obj, torch.nn.Module):
        return obj
    if isinstance(obj, Engine):
        return ModuleEngine(obj)
    if isinstance(obj, torch.nn.Module):
        return ModuleEngine(Engine(obj))
    if isinstance(obj, tuple) and 1 <= len(obj) <= 3:
        return ModuleEngine(Engine(*obj))
    model = getattr(obj, "model", None)
    if isinstance(model, torch.nn.Module):
        return ModuleEngine(Engine(model, getattr(obj, "optimizer", None),
                                   getattr(obj, "lr_scheduler", None)))
    raise ConfigError(f"cannot checkpoint a {type(obj).__name__}: pass an AReaL engine, an "
                      "nn.Module, an Engine(model, optimizer, lr_scheduler) or an object "
                      "with .model")


def engines_of(engine: Any) -> dict[str, Any]:
    """AReaL's engine argument: one engine (named ``default``) or a dict of them."""
    if isinstance(engine, Mapping):
        if not engine:
            raise ConfigError("no engine to checkpoint")
        return {str(k): as_engine(v) for k, v in engine.items()}
    return {"default": as_engine(engine)}
