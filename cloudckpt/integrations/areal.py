"""AReaL's ``Saver`` and ``RecoverHandler`` on cloudckpt: same keys, same layout, any URI.

AReaL writes everything below ``{fileroot}/checkpoints/{user}/{experiment}/{trial}/``:
Hugging Face exports ``{name}/epoch{E}epochstep{S}globalstep{G}/`` (the ``Saver``), a
recover checkpoint ``{name}/recover_checkpoint/`` overwritten by every dump and the
``recover_info/`` files describing it (the ``RecoverHandler``). Here ``fileroot`` may be
a bucket URI (``s3://``, ``gs://``) or a local path, and the recover checkpoint is a
:class:`~cloudckpt.slot.RecoverSlot`: each dump commits a new generation holding the
weights, the optimizer, the RNG states, every rank's dataloader state *and* AReaL's
recover info, then swaps the slot's pointer. Weights and recover info therefore can never
disagree, and a crash mid-dump leaves the previous dump loadable. ``recover_info/`` is
still written, after the swap, as a mirror in AReaL's file names for tools and people
who look there; :meth:`RecoverHandler.load` reads the slot, and treats a missing
``recover_info/`` as AReaL's documented "clean restart".
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import logging
import os
import re
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import coordination as coord
from .. import hf
from ..checkpoint import Checkpoint, list_checkpoints, open_checkpoint
from ..errors import CloudCkptError, ConfigError
from ..manager import SaveSchedule
from ..manifest import MANIFEST_NAME
from ..slot import RecoverSlot
from ..state import StepInfo, dumps_state, loads_state
from ..storage import Store, open_store

log = logging.getLogger("cloudckpt")

__all__ = [
    "Engine",
    "FreqCtl",
    "RecoverConfig",
    "RecoverHandler",
    "RecoverInfo",
    "Saver",
    "SaverConfig",
    "export_name",
    "latest_export",
    "list_exports",
    "load_yaml",
    "recover_checkpoint_uri",
    "recover_info_uri",
    "run_with_retries",
    "save_root",
]

#: AReaL's recover info files, in the order the mirror writes them (step_info.json last:
#: a mirror with a step_info.json has every other file of the same dump, or a newer one).
INFO_FILES = ("saver_info.json", "evaluator_info.json", "stats_logger_info.json",
              "checkpoint_info.json", "dataloader_info.pkl", "step_info.json")
EXPORT_RE = re.compile(r"^epoch(\d+)epochstep(\d+)globalstep(\d+)$")
_RECOVER_KEY = "areal_recover_info"
_ENGINE_EXTRA = "areal_lr_scheduler"
_SAVER_MODES = ("auto", "sync", "async")
_RECOVER_MODES = ("on", "auto", "off", "disabled")


# -------------------------------------------------------------------------- config


def _check_freq(cls: str, name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{cls}.{name} must be a positive integer or null, got {value!r}")


def _check_str(cls: str, name: str, value: Any, *, required: bool = True) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{cls}.{name} must be a non-empty string, got {value!r}")


def _from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{cls.__name__} needs a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} key(s) {unknown}; known keys: "
                          f"{sorted(known)}")
    try:
        return cls(**dict(data))
    except TypeError as exc:  # a required key is missing
        raise ConfigError(f"{cls.__name__}: {exc}") from None


@dataclass
class SaverConfig:
    """AReaL's ``saver:`` section. ``fileroot`` may be a bucket URI; ``user`` (not an
    AReaL key) overrides the ``getpass.getuser()`` path part."""

    experiment_name: str
    trial_name: str
    fileroot: str = "/tmp/areal/"
    freq_epochs: int | None = None
    freq_steps: int | None = None
    freq_secs: int | None = None
    mode: str = "auto"
    user: str | None = None

    def __post_init__(self) -> None:
        _validate_common(self)
        if self.mode not in _SAVER_MODES:
            raise ConfigError(f"SaverConfig.mode must be one of {list(_SAVER_MODES)}, "
                              f"got {self.mode!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SaverConfig:
        """Build from a YAML/dict section; unknown keys and bad values raise ConfigError."""
        return _from_dict(cls, data)


@dataclass
class RecoverConfig:
    """AReaL's ``recover:`` section. ``retries`` is how many times the launcher
    (:func:`run_with_retries`) relaunches a failed job."""

    experiment_name: str
    trial_name: str
    fileroot: str = "/tmp/areal/"
    freq_epochs: int | None = None
    freq_steps: int | None = None
    freq_secs: int | None = None
    mode: str = "disabled"
    retries: int = 3
    user: str | None = None

    def __post_init__(self) -> None:
        _validate_common(self)
        if self.mode not in _RECOVER_MODES:
            raise ConfigError(f"RecoverConfig.mode must be one of {list(_RECOVER_MODES)}, "
                              f"got {self.mode!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) \
                or self.retries < 0:
            raise ConfigError(f"RecoverConfig.retries must be an integer >= 0, "
                              f"got {self.retries!r}")

    @property
    def enabled(self) -> bool:
        return self.mode in ("on", "auto")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RecoverConfig:
        """Build from a YAML/dict section; unknown keys and bad values raise ConfigError."""
        return _from_dict(cls, data)


def _validate_common(cfg: SaverConfig | RecoverConfig) -> None:
    name = type(cfg).__name__
    for key in ("experiment_name", "trial_name", "fileroot"):
        _check_str(name, key, getattr(cfg, key))
    _check_str(name, "user", cfg.user, required=False)
    for key in ("experiment_name", "trial_name", "user"):
        value = getattr(cfg, key)
        if value is not None and ("/" in value or value in (".", "..")):
            raise ConfigError(f"{name}.{key} is a path part and cannot be {value!r}")
    for key in ("freq_epochs", "freq_steps", "freq_secs"):
        _check_freq(name, key, getattr(cfg, key))


def load_yaml(path: str | os.PathLike) -> tuple[SaverConfig, RecoverConfig]:
    """Read an AReaL experiment YAML and return its ``saver`` and ``recover`` sections.

    ``${a.b}`` interpolations (as OmegaConf writes them, e.g. ``${cluster.fileroot}``)
    are resolved against the whole document.
    """
    with open(path) as f:
        doc = _yaml_load(f.read())
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} is not a YAML mapping")
    for section in ("saver", "recover"):
        if not isinstance(doc.get(section), dict):
            raise ConfigError(f"{path} has no '{section}:' section")
    resolved = {s: {k: _interpolate(v, doc, str(path)) for k, v in doc[s].items()}
                for s in ("saver", "recover")}
    return SaverConfig.from_dict(resolved["saver"]), RecoverConfig.from_dict(resolved["recover"])


def _yaml_load(text: str) -> Any:
    """YAML as OmegaConf (AReaL's loader) reads it: only true/false are booleans, so
    ``mode: on`` stays the string "on" instead of YAML 1.1's True."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        ch: [(tag, rx) for tag, rx in rs if tag != "tag:yaml.org,2002:bool"]
        for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|"
                                 r"false|False|FALSE)$"), list("tTfF"))
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass


