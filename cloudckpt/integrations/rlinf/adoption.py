"""Steps written by RLinf itself: check and commit one in place (``adopt``), or put a
local one into a bucket, committed (``upload``).

A stock ``global_step_N`` has no manifest, so cloudckpt cannot tell it from a torn
save. Adopting it checks every DCP part against its ``.metadata`` (every file there,
long enough, each item checksummed: :func:`cloudckpt.dcp.adopt`), checksums the
other objects (``data/data.pt``, ``model_state_dict/full_weights.pt``...), and
commits a root manifest of kind ``rlinf``, after which it resumes like a step
cloudckpt wrote.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter, open_checkpoint
from cloudckpt.core.ownership import COMMITTED, FOREIGN, survey
from cloudckpt.errors import CheckpointNotFoundError, ConfigError, IncompleteCheckpointError
from cloudckpt.integrations.rlinf.layout import (
    ACTOR,
    CRITIC,
    DATA_PATH,
    DCP_DIR,
    KEY_PREFIX,
    KIND,
    parse_step,
)
from cloudckpt.movement.checkpoint_copy import copy_checkpoint
from cloudckpt.movement.copying import checksum_object
from cloudckpt.storage import Store, as_store

log = logging.getLogger(__name__)


def adopt_step(uri: str | Store, storage_options: Mapping[str, Any] | None = None
               ) -> Checkpoint:
    """Commit a ``global_step_N`` that RLinf wrote (anywhere: a bucket, a path) after
    checking it; the step comes from its name. Raises what is missing or short."""
    store = as_store(uri.rstrip("/") if isinstance(uri, str) else uri, storage_options)
    step = parse_step(store.uri)
    found = survey(store)
    if found.kind == COMMITTED:
        raise ConfigError(f"{store.uri} is already committed; nothing to adopt")
    if found.kind != FOREIGN:
        raise IncompleteCheckpointError(
            f"{store.uri} is not a step written by RLinf ({found.kind}): "
            + ("nothing is there" if not found.objects else
               "cloudckpt's own save left it unfinished; remove it (cloudckpt rm --force)"))
    parts = [p for p in (ACTOR, CRITIC) if store.exists(f"{p}/{DCP_DIR}/.metadata")]
    if ACTOR not in parts:
        raise CheckpointNotFoundError(f"{store.uri} has no {ACTOR}/{DCP_DIR}/.metadata: not "
                                      "an RLinf FSDP step (the Megatron layout is not supported)")
    writer = CheckpointWriter(store, step=step, kind=KIND, adopting=True, metadata={
        "parts": parts, "layout": "rlinf-fsdp", "key_prefix": KEY_PREFIX, "adopted": True})
    try:
        writer.claim()
        return _commit(store, writer, parts, step)
    except BaseException:
        writer.abandon()  # the objects stay RLinf's, untouched
        raise


def _commit(store: Store, writer: CheckpointWriter, parts: list[str], step: int) -> Checkpoint:
    from cloudckpt.dcp import adopt

    for part in parts:
        adopt(store.child(f"{part}/{DCP_DIR}"), step=step)
        writer.add_part(f"{part}/{DCP_DIR}")
    covered = tuple(f"{p}/{DCP_DIR}/" for p in parts)
    others = [o for o in store.list() if not o.key.startswith(covered)]
    for key, (size, crc) in zip([o.key for o in others],
                                store.map(lambda o: checksum_object(store, o.key, o.size),
                                          others), strict=True):
        writer.add_existing(key, size, crc)
    if DATA_PATH not in writer.entries:
        log.warning("%s has no %s: a resume restarts the dataloader (as RLinf does)",
                    store.uri, DATA_PATH)
    committed = writer.commit()
    log.info("adopted %s: %d objects checked and committed", store.uri, len(committed.files))
    return committed


def upload_step(local_step: str, dst: str, *,
                storage_options: Mapping[str, Any] | None = None) -> Checkpoint:
    """Put a ``global_step_N`` from local disk into ``dst`` (the run's ``checkpoints``
    directory, or the step's own URI there), checked and committed.

    A stock step is adopted in place first (this adds cloudckpt's manifests beside
    RLinf's files, which RLinf ignores); the copy is then verified object by object
    and committed, and an interrupted upload resumes when run again.
    """
    src = local_step.rstrip("/")
    name = f"global_step_{parse_step(src)}"
    target = dst.rstrip("/")
    if target.rpartition("/")[2] != name:
        if target.rpartition("/")[2].startswith("global_step_"):
            raise ConfigError(f"{dst} names another step than {src}; the step is taken from "
                              "the name, so they must match")
        target = f"{target}/{name}"
    try:
        ckpt = open_checkpoint(src)
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        ckpt = adopt_step(src)
    if ckpt.manifest.kind != KIND:
        raise ConfigError(f"{src} is a {ckpt.manifest.kind!r} checkpoint, not an RLinf step")
    out = copy_checkpoint(ckpt, target, dst_options=storage_options)
    log.info("uploaded %s -> %s", src, out.uri)
    return out

