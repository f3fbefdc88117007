"""AReaL's ``RecoverHandler`` on a :class:`~cloudckpt.slot.RecoverSlot`: the atomic
recover checkpoint, the ``recover_info/`` mirror, and the resume decision."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ... import coordination as coord
from ...errors import CloudCkptError, ConfigError
from ...slot import RecoverSlot
from ...state import StepInfo, dumps_state, loads_state
from ...storage import Store, open_store
from .config import RecoverConfig, recover_checkpoint_uri, recover_info_uri
from .engines import _engine_state, _engines, _set_engine_state
from .freq import _Periodic
from .saver import Saver

log = logging.getLogger("cloudckpt")

#: AReaL's recover info files, in the order the mirror writes them (step_info.json last:
#: a mirror with a step_info.json has every other file of the same dump, or a newer one).
INFO_FILES = ("saver_info.json", "evaluator_info.json", "stats_logger_info.json",
              "checkpoint_info.json", "dataloader_info.pkl", "step_info.json")
_RECOVER_KEY = "areal_recover_info"
_ENGINE_EXTRA = "areal_lr_scheduler"


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