_INTERP = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


def _interpolate(value: Any, doc: Mapping[str, Any], source: str, depth: int = 0) -> Any:
    if not isinstance(value, str) or "${" not in value:
        return value
    if depth > 8:
        raise ConfigError(f"{source}: interpolation of {value!r} does not terminate")

    def lookup(ref: str) -> Any:
        node: Any = doc
        for part in ref.split("."):
            if not isinstance(node, Mapping) or part not in node:
                raise ConfigError(f"{source}: ${{{ref}}} names no key of the document")
            node = node[part]
        return _interpolate(node, doc, source, depth + 1)

    whole = _INTERP.fullmatch(value)
    if whole:
        return lookup(whole.group(1))
    return _INTERP.sub(lambda m: str(lookup(m.group(1))), value)


# --------------------------------------------------------------------------- paths


def save_root(cfg: SaverConfig | RecoverConfig) -> str:
    """``{fileroot}/checkpoints/{user}/{experiment}/{trial}``, as AReaL builds it."""
    user = cfg.user or getpass.getuser()
    return "/".join([cfg.fileroot.rstrip("/"), "checkpoints", user, cfg.experiment_name,
                     cfg.trial_name])


def export_name(epoch: int, epoch_step: int, global_step: int) -> str:
    return f"epoch{epoch}epochstep{epoch_step}globalstep{global_step}"


