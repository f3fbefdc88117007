"""A trial AReaL wrote itself, already in a bucket (copied there with ``aws s3 sync``,
say): check it and commit it, so that these classes resume it.

``cloudckpt areal adopt URI``. Such a trial has AReaL's files
and no cloudckpt manifest, so nothing tells it from a torn save; adopting it checks
what can be checked and commits it:

- every export ``{name}/epoch{E}epochstep{S}globalstep{G}/`` in place (its config and
  weight files present, every object checksummed), as the Saver commits its own;
- the recover state (``recover_info/``, AReaL's six files, and every
  ``{name}/recover_checkpoint/``, each DCP checked against its ``.metadata``),
  checksummed and copied (on the server where the store can) into a new generation of
  the trial's recover slot, which then becomes current.

AReaL's own objects stay where they are: they are the user's, and cloudckpt deletes
only what it wrote. Once the run has resumed they can be removed by hand.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter
from cloudckpt.core.manifest import FileEntry, Manifest
from cloudckpt.core.ownership import COMMITTED, FOREIGN, survey
from cloudckpt.dcp.metadata import METADATA_NAME, load_metadata, missing_files
from cloudckpt.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from cloudckpt.hf import KIND as HF_KIND
from cloudckpt.integrations.areal.info import DATALOADER_FILE, JSON_FILES
from cloudckpt.integrations.areal.layout import EXPORT_RE, INFO_DIR, is_recover_file
from cloudckpt.integrations.areal.resume import KIND
from cloudckpt.movement.copying import checksum_object, copy_objects
from cloudckpt.storage import ObjectInfo, Store, as_store
from cloudckpt.training.slot import RecoverSlot

log = logging.getLogger(__name__)

INFO_FILES = ("step_info.json", *(f"{n}.json" for n in JSON_FILES), DATALOADER_FILE)
_STEP_KEYS = ("epoch", "epoch_step", "global_step", "steps_per_epoch")


def adopt_trial(uri: str | Store, *,
                storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Commit a trial directory AReaL wrote (``{fileroot}/checkpoints/{user}/
    {experiment}/{trial}``, in a bucket) after checking it; returns the URIs committed
    (the exports, then the slot's new generation). Raises what is missing or short."""
    store = as_store(uri.rstrip("/") if isinstance(uri, str) else uri, storage_options)
    slot = RecoverSlot(store)
    if slot.exists():
        raise ConfigError(f"{store.uri} already holds a recover state cloudckpt committed "
                          "(slot-pointer.json); nothing to adopt")
    objects = store.list()
    step = _step_info(store, objects)
    uris = [c.uri for c in _adopt_exports(store, objects)]
    recover = [o for o in objects if is_recover_file(o.key)]
    _check_recover(store, recover)
    source = _as_checkpoint(store, recover, step)
    generation = slot.commit(lambda gen: _copy_into(source, gen, store.uri),
                             step=step["global_step"], step_info=step)
    uris.append(store.child(generation).uri)
    log.info("adopted %s: %d export(s) and the recover state of global step %d", store.uri,
             len(uris) - 1, step["global_step"])
    return uris


def _step_info(store: Store, objects: list[ObjectInfo]) -> dict[str, int]:
    key = f"{INFO_DIR}/step_info.json"
    if not any(o.key == key for o in objects):
        raise CheckpointNotFoundError(
            f"{store.uri} holds no {key}: not an AReaL trial directory (expected "
            "{fileroot}/checkpoints/{user}/{experiment}/{trial})")
    try:
        doc = json.loads(store.get(key))
        return {k: int(doc[k]) for k in _STEP_KEYS}
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptCheckpointError(f"{store.key_uri(key)} is not AReaL's step info: {exc!r}",
                                     {key: "unreadable"}) from None


# ------------------------------------------------------------------------ exports


def _exports(objects: list[ObjectInfo]) -> dict[str, dict[str, int]]:
    """``{name}/{export}`` -> {relative key: size} for every export directory."""
    found: dict[str, dict[str, int]] = {}
    for o in objects:
        parts = o.key.split("/")
        if len(parts) > 2 and EXPORT_RE.match(parts[1]):
            found.setdefault("/".join(parts[:2]), {})["/".join(parts[2:])] = o.size
    return found


