"""The actor's FSDP state with RLinf's keys and value types (``fsdp_checkpoint.*``),
applying one loaded back, and the full weights RLinf writes beside it.

RLinf's ``Checkpoint.state_dict()`` (``hybrid_engines/fsdp/strategy/checkpoint.py``)
is ``{model, optimizers, lr_schedulers: [sd, ...], fsdp_version: "fsdp2", rng: {cpu,
numpy, random[, cuda]}}``; anything else makes RLinf's own loader fail, so this
module builds exactly that.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cloudckpt.core.blobs import BlobArea
from cloudckpt.core.checkpoint import CheckpointWriter
from cloudckpt.errors import ConfigError
from cloudckpt.integrations.rlinf.layout import DCP_DIR, FSDP_VERSIONS, FULL_WEIGHTS, ROOT_KEY
from cloudckpt.runtime import coordination as coord
from cloudckpt.serialization.torchload import numpy_rng_allowed, torch_bytes
from cloudckpt.storage import Store


def _options() -> Any:
    """RLinf's options for the sharded state (``base.py``: not full, CPU offload)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, cpu_offload=True)


def _schedulers(lr_schedulers: Any) -> list[Any]:
    """RLinf accepts one scheduler or an iterable of them; None means none."""
    from torch.optim.lr_scheduler import LRScheduler

    if lr_schedulers is None:
        return []
    if isinstance(lr_schedulers, LRScheduler) or hasattr(lr_schedulers, "state_dict"):
        return [lr_schedulers]
    return list(lr_schedulers)


def _version(fsdp_version: Any) -> str:
    value = getattr(fsdp_version, "value", fsdp_version)  # RLinf's FSDPVersion enum too
    if value not in FSDP_VERSIONS:
        raise ConfigError(f"fsdp_version must be one of {FSDP_VERSIONS} (RLinf's "
                          f"FSDPVersion values), got {fsdp_version!r}")
    return str(value)