def recover_checkpoint_uri(cfg: SaverConfig | RecoverConfig, name: str = "default") -> str:
    return f"{save_root(cfg)}/{name}/recover_checkpoint"


def recover_info_uri(cfg: SaverConfig | RecoverConfig) -> str:
    return f"{save_root(cfg)}/recover_info"


# ---------------------------------------------------------------- frequency control


class FreqCtl:
    """AReaL's epoch/step/time frequency controller on :class:`SaveSchedule`.

    The decision is ``SaveSchedule``'s (OR of the three counters, each restarting
    only when it fires, time MAX-all-reduced); :meth:`state_dict` renders it in
    AReaL's ``EpochStepTimeFreqCtl`` JSON shape (``{"epoch", "step", "time"}``, each
    a ``FrequencyControl`` state) so ``saver_info.json`` and ``checkpoint_info.json``
    keep their schema, and :meth:`load_state_dict` reads that shape back.
    """

    def __init__(self, freq_epochs: int | None, freq_steps: int | None,
                 freq_secs: float | None, group: Any = None) -> None:
        self.schedule = SaveSchedule(every_steps=freq_steps, every_epochs=freq_epochs,
                                     every_seconds=freq_secs, group=group)
        self.freq = (freq_epochs, freq_steps, freq_secs)
        self.start_time = time.time()
        self.total_epochs = 0
        self.total_steps = 0
        self.calls = 0
        self.time_fired_at_call = 0
        self.last_interval_seconds: float | None = None

    def check(self, *, epochs: int, steps: int = 1) -> bool:
        """Advance every counter; True when any fires (call once per training step)."""
        before = self.schedule.state_dict()["elapsed"]
        fired = self.schedule.check(steps=steps, epochs=epochs)
        after = self.schedule.state_dict()["elapsed"]
        self.total_epochs += epochs
        self.total_steps += steps
        self.calls += 1
        self.last_interval_seconds = before
        if self.freq[2] and after < before:
            self.time_fired_at_call = self.calls
        return fired

    def state_dict(self) -> dict[str, Any]:
        now = time.time()
        sched = self.schedule.state_dict()
        elapsed = float(sched["elapsed"])

        def ctl(freq_seconds: Any, freq_steps: Any, steps: int, last_steps: int,
                last_time: float, interval_seconds: Any) -> dict[str, Any]:
            return {"frequence_seconds": freq_seconds, "frequency_steps": freq_steps,
                    "start_time": self.start_time, "steps": steps, "last_time": last_time,
                    "last_steps": last_steps, "interval_steps": steps - last_steps,
                    "interval_seconds": interval_seconds, "initial_value": False}

        last = now - elapsed
        return {
            "epoch": ctl(None, self.freq[0], self.total_epochs,
                         self.total_epochs - int(sched["epochs"]), last, elapsed),
            "step": ctl(None, self.freq[1], self.total_steps,
                        self.total_steps - int(sched["steps"]), last, elapsed),
            "time": ctl(self.freq[2], None, self.calls, self.time_fired_at_call, last,
                        elapsed),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            ep, st, tm = state["epoch"], state["step"], state["time"]
            self.total_epochs, self.total_steps = int(ep["steps"]), int(st["steps"])
            self.calls, self.time_fired_at_call = int(tm["steps"]), int(tm["last_steps"])
            self.start_time = float(tm["start_time"])
            elapsed = tm.get("interval_seconds")
            self.schedule.load_state_dict({
                "epochs": self.total_epochs - int(ep["last_steps"]),
                "steps": self.total_steps - int(st["last_steps"]),
                # The time since the last save excludes the downtime, as SaveSchedule does.
                "elapsed": float(elapsed) if elapsed is not None else 0.0})
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not an AReaL frequency-control state ({exc!r}): "
                              f"{dict(state)!r}"[:500]) from None


