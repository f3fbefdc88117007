"""Save and resume RLinf-layout checkpoints: :class:`RLinfCheckpointer`."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ... import coordination as coord
from ...checkpoint import Checkpoint, CheckpointWriter
from ...errors import CommitConflictError, ConfigError
from ...manifest import MANIFEST_NAME
from ...retention import apply_retention
from ...storage import Store, open_store
from ...training import claim_prefix
from .config import RunnerConfig, should_save
from .layout import (
    _STEP_RE,
    ACTOR,
    CRITIC,
    DATA_PATH,
    DCP_DIR,
    KEY_PREFIX,
    KIND,
    ROOT_KEY,
    step_name,
)
from .resume import _checked_step, open_rlinf_checkpoint, resolve_resume_dir

log = logging.getLogger("cloudckpt.rlinf")


@dataclass
class Resumed:
    """What :meth:`RLinfCheckpointer.load` restored besides the tensors loaded in place."""

    step: int
    checkpoint: Checkpoint
    data_state: Any


class RLinfCheckpointer:
    """Save and resume RLinf-layout checkpoints under ``{output_dir}/{experiment_name}/
    checkpoints``; call :meth:`save` and :meth:`load` on every rank.

    >>> ck = RLinfCheckpointer.from_config(cfg, storage_options=opts)   # doctest: +SKIP
    >>> uri = ck.resume_uri()                  # runner.resume_dir resolved, or None
    """

    def __init__(self, output_dir: str, experiment_name: str, *, save_interval: int = -1,
                 max_steps: int | None = None, resume_dir: str | None = None,
                 time_limit_s: float | None = None, keep_last: int | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 process_group: Any = None) -> None:
        self.config = RunnerConfig(str(output_dir), str(experiment_name), int(save_interval),
                                   resume_dir, max_steps)
        self.storage_options = dict(storage_options or {})
        self.store = open_store(self.config.root, self.storage_options)
        self.time_limit_s = time_limit_s
        self.keep_last = keep_last
        self.group = process_group
        self._started = time.monotonic()
        if keep_last is not None and keep_last < 1:
            raise ConfigError("keep_last must be >= 1 (or None to keep every checkpoint)")

    @classmethod
    def from_config(cls, cfg: Any, **kwargs: Any) -> RLinfCheckpointer:
        """From a Hydra/OmegaConf config or a plain dict with RLinf's ``runner`` keys."""
        rc = RunnerConfig.from_config(cfg)
        return cls(rc.output_dir, rc.experiment_name, save_interval=rc.save_interval,
                   max_steps=rc.max_steps, resume_dir=rc.resume_dir, **kwargs)

    @property
    def root(self) -> str:
        return self.store.uri

    def step_uri(self, step: int) -> str:
        return self.store.child(step_name(step)).uri

    # -- when ---------------------------------------------------------------

    def time_limit_hit(self) -> bool:
        """Whether the slowest rank has passed ``time_limit_s`` (all ranks agree)."""
        if self.time_limit_s is None:
            return False
        elapsed = coord.all_reduce_max(time.monotonic() - self._started, self.group)
        return elapsed >= self.time_limit_s

    def should_save(self, step: int) -> bool:
        """RLinf's ``save_interval`` rule for the step just finished (counted from 1)."""
        c = self.config
        if c.save_interval <= 0:
            return False
        return should_save(step, c.save_interval, max_steps=c.max_steps,
                           time_limit_hit=self.time_limit_hit())

    # -- save ---------------------------------------------------------------

    def save(self, step: int, actor: Mapping[str, Any], *,
             critic: Mapping[str, Any] | None = None, data_state: Any = None,
             metadata: Mapping[str, Any] | None = None) -> Checkpoint | None:
        """Write ``global_step_{step}``: the DCP parts on every rank, then ``data/data.pt``
        and the root manifest on rank 0. Returns the committed checkpoint on rank 0.

        ``data_state`` is the driver's ``StatefulDataLoader.state_dict()`` (taken from
        rank 0). Raises on every rank if any rank failed; nothing is committed then.
        ``data_state`` that cloudckpt could not load back (not plain data or tensors)
        raises :class:`ConfigError` before anything is written.
        """
        from ... import state

        refused = None
        if data_state is not None:
            try:
                state.check_restorable("data_state", data_state)
            except ConfigError as exc:
                refused = exc
        coord.agree(refused, self.group)  # every rank stops, not only the one refused
        store = self.store.child(step_name(step))
        world = coord.world_size(self.group)
        parts = [ACTOR] + ([CRITIC] if critic is not None else [])
        try:
            writer = claim_prefix(store, self.group, step=step, kind=KIND, metadata={
                **dict(metadata or {}), "world_size": world, "parts": parts,
                "layout": "rlinf-fsdp", "key_prefix": KEY_PREFIX})
        except CommitConflictError as exc:  # raised alike on every rank
            if "already committed" not in str(exc):
                raise
            raise CommitConflictError(
                f"{exc}. This run resumed from an earlier step than the newest one: delete "
                f"the later steps first (cloudckpt rm {store.uri}) or resume with "
                "resume_dir: auto") from None
        try:
            committed = self._write_parts(store, writer, parts, actor, critic, data_state, step)
        except BaseException:
            if writer is not None:
                writer.abandon()  # the claim stays, marked: the leftovers remain ours
            raise
        if self.keep_last is not None:  # on rank 0; never fails the save just committed
            coord.on_coordinator(self._prune, self.group)
        return committed

    def _write_parts(self, store: Store, writer: CheckpointWriter | None, parts: list[str],
                     actor: Mapping[str, Any], critic: Mapping[str, Any] | None,
                     data_state: Any, step: int) -> Checkpoint | None:
        import torch

        from ... import dcp as cdcp

        for part, state in zip(parts, (actor, critic), strict=False):
            cdcp.save(dict(state), store.child(f"{part}/{DCP_DIR}"), process_group=self.group,
                      step=step)

        def commit() -> Checkpoint:
            assert writer is not None
            for part in parts:
                writer.add_part(f"{part}/{DCP_DIR}")
            if data_state is not None:
                buf = io.BytesIO()
                torch.save(data_state, buf)
                writer.put(DATA_PATH, buf.getvalue())  # last data object, as RLinf
            return writer.commit()

        return coord.on_coordinator(commit, self.group, share=False)

    def _prune(self) -> None:
        apply_retention(self.store, self.keep_last, number=_step_number)

    # -- resume -------------------------------------------------------------

    def resume_uri(self) -> str | None:
        """``runner.resume_dir`` resolved to a committed checkpoint URI (None: fresh start)."""
        return resolve_resume_dir(self.config.resume_dir, self.store, self.storage_options)

    def load(self, uri: str, actor: dict[str, Any], *, critic: dict[str, Any] | None = None,
             rng: bool = True) -> Resumed:
        """Load ``actor`` (and ``critic``) in place from ``global_step_N`` and return
        the step and ``data/data.pt``; call on every rank.

        The step comes from the directory name, as in RLinf, and must match the
        manifest's. RNG entries of another world size are dropped (with a warning):
        model and optimizer reshard, per-rank RNG cannot.
        """
        from ... import dcp as cdcp

        ckpt = open_rlinf_checkpoint(uri, self.storage_options)
        step = _checked_step(ckpt)
        saved_world = int(ckpt.metadata.get("world_size", 1))
        world = coord.world_size(self.group)
        for part, state in ((ACTOR, actor), (CRITIC, critic)):
            if state is None:
                continue
            if part not in ckpt.metadata.get("parts", []):
                raise ConfigError(f"{ckpt.uri} has no {part}/ part; it has "
                                  f"{ckpt.metadata.get('parts')}")
            inner = state.get(ROOT_KEY)
            if isinstance(inner, dict) and "rng" in inner and (not rng or saved_world != world):
                if rng:
                    log.warning("%s was saved by %d ranks, this job has %d: not restoring "
                                "per-rank RNG states", ckpt.uri, saved_world, world)
                inner.pop("rng")
            # The part's own manifest must be the one the root manifest committed.
            ckpt.read(f"{part}/{DCP_DIR}/{MANIFEST_NAME}")
            cdcp.load(state, ckpt.store.child(f"{part}/{DCP_DIR}"), process_group=self.group)
        data = read_data_state(ckpt) if DATA_PATH in ckpt.manifest.files else None
        log.info("resumed from %s at global step %d", ckpt.uri, step)
        return Resumed(step, ckpt, data)


def read_data_state(ckpt: Checkpoint) -> Any:
    """``data/data.pt``, checked against the manifest, loaded with ``weights_only=True``."""
    from ...state import safe_torch_load

    return safe_torch_load(io.BytesIO(ckpt.read(DATA_PATH)), f"{ckpt.uri}/{DATA_PATH}")


def _step_number(info: Any) -> int | None:
    """The N of ``global_step_N`` (retention governs only RLinf's own steps)."""
    m = _STEP_RE.match(info.name)
    return int(m.group(1)) if m and info.step is not None else None
