"""The resume side: which committed ``checkpoint-N`` is the latest, and downloading it to
a local directory, the only kind of path ROLL's ``download_model`` passes through
unchanged (anything else goes to a model hub)."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cloudckpt.core.checkpoint import open_checkpoint
from cloudckpt.core.expected import expect_kind, expect_step
from cloudckpt.core.listing import CheckpointInfo, list_checkpoints
from cloudckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError
from cloudckpt.integrations.roll.layout import CKPT_RE, KIND, checkpoint_order
from cloudckpt.integrations.roll.markers import part_names, read_markers
from cloudckpt.storage import Store, open_store

log = logging.getLogger(__name__)


def latest_committed(store: Store, expected_uploads: int | None = None) -> str | None:
    """The name of the highest committed ``checkpoint-N`` under ``store`` whose objects
    all match its manifest (None if there is none), with a WARNING naming each newer one
    it skips and why, so a resume that falls back, or starts from scratch, is never
    silent."""
    infos = [i for i in list_checkpoints(store, include_uncommitted=True)
             if CKPT_RE.match(i.name)]
    done = sorted(checkpoint_order(i.name) for i in infos if i.committed)
    by_name = {i.name: i for i in infos}
    while done and not by_name[done[-1][1]].whole(store):  # its objects disagree: skipped
        done.pop()
    floor = done[-1][0] if done else -1
    skipped = sorted((i for i in infos if not i.committed
                      and checkpoint_order(i.name)[0] > floor),
                     key=lambda i: checkpoint_order(i.name))
    for info in skipped:
        log.warning("resume from %s: skipping %s: %s", store.uri, info.name,
                    _why_skipped(store, info, expected_uploads))
    if skipped:
        names = ", ".join(i.name for i in skipped)
        if done:
            log.warning("resume from %s: resuming from %s, the newest committed checkpoint; "
                        "skipped the newer %s (not committed)", store.uri, done[-1][1], names)
        else:
            log.warning("resume from %s: no committed checkpoint-N, so the run starts from "
                        "scratch; skipped %s (not committed)", store.uri, names)
    return done[-1][1] if done else None


def recorded_clusters(store: Store) -> set[str]:
    """The checkpoint clusters the newest committed ``checkpoint-N`` under ``store``
    was made of (its manifest records them): a later checkpoint of the run, in any
    attempt, is whole only with every one of them."""
    done = [i for i in list_checkpoints(store) if i.committed and CKPT_RE.match(i.name)]
    if not done:
        return set()
    manifest = max(done, key=lambda i: checkpoint_order(i.name)).manifest
    assert manifest is not None
    return set((manifest.metadata or {}).get("clusters") or {})


def _why_skipped(store: Store, info: CheckpointInfo, expected: int | None) -> str:
    """Why an uncommitted ``checkpoint-N`` is not a resume point, with the fix."""
    if info.status == "unreadable":
        return f"its manifest cannot be read ({info.error})"
    parts = part_names(read_markers(store.child(info.name)))
    if not parts:
        return ("not committed, and no cloudckpt part markers (not uploaded by the s3/gcs "
                "uploader; `cloudckpt roll upload` commits a complete "
                "local copy)")
    want = f"of expected_uploads={expected} " if expected else ""
    hint = (" expected_uploads higher than the processes that upload leaves every "
            "checkpoint like this: set it to the pipeline + every uploading rank."
            if expected and len(parts) < expected else "")
    return (f"not committed: {len(parts)} {want}parts found ({', '.join(parts)}), so its "
            f"upload never completed.{hint}")


def default_download_dir(output_dir: str) -> Path:
    """Where ``get_latest_ckpt`` downloads to when ``download_dir`` is not set: one
    directory per bucket prefix under cloudckpt's cache (``CLOUDCKPT_CACHE``)."""
    from cloudckpt.hf import cache_dir

    return cache_dir() / "roll" / hashlib.sha1(output_dir.encode()).hexdigest()[:16]


def download_checkpoint(uri_or_latest: str, local_dir: str | os.PathLike[str],
                        storage_options: Mapping[str, Any] | None = None) -> str:
    """Download a committed checkpoint, every object checked, and return its local path.

    ``uri_or_latest`` is a ``.../checkpoint-N`` URI, or an ``output_dir`` whose
    newest committed ``checkpoint-N`` is taken. The files land in
    ``local_dir/checkpoint-N`` in ROLL's layout; files already there with the right
    CRC32C are not fetched again, so a second resume costs nothing.
    """
    from cloudckpt.movement.checkpoint_copy import download

    store = open_store(str(uri_or_latest).rstrip("/"), storage_options)
    name = store.uri.rstrip("/").rsplit("/", 1)[-1]
    if not CKPT_RE.match(name):
        best = latest_committed(store)
        if best is None:
            raise CheckpointNotFoundError(f"no committed checkpoint-N under {store.uri}")
        name = best
        store = store.child(name)
    try:
        ckpt = open_checkpoint(store)
    except IncompleteCheckpointError as exc:
        raise IncompleteCheckpointError(
            f"{store.uri} is a torn ROLL checkpoint (never committed); resume from "
            f"the latest committed one instead. {exc}") from None
    # ROLL resumes at the step its files hold and saves the next ones under their names:
    # a checkpoint copied under another name is refused.
    expect_step(expect_kind(ckpt, KIND, "a ROLL checkpoint"), checkpoint_order(name)[0])
    target = Path(local_dir) / name
    download(ckpt, target)
    return str(target)
