"""Training checkpoints: a DCP part and a training-state part under one root manifest.

Layout of one training checkpoint at ``<uri>``::

    model/...                       DCP checkpoint (model, optimizer; sharded), own manifest
    state/rank-00000.bin ...        per-rank state (RNG, dataloader position), one per rank
    state/shared.bin                shared state (step info, scheduler, controllers, extras)
    cloudckpt-manifest.json         root manifest, written last, listing every object above

The root manifest lists every object of both parts with its CRC32C (the DCP
part's manifest included), so one ``verify(deep=True)`` covers the whole
checkpoint, and nothing is visible until every rank's part is durable.

A save may hold less than the whole training state (a save profile,
:mod:`cloudckpt.core.profiles`): its root manifest records what it lacks, and
:func:`read` checks that record before it applies anything (:class:`Selection`
says which entries of the DCP state are the model).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.planner import LoadPlanner

from cloudckpt import dcp as cdcp
from cloudckpt.core import kinds
from cloudckpt.core.blobs import BlobArea
from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.core.expected import expect_kind, expect_step, expect_world_size
from cloudckpt.core.manifest import MAX_RANKS, metadata_int
from cloudckpt.core.profiles import (
    ADAPTERS,
    FROZEN,
    FULL,
    PROFILE_KEY,
    RNG,
    WEIGHTS,
    Profile,
    check_resume,
    recorded,
)
from cloudckpt.dcp.budget import StagedState
from cloudckpt.errors import ConfigError
from cloudckpt.names import MANIFEST_NAME, MODEL_PART
from cloudckpt.runtime import coordination as coord
from cloudckpt.runtime.state import (
    Stateful,
    StepInfo,
    check_restorable,
    check_state_dict,
    dumps_state,
    get_rng_state,
    loads_state,
    resolve_stateful,
    set_rng_state,
)
from cloudckpt.storage import Store, as_store
from cloudckpt.training import multipart

KIND = kinds.TRAINING
SHARED = "state/shared.bin"
_STEP_INFO = "__step_info__"
#: :func:`read`'s checks are agreed on by the group that loads (a local tier's loads
#: are each rank's own, its checks the job's).
SAME_GROUP: Any = object()
_RNG = "__rng__"


@dataclass
class Captured:
    """Training state snapshotted at save time (plain data, safe to write later)."""

    shared: dict[str, Any] = field(default_factory=dict)
    per_rank: dict[str, Any] = field(default_factory=dict)
    #: The DCP state (``app_state``) was checked with the rest, on every rank: the
    #: save does not check it again.
    state_checked: bool = False


def _snapshot(kind: str, key: str, value: Any) -> Any:
    """A copy of ``value``'s state, refused at once if a restore could not load it."""
    stateful = isinstance(value, Stateful)
    state = value.state_dict() if stateful else value
    check_restorable(f"{kind}[{key!r}]", state, owner=value if stateful else None)
    return copy.deepcopy(state)