def get_rng_state() -> dict[str, Any]:
    """RLinf's RNG state: ``cpu`` (torch), ``numpy`` (``np.random.get_state()``),
    ``random`` (``random.getstate()``) and, on a CUDA machine, ``cuda``."""
    import numpy as np
    import torch

    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(),
                             "random": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`get_rng_state` (or RLinf's) captured."""
    import numpy as np
    import torch

    missing = [k for k in ("cpu", "numpy", "random") if k not in state]
    if missing:
        raise ConfigError(f"the RNG state lacks {missing}; RLinf stores cpu, numpy, random")
    torch.set_rng_state(state["cpu"])
    np.random.set_state(state["numpy"])
    random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def fsdp_state_dict(model: Any, optimizers: Any, lr_schedulers: Any = None, *,
                    fsdp_version: Any = "fsdp2") -> dict[str, Any]:
    """The actor's DCP state with RLinf's keys and types: ``{"fsdp_checkpoint":
    {model, optimizers, lr_schedulers, fsdp_version, rng}}``.

    Model and optimizer come from ``get_state_dict`` with RLinf's options (sharded
    DTensors under FSDP2); ``lr_schedulers`` is a list of state dicts, one per
    scheduler. Every rank saves ``rng`` under the same keys, so DCP keeps one
    rank's copy and every rank gets it back, exactly as with RLinf.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizers, options=_options())
    return {ROOT_KEY: {
        "model": msd, "optimizers": osd,
        "lr_schedulers": [s.state_dict() for s in _schedulers(lr_schedulers)],
        "fsdp_version": _version(fsdp_version),
        "rng": get_rng_state(),
    }}


def load_fsdp_state_dict(model: Any, optimizers: Any, lr_schedulers: Any,
                         state: Mapping[str, Any], *, rng: bool = True,
                         fsdp_version: Any = "fsdp2") -> None:
    """Apply a state loaded in place (see :meth:`RLinfCheckpointer.load`), as RLinf's
    ``Checkpoint.load_state_dict`` does: the FSDP version must match."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    inner = state[ROOT_KEY]
    saved = inner.get("fsdp_version")
    if saved != _version(fsdp_version):
        raise ConfigError(f"FSDP version mismatch: the checkpoint has {saved!r}, this "
                          f"job {_version(fsdp_version)!r} (RLinf refuses it too)")
    set_state_dict(model, optimizers, model_state_dict=inner["model"],
                   optim_state_dict=inner["optimizers"], options=_options())
    for sched, sd in zip(_schedulers(lr_schedulers), inner.get("lr_schedulers", []),
                         strict=False):
        sched.load_state_dict(sd)
    if rng and "rng" in inner:
        set_rng_state(inner["rng"])


def full_weights(model_state: Mapping[str, Any], *, rank: int) -> bytes | None:
    """``model_state_dict/full_weights.pt`` as RLinf writes it (``get_model_state_dict``
    with ``full_state_dict=True, cpu_offload=True``, saved by rank 0): the sharded
    tensors gathered one at a time. Call on every rank; the bytes on rank 0."""
    import torch
    from torch.distributed.tensor import DTensor

    full: dict[str, Any] = {}
    for key, value in model_state.items():
        if isinstance(value, DTensor):
            value = value.full_tensor()  # a collective: every rank, same order
        elif not isinstance(value, torch.Tensor):
            raise ConfigError(f"cannot gather model entry {key!r} ({type(value).__name__}) "
                              "for full_weights.pt; pass save_full_model_weights=False")
        if rank == 0:
            full[key] = value.detach().cpu()
    return torch_bytes(full) if rank == 0 else None


def model_part(state: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The model entries of a part's state (``fsdp_checkpoint.model``), if any."""
    inner = state.get(ROOT_KEY)
    model = inner.get("model") if isinstance(inner, Mapping) else None
    return model if isinstance(model, Mapping) else None


@dataclass
class _RlinfDcp:
    """A part's DCP shards below ``prefix``, RLinf's ``rng.numpy`` allowed."""

    prefix: str
    state: Mapping[str, Any]
    step: int | None
    blobs: BlobArea | None = None

    def write(self, store: Store, group: Any) -> None:
        from cloudckpt import dcp as cdcp

        with numpy_rng_allowed():  # RLinf's rng.numpy, as its load allows it
            cdcp.save(dict(self.state), store.child(self.prefix), process_group=group,
                      step=self.step, blobs=self.blobs)

    def commit(self, writer: CheckpointWriter, written: None) -> None:
        writer.add_part(self.prefix)


@dataclass
class _FullWeights:
    """The part's model gathered into ``full_weights.pt`` by ``gather`` (called on every
    rank, after the DCP save, as RLinf's base.py; the bytes on rank 0), which rank 0
    writes at commit."""

    key: str
    gather: Callable[[Any], bytes | None]

    def write(self, store: Store, group: Any) -> bytes | None:
        return self.gather(group)

    def commit(self, writer: CheckpointWriter, written: bytes | None) -> None:
        assert written is not None
        writer.put(self.key, written)


def fsdp_parts(prefix: str, state: Mapping[str, Any], step: int | None,
               with_full_weights: bool, *,
               gather: Callable[[Any], bytes | None] | None = None,
               blobs: BlobArea | None = None) -> list[Any]:
    """The multi-part save handlers of one RLinf part (actor, critic) below ``prefix``
    (``""``: the checkpoint itself): its DCP shards, then, unless
    ``with_full_weights`` is off, ``model_state_dict/full_weights.pt``: what
    ``gather(group)`` returns on rank 0 (called on every rank), by default the state's
    own model tensors gathered (no file without a model). ``blobs``: the shards of an
    incremental save, in that area."""
    join = (lambda key: f"{prefix}/{key}") if prefix else (lambda key: key)
    parts: list[Any] = [_RlinfDcp(join(DCP_DIR), state, step, blobs)]
    if with_full_weights:
        model = model_part(state)
        if gather is None and model is not None:
            def gather(group: Any) -> bytes | None:
                return full_weights(model, rank=coord.rank(group))

        if gather is not None:
            parts.append(_FullWeights(join(FULL_WEIGHTS), gather))
    return parts
