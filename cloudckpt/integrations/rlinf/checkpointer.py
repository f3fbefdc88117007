"""Save and resume RLinf-layout checkpoints: :class:`RLinfCheckpointer`."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cloudckpt.core import blobs
from cloudckpt.core.checkpoint import Checkpoint
from cloudckpt.core.manifest import MANIFEST_NAME
from cloudckpt.core.retention import Managed, apply_retention
from cloudckpt.errors import CommitConflictError, ConfigError
from cloudckpt.integrations.rlinf.config import RunnerConfig, should_save
from cloudckpt.integrations.rlinf.fsdp import fsdp_parts
from cloudckpt.integrations.rlinf.layout import (
    ACTOR,
    CRITIC,
    DATA_PATH,
    DCP_DIR,
    KEY_PREFIX,
    KIND,
    ROOT_KEY,
    STEP_RE,
    step_name,
)
from cloudckpt.integrations.rlinf.resume import (
    checked_step,
    open_rlinf_checkpoint,
    resolve_resume_dir,
)
from cloudckpt.runtime import coordination as coord
from cloudckpt.runtime.state import resolve_stateful
from cloudckpt.serialization.torchload import numpy_rng_allowed, torch_bytes
from cloudckpt.storage import open_store
from cloudckpt.training import multipart

log = logging.getLogger(__name__)


@dataclass
class Resumed:
    """What :meth:`RLinfCheckpointer.load` restored besides the tensors loaded in place."""

    step: int
    checkpoint: Checkpoint
    data_state: Any


@dataclass(frozen=True)
class SaveOptions:
    """How :class:`RLinfCheckpointer` saves, beyond RLinf's ``runner`` keys.

    ``time_limit_s``: once the slowest rank has run that long, ``should_save`` says
    save (RLinf's time limit). ``keep_last``: prune committed steps beyond the newest
    N after each save (``None``: keep every one).
    ``save_full_model_weights``: write each part's ``model_state_dict/full_weights.pt``
    too, as RLinf does. ``incremental``: every object a blob of the checkpoints root's
    area, sending only bytes not there yet (``None``: ``$CLOUDCKPT_INCREMENTAL``)."""

    time_limit_s: float | None = None
    keep_last: int | None = None
    save_full_model_weights: bool = True
    incremental: bool | None = None


class RLinfCheckpointer:
    """Save and resume RLinf-layout checkpoints under ``{output_dir}/{experiment_name}/
    checkpoints``, as ``config`` (RLinf's ``runner`` keys) and ``options`` say; call
    :meth:`save` and :meth:`load` on every rank.

    ``steps_per_epoch`` is ``len(train_dataloader)``: with ``runner.max_steps: -1``
    RLinf's last step is ``steps_per_epoch * runner.max_epochs``, and it is saved.

    >>> ck = RLinfCheckpointer.from_config(cfg, storage_options=opts)   # doctest: +SKIP
    >>> uri = ck.resume_uri()                  # runner.resume_dir resolved, or None
    """

    def __init__(self, config: RunnerConfig, options: SaveOptions = SaveOptions(), *,
                 steps_per_epoch: int | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 process_group: Any = None) -> None:
        self.config = config
        self.options = options
        #: The run's last step, resolved as RLinf's runner does (always saved).
        self.max_steps = config.total_steps(steps_per_epoch)
        self.storage_options = dict(storage_options or {})
        self.store = open_store(config.root, self.storage_options)
        #: Every object a blob of the checkpoints root's area (None: $CLOUDCKPT_INCREMENTAL).
        self.incremental = blobs.requested(options.incremental)
        self.group = process_group
        self._started = time.monotonic()
        if options.keep_last is not None and options.keep_last < 1:
            raise ConfigError("keep_last must be >= 1 (or None to keep every checkpoint)")
        # Before training starts, not at the first save: a misspelt bucket fails here.
        coord.on_coordinator(self.store.check_bucket, process_group)

    @classmethod
    def from_config(cls, cfg: Any, options: SaveOptions = SaveOptions(), *,
                    steps_per_epoch: int | None = None,
                    storage_options: Mapping[str, Any] | None = None,
                    process_group: Any = None) -> RLinfCheckpointer:
        """From a Hydra/OmegaConf config or a plain dict with RLinf's ``runner`` keys."""
        return cls(RunnerConfig.from_config(cfg), options, steps_per_epoch=steps_per_epoch,
                   storage_options=storage_options, process_group=process_group)

    @property
    def root(self) -> str:
        return self.store.uri

    def step_uri(self, step: int) -> str:
        return self.store.child(step_name(step)).uri

    # -- when ---------------------------------------------------------------

    def time_limit_hit(self) -> bool:
        """Whether the slowest rank has passed ``options.time_limit_s`` (all ranks agree)."""
        limit = self.options.time_limit_s
        if limit is None:
            return False
        elapsed = coord.all_reduce_max(time.monotonic() - self._started, self.group)
        return elapsed >= limit

    def should_save(self, step: int) -> bool:
        """RLinf's ``save_interval`` rule for the step just finished (counted from 1)."""
        c = self.config
        if c.save_interval <= 0:
            return False
        if self.max_steps is None:
            raise ConfigError(
                "runner.max_steps is -1, so RLinf's last step is len(train_dataloader) * "
                "runner.max_epochs, and it is always saved: pass steps_per_epoch="
                "len(train_dataloader) (and runner.max_epochs) to RLinfCheckpointer")
        return should_save(step, c.save_interval, max_steps=self.max_steps,
                           time_limit_hit=self.time_limit_hit())

    # -- save ---------------------------------------------------------------

    def save(self, step: int, actor: Mapping[str, Any], *,
             critic: Mapping[str, Any] | None = None, data_state: Any = None,
             metadata: Mapping[str, Any] | None = None) -> Checkpoint | None:
        """Write ``global_step_{step}``: the DCP parts on every rank, each part's
        ``model_state_dict/full_weights.pt`` (unless ``options.save_full_model_weights`` is false),
        then ``data/data.pt`` and the root manifest on rank 0. Returns the committed
        checkpoint on rank 0.

        ``actor``/``critic`` are ``{"fsdp_checkpoint": ...}``: :func:`fsdp_state_dict`'s
        dict, or RLinf's own ``Checkpoint`` object (a ``Stateful``), as RLinf passes
        to ``dcp.save``. ``data_state`` is the driver's ``StatefulDataLoader.state_dict()``
        (taken from rank 0). Raises on every rank if any rank failed; nothing is
        committed then. ``data_state`` that cloudckpt could not load back (not plain
        data or tensors) raises :class:`ConfigError` before anything is written.
        """
        from cloudckpt.runtime import state

        refused = None
        if data_state is not None:
            try:
                state.check_restorable("data_state", data_state)
            except ConfigError as exc:
                refused = exc
        coord.agree(refused, self.group)  # every rank stops, not only the one refused
        store = self.store.child(step_name(step))
        states = {ACTOR: resolve_stateful(actor)}  # RLinf's Checkpoint: taken once
        if critic is not None:
            states[CRITIC] = resolve_stateful(critic)
        area = blobs.BlobArea(self.store) if self.incremental else None
        parts: list[multipart.Part] = [
            p for name, part_state in states.items()
            for p in fsdp_parts(name, part_state, step, self.options.save_full_model_weights,
                                blobs=area)]
        if data_state is not None:  # the last data object, as RLinf
            parts.append(multipart.SharedBytes(DATA_PATH, lambda: torch_bytes(data_state)))
        meta = {**dict(metadata or {}), "world_size": coord.world_size(self.group),
                "parts": list(states), "layout": "rlinf-fsdp", "key_prefix": KEY_PREFIX}
        try:
            committed = multipart.save(store, parts, group=self.group, step=step, kind=KIND,
                                       metadata=meta, blobs=area)
        except CommitConflictError as exc:  # raised alike on every rank
            if "already committed" not in str(exc):
                raise
            raise CommitConflictError(
                f"{exc}. This run resumed from an earlier step than the newest one: delete "
                f"the later steps first (cloudckpt rm {store.uri}) or resume with "
                "resume_dir: auto") from None
        if self.options.keep_last is not None:  # on rank 0; never fails the save committed
            coord.on_coordinator(self._prune, self.group)
        return committed

    def _prune(self) -> None:
        apply_retention(self.store, self.options.keep_last, number=_OWN_STEPS)

    # -- resume -------------------------------------------------------------

    def resume_uri(self) -> str | None:
        """``runner.resume_dir`` resolved to a committed checkpoint URI (None: fresh start)."""
        return resolve_resume_dir(self.config.resume_dir, self.store, self.storage_options)

    def load(self, uri: str, actor: dict[str, Any], *, critic: dict[str, Any] | None = None,
             rng: bool = True) -> Resumed:
        """Load ``actor`` (and ``critic``) in place from ``global_step_N`` and return
        the step and ``data/data.pt``; call on every rank.

        ``actor`` is :func:`fsdp_state_dict`'s dict (apply it with
        :func:`load_fsdp_state_dict`) or ``{"fsdp_checkpoint": <RLinf's Checkpoint>}``,
        which DCP loads and applies itself. The step comes from the directory name,
        as in RLinf, and must match the manifest's; it and every part asked for are
        checked before anything loads. Model and optimizer reshard to
        any world size; the RNG state is one copy, restored on every rank (as RLinf).
        ``rng=False`` leaves this process's generators alone.
        """
        from cloudckpt import dcp as cdcp

        parts = {part: part_state for part, part_state in ((ACTOR, actor), (CRITIC, critic))
                 if part_state is not None}

        def checked() -> tuple[Checkpoint, int, Any]:  # every part, before any loads
            ckpt = open_rlinf_checkpoint(uri, self.storage_options)
            step = checked_step(ckpt)
            for part in parts:
                if part not in ckpt.metadata.get("parts", []):
                    raise ConfigError(f"{ckpt.uri} has no {part}/ part; it has "
                                      f"{ckpt.metadata.get('parts')}")
                # The part's own manifest must be the one the root manifest committed.
                ckpt.read(f"{part}/{DCP_DIR}/{MANIFEST_NAME}")
            data = read_data_state(ckpt) if DATA_PATH in ckpt.manifest.files else None
            return ckpt, step, data

        ckpt, step, data = coord.checked(checked, self.group)
        for part, part_state in parts.items():
            inner = part_state.get(ROOT_KEY)
            if not rng and isinstance(inner, dict):
                inner.pop("rng", None)
            with numpy_rng_allowed():  # RLinf's rng.numpy holds an ndarray
                cdcp.load(part_state, ckpt.store.child(f"{part}/{DCP_DIR}"),
                          process_group=self.group)
        log.info("resumed from %s at global step %d", ckpt.uri, step)
        return Resumed(step, ckpt, data)


def read_data_state(ckpt: Checkpoint) -> Any:
    """``data/data.pt``, checked against the manifest, loaded with ``weights_only=True``."""
    from cloudckpt.serialization.torchload import safe_torch_load

    return safe_torch_load(io.BytesIO(ckpt.read(DATA_PATH)), f"{ckpt.uri}/{DATA_PATH}")


#: Retention governs only RLinf's own checkpoints: kind ``rlinf``, named ``global_step_N``.
_OWN_STEPS = Managed(KIND, STEP_RE)
