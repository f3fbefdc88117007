"""``save``, ``load`` and ``async_save``: DCP's own calls with cloudckpt's writer
and reader, raising cloudckpt errors.

DCP reports every rank's failure as one ``CheckpointException`` (a
``BaseException``); these raise the cloudckpt error inside it instead, or
translate DCP's own complaint (a state that does not match the checkpoint).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from cloudckpt.core.checkpoint import Checkpoint
from cloudckpt.dcp import rankload, ranksave
from cloudckpt.dcp.budget import BudgetStager
from cloudckpt.dcp.reader import CloudStorageReader
from cloudckpt.dcp.writer import CloudStorageWriter
from cloudckpt.errors import CloudCkptError, ConfigError, StateMismatchError, StorageError
from cloudckpt.runtime import coordination as coord
from cloudckpt.runtime import interrupts
from cloudckpt.runtime.pending import SaveFuture, run_in_background
from cloudckpt.runtime.state import Stateful, check_state_dict, resolve_stateful
from cloudckpt.serialization.torchload import refusal
from cloudckpt.storage import Store

log = logging.getLogger(__name__)


@contextmanager
def _unwrapped(what: str, group: Any = None) -> Iterator[None]:
    """DCP wraps every rank's failure in ``CheckpointException`` (a BaseException, which
    ``except Exception`` misses); raise a cloudckpt error instead, so callers can catch
    ours: the first cloudckpt error inside, else :func:`_translate`'s. An interrupt of
    this rank (Ctrl-C, ``SystemExit``) is raised as itself, so the caller's ``except
    KeyboardInterrupt`` runs; another rank's interrupt is a :class:`StorageError`."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        own = _own_interrupt(exc, coord.rank(group))
        if own is not None:
            raise own from None
        raise _ours(exc) or _translate(exc, what) from exc


def _own_interrupt(exc: BaseException, rank: int) -> BaseException | None:
    """This rank's failure inside ``exc`` when it is not an ``Exception``."""
    for r, inner in _failures(exc):
        if r == rank and not isinstance(inner, Exception):
            return inner
    return None