def _adopt_exports(store: Store, objects: list[ObjectInfo]) -> list[Checkpoint]:
    done = []
    for prefix, files in sorted(_exports(objects).items()):
        sub = store.child(prefix)
        kind = survey(sub).kind
        if kind == COMMITTED:
            continue  # the Saver's, or an earlier adopt's
        problem = _export_problem(sub, files) if kind == FOREIGN else \
            "a cloudckpt save of it never finished (cloudckpt gc removes it)"
        if problem:
            log.warning("not adopting export %s: %s; it stays uncommitted (invisible to "
                        "list_exports)", sub.uri, problem)
            continue
        m = EXPORT_RE.match(prefix.split("/")[1])
        assert m is not None
        done.append(_commit_in_place(sub, files, [int(g) for g in m.groups()]))
    return done


def _export_problem(store: Store, files: Mapping[str, int]) -> str | None:
    """What makes a Hugging Face folder incomplete, or None."""
    if "config.json" not in files:
        return "no config.json"
    index = next((f for f in files if f.endswith(".safetensors.index.json")), None)
    if index is None:
        return None if any(f.endswith((".safetensors", ".bin")) for f in files) \
            else "no weights"
    try:
        shards = set(json.loads(store.get(index))["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"unreadable {index} ({exc!r})"
    missing = sorted(shards - set(files))
    return f"missing {', '.join(missing)}" if missing else None


def _commit_in_place(store: Store, files: Mapping[str, int], steps: list[int]) -> Checkpoint:
    """Checksum every object of an export and commit it where it lies; ``steps`` are
    the epoch, epoch step and global step of its name."""
    writer = CheckpointWriter(store, step=steps[2], kind=HF_KIND, adopting=True, metadata={
        "step_info": dict(zip(("epoch", "epoch_step", "global_step"), steps, strict=True)),
        "adopted": True})
    try:
        writer.claim()
        keys = sorted(files)
        for key, (size, crc) in zip(keys, store.map(
                lambda k: checksum_object(store, k, files[k]), keys), strict=True):
            writer.add_existing(key, size, crc)
        return writer.commit()
    except BaseException:
        writer.abandon()  # the objects stay AReaL's, untouched
        raise


# ------------------------------------------------------------------ recover state


def _check_recover(store: Store, objects: list[ObjectInfo]) -> None:
    """AReaL's six recover-info files, and each engine's DCP complete by its
    ``.metadata``; raises :class:`CorruptCheckpointError` naming what is not."""
    sizes = {o.key: o.size for o in objects}
    problems = {f"{INFO_DIR}/{f}": "missing" for f in INFO_FILES
                if f"{INFO_DIR}/{f}" not in sizes}
    dcps = sorted({"/".join(k.split("/")[:2]) for k in sizes
                   if k.split("/")[1:2] == ["recover_checkpoint"]})
    if not dcps:
        problems["*/recover_checkpoint/.metadata"] = "missing"
    for prefix in dcps:
        problems.update(_dcp_problems(store, prefix, sizes))
    if problems:
        raise CorruptCheckpointError(
            f"cannot adopt {store.uri}: " + ", ".join(f"{k} ({v})" for k, v in problems.items())
            + ". A dump AReaL did not finish cannot be resumed; nothing was committed",
            problems)


def _dcp_problems(store: Store, prefix: str, sizes: Mapping[str, int]) -> dict[str, str]:
    """Each file an engine's ``.metadata`` names: present and long enough."""
    key = f"{prefix}/{METADATA_NAME}"
    if key not in sizes:
        return {key: "missing"}
    return missing_files(load_metadata(store.get(key), source=store.key_uri(key)), sizes,
                         prefix)


def _as_checkpoint(store: Store, objects: list[ObjectInfo], step: Mapping[str, int]
                   ) -> Checkpoint:
    """The recover objects as an (uncommitted) checkpoint: each checksummed once here,
    so every copy is checked against what was read."""
    sums = store.map(lambda o: checksum_object(store, o.key, o.size), objects)
    files = {o.key: FileEntry(size, crc) for o, (size, crc) in zip(objects, sums, strict=True)}
    return Checkpoint(store, Manifest(files=files, step=step["global_step"], kind=KIND))


def _copy_into(source: Checkpoint, generation: Store, slot_uri: str) -> Checkpoint:
    writer = CheckpointWriter(generation, step=source.step, kind=KIND,
                              metadata={"slot": slot_uri, "adopted": True})
    try:
        copy_objects(source, writer, source.files, None)
        return writer.commit()
    except BaseException:
        writer.abandon()  # what was copied is cloudckpt's (its claim says so): gc's
        raise