# ------------------------------------------------------------------------- engines


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


# --------------------------------------------------------------------------- Saver


class _Periodic:
    """What Saver and RecoverHandler share: their config, where they write, and the
    frequency control that decides when."""

    def __init__(self, config: SaverConfig | RecoverConfig, steps_per_epoch: int,
                 storage_options: Mapping[str, Any] | None, process_group: Any) -> None:
        if steps_per_epoch < 1:
            raise ConfigError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
        self.config = config
        self.steps_per_epoch = steps_per_epoch
        self.storage_options = dict(storage_options or {})
        self.group = process_group
        self.freq_ctl = FreqCtl(config.freq_epochs, config.freq_steps, config.freq_secs,
                                process_group)


class Saver(_Periodic):
    """AReaL's ``Saver``: a Hugging Face export of the model when due, each to a new
    ``{name}/epoch{E}epochstep{S}globalstep{G}/`` committed with a manifest (a crash
    mid-export leaves an invisible prefix that :func:`latest_export` skips)."""

    def __init__(self, config: SaverConfig, steps_per_epoch: int, *,
                 storage_options: Mapping[str, Any] | None = None,
                 process_group: Any = None) -> None:
        super().__init__(config, steps_per_epoch, storage_options, process_group)
        if config.mode == "async":
            log.warning("saver mode 'async' applies to AReaL's Archon engine only; HF exports "
                        "here are synchronous (as AReaL does for other engines)")

    def export_uri(self, epoch: int, epoch_step: int, global_step: int,
                   name: str = "default") -> str:
        return f"{save_root(self.config)}/{name}/{export_name(epoch, epoch_step, global_step)}"

    def save(self, engine: Any, epoch: int, step: int, global_step: int, *,
             name: str = "default", tokenizer: Any = None,
             config: Mapping[str, Any] | Any | None = None) -> str | None:
        """Export when due (AReaL's arguments: ``step`` is the step within the epoch).
        Call on every rank; rank 0 writes. Returns the export URI when one was written."""
        if not self.freq_ctl.check(epochs=int(step == self.steps_per_epoch - 1), steps=1):
            return None
        eng = _as_engine(engine)
        uri = self.export_uri(epoch, step, global_step, name)
        # A sharded (FSDP2) model is gathered on every rank; a plain one is exported
        # as itself, so transformers' tied weights and generation config are honoured.
        model: Any = _full_model_state(eng.model) if _is_sharded(eng.model) else eng.model
        if config is None:
            config = getattr(eng.model, "config", None)
        def export() -> None:
            if open_store(uri, self.storage_options).exists(MANIFEST_NAME):
                # Exported before a crash that came before the next recover dump:
                # the run resumed earlier and reached this step again.
                log.info("%s was exported before a restart; keeping it", uri)
            else:  # this job owns its exports: a crashed attempt's claim is ours
                hf.export(model, uri, config=config, tokenizer=tokenizer,
                          storage_options=self.storage_options, takeover=True,
                          metadata={"step_info": {"epoch": epoch, "epoch_step": step,
                                                  "global_step": global_step}})

        coord.on_coordinator(export, self.group)
        return uri

    def state_dict(self) -> dict[str, Any]:
        return self.freq_ctl.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.freq_ctl.load_state_dict(state)


