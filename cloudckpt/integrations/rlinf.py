"""RLinf on object storage: ``runner.*`` keys and the ``global_step_N/`` layout, crash-safe.

RLinf's FSDP backend writes, per saved step::

    {output_dir}/{experiment_name}/checkpoints/global_step_{N}/
        actor/dcp_checkpoint/{.metadata, __{rank}_{i}.distcp}   DCP, keys fsdp_checkpoint.*
        critic/dcp_checkpoint/...                                optional
        data/data.pt                                             torch.save(dataloader state)

This module writes the same layout to any cloudckpt URI (``s3://``, ``gs://``,
a path). Each DCP part is committed by its own manifest (all ranks write their
shards in parallel), ``data/data.pt`` is written after them, and then one root
manifest ``global_step_{N}/cloudckpt-manifest.json`` lists every object of every
part with its CRC32C. Until that manifest exists the step is invisible: a crash
at any point leaves the previous step as the latest, where RLinf's own rule
("``actor/`` and ``data/data.pt`` exist") accepts a half-written shard or
``data.pt``.

Our DCP writer names shard files ``__{rank}_{i}.distcp`` (``i`` > 0 when a
rank's items are split over several files); ``.metadata`` records every name,
so stock DCP readers load them as usual.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import coordination as coord
from ..checkpoint import Checkpoint, CheckpointWriter, list_checkpoints, open_checkpoint
from ..composite import claim_prefix
from ..errors import (
    CheckpointNotFoundError,
    CloudCkptError,
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ..manifest import MANIFEST_NAME
from ..retention import apply_retention
from ..storage import Store, as_store, open_store

log = logging.getLogger("cloudckpt.rlinf")

__all__ = [
    "KEY_PREFIX",
    "RLinfCheckpointer",
    "Resumed",
    "RunnerConfig",
    "checkpoints_root",
    "convert",
    "fsdp_state_dict",
    "load_fsdp_state_dict",
    "main",
    "parse_step",
    "resolve_resume_dir",
    "should_save",
]

KIND = "rlinf"
CHECKPOINTS = "checkpoints"
STEP_PREFIX = "global_step_"
ACTOR = "actor"
CRITIC = "critic"
DCP_DIR = "dcp_checkpoint"
DATA_PATH = "data/data.pt"
#: RLinf's DCP state dict is ``{"fsdp_checkpoint": {model, optimizers, lr_schedulers,
#: fsdp_version, rng}}``; DCP flattens it, so model tensors are under this prefix.
ROOT_KEY = "fsdp_checkpoint"
KEY_PREFIX = f"{ROOT_KEY}.model."
_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")
_NULLS = {"", "null", "none", "~"}


# ----------------------------------------------------------------- naming, config


def checkpoints_root(output_dir: str, experiment_name: str) -> str:
    """``{output_dir}/{experiment_name}/checkpoints`` (``output_dir`` may be a URI)."""
    if not output_dir or not experiment_name:
        raise ConfigError("runner.output_dir and runner.experiment_name must both be set")
    return f"{str(output_dir).rstrip('/')}/{experiment_name.strip('/')}/{CHECKPOINTS}"


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{int(step)}"


def parse_step(uri: str) -> int:
    """The step RLinf resumes at, from the directory name: ``.../global_step_150/`` -> 150."""
    name = str(uri).rstrip("/").rpartition("/")[2]
    m = _STEP_RE.match(name)
    if not m:
        raise ConfigError(f"resume_dir {uri!r} does not end in {STEP_PREFIX}<N>; RLinf takes "
                          "the resumed step from that name")
    return int(m.group(1))


def _plain(cfg: Any) -> dict[str, Any]:
    """A plain dict from a mapping or an OmegaConf/Hydra ``DictConfig`` (resolved)."""
    if cfg is None:
        return {}
    try:  # OmegaConf, without depending on it
        from omegaconf import OmegaConf

        if OmegaConf.is_config(cfg):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:
        pass
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"expected a mapping for the RLinf config, got {type(cfg).__name__}")
    return dict(cfg)


@dataclass(frozen=True)
class RunnerConfig:
    """The ``runner.*`` keys RLinf's checkpointing reads."""

    output_dir: str
    experiment_name: str
    save_interval: int = -1
    resume_dir: str | None = None
    max_steps: int | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> RunnerConfig:
        """From the whole Hydra config (with a ``runner`` section) or the section itself."""
        top = _plain(cfg)
        runner = _plain(top["runner"]) if "runner" in top else top
        missing = [k for k in ("output_dir", "experiment_name") if not runner.get(k)]
        if missing:
            raise ConfigError(f"the RLinf config lacks runner.{', runner.'.join(missing)}")
        resume = runner.get("resume_dir")
        max_steps = runner.get("max_steps")
        return cls(output_dir=str(runner["output_dir"]),
                   experiment_name=str(runner["experiment_name"]),
                   save_interval=int(-1 if runner.get("save_interval") is None
                                     else runner["save_interval"]),
                   resume_dir=None if resume is None else str(resume),
                   max_steps=None if max_steps in (None, -1) else int(max_steps))

    @property
    def root(self) -> str:
        return checkpoints_root(self.output_dir, self.experiment_name)


