"""Training state that is not a model: step counters, RNG, dataloaders, small states.

Everything here serialises to JSON or to ``torch.save`` data that loads with
``weights_only=True``: nothing loaded from a checkpoint can execute code.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from cloudckpt.compat import torch_private
from cloudckpt.errors import ConfigError, CorruptCheckpointError
from cloudckpt.serialization.torchload import safe_torch_load, weights_only_refusal

__all__ = [
    "Stateful",
    "StepInfo",
    "dumps_state",
    "get_rng_state",
    "check_restorable",
    "loads_state",
    "set_rng_state",
]


@dataclass(frozen=True)
class StepInfo:
    """Where training is: 0-based epoch, step within the epoch, global step, and the
    steps an epoch has (``next()`` wraps into the next epoch after the last one).
    ``steps_per_epoch`` may be 0: a dataset smaller than one batch."""

    epoch: int = 0
    epoch_step: int = 0
    global_step: int = 0
    steps_per_epoch: int = 1

    def __post_init__(self) -> None:
        if self.steps_per_epoch < 0:
            raise ConfigError("StepInfo.steps_per_epoch must be >= 0")

    def next(self) -> StepInfo:
        """The step after this one (wrapping into the next epoch)."""
        if self.epoch_step == self.steps_per_epoch - 1:
            return StepInfo(self.epoch + 1, 0, self.global_step + 1, self.steps_per_epoch)
        return StepInfo(self.epoch, self.epoch_step + 1, self.global_step + 1,
                        self.steps_per_epoch)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepInfo:
        try:
            return cls(**{f.name: int(d[f.name]) for f in fields(cls)})
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"invalid step info {dict(d)!r}: {exc}") from None


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()``/``load_state_dict()`` (dataloaders, schedulers, ...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


# ------------------------------------------------------------------------- RNG


def get_rng_state() -> dict[str, Any]:
    """The state of every random generator training touches: Python, NumPy, torch
    CPU and, when present, every CUDA device."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": _jsonable_numpy(np_state),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`get_rng_state` captured."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    np.random.set_state(_numpy_from_json(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def _jsonable_numpy(st: dict[str, Any]) -> dict[str, Any]:
    out = dict(st)
    inner = dict(st["state"])
    inner["key"] = [int(x) for x in np.asarray(inner["key"]).tolist()] if "key" in inner else None
    out["state"] = {k: (int(v) if isinstance(v, (np.integer,)) else v) for k, v in inner.items()}
    if out["state"].get("key") is None:
        out["state"].pop("key", None)
    return out


def _numpy_from_json(st: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(st)
    inner = dict(st["state"])
    if "key" in inner:
        inner["key"] = np.asarray(inner["key"], dtype=np.uint32)
    out["state"] = inner
    return out


# ----------------------------------------------------- serialising small states


def dumps_state(obj: Any) -> bytes:
    """Serialise a small state: JSON when it is plain data, else ``torch.save``
    (tensors, tuples, ...), which :func:`loads_state` reads with ``weights_only``."""
    try:
        return b"J" + json.dumps(obj, sort_keys=True, allow_nan=True).encode()
    except (TypeError, ValueError):
        buf = io.BytesIO()
        torch.save(obj, buf)
        return b"T" + buf.getvalue()


def loads_state(data: bytes, *, source: str = "state") -> Any:
    """Inverse of :func:`dumps_state`; never executes pickled code."""
    tag, body = data[:1], data[1:]
    if tag == b"J":
        try:
            return json.loads(body)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{source} is not valid JSON ({exc})",
                                         {source: "malformed"}) from None
    if tag == b"T":
        return safe_torch_load(io.BytesIO(body), source)
    raise CorruptCheckpointError(f"{source} has an unknown encoding", {source: "encoding"})


def check_restorable(where: str, value: Any, *, owner: Any = None) -> None:
    """Refuse, before anything is written, a value a restore could not load back.

    Plain data (JSON) and what ``torch.load(weights_only=True)`` accepts (tensors,
    tuples, ...) pass; anything else (a DataLoader, a generator, a lambda) raises
    :class:`ConfigError` naming ``where`` and the fix. ``owner`` is the object whose
    ``state_dict()`` gave ``value``, if it came from one.
    """
    reason = weights_only_refusal(value)
    if reason is None:
        return
    if owner is not None:
        raise ConfigError(
            f"{where}: the state_dict() of a {type(owner).__name__} holds what cannot be "
            f"restored ({reason}); a state_dict must hold only tensors and plain "
            "data. Nothing was saved.")
    raise ConfigError(
        f"{where} is a {type(value).__name__}, which cannot be restored: it has no "
        "state_dict()/load_state_dict(), and it is not plain data or tensors "
        f"({reason}). Pass an object with state_dict() and load_state_dict() "
        "(e.g. torchdata's StatefulDataLoader instead of a DataLoader), or its state as "
        "plain data. Nothing was saved.")


def resolve_stateful(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each top-level :class:`Stateful` replaced by its
    ``state_dict()``, as ``dcp.save`` does: taken once, then checked and saved."""
    return {k: v.state_dict() if isinstance(v, Stateful) and not isinstance(v, Mapping) else v
            for k, v in state_dict.items()}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_refusal(t: torch.Tensor) -> str | None:
    """Why DCP cannot save ``t`` so that a load gives it back (what it is, and what to
    save instead), or None: DCP writes a tensor as the dense bytes of its storage."""
    if t.is_meta:
        return ("a meta tensor: it has no data to save. Materialize it first (e.g. "
                "module.to_empty(device=...), then initialize or load its values)")
    if t.is_nested:
        return ("a nested tensor, which DCP cannot plan. Save its components "
                "(t.unbind()) or t.to_padded_tensor(...) instead")
    if t.layout != torch.strided:
        return (f"a tensor of layout {t.layout} (not dense), whose bytes DCP cannot write. "
                "Save t.to_dense(), or its parts as tensors of their own (for COO: "
                "indices() and values(); CSR: crow_indices(), col_indices(), values()), "
                "and rebuild it after loading")
    if t.is_quantized:
        return (f"a quantized tensor ({t.qscheme()}): DCP saves its integer values but "
                "not its scale and zero point, so a load would give other values back. "
                "Save t.dequantize(), or t.int_repr() with its scales and zero points")
    return None


def check_state_dict(state_dict: Mapping[str, Any], where: str = "state_dict") -> None:
    """Refuse, before anything is written, a DCP state that a load could not restore.

    Dense tensors (DTensors, sharded tensors, anything DCP writes as a tensor) pass;
    a sparse, nested, meta or quantized one does not (:func:`tensor_refusal`). DCP
    pickles every other leaf, and each must pass :func:`check_restorable` (a numpy
    array, a DataLoader or a custom object does not). Raises :class:`ConfigError`
    naming the key. Call on :func:`resolve_stateful`'s result.
    """
    flat, _ = torch_private.flatten_state_dict(dict(state_dict))
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            reason = tensor_refusal(local_tensor(value))
            if reason is not None:
                raise ConfigError(f"{where}[{key!r}] is {reason}. Nothing was saved.")
            continue
        if hasattr(value, "__create_write_items__"):
            continue
        if isinstance(value, Stateful):
            raise ConfigError(
                f"{where}[{key!r}] is a {type(value).__name__}: DCP calls state_dict() only "
                "on the top-level values of the state, so it would be pickled whole and could "
                "not be restored. Put it at the top level, or its state_dict() in its place. "
                "Nothing was saved.")
        check_restorable(f"{where}[{key!r}]", value)