def list_exports(cfg: SaverConfig | RecoverConfig, name: str = "default", *,
                 storage_options: Mapping[str, Any] | None = None) -> list[Checkpoint]:
    """The committed exports of engine ``name``, oldest global step first. Torn
    exports (no manifest) are not listed."""
    root = f"{save_root(cfg)}/{name}"
    found = []
    for info in list_checkpoints(root, storage_options):
        m = EXPORT_RE.match(info.name)
        if m:
            found.append((int(m.group(3)), info.uri))
    return [open_checkpoint(uri, storage_options) for _, uri in sorted(found)]


def latest_export(cfg: SaverConfig | RecoverConfig, name: str = "default", *,
                  storage_options: Mapping[str, Any] | None = None) -> Checkpoint | None:
    """The committed export with the highest global step, or None."""
    exports = list_exports(cfg, name, storage_options=storage_options)
    return exports[-1] if exports else None


# ------------------------------------------------------------------ RecoverHandler


@dataclass
class RecoverInfo:
    """What :meth:`RecoverHandler.load` found: AReaL's ``RecoverInfo`` fields. Resume at
    ``last_step_info.next()``. ``dataloader_info`` is this rank's dataloader state."""

    last_step_info: StepInfo
    saver_info: dict[str, Any]
    evaluator_info: dict[str, Any]
    stats_logger_info: dict[str, Any]
    dataloader_info: Any
    checkpoint_info: dict[str, Any]
    generation: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class RecoverHandler(_Periodic):
    """AReaL's ``RecoverHandler`` with an atomic recover checkpoint.

    ``dump`` (call on every rank, every step) writes, when due, one slot generation at
    ``{name}/recover_checkpoint/`` holding every engine's model and optimizer (DCP,
    sharded), LR schedulers, RNG states, each rank's dataloader state and AReaL's
    recover info; then rank 0 mirrors ``recover_info/``. All engines share the slot of
    the first one (``default``), so an actor and a critic cannot disagree either.
    """

    def __init__(self, config: RecoverConfig, steps_per_epoch: int, *,
                 storage_options: Mapping[str, Any] | None = None,
                 process_group: Any = None) -> None:
        super().__init__(config, steps_per_epoch, storage_options, process_group)
        self.last_step_info = StepInfo(steps_per_epoch=steps_per_epoch)
        self._info_store: Store | None = None

    @property
    def info_store(self) -> Store:
        if self._info_store is None:
            self._info_store = open_store(recover_info_uri(self.config), self.storage_options)
        return self._info_store

    def slot(self, name: str = "default") -> RecoverSlot:
        return RecoverSlot(recover_checkpoint_uri(self.config, name),
                           storage_options=self.storage_options, process_group=self.group)

    # -------------------------------------------------------------------- dump

    def dump(self, engine: Any, step_info: StepInfo, saver: Saver | None = None,
             evaluator: Any = None, stats_logger: Any = None, dataloader: Any = None, *,
             extra: Mapping[str, Any] | None = None) -> bool:
        """Write the recover checkpoint when due; True when one was committed."""
        if not self.config.enabled:
            return False
        due = self.freq_ctl.check(
            epochs=int(step_info.epoch_step == self.steps_per_epoch - 1), steps=1)
        if not due:
            return False
        engines = _engines(engine)
        first = next(iter(engines))
        state = {n: _engine_state(e) for n, e in engines.items()}
        info = {
            "step_info": step_info.to_dict(),
            "saver_info": saver.state_dict() if saver is not None else {},
            "evaluator_info": evaluator.state_dict() if evaluator is not None else {},
            "stats_logger_info": (stats_logger.state_dict() if stats_logger is not None
                                  else {"last_commit_step": step_info.global_step}),
            "checkpoint_info": self.freq_ctl.state_dict(),
        }
        shared: dict[str, Any] = {_RECOVER_KEY: info, **dict(extra or {})}
        shared[_ENGINE_EXTRA] = {n: e.lr_scheduler.state_dict() for n, e in engines.items()
                                 if e.lr_scheduler is not None}
        per_rank = {"dataloader": dataloader} if dataloader is not None else None
        slot = self.slot(first)
        generation = slot.save(state, step_info=step_info, extra=shared, per_rank=per_rank)
        self.last_step_info = step_info
        loaders = coord.each_rank(
            lambda: dataloader.state_dict() if dataloader is not None else None, self.group)
        coord.on_coordinator(lambda: self._write_mirror(info, loaders, generation), self.group)
        return True

    def _write_mirror(self, info: Mapping[str, Any], loaders: list[Any],
                      generation: str) -> None:
        """Rank 0: AReaL's ``recover_info/`` files, after the slot swap. A crash here
        leaves a stale mirror, never a wrong resume: :meth:`load` reads the slot."""
        store = self.info_store
        files = {f"{k}.json": json.dumps(info[k], indent=4).encode()
                 for k in ("saver_info", "evaluator_info", "stats_logger_info",
                           "checkpoint_info")}
        # AReaL pickles the per-rank list; ours is cloudckpt state encoding (JSON or
        # weights-only torch.save): same name for the layout, nothing executes on load.
        files["dataloader_info.pkl"] = dumps_state(loaders if len(loaders) > 1 else loaders[0])
        for name in INFO_FILES[:-1]:
            store.put(name, files[name])
        store.put("step_info.json", json.dumps(dict(info["step_info"]), indent=4).encode())
        log.info("recover info mirrored to %s (slot generation %s)", store.uri, generation)

    # -------------------------------------------------------------------- load

    def load(self, engine: Any, saver: Saver | None = None, evaluator: Any = None,
             stats_logger: Any = None, dataloader: Any = None, *,
             extra: Mapping[str, Any] | None = None) -> RecoverInfo | None:
        """Restore everything the last committed dump holds; None for a fresh start.

        A fresh start (with a WARNING) when recover is disabled, when the slot holds
        no committed dump, or when ``recover_info/step_info.json`` is missing: deleting
        ``recover_info/`` is AReaL's documented clean restart, honoured here (the old
        slot is then overwritten by the next dump).
        """
        if not self.config.enabled:
            return None
        engines = _engines(engine)
        first = next(iter(engines))
        slot = self.slot(first)
        decision = coord.on_coordinator(lambda: self._decide(slot), self.group)
        assert decision is not None
        if decision[0] != "resume":
            log.warning("%s: starting from scratch", decision[1])
            return None
        state = {n: _engine_state(e) for n, e in engines.items()}
        stateful_extra = dict(extra or {})
        per_rank = {"dataloader": dataloader} if dataloader is not None else None
        restored = slot.load(state, extra=stateful_extra, per_rank=per_rank)
        for n, e in engines.items():
            _set_engine_state(e, state[n])
        shared = restored.shared
        try:
            info = shared[_RECOVER_KEY]
        except KeyError:
            raise CloudCkptError(f"{restored.checkpoint.uri} is a recover slot generation "
                                 "without AReaL recover info; it was not written by "
                                 "cloudckpt.integrations.areal") from None
        schedulers = shared.get(_ENGINE_EXTRA, {})
        for n, e in engines.items():
            if e.lr_scheduler is not None:
                if n not in schedulers:
                    raise ConfigError(f"{restored.checkpoint.uri} holds no LR scheduler state "
                                      f"for engine {n!r}")
                e.lr_scheduler.load_state_dict(schedulers[n])
        if saver is not None:
            saver.load_state_dict(info["saver_info"])
        if evaluator is not None:
            evaluator.load_state_dict(info["evaluator_info"])
        if stats_logger is not None:
            stats_logger.load_state_dict(info["stats_logger_info"])
        self.freq_ctl.load_state_dict(info["checkpoint_info"])
        last = StepInfo.from_dict(info["step_info"])
        self.last_step_info = last
        log.info("recovered from %s (step %d); resuming at global step %d",
                 restored.checkpoint.uri, last.global_step, last.next().global_step)
        return RecoverInfo(
            last_step_info=last, saver_info=info["saver_info"],
            evaluator_info=info["evaluator_info"], stats_logger_info=info["stats_logger_info"],
            dataloader_info=dataloader.state_dict() if dataloader is not None else None,
            checkpoint_info=info["checkpoint_info"],
            generation=restored.checkpoint.uri.rstrip("/").rsplit("/", 1)[-1],
            extra={k: v for k, v in shared.items() if k not in (_RECOVER_KEY, _ENGINE_EXTRA)})

    def _decide(self, slot: RecoverSlot) -> tuple[str, str]:
        pointer = slot.info()
        store = self.info_store
        has_info = store.exists("step_info.json")
        if pointer is None:
            if has_info:
                return ("fresh", f"{store.uri} exists but {slot.uri} holds no committed dump "
                        "(a torn or foreign recover checkpoint is never trusted)")
            return ("fresh", f"no recover checkpoint at {slot.uri}")
        if not has_info:
            return ("fresh", f"{store.uri}/step_info.json is missing, which means a clean "
                    f"restart; the dump in {slot.uri} is ignored and will be overwritten")
        try:
            mirrored = json.loads(store.get("step_info.json")).get("global_step")
        except (ValueError, AttributeError):
            mirrored = None
        if mirrored != pointer.get("step"):
            log.warning("%s/step_info.json (step %s) is stale; the slot's committed dump "
                        "(step %s) is used", store.uri, mirrored, pointer.get("step"))
        return ("resume", "")