def should_save(step: int, save_interval: int, *, max_steps: int | None = None,
                time_limit_hit: bool = False) -> bool:
    """RLinf's rule, for ``step`` counted from 1 (the number of updates done).

    ``save_interval`` <= 0 disables saving entirely; otherwise save when
    ``step % save_interval == 0``, at ``max_steps``, or when the time limit is hit.
    """
    if save_interval <= 0:
        return False
    return step % save_interval == 0 or (max_steps is not None and step == max_steps) \
        or time_limit_hit


# ------------------------------------------------------------ FSDP state dicts


def fsdp_state_dict(model: Any, optimizer: Any, lr_scheduler: Any = None, *,
                    fsdp_version: int = 2, rank: int | None = None) -> dict[str, Any]:
    """The actor's DCP state dict with RLinf's keys: ``fsdp_checkpoint.{model,
    optimizers, lr_schedulers, fsdp_version, rng}``.

    Model and optimizer come from ``get_state_dict`` (sharded DTensors under
    FSDP2). RNG states are per rank (``rng.rank_{r}``), since DCP keeps one copy
    of a key that every rank saves.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ..state import get_rng_state

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

    from ..state import set_rng_state

    inner = state[ROOT_KEY]
    set_state_dict(model, optimizer, model_state_dict=inner["model"],
                   optim_state_dict=inner["optimizers"])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(inner["lr_schedulers"])
    if rng:
        for value in inner.get("rng", {}).values():  # only this rank's entry
            set_rng_state(value)


# ------------------------------------------------------------------ the checkpointer


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
        from .. import state

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

        from .. import dcp as cdcp

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
        from .. import dcp as cdcp

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
    from ..state import safe_torch_load

    return safe_torch_load(io.BytesIO(ckpt.read(DATA_PATH)), f"{ckpt.uri}/{DATA_PATH}")


def _step_number(info: Any) -> int | None:
    """The N of ``global_step_N`` (retention governs only RLinf's own steps)."""
    m = _STEP_RE.match(info.name)
    return int(m.group(1)) if m and info.step is not None else None


def open_rlinf_checkpoint(uri: str | Store,
                          storage_options: Mapping[str, Any] | None = None) -> Checkpoint:
    """Open a committed ``global_step_N`` (a trailing slash is fine)."""
    if isinstance(uri, str):
        uri = uri.rstrip("/") or uri
    ckpt = open_checkpoint(uri, storage_options)
    if ckpt.manifest.kind != KIND:
        raise CorruptCheckpointError(
            f"{ckpt.uri} is a {ckpt.manifest.kind!r} checkpoint, not an RLinf one")
    return ckpt


def _checked_step(ckpt: Checkpoint) -> int:
    step = parse_step(ckpt.uri)
    if ckpt.step is not None and ckpt.step != step:
        raise CorruptCheckpointError(
            f"{ckpt.uri} is named for step {step} but its manifest says step {ckpt.step}; "
            "was it renamed or copied to the wrong place?")
    return step


def resolve_resume_dir(resume_dir: str | None, root: str | Store,
                       storage_options: Mapping[str, Any] | None = None) -> str | None:
    """``runner.resume_dir`` -> the URI of a committed ``global_step_N``, or None.

    - null / empty: None (fresh start);
    - ``auto``: the highest committed step under ``root`` (None if there is none);
      uncommitted (torn) ``global_step_*`` prefixes are skipped with a WARNING;
    - a URI or path: that checkpoint, which must be committed.
    """
    if resume_dir is None or str(resume_dir).strip().lower() in _NULLS:
        return None
    store = as_store(root, storage_options)
    if str(resume_dir).strip().lower() == "auto":
        return _latest(store)
    target = str(resume_dir).strip().rstrip("/")
    if target.startswith(store.uri + "/"):  # below the root: reuse its client and options
        ckpt = open_rlinf_checkpoint(store.child(target[len(store.uri) + 1:]))
    else:
        ckpt = open_rlinf_checkpoint(target, storage_options)
    _checked_step(ckpt)
    return ckpt.uri


def _latest(store: Store) -> str | None:
    infos = [i for i in list_checkpoints(store, include_uncommitted=True)
             if _STEP_RE.match(i.name)]
    best: tuple[int, str] | None = None
    for info in sorted(infos, key=lambda i: parse_step(i.name), reverse=True):
        if not info.committed:
            log.warning("skipping %s: torn checkpoint (no cloudckpt manifest%s); a save "
                        "that never finished", info.uri, f": {info.error}" if info.error else "")
            continue
        best = (parse_step(info.name), info.uri)
        break
    if best is None:
        log.info("resume_dir=auto: no committed checkpoint under %s; starting fresh", store.uri)
        return None
    return best[1]


# ------------------------------------------------------------------- converter


def convert(dcp_path: str, output_path: str, *,
            storage_options: Mapping[str, Any] | None = None) -> int:
    """RLinf's ``--dcp_path/--output_path`` conversion, for URIs: the model tensors of
    an actor DCP checkpoint as a ``torch.save`` state dict. ``dcp_path`` may be the
    ``dcp_checkpoint`` prefix, ``actor/`` or the whole ``global_step_N``."""
    from ..convert import dcp_to_pt

    src = _dcp_part(dcp_path.rstrip("/"), storage_options)
    return dcp_to_pt(src, output_path, key_prefix=KEY_PREFIX, storage_options=storage_options)


def _dcp_part(uri: str, storage_options: Mapping[str, Any] | None) -> str:
    for candidate in (uri, f"{uri}/{DCP_DIR}", f"{uri}/{ACTOR}/{DCP_DIR}"):
        try:
            ckpt = open_checkpoint(candidate, storage_options)
        except (CheckpointNotFoundError, IncompleteCheckpointError):
            continue
        if ckpt.manifest.kind == "dcp":
            return candidate
    raise CheckpointNotFoundError(
        f"no committed DCP checkpoint at {uri} (nor at {uri}/{DCP_DIR} or "
        f"{uri}/{ACTOR}/{DCP_DIR})")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    from ..storage import parse_options

    opts = json.loads(args.storage_options) if args.storage_options else {}
    opts.update(parse_options(args.storage_option))
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cloudckpt.integrations.rlinf {convert,latest} ...``"""
    p = argparse.ArgumentParser(prog="python -m cloudckpt.integrations.rlinf",
                                description="RLinf checkpoints on object storage")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="DCP actor checkpoint -> torch.save state dict")
    c.add_argument("--dcp_path", "--dcp-path", required=True,
                   help="global_step_N, its actor/ or actor/dcp_checkpoint (any URI)")
    c.add_argument("--output_path", "--output-path", required=True,
                   help="file to write (a local path or any URI)")
    lt = sub.add_parser("latest", help="print the URI `resume_dir: auto` would resume from")
    lt.add_argument("--output_dir", "--output-dir", required=True)
    lt.add_argument("--experiment_name", "--experiment-name", required=True)
    for sp in (c, lt):
        sp.add_argument("--storage-options", default=None, help="storage options as JSON")
        sp.add_argument("-o", "--storage-option", action="append", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "convert":
            n = convert(args.dcp_path, args.output_path, storage_options=_options(args))
            print(f"wrote {n} tensors to {args.output_path}")
            return 0
        uri = resolve_resume_dir("auto", checkpoints_root(args.output_dir,
                                                          args.experiment_name),
                                 _options(args))
        if uri is None:
            print("no committed checkpoint", file=sys.stderr)
            return 1
        print(uri)
        return 0
    except CloudCkptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