def _failures(exc: BaseException) -> list[tuple[int, BaseException]]:
    out = []
    for rank, failure in sorted(getattr(exc, "failures", {}).items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            out.append((rank, inner))
    return out


def _ours(exc: BaseException) -> CloudCkptError | None:
    for _, inner in _failures(exc):
        if isinstance(inner, CloudCkptError):
            return inner
    return None


_SIZE_MISMATCH = re.compile(r"Size mismatch between saved (?P<saved>.+?) and current: "
                            r"(?P<current>.+?) for (?P<key>\S+)")
_MISSING_KEY = re.compile(r"Missing key in checkpoint state_dict: (?P<key>\S+?)\.?$")


def _translate(exc: BaseException, what: str) -> CloudCkptError:
    """A cloudckpt error for a failure DCP reported: the state to load not matching the
    checkpoint (a key's shape, a key the checkpoint lacks) is a
    :class:`StateMismatchError` naming the key; anything else a :class:`StorageError`."""
    failures = _failures(exc)
    if not failures:
        return StorageError(f"{what} failed: {refusal(exc)}")
    rank, inner = failures[0]
    text = refusal(inner)
    m = _SIZE_MISMATCH.search(str(inner))
    if m:
        return StateMismatchError(
            f"{what}: {m['key']} has shape {_shape(m['saved'])} in the checkpoint but "
            f"{_shape(m['current'])} in the state to load into. The model (or optimizer) does "
            "not match the checkpoint: build it with the configuration it was saved with.")
    m = _MISSING_KEY.search(str(inner))
    if m:
        return StateMismatchError(
            f"{what}: the state to load into has {m['key']}, which the checkpoint lacks. The "
            "model does not match the checkpoint; load with a matching model, or drop the key "
            "(or pass a planner allowing partial loads, e.g. DefaultLoadPlanner("
            "allow_partial_load=True)).")
    if isinstance(inner, (ValueError, KeyError, TypeError)):
        return StateMismatchError(f"{what} failed on rank {rank}: {type(inner).__name__}: "
                                  f"{text}; the state to load does not match the checkpoint")
    return StorageError(f"{what} failed on rank {rank}: {type(inner).__name__}: {text}")


def _shape(torch_size: str) -> str:
    """``torch.Size([3, 4])`` -> ``(3, 4)``."""
    m = re.fullmatch(r"torch\.Size\(\[(.*)\]\)", torch_size.strip())
    return f"({m[1]})" if m else torch_size


def checked_state(state_dict: Mapping[str, Any], group: Any = None) -> dict[str, Any]:
    """The state to save (stateful values as their ``state_dict()``), refused on every
    rank of ``group`` if any rank's holds what a load could not restore."""
    plain = resolve_stateful(state_dict)
    coord.each_rank(lambda: check_state_dict(plain), group)
    return plain


def _save(state_dict: dict[str, Any], writer: CloudStorageWriter, planner: SavePlanner | None,
          group: Any, indexed: bool | None) -> Checkpoint | None:
    """The save itself: indexed where asked and the state allows, else torch's."""
    import torch.distributed.checkpoint as dcp

    with _unwrapped(f"saving {writer.uri}", group):
        if indexed is not False:
            # Stateful values as their state_dict() (a caller's checked state may hold
            # them: the manager's), as torch's dcp.save takes them.
            state_dict = resolve_stateful(state_dict)
            prepared = ranksave.prepare(state_dict, writer, planner, group)
            if prepared is not None:
                return ranksave.write(prepared, writer, group)
        dcp.save(state_dict, storage_writer=writer, planner=planner, **_dist_args(group))
    return writer.committed


def _dist_args(group: Any) -> dict[str, Any]:
    """DCP's ``process_group``/``no_dist`` for ``group`` (no collectives for
    :data:`~cloudckpt.runtime.coordination.SOLO`, this rank alone)."""
    alone = coord.alone(group)
    return {"process_group": None if alone else group, "no_dist": alone}


@interrupts.watching()
def save(
    state_dict: dict[str, Any],
    uri: str | Store,
    *,
    storage_options: Mapping[str, Any] | None = None,
    process_group: Any = None,
    planner: SavePlanner | None = None,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    checked: bool = False,
    overwrite: bool = False,
    indexed: bool | None = None,
    **writer_options: Any,
) -> Checkpoint | None:
    """``dcp.save`` to ``uri`` with a :class:`CloudStorageWriter`; cloudckpt errors
    are raised as themselves. Returns the committed checkpoint on the coordinator.

    A URI holding a committed checkpoint is refused (:class:`CommitConflictError`)
    unless ``overwrite``, which replaces it as the writer does; cloudckpt's own
    functions keep commit-once as their default, the writer takes torch's.

    A state holding what a load could not restore (not tensors or plain data) raises
    :class:`ConfigError` naming the key on every rank, before anything is written;
    ``checked`` says the caller has refused such states on every rank already
    (:func:`cloudckpt.training.snapshot.capture` does), so they are not checked twice.

    ``indexed`` writes the indexed format (:mod:`cloudckpt.dcp.ranksave`: no plan
    gathered, metadata that grows with tensors, not ranks) where the state's chunks
    allow it; None (the default) does the same, False writes torch's own format.
    """
    if not checked:
        state_dict = checked_state(state_dict, process_group)
    writer = CloudStorageWriter(uri, storage_options=storage_options, step=step,
                                metadata=metadata, overwrite=overwrite, **writer_options)
    try:
        return _save(state_dict, writer, planner, process_group, indexed)
    except BaseException:
        writer.release_claim()
        raise


def load(
    state_dict: dict[str, Any],
    uri: str | Store | Checkpoint,
    *,
    storage_options: Mapping[str, Any] | None = None,
    process_group: Any = None,
    planner: LoadPlanner | None = None,
) -> None:
    """``dcp.load`` in place from the committed DCP checkpoint at ``uri``.

    Rank 0 reads the manifest and ``.metadata`` (or, in the indexed format, the index)
    first and shares them, so a missing, torn or unadopted checkpoint raises
    :class:`CheckpointNotFoundError`/:class:`IncompleteCheckpointError` on every
    rank at once, and the bucket sees one read of each per job, not per rank. A
    :class:`Checkpoint` given (every rank the same) is not read again. An object that
    disagrees with the manifest (missing, short, another CRC32C) raises
    :class:`CorruptCheckpointError` naming it.

    An indexed checkpoint is loaded by each rank alone (:mod:`.rankload`): it reads
    the records of the chunks its state overlaps (its own, on the layout it was saved
    with) and plans locally; a state that does not match the checkpoint raises
    :class:`StateMismatchError` on every rank before any data is read.
    """
    import torch.distributed.checkpoint as dcp

    reader = CloudStorageReader(uri, storage_options=storage_options, share_metadata=True,
                                process_group=process_group)
    # Manifest, metadata and index problems surface here as our own errors.
    start = reader.open_for_load()
    if start is not None and not _plans_by_name(planner):
        # Its planner may read items under other names or in other windows than the
        # state's own: it plans against the whole Metadata, every rank's records.
        log.info("loading %s with %s: reading the whole index and every rank's records",
                 reader.uri, type(planner).__name__)
        start = None
    if start is None:
        with _unwrapped(f"loading {reader.uri}", process_group):
            dcp.load(state_dict, storage_reader=reader, planner=planner,
                     **_dist_args(process_group))
        return
    # Stateful values as their state_dict(), taken once (in key order, as dcp.load does).
    plain = resolve_stateful({k: state_dict[k] for k in sorted(state_dict)})
    rankload.prepare(plain, reader, start, planner=planner, group=process_group)

    def alone() -> None:
        with _unwrapped(f"loading {reader.uri}", coord.SOLO):
            dcp.load(plain, storage_reader=reader, planner=planner, no_dist=True)

    coord.checked(alone, process_group)
    for key, value in plain.items():  # back into the caller's state, as dcp.load does
        target = state_dict[key]
        if isinstance(target, Stateful) and not isinstance(target, Mapping):
            target.load_state_dict(value)
        else:
            state_dict[key] = value


def _plans_by_name(planner: LoadPlanner | None) -> bool:
    """Whether ``planner`` loads each item of the state from the saved item of the same
    name and shape, what a rank-by-rank load plans on: DCP's default planner, a subclass
    that keeps its local plan, or one that says so (``plans_by_name = True``)."""
    return planner is None or getattr(planner, "plans_by_name", False) is True or (
        isinstance(planner, DefaultLoadPlanner)
        and type(planner).create_local_plan is DefaultLoadPlanner.create_local_plan)


# ----------------------------------------------------------------------- async


def async_save(
    state_dict: dict[str, Any],
    uri: str | Store,
    *,
    storage_options: Mapping[str, Any] | None = None,
    process_group: Any = None,
    planner: SavePlanner | None = None,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    staging_budget: int | None = None,
    stager: BudgetStager | None = None,
    overwrite: bool = False,
    indexed: bool | None = None,
    **writer_options: Any,
) -> SaveFuture:
    """Save with only staging on the caller's thread; the upload runs in the background.

    Up to ``staging_budget`` bytes of tensors (default: a quarter of the host's
    memory per local rank, see :func:`~cloudckpt.dcp.budget.default_budget`) are
    copied to host memory, pinned when they come from a GPU. A larger state's
    other tensors are uploaded first, straight from their memory, before this
    returns; then the copies upload in the background. Pass the same ``stager``
    (a :class:`~cloudckpt.dcp.budget.BudgetStager`, which then sets the budget)
    to every save to reuse its host buffers. ``result()`` on the returned future
    returns the committed checkpoint on the coordinator (None elsewhere), or
    raises what went wrong; a save still running when the process ends is waited
    for, or reported (see :mod:`cloudckpt.runtime.pending`). Use a gloo process group (or
    ``cpu:gloo,cuda:nccl``) for the background collectives. ``overwrite`` and
    ``indexed`` as for :func:`save`.
    """
    if stager is not None and staging_budget is not None:
        raise ConfigError("pass staging_budget or a stager (which has its own budget), not both")
    state_dict = checked_state(state_dict, process_group)
    staged = (stager or BudgetStager(staging_budget)).stage(state_dict)
    writer = CloudStorageWriter(uri, storage_options=storage_options, step=step,
                                metadata=metadata, staged=staged, overwrite=overwrite,
                                **writer_options)

    def run() -> Checkpoint | None:
        try:
            return _save(staged.state_dict, writer, planner, process_group, indexed)
        except BaseException:
            writer.release_claim()
            raise
        finally:
            staged.release()

    future = run_in_background(run, f"async save to {writer.uri}",
                               name="cloudckpt-async-save")
    staged.wait()  # the tensors that did not fit in the budget are written
    return future