def read_dataloader_info(cfg: RecoverConfig, *,
                         storage_options: Mapping[str, Any] | None = None) -> Any:
    """The mirrored ``recover_info/dataloader_info.pkl`` (a per-rank list, or one state
    for a single process), decoded without executing anything."""
    store = open_store(recover_info_uri(cfg), storage_options)
    return loads_state(store.get("dataloader_info.pkl"),
                       source=store.key_uri("dataloader_info.pkl"))


# ------------------------------------------------------------------------ launcher


def run_with_retries(train: Callable[[], Any] | Sequence[str], retries: int = 3,
                     delay_s: float = 10.0, *, env: Mapping[str, str] | None = None,
                     **run_kwargs: Any) -> Any:
    """Run a training job and relaunch it after a failure, up to ``retries`` times,
    ``delay_s`` apart, like AReaL's launcher (each relaunch resumes through
    :meth:`RecoverHandler.load`).

    ``train`` is a function (a failure is an exception; its result is returned) or a
    command line (a failure is a non-zero exit, a SIGKILL included; the last
    ``CompletedProcess`` is returned; ``run_kwargs`` go to :func:`subprocess.run`, e.g.
    ``stdout=``). Relaunches see ``AREAL_RECOVER_RUN=1``.
    """
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ConfigError(f"retries must be an integer >= 0, got {retries!r}")
    attempt = 0
    while True:
        if attempt:
            os.environ["AREAL_RECOVER_RUN"] = "1"
        try:
            if callable(train):
                return train()
            run_env = {**os.environ, **dict(env or {})}
            if attempt:
                run_env["AREAL_RECOVER_RUN"] = "1"
            proc = subprocess.run(list(train), env=run_env, check=False, **run_kwargs)
            if proc.returncode == 0:
                return proc
            error: BaseException = CloudCkptError(
                f"training exited with status {proc.returncode}")
        except Exception as exc:  # noqa: BLE001 - any training failure is retried
            error = exc
        if attempt >= retries:
            log.error("training failed %d time(s); giving up: %s", attempt + 1, error)
            raise error
        attempt += 1
        log.warning("training failed (%s); relaunch %d of %d in %.0f s", error, attempt,
                    retries, delay_s)
        time.sleep(delay_s)
