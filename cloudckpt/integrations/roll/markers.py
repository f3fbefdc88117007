"""A checkpoint's parts as the bucket holds them: their markers, and whether ROLL could
resume from the files they hold.

ROLL's resume reads ``pipeline/worker_state_pipeline.json`` first
(``BasePipeline.__init__``), then every worker loads its ``dcp/`` directory with
``dcp.load`` (``fsdp2_strategy.load_checkpoint``), which opens ``.metadata`` and every
shard it names; the older per-rank torch files
(``{model,optim,extra_state}_world_size_{W}_rank_{R}.pt``) are read rank by rank. A
commit checks exactly that, from the parts' own file lists, so a checkpoint missing any
of it is never made visible.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.integrations.roll.layout import PARTS_DIR as ROLL_PARTS_DIR
from cloudckpt.integrations.roll.layout import PIPELINE_STATE
from cloudckpt.storage import Store

log = logging.getLogger(__name__)

#: DCP's names (as in ``cloudckpt.dcp.metadata``, imported only when a part holds DCP
#: files: it imports torch, which the uploader's processes need not pay for).
METADATA_NAME, SUFFIX = ".metadata", ".distcp"
#: ROLL's per-rank torch files (fsdp2_strategy._build_checkpoint_paths).
_TORCH_SHARD_RE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
#: Problems named in one message, at most (the rest are counted).
_SHOWN = 5


def read_markers(store: Store) -> dict[str, dict[str, Any]]:
    """Every readable part marker of the checkpoint at ``store``, by key. A marker that
    vanished meanwhile (another process committed and cleaned up) is left out."""
    keys = [o.key for o in store.list(ROLL_PARTS_DIR) if o.key.endswith(".json")]
    found = store.map(lambda key: (key, _get_or_none(store, key)), keys)
    markers: dict[str, dict[str, Any]] = {}
    for key, data in found:
        marker = _parse(store, key, data)
        if marker is not None:
            markers[key] = marker
    return markers


def part_names(markers: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The distinct part names of ``markers``, sorted."""
    return sorted({str(m.get("part") or k.rsplit("/", 1)[-1][:-5]) for k, m in markers.items()})


def resume_problems(files: Mapping[str, int], read: Callable[[str], bytes]) -> list[str]:
    """Why ROLL could not resume from a checkpoint holding ``files`` (key -> size);
    empty when it could. ``read`` returns an object's bytes (for DCP ``.metadata``)."""
    problems = [] if PIPELINE_STATE in files else [
        f"{PIPELINE_STATE} is missing (the pipeline's part, which ROLL's resume reads first)"]
    for folder in sorted(_dcp_folders(files)):
        problems += _dcp_problems(folder, files, read)
    problems += _torch_shard_problems(files)
    return problems


def summary(problems: list[str]) -> str:
    """``problems`` as one clause: the first few, then how many more."""
    shown = "; ".join(problems[:_SHOWN])
    more = len(problems) - _SHOWN
    return f"{shown}; and {more} more" if more > 0 else shown


# ------------------------------------------------------------- internals

def _get_or_none(store: Store, key: str) -> bytes | None:
    try:
        return store.get(key)
    except FileNotFoundError:
        return None


def _parse(store: Store, key: str, data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        marker = json.loads(data)
    except ValueError:
        marker = None
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        log.warning("ignoring unreadable part marker %s", store.key_uri(key))
        return None
    return marker


def _dcp_folders(files: Mapping[str, int]) -> set[str]:
    """Folders holding DCP files: a ``.metadata`` or any ``.distcp`` shard."""
    return {posixpath.dirname(k) for k in files
            if posixpath.basename(k) == METADATA_NAME or k.endswith(SUFFIX)}


def _dcp_problems(folder: str, files: Mapping[str, int],
                  read: Callable[[str], bytes]) -> list[str]:
    """What ``dcp.load`` of ``folder`` would miss: its ``.metadata``, or a shard (or the
    bytes of one) that the metadata names."""
    meta_key = posixpath.join(folder, METADATA_NAME)
    where = f"{folder}/" if folder else "the checkpoint's root"
    if meta_key not in files:
        return [f"{where} holds DCP shards but no {METADATA_NAME} (the part of the rank "
                "that writes it has not arrived)"]
    from cloudckpt.dcp.metadata import load_metadata, missing_files

    try:
        metadata = load_metadata(read(meta_key), source=meta_key)
    except (CorruptCheckpointError, FileNotFoundError) as exc:
        return [f"{meta_key} cannot be read as DCP metadata: {exc}"]
    gaps = missing_files(metadata, files, folder)
    missing = sorted(k for k, why in gaps.items() if why == "missing")
    short = sorted(k for k, why in gaps.items() if why != "missing")
    out = [f"{meta_key} names {k}, which no part uploaded" for k in missing]
    return out + [f"{k} is shorter than {meta_key} says" for k in short]


def _torch_shard_problems(files: Mapping[str, int]) -> list[str]:
    """Ranks missing from a set of per-rank torch files saved by ``W`` ranks."""
    ranks: dict[tuple[str, str, int], set[int]] = defaultdict(set)
    for key in files:
        m = _TORCH_SHARD_RE.match(posixpath.basename(key))
        if m:
            ranks[(posixpath.dirname(key), m.group(1), int(m.group(2)))].add(int(m.group(3)))
    out = []
    for (folder, kind, world), seen in sorted(ranks.items()):
        for rank in sorted(set(range(world)) - seen):
            name = f"{kind}_world_size_{world}_rank_{rank}.pt"
            out.append(f"{posixpath.join(folder, name)} is missing (saved by {world} ranks)")
    return out
