"""The resume side: which committed ``checkpoint-N`` is the latest, and downloading it to
a local directory, the only kind of path ROLL's ``download_model`` passes through
unchanged (anything else goes to a model hub)."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...checkpoint import read_manifest
from ...errors import CheckpointNotFoundError, IncompleteCheckpointError
from ...listing import list_checkpoints
from ...storage import Store, open_store

#: ROLL's checkpoint directory names.
CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def committed(store: Store) -> list[tuple[int, str]]:
    """``(N, name)`` of every committed ``checkpoint-N`` under ``store``, by N."""
    out = []
    for info in list_checkpoints(store):
        m = CKPT_RE.match(info.name)
        if m:
            out.append((int(m.group(1)), info.name))
    return sorted(out)


def default_download_dir(output_dir: str) -> Path:
    """Where ``get_latest_ckpt`` downloads to when ``download_dir`` is not set: one
    directory per bucket prefix under cloudckpt's cache (``CLOUDCKPT_CACHE``)."""
    from ...hf import cache_dir

    return cache_dir() / "roll" / hashlib.sha1(output_dir.encode()).hexdigest()[:16]


def download_checkpoint(uri_or_latest: str, local_dir: str | os.PathLike[str],
                        storage_options: Mapping[str, Any] | None = None) -> str:
    """Download a committed checkpoint, every object checked, and return its local path.

    ``uri_or_latest`` is a ``.../checkpoint-N`` URI, or an ``output_dir`` whose
    newest committed ``checkpoint-N`` is taken. The files land in
    ``local_dir/checkpoint-N`` in ROLL's layout; files already there with the right
    CRC32C are not fetched again, so a second resume costs nothing.
    """
    from ...transfer import download

    store = open_store(str(uri_or_latest).rstrip("/"), storage_options)
    name = store.uri.rstrip("/").rsplit("/", 1)[-1]
    if not CKPT_RE.match(name):
        best = committed(store)
        if not best:
            raise CheckpointNotFoundError(f"no committed checkpoint-N under {store.uri}")
        name = best[-1][1]
        store = store.child(name)
    try:
        read_manifest(store)
    except IncompleteCheckpointError as exc:
        raise IncompleteCheckpointError(
            f"{store.uri} is a torn ROLL checkpoint (never committed); resume from "
            f"the latest committed one instead. {exc}") from None
    target = Path(local_dir) / name
    download(store.uri, target, storage_options)
    return str(target)