def capture(
    *,
    app_state: Mapping[str, Any] | None = None,
    step_info: StepInfo | None = None,
    shared: Mapping[str, Any] | None = None,
    per_rank: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> Captured:
    """Snapshot stateful objects (``state_dict()``) and plain values, and the RNG state.

    Raises :class:`ConfigError` for a value that could be saved but never restored
    (no ``state_dict()``, and not plain data or tensors), before anything is written;
    ``app_state``, the model and optimizer state for the DCP part, is checked too.
    """
    if app_state is not None:
        check_state_dict(resolve_stateful(app_state))
    snap = Captured({k: _snapshot("extra", k, v) for k, v in (shared or {}).items()},
                    {k: _snapshot("per_rank", k, v) for k, v in (per_rank or {}).items()},
                    state_checked=app_state is not None)
    if step_info is not None:
        snap.shared[_STEP_INFO] = step_info.to_dict()
    if rng:
        snap.per_rank[_RNG] = get_rng_state()
    return snap


def capture_together(*, group: Any = None, **what: Any) -> Captured:
    """:func:`capture` on every rank of ``group``; if it refuses state on any rank,
    every rank raises (no rank goes on to the save's collectives alone)."""
    captured, refused = None, None
    try:
        captured = capture(**what)
    except ConfigError as exc:
        refused = exc
    coord.agree(refused, group)
    assert captured is not None
    return captured


def is_lora(name: str) -> bool:
    """The default adapter filter: the names of LoRA's parameters (``lora_A``,
    ``lora_B``, ``lora_embedding_A``...) hold ``lora_``."""
    return "lora_" in name


@dataclass(frozen=True)
class Selection:
    """Which entries of the DCP state (``app_state``) a ``weights`` or ``adapters``
    profile keeps, at a save and at a load alike.

    ``model_keys`` names the entries that hold the model; every other entry is
    optimizer or other training state, which both profiles leave out. An ``adapters``
    profile keeps, of each model entry, the trainable parameters: of a module
    (anything with ``named_parameters()``) those with ``requires_grad``, without its
    buffers (no optimizer updates them: they are the base model's); of a mapping of
    tensors (a ``state_dict()``, where nothing says what trains) the names
    ``adapter_filter`` takes (by default :func:`is_lora`).
    """

    model_keys: tuple[str, ...] = ("model",)
    adapter_filter: Callable[[str], bool] = is_lora

    def select(self, app_state: Mapping[str, Any], profile: str) -> dict[str, Any]:
        """The entries of ``app_state`` a save of ``profile`` holds; a
        :class:`ConfigError` when it holds no model entry, or no adapter parameter."""
        if profile == FULL:
            return dict(app_state)
        keys = [k for k in app_state if k in self.model_keys]
        if not keys:
            raise ConfigError(
                f"the {profile!r} profile keeps the model's entries of the state, named by "
                f"ManagerOptions.model_keys={self.model_keys!r}, and this state has none: "
                f"its entries are {sorted(app_state)}. Name the model's entries in "
                "model_keys, or save it 'full'")
        if profile == WEIGHTS:
            return {k: app_state[k] for k in keys}
        return {k: self.adapters(k, app_state[k]) for k in keys}

    def adapters(self, key: str, value: Any) -> dict[str, Any]:
        """The trainable parameters of the model entry ``value`` (see the class)."""
        named = getattr(value, "named_parameters", None)
        if callable(named):
            found = {n: p.detach() for n, p in named() if p.requires_grad}
            what = "parameters has requires_grad=True"
        elif isinstance(value, Mapping):
            found = {n: v for n, v in value.items() if self.adapter_filter(n)}
            what = "names passes ManagerOptions.adapter_filter (by default: holds 'lora_')"
        else:
            raise ConfigError(
                f"state[{key!r}] is a {type(value).__name__}: an 'adapters' save takes the "
                "trainable parameters of a module (named_parameters()) or the adapter "
                "entries of a mapping of tensors. Pass the module, or its state_dict()")
        if not found:
            raise ConfigError(f"state[{key!r}] holds no adapter to save: none of its {what}. "
                              "Freeze the base model and leave the adapter trainable, set "
                              "ManagerOptions.adapter_filter, or save 'weights'")
        return found

    def lacks(self, profile: str, app_state: Mapping[str, Any], others: Collection[str]
              ) -> tuple[str, ...]:
        """What a save of ``profile`` leaves out (its record's ``lacks``): the entries of
        ``app_state`` that are not the model, the RNG, ``others`` (the names of the
        shared and per-rank states it was given) and, for ``adapters``, the frozen
        weights."""
        if profile == FULL:
            return ()
        out = {k for k in app_state if k not in self.model_keys} | {RNG} | set(others)
        if profile == ADAPTERS:
            out.add(FROZEN)
        return tuple(sorted(out))

    def may_hold(self, profile: str, wanted: Collection[str]) -> bool:
        """Whether any save of ``profile`` can hold all of ``wanted`` (what a resume
        loads: :func:`wanted`), judged by the profile alone: a ``weights`` save holds
        the model entries, an ``adapters`` save not even their frozen weights."""
        if profile == FULL:
            return True
        held = set(self.model_keys) | ({FROZEN} if profile == WEIGHTS else set())
        return set(wanted) <= held


def wanted(app_state: Mapping[str, Any], shared: Mapping[str, Any] | None,
           per_rank: Mapping[str, Any] | None, rng: bool, selection: Selection) -> set[str]:
    """What a load of these would take from a checkpoint, in the names a profile's
    record uses (:meth:`Selection.lacks`): every state's name, the RNG, and the frozen
    weights when it loads a model entry. Names starting ``__`` are cloudckpt's own."""
    out = {k for k in (*app_state, *(shared or {}), *(per_rank or {})) if not k.startswith("__")}
    if rng:
        out.add(RNG)
    if any(k in selection.model_keys for k in app_state):
        out.add(FROZEN)
    return out


def _rank_key(rank: int) -> str:
    return f"state/rank-{rank:05d}.bin"


@dataclass(frozen=True)
class WriteOptions:
    """How :func:`write` saves a training checkpoint.

    ``step`` and ``metadata`` go to the root manifest. ``as_rank``, with
    ``group=SOLO`` (this rank alone), names the DCP files and the per-rank state as
    that rank's of the job, so that the checkpoint's objects can join a job-wide one
    under the same names (:mod:`cloudckpt.training.tiers`). ``deadline``
    (``time.monotonic()``) refuses a commit after it (a preemption save).
    ``incremental`` stores every object in the run's blob area (the directory above
    the checkpoint), sending only those whose bytes are not there yet
    (:mod:`cloudckpt.core.blobs`); ``file_per_tensor`` only lays the DCP files out as
    such a save does. ``index`` records the commit in the root index of the directory
    above the checkpoint, making it when there is none (:mod:`cloudckpt.core.rootindex`:
    a saver of a run root). ``profile``, when given, is recorded in the root manifest
    (:mod:`cloudckpt.core.profiles`; a checkpoint without a record is ``full``)."""

    step: int | None = None
    metadata: Mapping[str, Any] | None = None
    profile: Profile | None = None
    as_rank: int | None = None
    deadline: float | None = None
    incremental: bool = False
    file_per_tensor: bool = False
    index: bool = False


def write(
    uri: str | Store,
    app_state: Mapping[str, Any],
    captured: Captured,
    options: WriteOptions = WriteOptions(),
    *,
    storage_options: Mapping[str, Any] | None = None,
    group: Any = None,
    staged: StagedState | None = None,
    figures: multipart.Part | None = None,
) -> Checkpoint | None:
    """Write and commit one training checkpoint, as ``options`` say; call on every rank.

    ``app_state`` (model and optimizer state dicts, DTensors welcome) goes to
    the DCP part; ``staged``, when ``app_state`` is one, has its live tensors
    written first (see :mod:`cloudckpt.dcp.budget`). ``figures``
    (:class:`cloudckpt.training.reports.Figures`) add the ranks' figures. Returns the
    committed checkpoint on rank 0, None elsewhere. Raises on every rank if any rank
    failed; then nothing is committed.
    """
    step, as_rank = options.step, options.as_rank
    incremental, file_per_tensor = options.incremental, options.file_per_tensor
    store = as_store(uri, storage_options)
    blobs = BlobArea.above(store, 1) if incremental else None
    dcp_options: dict[str, Any] = {"staged": staged, "checked": captured.state_checked,
                                   "blobs": blobs, "file_per_tensor": file_per_tensor}
    if as_rank is not None:
        dcp_options["files_of_rank"] = as_rank
    parts: list[multipart.Part] = [
        multipart.DcpPart(MODEL_PART, app_state, step, dcp_options),
        multipart.RankBytes(_rank_key if as_rank is None else lambda _: _rank_key(as_rank),
                            dumps_state(captured.per_rank), blobs),
        multipart.SharedBytes(SHARED, lambda: dumps_state(captured.shared)),
        *([figures] if figures is not None else []),
    ]
    record = {PROFILE_KEY: options.profile.record()} if options.profile is not None else {}
    return multipart.save(store, parts, group=group, step=step, kind=KIND,
                          deadline=options.deadline, blobs=blobs, index=options.index,
                          metadata={**dict(options.metadata or {}), **record, **root_metadata(
                              coord.world_size(group), captured.shared.get(_STEP_INFO))})


def root_metadata(world_size: int, step_info: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a training checkpoint's root manifest says of it: the ranks that saved
    it (its per-rank state), its parts, and where training was."""
    return {"world_size": world_size, "parts": [MODEL_PART, "state"], "step_info": step_info}


@dataclass
class Restored:
    """What :func:`read` found besides the tensors it loaded in place."""

    checkpoint: Checkpoint
    step_info: StepInfo | None
    shared: dict[str, Any]
    #: What the checkpoint holds (its profile's record), and what of the state asked
    #: for it lacked: left as it was, to start fresh (a partial resume).
    profile: Profile = field(default_factory=Profile)
    fresh: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReadOptions:
    """How :func:`read` loads a training checkpoint: ``rng`` restores the RNG state;
    ``planner`` is DCP's load planner; ``as_rank`` the per-rank state to read, for a
    checkpoint :func:`write` saved with one; ``step`` the step its name must say;
    ``checks_group`` the ranks that agree on the checks (by default the group that
    loads).

    A checkpoint saved with a profile that lacks some of what the load asks for
    (:mod:`cloudckpt.core.profiles`) is refused with :class:`PartialCheckpointError`
    unless ``allow_partial``: then it loads what the checkpoint holds (``selection``
    says what that is of ``app_state``), and leaves the rest as it was, named in a
    WARNING. ``how_to_allow`` is how the refusal tells the user to allow it."""

    rng: bool = True
    planner: LoadPlanner | None = None
    as_rank: int | None = None
    step: int | None = None
    checks_group: Any = SAME_GROUP
    allow_partial: bool = False
    how_to_allow: str = "ReadOptions(allow_partial=True)"
    selection: Selection = Selection()


def read(
    uri: str | Store | Checkpoint,
    app_state: Mapping[str, Any],
    options: ReadOptions = ReadOptions(),
    *,
    shared: Mapping[str, Any] | None = None,
    per_rank: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    group: Any = None,
) -> Restored:
    """Load a training checkpoint, as ``options`` say: ``app_state`` in place (DCP, any
    world size), stateful ``shared``/``per_rank`` objects via ``load_state_dict``, and
    RNG.

    Call on every rank of ``group``. Rank 0 alone reads the manifests, DCP's
    ``.metadata`` and the shared state, and shares them; every rank reads its own
    per-rank state and its shards.

    Everything refusable is checked before anything is applied: the kind, ``step``
    (the one its name says, when given), what a partial save lacks of what the load
    asks for (:class:`PartialCheckpointError`, unless ``options.allow_partial``: see
    :class:`ReadOptions`), the world size of per-rank state, the
    names of the states to restore, and that every object the manifest lists is there
    with its size (one listing: a missing, truncated or oversized object raises
    :class:`CorruptCheckpointError` naming it, as one whose bytes fail their CRC32C
    does while it loads, so a resume can fall back from either). If any rank refuses,
    every rank of ``checks_group`` (by default ``group``) raises, and nothing was
    loaded anywhere.
    """
    as_rank, step = options.as_rank, options.step
    asked = wanted(app_state, shared, per_rank, options.rng, options.selection)

    def opened() -> tuple[Checkpoint, dict[str, Any], Checkpoint | None, Profile,
                          tuple[str, ...]]:
        ckpt = uri if isinstance(uri, Checkpoint) else open_checkpoint(uri, storage_options)
        expect_step(expect_kind(ckpt, KIND, "a training checkpoint"), step)
        profile = recorded(ckpt.manifest.metadata)
        fresh = tuple(check_resume(ckpt.uri, profile, asked, allow_partial=options.allow_partial,
                                   how_to_allow=options.how_to_allow))
        load = _Load.of(profile, fresh, app_state, shared, per_rank, options)
        if load.per_rank or load.rng:
            saved_world = metadata_int(ckpt.manifest, "world_size", ckpt.store.key_uri(
                MANIFEST_NAME), default=1, low=1, high=MAX_RANKS)
            expect_world_size(
                ckpt.uri, saved_world, coord.world_size(group),
                holds="per-rank state (RNG, dataloader positions)",
                otherwise=", or restore without per-rank state (per_rank=None, rng=False): "
                          "model, optimizer and shared state reshard freely")
        ckpt.verify()
        shared_bytes, model = ckpt.store.map(lambda job: job(), [
            lambda: ckpt.read(SHARED), lambda: ckpt.part(MODEL_PART) if load.app else None])
        return (ckpt, loads_state(shared_bytes, source=f"{ckpt.uri}/{SHARED}"), model,
                profile, fresh)

    def checked() -> tuple[Checkpoint, dict[str, Any], dict[str, Any], Checkpoint | None,
                           Profile, tuple[str, ...], _Load]:
        found = coord.on_coordinator(opened, group)
        assert found is not None
        ckpt, saved_shared, model, profile, fresh = found
        load = _Load.of(profile, fresh, app_state, shared, per_rank, options)
        _check_names(load.shared, saved_shared, ckpt.uri)
        saved: dict[str, Any] = {}
        if load.per_rank or load.rng:
            key = _rank_key(coord.rank(group) if as_rank is None else as_rank)
            saved = loads_state(ckpt.read(key), source=f"{ckpt.uri}/{key}")
            _check_names(load.per_rank, saved, ckpt.uri)
        return ckpt, saved_shared, saved, model, profile, fresh, load

    # Checked on every rank before anything is applied; from here on, state is.
    ckpt, saved_shared, saved, model, profile, fresh, load = coord.checked(
        checked, group if options.checks_group is SAME_GROUP else options.checks_group)
    if model is not None:
        # DCP sets entries of the caller's state: a dict, though read() is typed Mapping
        cdcp.load(load.app, model, process_group=group,  # type: ignore[arg-type]
                  planner=options.planner)
        if load.app is not app_state:
            _put_back(app_state, load)
    _restore_into(load.shared, saved_shared)
    _restore_into(load.per_rank, saved)
    if load.rng and _RNG in saved:
        set_rng_state(saved[_RNG])
    info = saved_shared.get(_STEP_INFO)
    return Restored(ckpt, StepInfo.from_dict(info) if info else None,
                    {k: v for k, v in saved_shared.items() if k != _STEP_INFO}, profile, fresh)


@dataclass(frozen=True)
class _Load:
    """What :func:`read` loads of what it was asked: all of it from a ``full``
    checkpoint; from a partial one, what it holds (``fresh``: what it lacks)."""

    app: Mapping[str, Any]
    shared: Mapping[str, Any]
    per_rank: Mapping[str, Any]
    rng: bool
    #: The entries of ``app`` built for the load (an adapter's parameters).
    built: frozenset[str] = frozenset()

    @classmethod
    def of(cls, profile: Profile, fresh: tuple[str, ...], app_state: Mapping[str, Any],
           shared: Mapping[str, Any] | None, per_rank: Mapping[str, Any] | None,
           options: ReadOptions) -> _Load:
        if not fresh:
            return cls(app_state, shared or {}, per_rank or {}, options.rng)
        gone = set(fresh)
        app = {k: v for k, v in app_state.items() if k not in gone}
        built = frozenset(k for k in app if profile.name == ADAPTERS
                          and k in options.selection.model_keys)
        app.update({k: options.selection.adapters(k, app[k]) for k in built})
        return cls(app, {k: v for k, v in (shared or {}).items() if k not in gone},
                   {k: v for k, v in (per_rank or {}).items() if k not in gone},
                   options.rng and RNG not in gone, built)


def _put_back(app_state: Mapping[str, Any], load: _Load) -> None:
    """The entries of a partial load back in the caller's state, as a whole load sets
    them: a stateful one loaded itself; an adapter's parameters were loaded in place."""
    if not isinstance(app_state, MutableMapping):
        return
    for key, value in load.app.items():
        if key not in load.built and not isinstance(app_state[key], Stateful):
            app_state[key] = value


def _check_names(targets: Mapping[str, Any], saved: Mapping[str, Any], uri: str) -> None:
    for name in targets:
        if name not in saved:
            raise ConfigError(f"{uri} has no saved state named {name!r}; it has "
                              f"{sorted(k for k in saved if not k.startswith('__'))}")


def _restore_into(targets: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    for name, target in targets.items():
        if isinstance(target, Stateful):
            target.load_state_dict(saved[name])
