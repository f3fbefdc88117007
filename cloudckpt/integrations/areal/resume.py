"""AReaL's ``RecoverHandler`` on a :class:`~cloudckpt.training.slot.RecoverSlot`.

A dump is what AReaL's is, file for file: each engine's ``save`` writes
``{name}/recover_checkpoint/`` (DCP, in the engine's own format), and rank 0 writes
``recover_info/`` (AReaL's six files). Here they are written into a local staging
directory and committed together as one generation of a slot at the trial's
directory, then the slot's pointer swaps: weights and recover info can never
disagree, and a crash mid-dump leaves the previous dump loadable. ``cloudckpt
download`` of the trial writes the current generation back where AReaL expects it.

A dump records its save profile (:mod:`cloudckpt.core.profiles`): ``weights`` under
``recover.no_save_optim`` (no optimizer states), ``full`` otherwise. A load that would
apply optimizer states (``no_load_optim: false``) from a dump without them is refused
before anything is applied, unless ``$CLOUDCKPT_ALLOW_PARTIAL_RESUME=1`` allows it: then
the optimizer starts fresh, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cloudckpt.core.checkpoint import open_checkpoint
from cloudckpt.core.expected import expect_kind
from cloudckpt.core.profiles import PROFILE_KEY, WEIGHTS, Profile, recorded
from cloudckpt.integrations import check_framework_resume
from cloudckpt.integrations.areal.config import recover_enabled
from cloudckpt.integrations.areal.dataorder import mark_resumed
from cloudckpt.integrations.areal.engines import engines_of, save_load_meta
from cloudckpt.integrations.areal.freq import Periodic
from cloudckpt.integrations.areal.info import (
    DATALOADER_FILE,
    load_pickle,
    read,
    step_info_type,
    write,
)
from cloudckpt.integrations.areal.layout import INFO_DIR, save_root
from cloudckpt.integrations.areal.plugin import KIND
from cloudckpt.integrations.areal.preflight import check_trial, refuse_fresh_start
from cloudckpt.runtime import coordination as coord
from cloudckpt.runtime.state import dumps_state, get_rng_state, loads_state, set_rng_state
from cloudckpt.training.slot import RecoverSlot
from cloudckpt.training.staging import download_dir, staging_dir, upload_dir

log = logging.getLogger(__name__)

_RNG = INFO_DIR + "/cloudckpt_rng_rank{:05d}.bin"  # beside AReaL's files, which it ignores
#: Each engine's LR scheduler, which AReaL's engines do not checkpoint (its FSDP engine's
#: ``_save_to_dcp`` saves model and optimizer only): a resume would restart the schedule.
_SCHEDULER = INFO_DIR + "/cloudckpt_lr_scheduler_{}.bin"


def _state(obj: Any, default: Any = None) -> Any:
    return obj.state_dict() if obj is not None else default


class RecoverHandler(Periodic):
    """AReaL's ``RecoverHandler(config, ft_spec)``, with its ``dump`` and ``load``
    (same arguments, positions and results), on any URI.

    ``config`` is AReaL's ``RecoverConfig`` (or this package's); ``ft_spec`` AReaL's
    ``FinetuneSpec`` (or the number of steps per epoch). Call ``dump`` and ``load`` on
    every rank. RNG states are saved too (AReaL's FSDP path does not), one small file
    per rank in ``recover_info/``, and restored when present.

    When recover is on, construction checks the trial directory first: a missing
    bucket, refused credentials, or a trial AReaL wrote itself (which would be
    ignored) raise before any training, with what to do. When it is off, a trial that
    holds a committed dump is refused likewise: the run would start over beside it.
    """

    def __init__(self, config: Any, ft_spec: Any, *,
                 storage_options: Mapping[str, Any] | None = None,
                 process_group: Any = None, staging: str | None = None) -> None:
        super().__init__(config, ft_spec, storage_options, process_group)
        if recover_enabled(config):
            coord.on_coordinator(lambda: check_trial(config, self.storage_options,
                                                     recover=True), process_group)
        else:
            coord.on_coordinator(lambda: refuse_fresh_start(config, self.storage_options),
                                 process_group)
        self.staging = staging
        self.last_step_info = step_info_type()(epoch=-1, epoch_step=-1, global_step=-1,
                                               steps_per_epoch=self.steps_per_epoch)

    @staticmethod
    def recover_info_path(experiment_name: str, trial_name: str, fileroot: str) -> str:
        from cloudckpt.integrations.areal.saver import Saver

        return f"{Saver.get_save_root(experiment_name, trial_name, fileroot)}/{INFO_DIR}"

    @property
    def slot(self) -> RecoverSlot:
        """The trial's recover slot: every dump is one generation."""
        return RecoverSlot(self.root, storage_options=self.storage_options,
                           process_group=self.group)

    @property
    def enabled(self) -> bool:
        return recover_enabled(self.config)

    # -------------------------------------------------------------------- dump

    def dump(self, engine: Any, step_info: Any, saver: Any, evaluator: Any,
             stats_logger: Any, dataloader: Any, tokenizer: Any = None,
             processor: Any = None, base_model_path: str | None = None) -> None:
        """Write the recover checkpoint when due (AReaL's frequency rule)."""
        if not self.enabled:
            return
        if not self.freq_ctl.check(epochs=self.epoch_ends(step_info.epoch_step), steps=1):
            return
        engines = engines_of(engine)
        with staging_dir(self.staging, self.group) as local:
            for name, eng in engines.items():
                eng.save(save_load_meta(
                    path=str(local / name / "recover_checkpoint"), weight_format="dcp",
                    with_optim=not getattr(self.config, "no_save_optim", False),
                    tokenizer=tokenizer, processor=processor,
                    base_model_path=base_model_path))
            loaders = coord.each_rank(lambda: _state(dataloader), self.group)
            me = coord.rank(self.group)
            coord.each_rank(lambda: self._write_rng(local, me), self.group)
            coord.on_coordinator(lambda: _write_schedulers(local, engines), self.group)
            infos = {"saver_info": _state(saver, {}), "evaluator_info": _state(evaluator, {}),
                     "stats_logger_info": _state(stats_logger,
                                                 {"last_commit_step": step_info.global_step}),
                     "checkpoint_info": self.freq_ctl.state_dict()}
            data = loaders if coord.initialized() else loaders[0]
            coord.on_coordinator(lambda: write(local / INFO_DIR, step_info, infos, data),
                                 self.group)
            meta = {"slot": self.root, PROFILE_KEY: saved_profile(self.config).record()}
            self.slot.commit(
                lambda gen: upload_dir(local, gen, group=self.group, kind=KIND,
                                       step=step_info.global_step, metadata=meta),
                step=step_info.global_step, step_info=step_info)
        self.last_step_info = step_info
        log.info("recover checkpoint of global step %d committed to %s",
                 step_info.global_step, self.root)

    @staticmethod
    def _write_rng(local: Path, rank: int) -> None:
        path = local / _RNG.format(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(dumps_state(get_rng_state()))

    # -------------------------------------------------------------------- load

    def load(self, engine: Any, saver: Any, evaluator: Any, stats_logger: Any,
             dataloader: Any, inference_engine: Any = None, weight_update_meta: Any = None,
             inference_engine_update_from: str = "default") -> Any:
        """Restore the last committed dump, then (given an inference engine) push the
        weights to it, as AReaL does. Returns AReaL's ``RecoverInfo``, or None (with a
        warning) when there is nothing to resume."""
        if not self.enabled:
            return None
        if inference_engine is not None and weight_update_meta is None:
            raise ValueError("Weight update meta is required for recovery.")
        engines = engines_of(engine)
        pointer = coord.on_coordinator(self.slot.info, self.group)
        if pointer is None:
            log.warning("no recover checkpoint committed at %s: starting from scratch (this "
                        "should not be a resumed experiment)", self.root)
            return None
        gen = self.slot.store.child(pointer["generation"])
        me = coord.rank(self.group)
        world = coord.world_size(self.group) if coord.initialized() else None
        with staging_dir(self.staging, self.group) as local:
            ckpt = coord.checked(lambda: expect_kind(open_checkpoint(gen), KIND,
                                                     "an AReaL recover dump"), self.group)
            with_optim = not getattr(self.config, "no_load_optim", False)
            fresh = coord.checked(lambda: check_framework_resume(
                ckpt.uri, recorded(ckpt.metadata), ["optimizer"] if with_optim else [],
                framework_key="set recover.no_load_optim: true"), self.group)
            with_optim = with_optim and "optimizer" not in fresh
            download_dir(ckpt, local, group=self.group)
            # Read and checked on every rank before anything is applied (the world size
            # its dataloader states were saved by among them); the step is the one in the
            # same commit as the weights, so the two cannot disagree.
            info, rng, schedulers = coord.checked(
                lambda: _read_dump(local, engines, me, world), self.group)
            log.info("recovering from %s; resuming at %s", gen.uri, info.last_step_info.next())
            for obj, state in ((saver, info.saver_info), (evaluator, info.evaluator_info),
                               (stats_logger, info.stats_logger_info),
                               (dataloader, info.dataloader_info)):
                if obj is not None:
                    obj.load_state_dict(state)
            if dataloader is not None:
                mark_resumed(dataloader, info.last_step_info.epoch)
            self.freq_ctl.load_state_dict(info.checkpoint_info)
            for name, eng in engines.items():
                eng.load(save_load_meta(
                    path=str(local / name / "recover_checkpoint"), weight_format="dcp",
                    with_optim=with_optim))
            for name, state in schedulers.items():
                engines[name].lr_scheduler.load_state_dict(state)
            if rng is not None:
                set_rng_state(rng)
        self.last_step_info = info.last_step_info
        if inference_engine is not None:
            _sync_inference(engines[inference_engine_update_from], inference_engine,
                            weight_update_meta, info.last_step_info.global_step + 1)
        return info


def saved_profile(config: Any) -> Profile:
    """What a dump holds by AReaL's ``recover.no_save_optim``: everything (``full``), or
    all but the optimizer states (``weights``; the RNG, LR schedulers, dataloader and
    recover info are still dumped)."""
    if getattr(config, "no_save_optim", False):
        return Profile(WEIGHTS, ("optimizer",))
    return Profile()


def _schedulers(engines: Mapping[str, Any]) -> dict[str, Any]:
    return {name: eng.lr_scheduler for name, eng in engines.items()
            if hasattr(getattr(eng, "lr_scheduler", None), "state_dict")}


def _write_schedulers(local: Path, engines: Mapping[str, Any]) -> None:
    for name, sched in _schedulers(engines).items():
        (local / _SCHEDULER.format(name)).write_bytes(dumps_state(sched.state_dict()))


def _read_dump(local: Path, engines: Mapping[str, Any], rank: int, world: int | None
               ) -> tuple[Any, Any, dict[str, Any]]:
    """What a load applies besides the engines' DCP: AReaL's recover info (this rank's
    dataloader state), this rank's RNG state and the schedulers a dump holds (one of
    AReaL's own has neither: they restart), each decoded."""
    info = read(local / INFO_DIR, rank, world)
    path = local / _RNG.format(rank)
    rng = loads_state(path.read_bytes(), source=str(path)) if path.exists() else None
    schedulers = {}
    for name in _schedulers(engines):
        path = local / _SCHEDULER.format(name)
        if path.exists():
            schedulers[name] = loads_state(path.read_bytes(), source=str(path))
    return info, rng, schedulers


def _sync_inference(update_engine: Any, inference_engine: Any, meta: Any,
                    version: int) -> None:
    """AReaL's post-recovery weight push: the inference engine serves the recovered
    weights, at the recovered version."""
    versioned = meta.with_version(version)
    update_engine.connect_engine(inference_engine, versioned)
    inference_engine.pause()
    update_engine.update_weights(versioned)
    inference_engine.resume()
    update_engine.set_version(version)
    inference_engine.set_version(version)


def read_dataloader_info(cfg: Any, *, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The last committed dump's ``dataloader_info.pkl`` (a per-rank list, or one
    state for a single process), decoded without executing anything."""
    slot = RecoverSlot(save_root(cfg), storage_options=storage_options)
    ckpt = slot.current()
    key = f"{INFO_DIR}/{DATALOADER_FILE}"
    return load_pickle(ckpt.read(key), ckpt.store.key_uri(key))

